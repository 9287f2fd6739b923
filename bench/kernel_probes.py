"""Timing probes and retired options of the portable kernel, for the bench only.

`ProbeMmaKernel` subclasses the shipped `SparseDecodeTokenKernel` (kernels/sparse_decode_mma.py)
and overrides one role each; nothing here is in the shipped kernel sources, so experiments
never change a user's cache key. `bench/variants.py` builds it through
`compile_sparse_decode(..., kernel_class=ProbeMmaKernel, kernel_options=...)`.

Options (besides the shipped kernel's):
  probe="no_math"   consumers release every stage unread (results wrong): the stream alone
  probe="no_copy"   the producer completes each stage without copying (results wrong): the math alone
  probe="stream"    no_math without the epilogue (no reduction, no partial, no merge; a cluster build's
                    CTAs still wait on the cluster barrier they arrived on): the index chain and the
                    bytes in this kernel's shape, the part of #19's floor probe this kernel does
  probe="trace"     the full kernel; thread 0 of each CTA writes TRACE_WORDS int32 words over the
                    start of the CTA's partial_o slot (unused when num_splits == 1;
                    bench/trace_ctas.py reads them): smid | n_iter << 16, then %globaltimer_lo at
                    entry, after the PDL wait, after the slots are compacted, at the first and the
                    last full stage, after warp 0's last block, after the epilogue. With
                    split_merge="cluster" the slot is unused at every split count, and the
                    epilogue's end is after the push (and, on a merging CTA, after its merge)
  epilogue_part=    with probe="no_math" and split_merge="cluster" (session 25): "reduce" ends each CTA after its
                    4-warp reduction (no push, no merge, no store), "push" after its pushes and, on a
                    merging CTA, the wait for its peers' bytes (no combine, no store); "all" (default)
                    is the whole epilogue; "bars" keeps only the reduction's two CTA barriers (then the
                    cluster wait): what the barriers cost beside the reduction's data movement;
                    with probe="stream", "alu_unrolled" / "alu_loop" run the same ALU_STEPS x 8
                    independent xorshift steps per thread (~1000 integer ops) straight-line (~15 KiB of
                    code) or in a loop (~0.5 KiB): if the straight-line code costs more than the loop,
                    cold instruction fetch is on a batch-1 layer's critical path
  pdl=False         no programmatic dependent launch (the default until 2026-12-02 T1511)
  v_loads="v4"      V read with 16-byte shared loads (4-way bank conflicts; "rotated" since T1425)
  prefetch_bt=True  L2 prefetch of the request's block-table row before the topk-dependent lookup
                    (measured slower, variants-2026-12-02T1617.json)
  merge_trigger=T/F the split merge with / without its griddepcontrol.launch_dependents (none until
                    2026-12-04: the next layer's decode kernel was scheduled only when the merge
                    ended; since, the 2-CTA build's merge triggers, kv-format-ab-2026-12-04T1519)
  release="warp"    lane 0 arrives on a stage's `empty` barrier after `sync_warp` (the shipped way
                    until session 10; every lane arrives since, "lanes"): racecheck reports every
                    refill as a hazard (bench/results/race-ab-2026-12-04.log). Also tried there: the
                    "warp" way plus `fence.proxy.async.shared::cta` by every lane (the same hazards:
                    no proxy fence is missing)
  release="bar"     lane 0 arrives after a named barrier of the warp's 32 threads (`bar.sync 2 + warp,
                    32`): racecheck still reports the same hazards (race-2026-12-04-s10.log)
  convert="none"    NVFP4 K / V fragments are the raw code words (no conversion, no block scale;
                    results wrong): with probe="no_copy", the loop's math without the conversion
  convert="no_cvt"  the integer part of the e2m1 -> e4m3 step kept, its 4 F2FP per 8 codes left out
                    (row 61 priced the cvt form; since row 63 the kernel places the bits by PRMT
                    instead, and this probe leaves those 4 permutes out)
  convert="no_scale" the conversion kept, the block scale's HMUL2 left out (session 12, row 61)
Retired without a probe here (their commits keep them): the fp8 bit trick (`convert="bittrick"`,
before 6b956f7's parent), one 2-byte store per output element (`out_stores="scalar"`, 0b2e8da).

`kernel` and `consume` of the trace probe mirror the shipped ones with the timer reads added;
re-mirror them when those change (tests/test_kernel_options.py compiles every probe).
"""

