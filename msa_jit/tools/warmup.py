"""Compile (or find cached) kernels for a set of geometries, in parallel (`msa-jit warmup`'s library).

`warmup_configs(...)` expands head layouts x query dtypes x archs into every config the
planner may pick (`registry.plannable_configs`); `run_warmup(configs)` ensures each is in the
cache. The parent process never imports the DSL compiler: it resolves the cache root once,
looks every config up there and hands only the misses to spawn-context worker processes,
which open exactly that root and call `msa_jit.jit.compiler.ensure_compiled` (the cache's
per-entry lock makes concurrent warmups of the same geometry build it once). The workers
protect the warm-up's working set from the automatic prune, die with the parent however it
dies, and ignore Ctrl-C: the parent cancels the queue, ends them and raises
WarmupInterrupted (docs/cache.md §11).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..jit import cache, compiler, registry
from .. import env
from ..jit.cache.entry import tree_size
from ..geometry import (DEFAULT_ARCHES, DEFAULT_PAGE_SIZE, DEFAULT_TOPK_BLOCKS, KV_DTYPE_SHORT, KV_DTYPES, MINIMAX_M3_GEOMETRIES, Q_DTYPE_SHORT, Q_DTYPES, SparseDecodeConfig, build_suffix, check_config)

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
        from ..geometry import device_arch

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
    (`registry.plannable_configs`), without duplicates, in the given order. Raises ValueError
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
                    out.extend(c for c in registry.plannable_configs(cfg) if c not in out)
    return out


# ----------------------------------------------------------------------------- results
@dataclass
class WarmupRow:
    """Outcome for one geometry."""

    config: SparseDecodeConfig
    status: str = "pending"  # compiled | cached | failed; after Ctrl-C also interrupted | cancelled
    seconds: float = 0.0
    artifact: str | None = None
    key: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # the parent's lookup found (and removed) a corrupt entry of this key: the worker's
    # ArtifactMissingError (MSA_JIT_NO_COMPILE=1) must name it, not read like a plain miss
    corrupt: tuple[str, ...] = ()

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
        """'8/1 q bf16 kv fp8 sm_90a 2/SM' (' union' after a union build, ' cluster merge' after one
        that merges its splits in a cluster): the row in progress lines and failure messages."""
        c = self.config
        return f"{self.geometry} q {self.q} kv {self.kv} {c.arch} {c.ctas_per_sm}/SM" + build_suffix(c.kernel, c.split_merge)

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "geometry": self.geometry, "num_q_heads": c.num_q_heads, "num_kv_heads": c.num_kv_heads,
            "page_size": c.page_size, "topk_blocks": c.topk_blocks, "q_dtype": c.q_dtype,
            "kv_dtype": c.kv_dtype, "arch": c.arch,
            "ctas_per_sm": c.ctas_per_sm, "kernel": c.kernel, "split_merge": c.split_merge, "status": self.status, "seconds": round(self.seconds, 3), "artifact": self.artifact,
            "key": self.key, "error": self.error,
        }


# ----------------------------------------------------------------------------- workers
# Each worker is a spawned process fed one build at a time over its own pipe: nothing is ever
# queued inside a worker, so cancelling the queue is "send no more", and ending the warm-up
# is ending the workers (docs/cache.md §11).
STOP_GRACE_S = 2.0  # how long a stopped worker may take to delete its build dir before SIGKILL
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WarmupInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped `run_warmup`: the queued builds were cancelled and the workers
    ended. `rows` as far as they got: compiled / cached / failed (finished; kept in the cache),
    interrupted (were building), cancelled (never started)."""

    def __init__(self, rows: list[WarmupRow]) -> None:
        super().__init__("msa-jit warmup interrupted")
        self.rows = rows


