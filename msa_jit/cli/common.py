"""What several `msa-jit` commands share: sizes, times, tables, output files, and the geometry flags.

One flag vocabulary for `warmup`, `inspect`, `bench` and `selftest` (the PyTorch / CUDA tools'
habit, as nvcc's or TORCH_CUDA_ARCH_LIST's: a singular name whose value may be a comma list, and
the flag may be repeated): `--heads 64/4,16/1`, `--q-dtype bf16,fp8`, `--kv-dtype fp8,nvfp4`,
`--arch sm_90a,sm_100a`. `add_geometry_arguments` defines them; the configs they name come from
`msa_jit.tools.warmup.warmup_configs`.

`--json [FILE]` (`add_json_argument`) means the same in every command that takes it: the result
as JSON into FILE, or onto stdout when FILE is `-` or left out; the text output then goes to
stderr (`text_stream`), so stdout holds the JSON only. FILE is checked before any work.

Nothing heavy is imported at module level (no torch, no compiler): `msa-jit --help` builds every
parser from this module.
"""

from __future__ import annotations

import argparse
import importlib
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
from typing import TYPE_CHECKING, Any, Callable, Sequence, TextIO

from .. import env
from ..geometry import (DEFAULT_ARCHES, DEFAULT_PAGE_SIZE, DEFAULT_TOPK_BLOCKS, KV_DTYPE_SHORT, Q_DTYPE_SHORT, Q_DTYPES,
                        SparseDecodeConfig)

if TYPE_CHECKING:  # pragma: no cover
    from ..jit import cache
    from ..tools import warmup

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
    "ignore_further_interrupts",
    "interrupted",
    "json_path_problem",
    "say_interrupted",
    "text_stream",
    "cache_dir_problem",
    "say_jobs_cap",
    "heads_from",
    "q_dtypes_from",
    "kv_dtypes_from",
    "arches_from",
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
        n = env.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n == 0 and any(c in "123456789" for c in text):  # '0.5' is no byte: a cap of 0 removes every entry
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte (0 removes every entry)")
    return n


def human_size(n: int | float) -> str:
    """1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def when(ts: Any) -> str:
    """A Unix time as local 'YYYY-mm-dd HH:MM:SS' ('-' for none, '?' for what is no usable time:
    a cache entry's meta.json may hold anything, and one entry must not stop a listing)."""
    if ts is None or ts == 0:
        return "-"
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return "?"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    except (OverflowError, ValueError, OSError):  # NaN, infinity, or past what the platform's time_t holds
        return "?"


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
    """`--json [FILE]`: `what` as JSON into FILE, or onto stdout (FILE `-` or left out; the text
    output then goes to stderr). The same words in every command's help."""
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help=f"also write {what} as JSON into FILE (checked before any work); with no FILE or '-', "
                        "onto stdout, and the text output goes to stderr")


def text_stream(args: argparse.Namespace) -> TextIO:
    """Where a command's text output goes: stderr when its JSON is on stdout (`--json` / `--json -`)."""
    return sys.stderr if getattr(args, "json", None) == "-" else sys.stdout


def json_path_problem(args: argparse.Namespace, command: str) -> bool:
    """Check --json FILE before the work: False when it can be written (or is stdout / not given);
    True after printing `msa-jit <command>: --json FILE: <why>` (the command exits 2)."""
    problem = check_output_path(getattr(args, "json", None))
    if problem:
        print(f"msa-jit {command}: --json {args.json or repr(args.json)}: {problem}", file=sys.stderr)
    return bool(problem)


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
    if path == "":  # Path("") is the working directory
        return "an empty file name"
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
        from ..jit.cache.errors import describe_oserror

        return f"cannot create a file in {parent} ({describe_oserror(e)})"
    os.close(fd)
    os.unlink(probe)
    return None


