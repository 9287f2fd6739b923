"""How the bench times things (METHOD.md): CUDA events, CUDA-graph replay with L2 flushed, medians.

`time_graph` is the figure of every step, layer and floor row; `copy_bandwidth` the ceiling
every bandwidth is a ratio to; `issue_us` the host side (`per_call_us` its wall-clock forms).
torch is imported inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

FLUSH_BYTES = 256 << 20  # read before every timed replay: larger than the H200's 60 MB L2
WARMUP_MS = 50.0  # untimed replays first (bench/results/warmup-probe-2026-12-02.txt)
COPY_BYTES = 2 << 30
# torch.cuda._sleep cycles that hold the GPU while `issue_us` issues: ~10 ms at the H200's
# 1.98 GHz, the issue of 200 calls of up to 50 us each
HOLD_CYCLES = 20_000_000


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def event_seconds(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
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


def copy_bandwidth(nbytes: int = COPY_BYTES, iters: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median of iters)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    seconds = event_seconds(lambda: dst.copy_(src), iters)
    del src, dst
    return 2 * nbytes / seconds


def _run_on_side_stream(fn: Callable[[], object], times: int = 3) -> None:
    """Run fn a few times on a side stream before capture (what torch.cuda.graphs asks for)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


def time_graph(fn: Callable[[], object], iters: int = 50, flush_bytes: int = FLUSH_BYTES,
               warmup_ms: float = WARMUP_MS, after_replay: Callable[[], object] | None = None) -> list[float]:
    """Capture fn once in a CUDA graph; time `iters` replays (microseconds), L2 flushed before each.

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


def time_in_graph(fn: Callable[[], object], iters: int = 50, flush_bytes: int = FLUSH_BYTES,
                  warmup_ms: float = WARMUP_MS) -> list[float] | None:
    """Times of `iters` copies of fn captured in ONE graph, each after an L2 flush (inside the
    graph) and between two timing events recorded inside the graph (external event nodes).

    The step as it runs inside a larger graph, beside `time_graph`'s standalone replay. On the
    H200 (T1242) it is not shorter: the ~3.5 us of a one-tiny-kernel graph is the floor of an
    event pair around a kernel boundary, not the graph's launch (docs/performance.md).
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


def median_in_graph(fn: Callable[[], object], iters: int = 50) -> float | None:
    """Median of `time_in_graph(fn, iters)` in microseconds (2 decimals), None where it cannot run."""
    times = time_in_graph(fn, iters=iters)
    return round(statistics.median(times), 2) if times else None


def per_call_us(fn: Callable[[], object], n: int, *, warmup: int = 0, sync: str = "none") -> float:
    """Host wall-clock microseconds per call of fn over n calls, the GPU idle at the start.

    sync: "none" (CPU cost only: launches queue up), "each" (synchronize after every call),
    "end" (one synchronize after the last call, inside the timed region).
    """
    if sync not in ("none", "each", "end"):
        raise ValueError(f"sync: expected 'none', 'each' or 'end', got {sync!r}")
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


def issue_us(fn: Callable[[], object], n: int = 200, *, hold_cycles: int = HOLD_CYCLES,
             attempts: int = 4) -> float:
    """Host microseconds per call of fn over n calls issued while the GPU is held busy.

    A spin kernel (`torch.cuda._sleep`) queued first keeps every launch of the n calls waiting
    in the stream, so no call waits on the GPU and the figure is the CPU's alone: an eager
    engine whose CPU runs ahead of its GPU. Back-to-back calls with one sync at the end
    (`per_call_us(sync="end")`) give the larger of the CPU's and the GPU's time per call
    instead: on a fast host, the op's eager GPU time at 64/4 batch 1. An event recorded behind
    the spin must still be pending once the n calls are issued; when it is not (the spin was
    too short, or a full launch queue made a call wait) the chunk is timed again with twice the
    spin and half the calls, `attempts` times, then RuntimeError.
    """
    import torch

    _sync()
    for _ in range(attempts):
        spin, calls = hold_cycles, n
        torch.cuda._sleep(hold_cycles)
        held = torch.cuda.Event()
        held.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        seconds = time.perf_counter() - t0
        still_held = not held.query()
        _sync()
        if still_held:
            return seconds / n * 1e6
        hold_cycles, n = 2 * hold_cycles, max(n // 2, 1)
    raise RuntimeError(f"issue_us: the GPU finished a {spin}-cycle spin before {calls} calls were issued "
                       f"({attempts} tries): the figure would include waits on the GPU")


def interleaved_issue_us(fns: dict[str, Callable[[], object]], n: int = 200, *, rounds: int = 15,
                         warmup: int = 100) -> dict[str, float]:
    """Median over `rounds` of `issue_us(fn, n)` for each fn, the fns taken in turn every round
    (the lent hosts' CPUs drift within a run, and the figures are compared with each other)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(issue_us(fn, n))
    return {name: statistics.median(ts) for name, ts in times.items()}


def interleaved_per_call_us(fns: dict[str, Callable[[], object]], n: int, *, rounds: int = 3,
                            warmup: int = 100, sync: str = "end") -> dict[str, float]:
    """Median over `rounds` of `per_call_us(fn, n, sync=sync)` for each fn, the fns taken in turn
    every round: the lent hosts' CPUs drift within a run, so figures that are compared (an op
    call against a trivial torch op) are measured side by side."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(per_call_us(fn, n, sync=sync))
    return {name: statistics.median(ts) for name, ts in times.items()}
