"""What several `msa-jit` commands share: sizes, times, tables, output files, and the geometry flags.

The geometry flags (`--preset`, `--heads`, `--q-dtype`, `--kv-dtype`, `--arch`, `--page-size`,
`--topk-blocks`) are parsed here for `warmup` and `inspect`; the configs they name come from
`msa_jit.tools.warmup.warmup_configs`. `--json [FILE]` means the same in every command: FILE, or
stdout when FILE is `-` or left out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import stat
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from ..jit import cache
from .. import env
from ..tools import warmup
from ..jit.cache.errors import describe_oserror
from ..geometry import (DEFAULT_ARCHES, DEFAULT_PAGE_SIZE, DEFAULT_TOPK_BLOCKS, KV_DTYPE_SHORT, Q_DTYPE_SHORT, Q_DTYPES, SparseDecodeConfig)

__all__ = [
    "KV_DTYPE_ALIASES",
    "Q_DTYPE_ALIASES",
    "add_geometry_arguments",
    "add_json_argument",
    "check_output_path",
    "configs_from_args",
    "emit_json",
    "format_table",
    "human_size",
    "int_at_least",
    "interrupted",
    "normalize_arch",
    "open_cache",
    "parse_heads",
    "parse_kv_dtype",
    "parse_q_dtype",
    "parse_size",
    "positive_int",
    "split_list",
    "warm_geometry_flags",
    "when",
]

Q_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn",
}
# --kv-dtype: geometry.KV_DTYPE_SHORT's short names ("fp8", "nvfp4") and the config's own names
KV_DTYPE_ALIASES = {**{short: full for full, short in KV_DTYPE_SHORT.items()}, **{full: full for full in KV_DTYPE_SHORT}}
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


# ----------------------------------------------------------------------------- output
def int_at_least(low: int) -> Callable[[str], int]:
    """argparse type of an int >= `low` (e.g. bench's --layers: 2)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {n}")
        return n

    return parse


positive_int = int_at_least(1)  # argparse type of counts like --jobs


def add_json_argument(p: argparse.ArgumentParser, what: str) -> None:
    """`--json [FILE]`: `what` as JSON into FILE, or onto stdout (FILE `-` or left out)."""
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help=f"write {what} as JSON to FILE (checked before any work), or to stdout with no FILE or "
                        "'-' (the table then goes to stderr)")


def _special(p: Path) -> bool:
    """Whether `p` (followed through symlinks) exists and is no regular file or directory: a
    device (/dev/null, /dev/stdout's tty or pipe), a FIFO, a socket. Written into, never replaced."""
    try:
        st = p.stat()
    except OSError:
        return False
    return not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))


