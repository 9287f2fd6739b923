"""The split merge inside the decode launch, through distributed shared memory.

With num_splits > 1 the split CTAs of a (token, KV head) are one thread-block cluster
(1, 1, num_splits): split r is cluster rank r. Row `row` of the GQA group is merged by rank
row % num_splits. Each split pushes its normalized partial row (128 fp32) and log2-LSE straight
from registers into the merging CTA's receive buffer with `st.async`, which completes its bytes
on that CTA's mbarrier (a row it merges itself goes there by plain shared stores); the merging
CTA waits on its own mbarrier for every byte it expects, then combines its rows as the merge
kernel does (split_merge.combine_splits). No second launch, no partials in global memory, no
cluster-wide barrier at the end (a CTA that merges nothing exits after its pushes; one that
merges cannot exit before all bytes for it have landed).

The only cluster barrier is split: every thread arrives right after the mbarriers are
initialized (fence.mbarrier_init first), and a consumer waits just before its first push, long
after every CTA of the cluster has arrived.
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import ptx
from .constants import HEAD_DIM, MAX_CLUSTER_SPLITS
from .split_merge import combine_splits

PART_BYTES = 4 * HEAD_DIM  # one partial row, fp32
# partial rows a CTA can receive: ceil(G / num_splits) rows x num_splits splits, which is
# max(G, num_splits) <= 16 when one divides the other (the planner's 2, 4, 8, 16 splits at G 8 / 16)
RECV_SLOTS = MAX_CLUSTER_SPLITS
# the mbarrier sits behind the partial rows and their log2-LSEs (8-byte aligned)
RECV_BAR_OFFSET = RECV_SLOTS * (PART_BYTES + 4)
RECV_BYTES = RECV_BAR_OFFSET + 8


class ClusterMerge:
    """Static config in __init__; `fits` decides per launch (host and device alike); device code
    in `init`, `push` and `merge`, called by the decode kernel."""

    def __init__(self, *, group_size: int, max_splits: int, threads: int):
        self.group = group_size
        self.threads = threads  # the threads that push and merge (named barrier 1)
        # the merge's split loop is unrolled to at most 16 (the largest cluster)
        self.max_splits = min(max_splits, RECV_SLOTS)

    def fits(self, num_splits):
        """Host side: does a launch of `num_splits` > 1 (a runtime Int32) merge in a cluster? Yes when
        its receive slots fit RECV_SLOTS (more than 16 splits need more slots, so they never fit);
        otherwise the partials go through global memory to the merge kernel. The device side asks
        `in_cluster` instead, so it follows whatever the launch did."""
        return (self.group + num_splits - 1) // num_splits * num_splits <= RECV_SLOTS

    @cute.jit
    def in_cluster(self):
        """Device side: was this CTA launched in a cluster of more than one CTA (then of num_splits,
        rank == split)? st.async and the cluster barrier need one."""
        return cute.arch.cluster_size() > 1

    def divmod_splits(self, x, num_splits):
        """(x // num_splits, x % num_splits) for x >= 0; python ints (the host's tests) or device Int32s."""
        if isinstance(num_splits, int):
            return x // num_splits, x % num_splits
        return self.divmod_device(x, num_splits)

    @cute.jit
    def divmod_device(self, x: Int32, num_splits: Int32):
        """divmod_splits on the device, for 1 <= num_splits <= RECV_SLOTS (fits() holds for every launch that
        merges in a cluster): by shift and mask when num_splits is a power of two (the planner's 2, 4, 8,
        16), else by division (3 and 6, which fit at G = 8), whose ~25 dependent instructions sat twice on
        a batch-1 layer's critical path (docs/performance.md)."""
        q = Int32(0)
        r = Int32(0)
        if num_splits & (num_splits - 1) == 0:
            shift = Int32(0)
            for b in cutlass.range_constexpr(1, 5):  # num_splits <= RECV_SLOTS = 16
                if num_splits >= (1 << b):
                    shift = Int32(b)
            q = x >> shift
            r = x & (num_splits - 1)
        else:
            q = x // num_splits
            r = x - q * num_splits
        return q, r

    def route(self, row, split, num_splits):
        """(cluster rank that merges `row`, its receive slot for split `split`'s partial row):
        rank row % num_splits, slot (row // num_splits) * num_splits + split."""
        q, r = self.divmod_splits(row, num_splits)
        return r, q * num_splits + split

    def rows_merged(self, rank, num_splits):
        """How many group rows cluster rank `rank` merges: rank, rank + num_splits, ... < G."""
        return self.divmod_splits(self.group - rank + num_splits - 1, num_splits)[0]

    def merge_slot(self, j, split, num_splits):
        """The receive slot merge() reads for split `split` of the j-th row it merges (row
        rank + j * num_splits): route()'s slot for that row."""
        return j * num_splits + split

    def peer_bytes(self, rows, num_splits):
        """The bytes a rank merging `rows` rows receives by st.async: each row's partial (PART_BYTES)
        and log2-LSE (4) from every split but itself."""
        return rows * (num_splits - 1) * (PART_BYTES + 4)

    @cute.jit
    def init(self, recv: Int32):
        """One thread, before the CTA's mbarrier_init_fence: the receive mbarrier, one arrival
        (the merging CTA's own expect_tx) plus the pushed bytes."""
        ptx.mbarrier_init(recv + RECV_BAR_OFFSET, 1)

    @cute.jit
    def arrive(self, num_splits: Int32):
        """Every thread, after the CTA's mbarrier_init_fence: this CTA's receive mbarrier is set up."""
        if self.in_cluster():
            cute.arch.cluster_arrive_relaxed()

    @cute.jit
    def wait(self, num_splits: Int32):
        """Every pushing thread, before its push: every CTA of the cluster has arrived."""
        if self.in_cluster():
            cute.arch.cluster_wait()

    @cute.jit
    def push(self, recv: Int32, split: Int32, num_splits: Int32, row: Int32, d0: Int32, vals, lse2: Float32,
             n_vals: cutlass.Constexpr):
        """This thread's dims [d0, d0 + n_vals) of partial row `row` (fp32 registers `vals`) and,
        for d0 == 0, the row's log2-LSE, into the receive buffer of cluster rank row % num_splits."""
        dest, slot = self.route(row, split, num_splits)
        part = recv + slot * PART_BYTES + d0 * 4
        lse = recv + RECV_SLOTS * PART_BYTES + 4 * slot
        if dest == split:  # st.async is for peers: this CTA's own rows by plain stores (merge's barrier)
            for q in cutlass.range_constexpr(n_vals // 4):
                ptx.st_shared_v4_f32(part + 16 * q, vals[4 * q], vals[4 * q + 1], vals[4 * q + 2], vals[4 * q + 3])
            if d0 == 0:
                ptx.st_shared_f32(lse, lse2)
        else:
            bar = ptx.mapa_shared(recv + RECV_BAR_OFFSET, dest)
            dst = ptx.mapa_shared(part, dest)
            for q in cutlass.range_constexpr(n_vals // 4):
                ptx.st_async_v4_f32(dst + 16 * q, bar, vals[4 * q], vals[4 * q + 1], vals[4 * q + 2], vals[4 * q + 3])
            if d0 == 0:
                ptx.st_async_f32(ptx.mapa_shared(lse, dest), bar, lse2)

    @cute.jit
    def wait_for_peers(self, recv: Int32, split: Int32, num_splits: Int32, d: Int32):
        """How many group rows this CTA merges (0: none, or the launch does not merge in a cluster) and,
        when it merges any, wait until this CTA's own partial rows are visible to every pushing thread
        and every peer's bytes for them have landed. Every one of the `threads` pushing threads calls
        it, after its push; thread d == 0 arms the mbarrier."""
        n_rows = Int32(0)
        if self.in_cluster() and split < self.group:
            n_rows = self.rows_merged(split, num_splits)
        if n_rows > 0:
            # this CTA's own partial rows (plain stores in push) are visible to every merging thread
            cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
            bar = recv + RECV_BAR_OFFSET
            if d == 0:  # the peers' bytes: n_rows rows of num_splits - 1 partials each
                ptx.mbarrier_arrive_expect_tx(bar, self.peer_bytes(n_rows, num_splits))
            done = ptx.mbarrier_try_wait_cluster(bar, Int32(0))
            while done == 0:
                done = ptx.mbarrier_try_wait_cluster(bar, Int32(0))
        return n_rows

    @cute.jit
    def merge(self, mOut: cute.Tensor, mLse: cute.Tensor, recv: Int32, t: Int32, hq0: Int32, split: Int32,
              num_splits: Int32, d: Int32):
        """Rows split, split + num_splits, ... (< G) of the group whose first query head is hq0:
        wait for their num_splits partials each (wait_for_peers), then thread d < 128 merges dim d of
        each row into out[t, hq0 + row, d] (bf16) and, for d == 0, lse[t, hq0 + row] (natural log).
        Every one of the `threads` pushing threads calls it, after its push; nothing when the launch
        does not merge in a cluster."""
        n_rows = self.wait_for_peers(recv, split, num_splits, d)
        if n_rows > 0:
            if d < HEAD_DIM:
                # the planner's split counts (powers of two) each get a merge traced for that count alone;
                # the loop below, unrolled to max_splits predicated partials per row and one row after
                # another, was ~1800 instructions per thread at 2 splits (8 rows of 16 slots each), on the
                # critical path of every split layer's last CTA
                if num_splits == 2:
                    self.merge_rows(mOut, mLse, recv, t, hq0, split, d, 2)
                elif num_splits == 4:
                    self.merge_rows(mOut, mLse, recv, t, hq0, split, d, 4)
                elif num_splits == 8:
                    self.merge_rows(mOut, mLse, recv, t, hq0, split, d, 8)
                elif num_splits == 16:
                    self.merge_rows(mOut, mLse, recv, t, hq0, split, d, 16)
                else:  # any other count (3, 6 at G = 8, a topk that is no power of two)
                    for j in range(n_rows):
                        row = split + j * num_splits
                        lse_at = recv + RECV_SLOTS * PART_BYTES
                        out, lse_nat = combine_splits(
                            self.max_splits, num_splits,
                            lambda s: ptx.ld_shared_f32(lse_at + 4 * self.merge_slot(j, s, num_splits)),
                            lambda s: ptx.ld_shared_f32(recv + self.merge_slot(j, s, num_splits) * PART_BYTES + 4 * d))
                        self.store_row(mOut, mLse, t, hq0 + row, d, out, lse_nat)

    @cute.jit
    def merge_rows(self, mOut: cute.Tensor, mLse: cute.Tensor, recv: Int32, t: Int32, hq0: Int32, split: Int32,
                   d: Int32, n: cutlass.Constexpr):
        """merge() for a launch of exactly n splits (thread d < 128): the rows split, split + n, ... (< G)
        unrolled, each over its n partials, no predicated slot. Every row's slots lie inside the receive
        buffer (fits()), so all rows are loaded and combined unconditionally (independent chains the
        scheduler interleaves) and only the stores of a row past G are skipped."""
        if cutlass.const_expr(n <= self.max_splits):
            lse_at = recv + RECV_SLOTS * PART_BYTES
            for j in cutlass.range_constexpr((self.group + n - 1) // n):
                row = split + j * n
                out, lse_nat = combine_splits(
                    n, n,
                    lambda s: ptx.ld_shared_f32(lse_at + 4 * self.merge_slot(j, s, n)),
                    lambda s: ptx.ld_shared_f32(recv + self.merge_slot(j, s, n) * PART_BYTES + 4 * d))
                if row < self.group:
                    self.store_row(mOut, mLse, t, hq0 + row, d, out, lse_nat)

    @cute.jit
    def store_row(self, mOut: cute.Tensor, mLse: cute.Tensor, t: Int32, hq: Int32, d: Int32, out: Float32,
                  lse_nat: Float32):
        """Dim d of query head hq's merged output (bf16) and, for d == 0, its natural-log LSE."""
        mOut[t, hq, d] = out.to(cutlass.BFloat16)
        if d == 0:
            mLse[t, hq] = lse_nat