# no `from __future__ import annotations`: the DSL reads evaluated annotations
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cutlass_dsl import T, dsl_user_op

from msa_jit.jit.compiler import kernels_package

kernels_package()
from msa_jit.kernels import common, ptx  # noqa: E402
from msa_jit.kernels.cluster_merge import RECV_BYTES, ClusterMerge  # noqa: E402
from msa_jit.kernels.token import ROW_BYTES, SparseDecodeTokenKernel  # noqa: E402

TRACE_WORDS = 8
PROBES = ("full", "no_math", "no_copy", "trace", "stream")
CONVERTS = ("full", "none", "no_cvt", "no_scale")
RELEASES = ("lanes", "warp", "bar")
EPILOGUE_PARTS = ("all", "reduce", "push", "bars", "alu_unrolled", "alu_loop")
ALU_STEPS = 20


class ProbeClusterMerge(ClusterMerge):
    """The cluster merge cut short (epilogue_part): "reduce" pushes and merges nothing, "push" pushes
    and waits for the peers' bytes but neither combines nor stores."""

    def __init__(self, *, part: str, **kw):
        super().__init__(**kw)
        self.part = part

    @cute.jit
    def push(self, recv: Int32, split: Int32, num_splits: Int32, row: Int32, d0: Int32, vals, lse2: Float32,
             n_vals: cutlass.Constexpr):
        if cutlass.const_expr(self.part != "reduce"):
            ClusterMerge.push(self, recv, split, num_splits, row, d0, vals, lse2, n_vals)

    @cute.jit
    def merge(self, mOut: cute.Tensor, mLse: cute.Tensor, recv: Int32, t: Int32, hq0: Int32, split: Int32,
              num_splits: Int32, d: Int32):
        if cutlass.const_expr(self.part == "push"):
            self.wait_for_peers(recv, split, num_splits, d)


@dsl_user_op
def globaltimer_lo(*, loc=None, ip=None) -> Int32:
    """Low 32 bits of %globaltimer (ns, one clock for every SM)."""
    return Int32(ptx._asm(T.i32(), [], "mov.u32 $0, %globaltimer_lo;", "=r", side_effects=True))


@dsl_user_op
def smid(*, loc=None, ip=None) -> Int32:
    """%smid: the SM this thread runs on."""
    return Int32(ptx._asm(T.i32(), [], "mov.u32 $0, %smid;", "=r", side_effects=True))


@dsl_user_op
def e2m1x8_bits_only(w: Int32, *, loc=None, ip=None):
    """The e2m1 -> byte integer ops (row 61's e4m3 form) without the 4 cvt / prmt that make f16x2."""
    s = ptx._asm(
        ptx.llvm.StructType.get_literal([T.i32()] * 2),
        [Int32(w).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 t, u;\n\t"
        "shl.b32 t, $2, 2;\n\tand.b32 t, t, 0x1C1C1C1C;\n\tshl.b32 u, $2, 4;\n\t"
        "lop3.b32 $0, u, t, 0x80808080, 0xEC;\n\t"
        "shr.u32 t, $2, 2;\n\tand.b32 t, t, 0x1C1C1C1C;\n\t"
        "lop3.b32 $1, $2, t, 0x80808080, 0xEC;\n\t}",
        "=r,=r,r",
    )
    ey, ez = ptx._unpack(s, 2, T.i32(), Int32, loc, ip)
    return ey, ey ^ 0x10001, ez, ez ^ 0x10001  # four values, as the cvt's (XOR: one cheap op each)


@dsl_user_op
def prefetch_l2(addr: Int64, *, loc=None, ip=None) -> None:
    """prefetch.global.L2 [addr]."""
    ptx._asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)], "prefetch.global.L2 [$0];", "l", side_effects=True)


