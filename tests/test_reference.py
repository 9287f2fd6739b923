"""The float64 reference against an independent per-key Python loop (the contract, literally)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import FP8, Case, make_case

from msa_jit import sparse_decode_reference


def loop_reference(c: Case) -> tuple[np.ndarray, np.ndarray]:
    """Per-key loop over the contract's key set; returns (out [T,Hq,D], lse [T,Hq]) float64."""
    q = c.query.cpu().to(torch.float64).numpy() * c.q_scale
    kv = c.kv_cache.cpu().view(FP8).to(torch.float64).numpy()
    topk = c.topk.cpu().numpy()
    bt = c.block_table.cpu().numpy()
    sl = c.seq_lens_cpu.numpy()
    T, hq, D = q.shape
    hkv, page, K = c.num_kv_heads, c.page_size, c.topk_blocks
    G = hq // hkv
    out = np.zeros((T, hq, D))
    lse = np.full((T, hq), -math.inf)
    for t in range(T):
        r, j = divmod(t, c.qlen)
        pos = int(sl[r]) - c.qlen + j
        kv_len = max(pos + 1, 0)
        nvalid = min(K, math.ceil(kv_len / page))
        for h in range(hkv):
            keys = set()
            for s in range(nvalid):
                b = int(topk[t, h, s])
                if b < 0:
                    continue
                for n in range(page):
                    if page * b + n < kv_len:
                        keys.add(page * b + n)
            if not keys:
                continue
            qg = q[t, h * G:(h + 1) * G]  # [G, D]
            scores, values = [], []
            for key in sorted(keys):
                b, n = divmod(key, page)
                p = int(bt[r, b])
                k_vec = kv[p, h, n, :D] * c.k_scale
                v_vec = kv[p, h, n, D:] * c.v_scale
                scores.append(c.sm_scale * (qg @ k_vec))
                values.append(v_vec)
            s_mat = np.stack(scores, axis=1)  # [G, nk]
            m = s_mat.max(axis=1, keepdims=True)
            w = np.exp(s_mat - m)
            den = w.sum(axis=1)
            out[t, h * G:(h + 1) * G] = (w @ np.stack(values)) / den[:, None]
            lse[t, h * G:(h + 1) * G] = m[:, 0] + np.log(den)
    return out, lse


