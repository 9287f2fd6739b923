"""NVFP4 KV cache: the engine's 4-bit page layout, its two block-scale orders, a writer, a reader.

Layout (docs/contract.md, "NVFP4 KV cache"): uint8
`[num_pages, 2*Hkv, page_size, 72]`, slot `2h` the K of KV head h and slot `2h+1` its V. A
slot is `page_size * 72` contiguous bytes, so its last two dims are one flat byte area, not
72-byte rows:

    bytes [0, 64*page)            data: token n's 128 E2M1 codes in [64n, 64n+64),
                                  element 2i in the low nibble of byte i, 2i+1 in the high one
    bytes [64*page, 72*page)      block scales: page * 8 E4M3 bytes, one per 16 elements

    value = e2m1(code) * e4m3(block scale) * global scale    (k_scale / v_scale)

K's scale of (token n, group g) sits at byte `8n + g` of the scale area (row-major); V's at
row `(n // 4) * 4 + g // 2`, column `(g % 2) * 4 + n % 4` (the cache writer's swizzle, as
FlashInfer 0.7.2 `_v_scale_unswizzle_index` and vLLM's fmha_sm100 reader use it). Each order
lives in ONE function, `k_scale_offset` / `v_scale_offset`: another writer's order is a
one-line change there.

The writer (`quantize_kv_nvfp4`, `write_kv_nvfp4`) and the reader (`dequantize_kv_nvfp4`) are
vectorized torch on CPU or CUDA tensors, exact in float64 and bit-identical across devices.
They build caches for tests and benchmarks and are the reference's reader; the engine writes
its cache with its own fused kernel. Imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Union

import torch

from .kernels.constants import (E4M3_MAX, HEAD_DIM, NVFP4_CODE_BYTES, NVFP4_GROUP_SIZE, NVFP4_ROW_BYTES,
                                NVFP4_SCALE_BYTES, NVFP4_V_SCALE_TILE)

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "HEAD_DIM",
    "check_nvfp4_kv_cache",
    "default_global_scale",
    "dequantize_kv_nvfp4",
    "is_nvfp4_kv_layout",
    "k_scale_offset",
    "nvfp4_kv_cache_shape",
    "nvfp4_kv_cache_slots",
    "nvfp4_kv_cache_views",
    "quantize_kv_nvfp4",
    "v_scale_offset",
    "write_kv_nvfp4",
]

# E2M1 value of each 4-bit code: bit 3 the sign, the low 3 bits the magnitude.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0

_E4M3 = torch.float8_e4m3fn
_QUANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_OUT_DTYPES = (torch.float64, torch.float32)
# Pages quantized per chunk: caps the float64 temporaries near 64 MiB whatever the cache size.
_CHUNK_ELEMS = 1 << 23

Scale = Union[float, torch.Tensor]
Offsets = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------- the layout

def k_scale_offset(n, g):
    """Byte offset, inside a K slot's `[page, 8]` scale area, of the scale of (token n, group g).

    Row-major. Works on ints and (broadcasting) integer tensors.
    """
    return n * NVFP4_SCALE_BYTES + g


def v_scale_offset(n, g):
    """Byte offset, inside a V slot's `[page, 8]` scale area, of the scale of (token n, group g).

    The cache writer's swizzle: row `(n // 4) * 4 + g // 2`, column `(g % 2) * 4 + n % 4`; a
    permutation inside every 4-token tile (32 bytes), so page_size must be a multiple of 4.
    Works on ints and (broadcasting) non-negative integer tensors.
    """
    row = (n // NVFP4_V_SCALE_TILE) * NVFP4_V_SCALE_TILE + g // 2
    col = (g % 2) * NVFP4_V_SCALE_TILE + n % NVFP4_V_SCALE_TILE
    return row * NVFP4_SCALE_BYTES + col


def _scale_positions(offsets: Offsets, page_size: int, device: torch.device) -> torch.Tensor:
    """[page*8] int64: flat position in the scale area of logical scale (n, g) at index 8n+g."""
    n = torch.arange(page_size, dtype=torch.int64, device=device)[:, None]
    g = torch.arange(NVFP4_SCALE_BYTES, dtype=torch.int64, device=device)[None, :]
    return offsets(n, g).reshape(-1)


def nvfp4_kv_cache_shape(num_pages: int, num_kv_heads: int, page_size: int) -> tuple[int, int, int, int]:
    """Shape of an NVFP4 cache: (num_pages, 2*num_kv_heads, page_size, 72)."""
    return (int(num_pages), 2 * int(num_kv_heads), int(page_size), NVFP4_ROW_BYTES)


def is_nvfp4_kv_layout(kv_cache: torch.Tensor) -> bool:
    """True when kv_cache has the NVFP4 shape: uint8 [P, 2*Hkv, page, 72].

    The fp8 cache, [P, Hkv, page, 256] float8_e4m3fn or its uint8 storage, gives False (its
    last dim is 256). Reads metadata only; `check_nvfp4_kv_cache` also checks strides.
    """
    return (isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.uint8
            and kv_cache.dim() == 4 and kv_cache.shape[-1] == NVFP4_ROW_BYTES
            and kv_cache.shape[1] >= 2 and kv_cache.shape[1] % 2 == 0)


def check_nvfp4_kv_cache(kv_cache: torch.Tensor, name: str = "kv_cache") -> tuple[int, int, int]:
    """(num_pages, num_kv_heads, page_size) of an NVFP4 cache, or TypeError / ValueError.

    Requires uint8 [P, 2*Hkv, page, 72] with page a multiple of 4 (the V swizzle's tile) and
    every slot one contiguous run of page*72 bytes (strides (.., .., 72, 1)); the page and slot
    strides are free (a cache may be a view into a bigger allocation).
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8:
        raise TypeError(f"{name}: an NVFP4 cache is uint8, got {kv_cache.dtype}")
    if not is_nvfp4_kv_layout(kv_cache):
        raise ValueError(f"{name}: expected an NVFP4 cache [P, 2*Hkv, page, {NVFP4_ROW_BYTES}], "
                         f"got {list(kv_cache.shape)}")
    P, slots, page, _ = kv_cache.shape
    if page < NVFP4_V_SCALE_TILE or page % NVFP4_V_SCALE_TILE:
        raise ValueError(f"{name}: page_size {page} must be a positive multiple of "
                         f"{NVFP4_V_SCALE_TILE} (the V block-scale swizzle tile)")
    if kv_cache.stride(3) != 1 or kv_cache.stride(2) != NVFP4_ROW_BYTES:
        raise ValueError(f"{name}: every slot must be page*{NVFP4_ROW_BYTES} contiguous bytes "
                         f"(strides (.., .., {NVFP4_ROW_BYTES}, 1)), got strides {kv_cache.stride()}")
    return P, slots // 2, page


def nvfp4_kv_cache_slots(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K slots, V slots) of an NVFP4 cache: `kv_cache[:, 0::2], kv_cache[:, 1::2]`, each
    [P, Hkv, page, 72] uint8 (the engine's function; views, no checks)."""
    return kv_cache[:, 0::2], kv_cache[:, 1::2]


def nvfp4_kv_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_data, k_scales, v_data, v_scales): zero-copy uint8 views of an NVFP4 cache.

    k_data / v_data [P, Hkv, page, 64]: token n's packed codes at [p, h, n]. k_scales /
    v_scales [P, Hkv, page, 8]: the raw scale areas. k_scales[p, h, n, g] is the scale of
    (n, g); v_scales is in the writer's SWIZZLED order (the scale of (n, g) is at flat
    position `v_scale_offset(n, g)` of v_scales[p, h]), not indexed by (n, g).
    Strides: (cache page stride, 2 * slot stride, 64 or 8, 1).
    """
    check_nvfp4_kv_cache(kv_cache)
    P, hkv, page = kv_cache.shape[0], kv_cache.shape[1] // 2, kv_cache.shape[2]
    s_page, s_slot = kv_cache.stride(0), kv_cache.stride(1)
    base = kv_cache.storage_offset()
    views = []
    for side in (0, 1):
        for width, offset in ((NVFP4_CODE_BYTES, 0), (NVFP4_SCALE_BYTES, page * NVFP4_CODE_BYTES)):
            views.append(kv_cache.as_strided((P, hkv, page, width), (s_page, 2 * s_slot, width, 1),
                                             base + side * s_slot + offset))
    k_data, k_scales, v_data, v_scales = views
    return k_data, k_scales, v_data, v_scales


# ---------------------------------------------------------------- rounding

def _rne_index(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest value of the ascending `grid` to a >= 0, ties to the even index,
    saturating at the last one. For E2M1 and E4M3 the index's low bit is the mantissa's,
    so this is IEEE round-to-nearest-even with saturation."""
    mids = (grid[1:] + grid[:-1]) * 0.5                    # exact: grid values are short dyadics
    i = torch.bucketize(a, mids)                           # a == mids[i] -> i (the lower value)
    tie = a == mids[i.clamp(max=mids.numel() - 1)]
    return torch.where(tie & (i % 2 == 1), i + 1, i)


