"""The correctness grid of `msa-jit selftest` (the one-command hardware check for a new GPU).

`correctness_grid()` checks the kernels this GPU gets against the float64 reference on the full
grid: every MiniMax-M3 geometry x qlen x query dtype x batch, plus forced split-KV factors,
each on every occupancy the planner may pick (2 and 3 CTAs per SM for the token kernel);
on sm_90a also every qlen >= 2 case on the union kernel (the planner pinned to it) at the
occupancy a warmup builds for it (2 CTAs per SM). On sm_90a the 2-CTA cases whose split grid is
at most one CTA per SM merge in a cluster (the planner's choice), so exactly those also run with
the merge kernel pinned; each row says which merge ran.
`msa_jit.cli.selftest` runs it, then the benchmark grid.
"""

from __future__ import annotations

import itertools
import zlib

from ..geometry import DEFAULT_PAGE_SIZE, MINIMAX_M3_GEOMETRIES, Q_DTYPES, build_suffix

QLENS = [1, 2, 4, 8, 32]
BATCHES = [1, 3, 16, 64]
QUICK = dict(qlens=[1, 4], batches=[1, 16])
FORCE_SPLITS = 100000  # a num_sms that makes the planner split every step topk_blocks ways


def grid_cases(arch: str, *, quick: bool = False, union: bool = True, cluster: bool = True,
               device_sms: int = 132) -> list[tuple]:
    """The cases of `correctness_grid` on `arch`: ((Hq, Hkv), q dtype, qlen, batch, num_sms or None,
    kernel, ctas_per_sm, split_merge pin or None for the planner's choice). cluster: the planner may
    merge 2-CTA splits in a cluster, so the cases where it does (on a GPU of `device_sms` SMs where
    num_sms is None) also run with the merge kernel pinned. union: the union kernel's planned build
    runs every qlen >= 2 case. Pure Python (no GPU)."""
    from ..geometry import DEFAULT_TOPK_BLOCKS, UNION_PLANNED_CTAS_PER_SM, cluster_merge_problems, union_problems
    from ..jit.registry import supported_ctas_per_sm
    from ..planner import choose_num_splits, takes_cluster_merge

    qlens = QUICK["qlens"] if quick else QLENS
    batches = QUICK["batches"] if quick else BATCHES
    cases = [c + (None,) for c in itertools.product(MINIMAX_M3_GEOMETRIES, Q_DTYPES, qlens, batches)]
    cases += [((64, 4), "bfloat16", 4, 3, ns) for ns in (1, FORCE_SPLITS)]  # force 1 and topk splits
    # every case on every occupancy the planner may pick on this GPU (same inputs)
    builds = [("token", n, None) for n in supported_ctas_per_sm(arch)]
    if union and UNION_PLANNED_CTAS_PER_SM in supported_ctas_per_sm(arch, "union"):
        builds.append(("union", UNION_PLANNED_CTAS_PER_SM, None))
    if cluster:
        builds += [("token", n, "kernel") for n in supported_ctas_per_sm(arch)
                   if not cluster_merge_problems(kernel="token", ctas_per_sm=n, arch=arch)]

    def serves(build: tuple, item: tuple) -> bool:  # make_case's default page size and cache format
        (hq, hkv), _, qlen, batch, num_sms = item
        if build[2] == "kernel":  # the pinned merge kernel: where the planner's 2-CTA plan takes the cluster
            rows, sms = batch * qlen * hkv, num_sms or device_sms
            return takes_cluster_merge(rows, choose_num_splits(rows, DEFAULT_TOPK_BLOCKS, sms), sms)
        return build[0] == "token" or (qlen >= 2 and not union_problems(
            num_q_heads=hq, num_kv_heads=hkv, page_size=DEFAULT_PAGE_SIZE, kv_dtype="float8_e4m3fn", arch=arch))

    return [item + b for item in cases for b in builds if serves(b, item)]


def correctness_grid(*, quick: bool = False, log=print) -> list[dict]:
    """Run every case; returns one row per case with its error and problems."""
    import torch

    from .. import SparseDecodePlanner, sparse_decode
    from ..geometry import device_arch
    from ..testing import LSE_ATOL, UNION_LSE_ATOL, compare_with_reference, make_case

    rows = []
    cases = grid_cases(device_arch(0), quick=quick, device_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    for item in cases:
        (hq, hkv), qd, qlen, batch, num_sms, kernel, ctas_per_sm, split_merge = item
        seed = zlib.crc32(f"{hq}/{hkv}/{qd}/{qlen}/{batch}/{num_sms}".encode())
        case = make_case(batch, qlen, hq, hkv, q_dtype=getattr(torch, qd), seed=seed, device="cuda",
                         transposed_topk=bool(seed % 2), padded=batch > 1 and seed % 3 == 0)
        out, lse = case.new_out(), case.new_lse()
        planner = SparseDecodePlanner(num_sms=num_sms, ctas_per_sm=ctas_per_sm, kernel=kernel, split_merge=split_merge)
        plan = planner.prepare(*case.prepare_args(), **case.prepare_kwargs())
        stats = {"worst_row_rel_l2": float("nan")}
        try:
            sparse_decode(case.query, case.kv_cache, case.topk, out, plan, lse=lse, backend="kernel", **case.scales())
            torch.cuda.synchronize()
            err, problems = compare_with_reference(
                case, out, lse, lse_atol=UNION_LSE_ATOL if kernel == "union" else LSE_ATOL, stats=stats)
        except Exception as e:  # a launch or load failure is a failed case, not a crash
            err, problems = float("nan"), [f"{type(e).__name__}: {e}"]
        row = dict(geometry=f"{hq}/{hkv}", q_dtype=qd, qlen=qlen, batch=batch,
                   num_splits=plan.launch().num_splits, ctas_per_sm=ctas_per_sm, kernel=kernel,
                   split_merge=plan.launch().split_merge,
                   rel_l2=err, worst_row_rel_l2=stats["worst_row_rel_l2"], problems=problems)
        rows.append(row)
        status = "ok" if not problems else "FAIL " + "; ".join(problems)
        log(f"{row['geometry']:>5} {qd:<14} qlen={qlen:<2} B={batch:<3} splits={plan.launch().num_splits:<2} {ctas_per_sm}/SM"
            f"{build_suffix(kernel, plan.launch().split_merge)} "
            f"err={err:.2e} row={row['worst_row_rel_l2']:.1e} {status}")
    return rows
