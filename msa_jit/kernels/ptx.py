"""Small PTX helpers shared by the decode kernels (SM90 and later).

Each helper is one `llvm.inline_asm` with the exact instruction we want, so the SASS is
predictable: 16-byte shared/global accesses, `mma.sync` m16n8k16, fp8 -> f16 conversions
(`cvt`, and the SM100 kernel's bit trick) and the 1-D bulk copy that completes on an
mbarrier. The tcgen05 wrappers of the SM100 kernel are in ptx_sm100.py.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(ret, args, text, constraints, side_effects=False):
    return llvm.inline_asm(
        ret,
        args,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def _i32(v, loc, ip):
    return Int32(v).ir_value(loc=loc, ip=ip)


def _f32(v, loc, ip):
    return Float32(v).ir_value(loc=loc, ip=ip)


def _unpack(struct, n, ty, cls, loc, ip):
    return tuple(cls(llvm.extractvalue(ty, struct, [i], loc=loc, ip=ip)) for i in range(n))


@dsl_user_op
def smem_addr(ptr: cutlass.cute.Pointer, *, loc=None, ip=None) -> Int32:
    """32-bit shared-window address of a shared-memory pointer."""
    return Int32(ptr.toint(loc=loc, ip=ip))


@dsl_user_op
def ld_shared_v4(addr: Int32, *, loc=None, ip=None):
    """ld.shared.v4.b32 at a 16-byte aligned shared address -> 4 x Int32."""
    s = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_i32(addr, loc, ip)],
        "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        side_effects=True,
    )
    return _unpack(s, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def ld_shared_b32(addr: Int32, *, loc=None, ip=None) -> Int32:
    """ld.shared.b32 at a 4-byte aligned shared address."""
    return Int32(_asm(T.i32(), [_i32(addr, loc, ip)], "ld.shared.b32 $0, [$1];", "=r,r", side_effects=True))


@dsl_user_op
def ld_shared_v2(addr: Int32, *, loc=None, ip=None):
    """ld.shared.v2.b32 at an 8-byte aligned shared address -> 2 x Int32."""
    s = _asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        [_i32(addr, loc, ip)],
        "ld.shared.v2.b32 {$0, $1}, [$2];",
        "=r,=r,r",
        side_effects=True,
    )
    return _unpack(s, 2, T.i32(), Int32, loc, ip)


@dsl_user_op
def ld_shared_u8(addr: Int32, *, loc=None, ip=None) -> Int32:
    """ld.shared.u8, zero-extended to 32 bits."""
    return Int32(_asm(T.i32(), [_i32(addr, loc, ip)], "ld.shared.u8 $0, [$1];", "=r,r", side_effects=True))


@dsl_user_op
def ld_shared_v4_f32(addr: Int32, *, loc=None, ip=None):
    s = _asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [_i32(addr, loc, ip)],
        "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];",
        "=f,=f,=f,=f,r",
        side_effects=True,
    )
    return _unpack(s, 4, T.f32(), Float32, loc, ip)


@dsl_user_op
def st_shared_v4_f32(addr: Int32, v0, v1, v2, v3, *, loc=None, ip=None) -> None:
    _asm(
        None,
        [_i32(addr, loc, ip)] + [_f32(v, loc, ip) for v in (v0, v1, v2, v3)],
        "st.shared.v4.f32 [$0], {$1, $2, $3, $4};",
        "r,f,f,f,f",
        side_effects=True,
    )


@dsl_user_op
def st_shared_v4(addr: Int32, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    """st.shared.v4.b32 of 4 words at a 16-byte aligned shared address."""
    _asm(None, [_i32(x, loc, ip) for x in (addr, w0, w1, w2, w3)],
         "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", side_effects=True)


@dsl_user_op
def ld_global_nc_v4(addr: Int64, *, loc=None, ip=None):
    """Read-only 16-byte global load (ld.global.nc.v4.b32) -> 4 x Int32."""
    s = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        side_effects=True,
    )
    return _unpack(s, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def st_global_v4(addr: Int64, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    _asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip)] + [_i32(w, loc, ip) for w in (w0, w1, w2, w3)],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        side_effects=True,
    )


@dsl_user_op
def st_global_v4_f32(addr: Int64, v0, v1, v2, v3, *, loc=None, ip=None) -> None:
    _asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip)] + [_f32(v, loc, ip) for v in (v0, v1, v2, v3)],
        "st.global.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,f,f,f,f",
        side_effects=True,
    )


@dsl_user_op
def fp8x2_to_f16x2_scaled(lo: Int32, hi: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """Two e4m3 bytes -> f16x2 holding value * 2**-8, exactly (normals and subnormals).

    `prmt` puts the two chosen bytes of {hi:lo} into the high byte of each 16-bit half
    (the low bytes are don't-care); then sign stays at bit 15 and exponent+mantissa move
    down one bit, which reinterprets e4m3 (bias 7) as f16 (bias 15): a 2**-8 scale that
    the caller folds into its fp32 scale factors.
    """
    return Int32(
        _asm(
            T.i32(),
            [_i32(lo, loc, ip), _i32(hi, loc, ip)],
            "{\n\t.reg .b32 t, u;\n\t"
            f"prmt.b32 t, $1, $2, {selector:#x};\n\t"
            "shr.b32 u, t, 1;\n\t"
            "and.b32 u, u, 0x3f803f80;\n\t"
            "and.b32 t, t, 0x80008000;\n\t"
            "or.b32 $0, t, u;\n\t}",
            "=r,r,r",
        )
    )


def fp8x4_to_f16x2x2_scaled(w):
    """Bytes 0..3 of w (e4m3) -> (f16x2 of bytes 0,1; f16x2 of bytes 2,3), times 2**-8 (bit trick)."""
    return fp8x2_to_f16x2_scaled(w, w, 0x1000), fp8x2_to_f16x2_scaled(w, w, 0x3020)


@dsl_user_op
def e4m3x2_to_f16x2(w: Int32, half: int, *, loc=None, ip=None) -> Int32:
    """The two e4m3 bytes in 16-bit half `half` (0 low, 1 high) of w -> f16x2, exact (SM89+).

    One `cvt.rn.f16x2.e4m3x2` (one F2FP on SM90): the lower byte lands in the lower half.
    """
    pick = "l" if half == 0 else "h"
    return Int32(
        _asm(
            T.i32(),
            [_i32(w, loc, ip)],
            "{\n\t.reg .b16 l, h;\n\t"
            "mov.b32 {l, h}, $1;\n\t"
            f"cvt.rn.f16x2.e4m3x2 $0, {pick};\n\t}}",
            "=r,r",
        )
    )


@dsl_user_op
def e4m3_bytes_to_f16x2(lo: Int32, hi: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """Byte `selector & 7` of {hi:lo} -> low half, byte `(selector >> 4) & 7` -> high half (exact).

    `prmt` gathers the two bytes into 16 bits, one `cvt.rn.f16x2.e4m3x2` converts them.
    """
    return Int32(
        _asm(
            T.i32(),
            [_i32(lo, loc, ip), _i32(hi, loc, ip)],
            "{\n\t.reg .b32 t;\n\t.reg .b16 l, h;\n\t"
            f"prmt.b32 t, $1, $2, {selector:#x};\n\t"
            "mov.b32 {l, h}, t;\n\t"
            "cvt.rn.f16x2.e4m3x2 $0, l;\n\t}",
            "=r,r,r",
        )
    )


@dsl_user_op
def prmt(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """prmt.b32: byte i of the result is byte (selector >> 4i) & 7 of {b:a} (a = bytes 0..3)."""
    return Int32(_asm(T.i32(), [_i32(a, loc, ip), _i32(b, loc, ip)], f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r"))


@dsl_user_op
def hmul2(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """f16x2 a * b (round to nearest; exact when the product fits, as for e2m1 x e4m3)."""
    return Int32(_asm(T.i32(), [_i32(a, loc, ip), _i32(b, loc, ip)], "mul.rn.f16x2 $0, $1, $2;", "=r,r,r"))


@dsl_user_op
def e2m1x8_to_f16x2x4(w: Int32, *, loc=None, ip=None):
    """The 8 e2m1 codes of w (code j in bits [4j, 4j+4)) -> 4 f16x2 holding code * 2**-14, exactly:
    (codes 0, 2), (codes 4, 6), (codes 1, 3), (codes 5, 7).

    No e2m1 conversion instruction before SM100. An e2m1 code s|e1 e0 m is, as the f16 bits
    s|0 0 0 e1 e0|m 0..0, its value times 2**-14 (normals and the subnormal 0.5 alike): each code
    becomes the byte s|0 0 0 e1 e0 m|0 (magnitude to bits 1..3, sign to bit 7; a high nibble's sign
    is there already: 3 integer ops per 4 codes, a low nibble's 4), and one byte permute per f16x2
    puts two such bytes into the high bytes of the halves over zero low bytes. The permute replaces
    a `cvt.rn.f16x2.e4m3x2` of e4m3 bytes (measured: the cvt is the slower instruction).
    """
    s = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_i32(w, loc, ip)],
        "{\n\t.reg .b32 t, u, ey, ez;\n\t"
        # low nibbles: magnitude (w << 1) & 0x0E, sign (w << 4) & 0x80
        "shl.b32 t, $4, 1;\n\t"
        "and.b32 t, t, 0x0E0E0E0E;\n\t"
        "shl.b32 u, $4, 4;\n\t"
        "lop3.b32 ey, u, t, 0x80808080, 0xEC;\n\t"  # (u & c) | t
        # high nibbles: magnitude (w >> 3) & 0x0E, sign w & 0x80
        "shr.u32 t, $4, 3;\n\t"
        "and.b32 t, t, 0x0E0E0E0E;\n\t"
        "lop3.b32 ez, $4, t, 0x80808080, 0xEC;\n\t"
        # bytes 0, 1 (or 2, 3) into bytes 1 and 3 over zero bytes (selector 4 picks the zero register's)
        "prmt.b32 $0, ey, 0, 0x1404;\n\t"
        "prmt.b32 $1, ey, 0, 0x3424;\n\t"
        "prmt.b32 $2, ez, 0, 0x1404;\n\t"
        "prmt.b32 $3, ez, 0, 0x3424;\n\t}",
        "=r,=r,=r,=r,r",
    )
    return _unpack(s, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def e2m1x8_to_f16x2x4_cvt(w: Int32, *, loc=None, ip=None):
    """The 8 e2m1 codes of w (code j in bits [4j, 4j+4)) -> 4 f16x2 holding the code values
    exactly: (codes 0, 1), (2, 3), (4, 5), (6, 7), the lower code in the lower half.

    SM100+ only: one `cvt.rn.f16x2.e2m1x2` per byte (its low nibble lands in the low half).
    """
    s = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_i32(w, loc, ip)],
        "{\n\t.reg .b8 b0, b1, b2, b3;\n\t"
        "mov.b32 {b0, b1, b2, b3}, $4;\n\t"
        "cvt.rn.f16x2.e2m1x2 $0, b0;\n\t"
        "cvt.rn.f16x2.e2m1x2 $1, b1;\n\t"
        "cvt.rn.f16x2.e2m1x2 $2, b2;\n\t"
        "cvt.rn.f16x2.e2m1x2 $3, b3;\n\t}",
        "=r,=r,=r,=r,r",
    )
    return _unpack(s, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def e2m1_nibble_pairs(a: Int32, b: Int32, *, loc=None, ip=None):
    """Two words of 8 e2m1 codes each -> (even, odd): byte i of `even` holds code 2i of a (low
    nibble) and of b (high nibble), byte i of `odd` codes 2i+1 of a and b, so that one
    `cvt.rn.f16x2.e2m1x2` per byte gives the f16x2 (a's code, b's code) of one element."""
    s = _asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        [_i32(a, loc, ip), _i32(b, loc, ip)],
        "{\n\t.reg .b32 t;\n\t"
        "shl.b32 t, $3, 4;\n\t"
        "lop3.b32 $0, $2, t, 0x0F0F0F0F, 0xE4;\n\t"  # (a & m) | (t & ~m)
        "shr.u32 t, $2, 4;\n\t"
        "lop3.b32 $1, t, $3, 0x0F0F0F0F, 0xE4;\n\t}",
        "=r,=r,r,r",
    )
    return _unpack(s, 2, T.i32(), Int32, loc, ip)


@dsl_user_op
def f32x2_to_f16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Pack two fp32 into f16x2 (round to nearest); `lo` lands in the low half."""
    return Int32(
        _asm(T.i32(), [_f32(hi, loc, ip), _f32(lo, loc, ip)], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f")
    )


@dsl_user_op
def f32x2_to_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(
        _asm(T.i32(), [_f32(hi, loc, ip), _f32(lo, loc, ip)], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
    )


@dsl_user_op
def bf16x2_to_f16x2(w: Int32, scale: Float32 | None = None, *, loc=None, ip=None) -> Int32:
    """bf16x2 (times scale, in fp32) -> f16x2, rounded once; values past the f16 range become inf."""
    mul = "" if scale is None else "mul.f32 x, x, $2;\n\tmul.f32 y, y, $2;\n\t"
    args = [_i32(w, loc, ip)] + ([] if scale is None else [_f32(scale, loc, ip)])
    return Int32(
        _asm(
            T.i32(),
            args,
            "{\n\t.reg .b32 a, b;\n\t.reg .f32 x, y;\n\t"
            "shl.b32 a, $1, 16;\n\t"
            "and.b32 b, $1, 0xffff0000;\n\t"
            "mov.b32 x, a;\n\t"
            "mov.b32 y, b;\n\t" + mul +
            "cvt.rn.f16x2.f32 $0, y, x;\n\t}",
            "=r,r" + ("" if scale is None else ",f"),
        )
    )


@dsl_user_op
def mma_f16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, *, loc=None, ip=None):
    """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: D = A*B + C, 4 fp32 out."""
    s = _asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [_i32(x, loc, ip) for x in (a0, a1, a2, a3, b0, b1)] + [_f32(x, loc, ip) for x in (c0, c1, c2, c3)],
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
    )
    return _unpack(s, 4, T.f32(), Float32, loc, ip)


@dsl_user_op
def bulk_copy_g2s(dst_smem: Int32, src_gmem: Int64, nbytes: int, mbar_smem: Int32, *, loc=None, ip=None) -> None:
    """1-D bulk copy global -> shared that completes `nbytes` of tx on an mbarrier (SM90+)."""
    _asm(
        None,
        [_i32(dst_smem, loc, ip), Int64(src_gmem).ir_value(loc=loc, ip=ip), _i32(nbytes, loc, ip), _i32(mbar_smem, loc, ip)],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r",
        side_effects=True,
    )


@dsl_user_op
def ffma(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """a * b + c rounded once (fma.rn.f32)."""
    return Float32(_asm(T.f32(), [_f32(a, loc, ip), _f32(b, loc, ip), _f32(c, loc, ip)],
                        "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f"))


@dsl_user_op
def ex2(x: Float32, *, loc=None, ip=None) -> Float32:
    """2**x with ex2.approx.ftz (ex2(-inf) == 0)."""
    return Float32(_asm(T.f32(), [_f32(x, loc, ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f"))


@dsl_user_op
def rcp(x: Float32, *, loc=None, ip=None) -> Float32:
    """1 / x with rcp.approx.ftz (one MUFU, relative error ~2**-23; IEEE division is a ~20-instruction
    sequence with a slow path)."""
    return Float32(_asm(T.f32(), [_f32(x, loc, ip)], "rcp.approx.ftz.f32 $0, $1;", "=f,f"))


@dsl_user_op
def lg2(x: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [_f32(x, loc, ip)], "lg2.approx.ftz.f32 $0, $1;", "=f,f"))


@dsl_user_op
def mapa_shared(addr: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    """The shared::cluster address of `addr` (this CTA's shared window) in cluster CTA `rank`."""
    return Int32(_asm(T.i32(), [_i32(addr, loc, ip), _i32(rank, loc, ip)],
                      "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r"))


@dsl_user_op
def st_async_v4_f32(addr: Int32, mbar: Int32, v0, v1, v2, v3, *, loc=None, ip=None) -> None:
    """st.async of 4 fp32 to a shared::cluster address (mapa_shared), 16 bytes of tx completed on
    the mbarrier at shared::cluster address `mbar` (of the same CTA)."""
    _asm(
        None,
        [_i32(addr, loc, ip), _i32(mbar, loc, ip)] + [_f32(v, loc, ip) for v in (v0, v1, v2, v3)],
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [$0], {$2, $3, $4, $5}, [$1];",
        "r,r,f,f,f,f",
        side_effects=True,
    )


@dsl_user_op
def st_async_f32(addr: Int32, mbar: Int32, v, *, loc=None, ip=None) -> None:
    """st.async of one fp32 (4 bytes of tx), as st_async_v4_f32."""
    _asm(None, [_i32(addr, loc, ip), _i32(mbar, loc, ip), _f32(v, loc, ip)],
         "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [$0], $2, [$1];", "r,r,f", side_effects=True)


@dsl_user_op
def mbarrier_try_wait_cluster(mbar: Int32, parity: Int32, *, loc=None, ip=None) -> Int32:
    """1 once the phase of parity `parity` of this CTA's mbarrier has completed, else 0, with
    acquire semantics at cluster scope (the bytes other CTAs' st.async delivered are visible)."""
    return Int32(_asm(
        T.i32(),
        [_i32(mbar, loc, ip), _i32(parity, loc, ip)],
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$1], $2;\n"
        "selp.u32 $0, 1, 0, p;\n}",
        "=r,r,r",
        side_effects=True,
    ))


@dsl_user_op
def ld_shared_f32(addr: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [_i32(addr, loc, ip)], "ld.shared.f32 $0, [$1];", "=f,r", side_effects=True))


@dsl_user_op
def mbarrier_arrive_expect_tx(mbar: Int32, nbytes: Int32, *, loc=None, ip=None) -> None:
    """This thread's arrival on this CTA's mbarrier, raising its phase's expected tx by `nbytes`."""
    _asm(None, [_i32(mbar, loc, ip), _i32(nbytes, loc, ip)],
         "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r", side_effects=True)


@dsl_user_op
def mbarrier_init(mbar: Int32, count: int, *, loc=None, ip=None) -> None:
    """mbarrier.init of this CTA's mbarrier at shared address `mbar` for `count` arrivals."""
    _asm(None, [_i32(mbar, loc, ip), _i32(count, loc, ip)], "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r",
         side_effects=True)


@dsl_user_op
def st_shared_f32(addr: Int32, v, *, loc=None, ip=None) -> None:
    _asm(None, [_i32(addr, loc, ip), _f32(v, loc, ip)], "st.shared.f32 [$0], $1;", "r,f", side_effects=True)
