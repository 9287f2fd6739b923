"""Which kernel class serves a config, and which builds the planner may pick.

One entry per kernel family: its class (imported on first use by a static import, so a
runtime-only host that never compiles never imports the DSL) and the occupancies it can be
built for. The planner, warmup, selftest and inspect ask here; the compiler only builds
what it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from ..geometry import (CTAS_PER_SM, UNION_CTAS_PER_SM, UNION_PLANNED_CTAS_PER_SM, SparseDecodeConfig,
                        cluster_merge_problems, union_problems)
from ..kernels.constants import FP8_KV


def _token_kernel() -> type:
    from ..kernels.token import SparseDecodeTokenKernel

    return SparseDecodeTokenKernel


def _token_dims_kernel() -> type:
    from ..kernels.token_dims import SparseDecodeTokenDimsKernel

    return SparseDecodeTokenDimsKernel


def _union_kernel() -> type:
    from ..kernels.union import SparseDecodeUnionKernel

    return SparseDecodeUnionKernel


@dataclass(frozen=True)
class KernelFamily:
    """One registered kernel class and the occupancies it can be built for."""

    module: str  # its file in msa_jit/kernels/ (what `inspect` names a DSL kernel symbol by)
    load: Callable[[], type]
    # SparseDecodeConfig.ctas_per_sm values; the class's occupancy_options(n, q_dtype) gives the
    # constructor options of each build
    occupancies: tuple[int, ...] = (2,)
    # ctas_per_sm, or (arch, ctas_per_sm) where an arch differs, or (arch, ctas_per_sm, q_dtype)
    # where a query dtype does -> local-memory instructions (LDL + STL) in the decode kernel's SASS
    # that were measured and accepted; `msa-jit inspect` flags more as a spill (default: none)
    accepted_local_ops: Mapping[Any, int] = field(default_factory=dict)


# family -> kernel class. The token kernel serves every arch and both cache formats.
KERNEL_REGISTRY: dict[str, KernelFamily] = {
    # sm_90a builds use no local memory; sm_100a's 3-per-SM bf16-query builds keep one loop-carried
    # word there (the sm_100a builds are compiled and SASS-checked, never run on hardware)
    "token": KernelFamily("token", _token_kernel, CTAS_PER_SM, accepted_local_ops={("sm_100a", 3): 6}),
    # the token kernel's cluster build for the fp8 cache (split_merge "cluster", page 128): P V split
    # by head dims, so no cross-warp reduction of O before the cluster merge
    "token_dims": KernelFamily("token_dims", _token_dims_kernel, (2,)),
    # SparseDecodeConfig.kernel == "union" (sm_90a, fp8 cache); the planner picks it by
    # planner.choose_kernel's rule
    "union": KernelFamily("union", _union_kernel, UNION_CTAS_PER_SM),
}


def kernel_family(config: SparseDecodeConfig) -> str:
    """Which registered kernel serves this config (see KERNEL_REGISTRY): its `kernel` and arch, and for
    the token kernel's cluster build (split_merge="cluster") its cache format and page size."""
    if config.kernel == "union":
        return "union"
    if config.split_merge == "cluster" and config.kv_dtype == FP8_KV and config.page_size == 128:
        return "token_dims"
    return "token"


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


def plannable_configs(config: SparseDecodeConfig) -> list[SparseDecodeConfig]:
    """`config` at every build a planner without pins may pick for its arch (what a warmup builds):
    the token kernel at each occupancy, the union kernel at its planned one (2 CTAs per SM; a
    ctas_per_sm=1 pin compiles its build on first use) where it serves the geometry, and the
    cluster split merge's builds where they can be built."""
    token = replace(config, kernel="token", split_merge="kernel")
    out = [replace(token, ctas_per_sm=n) for n in supported_ctas_per_sm(config.arch)]
    out += [c for c in union_configs(config) if c.ctas_per_sm == UNION_PLANNED_CTAS_PER_SM]
    out += cluster_merge_configs(config)
    return out


