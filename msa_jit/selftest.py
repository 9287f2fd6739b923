"""`msa-jit selftest`: the one-command hardware check for a new GPU (e.g. a B200).

Correctness of the kernel this GPU gets (the dispatcher's choice: on 10.x the portable
kernel unless MSA_JIT_ENABLE_SM100_UMMA=1) against the float64 reference on the full grid
(every MiniMax-M3 geometry x qlen x query dtype x batch, plus forced split-KV factors, each
on every occupancy the planner may pick: 2 and 3 CTAs per SM for the portable kernel), then
the benchmark grid. Exit status 0 only if every case passes.
"""

from __future__ import annotations

import argparse
import itertools
import time
import zlib

GEOMETRIES = [(64, 4), (32, 2), (16, 1), (8, 1)]
QLENS = [1, 2, 4, 8, 32]
BATCHES = [1, 3, 16, 64]
QUICK = dict(qlens=[1, 4], batches=[1, 16])


def correctness_grid(*, quick: bool = False, log=print) -> list[dict]:
    """Run every case; returns one row per case with its error and problems."""
    import torch

    from . import SparseDecodePlanner, sparse_decode
    from .compiler import supported_ctas_per_sm
    from .geometry import device_arch
    from .testing import compare_with_reference, make_case

    qlens = QUICK["qlens"] if quick else QLENS
    batches = QUICK["batches"] if quick else BATCHES
    rows = []
    cases = [c + (None,) for c in itertools.product(GEOMETRIES, ("bfloat16", "float8_e4m3fn"), qlens, batches)]
    cases += [((64, 4), "bfloat16", 4, 3, ns) for ns in (1, 100000)]  # force 1 and topk splits
    # every case on every occupancy the planner may pick on this GPU (same inputs)
    occupancies = supported_ctas_per_sm(device_arch(0))
    cases = [item + (n,) for item in cases for n in occupancies]
    for item in cases:
        (hq, hkv), qd, qlen, batch, num_sms, ctas_per_sm = item
        seed = zlib.crc32(f"{hq}/{hkv}/{qd}/{qlen}/{batch}/{num_sms}".encode())
        case = make_case(batch, qlen, hq, hkv, q_dtype=getattr(torch, qd), seed=seed, device="cuda",
                         transposed_topk=bool(seed % 2), padded=batch > 1 and seed % 3 == 0)
        out, lse = case.new_out(), case.new_lse()
        planner = SparseDecodePlanner(num_sms=num_sms, ctas_per_sm=ctas_per_sm)
        plan = planner.prepare(*case.prepare_args(), **case.prepare_kwargs())
        try:
            sparse_decode(case.query, case.kv_cache, case.topk, out, plan, lse=lse, backend="kernel", **case.scales())
            torch.cuda.synchronize()
            err, problems = compare_with_reference(case, out, lse)
        except Exception as e:  # a launch or load failure is a failed case, not a crash
            err, problems = float("nan"), [f"{type(e).__name__}: {e}"]
        row = dict(geometry=f"{hq}/{hkv}", q_dtype=qd, qlen=qlen, batch=batch,
                   num_splits=plan.num_splits, ctas_per_sm=ctas_per_sm, rel_l2=err, problems=problems)
        rows.append(row)
        status = "ok" if not problems else "FAIL " + "; ".join(problems)
        log(f"{row['geometry']:>5} {qd:<14} qlen={qlen:<2} B={batch:<3} splits={plan.num_splits:<2} {ctas_per_sm}/SM "
            f"err={err:.2e} {status}")
    return rows


def main(args: argparse.Namespace) -> int:
    import torch

    from .compiler import kernel_family
    from .geometry import SparseDecodeConfig, device_arch

    if not torch.cuda.is_available():
        print("msa-jit selftest needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    arch = device_arch(0)
    if args.arch and args.arch != arch:
        print(f"--arch {args.arch} given, but this GPU is {arch} ({torch.cuda.get_device_name()}): "
              "the selftest checks the GPU it runs on")
        return 2
    family = kernel_family(SparseDecodeConfig(num_q_heads=64, num_kv_heads=4, arch=arch))
    print(f"selftest on {torch.cuda.get_device_name()} ({arch}), kernel family: {family}")
    t0 = time.time()
    rows = correctness_grid(quick=args.quick)
    failed = [r for r in rows if r["problems"]]
    worst = max((r["rel_l2"] for r in rows if r["rel_l2"] == r["rel_l2"]), default=float("nan"))
    print(f"correctness: {len(rows) - len(failed)}/{len(rows)} cases passed, worst rel L2 {worst:.2e} "
          f"({time.time() - t0:.0f} s)")
    if failed:
        return 1
    if not args.no_bench:
        from . import bench

        bench.main(args.out, iters=args.iters)
    return 0
