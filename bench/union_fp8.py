"""The union kernel with S on fp8 warpgroup MMAs straight from the cache's K, as a bench probe
(issue #19's speculative decode; docs/performance.md row 66).

bench/union_wgmma.py converts every union block's K and V to f16 tiles before its MMAs, and
row 55 measured that conversion as what the design waits on: the f16 tiles take the shared
memory that should hold fp8 stages in flight. Here K is never converted:
`wgmma.m64n128k32.f32.e4m3.e4m3` reads both operands K-major from shared memory, and the
cache's K half of a (page, KV head) is exactly a K-major tile (key rows of 128 bytes), only
interleaved with V at a 256-byte row stride. So each stage is filled by two TMA copies (boxes
of 128 keys x 128 bytes over the cache viewed as (key, byte, KV head, page), 128B swizzle),
which lay K and V down dense and swizzled: K is then the B operand of S as it lies. Only V is
converted (fp8 -> an f16 tile per MMA warpgroup, as union_wgmma's O = P V takes it), while the
block's S MMAs run.

The query: an fp8 query (vLLM's call) is the A operand as given; a bf16 query is split per row
into s * (hi + lo), hi = e4m3(q / s), lo = e4m3(q / s - hi), s = amax / 448: two QGMMA chains
into one accumulator, scaled per row (rel L2 <= 3.4e-3 in bench/split_q_error.py's model,
against 1e-2 allowed; e4m3 alone would be 1e-2..1e-1).

Shared memory: 4 stages x 32 KiB (K and V) + Q (8 KiB, 16 split) + 2 f16 V tiles (64 KiB) =
200-208 KiB, against union_wgmma's 2 stages beside 128 KiB of f16 tiles (row 55: >= ~110 KiB of
fp8 in flight per SM is what the stream needs).

trace=True: thread 0 of each MMA warpgroup stamps %globaltimer at 7 events of each block
(bench/union_trace.py --events fp8).

Roles: two MMA warpgroups take the union blocks in turn (block i: warpgroup i % 2); each
converts its block's V, and its thread 0 refills the stage once the warpgroup has read it.
v_converter=True: a third warpgroup converts every V instead. warpgroups=1: one MMA warpgroup
and 2 stages per CTA, 2 CTAs per SM (108-110 KiB each with an fp8 query; a bf16 query's two Q tiles
fit only with v_halves=True, V converted and multiplied in two 64-key halves: 100-102 KiB). Probe options (timing only,
results wrong): convert=False leaves V unconverted, mma=False skips the MMAs.
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # the wgmma helpers check the arch while tracing

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90  # noqa: E402
from cutlass import Float32, Int32, Int64  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from kernel_probes import globaltimer_lo, smid  # noqa: E402
from union_kernel import ptx  # noqa: E402
from union_wgmma import BAR_WG, ROWS, TRACE_BLOCKS, UnionWgmmaKernel, store_f16_chunks, swizzled  # noqa: E402
from msa_jit.kernels import common  # noqa: E402
from msa_jit.kernels.sparse_decode_mma import HEAD_DIM  # noqa: E402
from msa_jit.kernels.split_merge import SplitMergeKernel  # noqa: E402

ROW_BYTES = 2 * HEAD_DIM  # a key row of the fp8 cache: K bytes [0, 128), V bytes [128, 256)
E4M3_MAX = 448.0
AMAX_MIN = 2.0 ** -100  # a row below it is zero in e4m3 (its S is ~0 in the reference too)


@dsl_user_op
def bf16x2_absmax(w: Int32, *, loc=None, ip=None) -> Float32:
    """max(|a|, |b|) of the two bf16 in w, as f32."""
    return Float32(ptx._asm(
        T.f32(), [Int32(w).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 t0, t1; .reg .f32 x0, x1; and.b32 t0, $1, 0x7fff0000; shl.b32 t1, $1, 16;"
        " and.b32 t1, t1, 0x7fff0000; mov.b32 x0, t0; mov.b32 x1, t1; max.f32 $0, x0, x1; }",
        "=f,r"))


@dsl_user_op
def bf16x4_to_e4m3_hi_lo(w0: Int32, w1: Int32, inv: Float32, *, loc=None, ip=None):
    """The 4 bf16 of (w0, w1) (memory order) times inv, split into two e4m3 words, hi + lo = x to
    ~8 significant bits: hi = e4m3(x), lo = e4m3(x - hi) (bytes in memory order)."""
    text = (
        "{ .reg .b32 t0, t1, t2, t3, f0, f1; .reg .f32 a0, a1, a2, a3, h0, h1, h2, h3;"
        " .reg .b16 p0, p1, q0, q1; .reg .f16 g0, g1, g2, g3;"
        " shl.b32 t0, $2, 16; and.b32 t1, $2, 0xffff0000; shl.b32 t2, $3, 16; and.b32 t3, $3, 0xffff0000;"
        " mov.b32 a0, t0; mov.b32 a1, t1; mov.b32 a2, t2; mov.b32 a3, t3;"
        " mul.f32 a0, a0, $4; mul.f32 a1, a1, $4; mul.f32 a2, a2, $4; mul.f32 a3, a3, $4;"
        " cvt.rn.satfinite.e4m3x2.f32 p0, a1, a0; cvt.rn.satfinite.e4m3x2.f32 p1, a3, a2;"
        " mov.b32 $0, {p0, p1};"
        " cvt.rn.f16x2.e4m3x2 f0, p0; cvt.rn.f16x2.e4m3x2 f1, p1;"
        " mov.b32 {g0, g1}, f0; mov.b32 {g2, g3}, f1;"
        " cvt.f32.f16 h0, g0; cvt.f32.f16 h1, g1; cvt.f32.f16 h2, g2; cvt.f32.f16 h3, g3;"
        " sub.f32 a0, a0, h0; sub.f32 a1, a1, h1; sub.f32 a2, a2, h2; sub.f32 a3, a3, h3;"
        " cvt.rn.satfinite.e4m3x2.f32 q0, a1, a0; cvt.rn.satfinite.e4m3x2.f32 q1, a3, a2;"
        " mov.b32 $1, {q0, q1}; }"
    )
    st = ptx._asm(llvm.StructType.get_literal([T.i32()] * 2),
                  [Int32(w0).ir_value(loc=loc, ip=ip), Int32(w1).ir_value(loc=loc, ip=ip),
                   Float32(inv).ir_value(loc=loc, ip=ip)], text, "=r,=r,r,r,f")
    return tuple(Int32(llvm.extractvalue(T.i32(), st, [i], loc=loc, ip=ip)) for i in range(2))


def fp8_tile_layout(rows: int, stages: int = 0):
    """The 128B-swizzled K-major layout of (rows, 128) fp8 tiles (one 128-byte row per key or
    query row, 1024-byte swizzle atoms), with a stage mode when `stages`."""
    f8 = cutlass.Float8E4M3FN
    atom = warpgroup.make_smem_layout_atom(sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, f8, HEAD_DIM), f8)
    if stages:
        return cute.tile_to_shape(atom, (rows, HEAD_DIM, stages), order=(0, 1, 2))
    return cute.tile_to_shape(atom, (rows, HEAD_DIM), order=(0, 1))


@cute.jit
def swizzled_fp8(row, col):
    """Byte offset of (row, col) in an fp8_tile_layout tile (col % 16 == 0): 128-byte rows, the
    16-byte chunk index xor row % 8."""
    b = row * HEAD_DIM + col
    return b ^ ((b >> 3) & 0x70)


class UnionFp8Kernel(UnionWgmmaKernel):
    """One CTA per (request, KV head, 64 // G tokens): S on fp8 wgmma from the TMA'd K."""

    def __init__(self, *, union_fp8: bool = True, stages: int | None = None, warpgroups: int = 2,
                 convert: bool = True, mma: bool = True, v_converter: bool = False, v_halves: bool = False,
                 **options):
        options.pop("union_wgmma", None)
        self.query_dtype = options.get("q_dtype", "bfloat16")  # both: an fp8 query as given, bf16 split
        # warpgroups=1: one MMA warpgroup and 2 stages per CTA, 2 CTAs per SM (the same stages and MMA
        # warpgroups per SM as the default 1 x 2 x 4 stages, in one wave of 2 x 132 CTAs where that
        # takes two, so one CTA's index chain and first copies overlap the other's stream); fp8 query
        stages = stages or (4 if warpgroups == 2 else 2)
        if warpgroups == 2 and stages % 2:
            # blocks i and i + stages share a stage; with an odd count they go to different MMA
            # warpgroups, and block i's warpgroup could reach block i + 2 stages while i + stages'
            # copy is in flight: its full-barrier wait would pass on the phase of the same parity
            raise ValueError(f"stages={stages}: two MMA warpgroups need an even stage count")
        super().__init__(stages=stages, warpgroups=warpgroups,
                         converter=int(v_converter), convert=convert, mma=mma, **options)
        # v_converter: a third warpgroup (0) converts every block's V into the f16 tile of the MMA
        # warpgroup that takes the block (i % 2), handed over by mbarriers; a stage is read by the
        # converter (V) and by one MMA warpgroup (K), whose thread 0 refills it
        self.v_converter = bool(v_converter)
        self.empty_arrivals = self.consumer_threads * (2 if v_converter else 1)
        # a bf16 query: each row as s * (hi + lo), hi and lo e4m3 tiles, s = amax / 448 per row; S is
        # two QGMMA chains into one accumulator, then scaled per row (~8 significant bits of Q, as bf16)
        self.split_q = not self.q_fp8
        self.tile_bytes = self.page * HEAD_DIM  # a K or V tile of a stage (fp8)
        if self.stage_bytes != 2 * self.tile_bytes:
            raise ValueError("the fp8 union probe needs the fp8 cache's 256-byte key rows")
        # v_halves (warpgroups=1): V converted and multiplied in two 64-key halves through a 16 KiB
        # f16 tile, so a bf16 query's two Q tiles fit 2 CTAs per SM too (the stage is held until its
        # second half is converted)
        self.v_keys = self.page // 2 if v_halves else self.page
        if v_halves and (warpgroups != 1 or v_converter):
            raise ValueError("v_halves needs warpgroups=1 and no V converter")
        if warpgroups == 1:
            if self.split_q and not v_halves:  # its two Q tiles leave the CTA 1.6 KiB over half an SM
                raise ValueError("warpgroups=1 (2 CTAs per SM) takes an fp8 query, or a bf16 one with v_halves")
            self.ctas_per_sm = 2

    def storage_type(self):
        f8 = cutlass.Float8E4M3FN
        stage_tiles = self.stages * self.tile_bytes
        v16 = self.v_keys * HEAD_DIM

        @cute.struct
        class Storage:
            bufk: cute.struct.Align[cute.struct.MemRange[f8, stage_tiles], 1024]
            bufv: cute.struct.Align[cute.struct.MemRange[f8, stage_tiles], 1024]
            sq: cute.struct.Align[cute.struct.MemRange[f8, ROWS * HEAD_DIM], 1024]
            sq_lo: cute.struct.Align[cute.struct.MemRange[f8, ROWS * HEAD_DIM if self.split_q else 16], 1024]
            qscale: cute.struct.MemRange[Float32, ROWS]
            sv0: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, v16], 1024]
            sv1: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, v16 if self.wgs > 1 else 8], 1024]
            full: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            empty: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            # v_converter: V tile b full / empty (mbarriers 2b, 2b + 1)
            tiles: cute.struct.Align[cute.struct.MemRange[Int64, 4], 8]
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
        """The shipped calling convention: grid (requests, Hkv, token tiles x splits), then the split
        merge when the plan splits (each split takes a range of its tile's union blocks). The K and
        V halves of the cache [P, Hkv, page, 256] as (key, byte, KV head, page) views for TMA."""
        num_tokens = query.shape[0]
        page_stride = self.hkv * self.page * ROW_BYTES
        view = cute.make_layout((self.page, HEAD_DIM, self.hkv, kv_cache.shape[0]),
                                stride=(ROW_BYTES, 1, self.page * ROW_BYTES, page_stride))
        tile = fp8_tile_layout(self.page)
        tma_k, g_k = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(),
                                                 cute.make_tensor(kv_cache.iterator, view), tile,
                                                 (self.page, HEAD_DIM))
        tma_v, g_v = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(),
                                                 cute.make_tensor(kv_cache.iterator + HEAD_DIM, view), tile,
                                                 (self.page, HEAD_DIM))
        tiles = (qlen + self.tile_tokens - 1) // self.tile_tokens
        self.kernel(
            query, kv_cache, topk, block_table, kv_lens, out, lse, partial_o, partial_lse, k_scale_tensor,
            v_scale_tensor, qlen, num_splits, qk_scale_log2, v_scale, tma_k, g_k, tma_v, g_v, self.storage_type(),
        ).launch(
            grid=((num_tokens + qlen - 1) // qlen, self.hkv, tiles * num_splits),
            block=(self.threads, 1, 1),
            stream=stream,
            preferred_smem_carveout=100,
            use_pdl=self.pdl,
            **self.launch_options(),
        )
        if num_splits > 1:
            SplitMergeKernel(num_kv_heads=self.hkv, group_size=self.group, max_splits=self.topk, pdl=self.pdl,
                             trigger=self.merge_trigger).launch(out, lse, partial_o, partial_lse, num_splits,
                                                                num_tokens, stream)

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
        tma_k: cute.CopyAtom,
        g_k: cute.Tensor,
        tma_v: cute.CopyAtom,
        g_v: cute.Tensor,
        Storage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        req, h, z = cute.arch.block_idx()
        tile = z // num_splits
        split = z % num_splits
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        TT = self.tile_tokens

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(Storage)
        full_ptr = storage.full.data_ptr()
        empty_ptr = storage.empty.data_ptr()
        sPages, sBlocks, sMasks = self.union_lists(storage)
        sKvLen = storage.kvlen.get_tensor(cute.make_layout(TT))
        if warp == 0:
            if lane == 0:
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full_ptr + s, 1)
                    cute.arch.mbarrier_init(empty_ptr + s, self.empty_arrivals)
                for k in cutlass.range_constexpr(4):
                    cute.arch.mbarrier_init(storage.tiles.data_ptr() + k, self.consumer_threads)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        qk_scale_log2 = qk_scale_log2 * mKScale[0]
        v_scale = v_scale * mVScale[0]
        n_tok = cutlass.min(Int32(TT), qlen - tile * TT)
        n_union = self.build_union(mTopk, mBT, mKvLens, mKV, storage, sKvLen, req, h, tile, qlen, n_tok, warp, lane)
        # this CTA's split: union blocks first .. first + n_split (the loops count from 0)
        first, n_split = common.split_range(n_union, num_splits, split)
        self.first = first
        self.trace_po = mPO
        if cutlass.const_expr(self.trace):  # bench/union_trace.py --events fp8
            if tidx == 0:
                self.stamp(TRACE_BLOCKS * 8, n_split)
                self.stamp(TRACE_BLOCKS * 8 + 1, smid())
                self.stamp(TRACE_BLOCKS * 8 + 2, globaltimer_lo())

        # the stages as TMA destinations: (tile, stage) of K and of V; the cache as (tile, page) of this KV head
        staged = fp8_tile_layout(self.page, self.stages)
        sK = storage.bufk.get_tensor(staged.outer, swizzle=staged.inner)
        sV = storage.bufv.get_tensor(staged.outer, swizzle=staged.inner)
        gK = cute.local_tile(g_k[None, None, h, None], (self.page, HEAD_DIM), (0, 0, None))
        gV = cute.local_tile(g_v[None, None, h, None], (self.page, HEAD_DIM), (0, 0, None))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                         cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                         cute.group_modes(gV, 0, 2))
        self.tma = (tma_k, tKs, tKg, tma_v, tVs, tVg)
        if warp < 4:  # warpgroup 0: the first stages' blocks, then Q of the tile (its loads behind the TMA's)
            if warp == 0:  # the whole warp (the TMA copy elects its lane)
                for j in range(cutlass.min(n_split, Int32(self.stages))):
                    self.issue_block(mKV, sPages, h, j, Int32(0), full_ptr)
            if cutlass.const_expr(self.split_q):
                self.stage_q_split(mQ, ptx.smem_addr(storage.sq.data_ptr()), ptx.smem_addr(storage.sq_lo.data_ptr()),
                                   storage.qscale.get_tensor(cute.make_layout(ROWS)), req, h, tile, qlen, n_tok, tidx)
            else:
                self.stage_q_fp8(mQ, ptx.smem_addr(storage.sq.data_ptr()), req, h, tile, qlen, n_tok, tidx)
        cute.arch.sync_threads()  # sQ (fenced) is complete
        args = (mKV, mOut, mLse, mPO, mPL, storage, sPages, sBlocks, sMasks, sKvLen, full_ptr, empty_ptr,
                req, h, tile, split, num_splits, qlen, n_tok, first, n_split, qk_scale_log2, v_scale)
        if cutlass.const_expr(self.v_converter):
            if warp < 4:
                cute.arch.setmaxregister_decrease(self.conv_regs)
                self.convert_loop_v(storage, full_ptr, empty_ptr, n_split, tidx)
            elif warp < 8:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.mma_loop_fp8(*args, tidx - 128, 0)
            else:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.mma_loop_fp8(*args, tidx - 256, 1)
        else:
            if warp < 4:
                self.mma_loop_fp8(*args, tidx, 0)
            elif cutlass.const_expr(self.wgs > 1):
                self.mma_loop_fp8(*args, tidx - 128, 1)

    @cute.jit
    def convert_loop_v(self, storage, full_ptr, empty_ptr, n_union, tidx):
        """The V converter warpgroup: block i's V -> the f16 tile of MMA warpgroup i % 2, once that
        warpgroup's P V of block i - 2 is done; it releases the stage (its V half) before handing
        the tile over, so the MMA warpgroup that refills the stage waits only for itself."""
        bufv = ptx.smem_addr(storage.bufv.data_ptr())
        tiles = storage.tiles.data_ptr()
        v_tiles = (ptx.smem_addr(storage.sv0.data_ptr()), ptx.smem_addr(storage.sv1.data_ptr()))
        for i in range(n_union):
            s = i % self.stages
            b = i % 2
            cute.arch.mbarrier_wait(full_ptr + s, (i // self.stages) & 1)
            cute.arch.mbarrier_wait(tiles + 2 * b + 1, ((i // 2) & 1) ^ 1)  # V tile b is free
            dst = v_tiles[0]
            if b == 1:
                dst = v_tiles[1]
            self.convert_v(bufv + s * self.tile_bytes, dst, tidx)
            cute.arch.mbarrier_arrive(empty_ptr + s)
            cute.arch.mbarrier_arrive(tiles + 2 * b)

    @cute.jit
    def issue_block(self, mKV, sPages, h, j, buf_addr, full_ptr):
        """One WHOLE, converged warp: the split's block j (union block first + j): K and V (two TMA
        boxes) -> stage j % stages. cute.copy of a TMA atom elects its issuing lane itself
        (elect.sync over the full warp), so it must not run under a one-thread branch."""
        tma_k, tKs, tKg, tma_v, tVs, tVg = self.tma
        s = j % self.stages
        page = sPages[self.first + j]
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(full_ptr + s, self.stage_bytes)
        cute.copy(tma_k, tKg[None, page], tKs[None, s], tma_bar_ptr=full_ptr + s)
        cute.copy(tma_v, tVg[None, page], tVs[None, s], tma_bar_ptr=full_ptr + s)

    @cute.jit
    def release_stage_and_refill(self, mKV, sPages, h, i, n_union, buf_addr, full_ptr, empty_ptr, tidx,
                                 refills: cutlass.Constexpr):
        """This thread has read block i's stage: arrive on its empty barrier; with `refills`, warp 0
        of the caller's warpgroup (all 32 lanes: the TMA copy elects one) waits for every reader and
        copies block i + stages into it."""
        s = i % self.stages
        cute.arch.mbarrier_arrive(empty_ptr + s)
        if cutlass.const_expr(refills):
            if cute.arch.make_warp_uniform(tidx // 32) == 0:
                if i + self.stages < n_union:
                    cute.arch.mbarrier_wait(empty_ptr + s, (i // self.stages) & 1)
                    self.issue_block(mKV, sPages, h, i + self.stages, buf_addr, full_ptr)

    @cute.jit
    def q_half_row(self, mQ, req, h, tile, qlen, n_tok, tidx):
        """The 64 query elements (dims 64 (tidx % 2) ..) of tile row tidx // 2 (token row // G,
        head row % G) as words, zero past the tile's tokens: 16 words of fp8 or 32 of bf16."""
        G = self.group
        qrow = tidx // 2
        elem_bytes = 1 if self.q_fp8 else 2
        words = cute.make_rmem_tensor(16 * elem_bytes, Int32)
        for k in cutlass.range_constexpr(16 * elem_bytes):
            words[k] = Int32(0)
        if qrow // G < n_tok:
            t = req * qlen + tile * self.tile_tokens + qrow // G
            src = mQ.iterator.toint() + (Int64(t) * Int64(mQ.stride[0])
                                         + Int64((h * G + qrow % G) * HEAD_DIM + 64 * (tidx % 2))) * elem_bytes
            for p in cutlass.range_constexpr(4 * elem_bytes):
                wv = ptx.ld_global_nc_v4(src + 16 * p)
                for k in cutlass.range_constexpr(4):
                    words[4 * p + k] = wv[k]
        return words

    @cute.jit
    def stage_q_fp8(self, mQ, q_smem, req, h, tile, qlen, n_tok, tidx):
        """Q of the tile -> sQ (fp8 as given, 128B-swizzled): thread tidx (< 128) writes half (64
        bytes) of row tidx // 2; rows past the tile's tokens are zero."""
        words = self.q_half_row(mQ, req, h, tile, qlen, n_tok, tidx)
        for p in cutlass.range_constexpr(4):
            ptx.st_shared_v4(q_smem + swizzled_fp8(tidx // 2, 64 * (tidx % 2) + 16 * p),
                             words[4 * p], words[4 * p + 1], words[4 * p + 2], words[4 * p + 3])
        cute.arch.fence_view_async_shared()

    @cute.jit
    def stage_q_split(self, mQ, q_hi, q_lo, sScale, req, h, tile, qlen, n_tok, tidx):
        """Q of the tile (bf16) -> sQ (hi) and sQ_lo (lo), e4m3, 128B-swizzled, and each row's
        scale: thread tidx (< 128) takes half (64 dims) of row tidx // 2; rows past the tile's tokens
        are zero (scale 0)."""
        qrow = tidx // 2
        qhalf = tidx % 2
        words = self.q_half_row(mQ, req, h, tile, qlen, n_tok, tidx)
        amax = Float32(0.0)
        for k in cutlass.range_constexpr(32):
            amax = cute.arch.fmax(amax, bf16x2_absmax(words[k]))
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 1))  # the row's other half
        inv = Float32(0.0)
        scale = Float32(0.0)
        if amax > Float32(0.0):
            amax = cute.arch.fmax(amax, Float32(AMAX_MIN))  # 448 / a bf16 denormal would overflow
            inv = Float32(E4M3_MAX) / amax
            scale = amax / Float32(E4M3_MAX)
        hi = cute.make_rmem_tensor(16, Int32)
        lo = cute.make_rmem_tensor(16, Int32)
        for k in cutlass.range_constexpr(16):
            a, b = bf16x4_to_e4m3_hi_lo(words[2 * k], words[2 * k + 1], inv)
            hi[k] = a
            lo[k] = b
        for p in cutlass.range_constexpr(4):
            off = swizzled_fp8(qrow, 64 * qhalf + 16 * p)
            ptx.st_shared_v4(q_hi + off, hi[4 * p], hi[4 * p + 1], hi[4 * p + 2], hi[4 * p + 3])
            ptx.st_shared_v4(q_lo + off, lo[4 * p], lo[4 * p + 1], lo[4 * p + 2], lo[4 * p + 3])
        if qhalf == 0:
            sScale[qrow] = scale
        cute.arch.fence_view_async_shared()

    @cute.jit
    def convert_v(self, v_stage, dst_smem, tidx, fence: cutlass.Constexpr = True, half: cutlass.Constexpr = 0):
        """The stage's fp8 V tile (TMA-swizzled key rows; with v_halves its keys 64 half ..) -> an
        f16 tile of v_keys rows (union_wgmma's layout), by 128 threads: thread = 16 dims of keys
        tidx // 8 + 16 r; fenced for the MMAs that read it (fence=False: the caller fences)."""
        c8 = tidx % 8
        for r in cutlass.range_constexpr(self.v_keys // 16 if self.convert else 0):
            key = tidx // 8 + 16 * r
            w = ptx.ld_shared_v4(v_stage + swizzled_fp8(key + self.v_keys * half, 16 * c8))
            store_f16_chunks(dst_smem + swizzled(self.v_keys, key, 16 * c8), w, c8)
        if cutlass.const_expr(fence):
            cute.arch.fence_view_async_shared()

    def mma_setup_fp8(self, storage, wg: int, tidx):
        """The MMAs, fragments and accumulators of MMA warpgroup wg (thread tidx of its 128): S on
        QGMMA from sQ (and sQ_lo) and the staged K tiles, O as union_wgmma's."""
        f8 = cutlass.Float8E4M3FN
        sQ_layout = fp8_tile_layout(ROWS)
        staged = fp8_tile_layout(self.page, self.stages)
        sQ = storage.sq.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sQlo = storage.sq_lo.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner) if self.split_q else sQ
        sK = storage.bufk.get_tensor(staged.outer, swizzle=staged.inner)
        mma_s = sm90.make_trivial_tiled_mma(f8, f8, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                                            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS, self.page))
        thr_s = mma_s.get_slice(tidx)
        return dict(
            self.o_setup(storage.sv0 if wg == 0 else storage.sv1, tidx, self.v_keys),
            mma_s=mma_s, thr_s=thr_s,
            tSrQ=thr_s.make_fragment_A(thr_s.partition_A(sQ)), tSrQlo=thr_s.make_fragment_A(thr_s.partition_A(sQlo)),
            tSrK=thr_s.make_fragment_B(thr_s.partition_B(sK)),
        )

    @cute.jit
    def mma_loop_fp8(self, mKV, mOut, mLse, mPO, mPL, storage, sPages, sBlocks, sMasks, sKvLen, full_ptr,
                     empty_ptr, req, h, tile, split, num_splits, qlen, n_tok, first, n_union, qk_scale_log2, v_scale,
                     tidx, wg: cutlass.Constexpr):
        """MMA warpgroup wg (thread tidx of its 128): the split's blocks wg, wg + wgs, ... of n_union
        (union blocks first + i); warpgroup 0 merges the warpgroups' (m, l, O) and stores."""
        bar = BAR_WG + wg
        nthr = self.consumer_threads
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        m = self.mma_setup_fp8(storage, wg, tidx)
        tSrQ, tSrK, tOrV, tOrP, acc_o = m["tSrQ"], m["tSrK"], m["tOrV"], m["tOrP"], m["acc_o"]
        p_words = cute.make_tensor(cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(ROWS * self.page // 256))
        bufk = ptx.smem_addr(storage.bufk.data_ptr())
        bufv = ptx.smem_addr(storage.bufv.data_ptr())
        sQScale = storage.qscale.get_tensor(cute.make_layout(ROWS))
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = Float32(0.0)
        row_max, row_sum, alpha = self.row_state()
        for i in range(wg, n_union, self.wgs):
            s = i % self.stages
            blk = sBlocks[first + i]
            mask = sMasks[first + i]
            cute.arch.mbarrier_wait(full_ptr + s, (i // self.stages) & 1)
            self.trace_block(i, 0, tidx)  # the stage is full
            if cutlass.const_expr(not self.v_converter):
                cute.arch.barrier(barrier_id=bar, number_of_threads=nthr)  # every warp's P V of its last block is done
            self.trace_block(i, 1, tidx)  # S issued next
            # ---- S = Q K^T on the stage's K as the TMA laid it down (fp8), asynchronous
            acc_s = cute.make_rmem_tensor(m["thr_s"].partition_shape_C((ROWS, self.page)), Float32)
            if cutlass.const_expr(self.mma):
                warpgroup.fence()
                atom_s = cute.make_mma_atom(m["mma_s"].op)
                atom_s.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(cute.size(tSrQ.shape[2])):
                    cute.gemm(atom_s, acc_s, tSrQ[None, None, k], tSrK[None, None, k, s], acc_s)
                    atom_s.set(warpgroup.Field.ACCUMULATE, True)
                if cutlass.const_expr(self.split_q):
                    for k in cutlass.range_constexpr(cute.size(tSrQ.shape[2])):
                        cute.gemm(atom_s, acc_s, m["tSrQlo"][None, None, k], tSrK[None, None, k, s], acc_s)
                warpgroup.commit_group()
            if cutlass.const_expr(not self.v_converter):
                # ---- meanwhile V -> this warpgroup's f16 tile. Its proxy fence comes after the wait:
                # ptxas 12.9 (the DSL's) segfaults on a fence.proxy.async between a wgmma commit and wait
                self.convert_v(bufv + s * self.tile_bytes, m["v_smem"], tidx, fence=False)
            self.trace_block(i, 2, tidx)  # this thread's V conversion done
            if cutlass.const_expr(self.mma):
                warpgroup.wait_group(0)
            self.trace_block(i, 3, tidx)  # S done
            if cutlass.const_expr(not self.v_converter):
                cute.arch.fence_view_async_shared()
                if cutlass.const_expr(self.v_keys == self.page):
                    self.release_stage_and_refill(mKV, sPages, h, i, n_union, Int32(0), full_ptr, empty_ptr, tidx,
                                                  True)
            if cutlass.const_expr(self.mma):
                for hh in cutlass.range_constexpr(2):  # rows 16 warp + g + 8 hh
                    f = qk_scale_log2
                    if cutlass.const_expr(self.split_q):
                        f = f * sQScale[16 * warp + g + 8 * hh]
                    for jj in cutlass.range_constexpr(self.page // 8):
                        for e in cutlass.range_constexpr(2):
                            acc_s[e + 2 * hh + 4 * jj] = acc_s[e + 2 * hh + 4 * jj] * f
                self.softmax_cols(acc_s, acc_o, p_words, row_max, row_sum, alpha, blk, mask, sKvLen, 0, self.page,
                                  warp, g, c, True)
            self.trace_block(i, 4, tidx)  # softmax done (and thread 0's refill issued)
            # ---- O += P V
            if cutlass.const_expr(not self.v_converter):
                cute.arch.barrier(barrier_id=bar, number_of_threads=nthr)  # every thread's part of the V tile is in
            if cutlass.const_expr(self.v_converter):
                cute.arch.mbarrier_wait(storage.tiles.data_ptr() + 2 * wg, (i // 2) & 1)  # V tile converted
                # the converter has released the stage's V: thread 0's refill waits for this warpgroup only
                self.release_stage_and_refill(mKV, sPages, h, i, n_union, Int32(0), full_ptr, empty_ptr, tidx, True)
            self.trace_block(i, 5, tidx)  # the V tile is complete
            if cutlass.const_expr(self.mma):
                self.pv_mma(m["mma_o"], acc_o, tOrP, tOrV)
            if cutlass.const_expr(self.v_keys < self.page):  # ---- the second half of V, then of P V
                cute.arch.barrier(barrier_id=bar, number_of_threads=nthr)  # every warp's first half is done
                self.convert_v(bufv + s * self.tile_bytes, m["v_smem"], tidx, half=1)
                self.release_stage_and_refill(mKV, sPages, h, i, n_union, Int32(0), full_ptr, empty_ptr, tidx, True)
                cute.arch.barrier(barrier_id=bar, number_of_threads=nthr)
                if cutlass.const_expr(self.mma):
                    self.pv_mma(m["mma_o"], acc_o, tOrP, tOrV, cute.size(tOrV.shape[2]))
            self.trace_block(i, 6, tidx)  # P V done
            if cutlass.const_expr(self.v_converter):
                cute.arch.mbarrier_arrive(storage.tiles.data_ptr() + 2 * wg + 1)  # V tile read
        self.finish(mOut, mLse, storage, acc_o, row_max, row_sum, bufk, req, h, tile, qlen, n_tok, v_scale, tidx,
                    warp, g, c, wg, mPO, mPL, split, num_splits)
