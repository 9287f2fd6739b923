"""The correctness grid of `msa-jit selftest` (the one-command hardware check for a new GPU).

`correctness_grid()` checks the kernel this GPU gets (the dispatcher's choice: on 10.x the
portable kernel unless MSA_JIT_ENABLE_SM100_UMMA=1) against the float64 reference on the full
grid: every MiniMax-M3 geometry x qlen x query dtype x batch, plus forced split-KV factors,
each on every occupancy the planner may pick (2 and 3 CTAs per SM for the portable kernel).
`msa_jit.cli.selftest` runs it, then the benchmark grid.
"""

from __future__ import annotations

import itertools
import zlib

from .geometry import MINIMAX_M3_GEOMETRIES, Q_DTYPES

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
    cases = [c + (None,) for c in itertools.product(MINIMAX_M3_GEOMETRIES, Q_DTYPES, qlens, batches)]
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
