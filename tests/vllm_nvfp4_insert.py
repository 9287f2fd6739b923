"""A CPU model of the NVFP4 store of vLLM 0.33.0's fused MiniMax-M3 insert on Hopper.

vLLM writes the NVFP4 KV cache of MiniMax-M3's sparse layers with a compiled CUDA op,
`torch.ops._C.fused_minimax_m3_qknorm_rope_kv_insert` (`vllm/_custom_ops.py`; model.py passes
`kv_k_scale=self._k_scale, kv_v_scale=self._v_scale`). Its source is not in the wheel; this module
is its sm_90 machine code read back: the kernel
`vllm::minimax_m3_fused_ops::fusedMiniMaxM3QNormRopeKVInsertKernel<c10::BFloat16, uint8_t,
kAuto, true (NVFP4), ...>` in the sm_90 cubin of `vllm/_C_stable_libtorch.abi3.so`
(`cuobjdump -sass -fun <name>`). Offsets below (0x....) are that function's SASS.

One warp per (token, head); lane l holds elements 4l..4l+3 of the token's 128, after the
Gemma RMSNorm / RoPE, rounded to bf16 (0x1920) before they are quantized:

- global scale g: one float read from the device tensor `kv_k_scale` (K heads) or `kv_v_scale`
  (V heads) on every launch (0x0940-0x0970), the DEQUANTIZATION scale (x ~ e2m1 * block * g);
- amax of each 16-element group: max |x| over the lane's 4 values and a butterfly over 4 lanes
  (0x1970-0x1a50; FMNMX drops NaN, a group of NaN has amax 0);
- g == 1.0 (0x1e00): block = e4m3_satfinite(max(amax * (1/6), 2^-9)), q = x * rcp(block)
  with a round-toward-zero multiply (FMUL.RZ);
- otherwise (0x1a70-0x1df0): r = 1/g; block = e4m3_satfinite(max(amax/6 * r, 2^-9));
  x * r clamped to +-4096; q = (x * r) / block (a Newton-refined division);
- e2m1 of q (0x1ec0-0x2150): |q| >= 1: its float bits rounded to one mantissa bit (nearest
  even) and clamped to magnitude code 7 (6.0; NaN and inf too); |q| < 1: round(2|q|) to even;
  the sign bit of q, cleared where the magnitude is 0 (0x2340-0x23b0);
- the store (0x2100-0x2590): slot = 2 * kv_head + side (K 0, V 1); page = slot_mapping //
  page_size, token n = slot_mapping % page_size (a negative slot_mapping writes nothing);
  codes as one little-endian u16 per lane at page * stride(0) + slot * page_size * 72 + 64n + 2l
  (element 2i in the low nibble of byte i); the lane l % 4 == 0 of each group g = l // 4 writes
  the block byte at page_size * 64 + 8n + g for K and at
  (n//4)*32 + (g//2)*8 + (g%2)*4 + n%4 for V. Only stride(0) of the cache is taken: the slots of a
  page are one contiguous run (the LBHNC layout), whatever the tensor's other strides.

The model reproduces the machine code's formulas and its float32 rounding (the reciprocals as
correctly rounded float32 values: MUFU.RCP differs from them by at most one unit, which moves a
code only on an exact rounding tie). Imports torch only.
"""

from __future__ import annotations

import torch

PAGE_ROW = 72  # bytes per token row of a slot: 64 bytes of codes, 8 block scales
E4M3 = torch.float8_e4m3fn
MIN_BLOCK = 2.0 ** -9  # the smallest E4M3 subnormal: every block scale is at least this
SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32)  # 0.16666667f, as the kernel multiplies
CLAMP = 4096.0  # |x * r| above this is clamped (g != 1 only)

__all__ = ["MIN_BLOCK", "insert", "quantize_rows"]


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma: the float32 product is exact in float64."""
    return _f32(a.double() * b.double() + c.double())


def _mul_rz(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 a * b rounded toward zero (FMUL.RZ): the exact product, truncated to float32."""
    exact = a.double() * b.double()
    near = _f32(exact)
    over = near.double().abs() > exact.abs()
    return torch.where(over, torch.nextafter(near, torch.zeros_like(near)), near)


