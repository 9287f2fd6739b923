"""The `msa-jit` command: warmup | cache | doctor | inspect | bench."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

_HANDLER_FLAG = "_msa_jit_cli_handler"


def configure_logging() -> None:
    """Send the "msa_jit" loggers to stderr at MSA_JIT_LOG_LEVEL (a bad value: warning + WARNING)."""
    from . import env

    try:
        level = env.log_level()
        problem = None
    except ValueError as e:
        level, problem = logging.WARNING, str(e)
    logger = logging.getLogger("msa_jit")
    for h in list(logger.handlers):
        if getattr(h, _HANDLER_FLAG, False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    setattr(handler, _HANDLER_FLAG, True)
    logger.addHandler(handler)
    logger.setLevel(level)
    if problem:
        logger.warning("%s (using WARNING)", problem)


# ----------------------------------------------------------------------------- helpers
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'1048576', '512M', '2G', '2GiB' -> bytes (binary suffixes, like MSA_JIT_CACHE_MAX_BYTES)."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 2147483648, 512M, 2G)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def human_size(n: int | float) -> str:
    """1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _when(ts: float | None) -> str:
    return "-" if not ts else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def open_cache(cache_dir: str | None):
    """ArtifactCache at --cache-dir, else the default one."""
    from . import cache

    return cache.ArtifactCache(cache_dir) if cache_dir else cache.default_cache()


# ----------------------------------------------------------------------------- cache
def entry_row(entry: Any) -> dict[str, Any]:
    """One `cache list` row from a CacheEntry's meta.json."""
    from .warmup import Q_DTYPE_SHORT

    meta = entry.meta or {}
    cfg = meta.get("config") or {}
    fp = meta.get("fingerprint") or {}
    geometry = f"{cfg.get('num_q_heads', '?')}/{cfg.get('num_kv_heads', '?')}"
    if cfg.get("page_size", 128) != 128 or cfg.get("topk", 16) != 16:
        geometry += f" page{cfg.get('page_size')} top{cfg.get('topk')}"
    try:
        last_used = (entry.path / "meta.json").stat().st_mtime
    except OSError:
        last_used = None
    return {
        "key": entry.key, "geometry": geometry, "arch": cfg.get("arch", "?"), "ctas_per_sm": cfg.get("ctas_per_sm", "?"),
        "q_dtype": Q_DTYPE_SHORT.get(cfg.get("q_dtype"), cfg.get("q_dtype", "?")),
        "dsl_version": fp.get("cutlass_dsl", "?"), "kernel_family": fp.get("kernel_family", "?"),
        "size": entry.size_bytes, "created": meta.get("created"), "last_used": last_used,
        "readonly": entry.readonly, "path": str(entry.path),
    }


def _cmd_cache(args: argparse.Namespace) -> int:
    from . import env
    from .warmup import format_table

    c = open_cache(args.cache_dir)
    action = args.cache_command
    if action == "list":
        rows = [entry_row(e) for e in c.entries()]
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        print(format_table(
            ["key", "geometry", "arch", "q dtype", "CTAs/SM", "dsl", "size", "created", "last used"],
            [[r["key"][:12] + (" (ro)" if r["readonly"] else ""), r["geometry"], r["arch"], r["q_dtype"], r["ctas_per_sm"],
              r["dsl_version"], human_size(r["size"]), _when(r["created"]), _when(r["last_used"])] for r in rows],
        ))
        print(f"{len(rows)} entries in {c.root}")
        return 0
    if action == "info":
        entries = c.entries()
        info = {
            "root": str(c.root), "fallback_reason": c.fallback_reason, "ephemeral": c.ephemeral,
            "readonly_roots": [str(r) for r in c.readonly_roots], "entries": len(entries),
            "size_bytes": c.size_bytes(), "cap_bytes": env.cache_max_bytes(),
        }
        if args.json:
            print(json.dumps(info, indent=1))
            return 0
        print(f"root:           {info['root']}{' (temporary, deleted at exit)' if c.ephemeral else ''}")
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
        print(f"{len(results) - len(bad)} ok, {len(bad)} bad")
        return 1 if bad else 0
    if action == "prune":
        removed = c.prune(args.max_bytes)
        for p in removed:
            print(f"removed {p}")
        print(f"pruned {len(removed)} path(s); {human_size(c.size_bytes())} left in {c.root}")
        return 0
    if action == "clear":
        if not args.yes:
            print(f"msa-jit cache clear: refusing to delete every entry in {c.root} without --yes",
                  file=sys.stderr)
            return 2
        removed = c.clear()
        print(f"cleared {len(removed)} path(s) from {c.root}")
        return 0
    raise AssertionError(action)


