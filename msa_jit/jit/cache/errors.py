"""The cache's errors and warning, and the one way an ``OSError`` is worded in them.

A leaf of the cache package (docs/cache.md §5, §1): only the standard library and
``msa_jit.env`` (for the variable names in messages) are imported.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from ... import env

__all__ = [
    "ArtifactMissingError",
    "CacheDirError",
    "CacheError",
    "CacheFallbackWarning",
    "CacheLockTimeout",
    "describe_oserror",
]


class CacheError(RuntimeError):
    """Base class of the cache's errors."""


class ArtifactMissingError(CacheError):
    """A kernel is not in the cache and ``MSA_JIT_NO_COMPILE=1`` forbids compiling it.

    ``corrupt``: one ``"<entry dir> (<why>; <what was done>)"`` per cached entry of this key
    that was found corrupt on the way (so the message says why a shipped kernel is missing).
    ``near``: one ``"<field> <cached value> (this host: <value>)"`` text per fingerprint under which
    the cache holds this same config: the cache was warmed, but for other versions or sources than
    this host computes (a kernel source edited since, another CuTe DSL, a runtime not importable)."""

    def __init__(
        self,
        describe: str,
        key: str,
        roots: Iterable[os.PathLike | str] = (),
        warmup_hint: str | None = None,
        corrupt: Iterable[str] = (),
        near: Iterable[str] = (),
    ) -> None:
        self.describe = describe
        self.key = key
        self.roots = tuple(str(r) for r in roots)
        self.warmup_hint = warmup_hint
        self.corrupt = tuple(corrupt)
        self.near = tuple(near)
        where = f" in {', '.join(self.roots)}" if self.roots else ""
        how = warmup_hint or "msa-jit warmup ...  (with this geometry)"
        bad = f" The cached entry is corrupt: {'; '.join(self.corrupt)}." if self.corrupt else ""
        if self.near:
            unknown = (" (unknown: this host could not tell, e.g. the package is not importable here)"
                       if any("this host: unknown" in n for n in self.near) else "")
            bad += (f" The cache holds this kernel built for another fingerprint: {'; '.join(self.near)}"
                    f"{unknown}.")
        super().__init__(
            f"msa-jit: no {'usable ' if bad else ''}compiled kernel for {describe} (cache key {key}){where}, "
            f"and {env.NO_COMPILE}=1 forbids compiling on this host.{bad} Warm the cache on a build host "
            f"with the same msa-jit / CuTe DSL versions and GPU arch:\n    {how}\n"
            f"then ship the cache directory and point {env.CACHE_DIR} at it "
            f"(or unset {env.NO_COMPILE} to compile here)."
        )

    def __reduce__(self):  # picklable across processes despite the custom __init__
        return (type(self), (self.describe, self.key, self.roots, self.warmup_hint, self.corrupt, self.near))


class CacheLockTimeout(CacheError, TimeoutError):
    """Another process held an entry's build lock for longer than ``MSA_JIT_LOCK_TIMEOUT``."""


class CacheDirError(CacheError):
    """No usable cache directory at all (not even a temporary one)."""


class CacheFallbackWarning(UserWarning):
    """The configured cache directory is unusable; another one is used instead."""


def describe_oserror(e: OSError) -> str:
    """'PermissionError EACCES: Permission denied': the exception type, errno name and text."""
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    text = e.strerror or str(e)
    return f"{type(e).__name__}{' ' + name if name else ''}: {text}"
