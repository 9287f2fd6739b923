"""float64 reference of the sparse decode operator: the contract implemented literally.

Per token t (request r = t // qlen, local index j = t % qlen), KV head h:

    pos    = seq_lens[r] - qlen + j
    kv_len = max(pos + 1, 0)
    nvalid = min(K, ceil(kv_len / page))
    keys   = { page*b + n : b = topk[t,h,s], s < nvalid, b >= 0, 0 <= n < page, page*b + n < kv_len }
    out[t,q] = softmax(sm_scale * (q_scale Q[t,q]) . (k_scale K[key])) @ (v_scale V[key])

`keys` is a set: a block listed twice in a row (outside the contract, which promises unique
rows) counts once. Slots that are negative, past nvalid, or whose block has no visible key
(this also covers blocks past the request's blocks) are skipped without reading anything.
Blocks past the block table's width are skipped as well. Everything is computed on the CPU in
float64; inputs may live on CUDA (only the selected pages are gathered and copied). Work is
vectorized per (request, KV head): the keys of every block any of the request's tokens
selected are gathered once, and each token's key set is a boolean mask over them.

Cache formats, each read by one function that turns the gathered pages into float64 K, V:
- fp8 [P, Hkv, page, 2D] float8_e4m3fn (or its uint8 storage): K = k_scale * fp8(K bytes);
- NVFP4 uint8 [P, 2*Hkv, page, 72] (msa_jit.nvfp4): K = e2m1 * e4m3 block scale * k_scale;
- a float cache [P, Hkv, page, 2D] (bf16/fp16/fp32/fp64) holding the values themselves, so
  that unquantized or dequantized K/V go through the same math (no engine passes one).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .arguments import check_dim, check_int, check_scale, check_tensor
from .kernels.constants import HEAD_DIM
from .nvfp4 import check_nvfp4_kv_cache, dequantize_kv_nvfp4, is_nvfp4_kv_layout

__all__ = ["sparse_decode_reference"]

_FP8 = torch.float8_e4m3fn
_FLOAT_KV = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _on_cpu(scale: Any) -> Any:
    """A one-element device tensor (vLLM keeps its NVFP4 global scales on the GPU) as its value; anything
    else as it is, for check_scale to judge."""
    if isinstance(scale, torch.Tensor) and scale.device.type != "cpu" and scale.numel() == 1:
        return scale.detach().to("cpu")
    return scale


def _as_float64_cpu(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu").to(torch.float64)


def _dense_keys_values(kv_cache: torch.Tensor, pages: torch.Tensor, h: int, D: int,
                       k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 (or uint8 storage) or float [P, Hkv, page, 2D] cache -> K, V [len(pages)*page, D]."""
    if kv_cache.dtype in (_FP8, torch.uint8):
        kv_u8 = kv_cache.view(torch.uint8)
        chunk = kv_u8[pages.to(kv_u8.device), h].to("cpu").view(_FP8).to(torch.float64)
    else:
        chunk = kv_cache[pages.to(kv_cache.device), h].to("cpu").to(torch.float64)
    kk = chunk[..., :D].reshape(-1, D) * k_scale
    vv = chunk[..., D:].reshape(-1, D) * v_scale
    return kk, vv


