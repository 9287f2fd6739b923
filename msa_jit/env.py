"""Every ``MSA_JIT_*`` environment variable, read live.

Each variable is read through a small function that looks at ``os.environ``
on every call: there is no module-level caching and no hidden global state, so
tests (and long-running processes) may change the environment at any time.

Parsing rules (see ``docs/cache.md`` §8):

* an unset or empty variable means "use the default";
* booleans accept ``1/true/yes/on/y/t`` and ``0/false/no/off/n/f`` (any case,
  surrounding blanks ignored); anything else raises ``ValueError``;
* numbers that do not parse, are negative or NaN raise ``ValueError``;
  every error message names the variable.
"""

from __future__ import annotations

import decimal
import logging
import math
import os
import re
from pathlib import Path
from typing import Iterable

__all__ = [
    "CACHE_DIR",
    "NO_COMPILE",
    "CACHE_MAX_BYTES",
    "LOCK_TIMEOUT",
    "ARCH",
    "LOG_LEVEL",
    "DSL_VERSION",
    "DSL_RUNTIME",
    "VLLM_PLUGIN",
    "VLLM_SM100",
    "VARIABLES",
    "DEFAULT_CACHE_MAX_BYTES",
    "DEFAULT_LOCK_TIMEOUT_S",
    "cache_dir",
    "no_compile",
    "cache_max_bytes",
    "lock_timeout_s",
    "target_arch",
    "log_level",
    "dsl_version_override",
    "dsl_runtime",
    "vllm_plugin_enabled",
    "vllm_sm100",
    "parse_arch",
    "parse_size",
    "PARSERS",
    "problems",
    "describe",
]

CACHE_DIR = "MSA_JIT_CACHE_DIR"
NO_COMPILE = "MSA_JIT_NO_COMPILE"
CACHE_MAX_BYTES = "MSA_JIT_CACHE_MAX_BYTES"
LOCK_TIMEOUT = "MSA_JIT_LOCK_TIMEOUT"
ARCH = "MSA_JIT_ARCH"
LOG_LEVEL = "MSA_JIT_LOG_LEVEL"
DSL_VERSION = "MSA_JIT_DSL_VERSION"
DSL_RUNTIME = "MSA_JIT_DSL_RUNTIME"
VLLM_PLUGIN = "MSA_JIT_VLLM_PLUGIN"
VLLM_SM100 = "MSA_JIT_VLLM_SM100"

DEFAULT_CACHE_MAX_BYTES = 2 * 1024**3
DEFAULT_LOCK_TIMEOUT_S = 600.0

# name -> documentation (static data, not state). Order = order in describe().
VARIABLES: dict[str, str] = {
    CACHE_DIR: (
        "Root of the compiled-artifact cache. Default: $XDG_CACHE_HOME/msa-jit, else "
        "~/.cache/msa-jit, else <tmp>/msa-jit-<uid>; an unwritable root falls back to the "
        "per-user temp dir (see docs/cache.md)."
    ),
    NO_COMPILE: (
        "Bool, default 0. Production hosts: a missing artifact raises ArtifactMissingError "
        "instead of compiling (warm the cache with `msa-jit warmup`)."
    ),
    CACHE_MAX_BYTES: (
        "Size cap of the cache, default 2GiB. Bytes, or a number with a binary K/M/G/T/P suffix "
        "(2G = 2 GiB). After a build that exceeds it, least-recently-used entries are pruned."
    ),
    LOCK_TIMEOUT: (
        "Seconds to wait for another process building the same kernel, default 600; "
        "'inf' waits forever, 0 does not wait."
    ),
    ARCH: (
        "Target GPU arch override: sm_90a or sm_100a (the arches msa-jit builds for; '100a' and "
        "'10.0a' spell sm_100a too). Default: detect from the current device."
    ),
    LOG_LEVEL: "Logging level of the msa_jit loggers: debug/info/warning/error/critical or an int. Default warning.",
    DSL_VERSION: (
        "CuTe DSL version to key artifacts with when the DSL's package metadata is absent "
        "(a runtime-only host that has just libcute_dsl_runtime.so, e.g. the GPU bundle). "
        "Set it to the version the cache was warmed with (msa-jit cache list shows it)."
    ),
    DSL_RUNTIME: (
        "Path of libcute_dsl_runtime.so to load artifacts with. Default: found under "
        "nvidia_cutlass_dsl/{cu13,cu12}/lib on sys.path (a pip install or the GPU bundle)."
    ),
    VLLM_PLUGIN: (
        "Bool, default 1. 0 turns the vLLM plugin off: msa_jit.integrations.vllm_plugin.register() patches "
        "nothing (it logs one line saying so)."
    ),
    VLLM_SM100: (
        "Bool, default 0. 1: on compute capability 10.0 (B200) the vLLM plugin also routes MiniMax-M3 "
        "decode through msa-jit; by default vLLM keeps its own fmha_sm100 path there."
    ),
}

_TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE = frozenset({"0", "false", "no", "off", "n", "f"})



def _raw(name: str) -> str | None:
    """The variable's value, or None when it is unset or empty."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value


def parse_bool(value: str | None) -> bool | None:
    """A boolean variable's value as this module reads it: None when unset or empty; ValueError
    when it is not one of 1/true/yes/on or 0/false/no/off (any case)."""
    if value is None or value.strip() == "":
        return None
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{value!r} is not a boolean (use one of 1/true/yes/on or 0/false/no/off)")


def _bool(name: str, default: bool | None = False) -> bool | None:
    try:
        value = parse_bool(os.environ.get(name))
    except ValueError as e:
        raise ValueError(f"{name}={e}") from None
    return default if value is None else value


def cache_dir() -> Path | None:
    """``MSA_JIT_CACHE_DIR`` as an absolute path (``~`` expanded), or None when unset."""
    value = os.environ.get(CACHE_DIR)
    if value is None or value == "":
        return None
    return Path(os.path.abspath(os.path.expanduser(value)))


def no_compile() -> bool:
    """``MSA_JIT_NO_COMPILE``: True on hosts that must never compile."""
    return _bool(NO_COMPILE)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4, "p": 1024**5}
MAX_SIZE = 2**63 - 1  # the largest size accepted (8 EiB): a file size's range


def _shown(text: str, limit: int = 40) -> str:
    """`text` quoted for an error message, cut short when it is long."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def parse_size(text: str) -> int:
    """'2147483648', '512M', '2G', '2GiB', '1.5k' -> bytes (binary suffixes K/M/G/T/P).

    The one size syntax of msa-jit (MSA_JIT_CACHE_MAX_BYTES, `msa-jit cache prune
    --max-bytes`); ValueError naming the text otherwise, and for a size above MAX_SIZE (the
    number is read exactly, however many digits it has: no float overflow).
    """
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(
            f"{_shown(text)} is not a size (expected a non-negative number of "
            "bytes, optionally with a K/M/G/T/P suffix, e.g. 2147483648 or 2G)"
        )
    number, unit, _ = m.groups()
    if unit == "" and m.group(3) is not None and m.group(3).lower() == "ib":
        raise ValueError(f"{_shown(text)} is not a size ('iB' needs a K/M/G/T/P prefix)")
    if len(number.lstrip("0").partition(".")[0]) > 30:  # far above MAX_SIZE, whatever the suffix
        raise ValueError(f"{_shown(text)} is too large a size (at most {MAX_SIZE} bytes, 8 EiB)")
    with decimal.localcontext() as ctx:
        ctx.prec = 60  # exact for every number of <= 30 integer digits times a suffix
        value = decimal.Decimal(number) * _SIZE_MULT[unit.lower()]
    if value > MAX_SIZE:
        raise ValueError(f"{_shown(text)} is too large a size (at most {MAX_SIZE} bytes, 8 EiB)")
    return int(value)


def cache_max_bytes() -> int:
    """``MSA_JIT_CACHE_MAX_BYTES`` in bytes (default 2 GiB). Suffixes are binary."""
    value = _raw(CACHE_MAX_BYTES)
    if value is None:
        return DEFAULT_CACHE_MAX_BYTES
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"{CACHE_MAX_BYTES}={e}") from None


def lock_timeout_s() -> float:
    """``MSA_JIT_LOCK_TIMEOUT`` in seconds (default 600; ``inf`` = wait forever)."""
    value = _raw(LOCK_TIMEOUT)
    if value is None:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        t = float(value.strip())
    except ValueError:
        raise ValueError(
            f"{LOCK_TIMEOUT}={value!r} is not a number of seconds (e.g. 600, 0.5 or inf)"
        ) from None
    if math.isnan(t) or t < 0:
        raise ValueError(f"{LOCK_TIMEOUT}={value!r} must be a non-negative number of seconds")
    return t


_ARCH_SM_RE = re.compile(r"^(?:sm_?)?(\d{2,3})([af]?)$", re.IGNORECASE)
_ARCH_CC_RE = re.compile(r"^(\d{1,2})\.(\d)([af]?)$", re.IGNORECASE)


