"""Disk cache of compiled artifacts (shared objects); the contract is ``docs/cache.md``.

In short::

    key = make_key(config.to_dict(), fingerprint)
    entry, built = default_cache().get_or_build(
        key, build, config=config.to_dict(), fingerprint=fingerprint, describe=config.describe())
    so_path = entry.artifact_path()

The modules, lowest first (each imports only the ones above it, the standard library,
``filelock`` and ``msa_jit.env``; never the compiler, so a runtime-only host can use it)::

    errors.py    CacheError and its subclasses, CacheFallbackWarning, describe_oserror
    entry.py     FORMAT / LAYOUT / META_NAME, CacheEntry, reading and checking an entry dir
    key.py       canonical_json, make_key, source_fingerprint, key checks            (§3)
    location.py  preferred_root, user_temp_root, the probes, the fallback (resolve)  (§1)
    store.py     ArtifactCache, its counters, default_cache                           (§4-7)

This package exports the public names below; helpers are imported (and patched in tests)
from the module that defines them.
"""

from __future__ import annotations

from .entry import FORMAT, LAYOUT, META_NAME, CacheEntry
from .errors import ArtifactMissingError, CacheDirError, CacheError, CacheFallbackWarning, CacheLockTimeout
from .key import canonical_json, make_key, source_fingerprint
from .location import preferred_root, user_temp_root
from .store import STALE_TMP_AGE_S, ArtifactCache, default_cache, open_cache, reset_stats, stats

__all__ = [
    "FORMAT",
    "LAYOUT",
    "META_NAME",
    "STALE_TMP_AGE_S",
    "CacheError",
    "ArtifactMissingError",
    "CacheLockTimeout",
    "CacheDirError",
    "CacheFallbackWarning",
    "CacheEntry",
    "ArtifactCache",
    "canonical_json",
    "make_key",
    "source_fingerprint",
    "preferred_root",
    "user_temp_root",
    "default_cache",
    "open_cache",
    "stats",
    "reset_stats",
]