def _json_target(path: str) -> Path:
    """Where `emit_json` writes `path`: a symlink's final target (the link itself stays)."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)


def check_output_path(path: str | None) -> str | None:
    """Why `path` cannot be written (None when it can, or is '-' / None): checked before the work.

    A file is really created (and removed) beside the target, as `emit_json` will do: permission
    bits do not stop root, and a read-only, full or pseudo filesystem (/proc) only says no then."""
    if path is None or path == "-":
        return None
    p = Path(path)
    if p.is_dir():
        return f"{path} is a directory"
    if _special(p):
        return None if os.access(p, os.W_OK) else f"{path} is not writable"
    target = _json_target(path)
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"{path} is not writable"
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", dir=parent)
    except OSError as e:
        return f"cannot create a file in {parent} ({describe_oserror(e)})"
    os.close(fd)
    os.unlink(probe)
    return None


def emit_json(path: str | None, doc: Any) -> None:
    """`doc` as indented JSON to stdout (path '-') or into the file: written aside, then renamed
    onto it (onto a symlink's target); a device or FIFO (`--json /dev/stdout`) is written into."""
    text = json.dumps(doc, indent=1, default=str) + "\n"
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    if _special(Path(path)):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    target = _json_target(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_cache(cache_dir: str | None, command: str, *, create: bool = True) -> cache.ArtifactCache:
    """`cache.open_cache(cache_dir, create=)`, with a fallback said on stderr in one line (`msa-jit
    <command>: ...`), not only as a CacheFallbackWarning, which PYTHONWARNINGS=ignore hides."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cache.CacheFallbackWarning)
        c = cache.open_cache(cache_dir, create=create)
    if c.fallback_reason:  # the message starts with "msa-jit cache:"
        print(c.fallback_reason, file=sys.stderr)
    return c


# ----------------------------------------------------------------------------- geometry flags
def split_list(flag: str, values: str | Sequence[str] | None, allow_empty: bool = False) -> list[str]:
    """Flatten a comma-list flag's values (one string, or a repeated flag's list), dropping blanks
    around commas; [] when the flag is not given (None). ValueError naming `flag` for a value
    that lists nothing ('' or ','): it would otherwise mean the flag's default, i.e. everything."""
    out: list[str] = []
    for v in [values] if isinstance(values, str) else values or ():
        items = [p.strip() for p in v.split(",") if p.strip()]
        if not items and not allow_empty:
            raise ValueError(f"{flag} {v!r}: empty list (leave the flag out for its default)")
        out.extend(items)
    return out


def parse_heads(text: str) -> tuple[int, int]:
    """'64/4' -> (64, 4); ValueError otherwise."""
    m = _HEADS_RE.match(text)
    if m is None:
        raise ValueError(f"--heads {text!r}: expected Hq/Hkv, e.g. 64/4")
    return int(m.group(1)), int(m.group(2))


def parse_q_dtype(text: str) -> str:
    """'bf16' / 'fp8' (or the full dtype names) -> the config's name (`warmup` and `bench` alike)."""
    try:
        return Q_DTYPE_ALIASES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"--q-dtype {text!r}: expected bf16 or fp8") from None


def parse_kv_dtype(text: str, flag: str = "--kv-dtype") -> str:
    """'fp8' / 'nvfp4' (KV cache formats, or SparseDecodeConfig.kv_dtype's names) -> the config's name
    (warmup / inspect's --kv-dtype and bench's --kv-dtypes alike; `flag` names it in the error)."""
    try:
        return KV_DTYPE_ALIASES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"{flag} {text!r}: expected {' or '.join(KV_DTYPE_SHORT.values())}") from None


def q_dtype_arg(text: str) -> str:
    """`parse_q_dtype` as an argparse type (one value, e.g. bench's --q-dtype)."""
    try:
        return parse_q_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def normalize_arch(text: str) -> str:
    """'sm_100a', 'sm100a', '100a', '10.0a' -> 'sm_100a' (MSA_JIT_ARCH's spellings); ValueError
    naming --arch for anything else, an arch msa-jit does not build for included."""
    try:
        return env.parse_arch(text)
    except ValueError as e:
        raise ValueError(f"--arch {text!r}: {e}") from None


def configs_from_args(args: argparse.Namespace, default_preset: str | None = None) -> list[SparseDecodeConfig]:
    """The geometries named by --preset / --heads / --q-dtype / --kv-dtype / --arch / --page-size /
    --topk-blocks (with neither --preset nor --heads: `default_preset`, if given).

    --preset and --heads exclude each other; --q-dtype / --kv-dtype narrow a preset's dtypes.
    Without a preset the query dtypes default to both, the KV format to fp8. Raises ValueError
    on anything the kernel cannot serve (with check_config's reason).
    """
    heads: list[tuple[int, int]] = []
    q_dtypes: list[str] = list(Q_DTYPES)
    kv_dtypes: list[str] = list(warmup.DEFAULT_KV_DTYPES)
    preset = getattr(args, "preset", None)
    heads_given = split_list("--heads", args.heads)
    q_given = split_list("--q-dtype", args.q_dtype)
    kv_given = split_list("--kv-dtype", getattr(args, "kv_dtype", None))
    arch_given = split_list("--arch", args.arch)
    if preset and heads_given:
        raise ValueError(f"--preset {preset} and --heads name the head layouts both: give one "
                         "(--q-dtype / --kv-dtype / --arch narrow a preset)")
    preset = preset or (None if heads_given else default_preset)
    if preset:
        heads, q_dtypes, kv_dtypes = (list(x) for x in warmup.PRESETS[preset])
    if heads_given:
        heads = [parse_heads(h) for h in heads_given]
    if q_given:
        q_dtypes = [parse_q_dtype(q) for q in q_given]
    if kv_given:
        kv_dtypes = [parse_kv_dtype(k) for k in kv_given]
    if not heads:
        raise ValueError("no geometry: give --heads Hq/Hkv (repeatable) or --preset " + "|".join(warmup.PRESETS))
    arches = [normalize_arch(a) for a in arch_given] or warmup.default_arches()
    return warmup.warmup_configs(heads, q_dtypes, arches, kv_dtypes=kv_dtypes, page_size=args.page_size,
                                 topk_blocks=args.topk_blocks)


