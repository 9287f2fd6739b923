"""Stand-ins for the vLLM 0.33.0 infrastructure that the real engine files import (vLLM is not
installed in CI). The engine's own code is never stood in for: `install()` loads the unmodified
files of the vLLM 0.33.0 release (tests/vllm_files.py says where they come from) under their real
module names

    vllm.models.minimax_m3.common.sparse_attention       <- common/sparse_attention.py
    vllm.models.minimax_m3.nvidia.msa_cutlass_sparse_decode <- msa_cutlass_sparse_decode.py
    vllm.models.minimax_m3.nvidia.sparse_attention_msa   <- sparse_attention_msa.py

on top of these STAND-INS (each the smallest that lets that code run, written after vLLM 0.33.0's
own definitions where behaviour matters):

    vllm                                   package, __version__ = "0.33.0"
    vllm._aiter_ops.rocm_aiter_ops         is_enabled() / is_shuffle_kv_cache_enabled(): False
    vllm.config                            VllmConfig (annotation), get_current_vllm_config()
    vllm.config.attention                  MiniMaxM3MSADecodeBackend = Literal["triton", "cutlass"]
    vllm.config.cache                      CacheDType = str
    vllm.forward_context                   get_forward_context() -> .attn_metadata (set by a test)
    vllm.logger                            init_logger(): a logging.Logger with info_once / warning_once
    vllm.platforms                         current_platform: CUDA, a given compute capability, fp8 e4m3fn
    vllm.triton_utils                      the real triton / triton.language
    vllm.utils.torch_utils                 get_dtype_size, nvfp4_kv_cache_full_dim
    vllm.v1.attention.backend              AttentionBackend, AttentionCGSupport, AttentionImplBase,
                                           AttentionLayer, AttentionMetadata, AttentionMetadataBuilder
                                           (__init__, _init_reorder_batch_threshold),
                                           CommonAttentionMetadata (the fields the builders read,
                                           compute_num_computed_tokens), MultipleOf
    vllm.v1.attention.backends.utils       split_decodes_and_prefills (decode-first batch rule)
    vllm.v1.kv_cache_interface             AttentionSpec, KVCacheLayout, KVQuantMode,
                                           get_kv_quant_mode, is_quantized_kv_cache
    vllm.models.minimax_m3.common.ops.sparse_attn
                                           SPARSE_BLOCK_SIZE = 128 and the engine's two Triton kernels:
                                           `minimax_m3_sparse_attn_decode` RAISES (with the plugin applied
                                           decode must never reach it); `minimax_m3_sparse_attn` (Triton
                                           prefill) RECORDS its arguments and calls `prefill_hook` (a
                                           test's float64 answer). With `install(triton_kernels=True)` this
                                           module is instead vLLM's own file (common/ops/sparse_attn.py),
                                           run by Triton's interpreter on CPU tensors.

`current_platform.is_arch_support_pdl()` is False (no programmatic dependent launch under the
interpreter). Three defects of the Triton interpreter (3.9) itself are worked around while vLLM's
kernels run (`interpreter_fixes`): `tl.dot` of bfloat16 operands multiplies their raw 16-bit
patterns as integers (the interpreter stores bfloat16 as uint16); a load / store mask the
interpreter types int32 (values 0 / 1; a compiled kernel has an int1 mask there) is refused; and
a float32 -> bfloat16 conversion truncates, where a GPU rounds to nearest even (left truncating,
the engine's decode lands 3x further from the float64 oracle: 8.7e-3 per token against 2.9e-3).

Nothing else of vLLM exists: `vllm.third_party.fmha_sm100` (Blackwell kernels) is absent on
purpose, so reaching it fails with ModuleNotFoundError.
"""

from __future__ import annotations

import enum
import importlib.util
from abc import ABC
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar

import pytest
import torch
import vllm_files

# The files the engine tests read (model.py: tests/engine_cases.py's ModelWiring; common/ops/sparse_attn.py:
# install(triton_kernels=True)).
ENGINE_FILES = tuple(vllm_files.ENGINE_FILES)
ENGINE_SKIP_REASON = vllm_files.SKIP_REASON


def engine_file(name: str) -> Path:
    """Where the tests read the vLLM file `name` (one of ENGINE_FILES); a path that does not exist
    when the files are not available (the tests that read it skip then)."""
    return (vllm_files.FILES or {}).get(name, vllm_files.cache_dir() / name)


