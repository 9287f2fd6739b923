"""Block-stealing variant of the portable decode kernel (its num_splits == 1 launches).

At one wave every CTA streams its own (token, KV head) item and the HBM rate each CTA gets
varies, so the last CTA ends ~4 us after the median one (docs/performance.md, "Per-CTA
timelines"). Here an item's blocks are claimed one at a time from a per-item counter in the
plan's workspace (the owner claims `stages` at once first, then one per copy, the claim's
latency hidden behind the wait for a free stage). A CTA whose own item is done takes one of
the last <= STEAL_TAIL unclaimed blocks of another item, computes a partial (O, lse) for it
and publishes it; whoever completes an item's last block merges the item's partials. An
owner that kept all its blocks writes its output directly, as the parent kernel does.
num_splits > 1 launches run the parent kernel's code.

Workspace (int32 words; msa_jit.planner.steal_workspace_words has the same layout), N items:
  [0] launch sequence number, [1] CTAs finished in this launch (the last one resets [1], [2]
      and bumps [0]), [2] owners started (no stealing while an item waits for its CTA);
  [4 + 4 (p N + i) ..] counter set p of item i: claim, done (blocks | slot bits << 16),
      published n + 1 (0: not yet); launch L uses set L & 1 and its owners zero set 1 - L & 1
      for launch L + 1;
  [4 + 8 N + 36 i ..] item i's compacted pages [16], logical blocks [16], kv_len;
  [4 + 44 N + SLOT_WORDS (SLOTS i + s) ..] partial slot s of item i (0: the owner; 1..4: the
      thieves of the last 4 blocks), O [16][128] fp32 then log2-LSE [16].
"""

# no `from __future__ import annotations`: cute.struct in storage_type() needs evaluated annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import common, ptx
from .common import HEAD_DIM, LN2
from .sparse_decode_mma import SparseDecodeMmaKernel

STEAL_TAIL = 4  # a thief takes only one of an item's last 4 blocks (so 4 thief slots suffice)
SLOTS = 1 + STEAL_TAIL
SLOT_WORDS = 16 * HEAD_DIM + 16
SCAN = 8  # items each lane of the producer warp looks at per victim search (256 per warp)
TRIES = 4  # victim searches whose claim lost the race before a CTA gives up
# words of the shared `sched` array (0 .. stages-1: the block index in each stage, -1 = end)
S_SEQ, S_MASK, S_VICTIM, S_J, S_NV = 8, 9, 10, 11, 12


