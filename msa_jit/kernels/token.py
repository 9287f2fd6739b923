"""Portable MSA sparse decode kernel: warp-level `mma.sync` + 1-D bulk copies (SM90 and later).

"Portable" = no arch-specific MMA (no wgmma / tcgen05): the same source compiles for sm_90a
and sm_100a (the Blackwell default). The KV stream uses `cp.async.bulk` + mbarriers, SM90+.

One CTA serves one (token t, KV head h, split): the whole GQA group of h (G <= 16 query
heads) sits on the MMA M dimension, so every K/V byte is read from HBM once per (t, h).

Data path per selected block (one page of one KV head = one contiguous chunk of
page_size * 256 bytes, K in bytes [0,128) and V in [128,256) of every token row):
  * a producer warp bulk-copies the chunk into a shared-memory stage (`cp.async.bulk`,
    completion on an mbarrier), STAGES chunks in flight;
  * consumer warp w owns keys [32w, 32w+32) of every block and keeps its own online
    softmax; S = Q K^T and O += P V run on m16n8k16 f16 MMAs with fp32 accumulators;
  * fp8 K/V become f16 exactly with one `cvt.rn.f16x2.e4m3x2` per pair; the reduction
    indices (head_dim for S, keys for O) are permuted so that no transpose is needed; K is
    read with 16-byte shared loads, V with bank-conflict-free rotated 32-bit loads (see
    ld_v_rotated);
  * at the end the warps' partial (m, l, O) are merged through shared memory; with
    num_splits > 1 the CTA writes a normalized partial O and its log2-LSE, and the split
    merge (msa_jit/kernels/split_merge.py) combines them in the same launch sequence, or (option
    split_merge="cluster") pushes them to the CTA of its cluster that merges them (cluster_merge.py).

Timing probes and retired variants (the fp8 bit trick, 16-byte V loads, scalar stores, the
block-table prefetch, no-math / no-copy / trace builds) are not here: every source of this
package is in every cache key, and instrumentation would make the shipped artifact another one.
"""

# no `from __future__ import annotations`: cute.struct in storage_type() needs evaluated annotations


import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import common, ptx
from .base import SparseDecodeKernelBase
from .cluster_merge import RECV_BYTES, ClusterMerge
from .constants import FP8_ROW_BYTES, HEAD_DIM, KV_DTYPES, LN2, NVFP4_CODE_BYTES, NVFP4_ROW_BYTES
from .convention import KernelArguments

Q_FRAG_BYTES = 8 * 32 * 16  # 8 k-steps x 32 lanes x one 16-byte A fragment
LAZY_RESCALE = 8.0  # log2 units: P stays <= 256 between rescales
# NVFP4 slot: page * 64 bytes of e2m1 codes (token n's 128 values at [64n, 64n + 64)), then
# page * 8 e4m3 block scales (K: row-major, (n, g) at 8n + g; V: the writer's swizzle, (n, g)
# at row (n // 4) * 4 + g // 2, column (g % 2) * 4 + n % 4)
NVFP4_FOLD = 2.0**14  # K and V leave ptx.e2m1x8_to_f16x2x4 (times their block scale) as value * 2**-14
# Cross-warp reduction buffer: per warp 16 rows x 4 chunks of (32 fp32 + 4 pad); the
# 144-byte chunk and 576-byte row keep the 16-byte stores and loads bank-conflict free.
RED_CHUNK = 144
RED_ROW = 4 * RED_CHUNK
RED_WARP = 16 * RED_ROW