def _nvfp4_keys_values(kv_cache: torch.Tensor, pages: torch.Tensor, h: int, D: int,
                       k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 [P, 2*Hkv, page, 72] cache -> K, V [len(pages)*page, D]: only head h's two slots
    of the gathered pages are copied and dequantized."""
    slots = kv_cache[pages.to(kv_cache.device), 2 * h:2 * h + 2].to("cpu")  # [nu, 2, page, 72]
    kk, vv = dequantize_kv_nvfp4(slots, k_scale, v_scale)
    return kk.reshape(-1, D), vv.reshape(-1, D)


@torch.no_grad()
def sparse_decode_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    topk: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    decode_query_len: int,
    *,
    sm_scale: float,
    q_scale: float = 1.0,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference sparse decode in float64.

    Args:
        query: [T, Hq, D] bfloat16 or float8_e4m3fn (any float dtype works), T = B * qlen.
        kv_cache: [P, Hkv, page, 2*D] float8_e4m3fn, or uint8 storage of it; or an NVFP4
            cache, uint8 [P, 2*Hkv, page, 72] (D == 128); or a float [P, Hkv, page, 2*D] cache.
        topk: [T, Hkv, K] integer logical block indices, any strides.
        block_table: [B, max_blocks] integer, logical block -> physical page.
        seq_lens: [B] integer, context lengths including the qlen new tokens.
        decode_query_len: qlen, an int >= 1.
        sm_scale, q_scale, k_scale, v_scale: finite and > 0; k_scale and v_scale are per-tensor (fp8) or
            global (NVFP4) scales, python floats or one-element tensors.
    Raises TypeError / ValueError naming the argument.
    Returns:
        (out [T, Hq, D] float64, lse [T, Hq] float64 natural log) on the CPU. A row without
        visible keys has out = 0 and lse = -inf.
    """
    for name, x in (("query", query), ("kv_cache", kv_cache), ("topk", topk), ("block_table", block_table),
                    ("seq_lens", seq_lens)):
        check_tensor(name, x)
    for name, x in (("topk", topk), ("block_table", block_table), ("seq_lens", seq_lens)):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer dtype (int32), got {x.dtype}")
    check_dim("seq_lens", seq_lens, 1, "[batch]")
    qlen = check_int("decode_query_len", decode_query_len, lo=1)
    sm_scale = check_scale("sm_scale", sm_scale)
    q_scale = check_scale("q_scale", q_scale)
    k_scale = check_scale("k_scale", _on_cpu(k_scale))
    v_scale = check_scale("v_scale", _on_cpu(v_scale))
    if query.dim() != 3 or kv_cache.dim() != 4 or topk.dim() != 3:
        raise ValueError(
            "sparse_decode_reference: expected query [T,Hq,D], kv_cache [P,Hkv,page,2D] (NVFP4: "
            "[P,2*Hkv,page,72]), "
            f"topk [T,Hkv,K]; got {tuple(query.shape)}, {tuple(kv_cache.shape)}, {tuple(topk.shape)}"
        )
    T, Hq, D = query.shape
    if is_nvfp4_kv_layout(kv_cache):
        P, Hkv, page = check_nvfp4_kv_cache(kv_cache)
        kv_dim_ok, keys_values = D == HEAD_DIM, _nvfp4_keys_values
    else:
        P, Hkv, page, row = kv_cache.shape
        kv_dim_ok, keys_values = row == 2 * D, _dense_keys_values
    K = topk.shape[2]
    B = seq_lens.shape[0]
    if T != B * qlen:
        raise ValueError(f"sparse_decode_reference: T={T} != batch {B} * qlen {qlen}")
    if not kv_dim_ok or Hkv < 1 or Hq % Hkv or topk.shape[:2] != (T, Hkv):
        raise ValueError(
            "sparse_decode_reference: inconsistent shapes "
            f"query {tuple(query.shape)}, kv_cache {tuple(kv_cache.shape)}, topk {tuple(topk.shape)}"
        )
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table: expected [batch={B}, max_blocks], got shape {list(block_table.shape)}")
    G = Hq // Hkv

    if kv_cache.dtype not in (_FP8, torch.uint8) + _FLOAT_KV:
        raise TypeError(f"sparse_decode_reference: kv_cache dtype {kv_cache.dtype} is not fp8/uint8/float")

    q = _as_float64_cpu(query) * q_scale                     # [T, Hq, D]
    topk_c = topk.detach().to("cpu", torch.int64)           # [T, Hkv, K]
    bt = block_table.detach().to("cpu", torch.int64)        # [B, max_blocks]
    sl = seq_lens.detach().to("cpu", torch.int64)           # [B]
    max_blocks = bt.shape[1]

    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    lse = torch.full((T, Hq), -math.inf, dtype=torch.float64)
    offsets = torch.arange(page, dtype=torch.int64)
    slot = torch.arange(K, dtype=torch.int64)

    for r in range(B):
        rows = slice(r * qlen, (r + 1) * qlen)                      # this request's tokens
        pos = int(sl[r]) - qlen + torch.arange(qlen, dtype=torch.int64)
        kv_len = torch.clamp_min(pos + 1, 0)                         # [qlen]
        nvalid = torch.clamp_max((kv_len + page - 1) // page, K)     # [qlen]
        for h in range(Hkv):
            blk = topk_c[rows, h]                                    # [qlen, K]
            # slots that may hold keys: s < nvalid, b >= 0, inside the table, first key visible
            ok = (slot[None, :] < nvalid[:, None]) & (blk >= 0) & (blk < max_blocks)
            ok &= blk * page < kv_len[:, None]
            used = torch.unique(blk[ok])                             # sorted block ids, [nu]
            if used.numel() == 0:
                continue
            pages = bt[r, used]
            if bool(((pages < 0) | (pages >= P)).any()):
                raise ValueError(
                    f"block_table: row {r} maps the selected blocks {used.tolist()} to pages "
                    f"{pages.tolist()}, outside the kv_cache's [0, {P})"
                )
            kk, vv = keys_values(kv_cache, pages, h, D, k_scale, v_scale)  # [nu*page, D] each
            key_pos = (used[:, None] * page + offsets).reshape(-1)       # [nu*page]
            # the contract's key set of every token, as a mask over the gathered keys
            chosen = ((blk[:, :, None] == used[None, None, :]) & ok[:, :, None]).any(dim=1)  # [qlen, nu]
            mask = chosen.repeat_interleave(page, dim=1) & (key_pos[None, :] < kv_len[:, None])
            qq = q[rows, h * G:(h + 1) * G]                              # [qlen, G, D]
            scores = sm_scale * torch.einsum("jgd,kd->jgk", qq, kk)      # [qlen, G, nu*page]
            scores = scores.masked_fill(~mask[:, None, :], -math.inf)
            row_lse = torch.logsumexp(scores, dim=-1)                    # [qlen, G], -inf if empty
            p = torch.where(mask[:, None, :], torch.exp(scores - row_lse[..., None]), 0.0)
            out[rows, h * G:(h + 1) * G] = torch.einsum("jgk,kd->jgd", p, vv)
            lse[rows, h * G:(h + 1) * G] = row_lse
    return out, lse
