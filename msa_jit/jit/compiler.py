"""Compile driver: one registry from arch to kernel class, one compile path, one cache.

`compile_sparse_decode(config, out_dir)` traces the CuTe DSL kernel against the fake
arguments of its calling convention (msa_jit/kernels/convention.py: symbolic T / pages / batch, so
they stay out of the key), for the arch named in the config (no GPU needed), exports it
through TVM-FFI and links a shared object, with the options the convention names; those
steps and the config -> constructor mapping are msa_jit/kernels/build.py's, inside the hashed sources.
`get_sparse_decode_kernel(config)` resolves it through the disk cache and loads it with the
runtime only. The cache key is the config plus `fingerprint(config)`: a hash of every kernel
source (the convention included), the kernel family, the DSL version and the tvm-ffi C ABI
(`tvm_ffi_abi`: "0.1" for every 0.1.x release, so vLLM's pin and msa-jit's share artifacts).
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping

from . import cache as _cache
from .cache.store import disk_full_errno, disk_full_error
from .. import env
from ..geometry import KV_DTYPE_SHORT, Q_DTYPE_SHORT, SparseDecodeConfig
from ..kernels import build, convention
from .loader import load_artifact
from .registry import KERNEL_REGISTRY, kernel_family

log = logging.getLogger("msa_jit")



def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return "unknown"


def dsl_version() -> str:
    """The CuTe DSL version: package metadata (compiler or runtime libs), else MSA_JIT_DSL_VERSION.

    A runtime-only host (just libcute_dsl_runtime.so, no metadata) must say it explicitly:
    guessing would let artifacts of another DSL version load against this runtime.
    """
    found = _dist_version(
        "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-base"
    )
    if found != "unknown":
        return found
    return env.dsl_version_override() or "unknown"


def kernel_sources() -> list[Path]:
    """Every source that shapes an artifact: the whole kernels package (kernels, their PTX
    helpers, constants, the calling convention and the build steps)."""
    from .. import kernels

    return sorted(Path(kernels.__file__).parent.glob("*.py"))


@lru_cache(maxsize=None)
def _sources_hash() -> str:
    return _cache.source_fingerprint(kernel_sources())


def tvm_ffi_version() -> str:
    """apache-tvm-ffi's version: package metadata, else the module's __version__ (the GPU bundle
    unpacks tvm_ffi without its dist-info), else "unknown"."""
    found = _dist_version("apache-tvm-ffi")
    if found == "unknown":
        try:
            import tvm_ffi

            found = str(getattr(tvm_ffi, "__version__", "unknown"))
        except ImportError:
            pass
    return found


_VERSION_RE = re.compile(r"(\d+)\.(\d+)")


def tvm_ffi_abi(version: str | None = None) -> str:
    """The tvm-ffi C ABI an artifact links against, named by the version (default: the installed
    one, `tvm_ffi_version`): "0.X" while tvm-ffi is at 0.x, whose rule is that a bump of X breaks
    the C ABI and one of the patch level does not; the major version from 1.0 on (semantic
    versioning); the version itself where it does not parse ("unknown" included).

    Not the package version: an artifact's tvm-ffi side is the DSL's generated wrapper (the
    DSL version is in the key) calling three C functions of libtvm_ffi.so (TVMFFIEnvGetStream,
    TVMFFIErrorSetRaisedFromCStr[Parts]), and within 0.1 the C API only grew. vLLM 0.33.0 pins
    0.1.11 and msa-jit 0.1.15.post2: the same artifacts serve both (the same bytes are built under
    either), so a cache warmed beside one is found beside the other. A symbol missing from an
    older 0.X runtime would fail loudly when the artifact is loaded, never run wrong."""
    version = tvm_ffi_version() if version is None else version
    m = _VERSION_RE.match(version)
    if m is None:
        return version
    major, minor = int(m.group(1)), int(m.group(2))
    return f"0.{minor}" if major == 0 else str(major)


def fingerprint(config: SparseDecodeConfig) -> dict[str, str]:
    """What, besides the config, decides the artifact's bytes (never Python/torch versions).

    kernel_sources hashes every file of the kernels package: the kernels, their PTX helpers,
    and msa_jit/kernels/convention.py (arguments, fake arguments, compile / export / link options).
    """
    return {
        "kernel_sources": _sources_hash(),
        "kernel_family": kernel_family(config),
        "cutlass_dsl": dsl_version(),
        "tvm_ffi_abi": tvm_ffi_abi(),
    }


def cache_key(config: SparseDecodeConfig) -> str:
    return _cache.make_key(config.to_dict(), fingerprint(config))


def _kernel_class(family: str):
    # Our cache is the only one: the DSL's own file cache (in /tmp) would be a second,
    # unmanaged layer. Takes effect when this process imports cutlass for the first time.
    os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
    return KERNEL_REGISTRY[family].load()


def fake_arguments(config: SparseDecodeConfig) -> list[Any]:
    """Fake tensors and scalars of the calling convention (msa_jit/kernels/convention.py)."""
    return convention.fake_arguments(config)


def _linker() -> str:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    raise RuntimeError("no C compiler/linker (cc, gcc or clang) found to link the exported kernel; set CC")


def compile_sparse_decode(config: SparseDecodeConfig, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Compile + export + link one geometry into out_dir/sparse_decode.so. Needs the DSL, not a GPU.

    The steps themselves are msa_jit/kernels/build.py's (hashed: editing them changes every key); this
    picks the class and the host's linker.
    """
    from ..geometry import check_config

    reason = check_config(config)
    if reason:
        raise ValueError(f"cannot compile {config}: {reason}")
    os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")  # see _kernel_class
    family = kernel_family(config)
    kernel = make_kernel(config)
    try:
        seconds = build.build(kernel, config, out_dir, _linker())
    except Exception as e:
        # a full disk says "[Errno 28] No space left on device" without a path, or, from the
        # linker, "final link failed: No space left on device": name the two places the build
        # writes (the object and the .so into out_dir, the DSL's and linker's temp files into
        # the temp dir) with their free space
        code = disk_full_errno(e, text=True)
        if code is None:
            raise
        raise disk_full_error(
            e, f"compiling {config.describe()} for {config.arch}",
            [(out_dir, "the build dir: the object file and the linked .so"),
             (tempfile.gettempdir(), "the temp dir of the DSL and the linker, TMPDIR")], code) from e
    # the caller publishes out_dir (a temporary build dir) into the cache: ensure_compiled logs the path
    return {
        "artifacts": [convention.ARTIFACT_NAME],
        # the decode kernel's launch figures, for cluster_launch_fits on hosts without the compiler
        "extra": {"kernel_family": family, "compile_s": round(seconds["compile_s"], 3),
                  "total_s": round(seconds["total_s"], 3), "smem_bytes": kernel.smem_bytes(),
                  "threads": kernel.threads},
    }


