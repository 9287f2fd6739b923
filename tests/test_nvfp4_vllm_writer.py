"""msa_jit's NVFP4 reader on what vLLM 0.33.0's own cache writer puts in the cache on Hopper.

The writer is the NVFP4 store of the compiled fused MiniMax-M3 insert (vLLM's `_C` library);
tests/vllm_nvfp4_insert.py is its sm_90 machine code read back as a CPU model. These tests
feed that model's bytes to `msa_jit.nvfp4.dequantize_kv_nvfp4` and to `msa_jit.reference`:
layout, slot order, nibble order, both block-scale orders and the global-scale convention
(a dequantization scale: value = e2m1 * block * g) must give back exactly the values the
writer encoded. The last tests pin the value vLLM's dummy weight loader leaves in the scale
buffers, and what the writer makes of it.
"""

from __future__ import annotations

import pytest
import torch
import vllm_nvfp4_insert as vllm_insert

from msa_jit import sparse_decode_reference
from msa_jit.nvfp4 import E2M1_VALUES, dequantize_kv_nvfp4, nvfp4_kv_cache_shape, write_kv_nvfp4

E4M3 = torch.float8_e4m3fn


def _rows(n: int, hkv: int, seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn((n, hkv, 128), generator=gen) * 2 * scale).to(torch.bfloat16)
    v = (torch.randn((n, hkv, 128), generator=gen) * scale).to(torch.bfloat16)
    return k, v


def _encoded(wrote: dict[str, torch.Tensor], side: str, g: float) -> torch.Tensor:
    """float64 [N, Hkv, 128]: the values the writer encoded (code * block scale * g)."""
    codes, scales = wrote[f"{side}_codes"], wrote[f"{side}_scales"]
    vals = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes].reshape(*codes.shape[:-1], 8, 16)
    return (vals * scales.view(E4M3).double()[..., None] * g).reshape(codes.shape)


