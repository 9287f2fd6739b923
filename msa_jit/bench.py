"""`msa-jit bench`: the performance grid, measured as METHOD.md says.

Every point is timed by CUDA-graph replay of one decode step (prologue + kernel (+ merge)),
with L2 flushed before each replay and the median taken; every bandwidth is also given as
a ratio to a 2 GiB device-to-device copy measured in the same run (bytes read + written
over time). Effective bandwidth = KV bytes the step must read / step time. `per_layer` adds
the engine's view: one prologue, then several layers in one graph (what one more layer costs).
Each point is also timed inside one graph of 50 steps (`us_in_graph`), and `tiny_kernel` gives
the event / launch floor both ways; `host` / `host_b256` give the CPU side (per step and per
eager op call).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .geometry import MINIMAX_M3_GEOMETRIES

# "Hq/Hkv" -> (Hq, Hkv) of every MiniMax-M3 layout (what bench points and scripts are named by)
GEOMETRIES = {f"{hq}/{hkv}": (hq, hkv) for hq, hkv in MINIMAX_M3_GEOMETRIES}
# the grid of `msa-jit bench` and of the README's table
GRID_GEOMETRIES = ("64/4", "16/1", "8/1")
GRID_BATCHES = (1, 4, 16, 64, 256)
GRID_QLENS = (1, 4)
RESULTS_DIR = "bench/results"  # where `msa-jit bench` / `selftest` write (relative to the working dir)
BLOCK_BYTES = 128 * 256  # one (page, KV head) chunk: 128 tokens x (K 128 B + V 128 B)


@dataclass
class BenchPoint:
    geometry: str
    q_dtype: str
    batch: int
    qlen: int
    shared_blocks: int  # blocks consecutive tokens of a request share (0: independent draws)
    num_splits: int
    us: float  # median step time (graph replay), microseconds
    us_p10: float
    us_p90: float
    kv_bytes: int  # distinct KV bytes the step must read
    logical_bytes: int  # bytes a per-token kernel would read
    tbps: float  # effective TB/s = kv_bytes / time
    logical_tbps: float
    pct_of_copy: float  # tbps / copy bandwidth
    # the same step timed inside one graph of `iters` steps (time_in_graph): no standalone graph
    # launch in the figure; None where events cannot be recorded inside a graph
    us_in_graph: float | None = None
    pct_of_copy_in_graph: float | None = None
    ctas_per_sm: int | None = None  # the kernel build the planner picked (2 or 3 CTAs per SM)


def _sync():
    import torch

    torch.cuda.synchronize()


def event_seconds(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn between two CUDA events, after `warmup` untimed calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median of iters)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    seconds = event_seconds(lambda: dst.copy_(src), iters)
    del src, dst
    return 2 * nbytes / seconds


def make_step(hq: int, hkv: int, batch: int, qlen: int, q_dtype: str, *, ctx_len: int = 16384,
              shared_blocks: int = 0, topk: int = 16, seed: int = 0) -> dict[str, Any]:
    """Random decode step where every (token, KV head) selects `topk` full blocks."""
    import torch

    # every point starts from the same allocator state, whatever ran before it (this did not
    # move the 64/4 B=256 time, bench-2026-12-02T1623 vs T1618: the warm-up in time_graph did)
    torch.cuda.empty_cache()
    g = torch.Generator(device="cpu").manual_seed(seed)
    page = 128
    nblk = ctx_len // page
    pages = batch * nblk
    cg = torch.Generator(device="cuda").manual_seed(seed)
    kv = (torch.randn(pages, hkv, page, 256, generator=cg, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    perm = torch.randperm(pages, generator=g).to(torch.int32)
    block_table = perm.view(batch, nblk).cuda()
    seq_lens = torch.full((batch,), ctx_len, dtype=torch.int32)
    T = batch * qlen
    sel = torch.empty(T, hkv, topk, dtype=torch.int32)

    def pick(k: int, exclude=()) -> list[int]:  # k distinct blocks, never the last (added below)
        return [b for b in torch.randperm(nblk - 1, generator=g).tolist() if b not in exclude][:k]

    for r in range(batch):
        for h in range(hkv):
            first = pick(topk - 1)
            keep = first[: max(shared_blocks - 1, 0)]
            for j in range(qlen):
                if not shared_blocks:
                    cur = pick(topk - 1)
                elif j == 0:
                    cur = first
                else:  # shares `shared_blocks` blocks (the last one included) with token 0
                    cur = keep + pick(topk - 1 - len(keep), exclude=set(keep))
                sel[r * qlen + j, h] = torch.tensor(sorted(cur + [nblk - 1]), dtype=torch.int32)
    qdt = torch.bfloat16 if q_dtype == "bfloat16" else torch.float8_e4m3fn
    query = torch.randn(T, hq, 128, generator=cg, device="cuda").to(qdt)
    distinct = 0
    for r in range(batch):
        for h in range(hkv):
            distinct += len(set(sel[r * qlen : (r + 1) * qlen, h].flatten().tolist()))
    return {
        "query": query, "kv_cache": kv, "topk": sel.cuda(), "block_table": block_table,
        "seq_lens": seq_lens.cuda(), "seq_lens_cpu": seq_lens, "out": torch.empty(T, hq, 128, dtype=torch.bfloat16, device="cuda"),
        "kv_bytes": distinct * BLOCK_BYTES, "logical_bytes": T * hkv * topk * BLOCK_BYTES,
    }


def prepare_args(step: dict[str, Any], hq: int, hkv: int, qlen: int) -> tuple[tuple, dict[str, int]]:
    """(args, kwargs) of `SparseDecodePlanner.prepare` for a `make_step` step."""
    return ((step["block_table"], step["seq_lens"], step["seq_lens_cpu"], qlen),
            dict(num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16))


def _run_on_side_stream(fn, times: int = 3) -> None:
    """Run fn a few times on a side stream before capture (what torch.cuda.graphs asks for)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


