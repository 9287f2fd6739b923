"""Checks of msa-jit's decode inside the engine that run_vllm_e2e.py's hook makes beside its comparison
with msa_jit.reference: what vLLM's own Triton decode makes of the same tensors, and whether the decode
runs in order on the engine's CUDA stream. Each returns a JSON-able dict and never raises."""

from __future__ import annotations

import traceback
from typing import Any, Callable

import e2e_plan as plan

MSA_MODULE = "vllm.models.minimax_m3.nvidia.sparse_attention_msa"  # the module whose names the plugin rebinds


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_triton_decode(msa: Any, query_fp8: Any, kv_cache: Any, topk: Any, like: Any, p: Any, scale: float,
                         q_scale_float: float, k_scale_float: float, v_scale_float: float) -> Any:
    """vLLM's own Triton decode of the arguments msa-jit was given, as sparse_attention_msa runs it
    without the CUTLASS knob (its fp8 path: the query dequantized, top-k transposed, the scalar
    scales as tensors): a new output shaped like `like`, NaN where it wrote nothing. Not synchronized."""
    import torch

    q = msa._dequantize_query(query_fp8, q_scale_float,
                              torch.empty(query_fp8.shape, dtype=torch.bfloat16, device=query_fp8.device))
    out = torch.full_like(like, float("nan"))
    scales = dict(device=query_fp8.device, dtype=torch.float32)
    msa.minimax_m3_sparse_attn_decode(
        q, kv_cache, topk.transpose(0, 1), p.block_table[:p.batch], p.seq_lens[:p.batch], kv_cache.shape[1],
        scale, out, p.qlen, k_scale=torch.tensor([k_scale_float], **scales),
        v_scale=torch.tensor([v_scale_float], **scales))
    return out


def against_engine_triton(msa: Any, query_fp8: Any, kv_cache: Any, topk: Any, output: Any, p: Any, scale: float,
                          q_scale_float: float, k_scale_float: float, v_scale_float: float) -> dict[str, Any]:
    """`engine_triton_decode` against msa-jit's output: the relative L2 between the two. The
    reference check compares msa-jit with msa-jit's reading of the contract; this one compares it
    with what the engine means by the same arguments."""
    import torch

    try:
        ref = engine_triton_decode(msa, query_fp8, kv_cache, topk, output, p, scale, q_scale_float,
                                   k_scale_float, v_scale_float)
        sync()
        got, want = output.double(), ref.double()
        err = (got - want).norm().item() / max(want.norm().item(), 1e-30)
        return {"rel_err": err, "finite": bool(torch.isfinite(want).all()), "ok": err <= plan.HOOK_MAX_REL_ERR}
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}


def stream_order_probe(call: Callable[[], None], output: Any) -> dict[str, Any] | None:
    """Whether the decode's kernels run in order on the engine's current stream (vLLM 0.33 runs its
    model on a dedicated non-default stream), which the comparisons cannot tell: they synchronize
    the device first. That stream is held back (`torch.cuda._sleep`, ~0.1 s), then `output`
    poisoned with NaN, then the decode called: in order, the decode writes after the poison; on
    any other stream it runs during the sleep and the poison lands last. The decode then runs once
    more after a synchronize, so the generate goes on with a right output either way. None on a
    CPU (no streams)."""
    import torch

    if not output.is_cuda:
        call()
        return None
    try:
        sync()
        stream = torch.cuda.current_stream()
        torch.cuda._sleep(int(2e8))
        output.fill_(float("nan"))
        call()
        sync()
        written = int(torch.isfinite(output).all(dim=-1).sum())
        rows = int(output[..., 0].numel())
        ordered = written == rows
        if not ordered:
            call()
            sync()
        return {"ordered": ordered, "rows_written_after_poison": written, "rows": rows,
                "stream": hex(stream.cuda_stream), "default_stream": stream.cuda_stream == 0}
    except Exception as e:  # noqa: BLE001
        sync()
        call()
        sync()
        return {"ordered": None, "error": f"{type(e).__name__}: {e}"}


def first_step_watch(msa: Any, calls: int) -> tuple[Callable[..., None], list[dict[str, Any]]]:
    """A stand-in for the decode function the engine calls that runs the real one, then, for its
    first `calls` calls (the first decode steps of a generate, every sparse layer: the step that
    builds the plan and loads the kernels included), compares each output per token with vLLM's
    own Triton decode on the same tensors. Returns (the stand-in, the list it appends to)."""
    import torch

    real = msa.msa_cutlass_sparse_decode
    rows: list[dict[str, Any]] = []

    def watched(query_fp8, kv_cache, topk, output, metadata, *, scale, q_scale_float, k_scale_float,
                v_scale_float, k_scale=None, v_scale=None):
        real(query_fp8, kv_cache, topk, output, metadata, scale=scale, q_scale_float=q_scale_float,
             k_scale_float=k_scale_float, v_scale_float=v_scale_float, k_scale=k_scale, v_scale=v_scale)
        if len(rows) >= calls or kv_cache.dtype == torch.uint8:  # NVFP4: no Triton decode to compare with
            return
        try:
            got = output.detach().clone()  # before any sync: what the next layer would read
            sync()
            p = metadata.plan
            want = engine_triton_decode(msa, query_fp8, kv_cache, topk, output, p, scale, q_scale_float,
                                        k_scale_float, v_scale_float)
            sync()
            g, w = got.double().flatten(1), want.double().flatten(1)
            per_token = ((g - w).norm(dim=1) / w.norm(dim=1).clamp_min(1e-30)).tolist()
            rows.append({"call": len(rows) + 1, "tokens": int(g.shape[0]),
                         "seq_lens": [int(x) for x in p.seq_lens[:p.batch].tolist()],
                         "rel_err_per_token": [round(x, 5) for x in per_token],
                         "finite": bool(torch.isfinite(g).all())})
        except Exception as e:  # noqa: BLE001
            rows.append({"call": len(rows) + 1, "error": f"{type(e).__name__}: {e}"})

    return watched, rows


# What vLLM's MSA module calls per step (its builder) and per sparse layer (its impl), by the names the
# plugin rebinds there (and the engine's own Triton decode)
COUNTED = ("prepare_decode_metadata", "msa_cutlass_sparse_decode", "minimax_m3_sparse_attn_decode")


class CallCounter:
    """While entered, counts the calls of COUNTED through `module` (vLLM's MSA module, or None: nothing
    counted); `snapshot()` is the counts so far. A decode step replayed from a FULL CUDA graph calls no
    per-layer name; run in eager breaks (or eagerly), each once per sparse layer."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.names = [n for n in COUNTED if module is not None and callable(getattr(module, n, None))]
        self.counts = dict.fromkeys(self.names, 0)
        self.originals: dict[str, Any] = {}

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    def __enter__(self) -> "CallCounter":
        for n in self.names:
            self.originals[n] = getattr(self.module, n)
            setattr(self.module, n, self._counted(n, self.originals[n]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for n, fn in self.originals.items():
            setattr(self.module, n, fn)

    def snapshot(self) -> dict[str, int] | None:
        return dict(self.counts) if self.names else None
