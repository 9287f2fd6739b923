"""Per-CTA timelines of decode steps: where a step's time goes, CTA by CTA and SM by SM.

    python bench/variants.py build --variants trace          # here: the probe="trace" kernel
    python3 bench/trace_ctas.py --dir .variants --out $OUT    # GPU host: JSON + PNG
        [--variants trace trace_pbt]                          # several trace variants, same points
        [--points 64/4:1:1 8/1:4:1]                           # geometry:batch:qlen (default POINTS)

The `trace` variant is the full kernel plus a few stores: thread 0 of every CTA writes its SM
and %globaltimer at entry, after the PDL wait, after the slot compaction (the topk -> block
table chain), when the first and the last stage are full, after its warp's last block and
after the epilogue, over its (otherwise unused at num_splits == 1) partial_o slot. Each point
is replayed as in the bench (CUDA graph, L2 flushed by reading before every replay), and each
replay's trace is read back.

Per point the JSON has, as medians over the replays: the step time (events), the kernel's span
(first CTA entry to last CTA end), each phase's median / p90 over CTAs, the spread of CTA end
times, and how much of span x SMs the SMs held no CTA ("SM idle"); plus the last replay's raw
trace. The PNG draws that replay's CTAs on a time axis, grouped by SM. At a split point the
epilogue is also given apart for split ranks below G and the others (`epilogue_by_rank_us`): in
a build that merges the splits in a cluster (split_merge="cluster", its `trace` probe) ranks
below G push, wait for their peers and merge, the others only push; in the merge kernel's build
both store partials (a control).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

PHASES = ("pdl_wait", "index_chain", "first_copy", "stream", "last_block", "epilogue")
# word layout of the kernel's trace (probe="trace"); 1 = trace-2026-12-03T0822.json: [smid, entry,
# waited, indexed, first, last, end, n_iter] (its "last_block_epilogue" = last_block + epilogue)
TRACE_LAYOUT = 2
POINTS = [("64/4", 64, 1), ("8/1", 256, 1), ("64/4", 256, 1), ("64/4", 1, 1)]


def relative_ns(words: np.ndarray) -> np.ndarray:
    """[n, k] %globaltimer_lo stamps, column 0 the entry -> ns since the earliest entry (wraps handled)."""
    ref = int(words[:, 0].min())
    d = (words.astype(np.int64) - ref + (1 << 31)) % (1 << 32) - (1 << 31)
    return d - d[:, 0].min()


def decode(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(smid, n_iter, stamps in us) of the CTAs that had blocks; trace rows are the kernel's
    [smid | n_iter << 16, then %globaltimer_lo at entry, waited, indexed, first full, last full,
    last block done, end]."""
    trace = np.asarray(trace, dtype=np.int64)
    sm, n_iter = trace[:, 0] & 0xFFFF, trace[:, 0] >> 16
    keep = n_iter > 0
    return sm[keep], n_iter[keep], relative_ns(trace[keep, 1:8]) / 1e3


def epilogue_by_rank(trace: np.ndarray, num_splits: int, group: int) -> dict[str, float | None]:
    """Median epilogue (us) of the CTAs whose split rank is below `group` (in a cluster-merge build:
    the ones that merge rows) and of the others; trace rows are ordered (token, KV head, split)."""
    _, _, ts = decode(trace)  # the CTAs that had blocks, in trace order
    had_blocks = (np.asarray(trace, dtype=np.int64)[:, 0] >> 16) > 0
    rank = (np.arange(len(had_blocks)) % max(num_splits, 1))[had_blocks]
    epi, low = ts[:, 6] - ts[:, 5], rank < group
    return {"rank_below_g": round(float(np.median(epi[low])), 2) if low.any() else None,
            "rank_from_g": round(float(np.median(epi[~low])), 2) if (~low).any() else None}


def summarize(trace: np.ndarray) -> dict[str, Any]:
    """Summary of one replay's trace (see decode)."""
    sm, n_iter, ts = decode(trace)
    span = float(ts[:, -1].max())
    phases = {name: np.diff(ts, axis=1)[:, k] for k, name in enumerate(PHASES)}
    busy = []
    for s in np.unique(sm):
        rows = ts[sm == s]
        busy.append(rows[:, -1].max() - rows[:, 0].min())
    return {
        "ctas": int(len(ts)), "sms": int(len(busy)), "span_us": round(span, 2),
        "phases_us": {k: {"median": round(float(np.median(v)), 2), "p90": round(float(np.percentile(v, 90)), 2)}
                      for k, v in phases.items()},
        "first_entry_to_last_entry_us": round(float(ts[:, 0].max()), 2),
        "cta_end_us": {q: round(float(np.percentile(ts[:, -1], p)), 2) for q, p in (("min", 0), ("p10", 10),
                                                                                    ("median", 50), ("max", 100))},
        "stream_us_per_block": round(float(np.median(phases["stream"] / np.maximum(n_iter - 1, 1))), 3),
        "sm_idle_pct": round(float(100 * (1 - sum(busy) / (len(busy) * span))), 1),
    }


