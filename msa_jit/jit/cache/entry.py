"""On-disk format of cache entries: layout constants, ``CacheEntry``, reading and
checking an entry directory, and the helpers that hash, size and fsync what a build
publishes.

Part of the disk cache (``msa_jit.jit.cache`` exports the public names; the contract is
``docs/cache.md`` §2 and §4). Only the standard library and ``.errors`` are imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import describe_oserror

__all__ = [
    "FORMAT",
    "LAYOUT",
    "META_NAME",
    "CacheEntry",
    "CorruptEntry",
    "check_artifacts",
    "fsync_path",
    "lock_problem",
    "meta_signature",
    "parse_build_result",
    "read_meta",
    "sha256_file",
    "tree_size",
    "valid_artifact_name",
]

FORMAT = 1  # meta.json "format"
LAYOUT = "v1"  # directory under the root; bump when the layout changes
META_NAME = "meta.json"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CacheEntry:
    """One complete cache entry: ``path`` holds the artifact file(s) and meta.json."""

    path: Path
    key: str
    meta: dict = field(compare=False, repr=False)
    readonly: bool = False  # lives in a read-only (pre-warmed) root

    @property
    def artifacts(self) -> list[str]:
        return [a["name"] for a in self.meta.get("artifacts", [])]

    def artifact_path(self, name: str | None = None) -> Path:
        """Path of artifact ``name`` (default: the first/primary one)."""
        names = self.artifacts
        if name is None:
            if not names:
                raise KeyError(f"cache entry {self.key} lists no artifacts")
            return self.path / names[0]
        if name not in names:
            raise KeyError(f"{name!r} is not an artifact of cache entry {self.key} (it has {names})")
        return self.path / name

    @property
    def size_bytes(self) -> int:
        return sum(int(a.get("size", 0)) for a in self.meta.get("artifacts", []))


class CorruptEntry(Exception):
    """An entry directory that must not be used: ``reason`` says why, ``sig`` is the
    ``meta_signature`` of what was judged (None when meta.json could not be read)."""

    def __init__(self, reason: str, sig: tuple | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.sig = sig


def valid_artifact_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name != ""
        and name not in (".", "..", META_NAME)
        and not name.startswith(".")
        and not any(c in name for c in "/\\\0")
    )


def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file (or a directory), best effort: some filesystems cannot."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync directories
    finally:
        os.close(fd)


def tree_size(path: Path) -> int:
    """Bytes of every file below ``path`` (0 when it does not exist)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for fn in files:
            try:
                total += os.lstat(os.path.join(dirpath, fn)).st_size
            except OSError:
                pass
    return total


def parse_build_result(result: Any, tmp: Path) -> tuple[list[str], dict]:
    """(artifact names, extra) of what ``build(tmpdir)`` returned, after checking that the
    files it names are regular files in ``tmp``."""
    if not isinstance(result, Mapping) or "artifacts" not in result:
        raise TypeError(
            "build(tmpdir) must return a dict {'artifacts': [file names], 'extra': {...}}, "
            f"got {result!r}"
        )
    names = result["artifacts"]
    if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)) or not names:
        raise TypeError(f"build result 'artifacts' must be a non-empty list of file names, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"build result 'artifacts' has duplicates: {names!r}")
    for n in names:
        if not valid_artifact_name(n):
            raise ValueError(
                f"invalid artifact name {n!r}: a plain file name (no '/', not {META_NAME!r}, not hidden)"
            )
        p = tmp / n
        if not p.is_file() or p.is_symlink():
            raise FileNotFoundError(f"build did not write artifact {n!r} as a regular file in {tmp}")
    extra = result.get("extra", {})
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"build result 'extra' must be a dict, got {type(extra).__name__}")
    return list(names), dict(extra)


