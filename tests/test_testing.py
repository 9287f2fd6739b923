"""msa_jit.testing.compare_with_reference: the check `msa-jit selftest` relies on can fail."""

import pytest
import torch

import msa_jit
from msa_jit.testing import compare_with_reference, make_case


def _reference_run(case):
    out, lse = case.new_out(), case.new_lse()
    plan = msa_jit.SparseDecodePlanner().prepare(*case.prepare_args(), **case.prepare_kwargs())
    msa_jit.sparse_decode(case.query, case.kv_cache, case.topk, out, plan, lse=lse,
                          backend="reference", **case.scales())
    return out, lse


def test_accepts_a_correct_output():
    case = make_case(3, 2, 16, 1, q_dtype=torch.bfloat16, seed=1, padded=True)
    out, lse = _reference_run(case)
    stats = {}
    err, problems = compare_with_reference(case, out, lse, stats=stats)
    assert problems == [] and err < 5e-3
    # bf16 output rounding alone, per row: what ROW_TOL (5e-2) is set against
    assert 0 < stats["worst_row_rel_l2"] < 5e-3


def test_rejects_poison_wrong_values_and_wrong_lse():
    case = make_case(3, 2, 16, 1, q_dtype=torch.bfloat16, seed=2, padded=True)
    out, lse = _reference_run(case)
    bad = out.clone()
    bad[0, 0, 0] = float("nan")
    assert any("NaN" in p for p in compare_with_reference(case, bad, lse)[1])
    assert any("L2" in p for p in compare_with_reference(case, out * 1.1, lse)[1])
    assert any("lse" in p for p in compare_with_reference(case, out, lse + 0.01)[1])


def test_rejects_an_unwritten_lse_wrong_empty_rows_and_a_few_wrong_rows():
    """The checks of compare_with_reference that the GPU tests' claims rest on, each shown to fire."""
    case = make_case(3, 2, 16, 1, q_dtype=torch.bfloat16, seed=2, padded=True)
    out, lse = _reference_run(case)
    assert compare_with_reference(case, out, lse)[1] == []
    bad_l = lse.clone()
    bad_l[1, 0] = float("nan")
    assert compare_with_reference(case, out, bad_l)[1] == ["lse not fully written"]
    empty = torch.isinf(lse).nonzero()
    assert len(empty), "the padded case has rows without visible keys"
    t, h = empty[0].tolist()
    finite = lse.clone()
    finite[t, h] = 0.0
    assert compare_with_reference(case, out, finite)[1] == ["rows with -inf lse differ from the reference"]
    nonzero = out.clone()
    nonzero[t, h, 0] = 1e-3  # small: only the empty-row check may fire
    assert compare_with_reference(case, nonzero, lse)[1] == ["rows with no visible key are not zero"]


def test_a_few_zeroed_rows_fail_where_the_whole_tensor_error_passes():
    """At 131072 (token, head) rows, 8 zeroed rows keep the whole-tensor relative L2 under 1e-2 (contexts
    of 4 pages: the float64 reference's cost is per visible key)."""
    case = make_case(64, 32, 64, 4, q_dtype=torch.bfloat16, seed=1, ctx_lens=[512] * 64)
    out, lse = _reference_run(case)
    seen = (~torch.isinf(lse)).nonzero()
    bad = out.clone()
    for t, h in seen[torch.randperm(len(seen), generator=torch.Generator().manual_seed(0))[:8]].tolist():
        bad[t, h] = 0
    err, problems = compare_with_reference(case, bad, lse)
    assert err <= 1e-2
    assert len(problems) == 1 and problems[0].startswith("8 row(s) with relative error above 0.05"), problems


