"""`msa-jit warmup`: compile (or find cached) kernels for a set of geometries, in parallel.

Geometries come from flags (`--heads 64/4 --q-dtype bf16,fp8 --arch sm_90a,sm_100a`) or a
preset (`--preset minimax-m3`). The parent process never imports the DSL compiler: it looks
every geometry up in the cache first and hands only the misses to spawn-context worker
processes, each of which calls `msa_jit.compiler.ensure_compiled` (the cache's per-entry lock
makes concurrent warmups of the same geometry build it once).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from . import compiler, env
from .geometry import SparseDecodeConfig, check_config

log = logging.getLogger("msa_jit")

# preset name -> (heads as (Hq, Hkv), q dtypes)
PRESETS: dict[str, tuple[tuple[tuple[int, int], ...], tuple[str, ...]]] = {
    "minimax-m3": (((64, 4), (32, 2), (16, 1), (8, 1)), ("bfloat16", "float8_e4m3fn")),
}
DEFAULT_ARCHES = ("sm_90a", "sm_100a")
Q_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn",
}
Q_DTYPE_SHORT = {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}
_HEADS_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


# ----------------------------------------------------------------------------- parsing
def _split(values: Iterable[str] | None) -> list[str]:
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


def local_gpu_arch() -> str | None:
    """Arch string of CUDA device 0, or None without a usable GPU (never raises)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        from .geometry import device_arch

        return device_arch(0)
    except Exception:
        return None


def default_arches() -> list[str]:
    """MSA_JIT_ARCH if set, else the local GPU's arch, else both sm_90a and sm_100a."""

    forced = env.target_arch()
    if forced:
        return [forced]
    local = local_gpu_arch()
    return [local] if local else list(DEFAULT_ARCHES)


def configs_from_args(args: argparse.Namespace) -> list[SparseDecodeConfig]:
    """The geometries named by --preset / --heads / --q-dtype / --arch / --page-size / --topk.

    Explicit --heads / --q-dtype replace the preset's. Raises ValueError on anything the
    kernel cannot serve (with check_config's reason).
    """
    heads: list[tuple[int, int]] = []
    dtypes: list[str] = []
    if getattr(args, "preset", None):
        heads, dtypes = (list(x) for x in PRESETS[args.preset])
    if _split(args.heads):
        heads = [parse_heads(h) for h in _split(args.heads)]
    if _split(args.q_dtype):
        dtypes = [parse_q_dtype(q) for q in _split(args.q_dtype)]
    if not heads:
        raise ValueError("no geometry: give --heads Hq/Hkv (repeatable) or --preset " + "|".join(PRESETS))
    if not dtypes:
        dtypes = ["bfloat16", "float8_e4m3fn"]
    arches = [normalize_arch(a) for a in _split(args.arch)] or default_arches()
    out: list[SparseDecodeConfig] = []
    for hq, hkv in heads:
        for q in dtypes:
            for arch in arches:
                cfg = SparseDecodeConfig(hq, hkv, page_size=args.page_size, topk=args.topk, q_dtype=q, arch=arch)
                reason = check_config(cfg)
                if reason:
                    raise ValueError(f"{hq}/{hkv} {Q_DTYPE_SHORT.get(q, q)} {arch}: {reason}")
                # every occupancy the planner may pick for a step shape (compiler imports no DSL)
                out.extend(c for c in compiler.plannable_configs(cfg) if c not in out)
    return out


def add_geometry_arguments(p: argparse.ArgumentParser) -> None:
    """Geometry-selection flags shared by `warmup` and `inspect`."""
    p.add_argument("--preset", choices=sorted(PRESETS), help="named set of geometries (minimax-m3: 64/4 32/2 16/1 8/1 x bf16,fp8)")
    p.add_argument("--heads", action="append", metavar="HQ/HKV", help="query/KV heads, repeatable or comma-separated (e.g. 64/4)")
    p.add_argument("--q-dtype", action="append", metavar="DTYPES", help="bf16,fp8 (default: both)")
    p.add_argument("--arch", action="append", metavar="ARCHES",
                   help="sm_90a,sm_100a (default: $MSA_JIT_ARCH, else this GPU's arch, else both)")
    p.add_argument("--page-size", type=int, default=128, help="KV page size (default 128)")
    p.add_argument("--topk", type=int, default=16, help="top-k blocks per token (default 16)")
    p.add_argument("--cache-dir", help="cache root for this run (sets MSA_JIT_CACHE_DIR for the workers)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile processes (default min(4, CPUs))")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")


# ----------------------------------------------------------------------------- results
@dataclass
class WarmupRow:
    """Outcome for one geometry."""

    config: SparseDecodeConfig
    status: str = "pending"  # compiled | cached | failed
    seconds: float = 0.0
    artifact: str | None = None
    key: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def geometry(self) -> str:
        c = self.config
        g = f"{c.num_q_heads}/{c.num_kv_heads}"
        if c.page_size != 128 or c.topk != 16:
            g += f" page{c.page_size} top{c.topk}"
        return g

    @property
    def q(self) -> str:
        return Q_DTYPE_SHORT.get(self.config.q_dtype, self.config.q_dtype)

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "geometry": self.geometry, "num_q_heads": c.num_q_heads, "num_kv_heads": c.num_kv_heads,
            "page_size": c.page_size, "topk": c.topk, "q_dtype": c.q_dtype, "arch": c.arch,
            "ctas_per_sm": c.ctas_per_sm, "status": self.status, "seconds": round(self.seconds, 3), "artifact": self.artifact,
            "key": self.key, "error": self.error,
        }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain left-aligned text table."""
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- workers
def _worker_init(cache_dir: str | None) -> None:
    if cache_dir:
        os.environ["MSA_JIT_CACHE_DIR"] = cache_dir
    from .cli import configure_logging

    configure_logging()


def compile_one(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Worker: ensure_compiled(cfg) -> {status, seconds, artifact, key, error} (never raises)."""
    t0 = time.perf_counter()
    try:
        from . import compiler

        cfg = SparseDecodeConfig(**cfg_dict)
        entry, built = compiler.ensure_compiled(cfg)
        return {"status": "compiled" if built else "cached", "seconds": time.perf_counter() - t0,
                "artifact": str(entry.artifact_path()), "key": entry.key, "error": None,
                "extra": dict(entry.meta.get("extra") or {})}
    except BaseException as e:  # report, never kill the pool
        return {"status": "failed", "seconds": time.perf_counter() - t0, "artifact": None, "key": None,
                "error": f"{type(e).__name__}: {e}", "extra": {}}


