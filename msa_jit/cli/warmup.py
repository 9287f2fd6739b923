"""`msa-jit warmup`: compile (or find cached) kernels for a set of geometries, in parallel.

Geometries come from flags (`--heads 64/4 --q-dtype bf16,fp8 --arch sm_90a,sm_100a`) or a
preset (`--preset minimax-m3`); the work is `msa_jit.warmup.run_warmup`. Prints a closing
table; exit 1 if a geometry failed, 2 for flags naming nothing it can build.
"""

from __future__ import annotations

import argparse
import time
from typing import Sequence

from .. import warmup
from .common import add_geometry_arguments, format_table, warm_geometry_flags

HELP = "compile kernels for geometries into the cache (no GPU needed)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The geometry flags, and --json FILE for the result rows."""
    add_geometry_arguments(p)
    p.add_argument("--json", metavar="FILE", help="write the result rows as JSON")


def render(rows: Sequence[warmup.WarmupRow]) -> str:
    """The closing table, failures' errors, and the `N compiled, M cached, K failed` line."""
    table = format_table(
        ["geometry", "q dtype", "arch", "CTAs/SM", "status", "seconds", "artifact"],
        [[r.geometry, r.q, r.config.arch, r.config.ctas_per_sm, r.status, f"{r.seconds:.2f}", r.artifact or "-"]
         for r in rows],
    )
    parts = [table]
    for r in rows:
        if r.status == "failed":
            parts.append(f"FAILED {r.geometry} {r.q} {r.config.arch} {r.config.ctas_per_sm}/SM: {r.error}")
    s = warmup.summary(rows)
    parts.append(f"{s['compiled']} compiled, {s['cached']} cached, {s['failed']} failed")
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit warmup`."""
    t0 = time.perf_counter()
    rows = warm_geometry_flags(args, "warmup")
    if rows is None:
        return 2
    print(render(rows))
    if args.json:
        warmup.write_json(args.json, rows, wall_seconds=round(time.perf_counter() - t0, 3))
    return 1 if warmup.summary(rows)["failed"] else 0
