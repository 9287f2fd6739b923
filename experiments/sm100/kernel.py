"""SM100 (Blackwell, sm_100a) MSA sparse decode kernel: tcgen05 UMMA with TMEM accumulators.

The same calling convention as every decode kernel (msa_jit/kernels/convention.py; the launch and
the split merge are SparseDecodeKernelBase's, msa_jit/kernels/base.py), so the op works unchanged;
its tcgen05 PTX wrappers are in experiments/sm100/ptx_sm100.py. UNVERIFIED ON HARDWARE: it compiles
for sm_100a (experiments/sm100/test_sm100_kernel.py, table in experiments/sm100/variants.md) but has
never run, and the package does not register it: nothing selects it.

One CTA serves one (token t, KV head h, split), like the portable kernel. The 128 tokens of a
page sit on the UMMA M dimension and the GQA heads of h on N (padded to 16: M=128 needs
N % 16 == 0):

    S^T[key, head]  = K[key, :]  . Q[head, :]^T        (M=128 keys,  N=16 heads, K=128 dims)
    O^T[dim, head] += V[:, dim]^T . P[head, :]^T        (M=128 dims,  N=16 heads, K=128 keys)

MMA1 (S^T) depends on the query dtype: bf16 query -> kind::f16 on f16 K and Q (8 MMAs of
K=16 per page); fp8 (e4m3) query -> kind::f8f6f4 on e4m3 K and Q as stored (4 MMAs of K=32
per page). MMA2 (O^T) is kind::f16 in both variants.

Warp roles (192 threads):
  * warps 0-3, "softmax/convert" warpgroup, thread `tid` = TMEM lane `tid`:
      - converts key row `tid` of the fp8 page (K and V) into f16 operand tiles sK / sV
        (exact fp8 -> f16 bit trick of msa_jit/kernels/ptx.py, times 2**-8, folded into the scales);
        fp8-query variant: K is only repacked (e4m3 bytes copied, 16 bytes at a time, into the
        K-major core-matrix tile sK8, see below), V is converted as above;
      - reads S^T row `tid` (key `tid`, 16 heads) from TMEM, runs the online softmax (the
        per-head max over the 128 keys goes through warp shuffles + shared memory), writes
        P^T (f16) to sP;
      - reads this page's O^T row `tid` (dim `tid`, 16 heads) from TMEM and accumulates it in
        registers with the online-softmax rescale (acc = acc * alpha + O_page): each page's
        PV product goes to a fresh TMEM accumulator (enable_input_d = 0 on its first k-step),
        so TMEM never needs rescaling.
  * warp 4, "MMA": allocates TMEM (TMEM_COLS columns), one lane issues the tcgen05.mma
    instructions and tcgen05.commit's them to mbarriers; deallocates TMEM at the end.
  * warp 5, "producer": one lane bulk-copies (cp.async.bulk, mbarrier complete_tx) the 32 KiB
    chunk of each selected (page, KV head) into an fp8 stage, STAGES chunks in flight.

Per page the pipeline is serialized (convert -> MMA1 -> softmax -> MMA2 -> accumulate); only
the HBM stream (producer) runs ahead. This is the "simplest structure that can be right";
double-buffering sK/sV/sP/TMEM to overlap pages is future work.

Numerics: fp32 accumulators everywhere.
  * bf16 query: MMA1 kind::f16, Q bf16 -> f16 (exact inside the f16 range, like the portable
    kernel), K fp8 -> f16 (times 2**-8); S scale qk_scale_log2 * 2**8.
  * fp8 query: MMA1 kind::f8f6f4, a_format = b_format = E4M3 (the cache's float8_e4m3fn:
    OCP e4m3, no inf), raw e4m3 values, no 2**-8 factor; S scale = qk_scale_log2 alone
    (= q_scale * k_scale * sm_scale * log2(e), computed on the host in msa_jit/op.py).
    ASSUMED (unverified): the tensor core's fp32 accumulation of e4m3 products is accurate
    enough for K = 128 (Hopper's fp8 WGMMA is reported to accumulate with fewer than 23
    mantissa bits; each e4m3 x e4m3 product is exact, the sums are where error can enter).
  * MMA2 (both): V fp8 -> f16 (times 2**-8), P f32 -> f16 (round to nearest); output scale
    v_scale * 2**8. 16-bit P and V like the portable kernel.

Shared-memory operand layouts (all SWIZZLE_NONE, "interleaved" core matrices of 8 rows x 16
bytes = 8 x 8 f16, 128 contiguous bytes, row r of a core at +16*r). In cute's canonical
terms (cute/arch/mma_sm100_desc.hpp, make_umma_desc): for SWIZZLE_NONE
  K-major : ((8,m),(8,2)) : ((16B, SBO), (2B, LBO))   SBO = MN core stride, LBO = K core stride
  MN-major: ((8,m),(8,k)) : ((2B, SBO), (16B, LBO))   SBO = MN core stride, LBO = K core stride
  * sQ  (B of MMA1, K-major,  N=head, K=dim): core (head//8, dim//8) at (head//8)*2048 +
        (dim//8)*128, row head%8. LBO=128, SBO=2048. k-step s (dims 16s..16s+15) at +256*s.
  * sK  (A of MMA1, K-major,  M=key,  K=dim): core (key//8, dim//8) at (key//8)*2048 +
        (dim//8)*128, row key%8. LBO=128, SBO=2048. k-step s at +256*s.
  * sV  (A of MMA2, MN-major, M=dim,  K=key): core (dim//8, key//8) at (key//8)*2048 +
        (dim//8)*128, row key%8 (16 bytes = 8 consecutive dims of one key).
        SBO=128 (dim cores), LBO=2048 (key cores). k-step s (keys 16s..16s+15) at +4096*s.
        (The address a key-row thread writes is the same formula as for sK.)
  * sP  (B of MMA2, MN-major, N=head, K=key): core (head//8, key//8) at (key//8)*256 +
        (head//8)*128, row key%8 (8 consecutive heads of one key). SBO=128, LBO=256.
        k-step s at +512*s.
  fp8-query variant (MMA1 kind::f8f6f4, 8-bit elements: a core matrix is 8 rows x 16 bytes
  = 8 x 16 e4m3, still 128 contiguous bytes, row r at +16*r; cute's canonical K-major
  SWIZZLE_NONE form in uint128 units ((8,m),2):((1,SBO),LBO), i.e. T = 16 elements):
  * sK8 (A, K-major, M=key, K=dim, 16 KiB; Storage field sk, which holds the f16 sK in the
        bf16 variant): core (key//8, dim//16) at (key//8)*1024 + (dim//16)*128, row key%8.
        LBO=128, SBO=1024. One MMA covers K=32 dims = 2 K-cores: k-step s (dims
        32s..32s+31) at +256*s, 4 steps per page.
  * sQ8 (B, K-major, N=head, K=dim, 2 KiB; Storage field sq): core (head//8, dim//16) at
        (head//8)*1024 + (dim//16)*128, row head%8. LBO=128, SBO=1024, k-step +256*s.
  Why K is repacked rather than read from the fp8 stage in place: a token row of the stage
  is 256 bytes (K in bytes [0,128), V in [128,256)), so K-major rows of the page are 256 B
  apart. Every K-major UMMA shared-memory layout fixes the row pitch inside an 8-row group:
  16 B for SWIZZLE_NONE (the core matrix is 128 contiguous bytes; cute's make_umma_desc
  asserts stride<0,0> == 1 uint128) and 32/64/128 B for SWIZZLE_32B/64B/128B (the swizzle
  width); nothing takes 256 B. (An MN-major A would need the keys of one dim contiguous,
  the stage has the dims of one key contiguous.)
  So each softmax thread copies its key's 8 x 16 K bytes into sK8 (ld.shared.v4 +
  st.shared.v4, no conversion): 8 + 8 instead of 8 + 16 accesses, 16 KiB less shared memory.
  A 2-D TMA of the K half (box 128 B x 128 rows) could land K directly in an SW128 K-major
  tile and drop the repack; not done (the stage also feeds V's conversion).
  Descriptor: start>>4 in bits [0,14), LBO>>4 in [16,30), SBO>>4 in [32,46), version 1 in
  [46,48), base offset 0, lbo mode 0, layout type 0 (SWIZZLE_NONE) in [61,64).
  Instruction descriptor (kind::f16): D f32 (bit 4), A/B f16 (format 0), a_major bit 15,
  b_major bit 16 (1 = MN-major), N>>3 in [17,23), M>>4 in [24,29).
  Instruction descriptor (kind::f8f6f4, IDESC_S8): same fields, a_format [7,10) and b_format
  [10,13) = E4M3 = 0, both K-major; numerically equal to IDESC_S (0x08040010): the .kind
  selects the operand width. Checked against Tcgen05InstrDesc.build (c_dtype=Float32,
  a_dtype=b_dtype=Float8E4M3FN, n_dim=16, m_dim=128) == 0x08040010, and cute's
  UMMA::InstrDescriptor bitfields (mma_sm100_desc.hpp: MXF8F6F4Format::E4M3 = 0). ptxas
  emits UTCQMMA for it (UTCHMMA for kind::f16).

TMEM (TMEM_COLS = 32 columns, fp32, lane = accumulator row for M=128, cta_group::1):
  columns [0,16): S^T (lane = key, column = head); columns [16,32): this page's O^T
  (lane = dim, column = head). Warp w of the softmax group reads lanes [32w, 32w+32) with
  tcgen05.ld.32x32b.x16 (the warp-to-lane-quarter rule: warp w % 4 owns that quarter).

mbarriers (phase = page index & 1 for the four per-page ones):
  full[s] (1 arrive + tx), empty[s] (128), kv_ready (128: sK/sV written, after
  fence.proxy.async), s_full (tcgen05.commit after MMA1), p_ready (128: sP written, TMEM S
  read), o_full (tcgen05.commit after MMA2). sK/sV/sP/TMEM reuse is safe because the softmax
  group waits o_full(i) (commit covers every earlier MMA) before it writes page i+1.
"""

