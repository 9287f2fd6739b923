"""The union kernel on Hopper's warpgroup MMA (`wgmma`), as a bench probe (issue #19's speculative
decode; the "convert each block once" step row 54 of docs/performance.md asks for).

Same work split as bench/union_kernel.py (one CTA per (request, KV head, token tile), every union
block streamed once, the tile's union built by `UnionMmaKernel.build_union`), but the tile's
64 // G tokens x G query heads are the 64 rows of ONE warpgroup MMA, so each block is converted
once for all of them (FlashAttention-3's structure, written here for this layout):

* Q of the tile (64 rows x 128 dims, bf16 -> f16 times the softmax scale in log2 units) is
  written once to shared memory, 128B-swizzled, K-major (the A operand of S);
* a block's fp8 K and V become f16 tiles in shared memory (swizzled, key rows); S = Q K^T by 8
  `wgmma.m64n128k16` (SS); the online softmax runs on the accumulator rows (a row is (token,
  head): its token's kv_len mask, -inf when its token did not select the block); O += P V by 8
  `wgmma.m64n128k16` with P from registers (the S accumulator layout is the A fragment layout)
  and V as an MN-major B tile;
* consumer ("MMA") warpgroups take the union blocks in turn and merge their (m, l, O) at the end.

Roles: `converter=0`: each of `warpgroups` MMA warpgroups converts its own blocks (the stage
refilled by its thread 0); `converter=1`: warpgroup 0 converts every block (a K and a V tile per
MMA warpgroup, handed over by mbarriers) and refills the stages, the next 2 warpgroups only
multiply (`setmaxnreg`: 88 registers for the converter, 208 for them); `converter=2`: warpgroup 0
converts K, warpgroup 1 V (64 registers each, 192 for the 2 MMA warpgroups).

bf16 query and fp8 cache only; one CTA per SM.
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # the wgmma helpers check the arch while tracing

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90  # noqa: E402
from cutlass import Float32, Int32, Int64  # noqa: E402
from cutlass.cute.nvgpu import warpgroup  # noqa: E402
from cutlass.cutlass_dsl import dsl_user_op  # noqa: E402

from kernel_probes import globaltimer_lo, smid  # noqa: E402
from union_kernel import UnionMmaKernel, ptx  # noqa: E402
from msa_jit.kernels.sparse_decode_mma import HEAD_DIM, LN2  # noqa: E402
# the helpers it shares with the shipped union kernel (kernels/sparse_decode_union_sm90.py)
from msa_jit.kernels.union_sm90_ops import (BAR_ALL, BAR_WG, ROWS, f16_tile_layout, ld_shared_f32,  # noqa: E402
                                            st_global_b32, st_global_v2_f32, st_shared_f32, store_f16_chunks,
                                            swizzled_f16)

TRACE_BLOCKS = 64  # trace=True: 8 stamps for each of the first 64 union blocks, then n_union, smid, start
TRACE_WORDS = TRACE_BLOCKS * 8 + 4
_smem_layout = f16_tile_layout  # the shipped kernel's f16 tile (its V tile), and its swizzle
swizzled = swizzled_f16


@dsl_user_op
def st_shared_b32(addr: Int32, w: Int32, *, loc=None, ip=None) -> None:
    ptx._asm(None, [Int32(addr).ir_value(loc=loc, ip=ip), Int32(w).ir_value(loc=loc, ip=ip)],
             "st.shared.b32 [$0], $1;", "r,r", side_effects=True)


class UnionWgmmaKernel(UnionMmaKernel):
    """One CTA per (request, KV head, 64 // G tokens); S and O on warpgroup MMAs."""

    query_dtype = "bfloat16"  # the query this probe takes

    def __init__(self, *, union_wgmma: bool = True, stages: int | None = None, warpgroups: int = 2,
                 convert: bool = True, converter: int = 0, mma: bool = True, ring: bool = False,
                 direct: bool = False, trace: bool = False, **options):
        options.pop("union", None)
        # shared memory: stages x 32 KiB of fp8 pages + Q (16 KiB) + f16 K and V per MMA warpgroup (64 KiB)
        super().__init__(stages=stages or (3 if warpgroups == 1 and not converter else 2), **options)
        if self.q_fp8 != (self.query_dtype == "float8_e4m3fn") or self.nvfp4:
            raise ValueError(f"{type(self).__name__} takes a {self.query_dtype} query and an fp8 cache")
        if ROWS % self.group or self.warps != 4 or warpgroups not in (1, 2) or converter not in (0, 1, 2) \
                or (converter and warpgroups != 2):
            raise ValueError(f"group size {self.group} must divide {ROWS}; 1 or 2 MMA warpgroups (2 with converters); "
                             "0, 1 or 2 converter warpgroups")
        # convert=False: a timing probe that leaves the K / V tiles unconverted (stale: results wrong)
        self.convert = convert
        # mma=False: a timing probe whose MMA warpgroups only hand the tiles back (results wrong)
        self.mma = mma
        # ring=True (2 converters; bench/union_wgmma_ring.py's subclass): K / V tiles of half blocks
        # (64 keys), two per MMA warpgroup, so the converters fill the next block's first half while
        # the warpgroup works on the second
        if ring and (converter != 2 or not hasattr(self, "mma_loop_ring")):
            raise ValueError("ring needs converter=2 and UnionWgmmaRingKernel")
        self.ring = ring
        # direct=True (ring): the converters load the fp8 bytes from global memory into registers (one
        # block ahead) instead of a bulk copy into shared memory and a shared-memory read
        if direct and not ring:
            raise ValueError("direct needs ring=True")
        self.direct = direct
        # trace=True (converter=2): thread 0 of each role writes %globaltimer_lo per union block over
        # the plan's partial_o (bench/union_trace.py reads it): TRACE_WORDS int32 per CTA
        self.trace = trace
        self.converter = converter
        self.wgs = warpgroups
        self.tile_tokens = ROWS // self.group
        self.union_max = self.tile_tokens * self.topk
        self.converters = converter
        self.empty_arrivals = self.consumer_threads * max(converter, 1)  # the threads that read a stage
        # no producer warp (ptxas allots registers per warpgroup): the reader of a stage refills it
        self.threads = 128 * (warpgroups + converter)
        self.ctas_per_sm = 1
        # setmaxnreg: the converters give registers to the MMA warpgroups (the pool is 65536)
        self.conv_regs, self.mma_regs = (88, 208) if converter == 1 else ((96, 160) if direct else (64, 192))

    def storage_type(self):
        kv_tile = getattr(self, "kv_tile_elems", self.page * HEAD_DIM)

        @cute.struct
        class Storage:
            buf: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.stages * self.stage_bytes], 1024]
            sq: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, ROWS * HEAD_DIM], 1024]
            sk0: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, kv_tile], 1024]
            sv0: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, kv_tile], 1024]
            sk1: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, kv_tile if self.wgs > 1 else 8], 1024]
            sv1: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, kv_tile if self.wgs > 1 else 8], 1024]
            full: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            empty: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            # converter -> MMA warpgroup b: K tile b full / empty, V tile b full / empty
            tiles: cute.struct.Align[cute.struct.MemRange[Int64, 16], 8]
            tok_pages: cute.struct.MemRange[Int32, 32 * self.tile_tokens]
            tok_blocks: cute.struct.MemRange[Int32, 32 * self.tile_tokens]
            ballots: cute.struct.MemRange[Int32, self.tile_tokens]
            pages: cute.struct.MemRange[Int32, self.union_max]
            blocks: cute.struct.MemRange[Int32, self.union_max]
            masks: cute.struct.MemRange[Int32, self.union_max]
            kvlen: cute.struct.MemRange[Int32, self.tile_tokens]
            rowm: cute.struct.MemRange[Float32, ROWS * self.wgs]
            rowl: cute.struct.MemRange[Float32, ROWS * self.wgs]

        return Storage

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mTopk: cute.Tensor,
        mBT: cute.Tensor,
        mKvLens: cute.Tensor,
        mOut: cute.Tensor,
        mLse: cute.Tensor,
        mPO: cute.Tensor,
        mPL: cute.Tensor,
        mKScale: cute.Tensor,
        mVScale: cute.Tensor,
        qlen: Int32,
        num_splits: Int32,
        qk_scale_log2: Float32,
        v_scale: Float32,
        Storage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        req, h, tile = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        TT = self.tile_tokens

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(Storage)
        buf_addr = ptx.smem_addr(storage.buf.data_ptr())
        full_ptr = storage.full.data_ptr()
        empty_ptr = storage.empty.data_ptr()
        tiles_ptr = storage.tiles.data_ptr()
        sPages, sBlocks, sMasks = self.union_lists(storage)
        sKvLen = storage.kvlen.get_tensor(cute.make_layout(TT))
        if warp == 0:
            if lane == 0:
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full_ptr + s, 1)
                    cute.arch.mbarrier_init(empty_ptr + s, self.empty_arrivals)
                for k in cutlass.range_constexpr(16):
                    cute.arch.mbarrier_init(tiles_ptr + k, self.consumer_threads)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        qk_scale_log2 = qk_scale_log2 * mKScale[0]
        v_scale = v_scale * mVScale[0]
        n_tok = cutlass.min(Int32(TT), qlen - tile * TT)
        n_union = self.build_union(mTopk, mBT, mKvLens, mKV, storage, sKvLen, req, h, tile, qlen, n_tok, warp, lane)
        self.trace_po = mPO
        if cutlass.const_expr(self.trace):
            if tidx == 0:
                self.stamp(TRACE_BLOCKS * 8, Int32(n_union))
                self.stamp(TRACE_BLOCKS * 8 + 1, smid())
                self.stamp(TRACE_BLOCKS * 8 + 2, globaltimer_lo())
        if warp < 4:  # warpgroup 0: Q of the tile, and the first stages' blocks
            self.stage_q(mQ, ptx.smem_addr(storage.sq.data_ptr()), req, h, tile, qlen, n_tok, qk_scale_log2, tidx)
            if tidx == 0:
                if cutlass.const_expr(not self.direct):
                    for j in range(cutlass.min(n_union, Int32(self.stages))):
                        self.issue_block(mKV, sPages, h, j, buf_addr, full_ptr)
        cute.arch.sync_threads()  # sQ (fenced) is complete
        args = (mKV, mOut, mLse, storage, sPages, sBlocks, sMasks, sKvLen, buf_addr, full_ptr, empty_ptr, tiles_ptr,
                req, h, tile, qlen, n_tok, n_union, v_scale)
        if cutlass.const_expr(self.converters == 1):
            if warp < 4:
                cute.arch.setmaxregister_decrease(self.conv_regs)
                self.convert_loop(*args, tidx, 0)
            elif warp < 8:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.mma_loop(*args, tidx - 128, 0)
            else:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.mma_loop(*args, tidx - 256, 1)
        elif cutlass.const_expr(self.ring):  # half-block tiles: warpgroup 0 converts K, 1 converts V
            if warp < 4:
                cute.arch.setmaxregister_decrease(self.conv_regs)
                if cutlass.const_expr(self.direct):
                    self.convert_loop_direct(*args, tidx, 0)
                else:
                    self.convert_loop_ring(*args, tidx, 0)
            elif warp < 8:
                cute.arch.setmaxregister_decrease(self.conv_regs)
                if cutlass.const_expr(self.direct):
                    self.convert_loop_direct(*args, tidx - 128, 1)
                else:
                    self.convert_loop_ring(*args, tidx - 128, 1)
            elif warp < 12:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.mma_loop_ring(*args, tidx - 256, 0)
            else:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.mma_loop_ring(*args, tidx - 384, 1)
        elif cutlass.const_expr(self.converters == 2):  # warpgroup 0 converts K, 1 converts V
            if warp < 4:
                cute.arch.setmaxregister_decrease(self.conv_regs)
                self.convert_loop(*args, tidx, 0)
            elif warp < 8:
                cute.arch.setmaxregister_decrease(self.conv_regs)
                self.convert_loop(*args, tidx - 128, 1)
            elif warp < 12:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.mma_loop(*args, tidx - 256, 0)
            else:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.mma_loop(*args, tidx - 384, 1)
        else:
            if warp < 4:
                self.mma_loop(*args, tidx, 0)
            else:
                if cutlass.const_expr(self.wgs > 1):
                    self.mma_loop(*args, tidx - 128, 1)

    @cute.jit
    def stamp(self, slot, value):
        """Trace word `slot` of this CTA := value (trace builds only)."""
        req, h, tile = cute.arch.block_idx()
        nreq, _, ntile = cute.arch.grid_dim()
        cta = (h * nreq + req) * ntile + tile
        st_global_b32(self.trace_po.iterator.toint() + (Int64(cta) * TRACE_WORDS + slot) * 4, value)

    @cute.jit
    def trace_block(self, i, slot: cutlass.Constexpr, tidx):
        """Thread 0 of the caller's warpgroup stamps event `slot` (0..7) of union block i."""
        if cutlass.const_expr(self.trace):
            if tidx == 0:
                if i < TRACE_BLOCKS:
                    self.stamp(8 * i + slot, globaltimer_lo())

    @cute.jit
    def issue_block(self, mKV, sPages, h, j, buf_addr, full_ptr):
        """One thread: union block j's (page, KV head) chunk -> stage j % stages (bulk copy)."""
        s = j % self.stages
        cute.arch.mbarrier_arrive_and_expect_tx(full_ptr + s, self.stage_bytes)
        chunk = Int64(sPages[j]) * self.hkv + Int64(h)
        ptx.bulk_copy_g2s(buf_addr + s * self.stage_bytes, mKV.iterator.toint() + chunk * self.stage_bytes,
                          self.stage_bytes, ptx.smem_addr(full_ptr + s))

    @cute.jit
    def release_stage_and_refill(self, mKV, sPages, h, i, n_union, buf_addr, full_ptr, empty_ptr, tidx,
                                 refills: cutlass.Constexpr):
        """This thread has read union block i's stage: arrive on its empty barrier; with `refills`,
        thread 0 then waits for every reader and copies block i + stages into it."""
        s = i % self.stages
        cute.arch.mbarrier_arrive(empty_ptr + s)
        if cutlass.const_expr(refills):
            if tidx == 0:
                if i + self.stages < n_union:
                    cute.arch.mbarrier_wait(empty_ptr + s, (i // self.stages) & 1)
                    self.issue_block(mKV, sPages, h, i + self.stages, buf_addr, full_ptr)

    @cute.jit
    def stage_q(self, mQ, q_smem, req, h, tile, qlen, n_tok, qk_scale_log2, tidx):
        """Q of the tile -> sQ (f16, scaled): thread tidx (< 128) writes half (64 dims) of row tidx // 2."""
        G = self.group
        qrow = tidx // 2
        qhalf = tidx % 2
        words = cute.make_rmem_tensor(32, Int32)
        for k in cutlass.range_constexpr(32):
            words[k] = Int32(0)
        if qrow // G < n_tok:
            t = req * qlen + tile * self.tile_tokens + qrow // G
            src = mQ.iterator.toint() + (Int64(t) * Int64(mQ.stride[0])
                                         + Int64((h * G + qrow % G) * HEAD_DIM + 64 * qhalf)) * 2
            for p in cutlass.range_constexpr(8):
                wv = ptx.ld_global_nc_v4(src + 16 * p)
                for k in cutlass.range_constexpr(4):
                    words[4 * p + k] = ptx.bf16x2_to_f16x2(wv[k], qk_scale_log2)
        for p in cutlass.range_constexpr(8):
            ptx.st_shared_v4(q_smem + swizzled(ROWS, qrow, 64 * qhalf + 8 * p),
                             words[4 * p], words[4 * p + 1], words[4 * p + 2], words[4 * p + 3])
        cute.arch.fence_view_async_shared()

    @cute.jit
    def convert_tile(self, stage, kv: cutlass.Constexpr, dst_smem, tidx):
        """The stage's fp8 K (kv = 0) or V (kv = 1) -> an f16 tile (key rows, swizzled), by 128 threads:
        thread = 16 dims of keys tidx // 8 + 16 r."""
        c8 = tidx % 8
        for r in cutlass.range_constexpr(self.page // 16 if self.convert else 0):
            key = tidx // 8 + 16 * r
            w = ptx.ld_shared_v4(stage + key * 256 + HEAD_DIM * kv + 16 * c8)
            store_f16_chunks(dst_smem + swizzled(self.page, key, 16 * c8), w, c8)
        cute.arch.fence_view_async_shared()

    @cute.jit
    def convert_loop(self, mKV, mOut, mLse, storage, sPages, sBlocks, sMasks, sKvLen, buf_addr, full_ptr, empty_ptr,
                     tiles_ptr, req, h, tile, qlen, n_tok, n_union, v_scale, tidx, cw: cutlass.Constexpr):
        """Converter warpgroup cw: block i -> the K / V tiles (with 2 converters: cw 0 the K, cw 1 the V
        tile) of MMA warpgroup i % 2; thread 0 of converter 0 refills the stage once it is read."""
        k_tiles = (ptx.smem_addr(storage.sk0.data_ptr()), ptx.smem_addr(storage.sk1.data_ptr()))
        v_tiles = (ptx.smem_addr(storage.sv0.data_ptr()), ptx.smem_addr(storage.sv1.data_ptr()))
        for i in range(n_union):
            s = i % self.stages
            b = i % 2
            use = (i // 2) & 1
            cute.arch.mbarrier_wait(full_ptr + s, (i // self.stages) & 1)
            stage = buf_addr + s * self.stage_bytes
            k_dst = k_tiles[0]
            v_dst = v_tiles[0]
            if b == 1:
                k_dst = k_tiles[1]
                v_dst = v_tiles[1]
            if cutlass.const_expr(cw == 0):
                cute.arch.mbarrier_wait(tiles_ptr + 4 * b + 1, use ^ 1)  # K tile b is free
                self.trace_block(i, 0, tidx)
                self.convert_tile(stage, 0, k_dst, tidx)
                cute.arch.mbarrier_arrive(tiles_ptr + 4 * b)
                self.trace_block(i, 1, tidx)
            if cutlass.const_expr(cw == 1 or self.converters == 1):
                cute.arch.mbarrier_wait(tiles_ptr + 4 * b + 3, use ^ 1)  # V tile b is free
                self.trace_block(i, 2, tidx)
                self.convert_tile(stage, 1, v_dst, tidx)
                cute.arch.mbarrier_arrive(tiles_ptr + 4 * b + 2)
                self.trace_block(i, 3, tidx)
            self.release_stage_and_refill(mKV, sPages, h, i, n_union, buf_addr, full_ptr, empty_ptr, tidx, cw == 0)

    def o_setup(self, sv_field, tidx, v_keys: int = 0):
        """O = P V of one MMA warpgroup (thread tidx of its 128): the MMA (P from registers, the f16
        V tile of v_keys keys (default: the page) in sv_field as an MN-major B), its fragments (P's
        for the whole page) and the O accumulator."""
        f16 = cutlass.Float16
        v_keys = v_keys or self.page
        sV_layout = _smem_layout(v_keys)
        sV = sv_field.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # V as the B operand of O = P V: (N = head dims, K = keys), head dims contiguous (MN-major)
        sVt = cute.composition(sV, cute.make_ordered_layout((HEAD_DIM, v_keys), order=(1, 0)))
        mma_o = sm90.make_trivial_tiled_mma(f16, f16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
                                            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS, HEAD_DIM),
                                            a_source=warpgroup.OperandSource.RMEM)
        thr_o = mma_o.get_slice(tidx)
        return dict(
            mma_o=mma_o, v_smem=ptx.smem_addr(sv_field.data_ptr()),
            tOrV=thr_o.make_fragment_B(thr_o.partition_B(sVt)),
            tOrP=thr_o.make_fragment_A(thr_o.partition_shape_A((ROWS, self.page))),
            acc_o=cute.make_rmem_tensor(thr_o.partition_shape_C((ROWS, HEAD_DIM)), Float32),
        )

    def mma_setup(self, storage, wg: int, tidx):
        """The MMAs, fragments and accumulators of MMA warpgroup wg (thread tidx of its 128)."""
        f16 = cutlass.Float16
        sQ_layout = _smem_layout(ROWS)
        sK_layout = _smem_layout(self.page)
        sk_field = storage.sk0 if wg == 0 else storage.sk1
        sQ = storage.sq.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = sk_field.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        mma_s = sm90.make_trivial_tiled_mma(f16, f16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                                            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS, self.page))
        thr_s = mma_s.get_slice(tidx)
        return dict(
            self.o_setup(storage.sv0 if wg == 0 else storage.sv1, tidx),
            mma_s=mma_s, thr_s=thr_s, k_smem=ptx.smem_addr(sk_field.data_ptr()),
            tSrQ=thr_s.make_fragment_A(thr_s.partition_A(sQ)), tSrK=thr_s.make_fragment_B(thr_s.partition_B(sK)),
        )

    @staticmethod
    def row_state():
        """(row max, row sum, rescale factor) of a thread's two accumulator rows: -inf, 0, unset."""
        row_max = cute.make_rmem_tensor(2, Float32)
        row_sum = cute.make_rmem_tensor(2, Float32)
        for hh in range(2):  # traced inline (not a @cute.jit function)
            row_max[hh] = -Float32.inf
            row_sum[hh] = Float32(0.0)
        return row_max, row_sum, cute.make_rmem_tensor(2, Float32)

    @cute.jit
    def pv_mma(self, mma_o, acc_o, tOrP, tOrV, p_step0: cutlass.Constexpr = 0):
        """O += P V on the warpgroup's tensor cores, over tOrV's k-steps (P's from p_step0); returns
        when it is done."""
        warpgroup.fence()
        atom_o = cute.make_mma_atom(mma_o.op)
        atom_o.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(cute.size(tOrV.shape[2])):
            cute.gemm(atom_o, acc_o, tOrP[None, None, p_step0 + k], tOrV[None, None, k], acc_o)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def mma_loop(self, mKV, mOut, mLse, storage, sPages, sBlocks, sMasks, sKvLen, buf_addr, full_ptr, empty_ptr,
                 tiles_ptr, req, h, tile, qlen, n_tok, n_union, v_scale, tidx, wg: cutlass.Constexpr):
        """MMA warpgroup wg (thread tidx of its 128): union blocks wg, wg + wgs, ...; warpgroup 0 merges and stores."""
        G = self.group
        bar = BAR_WG + wg
        nthr = self.consumer_threads
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        m = self.mma_setup(storage, wg, tidx)
        tSrQ, tSrK, tOrV, tOrP, acc_o = m["tSrQ"], m["tSrK"], m["tOrV"], m["tOrP"], m["acc_o"]
        p_words = cute.make_tensor(cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(ROWS * self.page // 256))
        for i in cutlass.range_constexpr(cute.size(acc_o)):  # O, rows 16w + g + 8hh, dims 8j + 2c + e: [e + 2hh + 4j]
            acc_o[i] = Float32(0.0)
        row_max, row_sum, alpha = self.row_state()
        for i in range(wg, n_union, self.wgs):
            use = (i // self.wgs) & 1
            blk = sBlocks[i]
            mask = sMasks[i]
            if cutlass.const_expr(self.converters > 0):
                cute.arch.mbarrier_wait(tiles_ptr + 4 * wg, use)  # K tile converted
                self.trace_block(i, 4, tidx)
            else:
                s = i % self.stages
                cute.arch.mbarrier_wait(full_ptr + s, (i // self.stages) & 1)
                stage = buf_addr + s * self.stage_bytes
                # every warp's MMAs of the previous block (readers of the K / V tiles) are done
                cute.arch.barrier(barrier_id=bar, number_of_threads=nthr)
                self.convert_tile(stage, 0, m["k_smem"], tidx)
                self.convert_tile(stage, 1, m["v_smem"], tidx)
                self.release_stage_and_refill(mKV, sPages, h, i, n_union, buf_addr, full_ptr, empty_ptr, tidx, True)
                cute.arch.barrier(barrier_id=bar, number_of_threads=nthr)
            # ---- S = Q K^T (rows: token j = row // G, head row % G; columns: the block's keys)
            acc_s = cute.make_rmem_tensor(m["thr_s"].partition_shape_C((ROWS, self.page)), Float32)
            if cutlass.const_expr(self.mma):
                warpgroup.fence()
                atom_s = cute.make_mma_atom(m["mma_s"].op)
                atom_s.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(cute.size(tSrQ.shape[2])):
                    cute.gemm(atom_s, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)
                    atom_s.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
            if cutlass.const_expr(self.converters > 0):
                cute.arch.mbarrier_arrive(tiles_ptr + 4 * wg + 1)  # K tile read
                self.trace_block(i, 5, tidx)
            if cutlass.const_expr(self.mma):
                self.softmax_cols(acc_s, acc_o, p_words, row_max, row_sum, alpha, blk, mask, sKvLen, 0, self.page,
                              warp, g, c, True)
            # ---- O += P V
            if cutlass.const_expr(self.converters > 0):
                cute.arch.mbarrier_wait(tiles_ptr + 4 * wg + 2, use)  # V tile converted
                self.trace_block(i, 6, tidx)
            if cutlass.const_expr(self.mma):
                self.pv_mma(m["mma_o"], acc_o, tOrP, tOrV)
            if cutlass.const_expr(self.converters > 0):
                cute.arch.mbarrier_arrive(tiles_ptr + 4 * wg + 3)  # V tile read
                self.trace_block(i, 7, tidx)
        self.finish(mOut, mLse, storage, acc_o, row_max, row_sum, buf_addr, req, h, tile, qlen, n_tok, v_scale,
                    tidx, warp, g, c, wg)

    @cute.jit
    def softmax_cols(self, acc_s, acc_o, p_words, row_max, row_sum, alpha, blk, mask, sKvLen, col0: cutlass.Constexpr,
                     ncols: cutlass.Constexpr, warp, g, c, rescale: cutlass.Constexpr):
        """Online softmax of rows 16w + g + 8hh of S over the block's keys col0 .. col0 + ncols (log2
        units: the scale is in Q); O rescaled now (rescale) or the factors left in alpha; P -> the A
        fragments of O = P V (k-step ks: keys 16ks + 2c (+1), (+8, +9))."""
        G = self.group
        for hh in cutlass.range_constexpr(2):
            m_row = 16 * warp + g + 8 * hh
            j_row = m_row // G
            lim = sKvLen[j_row] - blk * self.page - col0  # visible keys: col < lim
            if ((mask >> j_row) & 1) == 0:
                lim = Int32(0)
            if lim < ncols:
                for jj in cutlass.range_constexpr(ncols // 8):
                    for e in cutlass.range_constexpr(2):
                        if 8 * jj + 2 * c + e >= lim:
                            acc_s[e + 2 * hh + 4 * jj] = -Float32.inf
            mx = -Float32.inf
            for jj in cutlass.range_constexpr(ncols // 8):
                for e in cutlass.range_constexpr(2):
                    mx = cute.arch.fmax(mx, acc_s[e + 2 * hh + 4 * jj])
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 2))
            m_new = cute.arch.fmax(row_max[hh], mx)
            m_use = m_new
            if m_new == -Float32.inf:
                m_use = Float32(0.0)
            a = ptx.ex2(row_max[hh] - m_use)
            row_max[hh] = m_new
            psum = Float32(0.0)
            for jj in cutlass.range_constexpr(ncols // 8):
                for e in cutlass.range_constexpr(2):
                    p = ptx.ex2(acc_s[e + 2 * hh + 4 * jj] - m_use)
                    acc_s[e + 2 * hh + 4 * jj] = p
                    psum = psum + p
            row_sum[hh] = row_sum[hh] * a + psum
            alpha[hh] = a
            if cutlass.const_expr(rescale):
                for j in cutlass.range_constexpr(HEAD_DIM // 8):
                    for e in cutlass.range_constexpr(2):
                        acc_o[e + 2 * hh + 4 * j] = acc_o[e + 2 * hh + 4 * j] * a
            for jj in cutlass.range_constexpr(ncols // 8):  # jj = 2ks + kh
                p_words[hh + 2 * (jj % 2) + 4 * (jj // 2)] = ptx.f32x2_to_f16x2(acc_s[2 * hh + 4 * jj],
                                                                              acc_s[1 + 2 * hh + 4 * jj])

    @cute.jit
    def finish(self, mOut, mLse, storage, acc_o, row_max, row_sum, buf_addr, req, h, tile, qlen, n_tok, v_scale,
               tidx, warp, g, c, wg: cutlass.Constexpr, mPO=None, mPL=None, split=0, num_splits=1):
        """Merge the MMA warpgroups' (m, l, O) through shared memory; warpgroup 0 writes out and lse,
        or, given the plan's partials and num_splits > 1 (as the shipped union kernel does), this split's
        normalized O and log2-LSE (kernels/split_merge.py's rows (t * Hkv + h) * num_splits + split)."""
        G = self.group
        nthr = self.consumer_threads
        sRowM = storage.rowm.get_tensor(cute.make_layout(ROWS * self.wgs))
        sRowL = storage.rowl.get_tensor(cute.make_layout(ROWS * self.wgs))
        for hh in cutlass.range_constexpr(2):
            tot = row_sum[hh]
            tot = tot + cute.arch.shuffle_sync_bfly(tot, 1)
            tot = tot + cute.arch.shuffle_sync_bfly(tot, 2)
            m_row = 16 * warp + g + 8 * hh
            if c == 0:
                sRowL[ROWS * wg + m_row] = tot
                sRowM[ROWS * wg + m_row] = row_max[hh]
        o_other = buf_addr  # MMA warpgroup 1's O (every stage is read by now)
        if cutlass.const_expr(self.wgs > 1):
            cute.arch.barrier(barrier_id=BAR_ALL, number_of_threads=nthr * self.wgs)
            if cutlass.const_expr(wg == 1):
                for k in cutlass.range_constexpr(cute.size(acc_o)):
                    st_shared_f32(o_other + (k * nthr + tidx) * 4, acc_o[k])
            cute.arch.barrier(barrier_id=BAR_ALL, number_of_threads=nthr * self.wgs)
        else:
            cute.arch.barrier(barrier_id=BAR_WG, number_of_threads=nthr)
        if cutlass.const_expr(wg == 0):
            for hh in cutlass.range_constexpr(2):
                m_row = 16 * warp + g + 8 * hh
                j_row = m_row // G
                if j_row < n_tok:
                    m_all, l_all = self.merged_stats(sRowM, sRowL, m_row)
                    m_use = m_all
                    if m_all == -Float32.inf:
                        m_use = Float32(0.0)
                    inv = Float32(0.0)
                    lse2 = -Float32.inf
                    if l_all > Float32(0.0):
                        inv = v_scale / l_all
                        lse2 = m_all + ptx.lg2(l_all)
                    w_self = inv * ptx.ex2(row_max[hh] - m_use)
                    w_other = Float32(0.0)
                    if cutlass.const_expr(self.wgs > 1):
                        w_other = inv * ptx.ex2(sRowM[ROWS + m_row] - m_use)
                    t = req * qlen + tile * self.tile_tokens + j_row
                    hq = h * G + m_row % G
                    prow = Int64(0)  # this split's partial row (partials only)
                    if cutlass.const_expr(mPO is not None):
                        pidx = (t * self.hkv + h) * num_splits + split
                        prow = mPO.iterator.toint() + (Int64(pidx) * Int64(mPO.stride[0])
                                                       + Int64((m_row % G) * HEAD_DIM + 2 * c)) * 4
                        if c == 0:
                            if num_splits > 1:
                                mPL[pidx, m_row % G] = lse2
                    if c == 0:
                        if num_splits == 1:
                            mLse[t, hq] = lse2 * LN2
                    row = mOut.iterator.toint() + (Int64(t) * Int64(mOut.stride[0]) + Int64(hq * HEAD_DIM + 2 * c)) * 2
                    for j in cutlass.range_constexpr(HEAD_DIM // 8):
                        v = []
                        for e in cutlass.range_constexpr(2):
                            idx = e + 2 * hh + 4 * j
                            x = acc_o[idx] * w_self
                            if cutlass.const_expr(self.wgs > 1):
                                x = x + ld_shared_f32(o_other + (idx * nthr + tidx) * 4) * w_other
                            v.append(x)
                        if num_splits == 1:
                            st_global_b32(row + 16 * j, ptx.f32x2_to_bf16x2(v[0], v[1]))
                        else:
                            st_global_v2_f32(prow + 32 * j, v[0], v[1])

    @cute.jit
    def merged_stats(self, sRowM, sRowL, n):
        """(max, sum) of tile row n over the MMA warpgroups (log2 units, sums rescaled to the max)."""
        m_all = sRowM[n]
        l_all = sRowL[n]
        if cutlass.const_expr(self.wgs > 1):
            m1 = sRowM[ROWS + n]
            m_new = cute.arch.fmax(m_all, m1)
            m_use = m_new
            if m_new == -Float32.inf:
                m_use = Float32(0.0)
            l_all = l_all * ptx.ex2(m_all - m_use) + sRowL[ROWS + n] * ptx.ex2(m1 - m_use)
            m_all = m_new
        return m_all, l_all