def _e2m1_magnitudes(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES[:8], dtype=torch.float64, device=device)


def _e4m3_grid(device: torch.device) -> torch.Tensor:
    """The 127 finite non-negative E4M3 values, ascending; index == byte (0x7E = 448)."""
    return torch.arange(0x7F, dtype=torch.uint8, device=device).view(_E4M3).to(torch.float64)


def _quantize_rows(x: torch.Tensor, gscale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 128] float64 -> (packed codes [..., 64] u8, logical block scales [..., 8] u8)."""
    dev = x.device
    blocks = x.reshape(*x.shape[:-1], NVFP4_SCALE_BYTES, NVFP4_GROUP_SIZE)
    amax = blocks.abs().amax(dim=-1)                                   # [..., 8]
    sbyte = _rne_index(amax / E2M1_MAX / gscale, _e4m3_grid(dev))      # saturates at 448
    sf = sbyte.to(torch.uint8).view(_E4M3).to(torch.float64)
    q = blocks.abs() / (sf * gscale)[..., None]                        # 0/0 only where sf == 0
    mag = torch.where(sf[..., None] > 0, _rne_index(q.nan_to_num(0.0), _e2m1_magnitudes(dev)), 0)
    codes = (mag | (torch.signbit(blocks).to(torch.int64) << 3)).reshape(x.shape).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, sbyte.to(torch.uint8)


def _decode_rows(data: torch.Tensor, logical_scales: torch.Tensor, gscale: float,
                 dtype: torch.dtype) -> torch.Tensor:
    """data [..., 64] u8, logical_scales [..., 8] u8 -> values [..., 128] in `dtype`."""
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=data.device)
    codes = torch.stack((data & 0x0F, data >> 4), dim=-1).reshape(*data.shape[:-1], HEAD_DIM)
    vals = lut[codes.long()].reshape(*data.shape[:-1], NVFP4_SCALE_BYTES, NVFP4_GROUP_SIZE)
    sf = logical_scales.view(_E4M3).to(dtype)
    # code * block scale is exact (as in f16 on the GPU); the global scale rounds once
    return ((vals * sf[..., None]) * gscale).reshape(*data.shape[:-1], HEAD_DIM)


# ---------------------------------------------------------------- argument checks

def _global_scale(name: str, s: Scale, *, positive: bool = True) -> float:
    """A global scale given as a python number or a one-element tensor, as a finite float
    (> 0 when `positive`: the writer divides by it)."""
    if isinstance(s, torch.Tensor):
        if s.numel() != 1 or not s.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a float or a one-element float tensor, got a "
                            f"{s.dtype} tensor of shape {list(s.shape)}")
        value = float(s.detach().reshape(()).to("cpu", torch.float64))
    elif isinstance(s, (int, float)) and not isinstance(s, bool):
        value = float(s)
    else:
        raise TypeError(f"{name}: expected a float or a one-element float tensor, got {type(s).__name__}")
    if not math.isfinite(value) or (positive and not value > 0):
        raise ValueError(f"{name}: a global scale must be finite{' and > 0' if positive else ''}, got {value}")
    return value


def default_global_scale(x: torch.Tensor) -> float:
    """The global scale chosen when none is given: amax(|x|) / (6 * 448), rounded to float32.

    This is the NVFP4 convention of Transformer Engine, FlashInfer's `nvfp4_quantize`
    (encode scale 448*6/amax) and vLLM's fmha_sm100 test quantizer: the largest block scale
    lands at 448. (FlashInfer's trtllm-gen `nvfp4_quantize_paged_kv_cache` uses amax / 448
    instead; vLLM itself serves checkpoint scales, 1.0 by default.) Rounded to float32 so
    that it is the same number as a python float and as the one-element float32 tensor vLLM
    passes. An all-zero x gets 1.0.
    """
    amax = float(x.detach().abs().amax().to(torch.float64)) if x.numel() else 0.0
    if amax == 0.0:
        return 1.0
    g = float(torch.tensor(amax / (E2M1_MAX * E4M3_MAX), dtype=torch.float32))
    return max(g, torch.finfo(torch.float32).tiny)


def _check_values(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _QUANT_DTYPES:
        raise TypeError(f"{name}: expected dtype bfloat16, float16, float32 or float64, got {x.dtype}")
    if x.dim() != 4 or x.shape[-1] != HEAD_DIM:
        raise ValueError(f"{name}: expected [P, Hkv, page, {HEAD_DIM}], got {list(x.shape)}")
    page = x.shape[2]
    if page < NVFP4_V_SCALE_TILE or page % NVFP4_V_SCALE_TILE:
        raise ValueError(f"{name}: page_size {page} must be a positive multiple of {NVFP4_V_SCALE_TILE}")
    if x.shape[1] < 1:
        raise ValueError(f"{name}: needs at least one KV head, got {list(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: holds NaN or inf; NVFP4 has no encoding for them")


def _check_pages(pages: torch.Tensor | Sequence[int] | None, num_pages: int,
                 device: torch.device, unique: bool) -> torch.Tensor:
    if pages is None:
        return torch.arange(num_pages, dtype=torch.int64, device=device)
    if isinstance(pages, torch.Tensor):
        if pages.dtype.is_floating_point or pages.dtype in (torch.bool, torch.uint8):
            raise TypeError(f"pages: expected integer page indices, got dtype {pages.dtype}")
        if pages.dim() != 1:
            raise ValueError(f"pages: expected a 1-D tensor of page indices, got shape {list(pages.shape)}")
        idx = pages.detach().to(torch.int64)
    else:
        try:
            idx = torch.tensor([int(p) for p in pages], dtype=torch.int64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"pages: expected a sequence of ints or an integer tensor ({e})") from None
    host = idx.to("cpu")
    if host.numel() and (int(host.min()) < 0 or int(host.max()) >= num_pages):
        raise ValueError(f"pages: indices must lie in [0, {num_pages}), got {host.tolist()}")
    if unique and torch.unique(host).numel() != host.numel():
        raise ValueError(f"pages: an index repeats ({host.tolist()}); each page is written once")
    return idx.to(device)


# ---------------------------------------------------------------- writer / reader

def write_kv_nvfp4(kv_cache: torch.Tensor, pages: torch.Tensor | Sequence[int],
                   k: torch.Tensor, v: torch.Tensor, k_scale: Scale, v_scale: Scale) -> None:
    """Quantize k, v [len(pages), Hkv, page, 128] and write them into those pages, in place.

    k_scale / v_scale: the cache's global (dequantization) scales, floats or one-element
    tensors. Per 16-element block: scale = e4m3(amax / 6 / global), round to nearest even,
    saturating at 448 (a block whose scale rounds to 0, e.g. all zeros, gets scale byte 0
    and magnitude-0 codes); code = e2m1(|x| / (scale * global)), round to nearest even,
    saturating at 6, with the sign bit of x (so -0.0 gives code 8). Computed in float64.
    Every argument is checked before anything is written; NaN/inf values raise ValueError.
    """
    P, hkv, page = check_nvfp4_kv_cache(kv_cache)
    gk, gv = _global_scale("k_scale", k_scale), _global_scale("v_scale", v_scale)
    for name, x in (("k", k), ("v", v)):
        _check_values(name, x)
        if x.device != kv_cache.device:
            raise ValueError(f"{name}: on {x.device}, kv_cache on {kv_cache.device}")
    if k.shape != v.shape:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} differ in shape")
    if tuple(k.shape[1:3]) != (hkv, page):
        raise ValueError(f"k: expected [n, {hkv}, {page}, {HEAD_DIM}] for this cache, got {list(k.shape)}")
    idx = _check_pages(pages, P, kv_cache.device, unique=True)
    if idx.numel() != k.shape[0]:
        raise ValueError(f"pages: {idx.numel()} indices for {k.shape[0]} pages of k/v")

    dev = kv_cache.device
    k_data, k_area, v_data, v_area = nvfp4_kv_cache_views(kv_cache)
    chunk = max(1, _CHUNK_ELEMS // (hkv * page * HEAD_DIM))
    for x, gs, data, area, offsets in ((k, gk, k_data, k_area, k_scale_offset),
                                       (v, gv, v_data, v_area, v_scale_offset)):
        pos = _scale_positions(offsets, page, dev)
        for lo in range(0, idx.numel(), chunk):
            sel = idx[lo:lo + chunk]
            packed, logical = _quantize_rows(x[lo:lo + chunk].to(torch.float64), gs)
            ordered = torch.empty_like(logical).reshape(*logical.shape[:2], -1)
            ordered[..., pos] = logical.reshape(*logical.shape[:2], -1)
            data[sel] = packed
            area[sel] = ordered.view(logical.shape)


def quantize_kv_nvfp4(k: torch.Tensor, v: torch.Tensor, *, k_global_scale: Scale | None = None,
                      v_global_scale: Scale | None = None) -> tuple[torch.Tensor, float, float]:
    """k, v [P, Hkv, page, 128] (bf16/fp16/fp32/fp64, same device) -> (kv_cache, k_scale, v_scale).

    kv_cache: a new contiguous uint8 [P, 2*Hkv, page, 72] NVFP4 cache on k's device, written
    by `write_kv_nvfp4`. k_scale / v_scale: the global scales as python floats, the given
    ones or `default_global_scale` of each tensor (amax / (6 * 448), float32-representable).
    """
    for name, x in (("k", k), ("v", v)):
        _check_values(name, x)
    if k.shape != v.shape or k.device != v.device:
        raise ValueError(f"k {list(k.shape)} on {k.device} and v {list(v.shape)} on {v.device} "
                         "must have the same shape and device")
    gk = default_global_scale(k) if k_global_scale is None else _global_scale("k_global_scale", k_global_scale)
    gv = default_global_scale(v) if v_global_scale is None else _global_scale("v_global_scale", v_global_scale)
    P, hkv, page, _ = k.shape
    kv_cache = torch.empty(nvfp4_kv_cache_shape(P, hkv, page), dtype=torch.uint8, device=k.device)
    write_kv_nvfp4(kv_cache, torch.arange(P, device=k.device), k, v, gk, gv)
    return kv_cache, gk, gv


def dequantize_kv_nvfp4(kv_cache: torch.Tensor, k_scale: Scale, v_scale: Scale,
                        pages: torch.Tensor | Sequence[int] | None = None, *,
                        dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) [len(pages) or P, Hkv, page, 128] in `dtype` (float64 or float32), on the cache's device.

    value = e2m1(code) * e4m3(block scale) * global, with K scales read row-major and V
    scales through the writer's swizzle; k_scale / v_scale are the global scales (floats or
    one-element tensors, finite). pages: physical page indices to read (repeats allowed), all
    when None. Scale bytes that are E4M3 NaN (0x7F/0xFF) give NaN values (the writer never makes
    them).
    """
    P, hkv, page = check_nvfp4_kv_cache(kv_cache)
    gk = _global_scale("k_scale", k_scale, positive=False)
    gv = _global_scale("v_scale", v_scale, positive=False)
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"dtype: expected torch.float64 or torch.float32, got {dtype}")
    idx = _check_pages(pages, P, kv_cache.device, unique=False)
    k_data, k_area, v_data, v_area = nvfp4_kv_cache_views(kv_cache)
    out = []
    for data, area, gs, offsets in ((k_data, k_area, gk, k_scale_offset), (v_data, v_area, gv, v_scale_offset)):
        pos = _scale_positions(offsets, page, kv_cache.device)
        raw = area[idx].reshape(idx.numel(), hkv, page * NVFP4_SCALE_BYTES)
        logical = raw[..., pos].reshape(idx.numel(), hkv, page, NVFP4_SCALE_BYTES)
        out.append(_decode_rows(data[idx], logical, gs, dtype))
    return out[0], out[1]
