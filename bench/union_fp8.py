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
* v_cvt="trick": V's e4m3 -> f16 by the integer bit trick (kernels/ptx.py fp8x2_to_f16x2_scaled:
  a byte permute, a shift and two logic ops per f16x2, value * 2**-8, undone in the output scale)
  instead of one `cvt.rn.f16x2.e4m3x2` (F2FP) per f16x2; v_cvt="mixed": half of each thread's pairs
  each way (the cvt ones times 2**-8 by one HMUL2), so the F2FP, integer and f16 pipes share it.
  Both exact (results right);
* v_ahead=n: V's shared loads issued n 16-key rows ahead of their conversion and stores instead of
  the shipped kernel's v_loads_ahead (0: each row's load after the row before is stored, as
  before session 18).

Its constructor takes the shipped class's options (warpgroups, stages, q_lo_regs)
as given: occupancy_options adds none (bench/kv_format_ab.py's VARIANTS name every build's).
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from kernel_probes import globaltimer_lo, smid
from msa_jit.compiler import kernels_package

kernels_package()
from msa_jit.kernels.sparse_decode_union_sm90 import SparseDecodeUnionSm90Kernel  # noqa: E402
from msa_jit.kernels import ptx  # noqa: E402
from msa_jit.kernels.union_sm90_ops import st_global_b32, swizzled_f16, swizzled_fp8  # noqa: E402

TRACE_BLOCKS = 64  # trace=True: 8 stamps for each of the first 64 blocks, then n_blocks, smid, start
TRACE_WORDS = TRACE_BLOCKS * 8 + 4
F16X2_2EXP_M8 = 0x1C001C00  # f16x2 (2**-8, 2**-8)


class UnionFp8Kernel(SparseDecodeUnionSm90Kernel):
    """The shipped union kernel with the bench's probe options (trace, convert=False, mma=False)."""

    @staticmethod
    def occupancy_options(ctas_per_sm: int, q_dtype: str, kv_dtype: str = "float8_e4m3fn") -> dict:
        """None: the variants' options are the whole build (the bench's configs say 2 CTAs per SM)."""
        return {}

    def __init__(self, *, union_fp8: bool = True, trace: bool = False, convert: bool = True, mma: bool = True,
                 lo_chain: bool = True, v_cvt: str = "cvt", v_ahead: int | None = None, **options):
        super().__init__(**options)
        # trace=True: TRACE_WORDS int32 per CTA over the plan's partial_o (bench/union_trace.py reads them)
        self.trace = trace
        self.convert = convert
        self.mma = mma
        self.lo_chain = lo_chain
        if v_cvt not in ("cvt", "trick", "mixed"):
            raise ValueError(f"v_cvt {v_cvt!r}")
        self.v_cvt = v_cvt
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

    # ---- convert=False: the V tiles stay as they are (only the fence); v_cvt: how V's bytes become f16
    def convert_v(self, v_stage, dst_smem, tidx, fence=True):
        if self.convert and self.v_cvt == "cvt":
            return super().convert_v(v_stage, dst_smem, tidx, fence)
        if self.convert:
            self.convert_v_scaled(v_stage, dst_smem, tidx)
        if fence:
            cute.arch.fence_view_async_shared()

    @cute.jit
    def convert_v_scaled(self, v_stage, dst_smem, tidx):
        """The shipped convert_v's loads and stores, V as f16 times 2**-8 (v_cvt "trick" / "mixed")."""
        c8 = tidx % 8
        for r in cutlass.range_constexpr(self.page // 16):
            key = tidx // 8 + 16 * r
            w = ptx.ld_shared_v4(v_stage + swizzled_fp8(key, 16 * c8))
            f = []
            for k in cutlass.range_constexpr(4):
                if cutlass.const_expr(self.v_cvt == "mixed" and k % 2 == 1):
                    f.append(ptx.hmul2(ptx.e4m3x2_to_f16x2(w[k], 0), Int32(F16X2_2EXP_M8)))
                    f.append(ptx.hmul2(ptx.e4m3x2_to_f16x2(w[k], 1), Int32(F16X2_2EXP_M8)))
                else:
                    lo, hi = ptx.fp8x4_to_f16x2x2_scaled(w[k])
                    f.append(lo)
                    f.append(hi)
            dst = dst_smem + swizzled_f16(self.page, key, 16 * c8)
            sel = c8 // 4  # the shipped store_f16_chunks' order: a phase covers 8 bank groups
            first = dst ^ (16 * sel)
            ptx.st_shared_v4(first, cutlass.select_(sel == 0, f[0], f[4]), cutlass.select_(sel == 0, f[1], f[5]),
                             cutlass.select_(sel == 0, f[2], f[6]), cutlass.select_(sel == 0, f[3], f[7]))
            ptx.st_shared_v4(first ^ 16, cutlass.select_(sel == 0, f[4], f[0]), cutlass.select_(sel == 0, f[5], f[1]),
                             cutlass.select_(sel == 0, f[6], f[2]), cutlass.select_(sel == 0, f[7], f[3]))

    def finish(self, mOut, mLse, mPO, mPL, storage, acc_o, row_max, row_sum, o_other, req, h, tile, split,
               num_splits, qlen, n_tok, v_scale, *rest):
        if self.convert and self.v_cvt != "cvt":
            v_scale = v_scale * 256.0  # V was converted times 2**-8
        super().finish(mOut, mLse, mPO, mPL, storage, acc_o, row_max, row_sum, o_other, req, h, tile, split,
                       num_splits, qlen, n_tok, v_scale, *rest)

    # ---- mma=False: no S, no softmax, no P V; lo_chain=False: S from Q's hi tile only
    def s_mma_issue(self, m, acc_s, s):
        if self.mma:
            # the shipped s_mma_issue reads split_q at trace time to add the lo chain: hide it while tracing
            split_q = self.split_q
            self.split_q = split_q and self.lo_chain
            super().s_mma_issue(m, acc_s, s)
            self.split_q = split_q

    def mma_wait(self):
        if self.mma:
            super().mma_wait()

    def softmax(self, *args):
        if self.mma:
            super().softmax(*args)

    def pv_mma(self, *args):
        if self.mma:
            super().pv_mma(*args)
