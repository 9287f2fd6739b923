"""The calling convention of an exported decode artifact, in one place.

Everything that shapes the artifact besides the kernel code lives here, inside the hashed
kernel sources (every file of this package is part of every cache key): the argument list
the exported function takes (`ARGUMENTS`), the fake arguments it is traced against
(`fake_arguments`), the order the op passes real arguments in (`call_arguments`), the
plan-owned tensors among them (`PLAN_TENSORS`), and the compile, export and link options.
Edit any of them and every cache key changes, so a stale artifact can never be loaded
against a new convention.

The kernels' `__call__` (msa_jit/kernels/base.py) takes exactly `ARGUMENTS` in this order
(tests/test_convention.py checks it) and hands them to the decode kernel as one `KernelArguments`,
so no kernel signature spells the list out again. T (tokens), P (pages), B (requests), max_blocks and
the split-KV rows are symbolic at compile time, so they never enter the cache key.

Importing this module imports nothing heavy: `cutlass` only inside `fake_arguments`.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from typing import Any

# the exported symbol, the DSL compile options (the arch is appended per config) and the
# link step: cc LINK_FLAGS -o <artifact> <object> <DSL runtime libraries>
EXPORT_NAME = "sparse_decode"
ARTIFACT_NAME = "sparse_decode.so"
COMPILE_OPTIONS = "--enable-tvm-ffi"
LINK_FLAGS = ("-shared",)


@dataclass(frozen=True)
class Argument:
    """One argument of the exported function.

    kind: "tensor" or "scalar" (scalars are Int32 / Float32 values). shape: symbolic dims
    ("T", "Hq", ... resolved per config by `fake_arguments`). layout: what the kernel
    assumes and the op guarantees: "compact" (row-major), "last_contiguous" (stride 1 in the
    last dim, other strides free), "query" (head stride == head_dim, token stride a multiple
    of 16 elements). align: assumed byte alignment of the data pointer (0: none).
    source: "call" (from the op's caller), "plan" (plan-owned, `PLAN_TENSORS`), "scalar".
    """

    name: str
    kind: str
    dtype: str
    shape: tuple[str, ...] = ()
    layout: str = "compact"
    align: int = 0
    source: str = "call"


# dtype "q": bfloat16 or float8_e4m3fn (SparseDecodeConfig.q_dtype); "kv": float8_e4m3fn for the
# fp8 cache, uint8 for NVFP4 (SparseDecodeConfig.kv_dtype). torch's fp8 tensors go in as they are
# (a `.view(torch.uint8)` per call cost 0.7-1.0 us each, docs/performance.md); the kernels
# address both through raw pointers, so only the exported function's dtype check depends on it.
# kv_cache: fp8 [P, Hkv, page, 256] (K bytes [0,128), V bytes [128,256) of a token row), or
# NVFP4 [P, 2*Hkv, page, 72] (slot 2h = K of head h, 2h+1 its V; each slot page*64 bytes of
# e2m1 codes then page*8 e4m3 block scales): "slots" and "row" resolve per kv_dtype.
# k_scale_tensor / v_scale_tensor: the global K / V scales as one-element fp32 device tensors
# (vLLM's NVFP4 layer._k_scale / _v_scale), read on the device and multiplied into
# qk_scale_log2 / v_scale; the plan's unit_scale (1.0) when the caller gives python floats.
ARGUMENTS: tuple[Argument, ...] = (
    Argument("query", "tensor", "q", ("T", "Hq", "D"), "query", 16),
    Argument("kv_cache", "tensor", "kv", ("P", "slots", "page", "row"), "compact", 16),
    Argument("topk", "tensor", "int32", ("T", "Hkv", "K"), "last_contiguous"),
    Argument("block_table", "tensor", "int32", ("B", "max_blocks"), "last_contiguous", source="plan"),
    Argument("kv_lens", "tensor", "int32", ("T",), source="plan"),
    Argument("out", "tensor", "bfloat16", ("T", "Hq", "D"), "compact", 16),
    Argument("lse", "tensor", "float32", ("T", "Hq")),  # the plan's scratch when the caller passes none
    Argument("partial_o", "tensor", "float32", ("rows", "G", "D"), "compact", 16, source="plan"),
    Argument("partial_lse", "tensor", "float32", ("rows", "G"), source="plan"),
    Argument("k_scale_tensor", "tensor", "float32", ("one",)),
    Argument("v_scale_tensor", "tensor", "float32", ("one",)),
    Argument("qlen", "scalar", "int32", source="scalar"),
    Argument("num_splits", "scalar", "int32", source="scalar"),
    # sm_scale * q_scale * k_scale * log2(e), k_scale the python float (1.0 with a tensor)
    Argument("qk_scale_log2", "scalar", "float32", source="scalar"),
    Argument("v_scale", "scalar", "float32", source="scalar"),  # the python float (1.0 with a tensor)
)
ARGUMENT_NAMES = tuple(a.name for a in ARGUMENTS)
# the arguments as one value, each field named as in ARGUMENTS: the decode kernel's first parameter
# (the DSL passes a named tuple's fields as the kernel's parameters, in this order, and rebuilds it
# inside the kernel), so a kernel reads `args.query`, `args.num_splits`, ...
KernelArguments = namedtuple("KernelArguments", ARGUMENT_NAMES)
# plan fields passed to the kernel, in the order `SparseDecodePlan.kernel_tensors` returns
# them (the plan wraps them as TVM-FFI tensors once); lse_scratch stands in for `lse`,
# unit_scale for a scale tensor the caller does not give
PLAN_TENSORS = ("kv_lens", "lse_scratch", "partial_o", "partial_lse", "unit_scale")


def call_arguments(plan: Any, query: Any, kv_cache: Any, topk: Any, out: Any, lse: Any,
                   k_scale_tensor: Any, v_scale_tensor: Any, qk_scale_log2: float,
                   v_scale: float) -> tuple[Any, ...]:
    """The exported function's arguments, in `ARGUMENTS` order, for one op call.

    An fp8 cache held as uint8 storage (the fp8 layout: rows of 2 * head_dim bytes) travels as
    its float8_e4m3fn view, an NVFP4 cache as it is; `lse` None means the plan's scratch, a scale
    tensor None the plan's unit_scale. The caller (msa_jit.op) has validated every tensor
    against the plan.
    """
    import torch

    kv_lens, lse_scratch, partial_o, partial_lse, unit_scale = plan.kernel_tensors()
    fp8_storage = kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == 2 * query.shape[-1]
    nvfp4 = kv_cache.dtype == torch.uint8 and not fp8_storage
    return (
        query,
        kv_cache.view(torch.float8_e4m3fn) if fp8_storage else kv_cache,
        topk,
        plan.block_table,
        kv_lens,
        out,
        lse_scratch if lse is None else lse,
        partial_o,
        partial_lse,
        unit_scale if k_scale_tensor is None else k_scale_tensor,
        unit_scale if v_scale_tensor is None else v_scale_tensor,
        plan.qlen,
        plan.launch("nvfp4" if nvfp4 else "float8_e4m3fn").num_splits,  # each cache format's own split count
        qk_scale_log2,
        v_scale,
    )


def symbolic_dims(config: Any) -> dict[str, Any]:
    """Each dim name of `ARGUMENTS` -> its compile-time value: an int, or a fresh symbol."""
    import cutlass.cute as cute

    d = config.head_dim
    nvfp4 = config.kv_dtype == "nvfp4"
    return {
        "T": cute.sym_int32(), "P": cute.sym_int32(), "B": cute.sym_int32(),
        "max_blocks": cute.sym_int32(), "rows": cute.sym_int32(),
        "Hq": config.num_q_heads, "Hkv": config.num_kv_heads, "G": config.group_size,
        "D": d, "page": config.page_size, "K": config.topk_blocks, "one": 1,
        # an NVFP4 slot row: d / 2 bytes of e2m1 codes + d / 16 e4m3 block scales (72 for d = 128)
        "slots": (2 if nvfp4 else 1) * config.num_kv_heads, "row": d // 2 + d // 16 if nvfp4 else 2 * d,
    }


def fake_arguments(config: Any) -> list[Any]:
    """Fake tensors and scalars of `ARGUMENTS` for tracing `config`'s kernel (no GPU needed),
    followed by the TVM-FFI environment stream."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    dtypes = {
        "q": cutlass.Float8E4M3FN if config.q_dtype == "float8_e4m3fn" else cutlass.BFloat16,
        "kv": cutlass.Uint8 if config.kv_dtype == "nvfp4" else cutlass.Float8E4M3FN,
        "int32": Int32, "float32": Float32, "bfloat16": cutlass.BFloat16,
    }
    scalars = {"int32": Int32(1), "float32": Float32(1.0)}
    dims = symbolic_dims(config)
    out: list[Any] = []
    for a in ARGUMENTS:
        if a.kind == "scalar":
            out.append(scalars[a.dtype])
            continue
        shape = tuple(dims[s] for s in a.shape)
        align = {"assumed_align": a.align} if a.align else {}
        if a.layout == "compact":
            order = tuple(range(len(shape) - 1, -1, -1))
            out.append(make_fake_compact_tensor(dtypes[a.dtype], shape, stride_order=order, **align))
        elif a.layout == "query":
            stride = (cute.sym_int32(divisibility=16), shape[2], 1)
            out.append(make_fake_tensor(dtypes[a.dtype], shape, stride=stride, **align))
        elif a.layout == "last_contiguous":
            stride = tuple(cute.sym_int32() for _ in shape[:-1]) + (1,)
            out.append(make_fake_tensor(dtypes[a.dtype], shape, stride=stride, **align))
        else:  # pragma: no cover - a typo in ARGUMENTS
            raise ValueError(f"{a.name}: unknown layout {a.layout!r}")
    out.append(make_fake_stream(use_tvm_ffi_env_stream=True))
    return out