def _umask() -> int:
    """This process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
        # mkstemp's file is 0600: give it the mode the file has, or that open() would give a new one
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except OSError:  # no such file yet
            mode = 0o666 & ~_umask()
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cache_dir_problem(cache_dir: str | None, reads_only: bool = False) -> str | None:
    """Why the cache root this command was given (--cache-dir, else MSA_JIT_CACHE_DIR) cannot be one,
    as one line naming the flag or variable and the path; None when it can (or none is given).

    A root that exists and is no directory (a file, a broken symlink) is a configuration error:
    refused before any work, instead of a silent fallback to the per-user temp dir. So is a
    --cache-dir that cannot be written: the person named that root, and the fallback's advice to
    set MSA_JIT_CACHE_DIR could not override the flag anyway (the variable keeps its documented
    fallback). `reads_only` (cache list / info / verify): a read-only --cache-dir that holds a
    cache is read, as the pre-warmed read-only root it is."""
    from ..jit.cache.location import not_a_directory, readable_v1, root_problem

    if cache_dir:
        source, path = "--cache-dir", Path(os.path.abspath(os.path.expanduser(cache_dir)))
    else:
        source, path = env.CACHE_DIR, env.cache_dir()
        if path is None:
            return None
    why = not_a_directory(path)
    if why is None and source == "--cache-dir" and not (reads_only and readable_v1(path)):
        problem = root_problem(path)
        why = None if problem is None else f"cannot be used as the cache root ({problem})"
    if why is None:
        return None
    return f"{source} {path}: {why}" if source.startswith("--") else f"{source}={path}: {why}"


def open_cache(cache_dir: str | None, command: str, *, create: bool = True) -> cache.ArtifactCache:
    """`cache.open_cache(cache_dir, create=)`, with a fallback said on stderr in one line (`msa-jit
    <command>: ...`), not only as a CacheFallbackWarning, which PYTHONWARNINGS=ignore hides."""
    from ..jit import cache

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
    """'bf16' / 'fp8' (or the full dtype names) -> the config's name (every command alike)."""
    try:
        return Q_DTYPE_ALIASES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"--q-dtype {text!r}: expected bf16 or fp8") from None


def parse_kv_dtype(text: str, flag: str = "--kv-dtype") -> str:
    """'fp8' / 'nvfp4' (KV cache formats, or SparseDecodeConfig.kv_dtype's names) -> the config's name
    (every command alike; `flag` names it in the error)."""
    try:
        return KV_DTYPE_ALIASES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"{flag} {text!r}: expected {' or '.join(KV_DTYPE_SHORT.values())}") from None


def normalize_arch(text: str) -> str:
    """'sm_100a', 'sm100a', '100a', '10.0a' -> 'sm_100a' (MSA_JIT_ARCH's spellings); ValueError
    naming --arch for anything else, an arch msa-jit does not build for included."""
    try:
        return env.parse_arch(text)
    except ValueError as e:
        raise ValueError(f"--arch {text!r}: {e}") from None


# what the shared flags name, parsed (each [] when the flag is not given); ValueError naming the flag
def heads_from(args: argparse.Namespace) -> list[tuple[int, int]]:
    """--heads, every value and comma-list item, as (Hq, Hkv)."""
    return [parse_heads(h) for h in split_list("--heads", getattr(args, "heads", None))]


def q_dtypes_from(args: argparse.Namespace) -> list[str]:
    """--q-dtype as SparseDecodeConfig.q_dtype names."""
    return [parse_q_dtype(q) for q in split_list("--q-dtype", getattr(args, "q_dtype", None))]


def kv_dtypes_from(args: argparse.Namespace) -> list[str]:
    """--kv-dtype as SparseDecodeConfig.kv_dtype names."""
    return [parse_kv_dtype(k) for k in split_list("--kv-dtype", getattr(args, "kv_dtype", None))]


def arches_from(args: argparse.Namespace) -> list[str]:
    """--arch as 'sm_90a' / 'sm_100a'."""
    return [normalize_arch(a) for a in split_list("--arch", getattr(args, "arch", None))]


def one_of(flag: str, values: list[str], why: str) -> str | None:
    """The one value of a list flag a command takes only one of (None when not given); ValueError
    saying `why` for more."""
    if len(values) > 1:
        raise ValueError(f"{flag}: one value only ({why}), got {','.join(values)}")
    return values[0] if values else None


def configs_from_args(args: argparse.Namespace, default_preset: str | None = None) -> list[SparseDecodeConfig]:
    """The geometries named by --preset / --heads / --q-dtype / --kv-dtype / --arch / --page-size /
    --topk-blocks (with neither --preset nor --heads: `default_preset`, if given).

    --preset and --heads exclude each other; --q-dtype / --kv-dtype narrow a preset's dtypes.
    Without a preset the query dtypes default to both, the KV format to fp8. Raises ValueError
    on anything the kernel cannot serve (with check_config's reason).
    """
    from ..tools import warmup

    heads: list[tuple[int, int]] = []
    q_dtypes: list[str] = list(Q_DTYPES)
    kv_dtypes: list[str] = list(warmup.DEFAULT_KV_DTYPES)
    preset = getattr(args, "preset", None)
    heads_given, q_given, kv_given, arch_given = heads_from(args), q_dtypes_from(args), kv_dtypes_from(args), \
        arches_from(args)
    if preset and heads_given:
        raise ValueError(f"--preset {preset} and --heads name the head layouts both: give one "
                         "(--q-dtype / --kv-dtype / --arch narrow a preset)")
    preset = preset or (None if heads_given else default_preset)
    if preset:
        heads, q_dtypes, kv_dtypes = (list(x) for x in warmup.PRESETS[preset])
    heads = heads_given or heads
    q_dtypes = q_given or q_dtypes
    kv_dtypes = kv_given or kv_dtypes
    if not heads:
        raise ValueError("no geometry: give --heads Hq/Hkv (repeatable) or --preset " + "|".join(warmup.PRESETS))
    arches = arch_given or warmup.default_arches()
    return warmup.warmup_configs(heads, q_dtypes, arches, kv_dtypes=kv_dtypes, page_size=args.page_size,
                                 topk_blocks=args.topk_blocks)


