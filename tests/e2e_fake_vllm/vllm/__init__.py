"""A fake `vllm` for tests/test_e2e_harness.py: just the surface bench/e2e/run_vllm_e2e.py uses, so
the harness's processes, phases and result files run on a CPU. Nothing here models vLLM's numerics.

- LLM(**kwargs): logs the lines a real start logs (the plugin's; "MiniMax M3 MSA sparse decode
  selected CUTLASS" or, vLLM alone, "MiniMax M3 sparse attention selected Triton");
  collective_rpc(fn, args) calls fn(worker) on a worker whose get_model() is a small torch module
  with M3-like parameter names and one attention layer's scale buffers as a dummy load leaves them
  (DUMMY_SCALE); generate() greedy-decodes a deterministic function of the context
  (top-5 log-probs on request; the msa-jit modes' values 0.001 lower, so comparisons have something
  to measure); llm_engine: add_request / step / has_unfinished_requests / abort_request with
  chunked prefill (max_num_batched_tokens a step) and DELTA outputs.
- With the cutlass knob or an NVFP4 cache (msa-jit modes), a short generate (max_tokens <= 3) calls
  vllm.models.minimax_m3.nvidia.sparse_attention_msa.msa_cutlass_sparse_decode once per sparse
  layer on a CPU case from msa_jit.testing (the float64 reference path), as vLLM's impl would.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.33.0"
__all__ = ["LLM", "SamplingParams"]
_LOG = logging.getLogger("vllm")
_LOG.setLevel(logging.INFO)
SPARSE_LAYERS = 3  # enough for the harness hook (it checks the third call); each is a float64 reference
VOCAB = 4096
DUMMY_SCALE = -7.4558414e-4  # vLLM 0.33's dummy loader's value for a 1-element buffer on a GPU


@dataclass
class Logprob:
    logprob: float
    rank: int = 1
    decoded_token: str | None = None


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[_Completion]
    finished: bool


def _next_token(ctx: list[int]) -> int:
    return (sum(ctx[-8:]) * 31 + len(ctx)) % (VOCAB - 2) + 1


def _top5(ctx: list[int], tok: int, offset: float) -> dict[int, Logprob]:
    out = {tok: Logprob(-0.5 + offset)}
    for i in range(1, 5):
        out[(tok + 97 * i) % (VOCAB - 2) + 1] = Logprob(-0.5 - 0.7 * i + offset, rank=i + 1)
    return out


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(64, 16)
        self.q_norm = torch.nn.Linear(16, 1, bias=False)  # only for the name: "q_norm.weight"
        self.index_q_norm = torch.nn.Linear(16, 1, bias=False)
        self.qkv_proj = torch.nn.Linear(16, 32, bias=False)
        self.input_layernorm = torch.nn.Linear(16, 1, bias=False)
        self.lm_head = torch.nn.Linear(16, 64, bias=False)
        self.attn = torch.nn.Module()
        for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            self.attn.register_buffer(name, torch.tensor(DUMMY_SCALE, dtype=torch.float32))
        self.attn._k_scale_float = self.attn._v_scale_float = 1.0


class _Worker:
    def __init__(self) -> None:
        self.model = _Model()
        self.model_runner = None

    def get_model(self) -> torch.nn.Module:
        return self.model


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    prefilled: int = 0
    out: list[int] = field(default_factory=list)


class LLM:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        plugin = os.environ.get("MSA_JIT_VLLM_PLUGIN", "1") != "0"
        if plugin:
            logging.getLogger("vllm.plugins.msa_jit").info(
                "msa-jit vLLM plugin: MiniMax-M3 decode on SM90 through msa-jit (fake vllm)")
        knob = (kwargs.get("attention_config") or {}).get("minimax_m3_msa_decode_backend")
        self.msa = plugin and (knob == "cutlass" or str(kwargs.get("kv_cache_dtype", "")).startswith("nvfp4"))
        if self.msa:  # vLLM 0.33's two lines: the MSA impl's (plugin's backend), the selector's (vLLM alone)
            logging.getLogger("vllm.models.minimax_m3").info("MiniMax M3 MSA sparse decode selected %s", "CUTLASS")
        else:
            logging.getLogger("vllm.models.minimax_m3").info(
                "MiniMax M3 sparse attention selected %s (kv_cache_dtype=%s, topk_blocks=%s)", "Triton",
                kwargs.get("kv_cache_dtype"), 16)
        self.spec = (kwargs.get("speculative_config") or {}).get("num_speculative_tokens", 0)
        self.budget = kwargs.get("max_num_batched_tokens", 16384)
        self.llm_engine = _Engine(self)
        self._case = None

    # -- the msa-jit decode call, as vLLM's MSA impl makes it
    def _decode_layers(self) -> None:
        if not self.msa:
            return
        from msa_jit.integrations.engine import prepare_decode_metadata
        from msa_jit.testing import make_case

        if self._case is None:
            kv = "nvfp4" if str(self.kwargs.get("kv_cache_dtype")).startswith("nvfp4") else "fp8"
            c = make_case(2, 1, 64, 4, q_dtype=torch.float8_e4m3fn, seed=3, kv_dtype=kv, ctx_lens=[300, 900])
            md = prepare_decode_metadata(c.block_table, c.seq_lens, c.seq_lens_cpu, 1, num_q_heads=64,
                                         num_kv_heads=4, page_size=128, topk_blocks=16)
            self._case = (c, md, kv)
        c, md, kv = self._case
        msa = importlib.import_module("vllm.models.minimax_m3.nvidia.sparse_attention_msa")
        out = torch.empty(c.query.shape, dtype=torch.bfloat16)
        ks = torch.tensor(c.k_scale) if kv == "nvfp4" else None
        vs = torch.tensor(c.v_scale) if kv == "nvfp4" else None
        for _ in range(SPARSE_LAYERS):
            msa.msa_cutlass_sparse_decode(c.query, c.kv_cache, c.topk, out, md, scale=c.sm_scale,
                                          q_scale_float=c.q_scale, k_scale_float=c.k_scale,
                                          v_scale_float=c.v_scale, k_scale=ks, v_scale=vs)

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [method(_Worker(), *args, **(kwargs or {}))]

    def generate(self, prompts: list[dict[str, Any]], sp: SamplingParams, use_tqdm: bool = True) -> list[RequestOutput]:
        outs = []
        if sp.max_tokens <= 3:  # a short generate (the harness's hook check): one decode step's layers
            self._decode_layers()
        for i, p in enumerate(prompts):
            ctx = list(p["prompt_token_ids"])
            toks, lps = [], []
            for _ in range(sp.max_tokens):
                t = _next_token(ctx)
                toks.append(t)
                lps.append(_top5(ctx, t, -0.001 if self.msa else 0.0))
                ctx.append(t)
            outs.append(RequestOutput(str(i), list(p["prompt_token_ids"]),
                                      [_Completion(toks, lps if sp.logprobs else None)], True))
        return outs


class _Engine:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.reqs: dict[str, _Request] = {}

    def add_request(self, request_id: str, prompt: dict[str, Any], params: SamplingParams, **_: Any) -> None:
        self.reqs[request_id] = _Request(request_id, list(prompt["prompt_token_ids"]), params)

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        for rid in request_ids:
            self.reqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        budget = self.llm.budget
        outs = []
        decoding = [r for r in self.reqs.values() if r.prefilled == len(r.prompt)]
        budget -= len(decoding)
        for r in self.reqs.values():
            if r.prefilled < len(r.prompt) and budget > 0:
                n = min(budget, len(r.prompt) - r.prefilled)
                r.prefilled += n
                budget -= n
                if r.prefilled == len(r.prompt):
                    decoding.append(r)
        for r in decoding:
            new = []
            for _ in range(1 + self.llm.spec):
                if len(r.out) < r.params.max_tokens:
                    t = _next_token(r.prompt + r.out)
                    r.out.append(t)
                    new.append(t)
            done = len(r.out) >= r.params.max_tokens
            assert r.params.output_kind == RequestOutputKind.DELTA
            outs.append(RequestOutput(r.rid, r.prompt, [_Completion(new)], done))
        for o in outs:
            if o.finished:
                del self.reqs[o.request_id]
        return outs
