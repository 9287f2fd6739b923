"""sm_90a speculative-decode ("union") kernel: fp8 warpgroup MMAs on K as the TMA lays it down.

A request's qlen query tokens (a speculative-decode step) select overlapping blocks. Grid
(requests, Hkv, tiles x num_splits): one CTA per (request, KV head h, tile of
tile_tokens = 64 // G consecutive query tokens of the request, split), so
CTAs = B * Hkv * ceil(qlen / (64 // G)) * num_splits. The tile's tokens x the G query heads
of h are the 64 rows of one warpgroup MMA. The CTA builds the UNION of the blocks its tokens
selected (each with a bitmask of the tokens that selected it) and streams every union block
once; split `split` takes its range of the union blocks (common.split_range) and writes
normalized partials, which the shipped split merge (msa_jit/kernels/split_merge.py) combines in the
same launch sequence when num_splits > 1.

Per union block (one page of KV head h: 128 keys of 256 bytes, K in bytes [0, 128), V in
[128, 256)):
  * two TMA copies (boxes of 128 keys x 128 bytes over the cache viewed as (key, byte, KV
    head, page), 128B swizzle) lay K and V down dense into a stage; K is then, as it lies, the
    K-major B operand of S = Q K^T on `wgmma.m64n128k32.f32.e4m3.e4m3` (QGMMA);
  * Q (64 rows x 128 dims) is an e4m3 A tile in shared memory: an fp8 query as given; a bf16
    query split per row into s * (hi + lo), hi = e4m3(q / s), lo = e4m3(q / s - hi),
    s = amax / 448: two QGMMA chains into one accumulator, scaled per row (~8 significant bits
    of Q, as bf16);
  * the online softmax runs on the accumulator rows (row = (token, head): its token's kv_len
    mask, -inf where its token did not select the block); V is converted to an f16 tile while
    S runs, and O += P V on `wgmma.m64n128k16` f16 MMAs with P from registers.

Roles: `warpgroups` MMA warpgroups take the union blocks in turn (block i: warpgroup i % 2);
each converts its block's V and its warp 0 refills the stage once the warpgroup has read it (no
producer warp: ptxas allots registers per warpgroup). A warpgroup's P V of block i runs on the
tensor cores while it waits for block i + wgs's stage and issues that block's S; it waits for P V
only before V's conversion overwrites the f16 tile. At the end the MMA warpgroups merge their
(m, l, O) through shared memory. With `v_converter` (the 2-CTA builds) a second
warpgroup converts every V instead, handed over by two mbarriers (tile free / tile full), while
the one MMA warpgroup runs S and the softmax; setmaxnreg moves its spare registers to the MMA side.

Builds (occupancy_options): 1 CTA per SM = 2 MMA warpgroups and 4 stages (G = 16 or 8, topk
16: 212-214 KiB of shared memory with a bf16 query, 204-206 KiB with an fp8 one); 2 CTAs per
SM = 1 MMA warpgroup, the V converter and 2 stages, 108-110 KiB: a bf16 query's lo tile is then
the A operand of its QGMMAs from registers (q_lo_regs=True), so the CTA holds one Q tile as with
an fp8 query (docs/performance.md).

Constraints (ValueError in the constructor, or in arch_options): sm_90a only (wgmma, TMA);
an fp8 cache with 128-token pages (256-byte key rows); G divides 64 and 64 // G <= 32 (the
token bitmask of a union block is 32 bits); 1 or 2 CTAs per SM, each CTA within its share of
the SM's shared memory (the union lists grow with 64 // G x topk: G = 2 or 4 with topk 32 may
not fit).
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations

import operator

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup

from . import common, ptx
from .base import SparseDecodeKernelBase
from .constants import FP8_ROW_BYTES, HEAD_DIM, LN2
from .convention import KernelArguments
from .union_ops import (BAR_ALL, BAR_WG, RESCALE_LOG2, ROWS, build_union, f16_tile_layout, fp8_tile_layout, ld_shared_f32, merged_row_stats, row_state, st_global_b32, st_global_v2_f32, st_shared_f32, stage_q_fp8, stage_q_split, store_f16_chunks, swizzled_f16, swizzled_fp8, tree)

WG_THREADS = 128  # threads of a warpgroup
PAGE_SIZE = 128  # keys of a block: one TMA box of K and one of V per stage
MAX_TILE_TOKENS = 32  # a union block's mask has one bit per tile token (Int32)
SMEM_PER_SM = 228 * 1024  # H100 / H200; each resident CTA reserves 1 KiB of it


class SparseDecodeUnionKernel(SparseDecodeKernelBase):
    """Static config in __init__; the launch in SparseDecodeKernelBase.__call__ on this class's grid
    and kernel_operands (the TMA atoms of K and V); device code in kernel() and the methods it
    calls, named by role."""

    # V's conversion: 16-key rows whose shared loads are in flight before a row's stores (all 8: 252-255
    # registers, no local memory)
    v_loads_ahead = 8
    cv_loads_ahead = 4  # v_converter: the converter's V loads ahead (16 registers)
    # programmatic dependent launch, as the portable kernel: each kernel of the launch waits
    # (griddepcontrol.wait) before its first global-memory access
    pdl = True

    @staticmethod
    def occupancy_options(ctas_per_sm: int, q_dtype: str, kv_dtype: str = "float8_e4m3fn") -> dict:
        """Constructor options of the build for `ctas_per_sm` CTAs per SM (SparseDecodeConfig.ctas_per_sm).

        1: 2 MMA warpgroups and 4 stages (the defaults). 2: one MMA warpgroup, the V converter and 2
        stages (one wave of twice the CTAs), a bf16 query's lo tile in registers so that one Q tile fits.
        """
        if ctas_per_sm == 1:
            return {}
        if ctas_per_sm == 2:
            return {"warpgroups": 1, "v_converter": True, **({} if q_dtype == "float8_e4m3fn" else {"q_lo_regs": True})}
        raise ValueError(f"no union build for {ctas_per_sm} CTAs per SM (1 or 2)")

    @staticmethod
    def arch_options(arch: str, kv_dtype: str) -> dict:
        """None; refuses any arch but sm_90a (wgmma and the TMA copies are sm_90a's)."""
        if arch != "sm_90a":
            raise ValueError(f"the union kernel is built for sm_90a only, not {arch!r}")
        return {}

    def __init__(
        self,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        page_size: int = PAGE_SIZE,
        topk: int = 16,
        q_dtype: str = "bfloat16",
        kv_dtype: str = "float8_e4m3fn",
        warpgroups: int = 2,
        stages: int | None = None,
        q_lo_regs: bool = False,
        v_converter: bool = False,
    ):
        super().__init__(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=page_size,
                         topk=topk, q_dtype=q_dtype, kv_dtype=kv_dtype)
        if kv_dtype != "float8_e4m3fn":
            raise ValueError(f"the union kernel reads an fp8 cache only, not {kv_dtype!r}")
        if q_dtype not in ("bfloat16", "float8_e4m3fn"):
            raise ValueError(f"q_dtype {q_dtype!r} not in ('bfloat16', 'float8_e4m3fn')")
        if page_size != PAGE_SIZE:
            raise ValueError(f"the union kernel takes page_size {PAGE_SIZE} (one TMA box of 128 keys of "
                             f"256-byte rows per K / V), not {page_size}")
        if ROWS % self.group or ROWS // self.group > MAX_TILE_TOKENS:
            raise ValueError(f"group size {self.group} must divide {ROWS} and leave at most {MAX_TILE_TOKENS} "
                             "tokens per tile (one mask bit each)")
        if warpgroups not in (1, 2):
            raise ValueError(f"warpgroups={warpgroups}: 1 or 2 MMA warpgroups")
        self.wgs = warpgroups
        self.stages = stages or (4 if warpgroups == 2 else 2)
        if self.stages < 1:
            raise ValueError(f"stages={self.stages}: at least 1")
        if warpgroups == 2 and self.stages % 2:
            # blocks i and i + stages share a stage; with an odd count they go to different MMA
            # warpgroups, and block i's warpgroup could reach block i + 2 stages while i + stages'
            # copy is in flight: its full-barrier wait would pass on the phase of the same parity
            raise ValueError(f"stages={self.stages}: two MMA warpgroups need an even stage count")
        # a bf16 query: each row as s * (hi + lo), hi and lo e4m3 tiles, s = amax / 448 per row; S is
        # two QGMMA chains into one accumulator, then scaled per row (~8 significant bits of Q, as bf16)
        self.split_q = not self.q_fp8
        # q_lo_regs (a bf16 query): Q's lo tile is the A operand of its QGMMAs from registers (16 per
        # thread), staged once through the f16 V tile, so the CTA holds one Q tile, as with an fp8 query;
        # its chain follows the hi chain in S's commit group
        if q_lo_regs and not self.split_q:
            raise ValueError("q_lo_regs takes a bf16 query (an fp8 one has no lo tile)")
        if q_lo_regs and not v_converter:  # staged through the MMA warpgroup's V tile, which only it may overwrite
            raise ValueError("q_lo_regs needs v_converter (and so warpgroups=1)")
        self.q_lo_regs = bool(q_lo_regs)
        if warpgroups == 1 and self.split_q and not q_lo_regs:  # two Q tiles: 1.6 KiB over
            raise ValueError("warpgroups=1 (2 CTAs per SM) takes an fp8 query, or a bf16 one with q_lo_regs")
        # v_converter (2 CTAs per SM): a second warpgroup converts every block's V into the MMA
        # warpgroup's f16 tile while that one runs S and the softmax, handed over by two mbarriers;
        # setmaxnreg gives the MMA warpgroup the registers the converter does not need
        if v_converter and warpgroups != 1:
            raise ValueError("v_converter needs warpgroups=1 (the converter takes the second warpgroup's place)")
        self.v_converter = bool(v_converter)
        # setmaxnreg's registers per thread of the MMA and the converter warpgroup (2 CTAs of 256 threads
        # share 65536, so the two sum to 256): the MMA's S, P, O and Q's lo tile take ~200 with a bf16
        # query, ~184 with an fp8 one (SASS); the converter's loop then spills nothing
        self.cv_regs = (208, 48) if self.q_lo_regs else (192, 64)
        self.tile_tokens = ROWS // self.group  # query tokens per CTA
        self.union_max = self.tile_tokens * self.topk  # union blocks of a tile, at most
        self.stage_bytes = self.page * FP8_ROW_BYTES  # K and V of a (page, KV head)
        self.tile_bytes = self.page * HEAD_DIM  # a K or V tile of a stage (fp8)
        self.empty_arrivals = WG_THREADS * (1 + int(self.v_converter))  # the threads that read a stage
        self.threads = WG_THREADS * (warpgroups + int(self.v_converter))
        self.ctas_per_sm = 2 if warpgroups == 1 else 1
        smem = self.storage_type().size_in_bytes()
        if smem > SMEM_PER_SM // self.ctas_per_sm - 1024:
            raise ValueError(f"{smem} bytes of shared memory per CTA: over an SM's share for "
                             f"{self.ctas_per_sm} CTAs per SM (topk {topk}, group size {self.group})")

    # ------------------------------------------------------------------ host side
    def storage_type(self):
        """The shared-memory struct: K and V stages, the Q tile(s), the f16 V tile(s), barriers, the
        union lists and the cross-warpgroup (m, l)."""
        f8 = cutlass.Float8E4M3FN
        stage_tiles = self.stages * self.tile_bytes
        v16 = self.page * HEAD_DIM

        @cute.struct
        class Storage:
            bufk: cute.struct.Align[cute.struct.MemRange[f8, stage_tiles], 1024]
            bufv: cute.struct.Align[cute.struct.MemRange[f8, stage_tiles], 1024]
            sq: cute.struct.Align[cute.struct.MemRange[f8, ROWS * HEAD_DIM], 1024]
            sq_lo: cute.struct.Align[cute.struct.MemRange[f8, ROWS * HEAD_DIM if self.split_q and not self.q_lo_regs
                                                          else 16], 1024]
            qscale: cute.struct.MemRange[Float32, ROWS]
            sv0: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, v16], 1024]
            sv1: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, v16 if self.wgs > 1 else 8], 1024]
            full: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            empty: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            tok_pages: cute.struct.MemRange[Int32, 32 * self.tile_tokens]
            tok_blocks: cute.struct.MemRange[Int32, 32 * self.tile_tokens]
            ballots: cute.struct.MemRange[Int32, self.tile_tokens]
            pages: cute.struct.MemRange[Int32, self.union_max]
            blocks: cute.struct.MemRange[Int32, self.union_max]
            masks: cute.struct.MemRange[Int32, self.union_max]
            kvlen: cute.struct.MemRange[Int32, self.tile_tokens]
            rowm: cute.struct.MemRange[Float32, ROWS * self.wgs]
            rowl: cute.struct.MemRange[Float32, ROWS * self.wgs]
            if self.v_converter:  # last, so the other builds' layout stays as it was
                # the f16 V tile: converted (arrivals: the converter's 128 threads), free (the MMA's 128)
                tile_full: cute.struct.Align[cute.struct.MemRange[Int64, 1], 8]
                tile_free: cute.struct.Align[cute.struct.MemRange[Int64, 1], 8]

        return Storage

    def launch_options(self) -> dict:
        return {"min_blocks_per_mp": self.ctas_per_sm}

    def grid(self, num_tokens, qlen, num_splits) -> tuple:
        """One CTA per (request, KV head, tile of tile_tokens query tokens x split): a query of
        num_tokens = requests x qlen rows."""
        tiles = (qlen + self.tile_tokens - 1) // self.tile_tokens
        return ((num_tokens + qlen - 1) // qlen, self.hkv, tiles * num_splits)

    def kernel_operands(self, kv_cache) -> tuple:
        """The TMA atoms and global views of the K and V halves of the cache [P, Hkv, page, 256]
        (fp8), as (key, byte, KV head, page) tensors: (tma_k, g_k, tma_v, g_v)."""
        page_stride = self.hkv * self.page * FP8_ROW_BYTES
        view = cute.make_layout((self.page, HEAD_DIM, self.hkv, kv_cache.shape[0]),
                                stride=(FP8_ROW_BYTES, 1, self.page * FP8_ROW_BYTES, page_stride))
        tile = fp8_tile_layout(self.page)
        tma_k, g_k = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(),
                                                 cute.make_tensor(kv_cache.iterator, view), tile,
                                                 (self.page, HEAD_DIM))
        tma_v, g_v = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(),
                                                 cute.make_tensor(kv_cache.iterator + HEAD_DIM, view), tile,
                                                 (self.page, HEAD_DIM))
        return tma_k, g_k, tma_v, g_v

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, args: KernelArguments, tma_k: cute.CopyAtom, g_k: cute.Tensor, tma_v: cute.CopyAtom,
               g_v: cute.Tensor, Storage: cutlass.Constexpr):
        """One CTA: the convention's tensors and scalars (`args`, named as in convention.ARGUMENTS), then
        kernel_operands()."""
        tidx, _, _ = cute.arch.thread_idx()
        req, h, z = cute.arch.block_idx()
        tile = z // args.num_splits
        split = z % args.num_splits
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        TT = self.tile_tokens

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(Storage)
        full_ptr = storage.full.data_ptr()
        empty_ptr = storage.empty.data_ptr()
        sPages, sBlocks, sMasks = self.union_lists(storage)
        sKvLen = storage.kvlen.get_tensor(cute.make_layout(TT))
        # the barriers touch no global memory: set them up while the previous kernel may still run
        if warp == 0:
            if lane == 0:
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full_ptr + s, 1)
                    cute.arch.mbarrier_init(empty_ptr + s, self.empty_arrivals)
                if cutlass.const_expr(self.v_converter):
                    cute.arch.mbarrier_init(storage.tile_full.data_ptr(), WG_THREADS)
                    cute.arch.mbarrier_init(storage.tile_free.data_ptr(), WG_THREADS)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the split merge may be scheduled now
        qk_scale_log2 = args.qk_scale_log2 * args.k_scale_tensor[0]
        v_scale = args.v_scale * args.v_scale_tensor[0]
        n_tok = cutlass.min(Int32(TT), args.qlen - tile * TT)
        # Q first: its loads overlap the union build's chain instead of queueing behind the first stages'
        # copies (ncu: a bf16 query's CTAs waited ~5% of the kernel for Q there)
        q_words = self.q_half_row(args.query, req, h, tile, args.qlen, n_tok, tidx)
        n_union = build_union(args.topk, args.block_table, args.kv_lens, args.kv_cache.shape[0], storage,
                              (sPages, sBlocks, sMasks), sKvLen, req, h, tile, args.qlen, n_tok, warp, lane, TT,
                              self.topk, self.page)
        # this CTA's split: union blocks first .. first + n_split (the loops count from 0)
        first, n_split = common.split_range(n_union, args.num_splits, split)

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
        tma = (tma_k, tKs, tKg, tma_v, tVs, tVg)
        if warp < 4:  # warpgroup 0: the first stages' blocks, then Q of the tile into shared memory
            if warp == 0:  # the whole warp (the TMA copy elects its lane)
                for j in range(cutlass.min(n_split, Int32(self.stages))):
                    self.issue_block(tma, sPages, first, j, full_ptr)
            if cutlass.const_expr(self.split_q):
                stage_q_split(q_words, ptx.smem_addr(storage.sq.data_ptr()),
                              ptx.smem_addr(self.q_lo_field(storage).data_ptr()),
                              storage.qscale.get_tensor(cute.make_layout(ROWS)), tidx)
            else:
                stage_q_fp8(q_words, ptx.smem_addr(storage.sq.data_ptr()), tidx)
        cute.arch.sync_threads()  # sQ (fenced) is complete
        loop_args = (args.out, args.lse, args.partial_o, args.partial_lse, storage, sPages, sBlocks, sMasks, sKvLen,
                     full_ptr, empty_ptr, tma, req, h, tile, split, args.num_splits, args.qlen, n_tok, first, n_split,
                     qk_scale_log2, v_scale)
        if cutlass.const_expr(self.v_converter):
            if warp < 4:
                cute.arch.setmaxregister_increase(self.cv_regs[0])
                self.mma_loop(*loop_args, tidx, 0)
            else:
                cute.arch.setmaxregister_decrease(self.cv_regs[1])
                self.convert_loop(storage, tma, sPages, first, n_split, full_ptr, empty_ptr, tidx - 128)
        elif warp < 4:
            self.mma_loop(*loop_args, tidx, 0)
        elif cutlass.const_expr(self.wgs > 1):
            self.mma_loop(*loop_args, tidx - 128, 1)

    # ---- the tile's union of blocks
    def union_lists(self, storage):
        """(pages, blocks, token masks) of the tile's union: shared-memory tensors of union_max int32."""
        return tuple(f.get_tensor(cute.make_layout(self.union_max)) for f in (storage.pages, storage.blocks,
                                                                             storage.masks))

    # ---- the stage ring
    @cute.jit
    def issue_block(self, tma, sPages, first, j, full_ptr):
        """One WHOLE, converged warp: the split's block j (union block first + j): K and V (two TMA
        boxes) -> stage j % stages. cute.copy of a TMA atom elects its issuing lane itself
        (elect.sync over the full warp), so it must not run under a one-thread branch."""
        tma_k, tKs, tKg, tma_v, tVs, tVg = tma
        s = j % self.stages
        page = sPages[first + j]
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(full_ptr + s, self.stage_bytes)
        cute.copy(tma_k, tKg[None, page], tKs[None, s], tma_bar_ptr=full_ptr + s)
        cute.copy(tma_v, tVg[None, page], tVs[None, s], tma_bar_ptr=full_ptr + s)

    @cute.jit
    def release_stage_and_refill(self, tma, sPages, first, i, n_union, full_ptr, empty_ptr, tidx,
                                 refill: cutlass.Constexpr = True):
        """This thread has read block i's stage: arrive on its empty barrier; with `refill`, warp 0
        of the caller's warpgroup (all 32 lanes: the TMA copy elects one) then waits for every reader
        and copies block i + stages into it."""
        s = i % self.stages
        cute.arch.mbarrier_arrive(empty_ptr + s)
        if cutlass.const_expr(refill):
            if cute.arch.make_warp_uniform(tidx // 32) == 0:
                if i + self.stages < n_union:
                    cute.arch.mbarrier_wait(empty_ptr + s, (i // self.stages) & 1)
                    self.issue_block(tma, sPages, first, i + self.stages, full_ptr)

    # ---- Q of the tile
    @cute.jit
    def q_half_row(self, mQ, req, h, tile, qlen, n_tok, tidx):
        """The 64 query elements (dims 64 (tidx % 2) ..) of tile row tidx // 2 (token row // G,
        head row % G) as words, zero past the tile's tokens (and for tidx >= 128): 16 words of fp8
        or 32 of bf16."""
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

    # ---- V: fp8 stage -> f16 tile
    @cute.jit
    def convert_v(self, v_stage, dst_smem, tidx, ahead: int = 0):
        """The stage's fp8 V tile (TMA-swizzled key rows) -> an f16 tile (f16_tile_layout), by 128
        threads: thread = 16 dims of keys tidx // 8 + 16 r; not fenced (the caller fences for the
        MMAs that read it). Row r's loads are issued v_loads_ahead rows before its stores: ptxas
        cannot hoist a load above stores that may alias it, so a load per row in series would wait
        out each one's latency (ncu); `ahead` (0: v_loads_ahead) sets that count instead
        (the converter's, cv_loads_ahead)."""
        c8 = tidx % 8
        rows = self.page // 16
        ahead = min(ahead or self.v_loads_ahead, rows)
        words = [ptx.ld_shared_v4(v_stage + swizzled_fp8(tidx // 8 + 16 * r, 16 * c8)) for r in range(ahead)]
        for r in cutlass.range_constexpr(rows):
            if cutlass.const_expr(r + ahead < rows):
                words.append(ptx.ld_shared_v4(v_stage + swizzled_fp8(tidx // 8 + 16 * (r + ahead), 16 * c8)))
            store_f16_chunks(dst_smem + swizzled_f16(self.page, tidx // 8 + 16 * r, 16 * c8), words[r], c8)

    @cute.jit
    def convert_loop(self, storage, tma, sPages, first, n_union, full_ptr, empty_ptr, tidx):
        """v_converter's warpgroup (thread tidx of its 128): block i's V -> the MMA warpgroup's f16
        tile once its P V of block i - 1 is done (tile_free), handed over by tile_full; then it
        releases the stage, and its warp 0 refills it once the MMA warpgroup has read K too."""
        bufv = ptx.smem_addr(storage.bufv.data_ptr())
        v_smem = ptx.smem_addr(storage.sv0.data_ptr())
        tile_full = storage.tile_full.data_ptr()
        tile_free = storage.tile_free.data_ptr()
        for i in range(n_union):
            s = i % self.stages
            cute.arch.mbarrier_wait(full_ptr + s, (i // self.stages) & 1)
            cute.arch.mbarrier_wait(tile_free, i & 1)
            self.convert_v(bufv + s * self.tile_bytes, v_smem, tidx, ahead=self.cv_loads_ahead)
            cute.arch.fence_view_async_shared()  # the tile's stores, before the MMA's async-proxy reads
            cute.arch.mbarrier_arrive(tile_full)
            self.release_stage_and_refill(tma, sPages, first, i, n_union, full_ptr, empty_ptr, tidx)

    # ---- the MMA warpgroups
    def o_setup(self, sv_field, tidx):
        """O = P V of one MMA warpgroup (thread tidx of its 128): the MMA (P from registers, the f16
        V tile in sv_field as an MN-major B), its fragments (P's for the whole page) and the O
        accumulator."""
        f16 = cutlass.Float16
        sV_layout = f16_tile_layout(self.page)
        sV = sv_field.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # V as the B operand of O = P V: (N = head dims, K = keys), head dims contiguous (MN-major)
        sVt = cute.composition(sV, cute.make_ordered_layout((HEAD_DIM, self.page), order=(1, 0)))
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

    def q_lo_field(self, storage):
        """Where Q's lo tile is staged: its own tile, or (q_lo_regs) the f16 V tile, free until the
        first block's V is converted."""
        return storage.sv0 if self.q_lo_regs else storage.sq_lo

    def mma_setup(self, storage, wg: int, tidx):
        """The MMAs, fragments and accumulators of MMA warpgroup wg (thread tidx of its 128): S on
        QGMMA from sQ (and sQ_lo) and the staged K tiles, O = P V from o_setup."""
        f8 = cutlass.Float8E4M3FN
        sQ_layout = fp8_tile_layout(ROWS)
        staged = fp8_tile_layout(self.page, self.stages)
        sQ = storage.sq.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sQlo = self.q_lo_field(storage).get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner, dtype=f8) \
            if self.split_q else sQ
        sK = storage.bufk.get_tensor(staged.outer, swizzle=staged.inner)
        mma_s = sm90.make_trivial_tiled_mma(f8, f8, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                                            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS, self.page))
        thr_s = mma_s.get_slice(tidx)
        if self.q_lo_regs:  # the lo tile -> registers (A from RMEM), before the first V overwrites it
            mma_s_lo = sm90.make_trivial_tiled_mma(f8, f8, cute.nvgpu.OperandMajorMode.K,
                                                   cute.nvgpu.OperandMajorMode.K, Float32, atom_layout_mnk=(1, 1, 1),
                                                   tiler_mn=(ROWS, self.page), a_source=warpgroup.OperandSource.RMEM)
            thr_lo = mma_s_lo.get_slice(tidx)
            tSrQlo = thr_lo.make_fragment_A(thr_lo.partition_shape_A((ROWS, HEAD_DIM)))
            cute.autovec_copy(thr_lo.partition_A(sQlo), tSrQlo)
        else:
            mma_s_lo = mma_s
            tSrQlo = thr_s.make_fragment_A(thr_s.partition_A(sQlo))
        return dict(
            self.o_setup(storage.sv0 if wg == 0 else storage.sv1, tidx),
            mma_s=mma_s, thr_s=thr_s, mma_s_lo=mma_s_lo,
            tSrQ=thr_s.make_fragment_A(thr_s.partition_A(sQ)), tSrQlo=tSrQlo,
            tSrK=thr_s.make_fragment_B(thr_s.partition_B(sK)),
        )

    @cute.jit
    def mma_loop(self, mOut, mLse, mPO, mPL, storage, sPages, sBlocks, sMasks, sKvLen, full_ptr, empty_ptr, tma,
                 req, h, tile, split, num_splits, qlen, n_tok, first, n_union, qk_scale_log2, v_scale,
                 tidx, wg: cutlass.Constexpr):
        """MMA warpgroup wg (thread tidx of its 128): the split's blocks wg, wg + wgs, ... of n_union
        (union blocks first + i); warpgroup 0 merges the warpgroups' (m, l, O) and stores."""
        bar = BAR_WG + wg
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        m = self.mma_setup(storage, wg, tidx)
        tOrV, tOrP, acc_o = m["tOrV"], m["tOrP"], m["acc_o"]
        p_words = cute.make_tensor(cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(ROWS * self.page // 256))
        bufk = ptx.smem_addr(storage.bufk.data_ptr())
        bufv = ptx.smem_addr(storage.bufv.data_ptr())
        sQScale = storage.qscale.get_tensor(cute.make_layout(ROWS))
        for j in cutlass.range_constexpr(cute.size(acc_o) // 4):  # O, rows 16w + g + 8hh, dims 8j + 2c + e:
            for i in cutlass.range_constexpr(4):  # [e + 2hh + 4j] (by j: one loop of 64 is flagged by the DSL)
                acc_o[4 * j + i] = Float32(0.0)
        row_max, row_sum = row_state()
        # block i's chain: S and V's conversion (s_and_v), softmax, P V. P V is issued and left running
        # on the tensor cores while block i + wgs's stage is waited for and its S issued; no MMA is in
        # flight across the loop's back edge (ptxas serializes every wgmma otherwise: its loop-carried
        # accumulators would be read while one runs)
        acc_s = cute.make_rmem_tensor(m["thr_s"].partition_shape_C((ROWS, self.page)), Float32)
        if wg < n_union:
            self.s_and_v(m, acc_s, tma, sPages, first, wg, n_union, full_ptr, empty_ptr, bufv, bar, tidx, storage)
        for i in range(wg, n_union, self.wgs):
            self.softmax(acc_s, acc_o, p_words, row_max, row_sum, sBlocks[first + i], sMasks[first + i], sKvLen,
                         sQScale, qk_scale_log2, warp, g, c)
            if cutlass.const_expr(self.v_converter):
                cute.arch.mbarrier_wait(storage.tile_full.data_ptr(), i & 1)  # the converter's V tile is in
            else:
                cute.arch.barrier(barrier_id=bar, number_of_threads=WG_THREADS)  # every thread's part of the V tile is in
            self.pv_mma(m["mma_o"], acc_o, tOrP, tOrV)
            if i + self.wgs < n_union:
                self.s_and_v(m, acc_s, tma, sPages, first, i + self.wgs, n_union, full_ptr, empty_ptr, bufv, bar,
                             tidx, storage)
            else:
                self.mma_wait()
        # MMA warpgroup 1's O goes over the K stages (every stage is read by now)
        self.finish(mOut, mLse, mPO, mPL, storage, acc_o, row_max, row_sum, bufk, req, h, tile, split, num_splits,
                    qlen, n_tok, v_scale, tidx, warp, g, c, wg)

    @cute.jit
    def s_and_v(self, m, acc_s, tma, sPages, first, i, n_union, full_ptr, empty_ptr, bufv, bar, tidx, storage):
        """Block i's S into acc_s, issued behind the warpgroup's P V of its previous block, and, once
        every warp's P V is done (the f16 tile is free), its V converted into the tile while S runs;
        returns with S done and the stage released. With v_converter: S only (a bf16 query's two
        chains), the tile handed to the converter once P V is done."""
        s = i % self.stages
        cute.arch.mbarrier_wait(full_ptr + s, (i // self.stages) & 1)
        self.s_mma_issue(m, acc_s, s)
        warpgroup.wait_group(1)  # this thread's share of the previous P V is done (S may still run)
        if cutlass.const_expr(self.v_converter):
            # release: this thread's reads of the tile (P V's, and Q's lo tile before block 0) come first
            cute.arch.mbarrier_arrive(storage.tile_free.data_ptr())
            self.mma_wait()
            self.release_stage_and_refill(tma, sPages, first, i, n_union, full_ptr, empty_ptr, tidx, refill=False)
        else:
            cute.arch.barrier(barrier_id=bar, number_of_threads=WG_THREADS)  # every warp's: the V tile is free
            # its proxy fence comes after the wait: ptxas 12.9 (the DSL's) segfaults on a fence.proxy.async
            # between a wgmma commit and its wait
            self.convert_v(bufv + s * self.tile_bytes, m["v_smem"], tidx)
            self.mma_wait()
            cute.arch.fence_view_async_shared()
            self.release_stage_and_refill(tma, sPages, first, i, n_union, full_ptr, empty_ptr, tidx)

    @cute.jit
    def s_mma_issue(self, m, acc_s, s):
        """S = Q K^T of stage s on QGMMA, issued and committed: asynchronous until mma_wait. A bf16
        query with its lo tile in shared memory: the hi chain, then the lo chain into the same
        accumulator; with the lo tile in registers (q_lo_regs), the lo chain from there."""
        tSrQ, tSrK = m["tSrQ"], m["tSrK"]
        warpgroup.fence()
        atom_s = cute.make_mma_atom(m["mma_s"].op)
        atom_s.set(warpgroup.Field.ACCUMULATE, False)
        for k in cutlass.range_constexpr(cute.size(tSrQ.shape[2])):
            cute.gemm(atom_s, acc_s, tSrQ[None, None, k], tSrK[None, None, k, s], acc_s)
            atom_s.set(warpgroup.Field.ACCUMULATE, True)
        if cutlass.const_expr(self.split_q and not self.q_lo_regs):
            for k in cutlass.range_constexpr(cute.size(tSrQ.shape[2])):
                cute.gemm(atom_s, acc_s, m["tSrQlo"][None, None, k], tSrK[None, None, k, s], acc_s)
        if cutlass.const_expr(self.q_lo_regs):
            self.s_lo_chain(m, acc_s, s)
        warpgroup.commit_group()

    def s_lo_chain(self, m, acc_s, s):
        """The QGMMAs of S += Q_lo K^T of stage s from registers, into the open group (traced inline)."""
        atom_lo = cute.make_mma_atom(m["mma_s_lo"].op)
        atom_lo.set(warpgroup.Field.ACCUMULATE, True)
        for k in range(cute.size(m["tSrQ"].shape[2])):
            cute.gemm(atom_lo, acc_s, m["tSrQlo"][None, None, k], m["tSrK"][None, None, k, s], acc_s)

    def mma_wait(self):
        """Wait for every MMA this warpgroup has issued (S, and P V before it)."""
        warpgroup.wait_group(0)

    @cute.jit
    def softmax(self, acc_s, acc_o, p_words, row_max, row_sum, blk, mask, sKvLen, sQScale, qk_scale_log2, warp, g, c):
        """The online softmax of the thread's accumulator rows r = 16 warp + g + 8 hh (hh = 0, 1) over the block's keys.

        A warp skips the rows of a token that did not select the block (or sees none of its keys):
        their P is zero and their (m, l, O) stay. With G >= 16 the warp's 16 rows are one token,
        with G = 8 each half hh is one; the vote keeps the branch warp-uniform for any G."""
        G = self.group
        lim0 = self.key_limit(blk, mask, sKvLen, (16 * warp + g) // G)
        lim1 = self.key_limit(blk, mask, sKvLen, (16 * warp + g + 8) // G)
        if cutlass.const_expr(G >= 16):  # one token: both halves in one pass (their chains interleave)
            if cute.arch.vote_all_sync(lim0 <= 0):
                self.zero_p(p_words, 0)
                self.zero_p(p_words, 1)
            else:
                self.softmax_rows(acc_s, acc_o, p_words, row_max, row_sum, (0, 1), lim0, sQScale, qk_scale_log2,
                                  warp, g, c)
        else:
            if cute.arch.vote_all_sync(lim0 <= 0):
                self.zero_p(p_words, 0)
            else:
                self.softmax_rows(acc_s, acc_o, p_words, row_max, row_sum, (0,), lim0, sQScale, qk_scale_log2,
                                  warp, g, c)
            if cute.arch.vote_all_sync(lim1 <= 0):
                self.zero_p(p_words, 1)
            else:
                self.softmax_rows(acc_s, acc_o, p_words, row_max, row_sum, (1,), lim1, sQScale, qk_scale_log2,
                                  warp, g, c)

    @cute.jit
    def key_limit(self, blk, mask, sKvLen, j_row):
        """Keys of union block blk that tile token j_row sees (col < limit; <= 0: none)."""
        lim = sKvLen[j_row] - blk * self.page
        if ((mask >> j_row) & 1) == 0:
            lim = Int32(0)
        return lim

    def zero_p(self, p_words, hh: int):
        """P of row half hh := 0 (a skipped token's rows add nothing to O = P V)."""
        for ks in range(self.page // 16):  # traced inline
            for kh in range(2):
                p_words[hh + 2 * kh + 4 * ks] = Int32(0)

    @cute.jit
    def softmax_rows(self, acc_s, acc_o, p_words, row_max, row_sum, hhs: cutlass.Constexpr, lim, sQScale,
                     qk_scale_log2, warp, g, c):
        """Online softmax of the thread's row halves hhs of S over the block's first lim keys (the rest
        -inf); P -> the A fragments of O = P V (k-step ks: keys 16ks + 2c (+1), (+8, +9)). S takes its
        log2 scale inside the exponent's FFMA (the max is taken on unscaled S: the scale is positive);
        reductions are trees. The running max moves only when a row of the warp grows by more than
        RESCALE_LOG2 (O and l rescaled, warp-uniformly); else P is taken against the old max, at most
        2^RESCALE_LOG2, which f16 P and the f32 sums hold as well."""
        ncols = self.page
        n = ncols // 8 * 2  # S elements of a row half per thread
        if lim < ncols:
            for hh in cutlass.range_constexpr(len(hhs)):
                for jj in cutlass.range_constexpr(ncols // 8):
                    for e in cutlass.range_constexpr(2):
                        if 8 * jj + 2 * c + e >= lim:
                            acc_s[e + 2 * hhs[hh] + 4 * jj] = -Float32.inf
        f = [qk_scale_log2, qk_scale_log2]
        m_new = [Float32(0.0), Float32(0.0)]
        grow = Int32(0)
        for hh in cutlass.range_constexpr(len(hhs)):
            r = hhs[hh]
            if cutlass.const_expr(self.split_q):
                f[hh] = qk_scale_log2 * sQScale[16 * warp + g + 8 * r]
            mx = tree(cute.arch.fmax, [acc_s[(k % 2) + 2 * r + 4 * (k // 2)] for k in range(n)])
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 2))
            m_new[hh] = cute.arch.fmax(row_max[r], mx * f[hh])
            if m_new[hh] > row_max[r] + RESCALE_LOG2:
                grow = Int32(1)
        if cute.arch.vote_any_sync(grow != 0):
            for hh in cutlass.range_constexpr(len(hhs)):
                r = hhs[hh]
                m_use = m_new[hh]
                if m_use == -Float32.inf:  # no visible key yet (G < 8 rows of a non-skipped half)
                    m_use = Float32(0.0)
                a = ptx.ex2(row_max[r] - m_use)
                row_max[r] = m_new[hh]
                row_sum[r] = row_sum[r] * a
                for j in cutlass.range_constexpr(HEAD_DIM // 8):
                    for e in cutlass.range_constexpr(2):
                        acc_o[e + 2 * r + 4 * j] = acc_o[e + 2 * r + 4 * j] * a
        for hh in cutlass.range_constexpr(len(hhs)):
            r = hhs[hh]
            m_use = row_max[r]
            if m_use == -Float32.inf:
                m_use = Float32(0.0)
            neg_m = -m_use
            for k in cutlass.range_constexpr(n):
                i = (k % 2) + 2 * r + 4 * (k // 2)
                acc_s[i] = ptx.ex2(ptx.ffma(acc_s[i], f[hh], neg_m))
            row_sum[r] = row_sum[r] + tree(operator.add, [acc_s[(k % 2) + 2 * r + 4 * (k // 2)]
                                                                for k in range(n)])
            for jj in cutlass.range_constexpr(ncols // 8):  # jj = 2ks + kh
                p_words[r + 2 * (jj % 2) + 4 * (jj // 2)] = ptx.f32x2_to_f16x2(acc_s[2 * r + 4 * jj],
                                                                             acc_s[1 + 2 * r + 4 * jj])

    @cute.jit
    def pv_mma(self, mma_o, acc_o, tOrP, tOrV):
        """O += P V on the warpgroup's tensor cores, issued and committed: asynchronous until the next
        block's wait_group(1) (or mma_wait), which P's registers and the V tile wait for too."""
        warpgroup.fence()
        atom_o = cute.make_mma_atom(mma_o.op)
        atom_o.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(cute.size(tOrV.shape[2])):
            cute.gemm(atom_o, acc_o, tOrP[None, None, k], tOrV[None, None, k], acc_o)
        warpgroup.commit_group()

    # ---- the epilogue
    @cute.jit
    def finish(self, mOut, mLse, mPO, mPL, storage, acc_o, row_max, row_sum, o_other, req, h, tile, split,
               num_splits, qlen, n_tok, v_scale, tidx, warp, g, c, wg: cutlass.Constexpr):
        """Merge the MMA warpgroups' (m, l, O) through shared memory (warpgroup 1's O at o_other);
        warpgroup 0 writes out [T, Hq, 128] bf16 and lse [T, Hq] (natural log), or with
        num_splits > 1 this split's normalized O and log2-LSE into partial_o / partial_lse rows
        (t * Hkv + h) * num_splits + split (msa_jit/kernels/split_merge.py's)."""
        G = self.group
        nthr = WG_THREADS
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
        if cutlass.const_expr(self.wgs > 1):
            cute.arch.barrier(barrier_id=BAR_ALL, number_of_threads=nthr * self.wgs)
            if cutlass.const_expr(wg == 1):
                for j in cutlass.range_constexpr(cute.size(acc_o) // 4):  # k = 4j + i, in order (one loop
                    for i in cutlass.range_constexpr(4):  # of 64 is flagged by the DSL)
                        st_shared_f32(o_other + ((4 * j + i) * nthr + tidx) * 4, acc_o[4 * j + i])
            cute.arch.barrier(barrier_id=BAR_ALL, number_of_threads=nthr * self.wgs)
        else:
            cute.arch.barrier(barrier_id=BAR_WG, number_of_threads=nthr)
        if cutlass.const_expr(wg == 0):
            for hh in cutlass.range_constexpr(2):
                m_row = 16 * warp + g + 8 * hh
                j_row = m_row // G
                if j_row < n_tok:
                    m_all, l_all = merged_row_stats(sRowM, sRowL, m_row, self.wgs)
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
                    pidx = (t * self.hkv + h) * num_splits + split  # this split's partial row
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
