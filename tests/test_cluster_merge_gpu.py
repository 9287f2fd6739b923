"""The split merge inside the decode launch (`split_merge="cluster"`, msa_jit/kernels/cluster_merge.py)
against the float64 reference on an H200 (`pytest -m gpu`).

The planner is pinned to it (split_merge="cluster"), so every split step served at 2 CTAs per SM
takes it, not only where the planner's default picks it. Every
geometry x query dtype x cache format x split factor (2, 3, 4, 6, 8, 16: those whose rows fit the
receive buffer merge in the cluster, 3 and 6 at G = 16 fall back to the merge kernel of the same
build; 2 is fp8's only; fp8's rule gives powers of two only, so its 3 and 6 are forced) x two step shapes (batch 1, and 3 padded requests of 2 tokens); outputs poisoned with NaN
before each run and checked fully written; three launches bitwise equal; the same step through
the merge kernel's build agrees; a CUDA graph of the step (prepare + op, one launch per layer)
follows its inputs between replays.
"""

from __future__ import annotations

import contextlib
import zlib
from unittest import mock

import pytest
import torch

from helpers import GraphInputs, capture, make_case
from msa_jit.kernels import convention
from msa_jit.geometry import MINIMAX_M3_GEOMETRIES
from msa_jit.planner import choose_num_splits
from msa_jit.testing import compare_with_reference, rel_l2

pytestmark = pytest.mark.gpu

Q_DTYPES = [torch.bfloat16, torch.float8_e4m3fn]
KV_DTYPES = ["fp8", "nvfp4"]
SPLITS = [2, 3, 4, 6, 8, 16]  # every factor the planner gives 16 blocks (2: fp8 only; 3, 6: NVFP4 only)
SHAPES = [(1, 1), (3, 2)]  # (batch, qlen)
TOL = 1e-2


@pytest.fixture(autouse=True)
def _sm90a_only():
    """The build exists for CLUSTER_MERGE_ARCHES only: elsewhere a pin keeps the merge kernel."""
    from msa_jit.geometry import CLUSTER_MERGE_ARCHES, device_arch

    arch = device_arch(torch.device("cuda", torch.cuda.current_device()))
    if arch not in CLUSTER_MERGE_ARCHES:
        pytest.skip(f"the cluster split merge is built for {CLUSTER_MERGE_ARCHES}, this GPU is {arch}")


def _num_sms_for(splits: int, rows_heads: int, kv_dtype: str, cluster_merge: bool = True) -> int | None:
    """An SM count for which the planner splits a grid of `rows_heads` (token, KV head) rows of a cache
    format in `splits` (its rule with or without the cluster merge: fp8 takes one wave of power-of-two
    splits merged in the cluster, two waves otherwise), or None where its rule never does (fp8 in 3 or 6
    with the cluster merge); skips the case no rule reaches (one row never splits in 3, NVFP4 never in 2)."""
    for merge in (cluster_merge, False):
        for num_sms in range(1, 4096):
            if choose_num_splits(rows_heads, 16, num_sms, kv_dtype, cluster_merge=merge) == splits:
                return num_sms if merge == cluster_merge else None
    pytest.skip(f"the planner never splits {rows_heads} rows of {kv_dtype} in {splits}")


def _run(case, split_merge: str, splits: int, *, scale_tensors: bool = False):
    import msa_jit
    from msa_jit import planner as planner_mod

    fmt = "nvfp4" if case.kv_dtype == "nvfp4" else "float8_e4m3fn"
    num_sms = _num_sms_for(splits, case.num_tokens * case.num_kv_heads, fmt, split_merge == "cluster")
    planner = msa_jit.SparseDecodePlanner(num_sms=num_sms or 132, ctas_per_sm=2, split_merge=split_merge)
    # a count the cluster rule never gives (fp8 in 3 or 6) is forced, as a split-count A/B does: the
    # cluster build's plain launch then writes its partials for the merge kernel (3 and 6 do not fit the
    # receive buffer at G = 16), the path a GPU that cannot hold the clusters takes
    forced = mock.patch.object(planner_mod, "choose_num_splits", lambda *_a, **_k: splits)
    with forced if num_sms is None else contextlib.nullcontext():
        plan = planner.prepare(*case.prepare_args(), **case.prepare_kwargs())
    assert plan.launch(fmt).num_splits == splits
    assert plan.config(case.query.dtype, fmt).split_merge == split_merge
    outs = []
    for _ in range(3):  # poisoned each time: a launch that leaves a row unwritten shows as NaN
        out, lse = case.new_out(), case.new_lse()
        msa_jit.sparse_decode(case.query, case.kv_cache, case.topk, out, plan, lse=lse, backend="kernel",
                              **case.scales(scale_tensors=scale_tensors))
        torch.cuda.synchronize()
        outs.append((out, lse))
    # the H200 holds these clusters: the plan did not fall back to the merge kernel (plan.resolve_kernel)
    assert plan.config(case.query.dtype, fmt).split_merge == split_merge
    return outs


def _case(hq, hkv, q_dtype, kv_dtype, batch, qlen, splits):
    seed = zlib.crc32(f"cluster/{hq}/{hkv}/{q_dtype}/{kv_dtype}/{batch}/{qlen}/{splits}".encode())
    return seed, make_case(batch, qlen, hq, hkv, q_dtype=q_dtype, seed=seed, device="cuda", kv_dtype=kv_dtype,
                           transposed_topk=bool(seed % 2), padded=batch > 1)