# no `from __future__ import annotations`: cute.struct must see evaluated annotations in
# storage_type(), which also runs outside a trace (smem_bytes).
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from msa_jit.kernels import common, ptx

from . import ptx_sm100
from msa_jit.kernels.base import SparseDecodeKernelBase
from msa_jit.kernels.convention import KernelArguments

HEAD_DIM = 128
ROW_BYTES = 2 * HEAD_DIM
LN2 = math.log(2.0)
PAGE = 128  # tokens per page == UMMA M
N_PAD = 16  # GQA heads padded to the UMMA N granule for M=128
CORE = 128  # bytes of one 8 x 16-byte core matrix
TILE_BYTES = PAGE * HEAD_DIM * 2  # one f16 128 x 128 operand tile (sK, sV)
Q_BYTES = N_PAD * HEAD_DIM * 2
TILE8_BYTES = PAGE * HEAD_DIM  # the e4m3 K tile of the fp8-query variant (kind::f8f6f4 MMA1)
Q8_BYTES = N_PAD * HEAD_DIM  # the e4m3 Q tile of the fp8-query variant
P_BYTES = N_PAD * PAGE * 2
SOFTMAX_WARPS = 4
SOFTMAX_THREADS = 32 * SOFTMAX_WARPS
MMA_WARP = 4
PRODUCER_WARP = 5
THREADS = 32 * 6
SOFTMAX_BAR = 1  # named barrier id of the softmax warpgroup