def _phys_key(logical: int) -> int:
    """Key order inside a warp's 16 keys that makes P's MMA layout match 4 adjacent keys."""
    if logical < 8:
        return 4 * (logical // 2) + logical % 2
    return 4 * ((logical - 8) // 2) + 2 + logical % 2


class SparseDecodeTokenKernel(SparseDecodeKernelBase):
    """Static config in __init__, the launch in SparseDecodeKernelBase.__call__, device code in kernel()."""

    # programmatic dependent launch: both kernels may be scheduled before the previous kernel
    # in the stream has finished; each waits (griddepcontrol.wait) before its first
    # global-memory access, so only the launch latency overlaps, never data (H200: batch 1
    # -1.2 us, never slower)
    pdl = True

    @staticmethod
    def occupancy_options(ctas_per_sm: int, q_dtype: str, kv_dtype: str = "float8_e4m3fn") -> dict:
        """Constructor options of the build for `ctas_per_sm` CTAs per SM (SparseDecodeConfig.ctas_per_sm).

        3: Q fragments in shared memory, K / V read per sub-tile (128 registers), the lean
        softmax, and as many stages as fit: 2 of an fp8 page (32 KiB), 3 of an NVFP4 one (18 KiB)
        (measured on the H200: docs/performance.md, "Occupancy").
        """
        if ctas_per_sm == 2:
            return {}
        if ctas_per_sm == 3:
            return {"q_frags": "smem", "smem_reads": "staged", "ctas_per_sm": 3, "softmax": "lean",
                    "stages": 3 if kv_dtype == "nvfp4" else 2}
        raise ValueError(f"no build for {ctas_per_sm} CTAs per SM")

    @staticmethod
    def arch_options(arch: str, kv_dtype: str) -> dict:
        """SM100 and later convert e2m1 codes in hardware (`cvt.rn.f16x2.e2m1x2`); never run on
        hardware here (no SM100 GPU), checked by its SASS (tests/test_nvfp4_kernel_compile.py)."""
        number = int(arch.removeprefix("sm_").rstrip("af"))
        return {"e2m1_cvt": True} if kv_dtype == "nvfp4" and number >= 100 else {}

    def __init__(
        self,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        page_size: int = 128,
        topk: int = 16,
        q_dtype: str = "bfloat16",
        kv_dtype: str = "float8_e4m3fn",
        stages: int = 3,
        consumer_warps: int = 4,
        q_frags: str = "regs",
        softmax: str = "plain",
        smem_reads: str = "block",
        ctas_per_sm: int = 2,
        e2m1_cvt: bool = False,
        split_merge: str = "kernel",
    ):
        super().__init__(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=page_size,
                         topk=topk, q_dtype=q_dtype, kv_dtype=kv_dtype)
        if page_size % 16 or not 32 <= page_size <= 256:
            raise ValueError(f"page_size {page_size} must be a multiple of 16 in 32..256")
        self.stages = stages
        if page_size % (16 * consumer_warps):
            raise ValueError(f"page_size {page_size} is not a multiple of 16 * {consumer_warps} warps")
        self.warps = consumer_warps
        self.keys_per_warp = page_size // consumer_warps  # in 16-key sub-tiles
        self.consumer_threads = 32 * self.warps
        self.threads = self.consumer_threads + 32
        # arrivals that complete a stage's `empty` barrier: every consumer thread (release_stage)
        self.empty_arrivals = self.consumer_threads
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r} not in {KV_DTYPES}")
        # NVFP4: one stage is the K slot and the V slot of a (page, KV head), adjacent in the cache
        self.nvfp4 = kv_dtype == "nvfp4"
        self.stage_bytes = page_size * (2 * NVFP4_ROW_BYTES if self.nvfp4 else FP8_ROW_BYTES)
        # NVFP4 codes -> f16 by the hardware's `cvt.rn.f16x2.e2m1x2` (SM100+, arch_options), exact
        # values; else bit placement into f16 (ptx.e2m1x8_to_f16x2x4, value * 2**-14)
        if e2m1_cvt and not self.nvfp4:
            raise ValueError("e2m1_cvt needs kv_dtype='nvfp4'")
        self.e2m1_cvt = bool(e2m1_cvt)
        self.kv_fold = NVFP4_FOLD if self.nvfp4 and not self.e2m1_cvt else 1.0
        # the NVFP4 bit trick pairs a word's codes (d, d+2), (d+1, d+3), and Q's A fragments
        # pair their dims alike; fp8 K and the hardware e2m1 conversion pair (d, d+1), (d+2, d+3)
        self.q_pairs_strided = self.nvfp4 and not self.e2m1_cvt
        self.buf_bytes = max(stages * self.stage_bytes, self.warps * RED_WARP)
        # elements of the 16 x 128 output tile each consumer thread finalizes (16-byte stores)
        self.out_elems = 16 * HEAD_DIM // self.consumer_threads
        for name, value, allowed in (
            ("q_frags", q_frags, ("regs", "smem")), ("softmax", softmax, ("plain", "lean")),
            ("smem_reads", smem_reads, ("block", "staged")), ("ctas_per_sm", ctas_per_sm, (1, 2, 3)),
            ("split_merge", split_merge, ("kernel", "cluster")),
        ):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} not in {allowed}")
        if self.out_elems % 8:
            raise ValueError(f"the 16-byte output stores need 8 | {self.out_elems} output elements per thread "
                             f"({consumer_warps} consumer warps)")
        # "smem": the Q A-fragments (the same for every consumer warp) live in shared memory,
        # read per k-step, which frees 32 registers per thread for more CTAs per SM
        self.q_smem = q_frags == "smem"
        # "lean": qk_scale_log2 folded into Q, the kv_len mask only on a block that crosses
        # kv_len, and O / l rescaled only when a row max grows by more than LAZY_RESCALE
        # (then P <= 2**LAZY_RESCALE, exact in f16 / fp32: the result is unchanged)
        self.lean = softmax == "lean"
        # where the lean softmax takes qk_scale_log2: folded into bf16 Q fragments (free), but for
        # an fp8 query, or an NVFP4 cache, applied in fp32 inside the exponent (one FFMA per P):
        # folding it into the f16 fragments rounds S by 2**-11 relative, which put the LSE
        # 2-3.4e-3 off the reference for an fp8 query (GPU tests T1334) and 2-7e-3 with NVFP4's
        # larger S (tests 2026-12-03 s8)
        self.scale_in_q = self.lean and not self.q_fp8 and not self.nvfp4
        # "block": all K and V words of a block are read before any math (the stage is released
        # early, more registers live); "staged": K per half of head_dim, V per sub-tile after the
        # softmax (fewer live registers, the stage is released after the last V read)
        self.staged = smem_reads == "staged"
        # the staged build's fp8 K read per k-step pair (8 bytes) instead of per half of head_dim
        # (16 bytes): 8 fewer live registers, which the fp8-query 3-CTA build needs at 128 (5 spill
        # instructions before); the bf16-query build ran 0.3-2% slower with it, so it keeps the
        # 16-byte reads
        self.k_pairs = self.staged and self.q_fp8 and not self.nvfp4
        self.ctas_per_sm = ctas_per_sm
        # the split merge lets the next layer's decode kernel be scheduled early only in the 2-CTA
        # build (per layer: batch 1 -0.4..-0.6 us); at 3 per SM its CTAs then took the slots
        # unevenly (64/4 B=16 +1.4..+1.7 us), as the decode kernel's own early trigger did
        self.merge_trigger = ctas_per_sm < 3
        # "cluster": the splits of a (t, h) merge inside the launch (msa_jit/kernels/cluster_merge.py); its
        # 8 KiB receive buffer fits beside 3 stages at 2 CTAs per SM, not at 3
        if split_merge == "cluster" and (ctas_per_sm > 2 or self.consumer_threads < HEAD_DIM):
            raise ValueError("split_merge='cluster' needs ctas_per_sm <= 2 and >= 4 consumer warps")
        self.cluster_merge = ClusterMerge(group_size=self.group, max_splits=topk, threads=self.consumer_threads) if split_merge == "cluster" else None

    # ------------------------------------------------------------------ host side
    def storage_type(self):
        """The shared-memory struct of the decode kernel."""

        @cute.struct
        class Storage:
            buf: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.buf_bytes], 1024]
            full: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            empty: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            pages: cute.struct.MemRange[Int32, 32]
            blocks: cute.struct.MemRange[Int32, 32]
            nvalid: cute.struct.MemRange[Int32, 4]
            ml: cute.struct.MemRange[Float32, self.warps * 32]
            q: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, Q_FRAG_BYTES if self.q_smem else 16], 16]

        return Storage

    def launch_options(self) -> dict:
        """Extra launch options of the main kernel."""
        # >= two CTAs per SM: one streams KV while another runs its prologue / epilogue
        return {"min_blocks_per_mp": self.ctas_per_sm}

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, args: KernelArguments, Storage: cutlass.Constexpr):
        """One CTA: the convention's tensors and scalars (`args`, named as in convention.ARGUMENTS)."""
        tidx, _, _ = cute.arch.thread_idx()
        t, h, split = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(Storage)
        buf_addr = ptx.smem_addr(storage.buf.data_ptr())
        full_ptr = storage.full.data_ptr()
        empty_ptr = storage.empty.data_ptr()
        sPages = storage.pages.get_tensor(cute.make_layout(32))
        sBlocks = storage.blocks.get_tensor(cute.make_layout(32))
        sNvalid = storage.nvalid.get_tensor(cute.make_layout(4))
        sML = storage.ml.get_tensor(cute.make_layout(self.warps * 32))
        q_addr = ptx.smem_addr(storage.q.data_ptr())
        recv = Int32(0)  # the cluster merge's receive buffer and mbarrier (msa_jit/kernels/cluster_merge.py)
        if cutlass.const_expr(self.cluster_merge is not None):
            recv = ptx.smem_addr(smem.allocate_array(cutlass.Uint8, RECV_BYTES, byte_alignment=16))
        # the barriers touch no global memory: set them up while the previous kernel may still run
        if warp == 0:
            if lane == 0:
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full_ptr + s, 1)
                    cute.arch.mbarrier_init(empty_ptr + s, self.empty_arrivals)
                if cutlass.const_expr(self.cluster_merge is not None):
                    self.cluster_merge.init(recv)
        # every write of the previous kernel (the prologue's kv_lens, or a caller's q / topk)
        # is visible after this; nothing above reads global memory
        cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.ctas_per_sm < 3):
            cute.arch.griddepcontrol_launch_dependents()  # the split merge may be scheduled now
        elif args.num_splits > 1:
            # at 3 per SM a one-wave grid leaves up to a third of the slots free: an early
            # trigger would let the NEXT decode kernel's CTAs take them while this grid runs,
            # unevenly across SMs (per_layer T1334: +5 us per layer); only the merge may
            cute.arch.griddepcontrol_launch_dependents()
        # the global scales as device tensors (1.0 when the caller gave python floats); an NVFP4
        # block's K and V leave the conversion times 2**-14 (e2m1x8_to_f16x2x4), folded back here
        qk_scale_log2 = args.qk_scale_log2 * args.k_scale_tensor[0] * self.kv_fold
        v_scale = args.v_scale * args.v_scale_tensor[0] * self.kv_fold

        kv_len = args.kv_lens[t]
        req = t // args.qlen
        num_pages = args.kv_cache.shape[0]

        # ---- 1. compact the valid slots of this (t, h) into shared memory (warp 0)
        if warp == 0:
            ballot = common.compact_valid_slots(
                args.topk, args.block_table, t, h, req, kv_len, num_pages, lane, sPages, sBlocks, self.topk, self.page,
            )
            if lane == 0:
                sNvalid[0] = cute.arch.popc(ballot)
        if cutlass.const_expr(self.q_smem):
            if warp == self.warps:  # the producer warp is idle until the slots are compacted
                self.stage_q(args.query, q_addr, t, h, lane, qk_scale_log2)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if cutlass.const_expr(self.cluster_merge is not None):
            self.cluster_merge.arrive(args.num_splits)  # waited for before the first push (epilogue)

        n_valid = sNvalid[0]
        first, n_iter = common.split_range(n_valid, args.num_splits, split)

        if warp == self.warps:
            # ---- 2a. producer warp: one lane streams the selected chunks into the stages
            if lane == 0:
                self.produce(args.kv_cache, sPages, h, first, n_iter, buf_addr, full_ptr, empty_ptr)
        else:
            # ---- 2b. consumer warps
            self.consume(
                args.query, args.out, args.lse, args.partial_o, args.partial_lse, sBlocks, sML, buf_addr, q_addr,
                recv, full_ptr, empty_ptr, t, h, split, warp, lane, kv_len, first, n_iter, args.num_splits,
                qk_scale_log2, v_scale,
            )

    @cute.jit
    def produce(self, mKV, sPages, h, first, n_iter, buf_addr, full_ptr, empty_ptr):
        """Producer (one thread): the selected chunks of slots [first, first + n_iter) into the stages."""
        common.stream_pages(
            mKV, sPages, h, first, n_iter, buf_addr, full_ptr, empty_ptr, self.stages, self.stage_bytes, self.hkv,
        )

    @cute.jit
    def stage_q(self, mQ, q_addr, t, h, lane, qk_scale_log2):
        """Q A-fragments -> shared memory, [k-step][lane][4 words]: conflict-free 16-byte reads."""
        qa = cute.make_rmem_tensor(32, Int32)
        self.load_q(mQ, qa, t, h, lane // 4, lane % 4, qk_scale_log2)
        for ks in cutlass.range_constexpr(8):
            ptx.st_shared_v4(q_addr + ks * 512 + 16 * lane, qa[4 * ks], qa[4 * ks + 1], qa[4 * ks + 2], qa[4 * ks + 3])

    @cute.jit
    def consume(
        self, mQ, mOut, mLse, mPO, mPL, sBlocks, sML, buf_addr, q_addr, recv, full_ptr, empty_ptr,
        t, h, split, warp, lane, kv_len, first, n_iter, num_splits, qk_scale_log2, v_scale,
    ):
        g = lane // 4
        c = lane % 4
        # Q fragments (A operand), loaded once: 8 k-steps x 4 f16x2 registers (or in shared memory).
        qa = cute.make_rmem_tensor(32, Int32)
        if cutlass.const_expr(not self.q_smem):
            self.load_q(mQ, qa, t, h, g, c, qk_scale_log2)

        acc = cute.make_rmem_tensor(64, Float32)  # 16 n-tiles (dims) x 4
        for nt in cutlass.range_constexpr(16):  # by n-tile: the same 64 stores as one loop of 64, which
            for k in cutlass.range_constexpr(4):  # the DSL flags (its optimization warning from 64 on)
                acc[4 * nt + k] = Float32(0.0)
        row_max = cute.make_rmem_tensor(2, Float32)
        row_sum = cute.make_rmem_tensor(2, Float32)
        for r in cutlass.range_constexpr(2):
            row_max[r] = -Float32.inf
            row_sum[r] = Float32(0.0)

        scale = Float32(1.0) if self.scale_in_q else qk_scale_log2
        for i in range(n_iter):
            s = i % self.stages
            phase = (i // self.stages) & 1
            cute.arch.mbarrier_wait(full_ptr + s, phase)
            stage = buf_addr + s * self.stage_bytes
            blk = sBlocks[first + i]
            self.consume_block(
                qa, q_addr + 16 * lane, acc, row_max, row_sum, stage, empty_ptr + s, blk, kv_len, scale,
                warp * self.keys_per_warp, g, c, lane,
            )

        self.epilogue(mOut, mLse, mPO, mPL, sML, buf_addr, recv, acc, row_max, row_sum,
                      t, h, split, warp, lane, num_splits, v_scale)

    @cute.jit
    def consume_block(self, qa, q_lane, acc, row_max, row_sum, stage, empty_bar, blk, kv_len, scale,
                      key_base, g, c, lane):
        """This warp's keys [key_base, key_base + keys_per_warp) of the block in `stage`.

        All shared-memory reads first (then the stage is released), S for every 16-key
        sub-tile (independent MMA chains), ONE online-softmax update for the whole block,
        then O = O * alpha + P V over the sub-tiles.
        """
        nsub = self.keys_per_warp // 16
        nt_s = 2 * nsub
        # K rows of this thread: S n-tile n = 2*sub + j holds key key_base + 16*sub + 4(g//2) + g%2 + 2j;
        # K half kh covers k-steps 4kh..4kh+3 (head dims 64kh + 16c.. in K's word order)
        k_keys = [key_base + 16 * (n // 2) + 4 * (g // 2) + g % 2 + 2 * (n % 2) for n in range(nt_s)]
        if cutlass.const_expr(self.staged):
            kw = None
            vw = None
        else:  # every read first, then the stage is released
            kw = [[self.load_k(stage, k_keys[n], kh, c) for n in range(nt_s)] for kh in range(2)]
            vw = [self.load_v(stage, key_base, sub, g, c) for sub in range(nsub)]
            self.release_stage(empty_bar, lane)

        # ---- S = Q K^T: 2 * nsub independent accumulation chains of 8 k-steps
        sv = cute.make_rmem_tensor(4 * nt_s, Float32)
        d = [[Float32(0.0)] * 4 for _ in range(nt_s)]
        for kh in cutlass.range_constexpr(2):
            kw_h = kw[kh] if cutlass.const_expr(not self.staged) else None
            if cutlass.const_expr(self.staged and not self.k_pairs):  # only this half's K words are live
                kw_h = [self.load_k(stage, k_keys[n], kh, c) for n in range(nt_s)]
            for kp in cutlass.range_constexpr(2):  # k-steps 2kp, 2kp+1 of the half
                if cutlass.const_expr(self.nvfp4):  # one e2m1 word (8 dims) holds both k-steps
                    bk = [self.nvfp4_k_frags(kw_h[n], kp) for n in range(nt_s)]
                else:
                    if cutlass.const_expr(self.k_pairs):  # only this pair's K words are live
                        kq_w = [self.load_k_pair(stage, k_keys[n], kh, kp, c) for n in range(nt_s)]
                    else:
                        kq_w = [(kw_h[n][2 * kp], kw_h[n][2 * kp + 1]) for n in range(nt_s)]
                    bk = [self.fp8x4_to_f16x2x2(kq_w[n][0]) + self.fp8x4_to_f16x2x2(kq_w[n][1]) for n in range(nt_s)]
                for kq in cutlass.range_constexpr(2):
                    ks = 4 * kh + 2 * kp + kq
                    if cutlass.const_expr(self.q_smem):
                        a = ptx.ld_shared_v4(q_lane + 512 * ks)
                    else:
                        a = [qa[4 * ks + k] for k in range(4)]
                    for n in cutlass.range_constexpr(nt_s):
                        d[n] = ptx.mma_f16_16816(a[0], a[1], a[2], a[3], bk[n][2 * kq], bk[n][2 * kq + 1], *d[n])
        for n in cutlass.range_constexpr(nt_s):
            for e in cutlass.range_constexpr(4):
                sv[4 * n + e] = d[n][e]

        # ---- one online-softmax step for the block (rows g and g+8 = heads h*G+g, h*G+g+8).
        # n-tile n = 2*sub + j, column 2c+e holds key key_base + 16*sub + 4c + 2j + e.
        key0 = blk * self.page + key_base + 4 * c
        if cutlass.const_expr(self.lean):
            self.softmax_lean(sv, acc, row_max, row_sum, key0, blk, kv_len, scale, nt_s)
        else:
            self.softmax_plain(sv, acc, row_max, row_sum, key0, kv_len, scale, nt_s)

        # ---- O += P V, one 16-key k-chunk per sub-tile, 16 n-tiles of 8 dims each
        for sub in cutlass.range_constexpr(nsub):
            if cutlass.const_expr(self.staged):  # V read just before it is used
                vsub = self.load_v(stage, key_base, sub, g, c)
                if sub == nsub - 1:
                    self.release_stage(empty_bar, lane)
            else:
                vsub = vw[sub]
            p0 = 8 * sub  # P A-fragment: n-tile 2*sub gives k 2c.., n-tile 2*sub+1 gives k 2c+8..
            pa0 = ptx.f32x2_to_f16x2(sv[p0], sv[p0 + 1])
            pa1 = ptx.f32x2_to_f16x2(sv[p0 + 2], sv[p0 + 3])
            pa2 = ptx.f32x2_to_f16x2(sv[p0 + 4], sv[p0 + 5])
            pa3 = ptx.f32x2_to_f16x2(sv[p0 + 6], sv[p0 + 7])
            # n-tile nt holds dims 16g' + nt (g' = the MMA column): 4 n-tiles per V group
            for grp in cutlass.range_constexpr(4):
                if cutlass.const_expr(self.nvfp4):
                    nts, bv = self.nvfp4_v_frags(vsub, grp)
                else:
                    v0, v1, v2, v3 = vsub
                    nts = [4 * grp + e for e in range(4)]
                    bv = [(self.fp8_bytes_to_f16x2(v0[grp], v1[grp], e), self.fp8_bytes_to_f16x2(v2[grp], v3[grp], e))
                          for e in range(4)]
                for i in cutlass.range_constexpr(4):
                    nt = nts[i]
                    dd = ptx.mma_f16_16816(
                        pa0, pa1, pa2, pa3, bv[i][0], bv[i][1],
                        acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3],
                    )
                    for k in cutlass.range_constexpr(4):
                        acc[4 * nt + k] = dd[k]

    @cute.jit
    def load_k(self, stage, key, kh, c):
        """K of `key`, head dims 64kh + 16c .. + 16: fp8 4 words; NVFP4 (2 words of codes, f16x2 scale)."""
        if cutlass.const_expr(self.nvfp4):
            codes = ptx.ld_shared_v2(stage + key * NVFP4_CODE_BYTES + 32 * kh + 8 * c)
            sc = ptx.ld_shared_u8(stage + self.page * NVFP4_CODE_BYTES + 8 * key + 4 * kh + c)  # row-major
            return [codes[0], codes[1], ptx.e4m3_bytes_to_f16x2(sc, sc, 0x00)]
        return ptx.ld_shared_v4(stage + key * FP8_ROW_BYTES + 16 * c + 64 * kh)

    @cute.jit
    def load_k_pair(self, stage, key, kh, kp, c):
        """fp8 K words 2kp, 2kp+1 of load_k's 4 (head dims 64kh + 16c + 8kp .. + 8), one 8-byte load."""
        return ptx.ld_shared_v2(stage + key * FP8_ROW_BYTES + 16 * c + 64 * kh + 8 * kp)

    @cute.jit
    def nvfp4_k_frags(self, kraw, kp):
        """B fragments (b0, b1) of k-steps 2kp and 2kp+1 from code word kp of load_k's NVFP4 K.

        Word kp holds dims 8kp..8kp+7 of the thread's 16; k-step 2kp + kq takes dims
        d = 8kp + 4kq: b0 = (d, d+2), b1 = (d+1, d+3) (load_q permutes Q alike). The block scale
        multiplies in f16, exactly.
        """
        sc = kraw[2]
        if cutlass.const_expr(self.e2m1_cvt):  # b0 = (d, d+1), b1 = (d+2, d+3), as for fp8 K
            return [ptx.hmul2(h, sc) for h in ptx.e2m1x8_to_f16x2x4_cvt(kraw[kp])]
        ev0, ev1, od0, od1 = ptx.e2m1x8_to_f16x2x4(kraw[kp])
        return [ptx.hmul2(ev0, sc), ptx.hmul2(od0, sc), ptx.hmul2(ev1, sc), ptx.hmul2(od1, sc)]

    @cute.jit
    def load_v(self, stage, key_base, sub, g, c):
        """V of sub-tile sub: rows key_base + 16 sub + 4c + i (i < 4), dims 16g .. 16g + 15.

        fp8: 4 rows x 4 words (bank-conflict-free rotated loads); NVFP4: 4 rows x 2 code words,
        then the 4 rows' block scales of group g as 2 f16x2 (rows 0,1 and rows 2,3).
        """
        row0 = key_base + 16 * sub + 4 * c
        if cutlass.const_expr(self.nvfp4):
            vslot = stage + self.page * NVFP4_ROW_BYTES
            rows = [ptx.ld_shared_v2(vslot + (row0 + i) * NVFP4_CODE_BYTES + 8 * g) for i in range(4)]
            # swizzled scales: (n, g) at row (n // 4) * 4 + g // 2, column (g % 2) * 4 + n % 4, so
            # rows row0..row0+3 (row0 % 4 == 0) of group g are 4 adjacent bytes
            sw = ptx.ld_shared_b32(vslot + self.page * NVFP4_CODE_BYTES + (row0 + g // 2) * 8 + (g % 2) * 4)
            return [rows, ptx.e4m3x2_to_f16x2(sw, 0), ptx.e4m3x2_to_f16x2(sw, 1)]
        vrow = stage + row0 * FP8_ROW_BYTES + HEAD_DIM + 16 * g
        return [self.ld_v_rotated(vrow + i * FP8_ROW_BYTES, c) for i in range(4)]

    @cute.jit
    def nvfp4_v_frags(self, vraw, grp):
        """(n-tiles, [(b0, b1)] x 4) of V group grp: dims 4grp + (0, 2, 1, 3) of the thread's 16.

        b0 pairs rows 0 and 1 (keys 4c, 4c+1) at one dim, b1 rows 2 and 3: a byte permute puts
        the two rows' bytes side by side, so the codes of one dim land in one f16x2.
        """
        rows, sc01, sc23 = vraw
        w = grp // 2
        if cutlass.const_expr(self.e2m1_cvt):  # dims 4(grp % 2) + j of word w, in order
            h = grp % 2
            e01 = ptx.e2m1_nibble_pairs(rows[0][w], rows[1][w])  # (even dims, odd dims), bytes by dim // 2
            e23 = ptx.e2m1_nibble_pairs(rows[2][w], rows[3][w])
            p01 = ptx.e2m1x8_to_f16x2x4_cvt(e01[0]) + ptx.e2m1x8_to_f16x2x4_cvt(e01[1])
            p23 = ptx.e2m1x8_to_f16x2x4_cvt(e23[0]) + ptx.e2m1x8_to_f16x2x4_cvt(e23[1])
            # p[k]: dim 2k (k < 4) or 2(k - 4) + 1 of the word's 8
            at = [2 * h, 4 + 2 * h, 2 * h + 1, 4 + 2 * h + 1]  # dims 4h, 4h + 1, 4h + 2, 4h + 3
            return ([4 * grp + j for j in range(4)],
                    [(ptx.hmul2(p01[at[j]], sc01), ptx.hmul2(p23[at[j]], sc23)) for j in range(4)])
        sel = 0x5140 if grp % 2 == 0 else 0x7362  # bytes 0,1 (dims 0..3) or 2,3 (dims 4..7) of word w
        e01 = ptx.e2m1x8_to_f16x2x4(ptx.prmt(rows[0][w], rows[1][w], sel))
        e23 = ptx.e2m1x8_to_f16x2x4(ptx.prmt(rows[2][w], rows[3][w], sel))
        base = 4 * grp
        return ([base, base + 2, base + 1, base + 3],
                [(ptx.hmul2(e01[i], sc01), ptx.hmul2(e23[i], sc23)) for i in range(4)])

    @cute.jit
    def release_stage(self, empty_bar, lane):
        """This warp is done reading the stage: every lane arrives on its `empty` barrier.

        Each lane's own arrival orders its reads before the producer's next bulk copy into the
        stage. One arrival by lane 0 after `sync_warp` is ordered as well by the PTX model, but
        compute-sanitizer's racecheck sees neither that warp barrier nor a named barrier of the
        warp in its place, and reported every refill as a race.
        """
        cute.arch.mbarrier_arrive(empty_bar)

    @cute.jit
    def softmax_plain(self, sv, acc, row_max, row_sum, key0, kv_len, scale, nt_s: cutlass.Constexpr):
        """S -> P in place (masked against kv_len, scaled inside the exponent), O and l rescaled every block.

        The row max is taken over the unscaled S (scale > 0: the same key wins) and scaled once;
        each P is ex2(S * scale - m) by one FFMA (row_max is in scaled, log2 units).
        """
        alpha = cute.make_rmem_tensor(2, Float32)
        for r in cutlass.range_constexpr(2):
            mx = -Float32.inf
            for n in cutlass.range_constexpr(nt_s):
                for e in cutlass.range_constexpr(2):
                    x = sv[4 * n + 2 * r + e]
                    if key0 + 16 * (n // 2) + 2 * (n % 2) + e >= kv_len:
                        x = -Float32.inf
                    sv[4 * n + 2 * r + e] = x
                    mx = cute.arch.fmax(mx, x)
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 2))
            mx = cute.arch.fmax(row_max[r], mx * scale)
            m_use = mx
            if mx == -Float32.inf:
                m_use = Float32(0.0)
            alpha[r] = ptx.ex2(row_max[r] - m_use)
            row_max[r] = mx
            row_sum[r] = row_sum[r] * alpha[r] + self.exp_rows(sv, r, m_use, scale, nt_s)
        for nt in cutlass.range_constexpr(16):
            for k in cutlass.range_constexpr(4):
                acc[4 * nt + k] = acc[4 * nt + k] * alpha[k // 2]

    @cute.jit
    def softmax_lean(self, sv, acc, row_max, row_sum, key0, blk, kv_len, scale, nt_s: cutlass.Constexpr):
        """S -> P in place, lazily rescaled; S is in log2 units already when the scale is in Q
        (bf16 query), else scaled inside the exponent as in softmax_plain.

        Only the block that crosses kv_len is masked (warp-uniform branch); O and l are
        rescaled, for the whole warp, only when some row max grew by more than LAZY_RESCALE.
        """
        if (blk + 1) * self.page > kv_len:
            for r in cutlass.range_constexpr(2):
                for n in cutlass.range_constexpr(nt_s):
                    for e in cutlass.range_constexpr(2):
                        if key0 + 16 * (n // 2) + 2 * (n % 2) + e >= kv_len:
                            sv[4 * n + 2 * r + e] = -Float32.inf
        mxs = cute.make_rmem_tensor(2, Float32)
        grow = Int32(0)
        for r in cutlass.range_constexpr(2):
            mx = -Float32.inf
            for n in cutlass.range_constexpr(nt_s):
                for e in cutlass.range_constexpr(2):
                    mx = cute.arch.fmax(mx, sv[4 * n + 2 * r + e])
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 2))
            if cutlass.const_expr(not self.scale_in_q):
                mx = mx * scale
            mxs[r] = mx
            if mx > row_max[r] + LAZY_RESCALE:  # row_max = -inf: any finite mx
                grow = Int32(1)
        if cute.arch.vote_any_sync(grow != 0):
            alpha = cute.make_rmem_tensor(2, Float32)
            for r in cutlass.range_constexpr(2):
                m_new = cute.arch.fmax(row_max[r], mxs[r])
                m_use = m_new
                if m_new == -Float32.inf:
                    m_use = Float32(0.0)
                alpha[r] = ptx.ex2(row_max[r] - m_use)
                row_max[r] = m_new
                row_sum[r] = row_sum[r] * alpha[r]
            for nt in cutlass.range_constexpr(16):
                for k in cutlass.range_constexpr(4):
                    acc[4 * nt + k] = acc[4 * nt + k] * alpha[k // 2]
        for r in cutlass.range_constexpr(2):
            m_use = row_max[r]
            if m_use == -Float32.inf:  # every key so far masked: P = ex2(-inf) = 0
                m_use = Float32(0.0)
            row_sum[r] = row_sum[r] + self.exp_rows(sv, r, m_use, scale, nt_s)

    @cute.jit
    def exp_rows(self, sv, r, m_use, scale, nt_s: cutlass.Constexpr):
        """P = 2**(S * scale - m_use) in place for row r of every S n-tile (one FFMA each; S alone
        when the scale is in Q); returns this thread's sum."""
        psum = Float32(0.0)
        for n in cutlass.range_constexpr(nt_s):
            for e in cutlass.range_constexpr(2):
                if cutlass.const_expr(self.scale_in_q):  # lean, bf16 query: S is in log2 units
                    p = ptx.ex2(sv[4 * n + 2 * r + e] - m_use)
                else:
                    p = ptx.ex2(ptx.ffma(sv[4 * n + 2 * r + e], scale, -m_use))
                sv[4 * n + 2 * r + e] = p
                psum = psum + p
        return psum

    @cute.jit
    def ld_v_rotated(self, addr, c):
        """The 16 bytes at addr as 4 words, read with 4 bank-conflict-free 32-bit loads.

        Lane c reads word (j + c) & 3 in its j-th load, so the 4 lanes of a row group that
        share banks (all V rows alias modulo 128 B) hit 4 different banks; the words are then
        rotated back into place by c (2 rounds of selects).
        """
        r = [ptx.ld_shared_b32(addr + 4 * ((j + c) & 3)) for j in range(4)]
        t = [r[(u - 1) & 3] if c & 1 else r[u] for u in range(4)]
        return [t[(u - 2) & 3] if c & 2 else t[u] for u in range(4)]

    @cute.jit
    def fp8x4_to_f16x2x2(self, w):
        """e4m3 bytes 0..3 of w -> (f16x2 of bytes 0,1; f16x2 of bytes 2,3), exact."""
        return ptx.e4m3x2_to_f16x2(w, 0), ptx.e4m3x2_to_f16x2(w, 1)

    @cute.jit
    def fp8_bytes_to_f16x2(self, lo, hi, e: cutlass.Constexpr):
        """f16x2 {byte e of lo, byte e of hi} (e4m3), exact."""
        return ptx.e4m3_bytes_to_f16x2(lo, hi, ((4 + e) << 4) | e)

    @cute.jit
    def load_q(self, mQ, qa, t, h, g, c, qk_scale_log2):
        """Q rows g and g+8 of the group into A fragments, dims permuted like K's words.

        k-step ks = 4 half + sub takes dims d = 64 half + 16c + 4 sub .. d + 3: a fp8 K word gives
        (d, d+1) and (d+2, d+3), an NVFP4 code word (d, d+2) and (d+1, d+3) (nvfp4_k_frags), and
        Q's A fragments pair its dims the same way. softmax="lean", bf16 query: Q * qk_scale_log2,
        so that S comes out in log2 units (an fp8 query's fragments stay exact and S is scaled
        in fp32 instead).
        """
        G = self.group
        bf16_scale = qk_scale_log2 if self.scale_in_q else None  # None: the plain conversion, no multiply
        q_base = mQ.iterator.toint()
        q_row_stride = Int64(mQ.stride[0])
        elem = 1 if self.q_fp8 else 2
        for r in cutlass.range_constexpr(2):
            head = g + 8 * r
            words = cute.make_rmem_tensor(16, Int32)
            for k in cutlass.range_constexpr(16):
                words[k] = Int32(0)
            if head < G:
                row = q_base + (Int64(t) * q_row_stride + Int64(h * G + head) * HEAD_DIM) * elem
                for half in cutlass.range_constexpr(2):
                    dim0 = 64 * half + 16 * c
                    if cutlass.const_expr(self.q_fp8):
                        wv = ptx.ld_global_nc_v4(row + dim0)
                        for k in cutlass.range_constexpr(4):
                            words[8 * half + k] = wv[k]
                    else:
                        for part in cutlass.range_constexpr(2):
                            wv = ptx.ld_global_nc_v4(row + (dim0 + 8 * part) * 2)
                            for k in cutlass.range_constexpr(4):
                                words[8 * half + 4 * part + k] = wv[k]
            for ks in cutlass.range_constexpr(8):
                half = ks // 4
                sub = ks % 4
                if cutlass.const_expr(self.q_fp8 and self.q_pairs_strided):  # bytes (0, 2) and (1, 3), exact
                    w = words[8 * half + sub]
                    lo = ptx.e4m3_bytes_to_f16x2(w, w, 0x20)
                    hi = ptx.e4m3_bytes_to_f16x2(w, w, 0x31)
                elif cutlass.const_expr(self.q_fp8):
                    lo, hi = self.fp8x4_to_f16x2x2(words[8 * half + sub])  # exact; S takes the scale
                elif cutlass.const_expr(self.q_pairs_strided):  # the low halves (d, d+2), the high halves (d+1, d+3)
                    w0 = words[8 * half + 2 * sub]
                    w1 = words[8 * half + 2 * sub + 1]
                    lo = ptx.bf16x2_to_f16x2(ptx.prmt(w0, w1, 0x5410), bf16_scale)
                    hi = ptx.bf16x2_to_f16x2(ptx.prmt(w0, w1, 0x7632), bf16_scale)
                else:
                    lo = ptx.bf16x2_to_f16x2(words[8 * half + 2 * sub], bf16_scale)
                    hi = ptx.bf16x2_to_f16x2(words[8 * half + 2 * sub + 1], bf16_scale)
                # A registers: {row g, k 2c..}, {row g+8, k 2c..}, {row g, k 2c+8..}, {row g+8, k 2c+8..}
                qa[4 * ks + r] = lo
                qa[4 * ks + 2 + r] = hi

    @cute.jit
    def epilogue(self, mOut, mLse, mPO, mPL, sML, buf_addr, recv, acc, row_max, row_sum,
                 t, h, split, warp, lane, num_splits, v_scale):
        G = self.group
        g = lane // 4
        c = lane % 4
        bar_id = 1
        nthr = self.consumer_threads
        for r in cutlass.range_constexpr(2):
            tot = row_sum[r]
            tot = tot + cute.arch.shuffle_sync_bfly(tot, 1)
            tot = tot + cute.arch.shuffle_sync_bfly(tot, 2)
            row_sum[r] = tot
        if c == 0:
            for r in cutlass.range_constexpr(2):
                sML[warp * 32 + 2 * (g + 8 * r)] = row_max[r]
                sML[warp * 32 + 2 * (g + 8 * r) + 1] = row_sum[r]
        # every consumer is done with the stages (they alias the reduction buffer): each warp's O rows go
        # there unscaled; the reader weighs them (one FFMA per warp and element), so no thread takes the row
        # max here (a batch-1 layer runs this epilogue one warp per scheduler: every instruction is on its
        # critical path)
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=nthr)
        for r in cutlass.range_constexpr(2):
            base = buf_addr + warp * RED_WARP + (g + 8 * r) * RED_ROW + c * RED_CHUNK
            for q in cutlass.range_constexpr(8):
                col = 0 if q < 4 else 1
                nt0 = 4 * (q % 4)
                ptx.st_shared_v4_f32(
                    base + 16 * q,
                    acc[4 * nt0 + 2 * r + col],
                    acc[4 * (nt0 + 1) + 2 * r + col],
                    acc[4 * (nt0 + 2) + 2 * r + col],
                    acc[4 * (nt0 + 3) + 2 * r + col],
                )
        # the O rows and sML are complete
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=nthr)

        tid = warp * 32 + lane
        per_row = HEAD_DIM // self.out_elems
        row = tid // per_row
        d0 = (tid % per_row) * self.out_elems
        if cutlass.const_expr(self.cluster_merge is not None):
            self.cluster_merge.wait(num_splits)
        if row < G:
            m_all = -Float32.inf
            for w in cutlass.range_constexpr(self.warps):
                m_all = cute.arch.fmax(m_all, sML[w * 32 + 2 * row])
            m_use = m_all
            if m_all == -Float32.inf:
                m_use = Float32(0.0)
            # warp w's O row counts 2**(m_w - m) in l_all, and weight[w] * its row in the output
            weight = cute.make_rmem_tensor(self.warps, Float32)
            l_all = Float32(0.0)
            for w in cutlass.range_constexpr(self.warps):
                weight[w] = ptx.ex2(sML[w * 32 + 2 * row] - m_use)  # 0 for a warp that saw no key
                l_all = l_all + sML[w * 32 + 2 * row + 1] * weight[w]
            inv = Float32(0.0)
            if l_all > Float32(0.0):
                inv = v_scale / l_all
            lse2 = -Float32.inf
            if l_all > Float32(0.0):
                lse2 = m_all + ptx.lg2(l_all)
            for w in cutlass.range_constexpr(self.warps):
                weight[w] = weight[w] * inv
            vals = cute.make_rmem_tensor(self.out_elems, Float32)
            for k in cutlass.range_constexpr(self.out_elems):
                vals[k] = Float32(0.0)
            rd = buf_addr + row * RED_ROW + (d0 // 32) * RED_CHUNK + (d0 % 32) * 4
            for w in cutlass.range_constexpr(self.warps):
                for q in cutlass.range_constexpr(self.out_elems // 4):
                    f = ptx.ld_shared_v4_f32(rd + w * RED_WARP + 16 * q)
                    for k in cutlass.range_constexpr(4):
                        vals[4 * q + k] = ptx.ffma(f[k], weight[w], vals[4 * q + k])
            hq = h * G + row
            # 16-byte stores (13x fewer L2 write sectors than one store per element, ncu T0929)
            if num_splits == 1:  # 8 bf16 per store (mOut is 16-byte aligned)
                dst = mOut.iterator.toint() + (Int64(t) * Int64(mOut.stride[0]) + Int64(hq * HEAD_DIM + d0)) * 2
                for q in cutlass.range_constexpr(self.out_elems // 8):
                    w = [ptx.f32x2_to_bf16x2(vals[8 * q + 2 * k], vals[8 * q + 2 * k + 1]) for k in range(4)]
                    ptx.st_global_v4(dst + 16 * q, w[0], w[1], w[2], w[3])
                if d0 == 0:
                    mLse[t, hq] = lse2 * LN2
            elif cutlass.const_expr(self.cluster_merge is None):
                self.store_partial(mPO, mPL, vals, lse2, t, h, split, row, d0, num_splits, self.out_elems)
            elif self.cluster_merge.in_cluster():  # into the merging CTA's shared memory
                self.cluster_merge.push(recv, split, num_splits, row, d0, vals, lse2, self.out_elems)
            else:
                self.store_partial(mPO, mPL, vals, lse2, t, h, split, row, d0, num_splits, self.out_elems)
        if cutlass.const_expr(self.cluster_merge is not None):
            self.cluster_merge.merge(mOut, mLse, recv, t, h * G, split, num_splits, tid)

    @cute.jit
    def store_partial(self, mPO, mPL, vals, lse2, t, h, split, row, d0, num_splits, n_vals: cutlass.Constexpr):
        """Dims [d0, d0 + n_vals) of the split's normalized partial row (4 fp32 per store) and its log2-LSE."""
        idx = (t * self.hkv + h) * num_splits + split
        dst = mPO.iterator.toint() + (Int64(idx) * Int64(mPO.stride[0]) + Int64(row * HEAD_DIM + d0)) * 4
        for q in cutlass.range_constexpr(n_vals // 4):
            ptx.st_global_v4_f32(dst + 16 * q, vals[4 * q], vals[4 * q + 1], vals[4 * q + 2], vals[4 * q + 3])
        if d0 == 0:
            mPL[idx, row] = lse2
