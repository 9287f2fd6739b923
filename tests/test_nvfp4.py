"""msa_jit.nvfp4: the NVFP4 cache layout, its writer and reader, against the contract written
out literally (tests/nvfp4_literal.py) rather than against the module's own helpers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nvfp4_literal import (E2M1_MAG, E4M3_NONNEG, decode_slot, e4m3_value, quantize_row,
                           read_code_and_scale, slot_bytes)

from msa_jit import nvfp4
from msa_jit.kernels import constants
from msa_jit.kernels.constants import NVFP4_ROW_BYTES
from msa_jit.nvfp4 import (default_global_scale, dequantize_kv_nvfp4,
                           is_nvfp4_kv_layout, k_scale_offset, nvfp4_kv_cache_slots,
                           nvfp4_kv_cache_views, quantize_kv_nvfp4, v_scale_offset, write_kv_nvfp4)

CUDA = torch.cuda.is_available()


def _kv(P, hkv, page, seed, dtype=torch.bfloat16, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn((P, hkv, page, 128), generator=gen) * scale).to(dtype)
    v = (torch.randn((P, hkv, page, 128), generator=gen) * scale * 0.5).to(dtype)
    return k, v


def _check_against_literal(cache, k, v, gk, gv):
    """Every byte as the literal quantizer predicts, every value as the literal decoder reads."""
    P, slots, page, _ = cache.shape
    kd, vd = dequantize_kv_nvfp4(cache, gk, gv)
    for p in range(P):
        for h in range(slots // 2):
            for is_v, x, gs, got in ((False, k, gk, kd), (True, v, gv, vd)):
                flat = slot_bytes(cache, p, 2 * h + is_v)
                for n in range(page):
                    codes, scales = quantize_row(x[p, h, n].double().tolist(), gs)
                    for j in range(128):
                        assert read_code_and_scale(flat, page, n, j, is_v) == (codes[j], scales[j // 16]), \
                            (p, h, is_v, n, j)
                expected = torch.tensor(decode_slot(flat, page, is_v, gs), dtype=torch.float64)
                assert torch.equal(got[p, h], expected), (p, h, is_v)


# ---------------------------------------------------------------- layout

def test_layout_constants():
    assert (constants.NVFP4_CODE_BYTES, constants.NVFP4_SCALE_BYTES, NVFP4_ROW_BYTES) == (64, 8, 72)
    assert constants.NVFP4_GROUP_SIZE == 16 and constants.HEAD_DIM == 128
    assert list(nvfp4.E2M1_VALUES) == E2M1_MAG + [-x for x in E2M1_MAG]
    assert math.copysign(1.0, nvfp4.E2M1_VALUES[8]) == -1.0      # code 8 is -0.0
    assert nvfp4.nvfp4_kv_cache_shape(5, 4, 128) == (5, 8, 128, 72)
    # the E4M3 grid the writer rounds onto is torch's float8_e4m3fn, checked bit by bit
    grid = nvfp4._e4m3_grid(torch.device("cpu")).tolist()
    assert grid == E4M3_NONNEG and grid[-1] == 448.0


def test_is_nvfp4_kv_layout_tells_the_two_formats_apart():
    assert is_nvfp4_kv_layout(torch.zeros(3, 8, 128, 72, dtype=torch.uint8))
    assert is_nvfp4_kv_layout(torch.zeros(1, 2, 4, 72, dtype=torch.uint8))
    fp8 = torch.zeros(3, 4, 128, 256, dtype=torch.float8_e4m3fn)
    assert not is_nvfp4_kv_layout(fp8) and not is_nvfp4_kv_layout(fp8.view(torch.uint8))
    assert not is_nvfp4_kv_layout(torch.zeros(3, 3, 128, 72, dtype=torch.uint8))    # odd slots
    assert not is_nvfp4_kv_layout(torch.zeros(3, 8, 128, 72, dtype=torch.float32))
    assert not is_nvfp4_kv_layout(torch.zeros(8, 128, 72, dtype=torch.uint8))
    assert not is_nvfp4_kv_layout("kv_cache")


def test_check_nvfp4_kv_cache_errors_name_the_argument():
    good = torch.zeros(2, 4, 8, 72, dtype=torch.uint8)
    assert nvfp4.check_nvfp4_kv_cache(good) == (2, 2, 8)
    with pytest.raises(TypeError, match="^kv_cache: expected a torch.Tensor"):
        nvfp4.check_nvfp4_kv_cache([1])
    with pytest.raises(TypeError, match="^kv_cache: an NVFP4 cache is uint8"):
        nvfp4.check_nvfp4_kv_cache(good.float())
    with pytest.raises(ValueError, match=r"^kv_cache: expected an NVFP4 cache"):
        nvfp4.check_nvfp4_kv_cache(torch.zeros(2, 4, 8, 256, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 4"):
        nvfp4.check_nvfp4_kv_cache(torch.zeros(2, 4, 6, 72, dtype=torch.uint8))
    wide = torch.zeros(2, 4, 8, 144, dtype=torch.uint8)[..., :72]     # slot not contiguous
    with pytest.raises(ValueError, match="contiguous bytes"):
        nvfp4.check_nvfp4_kv_cache(wide)


def test_slots_are_the_engine_slices():
    cache = torch.arange(3 * 6 * 4 * 72, dtype=torch.int64).to(torch.uint8).reshape(3, 6, 4, 72)
    k, v = nvfp4_kv_cache_slots(cache)
    assert k.shape == v.shape == (3, 3, 4, 72)
    assert k.data_ptr() == cache.data_ptr() and v.data_ptr() == cache.data_ptr() + 4 * 72
    assert k.stride() == v.stride() == (6 * 4 * 72, 2 * 4 * 72, 72, 1)
    assert torch.equal(k, cache[:, 0::2]) and torch.equal(v, cache[:, 1::2])


@pytest.mark.parametrize("page_stride_pad", [0, 3 * 72], ids=["contiguous", "page-strided"])
def test_views_are_zero_copy_with_the_documented_shapes(page_stride_pad):
    P, hkv, page = 3, 2, 8
    slot = page * 72
    buf = torch.randint(0, 256, (P * (2 * hkv * slot + page_stride_pad),), dtype=torch.uint8)
    cache = buf.as_strided((P, 2 * hkv, page, 72), (2 * hkv * slot + page_stride_pad, slot, 72, 1))
    k_data, k_sc, v_data, v_sc = nvfp4_kv_cache_views(cache)
    base, s_page = cache.data_ptr(), cache.stride(0)
    assert k_data.shape == v_data.shape == (P, hkv, page, 64)
    assert k_sc.shape == v_sc.shape == (P, hkv, page, 8)
    assert k_data.stride() == v_data.stride() == (s_page, 2 * slot, 64, 1)
    assert k_sc.stride() == v_sc.stride() == (s_page, 2 * slot, 8, 1)
    assert k_data.data_ptr() == base and v_data.data_ptr() == base + slot
    assert k_sc.data_ptr() == base + page * 64 and v_sc.data_ptr() == base + slot + page * 64
    for t in (k_data, k_sc, v_data, v_sc):
        assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    for p in range(P):
        for h in range(hkv):
            for side, data, sc in ((0, k_data, k_sc), (1, v_data, v_sc)):
                flat = cache[p, 2 * h + side].reshape(-1)
                assert torch.equal(data[p, h].reshape(-1), flat[:page * 64])
                assert torch.equal(sc[p, h].reshape(-1), flat[page * 64:])
    v_sc[1, 1, 2, 3] = 77                                       # writes go through to the cache
    assert int(cache[1, 3].reshape(-1)[page * 64 + 2 * 8 + 3]) == 77


def test_scale_offsets_match_the_contract_table():
    assert [k_scale_offset(n, g) for n in (0, 1, 5) for g in (0, 7)] == [0, 7, 8, 15, 40, 47]
    # V: (n, g) -> row (n//4)*4 + g//2, column (g%2)*4 + n%4, worked by hand
    table = {(0, 0): 0, (1, 0): 1, (3, 0): 3, (0, 1): 4, (3, 1): 7, (0, 2): 8, (2, 3): 14,
             (0, 7): 28, (3, 7): 31, (4, 0): 32, (5, 3): 45, (7, 6): 59, (127, 7): 1023}
    assert {key: v_scale_offset(*key) for key in table} == table
    n = torch.arange(12)[:, None]
    g = torch.arange(8)[None, :]
    assert torch.equal(v_scale_offset(n, g), torch.tensor([[v_scale_offset(a, b) for b in range(8)] for a in range(12)]))
    assert torch.equal(k_scale_offset(n, g), torch.arange(96).reshape(12, 8))


@given(tiles=st.integers(1, 64))
@settings(max_examples=30, deadline=None)
def test_v_scale_order_is_a_permutation_within_each_tile(tiles):
    n = torch.arange(4 * tiles)[:, None]
    pos = v_scale_offset(n, torch.arange(8)[None, :])
    assert torch.equal(pos.reshape(-1).sort().values, torch.arange(32 * tiles))
    assert torch.equal(pos // 32, (n // 4).expand(-1, 8))       # stays inside its 4-token tile


# ---------------------------------------------------------------- writer and reader

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("geom", [(2, 1, 4), (1, 2, 8)], ids=["P2-H1-page4", "P1-H2-page8"])
@pytest.mark.parametrize("given_scales", [False, True], ids=["default-global", "given-global"])
def test_round_trip_against_the_literal_codec(dtype, geom, given_scales):
    P, hkv, page = geom
    k, v = _kv(P, hkv, page, seed=P * 10 + hkv, dtype=dtype, scale=3.0)
    kw = dict(k_global_scale=0.0123, v_global_scale=torch.tensor([0.004], dtype=torch.float32)) if given_scales else {}
    cache, gk, gv = quantize_kv_nvfp4(k, v, **kw)
    assert cache.shape == (P, 2 * hkv, page, 72) and cache.dtype == torch.uint8 and cache.is_contiguous()
    if given_scales:
        assert gk == 0.0123 and gv == float(torch.tensor(0.004, dtype=torch.float32))
    _check_against_literal(cache, k, v, gk, gv)


def test_scale_orders_are_checked_with_distinct_scales():
    """Every (token, group) block gets its own scale: a swapped or transposed order would move
    a scale to another block, so both the bytes and the decoded values would differ."""
    page = 8
    want = torch.arange(1, 1 + page * 8).reshape(page, 8) + 40            # distinct scale bytes
    amax = torch.tensor([E4M3_NONNEG[b] for b in want.reshape(-1).tolist()], dtype=torch.float64).reshape(page, 8)
    grid_pattern = torch.tensor([6, -6, 4, -3, 2, -1.5, 1, -0.5, 0, 0.5, -1, 1.5, -2, 3, -4, 6],
                                dtype=torch.float64)
    blocks = amax[:, :, None] * grid_pattern                 # block amax = 6 * scale, codes on the grid
    k = blocks.reshape(1, 1, page, 128)
    cache, gk, gv = quantize_kv_nvfp4(k, k.flip(-2), k_global_scale=1.0, v_global_scale=1.0)
    kflat, vflat = slot_bytes(cache, 0, 0), slot_bytes(cache, 0, 1)
    vwant = want.flip(0)
    for n in range(page):
        for g in range(8):
            assert kflat[64 * page + 8 * n + g] == int(want[n, g])                       # row-major
            row, col = (n // 4) * 4 + g // 2, (g % 2) * 4 + n % 4
            assert vflat[64 * page + 8 * row + col] == int(vwant[n, g])                  # swizzled
    kd, vd = dequantize_kv_nvfp4(cache, 1.0, 1.0)
    assert torch.equal(kd, k) and torch.equal(vd, k.flip(-2))       # exact: every value on the grid
    # V's data under K's row-major scale bytes decodes to other values: the reader's V order
    # is not K's, so a reader (or writer) that used one order for both sides would fail above
    swapped = cache.clone()
    swapped[0, 1].reshape(-1)[64 * page:] = swapped[0, 0].reshape(-1)[64 * page:]
    assert not torch.equal(dequantize_kv_nvfp4(swapped, 1.0, 1.0)[1], k)


def _one_block(values, gscale=1.0):
    """Quantize one token whose block 0 is `values` (padded with 0); return (codes, scale byte)."""
    row = torch.zeros(128, dtype=torch.float64)
    row[:len(values)] = torch.tensor(values, dtype=torch.float64)
    k = row.expand(1, 1, 4, 128).contiguous()
    cache, _, _ = quantize_kv_nvfp4(k, k, k_global_scale=gscale, v_global_scale=gscale)
    flat = slot_bytes(cache, 0, 0)
    return [read_code_and_scale(flat, 4, 0, j, False)[0] for j in range(16)], flat[64 * 4]


def test_e2m1_grid_points_halfway_points_and_signs():
    # block amax 6 -> scale exactly 1.0 (byte 0x38) with a global scale of 1
    vals = [6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0,          # grid points
            0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5]      # halfway: ties to even
    codes, sb = _one_block(vals)
    assert sb == 0x38
    assert codes == [7, 0, 1, 2, 3, 4, 5, 6,
                     0, 2, 2, 4, 4, 6, 6, 8 | 4]
    above = [6.0, 0.2500001, 0.7500001, 1.2500001, 1.7500001, 2.5000001, 3.5000001, 5.0000001,
             -0.0, -1e-9, -0.24, -5.9, 0.2499999, 4.9999999, 3.4999999, 2.4999999]
    codes, _ = _one_block(above)
    assert codes == [7, 1, 2, 3, 4, 5, 6, 7,
                     8, 8, 8, 8 | 7, 0, 6, 5, 4]       # -0.0 and tiny negatives keep the sign bit


def test_saturation_of_codes_and_block_scales():
    # scale rounds down: 6.375 / 6 = 1.0625, a tie between e4m3 1.0 and 1.125 -> 1.0 (even),
    # so 6.375 / 1.0 saturates to code 7 (6.0), as does every value above the last midpoint
    codes, sb = _one_block([6.375, -6.375, 5.5, 3.0])
    assert sb == 0x38 and codes[:4] == [7, 8 | 7, 7, 5]
    # a global scale far too small: the block scale saturates at 448 (0x7E), codes at 6
    codes, sb = _one_block([1.0, -0.6, 0.1], gscale=1e-6)
    assert sb == 0x7E and codes[:3] == [7, 8 | 7, 7]


def test_zero_and_underflowing_blocks():
    row = torch.zeros(1, 1, 4, 128, dtype=torch.float64)
    row[0, 0, 0, 16:32] = -0.0
    tiny = 2.0 ** -10 * 6                      # amax/6 == 2**-10: the tie below the least subnormal
    row[0, 0, 0, 32:48] = torch.linspace(-tiny, tiny, 16, dtype=torch.float64)
    row[0, 0, 0, 48] = tiny * 1.0001           # just above the tie: the least subnormal, 2**-9
    cache, _, _ = quantize_kv_nvfp4(row, row, k_global_scale=1.0, v_global_scale=1.0)
    flat = slot_bytes(cache, 0, 0)
    scales = flat[64 * 4:64 * 4 + 8]
    assert scales[:4] == [0, 0, 0, 1]           # zero block, -0.0 block, underflow -> 0; then 2**-9
    codes = [read_code_and_scale(flat, 4, 0, j, False)[0] for j in range(48)]
    assert codes[:16] == [0] * 16 and codes[16:32] == [8] * 16      # -0.0 keeps its sign bit
    assert all(c & 7 == 0 for c in codes[32:48])                    # scale 0: magnitude 0
    kd, _ = dequantize_kv_nvfp4(cache, 1.0, 1.0)
    assert (kd[0, 0, 0, :48] == 0).all() and float(kd[0, 0, 0, 48]) == 3.0 * 2.0 ** -9   # code 3.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("side", ["k", "v"])
def test_nonfinite_values_raise_and_write_nothing(bad, side):
    k, v = _kv(2, 1, 4, seed=3)
    (k if side == "k" else v)[1, 0, 2, 5] = bad
    with pytest.raises(ValueError, match=f"^{side}: holds NaN or inf"):
        quantize_kv_nvfp4(k, v)
    cache = torch.full((2, 2, 4, 72), 0xAB, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"^{side}: holds NaN or inf"):
        write_kv_nvfp4(cache, [0, 1], k, v, 1.0, 1.0)
    assert (cache == 0xAB).all()


def test_default_global_scale_is_amax_over_6_times_448_in_float32():
    k, v = _kv(3, 2, 8, seed=4, scale=7.0)
    _, gk, gv = quantize_kv_nvfp4(k, v)
    for x, g in ((k, gk), (v, gv)):
        amax = float(x.double().abs().max())
        assert g == float(torch.tensor(amax / (6 * 448), dtype=torch.float32))
        assert g == default_global_scale(x) and abs(g / (amax / 2688) - 1) < 1e-7
    # the largest block's scale lands at (or within rounding of) 448
    cache, _, _ = quantize_kv_nvfp4(k, v)
    assert int(nvfp4_kv_cache_views(cache)[1].max()) == 0x7E
    assert default_global_scale(torch.zeros(1, 1, 4, 128)) == 1.0


def test_given_global_scale_forms_agree_and_bad_ones_are_refused():
    k, v = _kv(2, 1, 4, seed=5)
    ref = quantize_kv_nvfp4(k, v, k_global_scale=0.01, v_global_scale=0.02)
    g32 = float(torch.tensor(0.01, dtype=torch.float32))
    a = quantize_kv_nvfp4(k, v, k_global_scale=g32, v_global_scale=0.02)
    b = quantize_kv_nvfp4(k, v, k_global_scale=torch.tensor(0.01), v_global_scale=torch.tensor([0.02], dtype=torch.float64))
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:] == (g32, 0.02)
    assert ref[1] == 0.01 and not torch.equal(ref[0], quantize_kv_nvfp4(k, v)[0])
    for bad, exc in ((0.0, ValueError), (-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError),
                     (torch.tensor([1.0, 2.0]), TypeError), (torch.tensor(1), TypeError),
                     ("1.0", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="^k_global_scale: "):
            quantize_kv_nvfp4(k, v, k_global_scale=bad)


def test_quantize_rejects_bad_k_v():
    k, v = _kv(2, 1, 4, seed=6)
    with pytest.raises(TypeError, match="^k: expected dtype"):
        quantize_kv_nvfp4(k.to(torch.float8_e4m3fn), v)
    with pytest.raises(TypeError, match="^v: expected a torch.Tensor"):
        quantize_kv_nvfp4(k, v.tolist())
    with pytest.raises(ValueError, match=r"^k: expected \[P, Hkv, page, 128\]"):
        quantize_kv_nvfp4(k[..., :64], v[..., :64])
    with pytest.raises(ValueError, match="^k: page_size 6"):
        quantize_kv_nvfp4(torch.zeros(1, 1, 6, 128), torch.zeros(1, 1, 6, 128))
    with pytest.raises(ValueError, match="same shape"):
        quantize_kv_nvfp4(k, v[:1])


def test_write_kv_nvfp4_writes_only_the_given_pages():
    k, v = _kv(5, 2, 8, seed=7, scale=2.0)
    full, gk, gv = quantize_kv_nvfp4(k, v, k_global_scale=0.003, v_global_scale=0.002)
    cache = torch.full_like(full, 0xAB)
    write_kv_nvfp4(cache, torch.tensor([3, 0], dtype=torch.int32), k[[3, 0]], v[[3, 0]],
                   torch.tensor(gk), gv)
    assert torch.equal(cache[[0, 3]], full[[0, 3]])
    assert (cache[[1, 2, 4]] == 0xAB).all()
    write_kv_nvfp4(cache, [1, 2, 4], k[[1, 2, 4]], v[[1, 2, 4]], gk, gv)
    assert torch.equal(cache, full)


def test_write_kv_nvfp4_refuses_bad_arguments_and_writes_nothing():
    k, v = _kv(3, 1, 4, seed=8)
    cache = torch.full((4, 2, 4, 72), 0xAB, dtype=torch.uint8)
    cases = [
        (dict(pages=[0, 0, 1]), ValueError, "^pages: an index repeats"),
        (dict(pages=[0, 1, 4]), ValueError, r"^pages: indices must lie in \[0, 4\)"),
        (dict(pages=[-1, 1, 2]), ValueError, "^pages: indices"),
        (dict(pages=[0, 1]), ValueError, "^pages: 2 indices for 3 pages"),
        (dict(pages=torch.tensor([0.0, 1.0, 2.0])), TypeError, "^pages: expected integer"),
        (dict(pages=torch.tensor([[0, 1, 2]])), ValueError, "^pages: expected a 1-D"),
        (dict(k=k[:, :, :, :64]), ValueError, "^k: expected"),
        (dict(v=v.to(torch.float8_e4m3fn)), TypeError, "^v: expected dtype"),
        (dict(k=torch.zeros(3, 2, 4, 128), v=torch.zeros(3, 2, 4, 128)), ValueError, r"^k: expected \[n, 1, 4, 128\] for this cache"),
        (dict(k_scale=0.0), ValueError, "^k_scale: "),
        (dict(v_scale=[1.0]), TypeError, "^v_scale: "),
        (dict(kv_cache=cache.float()), TypeError, "^kv_cache: "),
    ]
    for over, exc, msg in cases:
        args = dict(kv_cache=cache, pages=[0, 1, 2], k=k, v=v, k_scale=1.0, v_scale=1.0) | over
        with pytest.raises(exc, match=msg):
            write_kv_nvfp4(**args)
        assert (cache == 0xAB).all(), over


def test_dequantize_pages_dtype_and_scale_forms():
    k, v = _kv(4, 2, 8, seed=9)
    cache, gk, gv = quantize_kv_nvfp4(k, v)
    kd, vd = dequantize_kv_nvfp4(cache, gk, gv)
    assert kd.dtype == vd.dtype == torch.float64 and kd.shape == (4, 2, 8, 128)
    ks, vs = dequantize_kv_nvfp4(cache, torch.tensor(gk), torch.tensor([gv]), pages=[3, 1, 3])
    assert torch.equal(ks, kd[[3, 1, 3]]) and torch.equal(vs, vd[[3, 1, 3]])
    k32, v32 = dequantize_kv_nvfp4(cache, gk, gv, pages=torch.tensor([2]), dtype=torch.float32)
    assert k32.dtype == torch.float32
    exact = dequantize_kv_nvfp4(cache, 1.0, 1.0, pages=[2])[0]        # code * block scale, exact
    assert torch.equal(k32, exact.float() * torch.tensor(gk, dtype=torch.float32))
    with pytest.raises(TypeError, match="^dtype: "):
        dequantize_kv_nvfp4(cache, gk, gv, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^pages: "):
        dequantize_kv_nvfp4(cache, gk, gv, pages=[4])
    with pytest.raises(ValueError, match="^v_scale: "):
        dequantize_kv_nvfp4(cache, gk, math.nan)
    nan_scale = cache.clone()
    nvfp4_kv_cache_views(nan_scale)[1][0, 0, 0, 0] = 0x7F                # E4M3 NaN scale byte
    bad = dequantize_kv_nvfp4(nan_scale, gk, gv)[0]
    assert bad[0, 0, 0, :16].isnan().all() and not bad[0, 0, 0, 16:].isnan().any()


@given(data=st.data())
@settings(max_examples=25, deadline=None)
def test_reader_matches_the_literal_decoder_on_random_bytes(data):
    """Any bytes (any codes, any finite non-negative scale byte, subnormals included)."""
    P, hkv = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    page = 4 * data.draw(st.integers(1, 2))
    seed = data.draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randint(0, 256, (P, 2 * hkv, page, 72), dtype=torch.uint8, generator=gen)
    _, k_sc, _, v_sc = nvfp4_kv_cache_views(cache)
    for sc in (k_sc, v_sc):
        sc.copy_(torch.randint(0, 0x7F, sc.shape, dtype=torch.uint8, generator=gen))
    gk = data.draw(st.floats(1e-4, 1e2))
    gv = data.draw(st.floats(1e-4, 1e2))
    kd, vd = dequantize_kv_nvfp4(cache, gk, gv)
    p, h = data.draw(st.integers(0, P - 1)), data.draw(st.integers(0, hkv - 1))
    for is_v, got, gs in ((False, kd, gk), (True, vd, gv)):
        want = torch.tensor(decode_slot(slot_bytes(cache, p, 2 * h + is_v), page, is_v, gs), dtype=torch.float64)
        assert torch.equal(got[p, h], want)


@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_writer_picks_the_nearest_representable_value(data):
    """Per element, no other (code, its block's scale) pair is strictly closer, and the block
    scale is the nearest E4M3 value to amax / 6 / global (unless saturated)."""
    seed = data.draw(st.integers(0, 2**31 - 1))
    log_spread = data.draw(st.floats(0.0, 12.0))
    gscale = data.draw(st.sampled_from([None, 1.0, 1e-3, 0.37]))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((1, 1, 4, 128), generator=gen, dtype=torch.float64)
    x = x * torch.exp2(log_spread * (torch.rand((1, 1, 4, 8), generator=gen, dtype=torch.float64) - 0.5)).repeat_interleave(16, -1)
    cache, g, _ = quantize_kv_nvfp4(x, x, k_global_scale=gscale, v_global_scale=gscale)
    kd, vd = dequantize_kv_nvfp4(cache, g, g)
    assert torch.equal(kd, vd)
    flat = slot_bytes(cache, 0, 0)
    # all 4 x 8 blocks of 16 at once (the same float64 operations, in the same order, as block by block)
    sf = torch.tensor([[e4m3_value(flat[64 * 4 + 8 * n + grp]) for grp in range(8)] for n in range(4)],
                      dtype=torch.float64)
    blk, got = x[0, 0].reshape(4, 8, 16), kd[0, 0].reshape(4, 8, 16)
    target = blk.abs().amax(-1) / 6 / g
    nearest = (torch.tensor(E4M3_NONNEG, dtype=torch.float64) - target[..., None]).abs().amin(-1)
    assert torch.all(torch.where(target < 448, (sf - target).abs() <= nearest, sf == 448.0))
    signed = torch.tensor([s * m for m in E2M1_MAG for s in (1, -1)], dtype=torch.float64)
    cand = signed * sf[..., None] * g  # [4, 8, 16 candidates]
    best = (blk[..., None] - cand[..., None, :]).abs().amin(-1)
    assert torch.all((blk - got).abs() <= best * (1 + 1e-12))


# ---------------------------------------------------------------- GPU: same bytes on CUDA

@pytest.mark.gpu
def test_cuda_writer_and_reader_match_the_cpu_bit_for_bit():
    k, v = _kv(6, 4, 128, seed=11, scale=4.0)
    cpu, gk, gv = quantize_kv_nvfp4(k, v)
    gpu, gk2, gv2 = quantize_kv_nvfp4(k.cuda(), v.cuda())
    assert gpu.is_cuda and (gk2, gv2) == (gk, gv) and torch.equal(gpu.cpu(), cpu)
    kc, vc = dequantize_kv_nvfp4(cpu, gk, gv)
    scales = torch.tensor([gk], dtype=torch.float32, device="cuda"), torch.tensor(gv, dtype=torch.float32, device="cuda")
    kg, vg = dequantize_kv_nvfp4(gpu, *scales)
    assert kg.is_cuda and torch.equal(kg.cpu(), kc) and torch.equal(vg.cpu(), vc)
    views = nvfp4_kv_cache_views(gpu)
    assert all(t.is_cuda for t in views) and views[2].data_ptr() == gpu.data_ptr() + 128 * 72
    part = torch.full_like(gpu, 0xAB)
    write_kv_nvfp4(part, torch.tensor([5, 1], device="cuda"), k[[5, 1]].cuda(), v[[5, 1]].cuda(), *scales)
    assert torch.equal(part[[1, 5]].cpu(), cpu[[1, 5]]) and (part[[0, 2, 3, 4]] == 0xAB).all()


def test_dequantize_takes_a_zero_global_scale():
    """The reader takes any finite global scale, 0 included (the writer needs one > 0): all zeros."""
    k = torch.randn(1, 1, 4, 128, dtype=torch.float64)
    cache, _, _ = quantize_kv_nvfp4(k, k)
    kd, vd = dequantize_kv_nvfp4(cache, 0.0, 0.0)
    assert (kd == 0).all() and (vd == 0).all()