def time_graph(fn, iters: int = 50, flush_bytes: int = 256 << 20, warmup_ms: float = 50.0,
               after_replay=None) -> list[float]:
    """Capture fn once in a CUDA graph; time `iters` replays, L2 flushed before each.

    The replays (with their flushes) first run untimed for `warmup_ms`: right after an idle
    stretch (the CPU building the next point's inputs) the first ~30 replays of 64/4 B=256
    ran ~7% slower on the H200 (bench/results/warmup-probe-2026-12-02.txt).
    after_replay(): called once the timed replay has finished (e.g. to read a trace), untimed.
    """
    import torch

    flush = torch.ones(flush_bytes, dtype=torch.uint8, device="cuda")
    _run_on_side_stream(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    _sync()
    t_end = time.perf_counter() + warmup_ms * 1e-3
    while time.perf_counter() < t_end:
        flush.sum(dtype=torch.int32)
        graph.replay()
        _sync()
    times = []
    for _ in range(iters):
        # Flush L2 by READING a buffer larger than it: a write (zero_()) would leave ~60 MB
        # of dirty lines whose write-back lands inside the timed region.
        flush.sum(dtype=torch.int32)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)  # microseconds
        if after_replay is not None:
            after_replay()
    return times


def time_in_graph(fn, iters: int = 50, flush_bytes: int = 256 << 20, warmup_ms: float = 50.0) -> list[float] | None:
    """Times of `iters` copies of fn captured in ONE graph, each after an L2 flush (inside the
    graph) and between two timing events recorded inside the graph (external event nodes).

    The step as it runs inside a larger graph, beside `time_graph`'s standalone replay. On the
    H200 (T1242) it is not shorter: the ~3.5 us of a one-tiny-kernel graph is the floor of an
    event pair around a kernel boundary, not the graph's launch (docs/performance.md #30).
    None when this torch / driver cannot record timing events inside a graph (torch without
    `Event(external=True)`).
    """
    import torch

    try:
        events = [(torch.cuda.Event(enable_timing=True, external=True),
                   torch.cuda.Event(enable_timing=True, external=True)) for _ in range(iters)]
    except TypeError:
        return None
    flush = torch.ones(flush_bytes, dtype=torch.uint8, device="cuda")
    _run_on_side_stream(fn)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for s, e in events:
                flush.sum(dtype=torch.int32)
                s.record()
                fn()
                e.record()
        t_end = time.perf_counter() + warmup_ms * 1e-3
        while True:
            graph.replay()
            _sync()
            if time.perf_counter() >= t_end:
                break
        return [s.elapsed_time(e) * 1e3 for s, e in events]  # the last replay, microseconds
    except RuntimeError:
        return None


