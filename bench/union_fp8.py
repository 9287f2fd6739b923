"""The shipped sm_90a union kernel (kernels/sparse_decode_union_sm90.py) with its timing probes
(issue #19's speculative decode; docs/performance.md row 66).

History: the retired bench/union_wgmma.py (commit d3bf0ed) converted every union block's K and V
to f16 tiles before its MMAs, and row 55 measured that conversion as what the design waits on. This kernel, first
built here as a probe and since shipped, never converts K: S runs on fp8 warpgroup MMAs
straight from the K tile two TMA copies lay down, and only V is converted while S runs (see
the shipped module's docstring for the design, the grid and the builds).

`UnionFp8Kernel` is the shipped class plus the probe options, through its hooks:

* trace=True: thread 0 of each MMA warpgroup stamps %globaltimer at 7 events of each block,
  and thread 0 of the CTA its block count, SM and start, over the plan's partial_o
  (bench/union_trace.py --events fp8; the stamps overwrite the partials: results wrong);
* convert=False leaves V unconverted, mma=False skips the MMAs and the softmax, lo_chain=False
  (a bf16 query) skips the QGMMA chain of Q's lo tile (timing only, results wrong);
* (retired in session 18, slower by 5-10 us: docs/performance.md row 75) v_cvt="trick" / "mixed",
  V converted by the integer bit trick, all or half of it: at commit 34bf61e;
* v_ahead=n: V's shared loads issued n 16-key rows ahead of their conversion and stores instead of
  the shipped kernel's v_loads_ahead (0: each row's load after the row before is stored, as
  before session 18).
* ex2_poly=n (session 27, row 85; n = 2, 3, 4, 6 are built; 0.3-3.4% slower on the H200 in session 29, not
  shipped, kept to reproduce that result): of every 16 of a thread's P
  elements, the first n are 2**x on the FMA pipe (ex2_poly3: x split into floor and fraction, a degree-3
  polynomial, the exponent added as an integer) instead of ex2.approx on the MUFU pipe, whose 16 results
  per SM and clock make a warp's 64 ex2 per block take 512 cycles.
* (retired in session 27, when row 84 shipped lo 0) lo_at=r, S's lo QGMMA chain issued after r of
  V's 8 16-key rows are converted (row 80): at commit 8871a82.
* (retired from the kernel in session 31) the bf16 2-CTA build without the V converter (row 84: S's lo
  chain behind V's shared loads) and every probe of it (q_lo_regs without v_converter): at commit 5986f3e.

Its constructor takes the shipped class's options (warpgroups, stages, q_lo_regs)
as given: occupancy_options adds none (bench/kv_format_ab.py's VARIANTS name every build's).
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64
from cutlass.cutlass_dsl import T, dsl_user_op

from kernel_probes import globaltimer_lo, smid
from msa_jit.jit.compiler import kernels_package

kernels_package()
from msa_jit.kernels.union import SparseDecodeUnionKernel  # noqa: E402
from msa_jit.kernels import ptx  # noqa: E402
from msa_jit.kernels.union_ops import st_global_b32  # noqa: E402

# 2**f on [0, 1) as 1 + f (C1 + f (C2 + f C3)): the minimax fit of the relative error with C0 = 1 exactly (so
# 2**-127, the clamp of -inf, comes out as +0), max relative error 8.6e-5 in float32 (f16 P rounds at 4.9e-4);
# fitted by linear programming on 4001 points
EX2_POLY3 = (0.6951166391372681, 0.22764497995376587, 0.07706724107265472)
ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: x + magic rounded down holds floor(x) in its low mantissa bits


def _f32_hex(v: float) -> str:
    import struct

    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


# ex2_poly3's asm ($1 = x, $0 = 2**x); tests/ptx_model.py interprets this very text on the CPU
EX2_POLY3_PTX = "\n".join([
    "{",
    ".reg .f32 xc, xr, xb, fr, p;",
    ".reg .b32 e, pi;",
    "max.ftz.f32 xc, $1, 0fC2FE0000;",  # -127: -inf and below give +0 at the end
    f"add.rm.ftz.f32 xr, xc, {_f32_hex(ROUND_MAGIC)};",
    f"sub.ftz.f32 xb, xr, {_f32_hex(ROUND_MAGIC)};",  # floor(x)
    "sub.ftz.f32 fr, xc, xb;",  # in [0, 1]
    f"fma.rn.ftz.f32 p, fr, {_f32_hex(EX2_POLY3[2])}, {_f32_hex(EX2_POLY3[1])};",
    f"fma.rn.ftz.f32 p, p, fr, {_f32_hex(EX2_POLY3[0])};",
    "fma.rn.ftz.f32 p, p, fr, 0f3F800000;",
    "mov.b32 e, xr;",
    "shl.b32 e, e, 23;",  # the low bits of xr's mantissa are floor(x): (floor(x) << 23) mod 2**32
    "mov.b32 pi, p;",
    "add.s32 pi, pi, e;",  # floor(x) added to p's exponent field
    "mov.b32 $0, pi;",
    "}",
])


@dsl_user_op
def ex2_poly3(x: Float32, *, loc=None, ip=None) -> Float32:
    """2**x on the FMA and integer pipes, for x <= 127: x <= -127 (and -inf) give +0, as ex2.approx.ftz
    does; -127 < x < -126 a denormal that is not near 2**x (0 once P is rounded to f16). j = floor(x) by a
    round-down add of ROUND_MAGIC, 2**(x - j) by the polynomial, j added to the exponent field as an integer."""
    return Float32(ptx._asm(T.f32(), [ptx._f32(x, loc, ip)], EX2_POLY3_PTX, "=f,f"))


TRACE_BLOCKS = 64  # trace=True: 8 stamps for each of the first 64 blocks, then n_blocks, smid, start
TRACE_WORDS = TRACE_BLOCKS * 8 + 4


class UnionFp8Kernel(SparseDecodeUnionKernel):
    """The shipped union kernel with the bench's probe options (trace, convert=False, mma=False)."""

    @staticmethod
    def occupancy_options(ctas_per_sm: int, q_dtype: str, kv_dtype: str = "float8_e4m3fn") -> dict:
        """None: the variants' options are the whole build (the bench's configs say 2 CTAs per SM)."""
        return {}

    def __init__(self, *, union_fp8: bool = True, trace: bool = False, convert: bool = True, mma: bool = True,
                 lo_chain: bool = True, v_ahead: int | None = None, ex2_poly: int = 0, **options):
        super().__init__(**options)
        if not 0 <= ex2_poly <= 16:
            raise ValueError(f"ex2_poly={ex2_poly}: 0..16 of every 16 P elements")
        self.ex2_poly = ex2_poly
        # trace=True: TRACE_WORDS int32 per CTA over the plan's partial_o (bench/union_trace.py reads them)
        self.trace = trace
        self.convert = convert
        self.mma = mma
        self.lo_chain = lo_chain
        if v_ahead is not None:
            self.v_loads_ahead = v_ahead

    # ---- trace=True
    def mark_cta(self, mPO, n_blocks, tidx):
        self.trace_po = mPO
        if self.trace:
            self.stamp_cta(n_blocks, tidx)

    @cute.jit
    def stamp_cta(self, n_blocks, tidx):
        if tidx == 0:
            self.stamp(TRACE_BLOCKS * 8, n_blocks)
            self.stamp(TRACE_BLOCKS * 8 + 1, smid())
            self.stamp(TRACE_BLOCKS * 8 + 2, globaltimer_lo())

    def mark(self, i, event: int, tidx):
        if self.trace:
            self.stamp_block(i, event, tidx)

    @cute.jit
    def stamp_block(self, i, slot: cutlass.Constexpr, tidx):
        """Thread 0 of the caller's warpgroup stamps event `slot` (0..7) of block i."""
        if tidx == 0:
            if i < TRACE_BLOCKS:
                self.stamp(8 * i + slot, globaltimer_lo())

    @cute.jit
    def stamp(self, slot, value):
        """Trace word `slot` of this CTA := value."""
        req, h, tile = cute.arch.block_idx()
        nreq, _, ntile = cute.arch.grid_dim()
        cta = (h * nreq + req) * ntile + tile
        st_global_b32(self.trace_po.iterator.toint() + (Int64(cta) * TRACE_WORDS + slot) * 4, value)

    # ---- convert=False: the V tiles stay as they are
    def convert_v(self, v_stage, dst_smem, tidx, ahead: int = 0):
        if self.convert:
            super().convert_v(v_stage, dst_smem, tidx, ahead)

    # ---- ex2_poly=n: the first n of every 16 P elements on the FMA pipe
    def exp2_p(self, x, k: int):
        if k % 16 < self.ex2_poly:
            return ex2_poly3(x)
        return super().exp2_p(x, k)

    # ---- mma=False: no S, no softmax, no P V; lo_chain=False: S from Q's hi tile only
    def s_mma_issue(self, m, acc_s, s):
        if self.mma:
            # the shipped s_mma_issue reads split_q at trace time to add a shared-memory lo chain: hide it
            split_q = self.split_q
            self.split_q = split_q and self.lo_chain
            super().s_mma_issue(m, acc_s, s)
            self.split_q = split_q

    def s_lo_chain(self, m, acc_s, s):
        if self.lo_chain:  # (s_mma_issue, its only caller, runs only with mma)
            super().s_lo_chain(m, acc_s, s)

    def mma_wait(self):
        if self.mma:
            super().mma_wait()

    def softmax(self, *args):
        if self.mma:
            super().softmax(*args)

    def pv_mma(self, *args):
        if self.mma:
            super().pv_mma(*args)
