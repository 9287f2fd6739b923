"""Static geometry of the sparse decode operator: what a compiled kernel depends on.

`SparseDecodeConfig` is the (frozen) description of one kernel specialization; the artifact
cache key is derived from `SparseDecodeConfig.to_dict()`. `check_config` / `supports` say
whether the kernel design can serve a geometry (and why not).

This module imports only torch (lazily, for the dtype helpers), never triton or cutlass.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .kernels.constants import HEAD_DIM, KV_DTYPES, MAX_CLUSTER_SPLITS, MAX_GROUP_SIZE, MAX_TOPK, UNION_ROWS

if TYPE_CHECKING:  # pragma: no cover
    import torch

PAGE_SIZES = (64, 128)
DEFAULT_PAGE_SIZE = 128
DEFAULT_TOPK_BLOCKS = 16
MIN_TOPK = 1
MIN_QLEN = 1
MAX_QLEN = 32
Q_DTYPES = ("bfloat16", "float8_e4m3fn")
OUT_DTYPES = ("bfloat16",)
# short names of the query dtypes and of the KV cache formats (CLI flags, tables, JSON "q" / "kv")
Q_DTYPE_SHORT = {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}
KV_DTYPE_SHORT = {"float8_e4m3fn": "fp8", "nvfp4": "nvfp4"}
DEFAULT_ARCH = "sm_90a"
# The arches this package builds for (the only ones check_config / supports / MSA_JIT_ARCH /
# --arch accept), and what a warmup builds when neither MSA_JIT_ARCH nor a local GPU says
# (H100/H200, B200). The "a" is the arch-specific feature set the kernels need.
DEFAULT_ARCHES = ("sm_90a", "sm_100a")
# (Hq, Hkv) of every MiniMax-M3 attention layout: the warmup preset, the selftest and bench grids
MINIMAX_M3_GEOMETRIES = ((64, 4), (32, 2), (16, 1), (8, 1))
# CTAs per SM a kernel can be built for: 2 (the default) or 3 (for grids of one wave at 3 per SM;
# the planner picks, see planner.choose_ctas_per_sm)
CTAS_PER_SM = (2, 3)
# SparseDecodeConfig.kernel: how the work is cut. "token": one CTA per (query token, KV head, split),
# every arch (msa_jit/kernels/token.py). "union": one CTA per (request, KV head, tile of
# UNION_ROWS // G consecutive query tokens, split) over the union of the tile's blocks,
# each block read once (msa_jit/kernels/union.py: sm_90a, fp8 cache, decode_query_len >= 2;
# the planner's where one tile holds a request's draft, planner.choose_kernel)
KERNELS = ("token", "union")
UNION_ARCHES = ("sm_90a",)
UNION_PAGE_SIZES = (128,)  # a stage is one 128-key TMA box of K and one of V
# tiles of 8 or 4 tokens: a smaller group's union lists (64 / G tokens x topk blocks) leave some
# builds over an SM's shared memory (G 4: topk > 16 at 2 CTAs per SM; G 2 at every topk), and
# G 1's 64-token tiles overflow the kernel's 32-bit token masks
UNION_GROUP_SIZES = (8, 16)
UNION_CTAS_PER_SM = (1, 2)  # 2 MMA warpgroups and 4 stages per CTA, or 1 warpgroup and 2 stages
# the union's occupancy the planner picks (planner.choose_union_ctas_per_sm); 1 only by a pin
UNION_PLANNED_CTAS_PER_SM = 2
# SparseDecodeConfig.split_merge: how a step's KV splits are merged. "kernel": by the split merge
# kernel launched after the decode kernel (msa_jit/kernels/split_merge.py), every build. "cluster": inside
# the decode launch, the split CTAs of a (token, KV head) being one thread-block cluster
# (msa_jit/kernels/cluster_merge.py; a split factor whose rows do not fit its receive buffer still
# launches the merge kernel): the token kernel's 2-CTA build on CLUSTER_MERGE_ARCHES; the planner's
# default there (planner.choose_split_merge), SparseDecodePlanner(split_merge="kernel") turns it off
SPLIT_MERGES = ("kernel", "cluster")
CLUSTER_MERGE_ARCHES = ("sm_90a",)
CLUSTER_MERGE_CTAS_PER_SM = 2  # its 8 KiB receive buffer fits beside 3 stages at 2 CTAs per SM, not at 3
_ARCH_RE = re.compile(r"sm_(\d+)([af]?)")


# ----------------------------------------------------------------------------- dtypes
def dtype_name(dtype: Any) -> str:
    """Canonical string name of a torch dtype (or pass a known name through).

    torch.bfloat16 -> "bfloat16", torch.float8_e4m3fn -> "float8_e4m3fn"; a string is
    returned unchanged (after stripping a "torch." prefix).
    """
    if isinstance(dtype, str):
        return dtype[len("torch."):] if dtype.startswith("torch.") else dtype
    import torch

    if isinstance(dtype, torch.dtype):
        return str(dtype)[len("torch."):]
    raise TypeError(f"expected a torch.dtype or a dtype name, got {type(dtype).__name__}")


def torch_dtype(name: Any) -> "torch.dtype":
    """Map a dtype name ("bfloat16", "float8_e4m3fn", ...) to the torch dtype."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    attr = dtype_name(name)
    dt = getattr(torch, attr, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt


def device_arch(device: Any) -> str:
    """Target arch string of a CUDA device: (9, 0) -> "sm_90a", (10, 0) -> "sm_100a", (8, 0) -> "sm_80".

    The "a" (arch-specific features) suffix is used from SM90 on.
    """
    import torch

    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def arch_problem(arch: Any) -> str | None:
    """None when msa-jit builds for `arch` (one of DEFAULT_ARCHES), else why not, listing them.

    `arch` is the canonical spelling ("sm_90a"). A target without the "a" of a supported GPU
    ("sm_90", "sm_100f") is refused with what it is: the baseline (or family) target, code
    without the arch-specific feature set that also runs on later GPUs. msa-jit builds, keys
    and tests the "a" targets only (the sm_100a tcgen05 kernel needs them); a GPU of compute
    capability 9.0 runs sm_90a code.
    """
    supported = ", ".join(DEFAULT_ARCHES)
    m = _ARCH_RE.fullmatch(arch) if isinstance(arch, str) else None
    if m is None:
        return f"arch must be one of {supported}, got {arch!r}"
    if arch in DEFAULT_ARCHES:
        return None
    number, suffix = m.groups()
    if f"sm_{number}a" in DEFAULT_ARCHES:
        what = "family" if suffix == "f" else "baseline"
        return (f"arch {arch!r} is the {what} target of compute capability {number[:-1]}.{number[-1]}, "
                "without the arch-specific ('a') feature set; msa-jit builds for the arch-specific "
                f"targets only ({supported}): use sm_{number}a")
    return f"arch {arch!r} is not one msa-jit builds for: it builds for {supported}"


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class SparseDecodeConfig:
    """Everything a compiled sparse decode kernel is specialized on.

    Runtime sizes (T, P, B, max_blocks, qlen, num_splits) are not part of it. ctas_per_sm:
    the occupancy the kernel is built for (one of CTAS_PER_SM, or of UNION_CTAS_PER_SM for the
    union kernel; the planner picks it per step shape, and the compiler maps it to the kernel
    class's options). kernel: one of KERNELS, how the work is cut into CTAs. split_merge: one of
    SPLIT_MERGES, how a step's KV splits are merged ("cluster": the token kernel's 2-CTA build on
    CLUSTER_MERGE_ARCHES only).
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int = HEAD_DIM
    page_size: int = DEFAULT_PAGE_SIZE
    topk_blocks: int = DEFAULT_TOPK_BLOCKS
    q_dtype: str = "bfloat16"
    kv_dtype: str = "float8_e4m3fn"
    out_dtype: str = "bfloat16"
    arch: str = DEFAULT_ARCH
    ctas_per_sm: int = 2
    kernel: str = "token"
    split_merge: str = "kernel"

    @property
    def group_size(self) -> int:
        """Query heads per KV head (G = Hq // Hkv)."""
        return self.num_q_heads // self.num_kv_heads if self.num_kv_heads else 0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (the cache key is derived from this, nothing else)."""
        return asdict(self)

    def describe(self) -> str:
        """Short human description (without the arch), e.g. for logs and cache-miss messages."""
        return (
            f"sparse_decode Hq={self.num_q_heads} Hkv={self.num_kv_heads} (G={self.group_size}) "
            f"D={self.head_dim} page={self.page_size} topk_blocks={self.topk_blocks} q={self.q_dtype} "
            f"kv={self.kv_dtype} out={self.out_dtype} ctas/SM={self.ctas_per_sm}"
            + (f" kernel={self.kernel}" if self.kernel != "token" else "")
            + (f" split_merge={self.split_merge}" if self.split_merge != "kernel" else "")
        )

    def validate(self) -> "SparseDecodeConfig":
        """Raise ValueError with `check_config`'s reason if the design cannot serve this config."""
        reason = check_config(self)
        if reason is not None:
            raise ValueError(f"unsupported sparse decode config: {reason}")
        return self


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def geometry_problems(
    *,
    num_q_heads: Any,
    num_kv_heads: Any,
    page_size: Any,
    topk_blocks: Any,
    head_dim: Any = HEAD_DIM,
) -> list[tuple[str, str]]:
    """List of (field, reason) for every head/page/topk rule the kernel design violates.

    Field names are the SparseDecodeConfig field names, which are also the parameter names
    of `supports`, `prepare` and the engine adapter; a rule between two of them names both
    ("num_q_heads / num_kv_heads"), since either may be the wrong one.
    """
    out: list[tuple[str, str]] = []
    for name, val in (
        ("num_q_heads", num_q_heads),
        ("num_kv_heads", num_kv_heads),
        ("page_size", page_size),
        ("topk_blocks", topk_blocks),
        ("head_dim", head_dim),
    ):
        if not _is_int(val):
            out.append((name, f"{name} must be an int, got {type(val).__name__}"))
    if out:
        return out
    if head_dim != HEAD_DIM:
        out.append(("head_dim", f"head_dim must be {HEAD_DIM}, got {head_dim}"))
    if page_size not in PAGE_SIZES:
        out.append(("page_size", f"page_size must be one of {PAGE_SIZES}, got {page_size}"))
    if not MIN_TOPK <= topk_blocks <= MAX_TOPK:
        out.append(("topk_blocks", f"topk_blocks must be in {MIN_TOPK}..{MAX_TOPK}, got {topk_blocks}"))
    if num_q_heads < 1:
        out.append(("num_q_heads", f"num_q_heads must be >= 1, got {num_q_heads}"))
    if num_kv_heads < 1:
        out.append(("num_kv_heads", f"num_kv_heads must be >= 1, got {num_kv_heads}"))
    if num_q_heads >= 1 and num_kv_heads >= 1:
        if num_q_heads % num_kv_heads:
            out.append((
                "num_q_heads / num_kv_heads",
                f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})",
            ))
        else:
            g = num_q_heads // num_kv_heads
            if not 1 <= g <= MAX_GROUP_SIZE:
                out.append((
                    "num_q_heads / num_kv_heads",
                    f"group size num_q_heads/num_kv_heads = {num_q_heads}/{num_kv_heads} = {g} "
                    f"must be in 1..{MAX_GROUP_SIZE}",
                ))
    return out


