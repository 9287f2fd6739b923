"""Runtime-only loading of compiled artifacts: `libcute_dsl_runtime.so` + tvm-ffi, never `cutlass`.

A production GPU host needs neither the DSL compiler nor the CUDA toolkit: it loads the
shared objects that `msa-jit warmup` exported (on any machine, GPU or not).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .. import env

RUNTIME_LIB = "libcute_dsl_runtime.so"
FUNCTION_NAME = "sparse_decode"


def find_runtime_library() -> Path:
    """Locate libcute_dsl_runtime.so where a pip install (or the GPU bundle) puts it.

    Order: $MSA_JIT_DSL_RUNTIME, then nvidia_cutlass_dsl/{cu13,cu12}/lib on sys.path.
    """
    override = env.dsl_runtime()
    if override is not None:
        if not override.is_file():
            raise FileNotFoundError(f"{env.DSL_RUNTIME}={str(override)!r} is not a file")
        return override
    for entry in sys.path:
        for flavor in ("cu13", "cu12"):
            p = Path(entry or ".") / "nvidia_cutlass_dsl" / flavor / "lib" / RUNTIME_LIB
            if p.is_file():
                return p
    raise FileNotFoundError(
        f"{RUNTIME_LIB} not found on sys.path: install nvidia-cutlass-dsl-libs-cu13 (or the full "
        f"nvidia-cutlass-dsl), source the GPU bundle (.gpu-bundle/setup.sh), or set {env.DSL_RUNTIME}"
    )


@functools.lru_cache(maxsize=None)
def load_runtime() -> Path:
    """dlopen the DSL runtime with RTLD_GLOBAL once per process (artifacts resolve against it)."""
    path = find_runtime_library()
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return path


@functools.lru_cache(maxsize=None)
def _load_module(path: str) -> Any:
    import tvm_ffi

    load_runtime()
    return tvm_ffi.load_module(path)


def load_artifact(path: str | os.PathLike, function_name: str = FUNCTION_NAME) -> tuple[Callable, float]:
    """Load an exported kernel; returns (callable, seconds spent loading). Memoized per path."""
    t0 = time.perf_counter()
    module = _load_module(str(Path(path).resolve()))
    fn = module[function_name]
    return fn, time.perf_counter() - t0
