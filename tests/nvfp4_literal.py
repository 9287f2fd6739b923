"""The NVFP4 cache format written out literally from the contract, element by element.

Test-side only and independent of msa_jit.nvfp4 (plain Python over ints and floats, no torch
fp8 casts, no offset functions): byte 64n + j//2 of a slot holds element j of token n (low
nibble for even j); K's scale of (n, g) is byte 8n + g of the scale area, V's is at row
(n//4)*4 + g//2, column (g%2)*4 + n%4. Slow: for pages of a few tokens.
"""

from __future__ import annotations

import math

E2M1_MAG = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_value(b: int) -> float:
    """float8_e4m3fn byte -> value: sign bit 7, exponent bits 6..3 (bias 7), mantissa 2..0."""
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * (m / 8) * 2.0 ** -6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


E4M3_NONNEG = [e4m3_value(b) for b in range(0x7F)]   # byte b -> value, ascending, 0x7E = 448


def nearest_even(x: float, grid: list[float]) -> int:
    """Index of the grid value nearest to x >= 0; a tie goes to the even index; saturating."""
    if x >= grid[-1]:
        return len(grid) - 1
    return min(range(len(grid)), key=lambda i: (abs(grid[i] - x), i % 2))


def k_scale_pos(n: int, g: int) -> int:
    return 8 * n + g


def v_scale_pos(n: int, g: int) -> int:
    row = (n // 4) * 4 + g // 2
    col = (g % 2) * 4 + n % 4
    return 8 * row + col


def slot_bytes(cache, p: int, slot: int) -> list[int]:
    """The page_size * 72 bytes of cache[p, slot] as ints."""
    return [int(b) for b in cache[p, slot].reshape(-1).tolist()]


def read_code_and_scale(flat: list[int], page: int, n: int, j: int, is_v: bool) -> tuple[int, int]:
    """(4-bit code of element j of token n, its block's scale byte) from one slot's bytes."""
    byte = flat[64 * n + j // 2]
    code = byte & 0x0F if j % 2 == 0 else byte >> 4
    g = j // 16
    pos = v_scale_pos(n, g) if is_v else k_scale_pos(n, g)
    return code, flat[64 * page + pos]


def decode_slot(flat: list[int], page: int, is_v: bool, gscale: float) -> list[list[float]]:
    """[page][128] values of one slot: e2m1(code) * e4m3(scale) * global."""
    out = []
    for n in range(page):
        row = []
        for j in range(128):
            code, sb = read_code_and_scale(flat, page, n, j, is_v)
            sign = -1.0 if code & 0x8 else 1.0
            row.append(sign * E2M1_MAG[code & 0x7] * e4m3_value(sb) * gscale)
        out.append(row)
    return out


def quantize_row(x: list[float], gscale: float) -> tuple[list[int], list[int]]:
    """128 values -> (128 codes, 8 scale bytes) by the quantizer's documented rule."""
    codes, scales = [], []
    for g in range(8):
        block = x[16 * g:16 * g + 16]
        sb = nearest_even(max(abs(e) for e in block) / 6.0 / gscale, E4M3_NONNEG)
        sf = E4M3_NONNEG[sb]
        scales.append(sb)
        for e in block:
            mag = nearest_even(abs(e) / (sf * gscale), E2M1_MAG) if sf > 0 else 0
            codes.append(mag | (8 if math.copysign(1.0, e) < 0 else 0))
    return codes, scales