def check_config(cfg: SparseDecodeConfig) -> str | None:
    """None when the kernel design can serve `cfg`, else a human-readable reason."""
    reasons = [r for _, r in geometry_problems(
        num_q_heads=cfg.num_q_heads,
        num_kv_heads=cfg.num_kv_heads,
        page_size=cfg.page_size,
        topk_blocks=cfg.topk_blocks,
        head_dim=cfg.head_dim,
    )]
    if cfg.q_dtype not in Q_DTYPES:
        reasons.append(f"q_dtype must be one of {Q_DTYPES}, got {cfg.q_dtype!r}")
    if cfg.kv_dtype not in KV_DTYPES:
        reasons.append(f"kv_dtype must be one of {KV_DTYPES}, got {cfg.kv_dtype!r}")
    if cfg.out_dtype not in OUT_DTYPES:
        reasons.append(f"out_dtype must be {OUT_DTYPES[0]!r}, got {cfg.out_dtype!r}")
    occupancies = UNION_CTAS_PER_SM if cfg.kernel == "union" else CTAS_PER_SM
    if not _is_int(cfg.ctas_per_sm) or cfg.ctas_per_sm not in occupancies:
        reasons.append(f"ctas_per_sm must be one of {occupancies} for the {cfg.kernel!r} kernel, "
                       f"got {cfg.ctas_per_sm!r}")
    arch_reason = arch_problem(cfg.arch)
    if arch_reason:
        reasons.append(arch_reason)
    if cfg.kernel not in KERNELS:
        reasons.append(f"kernel must be one of {KERNELS}, got {cfg.kernel!r}")
    elif cfg.kernel == "union" and not reasons:
        reasons.extend(union_problems(num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                                      page_size=cfg.page_size, kv_dtype=cfg.kv_dtype, arch=cfg.arch))
    if cfg.split_merge not in SPLIT_MERGES:
        reasons.append(f"split_merge must be one of {SPLIT_MERGES}, got {cfg.split_merge!r}")
    elif cfg.split_merge == "cluster":
        reasons.extend(cluster_merge_problems(kernel=cfg.kernel, ctas_per_sm=cfg.ctas_per_sm, arch=cfg.arch))
    return "; ".join(reasons) if reasons else None


