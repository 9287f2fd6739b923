"""`msa-jit warmup`: compile (or find cached) kernels for a set of geometries, in parallel.

Geometries come from flags (`--heads 64/4 --q-dtype bf16,fp8 --arch sm_90a,sm_100a`) or a
preset (`--preset minimax-m3`); the work is `msa_jit.warmup.run_warmup`. Prints a closing
table; exit 1 if a geometry failed or if no persistent cache directory is usable (nothing
would be kept), 2 for flags naming nothing it can build, 130 on Ctrl-C (one line on stderr:
what finished, what did not).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from .. import cache, warmup
from .common import add_geometry_arguments, format_table, interrupted, warm_geometry_flags

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
    try:
        rows = warm_geometry_flags(args, "warmup")
    except cache.CacheDirError as e:  # e.g. only an in-process temp dir: nothing would be kept
        print(e, file=sys.stderr)
        return 1
    except warmup.WarmupInterrupted as e:
        return interrupted("warmup", e)
    if rows is None:
        return 2
    print(render(rows))
    if args.json:
        warmup.write_json(args.json, rows, wall_seconds=round(time.perf_counter() - t0, 3))
    return 1 if warmup.summary(rows)["failed"] else 0
