"""Whether this GPU can co-schedule a thread-block cluster of a compiled decode kernel.

The cluster split merge (`split_merge="cluster"`, kernels/cluster_merge.py) launches the
num_splits CTAs of a (token, KV head) as one (1, 1, num_splits) cluster: 16 CTAs at batch 1, a
non-portable size that one GPC must hold at once. A full H100 / H200 can; a smaller partition
(a MIG slice) may not, and there the launch would fail. `max_active_clusters` asks the driver
(`cuOccupancyMaxActiveClusters`) with the artifact's own decode kernel, its block size and its
dynamic shared memory, so the plan can keep the merge kernel instead (plan.resolve_kernel).

Runtime only: cuda-python's driver bindings and the artifact's embedded cubin (msa_jit.sass reads
it from the ELF), never the DSL compiler.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from . import sass

__all__ = ["decode_kernel_name", "max_active_clusters"]


def decode_kernel_name(cubin: bytes) -> str:
    """The symbol of a decode kernel in an artifact's cubin (not the split merge's)."""
    names = [r.name for r in sass.kernel_resources(cubin) if "merge" not in r.name.lower()]
    if not names:
        raise ValueError("the cubin holds no decode kernel")
    return names[0]


def _ok(result: Any) -> Any:
    """The value of a cuda-python driver call's (CUresult, value...) tuple; RuntimeError on an error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {int(err)} ({err})")
    return rest[0] if len(rest) == 1 else (tuple(rest) or None)


def max_active_clusters(artifact: str | os.PathLike, cluster_size: int, threads: int, smem_bytes: int,
                        device_index: int, driver: Any = None) -> int:
    """How many (1, 1, cluster_size) clusters of the artifact's decode kernel, `threads` per CTA and
    `smem_bytes` of dynamic shared memory each, device `device_index` can hold at once (0: none,
    the launch would fail). `driver`: cuda.bindings.driver (tests pass a stand-in)."""
    if driver is None:
        from cuda.bindings import driver
    (cubin,) = sass.extract_cubins(artifact)
    name = decode_kernel_name(cubin)
    dev = _ok(driver.cuDeviceGet(device_index))
    ctx = _ok(driver.cuDevicePrimaryCtxRetain(dev))
    _ok(driver.cuCtxPushCurrent(ctx))
    try:
        image = ctypes.create_string_buffer(cubin)  # alive across the load: the driver reads its address
        module = _ok(driver.cuModuleLoadData(ctypes.addressof(image)))
        try:
            fn = _ok(driver.cuModuleGetFunction(module, name.encode()))
            attr = driver.CUfunction_attribute
            _ok(driver.cuFuncSetAttribute(fn, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes))
            _ok(driver.cuFuncSetAttribute(fn, attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = 1, 1, cluster_size
            config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
            config.sharedMemBytes = smem_bytes
            cluster = driver.CUlaunchAttribute()
            cluster.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            value = driver.CUlaunchAttributeValue()
            value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = 1, 1, cluster_size
            cluster.value = value
            config.attrs = [cluster]
            config.numAttrs = 1
            return int(_ok(driver.cuOccupancyMaxActiveClusters(fn, config)))
        finally:
            _ok(driver.cuModuleUnload(module))
    finally:
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(dev)