def median_in_graph(fn, iters: int = 50) -> float | None:
    """Median of `time_in_graph(fn, iters)` in microseconds (2 decimals), None where it cannot run."""
    times = time_in_graph(fn, iters=iters)
    return round(statistics.median(times), 2) if times else None


def bench_point(geometry: str, batch: int, qlen: int, q_dtype: str, copy_bw: float, *,
                shared_blocks: int = 0, iters: int = 50) -> BenchPoint:
    from . import SparseDecodePlanner, sparse_decode

    hq, hkv = GEOMETRIES[geometry]
    step = make_step(hq, hkv, batch, qlen, q_dtype, shared_blocks=shared_blocks)
    planner = SparseDecodePlanner()
    sm_scale = 1.0 / math.sqrt(128)

    def run():
        plan = planner.prepare(step["block_table"], step["seq_lens"], step["seq_lens_cpu"], qlen,
                               num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16)
        sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], plan, sm_scale=sm_scale)
        return plan

    plan = run()
    times = sorted(time_graph(run, iters=iters))
    med = statistics.median(times)
    tbps = step["kv_bytes"] / (med * 1e-6) / 1e12
    med_in = median_in_graph(run, iters=iters)
    return BenchPoint(
        geometry, q_dtype, batch, qlen, shared_blocks, plan.num_splits, round(med, 2),
        round(times[len(times) // 10], 2), round(times[(9 * len(times)) // 10], 2),
        step["kv_bytes"], step["logical_bytes"], round(tbps, 3),
        round(step["logical_bytes"] / (med * 1e-6) / 1e12, 3), round(100 * tbps * 1e12 / copy_bw, 1),
        med_in, round(100 * step["kv_bytes"] / (med_in * 1e-6) / copy_bw, 1) if med_in else None,
        plan.ctas_per_sm,
    )


def per_layer(copy_bw: float, points=(("64/4", 64), ("8/1", 256), ("64/4", 256), ("64/4", 1)),
              num_layers: int = 4, log=print, ctas_per_sm: int | None = None) -> list[dict[str, Any]]:
    """The op as an engine runs it: one prologue, then L layers (each its own KV cache, topk,
    query) in one graph, L2 flushed before the replay. `marginal_us` = (time of L layers - time
    of 1) / (L - 1): what one more layer costs once the graph launch and the prologue are paid.
    ctas_per_sm: pin the kernel build (None: the planner's choice, reported per row).
    """
    import torch

    from . import SparseDecodePlanner, sparse_decode

    rows = []
    for geo, batch in points:
        hq, hkv = GEOMETRIES[geo]
        steps = [make_step(hq, hkv, batch, 1, "bfloat16", seed=i) for i in range(num_layers)]
        bt, sl, slc = steps[0]["block_table"], steps[0]["seq_lens"], steps[0]["seq_lens_cpu"]
        planner = SparseDecodePlanner(ctas_per_sm=ctas_per_sm)

        def graph_of(n: int):
            def run():
                plan = planner.prepare(bt, sl, slc, 1, num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16)
                for s in steps[:n]:  # every layer's cache is a permutation of the same pages
                    sparse_decode(s["query"], s["kv_cache"], s["topk"], s["out"], plan, sm_scale=1 / math.sqrt(128))
            return run

        t1 = statistics.median(time_graph(graph_of(1)))
        t_all = statistics.median(time_graph(graph_of(num_layers)))
        marginal = (t_all - t1) / (num_layers - 1)
        kv = steps[0]["kv_bytes"]
        plan = planner.prepare(bt, sl, slc, 1, num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16)
        row = {"geometry": geo, "batch": batch, "qlen": 1, "layers": num_layers, "ctas_per_sm": plan.ctas_per_sm,
               "num_splits": plan.num_splits, "one_layer_us": round(t1, 2),
               "all_layers_us": round(t_all, 2), "marginal_us": round(marginal, 2),
               "one_layer_pct_of_copy": round(100 * kv / (t1 * 1e-6) / copy_bw, 1),
               "marginal_pct_of_copy": round(100 * kv / (marginal * 1e-6) / copy_bw, 1)}
        rows.append(row)
        log(f"layers {row}")
        del steps
        torch.cuda.empty_cache()
    return rows


def per_call_us(fn, n: int, *, warmup: int = 0, sync: str = "none") -> float:
    """Host wall-clock microseconds per call of fn over n calls, the GPU idle at the start.

    sync: "none" (CPU cost only: launches queue up), "each" (synchronize after every call),
    "end" (one synchronize after the last call, inside the timed region).
    """
    for _ in range(warmup):
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        if sync == "each":
            _sync()
    if sync == "end":
        _sync()
    return (time.perf_counter() - t0) / n * 1e6


def host_overheads(iters: int = 2000, batch: int = 1) -> dict[str, float]:
    """CPU cost of a cached prepare (no sync) and of an eager op call beyond its GPU time (64/4).

    Two eager figures: `eager_overhead_us` syncs after every step (prepare + op), so the CPU
    time of the launches adds to the GPU time; `eager_pipelined_overhead_us` issues 200 steps
    back to back and syncs once, as an eager model loop does, so only CPU time beyond the GPU
    time shows. GPU time = graph replay with L2 flushed.
    """
    import torch

    from . import SparseDecodePlanner, sparse_decode

    step = make_step(64, 4, batch, 1, "bfloat16")
    planner = SparseDecodePlanner()
    args, kw = prepare_args(step, 64, 4, 1)

    def eager_step():
        plan = planner.prepare(*args, **kw)
        sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], plan, sm_scale=0.088)

    plan = planner.prepare(*args, **kw)
    eager_step()
    prep_us = per_call_us(lambda: planner.prepare(*args, **kw), iters)
    op_us = per_call_us(lambda: sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], plan,
                                              sm_scale=0.088), iters)
    eager_us = per_call_us(eager_step, 200, sync="each")
    pipelined_us = per_call_us(eager_step, 200, sync="end")
    gpu_us = statistics.median(time_graph(eager_step, iters=50))

    def op_call():
        sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], plan, sm_scale=0.088)

    # an eager engine prepares once per step and calls the op once per layer: the op alone
    op_pipelined_us = per_call_us(op_call, 200, sync="end")
    op_gpu_us = statistics.median(time_graph(op_call, iters=50))
    return {"batch": batch, "prepare_cpu_us": round(prep_us, 2), "op_call_cpu_us": round(op_us, 2),
            "eager_step_wall_us": round(eager_us, 2), "graph_step_gpu_us": round(gpu_us, 2),
            "eager_overhead_us": round(eager_us - gpu_us, 2),
            "eager_pipelined_step_us": round(pipelined_us, 2),
            "eager_pipelined_overhead_us": round(pipelined_us - gpu_us, 2),
            "op_pipelined_us": round(op_pipelined_us, 2), "graph_op_gpu_us": round(op_gpu_us, 2),
            "op_pipelined_overhead_us": round(op_pipelined_us - op_gpu_us, 2)}


