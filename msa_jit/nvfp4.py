"""NVFP4 KV cache layout (contract, "NVFP4 KV cache"): the views the engine adapter needs.

MINIMAL on purpose (branch `engine`): the layout constant, the slot / view functions and a shape
check. The fuller module (quantizer, reference support) is written in parallel on another branch;
at merge the lead keeps one module, these names unchanged.

Layout: uint8 `[num_pages, 2 * Hkv, page_size, 72]`, contiguous. Slot `2h` is K of KV head h,
slot `2h + 1` its V. One slot is `page_size * 72` contiguous bytes: the E2M1 data
`[page_size, 64]` first, then the E4M3 block scales `[page_size, 8]`. So the last two dims of a
slot are one flat byte area, not 72-byte token rows.
"""

from __future__ import annotations

import torch

__all__ = [
    "NVFP4_DATA_BYTES",
    "NVFP4_ROW_BYTES",
    "NVFP4_SCALE_BYTES",
    "is_nvfp4_kv_layout",
    "nvfp4_kv_cache_slots",
    "nvfp4_kv_cache_views",
]

NVFP4_DATA_BYTES = 64  # 128 E2M1 codes of one token, two per byte
NVFP4_SCALE_BYTES = 8  # one E4M3 scale per 16 elements
NVFP4_ROW_BYTES = NVFP4_DATA_BYTES + NVFP4_SCALE_BYTES  # 72 bytes per token and slot


def _check_layout(kv_cache: torch.Tensor) -> None:
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8:
        raise TypeError(f"kv_cache: the NVFP4 layout is uint8, got {kv_cache.dtype}")
    if kv_cache.dim() != 4 or kv_cache.shape[3] != NVFP4_ROW_BYTES or kv_cache.shape[1] % 2:
        raise ValueError(
            f"kv_cache: expected the NVFP4 layout [pages, 2*Hkv, page_size, {NVFP4_ROW_BYTES}] "
            f"uint8, got shape {list(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache: the NVFP4 layout must be contiguous, got strides {list(kv_cache.stride())}")


def is_nvfp4_kv_layout(kv_cache: torch.Tensor, num_kv_heads: int, page_size: int) -> bool:
    """Whether `kv_cache` is uint8 `[P, 2*num_kv_heads, page_size, 72]` (shape and dtype only)."""
    return (
        isinstance(kv_cache, torch.Tensor)
        and kv_cache.dtype == torch.uint8
        and kv_cache.dim() == 4
        and tuple(kv_cache.shape[1:]) == (2 * num_kv_heads, page_size, NVFP4_ROW_BYTES)
    )


def nvfp4_kv_cache_slots(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head K and V slots, `kv_cache[:, 0::2]` and `kv_cache[:, 1::2]`.

    Each is a `[P, Hkv, page_size, 72]` uint8 view (head stride = 2 slots).
    """
    return kv_cache[:, 0::2], kv_cache[:, 1::2]


def nvfp4_kv_cache_views(
    kv_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(k_data, k_scales, v_data, v_scales)` views of an NVFP4 cache.

    kv_cache: uint8 `[P, 2*Hkv, page_size, 72]`, contiguous. Returns uint8 views
    `[P, Hkv, page_size, 64]` (data) and `[P, Hkv, page_size, 8]` (block scales, in the
    writer's order: K row-major, V swizzled, see the contract). Raises TypeError / ValueError
    naming `kv_cache` for any other layout.
    """
    _check_layout(kv_cache)
    pages, slots, page_size, _ = kv_cache.shape
    heads = slots // 2
    slot_bytes = page_size * NVFP4_ROW_BYTES
    page_stride, head_stride = kv_cache.stride(0), 2 * slot_bytes
    base = kv_cache.storage_offset()
    views = []
    for side in (0, 1):  # K slot, then V slot of each head
        for width, offset in ((NVFP4_DATA_BYTES, 0), (NVFP4_SCALE_BYTES, page_size * NVFP4_DATA_BYTES)):
            views.append(kv_cache.as_strided(
                (pages, heads, page_size, width), (page_stride, head_stride, width, 1),
                base + side * slot_bytes + offset,
            ))
    k_data, k_scales, v_data, v_scales = views
    return k_data, k_scales, v_data, v_scales
