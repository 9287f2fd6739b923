"""Plans: per-step metadata and workspaces of the sparse decode op, cached per shape key.

A plan is built once per key (batch, qlen, block_table.stride(0), Hq, Hkv, page_size,
topk_blocks, device); a later `prepare` with the same key returns the same plan object
whose tensors keep their addresses (CUDA-graph replay), after refreshing `kv_lens` and
`qo_offset` in place from the device `seq_lens` with one Triton launch (no host sync, no
allocation; eagerly it is replayed from a CUDA graph captured once per seq_lens address,
`prologue.replay_from_graphs`, inside a caller's capture launched as is). `seq_lens_cpu`, when given, is checked on every call (a scan of the CPU copy:
0 <= length <= the block table's capacity).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any, Mapping

import torch

from .geometry import (CLUSTER_MERGE_CTAS_PER_SM, CTAS_PER_SM, HEAD_DIM, KERNELS, MAX_CLUSTER_SPLITS, SPLIT_MERGES, UNION_CTAS_PER_SM, UNION_PLANNED_CTAS_PER_SM, UNION_ROWS, SparseDecodeConfig, arch_problem, check_config, cluster_merge_problems, device_arch, union_problems)
from .kernels.constants import FP8_KV, KV_DTYPES, NVFP4_KV
from .plan import LaunchChoice, PlanKey, SparseDecodePlan
from .validation import validate_prepare, validate_prepare_tensors, validate_seq_lens_cpu, validate_seq_lens_values

__all__ = [
    "DEFAULT_NUM_SMS",
    "SparseDecodePlanner",
    "choose_ctas_per_sm",
    "choose_kernel",
    "choose_num_splits",
    "choose_union_ctas_per_sm",
    "choose_split_merge",
    "takes_cluster_merge",
    "union_grid_ctas",
    "default_planner",
    "prepare",
]

# SM count assumed for plans on non-CUDA devices (H100/H200: 132), so CPU plans look like GPU ones.
DEFAULT_NUM_SMS = 132
# Target number of CTA waves when the (token, KV head) grid alone does not fill the GPU (the split
# count of the union kernel's grid, and of the token kernel's smallest grids).
TARGET_WAVES = 2
# The token kernel's fewer, longer splits where T*Hkv fills a good part of the GPU (docs/performance.md
# and its split-count A/B, H200 and H100): ONE split above this fraction of the SMs per cache
# format.
ONE_SPLIT_FILL = {"float8_e4m3fn": 1 / 2, "nvfp4": 0.7}
# Below it, the cache formats whose split steps fill ONE wave of CTAs merged in the cluster: the largest
# power-of-two split count (at most geometry.MAX_CLUSTER_SPLITS) whose grid is at most one CTA per SM (with the dims-split cluster build, 3-15% per layer faster than two waves and the merge kernel at
# T*Hkv = 12-40 on an H100).
CLUSTER_WAVE_FORMATS = ("float8_e4m3fn",)
# Within that wave, fewer and longer splits where the grid stays at least SPLIT_MIN_CTAS CTAs and a split
# holds at most SPLIT_MAX_BLOCKS blocks: each CTA's later blocks then arrive while it computes the earlier
# ones, and the merge takes fewer partials. Measured on an H100 beside FlashInfer (bench/results/
# plan-sweep-h100.json): T*Hkv = 16 at 4 splits 1.8-8.0% faster than at 8 (6 points, 4 geometries), T*Hkv
# = 8 at 8 splits 3.7% faster than at 16; 48 CTAs (T*Hkv = 12 at 4) and 8 blocks a split (T*Hkv = 32 at 2)
# were slower.
SPLIT_MIN_CTAS = 64
SPLIT_MAX_BLOCKS = 4
_Tensor, _I32 = torch.Tensor, torch.int32


def _plan_key(block_table: torch.Tensor, seq_lens: torch.Tensor, qlen: int, num_q_heads: int,
              num_kv_heads: int, page_size: int, topk_blocks: int) -> PlanKey:
    """The planner cache key of a prepare() call (same order as SparseDecodePlan.key)."""
    return (seq_lens.shape[0], qlen, block_table.stride(0), num_q_heads, num_kv_heads,
            page_size, topk_blocks, seq_lens.device)


def _normalized(splits: int, topk_blocks: int) -> int:
    """`splits` made the count that gives every split ceil(topk_blocks / splits) slots (none empty for a full row)."""
    per_split = -(-topk_blocks // splits)
    return max(1, -(-topk_blocks // per_split))


def choose_num_splits(num_rows_heads: int, topk_blocks: int, num_sms: int, kv_dtype: str = "float8_e4m3fn",
                      kernel: str = "token", cluster_merge: bool = True) -> int:
    """Split-KV factor in [1, topk_blocks] for a grid of `num_rows_heads` = T*Hkv CTAs per split
    (the union kernel's grid for kernel="union").

    1 when T*Hkv already fills the GPU (>= num_sms). The token kernel also runs unsplit above
    ONE_SPLIT_FILL of the SMs (fp8: half, NVFP4: 0.7): measured on the H200 and H100 (docs/performance.md
    "How many splits"), one CTA per (token, head) streaming its 16 blocks beats the 3-4 splits of two waves by 8-20%
    per layer there. Below that an fp8 cache (CLUSTER_WAVE_FORMATS) takes one wave of splits merged in
    the cluster when the cluster merge can take them (`cluster_merge`: the 2-CTA build on an arch that
    has it, the merge not turned off): a power of two with T*Hkv*splits <= num_sms, the fewest that keep
    at least SPLIT_MIN_CTAS CTAs of at most SPLIT_MAX_BLOCKS blocks each, at most topk_blocks and
    MAX_CLUSTER_SPLITS, when it stays a power of two once normalized (on 132 SMs with 16 blocks: 16
    splits at T*Hkv <= 7, 8 at 8-15, 4 at 16-33, 2 at 34-66), which beat the two-wave plans by
    4-13% at T*Hkv = 48-64 and, with the dims-split cluster build, by 3-15% at 12-40;
    two splits merged by the merge kernel were 0.94-1.19x (NVFP4's heavier math per block wants the 3-CTA
    build's warps longer, and its cluster build keeps the key split). Otherwise the smallest factor
    giving about TARGET_WAVES waves (T*Hkv*splits >= 2*num_sms), capped at topk_blocks. The count is then
    normalized so every split gets ceil(topk_blocks/splits) slots and none is empty for a full row.
    """
    if kv_dtype not in ONE_SPLIT_FILL:
        raise ValueError(f"kv_dtype {kv_dtype!r} not in {tuple(ONE_SPLIT_FILL)}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} not in {KERNELS}")
    topk_blocks = max(1, int(topk_blocks))
    num_rows_heads = max(1, int(num_rows_heads))
    num_sms = max(1, int(num_sms))
    if num_rows_heads >= num_sms:
        return 1
    if kernel == "token":
        if num_rows_heads > ONE_SPLIT_FILL[kv_dtype] * num_sms:
            return 1
        if cluster_merge and kv_dtype in CLUSTER_WAVE_FORMATS:  # num_sms // num_rows_heads >= 2 here
            one_wave = 1 << ((num_sms // num_rows_heads).bit_length() - 1)
            enough_ctas = _pow2_at_least(-(-SPLIT_MIN_CTAS // num_rows_heads))
            short_splits = _pow2_at_least(-(-topk_blocks // SPLIT_MAX_BLOCKS))
            splits = _normalized(min(one_wave, max(enough_ctas, short_splits), topk_blocks, MAX_CLUSTER_SPLITS),
                                 topk_blocks)
            if splits & (splits - 1) == 0:  # else (a topk that is no power of two) it may not merge in the cluster
                return splits
    return _normalized(min(topk_blocks, -(-TARGET_WAVES * num_sms // num_rows_heads)), topk_blocks)


def _pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def choose_ctas_per_sm(grid_ctas: int, num_sms: int, supported: tuple[int, ...] = (2,),
                       kv_dtype: str = "float8_e4m3fn") -> int:
    """Occupancy of the kernel for a grid of `grid_ctas` = T*Hkv*num_splits CTAs and a cache format.

    fp8: 3 per SM (2 stages each) when the grid is more than one CTA per SM and fits one wave at 3
    per SM, else 2 (3 stages each). Measured on the H200 (docs/performance.md): 3 per SM is
    0.7-1.6 us faster at 256 CTAs and 7-15% at 320-384 (one wave instead of 1.2-1.5), equal at
    64, 12-15% slower at 512 (1.3 waves) and 2-4% at 1024. NVFP4 (its 18 KiB pages leave room for
    3 stages at 3 per SM; its conversions make a CTA latency-bound, so more warps win): 3 per SM
    whenever the grid is more than one CTA per SM (11% faster at 1024 CTAs, 4-12% at 256),
    2 below (equal at 64). `supported`: what the arch's kernel can be built for
    (registry.supported_ctas_per_sm).
    """
    if 3 in supported and num_sms < grid_ctas and (kv_dtype == "nvfp4" or grid_ctas <= 3 * num_sms):
        return 3
    return 2 if 2 in supported else min(supported)


def union_grid_ctas(batch: int, qlen: int, num_q_heads: int, num_kv_heads: int) -> int:
    """CTAs of the union kernel per split: B * Hkv * ceil(qlen / (UNION_ROWS // G)) (a CTA serves a
    tile of UNION_ROWS // G consecutive query tokens of one request and KV head)."""
    tile_tokens = UNION_ROWS // (num_q_heads // num_kv_heads)
    return batch * num_kv_heads * -(-qlen // tile_tokens)


# the planner's union rule takes grids that fill at least this share of one wave at the union's
# occupancy (docs/performance.md: the union kernel's band)
UNION_WAVE_FILL = 0.95


def choose_kernel(batch: int, qlen: int, num_q_heads: int, num_kv_heads: int, page_size: int,
                  arch: str | None, num_sms: int, drafts_share_blocks: bool = False) -> str:
    """SparseDecodeConfig.kernel for an fp8 cache: "union" where the union kernel serves the geometry
    on `arch`, qlen >= 2 and the rule below takes the step; else "token". The rule: where one tile holds
    a request's draft (qlen <= UNION_ROWS // G: 4 at G = 16, 8 at G = 8) and the grid is one wave at the
    union's occupancy, filled to UNION_WAVE_FILL (251-264 CTAs on 132 SMs). With `drafts_share_blocks`
    (the caller knows its draft tokens pick mostly the same blocks, as MTP drafts do): wherever its grid
    fills the GPU once (>= num_sms CTAs).

    Why one full wave: a union CTA reads every block of its tile's tokens, so a partial wave costs a
    whole CTA's time. With no block shared (which a plan cannot see) the union is 0.94-0.99x the token
    kernel at one full wave on the H200 (64/4 B=64, 16/1 and 8/1 B=256, qlen 2-8), but 1.04-1.05x at four
    waves (64/4 B=256), and on an H100 1.03-1.10x at 0.73-0.85 of a wave, 0.99-1.02x at 0.91-0.94
    (0.99-1.003x from 0.95) and 1.16-1.25x just past one (the H200 1.32-1.52x); with two tiles per
    request (qlen 8 at G = 16) 1.1-1.45x at every grid. With 12/16 blocks shared it reads 44% of the
    bytes: 64/4 B=64 qlen 4 at 64.0 us against 93.1 on the H200 (docs/performance.md)."""
    if qlen < 2 or union_problems(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                                      page_size=page_size, kv_dtype="float8_e4m3fn", arch=arch):
        return "token"
    grid = union_grid_ctas(batch, qlen, num_q_heads, num_kv_heads)
    if drafts_share_blocks:
        return "union" if grid >= num_sms else "token"
    wave = choose_union_ctas_per_sm(grid, num_sms) * num_sms
    one_tile = qlen <= UNION_ROWS // (num_q_heads // num_kv_heads)
    return "union" if one_tile and UNION_WAVE_FILL * wave <= grid <= wave else "token"


def choose_union_ctas_per_sm(grid_ctas: int, num_sms: int) -> int:
    """Occupancy of the union kernel for `grid_ctas` = its grid * num_splits: 2 (one MMA warpgroup and
    2 stages per CTA) at every grid. Measured on the H200 (docs/performance.md): the 2-CTA build beat the 1-CTA one (2 MMA warpgroups, 4 stages) at
    every point, 256 to 1024 CTAs, 12/16 or 0/16 shared, both query dtypes: by 4-20%."""
    return UNION_PLANNED_CTAS_PER_SM


def choose_split_merge(num_splits: int, ctas_per_sm: int, kernel: str, arch: str | None, enabled: bool) -> str:
    """SparseDecodeConfig.split_merge of one cache format's build: "cluster" when `enabled`
    (the planner's default rule, or a pin), the step splits (num_splits > 1) and the build
    can merge inside the decode launch (geometry.cluster_merge_problems: the token kernel at 2 CTAs
    per SM on sm_90a); else "kernel". One-split steps keep the plain build: nothing to merge.
    With 16 topk blocks on an H100 / H200 (132 SMs) a split step runs at 2 CTAs per SM when
    T*Hkv <= 8 (16 splits: clusters of 16 CTAs, a non-portable size the DSL allows on every kernel;
    Hopper schedules it within one GPC) and, with an fp8 cache, at every split step (one wave of 2-16
    splits, choose_num_splits).
    The planner's default asks for it (`enabled`) only where the grid is at most one CTA per SM, so a
    ctas_per_sm=2 pin at a larger grid keeps the merge kernel; a split_merge="cluster" pin does not.

    On by default: on an H100 every point it is picked for ran 2.6-9.1% faster per layer, and the
    batch-1 op call is one launch instead of two (docs/performance.md)."""
    if not enabled or num_splits < 2 or cluster_merge_problems(kernel=kernel, ctas_per_sm=ctas_per_sm, arch=arch):
        return "kernel"
    return "cluster"


def takes_cluster_merge(num_rows_heads: int, num_splits: int, num_sms: int) -> bool:
    """Whether the planner's default asks for the cluster merge for the
    token kernel's grid of `num_rows_heads` = T*Hkv CTAs per split: where the step splits and the split
    grid is at most one CTA per SM (on 132 SMs every fp8 split step, choose_num_splits' one wave, and
    NVFP4's at T*Hkv <= 8 with 16 splits), where it measured faster. A ctas_per_sm=2
    pin at a larger split grid keeps the merge kernel, measured 1.6-3.5 us faster there (a
    cluster waits for a GPC with enough free SMs); `choose_split_merge` then decides whether the build can."""
    return num_splits > 1 and num_rows_heads * num_splits <= num_sms


@functools.lru_cache(maxsize=None)
def _cuda_num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _device_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_NUM_SMS


def workspace_rows(num_tokens: int, num_kv_heads: int, num_splits: int) -> int:
    """Rows of a plan's split-KV workspace (partial_o, partial_lse): T * Hkv * num_splits, or one row when no
    cache format's launch splits, which never touches it (an engine holds a plan per CUDA-graph batch size:
    full-size rows there came to ~0.3 GiB for 64/4 over vLLM's capture sizes)."""
    return num_tokens * num_kv_heads * num_splits if num_splits > 1 else 1


def workspace_bytes(num_tokens: int, num_q_heads: int, num_kv_heads: int, num_splits: int) -> int:
    """Bytes a plan allocates for T = num_tokens (kv_lens, qo_offset, partial_o, partial_lse,
    lse_scratch, unit_scale: the shapes of SparseDecodePlan's fields)."""
    g = num_q_heads // num_kv_heads
    rows = workspace_rows(num_tokens, num_kv_heads, num_splits)
    return 4 * (2 * num_tokens + rows * g * HEAD_DIM + rows * g + num_tokens * num_q_heads + 1)


def _memory_bytes(device: torch.device) -> int | None:
    """Total memory of `device` (a CUDA GPU's, or the host's RAM for CPU plans); None if unknown."""
    try:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return int(torch.cuda.get_device_properties(index).total_memory)
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError):
        pass
    return None


def check_workspace(num_tokens: int, num_q_heads: int, num_kv_heads: int, num_splits: int,
                    device: torch.device) -> None:
    """ValueError naming batch*qlen and the bytes when a plan's workspace exceeds the device's memory
    (checked before anything is allocated: the allocator's own error names neither)."""
    need = workspace_bytes(num_tokens, num_q_heads, num_kv_heads, num_splits)
    have = _memory_bytes(device)
    if have is not None and need > have:
        raise ValueError(
            f"seq_lens: batch*qlen = {num_tokens} tokens need a plan workspace of {need} bytes "
            f"({need / 2**30:.1f} GiB: partial_o [T*Hkv*num_splits, G, {HEAD_DIM}] fp32 and the rest), "
            f"more than {device}'s {have} bytes; split the batch"
        )


def _ctas_per_sm_allowed(ctas_per_sm: Any, kernel: str | None) -> tuple[int, ...] | None:
    """The occupancies the `kernel`'s builds have when `ctas_per_sm` is not one of them (None when it is).
    type() is int: 2.0 == 2 and True == 1 would pass `in` and reach a launch as a float or bool."""
    allowed = UNION_CTAS_PER_SM if kernel == "union" else CTAS_PER_SM
    return None if type(ctas_per_sm) is int and ctas_per_sm in allowed else allowed


def _checked_pins(launches: Mapping[str, LaunchChoice] | None, kernel: str | None, ctas_per_sm: int | None,
                  split_merge: str | None) -> dict[str, LaunchChoice]:
    """SparseDecodePlanner's `launches` pins as a dict, checked as far as no geometry is needed."""
    if not launches:
        return {}
    if kernel is not None or ctas_per_sm is not None or split_merge is not None:
        raise ValueError("launches pins whole launches: give it without kernel=, ctas_per_sm= or split_merge=")
    out = dict(launches)
    for fmt, pin in out.items():
        if fmt not in KV_DTYPES:
            raise ValueError(f"launches: cache format {fmt!r} is not one of {KV_DTYPES}")
        if not isinstance(pin, LaunchChoice):
            raise ValueError(f"launches[{fmt!r}]: expected a LaunchChoice, got {type(pin).__name__}")
        if type(pin.num_splits) is not int or pin.num_splits < 1:
            raise ValueError(f"launches[{fmt!r}]: num_splits must be an int >= 1, got {pin.num_splits!r}")
        # what needs no arch nor geometry is checked here, so a planner without an arch (a CPU plan) refuses
        # the pins a CUDA one would; the rest waits for the first prepare (_check_pin)
        if pin.kernel not in KERNELS:
            raise ValueError(f"launches[{fmt!r}]: kernel must be one of {KERNELS}, got {pin.kernel!r}")
        if pin.split_merge not in SPLIT_MERGES:
            raise ValueError(f"launches[{fmt!r}]: split_merge must be one of {SPLIT_MERGES}, got {pin.split_merge!r}")
        allowed = _ctas_per_sm_allowed(pin.ctas_per_sm, pin.kernel)
        if allowed is not None:
            raise ValueError(f"launches[{fmt!r}]: ctas_per_sm must be one of {allowed} for the {pin.kernel} kernel, "
                             f"got {pin.ctas_per_sm!r}")
    return out


def _check_pin(fmt: str, pin: LaunchChoice, hq: int, hkv: int, page: int, topk_blocks: int, arch: str | None) -> None:
    """ValueError when a pinned launch cannot serve this geometry: its build (check_config, where the
    arch is known) or more splits than blocks (a split would get none)."""
    if pin.num_splits > topk_blocks:
        raise ValueError(f"launches[{fmt!r}]: num_splits={pin.num_splits} > topk_blocks={topk_blocks}")
    if arch is None:
        return
    why = check_config(SparseDecodeConfig(hq, hkv, page_size=page, topk_blocks=topk_blocks, kv_dtype=fmt, arch=arch,
                                          ctas_per_sm=pin.ctas_per_sm, kernel=pin.kernel, split_merge=pin.split_merge))
    if why:
        raise ValueError(f"launches[{fmt!r}] = {pin.describe()}: {why}")


class SparseDecodePlanner:
    """Cache of SparseDecodePlan per key; `prepare` is called once per decode step.

    num_sms: SM count used by `choose_num_splits` / `choose_ctas_per_sm` (default: the CUDA
    device's, or DEFAULT_NUM_SMS on other devices). arch: target arch for plans on non-CUDA
    devices (CUDA plans use the device's own, e.g. "sm_90a"). ctas_per_sm: pin the kernel's
    occupancy (2 or 3 for the token kernel, 1 or 2 for the union kernel) instead of choosing it per
    step shape. kernel: pin the fp8 cache's kernel ("token" or "union", KERNELS) instead of
    `choose_kernel` (None: its rule, and no union under a ctas_per_sm pin); a union pin serves every
    step shape, qlen 1 and split grids included, and raises ValueError at the first prepare of a
    geometry it cannot serve. drafts_share_blocks: the caller's draft tokens (decode_query_len >= 2)
    pick mostly the same blocks, as MTP drafts do: the union kernel then also takes partial and
    several waves and longer drafts, where reading a shared block once pays for the lost wave (up to
    1.5x slower where drafts share no block). split_merge: "cluster" merges the KV splits inside the
    decode launch wherever `choose_split_merge` allows it, "kernel" never; None: "cluster" where
    `takes_cluster_merge` (a split grid of at most one CTA per SM). launches: cache format ->
    LaunchChoice, the whole launch of that format pinned as given at every step shape (a plan A/B
    times the builds the rules did not pick this way); not with the kernel, ctas_per_sm or
    split_merge pins. A "cluster" pin at one split runs the cluster build's plain launch; a pin
    whose build cannot serve the geometry or arch, or with more splits than topk_blocks, raises
    ValueError at the first prepare of that geometry.
    """

    def __init__(self, *, num_sms: int | None = None, arch: str | None = None,
                 ctas_per_sm: int | None = None, kernel: str | None = None, split_merge: str | None = None,
                 drafts_share_blocks: bool = False, launches: Mapping[str, LaunchChoice] | None = None) -> None:
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"kernel must be None or one of {KERNELS}, got {kernel!r}")
        if split_merge is not None and split_merge not in SPLIT_MERGES:
            raise ValueError(f"split_merge must be None or one of {SPLIT_MERGES}, got {split_merge!r}")
        allowed = None if ctas_per_sm is None else _ctas_per_sm_allowed(ctas_per_sm, kernel)
        if allowed is not None:
            raise ValueError(f"ctas_per_sm must be None or one of {allowed}"
                             f"{' for the union kernel' if kernel == 'union' else ''}, got {ctas_per_sm!r}")
        if num_sms is not None and (type(num_sms) is not int or num_sms < 1):
            raise ValueError(f"num_sms must be None or an int >= 1, got {num_sms!r}")
        if arch is not None and arch_problem(arch):
            raise ValueError(f"arch: {arch_problem(arch)}")
        if type(drafts_share_blocks) is not bool:
            raise TypeError(f"drafts_share_blocks must be True or False, got {drafts_share_blocks!r}")
        self.plans: dict[PlanKey, SparseDecodePlan] = {}
        self.num_sms = num_sms
        self.arch = arch
        self.ctas_per_sm = ctas_per_sm
        self.kernel = kernel
        self.split_merge = split_merge
        self.drafts_share_blocks = drafts_share_blocks
        self.launches = _checked_pins(launches, kernel, ctas_per_sm, split_merge)
        self._lock = threading.Lock()

    def prepare(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor | None,
        decode_query_len: int,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        page_size: int,
        topk_blocks: int,
    ) -> SparseDecodePlan:
        """Plan of one decode step (cached per key) with kv_lens / qo_offset refreshed in place.

        block_table: [B, max_blocks] int32 (stride(1) == 1); seq_lens: [B] int32 contiguous on the
        same device (counts the qlen new tokens); seq_lens_cpu: optional CPU copy of seq_lens,
        its values checked on every call (0 <= length <= max_blocks * page_size; a CUDA
        seq_lens never is: that would sync; a CPU one is, and must equal seq_lens_cpu);
        decode_query_len: qlen in 1..32.

        The plan of a key is one object, refreshed in place (its tensors keep their addresses for CUDA
        graphs): a second prepare of the same shape changes the plan the first one returned. Plans of one
        shape that must live at once (two micro-batches) need a planner each.
        """
        key: PlanKey | None = None
        plan = None
        # Fast path (a cached step): the ints are exactly those of a validated key and the tensors
        # pass validate_prepare_tensors' checks, spelled out here in one pass of attribute reads
        # (the key's batch >= 1 and device stand for theirs): ~2 us less per step than calling
        # it. Anything else goes through the full validation, which names the problem.
        if (type(decode_query_len) is int and type(num_q_heads) is int and type(num_kv_heads) is int
                and type(page_size) is int and type(topk_blocks) is int
                and type(seq_lens) is _Tensor and type(block_table) is _Tensor):
            sl_shape, bt_shape = seq_lens.shape, block_table.shape
            if len(sl_shape) == 1 and len(bt_shape) == 2:
                batch, device, bt_stride = sl_shape[0], seq_lens.device, block_table.stride()
                key = (batch, decode_query_len, bt_stride[0], num_q_heads, num_kv_heads,
                       page_size, topk_blocks, device)  # _plan_key's order
                plan = self.plans.get(key)
        if plan is not None:
            cpu_dtype = seq_lens_cpu.dtype if type(seq_lens_cpu) is _Tensor else None
            if not (seq_lens.dtype is _I32 and block_table.dtype is _I32 and bt_shape[0] == batch
                    and bt_shape[1] >= 1 and (bt_shape[1] == 1 or bt_stride[1] == 1)
                    and (batch == 1 or seq_lens.stride(0) == 1) and block_table.device == device
                    and (seq_lens_cpu is None or ((cpu_dtype is _I32 or cpu_dtype is torch.int64)
                                                  and seq_lens_cpu.is_cpu and seq_lens_cpu.shape == sl_shape))):
                validate_prepare_tensors(block_table, seq_lens, seq_lens_cpu)
            if seq_lens_cpu is not None:
                validate_seq_lens_cpu(seq_lens_cpu, block_table, page_size)
        else:
            validate_prepare(
                block_table, seq_lens, seq_lens_cpu, decode_query_len,
                num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                page_size=page_size, topk_blocks=topk_blocks,
            )
            if seq_lens_cpu is not None:
                validate_seq_lens_cpu(seq_lens_cpu, block_table, page_size)
            if key is None:
                key = _plan_key(block_table, seq_lens, decode_query_len, num_q_heads, num_kv_heads,
                                page_size, topk_blocks)
            plan = self._get_or_build(key, block_table, seq_lens)
        if not plan.is_cuda:  # values a CUDA plan cannot read without a sync
            validate_seq_lens_values(seq_lens, seq_lens_cpu, block_table, page_size)
        # object.__setattr__: past the plan's read-only-field guard (neither field is read-only), ~0.15 us a step
        object.__setattr__(plan, "block_table", block_table)
        object.__setattr__(plan, "seq_lens", seq_lens)
        plan.refresh(seq_lens)
        return plan

    def _get_or_build(self, key: PlanKey, block_table: torch.Tensor, seq_lens: torch.Tensor) -> SparseDecodePlan:
        with self._lock:
            plan = self.plans.get(key)
            if plan is None:
                # on the plan's GPU: the build launches the prologue (Triton launches on the current
                # device), and a process may serve several GPUs (its current device another one)
                on_device = torch.cuda.device(key[-1]) if key[-1].type == "cuda" else contextlib.nullcontext()
                with torch.no_grad(), on_device:
                    plan = self._build(key, block_table, seq_lens)
                self.plans[key] = plan
        return plan

    def _build(self, key: PlanKey, block_table: torch.Tensor, seq_lens: torch.Tensor) -> SparseDecodePlan:
        batch, qlen, stride, hq, hkv, page, topk_blocks, device = key
        T = batch * qlen
        G = hq // hkv
        num_sms = self.num_sms if self.num_sms is not None else _device_num_sms(device)
        arch = device_arch(device) if device.type == "cuda" else self.arch
        kernel = self.kernel
        if kernel is None:
            kernel = "token" if self.ctas_per_sm is not None else choose_kernel(
                batch, qlen, hq, hkv, page, arch, num_sms, self.drafts_share_blocks)
        elif kernel == "union":
            problems = union_problems(num_q_heads=hq, num_kv_heads=hkv, page_size=page,
                                      kv_dtype="float8_e4m3fn", arch=arch)
            if problems:
                raise ValueError(f"SparseDecodePlanner(kernel='union'): {'; '.join(problems)}")
        # a split count per cache format (an NVFP4 cache is always the token kernel's): the union's grid
        # where it serves fp8, which splits only when pinned below one wave
        grid = union_grid_ctas(batch, qlen, hq, hkv) if kernel == "union" else T * hkv
        from .jit.registry import supported_ctas_per_sm

        supported = supported_ctas_per_sm(arch) if arch is not None else CTAS_PER_SM
        pin = self.ctas_per_sm
        # the split merge in the cluster: unless pinned to the merge kernel
        cluster_on = self.split_merge != "kernel"
        # can a split grid of at most one CTA per SM (the 2-CTA build's) merge in the cluster here?
        cluster_ok = choose_split_merge(2, CLUSTER_MERGE_CTAS_PER_SM if pin is None else pin, "token", arch,
                                        cluster_on) == "cluster"
        splits = choose_num_splits(grid, topk_blocks, num_sms, kernel=kernel, cluster_merge=cluster_ok)
        nvfp4_splits = choose_num_splits(T * hkv, topk_blocks, num_sms, "nvfp4", cluster_merge=cluster_ok)
        if kernel == "union":
            ctas_per_sm = pin if pin is not None else choose_union_ctas_per_sm(grid * splits, num_sms)
        elif pin is None:
            ctas_per_sm = choose_ctas_per_sm(T * hkv * splits, num_sms, supported)
        elif pin in supported:
            ctas_per_sm = pin
        else:
            raise ValueError(f"ctas_per_sm={pin}: the kernel for {arch} is built for {supported} only")
        # a token-kernel pin holds for both cache formats
        nvfp4_ctas_per_sm = (pin if pin in supported else
                             choose_ctas_per_sm(T * hkv * nvfp4_splits, num_sms, supported, "nvfp4"))

        def cluster(n: int) -> bool:  # a pin, or the default's rule for a split count n
            return cluster_on and (self.split_merge is not None or takes_cluster_merge(T * hkv, n, num_sms))

        split_merge = choose_split_merge(splits, ctas_per_sm, kernel, arch, cluster(splits))
        nvfp4_split_merge = choose_split_merge(nvfp4_splits, nvfp4_ctas_per_sm, "token", arch, cluster(nvfp4_splits))
        launches = {
            FP8_KV: LaunchChoice(kernel, ctas_per_sm, splits, split_merge),
            # an NVFP4 cache is always the token kernel's
            NVFP4_KV: LaunchChoice("token", nvfp4_ctas_per_sm, nvfp4_splits, nvfp4_split_merge),
        }
        for fmt, pin in self.launches.items():
            _check_pin(fmt, pin, hq, hkv, page, topk_blocks, arch)
            launches[fmt] = pin
        work_splits = max(c.num_splits for c in launches.values())  # one workspace serves both formats
        check_workspace(T, hq, hkv, work_splits, device)
        rows = workspace_rows(T, hkv, work_splits)
        f32 = dict(dtype=torch.float32, device=device)
        try:
            tensors = dict(
                kv_lens=torch.zeros(T, dtype=torch.int32, device=device),
                qo_offset=torch.zeros(T, dtype=torch.int32, device=device),
                partial_o=torch.empty(rows, G, HEAD_DIM, **f32),
                partial_lse=torch.empty(rows, G, **f32),
                lse_scratch=torch.empty(T, hq, **f32),
                unit_scale=torch.ones(1, **f32),
            )
        except RuntimeError as e:  # torch.OutOfMemoryError, the CPU allocator's error
            raise ValueError(
                f"seq_lens: batch*qlen = {T} tokens: the plan workspace of "
                f"{workspace_bytes(T, hq, hkv, work_splits)} bytes could not be allocated on {device} ({e})"
            ) from e
        plan = SparseDecodePlan(
            num_q_heads=hq,
            num_kv_heads=hkv,
            page_size=page,
            topk_blocks=topk_blocks,
            head_dim=HEAD_DIM,
            batch=batch,
            qlen=qlen,
            block_table_stride=stride,
            device=device,
            launches=launches,
            block_table=block_table,
            seq_lens=seq_lens,
            arch=arch,
            **tensors,
        )
        from .prologue import bind_refresh  # imports triton: only once a plan is built

        plan.refresh = bind_refresh(seq_lens, plan.kv_lens, plan.qo_offset, qlen)
        return plan

    def clear(self) -> None:
        """Forget every cached plan (their tensors are freed once no one references them)."""
        with self._lock:
            self.plans.clear()


_default_planner: SparseDecodePlanner | None = None
_default_lock = threading.Lock()


def default_planner() -> SparseDecodePlanner:
    """The process-wide planner used by `msa_jit.prepare`, created on first use."""
    global _default_planner
    if _default_planner is None:
        with _default_lock:
            if _default_planner is None:
                _default_planner = SparseDecodePlanner()
    return _default_planner


def prepare(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor | None,
    decode_query_len: int,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    topk_blocks: int,
) -> SparseDecodePlan:
    """`SparseDecodePlanner.prepare` on the shared `default_planner()` (created lazily).

    Plans are cached for the life of the process, one per step shape, refreshed in place by each
    prepare of that shape; use your own SparseDecodePlanner to control their lifetime or to hold two
    plans of one shape at once.
    """
    return default_planner().prepare(
        block_table, seq_lens, seq_lens_cpu, decode_query_len,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        page_size=page_size, topk_blocks=topk_blocks,
    )
