"""The public op: `sparse_decode(query, kv_cache, topk, out, plan, ...)` (validation + dispatch).

A call on a CUDA plan whose kernel is loaded takes the fast path: the few checks the exported
function does not make in Python, everything else left to the
function's own TVM-FFI argument decoding, which checks every tensor's type, dtype, rank,
static dims and strides, 16-byte alignment, device type and index, and binds each symbolic
dim (T, pages, batch, ...) across all tensors, the plan's included, before it launches
anything. Any exception from that path re-runs the full validation, which raises the named
ValueError / TypeError; only when that passes is the original exception re-raised (a CUDA
launch error). Every other call (the reference backend, ints or CPU tensors as scales, tensor
subclasses, the first call of a plan) takes the checked path: the full validation first.

Outputs sharing memory (`validation.check_outputs_own_memory`: a zero-stride or otherwise
self-overlapping out / lse, or out / lse overlapping query, kv_cache, topk or each other) are
refused by the full validation, so on the checked path (the reference backend, a plan's first
call per dtype, every call the fast path declines or the exported function refuses), before
anything is written. The fast path does not look: four data_ptr reads and the span compares
alone took a call with a no-op kernel from 1.7 to 2.3 us here. It is still safe: an out or lse
sharing its own elements never reaches a launch, because the exported function demands compact
strides for both (a size>1 dim of stride 0 fails that), so the call falls back to the full
validation, which names it; no kernel races on one location of out. What the fast path can
launch is a compact out / lse that overlaps another argument (a caller re-aiming a later call of
a plan at such memory); the kernel then writes only inside out's / lse's own extents, bound to
the plan's shapes by the function, i.e. memory the caller handed in as an output, as a torch
kernel given an aliased out= would (wrong values, no write outside the arguments).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .kernels.constants import FP8_KV, NVFP4_KV, NVFP4_ROW_BYTES
from .plan import SparseDecodePlan
from .reference import sparse_decode_reference
from .validation import check_kv_scale, check_scale, validate_sparse_decode

__all__ = ["LOG2E", "sparse_decode"]

LOG2E = 1.0 / math.log(2.0)
_call_arguments = None  # msa_jit/kernels/convention.py:call_arguments, looked up on the first kernel call

_Tensor = torch.Tensor
_FP8 = torch.float8_e4m3fn
_U8 = torch.uint8
_I32 = torch.int32
_INF = math.inf


# 0-dim device scales (vLLM's layer._k_scale / _v_scale) -> their [1] view, made once per tensor: a
# view costs ~1 us per scale and call (2 per op call). Keyed by identity and data pointer (a storage
# swap, `t.data = ...`, makes a new view; an in-place write is seen through the view); cleared when
# full, so fresh scale tensors per call cannot pile up.
_SCALE_VIEWS: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
_SCALE_VIEWS_MAX = 1024


def _scale_view(scale: torch.Tensor) -> torch.Tensor:
    """The [1]-shaped view of a 0-dim scale tensor, cached."""
    ptr = scale.data_ptr()
    hit = _SCALE_VIEWS.get(id(scale))
    if hit is not None and hit[0] is scale and hit[1] == ptr:
        return hit[2]
    view = scale.view(1)
    if len(_SCALE_VIEWS) >= _SCALE_VIEWS_MAX:
        _SCALE_VIEWS.clear()
    _SCALE_VIEWS[id(scale)] = (scale, ptr, view)
    return view


def _kernel_call_arguments():
    global _call_arguments
    if _call_arguments is None:
        from .kernels import convention

        _call_arguments = convention.call_arguments
    return _call_arguments


def sparse_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    topk: torch.Tensor,
    out: torch.Tensor,
    plan: SparseDecodePlan,
    *,
    sm_scale: float,
    q_scale: float = 1.0,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    lse: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Block-sparse GQA decode attention, written in place into `out` (and `lse` if given).

    query: [T, Hq, 128] bfloat16 or float8_e4m3fn (T = plan.batch * plan.qlen), last dim contiguous.
    kv_cache: fp8 [P, Hkv, page_size, 256] float8_e4m3fn (or uint8 storage), or NVFP4
        [P, 2*Hkv, page_size, 72] uint8 (msa_jit.nvfp4), contiguous; the shape tells them apart.
    topk: [T, Hkv, topk_blocks] int32 logical block indices, innermost stride 1 (a [Hkv, T, k]
        buffer is passed as buf.transpose(0, 1)).
    out: [T, Hq, 128] bfloat16. lse: optional [T, Hq] float32 (natural log).
    plan: from `prepare(...)` for this step: its block_table and the lengths prepare read from seq_lens
        (change seq_lens in place and prepare again before the next call).
    Scales are python floats > 0; k_scale / v_scale may also be one-element float32 tensors on
    the plan's device (as vLLM passes NVFP4 global scales), read by the kernel on the device:
    their value must be finite and > 0 as well, which only the reference backend checks (the
    kernel would need a host sync to).
    backend: "kernel" (compiled CUDA kernel), "reference" (float64 reference, any device),
    "auto" (kernel on CUDA, reference otherwise). Everything else is validated before anything
    is written; errors are ValueError / TypeError naming the argument.
    """
    if type(plan) is SparseDecodePlan and plan.is_cuda and (backend == "auto" or backend == "kernel"):
        try:
            if _kernel_fast_path(query, kv_cache, topk, out, plan, sm_scale, q_scale, k_scale, v_scale, lse):
                return
            failure = None
        except Exception as e:  # noqa: BLE001 - named below, or re-raised
            failure = e
        if failure is not None:
            # an argument check of the exported function, a DLPack export or an attribute read
            # failed before any launch (or a launch failed): the full validation names a bad
            # argument (outside the except: no chained traceback); otherwise it is re-raised
            _validate(query, kv_cache, topk, out, plan, sm_scale, q_scale, k_scale, v_scale, lse, backend)
            raise failure
    _checked_sparse_decode(query, kv_cache, topk, out, plan, sm_scale=sm_scale, q_scale=q_scale,
                           k_scale=k_scale, v_scale=v_scale, lse=lse, backend=backend)