@pytest.mark.parametrize("seed", range(4))
def test_share_slots_makes_draft_tokens_share_within_the_contract(seed):
    from msa_jit.testing import share_slots

    c = make_case(3, 4, 16, 2, q_dtype=torch.bfloat16, seed=seed, transposed_topk=bool(seed % 2), padded=seed == 0)
    before = c.topk.clone()
    share_slots(c, 12)
    tk, seq, page = c.topk, c.seq_lens_cpu.tolist(), c.page_size
    assert torch.equal(tk[0::4], before[0::4])  # first tokens unchanged
    shared = 0
    for t in range(tk.shape[0]):
        r, j = divmod(t, 4)
        pos = seq[r] - 4 + j
        if j == 0 or pos < 0:
            continue
        nvalid = min(16, -(-(pos + 1) // page))
        for h in range(tk.shape[1]):
            row = tk[t, h].tolist()
            valid = [b for b in row if b >= 0]
            assert valid == sorted(set(valid)) and row[len(valid):] == [-1] * (16 - len(valid))  # ascending, unique
            assert pos // page in valid and len(valid) <= nvalid and all(b * page <= pos for b in valid)
            first = {b for b in tk[t - j, h, :12].tolist() if b >= 0}
            shared += len(first & set(valid))
            assert len(first & set(valid)) >= min(len(first), nvalid - 1)
    assert shared > 0


def test_rejects_one_wrong_lse_row():
    """The LSE check takes the worst row, not the mean: one row off by 0.01 fails it."""
    case = make_case(3, 2, 16, 1, q_dtype=torch.bfloat16, seed=2, padded=True, page_size=64, topk_blocks=4)
    out, lse = _reference_run(case)
    assert compare_with_reference(case, out, lse)[1] == []
    t, h = (~torch.isinf(lse)).nonzero()[0].tolist()
    lse[t, h] += 0.01
    assert any("lse max abs error" in p for p in compare_with_reference(case, out, lse)[1])


def _has_repeats(case) -> bool:
    """Whether some (token, head) row selects a visible block twice, recomputed from the case's tensors."""
    topk, seq_lens, page, k = case.topk.cpu(), case.seq_lens_cpu.tolist(), case.page_size, case.topk_blocks
    for t in range(case.num_tokens):
        r, j = divmod(t, case.qlen)
        kv_len = max(seq_lens[r] - case.qlen + j + 1, 0)
        for h in range(case.num_kv_heads):
            valid = [b for b in topk[t, h, :min(k, -(-kv_len // page))].tolist() if b >= 0 and b * page < kv_len]
            if len(valid) != len(set(valid)):
                return True
    return False


def test_has_duplicates_says_what_topk_holds():
    """GPU tests compare an adversarial case with the reference only without duplicates (the reference
    counts a repeated block once): the flag must be right, and adversarial cases must come both ways."""
    seen = set()
    for seed in range(6):
        for adversarial in (False, True):
            c = make_case(4, 3, 4, 2, q_dtype=torch.float8_e4m3fn, seed=seed, adversarial=adversarial,
                          padded=True, page_size=64, topk_blocks=6)
            assert c.has_duplicates == _has_repeats(c), (seed, adversarial)
            seen.add((adversarial, c.has_duplicates))
    for seed in range(4):  # smaller adversarial cases, some without a repeat
        c = make_case(2, 1, 4, 1, q_dtype=torch.bfloat16, seed=seed, adversarial=True, page_size=64, topk_blocks=4)
        assert c.has_duplicates == _has_repeats(c), seed
        seen.add((True, c.has_duplicates))
    assert {(True, True), (True, False), (False, False)} <= seen


def test_adversarial_block_table_is_strided_and_holds_garbage():
    """An adversarial case's block table has a row stride wider than its columns and out-of-range
    pages past each request's blocks, so the GPU tests' strides and skipped pages are exercised."""
    c = make_case(4, 2, 4, 2, q_dtype=torch.bfloat16, seed=1, adversarial=True, page_size=64, topk_blocks=4,
                  ctx_lens=[70, 300, 5, 130])
    bt, pages, page = c.block_table, c.kv_cache.shape[0], c.page_size
    assert bt.stride(0) > bt.shape[1]
    full = torch.as_strided(bt, (c.batch, bt.stride(0)), (bt.stride(0), 1))
    for r, n in enumerate(c.seq_lens_cpu.tolist()):
        past = full[r, -(-n // page):]
        assert len(past) and ((past < 0) | (past >= pages)).all(), (r, past.tolist())


def test_graph_inputs_give_each_case_its_own_pages():
    """tests/helpers.py GraphInputs (the GPU graph-replay tests' inputs), on the CPU: case i through the
    shared cache and its shifted block table, and through load(i), has case i's own reference."""
    from helpers import GraphInputs

    cases = [make_case(3, 2, 4, 2, q_dtype=torch.bfloat16, seed=s, page_size=64, topk_blocks=4) for s in range(3)]
    inputs = GraphInputs(cases)
    for i, c in enumerate(cases):
        want = msa_jit.sparse_decode_reference(*c.reference_args(), **c.scales())
        shifted = msa_jit.sparse_decode_reference(c.query, inputs.kv, c.topk, inputs.block_tables[i], c.seq_lens,
                                                  c.qlen, **c.scales())
        inputs.load(i)
        loaded = msa_jit.sparse_decode_reference(inputs.query, inputs.kv, inputs.topk, inputs.block_table,
                                                 inputs.seq_lens, c.qlen, **c.scales())
        for got in (shifted, loaded):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), i
