"""The bench grid's definition: which rows `msa-jit bench` times, in which order (no GPU).

A row is a step shape (geometry, batch, qlen, shared blocks) and a cache format; the fp8 and
NVFP4 rows of a point are timed one after the other on the same topk, block table and query.
`measure` times them; `report` and `targets` read the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...geometry import KV_DTYPES, MINIMAX_M3_GEOMETRIES

# "Hq/Hkv" -> (Hq, Hkv) of every MiniMax-M3 layout (what bench points and scripts are named by)
GEOMETRIES = {f"{hq}/{hkv}": (hq, hkv) for hq, hkv in MINIMAX_M3_GEOMETRIES}
FP8_KV, NVFP4_KV = KV_DTYPES  # SparseDecodeConfig.kv_dtype names, also the bench JSON's kv_dtype

# the grid of `msa-jit bench` and of the README's tables
GRID_GEOMETRIES = ("64/4", "16/1", "8/1")
GRID_BATCHES = (1, 4, 16, 64, 256)
GRID_QLENS = (1, 2, 4, 8)
GRID_KV_DTYPES = KV_DTYPES  # ("float8_e4m3fn", "nvfp4")
# speculative decode: consecutive tokens of a request share SHARED_BLOCKS of their 16 blocks
SHARED_BLOCKS = 12
SHARED_POINTS = (("64/4", 1, 4), ("64/4", 16, 4), ("64/4", 64, 4), ("64/4", 64, 2), ("64/4", 64, 8))
FLOOR_BATCHES = (1, 4, 16)  # rows that get the floor probe beside them
NUM_LAYERS = 4
# `--quick`: the qlens and shared points of the old grid (about half the rows)
QUICK_QLENS = (1, 4)
QUICK_SHARED_POINTS = (("64/4", 64, 4),)
RESULTS_DIR = "bench/results"  # where `msa-jit bench` / `selftest` write (relative to the working dir)


@dataclass(frozen=True)
class RowSpec:
    """One row of the grid: a step shape and a cache format."""

    geometry: str
    batch: int
    qlen: int
    shared_blocks: int
    kv_dtype: str
    floor: bool  # also time the floor probe at this point

    @property
    def point(self) -> tuple[str, int, int, int]:
        """What the fp8 and NVFP4 rows of a point share (their topk, block table, query)."""
        return (self.geometry, self.batch, self.qlen, self.shared_blocks)


def grid_rows(geometries=GRID_GEOMETRIES, batches=GRID_BATCHES, qlens=GRID_QLENS,
              kv_dtypes=GRID_KV_DTYPES, shared_points=SHARED_POINTS,
              floor_batches=FLOOR_BATCHES) -> list[RowSpec]:
    """The rows in the order they are timed. Pure Python (no GPU).

    Per qlen, geometry and batch, every cache format in turn (so the NVFP4 / fp8 speed-up
    compares neighbours in time). The qlens the targets need come first (QUICK_QLENS: 1 and 4),
    then the shared-block rows whose geometry is in `geometries`, then the other qlens: a run
    stopped early (`msa-jit bench` under a timeout keeps the rows done) still checks the targets.
    """
    for g in geometries:
        if g not in GEOMETRIES:
            raise ValueError(f"geometries: {g!r} is not one of {sorted(GEOMETRIES)}")
    for kv in kv_dtypes:
        if kv not in KV_DTYPES:
            raise ValueError(f"kv_dtypes: {kv!r} is not one of {KV_DTYPES}")

    def plain(qs) -> list[RowSpec]:
        return [RowSpec(g, b, q, 0, kv, b in floor_batches)
                for q in qs for g in geometries for b in batches for kv in kv_dtypes]

    first = [q for q in qlens if q in QUICK_QLENS]
    shared = [RowSpec(g, b, q, SHARED_BLOCKS, kv, False)
              for g, b, q in shared_points if g in geometries for kv in kv_dtypes]
    return plain(first) + shared + plain([q for q in qlens if q not in QUICK_QLENS])


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Give every NVFP4 row `speedup_vs_fp8` (fp8 marginal / NVFP4 marginal at the same point,
    query dtype and layer count) and `one_layer_speedup_vs_fp8`, in place; and, for each peer timed
    on that fp8 row (`<peer>_marginal_us`), `speedup_vs_<peer>_fp8`: the peer's fp8 time over the
    NVFP4 row's, what a user gains by moving from that peer's fp8 cache (the peers serve no NVFP4
    cache on Hopper) to msa-jit's NVFP4 one. Pure Python."""
    def key(r):
        return (r["geometry"], r["batch"], r["qlen"], r["shared_blocks"], r["q_dtype"], r["layers"])

    fp8 = {key(r): r for r in rows if r.get("kv_dtype", FP8_KV) == FP8_KV}
    for r in rows:
        o = fp8.get(key(r)) if r.get("kv_dtype") == NVFP4_KV else None
        if o and r["marginal_us"] > 0 and r["one_layer_us"] > 0:
            r["speedup_vs_fp8"] = round(o["marginal_us"] / r["marginal_us"], 3)
            r["one_layer_speedup_vs_fp8"] = round(o["one_layer_us"] / r["one_layer_us"], 3)
            for name, value in o.items():
                # a peer's figure: `<peer>_marginal_us` beside its `speedup_vs_<peer>` (the floor
                # probe's `floor_marginal_us` has none)
                peer = name[:-len("_marginal_us")] if name.endswith("_marginal_us") else None
                if peer and f"speedup_vs_{peer}" in o and isinstance(value, (int, float)) and value > 0:
                    r[f"speedup_vs_{peer}_fp8"] = round(value / r["marginal_us"], 3)


