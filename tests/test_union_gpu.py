"""The union kernel (msa_jit/kernels/union.py) against the float64 reference on an H200
(`pytest -m gpu`; `bash bench/device_run.sh union_tests`).

The planner is pinned to it (kernel="union"), so it serves every step shape here, qlen 1 and split
grids included, not only where the planner's rule picks it. Every
geometry it serves x query dtype x qlen x batch x occupancy build, the draft tokens of a request
sharing 12 of the first token's slots (what the union is for) or none, padded rows, both topk
layouts; outputs poisoned with NaN before each run and checked fully written.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from helpers import GraphInputs, capture, make_case
from msa_jit.geometry import MINIMAX_M3_GEOMETRIES, UNION_CTAS_PER_SM
from msa_jit.testing import UNION_LSE_ATOL, compare_with_reference, share_slots

pytestmark = pytest.mark.gpu

QLENS = [1, 2, 4, 5, 8, 32]  # 5: a partial last tile at G = 16 (4-token tiles)
BATCHES = [1, 3, 16, 64]
Q_DTYPES = [torch.bfloat16, torch.float8_e4m3fn]
TOL = 1e-2


def _planner(**kw):
    import msa_jit

    return msa_jit.SparseDecodePlanner(kernel="union", **kw)


def _run(case, planner, *, lse=True, kernel="union"):
    import msa_jit

    out = case.new_out()
    lse_t = case.new_lse() if lse else None
    plan = planner.prepare(*case.prepare_args(), **case.prepare_kwargs())
    assert plan.launch().kernel == kernel
    msa_jit.sparse_decode(case.query, case.kv_cache, case.topk, out, plan, lse=lse_t, backend="kernel",
                          **case.scales())
    torch.cuda.synchronize()
    return out, lse_t, plan


def _check(case, out, lse, tag):
    err, problems = compare_with_reference(case, out, lse, tol=TOL, lse_atol=UNION_LSE_ATOL)
    assert not problems, f"{tag}: {problems}"
    return err


@pytest.mark.parametrize("hq,hkv", MINIMAX_M3_GEOMETRIES, ids=lambda v: str(v))
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("qlen", QLENS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("ctas_per_sm", UNION_CTAS_PER_SM, ids=lambda n: f"{n}perSM")
def test_union_matches_reference(hq, hkv, q_dtype, qlen, batch, ctas_per_sm, record_property):
    seed = zlib.crc32(f"union/{hq}/{hkv}/{q_dtype}/{qlen}/{batch}".encode())
    case = make_case(batch, qlen, hq, hkv, q_dtype=q_dtype, seed=seed, device="cuda",
                     transposed_topk=bool(seed % 2), padded=batch > 1 and seed % 3 == 0)
    share_slots(case, 12 if seed % 4 else 0)
    out, lse, plan = _run(case, _planner(ctas_per_sm=ctas_per_sm))
    tag = f"union {hq}/{hkv} {q_dtype} qlen={qlen} B={batch} {ctas_per_sm}/SM"
    if batch * qlen > 512:
        # the float64 reference on the host takes minutes at T = 2048: against the token kernel, which
        # test_kernel_gpu checks against that reference at this shape
        err = _agree_with_token_kernel(case, out, lse, tag)
    else:
        err = _check(case, out, lse, tag)
    record_property("rel_l2", err)
    print(f"REL_L2 union {hq}/{hkv} {str(q_dtype)[6:]} qlen={qlen} B={batch} splits={plan.launch().num_splits} "
          f"{ctas_per_sm}/SM err={err:.3e}")


@pytest.mark.parametrize("num_sms", [1, 24, 100000], ids=["splits1", "splits4", "splits16"])
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("ctas_per_sm", UNION_CTAS_PER_SM, ids=lambda n: f"{n}perSM")
def test_union_split_paths_agree(num_sms, q_dtype, ctas_per_sm):
    case = make_case(3, 4, 64, 4, q_dtype=q_dtype, seed=7, device="cuda", padded=True)
    share_slots(case, 12)
    out, lse, plan = _run(case, _planner(num_sms=num_sms, ctas_per_sm=ctas_per_sm))
    assert plan.launch().num_splits == {1: 1, 24: 4, 100000: 16}[num_sms]
    _check(case, out, lse, f"union num_splits={plan.launch().num_splits} {ctas_per_sm}/SM")


def test_union_bitwise_deterministic():
    case = make_case(16, 4, 64, 4, q_dtype=torch.bfloat16, seed=11, device="cuda")
    share_slots(case, 12)
    for num_sms in (1, 100000):
        for ctas_per_sm in UNION_CTAS_PER_SM:
            planner = _planner(num_sms=num_sms, ctas_per_sm=ctas_per_sm)
            a, la, _ = _run(case, planner)
            b, lb, _ = _run(case, planner)
            assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=["bf16", "fp8"])
def test_union_adversarial_indices(q_dtype):
    """-1 in the middle, blocks past the request, duplicates, garbage pages: never read, and a
    block listed twice by a token served once (the contract's set semantics)."""
    for seed in range(4):
        case = make_case(4, 4, 16, 1, q_dtype=q_dtype, seed=50 + seed, device="cuda", adversarial=True)
        out, lse, _ = _run(case, _planner())
        _check(case, out, lse, f"union adversarial seed={seed}")


def _agree_with_token_kernel(case, u, lu, tag, tol=TOL):
    """Relative L2 of the union kernel's output `u` (lse `lu`) against the token kernel's on `case`;
    asserts both fully written, the same empty rows, and the LSE within UNION_LSE_ATOL."""
    import msa_jit

    t, lt, _ = _run(case, msa_jit.SparseDecodePlanner(kernel="token"), kernel="token")
    assert not (u.isnan().any() or lu.isnan().any() or t.isnan().any()), f"{tag}: not fully written"
    diff = float((u.double() - t.double()).norm() / t.double().norm())
    finite = ~torch.isinf(lt)
    assert diff < tol, f"{tag}: union vs token rel L2 {diff:.2e}"
    assert torch.equal(torch.isinf(lu), torch.isinf(lt)), f"{tag}: empty rows differ"
    assert (lu[finite] - lt[finite]).abs().max() < UNION_LSE_ATOL, f"{tag}: lse differs"
    return diff


def test_union_and_token_kernels_agree():
    """The same step through both kernels: equal within the kernels' rounding."""
    case = make_case(64, 4, 64, 4, q_dtype=torch.float8_e4m3fn, seed=21, device="cuda")
    share_slots(case, 12)
    u, lu, _ = _run(case, _planner())
    _agree_with_token_kernel(case, u, lu, "union vs token 64/4 B=64 qlen 4", tol=5e-3)


@pytest.mark.parametrize("share", [False, True], ids=["rule", "drafts_share_blocks"])
def test_planner_picks_union(share):
    """The spec-decode point (64/4 B=64 qlen 4) runs the union kernel by default on a 132-SM GPU (one
    full wave: planner.choose_kernel) and with drafts_share_blocks=True anywhere, and is correct."""
    import msa_jit
    from msa_jit.planner import choose_kernel

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not share and choose_kernel(64, 4, 64, 4, 128, "sm_90a", sms) != "union":
        pytest.skip(f"{sms} SMs: 256 union CTAs are not one full wave here")
    case = make_case(64, 4, 64, 4, q_dtype=torch.bfloat16, seed=23, device="cuda")
    share_slots(case, 12)
    out, lse = case.new_out(), case.new_lse()
    plan = msa_jit.SparseDecodePlanner(drafts_share_blocks=share).prepare(*case.prepare_args(), **case.prepare_kwargs())
    assert plan.launch().kernel == "union" and plan.launch().num_splits == 1
    msa_jit.sparse_decode(case.query, case.kv_cache, case.topk, out, plan, lse=lse, **case.scales())
    torch.cuda.synchronize()
    _check(case, out, lse, "union picked by the planner")


def test_union_cuda_graph_replay_follows_inputs():
    """Captured once; seq_lens, block table, topk and query change in place between replays."""
    import msa_jit

    planner = _planner()
    # contexts past topk_blocks pages, so that each topk row is a choice (a stale topk would be wrong)
    cases = [make_case(8, 4, 64, 4, q_dtype=torch.bfloat16, seed=s, device="cuda",
                       ctx_lens=[2100 + 257 * i + 41 * s for i in range(7)] + [4000]) for s in range(3)]
    for c in cases:
        share_slots(c, 12)
    live = cases[0]
    out = live.new_out()
    inputs = GraphInputs(cases)  # one cache; later cases index shifted pages
    bt, seq, q, tk, kv = inputs.block_table, inputs.seq_lens, inputs.query, inputs.topk, inputs.kv

    def step():
        plan = planner.prepare(bt, seq, live.seq_lens_cpu, live.qlen, **live.prepare_kwargs())
        assert plan.launch().kernel == "union"
        msa_jit.sparse_decode(q, kv, tk, out, plan, **live.scales())

    for err, written in inputs.replay_each(capture(step), out, live.scales()):
        assert written and err <= TOL, f"union graph replay: err {err:.3e}"