class SparseDecodeStealKernel(SparseDecodeMmaKernel):
    """The portable kernel plus block stealing between CTAs (see the module docstring)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.topk > 16 or self.stages > 8:
            raise ValueError("block stealing needs topk <= 16 and stages <= 8")
        if not self.v4_stores or self.probe != "full" or self.q_smem:
            raise ValueError("block stealing needs out_stores='v4', probe='full' and q_frags='regs'")

    # ---- workspace addresses (bytes)
    @staticmethod
    def counters(ws, n_items, p, i):
        return ws + Int64(4 + (p * n_items + i) * 4) * 4

    @staticmethod
    def published(ws, n_items, i):
        return ws + Int64(4 + 8 * n_items + 36 * i) * 4

    @staticmethod
    def slot_addr(ws, n_items, i, s):
        return ws + (Int64(4 + 44 * n_items) + Int64(SLOTS * i + s) * SLOT_WORDS) * 4

    @cute.jit
    def cta(self, mQ, mKV, mTopk, mBT, mKvLens, mOut, mLse, mPO, mPL, mWS, qlen, num_splits, qk_scale_log2, v_scale,
            storage, t, h, split, tidx, warp, lane, tr):
        if num_splits > 1:
            SparseDecodeMmaKernel.cta(self, mQ, mKV, mTopk, mBT, mKvLens, mOut, mLse, mPO, mPL, mWS, qlen, num_splits,
                                      qk_scale_log2, v_scale, storage, t, h, split, tidx, warp, lane, tr)
        else:
            self.steal_cta(mQ, mKV, mTopk, mBT, mKvLens, mOut, mLse, mPO, mPL, mWS, qlen, qk_scale_log2, v_scale,
                           storage, t, h, tidx, warp, lane)

    @cute.jit
    def steal_cta(self, mQ, mKV, mTopk, mBT, mKvLens, mOut, mLse, mPO, mPL, mWS, qlen, qk_scale_log2, v_scale,
                  storage, t, h, tidx, warp, lane):
        buf_addr, full_ptr, empty_ptr, sPages, sBlocks, sNvalid, sML = self.smem_views(storage)
        sS = storage.sched.get_tensor(cute.make_layout(16))
        n_items = mQ.shape[0] * self.hkv
        item = t * self.hkv + h
        ws = mWS.iterator.toint()
        kv_base = mKV.iterator.toint()
        kv_len = mKvLens[t]
        g = lane // 4
        c = lane % 4
        scale = Float32(1.0) if self.lean else qk_scale_log2 * self.s_fold

        # ---- 1. compact this item's slots (warp 0), publish them for thieves
        if warp == 0:
            ballot = common.compact_valid_slots(
                mTopk, mBT, t, h, t // qlen, kv_len, mKV.shape[0], lane, sPages, sBlocks, self.topk, self.page,
            )
            n = cute.arch.popc(ballot)
            seq = Int32(0)
            if lane == 0:
                seq = ptx.ld_global_cg_b32(ws)
                sS[S_SEQ] = seq
                sNvalid[0] = n
                zero = Int32(0)
                ptx.st_global_v4(self.counters(ws, n_items, 1 - (seq & 1), item), zero, zero, zero, zero)
            seq = cute.arch.shuffle_sync(seq, 0)
            cute.arch.sync_warp()
            pub = self.published(ws, n_items, item)
            if lane < n:
                ptx.st_global_b32(pub + 4 * lane, sPages[lane])
                ptx.st_global_b32(pub + 64 + 4 * lane, sBlocks[lane])
            if lane == 0:
                ptx.st_global_b32(pub + 128, kv_len)
            cute.arch.sync_warp()
            if lane == 0:
                ptx.fence_acq_rel_gpu()  # the lists before the count that announces them
                ptx.st_global_b32(self.counters(ws, n_items, seq & 1, item) + 8, n + 1)
                ptx.atom_add_u32(ws + 8, Int32(1))  # items started: nobody steals before all have
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        n = sNvalid[0]
        seq = sS[S_SEQ]
        p = seq & 1
        qa = cute.make_rmem_tensor(32, Int32)
        acc = cute.make_rmem_tensor(64, Float32)
        row_max = cute.make_rmem_tensor(2, Float32)
        row_sum = cute.make_rmem_tensor(2, Float32)
        pos = Int32(0)  # stage uses so far: the same count in the producer thread and the consumers

        # ---- 2. the own item, its blocks claimed one by one
        if warp == self.warps:
            if lane == 0:
                pos = self.produce_own(kv_base, sPages, sS, h, n, self.counters(ws, n_items, p, item),
                                       buf_addr, full_ptr, empty_ptr)
        else:
            self.load_q(mQ, qa, t, h, g, c, qk_scale_log2)
            self.reset_state(acc, row_max, row_sum)
            k = self.consume_own(qa, acc, row_max, row_sum, sS, sBlocks, buf_addr, full_ptr, empty_ptr, kv_len, scale,
                                 warp, lane)
            pos = k + 1
            slot = Int64(0)  # all blocks kept: the output directly
            if k != n:
                slot = self.slot_addr(ws, n_items, item, 0)
            self.epilogue(mOut, mLse, mPO, mPL, sML, buf_addr, acc, row_max, row_sum,
                          t, h, 0, warp, lane, Int32(1), v_scale, slot=slot)
            if k != n:
                self.publish(mOut, mLse, ws, n_items, p, item, t, h, n, k, 0, sS, warp, lane)

        # ---- 3. steal single blocks from the tails of other items until none is left
        go = Int32(1)
        while go != 0:
            cute.arch.sync_threads()  # the stages / reduction buffer are free again
            if warp == self.warps:
                self.find_victim(ws, n_items, p, item, lane, sS)
            cute.arch.sync_threads()
            v = sS[S_VICTIM]
            if v < 0:
                go = Int32(0)
            else:
                j = sS[S_J]
                n_v = sS[S_NV]
                pub_v = self.published(ws, n_items, v)
                t_v = v // self.hkv
                h_v = v - t_v * self.hkv
                s = pos % self.stages
                if warp == self.warps:
                    if lane == 0:
                        cute.arch.mbarrier_wait(empty_ptr + s, ((pos // self.stages) & 1) ^ 1)
                        page = ptx.ld_global_cg_b32(pub_v + 4 * j)
                        common.copy_chunk(kv_base, page, h_v, s, buf_addr, full_ptr, self.stage_bytes, self.hkv)
                else:
                    kv_len_v = ptx.ld_global_cg_b32(pub_v + 128)
                    blk = ptx.ld_global_cg_b32(pub_v + 64 + 4 * j)
                    self.load_q(mQ, qa, t_v, h_v, g, c, qk_scale_log2)
                    self.reset_state(acc, row_max, row_sum)
                    cute.arch.mbarrier_wait(full_ptr + s, (pos // self.stages) & 1)
                    self.consume_block(qa, 0, acc, row_max, row_sum, buf_addr + s * self.stage_bytes, empty_ptr + s,
                                       blk, kv_len_v, scale, warp * self.keys_per_warp, g, c, lane)
                    slot_id = 1 + j - (n_v - STEAL_TAIL)
                    self.epilogue(mOut, mLse, mPO, mPL, sML, buf_addr, acc, row_max, row_sum,
                                  t_v, h_v, 0, warp, lane, Int32(1), v_scale, slot=self.slot_addr(ws, n_items, v, slot_id))
                    self.publish(mOut, mLse, ws, n_items, p, v, t_v, h_v, n_v, Int32(1), slot_id, sS, warp, lane)
                pos = pos + 1

        # ---- 4. the last CTA of the launch moves the next launch to the other counter set
        if tidx == 0:
            ptx.fence_acq_rel_gpu()
            if ptx.atom_add_u32(ws + 4, Int32(1)) == n_items - 1:
                ptx.st_global_b32(ws + 4, Int32(0))
                ptx.st_global_b32(ws + 8, Int32(0))
                ptx.st_global_b32(ws, seq + 1)

    @cute.jit
    def reset_state(self, acc, row_max, row_sum):
        for i in cutlass.range_constexpr(64):
            acc[i] = Float32(0.0)
        for r in cutlass.range_constexpr(2):
            row_max[r] = -Float32.inf
            row_sum[r] = Float32(0.0)

    @cute.jit
    def produce_own(self, kv_base, sPages, sS, h, n, cnt, buf_addr, full_ptr, empty_ptr):
        """Producer thread: claim the item's blocks (`stages` at once, then one per copy) and copy
        each into the ring; a claim past n ends the stream (-1 in the stage's sched word).
        Returns the stage uses (copies + the end marker)."""
        lo = ptx.atom_add_u32(cnt, Int32(self.stages))
        hi = lo + self.stages
        i = Int32(0)
        go = Int32(1)
        while go != 0:
            if lo >= hi:  # issued before the wait for a free stage, which hides its latency
                lo = ptx.atom_add_u32(cnt, Int32(1))
                hi = lo + 1
            j = lo
            lo = lo + 1
            s = i % self.stages
            cute.arch.mbarrier_wait(empty_ptr + s, ((i // self.stages) & 1) ^ 1)
            if j >= n:
                sS[s] = Int32(-1)
                cute.arch.mbarrier_arrive(full_ptr + s)
                go = Int32(0)
            else:
                sS[s] = j
                common.copy_chunk(kv_base, sPages[j], h, s, buf_addr, full_ptr, self.stage_bytes, self.hkv)
            i = i + 1
        return i

    @cute.jit
    def consume_own(self, qa, acc, row_max, row_sum, sS, sBlocks, buf_addr, full_ptr, empty_ptr, kv_len, scale,
                    warp, lane):
        """Consumer warp: the blocks the producer copies, until its end marker. Returns their count."""
        i = Int32(0)
        k = Int32(0)
        go = Int32(1)
        while go != 0:
            s = i % self.stages
            cute.arch.mbarrier_wait(full_ptr + s, (i // self.stages) & 1)
            j = sS[s]
            if j < 0:
                self.release_stage(empty_ptr + s, lane)
                go = Int32(0)
            else:
                self.consume_block(qa, 0, acc, row_max, row_sum, buf_addr + s * self.stage_bytes, empty_ptr + s,
                                   sBlocks[j], kv_len, scale, warp * self.keys_per_warp, lane // 4, lane % 4, lane)
                k = k + 1
            i = i + 1
        return k

    @cute.jit
    def publish(self, mOut, mLse, ws, n_items, p, v, t_v, h_v, n_v, k, slot_id, sS, warp, lane):
        """Consumers, after writing a partial of item v (k blocks) to slot slot_id: count it in v's
        done word; the CTA that completes v's last block merges v's partials into its output."""
        tid = warp * 32 + lane
        cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)  # every partial store issued
        if tid == 0:
            ptx.fence_acq_rel_gpu()  # the partial before the count (release)
            old = ptx.atom_add_u32(self.counters(ws, n_items, p, v) + 4, k | (Int32(1) << (16 + slot_id)))
            mask = Int32(0)
            if (old & 0xFFFF) + k == n_v:
                ptx.fence_acq_rel_gpu()  # the others' partials after the count (acquire)
                mask = (old >> 16) | (Int32(1) << slot_id)
            sS[S_MASK] = mask
        cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
        mask = sS[S_MASK]
        if mask != 0:
            self.merge_slots(mOut, mLse, ws, n_items, v, t_v, h_v, mask, tid)

    @cute.jit
    def merge_slots(self, mOut, mLse, ws, n_items, v, t_v, h_v, mask, tid):
        """Item v's output from its partial slots in `mask` (consumer threads, 16 values each)."""
        per_row = HEAD_DIM // self.out_elems
        row = tid // per_row
        d0 = (tid % per_row) * self.out_elems
        if row < self.group:
            base = self.slot_addr(ws, n_items, v, 0)
            lse = cute.make_rmem_tensor(SLOTS, Float32)
            m_all = -Float32.inf
            for s in cutlass.range_constexpr(SLOTS):
                lse[s] = -Float32.inf
                if (mask >> s) & 1 != 0:
                    lse[s] = ptx.ld_global_cg_f32(base + Int64(s * SLOT_WORDS + 16 * HEAD_DIM + row) * 4)
                m_all = cute.arch.fmax(m_all, lse[s])
            vals = cute.make_rmem_tensor(self.out_elems, Float32)
            for e in cutlass.range_constexpr(self.out_elems):
                vals[e] = Float32(0.0)
            den = Float32(0.0)
            if m_all != -Float32.inf:
                for s in cutlass.range_constexpr(SLOTS):
                    if (mask >> s) & 1 != 0:
                        w = ptx.ex2(lse[s] - m_all)
                        den = den + w
                        for q in cutlass.range_constexpr(self.out_elems // 4):
                            f = ptx.ld_global_cg_v4_f32(base + Int64(s * SLOT_WORDS + row * HEAD_DIM + d0 + 4 * q) * 4)
                            for e in cutlass.range_constexpr(4):
                                vals[4 * q + e] = vals[4 * q + e] + w * f[e]
            inv = Float32(0.0)
            lse_nat = -Float32.inf
            if den > Float32(0.0):
                inv = Float32(1.0) / den
                lse_nat = (m_all + ptx.lg2(den)) * LN2
            hq = h_v * self.group + row
            dst = mOut.iterator.toint() + (Int64(t_v) * Int64(mOut.stride[0]) + Int64(hq * HEAD_DIM + d0)) * 2
            for q in cutlass.range_constexpr(self.out_elems // 8):
                wd = [ptx.f32x2_to_bf16x2(vals[8 * q + 2 * e] * inv, vals[8 * q + 2 * e + 1] * inv) for e in range(4)]
                ptx.st_global_v4(dst + 16 * q, wd[0], wd[1], wd[2], wd[3])
            if d0 == 0:
                mLse[t_v, hq] = lse_nat

    @cute.jit
    def find_victim(self, ws, n_items, p, item, lane, sS):
        """Producer warp: claim one of the last STEAL_TAIL unclaimed blocks of the published item
        with the most of them among 256 looked at; lane 0 writes (victim, block, n) or victim -1."""
        v_res = Int32(-1)
        j_res = Int32(0)
        n_res = Int32(0)
        tries = Int32(0)
        go = Int32(1)
        if ptx.ld_global_cg_b32(ws + 8) < n_items:  # an item not started yet: leave this SM to its owner
            go = Int32(0)
        while go != 0:
            best = Int32(0)
            best_v = Int32(-1)
            best_n = Int32(0)
            start = item * 97 + tries * (32 * SCAN) + lane
            for u in cutlass.range_constexpr(SCAN):
                cand = (start + 32 * u) % n_items
                w = ptx.ld_global_cg_v4(self.counters(ws, n_items, p, cand))
                rem = w[2] - 1 - w[0]
                if w[2] > 0 and rem >= 1 and rem <= STEAL_TAIL and rem > best:
                    best = rem
                    best_v = cand
                    best_n = w[2] - 1
            key = best * 32 + lane
            for off in cutlass.range_constexpr(5):
                key = cutlass.max(key, cute.arch.shuffle_sync_bfly(key, 1 << off))
            if key < 32:  # nobody saw a block to take
                go = Int32(0)
            else:
                src = key % 32
                vv = cute.arch.shuffle_sync(best_v, src)
                nn = cute.arch.shuffle_sync(best_n, src)
                j = Int32(0)
                if lane == 0:
                    j = ptx.atom_add_u32(self.counters(ws, n_items, p, vv), Int32(1))
                j = cute.arch.shuffle_sync(j, 0)
                if j < nn:
                    v_res = vv
                    j_res = j
                    n_res = nn
                    go = Int32(0)
                else:
                    tries = tries + 1
                    if tries >= TRIES:
                        go = Int32(0)
        if lane == 0:
            if v_res >= 0:
                ptx.fence_acq_rel_gpu()  # the victim's published lists after its count (acquire)
            sS[S_VICTIM] = v_res
            sS[S_J] = j_res
            sS[S_NV] = n_res
