"""On-disk format of cache entries: layout constants, ``CacheEntry`` and the
helpers that check, size and fsync what a build publishes.

Part of the disk cache (``msa_jit.cache`` re-exports every public name; the
contract is ``cache_dir_policy.md`` §2). Only the standard library is imported.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "LAYOUT",
    "META_NAME",
    "CacheEntry",
]

FORMAT = 1  # meta.json "format"
LAYOUT = "v1"  # directory under the root; bump when the layout changes
META_NAME = "meta.json"


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


class _Corrupt(Exception):
    def __init__(self, reason: str, sig: tuple | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.sig = sig


def _valid_artifact_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name != ""
        and name not in (".", "..", META_NAME)
        and not name.startswith(".")
        and not any(c in name for c in "/\\\0")
    )


def _fsync_path(path: Path, directory: bool = False) -> None:
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


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for fn in files:
            try:
                total += os.lstat(os.path.join(dirpath, fn)).st_size
            except OSError:
                pass
    return total


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"



def _parse_build_result(result: Any, tmp: Path) -> tuple[list[str], dict]:
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
        if not _valid_artifact_name(n):
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
