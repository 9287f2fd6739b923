"""The public op: `sparse_decode(query, kv_cache, topk, out, plan, ...)` (validation + dispatch)."""

from __future__ import annotations

import math
import torch

from .plan import SparseDecodePlan
from .reference import sparse_decode_reference
from .validation import check_kv_scale, check_scale, validate_sparse_decode

__all__ = ["LOG2E", "sparse_decode"]

LOG2E = 1.0 / math.log(2.0)
_call_arguments = None  # kernels/convention.py:call_arguments, looked up on the first kernel call


def _kernel_call_arguments():
    global _call_arguments
    if _call_arguments is None:
        from .compiler import convention

        _call_arguments = convention().call_arguments
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
    plan: from `prepare(...)` for this step (its block_table / seq_lens are used).
    Scales are python floats > 0; k_scale / v_scale may also be one-element float32 tensors on
    the plan's device (as vLLM passes NVFP4 global scales), read by the kernel on the device.
    backend: "kernel" (compiled CUDA kernel), "reference" (float64 reference, any device),
    "auto" (kernel on CUDA, reference otherwise). Everything is validated before anything is
    written; errors are ValueError / TypeError naming the argument.
    """
    resolved, kv_dtype = validate_sparse_decode(query, kv_cache, topk, out, plan, lse, backend)
    sm = check_scale("sm_scale", sm_scale)
    qs = check_scale("q_scale", q_scale)
    ks, k_dev = check_kv_scale("k_scale", k_scale, plan, resolved)
    vs, v_dev = check_kv_scale("v_scale", v_scale, plan, resolved)

    if resolved == "reference":
        with torch.no_grad():  # the kernel path needs no autograd guard (~1.5 us saved per call)
            o64, lse64 = sparse_decode_reference(
                query, kv_cache, topk, plan.block_table, plan.seq_lens, plan.qlen,
                sm_scale=sm, q_scale=qs, k_scale=ks, v_scale=vs,
            )
            out.copy_(o64.to(torch.bfloat16))
            if lse is not None:
                lse.copy_(lse64.to(torch.float32))
        return

    fn = plan.kernels.get((query.dtype, kv_dtype))
    if fn is None:
        fn = plan.resolve_kernel(query.dtype, kv_dtype)
    fn(*(_call_arguments or _kernel_call_arguments())(
        plan, query, kv_cache, topk, out, lse, k_dev, v_dev, sm * qs * ks * LOG2E, vs))