def _open_cache(cache_dir: str | None):
    from . import cache as _cache

    return _cache.ArtifactCache(cache_dir) if cache_dir else _cache.default_cache()


def _lookup_cached(rows: list[WarmupRow], cache_dir: str | None) -> None:
    """Mark rows already in the cache as cached (no compiler import, no worker)."""
    from . import compiler

    try:
        c = _open_cache(cache_dir)
    except Exception as e:
        log.warning("msa-jit warmup: cannot open the cache for a quick lookup: %s", e)
        return
    for row in rows:
        t0 = time.perf_counter()
        try:
            key = compiler.cache_key(row.config)
            entry = c.lookup(key)
        except Exception as e:
            log.debug("msa-jit warmup: lookup of %s failed: %s", row.geometry, e)
            continue
        if entry is not None:
            row.status, row.key = "cached", key
            row.artifact = str(entry.artifact_path())
            row.seconds = time.perf_counter() - t0


def _progress(total: int, quiet: bool) -> tuple[Callable[[WarmupRow], None], Callable[[], None]]:
    """(advance, close): a tqdm bar on a TTY, else one line per finished item (nothing if quiet)."""
    done = [0]
    bar = None
    if not quiet and sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, file=sys.stderr, unit="kernel", desc="msa-jit warmup")
        except ImportError:
            bar = None

    def advance(row: WarmupRow) -> None:
        done[0] += 1
        if quiet:
            return
        if bar is not None:
            bar.set_postfix_str(f"{row.geometry} {row.q} {row.config.arch} {row.config.ctas_per_sm}/SM {row.status}")
            bar.update(1)
        else:
            print(f"[{done[0]}/{total}] {row.geometry} {row.q} {row.config.arch} {row.config.ctas_per_sm}/SM: {row.status} "
                  f"({row.seconds:.1f}s)", file=sys.stderr, flush=True)

    def close() -> None:
        if bar is not None:
            bar.close()

    return advance, close


def run_warmup(
    configs: Sequence[SparseDecodeConfig], *, jobs: int | None = None, cache_dir: str | None = None,
    quiet: bool = False,
) -> list[WarmupRow]:
    """Ensure every config is compiled; returns one row per config (in the given order)."""
    rows = [WarmupRow(c) for c in configs]
    if cache_dir:
        cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
    advance, close = _progress(len(rows), quiet)
    try:
        _lookup_cached(rows, cache_dir)
        for row in rows:
            if row.status == "cached":
                advance(row)
        todo = [r for r in rows if r.status == "pending"]
        if todo:
            import multiprocessing

            n = max(1, min(jobs or min(4, os.cpu_count() or 1), len(todo)))
            ctx = multiprocessing.get_context("spawn")
            try:
                with ProcessPoolExecutor(n, mp_context=ctx, initializer=_worker_init, initargs=(cache_dir,)) as pool:
                    futures = {pool.submit(compile_one, r.config.to_dict()): r for r in todo}
                    for fut in as_completed(futures):
                        row = futures[fut]
                        try:
                            res = fut.result()
                        except BaseException as e:  # a worker died (e.g. killed)
                            res = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
                        row.status = res.get("status", "failed")
                        row.seconds = float(res.get("seconds") or 0.0)
                        row.artifact, row.key = res.get("artifact"), res.get("key")
                        row.error, row.extra = res.get("error"), res.get("extra") or {}
                        advance(row)
            except (BrokenProcessPool, OSError, RuntimeError) as e:  # could not start / lost the pool
                for row in todo:
                    if row.status == "pending":
                        row.status, row.error = "failed", f"worker pool failed: {type(e).__name__}: {e}"
                        advance(row)
    finally:
        close()
    return rows


def summary(rows: Sequence[WarmupRow]) -> dict[str, int]:
    """Counts of compiled / cached / failed rows."""
    return {s: sum(r.status == s for r in rows) for s in ("compiled", "cached", "failed")}


def render(rows: Sequence[WarmupRow]) -> str:
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
    s = summary(rows)
    parts.append(f"{s['compiled']} compiled, {s['cached']} cached, {s['failed']} failed")
    return "\n".join(parts)


def write_json(path: str | os.PathLike, rows: Sequence[WarmupRow], **extra: Any) -> None:
    """Write {"rows": [...], "compiled", "cached", "failed", ...extra} to path."""
    doc = {"rows": [r.to_json() for r in rows], **summary(rows), **extra}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def cmd_warmup(args: argparse.Namespace) -> int:
    """CLI handler of `msa-jit warmup`."""
    try:
        configs = configs_from_args(args)
    except ValueError as e:
        print(f"msa-jit warmup: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = run_warmup(configs, jobs=args.jobs, cache_dir=args.cache_dir, quiet=args.quiet)
    print(render(rows))
    if args.json:
        write_json(args.json, rows, wall_seconds=round(time.perf_counter() - t0, 3))
    return 1 if summary(rows)["failed"] else 0