def _die_with_parent() -> None:
    """End this worker when the warm-up's parent dies, however it dies (even SIGKILL): on Linux
    the kernel sends SIGKILL (PR_SET_PDEATHSIG); everywhere a watchdog thread waits on the
    spawn sentinel, a pipe the parent holds open for as long as it lives."""
    parent = multiprocessing.parent_process()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)  # the build lock is an flock: it goes with the process

    threading.Thread(target=watch, name="msa-jit-parent-watchdog", daemon=True).start()
    if os.getppid() != parent.pid:  # the parent died before the prctl took effect
        os._exit(1)


_terminating = False  # this worker got SIGTERM: it exits, whatever the build does with the exception


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    global _terminating
    _terminating = True
    raise SystemExit(128 + signum)  # unwinds the build: its temp dir is deleted, its lock released


def _exit_quietly(code: int) -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    # skip the interpreter's teardown: over a second with torch imported, past the
    # parent's grace period (STOP_GRACE_S) on a small machine
    os._exit(code)


def _unraisable(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """sys.unraisablehook of a worker: SIGTERM's SystemExit raised where it cannot propagate (a
    __del__, a callback of the compiler's C++) ends the worker at once, instead of being printed
    as an ignored exception while the build goes on; anything else as before."""
    def unraisable(u: Any) -> None:
        if _terminating and issubclass(u.exc_type, SystemExit):
            _exit_quietly(u.exc_value.code if isinstance(getattr(u.exc_value, "code", None), int) else 143)
        hook(u)

    return unraisable


def _worker_main(conn: Any, root: str, readonly_roots: tuple[str, ...], protect: tuple[str, ...]) -> None:
    """A compile worker: open exactly the parent's cache root, then build each config the
    parent sends (a job: {"config": dict, "corrupt": [...]}; None: exit), answering with
    `compile_one`'s result."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    sys.unraisablehook = _unraisable(sys.unraisablehook)
    try:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        from ..logs import configure_logging

        configure_logging()
        _serve(conn, root, readonly_roots, protect)
    except SystemExit as e:  # SIGTERM: the build has unwound (temp dir deleted, lock released)
        _exit_quietly(e.code if isinstance(e.code, int) else 1)


def _serve(conn: Any, root: str, readonly_roots: tuple[str, ...], protect: tuple[str, ...]) -> None:
    problem = None
    try:
        c = cache.ArtifactCache(root, fallback=False, readonly_roots=readonly_roots)
        c.protect(protect)
    except Exception as e:
        c, problem = None, f"{type(e).__name__}: {e}"
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if job is None:
            return
        res = (compile_one(job["config"], c, corrupt=job.get("corrupt", ())) if c is not None
               else _failed(problem, 0.0))
        try:
            conn.send(res)
        except OSError:
            return


def _failed(error: str | None, seconds: float) -> dict[str, Any]:
    return {"status": "failed", "seconds": seconds, "artifact": None, "key": None, "error": error, "extra": {}}


def compile_one(cfg_dict: dict[str, Any], c: cache.ArtifactCache | None = None,
                corrupt: Sequence[str] = ()) -> dict[str, Any]:
    """Worker: ensure_compiled(cfg) in cache `c` (default: the default cache) ->
    {status, seconds, artifact, key, error, extra}; an error is reported, not raised.
    `corrupt`: what the parent's lookup found corrupt for this key (and removed), named in an
    ArtifactMissingError that would otherwise read like a plain miss."""
    t0 = time.perf_counter()
    try:
        from ..jit import compiler

        cfg = SparseDecodeConfig(**cfg_dict)
        entry, built = compiler.ensure_compiled(cfg, cache=c)
        return {"status": "compiled" if built else "cached", "seconds": time.perf_counter() - t0,
                "artifact": str(entry.artifact_path()), "key": entry.key, "error": None,
                "extra": dict(entry.meta.get("extra") or {})}
    except cache.ArtifactMissingError as e:
        if corrupt and not e.corrupt:
            e = cache.ArtifactMissingError(e.describe, e.key, e.roots, e.warmup_hint, corrupt=corrupt, near=e.near)
        return _failed(plain_text(f"{type(e).__name__}: {e}"), time.perf_counter() - t0)
    except Exception as e:  # report, keep the worker; SIGTERM's SystemExit ends it
        if _terminating:  # SIGTERM's SystemExit, caught and wrapped by the compiler: end the worker still
            raise SystemExit(143) from None
        return _failed(plain_text(f"{type(e).__name__}: {e}"), time.perf_counter() - t0)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def plain_text(text: str) -> str:
    """`text` without terminal escape sequences (the DSL colours its errors), for tables and files."""
    return _ANSI.sub("", text)


@contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Block SIGINT while a worker is spawned: the child inherits the mask, so a Ctrl-C that
    lands before it ignores SIGINT cannot kill it mid-import (with a traceback); the parent
    gets the signal as soon as the mask is restored."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclass
class _Worker:
    proc: Any
    conn: Any
    row: WarmupRow | None = None


class _Pool:
    """The warm-up's worker processes (spawn context, one build in flight each)."""

    def __init__(self, c: cache.ArtifactCache, protect: Sequence[str]) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._args = (str(c.root), tuple(str(r) for r in c.readonly_roots), tuple(protect))
        self.workers: list[_Worker] = []
        self.hurry = False

    def start(self) -> _Worker:
        # spawn's Popen starts multiprocessing's resource tracker on first use, and unblocks SIGINT
        # once it has: started here, before the block, so every worker starts with SIGINT blocked
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        parent_end, child_end = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child_end, *self._args), daemon=True,
                                 name=f"msa-jit-warmup-{len(self.workers)}")
        with _sigint_blocked():
            proc.start()
        child_end.close()
        w = _Worker(proc, parent_end)
        self.workers.append(w)
        return w

    def give(self, w: _Worker, row: WarmupRow) -> None:
        w.row = row
        try:
            w.conn.send({"config": row.config.to_dict(), "corrupt": list(row.corrupt)})
        except OSError:
            pass  # the worker died: `wait` sees its sentinel and fails this row

    def busy(self) -> list[_Worker]:
        return [w for w in self.workers if w.row is not None]

    def wait(self) -> list[tuple[_Worker, dict[str, Any]]]:
        """Block until a busy worker answers or dies: [(worker, result)] of those that did."""
        busy = self.busy()
        mp_connection.wait([w.conn for w in busy] + [w.proc.sentinel for w in busy])
        done = []
        for w in busy:
            res = None
            try:
                if w.conn.poll():
                    res = w.conn.recv()
            except (EOFError, OSError):
                pass
            if res is None and not w.proc.is_alive():
                w.proc.join()
                res = _failed(f"the worker process died ({_exit_text(w.proc.exitcode)}) while building this kernel", 0.0)
                self.workers.remove(w)
            if res is not None:
                done.append((w, res))
        return done

    def stop(self, graceful: bool) -> None:
        """End every worker: graceful, tell idle workers to exit; otherwise SIGTERM, then after
        STOP_GRACE_S (or at once once `hurry` is set: another Ctrl-C) SIGKILL."""
        for w in self.workers:
            try:
                if graceful:
                    w.conn.send(None)
                else:
                    w.proc.terminate()
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (10.0 if graceful else STOP_GRACE_S)
        for w in self.workers:
            while w.proc.is_alive() and not self.hurry and time.monotonic() < deadline:
                w.proc.join(0.05)
        for w in self.workers:
            if w.proc.is_alive():
                w.proc.kill()
        for w in self.workers:
            w.proc.join(5.0)
            w.conn.close()
        self.workers = []