def _kernel_fast_path(query: Any, kv_cache: Any, topk: Any, out: Any, plan: SparseDecodePlan, sm_scale: Any,
                      q_scale: Any, k_scale: Any, v_scale: Any, lse: Any) -> bool:
    """Launch the plan's loaded kernel, or return False (nothing done) for what only the checked
    path handles.

    Checked here because the exported function's argument decoding does not: the scales
    (finite floats > 0, or CUDA tensors), out / lse being torch tensors (it takes any DLPack
    producer), topk int32 (it also takes uint32), an fp8 or uint8 cache (it also takes int8
    for uint8), at least one page (P is a free symbol there), and the query dtype (plan.kernels
    holds bf16 / fp8 kernels only). Everything else (shapes against the plan, strides,
    alignment, devices) the function checks before its first launch; docs/performance.md
    ("Host cost, round 2") lists who checks what.
    """
    if not (type(sm_scale) is float and 0.0 < sm_scale < _INF and type(q_scale) is float and 0.0 < q_scale < _INF):
        return False
    # a scale tensor goes in as [1] (a 0-dim one as its cached view); the function checks float32, [1], device
    if type(k_scale) is float and 0.0 < k_scale < _INF:
        ks, k_dev = k_scale, None
    elif isinstance(k_scale, _Tensor) and k_scale.is_cuda:
        ks, k_dev = 1.0, k_scale if k_scale.dim() == 1 else _scale_view(k_scale)
    else:
        return False
    if type(v_scale) is float and 0.0 < v_scale < _INF:
        vs, v_dev = v_scale, None
    elif isinstance(v_scale, _Tensor) and v_scale.is_cuda:
        vs, v_dev = 1.0, v_scale if v_scale.dim() == 1 else _scale_view(v_scale)
    else:
        return False
    kv_dtype = kv_cache.dtype
    kv_shape = kv_cache.shape
    if kv_shape[0] < 1 or type(out) is not _Tensor or topk.dtype is not _I32:
        return False
    if kv_dtype is _FP8:
        fmt, kv = FP8_KV, kv_cache
    elif kv_dtype is _U8:  # NVFP4, or the uint8 storage of an fp8 cache (the kernel takes it as fp8)
        # the last dim of an NVFP4 cache (an fp8 cache's is 256): only picks which kernel's checks decide
        if kv_shape[-1] == NVFP4_ROW_BYTES:
            fmt, kv = NVFP4_KV, kv_cache
        else:
            fmt, kv = FP8_KV, kv_cache.view(_FP8)
    else:
        return False
    q_dtype = query.dtype
    fn = plan.kernels.get((q_dtype, fmt))
    ffi = plan._ffi_tensors
    if fn is None or ffi is None:
        return False
    if lse is None:
        lse = ffi[1]
    elif type(lse) is not _Tensor:
        return False
    kv_lens, _, partial_o, partial_lse, unit = ffi
    # msa_jit/kernels/convention.py ARGUMENTS order (call_arguments); tests pin the two to each other
    fn(query, kv, topk, plan.block_table, kv_lens, out, lse,
       partial_o, partial_lse, unit if k_dev is None else k_dev, unit if v_dev is None else v_dev,
       plan.qlen, plan.launches[fmt].num_splits, sm_scale * q_scale * ks * LOG2E, vs)
    return True