def warm_geometry_flags(args: argparse.Namespace, command: str,
                        allow_ephemeral: bool = False, default_preset: str | None = None
                        ) -> list[warmup.WarmupRow] | None:
    """`warmup.run_warmup` of the configs the geometry flags name (one row per config); None,
    after printing `msa-jit <command>: <why>` to stderr, when the flags name nothing it can build.
    run_warmup's CacheDirError and WarmupInterrupted propagate (see `interrupted`)."""
    try:
        configs = configs_from_args(args, default_preset)
    except ValueError as e:
        print(f"msa-jit {command}: {e}", file=sys.stderr)
        return None
    open_cache(args.cache_dir, command)  # says a fallback on stderr once, before the work
    with warnings.catch_warnings():  # ... so the library's own opening of it need not warn again
        warnings.simplefilter("ignore", cache.CacheFallbackWarning)
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


def add_geometry_arguments(p: argparse.ArgumentParser, default_preset: str | None = None) -> None:
    """Geometry-selection flags shared by `warmup` and `inspect`."""
    def short(names, table):
        return ",".join(table.get(d, d) for d in names)

    presets = "; ".join(f"{name}: {' '.join(f'{hq}/{hkv}' for hq, hkv in heads)} x q {short(qs, Q_DTYPE_SHORT)} "
                        f"x kv {short(kvs, KV_DTYPE_SHORT)}"
                        for name, (heads, qs, kvs) in sorted(warmup.PRESETS.items()))
    default = f" (default without --heads: {default_preset})" if default_preset else ""
    p.add_argument("--preset", choices=sorted(warmup.PRESETS),
                   help=f"named set of geometries ({presets}){default}; not with --heads, "
                        "--q-dtype / --kv-dtype / --arch narrow it")
    p.add_argument("--heads", action="append", metavar="HQ/HKV", help="query/KV heads, repeatable or comma-separated (e.g. 64/4)")
    p.add_argument("--q-dtype", action="append", metavar="DTYPES", help="query dtypes: bf16,fp8 (default: both)")
    p.add_argument("--kv-dtype", action="append", metavar="FORMATS",
                   help="KV cache formats: fp8,nvfp4 (default: fp8; a preset: both)")
    p.add_argument("--arch", action="append", metavar="ARCHES",
                   help=f"{','.join(DEFAULT_ARCHES)}, the arches msa-jit builds for (the arch-specific 'a' targets; "
                        "sm_90 / sm_100 are refused); default: $MSA_JIT_ARCH, else this GPU's arch, else all of them")
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help=f"KV page size (default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--topk-blocks", type=int, default=DEFAULT_TOPK_BLOCKS,
                   help=f"top-k blocks per token (default {DEFAULT_TOPK_BLOCKS})")
    p.add_argument("--cache-dir", help="cache root for this run (sets MSA_JIT_CACHE_DIR for the workers)")
    p.add_argument("--jobs", "-j", type=positive_int, default=None,
                   help="parallel compile processes, >= 1 (default min(4, CPUs))")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")