def trace_point(fn, geom: str, batch: int, qlen: int, replays: int) -> dict[str, Any]:
    import torch

    from msa_jit import SparseDecodePlanner, sparse_decode
    from msa_jit.tools.bench import GEOMETRIES, make_step, prepare_args, time_graph

    hq, hkv = GEOMETRIES[geom]
    group = hq // hkv
    step = make_step(hq, hkv, batch, qlen, "bfloat16")
    planner = SparseDecodePlanner()
    args, kw = prepare_args(step, hq, hkv, qlen)
    plan = planner.prepare(*args, **kw)
    plan.kernels[(step["query"].dtype, "float8_e4m3fn")] = fn
    words = plan.partial_o.view(torch.int32).view(plan.partial_o.shape[0], -1)[:, :8]
    traces: list[np.ndarray] = []

    def run():
        sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], planner.prepare(*args, **kw),
                      sm_scale=0.088)

    def read():
        traces.append(words.cpu().numpy().copy())
        words.zero_()

    times = time_graph(run, iters=replays, after_replay=read)
    sums = [summarize(t) for t in traces]
    by_rank = [epilogue_by_rank(t, plan.num_splits, group) for t in traces] if plan.num_splits > 1 else []

    def med(get):
        return round(statistics.median(get(s) for s in sums), 2)

    res = {
        "geometry": geom, "batch": batch, "qlen": qlen, "num_splits": plan.num_splits,
        "step_us": round(statistics.median(times), 2), "replays": replays,
        "span_us": med(lambda s: s["span_us"]), "sm_idle_pct": med(lambda s: s["sm_idle_pct"]),
        "phases_us": {k: {q: med(lambda s, k=k, q=q: s["phases_us"][k][q]) for q in ("median", "p90")}
                      for k in PHASES},
        "cta_end_us": {q: med(lambda s, q=q: s["cta_end_us"][q]) for q in ("min", "p10", "median", "max")},
        "first_entry_to_last_entry_us": med(lambda s: s["first_entry_to_last_entry_us"]),
        "stream_us_per_block": med(lambda s: s["stream_us_per_block"]),
        "epilogue_by_rank_us": {k: (round(statistics.median(v), 2) if (v := [b[k] for b in by_rank if b[k] is not None])
                                    else None) for k in ("rank_below_g", "rank_from_g")} if by_rank else None,
        "ctas": sums[-1]["ctas"], "sms": sums[-1]["sms"],
        "last_trace": traces[-1].tolist(),
    }
    del step
    return res


def plot(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ("0.75", "tab:orange", "tab:red", "tab:blue", "tab:green", "tab:purple")
    fig, axes = plt.subplots(len(points), 1, figsize=(11, 3.2 * len(points)))
    for ax, p in zip(np.atleast_1d(axes), points):
        sm, _, ts = decode(p["last_trace"])
        ts = ts[np.lexsort((ts[:, 0], sm))]  # by SM, then by entry
        for k in range(len(PHASES)):
            ax.hlines(np.arange(len(ts)), ts[:, k], ts[:, k + 1], color=colors[k], lw=0.8 if len(ts) > 300 else 1.5)
        ax.set_title(f"{p['geometry']} B={p['batch']} qlen={p['qlen']} S={p['num_splits']}: step {p['step_us']} us, "
                     f"kernel span {p['span_us']} us, SM idle {p['sm_idle_pct']}%", fontsize=9)
        ax.set_ylabel("CTA (grouped by SM)")
        ax.set_xlabel("us since the first CTA entered")
    handles = [plt.Line2D([], [], color=c, lw=3) for c in colors]
    fig.legend(handles, PHASES, loc="upper center", ncol=len(PHASES), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)


def _point(text: str) -> tuple[str, int, int]:
    """'64/4:1:1' -> ("64/4", 1, 1)."""
    geom, batch, qlen = text.split(":")
    return geom, int(batch), int(qlen)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".variants", help="bench/variants.py build folder (variant 'trace')")
    ap.add_argument("--out", required=True)
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--variants", nargs="+", default=["trace"],
                    help="probe='trace' variants built by bench/variants.py (the first one is plotted)")
    ap.add_argument("--points", nargs="+", default=None, metavar="GEOM:BATCH:QLEN",
                    help=f"the points to trace (default: {' '.join(f'{g}:{b}:{q}' for g, b, q in POINTS)})")
    a = ap.parse_args(argv)
    points = POINTS if a.points is None else [_point(p) for p in a.points]
    from msa_jit.tools.bench import environment
    from msa_jit.jit.loader import load_artifact

    result: dict[str, Any] = {"environment": environment(), "command": " ".join(sys.argv),
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "trace_layout": TRACE_LAYOUT, "points": []}
    for variant in a.variants:
        fns = {}
        for geom, batch, qlen in points:
            if geom not in fns:
                hq, hkv = (int(x) for x in geom.split("/"))
                fns[geom] = load_artifact(Path(a.dir) / variant / f"{hq}x{hkv}-bfloat16" / "sparse_decode.so")[0]
        for geom, batch, qlen in points:
            p = {"variant": variant, **trace_point(fns[geom], geom, batch, qlen, a.replays)}
            result["points"].append(p)
            print(json.dumps({k: v for k, v in p.items() if k != "last_trace"}), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"trace-{time.strftime('%Y-%m-%dT%H%M', time.gmtime())}"
    (out / f"{stem}.json").write_text(json.dumps(result, separators=(",", ":")))
    plot([p for p in result["points"] if p["variant"] == a.variants[0]], out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