def _e4m3_byte(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3 byte, round to nearest even, saturating at +-448 (F2FP.SATFINITE.E4M3)."""
    return x.clamp(-448.0, 448.0).to(E4M3).view(torch.uint8)


def _e2m1(q: torch.Tensor) -> torch.Tensor:
    """float32 q -> 4-bit code (0x1ec0-0x2150, 0x2340-0x23b0)."""
    a = q.abs()
    bits = a.view(torch.int32).to(torch.int64)
    big = (bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22
    mag_big = (big - 252).clamp(max=7)
    mag_small = torch.round(a + a).to(torch.int64)  # F2I: nearest even; |q| < 1 gives 0, 1 or 2
    ge1 = ~(a < 1.0)  # FSETP.GEU: NaN takes the bit path
    mag = torch.where(ge1, mag_big, mag_small)
    sign = (q.view(torch.int32).to(torch.int64) >> 28) & 8
    return torch.where(mag == 0, mag, mag | sign)


def quantize_rows(x: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 128] (any float dtype; rounded to bf16 as the kernel does) -> (codes [..., 128]
    int64, block-scale bytes [..., 8] uint8), the kernel's arithmetic with global scale g."""
    xs = _f32(x.to(torch.bfloat16))
    blocks = xs.reshape(*xs.shape[:-1], 8, 16)
    amax = torch.where(torch.isnan(blocks), torch.zeros_like(blocks), blocks.abs()).amax(-1)
    g32 = torch.tensor(g, dtype=torch.float32)
    if float(g32) == 1.0:
        scale = torch.clamp(_f32(amax * SIXTH), min=MIN_BLOCK)
        sbyte = _e4m3_byte(scale)
        sf = _f32(sbyte.view(E4M3))
        r = _f32(1.0 / sf.double())
        q = _mul_rz(blocks, r[..., None])
    else:
        r = _f32(1.0 / g32.double())
        a = torch.clamp(amax, min=1e-12)
        a6 = _f32(a * SIXTH)
        a6r = _fma(_fma(-a6, torch.tensor(6.0), a), SIXTH, a6)
        scale = torch.clamp(_f32(torch.minimum(a6, a6r) * r), min=MIN_BLOCK)
        sbyte = _e4m3_byte(scale)
        sf = _f32(sbyte.view(E4M3))
        xr = _f32(blocks * r)
        xr = torch.where(xr.abs() > CLAMP, torch.copysign(torch.tensor(CLAMP), xr), xr)
        q = _f32(xr.double() / sf.double()[..., None])
    return _e2m1(q).reshape(x.shape), sbyte


def _scale_offset(n: torch.Tensor, g: torch.Tensor, side: int) -> torch.Tensor:
    if side == 0:
        return 8 * n + g
    return (n // 4) * 32 + (g // 2) * 8 + (g % 2) * 4 + n % 4


def insert(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           k_scale: float, v_scale: float) -> dict[str, torch.Tensor]:
    """Write k, v [N, Hkv, 128] of N tokens into the uint8 NVFP4 cache [P, 2*Hkv, page, 72] at
    slot_mapping [N] (int64; -1 skips a token), as the kernel does. Returns what it wrote in
    logical form: {"k_codes", "v_codes": [N, Hkv, 128] int64, "k_scales", "v_scales":
    [N, Hkv, 8] uint8}."""
    P, slots, page, row = kv_cache.shape
    assert kv_cache.dtype == torch.uint8 and row == PAGE_ROW and slots == 2 * k.shape[1]
    page_stride = kv_cache.stride(0)
    flat = kv_cache.as_strided((kv_cache.untyped_storage().nbytes(),), (1,), 0)
    out = {}
    for side, (x, g) in enumerate(((k, k_scale), (v, v_scale))):
        codes, sbytes = quantize_rows(x, g)
        name = "kv"[side]
        out[f"{name}_codes"], out[f"{name}_scales"] = codes, sbytes
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [N, Hkv, 64]
        for t in range(x.shape[0]):
            s = int(slot_mapping[t])
            if s < 0:
                continue
            blk, n = divmod(s, page)
            for h in range(x.shape[1]):
                base = kv_cache.storage_offset() + blk * page_stride + (2 * h + side) * page * PAGE_ROW
                flat[base + 64 * n: base + 64 * n + 64] = packed[t, h]
                grp = torch.arange(8)
                pos = base + page * 64 + _scale_offset(torch.tensor(n), grp, side)
                flat[pos] = sbytes[t, h]
    return out