def build_suffix(kernel: str = "token", split_merge: str = "kernel") -> str:
    """What a label adds after a build's occupancy: '' for the default build, ' union' for the union
    kernel's, ' cluster merge' for one that merges its splits in a cluster (warmup, doctor, selftest,
    `cache list`, `inspect`)."""
    return (" union" if kernel == "union" else "") + (" cluster merge" if split_merge == "cluster" else "")


def cluster_merge_problems(*, kernel: str, ctas_per_sm: int, arch: str | None) -> list[str]:
    """Why split_merge="cluster" cannot serve a build (empty when it can): the token kernel only, at
    CLUSTER_MERGE_CTAS_PER_SM, on CLUSTER_MERGE_ARCHES."""
    out = []
    if kernel != "token":
        out.append(f"split_merge='cluster' is built into the token kernel only, not {kernel!r}")
    if ctas_per_sm != CLUSTER_MERGE_CTAS_PER_SM:
        out.append(f"split_merge='cluster' needs ctas_per_sm={CLUSTER_MERGE_CTAS_PER_SM} (its receive buffer), "
                   f"not {ctas_per_sm!r}")
    if arch not in CLUSTER_MERGE_ARCHES:
        out.append(f"split_merge='cluster' is built for {CLUSTER_MERGE_ARCHES} only, not {arch!r}")
    return out