def _check(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = sparse_decode_reference(*c.reference_args(), **c.scales())
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == (c.num_tokens, c.num_q_heads, 128) and lse.shape == (c.num_tokens, c.num_q_heads)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    exp_out, exp_lse = loop_reference(c)
    np.testing.assert_allclose(out.numpy(), exp_out, rtol=1e-12, atol=1e-12)
    finite = np.isfinite(exp_lse)
    assert np.array_equal(np.isfinite(lse.numpy()), finite)
    np.testing.assert_allclose(lse.numpy()[finite], exp_lse[finite], rtol=1e-12, atol=1e-12)
    assert (lse.numpy()[~finite] == -np.inf).all()
    return out, lse


# (batch, qlen, Hq, Hkv, page, topk, ctx_lens or None)
CASES = [
    (3, 1, 4, 2, 64, 4, None),
    (2, 3, 4, 1, 64, 16, [70, 1000]),         # partial last blocks, < 16 valid blocks
    (2, 2, 2, 2, 64, 4, [64, 384]),           # exact multiples, > topk blocks (truncated to topk)
    (1, 32, 2, 1, 64, 16, [200]),             # qlen 32: causality between speculative tokens
    (2, 5, 4, 2, 64, 8, [3, 0]),              # kv_len == 0 rows (padded requests)
    (1, 2, 16, 1, 128, 16, [300]),            # the production page size, group 16
    (4, 2, 8, 1, 64, 3, None),
]


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("transposed", [False, True], ids=["tok-major", "transposed"])
@pytest.mark.parametrize("geom", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_reference_matches_loop(geom, q_dtype, transposed):
    batch, qlen, hq, hkv, page, topk, ctx = geom
    c = make_case(batch, qlen, hq, hkv, q_dtype=q_dtype, seed=CASES.index(geom) + 100 * transposed, device="cpu",
                  ctx_lens=ctx, transposed_topk=transposed, page_size=page, topk_blocks=topk)
    if transposed:
        assert c.topk.stride() == (topk, c.num_tokens * topk, 1)  # really the [Hkv, T, K] layout
    _check(c)


@pytest.mark.parametrize("seed", range(4))
def test_reference_adversarial_matches_loop(seed):
    """Garbage pages, -1 mid-row, blocks past the request, duplicates: no OOB, set semantics."""
    c = make_case(4, 3, 4, 2, q_dtype=FP8, seed=seed, device="cpu", adversarial=True,
                  padded=True, page_size=64, topk_blocks=6, ctx_lens=None if seed % 2 else [5, 130, 0, 520])
    _check(c)


def test_empty_rows_are_zero_with_minus_inf_lse():
    c = make_case(3, 4, 4, 2, q_dtype=torch.bfloat16, seed=7, ctx_lens=[0, 2, 100],
                  page_size=64, topk_blocks=4)
    out, lse = _check(c)
    # request 0: all 4 rows empty; request 1 (seq_len 2, qlen 4): rows j=0,1 empty
    empty = [0, 1, 2, 3, 4, 5]
    assert (out[empty] == 0).all()
    assert torch.isneginf(lse[empty]).all()
    assert torch.isfinite(lse[6:]).all()


def test_uint8_kv_storage_and_topk_width_mask():
    c = make_case(2, 2, 4, 2, q_dtype=torch.bfloat16, seed=11, ctx_lens=[150, 600],
                  page_size=64, topk_blocks=5)
    a = sparse_decode_reference(*c.reference_args(), **c.scales())
    args = list(c.reference_args())
    args[1] = c.kv_cache.view(torch.uint8)
    b = sparse_decode_reference(*args, **c.scales())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_single_visible_key_returns_its_value():
    """seq_len 1, qlen 1: the only key is position 0; out == v_scale * V exactly, lse == score."""
    c = make_case(1, 1, 2, 1, q_dtype=torch.bfloat16, seed=5, ctx_lens=[1], page_size=64, topk_blocks=4)
    out, lse = sparse_decode_reference(*c.reference_args(), **c.scales())
    p = int(c.block_table[0, 0])
    kv = c.kv_cache.view(FP8)[p, 0, 0].to(torch.float64)
    assert torch.allclose(out[0, 0], kv[128:] * c.v_scale, rtol=0, atol=1e-15)
    s = c.sm_scale * (c.query[0, 0].double() * c.q_scale) @ (kv[:128] * c.k_scale)
    assert math.isclose(float(lse[0, 0]), float(s), rel_tol=1e-13)


def test_reference_rejects_broken_block_table():
    c = make_case(1, 1, 2, 1, q_dtype=torch.bfloat16, seed=5, ctx_lens=[100], page_size=64, topk_blocks=4)
    bt = c.block_table.clone()
    bt[0, 0] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        sparse_decode_reference(c.query, c.kv_cache, c.topk, bt, c.seq_lens, 1, **c.scales())


@pytest.mark.parametrize("sm_scale", [0.37, 1.0])
def test_reference_takes_the_given_sm_scale(sm_scale):
    """Every other case passes sm_scale = 1/sqrt(128): a reference that used 1/sqrt(D) instead of its
    argument would pass all of them."""
    c = make_case(2, 2, 4, 2, q_dtype=FP8, seed=3, ctx_lens=[70, 300], page_size=64, topk_blocks=4)
    c.sm_scale = sm_scale
    out, lse = sparse_decode_reference(*c.reference_args(), **c.scales())
    want_out, want_lse = loop_reference(c)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-12, atol=1e-12)


def test_reference_skips_blocks_past_the_table_width():
    """Called directly (the op's validation rejects seq_len > width * page), the reference skips a
    selected block past the block table's width, as its docstring says."""
    c = make_case(1, 1, 2, 1, q_dtype=torch.bfloat16, seed=4, ctx_lens=[300], page_size=64, topk_blocks=5)
    assert c.topk[0, 0].tolist() == [0, 1, 2, 3, 4]
    args = list(c.reference_args())
    args[3] = c.block_table[:, :3]
    out, lse = sparse_decode_reference(*args, **c.scales())
    c.topk = torch.where(c.topk >= 3, -1, c.topk)
    want_out, want_lse = loop_reference(c)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-12, atol=1e-12)