def sha256_file(path: Path) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def meta_signature(d: Path) -> tuple | None:
    """(st_dev, st_ino, sha256 of the bytes) of ``d``'s meta.json: the identity of one
    published entry (a re-published entry gets another); None when it cannot be read."""
    try:
        with open(d / META_NAME, "rb") as f:
            st = os.fstat(f.fileno())
            return (st.st_dev, st.st_ino, hashlib.sha256(f.read()).hexdigest())
    except OSError:
        return None


def read_meta(d: Path, key: str) -> tuple[dict, tuple] | None:
    """(meta, signature) of the entry dir ``d``; None if it has no meta.json (absent or
    incomplete); raises CorruptEntry if meta.json is unusable."""
    meta_path = d / META_NAME
    try:
        with open(meta_path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read()
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise CorruptEntry(f"{d} is not a directory", None) from None
    except OSError as e:
        raise CorruptEntry(f"cannot read meta.json ({describe_oserror(e)})", None) from None
    sig = (st.st_dev, st.st_ino, hashlib.sha256(raw).hexdigest())
    try:
        meta = json.loads(raw)
    except ValueError:
        raise CorruptEntry("meta.json is not valid JSON", sig) from None
    if not isinstance(meta, dict):
        raise CorruptEntry("meta.json is not a JSON object", sig)
    if meta.get("format") != FORMAT:
        raise CorruptEntry(f"meta.json format {meta.get('format')!r} != {FORMAT}", sig)
    if meta.get("key") != key:
        raise CorruptEntry(f"meta.json key {meta.get('key')!r} != directory key", sig)
    arts = meta.get("artifacts")
    if not isinstance(arts, list) or not arts:
        raise CorruptEntry("meta.json lists no artifacts", sig)
    for a in arts:
        if not (
            isinstance(a, dict)
            and valid_artifact_name(a.get("name"))
            and isinstance(a.get("size"), int)
            and isinstance(a.get("sha256"), str)
        ):
            raise CorruptEntry(f"meta.json has a malformed artifact record {a!r}", sig)
    return meta, sig


def check_artifacts(d: Path, meta: dict, sig: tuple, hash_check: bool) -> None:
    """Raise CorruptEntry unless every artifact of ``meta`` is a regular file of the recorded
    size in ``d`` (and, with ``hash_check``, of the recorded sha256)."""
    for a in meta["artifacts"]:
        p = d / a["name"]
        try:
            st = os.lstat(p)
        except OSError:
            raise CorruptEntry(f"artifact {a['name']} is missing", sig) from None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptEntry(f"artifact {a['name']} is not a regular file", sig)
        if st.st_size != a["size"]:
            raise CorruptEntry(
                f"artifact {a['name']} has {st.st_size} bytes, meta.json says {a['size']}", sig
            )
    if hash_check:
        for a in meta["artifacts"]:
            try:
                digest, _ = sha256_file(d / a["name"])
            except OSError as e:
                raise CorruptEntry(f"cannot read artifact {a['name']} ({describe_oserror(e)})", sig) from None
            if digest != a["sha256"]:
                raise CorruptEntry(
                    f"artifact {a['name']} sha256 {digest[:16]}... != recorded {a['sha256'][:16]}...",
                    sig,
                )


def lock_problem(path: Path) -> str | None:
    """What is at a lock file's path when it is not a regular file (a directory, a symlink of any
    kind, a FIFO...), None when it is one or nothing is there. Never follows a link: filelock opens
    the lock with O_NOFOLLOW, so any symlink there makes every build of its key fail (ELOOP), and a
    directory does too (EISDIR)."""
    try:
        st = os.lstat(path)
    except OSError:  # nothing there, or locks/ unreadable: filelock then says what is wrong
        return None
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"a symbolic link (to {target!r}), not a regular file"
    if stat.S_ISDIR(mode):
        return "a directory, not a regular file"
    kind = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
            stat.S_IFBLK: "a block device"}.get(stat.S_IFMT(mode), f"of mode {stat.S_IFMT(mode):#o}")
    return f"{kind}, not a regular file"