# vLLM's Triton decode and prefill kernels (install(triton_kernels=True)): module name, file
TRITON_KERNELS = "vllm.models.minimax_m3.common.ops.sparse_attn"
TRITON_KERNELS_FILE = "common/ops/sparse_attn.py"

REAL_FILES = {
    "vllm.models.minimax_m3.common.sparse_attention": engine_file("common/sparse_attention.py"),
    "vllm.models.minimax_m3.nvidia.msa_cutlass_sparse_decode": engine_file("msa_cutlass_sparse_decode.py"),
    "vllm.models.minimax_m3.nvidia.sparse_attention_msa": engine_file("sparse_attention_msa.py"),
}


def engine_files_present() -> bool:
    """Whether the engine files were found (else the engine tests skip with
    ENGINE_SKIP_REASON)."""
    return vllm_files.FILES is not None


# ----------------------------------------------------------------------------- stand-ins
class DeviceCapability(NamedTuple):
    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor


class Platform:
    """current_platform: a CUDA platform with the given capability."""

    def __init__(self, capability: tuple[int, int] | None) -> None:
        self.capability = capability

    def is_cuda(self) -> bool:
        return self.capability is not None

    def is_rocm(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        return None if self.capability is None else DeviceCapability(*self.capability)

    def is_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        cap = self.get_device_capability(device_id)
        if cap is None:
            return False
        return cap == capability if isinstance(capability, tuple) else cap.to_int() == capability

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        cap = self.get_device_capability(device_id)
        return cap is not None and cap.to_int() // 10 == capability // 10

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def is_fp8_fnuz(self) -> bool:
        return False

    def is_arch_support_pdl(self) -> bool:
        return False


class KVQuantMode(enum.Enum):
    NONE = 0
    FP8_PER_TENSOR = 1
    NVFP4 = 2
    NVFP4_DS_MLA = 3

    @property
    def is_nvfp4(self) -> bool:
        return self is KVQuantMode.NVFP4


def get_kv_quant_mode(kv_cache_dtype: str) -> KVQuantMode:
    """vLLM 0.33's mapping for the dtypes MiniMax-M3 takes (no registered handlers)."""
    if kv_cache_dtype == "nvfp4_ds_mla":
        return KVQuantMode.NVFP4_DS_MLA
    if kv_cache_dtype.startswith("nvfp4"):
        return KVQuantMode.NVFP4
    if kv_cache_dtype.startswith("fp8"):
        return KVQuantMode.FP8_PER_TENSOR
    return KVQuantMode.NONE


class KVCacheLayout(enum.Enum):
    LBHNC = (0, 1, 2, 3, 4)
    LHBNC = (0, 2, 1, 3, 4)


class AttentionSpec:
    """Annotation only; a test passes `SimpleNamespace(num_kv_heads=..., block_size=...)`."""


class AttentionCGSupport(enum.Enum):
    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


class MultipleOf:
    def __init__(self, base: int) -> None:
        self.base = base


class AttentionBackend(ABC):
    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...] | None:
        return None


M = TypeVar("M")


class AttentionImplBase(ABC, Generic[M]):
    pass


class AttentionLayer(Protocol):
    layer_name: str


class AttentionMetadata:
    pass


class AttentionMetadataBuilder(ABC, Generic[M]):
    reorder_batch_threshold: int | None = None

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device

    def _init_reorder_batch_threshold(self, reorder_batch_threshold: int | None = 1,
                                      supports_spec_as_decode: bool = False,
                                      supports_dcp_with_varlen: bool = False) -> None:
        self.reorder_batch_threshold = reorder_batch_threshold
        spec = getattr(self.vllm_config, "speculative_config", None)
        if (reorder_batch_threshold is not None and supports_spec_as_decode and spec is not None
                and spec.num_speculative_tokens is not None):
            self.reorder_batch_threshold = max(reorder_batch_threshold, 1 + spec.num_speculative_tokens)


@dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    _num_computed_tokens_cache: torch.Tensor | None = field(default=None, repr=False)

    def compute_num_computed_tokens(self) -> torch.Tensor:
        if self._num_computed_tokens_cache is None:
            query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
            self._num_computed_tokens_cache = self.seq_lens - query_lens
        return self._num_computed_tokens_cache


