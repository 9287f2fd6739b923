"""The e2e harness's weights: what bench/e2e/run_vllm_e2e.py does to the dummy-loaded model on the
worker (through collective_rpc) before anything runs on it: the float matrices redrawn by name
(`plan.REINIT`, the same model in every mode) and the attention layers' scale buffers put back
to a checkpoint's 1.0."""

from __future__ import annotations

import math
import zlib
from typing import Any


def reinit_module(module: Any, spec: dict[str, float]) -> int:
    """Redraw `module`'s float matrices (plan.REINIT): N(0, 1/fan_in) from a generator seeded by
    the parameter's name; the LM head x lm_head_gain, embeddings N(0, embed_std); the per-head
    q norms' Gemma weights (scale 1 + w) set to q_norm_scale - 1. Returns how many were set."""
    import torch

    n = 0
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not p.dtype.is_floating_point or p.element_size() < 2:
                continue
            if name.endswith("q_norm.weight") and "index" not in name:
                p.fill_(spec["q_norm_scale"] - 1.0)
                n += 1
                continue
            if p.dim() < 2 or "norm" in name:
                continue
            g = torch.Generator(device=p.device)
            g.manual_seed((zlib.crc32(name.encode()) + int(spec["seed"])) & 0x7FFFFFFF)
            if "embed_tokens" in name:
                std = spec["embed_std"]
            else:
                std = 1.0 / math.sqrt(p.shape[-1]) * (spec["lm_head_gain"] if "lm_head" in name else 1.0)
            p.normal_(0.0, std, generator=g)
            n += 1
    return n


# The quantization scale buffers of vLLM's attention layers (set_default_quant_scales registers
# them at 1.0) and their host copies.
SCALE_BUFFERS = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
SCALE_FLOATS = ("_k_scale_float", "_v_scale_float", "_q_scale_float", "_prob_scale_float")


def reset_scale_buffers(module: Any) -> dict[str, Any]:
    """Put the scale buffers of every attention layer in `module` back to 1.0, what a checkpoint
    load leaves them at, and say what they held: {"layers": n, "before": [[value, count], ...]}.

    The harness loads dummy weights, and vLLM 0.33's dummy loader fills every persistent buffer
    with uniform(-1e-3, 1e-3) values (seed 1234: -7.4558414e-4 on a GPU). vLLM's Attention resets
    its own after loading; MiniMax-M3's sparse layer has no such step (the msa-jit plugin adds it
    to the layers it serves). Left as loaded, the NVFP4 insert and msa-jit take that value as the
    global scale (negative: a cache of signs, NaN), and the engine's Triton fp8 decode and prefill
    multiply K and V by it while its fp8 insert writes with 1.0: the baseline must be reset too."""
    import torch

    seen: dict[float, int] = {}
    layers = 0
    with torch.no_grad():
        for m in module.modules():
            bufs = [b for b in (getattr(m, n, None) for n in SCALE_BUFFERS)
                    if isinstance(b, torch.Tensor) and b.is_floating_point()]
            if not bufs:
                continue
            layers += 1
            for b in bufs:
                for x in b.detach().reshape(-1).tolist():
                    seen[x] = seen.get(x, 0) + 1
                b.fill_(1.0)
            for name in SCALE_FLOATS:
                if isinstance(getattr(m, name, None), float):
                    setattr(m, name, 1.0)
            for name in ("_k_scale_cpu", "_v_scale_cpu"):
                t = getattr(m, name, None)
                if isinstance(t, torch.Tensor):
                    t.fill_(1.0)
    return {"layers": layers, "before": sorted([v, c] for v, c in seen.items())}


def reinit_worker(worker: Any, spec: dict[str, float]) -> dict[str, Any]:
    """collective_rpc target: reinit_module and reset_scale_buffers on the target model and, with
    MTP, the drafter's."""
    import torch.nn as nn

    model = worker.get_model()
    done: dict[str, Any] = {"target": reinit_module(model, spec), "target_scales": reset_scale_buffers(model)}
    runner = getattr(worker, "model_runner", None)
    for attr in ("drafter", "speculator", "proposer"):
        model = getattr(getattr(runner, attr, None), "model", None)
        if isinstance(model, nn.Module):
            done[attr] = reinit_module(model, spec)
            done[f"{attr}_scales"] = reset_scale_buffers(model)
    return done