@contextmanager
def _further_sigints(pool: _Pool | None) -> Iterator[None]:
    """While the warm-up ends, a (further) Ctrl-C only hurries it (no grace period for the
    workers) instead of raising where the cleanup happens to be; the caller's handler is put
    back on the way out (only the main thread can; signals only reach it anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if pool is not None:
            pool.hurry = True

    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit status {code}"


# ----------------------------------------------------------------------------- how many workers
# resident memory of one compile worker (a spawned interpreter with torch and the DSL compiler,
# compiling one kernel): ~450 MiB measured; the bound below keeps a margin over it
WORKER_RSS_BYTES = 512 * 1024**2
DEFAULT_JOBS = 4  # with no --jobs: at most this many (and at most the CPUs)


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file or line)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_limit(jobs: int | None) -> tuple[int, str | None]:
    """(compile processes to start at most, why that is fewer than asked or None): `jobs`
    (default min(DEFAULT_JOBS, CPUs)), bounded by the CPUs and by MemAvailable at
    WORKER_RSS_BYTES each; always at least one."""
    cpus = cpu_count()
    want = jobs if jobs is not None else min(DEFAULT_JOBS, cpus)
    mem = available_memory_bytes()
    by_memory = max(1, mem // WORKER_RSS_BYTES) if mem is not None else want
    n = max(1, min(want, cpus, by_memory))
    if n >= want:
        return n, None
    why = []  # what binds
    if cpus == n:
        why.append(f"{cpus} CPU{'s' if cpus > 1 else ''}")
    if by_memory == n:
        why.append(f"{mem / 1024**3:.1f} GiB of memory available, ~{WORKER_RSS_BYTES // 1024**2} MiB per compile process")
    return n, "; ".join(why)


# ----------------------------------------------------------------------------- the warm-up
def _keys_and_cached(rows: list[WarmupRow], c: cache.ArtifactCache) -> list[str]:
    """Set each row's key, mark rows already in the cache as cached (no compiler import, no
    worker); returns every key (the warm-up's working set)."""
    from ..jit import compiler

    keys = []
    for row in rows:
        t0 = time.perf_counter()
        try:
            row.key = compiler.cache_key(row.config)
            keys.append(row.key)
            found: list[str] = []
            entry = c.lookup(row.key, corrupt=found)
            row.corrupt = tuple(found)
        except Exception as e:
            log.debug("msa-jit warmup: lookup of %s failed: %s", row.geometry, e)
            continue
        if entry is not None:
            row.status = "cached"
            row.artifact = str(entry.artifact_path())
            row.seconds = time.perf_counter() - t0
    return keys


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


def _open_cache(cache_dir: str | None, allow_ephemeral: bool) -> cache.ArtifactCache:
    c = cache.open_cache(cache_dir)
    if c.ephemeral and not allow_ephemeral:
        raise cache.CacheDirError(
            f"msa-jit warmup: refusing to compile, nothing would be kept: no persistent cache directory "
            f"is usable (the warning above says why), so the cache fell back to {c.root}, an in-process "
            f"temporary directory deleted when this warm-up exits. Set {env.CACHE_DIR} (or --cache-dir) "
            "to a writable directory."
        )
    return c


def _check_cap(rows: Sequence[WarmupRow], c: cache.ArtifactCache) -> None:
    """Say so when MSA_JIT_CACHE_MAX_BYTES is below this warm-up's kernels in the writable
    root: they are kept (the workers protect them), but the next build elsewhere prunes them."""
    try:
        cap = env.cache_max_bytes()
    except ValueError:
        return  # the build itself reported it
    dirs = {Path(r.artifact).parent for r in rows if r.status in ("compiled", "cached") and r.artifact}
    dirs = {d for d in dirs if d.is_relative_to(c.root)}
    size = sum(tree_size(d) for d in dirs)
    if size > cap:
        log.warning(
            "msa-jit warmup: %s = %d bytes is smaller than the %d kernels of this warm-up (%d bytes in %s): "
            "all are kept (a warm-up never prunes its own), but the next build in this cache outside a "
            "warm-up will prune the least recently used of them. Raise %s to at least %d.",
            env.CACHE_MAX_BYTES, cap, len(dirs), size, c.root, env.CACHE_MAX_BYTES, size,
        )


def run_warmup(
    configs: Sequence[SparseDecodeConfig], *, jobs: int | None = None, cache_dir: str | None = None,
    quiet: bool = False, allow_ephemeral: bool = False,
) -> list[WarmupRow]:
    """Ensure every config is compiled; returns one row per config (in the given order).

    The cache root is resolved once, here, and the workers write exactly there; at most
    `worker_limit(jobs)` of them run (`jobs`, bounded by the CPUs and the available memory). Raises
    CacheDirError when that root is an in-process temporary directory (nothing would outlive
    the warm-up) unless `allow_ephemeral` (`msa-jit inspect` reads the artifacts before it
    exits); WarmupInterrupted (a KeyboardInterrupt) on Ctrl-C, after cancelling the queued
    builds and ending the workers.
    """
    rows = [WarmupRow(c) for c in configs]
    if cache_dir:
        cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
    advance, close = _progress(len(rows), quiet)
    pool: _Pool | None = None
    c: cache.ArtifactCache | None = None
    interrupted = False
    try:
        c = _open_cache(cache_dir, allow_ephemeral)
        keys = _keys_and_cached(rows, c)
        for row in rows:
            if row.status == "cached":
                advance(row)
        pending = deque(r for r in rows if r.status == "pending")
        if pending:
            pool = _Pool(c, keys)
            for _ in range(min(worker_limit(jobs)[0], len(pending))):
                pool.give(pool.start(), pending.popleft())
            while pool.busy():
                for w, res in pool.wait():
                    row, w.row = w.row, None
                    row.status = res.get("status", "failed")
                    row.seconds = float(res.get("seconds") or 0.0)
                    row.artifact, row.key = res.get("artifact"), res.get("key") or row.key
                    row.error, row.extra = res.get("error"), res.get("extra") or {}
                    advance(row)
                    if pending:
                        pool.give(w if w in pool.workers else pool.start(), pending.popleft())
    except KeyboardInterrupt:
        interrupted = True
        building = {id(w.row) for w in (pool.busy() if pool else [])}
        for row in rows:
            if row.status == "pending":
                row.status = "interrupted" if id(row) in building else "cancelled"
    except (OSError, RuntimeError) as e:  # could not start a worker / lost its pipe
        if isinstance(e, cache.CacheDirError):
            raise
        for row in rows:
            if row.status == "pending":
                row.status, row.error = "failed", f"worker pool failed: {type(e).__name__}: {e}"
                advance(row)
    finally:
        with _further_sigints(pool):
            if pool is not None:
                pool.stop(graceful=not interrupted)
            close()
            if interrupted:  # raised in here: nothing is in flight (the except clause handled it)
                raise WarmupInterrupted(rows) from None
    if c is not None:
        _check_cap(rows, c)
    return rows


def interrupted_summary(rows: Sequence[WarmupRow]) -> str:
    """'1 compiled, 0 cached, 2 interrupted, 3 not started' (failed counted when there are any)."""
    n = {s: sum(r.status == s for r in rows) for s in ("compiled", "cached", "failed", "interrupted", "cancelled")}
    failed = f", {n['failed']} failed" if n["failed"] else ""
    return (f"{n['compiled']} compiled, {n['cached']} cached{failed}, {n['interrupted']} interrupted, "
            f"{n['cancelled']} not started")


def summary(rows: Sequence[WarmupRow]) -> dict[str, int]:
    """Counts of compiled / cached / failed rows."""
    return {s: sum(r.status == s for r in rows) for s in ("compiled", "cached", "failed")}


def json_document(rows: Sequence[WarmupRow], **extra: Any) -> dict[str, Any]:
    """{"rows": [...], "compiled", "cached", "failed", ...extra}: what `msa-jit warmup --json` writes."""
    return {"rows": [r.to_json() for r in rows], **summary(rows), **extra}
