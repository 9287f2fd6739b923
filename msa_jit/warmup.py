"""Compile (or find cached) kernels for a set of geometries, in parallel (`msa-jit warmup`'s library).

`warmup_configs(...)` expands head layouts x query dtypes x archs into every config the
planner may pick (`compiler.plannable_configs`); `run_warmup(configs)` ensures each is in the
cache. The parent process never imports the DSL compiler: it looks every config up in the
cache first and hands only the misses to spawn-context worker processes, each of which calls
`msa_jit.compiler.ensure_compiled` (the cache's per-entry lock makes concurrent warmups of
the same geometry build it once).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from . import cache, compiler, env
from .geometry import (
    DEFAULT_ARCHES, DEFAULT_PAGE_SIZE, DEFAULT_TOPK_BLOCKS, KV_DTYPE_SHORT, KV_DTYPES, MINIMAX_M3_GEOMETRIES,
    Q_DTYPE_SHORT, Q_DTYPES, SparseDecodeConfig, check_config,
)

log = logging.getLogger("msa_jit")

# preset name -> (heads as (Hq, Hkv), q dtypes, KV cache formats)
PRESETS: dict[str, tuple[tuple[tuple[int, int], ...], tuple[str, ...], tuple[str, ...]]] = {
    "minimax-m3": (MINIMAX_M3_GEOMETRIES, Q_DTYPES, KV_DTYPES),
}
# the KV cache format of a warmup that names none (SparseDecodeConfig's default, fp8)
DEFAULT_KV_DTYPES = ("float8_e4m3fn",)


# ----------------------------------------------------------------------------- configs
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
    """MSA_JIT_ARCH if set, else the local GPU's arch, else DEFAULT_ARCHES (sm_90a and sm_100a)."""
    forced = env.target_arch()
    if forced:
        return [forced]
    local = local_gpu_arch()
    return [local] if local else list(DEFAULT_ARCHES)


def warmup_configs(
    heads: Iterable[tuple[int, int]], q_dtypes: Iterable[str], arches: Iterable[str], *,
    kv_dtypes: Iterable[str] = DEFAULT_KV_DTYPES,
    page_size: int = DEFAULT_PAGE_SIZE, topk_blocks: int = DEFAULT_TOPK_BLOCKS,
) -> list[SparseDecodeConfig]:
    """Every config a warmup of these (Hq, Hkv) layouts x query dtypes x KV cache formats x archs builds.

    Dtypes are SparseDecodeConfig names ("bfloat16", "float8_e4m3fn"; kv "float8_e4m3fn",
    "nvfp4"). Each geometry at every occupancy the planner may pick for its arch
    (`compiler.plannable_configs`), without duplicates, in the given order. Raises ValueError
    on anything the kernel cannot serve (with check_config's reason).
    """
    out: list[SparseDecodeConfig] = []
    q_dtypes, kv_dtypes, arches = list(q_dtypes), list(kv_dtypes), list(arches)
    for hq, hkv in heads:
        for q in q_dtypes:
            for kv in kv_dtypes:
                for arch in arches:
                    cfg = SparseDecodeConfig(hq, hkv, page_size=page_size, topk_blocks=topk_blocks, q_dtype=q,
                                             kv_dtype=kv, arch=arch)
                    reason = check_config(cfg)
                    if reason:
                        raise ValueError(f"{hq}/{hkv} q {Q_DTYPE_SHORT.get(q, q)} kv {KV_DTYPE_SHORT.get(kv, kv)} "
                                         f"{arch}: {reason}")
                    # every occupancy the planner may pick for a step shape (compiler imports no DSL)
                    out.extend(c for c in compiler.plannable_configs(cfg) if c not in out)
    return out


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
        if c.page_size != DEFAULT_PAGE_SIZE or c.topk_blocks != DEFAULT_TOPK_BLOCKS:
            g += f" page{c.page_size} top{c.topk_blocks}"
        return g

    @property
    def q(self) -> str:
        """Short name of the query dtype ("bf16", "fp8")."""
        return Q_DTYPE_SHORT.get(self.config.q_dtype, self.config.q_dtype)

    @property
    def kv(self) -> str:
        """Short name of the KV cache format ("fp8", "nvfp4")."""
        return KV_DTYPE_SHORT.get(self.config.kv_dtype, self.config.kv_dtype)

    @property
    def label(self) -> str:
        """'8/1 q bf16 kv fp8 sm_90a 2/SM': the row in progress lines and failure messages."""
        c = self.config
        return f"{self.geometry} q {self.q} kv {self.kv} {c.arch} {c.ctas_per_sm}/SM"

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "geometry": self.geometry, "num_q_heads": c.num_q_heads, "num_kv_heads": c.num_kv_heads,
            "page_size": c.page_size, "topk_blocks": c.topk_blocks, "q_dtype": c.q_dtype,
            "kv_dtype": c.kv_dtype, "arch": c.arch,
            "ctas_per_sm": c.ctas_per_sm, "status": self.status, "seconds": round(self.seconds, 3), "artifact": self.artifact,
            "key": self.key, "error": self.error,
        }


# ----------------------------------------------------------------------------- workers
def _worker_init(cache_dir: str | None) -> None:
    if cache_dir:
        os.environ[env.CACHE_DIR] = cache_dir
    from .logs import configure_logging

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
                "error": plain_text(f"{type(e).__name__}: {e}"), "extra": {}}


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def plain_text(text: str) -> str:
    """`text` without terminal escape sequences (the DSL colours its errors), for tables and files."""
    return _ANSI.sub("", text)


def _lookup_cached(rows: list[WarmupRow], cache_dir: str | None) -> None:
    """Mark rows already in the cache as cached (no compiler import, no worker)."""
    from . import compiler

    try:
        c = cache.open_cache(cache_dir)
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
            bar.set_postfix_str(f"{row.label} {row.status}")
            bar.update(1)
        else:
            print(f"[{done[0]}/{total}] {row.label}: {row.status} ({row.seconds:.1f}s)", file=sys.stderr, flush=True)

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


def json_document(rows: Sequence[WarmupRow], **extra: Any) -> dict[str, Any]:
    """{"rows": [...], "compiled", "cached", "failed", ...extra}: what `msa-jit warmup --json` writes."""
    return {"rows": [r.to_json() for r in rows], **summary(rows), **extra}
