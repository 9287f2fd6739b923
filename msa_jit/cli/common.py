"""What several `msa-jit` commands share: sizes, times, tables, and the geometry flags.

The geometry flags (`--preset`, `--heads`, `--q-dtype`, `--arch`, `--page-size`, `--topk-blocks`)
are parsed here for `warmup` and `inspect`; the configs they name come from
`msa_jit.warmup.warmup_configs`.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import threading
import time
from typing import Any, Sequence

from .. import env, warmup
from ..geometry import DEFAULT_PAGE_SIZE, DEFAULT_TOPK_BLOCKS, Q_DTYPE_SHORT, Q_DTYPES, SparseDecodeConfig

__all__ = [
    "Q_DTYPE_ALIASES",
    "add_geometry_arguments",
    "configs_from_args",
    "warm_geometry_flags",
    "format_table",
    "human_size",
    "interrupted",
    "normalize_arch",
    "parse_heads",
    "parse_q_dtype",
    "parse_size",
    "when",
]

Q_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn",
}
_HEADS_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


# ----------------------------------------------------------------------------- sizes, times, tables
def parse_size(text: str) -> int:
    """`env.parse_size` as an argparse type: '512M', '2G', '2GiB' -> bytes (MSA_JIT_CACHE_MAX_BYTES's syntax)."""
    try:
        return env.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def human_size(n: int | float) -> str:
    """1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def when(ts: float | None) -> str:
    """A Unix time as local 'YYYY-mm-dd HH:MM:SS' ('-' for none)."""
    return "-" if not ts else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain left-aligned text table."""
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- geometry flags
def _split(values: Sequence[str] | None) -> list[str]:
    """Flatten repeated and comma-separated flag values, dropping blanks."""
    out: list[str] = []
    for v in values or ():
        out.extend(p.strip() for p in v.split(",") if p.strip())
    return out


def parse_heads(text: str) -> tuple[int, int]:
    """'64/4' -> (64, 4); ValueError otherwise."""
    m = _HEADS_RE.match(text)
    if m is None:
        raise ValueError(f"--heads {text!r}: expected Hq/Hkv, e.g. 64/4")
    return int(m.group(1)), int(m.group(2))


def parse_q_dtype(text: str) -> str:
    """'bf16' / 'fp8' (or the full dtype names) -> canonical dtype name."""
    try:
        return Q_DTYPE_ALIASES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"--q-dtype {text!r}: expected bf16 or fp8") from None


def normalize_arch(text: str) -> str:
    """'sm_100a', 'sm100a', '100a', '10.0a' -> 'sm_100a' (same spellings as MSA_JIT_ARCH)."""
    arch = env.parse_arch(text)
    if arch is None:
        raise ValueError(f"--arch {text!r}: expected e.g. sm_90a or sm_100a")
    return arch


def configs_from_args(args: argparse.Namespace) -> list[SparseDecodeConfig]:
    """The geometries named by --preset / --heads / --q-dtype / --arch / --page-size / --topk-blocks.

    Explicit --heads / --q-dtype replace the preset's. Raises ValueError on anything the
    kernel cannot serve (with check_config's reason).
    """
    heads: list[tuple[int, int]] = []
    dtypes: list[str] = []
    if getattr(args, "preset", None):
        heads, dtypes = (list(x) for x in warmup.PRESETS[args.preset])
    if _split(args.heads):
        heads = [parse_heads(h) for h in _split(args.heads)]
    if _split(args.q_dtype):
        dtypes = [parse_q_dtype(q) for q in _split(args.q_dtype)]
    if not heads:
        raise ValueError("no geometry: give --heads Hq/Hkv (repeatable) or --preset " + "|".join(warmup.PRESETS))
    if not dtypes:
        dtypes = list(Q_DTYPES)
    arches = [normalize_arch(a) for a in _split(args.arch)] or warmup.default_arches()
    return warmup.warmup_configs(heads, dtypes, arches, page_size=args.page_size, topk_blocks=args.topk_blocks)


def warm_geometry_flags(args: argparse.Namespace, command: str,
                        allow_ephemeral: bool = False) -> list[warmup.WarmupRow] | None:
    """`warmup.run_warmup` of the configs the geometry flags name (one row per config); None,
    after printing `msa-jit <command>: <why>` to stderr, when the flags name nothing it can build.
    run_warmup's CacheDirError and WarmupInterrupted propagate (see `interrupted`)."""
    try:
        configs = configs_from_args(args)
    except ValueError as e:
        print(f"msa-jit {command}: {e}", file=sys.stderr)
        return None
    return warmup.run_warmup(configs, jobs=args.jobs, cache_dir=args.cache_dir, quiet=args.quiet,
                             allow_ephemeral=allow_ephemeral)


def interrupted(command: str, e: warmup.WarmupInterrupted) -> int:
    """Ctrl-C during a warm-up: the one line saying what finished and what did not; exit 130.
    Further Ctrl-Cs are ignored from here on: the command is exiting, and one must not turn the
    exit into a traceback."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"msa-jit {command}: interrupted: {warmup.interrupted_summary(e.rows)} "
          "(finished builds are kept in the cache)", file=sys.stderr)
    return 130


def add_geometry_arguments(p: argparse.ArgumentParser) -> None:
    """Geometry-selection flags shared by `warmup` and `inspect`."""
    presets = "; ".join(f"{name}: {' '.join(f'{hq}/{hkv}' for hq, hkv in heads)} x {','.join(Q_DTYPE_SHORT.get(d, d) for d in dtypes)}"
                        for name, (heads, dtypes) in sorted(warmup.PRESETS.items()))
    p.add_argument("--preset", choices=sorted(warmup.PRESETS), help=f"named set of geometries ({presets})")
    p.add_argument("--heads", action="append", metavar="HQ/HKV", help="query/KV heads, repeatable or comma-separated (e.g. 64/4)")
    p.add_argument("--q-dtype", action="append", metavar="DTYPES", help="bf16,fp8 (default: both)")
    p.add_argument("--arch", action="append", metavar="ARCHES",
                   help="sm_90a,sm_100a (default: $MSA_JIT_ARCH, else this GPU's arch, else both)")
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help=f"KV page size (default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--topk-blocks", type=int, default=DEFAULT_TOPK_BLOCKS,
                   help=f"top-k blocks per token (default {DEFAULT_TOPK_BLOCKS})")
    p.add_argument("--cache-dir", help="cache root for this run (sets MSA_JIT_CACHE_DIR for the workers)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile processes (default min(4, CPUs))")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")
