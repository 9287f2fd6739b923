"""The split-KV merge shared by the decode kernels: a mixin of the kernel classes.

num_splits > 1 CTAs of a (token, KV head) each leave a normalized partial O and its log2-LSE;
`merge_kernel` (a second launch, partials in global memory) or `merge_cluster` (inside the
(1, 1, num_splits) thread-block cluster, partials in each CTA's shared memory) combine them.
The host class provides pdl, hkv, group, topk and (cluster merge) merge_off.
"""

# no `from __future__ import annotations`: @cute.kernel needs evaluated annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import ptx
from .common import HEAD_DIM, LN2


class SplitMergeMixin:
    @cute.kernel
    def merge_kernel(self, mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, num_splits: Int32):
        """out[t, h*G+row, d] = sum_s w_s O_s / sum_s w_s with w_s = 2**(lse_s - max_s lse_s).

        One CTA per (t, h, row), one thread per dim.
        """
        d, _, _ = cute.arch.thread_idx()
        t, h, row = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # every split's partial is written
        idx0 = (t * self.hkv + h) * num_splits
        self.merge_row(mOut, mLse, t, h * self.group + row, d, num_splits,
                       lambda s: (mPL[idx0 + s, row], mPO[idx0 + s, row, d]))

    @cute.jit
    def merge_cluster(self, mOut, mLse, buf_addr, t, h, split, d, num_splits):
        """The split merge inside the (1, 1, num_splits) cluster of a (token t, KV head h).

        Split CTA `split` (its rank in the cluster) merges rows split, split + num_splits, ...
        of the group; thread d < 128 reads dim d of every split's partial O and the row's
        log2-LSE from that split's shared memory (epilogue), all loads in flight at once.
        """
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()  # every split's partial is in its shared memory
        part_base = buf_addr + self.merge_off
        lse_base = part_base + 16 * HEAD_DIM * 4
        if d < HEAD_DIM:
            for row in range(split, self.group, num_splits):
                self.merge_row(mOut, mLse, t, h * self.group + row, d, num_splits,
                               lambda s: (ptx.ld_dsmem_f32(lse_base + 4 * row, Int32(s)),
                                          ptx.ld_dsmem_f32(part_base + (row * HEAD_DIM + d) * 4, Int32(s))))
        # only execution order is needed here: every load above has been consumed
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()  # no CTA exits while another still reads its shared memory

    @cute.jit
    def merge_row(self, mOut, mLse, t, hq, d, num_splits, load):
        """out[t, hq, d] (bf16) and, for d == 0, lse[t, hq] (natural log) from the splits'
        (log2-LSE, normalized partial) = load(s), s < num_splits; the loop is unrolled to topk
        with predicated loads, so all of them are in flight at once."""
        lse = cute.make_rmem_tensor(self.topk, Float32)
        part = cute.make_rmem_tensor(self.topk, Float32)
        for s in cutlass.range_constexpr(self.topk):
            lse[s] = -Float32.inf
            part[s] = Float32(0.0)
            if s < num_splits:
                ls, ps = load(s)
                lse[s] = ls
                part[s] = ps
        m_all = -Float32.inf
        for s in cutlass.range_constexpr(self.topk):
            m_all = cute.arch.fmax(m_all, lse[s])
        num = Float32(0.0)
        den = Float32(0.0)
        if m_all != -Float32.inf:
            for s in cutlass.range_constexpr(self.topk):
                w = ptx.ex2(lse[s] - m_all)
                num = num + w * part[s]
                den = den + w
        out = Float32(0.0)
        lse_nat = -Float32.inf
        if den > Float32(0.0):
            out = num / den
            lse_nat = (m_all + ptx.lg2(den)) * LN2
        mOut[t, hq, d] = out.to(cutlass.BFloat16)
        if d == 0:
            mLse[t, hq] = lse_nat
