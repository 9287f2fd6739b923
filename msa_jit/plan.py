"""`SparseDecodePlan`: the per-step state of one step shape (what `prepare` returns, what the op reads).

A leaf of the runtime: only torch and `msa_jit.geometry` are imported (the compiler, on a
plan's first kernel resolution). The planner builds plans, validation and the op read them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from .geometry import KV_DTYPE_SHORT, SparseDecodeConfig, dtype_name, torch_dtype
from .kernels.constants import FP8_KV

__all__ = ["LaunchChoice", "PlanKey", "SparseDecodePlan"]

# a cache format's full name, and its short one (KV_DTYPE_SHORT: "fp8"), -> the full name
_FORMAT_NAMES = {**{k: k for k in KV_DTYPE_SHORT}, **{v: k for k, v in KV_DTYPE_SHORT.items()}}
# SparseDecodePlan fields that cannot change once the plan is made (its __setattr__)
_READ_ONLY = frozenset({"num_q_heads", "num_kv_heads", "page_size", "topk_blocks", "head_dim", "batch", "qlen",
                        "block_table_stride", "device", "num_tokens", "group_size", "kv_lens", "qo_offset",
                        "partial_o", "partial_lse", "lse_scratch", "unit_scale"})

# (batch, qlen, block_table.stride(0), Hq, Hkv, page_size, topk_blocks, device): the planner's cache key
PlanKey = tuple[int, int, int, int, int, int, int, torch.device]


@dataclass(frozen=True)
class LaunchChoice:
    """How one cache format's decode kernel is launched for a step shape (the planner's choice):
    SparseDecodeConfig.kernel ("token" or "union"), its occupancy, the split-KV factor and how the
    splits merge ("kernel": a second launch; "cluster": inside the decode launch)."""

    kernel: str = "token"
    ctas_per_sm: int = 2
    num_splits: int = 1
    split_merge: str = "kernel"

    def describe(self) -> str:
        return (f"num_splits={self.num_splits}, ctas_per_sm={self.ctas_per_sm}, kernel={self.kernel}, "
                f"split_merge={self.split_merge}")


@dataclass(eq=False)
class SparseDecodePlan:
    """Cached state of one step shape. Tensors are allocated once and refreshed in place.

    kv_lens, qo_offset: [T] int32, T = batch * qlen (refreshed every `prepare`).
    launches: cache format ("float8_e4m3fn", "nvfp4") -> its LaunchChoice (`launch(kv_dtype)`).
    partial_o: [T*Hkv*S, G, head_dim] fp32, partial_lse: [T*Hkv*S, G] fp32, S the larger factor
    (split-KV workspace; one row when neither format splits), lse_scratch: [T, Hq] fp32 (used when the caller wants no lse),
    unit_scale: [1] fp32 = 1.0 (the kernel's scale tensor when the caller gives python floats).
    block_table / seq_lens: the tensors of the latest `prepare`.
    """

    num_q_heads: int
    num_kv_heads: int
    page_size: int
    topk_blocks: int
    head_dim: int
    batch: int
    qlen: int
    block_table_stride: int
    device: torch.device
    launches: dict[str, LaunchChoice]
    kv_lens: torch.Tensor
    qo_offset: torch.Tensor
    partial_o: torch.Tensor
    partial_lse: torch.Tensor
    lse_scratch: torch.Tensor
    unit_scale: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    arch: str | None = None
    # (query dtype, kv dtype) -> compiled kernel
    kernels: dict[tuple[torch.dtype, str], Callable[..., Any]] = field(default_factory=dict)
    # refresh(seq_lens): the per-step prologue launch bound to this plan's tensors (planner sets it)
    refresh: Callable[[torch.Tensor], None] | None = None
    # msa_jit/kernels/convention.py PLAN_TENSORS as TVM-FFI tensors (kernel_tensors())
    _ffi_tensors: tuple[Any, ...] | None = field(default=None, repr=False)
    num_tokens: int = field(init=False)
    group_size: int = field(init=False)
    is_cuda: bool = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = self.batch * self.qlen
        self.group_size = self.num_q_heads // self.num_kv_heads
        self.is_cuda = self.device.type == "cuda"
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        # the step shape and the workspace sized for it are what the plan was planned and allocated for: a
        # changed qlen or head count would reach the kernel with buffers of the old shape (and pass the op's
        # checks, which compare against these fields). prepare() makes the plan of another shape.
        if name in _READ_ONLY and getattr(self, "_sealed", False):
            raise AttributeError(f"SparseDecodePlan.{name} is fixed for the plan's life: prepare() a plan "
                                 "for another step shape")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        """The step shape and the workspace's sizes, never tensor contents (`print(plan)`)."""
        work = sum(t.numel() * t.element_size() for t in (self.kv_lens, self.qo_offset, self.partial_o,
                                                          self.partial_lse, self.lse_scratch, self.unit_scale))
        built = ", ".join(f"{dtype_name(q)}/{kv}" for q, kv in self.kernels) or "none"
        return (f"SparseDecodePlan(batch={self.batch}, qlen={self.qlen}, heads={self.num_q_heads}/{self.num_kv_heads}, "
                f"page_size={self.page_size}, topk_blocks={self.topk_blocks}, "
                + "".join(f"{KV_DTYPE_SHORT.get(kv, kv)}: {c.describe()}; " for kv, c in self.launches.items())
                + f"arch={self.arch}, device={self.device}, workspace={work} bytes, kernels: {built})")

    @property
    def key(self) -> PlanKey:
        """The planner cache key of this plan."""
        return (self.batch, self.qlen, self.block_table_stride, self.num_q_heads,
                self.num_kv_heads, self.page_size, self.topk_blocks, self.device)

    def launch(self, kv_dtype: str = FP8_KV) -> LaunchChoice:
        """The launch choice of the kernel serving a cache format ("float8_e4m3fn" or "nvfp4"; "fp8" as
        `print(plan)` names it)."""
        choice = self.launches.get(kv_dtype)
        return choice if choice is not None else self.launches[self._format(kv_dtype)]

    def _format(self, kv_dtype: Any) -> str:
        """A cache format's full name from its full or short name; ValueError naming the formats else."""
        name = _FORMAT_NAMES.get(kv_dtype) if isinstance(kv_dtype, str) else None
        if name is None or name not in self.launches:
            raise ValueError(f"kv_dtype: expected one of {sorted(self.launches)} (or "
                             f"{sorted(KV_DTYPE_SHORT[k] for k in self.launches)}), got {kv_dtype!r}")
        return name

    def config(self, q_dtype: Any, kv_dtype: str = "float8_e4m3fn") -> SparseDecodeConfig:
        """SparseDecodeConfig of the kernel serving this plan for a query dtype (torch dtype or name)
        and a cache format ("float8_e4m3fn" or "nvfp4")."""
        if self.arch is None:
            raise RuntimeError(
                f"plan on {self.device} has no target arch: build it on a CUDA device or create "
                "the planner with SparseDecodePlanner(arch='sm_90a')"
            )
        kv_dtype = self._format(kv_dtype)
        launch = self.launches[kv_dtype]
        return SparseDecodeConfig(
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            topk_blocks=self.topk_blocks,
            q_dtype=dtype_name(q_dtype),
            kv_dtype=kv_dtype,
            arch=self.arch,
            ctas_per_sm=launch.ctas_per_sm,
            kernel=launch.kernel,
            split_merge=launch.split_merge,
        )

    def kernel_tensors(self) -> tuple[Any, ...]:
        """The plan-owned kernel arguments (msa_jit/kernels/convention.py PLAN_TENSORS: kv_lens, lse_scratch,
        partial_o, partial_lse, unit_scale) in the form the kernel call takes best.

        The plan owns them for its whole life, so they are wrapped as TVM-FFI tensors once
        (a torch tensor argument costs a DLPack exchange on every call); torch tensors when
        tvm_ffi is not importable.
        """
        if self._ffi_tensors is None:
            from .kernels import convention

            ts = tuple(getattr(self, name) for name in convention.PLAN_TENSORS)
            try:
                import tvm_ffi

                self._ffi_tensors = tuple(tvm_ffi.from_dlpack(t) for t in ts)
            except ImportError:  # pragma: no cover - the kernel path needs tvm_ffi anyway
                self._ffi_tensors = ts
        return self._ffi_tensors

    def resolve_kernel(self, q_dtype: Any, kv_dtype: str = "float8_e4m3fn") -> Callable[..., Any]:
        """Compiled kernel for this plan's geometry, `q_dtype` and cache format (cached in `self.kernels`).

        Calls `msa_jit.jit.compiler.get_sparse_decode_kernel(config)` on the first use; the result
        takes the arguments of msa_jit/kernels/convention.py in order.
        """
        dt = torch_dtype(q_dtype)
        fn = self.kernels.get((dt, kv_dtype))
        if fn is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                # a compile (seconds) or a module load inside capture would stall or break the capture
                raise RuntimeError(
                    f"msa-jit: the {dtype_name(dt)} / {kv_dtype} kernel of this plan was first needed inside "
                    "CUDA-graph capture: run the step once eagerly before capturing (or `msa-jit warmup` and one "
                    "eager step), as torch's own warm-up before a capture does")
            cfg = self.config(dt, kv_dtype).validate()
            from .jit.compiler import get_sparse_decode_kernel

            if cfg.split_merge == "cluster":
                from .jit.compiler import cluster_launch_fits

                if not cluster_launch_fits(cfg, self.launches[kv_dtype].num_splits, self._device_index()):
                    self._merge_by_kernel(kv_dtype)
                    cfg = self.config(dt, kv_dtype)
            fn = get_sparse_decode_kernel(cfg)
            self.kernels[(dt, kv_dtype)] = fn
        return fn

    def _device_index(self) -> int:
        if self.device.index is not None or self.device.type != "cuda":
            return self.device.index or 0
        return torch.cuda.current_device()

    def _merge_by_kernel(self, kv_dtype: str) -> None:
        """This GPU cannot hold a cluster of the plan's splits: the cache format's splits are merged by
        the merge kernel from now on (its kernels resolved again)."""
        logging.getLogger("msa_jit").warning(
            "msa-jit: device %s cannot hold a cluster of %d CTAs of the %s decode kernel: its splits are "
            "merged by the split merge kernel instead", self.device, self.launches[kv_dtype].num_splits, kv_dtype)
        self.launches[kv_dtype] = replace(self.launches[kv_dtype], split_merge="kernel")
        for key in [k for k in self.kernels if k[1] == kv_dtype]:
            del self.kernels[key]