def warm_geometry_flags(args: argparse.Namespace, command: str,
                        allow_ephemeral: bool = False, default_preset: str | None = None
                        ) -> list[warmup.WarmupRow] | None:
    """`warmup.run_warmup` of the configs the geometry flags name (one row per config); None,
    after printing `msa-jit <command>: <why>` to stderr, when the flags name nothing it can build.
    run_warmup's CacheDirError and WarmupInterrupted propagate (see `interrupted`)."""
    from ..jit import cache
    from ..tools import warmup

    try:
        configs = configs_from_args(args, default_preset)
    except ValueError as e:
        print(f"msa-jit {command}: {e}", file=sys.stderr)
        return None
    open_cache(args.cache_dir, command)  # says a fallback on stderr once, before the work
    say_jobs_cap(args.jobs, command)
    with warnings.catch_warnings():  # ... so the library's own opening of it need not warn again
        warnings.simplefilter("ignore", cache.CacheFallbackWarning)
        return warmup.run_warmup(configs, jobs=args.jobs, cache_dir=args.cache_dir, quiet=args.quiet,
                                 allow_ephemeral=allow_ephemeral)


# ----------------------------------------------------------------------------- interrupts and the exit
EXIT_INTERRUPTED = 130
_said = threading.Event()  # the one "interrupted" line is out
_exit = {"late_interrupt": False, "status": None}  # a Ctrl-C after the work; what main returned


def reset_interrupts() -> None:
    """A new command starts (main): nothing said yet."""
    _said.clear()


def interrupted_already() -> bool:
    return _said.is_set()


def set_exit_status(rc: int) -> None:
    """What main returned: the command's process exits with it (`exit_at_the_end`)."""
    _exit["status"] = rc


def say_interrupted(line: str) -> None:
    """Print the one line of an interrupted command (later calls print nothing)."""
    if not _said.is_set():
        _said.set()
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def _sigint_while_exiting(signum: int, frame: Any) -> None:
    """SIGINT once the work is over (the command prints its last lines, or the interpreter shuts
    down): no exception, which would print a traceback from wherever it landed (an atexit
    callback, a thread join); one line, and exit 130 at the end (`exit_at_the_end`)."""
    _exit["late_interrupt"] = True
    say_interrupted("msa-jit: interrupted")
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def import_holding_interrupts(module: str) -> None:
    """Import `module` with a Ctrl-C held until the import is done, then raised (KeyboardInterrupt).

    torch's import runs C++ that calls back into Python: a KeyboardInterrupt raised inside such a
    callback crosses pybind11 and ends the process in std::terminate (SIGABRT, exit -6) instead of
    the command's "interrupted" line and 130. Main thread only (elsewhere a plain import: signals
    reach only the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        importlib.import_module(module)
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        importlib.import_module(module)
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def ignore_further_interrupts() -> None:
    """From here on a Ctrl-C raises nothing: the command is exiting, and one must not turn the exit
    into a traceback. Once the "interrupted" line is out they are ignored (SIG_IGN, which also holds
    while the interpreter tears down); before, one makes the exit status 130. Main thread only
    (signals reach only it)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN if _said.is_set() else _sigint_while_exiting)


def exit_at_the_end() -> None:
    """The command's process's last atexit callback: exit with main's status (130 after a late
    Ctrl-C) at once. The interpreter's teardown that would follow (seconds with torch loaded) is
    where a late Ctrl-C would kill it by SIGINT, Python's handlers being gone by then."""
    status = EXIT_INTERRUPTED if _exit["late_interrupt"] else _exit["status"]
    if status is None:  # main did not return (an uncaught exception): the interpreter's own exit
        return
    if "logging" in sys.modules:  # its own atexit callback was registered before this one: it has not run
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(status)


