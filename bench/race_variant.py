"""Run one variant artifact (bench/variants.py build) on the sanitizer's adversarial cases.

    compute-sanitizer --tool racecheck python3 bench/race_variant.py .variants/rel_warp/16x1-bfloat16/sparse_decode.so

The cases of tests/gpu_memcheck.py (batch 3, qlen 4, padded rows, -1 / duplicate / out-of-range
topk and block-table entries, both split paths), on the artifact's geometry (read from its
folder name `HQxHKV-QDTYPE`) with the fp8 cache; each output is checked against the float64
reference (unless the case holds duplicate topk entries, which the reference counts
differently: then only for NaN), so a variant that quiets the sanitizer by computing
something else fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import msa_jit
from msa_jit.jit.loader import load_artifact
from msa_jit.testing import compare_with_reference, make_case


def main(argv: list[str]) -> int:
    so = Path(argv[0])
    hq, rest = so.parent.name.split("x")
    hkv, qd = rest.split("-", 1)
    fn = load_artifact(so)[0]
    bad = 0
    for num_sms in (1, 100000):  # one split, then the split-KV path with its merge
        case = make_case(3, 4, int(hq), int(hkv), q_dtype=getattr(torch, qd), seed=3, device="cuda",
                         adversarial=True, padded=True)
        plan = msa_jit.SparseDecodePlanner(num_sms=num_sms).prepare(*case.prepare_args(), **case.prepare_kwargs())
        plan.kernels[(case.query.dtype, "float8_e4m3fn")] = fn
        out, lse = case.new_out(), case.new_lse()
        msa_jit.sparse_decode(case.query, case.kv_cache, case.topk, out, plan, lse=lse, backend="kernel",
                              **case.scales())
        torch.cuda.synchronize()
        if case.has_duplicates:  # the reference counts a duplicate topk entry differently: no comparison
            err, problems = float("nan"), [] if not (out.isnan().any() or lse.isnan().any()) else ["NaN left"]
        else:
            err, problems = compare_with_reference(case, out, lse)
        bad += bool(problems)
        print(f"{so.parent.parent.name} {so.parent.name} splits={plan.num_splits}: rel L2 {err:.2e} "
              f"{'FAIL ' + '; '.join(problems) if problems else 'ok'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
