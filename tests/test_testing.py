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
    """At 131072 (token, head) rows, 8 zeroed rows keep the whole-tensor relative L2 under 1e-2."""
    case = make_case(64, 32, 64, 4, q_dtype=torch.bfloat16, seed=1)
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