def parse_arch(text: str) -> str:
    """'sm_100a', 'sm100a', '100a', '10.0a' -> 'sm_100a': the one arch syntax (MSA_JIT_ARCH, --arch).

    ValueError (without a variable name: callers add theirs) when the text is not an arch
    spelling, or names an arch msa-jit does not build for (`geometry.arch_problem`: the list
    is `geometry.DEFAULT_ARCHES`, and what a target without the "a" is).
    """
    from .geometry import DEFAULT_ARCHES, arch_problem  # geometry imports nothing of msa_jit

    v = text.strip()
    m = _ARCH_SM_RE.match(v)
    if m is not None:
        arch = f"sm_{int(m.group(1))}{m.group(2).lower()}"
    elif (m := _ARCH_CC_RE.match(v)) is not None:
        arch = f"sm_{int(m.group(1))}{m.group(2)}{m.group(3).lower()}"
    else:
        raise ValueError(f"{text!r} is not a GPU arch (expected one of {', '.join(DEFAULT_ARCHES)}; "
                         "sm100a, 100a and 10.0a spell sm_100a too)")
    reason = arch_problem(arch)
    if reason:
        raise ValueError(reason)
    return arch


def target_arch() -> str | None:
    """``MSA_JIT_ARCH`` normalized (e.g. ``sm_100a``), or None when unset; ValueError naming the
    variable for a value that is no arch or an arch msa-jit does not build for."""
    value = _raw(ARCH)
    if value is None:
        return None
    try:
        return parse_arch(value)
    except ValueError as e:
        raise ValueError(f"{ARCH}={value!r}: {e}") from None


def dsl_version_override() -> str | None:
    """``MSA_JIT_DSL_VERSION`` stripped, or None when unset/empty."""
    value = _raw(DSL_VERSION)
    return value.strip() if value and value.strip() else None


def dsl_runtime() -> Path | None:
    """``MSA_JIT_DSL_RUNTIME`` as a path (not checked here: the loader says if it is no file), or None."""
    value = os.environ.get(DSL_RUNTIME)
    if value is None or value == "":
        return None
    return Path(value)
def vllm_plugin_enabled() -> bool:
    """``MSA_JIT_VLLM_PLUGIN``: whether the vLLM plugin patches anything (default True)."""
    return _bool(VLLM_PLUGIN, default=True)


def vllm_sm100() -> bool:
    """``MSA_JIT_VLLM_SM100``: route vLLM's SM100 MiniMax-M3 decode through msa-jit (default False)."""
    return _bool(VLLM_SM100)


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


def log_level() -> int:
    """``MSA_JIT_LOG_LEVEL`` as a ``logging`` level int (default ``logging.WARNING``)."""
    value = _raw(LOG_LEVEL)
    if value is None:
        return logging.WARNING
    v = value.strip().lower()
    if v in _LEVELS:
        return _LEVELS[v]
    try:
        level = int(v)
    except ValueError:
        raise ValueError(
            f"{LOG_LEVEL}={value!r} is not a log level (debug/info/warning/error/critical or an int)"
        ) from None
    if level < 0:
        raise ValueError(f"{LOG_LEVEL}={value!r} must be a non-negative int")
    return level


# variable -> the function of this module that parses it (doctor shows its value or its error)
PARSERS: dict[str, str] = {
    CACHE_DIR: "cache_dir", NO_COMPILE: "no_compile", CACHE_MAX_BYTES: "cache_max_bytes",
    LOCK_TIMEOUT: "lock_timeout_s", ARCH: "target_arch",
    LOG_LEVEL: "log_level", DSL_VERSION: "dsl_version_override", DSL_RUNTIME: "dsl_runtime",
    VLLM_PLUGIN: "vllm_plugin_enabled", VLLM_SM100: "vllm_sm100",
}


def problems(names: Iterable[str] | None = None) -> list[str]:
    """The error message of every variable (of `names`, default all) whose value does not parse."""
    out = []
    for name in VARIABLES if names is None else names:
        try:
            globals()[PARSERS[name]]()
        except ValueError as e:
            out.append(str(e))
    return out


def describe() -> list[tuple[str, str | None, str]]:
    """``(name, raw value or None when unset, documentation)`` for every variable.

    Values are returned raw (never parsed) so that ``msa-jit doctor`` can show a
    garbage value next to its documentation instead of crashing on it.
    """
    return [(name, os.environ.get(name), doc) for name, doc in VARIABLES.items()]