def _reachable(splits: int, rows_heads: int) -> bool:  # for some cache format (_run skips the other)
    return any(choose_num_splits(rows_heads, 16, n, kv) == splits for n in range(1, 4096)
               for kv in ("float8_e4m3fn", "nvfp4"))


# every (geometry, splits, shape) the planner can give: one (token, KV head) row never splits in 3,
# so 16/1 and 8/1 at batch 1 have no splits-3 case (they skipped on every machine before)
REACHABLE = [pytest.param(hq, hkv, splits, batch, qlen, id=f"{hq}/{hkv}-splits{splits}-({batch}, {qlen})")
             for hq, hkv in MINIMAX_M3_GEOMETRIES for splits in SPLITS for batch, qlen in SHAPES
             if _reachable(splits, batch * qlen * hkv)]


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("hq,hkv,splits,batch,qlen", REACHABLE)
def test_cluster_merge_matches_reference(hq, hkv, q_dtype, kv_dtype, splits, batch, qlen, record_property):
    seed, case = _case(hq, hkv, q_dtype, kv_dtype, batch, qlen, splits)
    runs = _run(case, "cluster", splits, scale_tensors=kv_dtype == "nvfp4" and seed % 2 == 0)
    out, lse = runs[0]
    tag = f"cluster {hq}/{hkv} {q_dtype} {kv_dtype} B={batch} qlen={qlen} splits={splits}"
    err, problems = compare_with_reference(case, out, lse, tol=TOL)
    assert not problems, f"{tag}: {problems}"
    for o, l in runs[1:]:
        assert torch.equal(o, out) and torch.equal(l, lse), f"{tag}: launches differ"
    record_property("rel_l2", err)
    print(f"REL_L2 {tag} err={err:.3e}")


@pytest.mark.parametrize("hq,hkv", [(64, 4), (8, 1)], ids=lambda v: str(v))
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_cluster_merge_agrees_with_the_merge_kernel(hq, hkv, kv_dtype):
    """The same step merged in the cluster and by the merge kernel: both combine the same fp32
    partials in the same split order (split_merge.combine_splits), so they agree to rounding."""
    for splits in (4, 16):
        _, case = _case(hq, hkv, torch.bfloat16, kv_dtype, 1, 1, splits)
        c_out, c_lse = _run(case, "cluster", splits)[0]
        k_out, k_lse = _run(case, "kernel", splits)[0]
        assert rel_l2(c_out, k_out) < 1e-3, f"splits={splits}: rel L2 {rel_l2(c_out, k_out):.2e}"
        finite = torch.isfinite(k_lse)
        assert torch.equal(finite, torch.isfinite(c_lse))
        assert (c_lse[finite] - k_lse[finite]).abs().max() < 1e-4
        print(f"cluster vs merge kernel {hq}/{hkv} {kv_dtype} splits={splits}: "
              f"bitwise {'equal' if torch.equal(c_out, k_out) else 'different'}")


@pytest.mark.parametrize("hq,hkv", [(64, 4), (8, 1)], ids=lambda v: str(v))
def test_cluster_merge_graph_replay_follows_inputs(hq, hkv):
    """Captured once at batch 1 (16 splits: one cluster of 16 CTAs per KV head); seq_lens, topk and
    query change in place between replays."""
    import msa_jit

    planner = msa_jit.SparseDecodePlanner(ctas_per_sm=2, split_merge="cluster")
    cases = [make_case(1, 1, hq, hkv, q_dtype=torch.bfloat16, seed=40 + s, device="cuda", ctx_lens=[ctx])
             for s, ctx in enumerate((300, 2100 + 128 * 7, 5000))]
    live = cases[0]
    out = live.new_out()
    inputs = GraphInputs(cases)
    bt, seq, q, tk, kv = inputs.block_table, inputs.seq_lens, inputs.query, inputs.topk, inputs.kv

    def step():
        plan = planner.prepare(bt, seq, live.seq_lens_cpu, live.qlen, **live.prepare_kwargs())
        assert plan.launch().split_merge == "cluster" and plan.launch().num_splits == 16
        msa_jit.sparse_decode(q, kv, tk, out, plan, **live.scales())

    for i, (err, written) in enumerate(inputs.replay_each(capture(step), out, live.scales())):
        assert written and err <= TOL, f"graph replay {i}: rel L2 {err:.3e}"


@pytest.mark.parametrize("hq,hkv", MINIMAX_M3_GEOMETRIES, ids=lambda v: str(v))
def test_the_h200_holds_16_cta_clusters(hq, hkv):
    """cuOccupancyMaxActiveClusters on the artifact's decode kernel (msa_jit.jit.cluster_fit): batch 1's
    (1, 1, 16) clusters fit, at least one per KV head at once."""
    from msa_jit.jit import compiler
    from msa_jit.jit.cluster_fit import max_active_clusters
    from msa_jit.geometry import SparseDecodeConfig

    cfg = SparseDecodeConfig(hq, hkv, arch="sm_90a", split_merge="cluster")
    entry, _ = compiler.ensure_compiled(cfg)
    extra = entry.meta["extra"]
    n = max_active_clusters(entry.artifact_path(convention.ARTIFACT_NAME), 16, extra["threads"],
                            extra["smem_bytes"], torch.cuda.current_device())
    print(f"MAX_ACTIVE_CLUSTERS {hq}/{hkv} 16 CTAs x {extra['smem_bytes']} B: {n}")
    assert n >= hkv and compiler.cluster_launch_fits(cfg, 16, torch.cuda.current_device())

