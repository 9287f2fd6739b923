"""`msa-jit warmup`: compile (or find cached) kernels for a set of geometries, in parallel.

Geometries come from flags (`--heads 64/4 --q-dtype bf16,fp8 --kv-dtype fp8,nvfp4 --arch
sm_90a,sm_100a`) or a preset (`--preset minimax-m3`); the work is `msa_jit.tools.warmup.run_warmup`.
Prints a closing table; exit 1 if a geometry failed or if no persistent cache directory is
usable (nothing would be kept), 2 for flags naming nothing it can build (or a --json FILE that
cannot be written, or a cache root that is no directory: checked first), 130 on Ctrl-C (one
line on stderr: what finished, what did not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from .. import env
from ..geometry import build_suffix
from .common import add_geometry_arguments, add_json_argument, emit_json, format_table, interrupted, \
    json_path_problem, text_stream, warm_geometry_flags

if TYPE_CHECKING:  # pragma: no cover
    from ..tools import warmup

HELP = "compile kernels for geometries into the cache (no GPU needed)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The geometry flags, and --json [FILE] for the result rows."""
    add_geometry_arguments(p)
    add_json_argument(p, "the result rows")


def _occupancy(config) -> str:
    """The CTAs/SM cell: '2', '2 union', '2 cluster merge' (as `cache list` and `inspect` write it)."""
    return f"{config.ctas_per_sm}{build_suffix(config.kernel, config.split_merge)}"


def render(rows: Sequence[warmup.WarmupRow]) -> str:
    """The closing table (the cache key's first 12 digits, the cache dirs once below), failures'
    errors, and the `N compiled, M cached, K failed` line."""
    from ..tools import warmup

    table = format_table(
        ["geometry", "q", "kv", "arch", "CTAs/SM", "status", "seconds", "key"],
        [[r.geometry, r.q, r.kv, r.config.arch, _occupancy(r.config), r.status, f"{r.seconds:.2f}",
          r.key[:12] if r.key else "-"] for r in rows],
    )
    parts = [table]
    # an artifact is <root>/v1/<key[:2]>/<key>/<file>: name the roots, not every path
    roots = sorted({str(Path(r.artifact).parents[3]) for r in rows if r.artifact})
    if roots:
        parts.append(f"artifacts in {', '.join(roots)} (`msa-jit cache list` shows every entry)")
    # under MSA_JIT_NO_COMPILE=1 a miss is ArtifactMissingError, whose hint is the warmup that just ran:
    # one short line per missing kernel and one closing hint instead
    missing = [r for r in rows if r.status == "failed" and (r.error or "").startswith("ArtifactMissingError:")]
    for r in rows:
        if r in missing:
            parts.append(f"FAILED {r.label}: not in the cache")
        elif r.status == "failed":
            parts.append(f"FAILED {r.label}: {r.error}")
    s = warmup.summary(rows)
    parts.append(f"{s['compiled']} compiled, {s['cached']} cached, {s['failed']} failed")
    if missing:
        parts.append(f"{env.NO_COMPILE}=1: this warmup only looked the kernels up; unset it to build the "
                     f"{len(missing)} missing here, or warm a cache on a build host and ship it (docs/cache.md §9)")
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit warmup`."""
    from ..jit import cache
    from ..tools import warmup

    t0 = time.perf_counter()
    if json_path_problem(args, "warmup"):
        return 2
    try:
        rows = warm_geometry_flags(args, "warmup")
    except cache.CacheDirError as e:  # e.g. only an in-process temp dir: nothing would be kept
        print(e, file=sys.stderr)
        return 1
    except warmup.WarmupInterrupted as e:
        return interrupted("warmup", e)
    if rows is None:
        return 2
    print(render(rows), file=text_stream(args))  # stderr when the JSON is on stdout
    if args.json:
        emit_json(args.json, warmup.json_document(rows, wall_seconds=round(time.perf_counter() - t0, 3)))
    return 1 if warmup.summary(rows)["failed"] else 0
