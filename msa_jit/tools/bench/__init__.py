"""`msa-jit bench`: the performance grid, measured as docs/performance.md ("How msa-jit measures") says.

Every figure is a CUDA-graph replay with L2 flushed (by reading) before each replay, after a
warm-up, median taken; every bandwidth is also a ratio to a 2 GiB device-to-device copy
measured in the same run (bytes read + written), beside which `read_2g` gives the read-only
stream's ceiling. The grid (`grid.grid_rows`: 64/4, 16/1, 8/1 x B 1..256 x qlen 1, 2, 4, 8,
fp8 and NVFP4 caches, plus the speculative-decode rows) is timed as an engine runs the op:
one prologue, then L layers in one graph; `per_layer` rows give what one more layer costs,
`points` the one-layer step. Small-batch rows carry the floor probe (`readers.floor_layer`),
`host` the CPU side.

Modules: `timing` (how things are timed), `steps` (random fp8 / NVFP4 decode steps, byte
accounting), `readers` (Triton read-only kernels: the 2 GiB stream, the floor probe; imports
triton), `grid` (which rows, pure Python), `measure` (timing them: `run_grid`, `main`), `report` (result tables, plot,
regression check), `peers` (other decode kernels timed beside msa-jit). The names below are what bench/*.py and
the CLI import; all but `grid`'s are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .grid import (FLOOR_BATCHES, FP8_KV, GEOMETRIES, GRID_BATCHES, GRID_GEOMETRIES, GRID_KV_DTYPES, GRID_QLENS, NUM_LAYERS, NVFP4_KV, QUICK_QLENS, QUICK_SHARED_POINTS, RESULTS_DIR, SHARED_BLOCKS, SHARED_POINTS, RowSpec, add_speedups, grid_rows)

# name -> the module that defines it, imported on first use: `grid` (pure Python) is all that
# `msa-jit bench --help` needs, the others import torch (and `readers` triton)
_LAZY = {
    **dict.fromkeys(("BenchPoint", "environment", "host_overheads", "main", "measure_row", "per_layer", "run_grid"),
                    "measure"),
    **dict.fromkeys(("compare_with_baseline", "latest_result", "plot", "result_tables", "regressions"), "report"),
    **dict.fromkeys(("BLOCK_BYTES", "NVFP4_BLOCK_BYTES", "StepIndices", "block_bytes", "decode", "make_indices",
                     "make_kv_cache", "make_step", "prepare_args"), "steps"),
    **dict.fromkeys(("copy_bandwidth", "event_seconds", "interleaved_issue_us", "interleaved_per_call_us", "issue_us",
                     "median_in_graph", "per_call_us", "time_graph", "time_in_graph"), "timing"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BLOCK_BYTES", "FLOOR_BATCHES", "FP8_KV", "GEOMETRIES", "GRID_BATCHES", "GRID_GEOMETRIES", "GRID_KV_DTYPES",
    "GRID_QLENS", "NUM_LAYERS", "NVFP4_BLOCK_BYTES", "NVFP4_KV", "QUICK_QLENS", "QUICK_SHARED_POINTS",
    "RESULTS_DIR", "SHARED_BLOCKS", "SHARED_POINTS", "BenchPoint", "RowSpec", "StepIndices", "add_speedups",
    "block_bytes", "compare_with_baseline", "copy_bandwidth", "decode", "environment",
    "event_seconds", "grid_rows", "host_overheads", "interleaved_issue_us", "interleaved_per_call_us",
    "issue_us", "latest_result",
    "main", "make_indices", "make_kv_cache", "make_step", "measure_row", "median_in_graph", "per_call_us",
    "per_layer", "plot", "prepare_args", "result_tables", "regressions", "run_grid", "time_graph", "time_in_graph",
]