def _validate(query: Any, kv_cache: Any, topk: Any, out: Any, plan: Any, sm_scale: Any, q_scale: Any,
              k_scale: Any, v_scale: Any, lse: Any, backend: Any) -> tuple[str, str, float, float, float, Any, float, Any]:
    """Every check of the op: (backend, cache format, sm, q, k scale, k tensor, v scale, v tensor)."""
    resolved, kv_dtype = validate_sparse_decode(query, kv_cache, topk, out, plan, lse, backend)
    sm = check_scale("sm_scale", sm_scale)
    qs = check_scale("q_scale", q_scale)
    ks, k_dev = check_kv_scale("k_scale", k_scale, plan, resolved)
    vs, v_dev = check_kv_scale("v_scale", v_scale, plan, resolved)
    return resolved, kv_dtype, sm, qs, ks, k_dev, vs, v_dev


def _checked_sparse_decode(
    query: Any, kv_cache: Any, topk: Any, out: Any, plan: Any, *, sm_scale: Any, q_scale: Any = 1.0,
    k_scale: Any = 1.0, v_scale: Any = 1.0, lse: Any = None, backend: Any = "auto",
) -> None:
    """`sparse_decode` with every check in Python before the call (the path before the fast one)."""
    resolved, kv_dtype, sm, qs, ks, k_dev, vs, v_dev = _validate(
        query, kv_cache, topk, out, plan, sm_scale, q_scale, k_scale, v_scale, lse, backend)

    if resolved == "reference":
        with torch.no_grad():  # the kernel path needs no autograd guard (~1.5 us saved per call)
            # the lengths the plan's prepare wrote, which the kernel reads (a request's last token sees
            # kv_len = seq_len keys), not seq_lens as the caller's tensor holds them now
            seq_lens = plan.kv_lens.view(plan.batch, plan.qlen)[:, -1]
            o64, lse64 = sparse_decode_reference(
                query, kv_cache, topk, plan.block_table, seq_lens, plan.qlen,
                sm_scale=sm, q_scale=qs, k_scale=ks, v_scale=vs,
            )
            # both converted before either is written: nothing can fail between the two copies
            o, l = o64.to(torch.bfloat16), (None if lse is None else lse64.to(torch.float32))
            out.copy_(o)
            if lse is not None:
                lse.copy_(l)
        return

    fn = plan.kernels.get((query.dtype, kv_dtype))
    if fn is None:
        fn = plan.resolve_kernel(query.dtype, kv_dtype)
    fn(*(_call_arguments or _kernel_call_arguments())(
        plan, query, kv_cache, topk, out, lse, k_dev, v_dev, sm * qs * ks * LOG2E, vs))