class ProbeMmaKernel(SparseDecodeTokenKernel):
    """The shipped portable kernel plus one probe or retired option (see the module docstring)."""

    def __init__(self, *, probe: str = "full", pdl: bool = True, v_loads: str = "rotated",
                 prefetch_bt: bool = False, release: str = "lanes", merge_trigger: bool | None = None,
                 convert: str = "full", epilogue_part: str = "all", **options):
        super().__init__(**options)
        if epilogue_part not in EPILOGUE_PARTS:
            raise ValueError(f"epilogue_part {epilogue_part!r} not in {EPILOGUE_PARTS}")
        self.epilogue_part = epilogue_part
        if epilogue_part != "all":
            if self.cluster_merge is None or probe != ("stream" if epilogue_part.startswith("alu") else "no_math"):
                raise ValueError("epilogue_part needs split_merge='cluster' and probe='no_math' ('stream' for alu_*)")
        if epilogue_part in ("reduce", "push"):
            self.cluster_merge = ProbeClusterMerge(part=epilogue_part, group_size=self.group, max_splits=self.topk,
                                                   threads=self.consumer_threads)
        for name, value, allowed in (("probe", probe, PROBES), ("v_loads", v_loads, ("rotated", "v4")),
                                     ("release", release, RELEASES), ("convert", convert, CONVERTS)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} not in {allowed}")
        self.probe = probe
        self.trace = probe == "trace"
        self.pdl = bool(pdl)
        self.v_rotated = v_loads == "rotated"
        self.prefetch_bt = bool(prefetch_bt)
        self.release = release
        self.convert = convert
        if merge_trigger is not None:
            self.merge_trigger = bool(merge_trigger)
        if release != "lanes":  # one arrival per warp
            self.empty_arrivals = self.warps

    # ---- no_copy: complete each stage without copying
    @cute.jit
    def produce(self, mKV, sPages, h, first, n_iter, buf_addr, full_ptr, empty_ptr):
        if cutlass.const_expr(self.probe != "no_copy"):
            SparseDecodeTokenKernel.produce(self, mKV, sPages, h, first, n_iter, buf_addr, full_ptr, empty_ptr)
        else:
            for i in range(n_iter):
                s = i % self.stages
                cute.arch.mbarrier_wait(empty_ptr + s, ((i // self.stages) & 1) ^ 1)
                cute.arch.mbarrier_arrive(full_ptr + s)

    # ---- no_math: release every stage unread
    @cute.jit
    def consume_block(self, qa, q_lane, acc, row_max, row_sum, stage, empty_bar, blk, kv_len, scale,
                      key_base, g, c, lane):
        if cutlass.const_expr(self.probe in ("no_math", "stream")):
            self.release_stage(empty_bar, lane)
        else:
            SparseDecodeTokenKernel.consume_block(self, qa, q_lane, acc, row_max, row_sum, stage, empty_bar, blk,
                                                kv_len, scale, key_base, g, c, lane)

    # ---- stream: no epilogue
    @cute.jit
    def epilogue(self, mOut, mLse, mPO, mPL, sML, buf_addr, recv, acc, row_max, row_sum,
                 t, h, split, warp, lane, num_splits, v_scale):
        if cutlass.const_expr(self.epilogue_part.startswith("alu")):
            self.alu_chain(buf_addr, warp * 32 + lane, num_splits)
            self.cluster_merge.wait(num_splits)
        elif cutlass.const_expr(self.epilogue_part == "bars"):
            cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
            cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
            self.cluster_merge.wait(num_splits)
        elif cutlass.const_expr(self.probe != "stream"):
            SparseDecodeTokenKernel.epilogue(self, mOut, mLse, mPO, mPL, sML, buf_addr, recv, acc, row_max, row_sum,
                                           t, h, split, warp, lane, num_splits, v_scale)
        elif cutlass.const_expr(self.cluster_merge is not None):
            self.cluster_merge.wait(num_splits)

    @cute.jit
    def alu_chain(self, buf_addr, tid, num_splits):
        """epilogue_part="alu_*": ALU_STEPS rounds of 8 independent xorshifts, the sum to shared memory."""
        x = cute.make_rmem_tensor(8, Int32)
        for k in cutlass.range_constexpr(8):
            x[k] = tid * (2 * k + 1) + num_splits
        if cutlass.const_expr(self.epilogue_part == "alu_unrolled"):
            for _ in cutlass.range_constexpr(ALU_STEPS):
                for k in cutlass.range_constexpr(8):
                    x[k] = self.xorshift(x[k])
        else:
            for _ in cutlass.range(num_splits * 0 + ALU_STEPS, unroll=1):
                for k in cutlass.range_constexpr(8):
                    x[k] = self.xorshift(x[k])
        acc = x[0]
        for k in cutlass.range_constexpr(1, 8):
            acc = acc ^ x[k]
        ptx.st_shared_v4(buf_addr + 16 * tid, acc, acc, acc, acc)

    @cute.jit
    def xorshift(self, v):
        v = v ^ (v << 13)
        v = v ^ (v >> 17)
        return v ^ (v << 5)

    # ---- release="warp" / "bar"
    @cute.jit
    def release_stage(self, empty_bar, lane):
        if cutlass.const_expr(self.release == "warp"):
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(empty_bar)
        elif cutlass.const_expr(self.release == "bar"):
            warp = cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // 32)
            cute.arch.barrier(barrier_id=2 + warp, number_of_threads=32)  # 0: sync_threads, 1: the epilogue
            if lane == 0:
                cute.arch.mbarrier_arrive(empty_bar)
        else:
            SparseDecodeTokenKernel.release_stage(self, empty_bar, lane)

    # ---- convert="none" / "no_cvt" / "no_scale" (NVFP4 only)
    @cute.jit
    def nvfp4_k_frags(self, kraw, kp):
        if cutlass.const_expr(self.convert == "full"):
            return SparseDecodeTokenKernel.nvfp4_k_frags(self, kraw, kp)
        sc = kraw[2]
        if cutlass.const_expr(self.convert == "none"):
            w = kraw[kp]
            return [w, w ^ 0x10001, w ^ 0x20002, w ^ 0x30003]
        if cutlass.const_expr(self.convert == "no_cvt"):
            return [ptx.hmul2(h, sc) for h in e2m1x8_bits_only(kraw[kp])]
        return list(ptx.e2m1x8_to_f16x2x4(kraw[kp]))

    @cute.jit
    def nvfp4_v_frags(self, vraw, grp):
        if cutlass.const_expr(self.convert == "full"):
            return SparseDecodeTokenKernel.nvfp4_v_frags(self, vraw, grp)
        rows, sc01, sc23 = vraw
        w = grp // 2
        base = 4 * grp
        nts = [base, base + 2, base + 1, base + 3]
        if cutlass.const_expr(self.convert == "none"):
            return nts, [(rows[0][w] ^ i, rows[2][w] ^ i) for i in range(4)]
        sel = 0x5140 if grp % 2 == 0 else 0x7362
        a, b = ptx.prmt(rows[0][w], rows[1][w], sel), ptx.prmt(rows[2][w], rows[3][w], sel)
        if cutlass.const_expr(self.convert == "no_cvt"):
            e01, e23 = e2m1x8_bits_only(a), e2m1x8_bits_only(b)
            return nts, [(ptx.hmul2(e01[i], sc01), ptx.hmul2(e23[i], sc23)) for i in range(4)]
        e01, e23 = ptx.e2m1x8_to_f16x2x4(a), ptx.e2m1x8_to_f16x2x4(b)
        return nts, [(e01[i], e23[i]) for i in range(4)]

    # ---- v_loads="v4"
    @cute.jit
    def load_v(self, stage, key_base, sub, g, c):
        if cutlass.const_expr(self.v_rotated):
            return SparseDecodeTokenKernel.load_v(self, stage, key_base, sub, g, c)
        vrow = stage + (key_base + 16 * sub + 4 * c) * ROW_BYTES + 128 + 16 * g
        return [ptx.ld_shared_v4(vrow + i * ROW_BYTES) for i in range(4)]

    # ---- the kernel body with the trace's timer reads and the block-table prefetch
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKV: cute.Tensor, mTopk: cute.Tensor, mBT: cute.Tensor, mKvLens: cute.Tensor,
               mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, mKScale: cute.Tensor,
               mVScale: cute.Tensor, qlen: Int32,
               num_splits: Int32, qk_scale_log2: Float32, v_scale: Float32, Storage: cutlass.Constexpr):
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
        recv = Int32(0)  # the cluster merge's receive buffer, as the shipped kernel() sets it up
        if cutlass.const_expr(self.cluster_merge is not None):
            recv = ptx.smem_addr(smem.allocate_array(cutlass.Uint8, RECV_BYTES, byte_alignment=16))
        tr = cute.make_rmem_tensor(TRACE_WORDS, Int32)
        if cutlass.const_expr(self.trace):
            tr[0] = smid()
            tr[1] = globaltimer_lo()
            tr[4] = Int32(0)  # stays 0 when the CTA has no valid block
            tr[5] = Int32(0)
        if warp == 0:
            if lane == 0:
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full_ptr + s, 1)
                    cute.arch.mbarrier_init(empty_ptr + s, self.empty_arrivals)
                if cutlass.const_expr(self.cluster_merge is not None):
                    self.cluster_merge.init(recv)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            if cutlass.const_expr(self.ctas_per_sm < 3):
                cute.arch.griddepcontrol_launch_dependents()
            elif num_splits > 1:
                cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.trace):
            tr[2] = globaltimer_lo()
        qk_scale_log2 = qk_scale_log2 * mKScale[0] * self.kv_fold
        v_scale = v_scale * mVScale[0] * self.kv_fold

        kv_len = mKvLens[t]
        req = t // qlen
        num_pages = mKV.shape[0]
        if warp == 0:
            if cutlass.const_expr(self.prefetch_bt):
                row = mBT.iterator.toint() + Int64(req) * Int64(mBT.stride[0]) * 4
                row_bytes = mBT.shape[1] * 4
                for off in range(lane * 128, row_bytes, 32 * 128):
                    prefetch_l2(row + Int64(off))
                if lane == 0:  # the row's last line when the row does not start on a line
                    prefetch_l2(row + Int64(row_bytes - 4))
            ballot = common.compact_valid_slots(
                mTopk, mBT, t, h, req, kv_len, num_pages, lane, sPages, sBlocks, self.topk, self.page,
            )
            if lane == 0:
                sNvalid[0] = cute.arch.popc(ballot)
        if cutlass.const_expr(self.q_smem):
            if warp == self.warps:
                self.stage_q(mQ, q_addr, t, h, lane, qk_scale_log2)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if cutlass.const_expr(self.cluster_merge is not None):
            self.cluster_merge.arrive(num_splits)

        n_valid = sNvalid[0]
        first, n_iter = common.split_range(n_valid, num_splits, split)
        if cutlass.const_expr(self.trace):
            tr[3] = globaltimer_lo()
            tr[0] = tr[0] | (n_iter << 16)

        if warp == self.warps:
            if lane == 0:
                self.produce(mKV, sPages, h, first, n_iter, buf_addr, full_ptr, empty_ptr)
        else:
            self.consume_traced(
                mQ, mOut, mLse, mPO, mPL, sBlocks, sML, buf_addr, q_addr, recv, full_ptr, empty_ptr,
                t, h, split, warp, lane, kv_len, first, n_iter, num_splits, qk_scale_log2, v_scale, tr,
            )
            if cutlass.const_expr(self.trace):
                if warp == 0 and lane == 0:
                    tr[7] = globaltimer_lo()
                    idx = (t * self.hkv + h) * num_splits + split
                    slot = mPO.iterator.toint() + Int64(idx) * Int64(mPO.stride[0]) * 4
                    ptx.st_global_v4(slot, tr[0], tr[1], tr[2], tr[3])
                    ptx.st_global_v4(slot + 16, tr[4], tr[5], tr[6], tr[7])

    @cute.jit
    def consume_traced(self, mQ, mOut, mLse, mPO, mPL, sBlocks, sML, buf_addr, q_addr, recv, full_ptr, empty_ptr,
                       t, h, split, warp, lane, kv_len, first, n_iter, num_splits, qk_scale_log2, v_scale, tr):
        g = lane // 4
        c = lane % 4
        qa = cute.make_rmem_tensor(32, Int32)
        if cutlass.const_expr(not self.q_smem):
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
        for i in range(n_iter):
            s = i % self.stages
            phase = (i // self.stages) & 1
            cute.arch.mbarrier_wait(full_ptr + s, phase)
            if cutlass.const_expr(self.trace):
                if i == 0:
                    tr[4] = globaltimer_lo()
                if i == n_iter - 1:
                    tr[5] = globaltimer_lo()
            stage = buf_addr + s * self.stage_bytes
            blk = sBlocks[first + i]
            self.consume_block(
                qa, q_addr + 16 * lane, acc, row_max, row_sum, stage, empty_ptr + s, blk, kv_len, scale,
                warp * self.keys_per_warp, g, c, lane,
            )
        if cutlass.const_expr(self.trace):
            tr[6] = globaltimer_lo()
        self.epilogue(mOut, mLse, mPO, mPL, sML, buf_addr, recv, acc, row_max, row_sum,
                      t, h, split, warp, lane, num_splits, v_scale)