def make_kernel(config: SparseDecodeConfig) -> Any:
    """The kernel object `compile_sparse_decode` traces for `config` (imports the DSL): the
    registered class of its family built by msa_jit/kernels/build.py's make_kernel."""
    family = kernel_family(config)
    occupancies = KERNEL_REGISTRY[family].occupancies
    if config.ctas_per_sm not in occupancies:
        raise ValueError(f"cannot compile {config}: the {family} kernel has no build for "
                         f"{config.ctas_per_sm} CTAs per SM (it has {sorted(occupancies)})")
    return build.make_kernel(_kernel_class(family), config)


def dynamic_smem_bytes(config: SparseDecodeConfig) -> int:
    """Dynamic shared memory the decode kernel of `config` is launched with (kernel.smem_bytes():
    its shared-storage struct, and a cluster merge's receive buffer). Imports the DSL; the split
    merge kernel takes none."""
    from ..geometry import check_config

    reason = check_config(config)
    if reason:
        raise ValueError(f"unsupported sparse decode config: {reason}")
    return make_kernel(config).smem_bytes()


def ensure_compiled(config: SparseDecodeConfig, cache: _cache.ArtifactCache | None = None) -> tuple[_cache.CacheEntry, bool]:
    """The cache entry for config, compiling on a miss (or failing fast in no-compile mode)."""
    cache = cache or _cache.default_cache()
    entry, built = cache.get_or_build(
        cache_key(config),
        lambda tmp: compile_sparse_decode(config, tmp),
        config=config.to_dict(),
        fingerprint=fingerprint(config),
        describe=f"{config.describe()} for {config.arch}",
        warmup_hint=warmup_command(config),
    )
    if built:
        seconds = (entry.meta.get("extra") or {}).get("total_s")
        log.info("msa-jit compiled %s for %s in %ss: %s", config.describe(), config.arch,
                 seconds if seconds is not None else "?", entry.path)
    return entry, built


