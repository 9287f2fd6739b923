"""Drop-in for vLLM's `vllm.models.minimax_m3.nvidia.msa_cutlass_sparse_decode` module.

Same public names, parameter names, kinds and defaults as that module of vLLM 0.33.0 (an earlier
subset of its signatures is still accepted), backed by msa_jit's planner and op:

    cache = MSACutlassDecodePlanCache()
    md = cache.prepare(block_table, seq_lens, seq_lens_cpu, qlen, num_q_heads=64,
                       num_kv_heads=4, page_size=128, topk_blocks=16)      # every step
    msa_cutlass_sparse_decode(query, kv_cache, topk, output, md, scale=128 ** -0.5,
                              q_scale_float=qs, k_scale_float=ks, v_scale_float=vs)

`msa_jit.integrations.vllm_plugin` rebinds these names inside vLLM (see the README, "Use it from vLLM").

Differences from the engine's module, all widening what it accepts:

* No minimum batch: the engine only took this path from 16 requests on (its
  `_DEFAULT_MIN_CUTLASS_BATCH_SIZE`, where its CUTLASS kernel overtook its default Triton split-K
  kernel; fewer on a B300). msa_jit has no second kernel to cross over to: the same kernel serves
  every batch, and the planner splits the top-k blocks across CTAs (split-KV) when T*Hkv alone
  cannot fill the GPU, so `should_prepare_decode_metadata(..., min_batch_size=None)` accepts every
  batch >= 1; an int `min_batch_size` (vLLM: `VLLM_MINIMAX_M3_MSA_CUTLASS_MIN_BATCH`) is honoured,
  except for an NVFP4 cache, which has no fallback (as in the engine).
* Devices: the compute capabilities msa-jit builds for, 9.0 (H100/H200, sm_90a) and 10.0 (B200,
  sm_100a; the engine: 10.x only). Not 10.3 (B300) or later: arch-specific code runs on its own
  capability only, and msa-jit builds none for them. Not 8.x: the portable mma.sync kernel streams KV with `cp.async.bulk`
  completing on an mbarrier (msa_jit/kernels/ptx.py `bulk_copy_g2s`), which needs SM90+.
* `decode_backend`: "cutlass" (the engine's name for this path) or "msa_jit"; an NVFP4 cache
  takes this path whatever the backend (as in the engine).
* Query: bfloat16 or float8_e4m3fn (the parameter keeps the engine's name `query_fp8`).
* `kv_cache` is dispatched by shape: `[P, Hkv, page, 256]` float8_e4m3fn or its uint8 storage is
  the fp8 layout; uint8 `[P, 2*Hkv, page, 72]` is the NVFP4 layout (`msa_jit.nvfp4`), which
  takes the global scales `k_scale` / `v_scale` (one-element float32 tensors, 0-dim as vLLM
  keeps them or [1]; the kernel reads them on the device). The engine calls every uint8 cache
  NVFP4 (its caller views fp8 caches as float8 first).
* CPU tensors are accepted by `prepare` and run the float64 reference (tests, notebooks);
  the engine requires CUDA.
* `prepare_decode_metadata(..., plan_cache=None)` uses a process-wide cache instead of a
  fresh one per call, so its plans keep stable addresses too (CUDA graphs).
* `msa_sparse_prefill` (not in the engine's module): causal sparse prefill through the same op,
  each prefill token a one-token request; vLLM's MSA impl on SM90 uses it where the engine has
  only a Blackwell prefill kernel (NVFP4).

Under `torch.compile`, `msa_cutlass_sparse_decode` goes through the custom op
`torch.ops.msa_jit.sparse_decode` (msa_jit.integrations.torch_op); eagerly it calls the op directly.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ..arguments import check_dim, check_dtype, check_tensor
from ..geometry import HEAD_DIM, MAX_QLEN, MIN_QLEN, arch_problem, supports
from ..nvfp4 import NVFP4_ROW_BYTES, nvfp4_kv_cache_slots, nvfp4_kv_cache_views
from ..op import sparse_decode
from ..plan import SparseDecodePlan
from ..planner import SparseDecodePlanner

__all__ = [
    "DECODE_BACKENDS",
    "KV_CACHE_DTYPES",
    "PREFILL_CHUNK_TOKENS",
    "MSACutlassDecodeMetadata",
    "MSACutlassDecodePlanCache",
    "is_nvfp4_kv_cache",
    "kv_cache_layout",
    "msa_cutlass_sparse_decode",
    "msa_sparse_prefill",
    "nvfp4_kv_cache_slots",
    "nvfp4_kv_cache_views",
    "prepare_decode_metadata",
    "should_prepare_decode_metadata",
    "supports_cutlass_sparse_decode",
]

DECODE_BACKENDS = ("cutlass", "msa_jit")
KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
# cp.async.bulk + mbarrier expect_tx in the kernel's data path need SM90 (see module doc); above it, only the
# capabilities msa-jit builds for (capability_problem)
MIN_CAPABILITY = (9, 0)
# The engine's batch floor, kept at 1 for code that imports it: no crossover to guard.
_MIN_CUTLASS_BATCH_SIZE = 1
_MAX_DECODE_QUERY_LEN = MAX_QLEN
# T * Hq rows: the output [T, Hq, 128] keeps an int32 element count (the kernel itself
# addresses memory with 64-bit offsets; this only guards absurd shapes).
_MAX_QUERY_HEAD_ROWS = (2**31 - 1) // HEAD_DIM
# Prefill tokens per op call in msa_sparse_prefill: one cached plan of this batch serves every
# prefill; 256 one-token requests x 4 KV heads fill an H200 several waves deep.
PREFILL_CHUNK_TOKENS = 256

_FP8 = torch.float8_e4m3fn
_U8 = torch.uint8
_FP8_ROW_BYTES = 2 * HEAD_DIM

_FP8_LAYOUT = "the fp8 layout [P, Hkv, page_size, 256] (float8_e4m3fn, or its uint8 storage)"
_NVFP4_LAYOUT = f"the NVFP4 layout [P, 2*Hkv, page_size, {NVFP4_ROW_BYTES}] (uint8)"


def _no_grad_when_enabled(fn):
    """`torch.no_grad()` around fn, as the engine's module has it, entered only when grad mode is
    on: vLLM calls under `torch.inference_mode()`, where the guard changes nothing and costs
    1.6 us per call (this repo's CPU machine). The per-layer call checks inline instead: this
    wrapper's argument repacking costs 0.4 us more."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


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
class _PrefillWorkspace:
    """Fixed buffers of msa_sparse_prefill's chunks: a gathered block table, and the padded
    query / topk / seq_lens / output of a last chunk shorter than PREFILL_CHUNK_TOKENS."""

    block_table: torch.Tensor  # [C, W] int32
    seq_lens: torch.Tensor  # [C] int32
    query: torch.Tensor  # [C, Hq, 128]
    topk: torch.Tensor  # [C, Hkv, K] int32
    output: torch.Tensor  # [C, Hq, 128] bf16


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
    _prefill: dict[tuple[Any, ...], _PrefillWorkspace] = field(init=False, default_factory=dict,
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
        same device; seq_lens_cpu: [B] int32 CPU copy, its values checked on every call (None:
        not checked; a CPU plan checks seq_lens itself). Raises ValueError / TypeError naming the
        bad argument.
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


def capability_problem(cap: tuple[int, int]) -> str | None:
    """Why msa-jit cannot serve a GPU of compute capability `cap` (None when it can): its arch-specific
    ("a") builds run on their own capability only, so a 10.3 GPU is not served by sm_100a code."""
    if tuple(cap) < MIN_CAPABILITY:
        return f"compute capability {cap[0]}.{cap[1]} is below {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    problem = arch_problem(f"sm_{cap[0]}{cap[1]}a")
    return None if problem is None else f"compute capability {cap[0]}.{cap[1]}: {problem}"


def _device_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA device, None without CUDA (tests monkeypatch this)."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def is_nvfp4_kv_cache(kv_cache_dtype: str) -> bool:
    """Whether a vLLM `--kv-cache-dtype` string names an NVFP4 cache.

    vLLM's meaning, `get_kv_quant_mode(kv_cache_dtype).is_nvfp4`: that function decides when
    vLLM is imported (it knows dtypes registered by plugins); otherwise vLLM 0.33's rule without
    handlers: "nvfp4" and its variants ("nvfp4_4over6"), not "nvfp4_ds_mla" (MLA's own layout).
    """
    kv_interface = sys.modules.get("vllm.v1.kv_cache_interface")
    get_mode = getattr(kv_interface, "get_kv_quant_mode", None)
    if get_mode is not None:
        return bool(get_mode(kv_cache_dtype).is_nvfp4)
    return (isinstance(kv_cache_dtype, str) and kv_cache_dtype.startswith("nvfp4")
            and kv_cache_dtype != "nvfp4_ds_mla")


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

    True for decode_backend "cutlass" / "msa_jit" (any backend for an NVFP4 cache), a CUDA
    device of a capability msa-jit builds for (9.0, 10.0: `capability_problem`), kv_cache_dtype "fp8" /
    "fp8_e4m3" or NVFP4 (`is_nvfp4_kv_cache`) and a head / page / topk geometry that
    `msa_jit.supports` accepts.
    """
    nvfp4 = is_nvfp4_kv_cache(kv_cache_dtype)
    cap = _device_capability()
    return (
        (decode_backend in DECODE_BACKENDS or nvfp4)
        and cap is not None
        and capability_problem(cap) is None
        and (kv_cache_dtype in KV_CACHE_DTYPES or nvfp4)
        and bool(supports(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          page_size=page_size, topk_blocks=topk_blocks))
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
    min_batch_size: int | None = None,
) -> bool:
    """Return whether a graph shape can use the msa_jit decode path.

    min_batch_size: None = no floor (this package's rule); an int is honoured, except for an
    NVFP4 cache (no other decode kernel to fall back to, as in the engine).
    """
    if min_batch_size is None:
        floor = _MIN_CUTLASS_BATCH_SIZE
    elif isinstance(min_batch_size, int) and not isinstance(min_batch_size, bool):
        floor = min_batch_size
    else:
        raise TypeError(f"min_batch_size: expected None or an int, got {min_batch_size!r}")
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
        and (batch_size >= floor or is_nvfp4_kv_cache(kv_cache_dtype))
        and total_q * num_q_heads <= _MAX_QUERY_HEAD_ROWS
    )


@_no_grad_when_enabled
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


def kv_cache_layout(kv_cache: torch.Tensor) -> str:
    """"fp8" or "nvfp4": which KV cache layout `kv_cache` is, by dtype and shape.

    fp8: [P, Hkv, page_size, 256] float8_e4m3fn or uint8; NVFP4: [P, 2*Hkv, page_size, 72]
    uint8. Anything else raises, naming both: TypeError for a non-tensor or a dtype neither
    layout has (as `msa_jit.sparse_decode` does), else ValueError.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    shape = kv_cache.shape  # read once: the engine's eager call pays for every attribute read
    dtype = kv_cache.dtype
    if len(shape) == 4:
        row = shape[3]
        if row == _FP8_ROW_BYTES and (dtype is _FP8 or dtype is _U8):
            return "fp8"
        if row == NVFP4_ROW_BYTES and dtype is _U8 and shape[1] % 2 == 0:
            return "nvfp4"
    if dtype is not _FP8 and dtype is not _U8:
        raise TypeError(f"kv_cache: expected {_FP8_LAYOUT} or {_NVFP4_LAYOUT}, got a {dtype} tensor "
                        f"of shape {list(shape)}")
    raise ValueError(
        f"kv_cache: expected {_FP8_LAYOUT} or {_NVFP4_LAYOUT}, got shape {list(shape)} {dtype}"
    )


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Run msa_jit sparse decode with metadata prepared by `prepare_decode_metadata`.

    query_fp8: [T, Hq, 128] float8_e4m3fn or bfloat16; topk: [T, Hkv, topk] int32 (or the
    transposed [Hkv, T, topk] buffer's view); output: [T, Hq, 128] bfloat16, written in place.
    kv_cache (`kv_cache_layout`): fp8 [P, Hkv, page, 256] with the scalar scales
    k_scale_float / v_scale_float (k_scale / v_scale are ignored, as in the engine), or NVFP4
    uint8 [P, 2*Hkv, page, 72] with the global scales k_scale / v_scale (one-element float32
    tensors, 0-dim or [1], on the cache's device; required; k_scale_float / v_scale_float are
    then ignored, as in the engine). Backend: the compiled kernel on CUDA, the float64
    reference on a CPU. Errors start with the argument's name and end with the layout recognised.
    """
    if not isinstance(metadata, MSACutlassDecodeMetadata):
        hint = " (wrap a plan as MSACutlassDecodeMetadata(plan, page_table))" if isinstance(metadata, SparseDecodePlan) else ""
        raise TypeError("metadata: expected MSACutlassDecodeMetadata (from prepare_decode_metadata or "
                        f"MSACutlassDecodePlanCache.prepare), got {type(metadata).__name__}{hint}")
    if torch.is_grad_enabled():  # the engine's @torch.no_grad(), inline: no cost under inference_mode
        with torch.no_grad():
            return msa_cutlass_sparse_decode(
                query_fp8, kv_cache, topk, output, metadata, scale=scale, q_scale_float=q_scale_float,
                k_scale_float=k_scale_float, v_scale_float=v_scale_float, k_scale=k_scale, v_scale=v_scale)
    if kv_cache_layout(kv_cache) == "nvfp4":
        if k_scale is None or v_scale is None:
            missing = [n for n, v in (("k_scale", k_scale), ("v_scale", v_scale)) if v is None]
            raise TypeError(
                f"{', '.join(missing)}: {_NVFP4_LAYOUT} needs its global scales k_scale and v_scale "
                "(one-element float32 tensors, vLLM's layer._k_scale / layer._v_scale), got None"
            )
        ks, vs, name = k_scale, v_scale, _NVFP4_LAYOUT
    else:
        if not kv_cache.is_contiguous():
            raise ValueError(
                f"kv_cache: recognised {_FP8_LAYOUT}, but its strides {list(kv_cache.stride())} are not "
                "contiguous: each (page, KV head) block must be one contiguous run (in vLLM the LBHNC / "
                "HND KV cache layout, which msa_jit.integrations.vllm_plugin's backend asks for; "
                "VLLM_KV_CACHE_LAYOUT=HND forces it)"
            )
        ks, vs, name = k_scale_float, v_scale_float, _FP8_LAYOUT
    if torch.compiler.is_compiling():
        from .torch_op import sparse_decode_op

        sparse_decode_op(query_fp8, kv_cache, topk, output, metadata.plan, sm_scale=scale,
                         q_scale=q_scale_float, k_scale=ks, v_scale=vs)
        return
    try:
        sparse_decode(query_fp8, kv_cache, topk, output, metadata.plan, sm_scale=scale,
                      q_scale=q_scale_float, k_scale=ks, v_scale=vs)
    except (ValueError, TypeError) as e:
        if type(e) not in (ValueError, TypeError):  # subclasses may take other arguments
            raise
        # the argument's name stays first (validation's convention), the layout it was judged by after
        raise type(e)(f"{e} (kv_cache recognised as {name})") from e


def _check_prefill_lengths(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> None:
    """ValueError naming the argument unless cu_seqlens_q starts at 0 and never decreases and every
    context length is >= 0 (a token of a decreasing span would otherwise be written as zeros)."""
    if int(cu_seqlens_q[0]) != 0:
        raise ValueError(f"cu_seqlens_q: expected offsets from 0, got {cu_seqlens_q[:4].tolist()}...")
    if bool((cu_seqlens_q[1:] < cu_seqlens_q[:-1]).any()):
        raise ValueError(f"cu_seqlens_q: expected non-decreasing offsets, got {cu_seqlens_q.tolist()}")
    if bool((context_lens < 0).any()):
        raise ValueError(f"context_lens: expected lengths >= 0, got {context_lens.tolist()}")


def _prefill_rows(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                  num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request row, seq_len = position + 1) of each prefill token, on the device.

    Tokens past cu_seqlens_q[-1] (a padded tail) get seq_len 0: the op writes zeros for them.
    """
    num_reqs = context_lens.shape[0]
    tok = torch.arange(num_tokens, dtype=torch.int32, device=context_lens.device)
    req = torch.searchsorted(cu_seqlens_q[1:num_reqs + 1].contiguous(), tok, right=True)
    inside = req < num_reqs
    req.clamp_(max=num_reqs - 1)
    pos = context_lens[req] + (tok - cu_seqlens_q[req])
    seq = torch.where(inside, pos + 1, torch.zeros_like(pos)).to(torch.int32)
    return req, seq


def _prefill_workspace(cache: MSACutlassDecodePlanCache, query: torch.Tensor, topk: torch.Tensor,
                       block_table: torch.Tensor, chunk: int) -> _PrefillWorkspace:
    key = (query.device, query.dtype, query.shape[1], topk.shape[1], topk.shape[2],
           block_table.shape[1], chunk)
    ws = cache._prefill.get(key)
    if ws is None:
        dev = query.device
        ws = _PrefillWorkspace(
            block_table=torch.zeros(chunk, block_table.shape[1], dtype=torch.int32, device=dev),
            seq_lens=torch.zeros(chunk, dtype=torch.int32, device=dev),
            query=torch.zeros(chunk, *query.shape[1:], dtype=query.dtype, device=dev),
            topk=torch.full((chunk, *topk.shape[1:]), -1, dtype=torch.int32, device=dev),
            output=torch.zeros(chunk, *query.shape[1:], dtype=torch.bfloat16, device=dev),
        )
        cache._prefill[key] = ws
    return ws


@_no_grad_when_enabled
def msa_sparse_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    topk: torch.Tensor,
    output: torch.Tensor,
    *,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    page_size: int,
    scale: float,
    q_scale_float: float,
    k_scale_float: float,
    v_scale_float: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    plan_cache: MSACutlassDecodePlanCache | None = None,
    chunk_tokens: int = PREFILL_CHUNK_TOKENS,
) -> None:
    """Causal block-sparse prefill through the decode op (any KV layout it takes).

    The op's semantics per token are causal attention over the token's top-k blocks at
    pos = seq_len - qlen + j, so each prefill token runs as a one-token request (qlen 1,
    seq_len pos + 1, its request's block-table row), `chunk_tokens` tokens per call: one
    cached plan serves every prefill; a shorter last chunk is padded with seq_len-0 rows.

    query: [N, Hq, 128] bf16 / fp8 (request-major prefill tokens); topk: [N, Hkv, K] int32
    token-major, innermost contiguous; output: [N, Hq, 128] bf16, written in place.
    block_table: [R, W] int32 (the prefill requests' rows); cu_seqlens_q: [R + 1] int32 from 0,
    non-decreasing; context_lens: [R] int32 >= 0, tokens of each request in the cache before this step
    (both on the device of query; their values are checked where they are on the CPU, as a CUDA tensor's
    would need a sync). Scales as in `msa_cutlass_sparse_decode`.
    """
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: expected an int >= 1, got {chunk_tokens!r}")
    for name, t in (("query", query), ("topk", topk), ("output", output), ("block_table", block_table),
                    ("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens)):
        check_tensor(name, t)
    check_dim("query", query, 3, "[N, Hq, 128]")
    for name, t, ndim, layout in (("block_table", block_table, 2, "[R, W]"),
                                  ("cu_seqlens_q", cu_seqlens_q, 1, "[R + 1]"), ("context_lens", context_lens, 1, "[R]")):
        check_dtype(name, t, (torch.int32,))
        check_dim(name, t, ndim, layout)
    n = int(query.shape[0])
    if n == 0:
        return
    if topk.dim() != 3 or topk.shape[0] != n or output.shape[:1] != query.shape[:1]:
        raise ValueError(f"topk / output: expected [{n}, Hkv, K] / [{n}, Hq, 128] like query, "
                         f"got {list(topk.shape)} / {list(output.shape)}")
    num_reqs = int(context_lens.shape[0])
    if num_reqs < 1 or tuple(cu_seqlens_q.shape) != (num_reqs + 1,) or block_table.shape[0] != num_reqs:
        raise ValueError(
            f"cu_seqlens_q / block_table: expected [{num_reqs + 1}] / [{num_reqs}, W] for "
            f"{num_reqs} requests (context_lens), got {list(cu_seqlens_q.shape)} / {list(block_table.shape)}"
        )
    if not cu_seqlens_q.is_cuda and not context_lens.is_cuda:  # values on the GPU are not read: that would sync
        _check_prefill_lengths(cu_seqlens_q, context_lens)
    cache = plan_cache if plan_cache is not None else _default_cache()
    chunk = chunk_tokens
    ws = _prefill_workspace(cache, query, topk, block_table, chunk)
    req, seq = _prefill_rows(cu_seqlens_q, context_lens, n)
    hq, hkv, k = int(query.shape[1]), int(topk.shape[1]), int(topk.shape[2])
    # Every chunk has the first one's shapes, so on CUDA a bad argument fails before anything is
    # written. The reference (CPU) also checks values, which can fail in a later chunk: there the
    # chunks go to a scratch output, copied into `output` only when all of them have passed.
    target = output
    if not query.is_cuda:
        output = torch.empty_like(target)
    for c0 in range(0, n, chunk):
        m = min(chunk, n - c0)
        torch.index_select(block_table, 0, req[c0:c0 + m], out=ws.block_table[:m])
        if m == chunk:
            q, tk, out, s = query[c0:c0 + m], topk[c0:c0 + m], output[c0:c0 + m], seq[c0:c0 + m]
        else:
            ws.query[:m].copy_(query[c0:])
            ws.topk[:m].copy_(topk[c0:])
            ws.seq_lens.zero_()
            ws.seq_lens[:m].copy_(seq[c0:])
            q, tk, out, s = ws.query, ws.topk, ws.output, ws.seq_lens
        md = cache.prepare(ws.block_table, s, None, 1, num_q_heads=hq, num_kv_heads=hkv,
                           page_size=page_size, topk_blocks=k)
        msa_cutlass_sparse_decode(q, kv_cache, tk, out, md, scale=scale, q_scale_float=q_scale_float,
                                  k_scale_float=k_scale_float, v_scale_float=v_scale_float,
                                  k_scale=k_scale, v_scale=v_scale)
        if m < chunk:
            output[c0:].copy_(ws.output[:m])
    if output is not target:
        target.copy_(output)
