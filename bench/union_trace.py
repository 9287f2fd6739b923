"""Per-block timelines of the union kernel's MMA warpgroups (bench/union_fp8.py trace=True builds).

    python3 bench/union_trace.py --so .kv-variants/f_union_k8_trace/64x4/sparse_decode.so --out $OUT

Each MMA warpgroup's thread 0 stamps %globaltimer per union block: 0 stage full, 1 S issued, 2
its V conversion done, 3 S done, 4 softmax done, 5 V tile complete, 6 P V done, over the plan's
partial_o (the builds of branch wip/union-s18, s18c / s18d: 1 is "S issued, the previous P V done"
and 6 "P V issued", its wait falling in the next block's 0 -> 1). One eager step of 64/4 B=64 qlen 4
with 12/16 shared blocks (the spec-decode point) by default. Prints medians of each interval and writes union-trace-<date>-<query>-w<warpgroups>-<build>.json
(device, versions, command, the raw stamps of CTA 0 and the medians). (The converter-warpgroup
events of the retired bench/union_wgmma.py probes are at commit d3bf0ed.)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from msa_jit import SparseDecodePlanner, sparse_decode  # noqa: E402
from msa_jit.jit import loader  # noqa: E402
from msa_jit.tools.bench import environment, make_step  # noqa: E402

TRACE_BLOCKS = 64
TRACE_WORDS = TRACE_BLOCKS * 8 + 4
EVENTS = ("full", "s_issued", "v_converted", "s_done", "softmax_done", "v_tile_ready", "pv_done")


def intervals(stamps: list[list[int]], n: int, warpgroups: int = 2) -> dict[str, list[float]]:
    """Microseconds of each interval of one CTA's n blocks (a warpgroup takes blocks i, i + wgs, ...:
    its wait for block i's stage counts from its P V of block i - wgs)."""
    out: dict[str, list[float]] = {k: [] for k in ("stage_wait", "barrier", "convert_v", "s_after_convert",
                                                   "softmax", "v_tile_wait", "pv", "block")}
    for i in range(min(n, TRACE_BLOCKS)):
        s = stamps[i]
        if i >= warpgroups:
            out["stage_wait"].append((s[0] - stamps[i - warpgroups][6]) / 1e3)
        for name, a, b in (("barrier", 0, 1), ("convert_v", 1, 2), ("s_after_convert", 2, 3), ("softmax", 3, 4),
                           ("v_tile_wait", 4, 5), ("pv", 5, 6), ("block", 0, 6)):
            out[name].append((s[b] - s[a]) / 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--so", required=True)
    ap.add_argument("--out", default=".")
    ap.add_argument("--point", default="64/4:64:4:12", help="GEOMETRY:BATCH:QLEN:SHARED_BLOCKS")
    ap.add_argument("--q-dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn"))
    ap.add_argument("--warpgroups", type=int, default=2, choices=(1, 2),
                    help="the build's MMA warpgroups (1: the 2-CTA _w1 builds)")
    a = ap.parse_args()
    geo, batch, qlen, shared = a.point.split(":")
    (hq, hkv), batch, qlen, shared = map(int, geo.split("/")), int(batch), int(qlen), int(shared)
    step = make_step(hq, hkv, batch, qlen, a.q_dtype, shared_blocks=shared)
    plan = SparseDecodePlanner().prepare(step["block_table"], step["seq_lens"], step["seq_lens_cpu"], qlen,
                                         num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16)
    plan.kernels[(getattr(torch, a.q_dtype), "float8_e4m3fn")] = loader.load_artifact(a.so)[0]
    for _ in range(3):  # warm, then the traced run
        plan.partial_o.zero_()
        sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], plan, sm_scale=1 / math.sqrt(128))
    torch.cuda.synchronize()
    tiles = -(-qlen // (64 // (hq // hkv)))  # a CTA per (request, KV head, 64 // G tokens, split)
    ctas = batch * hkv * tiles * plan.num_splits
    words = plan.partial_o.view(-1).view(torch.int32)[: ctas * TRACE_WORDS].view(ctas, TRACE_WORDS).cpu().tolist()
    agg: dict[str, list[float]] = {}
    spans = []
    firsts: list[float] = []
    for w in words:
        n, t0 = w[TRACE_BLOCKS * 8], w[TRACE_BLOCKS * 8 + 2]
        stamps = [[(w[8 * i + e] - t0) & 0xFFFFFFFF for e in range(8)] for i in range(min(n, TRACE_BLOCKS))]
        spans.append(max(max(s[:len(EVENTS)]) for s in stamps) / 1e3 if stamps else 0.0)  # slot 7 unused
        if stamps:
            firsts.append(stamps[0][0] / 1e3)  # the CTA's start stamp (after its union build) -> first stage full
        for k, v in intervals(stamps, n, a.warpgroups).items():
            agg.setdefault(k, []).extend(v)
    med = {k: round(statistics.median(v), 3) for k, v in agg.items() if v}
    mean = {k: round(statistics.fmean(v), 3) for k, v in agg.items() if v}
    result = {"environment": environment(), "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%dT%H%M", time.gmtime()),
              "point": a.point, "q_dtype": a.q_dtype, "warpgroups": a.warpgroups, "ctas": ctas,
              "events": EVENTS,
              "median_us": med, "mean_us": mean, "cta_span_us_median": round(statistics.median(spans), 2),
              "cta_span_us_max": round(max(spans), 2),
              "first_full_us_median": round(statistics.median(firsts), 3),
              "first_full_us_max": round(max(firsts), 3), "cta0_n_union": words[0][TRACE_BLOCKS * 8],
              "cta0_stamps_ns": [[(words[0][8 * i + e] - words[0][TRACE_BLOCKS * 8 + 2]) & 0xFFFFFFFF
                                  for e in range(8)] for i in range(min(words[0][TRACE_BLOCKS * 8], TRACE_BLOCKS))]}
    for k in med:
        print(f"{k:22s} median {med[k]:8.3f} us  mean {mean[k]:8.3f} us")
    print(f"CTA span median {result['cta_span_us_median']} us, max {result['cta_span_us_max']} us; first stage full "
          f"median {result['first_full_us_median']} us, max {result['first_full_us_max']} us after the union build")
    q = "q8" if a.q_dtype == "float8_e4m3fn" else "bf16"
    build = Path(a.so).parent.parent.name  # .kv-variants/<build>/<geometry>/sparse_decode.so: two builds, two files
    path = Path(a.out) / f"union-trace-{result['date']}-{q}-w{a.warpgroups}-{build}.json"
    path.write_text(json.dumps(result, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