def interrupted(command: str, e: warmup.WarmupInterrupted) -> int:
    """Ctrl-C during a warm-up: the one line saying what finished and what did not; exit 130.
    Further Ctrl-Cs are ignored from here on: the command is exiting, and one must not turn the
    exit into a traceback."""
    from ..tools import warmup

    say_interrupted(f"msa-jit {command}: interrupted: {warmup.interrupted_summary(e.rows)} "
                    "(finished builds are kept in the cache)")
    ignore_further_interrupts()  # said: ignored from here on
    return EXIT_INTERRUPTED


def say_jobs_cap(jobs: int | None, command: str) -> None:
    """Say on stderr when the warm-up will start fewer compile processes than --jobs (or its default)
    asks: `warmup.worker_limit` caps them by the CPUs and by the available memory."""
    from ..tools import warmup

    n, why = warmup.worker_limit(jobs)
    if why:
        asked = f"--jobs {jobs}" if jobs is not None else "the default --jobs"
        print(f"msa-jit {command}: {asked}: starting at most {n} compile process{'es' if n > 1 else ''} ({why})",
              file=sys.stderr)


# ----------------------------------------------------------------------------- the shared flags
class DeprecatedAlias(argparse.Action):
    """A former spelling of a flag (hidden from the help): stores into the new flag's dest, as the new
    flag would, and says once on stderr which spelling to use."""

    def __init__(self, option_strings, dest, new: str, append: bool = True, **kw) -> None:
        self.new, self.append = new, append
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"msa-jit: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        if self.append:
            current = getattr(namespace, self.dest, None)
            setattr(namespace, self.dest, [*(current or []), values])
        else:
            setattr(namespace, self.dest, values)


def add_alias(p: argparse.ArgumentParser, old: str, new: str, dest: str, append: bool = True) -> None:
    """`old` as a hidden, deprecated spelling of `new` (same dest)."""
    p.add_argument(old, dest=dest, action=DeprecatedAlias, new=new, append=append)


def add_heads_argument(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--heads", action="append", metavar="HQ/HKV[,...]",
                   help=f"query/KV head layouts, comma-separated or repeated, e.g. 64/4,16/1 ({default})")


def add_dtype_arguments(p: argparse.ArgumentParser, q_default: str, kv_default: str) -> None:
    p.add_argument("--q-dtype", action="append", metavar="DTYPE[,...]",
                   help=f"query dtypes: bf16, fp8, comma-separated or repeated ({q_default})")
    p.add_argument("--kv-dtype", action="append", metavar="FORMAT[,...]",
                   help=f"KV cache formats: fp8, nvfp4, comma-separated or repeated ({kv_default})")


def add_arch_argument(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("--arch", action="append", metavar="ARCH[,...]", help=help_text)


def add_geometry_arguments(p: argparse.ArgumentParser, default_preset: str | None = None) -> None:
    """Geometry-selection flags shared by `warmup` and `inspect`."""
    from ..tools import warmup

    def short(names, table):
        return ",".join(table.get(d, d) for d in names)

    presets = "; ".join(f"{name}: {' '.join(f'{hq}/{hkv}' for hq, hkv in heads)} x q {short(qs, Q_DTYPE_SHORT)} "
                        f"x kv {short(kvs, KV_DTYPE_SHORT)}"
                        for name, (heads, qs, kvs) in sorted(warmup.PRESETS.items()))
    default = f" (default without --heads: {default_preset})" if default_preset else ""
    p.add_argument("--preset", choices=sorted(warmup.PRESETS),
                   help=f"named set of geometries ({presets}){default}; not with --heads, "
                        "--q-dtype / --kv-dtype / --arch narrow it")
    add_heads_argument(p, f"default: --preset {default_preset}'s" if default_preset else "not with --preset")
    add_dtype_arguments(p, "default: both, or the preset's", "default: fp8, or the preset's")
    add_arch_argument(p, f"{','.join(DEFAULT_ARCHES)}, the arches msa-jit builds for (the arch-specific 'a' "
                         "targets; sm_90 / sm_100 are refused); default: $MSA_JIT_ARCH, else this GPU's arch, "
                         "else all of them")
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help=f"KV page size (default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--topk-blocks", type=int, default=DEFAULT_TOPK_BLOCKS,
                   help=f"top-k blocks per token (default {DEFAULT_TOPK_BLOCKS})")
    p.add_argument("--cache-dir", help="cache root for this run (sets MSA_JIT_CACHE_DIR for the workers)")
    p.add_argument("--jobs", "-j", type=positive_int, default=None,
                   help="parallel compile processes, >= 1 (default min(4, CPUs); never more than the CPUs, nor "
                        f"than the available memory holds at ~{warmup.WORKER_RSS_BYTES // 1024**2} MiB each)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")