def warmup_command(config: SparseDecodeConfig) -> str:
    """The `msa-jit warmup` line that builds this config (used in error messages): a warmup builds
    every build the planner may pick for a geometry (registry.plannable_configs)."""
    q = Q_DTYPE_SHORT.get(config.q_dtype, config.q_dtype)
    kv = KV_DTYPE_SHORT.get(config.kv_dtype, config.kv_dtype)
    cmd = (f"msa-jit warmup --heads {config.num_q_heads}/{config.num_kv_heads} --q-dtype {q} --kv-dtype {kv} "
           f"--arch {config.arch} --page-size {config.page_size} --topk-blocks {config.topk_blocks}")
    if dsl_version() == "unknown":
        cmd += (f"\n    (this host has no CuTe DSL package metadata: set {env.DSL_VERSION} to the "
                "DSL version the cache was warmed with, e.g. 4.8.1)")
    return cmd


_CLUSTER_FITS: dict[tuple[str, int, int], bool] = {}


def cluster_launch_fits(config: SparseDecodeConfig, num_splits: int, device_index: int) -> bool:
    """Can GPU `device_index` hold a (1, 1, num_splits) cluster of `config`'s decode kernel
    (`cluster_fit.max_active_clusters` > 0)? Cached per artifact, split count and device. True where
    it cannot tell (no driver library, an artifact without its launch figures, a driver
    error: logged), so the launch itself decides, as without the check. Keyed by the artifact's
    cache key, computed without touching the disk: only the first ask per process looks the entry up."""
    key = (cache_key(config), num_splits, device_index)
    if key not in _CLUSTER_FITS:
        entry, _ = ensure_compiled(config)
        extra = entry.meta.get("extra") or {}
        try:
            from .cluster_fit import max_active_clusters

            n = max_active_clusters(entry.artifact_path(convention.ARTIFACT_NAME), num_splits,
                                    int(extra["threads"]), int(extra["smem_bytes"]), device_index)
            log.debug("msa-jit: %d clusters of %d CTAs of %s fit on device %d", n, num_splits, config.describe(),
                      device_index)
            _CLUSTER_FITS[key] = n > 0
        except Exception as e:  # noqa: BLE001 - cannot tell: keep the cluster build
            log.info("msa-jit: cannot ask whether clusters of %d CTAs of %s fit (%s: %s); launching them",
                     num_splits, config.describe(), type(e).__name__, e)
            _CLUSTER_FITS[key] = True
    return _CLUSTER_FITS[key]


def get_sparse_decode_kernel(config: SparseDecodeConfig) -> Callable:
    """A callable taking the calling-convention arguments (docs/design.md), loaded runtime-only."""
    entry, _ = ensure_compiled(config)
    fn, seconds = load_artifact(entry.artifact_path(convention.ARTIFACT_NAME))
    log.debug("msa-jit loaded %s in %.1f ms", entry.path, seconds * 1e3)
    return fn
