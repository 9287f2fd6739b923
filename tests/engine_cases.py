"""Inputs and a float64 oracle for engine-level tests: mixed decode + prefill steps as vLLM
builds them (decode-first batch, token-major topk buffer, a paged fp8 or NVFP4 cache), and the
wiring code of vLLM's MiniMax-M3 model (model.py) extracted by ast so that tests run it unmodified.

The oracle is written from the contract alone (per token: pos = seq_len - qlen + j, keys of the
token's top-k blocks at positions < pos + 1), independent of msa_jit's planner and reference.
An NVFP4 step's cache is written by msa_jit.nvfp4 from bf16 K/V; the oracle reads it
dequantized (`msa_jit.nvfp4.dequantize_kv_nvfp4`, the format's float64 reader).
"""

from __future__ import annotations

import ast
import math
import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm_standins import engine_file

from msa_jit.nvfp4 import dequantize_kv_nvfp4, nvfp4_kv_cache_shape, write_kv_nvfp4

FP8 = torch.float8_e4m3fn
D = 128
PAGE = 128
MODEL_PY = engine_file("model.py")


def oracle(q: torch.Tensor, kv_cache: torch.Tensor, topk: torch.Tensor, block_table: torch.Tensor,
           rows: list[int], pos: list[int], *, sm_scale: float, q_scale: float, k_scale: float,
           v_scale: float) -> torch.Tensor:
    """float64 [N, Hq, 128]: token i (block-table row rows[i], position pos[i]) attends to the
    keys of its top-k blocks topk[i, h] (logical, -1 padded) at positions <= pos[i].

    q: [N, Hq, 128] (any float dtype, times q_scale); kv_cache [P, Hkv, page, 256]: fp8 (or its
    uint8 storage), or float values (a dequantized cache, with k_scale = v_scale = 1)."""
    n, hq, _ = q.shape
    _, hkv, page, _ = kv_cache.shape
    k_top = topk.shape[-1]
    g = hq // hkv
    qd = q.detach().double().cpu() * q_scale
    kv = kv_cache.detach().cpu()
    kv = (kv.view(FP8) if kv.dtype in (FP8, torch.uint8) else kv).double()
    tk, bt = topk.detach().cpu(), block_table.detach().cpu()
    out = torch.zeros(n, hq, D, dtype=torch.float64)
    for i in range(n):
        kv_len = max(pos[i] + 1, 0)
        nvalid = min(k_top, -(-kv_len // page))
        for h in range(hkv):
            blocks = sorted({int(b) for b in tk[i, h, :nvalid].tolist() if b >= 0 and b * page < kv_len})
            if not blocks:
                continue
            keys, vals = [], []
            for b in blocks:
                valid = min(page, kv_len - b * page)
                chunk = kv[int(bt[rows[i], b]), h, :valid]
                keys.append(chunk[:, :D])
                vals.append(chunk[:, D:])
            kmat, vmat = torch.cat(keys) * k_scale, torch.cat(vals) * v_scale
            s = sm_scale * qd[i, h * g:(h + 1) * g] @ kmat.T
            out[i, h * g:(h + 1) * g] = torch.softmax(s, dim=-1) @ vmat
    return out


@dataclass
class Step:
    """One scheduler step, decode requests first. Tensors on `device` unless *_cpu.

    query_fp8 [T, Hq*128] fp8 (q_true = query_fp8 * q_scale); query_bf16: q_true rounded to bf16;
    kv_u8: the cache as vLLM stores it, uint8: kv_dtype "fp8" [P, Hkv, 128, 256] (fp8 bytes,
    values times k_scale / v_scale) or "nvfp4" [P, 2*Hkv, 128, 72] (msa_jit.nvfp4's layout,
    k_scale / v_scale its global scales); topk_buffer [T + pad, Hkv, K] int32 (rows past T:
    garbage nobody may read).
    """

    num_decodes: int
    decode_qlen: int
    query_lens: list[int]
    seq_lens_list: list[int]
    num_q_heads: int
    num_kv_heads: int
    query_fp8: torch.Tensor
    query_bf16: torch.Tensor
    kv_u8: torch.Tensor
    topk_buffer: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    sm_scale: float
    q_scale: float
    k_scale: float
    v_scale: float
    kv_dtype: str = "fp8"

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def token_rows_and_pos(self) -> tuple[list[int], list[int]]:
        rows, pos = [], []
        for r, (ql, sl) in enumerate(zip(self.query_lens, self.seq_lens_list)):
            for j in range(ql):
                rows.append(r)
                pos.append(sl - ql + j)
        return rows, pos

    def expected(self) -> torch.Tensor:
        """float64 [T, Hq, 128] of the whole step."""
        rows, pos = self.token_rows_and_pos()
        q = self.query_fp8.view(self.num_tokens, self.num_q_heads, D)
        kv, ks, vs = self.kv_u8, self.k_scale, self.v_scale
        if self.kv_dtype == "nvfp4":
            kv, ks, vs = torch.cat(dequantize_kv_nvfp4(kv.cpu(), ks, vs), dim=-1), 1.0, 1.0
        return oracle(q, kv, self.topk_buffer[:self.num_tokens], self.block_table, rows, pos,
                      sm_scale=self.sm_scale, q_scale=self.q_scale, k_scale=ks, v_scale=vs)


def make_step(*, num_decodes: int, decode_qlen: int, prefills: list[tuple[int, int]],
              num_q_heads: int, num_kv_heads: int, seed: int, device: Any = "cpu",
              decode_seq_lens: list[int] | None = None, topk_blocks: int = 16,
              pad_tokens: int = 3, kv_dtype: str = "fp8") -> Step:
    """prefills: (context_len, query_len) per prefill request; decode seq_lens random (or given).

    kv_dtype "fp8": random fp8 K/V, random per-tensor scales. "nvfp4": random bf16 K/V quantized
    by msa_jit.nvfp4.write_kv_nvfp4 into the pages the step uses (the spare pages stay zero, as
    in a fresh vLLM cache), with random global scales of 1..2 x amax / (6 * 448), float32 values.
    """
    if kv_dtype not in ("fp8", "nvfp4"):
        raise ValueError(f"kv_dtype: expected 'fp8' or 'nvfp4', got {kv_dtype!r}")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if decode_seq_lens is None:
        decode_seq_lens = [rng.choice([rng.randint(decode_qlen, PAGE - 1), PAGE * rng.randint(1, 4),
                                       rng.randint(PAGE, 20 * PAGE)]) for _ in range(num_decodes)]
    query_lens = [decode_qlen] * num_decodes + [ql for _, ql in prefills]
    seq_lens = list(decode_seq_lens) + [c + ql for c, ql in prefills]
    nreq, T, hkv, K = len(query_lens), sum(query_lens), num_kv_heads, topk_blocks
    nblocks = [-(-s // PAGE) for s in seq_lens]
    P = sum(nblocks) + 2
    perm = torch.randperm(P, generator=gen).tolist()
    W = max(nblocks) + 2
    bt = torch.zeros(nreq, W, dtype=torch.int32)
    nxt = 0
    for r in range(nreq):
        for b in range(nblocks[r]):
            bt[r, b] = perm[nxt]
            nxt += 1
    topk = torch.randint(-5, W + 5, (T + pad_tokens, hkv, K), generator=gen, dtype=torch.int32)
    t = 0
    for r in range(nreq):
        for j in range(query_lens[r]):
            kv_len = seq_lens[r] - query_lens[r] + j + 1
            nvis = -(-kv_len // PAGE)
            nvalid = min(K, nvis)
            cur = (kv_len - 1) // PAGE
            for h in range(hkv):
                others = rng.sample([b for b in range(nvis) if b != cur], nvalid - 1)
                row = sorted(others + [cur]) + [-1] * (K - nvalid)
                topk[t, h] = torch.tensor(row, dtype=torch.int32)
            t += 1
    x = torch.randn((P, hkv, PAGE, 2 * D), generator=gen)
    q_scale = rng.uniform(0.5, 2.0)
    qf = torch.randn((T, num_q_heads * D), generator=gen).clamp(-6, 6).to(FP8)
    qsl = torch.tensor([0] + [sum(query_lens[:i + 1]) for i in range(nreq)], dtype=torch.int32)
    sl_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    dev = torch.device(device)
    if kv_dtype == "fp8":
        kv_u8 = (torch.where(x >= 0, 1.0, -1.0) * x.abs().clamp_min(0.02)).to(FP8).view(torch.uint8).to(dev)
        k_scale, v_scale = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0)
    else:
        used = sorted(perm[:sum(nblocks)])  # the pages of the block table
        kv = x[used].to(torch.bfloat16).to(dev)
        k, v = kv[..., :D], kv[..., D:]
        # vLLM reads the global scales from the checkpoint: not the quantizer's default here,
        # but >= it, so that no block scale saturates
        k_scale, v_scale = (float(torch.tensor(float(a.abs().amax()) / (6 * 448) * rng.uniform(1.0, 2.0),
                                               dtype=torch.float32)) for a in (k, v))
        kv_u8 = torch.zeros(nvfp4_kv_cache_shape(P, hkv, PAGE), dtype=torch.uint8, device=dev)
        write_kv_nvfp4(kv_u8, used, k, v, k_scale, v_scale)
    return Step(
        num_decodes=num_decodes, decode_qlen=decode_qlen, query_lens=query_lens,
        seq_lens_list=seq_lens, num_q_heads=num_q_heads, num_kv_heads=hkv,
        query_fp8=qf.to(dev), query_bf16=(qf.float() * q_scale).to(torch.bfloat16).to(dev),
        kv_u8=kv_u8, topk_buffer=topk.to(dev), block_table=bt.to(dev),
        seq_lens=sl_cpu.to(dev), seq_lens_cpu=sl_cpu, query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl, sm_scale=1 / math.sqrt(D), q_scale=q_scale,
        k_scale=k_scale, v_scale=v_scale, kv_dtype=kv_dtype,
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.detach().double().cpu().reshape(ref.shape)
    assert not torch.isnan(o).any(), "NaN in the output (a row was not written)"
    norm = float(ref.norm())
    return float((o - ref).norm()) / norm if norm else float(o.abs().max())


# ----------------------------------------------------------------------------- model.py wiring
@dataclass
class ModelWiring:
    """The parts of vLLM's MiniMaxM3SparseAttention.__init__ / forward that pick and use the
    attention impl, as written in model.py: run them with `select`, `make_impl`, `allocate_query_fp8`."""

    selector_call: ast.Call
    impl_call: ast.Call
    allocate_query_fp8_def: ast.FunctionDef
    imported_from_common: list[str]

    @classmethod
    def parse(cls, path: Path = MODEL_PY) -> "ModelWiring":
        tree = ast.parse(path.read_text())
        imported = [a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                    and n.module == "vllm.models.minimax_m3.common.sparse_attention" for a in n.names]
        attn = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MiniMaxM3SparseAttention")
        init = next(n for n in attn.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        alloc = next(n for n in attn.body if isinstance(n, ast.FunctionDef) and n.name == "_allocate_query_fp8")
        selector = impl = None
        for node in ast.walk(init):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id == "select_main_backend_and_impl_cls":
                    selector = node
                elif node.func.id == "impl_cls":
                    impl = node
        assert selector is not None and impl is not None, "model.py no longer builds its impl this way"
        return cls(selector, impl, alloc, imported)

    def _eval(self, call: ast.Call, names: dict[str, Any]) -> Any:
        expr = ast.fix_missing_locations(ast.Expression(call))
        return eval(compile(expr, str(MODEL_PY), "eval"), dict(names))

    @staticmethod
    def layer_namespace(*, num_heads: int, num_kv_heads: int, kv_cache_dtype: str) -> SimpleNamespace:
        """`self` of MiniMaxM3SparseAttention.__init__ with the attributes its calls read."""
        return SimpleNamespace(num_heads=num_heads, head_dim=D, scaling=D ** -0.5,
                               num_kv_heads=num_kv_heads, kv_cache_dtype=kv_cache_dtype,
                               q_size=num_heads * D)

    def select(self, selector: Any, layer: SimpleNamespace, vllm_config: Any) -> tuple[type, type]:
        cfg = vllm_config.model_config.hf_text_config.sparse_attention_config
        return self._eval(self.selector_call, {"select_main_backend_and_impl_cls": selector,
                                               "self": layer, "sparse_cfg": cfg})

    def make_impl(self, impl_cls: type, layer: SimpleNamespace, vllm_config: Any) -> Any:
        cfg = vllm_config.model_config.hf_text_config.sparse_attention_config
        return self._eval(self.impl_call, {"impl_cls": impl_cls, "self": layer, "sparse_cfg": cfg,
                                           "vllm_config": vllm_config})

    def allocate_query_fp8(self, layer: SimpleNamespace, qkv: torch.Tensor) -> torch.Tensor | None:
        mod = ast.fix_missing_locations(ast.Module(body=[self.allocate_query_fp8_def], type_ignores=[]))
        ns: dict[str, Any] = {"torch": torch}
        exec(compile(mod, str(MODEL_PY), "exec"), ns)
        return ns["_allocate_query_fp8"](layer, qkv)


def vllm_config(*, num_q_heads: int, decode_backend: str, kv_cache_dtype: str, decode_qlen: int = 1,
                max_num_batched_tokens: int = 4096) -> SimpleNamespace:
    """The VllmConfig fields the MiniMax-M3 builders and model read (data, not a stand-in class)."""
    spec = None if decode_qlen == 1 else SimpleNamespace(num_speculative_tokens=decode_qlen - 1)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(
            num_attention_heads=num_q_heads,
            sparse_attention_config={"sparse_topk_blocks": 16, "sparse_block_size": PAGE})),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype=kv_cache_dtype),
        attention_config=SimpleNamespace(minimax_m3_msa_decode_backend=decode_backend),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens),
        speculative_config=spec,
    )