def split_decodes_and_prefills(cm: CommonAttentionMetadata, decode_threshold: int = 1,
                               require_uniform: bool = False,
                               treat_short_extends_as_decodes: bool = True) -> tuple[int, int, int, int]:
    """(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens) of a decode-first batch:
    decodes are the leading requests of query length <= decode_threshold (with require_uniform:
    equal to the first one's, or 0 = padding)."""
    qsl = cm.query_start_loc_cpu
    lens = (qsl[1:] - qsl[:-1]).tolist()
    if not lens or lens[0] > decode_threshold:
        return 0, cm.num_reqs, 0, cm.num_actual_tokens
    first = lens[0]
    is_decode = (lambda n: n in (first, 0)) if require_uniform else (lambda n: n <= decode_threshold)
    nd = next((i for i, n in enumerate(lens) if not is_decode(n)), len(lens))
    nd_tokens = int(qsl[nd])
    return nd, cm.num_reqs - nd, nd_tokens, cm.num_actual_tokens - nd_tokens


class ForwardContext:
    attn_metadata: Any = None


def _init_logger(name: str) -> logging.Logger:
    log = logging.getLogger(name)
    log.info_once = log.info  # type: ignore[attr-defined]
    log.warning_once = log.warning  # type: ignore[attr-defined]
    log.debug_once = log.debug  # type: ignore[attr-defined]
    return log


class EngineKernelStandIn:
    """The engine's Triton kernels (vllm.models.minimax_m3.common.ops.sparse_attn)."""

    def __init__(self) -> None:
        self.prefill_calls: list[dict[str, Any]] = []
        self.prefill_hook: Any = None

    def minimax_m3_sparse_attn_decode(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine's Triton decode ran: the msa-jit decode path was not taken")

    def minimax_m3_sparse_attn(self, q, kv_cache, topk_idx, block_table, cu_seqlens_q, seq_lens,
                               prefix_lens, max_query_len, num_kv_heads, sm_scale, output,
                               k_scale=None, v_scale=None) -> None:
        call = dict(q=q, kv_cache=kv_cache, topk_idx=topk_idx, block_table=block_table,
                    cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, prefix_lens=prefix_lens,
                    max_query_len=max_query_len, num_kv_heads=num_kv_heads, sm_scale=sm_scale,
                    output=output, k_scale=k_scale, v_scale=v_scale)
        self.prefill_calls.append(call)
        if self.prefill_hook is not None:
            self.prefill_hook(call)


# ----------------------------------------------------------------------------- installation
def _module(name: str, **attrs: Any) -> ModuleType:
    m = ModuleType(name)
    m.__path__ = []  # every stand-in may be a package
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def interpreter_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work around the three Triton interpreter defects named in the module docstring (undone by
    monkeypatch): bfloat16 operands of `tl.dot` are widened to float32 by their bits (exact), a
    non-boolean mask is read as `mask != 0`, float32 -> bfloat16 rounds to nearest even (torch's
    conversion)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    dot, load, store = builder.create_dot, builder.create_masked_load, builder.create_masked_store
    cast = builder.cast_impl

    def widened(h: Any) -> Any:
        if h.dtype.scalar == tl.bfloat16 and h.data.dtype == np.uint16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def boolean(m: Any) -> Any:
        return m if m.data.dtype == np.bool_ else interp.TensorHandle(m.data != 0, tl.int1)

    def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        return dot(self, widened(a), widened(b), d, *args)

    def create_masked_load(self: Any, ptrs: Any, mask: Any, *args: Any) -> Any:
        return load(self, ptrs, boolean(mask), *args)

    def create_masked_store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any) -> Any:
        return store(self, ptrs, value, boolean(mask), *args)

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interp.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(builder, "cast_impl", cast_impl)
    monkeypatch.setattr(builder, "create_dot", create_dot)
    monkeypatch.setattr(builder, "create_masked_load", create_masked_load)
    monkeypatch.setattr(builder, "create_masked_store", create_masked_store)


