"""Per-role timelines of the wgmma union probe (bench/union_wgmma.py, trace=True builds).

    python3 bench/union_trace.py --so .kv-variants/f_union_cv2_trace/64x4/sparse_decode.so --out $OUT

One eager step of 64/4 B=64 qlen 4 with 12/16 shared blocks (the spec-decode point); every CTA's
converter and MMA warpgroups stamp %globaltimer per union block (events 0-7: K tile free, K tile
converted, V tile free, V tile converted, K tile arrived at the MMA warpgroup, S done, V tile
arrived, P V done), over the plan's partial_o. Prints medians of each interval and writes
union-trace-<date>.json (device, versions, command, the raw stamps of CTA 0 and the medians).
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

from msa_jit import SparseDecodePlanner, loader, sparse_decode  # noqa: E402
from msa_jit.bench import environment, make_step  # noqa: E402

TRACE_BLOCKS = 64
TRACE_WORDS = TRACE_BLOCKS * 8 + 4
EVENTS = ("k_free", "k_full", "v_free", "v_full", "k_at_mma", "s_done", "v_at_mma", "pv_done")


def intervals(stamps: list[list[int]], n: int) -> dict[str, list[float]]:
    """Microseconds of each interval of one CTA's n blocks (stamps[i][event], ns from the CTA start)."""
    out: dict[str, list[float]] = {k: [] for k in ("k_convert", "v_convert", "k_converter_idle", "v_converter_idle",
                                                   "mma_wait_k", "s", "softmax_and_wait_v", "pv", "k_ready_to_s",
                                                   "v_ready_to_pv")}
    for i in range(min(n, TRACE_BLOCKS)):
        s = stamps[i]
        out["k_convert"].append((s[1] - s[0]) / 1e3)
        out["v_convert"].append((s[3] - s[2]) / 1e3)
        if i:
            out["k_converter_idle"].append((s[0] - stamps[i - 1][1]) / 1e3)
            out["v_converter_idle"].append((s[2] - stamps[i - 1][3]) / 1e3)
        if i >= 2:
            out["mma_wait_k"].append((s[4] - stamps[i - 2][7]) / 1e3)
        out["s"].append((s[5] - s[4]) / 1e3)
        out["softmax_and_wait_v"].append((s[6] - s[5]) / 1e3)
        out["pv"].append((s[7] - s[6]) / 1e3)
        out["k_ready_to_s"].append((s[4] - s[1]) / 1e3)
        out["v_ready_to_pv"].append((s[6] - s[3]) / 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--so", required=True)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    hq, hkv, batch, qlen = 64, 4, 64, 4
    step = make_step(hq, hkv, batch, qlen, "bfloat16", shared_blocks=12)
    plan = SparseDecodePlanner().prepare(step["block_table"], step["seq_lens"], step["seq_lens_cpu"], qlen,
                                         num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16)
    plan.kernels[(torch.bfloat16, "float8_e4m3fn")] = loader.load_artifact(a.so)[0]
    for _ in range(3):  # warm, then the traced run
        plan.partial_o.zero_()
        sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], plan, sm_scale=1 / math.sqrt(128))
    torch.cuda.synchronize()
    ctas = batch * hkv
    words = plan.partial_o.view(-1).view(torch.int32)[: ctas * TRACE_WORDS].view(ctas, TRACE_WORDS).cpu().tolist()
    agg: dict[str, list[float]] = {}
    spans = []
    for w in words:
        n, t0 = w[TRACE_BLOCKS * 8], w[TRACE_BLOCKS * 8 + 2]
        stamps = [[(w[8 * i + e] - t0) & 0xFFFFFFFF for e in range(8)] for i in range(min(n, TRACE_BLOCKS))]
        spans.append(max(max(s) for s in stamps) / 1e3 if stamps else 0.0)
        for k, v in intervals(stamps, n).items():
            agg.setdefault(k, []).extend(v)
    med = {k: round(statistics.median(v), 3) for k, v in agg.items() if v}
    mean = {k: round(statistics.fmean(v), 3) for k, v in agg.items() if v}
    result = {"environment": environment(), "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%dT%H%M", time.gmtime()),
              "point": "64/4 B=64 qlen 4, 12/16 shared", "ctas": ctas, "events": EVENTS,
              "median_us": med, "mean_us": mean, "cta_span_us_median": round(statistics.median(spans), 2),
              "cta_span_us_max": round(max(spans), 2), "cta0_n_union": words[0][TRACE_BLOCKS * 8],
              "cta0_stamps_ns": [[(words[0][8 * i + e] - words[0][TRACE_BLOCKS * 8 + 2]) & 0xFFFFFFFF
                                  for e in range(8)] for i in range(min(words[0][TRACE_BLOCKS * 8], TRACE_BLOCKS))]}
    for k in med:
        print(f"{k:22s} median {med[k]:8.3f} us  mean {mean[k]:8.3f} us")
    print(f"CTA span median {result['cta_span_us_median']} us, max {result['cta_span_us_max']} us")
    path = Path(a.out) / f"union-trace-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