def union_problems(*, num_q_heads: int, num_kv_heads: int, page_size: int, kv_dtype: str,
                   arch: str | None) -> list[str]:
    """Why the union kernel cannot serve a geometry the token kernel serves (empty when it can):
    sm_90a only, an fp8 cache, 128-token pages, a group size in UNION_GROUP_SIZES."""
    out = []
    if arch not in UNION_ARCHES:
        out.append(f"the union kernel is built for {UNION_ARCHES} only, not {arch!r}")
    if kv_dtype != "float8_e4m3fn":
        out.append(f"the union kernel reads an fp8 cache only, not {kv_dtype!r}")
    if page_size not in UNION_PAGE_SIZES:
        out.append(f"the union kernel takes page_size {UNION_PAGE_SIZES}, not {page_size}")
    g = num_q_heads // num_kv_heads
    if g not in UNION_GROUP_SIZES:
        out.append(f"the union kernel needs a group size num_q_heads / num_kv_heads in {UNION_GROUP_SIZES}, not {g}")
    return out


# ----------------------------------------------------------------------------- supports()
@dataclass(frozen=True)
class SupportResult:
    """Answer of `supports()`: truthy when supported; `reason` says why not ("" when ok)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def supports(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    topk_blocks: int,
    head_dim: int = HEAD_DIM,
    q_dtype: Any = "bfloat16",
    batch: int | None = None,
    decode_query_len: int | None = None,
    arch: str | None = None,
) -> SupportResult:
    """Whether the sparse decode kernel can serve this geometry (and step shape, if given).

    Parameter names are `prepare`'s. `q_dtype` is a torch dtype or its name. `batch` /
    `decode_query_len` (optional) check the step shape: batch >= 1, 1 <= decode_query_len <=
    MAX_QLEN. Never raises for bad values; it returns the reason.
    """
    try:
        qname = dtype_name(q_dtype)
    except TypeError as e:
        return SupportResult(False, f"q_dtype: {e}")
    problems = [r for _, r in geometry_problems(
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=page_size,
        topk_blocks=topk_blocks, head_dim=head_dim,
    )]
    if qname not in Q_DTYPES:
        problems.append(f"q_dtype must be one of {Q_DTYPES}, got {qname!r}")
    if arch is not None and arch_problem(arch):
        problems.append(arch_problem(arch))
    if batch is not None and (not _is_int(batch) or batch < 1):
        problems.append(f"batch must be an int >= 1, got {batch!r}")
    if decode_query_len is not None and (not _is_int(decode_query_len)
                                         or not MIN_QLEN <= decode_query_len <= MAX_QLEN):
        problems.append(f"decode_query_len must be an int in {MIN_QLEN}..{MAX_QLEN}, got {decode_query_len!r}")
    if problems:
        return SupportResult(False, "; ".join(problems))
    return SupportResult(True, "")