def _token_rows(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[P, Hkv, page, 128] -> the rows of the given slot_mapping entries, [N, Hkv, 128]."""
    P, hkv, page, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(P * page, hkv, d)[slots]


@pytest.mark.parametrize("g_k, g_v", [(1.0, 1.0), (0.0042, 0.0017), (3.0, 0.5)])
def test_reader_gives_back_what_the_hopper_insert_encoded(g_k, g_v):
    """Every token the writer stored, read back through msa_jit.nvfp4: bit-exact values. The
    cache is a view with a padded page stride (the writer takes stride(0) only), pages and
    tokens scattered, one token skipped (slot_mapping -1)."""
    P, hkv, page, n = 5, 2, 16, 37
    big = torch.zeros((P, 2 * hkv * page * 72 + 48), dtype=torch.uint8)
    cache = big[:, :2 * hkv * page * 72].view(P, 2 * hkv, page, 72)
    assert cache.stride(0) != 2 * hkv * page * 72
    slots = torch.randperm(P * page, generator=torch.Generator().manual_seed(1))[:n]
    slots[5] = -1
    k, v = _rows(n, hkv, seed=2)
    wrote = vllm_insert.insert(cache, slots, k, v, g_k, g_v)
    kd, vd = dequantize_kv_nvfp4(cache, g_k, g_v)
    keep = slots >= 0
    for side, got, x, g in (("k", kd, k, g_k), ("v", vd, v, g_v)):
        want = _encoded(wrote, side, g)[keep]
        assert torch.equal(_token_rows(got, slots[keep]), want), side
        # and the encoded values are x's NVFP4 approximation (relative L2 ~0.09 on normal data)
        err = (want - x[keep].double()).norm() / x[keep].double().norm()
        assert 0.05 < err < 0.15, (side, float(err))
    # nothing outside the written rows was touched (the padding of each page stays 0)
    assert int(big[:, 2 * hkv * page * 72:].count_nonzero()) == 0


def test_layout_is_the_engines_block_contiguous_slots():
    """One token, two KV heads: its bytes sit where docs/nvfp4.md says (codes at 64n of the
    head's slot 2h+side, K scales row-major at page*64 + 8n + g, V scales swizzled), and
    nowhere else."""
    page, n = 8, 6
    cache = torch.zeros(nvfp4_kv_cache_shape(1, 2, page), dtype=torch.uint8)
    k, v = _rows(1, 2, seed=3)
    wrote = vllm_insert.insert(cache, torch.tensor([n]), k, v, 1.0, 1.0)
    flat = cache.reshape(2 * 2, page * 72)
    for h in (0, 1):
        for side in (0, 1):
            slot = flat[2 * h + side].clone()
            codes = wrote["kv"[side] + "_codes"][0, h]
            assert slot[64 * n: 64 * n + 64].tolist() == (codes[0::2] | (codes[1::2] << 4)).tolist()
            scales = wrote["kv"[side] + "_scales"][0, h].tolist()
            at = [page * 64 + (8 * n + g if side == 0 else (n // 4) * 32 + (g // 2) * 8 + (g % 2) * 4 + n % 4)
                  for g in range(8)]
            assert [int(slot[a]) for a in at] == scales
            slot[64 * n: 64 * n + 64] = 0
            slot[at] = 0
            assert int(slot.count_nonzero()) == 0, (h, side)  # no other byte of the slot written


@pytest.mark.parametrize("g", [1.0, 0.25])
def test_msa_jit_writer_stores_the_same_values(g):
    """msa_jit.nvfp4's writer (tests, benchmarks) and the engine's agree value for value at the
    scales where both divisions are exact (1.0, what vLLM serves by default; powers of two).
    Bytes differ only in the sign of zero codes (the engine clears it). At other global scales
    the engine's float32 x * (1/g) can land a near-tie on the other side: one code step, on
    about 0.1% of the elements of a calibrated scale amax / 2688."""
    P, hkv, page = 3, 2, 16
    gen = torch.Generator().manual_seed(4)
    k = (torch.randn((P, hkv, page, 128), generator=gen) * 3).to(torch.bfloat16)
    v = torch.randn((P, hkv, page, 128), generator=gen).to(torch.bfloat16)
    ours = torch.zeros(nvfp4_kv_cache_shape(P, hkv, page), dtype=torch.uint8)
    write_kv_nvfp4(ours, list(range(P)), k, v, g, g)
    engine = torch.zeros_like(ours)
    slots = torch.arange(P * page)
    vllm_insert.insert(engine, slots, _token_rows(k, slots), _token_rows(v, slots), g, g)
    for a, b in zip(dequantize_kv_nvfp4(ours, g, g), dequantize_kv_nvfp4(engine, g, g)):
        assert torch.equal(a, b)


def test_reference_decodes_the_engines_cache():
    """msa_jit.reference on the engine-written cache equals the reference on a float cache that
    holds the values the writer encoded."""
    P, hkv, hq, page, B = 6, 2, 8, 16, 2
    ctx = [40, 75]
    block_table = torch.tensor([[0, 2, 4, 5, 1], [3, 1, 5, 4, 2]], dtype=torch.int32)
    slots, rows = [], []
    for b, L in enumerate(ctx):
        for pos in range(L):
            slots.append(int(block_table[b, pos // page]) * page + pos % page)
    slots = torch.tensor(slots)
    k, v = _rows(len(slots), hkv, seed=5)
    g_k, g_v = 1.0, 0.5
    cache = torch.zeros(nvfp4_kv_cache_shape(P, hkv, page), dtype=torch.uint8)
    wrote = vllm_insert.insert(cache, slots, k, v, g_k, g_v)
    dense = torch.zeros((P * page, hkv, 256), dtype=torch.float64)
    dense[slots, :, :128] = _encoded(wrote, "k", g_k)
    dense[slots, :, 128:] = _encoded(wrote, "v", g_v)
    dense = dense.reshape(P, page, hkv, 256).permute(0, 2, 1, 3).contiguous()
    gen = torch.Generator().manual_seed(6)
    q = torch.randn((B, hq, 128), generator=gen).to(torch.bfloat16)
    topk = torch.tensor([[[0, 2, 1]] * hkv, [[4, 0, 3]] * hkv], dtype=torch.int32)
    seq_lens = torch.tensor(ctx, dtype=torch.int32)
    got, _ = sparse_decode_reference(q, cache, topk, block_table, seq_lens, 1, sm_scale=0.088,
                                     k_scale=torch.tensor(g_k), v_scale=torch.tensor(g_v))
    want, _ = sparse_decode_reference(q, dense, topk, block_table, seq_lens, 1, sm_scale=0.088)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- the scale buffers after a dummy load

def philox_uniform(seed: int, low: float, high: float) -> float:
    """The first value of a 1-element float32 `uniform_(low, high)` on a CUDA generator seeded
    `seed` (torch: curand Philox4x32-10, counter 0, key = seed; curand_uniform4's first lane)."""
    m0, m1, w0, w1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
    c, key = [0, 0, 0, 0], [seed & 0xFFFFFFFF, seed >> 32]
    for _ in range(10):
        p0, p1 = m0 * c[0], m1 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ key[0], p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ key[1], p0 & 0xFFFFFFFF]
        key = [(key[0] + w0) & 0xFFFFFFFF, (key[1] + w1) & 0xFFFFFFFF]
    inv = torch.tensor(2.3283064e-10, dtype=torch.float32)
    u = torch.tensor(float(c[0]), dtype=torch.float32) * inv + inv / 2
    return float(u * torch.tensor(high - low, dtype=torch.float32) + torch.tensor(low, dtype=torch.float32))


# vLLM 0.33's DummyModelLoader fills every persistent buffer of a layer with
# initialize_single_dummy_weight (uniform(-1e-3, 1e-3), seed 1234 for each tensor), so the
# MiniMax-M3 sparse layer's _k_scale and _v_scale both hold this value on a GPU worker.
DUMMY_SCALE = philox_uniform(1234, -1e-3, 1e-3)
# What the bench/e2e hook measured on an H100 (RMS of the one key it read, K and V alike).
MEASURED_RMS = 8.737314146856079e-06


def test_the_dummy_loaders_scale_value():
    assert DUMMY_SCALE == pytest.approx(-7.4558414e-4, rel=1e-7)
    assert float(torch.tensor(DUMMY_SCALE, dtype=torch.float32)) == DUMMY_SCALE


def test_a_negative_global_scale_leaves_only_signs():
    """g < 0: amax/6 * (1/g) is negative, the 2^-9 floor takes every block scale, every code
    saturates at 6: each element reads back as +-6 * 2^-9 * g whatever it was. The RMS of one
    key is exactly what the e2e hook saw in vLLM's NVFP4 cache."""
    cache = torch.zeros(nvfp4_kv_cache_shape(1, 1, 8), dtype=torch.uint8)
    k, v = _rows(8, 1, seed=7)
    wrote = vllm_insert.insert(cache, torch.arange(8), k, v, DUMMY_SCALE, DUMMY_SCALE)
    for side in "kv":
        assert bool((wrote[f"{side}_scales"] == 0x01).all())  # E4M3 2^-9
        assert bool(((wrote[f"{side}_codes"] & 7) == 7).all())  # magnitude 6
    kd, vd = dequantize_kv_nvfp4(cache, DUMMY_SCALE, DUMMY_SCALE)
    for x in (kd, vd):
        assert x.pow(2).mean().sqrt().item() == pytest.approx(MEASURED_RMS, rel=1e-12)
        assert torch.equal(x.abs(), torch.full_like(x, 6 * vllm_insert.MIN_BLOCK * abs(DUMMY_SCALE)))


def test_global_scale_one_keeps_the_values():
    """With the scale vLLM registers (1.0), the same rows come back at NVFP4 precision."""
    cache = torch.zeros(nvfp4_kv_cache_shape(1, 1, 8), dtype=torch.uint8)
    k, v = _rows(8, 1, seed=7)
    vllm_insert.insert(cache, torch.arange(8), k, v, 1.0, 1.0)
    kd, vd = dequantize_kv_nvfp4(cache, 1.0, 1.0)
    for got, x in ((kd, k), (vd, v)):
        x = x.double().reshape(1, 8, 1, 128).transpose(1, 2)
        assert ((got - x).norm() / x.norm()).item() < 0.15