# ----------------------------------------------------------------------------- inspect
def short_kernel_name(name: str) -> str:
    """The kernels module of a DSL kernel symbol: 'kernel_cutlass_kernel_msa_jitkernelssplit_merge
    SplitMergeKernel_object_at_...' -> 'split_merge' (a method other than `kernel` is appended)."""
    m = re.match(r"kernel_cutlass_(\w+?)_msa_jitkernels([a-z0-9_]+?)[A-Z]\w*?_object_at", name)
    if m:
        return m.group(2) if m.group(1) == "kernel" else f"{m.group(2)}.{m.group(1)}"
    return name if len(name) <= 40 else name[:37] + "..."


def _cmd_inspect(args: argparse.Namespace) -> int:
    from . import compiler, sass, warmup

    try:
        configs = warmup.configs_from_args(args)
    except ValueError as e:
        print(f"msa-jit inspect: {e}", file=sys.stderr)
        return 2
    rows = warmup.run_warmup(configs, jobs=args.jobs, cache_dir=args.cache_dir, quiet=args.quiet)
    out: list[dict[str, Any]] = []
    failed = False
    for r in rows:
        base = {"geometry": r.geometry, "q_dtype": r.q, "arch": r.config.arch, "ctas_per_sm": r.config.ctas_per_sm,
                "accepted_local_ops": compiler.accepted_local_ops(r.config), "artifact": r.artifact}
        if r.status == "failed" or not r.artifact:
            out.append({**base, "error": r.error})
            failed = True
            continue
        try:
            for k in sass.summarize(r.artifact):
                out.append({**base, **k})
        except Exception as e:
            out.append({**base, "error": f"{type(e).__name__}: {e}"})
            failed = True
    print(warmup.format_table(
        ["geometry", "q", "arch", "CTAs/SM", "kernel", "sm", "regs", "smem", "LDL/STL", "MMA"],
        [[o["geometry"], o["q_dtype"], o["arch"], o["ctas_per_sm"], short_kernel_name(o["kernel"]), o["sm"],
          o["registers"], o["static_smem"],
          f"{o['local_ops']}" + (f" (<= {o['accepted_local_ops']} accepted)" if o["accepted_local_ops"] else ""),
          " ".join(f"{k}:{v}" for k, v in sorted(o["mma_ops"].items())) or "-"]
         if "kernel" in o else [o["geometry"], o["q_dtype"], o["arch"], o["ctas_per_sm"], "ERROR", "", "", "", "",
                                o["error"]]
         for o in out],
    ))
    # a known local-memory use of a build (compiler.accepted_local_ops) is not a spill; more is
    spills = [o for o in out if o.get("local_ops", 0) > o["accepted_local_ops"]]
    for o in spills:
        print(f"SPILL {o['geometry']} {o['q_dtype']} {o['arch']} {o['ctas_per_sm']}/SM {o['kernel']}: "
              f"{o['local_ops']} LDL/STL (accepted: {o['accepted_local_ops']})")
    print(f"{len(out)} kernel(s), {len(spills)} with local-memory ops beyond the accepted{', errors above' if failed else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps({"kernels": out}, indent=1) + "\n", encoding="utf-8")
    return 1 if spills or failed else 0


def _cmd_warmup(args: argparse.Namespace) -> int:
    from .warmup import cmd_warmup

    return cmd_warmup(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import cmd_doctor

    return cmd_doctor(args)


def _cmd_selftest(args: argparse.Namespace) -> int:
    from . import selftest

    return selftest.main(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    if args.table:  # no GPU: print the README table of a result file
        print(bench.readme_table(json.loads(Path(args.table).read_text())))
        return 0
    geos = tuple(args.geometries.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    qlens = tuple(int(q) for q in args.qlens.split(","))
    result = bench.main(args.out, geometries=geos, batches=batches, qlens=qlens, q_dtype=args.q_dtype,
                        iters=args.iters, baseline=args.baseline)
    return 1 if result.get("regressions") else 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every subcommand."""
    from .warmup import add_geometry_arguments

    p = argparse.ArgumentParser(prog="msa-jit", description="JIT-compiled MSA sparse decode kernels")
    sub = p.add_subparsers(dest="command", required=True)

    w = sub.add_parser("warmup", help="compile kernels for geometries into the cache (no GPU needed)")
    add_geometry_arguments(w)
    w.add_argument("--json", metavar="FILE", help="write the result rows as JSON")
    w.set_defaults(func=_cmd_warmup)

    c = sub.add_parser("cache", help="list / inspect / verify / prune / clear the artifact cache")
    csub = c.add_subparsers(dest="cache_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", help="cache root (default: MSA_JIT_CACHE_DIR / XDG / ~/.cache/msa-jit)")
    cl = csub.add_parser("list", parents=[common], help="one row per entry")
    cl.add_argument("--json", action="store_true")
    ci = csub.add_parser("info", parents=[common], help="root, fallback, size, cap")
    ci.add_argument("--json", action="store_true")
    cv = csub.add_parser("verify", parents=[common], help="hash-check every entry (exit 1 if any is bad)")
    cv.add_argument("--remove", action="store_true", help="delete bad entries")
    cp = csub.add_parser("prune", parents=[common], help="drop garbage, then LRU entries down to a size")
    cp.add_argument("--max-bytes", type=parse_size, default=None, help="size cap (default MSA_JIT_CACHE_MAX_BYTES)")
    cc = csub.add_parser("clear", parents=[common], help="delete every entry (needs --yes)")
    cc.add_argument("--yes", action="store_true", help="really delete")
    c.set_defaults(func=_cmd_cache)

    d = sub.add_parser("doctor", help="GPU, driver, versions, compiler/runtime, cache, env, readiness")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--cache-dir", help="cache root to report on")
    d.set_defaults(func=_cmd_doctor)

    i = sub.add_parser("inspect", help="compile (if needed) and summarize SASS: registers, smem, spills, MMA")
    add_geometry_arguments(i)
    i.add_argument("--json", metavar="FILE", help="write the per-kernel rows as JSON")
    i.set_defaults(func=_cmd_inspect)

    b = sub.add_parser("bench", help="benchmark grid on this GPU: JSON + PNG (needs CUDA)")
    b.add_argument("--out", default="bench/results", help="folder for bench-<date>.json/.png")
    b.add_argument("--geometries", default="64/4,16/1,8/1")
    b.add_argument("--batches", default="1,4,16,64,256")
    b.add_argument("--qlens", default="1,4")
    b.add_argument("--q-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    b.add_argument("--iters", type=int, default=50)
    b.add_argument("--baseline", default="auto",
                   help="result JSON to compare with (default: the newest in --out; 'none' to skip); "
                        "exit 1 if a point is >5%% slower")
    b.add_argument("--table", metavar="RESULT_JSON",
                   help="print the README's markdown table of a result file and exit (no GPU)")
    b.set_defaults(func=_cmd_bench)

    t = sub.add_parser("selftest", help="hardware check of this GPU: correctness on the full grid, then bench")
    t.add_argument("--arch", default=None, help="expected arch of this GPU (e.g. sm_100a); refuse if it differs")
    t.add_argument("--quick", action="store_true", help="a subset of the grid (qlen 1/4, batch 1/16)")
    t.add_argument("--no-bench", action="store_true", help="stop after the correctness grid")
    t.add_argument("--out", default="bench/results", help="folder for the bench JSON/PNG")
    t.add_argument("--iters", type=int, default=50)
    t.set_defaults(func=_cmd_selftest)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `msa-jit` / `python -m msa_jit`; returns the exit status."""
    args = build_parser().parse_args(argv)
    configure_logging()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