def environment() -> dict[str, str]:
    import torch

    from .compiler import dsl_version

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "cutlass_dsl": dsl_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "msa-jit " + " ".join(sys.argv[1:]),
    }


def run_grid(geometries=GRID_GEOMETRIES, batches=GRID_BATCHES, qlens=GRID_QLENS,
             q_dtype="bfloat16", shared=True, iters: int = 50, log=print) -> dict[str, Any]:
    import torch

    copy_bw = copy_bandwidth()
    log(f"copy bandwidth: {copy_bw / 1e12:.3f} TB/s (read + write)")
    points = []
    for geo in geometries:
        for qlen in qlens:
            for b in batches:
                p = bench_point(geo, b, qlen, q_dtype, copy_bw, iters=iters)
                points.append(p)
                log(f"{geo:>5} q{qlen} B{b:<4} S{p.num_splits:<2} C{p.ctas_per_sm} {p.us:8.2f} us {p.tbps:6.3f} TB/s {p.pct_of_copy:5.1f}% of copy"
                    f" | in a graph {p.us_in_graph} us {p.pct_of_copy_in_graph}%")
    if shared:
        for b in (1, 16, 64):
            p = bench_point("64/4", b, 4, q_dtype, copy_bw, shared_blocks=12, iters=iters)
            points.append(p)
            log(f"shared12 64/4 q4 B{b:<4} {p.us:8.2f} us logical {p.logical_tbps:6.3f} TB/s")
    tiny = torch.zeros(1, device="cuda")
    floor = {"graph_us": round(statistics.median(time_graph(lambda: tiny.add_(1), iters=100)), 2)}
    floor["in_graph_us"] = median_in_graph(lambda: tiny.add_(1), iters=100)
    log(f"one tiny kernel: {floor['graph_us']} us as a graph, {floor['in_graph_us']} us inside a graph")
    return {"environment": environment(), "copy_tbps": round(copy_bw / 1e12, 4), "tiny_kernel": floor,
            "host": host_overheads(), "host_b256": host_overheads(iters=500, batch=256),
            "per_layer": per_layer(copy_bw, log=log), "points": [asdict(p) for p in points]}


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Effective TB/s and % of copy against batch, one line per geometry x qlen; copy = ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[tuple, list] = {}
    for p in result["points"]:
        if p["shared_blocks"]:
            continue
        series.setdefault((p["geometry"], p["qlen"], p["q_dtype"]), []).append((p["batch"], p["tbps"]))
    for (geo, qlen, qd), pts in sorted(series.items()):
        pts.sort()
        ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=f"{geo} qlen={qlen} {qd}")
    copy = result["copy_tbps"]
    ax.axhline(copy, color="k", ls="--", label=f"D2D copy {copy:.2f} TB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (requests)")
    ax.set_ylabel("effective TB/s (KV bytes / step time)")
    sec = ax.secondary_yaxis("right", functions=(lambda y: 100 * y / copy, lambda p: p * copy / 100))
    sec.set_ylabel("% of copy bandwidth")
    env = result["environment"]
    ax.set_title(f"MSA sparse decode, {env['device']}, {env['date'][:10]}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def readme_table(result: dict[str, Any], geometries=GRID_GEOMETRIES, batches=GRID_BATCHES,
                 qlens=GRID_QLENS) -> str:
    """The README's markdown table (µs and % of copy per point) of a result file."""
    points = {(p["geometry"], p["qlen"], p["batch"]): p for p in result["points"] if not p["shared_blocks"]}
    lines = ["| geometry | qlen | " + " | ".join(f"B={b}" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    for geo in geometries:
        for qlen in qlens:
            cells = [f"{points[(geo, qlen, b)]['us']:.1f} µs ({points[(geo, qlen, b)]['pct_of_copy']:.0f}%)"
                     for b in batches]
            lines.append(f"| {geo} | {qlen} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def regressions(result: dict[str, Any], baseline: dict[str, Any], slack: float = 1.05) -> list[str]:
    """Points slower than the same point of a previous result file by more than `slack`."""
    def key(p):
        return (p["geometry"], p["q_dtype"], p["batch"], p["qlen"], p["shared_blocks"])

    old = {key(p): p for p in baseline.get("points", [])}
    out = []
    for p in result["points"]:
        o = old.get(key(p))
        if o and p["us"] > o["us"] * slack:
            out.append(f"{key(p)}: {p['us']} us vs {o['us']} us before")
    return out


def latest_result(out_dir: str | Path) -> Path | None:
    """The newest bench-*.json in out_dir (by its recorded date), or None."""
    best, best_date = None, ""
    for path in Path(out_dir).glob("bench-*.json"):
        try:
            date = json.loads(path.read_text())["environment"]["date"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if date > best_date:
            best, best_date = path, date
    return best


def main(out_dir: str, baseline: str | None = "auto", **kw) -> dict[str, Any]:
    """Run the grid, write bench-<date>T<time>.json/.png into out_dir, compare with a baseline.

    baseline: a result JSON, "auto" (the newest result already in out_dir) or None/"none".
    Points slower than the baseline by more than 5% are listed in result["regressions"].
    """
    out = Path(out_dir)
    if baseline == "auto":
        baseline = latest_result(out)
    elif baseline in (None, "none"):
        baseline = None
    result = run_grid(**kw)
    out.mkdir(parents=True, exist_ok=True)  # only now: a run that fails leaves no empty folder
    if baseline:
        result["baseline"] = str(baseline)
        result["regressions"] = regressions(result, json.loads(Path(baseline).read_text()))
        for line in result["regressions"]:
            print("REGRESSION", line)
    stamp = result["environment"]["date"][:16].replace(":", "")
    (out / f"bench-{stamp}.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, out / f"bench-{stamp}.png")
    except ImportError:
        print("matplotlib missing: no plot written")
    return result
