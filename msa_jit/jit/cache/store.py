"""The cache itself: ``ArtifactCache`` (lookup, build under a lock, publish, prune),
its counters and ``default_cache``.

The contract (locations, fallback, layout, key, concurrency, crash safety,
pruning) is written down in ``docs/cache.md``;
keep the two in sync. In short::

    key = make_key(dataclasses.asdict(cfg), fingerprint)
    entry, built = default_cache().get_or_build(
        key, build, config=asdict(cfg), fingerprint=fingerprint, describe=str(cfg))
    so_path = entry.artifact_path()

``build(tmpdir)`` writes the artifact file(s) into ``tmpdir`` and returns
``{"artifacts": [names], "extra": {...}}``. Entries are published atomically
(``meta.json`` written last inside a temp dir, then one ``rename``), so a
reader never sees a half-written entry, and a killed build leaves only a temp
dir that lookups ignore and ``prune``/``clear`` remove.

Only the standard library and ``filelock`` are imported: the runtime-only
loader uses this module on hosts without the compiler.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import re
import secrets
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import filelock

from ... import env
from .entry import (FORMAT, LAYOUT, META_NAME, CacheEntry, CorruptEntry, check_artifacts, fsync_path, lock_problem, meta_signature, parse_build_result, read_meta, sha256_file, tree_size)
from .errors import ArtifactMissingError, CacheError, CacheFallbackWarning, CacheLockTimeout
from .key import KEY_RE, check_key, entry_key_problem, jsonable, make_key
from .location import not_a_directory, pinned, preferred_root, resolve

__all__ = ["STALE_TMP_AGE_S", "ArtifactCache", "default_cache", "disk_full_errno", "disk_full_error", "open_cache",
           "reset_stats", "stats"]

log = logging.getLogger("msa_jit.jit.cache")

STALE_TMP_AGE_S = 3600.0  # unrecognised files in tmp/ older than this are garbage
_SHARD_RE = re.compile(r"\A[0-9a-f]{2}\Z")
_LOCK_SUFFIX = ".lock"
_DAMAGED = object()  # _read_entries' mark of an entry whose meta.json cannot be read
_DISK_FULL = {errno.ENOSPC: "no space left on device (ENOSPC)", errno.EDQUOT: "disk quota exceeded (EDQUOT)"}
# how a tool that reports through text (the linker's stderr, a DSL error) says the same
_DISK_FULL_TEXT = re.compile(r"no space left on device|disk quota exceeded", re.IGNORECASE)


def disk_full_errno(e: BaseException, text: bool = False) -> int | None:
    """ENOSPC / EDQUOT when ``e`` says the disk (or the quota) is full; with ``text``, also an
    error of another type whose message says so (ENOSPC then). None otherwise, and for an error
    ``disk_full_error`` already made."""
    if getattr(e, "msa_jit_disk_full", False):
        return None
    if isinstance(e, OSError) and e.errno in _DISK_FULL:
        return e.errno
    if text:
        m = _DISK_FULL_TEXT.search(str(e))
        if m:
            return errno.EDQUOT if m.group(0).lower().startswith("disk") else errno.ENOSPC
    return None


def _free_space(path: Path) -> str:
    """'1.2 GiB free' on the filesystem of ``path`` (its nearest existing ancestor), or ''."""
    for p in (path, *path.parents):
        try:
            free = shutil.disk_usage(p).free
            break
        except OSError:
            continue
    else:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if free < 1024 or unit == "TiB":
            return f"{free:.0f} {unit} free" if unit == "B" else f"{free:.1f} {unit} free"
        free /= 1024
    return ""


def disk_full_error(e: BaseException, what: str, places: Iterable[tuple[os.PathLike | str, str]],
                    code: int | None = None) -> OSError:
    """An OSError (errno ENOSPC / EDQUOT, as ``e``) whose message says where: what was being
    done, the file ``e`` names if any, and each directory that may be the full one with its
    role and free space (``[Errno 28] No space left on device`` alone names none). Marked so that
    an outer caller does not wrap it again."""
    code = code if code is not None else (disk_full_errno(e, text=True) or errno.ENOSPC)
    where = []
    filename = getattr(e, "filename", None)
    if filename:
        where.append(f"writing {filename}")
    seen = set()
    for path, role in places:
        path = Path(path)
        if str(path) in seen:
            continue
        seen.add(str(path))
        free = _free_space(path)
        where.append(f"{path} ({role}{'; ' + free if free else ''})")
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    said = [ln for ln in lines if _DISK_FULL_TEXT.search(ln)] or lines[-1:]
    tail = f" [{said[0]}]" if said else ""  # the tool's own words (the linker's line)
    err = OSError(code, f"msa-jit: {_DISK_FULL[code]} while {what}: {', '.join(where)}{tail}. Free space "
                        f"there, or point {env.CACHE_DIR} (the cache) / TMPDIR (the compiler's temp files) at a "
                        f"filesystem with room")
    err.msa_jit_disk_full = True
    return err


# --------------------------------------------------------------------------- stats

_STAT_NAMES = ("builds", "hits", "misses", "corrupt")
_stats_mu = threading.Lock()
_global_stats = dict.fromkeys(_STAT_NAMES, 0)


def stats() -> dict[str, int]:
    """Process-wide counters of all ``ArtifactCache`` instances: builds, hits, misses, corrupt."""
    with _stats_mu:
        return dict(_global_stats)


def reset_stats() -> None:
    """Zero the process-wide counters (tests)."""
    with _stats_mu:
        for k in _STAT_NAMES:
            _global_stats[k] = 0


# --------------------------------------------------------------------------- the cache


class ArtifactCache:
    """Content-addressed disk cache of compiled artifacts (see docs/cache.md).

    ``root`` is fixed at construction: the argument, else MSA_JIT_CACHE_DIR,
    else $XDG_CACHE_HOME/msa-jit, else ~/.cache/msa-jit, else the per-user
    temp dir; an unusable root falls back (one ``CacheFallbackWarning``).

    ``fallback=False``: exactly ``root`` with ``readonly_roots`` (what another process
    resolved: the warm-up's workers get their parent's), CacheDirError if it is unusable.
    ``create=False``: a root without a cache that a first use would create is left alone and
    read as empty (``exists`` is False); the maintenance commands use it.
    """

    def __init__(
        self,
        root: os.PathLike | str | None = None,
        *,
        fallback: bool = True,
        readonly_roots: Iterable[os.PathLike | str] = (),
        create: bool = True,
    ) -> None:
        if fallback:
            res = resolve(root, create=create)
        elif root is None:
            raise ValueError("ArtifactCache(fallback=False) needs the root to use")
        else:
            res = pinned(root, tuple(readonly_roots))
        self.requested_root: Path = res.requested
        self.root: Path = res.root
        self.readonly_roots: tuple[Path, ...] = res.readonly
        self.ephemeral: bool = res.ephemeral
        self.fallback_reason: str | None = res.message
        self.exists: bool = res.exists
        self._verified: dict[tuple[str, str], tuple] = {}
        self._protected: set[str] = set()
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._mu = threading.Lock()
        if res.message is not None:
            warnings.warn(res.message, CacheFallbackWarning, stacklevel=2)

    def __repr__(self) -> str:
        ro = f", readonly_roots={list(map(str, self.readonly_roots))}" if self.readonly_roots else ""
        return f"ArtifactCache(root={str(self.root)!r}{ro})"

    # ---------------------------------------------------------------- paths / stats
    @property
    def v1(self) -> Path:
        return self.root / LAYOUT

    def entry_path(self, key: str, root: Path | None = None) -> Path:
        check_key(key)
        return (root or self.root) / LAYOUT / key[:2] / key

    def lock_path(self, key: str) -> Path:
        check_key(key)
        return self.v1 / "locks" / f"{key}.lock"

    @property
    def stats(self) -> dict[str, int]:
        """This instance's counters (builds, hits, misses, corrupt); see also ``stats()``."""
        with self._mu:
            return dict(self._stats)

    def _count(self, name: str) -> None:
        with self._mu:
            self._stats[name] += 1
        with _stats_mu:
            _global_stats[name] += 1

    # ---------------------------------------------------------------- locks
    def _file_lock(self, key: str, timeout: float) -> filelock.FileLock:
        path = self.lock_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._heal_lock(path)
        if math.isinf(timeout):
            timeout = -1
        return filelock.FileLock(str(path), timeout=timeout)

    def _heal_lock(self, path: Path) -> str | None:
        """Replace a lock path that is no regular file (see ``lock_problem``): it is moved aside
        and deleted (the link itself, never its target; a directory with what is in it), and the
        next lock taken creates a fresh file. Nobody can hold such a lock (filelock cannot open
        it), so no mutual exclusion is broken. Returns what was there, None when it was fine."""
        why = lock_problem(path)
        if why is not None:
            log.warning("msa-jit cache: lock file %s is %s; replacing it", path, why)
            self._remove_path(path)
        return why

    def _acquire(self, lock: filelock.FileLock) -> None:
        """``lock.acquire()``; when the lock path turns out damaged (replaced by something else
        since ``_file_lock`` looked), heal it and try once more."""
        try:
            lock.acquire()
        except OSError as e:
            if isinstance(e, filelock.Timeout) or self._heal_lock(Path(lock.lock_file)) is None:
                raise
            lock.acquire()

    def _bad_locks(self) -> list[tuple[Path, str, str]]:
        """(path, key, why) of every ``locks/<key>.lock`` of the writable root that is no
        regular file."""
        try:
            names = sorted((self.v1 / "locks").iterdir())
        except OSError:
            return []
        out = []
        for p in names:
            key = p.name[: -len(_LOCK_SUFFIX)] if p.name.endswith(_LOCK_SUFFIX) else ""
            if KEY_RE.match(key):
                why = lock_problem(p)
                if why is not None:
                    out.append((p, key, why))
        return out

    @contextmanager
    def _try_lock(self, key: str) -> Iterator[bool]:
        """Take ``key``'s lock without waiting; yields whether it was taken."""
        try:
            lock = self._file_lock(key, 0)
            self._acquire(lock)
        except (filelock.Timeout, OSError):
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    # ---------------------------------------------------------------- reading
    def _read_entry(self, root: Path, key: str, verify: bool) -> CacheEntry | None:
        """The entry of ``key`` under ``root`` if complete and intact, None if
        absent; raises CorruptEntry."""
        d = self.entry_path(key, root)
        loaded = read_meta(d, key)
        if loaded is None:
            return None
        meta, sig = loaded
        memo = (str(root), key)
        known = self._verified.get(memo) == sig  # this very meta.json passed every check before
        if not known:
            why = entry_key_problem(meta, key)
            if why is not None:
                raise CorruptEntry(why, sig)
        need_hash = verify and not known
        check_artifacts(d, meta, sig, need_hash)
        if need_hash:
            self._verified[memo] = sig
        return CacheEntry(d, key, meta, readonly=(root != self.root))

    def _lookup(self, key: str, verify: bool, locked: bool, corrupt: list[str] | None = None) -> CacheEntry | None:
        """The entry of ``key`` (writable root first); a corrupt one is logged, removed (or, in
        a read-only root, skipped) and described in ``corrupt``."""
        for root in (self.root, *self.readonly_roots):
            try:
                entry = self._read_entry(root, key, verify)
            except CorruptEntry as c:
                self._count("corrupt")
                self._verified.pop((str(root), key), None)
                d = self.entry_path(key, root)
                shard_problem = not_a_directory(d.parent)
                reason = f"its shard: {shard_problem}" if shard_problem else c.reason
                if root != self.root:
                    log.warning("msa-jit cache: skipping corrupt read-only entry %s: %s", d, reason)
                    if corrupt is not None:
                        corrupt.append(f"{d} ({reason}; read-only, skipped)")
                    continue
                then = (f"{env.NO_COMPILE}=1: it is not rebuilt on this host" if env.no_compile()
                        else "so that it is rebuilt")
                log.warning("msa-jit cache: entry %s is corrupt (%s); removing it (%s)", d, reason, then)
                self._discard(key, d, c.sig, locked, bad_shard=shard_problem is not None)
                if corrupt is not None:
                    corrupt.append(f"{d} ({reason}; removed)")
                continue
            if entry is not None:
                if not entry.readonly:
                    try:
                        os.utime(entry.path / META_NAME)  # LRU clock (best effort)
                    except OSError:
                        pass
                return entry
        return None

    def _discard(self, key: str, d: Path, sig: tuple | None, locked: bool, bad_shard: bool = False) -> None:
        """Remove a corrupt entry, unless it was replaced since it was judged (or, when its
        shard is no directory, move the shard aside: no entry can live in it)."""

        def remove() -> None:
            if bad_shard:
                self._heal_shard(d.parent)
            elif meta_signature(d) == sig:
                self._remove_path(d)

        if locked:
            remove()
            return
        with self._try_lock(key) as got:
            if got:
                remove()
            else:
                log.debug("msa-jit cache: %s is being rebuilt by another process; left alone", d)

    def lookup(self, key: str, verify: bool = True, *, corrupt: list[str] | None = None) -> CacheEntry | None:
        """The complete, intact entry of ``key``, or None (lock-free).

        ``verify=True`` checks the artifacts' sha256 once per process per entry
        (sizes are always checked). A corrupt entry is logged, removed, and
        reported as a miss so that the caller rebuilds it; ``corrupt``, if given,
        gets one ``"<entry dir> (<why>; <what was done>)"`` per corrupt entry found
        (what ``ArtifactMissingError.corrupt`` holds).
        """
        check_key(key)
        entry = self._lookup(key, verify, locked=False, corrupt=corrupt)
        self._count("hits" if entry is not None else "misses")
        return entry

    # ---------------------------------------------------------------- building
    def get_or_build(
        self,
        key: str,
        build: Callable[[Path], Mapping[str, Any]],
        *,
        config: Mapping[str, Any],
        fingerprint: Mapping[str, Any],
        describe: str,
        verify: bool = True,
        warmup_hint: str | None = None,
    ) -> tuple[CacheEntry, bool]:
        """Return ``(entry, built)``: the cached entry of ``key``, building it
        with ``build(tmpdir)`` under the entry's lock on a miss.

        Raises ArtifactMissingError on a miss when MSA_JIT_NO_COMPILE=1,
        CacheLockTimeout when another build holds the lock too long, ValueError
        when ``key != make_key(config, fingerprint)``.
        """
        check_key(key)
        expected = make_key(config, fingerprint)
        if key != expected:
            raise ValueError(
                f"cache key {key} does not match make_key(config, fingerprint) = {expected} for {describe}"
            )
        corrupt: list[str] = []
        entry = self._lookup(key, verify, locked=False, corrupt=corrupt)
        if entry is not None:
            self._count("hits")
            return entry, False
        self._count("misses")
        if env.no_compile():
            raise ArtifactMissingError(
                describe, key, roots=(self.root, *self.readonly_roots), warmup_hint=warmup_hint,
                corrupt=corrupt, near=self._fingerprint_mismatches(config, fingerprint),
            )
        timeout = env.lock_timeout_s()
        lock = self._file_lock(key, timeout)
        try:
            self._acquire(lock)
        except filelock.Timeout:
            raise CacheLockTimeout(
                f"msa-jit: timed out after {timeout:g} s ({env.LOCK_TIMEOUT}) waiting for the build "
                f"lock {lock.lock_file} of {describe}: another process is still building it. "
                f"Raise {env.LOCK_TIMEOUT}, or find the process holding the lock (e.g. `fuser {lock.lock_file}`)."
            ) from None
        try:
            entry = self._lookup(key, verify, locked=True)
            if entry is not None:
                self._count("hits")
                return entry, False
            entry = self._build_locked(key, build, config, fingerprint, describe)
        finally:
            lock.release()
        self._count("builds")
        self._auto_prune(protect=key)
        return entry, True

    def _build_locked(
        self,
        key: str,
        build: Callable[[Path], Mapping[str, Any]],
        config: Mapping[str, Any],
        fingerprint: Mapping[str, Any],
        describe: str,
    ) -> CacheEntry:
        tmp_root = self.v1 / "tmp"
        try:
            tmp_root.mkdir(parents=True, exist_ok=True)
            tmp = tmp_root / f"build-{key}-{secrets.token_hex(6)}"
            os.mkdir(tmp)
        except OSError as e:
            if disk_full_errno(e) is None:
                raise
            raise self._disk_full(e, describe, tmp_root) from e
        try:
            log.info("msa-jit cache: building %s (key %s)", describe, key)
            t0 = time.monotonic()
            result = build(tmp)
            build_s = time.monotonic() - t0
            names, extra = parse_build_result(result, tmp)
            records = []
            for name in names:
                p = tmp / name
                digest, size = sha256_file(p)
                fsync_path(p)
                records.append({"name": name, "size": size, "sha256": digest})
            created = time.time()
            if dataclasses.is_dataclass(config) and not isinstance(config, type):
                config = dataclasses.asdict(config)
            meta = {
                "format": FORMAT,
                "key": key,
                "describe": describe,
                "config": jsonable(config),
                "fingerprint": jsonable(fingerprint),
                "artifacts": records,
                "created": created,
                "created_iso": datetime.fromtimestamp(created, timezone.utc).isoformat(),
                "build_seconds": round(build_s, 6),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "extra": extra,
            }
            text = json.dumps(meta, sort_keys=True, indent=1, default=str)
            part = tmp / f".{META_NAME}.part"
            with open(part, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, tmp / META_NAME)  # meta.json LAST: marks the entry complete
            fsync_path(tmp, directory=True)
            return self._publish(tmp, key, meta)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if disk_full_errno(e) is None:
                raise
            # a build callback that knows better (the compiler: its temp dir, the linker) has
            # already named the place; here the cache's own writes (meta.json, the publish) or
            # a plain OSError out of the build: the build dir's filesystem is the cache root's
            raise self._disk_full(e, describe, tmp_root) from e

    def _disk_full(self, e: OSError, describe: str, where: Path) -> OSError:
        return disk_full_error(e, f"building {describe} into the cache",
                               [(where, f"the cache's build dirs, under the cache root {self.root}")])

    def _publish(self, tmp: Path, key: str, meta: dict) -> CacheEntry:
        dest = self.entry_path(key)
        self._heal_shard(dest.parent)
        dest.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            try:
                os.rename(tmp, dest)  # atomic; replaces at most an empty dir
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
            else:
                fsync_path(dest.parent, directory=True)
                self._verified[(str(self.root), key)] = meta_signature(dest)
                return CacheEntry(dest, key, meta)
            # Something is in the way. A valid entry wins (first writer wins:
            # correctness does not depend on the lock); anything else is stale.
            try:
                existing = self._read_entry(self.root, key, verify=True)
            except CorruptEntry as c:
                log.warning("msa-jit cache: replacing invalid entry %s (%s)", dest, c.reason)
                existing = None
            if existing is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                return existing
            self._remove_path(dest)
        raise CacheError(f"msa-jit cache: could not publish {tmp} onto {dest}")

    def protect(self, keys: Iterable[str]) -> None:
        """Never let this instance's automatic prune remove the entries of ``keys`` (a warm-up
        protects its whole working set: what it built must survive its own later builds)."""
        keys = list(keys)
        for k in keys:
            check_key(k)
        self._protected.update(keys)

    def _auto_prune(self, protect: str) -> None:
        try:
            cap = env.cache_max_bytes()
            if self.size_bytes() > cap:
                self.prune(cap, _protect={protect, *self._protected})
        except Exception as e:  # a prune problem must not fail a successful build
            log.warning("msa-jit cache: automatic prune of %s failed: %s", self.root, e)

    def _heal_shard(self, shard: Path) -> None:
        """A shard path that is no directory (a symlink loop, a dangling link, a file) can hold
        no entry and makes every publish under it fail: move it aside (the link itself, never
        what it points to). A symlink to a real directory is followed, like a symlinked root."""
        why = not_a_directory(shard)
        if why is not None:
            log.warning("msa-jit cache: %s; moving it aside", why)
            self._remove_path(shard)

    # ---------------------------------------------------------------- removal
    def _remove_path(self, path: Path) -> bool:
        """Rename ``path`` aside into tmp/ (atomic disappearance), then delete it."""
        trash_root = self.v1 / "tmp"
        trash = trash_root / f"trash-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            trash_root.mkdir(parents=True, exist_ok=True)
            os.rename(path, trash)
        except FileNotFoundError:
            return False
        except OSError:
            trash = path  # cannot rename aside: delete in place
        try:
            if trash.is_dir() and not trash.is_symlink():
                shutil.rmtree(trash, ignore_errors=True)
            else:
                trash.unlink()
        except OSError as e:
            log.warning("msa-jit cache: could not remove %s: %s", trash, e)
        return True

    def _collect_garbage(self) -> list[Path]:
        """Remove trash, dead builds' temp dirs, stale junk and incomplete entries."""
        removed: list[Path] = []
        tmp_root = self.v1 / "tmp"
        try:
            children = list(tmp_root.iterdir())
        except OSError:
            children = []
        now = time.time()
        for child in children:
            name = child.name
            if name.startswith("trash-"):
                if self._remove_path(child):
                    removed.append(child)
                continue
            key = name[len("build-"):len("build-") + 64] if name.startswith("build-") else ""
            if KEY_RE.match(key):
                # A build in progress holds its key's lock: free lock => builder is dead.
                with self._try_lock(key) as free:
                    if free and self._remove_path(child):
                        removed.append(child)
                continue
            try:
                old = now - os.lstat(child).st_mtime > STALE_TMP_AGE_S
            except OSError:
                continue
            if old and self._remove_path(child):
                removed.append(child)
        for shard, _why in self._bad_shards(self.root):
            self._heal_shard(shard)
            removed.append(shard)
        for lock, _key, _why in self._bad_locks():
            if self._heal_lock(lock) is not None:
                removed.append(lock)
        for key, d in self._iter_entry_dirs(self.root):
            if (d / META_NAME).exists():
                continue
            with self._try_lock(key) as free:
                if free and not (d / META_NAME).exists() and self._remove_path(d):
                    removed.append(d)
        return removed

    # ---------------------------------------------------------------- maintenance
    def _bad_shards(self, root: Path) -> list[tuple[Path, str]]:
        """(path, why) of every shard name under ``root/v1`` that is no real directory."""
        try:
            names = sorted(p for p in (root / LAYOUT).iterdir() if _SHARD_RE.match(p.name))
        except OSError:
            return []
        out = []
        for p in names:
            why = not_a_directory(p)
            if why is not None:
                out.append((p, why))
        return out

    def _iter_entry_dirs(self, root: Path) -> Iterator[tuple[str, Path]]:
        v1 = root / LAYOUT
        try:
            shards = sorted(p for p in v1.iterdir() if _SHARD_RE.match(p.name))
        except OSError:
            return
        for shard in shards:
            try:
                dirs = sorted(shard.iterdir())
            except OSError:
                continue
            for d in dirs:
                if KEY_RE.match(d.name) and d.name[:2] == shard.name:
                    yield d.name, d

    def _read_entries(self) -> Iterator[tuple[Path, str, Path, Any]]:
        """(root, key, dir, read_meta's result: None while incomplete, _DAMAGED for a meta.json that cannot
        be read) of every entry directory, writable root first, then the read-only roots."""
        for root in (self.root, *self.readonly_roots):
            for key, d in self._iter_entry_dirs(root):
                try:
                    loaded = read_meta(d, key)
                except CorruptEntry:
                    loaded = _DAMAGED
                yield root, key, d, loaded

    def entries(self) -> list[CacheEntry]:
        """Every complete entry (parseable meta.json; artifacts not checked), writable root first."""
        out: dict[str, CacheEntry] = {}
        for root, key, d, loaded in self._read_entries():
            if key not in out and loaded is not None and loaded is not _DAMAGED:
                out[key] = CacheEntry(d, key, loaded[0], readonly=(root != self.root))
        return list(out.values())

    def unreadable_entries(self) -> list[Path]:
        """Entry directories whose meta.json cannot be read: what `entries` skips, `verify(remove=True)` removes."""
        return [d for _, _, d, loaded in self._read_entries() if loaded is _DAMAGED]

    def _fingerprint_mismatches(self, config: Mapping[str, Any], fingerprint: Mapping[str, Any],
                                limit: int = 3) -> list[str]:
        """How the fingerprints of the cached entries of ``config`` differ from ``fingerprint`` (the
        error path of a miss only: it reads every entry's meta.json)."""
        out: list[str] = []
        for e in self.entries():
            theirs = e.meta.get("fingerprint")
            if e.meta.get("config") != dict(config) or not isinstance(theirs, dict) or theirs == dict(fingerprint):
                continue
            diff = ", ".join(f"{k} {theirs.get(k)} (this host: {fingerprint.get(k)})"
                             for k in sorted(set(theirs) | set(fingerprint)) if theirs.get(k) != fingerprint.get(k))
            if diff not in out:
                out.append(diff)
        return out[:limit]

    def verify(self, remove: bool = False) -> list[tuple[CacheEntry, str | None]]:
        """Full check (key, sizes and sha256) of every entry: ``(entry, None)`` when
        intact, ``(entry, reason)`` otherwise (entries with an unusable
        meta.json get ``meta == {}``; a shard that is no directory is reported as
        an entry whose ``key`` is the shard's name, a lock path of the writable root
        that is no regular file as one whose ``path`` is the lock's and ``key`` its
        key's). ``remove=True`` deletes bad entries (and bad shards, and replaces bad
        locks) of the writable root."""
        results: list[tuple[CacheEntry, str | None]] = []
        seen: set[str] = set()
        for lock, key, why in self._bad_locks():
            results.append((CacheEntry(lock, key, {}), f"lock file is {why}"))
            if remove:
                self._heal_lock(lock)
        for root in (self.root, *self.readonly_roots):
            ro = root != self.root
            for shard, why in self._bad_shards(root):
                results.append((CacheEntry(shard, shard.name, {}, readonly=ro), f"not a shard directory: {why}"))
                if remove and not ro:
                    self._heal_shard(shard)
            for key, d in self._iter_entry_dirs(root):
                if key in seen:
                    continue
                try:
                    loaded = read_meta(d, key)
                    if loaded is None:
                        continue  # incomplete (a build dir never lands here); prune() removes it
                    meta, sig = loaded
                    why = entry_key_problem(meta, key)
                    if why is not None:
                        raise CorruptEntry(why, sig)
                    check_artifacts(d, meta, sig, hash_check=True)
                    self._verified[(str(root), key)] = sig
                    results.append((CacheEntry(d, key, meta, readonly=ro), None))
                except CorruptEntry as c:
                    try:
                        got = read_meta(d, key)
                        meta = got[0] if got else {}
                    except CorruptEntry:
                        meta = {}
                    self._verified.pop((str(root), key), None)
                    results.append((CacheEntry(d, key, meta, readonly=ro), c.reason))
                    if remove and not ro:
                        self._remove_path(d)
                seen.add(key)
        return results

    def size_bytes(self) -> int:
        """Bytes under the writable root's v1/ (entries and in-progress builds)."""
        return tree_size(self.v1)

    def prune(self, max_bytes: int | None = None, *, _protect: Iterable[str] = ()) -> list[Path]:
        """Remove garbage (dead builds' temp dirs, trash, incomplete entries, lock paths that
        are no regular file), then
        least-recently-used entries (meta.json mtime) until the writable root
        holds at most ``max_bytes`` (default MSA_JIT_CACHE_MAX_BYTES). Returns
        the removed paths."""
        cap = env.cache_max_bytes() if max_bytes is None else int(max_bytes)
        if cap < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        protect = set(_protect)
        removed = self._collect_garbage()
        items: list[tuple[float, str, Path]] = []
        for key, d in self._iter_entry_dirs(self.root):
            try:
                items.append((os.stat(d / META_NAME).st_mtime, key, d))
            except OSError:
                continue
        total = self.size_bytes()
        items.sort()
        for _mtime, key, d in items:
            if total <= cap:
                break
            if key in protect:
                continue
            size = tree_size(d)
            if self._remove_path(d):
                self._verified.pop((str(self.root), key), None)
                removed.append(d)
                total -= size
        if removed:
            log.info("msa-jit cache: pruned %d path(s) from %s", len(removed), self.root)
        return removed

    def clear(self) -> list[Path]:
        """Remove every entry and all garbage of the writable root (read-only
        roots and lock files are left alone, but for lock paths that are no
        regular file, which are replaced; builds in progress are not
        disturbed). Returns the removed paths."""
        removed = self._collect_garbage()
        for key, d in self._iter_entry_dirs(self.root):
            if self._remove_path(d):
                removed.append(d)
        self._verified.clear()
        return removed


# --------------------------------------------------------------------------- default instance

_default_mu = threading.Lock()
_defaults: dict[str, ArtifactCache] = {}


def default_cache() -> ArtifactCache:
    """A shared ``ArtifactCache`` for the currently configured root (one per
    distinct preferred root, so a fallback is warned about once per process)."""
    pref, _source = preferred_root()
    with _default_mu:
        cache = _defaults.get(str(pref))
        if cache is None:
            cache = ArtifactCache(pref)
            _defaults[str(pref)] = cache
        return cache


def open_cache(root: os.PathLike | str | None = None, *, create: bool = True) -> ArtifactCache:
    """``ArtifactCache(root)`` for an explicit root (e.g. ``--cache-dir``), else the shared
    ``default_cache()``. ``create=False``: see ``ArtifactCache`` (nothing is created for a
    root that holds no cache yet)."""
    if not create:
        return ArtifactCache(root, create=False)
    return ArtifactCache(root) if root else default_cache()