# instruction descriptors (kind::f16, f16 x f16 -> f32, M=128, N=16)
_IDESC_BASE = (1 << 4) | ((N_PAD >> 3) << 17) | ((PAGE >> 4) << 24)
IDESC_S = _IDESC_BASE  # A (K) K-major, B (Q) K-major
IDESC_O = _IDESC_BASE | (1 << 15) | (1 << 16)  # A (V^T) MN-major, B (P^T) MN-major

# instruction descriptor of the fp8-query MMA1 (kind::f8f6f4, e4m3 x e4m3 -> f32, M=128, N=16,
# A (K) and B (Q) K-major). Field by field: c_format F32 = 1 at [4,6), a_format E4M3 = 0 at
# [7,10), b_format E4M3 = 0 at [10,13), majors 0, N>>3 at [17,23), M>>4 at [24,29). E4M3 = 0
# = F16, so the value equals IDESC_S: the .kind of the instruction tells the formats apart
# (cross-checked against Tcgen05InstrDesc.build(c_dtype=Float32, a_dtype=b_dtype=
# Float8E4M3FN, n_dim=16, m_dim=128) and cute's UMMA::make_instr_desc<float_e4m3_t, ...>).
E4M3 = 0
IDESC_S8 = (1 << 4) | (E4M3 << 7) | (E4M3 << 10) | ((N_PAD >> 3) << 17) | ((PAGE >> 4) << 24)
K8_STEP = 32  # K (head dims) per kind::f8f6f4 MMA for 8-bit operands: 32 bytes = 2 core matrices


