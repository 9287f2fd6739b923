"""The float64 reference on an NVFP4 cache, and NVFP4 cases of msa_jit.testing.

The reference is checked against a per-key loop that reads K/V through the literal decoder
(tests/nvfp4_literal.py), and against itself on a float cache holding the dequantized values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import FP8, Case, error_vs_unquantized, make_case
from nvfp4_literal import decode_slot, slot_bytes

from msa_jit import sparse_decode_reference
from msa_jit.nvfp4 import dequantize_kv_nvfp4, quantize_kv_nvfp4
from msa_jit.testing import compare_with_reference


def literal_loop_reference(c: Case) -> tuple[np.ndarray, np.ndarray]:
    """The contract per key, K/V decoded element by element from the cache bytes."""
    q = c.query.cpu().to(torch.float64).numpy() * c.q_scale
    cache = c.kv_cache.cpu()
    topk, bt, sl = c.topk.cpu().numpy(), c.block_table.cpu().numpy(), c.seq_lens_cpu.numpy()
    T, hq, D = q.shape
    hkv, page, K = c.num_kv_heads, c.page_size, c.topk_blocks
    G = hq // hkv
    decoded: dict[tuple[int, int], np.ndarray] = {}

    def row(p: int, slot: int, n: int) -> np.ndarray:
        if (p, slot) not in decoded:
            gs = c.v_scale if slot % 2 else c.k_scale
            decoded[p, slot] = np.array(decode_slot(slot_bytes(cache, p, slot), page, slot % 2 == 1, gs))
        return decoded[p, slot][n]

    out, lse = np.zeros((T, hq, D)), np.full((T, hq), -math.inf)
    for t in range(T):
        r, j = divmod(t, c.qlen)
        kv_len = max(int(sl[r]) - c.qlen + j + 1, 0)
        nvalid = min(K, math.ceil(kv_len / page))
        for h in range(hkv):
            keys = sorted({page * int(b) + n for b in topk[t, h, :nvalid] if b >= 0
                           for n in range(page) if page * int(b) + n < kv_len})
            if not keys:
                continue
            qg = q[t, h * G:(h + 1) * G]
            s = np.stack([c.sm_scale * (qg @ row(int(bt[r, key // page]), 2 * h, key % page)) for key in keys], axis=1)
            vals = np.stack([row(int(bt[r, key // page]), 2 * h + 1, key % page) for key in keys])
            m = s.max(axis=1, keepdims=True)
            w = np.exp(s - m)
            out[t, h * G:(h + 1) * G] = (w @ vals) / w.sum(axis=1)[:, None]
            lse[t, h * G:(h + 1) * G] = m[:, 0] + np.log(w.sum(axis=1))
    return out, lse


def _dequantized_float_cache(c: Case) -> torch.Tensor:
    k, v = dequantize_kv_nvfp4(c.kv_cache, c.k_scale, c.v_scale)
    return torch.cat((k, v), dim=-1)                               # [P, Hkv, page, 256] float64


# (batch, qlen, Hq, Hkv, page, topk, ctx_lens or None)
CASES = [
    (2, 1, 4, 2, 16, 4, [20, 70]),
    (2, 3, 4, 1, 8, 6, [5, 45]),           # partial last blocks, more blocks than topk
    (1, 4, 2, 1, 16, 4, [3]),              # kv_len == 0 rows
]


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("geom", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_nvfp4_reference_matches_the_literal_loop(geom, q_dtype):
    batch, qlen, hq, hkv, page, topk, ctx = geom
    c = make_case(batch, qlen, hq, hkv, q_dtype=q_dtype, seed=CASES.index(geom), ctx_lens=ctx,
                  page_size=page, topk_blocks=topk, kv_dtype="nvfp4")
    out, lse = sparse_decode_reference(*c.reference_args(), **c.scales())
    exp_out, exp_lse = literal_loop_reference(c)
    np.testing.assert_allclose(out.numpy(), exp_out, rtol=1e-12, atol=1e-12)
    finite = np.isfinite(exp_lse)
    assert np.array_equal(np.isfinite(lse.numpy()), finite)
    np.testing.assert_allclose(lse.numpy()[finite], exp_lse[finite], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw", [dict(), dict(adversarial=True, padded=True), dict(transposed_topk=True, qlen=3)],
                         ids=["plain", "adversarial", "transposed"])
def test_nvfp4_reference_equals_the_reference_on_the_dequantized_float_cache(kw):
    kw = dict(qlen=2) | kw
    c = make_case(4, kw.pop("qlen"), 8, 2, q_dtype=torch.bfloat16, seed=21, page_size=32, topk_blocks=5,
                  kv_dtype="nvfp4", **kw)
    a = sparse_decode_reference(*c.reference_args(), **c.scales())
    args = list(c.reference_args())
    args[1] = _dequantized_float_cache(c)
    b = sparse_decode_reference(*args, **dict(c.scales(), k_scale=1.0, v_scale=1.0))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].abs().sum() > 0


def test_reference_takes_global_scales_as_floats_or_one_element_tensors():
    c = make_case(2, 2, 4, 1, q_dtype=FP8, seed=3, ctx_lens=[40, 200], page_size=32, topk_blocks=4, kv_dtype="nvfp4")
    a = sparse_decode_reference(*c.reference_args(), **c.scales())
    b = sparse_decode_reference(*c.reference_args(), **c.scales(scale_tensors=True))
    s = c.scales()
    s.update(k_scale=torch.tensor([c.k_scale], dtype=torch.float64), v_scale=torch.tensor([[c.v_scale]]))
    d = sparse_decode_reference(*c.reference_args(), **s)
    assert all(torch.equal(a[i], x[i]) for x in (b, d) for i in (0, 1))
    # the global scales are really used: doubling v_scale doubles the output
    e = sparse_decode_reference(*c.reference_args(), **dict(c.scales(), v_scale=2 * c.v_scale))
    assert torch.equal(e[0], 2 * a[0])


def test_reference_on_a_float_cache_equals_the_fp8_cache_it_holds():
    c = make_case(2, 2, 4, 2, q_dtype=torch.bfloat16, seed=9, ctx_lens=[100, 300], page_size=64, topk_blocks=4)
    a = sparse_decode_reference(*c.reference_args(), **c.scales())
    args = list(c.reference_args())
    for dt in (torch.float64, torch.float32, torch.bfloat16):     # fp8 values are exact in each
        args[1] = c.kv_cache.to(dt)
        b = sparse_decode_reference(*args, **c.scales())
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_reference_rejects_bad_nvfp4_inputs():
    c = make_case(1, 1, 2, 1, q_dtype=torch.bfloat16, seed=5, ctx_lens=[20], page_size=16, topk_blocks=2, kv_dtype="nvfp4")
    with pytest.raises(ValueError, match="inconsistent shapes"):
        sparse_decode_reference(c.query[..., :64], *c.reference_args()[1:], **c.scales())
    with pytest.raises(ValueError, match="inconsistent shapes"):        # 2*Hkv slots, Hkv = 1
        sparse_decode_reference(c.query, torch.cat((c.kv_cache, c.kv_cache), 1), *c.reference_args()[2:], **c.scales())
    odd = torch.zeros(c.kv_cache.shape[0], 2, 6, 72, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 4"):
        sparse_decode_reference(c.query, odd, *c.reference_args()[2:], **c.scales())
    with pytest.raises(ValueError, match="^k_scale: "):
        sparse_decode_reference(*c.reference_args(), **dict(c.scales(), k_scale=math.inf))
    with pytest.raises(TypeError, match="kv_cache dtype"):
        sparse_decode_reference(c.query, torch.zeros(5, 1, 16, 256, dtype=torch.int32), *c.reference_args()[2:],
                                **c.scales())


# ---------------------------------------------------------------- msa_jit.testing

def test_make_case_nvfp4_builds_the_cache_with_the_writer():
    c = make_case(3, 2, 8, 2, q_dtype=torch.bfloat16, seed=4, page_size=32, topk_blocks=4, kv_dtype="nvfp4")
    P = c.kv_cache.shape[0]
    assert c.kv_dtype == "nvfp4" and c.kv_cache.dtype == torch.uint8 and c.kv_cache.is_contiguous()
    assert c.kv_cache.shape == (P, 4, 32, 72)
    assert c.k_unquantized.shape == c.v_unquantized.shape == (P, 2, 32, 128)
    assert c.k_unquantized.dtype == torch.bfloat16 and c.k_unquantized.device.type == "cpu"
    again, gk, gv = quantize_kv_nvfp4(c.k_unquantized, c.v_unquantized)
    assert torch.equal(again, c.kv_cache) and (gk, gv) == (c.k_scale, c.v_scale)
    assert c.unquantized_kv_cache().shape == (P, 2, 32, 256)
    # outlier channels: a few K channels per head carry much more energy than the median one
    energy = c.k_unquantized.double().pow(2).mean(dim=(0, 2))          # [Hkv, 128]
    assert (energy.max(dim=1).values > 10 * energy.median(dim=1).values).all()


def test_make_case_defaults_stay_fp8():
    c = make_case(2, 1, 4, 1, q_dtype=torch.bfloat16, seed=2, page_size=64, topk_blocks=4)
    assert c.kv_dtype == "fp8" and c.kv_cache.dtype == FP8 and c.kv_cache.shape[-1] == 256
    assert c.k_unquantized is None and 0.5 <= c.k_scale <= 2.0
    with pytest.raises(ValueError, match="keeps no unquantized"):
        c.unquantized_kv_cache()
    with pytest.raises(ValueError, match="^kv_dtype: "):
        make_case(1, 1, 4, 1, q_dtype=torch.bfloat16, seed=0, kv_dtype="fp4")
    with pytest.raises(ValueError, match="^page_size: "):
        make_case(1, 1, 4, 1, q_dtype=torch.bfloat16, seed=0, page_size=6, kv_dtype="nvfp4")


def test_scales_as_tensors_are_the_same_numbers():
    c = make_case(1, 1, 4, 1, q_dtype=torch.bfloat16, seed=1, page_size=16, topk_blocks=2, kv_dtype="nvfp4")
    f, t = c.scales(), c.scales(scale_tensors=True)
    for name in ("k_scale", "v_scale"):
        x = t[name]
        assert isinstance(f[name], float) and x.dtype == torch.float32 and x.shape == () and x.device == c.device
        assert float(x) == f[name]                                   # float32-representable
    assert t["sm_scale"] == f["sm_scale"] and t["q_scale"] == f["q_scale"]


def test_compare_with_reference_on_an_nvfp4_case():
    c = make_case(2, 2, 8, 1, q_dtype=torch.bfloat16, seed=6, page_size=64, topk_blocks=4, kv_dtype="nvfp4")
    out, lse = sparse_decode_reference(*c.reference_args(), **c.scales())
    err, problems = compare_with_reference(c, out.to(torch.bfloat16), lse.float())
    assert problems == [] and err < 5e-3
    assert any("L2" in p for p in compare_with_reference(c, out * 1.05, lse)[1])


@pytest.mark.parametrize("geom", [(2, 2, 16, 1, [2500, 900]), (1, 1, 64, 4, [3000])], ids=["16/1", "64/4"])
def test_error_vs_unquantized_kv_is_finite_and_bounded(geom):
    """What NVFP4 gives up on the stand-in K/V distribution: 0.2-0.3 here (docs/nvfp4.md).
    A reader that disagrees with the writer (V scales read row-major: 0.52) fails it."""
    batch, qlen, hq, hkv, ctx = geom
    c = make_case(batch, qlen, hq, hkv, q_dtype=torch.bfloat16, seed=7, ctx_lens=ctx, kv_dtype="nvfp4")
    out, _ = sparse_decode_reference(*c.reference_args(), **c.scales())
    err = error_vs_unquantized(c, out)
    assert math.isfinite(err) and 0.05 < err < 0.4, err
    assert error_vs_unquantized(c, sparse_decode_reference(*_unquantized_args(c), **dict(c.scales(), k_scale=1.0, v_scale=1.0))[0]) == 0.0


def _unquantized_args(c: Case) -> list:
    args = list(c.reference_args())
    args[1] = c.unquantized_kv_cache()
    return args


@pytest.mark.gpu
def test_make_case_nvfp4_on_cuda_matches_the_cpu_case():
    cpu = make_case(3, 2, 16, 1, q_dtype=FP8, seed=12, kv_dtype="nvfp4")
    gpu = make_case(3, 2, 16, 1, q_dtype=FP8, seed=12, kv_dtype="nvfp4", device="cuda")
    assert gpu.kv_cache.is_cuda and torch.equal(gpu.kv_cache.cpu(), cpu.kv_cache)
    assert (gpu.k_scale, gpu.v_scale) == (cpu.k_scale, cpu.v_scale)
    s = gpu.scales(scale_tensors=True)
    assert s["k_scale"].is_cuda and s["k_scale"].dtype == torch.float32
    a = sparse_decode_reference(*gpu.reference_args(), **s)
    b = sparse_decode_reference(*cpu.reference_args(), **cpu.scales())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
