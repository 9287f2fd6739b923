"""Device helpers of the sm_90a union kernel (msa_jit/kernels/union.py): the union
of a tile's blocks (`build_union`), its tile layouts and swizzles, the query split into e4m3
halves and the tile's Q staged (`stage_q_fp8`, `stage_q_split`), the fp8 -> f16 V chunk store, the
online softmax's row state and tree reductions, the MMA warpgroups' row merge (`merged_row_stats`),
and the scalar shared / global accesses of its epilogue.

Two shared-memory tile kinds, both 128B-swizzled (the 16-byte chunk index of a byte address
xor its bits 7-9; every tile 1024-byte aligned):

* fp8 (rows, 128) tiles, K-major, one 128-byte row per key or query row: the TMA boxes of K
  and V and the query tiles (`fp8_tile_layout`, `swizzled_fp8`);
* f16 (rows, 128) tiles as two 64-column halves of rows x 128 bytes: the V tile that O = P V
  reads as an MN-major B operand (`f16_tile_layout`, `swizzled_f16`).
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from . import common, ptx
from .constants import E4M3_MAX, HEAD_DIM, UNION_ROWS

BUILD_WARPS = 4  # warps 0-3 compact the tile tokens' slots (token j: warp j % 4)
ROWS = UNION_ROWS  # the warpgroup MMA's M: a tile's tokens x the group's G query heads
BAR_WG = 1  # named barriers 1, 2: the 128 threads of MMA warpgroup 0, 1
BAR_ALL = 3  # both MMA warpgroups
AMAX_MIN = 2.0 ** -100  # a row below it is zero in e4m3 (its S is ~0 in the reference too)
RESCALE_LOG2 = 8.0  # the running max moves only when a row grows past it by more than this (log2 units)


def tree(op, xs: list):
    """op folded over xs as a balanced tree (depth log2 n, not a chain of n)."""
    while len(xs) > 1:
        xs = [op(xs[i], xs[i + 1]) for i in range(0, len(xs) - 1, 2)] + ([xs[-1]] if len(xs) % 2 else [])
    return xs[0]


def row_state():
    """(row max, row sum) of a thread's two accumulator rows: -inf, 0 (traced inline)."""
    row_max = cute.make_rmem_tensor(2, Float32)
    row_sum = cute.make_rmem_tensor(2, Float32)
    for hh in range(2):
        row_max[hh] = -Float32.inf
        row_sum[hh] = Float32(0.0)
    return row_max, row_sum


@dsl_user_op
def st_global_b32(addr: Int64, w: Int32, *, loc=None, ip=None) -> None:
    ptx._asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(w).ir_value(loc=loc, ip=ip)],
             "st.global.b32 [$0], $1;", "l,r", side_effects=True)


@dsl_user_op
def st_global_v2_f32(addr: Int64, v0: Float32, v1: Float32, *, loc=None, ip=None) -> None:
    """st.global.v2.f32 at an 8-byte aligned address."""
    ptx._asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(v0).ir_value(loc=loc, ip=ip),
                    Float32(v1).ir_value(loc=loc, ip=ip)], "st.global.v2.f32 [$0], {$1, $2};", "l,f,f",
             side_effects=True)


@dsl_user_op
def st_shared_f32(addr: Int32, v: Float32, *, loc=None, ip=None) -> None:
    ptx._asm(None, [Int32(addr).ir_value(loc=loc, ip=ip), Float32(v).ir_value(loc=loc, ip=ip)],
             "st.shared.f32 [$0], $1;", "r,f", side_effects=True)


@dsl_user_op
def ld_shared_f32(addr: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(ptx._asm(T.f32(), [Int32(addr).ir_value(loc=loc, ip=ip)], "ld.shared.f32 $0, [$1];", "=f,r",
                            side_effects=True))


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


def f16_tile_layout(rows: int):
    """The 128B-swizzled K-major f16 layout of a (rows, 128) tile (two 64-column halves)."""
    atom = warpgroup.make_smem_layout_atom(sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.Float16, HEAD_DIM),
                                           cutlass.Float16)
    return cute.tile_to_shape(atom, (rows, HEAD_DIM), order=(0, 1))


@cute.jit
def swizzled_fp8(row, col):
    """Byte offset of (row, col) in an fp8_tile_layout tile (col % 16 == 0): 128-byte rows, the
    16-byte chunk index xor row % 8."""
    b = row * HEAD_DIM + col
    return b ^ ((b >> 3) & 0x70)


