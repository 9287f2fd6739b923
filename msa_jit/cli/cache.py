"""`msa-jit cache list|info|verify|prune|clear`: inspect and maintain the artifact cache.

Every action works on the root a process would use (resolved as a real process does, without
creating anything: `resolve(create=False)`), says on stderr when that is a fallback of the
configured one, and takes `--cache-dir DIR` and `--json [FILE]` (the result as JSON into FILE,
or onto stdout with no FILE, the text then on stderr: `common.add_json_argument`). None of them
creates a cache: a root without one reads as empty, and a --cache-dir that does not exist, or
that cannot be used (`common.cache_dir_problem`: list, info and verify still read a read-only
one that holds a cache), is exit 2.

`verify` exits 1 when an entry is bad. `clear`, and a `prune` whose cap is 0 (every entry goes),
ask first on a terminal, and without one refuse (exit 2) unless given --yes; `clear`, and a
`prune` below the run-time cap, also refuse when the configured root is unusable and the cache
fell back to another one (which may hold other configurations' kernels: name that one with
--cache-dir).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import env
from ..geometry import KV_DTYPE_SHORT, Q_DTYPE_SHORT, build_suffix
from .common import add_json_argument, emit_json, format_table, human_size, json_path_problem, open_cache, \
    parse_size, text_stream, when

if TYPE_CHECKING:  # pragma: no cover
    from ..jit import cache

HELP = "list / inspect / verify / prune / clear the artifact cache"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The five actions, each with --cache-dir and --json [FILE]."""
    sub = p.add_subparsers(dest="cache_command", metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", help="cache root (default: what a process uses: MSA_JIT_CACHE_DIR, XDG, "
                                            "~/.cache/msa-jit, or their fallback)")
    actions = (
        ("list", "one row per entry", "the entries"),
        ("info", "root, fallback, size, cap", "the cache's state"),
        ("verify", "hash-check every entry (exit 1 if any is bad)", "each entry's result"),
        ("prune", "drop garbage, then least recently used entries down to a size", "what was removed and what is left"),
        ("clear", "delete every entry (asks first; --yes to skip the question)", "what was removed"),
    )
    parsers = {}
    for name, help_text, json_what in actions:
        parsers[name] = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        add_json_argument(parsers[name], json_what)
    parsers["verify"].add_argument("--remove", action="store_true", help="delete bad entries")
    parsers["prune"].add_argument("--max-bytes", type=parse_size, default=None,
                                  help="size cap, e.g. 512M or 2G (default MSA_JIT_CACHE_MAX_BYTES); 0 removes every "
                                       "entry and asks first, as clear does")
    parsers["prune"].add_argument("--verbose", "-v", action="store_true", help="list each removed entry")
    for name in ("prune", "clear"):
        parsers[name].add_argument("--yes", "-y", action="store_true", help="do not ask before deleting every entry")


def _shown(value: Any, default: Any = "?") -> Any:
    """A meta.json field as a row shows it: a string or a number as it is, `default` when absent,
    '?' for anything else (a list, an object): a hand-edited or damaged entry must not stop a
    listing, nor `prune` / `clear`, which list what they remove."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return "?"
    return value if not isinstance(value, float) or math.isfinite(value) else "?"


def _created(value: Any) -> float | str | None:
    """meta.json's creation time: the number, None when absent, '?' when it is no usable time
    (JSON has no NaN or infinity to carry, and `when` cannot show a time past time_t)."""
    if value is None:
        return None
    return value if when(value) != "?" else "?"


def entry_row(entry: cache.CacheEntry) -> dict[str, Any]:
    """One `cache list` row from a CacheEntry's meta.json ('?' for a field that is missing or unusable)."""
    from ..jit import cache

    meta = entry.meta or {}
    has_config = isinstance(meta.get("config"), dict)
    cfg = meta["config"] if has_config else {}
    fp = meta.get("fingerprint") if isinstance(meta.get("fingerprint"), dict) else {}
    # an entry written before kv_dtype, kernel or split_merge joined the config is an fp8 token
    # merge-kernel one; an entry without a config object says nothing of the kind
    older = (lambda default: default) if has_config else (lambda default: "?")
    geometry = f"{_shown(cfg.get('num_q_heads'))}/{_shown(cfg.get('num_kv_heads'))}"
    if cfg.get("page_size", 128) != 128 or cfg.get("topk_blocks", 16) != 16:
        geometry += f" page{_shown(cfg.get('page_size'))} top{_shown(cfg.get('topk_blocks'))}"
    q_dtype, kv_dtype = _shown(cfg.get("q_dtype")), _shown(cfg.get("kv_dtype"), older("float8_e4m3fn"))
    try:
        last_used = (entry.path / cache.META_NAME).stat().st_mtime
    except OSError:
        last_used = None
    return {
        "key": entry.key, "geometry": geometry, "arch": _shown(cfg.get("arch")),
        "ctas_per_sm": _shown(cfg.get("ctas_per_sm")),
        "kernel": _shown(cfg.get("kernel"), older("token")),
        "split_merge": _shown(cfg.get("split_merge"), older("kernel")),
        "q_dtype": Q_DTYPE_SHORT.get(q_dtype, q_dtype), "kv_dtype": KV_DTYPE_SHORT.get(kv_dtype, kv_dtype),
        "dsl_version": _shown(fp.get("cutlass_dsl")), "kernel_family": _shown(fp.get("kernel_family")),
        "size": entry.size_bytes, "created": _created(meta.get("created")), "last_used": last_used,
        "readonly": entry.readonly, "path": str(entry.path),
    }


def _label(r: dict[str, Any]) -> str:
    """'0123456789ab 8/1 q bf16 kv fp8 sm_90a 2/SM': an entry in one short line."""
    return (f"{r['key'][:12]} {r['geometry']} q {r['q_dtype']} kv {r['kv_dtype']} {r['arch']} "
            f"{r['ctas_per_sm']}/SM{build_suffix(r['kernel'], r['split_merge'])}")


def _where(c: cache.ArtifactCache) -> str:
    """The root and what it is: '/r', '/r (no cache there yet)', '/r (the fallback: the configured
    root /x is unusable)', or what an in-process temporary directory would be."""
    if c.ephemeral:
        return (f"no persistent root (every candidate is unusable: a process would use an in-process temporary "
                f"directory, {c.root.parent}/msa-jit-*, deleted at exit)")
    notes = []
    if not c.exists:
        notes.append("no cache there yet")
    if c.root != c.requested_root:
        notes.append(f"the fallback: the configured root {c.requested_root} is unusable")
    return f"{c.root}" + (f" ({'; '.join(notes)})" if notes else "")


def _root_doc(c: cache.ArtifactCache) -> dict[str, Any]:
    """The root's part of every action's JSON."""
    return {"root": None if c.ephemeral else str(c.root), "configured_root": str(c.requested_root),
            "fallback": c.root != c.requested_root, "fallback_reason": c.fallback_reason, "exists": c.exists,
            "ephemeral": c.ephemeral, "readonly_roots": [str(r) for r in c.readonly_roots]}


def _configured_source(cache_dir: str | None) -> str:
    if cache_dir:
        return "--cache-dir"
    from ..jit.cache.location import preferred_root

    return preferred_root()[1]


def _interactive() -> bool:
    """Whether there is a person to ask: stdin and stderr are terminals."""
    try:
        return sys.stdin is not None and sys.stdin.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def confirm(what: str, yes: bool, command: str) -> bool | None:
    """Whether to `what` ('delete every entry ... in ROOT'): True for --yes, or for 'y' answered on a
    terminal; False when answered otherwise (nothing is done, exit 0); None when there is no
    terminal to ask on (after saying to pass --yes: exit 2)."""
    if yes:
        return True
    if not _interactive():
        print(f"msa-jit {command}: refusing to {what} without --yes (no terminal to ask on)", file=sys.stderr)
        return None
    sys.stderr.write(f"msa-jit {command}: {what}? [y/N] ")
    sys.stderr.flush()
    try:
        answer = sys.stdin.readline()
    except (OSError, ValueError):
        answer = ""
    return answer.strip().lower() in ("y", "yes")


def _size_of(paths: list[Path]) -> int:
    from ..jit.cache.entry import tree_size

    return sum(tree_size(p) for p in paths)


def _removal_doc(c: cache.ArtifactCache, removed: list[Path], before: dict[str, dict[str, Any]],
                 freed: int) -> dict[str, Any]:
    entries = [before[p.name] for p in removed if p.name in before]
    return {**_root_doc(c), "removed_entries": entries, "removed_other": [str(p) for p in removed if p.name not in before],
            "freed_bytes": freed}


def _say_unreadable(unreadable: int, out: Any) -> None:
    """A line for the entries a listing cannot show (their meta.json is damaged), so none is silently left out."""
    if unreadable:
        print(f"{unreadable} unreadable entries (damaged meta.json), not listed: `msa-jit cache verify --remove` "
              "removes them", file=out)


def _refuse_fallback(c: cache.ArtifactCache, command: str, flags: str) -> int:
    """Exit 2 for a deletion the fallback root must not get: it is the per-user temp dir, which
    may hold other configurations' kernels; naming it with --cache-dir is asking for it."""
    action = command.split()[-1]
    print(f"msa-jit {command}: refusing: the configured cache {c.requested_root} is unusable and this run fell "
          f"back to {c.root}, which may hold other configurations' kernels. To {action} that one, name it: "
          f"msa-jit {command} {flags} --cache-dir {c.root}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit cache ...`."""
    action = args.cache_command
    command = f"cache {action}"
    if json_path_problem(args, command):
        return 2
    if args.cache_dir and not os.path.lexists(os.path.expanduser(args.cache_dir)):
        print(f"msa-jit {command}: --cache-dir {args.cache_dir} does not exist", file=sys.stderr)
        return 2
    c = open_cache(args.cache_dir, command, create=False)  # a fallback is said on stderr
    out = text_stream(args)
    where = _where(c)
    if action == "list":
        rows = [entry_row(e) for e in c.entries()]
        print(format_table(
            ["key", "geometry", "arch", "q", "kv", "CTAs/SM", "dsl", "size", "created", "last used"],
            [[r["key"][:12] + (" (ro)" if r["readonly"] else ""), r["geometry"], r["arch"], r["q_dtype"], r["kv_dtype"],
              f"{r['ctas_per_sm']}{build_suffix(r['kernel'], r['split_merge'])}", r["dsl_version"], human_size(r["size"]),
              when(r["created"]), when(r["last_used"])]
             for r in rows],
        ), file=out)
        print(f"{len(rows)} entries in {where}", file=out)
        _say_unreadable(len(c.unreadable_entries()), out)
        if args.json:
            emit_json(args.json, rows)  # each row's path names its root (`cache info` says which that is)
        return 0
    if action == "info":
        entries = c.entries()
        info = {**_root_doc(c), "configured_source": _configured_source(args.cache_dir), "entries": len(entries),
                "unreadable_entries": len(c.unreadable_entries()),
                "size_bytes": c.size_bytes() if not c.ephemeral else 0, "cap_bytes": env.cache_max_bytes()}
        print(f"root:            {where}", file=out)
        if c.root != c.requested_root or c.ephemeral:
            print(f"configured:      {c.requested_root} ({info['configured_source']}): unusable", file=out)
        print(f"fallback:        {info['fallback_reason'] or 'none (the configured root is used)'}", file=out)
        print(f"read-only roots: {', '.join(info['readonly_roots']) or 'none'}", file=out)
        print(f"entries:         {info['entries']}", file=out)
        _say_unreadable(info["unreadable_entries"], out)
        print(f"total size:      {human_size(info['size_bytes'])} ({info['size_bytes']} bytes)", file=out)
        print(f"cap:             {human_size(info['cap_bytes'])} ({env.CACHE_MAX_BYTES})", file=out)
        if args.json:
            emit_json(args.json, info)
        return 0
    if action == "verify":
        results = c.verify(remove=args.remove)
        bad = [(e, why) for e, why in results if why]
        for e, why in bad:
            gone = " (removed)" if args.remove and not e.readonly else ""
            print(f"BAD {e.key[:12]} {e.path}: {why}{gone}", file=out)
        print(f"{len(results) - len(bad)} ok, {len(bad)} bad in {where}", file=out)
        if args.json:
            emit_json(args.json, {**_root_doc(c), "ok": len(results) - len(bad), "bad": len(bad), "entries": [
                {"key": e.key, "path": str(e.path), "readonly": e.readonly, "problem": why,
                 "removed": bool(why) and args.remove and not e.readonly} for e, why in results]})
        return 1 if bad else 0
    # prune / clear: they delete
    if c.ephemeral:
        print(f"msa-jit {command}: nothing to do: {where}", file=out)
        if args.json:
            emit_json(args.json, {**_root_doc(c), "removed_entries": [], "removed_other": [], "freed_bytes": 0})
        return 0
    before = {e.key: entry_row(e) for e in c.entries() if not e.readonly}
    if action == "prune":
        cap = env.cache_max_bytes() if args.max_bytes is None else args.max_bytes
        if c.root != c.requested_root and cap < env.cache_max_bytes():
            # below the run-time cap it removes what no process's automatic prune would there
            return _refuse_fallback(c, command, f"--max-bytes {args.max_bytes}")
        if cap == 0 and before:
            source = "--max-bytes 0" if args.max_bytes is not None else f"{env.CACHE_MAX_BYTES}=0"
            ok = confirm(f"delete every entry ({len(before)}, {human_size(c.size_bytes())}) in {c.root} ({source})",
                         args.yes, command)
            if not ok:
                return 2 if ok is None else 0
        size0 = c.size_bytes()
        removed = c.prune(cap)
        freed = max(0, size0 - c.size_bytes())
        gone = [before[p.name] for p in removed if p.name in before]
        other = [p for p in removed if p.name not in before]
        if args.verbose:
            for r in gone:
                print(f"removed {_label(r)}  {human_size(r['size'])}", file=out)
            for p in other:
                print(f"removed {p} (a leftover: an unfinished build, trash or an incomplete entry)", file=out)
        left = sum(not e.readonly for e in c.entries())
        print(f"pruned {len(gone)} entr{'y' if len(gone) == 1 else 'ies'}"
              + (f" and {len(other)} leftover{'s' if len(other) != 1 else ''}" if other else "")
              + f", {human_size(freed)} freed; {left} entr{'y' if left == 1 else 'ies'}, {human_size(c.size_bytes())} "
              f"left in {where} (cap {human_size(cap)})"
              + ("" if args.verbose or not removed else "; --verbose lists them"), file=out)
        if args.json:
            emit_json(args.json, {**_removal_doc(c, removed, before, freed), "cap_bytes": cap,
                                  "entries_left": left, "size_bytes_left": c.size_bytes()})
        return 0
    if action == "clear":
        if c.root != c.requested_root:
            return _refuse_fallback(c, command, "--yes")
        if before:
            ok = confirm(f"delete every entry ({len(before)}, {human_size(c.size_bytes())}) in {c.root}", args.yes,
                         command)
            if not ok:
                return 2 if ok is None else 0
        size0 = c.size_bytes()
        removed = c.clear()
        freed = max(0, size0 - c.size_bytes())
        gone = [p for p in removed if p.name in before]
        print(f"cleared {len(gone)} entr{'y' if len(gone) == 1 else 'ies'}"
              + (f" and {len(removed) - len(gone)} leftovers" if len(removed) > len(gone) else "")
              + f", {human_size(freed)} freed, from {where}", file=out)
        if args.json:
            emit_json(args.json, _removal_doc(c, removed, before, freed))
        return 0
    raise AssertionError(action)
