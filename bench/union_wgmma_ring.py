"""The half-block ("ring") variants of the wgmma union probe (bench/union_wgmma.py), as a subclass.

`UnionWgmmaRingKernel(ring=True, converter=2, ...)`: K / V tiles of 64 keys, two per MMA warpgroup
(tile (b, hf): half hf of MMA warpgroup b's block), so the converters fill the next block's first
half while a warpgroup works on the second; S of both halves is issued together and the softmax of
half 0 runs under S of half 1. `direct=True`: the converters load the fp8 bytes from global memory
one block ahead (no bulk copy, no shared-memory read). Measured in docs/performance.md row 55 (g),
(h): correct, not faster.
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup

from union_wgmma import HEAD_DIM, ROWS, UnionWgmmaKernel, _smem_layout, ptx, store_f16_chunks, swizzled


class UnionWgmmaRingKernel(UnionWgmmaKernel):
    """UnionWgmmaKernel with half-block K / V tiles (ring=True) and optionally direct converter loads.

    slots=2: two half tiles of K and of V per MMA warpgroup (128 KiB); slots=1: one of each (64 KiB),
    used for both halves in turn, so that four fp8 stages fit (the trace of row 55: two stages hold
    the stream back)."""

    def __init__(self, *, slots: int = 2, **options):
        super().__init__(**options)
        if slots not in (1, 2):
            raise ValueError("slots must be 1 or 2")
        self.slots = slots
        self.kv_tile_elems = 64 * HEAD_DIM * slots
        # S of half 1 after the softmax of half 0 where its K tile is not there yet (one slot) or
        # the registers are short (direct)
        self.s_serial = self.direct or slots == 1

    def slot_bar(self, kind: int, b, hf: int):
        """Barrier offset of kind (0: K full, 1: K empty, 2: V full, 3: V empty) of tile (b, hf)."""
        return 4 * kind + 2 * b + (hf if self.slots == 2 else 0)

    def slot_parity(self, i, hf: int):
        """Phase parity of tile (b, hf)'s full barrier for union block i of MMA warpgroup b."""
        return (i // 2) & 1 if self.slots == 2 else hf

    def slot_offset(self, hf: int) -> int:
        return hf * self.HALF_TILE_BYTES if self.slots == 2 else 0

    # ------------------------------------------------------------------ ring=True: half-block tiles
    # Tile (b, hf) = half hf (keys 64hf ..) of MMA warpgroup b's block; its K tile is bytes
    # [hf * 16 KiB, +16 KiB) of sk{b}, its V tile of sv{b}; barriers at tiles_ptr + 4 * kind + 2b + hf
    # (kind 0: K full, 1: K empty, 2: V full, 3: V empty)
    HALF_TILE_BYTES = 64 * HEAD_DIM * 2

    @cute.jit
    def convert_loop_ring(self, mKV, mOut, mLse, storage, sPages, sBlocks, sMasks, sKvLen, buf_addr, full_ptr,
                          empty_ptr, tiles_ptr, req, h, tile, qlen, n_tok, n_union, v_scale, tidx, cw: cutlass.Constexpr):
        """Converter cw (0: K, 1: V): block i's two halves -> the tiles of MMA warpgroup i % 2."""
        field0 = storage.sk0 if cutlass.const_expr(cw == 0) else storage.sv0
        field1 = storage.sk1 if cutlass.const_expr(cw == 0) else storage.sv1
        base0 = ptx.smem_addr(field0.data_ptr())
        base1 = ptx.smem_addr(field1.data_ptr())
        c8 = tidx % 8
        for i in range(n_union):
            s = i % self.stages
            b = i % 2
            cute.arch.mbarrier_wait(full_ptr + s, (i // self.stages) & 1)
            stage = buf_addr + s * self.stage_bytes
            base = base0
            if b == 1:
                base = base1
            for hf in cutlass.range_constexpr(2):
                cute.arch.mbarrier_wait(tiles_ptr + self.slot_bar(2 * cw + 1, b, hf), self.slot_parity(i, hf) ^ 1)
                dst_tile = base + self.slot_offset(hf)
                for r in cutlass.range_constexpr(4 if self.convert else 0):
                    key = tidx // 8 + 16 * r
                    w = ptx.ld_shared_v4(stage + (64 * hf + key) * 256 + HEAD_DIM * cw + 16 * c8)
                    store_f16_chunks(dst_tile + swizzled(ROWS, key, 16 * c8), w, c8)
                cute.arch.fence_view_async_shared()
                cute.arch.mbarrier_arrive(tiles_ptr + self.slot_bar(2 * cw, b, hf))  # tile full
            self.release_stage_and_refill(mKV, sPages, h, i, n_union, buf_addr, full_ptr, empty_ptr, tidx, cw == 0)

    @cute.jit
    def prefetch_block(self, mKV, sPages, h, i, cw: cutlass.Constexpr, raw, tidx):
        """Converter cw's 128 bytes of union block i (K or V of keys tidx // 8 + 16r + 64hf, 16 bytes
        at dim 16 * (tidx % 8)) from global memory into raw[32]."""
        chunk = Int64(sPages[i]) * self.hkv + Int64(h)
        base = mKV.iterator.toint() + chunk * self.stage_bytes + HEAD_DIM * cw + 16 * (tidx % 8)
        for hf in cutlass.range_constexpr(2):
            for r in cutlass.range_constexpr(4):
                key = 64 * hf + tidx // 8 + 16 * r
                w = ptx.ld_global_nc_v4(base + Int64(key) * 256)
                for k in cutlass.range_constexpr(4):
                    raw[16 * hf + 4 * r + k] = w[k]

    @cute.jit
    def convert_loop_direct(self, mKV, mOut, mLse, storage, sPages, sBlocks, sMasks, sKvLen, buf_addr, full_ptr,
                            empty_ptr, tiles_ptr, req, h, tile, qlen, n_tok, n_union, v_scale, tidx,
                            cw: cutlass.Constexpr):
        """Converter cw (0: K, 1: V), ring tiles, loading block i + 1 from global memory while it
        converts block i (blocks in pairs so that the register buffers are static)."""
        raws = [cute.make_rmem_tensor(32, Int32) for _ in range(2)]
        if n_union > 0:
            self.prefetch_block(mKV, sPages, h, 0, cw, raws[0], tidx)
        c8 = tidx % 8
        for i0 in range(0, n_union, 2):
            for u in cutlass.range_constexpr(2):  # block i = i0 + u goes to MMA warpgroup u
                i = i0 + u
                if i < n_union:
                    if i + 1 < n_union:
                        self.prefetch_block(mKV, sPages, h, i + 1, cw, raws[1 - u], tidx)
                    cur = raws[u]
                    field = (storage.sk0 if u == 0 else storage.sk1) if cw == 0 else (storage.sv0 if u == 0 else storage.sv1)
                    base = ptx.smem_addr(field.data_ptr())
                    for hf in cutlass.range_constexpr(2):
                        cute.arch.mbarrier_wait(tiles_ptr + self.slot_bar(2 * cw + 1, u, hf),
                                                self.slot_parity(i, hf) ^ 1)  # tile free
                        for r in cutlass.range_constexpr(4 if self.convert else 0):
                            key = tidx // 8 + 16 * r
                            w = [cur[16 * hf + 4 * r + k] for k in range(4)]
                            store_f16_chunks(base + self.slot_offset(hf) + swizzled(ROWS, key, 16 * c8), w, c8)
                        cute.arch.fence_view_async_shared()
                        cute.arch.mbarrier_arrive(tiles_ptr + self.slot_bar(2 * cw, u, hf))  # tile full

    @cute.jit
    def mma_loop_ring(self, mKV, mOut, mLse, storage, sPages, sBlocks, sMasks, sKvLen, buf_addr, full_ptr, empty_ptr,
                      tiles_ptr, req, h, tile, qlen, n_tok, n_union, v_scale, tidx, wg: cutlass.Constexpr):
        """MMA warpgroup wg over half blocks: S of both halves issued together, the softmax of half 0
        under S of half 1, the softmax of half 1 under P V of half 0."""
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        f16 = cutlass.Float16
        lay = _smem_layout(ROWS)  # a (64, 128) tile: Q, and each half-block K / V tile
        sk_field = storage.sk0 if cutlass.const_expr(wg == 0) else storage.sk1
        sv_field = storage.sv0 if cutlass.const_expr(wg == 0) else storage.sv1
        sQ = storage.sq.get_tensor(lay.outer, swizzle=lay.inner)
        sK = sk_field.get_tensor(cute.append(lay.outer, cute.make_layout(2, stride=ROWS * HEAD_DIM)), swizzle=lay.inner)
        sV = sv_field.get_tensor(cute.append(lay.outer, cute.make_layout(2, stride=ROWS * HEAD_DIM)), swizzle=lay.inner)
        mma_s = sm90.make_trivial_tiled_mma(f16, f16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                                            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS, 64))
        mma_o = sm90.make_trivial_tiled_mma(f16, f16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
                                            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS, HEAD_DIM),
                                            a_source=warpgroup.OperandSource.RMEM)
        thr_s = mma_s.get_slice(tidx)
        thr_o = mma_o.get_slice(tidx)
        tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ))
        tSrK = [thr_s.make_fragment_B(thr_s.partition_B(sK[None, None, hf if self.slots == 2 else 0]))
                for hf in range(2)]
        sVt = [cute.composition(sV[None, None, hf if self.slots == 2 else 0],
                                cute.make_ordered_layout((HEAD_DIM, 64), order=(1, 0))) for hf in range(2)]
        tOrV = [thr_o.make_fragment_B(thr_o.partition_B(v)) for v in sVt]
        tOrP = [thr_o.make_fragment_A(thr_o.partition_shape_A((ROWS, 64))) for _ in range(2)]
        p_words = [cute.make_tensor(cute.recast_ptr(p.iterator, dtype=Int32), cute.make_layout(16)) for p in tOrP]
        acc_o = cute.make_rmem_tensor(thr_o.partition_shape_C((ROWS, HEAD_DIM)), Float32)
        for k in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[k] = Float32(0.0)
        row_max = cute.make_rmem_tensor(2, Float32)
        row_sum = cute.make_rmem_tensor(2, Float32)
        for hh in cutlass.range_constexpr(2):
            row_max[hh] = -Float32.inf
            row_sum[hh] = Float32(0.0)
        alpha1 = cute.make_rmem_tensor(2, Float32)
        for i in range(wg, n_union, self.wgs):
            blk = sBlocks[i]
            mask = sMasks[i]
            # direct: S of half 1 after the softmax of half 0 (its accumulators reuse half 0's
            # registers: the converters need theirs for the loads in flight)
            acc_s = [cute.make_rmem_tensor(thr_s.partition_shape_C((ROWS, 64)), Float32) for _ in range(2)]
            for hf in cutlass.range_constexpr(1 if self.s_serial else 2):
                self.issue_s_half(tiles_ptr, wg, hf, i, mma_s, acc_s[hf], tSrQ, tSrK[hf])
            if cutlass.const_expr(self.mma):
                warpgroup.wait_group(0 if self.s_serial else 1)
            cute.arch.mbarrier_arrive(tiles_ptr + self.slot_bar(1, wg, 0))  # K half 0 read
            if cutlass.const_expr(self.mma):
                self.softmax_cols(acc_s[0], acc_o, p_words[0], row_max, row_sum, alpha1, blk, mask, sKvLen, 0, 64,
                                  warp, g, c, True)
            if cutlass.const_expr(self.s_serial):
                self.issue_s_half(tiles_ptr, wg, 1, i, mma_s, acc_s[1], tSrQ, tSrK[1])
            cute.arch.mbarrier_wait(tiles_ptr + self.slot_bar(2, wg, 0), self.slot_parity(i, 0))  # V half 0 converted
            if cutlass.const_expr(self.mma):
                warpgroup.fence()
                atom_o = cute.make_mma_atom(mma_o.op)
                atom_o.set(warpgroup.Field.ACCUMULATE, True)
                for k in cutlass.range_constexpr(cute.size(tOrP[0].shape[2])):
                    cute.gemm(atom_o, acc_o, tOrP[0][None, None, k], tOrV[0][None, None, k], acc_o)
                warpgroup.commit_group()
                warpgroup.wait_group(1)  # S of half 1 done (P V of half 0 may still run)
            cute.arch.mbarrier_arrive(tiles_ptr + self.slot_bar(1, wg, 1))  # K half 1 read
            if cutlass.const_expr(self.mma):
                self.softmax_cols(acc_s[1], acc_o, p_words[1], row_max, row_sum, alpha1, blk, mask, sKvLen, 64, 64,
                                  warp, g, c, False)
                warpgroup.wait_group(0)  # P V of half 0 done: O may be rescaled
            cute.arch.mbarrier_arrive(tiles_ptr + self.slot_bar(3, wg, 0))  # V half 0 read
            if cutlass.const_expr(self.mma):
                for hh in cutlass.range_constexpr(2):
                    for j in cutlass.range_constexpr(HEAD_DIM // 8):
                        for e in cutlass.range_constexpr(2):
                            acc_o[e + 2 * hh + 4 * j] = acc_o[e + 2 * hh + 4 * j] * alpha1[hh]
            cute.arch.mbarrier_wait(tiles_ptr + self.slot_bar(2, wg, 1), self.slot_parity(i, 1))  # V half 1 converted
            if cutlass.const_expr(self.mma):
                warpgroup.fence()
                atom_o1 = cute.make_mma_atom(mma_o.op)
                atom_o1.set(warpgroup.Field.ACCUMULATE, True)
                for k in cutlass.range_constexpr(cute.size(tOrP[1].shape[2])):
                    cute.gemm(atom_o1, acc_o, tOrP[1][None, None, k], tOrV[1][None, None, k], acc_o)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
            cute.arch.mbarrier_arrive(tiles_ptr + self.slot_bar(3, wg, 1))  # V half 1 read
        self.finish(mOut, mLse, storage, acc_o, row_max, row_sum, buf_addr, req, h, tile, qlen, n_tok, v_scale,
                    tidx, warp, g, c, wg)

    @cute.jit
    def issue_s_half(self, tiles_ptr, wg, hf: cutlass.Constexpr, i, mma_s, acc, tSrQ, tSrK_hf):
        """Wait for K half hf of union block i (this warpgroup's), then issue S of that half (one commit group)."""
        cute.arch.mbarrier_wait(tiles_ptr + self.slot_bar(0, wg, hf), self.slot_parity(i, hf))  # K half hf converted
        if cutlass.const_expr(self.mma):
            warpgroup.fence()
            atom_s = cute.make_mma_atom(mma_s.op)
            atom_s.set(warpgroup.Field.ACCUMULATE, False)
            for k in cutlass.range_constexpr(cute.size(tSrQ.shape[2])):
                cute.gemm(atom_s, acc, tSrQ[None, None, k], tSrK_hf[None, None, k], acc)
                atom_s.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
