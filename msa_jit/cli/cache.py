"""`msa-jit cache list|info|verify|prune|clear`: inspect and maintain the artifact cache.

`verify` exits 1 when an entry is bad; `clear` refuses (exit 2) without --yes, and when the
configured root is unusable and the cache fell back to another one (which may hold other
configurations' kernels: clear that one by naming it with --cache-dir). None of them creates
a cache: a root without one reads as empty, and a --cache-dir that does not exist is exit 2.
`list` / `info` take `--json [FILE]` (stdout without FILE), like every command.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..jit import cache
from .. import env
from ..geometry import KV_DTYPE_SHORT, Q_DTYPE_SHORT, build_suffix
from .common import add_json_argument, check_output_path, emit_json, format_table, human_size, open_cache, \
    parse_size, when

HELP = "list / inspect / verify / prune / clear the artifact cache"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The five subcommands, each with --cache-dir."""
    sub = p.add_subparsers(dest="cache_command", metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", help="cache root (default: MSA_JIT_CACHE_DIR / XDG / ~/.cache/msa-jit)")
    cl = sub.add_parser("list", parents=[common], help="one row per entry")
    add_json_argument(cl, "the entries")
    ci = sub.add_parser("info", parents=[common], help="root, fallback, size, cap")
    add_json_argument(ci, "the cache's state")
    cv = sub.add_parser("verify", parents=[common], help="hash-check every entry (exit 1 if any is bad)")
    cv.add_argument("--remove", action="store_true", help="delete bad entries")
    cp = sub.add_parser("prune", parents=[common], help="drop garbage, then LRU entries down to a size")
    cp.add_argument("--max-bytes", type=parse_size, default=None, help="size cap (default MSA_JIT_CACHE_MAX_BYTES)")
    cc = sub.add_parser("clear", parents=[common], help="delete every entry (needs --yes)")
    cc.add_argument("--yes", action="store_true", help="really delete")


def entry_row(entry: cache.CacheEntry) -> dict[str, Any]:
    """One `cache list` row from a CacheEntry's meta.json."""
    meta = entry.meta or {}
    cfg = meta.get("config") or {}
    fp = meta.get("fingerprint") or {}
    geometry = f"{cfg.get('num_q_heads', '?')}/{cfg.get('num_kv_heads', '?')}"
    if cfg.get("page_size", 128) != 128 or cfg.get("topk_blocks", 16) != 16:
        geometry += f" page{cfg.get('page_size')} top{cfg.get('topk_blocks')}"
    try:
        last_used = (entry.path / cache.META_NAME).stat().st_mtime
    except OSError:
        last_used = None
    return {
        "key": entry.key, "geometry": geometry, "arch": cfg.get("arch", "?"), "ctas_per_sm": cfg.get("ctas_per_sm", "?"),
        "kernel": cfg.get("kernel", "token"),  # an entry written before kernel joined the config is a token one
        "split_merge": cfg.get("split_merge", "kernel"),  # likewise a merge-kernel one before split_merge
        "q_dtype": Q_DTYPE_SHORT.get(cfg.get("q_dtype"), cfg.get("q_dtype", "?")),
        # an entry written before kv_dtype joined the config is an fp8 one
        "kv_dtype": KV_DTYPE_SHORT.get(cfg.get("kv_dtype", "float8_e4m3fn"), cfg.get("kv_dtype", "?")),
        "dsl_version": fp.get("cutlass_dsl", "?"), "kernel_family": fp.get("kernel_family", "?"),
        "size": entry.size_bytes, "created": meta.get("created"), "last_used": last_used,
        "readonly": entry.readonly, "path": str(entry.path),
    }


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit cache ...`."""
    action = args.cache_command
    problem = check_output_path(getattr(args, "json", None))
    if problem:
        print(f"msa-jit cache {action}: --json {args.json}: {problem}", file=sys.stderr)
        return 2
    if args.cache_dir and not os.path.lexists(os.path.expanduser(args.cache_dir)):
        print(f"msa-jit cache {action}: --cache-dir {args.cache_dir} does not exist", file=sys.stderr)
        return 2
    c = open_cache(args.cache_dir, f"cache {action}", create=False)
    where = f"{c.root}" + ("" if c.exists else " (no cache there yet)")
    if action == "list":
        rows = [entry_row(e) for e in c.entries()]
        if args.json:
            emit_json(args.json, rows)
            return 0
        print(format_table(
            ["key", "geometry", "arch", "q", "kv", "CTAs/SM", "dsl", "size", "created", "last used"],
            [[r["key"][:12] + (" (ro)" if r["readonly"] else ""), r["geometry"], r["arch"], r["q_dtype"], r["kv_dtype"],
              f"{r['ctas_per_sm']}{build_suffix(r['kernel'], r['split_merge'])}", r["dsl_version"], human_size(r["size"]), when(r["created"]), when(r["last_used"])]
             for r in rows],
        ))
        print(f"{len(rows)} entries in {where}")
        return 0
    if action == "info":
        entries = c.entries()
        info = {
            "root": str(c.root), "exists": c.exists, "fallback_reason": c.fallback_reason, "ephemeral": c.ephemeral,
            "readonly_roots": [str(r) for r in c.readonly_roots], "entries": len(entries),
            "size_bytes": c.size_bytes(), "cap_bytes": env.cache_max_bytes(),
        }
        if args.json:
            emit_json(args.json, info)
            return 0
        print(f"root:           {where}{' (temporary, deleted at exit)' if c.ephemeral else ''}")
        print(f"fallback:       {info['fallback_reason'] or 'none (the configured root is used)'}")
        print(f"read-only roots: {', '.join(info['readonly_roots']) or 'none'}")
        print(f"entries:        {info['entries']}")
        print(f"total size:     {human_size(info['size_bytes'])} ({info['size_bytes']} bytes)")
        print(f"cap:            {human_size(info['cap_bytes'])} ({env.CACHE_MAX_BYTES})")
        return 0
    if action == "verify":
        results = c.verify(remove=args.remove)
        bad = [(e, why) for e, why in results if why]
        for e, why in bad:
            gone = " (removed)" if args.remove and not e.readonly else ""
            print(f"BAD {e.key[:12]} {e.path}: {why}{gone}")
        print(f"{len(results) - len(bad)} ok, {len(bad)} bad in {where}")
        return 1 if bad else 0
    if action == "prune":
        removed = c.prune(args.max_bytes)
        for p in removed:
            print(f"removed {p}")
        print(f"pruned {len(removed)} path(s); {human_size(c.size_bytes())} left in {where}")
        return 0
    if action == "clear":
        if not args.yes:
            print(f"msa-jit cache clear: refusing to delete every entry in {c.root} without --yes",
                  file=sys.stderr)
            return 2
        if c.root != c.requested_root:
            print(f"msa-jit cache clear: refusing: the configured cache {c.requested_root} is unusable and this "
                  f"run fell back to {c.root}, which may hold other configurations' kernels. To clear that "
                  f"one, name it: msa-jit cache clear --yes --cache-dir {c.root}", file=sys.stderr)
            return 2
        removed = c.clear()
        print(f"cleared {len(removed)} path(s) from {where}")
        return 0
    raise AssertionError(action)
