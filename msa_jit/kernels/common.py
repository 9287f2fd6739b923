"""Device-side steps shared by every decode kernel (portable and SM100): one copy each.

All are @cute.jit functions, inlined into the calling kernel.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from . import ptx


@cute.jit
def compact_valid_slots(mTopk, mBT, t, h, req, kv_len, num_pages, lane, sPages, sBlocks,
                        topk: cutlass.Constexpr, page_size: cutlass.Constexpr):
    """One warp: the usable slots of topk[t, h, :] -> sPages / sBlocks at ranks 0..n-1.

    A slot is used when s < nvalid = min(topk, ceil(kv_len / page)), its block is in
    [0, max_blocks) and starts before kv_len, and the block table maps it to a page in
    [0, num_pages): anything else (-1, past the request, garbage) is never dereferenced.
    Returns the warp's ballot of used slots (popc = how many).
    """
    max_blocks = mBT.shape[1]
    slot_ok = False
    page = Int32(0)
    blk = Int32(-1)
    if lane < topk:  # issued together with the caller's kv_len load
        blk = mTopk[t, h, lane]
    nvalid = cutlass.min(Int32(topk), (kv_len + (page_size - 1)) // page_size)
    if lane < nvalid and blk >= 0 and blk < max_blocks and blk * page_size < kv_len:
        page = mBT[req, blk]
        if page >= 0 and page < num_pages:
            slot_ok = True
    ballot = cute.arch.vote_ballot_sync(slot_ok)
    rank = cute.arch.popc(ballot & cute.arch.lanemask_lt())
    if slot_ok:
        sPages[rank] = page
        sBlocks[rank] = blk
    return ballot


@cute.jit
def split_range(n_valid, num_splits, split):
    """(first slot, slot count) of split `split` when n_valid slots go to num_splits CTAs."""
    per_split = (n_valid + num_splits - 1) // num_splits
    first = split * per_split
    n_iter = cutlass.max(cutlass.min(n_valid - first, per_split), Int32(0))
    return first, n_iter


@cute.jit
def stream_pages(mKV, sPages, h, first, n_iter, buf_addr, full_ptr, empty_ptr,
                 stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr, num_kv_heads: cutlass.Constexpr):
    """Producer (one thread): bulk-copy each selected (page, KV head) chunk into the stage ring.

    Stage s = i % stages is reused once its `empty` barrier completed the previous phase;
    `full[s]` completes when the copy's bytes have landed.
    """
    kv_base = mKV.iterator.toint()
    for i in range(n_iter):
        s = i % stages
        phase = (i // stages) & 1
        cute.arch.mbarrier_wait(empty_ptr + s, phase ^ 1)
        cute.arch.mbarrier_arrive_and_expect_tx(full_ptr + s, stage_bytes)
        chunk = Int64(sPages[first + i]) * num_kv_heads + Int64(h)
        ptx.bulk_copy_g2s(
            buf_addr + s * stage_bytes,
            kv_base + chunk * stage_bytes,
            stage_bytes,
            ptx.smem_addr(full_ptr + s),
        )
