"""tcgen05 / TMEM PTX helpers of the SM100 kernel (experiments/sm100/kernel.py), sm_100a only.

Each helper is one `llvm.inline_asm` with side effects (always ordered), like msa_jit/kernels/ptx.py.
"""

from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from msa_jit.kernels import ptx


def _asm(ret, args, text, constraints):
    # tcgen05 / fence / barrier instructions: always ordered (side effects)
    return ptx._asm(ret, args, text, constraints, side_effects=True)


_i32 = ptx._i32


@dsl_user_op
def ld_shared_u32(addr: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [_i32(addr, loc, ip)], "ld.shared.b32 $0, [$1];", "=r,r"))


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None) -> None:
    """Make this thread's generic-proxy shared-memory writes visible to the async proxy (UMMA)."""
    _asm(None, [], "fence.proxy.async.shared::cta;", "")


@dsl_user_op
def tc_fence_before(*, loc=None, ip=None) -> None:
    _asm(None, [], "tcgen05.fence::before_thread_sync;", "")


@dsl_user_op
def tc_fence_after(*, loc=None, ip=None) -> None:
    _asm(None, [], "tcgen05.fence::after_thread_sync;", "")


@dsl_user_op
def tmem_alloc(holder_smem: Int32, ncols: int, *, loc=None, ip=None) -> None:
    """Warp-wide: allocate ncols TMEM columns, the address is written to holder_smem."""
    _asm(None, [_i32(holder_smem, loc, ip)],
         f"tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [$0], {ncols};", "r")
    _asm(None, [], "tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;", "")


@dsl_user_op
def tmem_dealloc(taddr: Int32, ncols: int, *, loc=None, ip=None) -> None:
    _asm(None, [_i32(taddr, loc, ip)], f"tcgen05.dealloc.cta_group::1.sync.aligned.b32 $0, {ncols};", "r")


def _umma(kind, d_taddr, a_lo, a_hi, b_lo, b_hi, idesc, accumulate, loc, ip):
    _asm(
        None,
        [_i32(x, loc, ip) for x in (d_taddr, a_lo, a_hi, b_lo, b_hi, idesc, accumulate)],
        "{\n\t.reg .pred p;\n\t.reg .b64 ad, bd;\n\t"
        "mov.b64 ad, {$1, $2};\n\t"
        "mov.b64 bd, {$3, $4};\n\t"
        "setp.ne.b32 p, $6, 0;\n\t"
        f"tcgen05.mma.cta_group::1.kind::{kind} [$0], ad, bd, $5, p;\n\t}}",
        "r,r,r,r,r,r,r",
    )


@dsl_user_op
def umma_f16(d_taddr: Int32, a_lo: Int32, a_hi: int, b_lo: Int32, b_hi: int, idesc: int, accumulate: Int32,
             *, loc=None, ip=None) -> None:
    """tcgen05.mma.cta_group::1.kind::f16 [d], a_desc, b_desc, idesc, accumulate != 0."""
    _umma("f16", d_taddr, a_lo, a_hi, b_lo, b_hi, idesc, accumulate, loc, ip)


@dsl_user_op
def umma_f8f6f4(d_taddr: Int32, a_lo: Int32, a_hi: int, b_lo: Int32, b_hi: int, idesc: int, accumulate: Int32,
                *, loc=None, ip=None) -> None:
    """tcgen05.mma.cta_group::1.kind::f8f6f4 [d], a_desc, b_desc, idesc, accumulate != 0 (K = 32 per MMA)."""
    _umma("f8f6f4", d_taddr, a_lo, a_hi, b_lo, b_hi, idesc, accumulate, loc, ip)


@dsl_user_op
def umma_commit(mbar_smem: Int32, *, loc=None, ip=None) -> None:
    """Arrive once on the mbarrier when every tcgen05.mma issued so far by this thread is done."""
    _asm(None, [_i32(mbar_smem, loc, ip)],
         "tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [$0];", "r")


@dsl_user_op
def tmem_ld16(taddr: Int32, *, loc=None, ip=None):
    """tcgen05.ld.32x32b.x16 (+ wait::ld in the same asm): this lane's row, 16 fp32 columns."""
    s = _asm(
        llvm.StructType.get_literal([T.f32()] * 16),
        [_i32(taddr, loc, ip)],
        "tcgen05.ld.sync.aligned.32x32b.x16.b32 "
        "{$0, $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15}, [$16];\n\t"
        "tcgen05.wait::ld.sync.aligned;",
        ",".join(["=f"] * 16) + ",r",
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), s, [i], loc=loc, ip=ip)) for i in range(16))
