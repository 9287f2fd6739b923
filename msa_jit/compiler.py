"""Compile driver: one registry from arch to kernel class, one compile path, one cache.

`compile_sparse_decode(config, out_dir)` traces the CuTe DSL kernel against the fake
arguments of its calling convention (kernels/convention.py: symbolic T / pages / batch, so
they stay out of the key), for the arch named in the config (no GPU needed), exports it
through TVM-FFI and links a shared object, with the options the convention names; those
steps and the config -> constructor mapping are kernels/build.py's, inside the hashed sources.
`get_sparse_decode_kernel(config)` resolves it through the disk cache and loads it with the
runtime only. The cache key is the config plus `fingerprint(config)`: a hash of every kernel
source (the convention included), the kernel family, and the DSL and tvm-ffi versions.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import shutil
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping

from . import cache as _cache
from . import env
from .geometry import (KV_DTYPE_SHORT, Q_DTYPE_SHORT, UNION_CTAS_PER_SM, UNION_PLANNED_CTAS_PER_SM, SparseDecodeConfig,
                       cluster_merge_problems, union_problems)
from .loader import load_artifact

log = logging.getLogger("msa_jit")



def kernels_package():
    """The `msa_jit.kernels` package: kernels/ beside this msa_jit when it runs from a source
    checkout, else the installed one (the wheel's msa_jit/kernels/).

    A checkout's own kernels/ wins over what `import msa_jit.kernels` would find: with an
    editable install of another checkout (a git worktree, a CI copy), setuptools' finder maps
    msa_jit.kernels to that checkout's kernels/, and this checkout's msa_jit would then build,
    hash and test another checkout's kernel sources. Every import of msa_jit.kernels goes
    through here first (compiler, bench/kernel_probes.py, the tests)."""
    import importlib.util
    import sys

    pkg = sys.modules.get("msa_jit.kernels")
    if pkg is not None:
        return pkg
    here = Path(__file__).resolve().parent
    src = here.parent / "kernels"
    checkout = (not (here / "kernels").exists() and (src / "__init__.py").is_file()
                and (src / "convention.py").is_file())  # not some other top-level "kernels" package
    if not checkout:
        try:
            import msa_jit.kernels as pkg

            return pkg
        except ImportError:
            raise ImportError("msa_jit.kernels is not importable: reinstall msa-jit") from None
    spec = importlib.util.spec_from_file_location(
        "msa_jit.kernels", src / "__init__.py", submodule_search_locations=[str(src)]
    )
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["msa_jit.kernels"] = pkg
    spec.loader.exec_module(pkg)
    setattr(sys.modules[__package__], "kernels", pkg)
    return pkg


def kernels_dir() -> Path:
    """Where the kernel sources live (their content is part of every cache key)."""
    return Path(list(kernels_package().__path__)[0])


@dataclass(frozen=True)
class KernelFamily:
    """One registered kernel class and the occupancies it can be built for."""

    module: str  # in msa_jit.kernels
    class_name: str
    # SparseDecodeConfig.ctas_per_sm values; the class's occupancy_options(n, q_dtype) gives the
    # constructor options of each build (docs/performance.md #29 measured them)
    occupancies: tuple[int, ...] = (2,)
    # ctas_per_sm, or (arch, ctas_per_sm) where an arch differs, or (arch, ctas_per_sm, q_dtype)
    # where a query dtype does -> local-memory instructions (LDL + STL) in the decode kernel's SASS
    # that were measured and accepted; `msa-jit inspect` flags more as a spill (default: none)
    accepted_local_ops: Mapping[Any, int] = field(default_factory=dict)


# arch family -> kernel. The portable mma.sync kernel serves every arch; arch-specialized
# kernels register here and must beat it to be chosen.
KERNEL_REGISTRY: dict[str, KernelFamily] = {
    # sm_90a: no local memory in any build since session 10 (every 3-per-SM build had 5-15 LDL/STL
    # before: the fp8-query builds' K now read per k-step pair); sm_100a's 3-per-SM bf16-query builds
    # keep one loop-carried word there (5 LDL/STL); the sm_100a build never ran on hardware
    "portable": KernelFamily("sparse_decode_mma", "SparseDecodeMmaKernel", (2, 3),
                             accepted_local_ops={("sm_100a", 3): 6}),
    # the cluster build of the fp8 cache (SparseDecodeConfig.split_merge == "cluster", page 128): the portable
    # kernel with P V split by head dims, no 4-warp reduction of O (docs/performance.md rows 89-90)
    "portable_dims": KernelFamily("sparse_decode_dims", "SparseDecodeDimsKernel", (2,)),
    # tcgen05 kernel: compiles and its SASS is checked in CI, never run on hardware yet, so
    # kernel_family() picks it only with MSA_JIT_ENABLE_SM100_UMMA=1 on sm_100*.
    "sm100": KernelFamily("sparse_decode_sm100", "SparseDecodeSm100Kernel", (2,)),
    # SparseDecodeConfig.kernel == "union" (sm_90a, fp8 cache): verified on the H200; the planner picks it
    # by planner.choose_kernel's rule (MSA_JIT_ENABLE_SM90_UNION)
    "union_sm90": KernelFamily("sparse_decode_union_sm90", "SparseDecodeUnionSm90Kernel", UNION_CTAS_PER_SM),
}


def kernel_family(config: SparseDecodeConfig) -> str:
    """Which registered kernel serves this config (see KERNEL_REGISTRY): its `kernel` and arch, and for
    the token kernel's cluster build (split_merge="cluster") its cache format and page size."""
    if config.kernel == "union":
        return "union_sm90"
    if (config.arch.startswith("sm_100") and env.enable_sm100_umma() and config.kv_dtype == "float8_e4m3fn"
            and "sm100" in KERNEL_REGISTRY):  # the tcgen05 kernel reads fp8 caches only
        return "sm100"
    if config.split_merge == "cluster" and config.kv_dtype == "float8_e4m3fn" and config.page_size == 128:
        return "portable_dims"
    return "portable"


def supported_ctas_per_sm(arch: str, kernel: str = "token") -> tuple[int, ...]:
    """The occupancies the `kernel` ("token" or "union") serving `arch` can be built for, ascending
    (the planner's choice)."""
    family = kernel_family(SparseDecodeConfig(1, 1, arch=arch, kernel=kernel))
    return tuple(sorted(KERNEL_REGISTRY[family].occupancies))


def accepted_local_ops(config: SparseDecodeConfig) -> int:
    """LDL + STL instructions the decode kernel built for `config` may have without being a regression."""
    accepted = KERNEL_REGISTRY[kernel_family(config)].accepted_local_ops
    for key in ((config.arch, config.ctas_per_sm, config.q_dtype), (config.arch, config.ctas_per_sm),
                config.ctas_per_sm):
        if key in accepted:
            return accepted[key]
    return 0


def union_configs(config: SparseDecodeConfig) -> list[SparseDecodeConfig]:
    """The union kernel's builds of `config`'s geometry, query dtype and arch (every occupancy), or
    none where it cannot serve it (geometry.union_problems: sm_90a, an fp8 cache, ...)."""
    if union_problems(num_q_heads=config.num_q_heads, num_kv_heads=config.num_kv_heads,
                      page_size=config.page_size, kv_dtype=config.kv_dtype, arch=config.arch):
        return []
    return [replace(config, kernel="union", split_merge="kernel", ctas_per_sm=n)
            for n in supported_ctas_per_sm(config.arch, "union")]


def cluster_merge_configs(config: SparseDecodeConfig) -> list[SparseDecodeConfig]:
    """The token kernel's builds of `config`'s geometry, dtypes and arch that merge the KV splits in a
    cluster (geometry.cluster_merge_problems), or none where that cannot be built."""
    token = replace(config, kernel="token", split_merge="cluster")
    return [replace(token, ctas_per_sm=n) for n in supported_ctas_per_sm(config.arch)
            if not cluster_merge_problems(kernel="token", ctas_per_sm=n, arch=config.arch)]


def warmed_union_ctas_per_sm(arch: str | None, flag: bool | None) -> tuple[int, ...]:
    """The union kernel's occupancies a warmup builds (and selftest checks) for MSA_JIT_ENABLE_SM90_UNION's
    value `flag` (env.enable_sm90_union): none for False, the planner's (UNION_PLANNED_CTAS_PER_SM) when
    unset (None), every one for True (a pin may take any)."""
    if flag is False:
        return ()
    return tuple(n for n in supported_ctas_per_sm(arch, "union") if flag or n == UNION_PLANNED_CTAS_PER_SM)


def plannable_configs(config: SparseDecodeConfig) -> list[SparseDecodeConfig]:
    """`config` at every occupancy the planner may pick for its arch (what a warmup builds), and
    the union kernel's builds where the planner may pick it (unset: its planned occupancy, 2 CTAs per SM;
    MSA_JIT_ENABLE_SM90_UNION=1: both, as a pin may take 1; 0: none), and the
    cluster split merge's where it may (MSA_JIT_ENABLE_CLUSTER_MERGE, on unless set to 0)."""
    token = replace(config, kernel="token", split_merge="kernel")
    out = [replace(token, ctas_per_sm=n) for n in supported_ctas_per_sm(config.arch)]
    union_ctas = warmed_union_ctas_per_sm(config.arch, env.enable_sm90_union())
    out += [c for c in union_configs(config) if c.ctas_per_sm in union_ctas]
    if env.enable_cluster_merge():
        out += cluster_merge_configs(config)
    return out


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
    return sorted(kernels_dir().glob("*.py"))


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


def fingerprint(config: SparseDecodeConfig) -> dict[str, str]:
    """What, besides the config, decides the artifact's bytes (never Python/torch versions).

    kernel_sources hashes every file of the kernels package: the kernels, their PTX helpers,
    and kernels/convention.py (arguments, fake arguments, compile / export / link options).
    """
    return {
        "kernel_sources": _sources_hash(),
        "kernel_family": kernel_family(config),
        "cutlass_dsl": dsl_version(),
        "tvm_ffi": tvm_ffi_version(),
    }


def cache_key(config: SparseDecodeConfig) -> str:
    return _cache.make_key(config.to_dict(), fingerprint(config))


def _kernel_class(family: str):
    import importlib

    # Our cache is the only one: the DSL's own file cache (in /tmp) would be a second,
    # unmanaged layer. Takes effect when this process imports cutlass for the first time.
    os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
    entry = KERNEL_REGISTRY[family]
    kernels_package()
    module = importlib.import_module(f"msa_jit.kernels.{entry.module}")
    return getattr(module, entry.class_name)


def convention():
    """kernels/convention.py: the calling convention every artifact is built for."""
    import importlib

    kernels_package()
    return importlib.import_module("msa_jit.kernels.convention")


def _build_module():
    """kernels/build.py: the hashed steps that turn a config into an artifact."""
    import importlib

    kernels_package()
    return importlib.import_module("msa_jit.kernels.build")


def fake_arguments(config: SparseDecodeConfig) -> list[Any]:
    """Fake tensors and scalars of the calling convention (kernels/convention.py)."""
    return convention().fake_arguments(config)


def _linker() -> str:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    raise RuntimeError("no C compiler/linker (cc, gcc or clang) found to link the exported kernel; set CC")


def compile_sparse_decode(config: SparseDecodeConfig, out_dir: str | os.PathLike,
                          kernel_options: dict[str, Any] | None = None,
                          kernel_class: type | None = None) -> dict[str, Any]:
    """Compile + export + link one geometry into out_dir/sparse_decode.so. Needs the DSL, not a GPU.

    The steps themselves are kernels/build.py's (hashed: editing them changes every key); this
    picks the class and the host's linker. kernel_options / kernel_class: extra constructor
    arguments of the kernel class, or another class (a bench-side probe subclass,
    bench/kernel_probes.py), for experiments (bench/variants.py); the cache never passes
    either, so cached artifacts are the shipped kernels.
    """
    from .geometry import check_config

    reason = check_config(config)
    if reason:
        raise ValueError(f"cannot compile {config}: {reason}")
    os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")  # see _kernel_class
    family = kernel_family(config)
    kernel = make_kernel(config, kernel_options, kernel_class)
    seconds = _build_module().build(kernel, config, out_dir, _linker())
    # the caller publishes out_dir (a temporary build dir) into the cache: ensure_compiled logs the path
    return {
        "artifacts": [convention().ARTIFACT_NAME],
        # the decode kernel's launch figures, for cluster_launch_fits on hosts without the compiler
        "extra": {"kernel_family": family, "compile_s": round(seconds["compile_s"], 3),
                  "total_s": round(seconds["total_s"], 3), "smem_bytes": kernel.smem_bytes(),
                  "threads": kernel.threads},
    }


def make_kernel(config: SparseDecodeConfig, kernel_options: dict[str, Any] | None = None,
                kernel_class: type | None = None) -> Any:
    """The kernel object `compile_sparse_decode` traces for `config` (imports the DSL): the
    registered class of its family (or `kernel_class`) built by kernels/build.py's make_kernel."""
    family = kernel_family(config)
    occupancies = KERNEL_REGISTRY[family].occupancies
    if config.ctas_per_sm not in occupancies:
        raise ValueError(f"cannot compile {config}: the {family} kernel has no build for "
                         f"{config.ctas_per_sm} CTAs per SM (it has {sorted(occupancies)})")
    cls = kernel_class or _kernel_class(family)
    return _build_module().make_kernel(cls, config, kernel_options)


def dynamic_smem_bytes(config: SparseDecodeConfig) -> int:
    """Dynamic shared memory the decode kernel of `config` is launched with (kernel.smem_bytes():
    its shared-storage struct, and a cluster merge's receive buffer). Imports the DSL; the split
    merge kernel takes none."""
    from .geometry import check_config

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
    """The `msa-jit warmup` line that builds exactly this config (used in error messages): a union or
    cluster-merge build behind the environment variable that makes a warmup build it."""
    q = Q_DTYPE_SHORT.get(config.q_dtype, config.q_dtype)
    kv = KV_DTYPE_SHORT.get(config.kv_dtype, config.kv_dtype)
    flags = ((f"{env.ENABLE_SM90_UNION}=1 " if config.kernel == "union" else "")
             + (f"{env.ENABLE_CLUSTER_MERGE}=1 " if config.split_merge == "cluster" else ""))
    cmd = (f"{flags}msa-jit warmup --heads {config.num_q_heads}/{config.num_kv_heads} --q-dtype {q} --kv-dtype {kv} "
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

            n = max_active_clusters(entry.artifact_path(convention().ARTIFACT_NAME), num_splits,
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
    fn, seconds = load_artifact(entry.artifact_path(convention().ARTIFACT_NAME))
    log.debug("msa-jit loaded %s in %.1f ms", entry.path, seconds * 1e3)
    return fn
