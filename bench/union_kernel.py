"""The speculative-decode union kernel, as a bench probe (issue #19: qlen tokens that share blocks).

`UnionMmaKernel` subclasses the shipped `SparseDecodeMmaKernel` (kernels/sparse_decode_mma.py)
and keeps its per-warp block math (`consume_block`, the softmax, the conversions, `load_q`);
what changes is the work of a CTA:

* one CTA per (request, KV head, tile of up to `consumer_warps` consecutive tokens of the
  request), grid (B, Hkv, ceil(qlen / warps)); no split-KV, no partials, no merge kernel (the
  plan's num_splits is ignored: every CTA writes its tokens' out / lse itself);
* the tile's valid slots (each token's, compacted as the shipped kernel does) are merged into
  the UNION of their blocks, ordered by slot rank then token (so tokens that share nothing still
  take turns), each with a bitmask of the tokens that selected it; the producer streams every
  union block ONCE;
* consumer warp w serves token w of the tile: for every union block its token selected, its
  whole 128 keys (page // keys_per_warp slices of the shipped kernel's per-warp math), with its
  own Q, kv_len mask and online softmax; it writes its token's rows itself (no cross-warp merge).
  A warp whose token did not select a block only releases the stage.

Set semantics: a block listed twice by a token is served once (the contract's key set).
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from msa_jit.compiler import kernels_package

kernels_package()
from msa_jit.kernels import common, ptx  # noqa: E402
from msa_jit.kernels.sparse_decode_mma import HEAD_DIM, LN2, SparseDecodeMmaKernel  # noqa: E402


class UnionMmaKernel(SparseDecodeMmaKernel):
    """One CTA per (request, KV head, token tile) over the union of the tile's blocks."""

    def __init__(self, *, union: bool = True, **options):
        options.setdefault("softmax", "lean")
        super().__init__(**options)
        if self.staged:
            raise ValueError("the union probe reads K / V per block (smem_reads='block')")
        self.slices = self.page // self.keys_per_warp  # a warp's whole block, keys_per_warp at a time
        # every consumer thread arrives once per slice (a warp that skips the block: all at once)
        self.empty_arrivals = self.consumer_threads * self.slices
        self.tile_tokens = self.warps  # tokens per CTA: one per consumer warp
        self.union_max = self.tile_tokens * self.topk
        self.buf_bytes = self.stages * self.stage_bytes  # no cross-warp reduction buffer

    def storage_type(self):
        @cute.struct
        class Storage:
            buf: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.buf_bytes], 1024]
            full: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            empty: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            tok_pages: cute.struct.MemRange[Int32, 32 * self.tile_tokens]
            tok_blocks: cute.struct.MemRange[Int32, 32 * self.tile_tokens]
            ballots: cute.struct.MemRange[Int32, self.tile_tokens]
            pages: cute.struct.MemRange[Int32, self.union_max]
            blocks: cute.struct.MemRange[Int32, self.union_max]
            masks: cute.struct.MemRange[Int32, self.union_max]

        return Storage

    @cute.jit
    def __call__(
        self,
        query: cute.Tensor,
        kv_cache: cute.Tensor,
        topk: cute.Tensor,
        block_table: cute.Tensor,
        kv_lens: cute.Tensor,
        out: cute.Tensor,
        lse: cute.Tensor,
        partial_o: cute.Tensor,
        partial_lse: cute.Tensor,
        k_scale_tensor: cute.Tensor,
        v_scale_tensor: cute.Tensor,
        qlen: Int32,
        num_splits: Int32,
        qk_scale_log2: Float32,
        v_scale: Float32,
        stream: cuda.CUstream,
    ):
        """The shipped calling convention; one launch, grid (requests, Hkv, token tiles)."""
        num_tokens = query.shape[0]
        self.kernel(
            query, kv_cache, topk, block_table, kv_lens, out, lse, partial_o, partial_lse, k_scale_tensor,
            v_scale_tensor, qlen, num_splits, qk_scale_log2, v_scale, self.storage_type(),
        ).launch(
            grid=((num_tokens + qlen - 1) // qlen, self.hkv, (qlen + self.tile_tokens - 1) // self.tile_tokens),
            block=(self.threads, 1, 1),
            stream=stream,
            preferred_smem_carveout=100,
            use_pdl=self.pdl,
            **self.launch_options(),
        )

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

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(Storage)
        buf_addr = ptx.smem_addr(storage.buf.data_ptr())
        full_ptr = storage.full.data_ptr()
        empty_ptr = storage.empty.data_ptr()
        sPages, sBlocks, sMasks = self.union_lists(storage)
        if warp == 0:
            if lane == 0:
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full_ptr + s, 1)
                    cute.arch.mbarrier_init(empty_ptr + s, self.empty_arrivals)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        qk_scale_log2 = qk_scale_log2 * mKScale[0] * self.kv_fold
        v_scale = v_scale * mVScale[0] * self.kv_fold

        # token of consumer warp w: req * qlen + tile * warps + w, if the tile has it
        n_tok = cutlass.min(Int32(self.tile_tokens), qlen - tile * self.tile_tokens)
        t = req * qlen + tile * self.tile_tokens + warp
        active = warp < n_tok
        kv_len = Int32(0)
        if active:
            kv_len = mKvLens[t]
        n_union = self.build_union(mTopk, mBT, mKvLens, mKV, storage, None, req, h, tile, qlen, n_tok, warp, lane)

        if warp == self.warps:
            # ---- 3a. producer: every union block once
            if lane == 0:
                common.stream_pages(mKV, sPages, h, Int32(0), n_union, buf_addr, full_ptr, empty_ptr,
                                    self.stages, self.stage_bytes, self.hkv)
        else:
            # ---- 3b. consumer warp: its token over the union blocks it selected
            self.consume_union(mQ, mOut, mLse, sBlocks, sMasks, buf_addr, full_ptr, empty_ptr,
                               t, h, warp, lane, kv_len, n_union, active, qk_scale_log2, v_scale)

    def union_lists(self, storage):
        """(pages, blocks, token masks) of the tile's union: shared-memory tensors of union_max int32."""
        return tuple(f.get_tensor(cute.make_layout(self.union_max)) for f in (storage.pages, storage.blocks,
                                                                             storage.masks))

    @cute.jit
    def build_union(self, mTopk, mBT, mKvLens, mKV, storage, sKvLen, req, h, tile, qlen, n_tok, warp, lane):
        """The tile's union of blocks -> union_lists(storage)[0, n): returns n (every thread).

        Token j of the tile (j < tile_tokens) is compacted by consumer warp j % warps (its valid
        slots, as the shipped kernel does, -1 past them); then lane l of that warp owns token j's
        slot l: its block is a union entry unless an earlier (slot rank, token) holds the same
        block, and its mask has bit j' for every token j' that selected it. sKvLen (optional)
        gets each token's kv_len (0 past the tile).
        """
        TT = self.tile_tokens
        per_warp = TT // self.warps
        sTokPages = storage.tok_pages.get_tensor(cute.make_layout(32 * TT))
        sTokBlocks = storage.tok_blocks.get_tensor(cute.make_layout(32 * TT))
        sBallots = storage.ballots.get_tensor(cute.make_layout(TT))
        sPages, sBlocks, sMasks = self.union_lists(storage)
        if warp < self.warps:
            for k in cutlass.range_constexpr(per_warp):
                j = warp + self.warps * k
                sTokBlocks[j * 32 + lane] = Int32(-1)
                cute.arch.sync_warp()
                kv_len = Int32(0)
                if j < n_tok:
                    t = req * qlen + tile * TT + j
                    kv_len = mKvLens[t]
                    tok_pages = cute.make_tensor(sTokPages.iterator + j * 32, cute.make_layout(32))
                    tok_blocks = cute.make_tensor(sTokBlocks.iterator + j * 32, cute.make_layout(32))
                    common.compact_valid_slots(mTopk, mBT, t, h, req, kv_len, mKV.shape[0], lane, tok_pages,
                                               tok_blocks, self.topk, self.page)
                if cutlass.const_expr(sKvLen is not None):
                    if lane == 0:
                        sKvLen[j] = kv_len
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        my_blk = cute.make_rmem_tensor(per_warp, Int32)
        my_page = cute.make_rmem_tensor(per_warp, Int32)
        my_mask = cute.make_rmem_tensor(per_warp, Int32)
        unique = cute.make_rmem_tensor(per_warp, Int32)
        for k in cutlass.range_constexpr(per_warp):
            my_blk[k] = Int32(-1)
            my_page[k] = Int32(0)
            my_mask[k] = Int32(0)
            unique[k] = Int32(0)
        if warp < self.warps:
            for k in cutlass.range_constexpr(per_warp):
                j = warp + self.warps * k
                if lane < self.topk:
                    my_blk[k] = sTokBlocks[j * 32 + lane]
                    my_page[k] = sTokPages[j * 32 + lane]
                my_key = lane * TT + j  # union order: slot rank, then token
                b_mine = my_blk[k]
                mask = Int32(0)
                dup = Int32(0)
                for j2 in range(TT):
                    for kk in cutlass.range_constexpr(self.topk):
                        if sTokBlocks[j2 * 32 + kk] == b_mine:
                            mask = mask | (Int32(1) << j2)
                            if kk * TT + j2 < my_key:
                                dup = Int32(1)
                my_mask[k] = mask
                if b_mine >= 0:
                    if dup == 0:
                        unique[k] = Int32(1)
                ballot = cute.arch.vote_ballot_sync(unique[k] != 0)
                if lane == 0:
                    sBallots[j] = Int32(ballot)
        cute.arch.sync_threads()
        n_union = Int32(0)
        for j in cutlass.range_constexpr(TT):
            n_union = n_union + cute.arch.popc(sBallots[j])
        if warp < self.warps:
            for k in cutlass.range_constexpr(per_warp):
                j = warp + self.warps * k
                if unique[k] != 0:
                    rank = Int32(0)
                    for j2 in cutlass.range_constexpr(TT):
                        bj = sBallots[j2]
                        rank = rank + cute.arch.popc(bj & cute.arch.lanemask_lt())
                        if j2 < j:
                            rank = rank + ((bj >> lane) & 1)
                    sPages[rank] = my_page[k]
                    sBlocks[rank] = my_blk[k]
                    sMasks[rank] = my_mask[k]
        cute.arch.sync_threads()
        return n_union

    @cute.jit
    def consume_union(self, mQ, mOut, mLse, sBlocks, sMasks, buf_addr, full_ptr, empty_ptr,
                      t, h, warp, lane, kv_len, n_union, active, qk_scale_log2, v_scale):
        g = lane // 4
        c = lane % 4
        qa = cute.make_rmem_tensor(32, Int32)
        if active:
            self.load_q(mQ, qa, t, h, g, c, qk_scale_log2)
        acc = cute.make_rmem_tensor(64, Float32)
        for i in cutlass.range_constexpr(64):
            acc[i] = Float32(0.0)
        row_max = cute.make_rmem_tensor(2, Float32)
        row_sum = cute.make_rmem_tensor(2, Float32)
        for r in cutlass.range_constexpr(2):
            row_max[r] = -Float32.inf
            row_sum[r] = Float32(0.0)
        scale = Float32(1.0) if self.scale_in_q else qk_scale_log2
        for i in range(n_union):
            s = i % self.stages
            phase = (i // self.stages) & 1
            cute.arch.mbarrier_wait(full_ptr + s, phase)
            if ((sMasks[i] >> warp) & 1) != 0:
                stage = buf_addr + s * self.stage_bytes
                blk = sBlocks[i]
                for j in range(self.slices):  # each slice releases once (consume_block)
                    self.consume_block(qa, 0, acc, row_max, row_sum, stage, empty_ptr + s, blk, kv_len, scale,
                                       j * self.keys_per_warp, g, c, lane)
            else:
                cute.arch.mbarrier_arrive(empty_ptr + s, arrive_count=self.slices)
        if active:
            self.store_token(mOut, mLse, acc, row_max, row_sum, t, h, g, c, v_scale)

    @cute.jit
    def store_token(self, mOut, mLse, acc, row_max, row_sum, t, h, g, c, v_scale):
        """This warp's token: rows g, g + 8 of the group, dims [32c, 32c + 32) of each (acc's
        n-tile nt, column 2c + col holds dim 32c + 16col + nt), 16-byte bf16 stores."""
        G = self.group
        for r in cutlass.range_constexpr(2):
            tot = row_sum[r]
            tot = tot + cute.arch.shuffle_sync_bfly(tot, 1)
            tot = tot + cute.arch.shuffle_sync_bfly(tot, 2)
            inv = Float32(0.0)
            lse2 = -Float32.inf
            if tot > Float32(0.0):
                inv = v_scale / tot
                lse2 = row_max[r] + ptx.lg2(tot)
            row = g + 8 * r
            if row < G:
                hq = h * G + row
                dst = mOut.iterator.toint() + (Int64(t) * Int64(mOut.stride[0]) + Int64(hq * HEAD_DIM + 32 * c)) * 2
                for q in cutlass.range_constexpr(4):  # dims 32c + 8q .. + 8
                    col = q // 2
                    nt0 = 8 * (q % 2)
                    w = [ptx.f32x2_to_bf16x2(acc[4 * (nt0 + 2 * k) + 2 * r + col] * inv,
                                             acc[4 * (nt0 + 2 * k + 1) + 2 * r + col] * inv) for k in range(4)]
                    ptx.st_global_v4(dst + 16 * q, w[0], w[1], w[2], w[3])
                if c == 0:
                    mLse[t, hq] = lse2 * LN2