def _smem_desc_hi_lo(lbo: int, sbo: int) -> tuple[int, int]:
    """Constant parts (low word without the address, high word) of a SWIZZLE_NONE descriptor."""
    lo = (lbo >> 4) << 16
    hi = (sbo >> 4) | (1 << 14)  # version 1 at bit 46 = bit 14 of the high word
    return lo, hi


DESC_K = _smem_desc_hi_lo(lbo=CORE, sbo=16 * CORE)
DESC_Q = _smem_desc_hi_lo(lbo=CORE, sbo=16 * CORE)
DESC_V = _smem_desc_hi_lo(lbo=16 * CORE, sbo=CORE)
DESC_P = _smem_desc_hi_lo(lbo=2 * CORE, sbo=CORE)
# e4m3 K-major tiles (fp8-query MMA1): core (mn//8, dim//16), 8 K-cores per 8 rows
DESC_K8 = _smem_desc_hi_lo(lbo=CORE, sbo=(HEAD_DIM // 16) * CORE)
DESC_Q8 = _smem_desc_hi_lo(lbo=CORE, sbo=(HEAD_DIM // 16) * CORE)


# ----------------------------------------------------------------------------- kernel
class SparseDecodeSm100Kernel(SparseDecodeKernelBase):
    """tcgen05 UMMA + TMEM kernel; the launch (and the split merge) is SparseDecodeKernelBase's."""

    arch_family = "sm100"
    pdl = False
    TMEM_COLS = 32  # S^T (16 columns) + one page's O^T (16 columns); power of two >= 32

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
    ):
        super().__init__(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=page_size,
                         topk=topk, q_dtype=q_dtype, kv_dtype=kv_dtype)
        if kv_dtype != "float8_e4m3fn":
            raise ValueError(f"the sm100 kernel reads fp8 caches only, got kv_dtype {kv_dtype!r}")
        if self.group > N_PAD:
            raise ValueError(f"group size {self.group} not in 1..{N_PAD} (sm100 kernel)")
        if page_size != PAGE:
            raise ValueError(f"the sm100 kernel needs page_size {PAGE} (the UMMA M dimension), got {page_size}")
        if consumer_warps != SOFTMAX_WARPS:
            raise ValueError(f"the sm100 kernel needs consumer_warps={SOFTMAX_WARPS} (one thread per TMEM lane)")
        if not 1 <= stages <= 4:
            raise ValueError(f"stages {stages} not in 1..4")
        self.stages = stages
        self.warps = consumer_warps
        self.threads = THREADS
        self.stage_bytes = page_size * ROW_BYTES
        # fp8 query: MMA1 multiplies the raw e4m3 values (kind::f8f6f4), so qk_scale_log2
        # (= q_scale * k_scale * sm_scale * log2(e)) is the whole fold; bf16 query: K is f16
        # holding K * 2**-8.
        self.s_fold = 1.0 if self.q_fp8 else 2.0**8
        self.sk_bytes = TILE8_BYTES if self.q_fp8 else TILE_BYTES
        self.sq_bytes = Q8_BYTES if self.q_fp8 else Q_BYTES

    def storage_type(self):
        """The shared-memory struct of the main kernel (also usable outside a trace)."""

        @cute.struct
        class Storage:
            stages: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.stages * self.stage_bytes], 1024]
            sk: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.sk_bytes], 1024]
            sv: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, TILE_BYTES], 1024]
            sq: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.sq_bytes], 1024]
            sp: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, P_BYTES], 1024]
            full: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            empty: cute.struct.Align[cute.struct.MemRange[Int64, self.stages], 8]
            bars: cute.struct.Align[cute.struct.MemRange[Int64, 4], 8]  # kv_ready, s_full, p_ready, o_full
            tmem: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]  # tcgen05.alloc writes the address here
            pages: cute.struct.MemRange[Int32, 32]
            blocks: cute.struct.MemRange[Int32, 32]
            nvalid: cute.struct.MemRange[Int32, 4]
            red: cute.struct.MemRange[Float32, 3 * SOFTMAX_WARPS * N_PAD]

        return Storage

    def launch_options(self) -> dict:
        """One CTA per SM (shared memory), nothing to ask of the compiler."""
        return {}

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
        stage_addr = ptx.smem_addr(storage.stages.data_ptr())
        sk_addr = ptx.smem_addr(storage.sk.data_ptr())
        sv_addr = ptx.smem_addr(storage.sv.data_ptr())
        sq_addr = ptx.smem_addr(storage.sq.data_ptr())
        sp_addr = ptx.smem_addr(storage.sp.data_ptr())
        tmem_holder = ptx.smem_addr(storage.tmem.data_ptr())
        full_ptr = storage.full.data_ptr()
        empty_ptr = storage.empty.data_ptr()
        bars = storage.bars.data_ptr()
        kv_ready = bars + 0
        s_full = bars + 1
        p_ready = bars + 2
        o_full = bars + 3
        sPages = storage.pages.get_tensor(cute.make_layout(32))
        sBlocks = storage.blocks.get_tensor(cute.make_layout(32))
        sNvalid = storage.nvalid.get_tensor(cute.make_layout(4))
        sRed = storage.red.get_tensor(cute.make_layout(3 * SOFTMAX_WARPS * N_PAD))

        kv_len = args.kv_lens[t]
        req = t // args.qlen
        num_pages = args.kv_cache.shape[0]
        # the global scales as device tensors (1.0 when the caller gave python floats)
        qk_scale_log2 = args.qk_scale_log2 * args.k_scale_tensor[0]
        v_scale = args.v_scale * args.v_scale_tensor[0]

        # ---- 1. setup: slot compaction + barriers (warp 0), TMEM alloc (MMA warp), Q -> sQ (softmax group)
        if warp == 0:
            ballot = common.compact_valid_slots(
                args.topk, args.block_table, t, h, req, kv_len, num_pages, lane, sPages, sBlocks, self.topk, self.page
            )
            if lane == 0:
                sNvalid[0] = cute.arch.popc(ballot)
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full_ptr + s, 1)
                    cute.arch.mbarrier_init(empty_ptr + s, SOFTMAX_THREADS)
                cute.arch.mbarrier_init(kv_ready, SOFTMAX_THREADS)
                cute.arch.mbarrier_init(s_full, 1)
                cute.arch.mbarrier_init(p_ready, SOFTMAX_THREADS)
                cute.arch.mbarrier_init(o_full, 1)
        if warp == MMA_WARP:
            ptx_sm100.tmem_alloc(tmem_holder, self.TMEM_COLS)
        if warp < SOFTMAX_WARPS:
            self.load_q(args.query, sq_addr, t, h, tidx)
            ptx_sm100.fence_proxy_async_shared()
        cute.arch.mbarrier_init_fence()
        ptx_sm100.tc_fence_before()
        cute.arch.sync_threads()
        ptx_sm100.tc_fence_after()
        taddr = ptx_sm100.ld_shared_u32(tmem_holder)

        n_valid = sNvalid[0]
        first, n_iter = common.split_range(n_valid, args.num_splits, split)

        if warp == PRODUCER_WARP:
            # ---- 2a. producer: one lane streams the selected chunks into the fp8 stages
            if lane == 0:
                common.stream_pages(
                    args.kv_cache, sPages, h, first, n_iter, stage_addr, full_ptr, empty_ptr,
                    self.stages, self.stage_bytes, self.hkv,
                )
        elif warp == MMA_WARP:
            # ---- 2b. MMA issuer: one lane
            if lane == 0:
                s_full_a = ptx.smem_addr(s_full)
                o_full_a = ptx.smem_addr(o_full)
                for i in range(n_iter):
                    ph = i & 1
                    cute.arch.mbarrier_wait(kv_ready, ph)
                    ptx_sm100.tc_fence_after()
                    if cutlass.const_expr(self.q_fp8):
                        # e4m3 K x e4m3 Q: 32 dims (2 K-cores, 256 B) per MMA
                        for ks in cutlass.range_constexpr(HEAD_DIM // K8_STEP):
                            ptx_sm100.umma_f8f6f4(
                                taddr,
                                ((sk_addr + 2 * CORE * ks) >> 4) | DESC_K8[0], DESC_K8[1],
                                ((sq_addr + 2 * CORE * ks) >> 4) | DESC_Q8[0], DESC_Q8[1],
                                IDESC_S8, Int32(1 if ks > 0 else 0),
                            )
                    else:
                        for ks in cutlass.range_constexpr(HEAD_DIM // 16):
                            ptx_sm100.umma_f16(
                                taddr,
                                ((sk_addr + 256 * ks) >> 4) | DESC_K[0], DESC_K[1],
                                ((sq_addr + 256 * ks) >> 4) | DESC_Q[0], DESC_Q[1],
                                IDESC_S, Int32(1 if ks > 0 else 0),
                            )
                    ptx_sm100.umma_commit(s_full_a)
                    cute.arch.mbarrier_wait(p_ready, ph)
                    ptx_sm100.tc_fence_after()
                    for ks in cutlass.range_constexpr(PAGE // 16):
                        ptx_sm100.umma_f16(
                            taddr + N_PAD,
                            ((sv_addr + 4096 * ks) >> 4) | DESC_V[0], DESC_V[1],
                            ((sp_addr + 512 * ks) >> 4) | DESC_P[0], DESC_P[1],
                            IDESC_O, Int32(1 if ks > 0 else 0),
                        )
                    ptx_sm100.umma_commit(o_full_a)
        else:
            # ---- 2c. softmax / convert warpgroup
            self.softmax_loop(
                args.out, args.lse, args.partial_o, args.partial_lse, sBlocks, sRed, stage_addr, sk_addr, sv_addr,
                sp_addr, full_ptr, empty_ptr, kv_ready, s_full, p_ready, o_full, taddr,
                t, h, split, warp, lane, tidx, kv_len, first, n_iter, args.num_splits, qk_scale_log2, v_scale,
            )

        # ---- 3. teardown: everyone is done with TMEM
        ptx_sm100.tc_fence_before()
        cute.arch.sync_threads()
        if warp == MMA_WARP:
            ptx_sm100.tc_fence_after()
            ptx_sm100.tmem_dealloc(taddr, self.TMEM_COLS)

    @cute.jit
    def load_q(self, mQ, sq_addr, t, h, tidx):
        """Thread tidx: head n = tidx // 8 (zeros past the group), dims [16c, 16c+16), c = tidx % 8."""
        G = self.group
        n = tidx // 8
        c = tidx % 8
        if cutlass.const_expr(self.q_fp8):
            # e4m3 kept as is: 16 dims = 16 bytes = one row of the K-major e4m3 core (n//8, c)
            words = cute.make_rmem_tensor(4, Int32)
            for k in cutlass.range_constexpr(4):
                words[k] = Int32(0)
            if n < G:
                q_base = mQ.iterator.toint()
                row_elem = Int64(t) * Int64(mQ.stride[0]) + Int64(h * G + n) * HEAD_DIM + 16 * c
                w = ptx.ld_global_nc_v4(q_base + row_elem)
                for k in cutlass.range_constexpr(4):
                    words[k] = w[k]
            dst = sq_addr + (n // 8) * ((HEAD_DIM // 16) * CORE) + c * CORE + (n % 8) * 16
            ptx.st_shared_v4(dst, words[0], words[1], words[2], words[3])
        else:
            words = cute.make_rmem_tensor(8, Int32)
            for k in cutlass.range_constexpr(8):
                words[k] = Int32(0)
            if n < G:
                q_base = mQ.iterator.toint()
                row_elem = Int64(t) * Int64(mQ.stride[0]) + Int64(h * G + n) * HEAD_DIM + 16 * c
                for part in cutlass.range_constexpr(2):
                    w = ptx.ld_global_nc_v4(q_base + (row_elem + 8 * part) * 2)
                    for k in cutlass.range_constexpr(4):
                        words[4 * part + k] = ptx.bf16x2_to_f16x2(w[k])
            # K-major core (head//8, dim//8): dims 16c..16c+7 -> kb 2c, 16c+8.. -> kb 2c+1
            dst = sq_addr + (n // 8) * (16 * CORE) + (2 * c) * CORE + (n % 8) * 16
            ptx.st_shared_v4(dst, words[0], words[1], words[2], words[3])
            ptx.st_shared_v4(dst + CORE, words[4], words[5], words[6], words[7])

    @cute.jit
    def convert_row(self, stage, sk_addr, sv_addr, tidx):
        """Key row tidx of the fp8 stage -> f16 rows of sK (K-major) and sV (MN-major).

        The 16-byte chunk order is rotated by the thread index so the 8 threads of a
        shared-memory phase read 8 different bank groups (rows are 256 bytes apart).
        """
        row = stage + tidx * ROW_BYTES
        dst_row = (tidx // 8) * (16 * CORE) + (tidx % 8) * 16
        for j in cutlass.range_constexpr(16):
            cc = (tidx + j) % 16  # chunk: 0..7 K dims 16cc.., 8..15 V dims 16(cc-8)..
            w = ptx.ld_shared_v4(row + 16 * cc)
            f = []
            for k in cutlass.range_constexpr(4):
                lo, hi = ptx.fp8x4_to_f16x2x2_scaled(w[k])
                f.append(lo)
                f.append(hi)
            c = cc % 8
            base = sk_addr
            if cc >= 8:
                base = sv_addr
            dst = base + dst_row + (2 * c) * CORE
            ptx.st_shared_v4(dst, f[0], f[1], f[2], f[3])
            ptx.st_shared_v4(dst + CORE, f[4], f[5], f[6], f[7])

    @cute.jit
    def convert_row_fp8q(self, stage, sk_addr, sv_addr, tidx):
        """fp8-query variant: key row tidx of the fp8 stage -> e4m3 row of sK8 (repacked, not
        converted: K-major core (key//8, dim//16)) and f16 row of sV (as convert_row).

        The chunk order is rotated by the thread index (mod 8 within the K half and within the
        V half) so the 8 threads of a shared-memory phase read 8 different bank groups.
        """
        row = stage + tidx * ROW_BYTES
        k_row = sk_addr + (tidx // 8) * ((HEAD_DIM // 16) * CORE) + (tidx % 8) * 16
        for j in cutlass.range_constexpr(8):
            c = (tidx + j) % 8  # K dims 16c..16c+15
            w = ptx.ld_shared_v4(row + 16 * c)
            ptx.st_shared_v4(k_row + c * CORE, w[0], w[1], w[2], w[3])
        dst_row = sv_addr + (tidx // 8) * (16 * CORE) + (tidx % 8) * 16
        for j in cutlass.range_constexpr(8):
            c = (tidx + j) % 8  # V dims 16c..16c+15
            w = ptx.ld_shared_v4(row + HEAD_DIM + 16 * c)
            f = []
            for k in cutlass.range_constexpr(4):
                lo, hi = ptx.fp8x4_to_f16x2x2_scaled(w[k])
                f.append(lo)
                f.append(hi)
            dst = dst_row + (2 * c) * CORE
            ptx.st_shared_v4(dst, f[0], f[1], f[2], f[3])
            ptx.st_shared_v4(dst + CORE, f[4], f[5], f[6], f[7])

    @cute.jit
    def softmax_loop(
        self, mOut, mLse, mPO, mPL, sBlocks, sRed, stage_addr, sk_addr, sv_addr, sp_addr,
        full_ptr, empty_ptr, kv_ready, s_full, p_ready, o_full, taddr,
        t, h, split, warp, lane, tidx, kv_len, first, n_iter, num_splits, qk_scale_log2, v_scale,
    ):
        G = self.group
        acc = cute.make_rmem_tensor(N_PAD, Float32)  # O^T row `tidx` (dim tidx), per head
        m_run = cute.make_rmem_tensor(N_PAD, Float32)  # running max per head (uniform over threads)
        l_run = cute.make_rmem_tensor(N_PAD, Float32)  # this thread's keys' share of the row sum
        for n in cutlass.range_constexpr(N_PAD):
            acc[n] = Float32(0.0)
            m_run[n] = -Float32.inf
            l_run[n] = Float32(0.0)
        scale = qk_scale_log2 * self.s_fold
        lane_taddr = taddr + ((warp * 32) << 16)
        p_row = sp_addr + (tidx // 8) * (2 * CORE) + (tidx % 8) * 16

        for i in range(n_iter):
            s = i % self.stages
            phs = (i // self.stages) & 1
            ph = i & 1
            # -- fp8 stage -> f16 operand tiles
            cute.arch.mbarrier_wait(full_ptr + s, phs)
            if cutlass.const_expr(self.q_fp8):
                self.convert_row_fp8q(stage_addr + s * self.stage_bytes, sk_addr, sv_addr, tidx)
            else:
                self.convert_row(stage_addr + s * self.stage_bytes, sk_addr, sv_addr, tidx)
            cute.arch.mbarrier_arrive(empty_ptr + s)
            ptx_sm100.fence_proxy_async_shared()
            cute.arch.mbarrier_arrive(kv_ready)

            # -- S^T row tidx: key tidx of the block, one column per head
            cute.arch.mbarrier_wait(s_full, ph)
            ptx_sm100.tc_fence_after()
            sv = ptx_sm100.tmem_ld16(lane_taddr)
            blk = sBlocks[first + i]
            masked = blk * self.page + tidx >= kv_len
            x = []
            for n in cutlass.range_constexpr(G):
                v = sv[n] * scale
                if masked:
                    v = -Float32.inf
                x.append(v)
            # per-head block max over the 128 keys: warp butterfly, then across the 4 warps
            red = (i % 2) * (SOFTMAX_WARPS * N_PAD)
            for n in cutlass.range_constexpr(G):
                mx = x[n]
                for sh in cutlass.range_constexpr(5):
                    mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1 << sh))
                if lane == 0:
                    sRed[red + warp * N_PAD + n] = mx
            cute.arch.barrier(barrier_id=SOFTMAX_BAR, number_of_threads=SOFTMAX_THREADS)
            alpha = cute.make_rmem_tensor(N_PAD, Float32)
            p = []
            for n in cutlass.range_constexpr(G):
                mb = m_run[n]
                for w in cutlass.range_constexpr(SOFTMAX_WARPS):
                    mb = cute.arch.fmax(mb, sRed[red + w * N_PAD + n])
                m_use = mb
                if mb == -Float32.inf:
                    m_use = Float32(0.0)
                alpha[n] = ptx.ex2(m_run[n] - m_use)
                m_run[n] = mb
                pv = ptx.ex2(x[n] - m_use)
                l_run[n] = l_run[n] * alpha[n] + pv
                p.append(pv)
            for n in cutlass.range_constexpr(G, N_PAD):
                p.append(Float32(0.0))
            # -- P^T (f16): key tidx, heads 0..7 then 8..15 (MN-major B tile)
            pw = [ptx.f32x2_to_f16x2(p[2 * k], p[2 * k + 1]) for k in range(N_PAD // 2)]
            ptx.st_shared_v4(p_row, pw[0], pw[1], pw[2], pw[3])
            ptx.st_shared_v4(p_row + CORE, pw[4], pw[5], pw[6], pw[7])
            ptx_sm100.fence_proxy_async_shared()
            ptx_sm100.tc_fence_before()
            cute.arch.mbarrier_arrive(p_ready)

            # -- this page's O^T row tidx (dim tidx) -> rescaled register accumulator
            cute.arch.mbarrier_wait(o_full, ph)
            ptx_sm100.tc_fence_after()
            ov = ptx_sm100.tmem_ld16(lane_taddr + N_PAD)
            for n in cutlass.range_constexpr(G):
                acc[n] = acc[n] * alpha[n] + ov[n]
            ptx_sm100.tc_fence_before()

        self.epilogue_sm100(mOut, mLse, mPO, mPL, sRed, acc, m_run, l_run,
                            t, h, split, warp, lane, tidx, num_splits, v_scale)

    @cute.jit
    def epilogue_sm100(self, mOut, mLse, mPO, mPL, sRed, acc, m_run, l_run,
                       t, h, split, warp, lane, tidx, num_splits, v_scale):
        G = self.group
        red = 2 * SOFTMAX_WARPS * N_PAD  # third region: never used by the per-page max
        for n in cutlass.range_constexpr(G):
            sm = l_run[n]
            for sh in cutlass.range_constexpr(5):
                sm = sm + cute.arch.shuffle_sync_bfly(sm, 1 << sh)
            if lane == 0:
                sRed[red + warp * N_PAD + n] = sm
        cute.arch.barrier(barrier_id=SOFTMAX_BAR, number_of_threads=SOFTMAX_THREADS)
        d = tidx
        for n in cutlass.range_constexpr(G):
            l_all = Float32(0.0)
            for w in cutlass.range_constexpr(SOFTMAX_WARPS):
                l_all = l_all + sRed[red + w * N_PAD + n]
            inv = Float32(0.0)
            lse2 = -Float32.inf
            if l_all > Float32(0.0):
                inv = v_scale * 256.0 / l_all
                lse2 = m_run[n] + ptx.lg2(l_all)
            hq = h * G + n
            if num_splits == 1:
                mOut[t, hq, d] = (acc[n] * inv).to(cutlass.BFloat16)
                if d == 0:
                    mLse[t, hq] = lse2 * LN2
            else:
                idx = (t * self.hkv + h) * num_splits + split
                mPO[idx, n, d] = acc[n] * inv
                if d == 0:
                    mPL[idx, n] = lse2