@cute.jit
def swizzled_f16(rows: cutlass.Constexpr, row, col):
    """Byte offset of element (row, col) of an f16_tile_layout(rows) tile (col % 8 == 0 for 16-byte
    chunks): linear 64 * row + col % 64 + rows * 64 * (col // 64) elements, then the 128B swizzle
    on the byte address (bits 4-6 ^= bits 7-9; the tile is 1024-byte aligned)."""
    b = (row * 64 + (col % 64) + (col // 64) * (rows * 64)) * 2
    return b ^ ((b >> 3) & 0x70)


@cute.jit
def store_f16_chunks(dst, w, c8):
    """The 16 e4m3 bytes of w (4 words) as 16 f16 at dst (the even 16-byte chunk of a swizzled tile
    row, col 16c8) and the odd chunk after it (byte offset ^ 16). The 8 threads of a key row are one
    phase of a 16-byte store: threads c8 < 4 store their even chunk first, the others their odd
    one, so a phase covers 8 different bank groups (even chunks of one half, odd of the other)."""
    f = []
    for k in cutlass.range_constexpr(4):
        f.append(ptx.e4m3x2_to_f16x2(w[k], 0))
        f.append(ptx.e4m3x2_to_f16x2(w[k], 1))
    hi = c8 // 4
    first = dst ^ (16 * hi)
    ptx.st_shared_v4(first, cutlass.select_(hi == 0, f[0], f[4]), cutlass.select_(hi == 0, f[1], f[5]),
                     cutlass.select_(hi == 0, f[2], f[6]), cutlass.select_(hi == 0, f[3], f[7]))
    ptx.st_shared_v4(first ^ 16, cutlass.select_(hi == 0, f[4], f[0]), cutlass.select_(hi == 0, f[5], f[1]),
                     cutlass.select_(hi == 0, f[6], f[2]), cutlass.select_(hi == 0, f[7], f[3]))


@cute.jit
def build_union(mTopk, mBT, mKvLens, num_pages, storage, union_lists, sKvLen, req, h, tile, qlen, n_tok, warp, lane,
                tile_tokens: cutlass.Constexpr, topk: cutlass.Constexpr, page_size: cutlass.Constexpr):
    """The union of the blocks of a tile's tokens -> union_lists (pages, blocks, token masks:
    shared-memory int32 tensors) [0, n); returns n (every thread). `storage`: the kernel's struct
    (its tok_pages, tok_blocks and ballots scratch).

    Token j of the tile (j < tile_tokens) is compacted by warp j % 4 (its valid slots, as
    common.compact_valid_slots does, -1 past them); then lane l of that warp owns token j's
    slot l: its block is a union entry unless an earlier (slot rank, token) holds the same
    block, and its mask has bit j' for every token j' that selected it. sKvLen[j] gets token
    j's kv_len (0 past the tile's tokens).
    """
    TT = tile_tokens
    per_warp = TT // BUILD_WARPS
    sTokPages = storage.tok_pages.get_tensor(cute.make_layout(32 * TT))
    sTokBlocks = storage.tok_blocks.get_tensor(cute.make_layout(32 * TT))
    sBallots = storage.ballots.get_tensor(cute.make_layout(TT))
    sPages, sBlocks, sMasks = union_lists
    if warp < BUILD_WARPS:
        for k in cutlass.range_constexpr(per_warp):
            j = warp + BUILD_WARPS * k
            sTokBlocks[j * 32 + lane] = Int32(-1)
            cute.arch.sync_warp()
            kv_len = Int32(0)
            if j < n_tok:
                t = req * qlen + tile * TT + j
                kv_len = mKvLens[t]
                tok_pages = cute.make_tensor(sTokPages.iterator + j * 32, cute.make_layout(32))
                tok_blocks = cute.make_tensor(sTokBlocks.iterator + j * 32, cute.make_layout(32))
                common.compact_valid_slots(mTopk, mBT, t, h, req, kv_len, num_pages, lane, tok_pages,
                                           tok_blocks, topk, page_size)
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
    if warp < BUILD_WARPS:
        for k in cutlass.range_constexpr(per_warp):
            j = warp + BUILD_WARPS * k
            if lane < topk:
                my_blk[k] = sTokBlocks[j * 32 + lane]
                my_page[k] = sTokPages[j * 32 + lane]
            my_key = lane * TT + j  # union order: slot rank, then token
            b_mine = my_blk[k]
            mask = Int32(0)
            dup = Int32(0)
            for j2 in range(TT):
                for kk in cutlass.range_constexpr(topk):
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
    if warp < BUILD_WARPS:
        for k in cutlass.range_constexpr(per_warp):
            j = warp + BUILD_WARPS * k
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
def stage_q_fp8(words, q_smem, tidx):
    """Q of the tile (the kernel's q_half_row words) -> sQ (fp8 as given, 128B-swizzled): thread tidx (< 128)
    writes half (64 bytes) of row tidx // 2."""
    for p in cutlass.range_constexpr(4):
        ptx.st_shared_v4(q_smem + swizzled_fp8(tidx // 2, 64 * (tidx % 2) + 16 * p),
                         words[4 * p], words[4 * p + 1], words[4 * p + 2], words[4 * p + 3])
    cute.arch.fence_view_async_shared()


@cute.jit
def stage_q_split(words, q_hi, q_lo, sScale, tidx):
    """Q of the tile (the kernel's q_half_row bf16 words) -> sQ (hi) and sQ_lo (lo), e4m3, 128B-swizzled, and
    each row's scale: thread tidx (< 128) takes half (64 dims) of row tidx // 2; zero rows get
    scale 0."""
    qrow = tidx // 2
    qhalf = tidx % 2
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
def merged_row_stats(sRowM, sRowL, n, wgs: cutlass.Constexpr):
    """(max, sum) of tile row n over the kernel's wgs MMA warpgroups (log2 units, sums rescaled to the
    max): the rows' (m, l) in sRowM / sRowL, warpgroup w's at w * ROWS."""
    m_all = sRowM[n]
    l_all = sRowL[n]
    if cutlass.const_expr(wgs > 1):
        m1 = sRowM[ROWS + n]
        m_new = cute.arch.fmax(m_all, m1)
        m_use = m_new
        if m_new == -Float32.inf:
            m_use = Float32(0.0)
        l_all = l_all * ptx.ex2(m_all - m_use) + sRowL[ROWS + n] * ptx.ex2(m1 - m_use)
        m_all = m_new
    return m_all, l_all
