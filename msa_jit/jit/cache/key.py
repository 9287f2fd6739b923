"""Cache keys: canonical JSON, ``make_key``, ``source_fingerprint`` and key checks.

Part of the disk cache (``msa_jit.jit.cache`` exports the public names; the contract
is ``docs/cache.md`` §3). Only the standard library and ``.entry`` (the
file hash) are imported: the runtime-only loader uses the cache on hosts without
the compiler.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .entry import sha256_file

__all__ = [
    "KEY_RE",
    "canonical_json",
    "check_key",
    "entry_key_problem",
    "jsonable",
    "make_key",
    "source_fingerprint",
]

_KEY_SCHEMA = 1
KEY_RE = re.compile(r"\A[0-9a-f]{64}\Z")  # \Z: "$" would also take a trailing newline


def jsonable(obj: Any, where: str = "$") -> Any:
    """Canonical JSON-compatible copy of ``obj``; TypeError on anything ambiguous."""
    if isinstance(obj, enum.Enum):
        return jsonable(obj.value, where)
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise TypeError(f"{where}: non-finite float {obj!r} cannot be part of a cache key")
        return float(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj), where)
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if isinstance(k, enum.Enum):
                k = k.value
            if not isinstance(k, str):
                raise TypeError(f"{where}: mapping key {k!r} is not a str")
            out[k] = jsonable(v, f"{where}.{k}")
        return out
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(
        f"{where}: {type(obj).__name__} value {obj!r} is not JSON-serializable; "
        "put only str/int/float/bool/None/list/dict (or enums, dataclasses) in a cache key"
    )


def canonical_json(obj: Any) -> str:
    """The canonical JSON text used for keys: sorted keys, no blanks, ASCII, no NaN."""
    return json.dumps(
        jsonable(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


def make_key(config: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of ``config`` and ``fingerprint``.

    ``config`` is ``dataclasses.asdict`` of the frozen kernel config (a
    dataclass instance is also accepted and converted); ``fingerprint`` holds
    the kernel-source hash, DSL / tvm-ffi / package versions and compile
    options — never mtimes, PATH, Python or torch versions.
    """
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping (dataclasses.asdict(cfg)), got {type(config).__name__}")
    if not isinstance(fingerprint, Mapping):
        raise TypeError(f"fingerprint must be a mapping, got {type(fingerprint).__name__}")
    payload = {"schema": _KEY_SCHEMA, "config": config, "fingerprint": fingerprint}
    return hashlib.sha256(canonical_json(payload).encode("ascii")).hexdigest()


def source_fingerprint(
    paths: Iterable[os.PathLike | str], root: os.PathLike | str | None = None
) -> str:
    """sha256 (hex) of the contents of ``paths`` (files, or directories walked
    recursively, skipping ``__pycache__`` and ``*.pyc``), sorted by their path
    relative to ``root`` (default: the common directory of the arguments), so
    the result depends on names and contents only — not on where the checkout
    lives, nor on mtimes or argument order."""
    paths = [Path(p).absolute() for p in paths]
    if not paths:
        raise ValueError("source_fingerprint() needs at least one path")
    files: set[Path] = set()
    anchors: list[str] = []
    for p in paths:
        if p.is_dir():
            anchors.append(str(p))
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
                for fn in filenames:
                    if not fn.endswith((".pyc", ".pyo")):
                        files.add(Path(dirpath) / fn)
        elif p.is_file():
            anchors.append(str(p.parent))
            files.add(p)
        else:
            raise FileNotFoundError(f"source_fingerprint: {p} does not exist")
    base = Path(root).absolute() if root is not None else Path(os.path.commonpath(anchors))
    rel = sorted((f.relative_to(base).as_posix(), f) for f in files)
    h = hashlib.sha256(b"msa-jit-sources-v1\0")
    for name, f in rel:
        digest, size = sha256_file(f)
        h.update(f"{name}\0{size}\0{digest}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def check_key(key: str) -> None:
    """ValueError unless ``key`` is 64 lower-case hex digits (what ``make_key`` returns)."""
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise ValueError(f"invalid cache key {key!r}: expected 64 lower-case hex digits (make_key)")


def entry_key_problem(meta: Mapping[str, Any], key: str) -> str | None:
    """None when ``make_key(meta["config"], meta["fingerprint"]) == key`` (the entry in the
    directory ``key`` was built for what that key names), else why not.

    A mismatch (an entry copied under another key, its ``"key"`` field rewritten) would run a
    kernel built for another geometry or convention, so the entry is never served."""
    config, fp = meta.get("config"), meta.get("fingerprint")
    if not isinstance(config, Mapping) or not isinstance(fp, Mapping):
        return "meta.json has no config / fingerprint object to derive the key from"
    try:
        derived = make_key(config, fp)
    except TypeError as e:
        return f"meta.json's config / fingerprint cannot be keyed ({e})"
    if derived != key:
        return (f"meta.json's config and fingerprint give key {derived[:12]}..., not the directory's "
                f"{key[:12]}... (an entry copied under another key)")
    return None
