"""Whether this GPU can co-schedule a thread-block cluster of a compiled decode kernel.

The cluster split merge (`split_merge="cluster"`, msa_jit/kernels/cluster_merge.py) launches the
num_splits CTAs of a (token, KV head) as one (1, 1, num_splits) cluster: 16 CTAs at batch 1, a
non-portable size that one GPC must hold at once. A full H100 / H200 can (14 at a time on an H100,
2026-12-05); a smaller partition (a MIG slice) may not, and there the launch would fail.
`max_active_clusters` asks the driver (`cuOccupancyMaxActiveClusters`) with the artifact's own
decode kernel, its block size and its dynamic shared memory, so the plan can keep the merge kernel
instead (plan.resolve_kernel).

Runtime only: the driver library through ctypes (cuda-python's bindings resolve every entry point
on first use, which compute-sanitizer reports as 34 API errors) and the artifact's embedded cubin
(msa_jit.jit.sass reads it from the ELF), never the DSL compiler.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

from . import sass

__all__ = ["LaunchConfig", "decode_kernel_name", "max_active_clusters"]

# cuda.h
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue: a 64-byte union
    _fields_ = [("pad", ctypes.c_char * 64), ("clusterDim", _Dim3)]


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _libcuda() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def decode_kernel_name(cubin: bytes) -> str:
    """The symbol of a decode kernel in an artifact's cubin (not the split merge's)."""
    names = [r.name for r in sass.kernel_resources(cubin) if "merge" not in r.name.lower()]
    if not names:
        raise ValueError("the cubin holds no decode kernel")
    return names[0]


def _ok(name: str, code: int) -> None:
    if code != 0:
        raise RuntimeError(f"{name} failed: CUDA driver error {code}")


def max_active_clusters(artifact: str | os.PathLike, cluster_size: int, threads: int, smem_bytes: int,
                        device_index: int, lib: Any = None) -> int:
    """How many (1, 1, cluster_size) clusters of the artifact's decode kernel, `threads` per CTA and
    `smem_bytes` of dynamic shared memory each, device `device_index` can hold at once (0: none,
    the launch would fail). `lib`: the driver library (tests pass a stand-in)."""
    cu = _libcuda() if lib is None else lib
    (cubin,) = sass.extract_cubins(artifact)
    name = decode_kernel_name(cubin)
    _ok("cuInit", cu.cuInit(0))
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _ok("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), device_index))
    _ok("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    try:
        _ok("cuCtxPushCurrent", cu.cuCtxPushCurrent_v2(ctx))
        try:
            image = ctypes.create_string_buffer(cubin)  # alive across the load: the driver reads its address
            module, fn = ctypes.c_void_p(), ctypes.c_void_p()
            _ok("cuModuleLoadData", cu.cuModuleLoadData(ctypes.byref(module), image))
            try:
                _ok("cuModuleGetFunction", cu.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()))
                _ok("cuFuncSetAttribute", cu.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                                smem_bytes))
                _ok("cuFuncSetAttribute", cu.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
                attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
                attr.value.clusterDim = _Dim3(1, 1, cluster_size)
                config = LaunchConfig(gridDimX=1, gridDimY=1, gridDimZ=cluster_size, blockDimX=threads, blockDimY=1,
                                      blockDimZ=1, sharedMemBytes=smem_bytes, hStream=None,
                                      attrs=ctypes.pointer(attr), numAttrs=1)
                count = ctypes.c_int()
                _ok("cuOccupancyMaxActiveClusters",
                    cu.cuOccupancyMaxActiveClusters(ctypes.byref(count), fn, ctypes.byref(config)))
                return int(count.value)
            finally:
                cu.cuModuleUnload(module)
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cu.cuDevicePrimaryCtxRelease_v2(dev)
