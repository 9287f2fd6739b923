"""Split-KV merge: the second kernel of a decode launch when the top-k blocks were split.

With num_splits > 1 each decode CTA writes a normalized partial O `[rows, G, 128]` fp32 and
its log2-LSE `[rows, G]` (row = (t * Hkv + h) * num_splits + split); this kernel combines
them into the bf16 output and the natural-log LSE (FlashAttention-4's
`flash_fwd_combine.py` plays the same role there).
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import ptx
from .constants import HEAD_DIM, LN2


class SplitMergeKernel:
    """Static config in __init__, the launch in `launch` (called while the decode kernel's
    `__call__` is traced, so both kernels are one exported function), device code in kernel()."""

    def __init__(self, *, num_kv_heads: int, group_size: int, max_splits: int, pdl: bool, trigger: bool = True):
        self.hkv = num_kv_heads
        self.group = group_size
        # the split loop is unrolled to max_splits (= topk: a split holds at least one slot)
        self.max_splits = max_splits
        self.pdl = pdl
        self.trigger = pdl and trigger

    def launch(self, mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor,
               num_splits: Int32, num_tokens: Int32, stream) -> None:
        """One CTA per (token, KV head, group row), one thread per head dim."""
        self.kernel(mOut, mLse, mPO, mPL, num_splits).launch(
            grid=(num_tokens, self.hkv, self.group), block=(HEAD_DIM, 1, 1), stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, num_splits: Int32):
        """out[t, h*G+row, d] = sum_s w_s O_s / sum_s w_s with w_s = 2**(lse_s - max_s lse_s).

        One CTA per (t, h, row), one thread per dim; the split loop is unrolled to max_splits
        with predicated loads so all of them are in flight at once.
        """
        d, _, _ = cute.arch.thread_idx()
        t, h, row = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # every split's partial is written
        if cutlass.const_expr(self.trigger):
            # the next kernel (the next layer's decode) may be scheduled now: it waits for this
            # grid before its first global access, and the decode grid is done, so its CTAs only
            # take slots this small grid leaves free while their launch latency overlaps the merge
            cute.arch.griddepcontrol_launch_dependents()
        idx0 = (t * self.hkv + h) * num_splits
        out, lse_nat = combine_splits(self.max_splits, num_splits, lambda s: mPL[idx0 + s, row],
                                      lambda s: mPO[idx0 + s, row, d])
        mOut[t, h * self.group + row, d] = out.to(cutlass.BFloat16)
        if d == 0:
            mLse[t, h * self.group + row] = lse_nat


@cute.jit
def combine_splits(n: cutlass.Constexpr, num_splits: Int32, lse_of, part_of):
    """(out, natural-log LSE) of one output element from the first num_splits of n splits, split s
    giving its log2-LSE lse_of(s) and normalized partial part_of(s) (loads, all issued before any
    math): sum_s w_s part_s / sum_s w_s with w_s = 2**(lse_s - max lse); (0, -inf) when no split
    saw a key. num_splits: a device Int32 (each of the n slots predicated on it), or the python int n
    (no predicate: the caller traced the merge for that split count)."""
    lse = cute.make_rmem_tensor(n, Float32)
    part = cute.make_rmem_tensor(n, Float32)
    for s in cutlass.range_constexpr(n):
        lse[s] = -Float32.inf
        part[s] = Float32(0.0)
        if s < num_splits:
            lse[s] = lse_of(s)
            part[s] = part_of(s)
    m_all = -Float32.inf
    for s in cutlass.range_constexpr(n):
        m_all = cute.arch.fmax(m_all, lse[s])
    num = Float32(0.0)
    den = Float32(0.0)
    if m_all != -Float32.inf:
        for s in cutlass.range_constexpr(n):
            w = ptx.ex2(lse[s] - m_all)
            num = num + w * part[s]
            den = den + w
    out = Float32(0.0)
    lse_nat = -Float32.inf
    if den > Float32(0.0):  # den >= 1 (the largest split's weight is 1): never a denormal
        out = num * ptx.rcp(den)
        lse_nat = (m_all + ptx.lg2(den)) * LN2
    return out, lse_nat
