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
* lo_at=r (a bf16 query, q_lo_regs; session 25): S's lo QGMMA chain is issued after r of V's 8
  16-key rows are converted (every row's shared loads still issued first), not beside the hi chain
  before the conversion (row 75: the two chains' shared reads lengthen the conversion's loads).
  8: after the whole conversion.

Its constructor takes the shipped class's options (warpgroups, stages, q_lo_regs)
as given: occupancy_options adds none (bench/kv_format_ab.py's VARIANTS name every build's).
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations
import cutlass
import cutlass.cute as cute
from cutlass import Int64
from cutlass.cute.nvgpu import warpgroup

from kernel_probes import globaltimer_lo, smid
from msa_jit.compiler import kernels_package

kernels_package()
from msa_jit.kernels.sparse_decode_union_sm90 import SparseDecodeUnionSm90Kernel  # noqa: E402
from msa_jit.kernels.sparse_decode_union_sm90 import WG_THREADS  # noqa: E402
from msa_jit.kernels import ptx  # noqa: E402
from msa_jit.kernels.union_sm90_ops import st_global_b32, store_f16_chunks, swizzled_f16, swizzled_fp8  # noqa: E402

TRACE_BLOCKS = 64  # trace=True: 8 stamps for each of the first 64 blocks, then n_blocks, smid, start
TRACE_WORDS = TRACE_BLOCKS * 8 + 4


class UnionFp8Kernel(SparseDecodeUnionSm90Kernel):
    """The shipped union kernel with the bench's probe options (trace, convert=False, mma=False)."""

    @staticmethod
    def occupancy_options(ctas_per_sm: int, q_dtype: str, kv_dtype: str = "float8_e4m3fn") -> dict:
        """None: the variants' options are the whole build (the bench's configs say 2 CTAs per SM)."""
        return {}

    def __init__(self, *, union_fp8: bool = True, trace: bool = False, convert: bool = True, mma: bool = True,
                 lo_chain: bool = True, v_ahead: int | None = None, lo_at: int | None = None, **options):
        super().__init__(**options)
        if lo_at is not None and not (self.q_lo_regs and 0 <= lo_at <= self.page // 16):
            raise ValueError(f"lo_at {lo_at} needs q_lo_regs (a bf16 query) and 0..{self.page // 16}")
        self.lo_at = lo_at
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

    # ---- convert=False: the V tiles stay as they are (only the fence)
    def convert_v(self, v_stage, dst_smem, tidx, fence=True):
        if self.convert:
            return super().convert_v(v_stage, dst_smem, tidx, fence)
        if fence:
            cute.arch.fence_view_async_shared()

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

    # ---- lo_at=r: the lo chain issued after r rows of V's conversion (not @cute.jit: super() needs the
    # plain method; every branch here is decided at trace time)
    def s_and_v(self, m, acc_s, tma, sPages, first, i, n_union, full_ptr, empty_ptr, bufv, bar, tidx):
        if cutlass.const_expr(self.lo_at is None):
            super().s_and_v(m, acc_s, tma, sPages, first, i, n_union, full_ptr, empty_ptr, bufv, bar, tidx)
        else:
            s = i % self.stages
            cute.arch.mbarrier_wait(full_ptr + s, (i // self.stages) & 1)
            self.mark(i, 0, tidx)
            split_q = self.split_q
            self.split_q = False  # the hi chain alone
            super().s_mma_issue(m, acc_s, s)
            self.split_q = split_q
            warpgroup.wait_group(1)  # the previous P V (the hi chain may still run)
            cute.arch.barrier(barrier_id=bar, number_of_threads=WG_THREADS)
            self.mark(i, 1, tidx)
            self.convert_v_lo(m, acc_s, s, bufv + s * self.tile_bytes, m["v_smem"], tidx)
            self.mark(i, 2, tidx)
            self.mma_wait()
            self.mark(i, 3, tidx)
            cute.arch.fence_view_async_shared()
            self.release_stage_and_refill(tma, sPages, first, i, n_union, full_ptr, empty_ptr, tidx)

    @cute.jit
    def convert_v_lo(self, m, acc_s, s, v_stage, dst_smem, tidx):
        """The shipped convert_v with every row's loads first (its v_loads_ahead = 8) and the lo
        chain issued after row lo_at's stores; not fenced (s_and_v fences after the wait)."""
        c8 = tidx % 8
        rows = self.page // 16
        words = [ptx.ld_shared_v4(v_stage + swizzled_fp8(tidx // 8 + 16 * r, 16 * c8)) for r in range(rows)]
        for r in cutlass.range_constexpr(rows + 1):
            if cutlass.const_expr(r == self.lo_at):
                self.s_lo_issue(m, acc_s, s)
            if cutlass.const_expr(r < rows):
                store_f16_chunks(dst_smem + swizzled_f16(self.page, tidx // 8 + 16 * r, 16 * c8), words[r], c8)

    @cute.jit
    def s_lo_issue(self, m, acc_s, s):
        """S += Q_lo K^T of stage s (Q's lo tile from registers), issued and committed."""
        if self.mma:
            tSrK = m["tSrK"]
            warpgroup.fence()
            atom_lo = cute.make_mma_atom(m["mma_s_lo"].op)
            atom_lo.set(warpgroup.Field.ACCUMULATE, True)
            for k in cutlass.range_constexpr(cute.size(m["tSrQ"].shape[2])):
                cute.gemm(atom_lo, acc_s, m["tSrQlo"][None, None, k], tSrK[None, None, k, s], acc_s)
            warpgroup.commit_group()
