"""The fp8 cluster build's decode kernel: P V split by head dims, for the CTAs of one-wave split steps.

The planner merges a step's KV splits inside the decode launch (split_merge="cluster") where the split
grid is at most one CTA per SM: each CTA holds 1 block at T * Hkv <= 8 (16 splits) and 2-8 at larger
T * Hkv (docs/performance.md). At batch 1 a layer waits on one block's math and the
epilogue after its last byte, one warp per scheduler, and the 4-warp reduction of O (16 x 128 fp32 per
warp through shared memory) was 0.8 us of it (measured).
This kernel is the token kernel (msa_jit/kernels/token.py) with its consumers changed:

  * warp w still computes S for its 32 keys of the block;
  * the warps exchange their row maxima through shared memory (one CTA barrier), so every warp
    takes P against the same running max (and rescales O alike);
  * each warp writes its P A-fragments (f16, 2 x 16 B per lane), a second barrier, and
  * warp w computes the O columns 32w .. 32w + 31 over all 128 keys (8 k-steps x 4 n-tiles: the
    key split's 32 MMAs per warp), one V word per key row.

Each warp then holds final O columns: the epilogue exchanges only the row sums, and each lane
stores or pushes 2 rows x 8 dims. V rows are 256 bytes apart, so the 4 lanes that share an n-tile
column would read one bank in 4 rows; the stage is laid down as 4 groups of 32 rows (4 bulk
copies), each 32 bytes after the previous, and lane c of a P V k-step takes its 4 keys from group
c: 8 banks apart, no conflict. Measured (H100, same process): -0.03..-0.46 us per layer at the
16-split points against the key split (3-6% with a bf16 query), within +-1.4% at 2 splits; the key split
stays the NVFP4 cluster build's.
fp8 cache, page 128, the 2-CTA build's options (plain softmax, Q in registers, block reads).
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import ptx
from .constants import FP8_ROW_BYTES, HEAD_DIM, LN2
from .token import SparseDecodeTokenKernel

GROUP_ROWS = 32  # rows per bulk copy of a block
GROUP_PAD = 32  # bytes between two groups: the next group's banks are 8 further on
P_BYTES = 4 * 2 * 32 * 16  # warps x 16-key sub-tiles x lanes x one 16-byte A fragment


class SparseDecodeTokenDimsKernel(SparseDecodeTokenKernel):
    """Static config in __init__, the launch and kernel() as the portable kernel; consume_block and
    epilogue are this kernel's own."""

    def __init__(self, **options):
        # 2 stages: 3 fit at 2 CTAs per SM (112.7 KB) but were no faster at any split count (measured)
        options.setdefault("stages", 2)
        super().__init__(**options)
        if self.nvfp4 or self.q_smem or self.staged or self.lean or self.warps != 4 or self.page != 4 * GROUP_ROWS:
            raise ValueError("the dims split is built for the fp8 cache, page 128 and the 2-CTA build's options")
        self.set_stage_layout(GROUP_ROWS, GROUP_PAD)

    def set_stage_layout(self, group_rows: int, pad: int):
        """A stage as page // group_rows bulk copies of group_rows rows, each `pad` bytes after the previous."""
        self.group_rows = group_rows
        self.group_stride = group_rows * FP8_ROW_BYTES + pad
        self.stage_stride = self.page // group_rows * self.group_stride  # shared bytes of a stage (stage_bytes copied)
        self.p_offset = self.stages * self.stage_stride
        self.buf_bytes = self.p_offset + P_BYTES

    # ------------------------------------------------------------------ layout
    def key_of(self, wp, sub, c, i):
        """The block row at P position (sub-tile sub, lane column c, i = 2j + e) of warp wp's keys: b0 of a
        P V k-step pairs i = 0, 1 and b1 pairs i = 2, 3. Lane c's keys lie in group c."""
        return GROUP_ROWS * c + 8 * wp + 4 * sub + i

    @cute.jit
    def row_addr(self, stage, key):
        """Shared address of block row `key` of the stage."""
        return stage + (key // self.group_rows) * self.group_stride + (key % self.group_rows) * FP8_ROW_BYTES

    # ------------------------------------------------------------------ producer
    @cute.jit
    def produce(self, mKV, sPages, h, first, n_iter, buf_addr, full_ptr, empty_ptr):
        """Producer (one thread): each selected block as 4 bulk copies of 32 rows into the padded stage."""
        kv_base = mKV.iterator.toint()
        group_bytes = self.group_rows * FP8_ROW_BYTES
        for i in range(n_iter):
            s = i % self.stages
            cute.arch.mbarrier_wait(empty_ptr + s, ((i // self.stages) & 1) ^ 1)
            cute.arch.mbarrier_arrive_and_expect_tx(full_ptr + s, self.stage_bytes)
            src = kv_base + (Int64(sPages[first + i]) * self.hkv + Int64(h)) * self.stage_bytes
            dst = buf_addr + s * self.stage_stride
            for q in cutlass.range_constexpr(self.page // self.group_rows):
                ptx.bulk_copy_g2s(dst + q * self.group_stride, src + q * group_bytes, group_bytes,
                                  ptx.smem_addr(full_ptr + s))

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(
        self, mQ, mOut, mLse, mPO, mPL, sBlocks, sML, buf_addr, q_addr, recv, full_ptr, empty_ptr,
        t, h, split, warp, lane, kv_len, first, n_iter, num_splits, qk_scale_log2, v_scale,
    ):
        g = lane // 4
        c = lane % 4
        qa = cute.make_rmem_tensor(32, Int32)
        self.load_q(mQ, qa, t, h, g, c, qk_scale_log2)
        acc = cute.make_rmem_tensor(16, Float32)  # 4 n-tiles (dims 32 warp + 4 g' + j) x 4
        for i in cutlass.range_constexpr(16):
            acc[i] = Float32(0.0)
        row_max = cute.make_rmem_tensor(2, Float32)  # the CTA's, in log2 units
        row_sum = cute.make_rmem_tensor(2, Float32)  # over this warp's keys, against row_max
        for r in cutlass.range_constexpr(2):
            row_max[r] = -Float32.inf
            row_sum[r] = Float32(0.0)
        p_addr = buf_addr + self.p_offset
        for i in range(n_iter):
            s = i % self.stages
            cute.arch.mbarrier_wait(full_ptr + s, (i // self.stages) & 1)
            self.consume_block(qa, acc, row_max, row_sum, buf_addr + s * self.stage_stride, empty_ptr + s,
                               sBlocks[first + i], kv_len, qk_scale_log2, sML, p_addr, warp, g, c, lane)
        self.epilogue(mOut, mLse, mPO, mPL, sML, recv, acc, row_max, row_sum, t, h, split, warp, lane,
                      num_splits, v_scale)

    @cute.jit
    def consume_block(self, qa, acc, row_max, row_sum, stage, empty_bar, blk, kv_len, scale, sML, p_addr,
                      warp, g, c, lane):
        """S for this warp's 32 keys, the CTA's row max, P through shared memory, then O[:, 32 warp ..] += P V."""
        # S n-tile n, column g' (lane column g' // 2, e = g' % 2) is key_of(warp, n // 2, g' // 2, 2 (n % 2) + e)
        k_keys = [self.key_of(warp, n // 2, g // 2, 2 * (n % 2) + g % 2) for n in range(4)]
        kw = [[ptx.ld_shared_v4(self.row_addr(stage, k_keys[n]) + 16 * c + 64 * kh) for n in range(4)]
              for kh in range(2)]
        # V of every warp's keys at this warp's dims 32 warp + 4g .. + 3: one word per row
        vcol = HEAD_DIM + 32 * warp + 4 * g
        vw = [[[ptx.ld_shared_b32(self.row_addr(stage, self.key_of(wp, sub, c, i)) + vcol) for i in range(4)]
               for sub in range(2)] for wp in range(4)]
        self.release_stage(empty_bar, lane)

        # ---- S = Q K^T: 4 independent accumulation chains of 8 k-steps (the portable kernel's)
        sv = cute.make_rmem_tensor(16, Float32)
        d = [[Float32(0.0)] * 4 for _ in range(4)]
        for kh in cutlass.range_constexpr(2):
            for kp in cutlass.range_constexpr(2):
                bk = [self.fp8x4_to_f16x2x2(kw[kh][n][2 * kp]) + self.fp8x4_to_f16x2x2(kw[kh][n][2 * kp + 1])
                      for n in range(4)]
                for kq in cutlass.range_constexpr(2):
                    ks = 4 * kh + 2 * kp + kq
                    for n in cutlass.range_constexpr(4):
                        d[n] = ptx.mma_f16_16816(qa[4 * ks], qa[4 * ks + 1], qa[4 * ks + 2], qa[4 * ks + 3],
                                                 bk[n][2 * kq], bk[n][2 * kq + 1], *d[n])
        for n in cutlass.range_constexpr(4):
            for e in cutlass.range_constexpr(4):
                sv[4 * n + e] = d[n][e]

        # ---- the block's row max over every warp's keys (rows g and g + 8), then P against it
        if (blk + 1) * self.page > kv_len:
            for r in cutlass.range_constexpr(2):
                for n in cutlass.range_constexpr(4):
                    for e in cutlass.range_constexpr(2):
                        if blk * self.page + self.key_of(warp, n // 2, c, 2 * (n % 2) + e) >= kv_len:
                            sv[4 * n + 2 * r + e] = -Float32.inf
        for r in cutlass.range_constexpr(2):
            mx = -Float32.inf
            for n in cutlass.range_constexpr(4):
                for e in cutlass.range_constexpr(2):
                    mx = cute.arch.fmax(mx, sv[4 * n + 2 * r + e])
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 2))
            if c == 0:
                sML[warp * 32 + g + 8 * r] = mx
        cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
        alpha = cute.make_rmem_tensor(2, Float32)
        for r in cutlass.range_constexpr(2):
            mx = sML[g + 8 * r]
            for wp in cutlass.range_constexpr(1, 4):
                mx = cute.arch.fmax(mx, sML[wp * 32 + g + 8 * r])
            m_new = cute.arch.fmax(row_max[r], mx * scale)
            m_use = m_new
            if m_new == -Float32.inf:  # every key so far masked: P = ex2(-inf) = 0
                m_use = Float32(0.0)
            alpha[r] = ptx.ex2(row_max[r] - m_use)
            row_max[r] = m_new
            row_sum[r] = row_sum[r] * alpha[r] + self.exp_rows(sv, r, m_use, scale, 4)
        for j in cutlass.range_constexpr(4):
            for k in cutlass.range_constexpr(4):
                acc[4 * j + k] = acc[4 * j + k] * alpha[k // 2]

        # ---- this warp's P as A fragments (sub-tile sub: the n-tiles 2 sub, 2 sub + 1); all visible after the barrier
        for sub in cutlass.range_constexpr(2):
            p0 = 8 * sub
            ptx.st_shared_v4(p_addr + ((warp * 2 + sub) * 32 + lane) * 16,
                             ptx.f32x2_to_f16x2(sv[p0], sv[p0 + 1]), ptx.f32x2_to_f16x2(sv[p0 + 2], sv[p0 + 3]),
                             ptx.f32x2_to_f16x2(sv[p0 + 4], sv[p0 + 5]), ptx.f32x2_to_f16x2(sv[p0 + 6], sv[p0 + 7]))
        cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)

        # ---- O[:, 32 warp ..] += P V over all 128 keys: n-tile j, column g' = dim 32 warp + 4 g' + j
        for wp in cutlass.range_constexpr(4):
            for sub in cutlass.range_constexpr(2):
                a = ptx.ld_shared_v4(p_addr + ((wp * 2 + sub) * 32 + lane) * 16)
                v0, v1, v2, v3 = vw[wp][sub]
                for j in cutlass.range_constexpr(4):
                    dd = ptx.mma_f16_16816(a[0], a[1], a[2], a[3],
                                           self.fp8_bytes_to_f16x2(v0, v1, j), self.fp8_bytes_to_f16x2(v2, v3, j),
                                           acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3])
                    for k in cutlass.range_constexpr(4):
                        acc[4 * j + k] = dd[k]

    @cute.jit
    def epilogue(self, mOut, mLse, mPO, mPL, sML, recv, acc, row_max, row_sum, t, h, split, warp, lane,
                 num_splits, v_scale):
        """The row sums' exchange, then each lane's rows g, g + 8 at dims 32 warp + 8c .. + 7 (acc[4j + 2r + e]:
        row g + 8r, dim 32 warp + 8c + 4e + j) stored, written as a partial, or pushed to the merging CTA."""
        G = self.group
        g = lane // 4
        c = lane % 4
        for r in cutlass.range_constexpr(2):
            tot = row_sum[r]
            tot = tot + cute.arch.shuffle_sync_bfly(tot, 1)
            tot = tot + cute.arch.shuffle_sync_bfly(tot, 2)
            if c == 0:
                sML[warp * 32 + 16 + g + 8 * r] = tot
        cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
        if cutlass.const_expr(self.cluster_merge is not None):
            self.cluster_merge.wait(num_splits)
        d0 = 32 * warp + 8 * c
        for r in cutlass.range_constexpr(2):
            row = g + 8 * r
            if row < G:
                l_all = sML[16 + row]
                for wp in cutlass.range_constexpr(1, self.warps):
                    l_all = l_all + sML[wp * 32 + 16 + row]
                inv = Float32(0.0)
                lse2 = -Float32.inf
                if l_all > Float32(0.0):
                    inv = v_scale / l_all
                    lse2 = row_max[r] + ptx.lg2(l_all)
                vals = cute.make_rmem_tensor(8, Float32)
                for e in cutlass.range_constexpr(2):
                    for j in cutlass.range_constexpr(4):
                        vals[4 * e + j] = acc[4 * j + 2 * r + e] * inv
                if num_splits == 1:  # 8 bf16 in one 16-byte store
                    hq = h * G + row
                    dst = mOut.iterator.toint() + (Int64(t) * Int64(mOut.stride[0]) + Int64(hq * HEAD_DIM + d0)) * 2
                    ptx.st_global_v4(dst, ptx.f32x2_to_bf16x2(vals[0], vals[1]), ptx.f32x2_to_bf16x2(vals[2], vals[3]),
                                     ptx.f32x2_to_bf16x2(vals[4], vals[5]), ptx.f32x2_to_bf16x2(vals[6], vals[7]))
                    if d0 == 0:
                        mLse[t, hq] = lse2 * LN2
                elif cutlass.const_expr(self.cluster_merge is None):
                    self.store_partial(mPO, mPL, vals, lse2, t, h, split, row, d0, num_splits, 8)
                elif self.cluster_merge.in_cluster():
                    self.cluster_merge.push(recv, split, num_splits, row, d0, vals, lse2, 8)
                else:
                    self.store_partial(mPO, mPL, vals, lse2, t, h, split, row, d0, num_splits, 8)
        if cutlass.const_expr(self.cluster_merge is not None):
            self.cluster_merge.merge(mOut, mLse, recv, t, h * G, split, num_splits, warp * 32 + lane)
