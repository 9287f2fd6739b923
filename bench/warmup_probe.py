"""Replay-by-replay step times of 64/4 B=256 (the bench's time_graph with warmup_ms=0).

    python3 bench/warmup_probe.py        # on the GPU host (PYTHONPATH=., a warmed cache)

Prints the median / p10 / p90 and the first 60 replay times of three 100-replay runs: fresh
inputs, after the 2 GiB copy benchmark, and once more. Finding (2026-12-02,
bench/results/warmup-probe-2026-12-02.txt): the first ~30 replays after the inputs are built
run at ~160 us, then ~149 us, which is why time_graph now warms up for 50 ms.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path


def main() -> None:
    from msa_jit import SparseDecodePlanner, sparse_decode
    from msa_jit.tools.bench import copy_bandwidth, make_step, time_graph

    step = make_step(64, 4, 256, 1, "bfloat16")
    planner = SparseDecodePlanner()

    def run():
        plan = planner.prepare(step["block_table"], step["seq_lens"], step["seq_lens_cpu"], 1,
                               num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16)
        sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], plan, sm_scale=0.088)

    def show(tag: str, ts: list[float]) -> None:
        s = sorted(ts)
        print(f"{tag} median {statistics.median(ts):.1f} p10 {s[len(s) // 10]:.1f} p90 {s[9 * len(s) // 10]:.1f}")
        print("  seq:", " ".join(f"{t:.0f}" for t in ts[:60]))

    show("fresh", time_graph(run, iters=100, warmup_ms=0))
    copy_bandwidth()
    show("after-copy", time_graph(run, iters=100, warmup_ms=0))
    show("again", time_graph(run, iters=100, warmup_ms=0))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