def load_file(monkeypatch: pytest.MonkeyPatch, name: str, path: Path) -> ModuleType:
    """The Python file at `path` run as module `name` (in sys.modules until monkeypatch undoes it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    m = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, m)
    spec.loader.exec_module(m)
    return m


def install(monkeypatch: pytest.MonkeyPatch, *, capability: tuple[int, int] | None = (9, 0),
            vllm_config: Any = None, version: str = "0.33.0", triton_kernels: bool = False) -> SimpleNamespace:
    """Put the stand-ins and the three real engine files into sys.modules (undone by
    monkeypatch). Returns the modules: .msa, .common, .engine_msa (vLLM's own
    msa_cutlass_sparse_decode), .kernels (EngineKernelStandIn; with triton_kernels, vLLM's own
    common/ops/sparse_attn.py, its kernels decorated for the Triton interpreter), .forward_context,
    .config."""
    import triton
    import triton.language as tl

    kernels: Any = EngineKernelStandIn()
    forward_context = ForwardContext()
    holder = SimpleNamespace(vllm_config=vllm_config)

    def get_current_vllm_config() -> Any:
        return holder.vllm_config

    mods = {
        "vllm": _module("vllm", __version__=version),
        "vllm._aiter_ops": _module("vllm._aiter_ops", rocm_aiter_ops=SimpleNamespace(
            is_enabled=lambda: False, is_shuffle_kv_cache_enabled=lambda: False)),
        "vllm.config": _module("vllm.config", VllmConfig=object,
                               get_current_vllm_config=get_current_vllm_config),
        "vllm.config.attention": _module("vllm.config.attention",
                                         MiniMaxM3MSADecodeBackend=Literal["triton", "cutlass"]),
        "vllm.config.cache": _module("vllm.config.cache", CacheDType=str),
        "vllm.forward_context": _module("vllm.forward_context",
                                        get_forward_context=lambda: forward_context),
        "vllm.logger": _module("vllm.logger", init_logger=_init_logger),
        "vllm.platforms": _module("vllm.platforms", current_platform=Platform(capability)),
        "vllm.triton_utils": _module("vllm.triton_utils", triton=triton, tl=tl),
        "vllm.utils": _module("vllm.utils"),
        "vllm.utils.torch_utils": _module(
            "vllm.utils.torch_utils",
            get_dtype_size=lambda dtype: torch.empty((), dtype=dtype).element_size(),
            nvfp4_kv_cache_full_dim=lambda head_size: head_size // 2 + head_size // 16),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.attention": _module("vllm.v1.attention"),
        "vllm.v1.attention.backend": _module(
            "vllm.v1.attention.backend", AttentionBackend=AttentionBackend,
            AttentionCGSupport=AttentionCGSupport, AttentionImplBase=AttentionImplBase,
            AttentionLayer=AttentionLayer, AttentionMetadata=AttentionMetadata,
            AttentionMetadataBuilder=AttentionMetadataBuilder,
            CommonAttentionMetadata=CommonAttentionMetadata, MultipleOf=MultipleOf),
        "vllm.v1.attention.backends": _module("vllm.v1.attention.backends"),
        "vllm.v1.attention.backends.utils": _module(
            "vllm.v1.attention.backends.utils", split_decodes_and_prefills=split_decodes_and_prefills),
        "vllm.v1.kv_cache_interface": _module(
            "vllm.v1.kv_cache_interface", AttentionSpec=AttentionSpec, KVCacheLayout=KVCacheLayout,
            KVQuantMode=KVQuantMode, get_kv_quant_mode=get_kv_quant_mode,
            is_quantized_kv_cache=lambda d: get_kv_quant_mode(d) is not KVQuantMode.NONE),
        "vllm.models": _module("vllm.models"),
        "vllm.models.minimax_m3": _module("vllm.models.minimax_m3"),
        "vllm.models.minimax_m3.common": _module("vllm.models.minimax_m3.common"),
        "vllm.models.minimax_m3.common.ops": _module("vllm.models.minimax_m3.common.ops"),
        "vllm.models.minimax_m3.common.ops.sparse_attn": _module(
            "vllm.models.minimax_m3.common.ops.sparse_attn", SPARSE_BLOCK_SIZE=128,
            minimax_m3_sparse_attn=kernels.minimax_m3_sparse_attn,
            minimax_m3_sparse_attn_decode=kernels.minimax_m3_sparse_attn_decode),
        "vllm.models.minimax_m3.nvidia": _module("vllm.models.minimax_m3.nvidia"),
    }
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)  # a real vLLM never mixes with the stand-ins
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    if triton_kernels:
        # the kernels are decorated when the file runs: the interpreter must be chosen by then
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        interpreter_fixes(monkeypatch)
        kernels = load_file(monkeypatch, TRITON_KERNELS, engine_file(TRITON_KERNELS_FILE))
    loaded = {}
    for name, path in REAL_FILES.items():  # in import order: common, engine module, msa
        loaded[name] = load_file(monkeypatch, name, path)
    return SimpleNamespace(
        common=loaded["vllm.models.minimax_m3.common.sparse_attention"],
        engine_msa=loaded["vllm.models.minimax_m3.nvidia.msa_cutlass_sparse_decode"],
        msa=loaded["vllm.models.minimax_m3.nvidia.sparse_attention_msa"],
        kernels=kernels,
        forward_context=forward_context,
        config=holder,
        platform=mods["vllm.platforms"].current_platform,
    )
