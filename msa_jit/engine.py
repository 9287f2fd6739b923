"""Drop-in for vLLM's `vllm.models.minimax_m3.nvidia.msa_cutlass_sparse_decode` module.

Same public names, parameter names, kinds and defaults as the engine's module (the seed
document `shared/seeds/000_*.txt`), backed by msa_jit's planner and op:

    cache = MSACutlassDecodePlanCache()
    md = cache.prepare(block_table, seq_lens, seq_lens_cpu, qlen, num_q_heads=64,
                       num_kv_heads=4, page_size=128, topk_blocks=16)      # every step
    msa_cutlass_sparse_decode(query, kv_cache, topk, output, md, scale=128 ** -0.5,
                              q_scale_float=qs, k_scale_float=ks, v_scale_float=vs)

Differences from the engine's module, all widening what it accepts:

* No minimum batch: the engine only took this path from 16 requests on (its
  `_MIN_CUTLASS_BATCH_SIZE`, where its CUTLASS kernel overtook its default Triton split-K
  kernel). msa_jit has no second kernel to cross over to: the same kernel serves every
  batch, and the planner splits the top-k blocks across CTAs (split-KV) when T*Hkv alone
  cannot fill the GPU, so `should_prepare_decode_metadata` accepts every batch >= 1
  (`_MIN_CUTLASS_BATCH_SIZE` is kept, at 1, for code that imports it).
* Devices: compute capability 9.x (H100/H200) and 10.x (B200/B300), and any later one (the
  engine: 10.x only). Not 8.x: the portable mma.sync kernel streams KV with `cp.async.bulk`
  completing on an mbarrier (kernels/ptx.py `bulk_copy_g2s`), which needs SM90+.
* `decode_backend`: "cutlass" (the engine's name for this path) or "msa_jit".
* Query: bfloat16 or float8_e4m3fn (the parameter keeps the engine's name `query_fp8`);
  `kv_cache` may be float8_e4m3fn or its uint8 storage.
* CPU tensors are accepted by `prepare` and run the float64 reference (tests, notebooks);
  the engine requires CUDA.
* `prepare_decode_metadata(..., plan_cache=None)` uses a process-wide cache instead of a
  fresh one per call, so its plans keep stable addresses too (CUDA graphs).

Under `torch.compile`, `msa_cutlass_sparse_decode` goes through the custom op
`torch.ops.msa_jit.sparse_decode` (msa_jit.torch_op); eagerly it calls the op directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .geometry import HEAD_DIM, MAX_QLEN, MIN_QLEN, supports
from .op import sparse_decode
from .planner import SparseDecodePlan, SparseDecodePlanner

__all__ = [
    "DECODE_BACKENDS",
    "KV_CACHE_DTYPES",
    "MSACutlassDecodeMetadata",
    "MSACutlassDecodePlanCache",
    "msa_cutlass_sparse_decode",
    "prepare_decode_metadata",
    "should_prepare_decode_metadata",
    "supports_cutlass_sparse_decode",
]

DECODE_BACKENDS = ("cutlass", "msa_jit")
KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
# cp.async.bulk + mbarrier expect_tx in the kernel's data path need SM90 (see module doc).
MIN_CAPABILITY = (9, 0)
# The engine's batch floor, kept at 1 for code that imports it: no crossover to guard.
_MIN_CUTLASS_BATCH_SIZE = 1
_MAX_DECODE_QUERY_LEN = MAX_QLEN
# T * Hq rows: the output [T, Hq, 128] keeps an int32 element count (the kernel itself
# addresses memory with 64-bit offsets; this only guards absurd shapes).
_MAX_QUERY_HEAD_ROWS = (2**31 - 1) // HEAD_DIM


@dataclass
class MSACutlassDecodeMetadata:
    """Per-step metadata: the plan (msa_jit.SparseDecodePlan) and the flattened page table.

    page_table: `block_table.view(-1)` ([B * max_blocks] int32) when the block table is
    contiguous, else the [B, max_blocks] block table itself. The op reads
    `plan.block_table`; page_table is kept for engine code that inspects it.
    """

    plan: SparseDecodePlan
    page_table: torch.Tensor


@dataclass
class MSACutlassDecodePlanCache:
    """Reusable plans whose mutable tensors retain cudagraph-stable addresses.

    plans: (batch, decode_query_len, block_table.stride(0), Hq, Hkv, page_size, topk) ->
    SparseDecodePlan, as in the engine. Backed by a private msa_jit.SparseDecodePlanner
    (which also keys on the device).
    """

    plans: dict[tuple[int, ...], Any] = field(init=False, default_factory=dict)
    _planner: SparseDecodePlanner = field(init=False, default_factory=SparseDecodePlanner,
                                          repr=False, compare=False)

    def prepare(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        decode_query_len: int,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        page_size: int,
        topk_blocks: int,
    ) -> MSACutlassDecodeMetadata:
        """Plan of this step (built once per key), kv lengths refreshed in place from `seq_lens`.

        block_table: [B, max_blocks] int32 (innermost stride 1); seq_lens: [B] int32 on the
        same device; seq_lens_cpu: [B] int32 CPU copy, read only when a plan is built.
        Raises ValueError / TypeError naming the bad argument.
        """
        plan = self._planner.prepare(
            block_table, seq_lens, seq_lens_cpu, decode_query_len,
            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            page_size=page_size, topk_blocks=topk_blocks,
        )
        key = (int(seq_lens.shape[0]), decode_query_len, int(block_table.stride(0)),
               num_q_heads, num_kv_heads, page_size, topk_blocks)
        self.plans[key] = plan
        page_table = block_table.view(-1) if block_table.is_contiguous() else block_table
        return MSACutlassDecodeMetadata(plan=plan, page_table=page_table)


_DEFAULT_CACHE: MSACutlassDecodePlanCache | None = None


def _default_cache() -> MSACutlassDecodePlanCache:
    global _DEFAULT_CACHE
    if _DEFAULT_CACHE is None:
        _DEFAULT_CACHE = MSACutlassDecodePlanCache()
    return _DEFAULT_CACHE


def _device_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA device, None without CUDA (tests monkeypatch this)."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def supports_cutlass_sparse_decode(
    *,
    decode_backend: str,
    num_q_heads: int,
    num_kv_heads: int,
    kv_cache_dtype: str,
    page_size: int,
    topk_blocks: int,
) -> bool:
    """Return whether static model geometry supports the msa_jit sparse decode kernel.

    True for decode_backend "cutlass" / "msa_jit", a CUDA device of capability >= 9.0 (9.x
    and 10.x are the targets), kv_cache_dtype "fp8" / "fp8_e4m3" and a head / page / topk
    geometry that `msa_jit.supports` accepts.
    """
    cap = _device_capability()
    return (
        decode_backend in DECODE_BACKENDS
        and cap is not None
        and cap >= MIN_CAPABILITY
        and kv_cache_dtype in KV_CACHE_DTYPES
        and bool(supports(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          page_size=page_size, topk=topk_blocks))
    )


def should_prepare_decode_metadata(
    batch_size: int,
    decode_query_len: int,
    *,
    decode_backend: str,
    num_q_heads: int,
    num_kv_heads: int,
    kv_cache_dtype: str,
    page_size: int,
    topk_blocks: int,
) -> bool:
    """Return whether a graph shape can use the msa_jit decode path (no minimum batch)."""
    total_q = batch_size * decode_query_len
    return (
        supports_cutlass_sparse_decode(
            decode_backend=decode_backend,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            kv_cache_dtype=kv_cache_dtype,
            page_size=page_size,
            topk_blocks=topk_blocks,
        )
        and MIN_QLEN <= decode_query_len <= _MAX_DECODE_QUERY_LEN
        and batch_size >= _MIN_CUTLASS_BATCH_SIZE
        and total_q * num_q_heads <= _MAX_QUERY_HEAD_ROWS
    )


@torch.no_grad()
def prepare_decode_metadata(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    decode_query_len: int,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    topk_blocks: int,
    plan_cache: MSACutlassDecodePlanCache | None = None,
) -> MSACutlassDecodeMetadata:
    """Prepare graph-stable runtime metadata for one sparse decode step.

    plan_cache None uses a process-wide cache (plans live as long as the process).
    """
    cache = plan_cache if plan_cache is not None else _default_cache()
    return cache.prepare(
        block_table,
        seq_lens,
        seq_lens_cpu,
        decode_query_len,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        topk_blocks=topk_blocks,
    )


@torch.no_grad()
def msa_cutlass_sparse_decode(
    query_fp8: torch.Tensor,
    kv_cache: torch.Tensor,
    topk: torch.Tensor,
    output: torch.Tensor,
    metadata: MSACutlassDecodeMetadata,
    *,
    scale: float,
    q_scale_float: float,
    k_scale_float: float,
    v_scale_float: float,
) -> None:
    """Run msa_jit sparse decode with metadata prepared by `prepare_decode_metadata`.

    query_fp8: [T, Hq, 128] float8_e4m3fn or bfloat16; kv_cache: [P, Hkv, page, 256] fp8 or
    uint8; topk: [T, Hkv, topk] int32 (or the transposed [Hkv, T, topk] buffer's view);
    output: [T, Hq, 128] bfloat16, written in place. Backend: the compiled kernel on CUDA,
    the float64 reference on a CPU.
    """
    kwargs = dict(sm_scale=scale, q_scale=q_scale_float, k_scale=k_scale_float, v_scale=v_scale_float)
    if torch.compiler.is_compiling():
        from .torch_op import sparse_decode_op

        sparse_decode_op(query_fp8, kv_cache, topk, output, metadata.plan, **kwargs)
    else:
        sparse_decode(query_fp8, kv_cache, topk, output, metadata.plan, **kwargs)
