"""Random decode steps for the bench (fp8 or NVFP4 cache) and their byte accounting.

A step: B requests of a 16K-token context, every (token, KV head) selecting `topk` full
blocks, the last block always among them; consecutive tokens of a request share
`shared_blocks` blocks (0: independent draws). Its `kv_bytes` counts the DISTINCT
(page, KV head) blocks the step must read, `logical_bytes` what a per-token kernel reads;
both in the cache's own block size (`block_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ...geometry import DEFAULT_PAGE_SIZE, DEFAULT_TOPK_BLOCKS, HEAD_DIM, KV_DTYPES
from ...nvfp4 import NVFP4_ROW_BYTES
from .grid import FP8_KV, GEOMETRIES, NVFP4_KV  # noqa: F401 (defined with the grid, which imports no torch)
PAGE = DEFAULT_PAGE_SIZE
CTX_LEN = 16384
# one (page, KV head) block of the fp8 cache: 128 tokens x (K 128 B + V 128 B) = 32 KiB
BLOCK_BYTES = PAGE * 2 * HEAD_DIM
# ... and of the NVFP4 cache: a K slot and a V slot of 128 tokens x 72 B, adjacent = 18 KiB
NVFP4_BLOCK_BYTES = 2 * PAGE * NVFP4_ROW_BYTES
# pages of bf16 K/V quantized per (Hkv, seed) for an NVFP4 cache; the cache repeats them
NVFP4_POOL_PAGES = 1024


def block_bytes(kv_dtype: str) -> int:
    """Bytes of one (page, KV head) block of a 128-token page in this cache format."""
    if kv_dtype == FP8_KV:
        return BLOCK_BYTES
    if kv_dtype == NVFP4_KV:
        return NVFP4_BLOCK_BYTES
    raise ValueError(f"kv_dtype: expected one of {KV_DTYPES}, got {kv_dtype!r}")


@dataclass
class StepIndices:
    """The CPU side of a step: topk [T, Hkv, topk] int32, block_table [B, nblk] int32, seq_lens [B]."""

    topk: Any
    block_table: Any
    seq_lens: Any
    distinct_blocks: int  # (request, KV head, block) triples the step reads
    logical_blocks: int  # (token, KV head, slot) triples: what a per-token kernel reads


def make_indices(batch: int, hkv: int, qlen: int, *, ctx_len: int = CTX_LEN, shared_blocks: int = 0,
                 topk: int = DEFAULT_TOPK_BLOCKS, seed: int = 0) -> StepIndices:
    """Random topk rows and a random page permutation (CPU tensors, deterministic in seed)."""
    import torch

    if not 0 <= shared_blocks <= topk:
        raise ValueError(f"shared_blocks: expected 0..{topk}, got {shared_blocks}")
    if ctx_len % PAGE or ctx_len // PAGE < topk:
        raise ValueError(f"ctx_len: expected a multiple of {PAGE} of at least {topk} blocks, got {ctx_len}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblk = ctx_len // PAGE
    pages = batch * nblk
    perm = torch.randperm(pages, generator=g).to(torch.int32)
    block_table = perm.view(batch, nblk)
    seq_lens = torch.full((batch,), ctx_len, dtype=torch.int32)
    T = batch * qlen
    sel = torch.empty(T, hkv, topk, dtype=torch.int32)

    def pick(k: int, exclude=()) -> list[int]:  # k distinct blocks, never the last (added below)
        return [b for b in torch.randperm(nblk - 1, generator=g).tolist() if b not in exclude][:k]

    for r in range(batch):
        for h in range(hkv):
            first = pick(topk - 1)
            keep = first[: max(shared_blocks - 1, 0)]
            for j in range(qlen):
                if not shared_blocks:
                    cur = pick(topk - 1)
                elif j == 0:
                    cur = first
                else:  # shares `shared_blocks` blocks (the last one included) with token 0
                    cur = keep + pick(topk - 1 - len(keep), exclude=set(keep))
                sel[r * qlen + j, h] = torch.tensor(sorted(cur + [nblk - 1]), dtype=torch.int32)
    distinct = 0
    for r in range(batch):
        for h in range(hkv):
            distinct += len(set(sel[r * qlen : (r + 1) * qlen, h].flatten().tolist()))
    return StepIndices(sel, block_table, seq_lens, distinct, T * hkv * topk)


@lru_cache(maxsize=8)  # a grid asks for the same few (Hkv, seed) pools at every point
def _nvfp4_pool(hkv: int, seed: int, pool_pages: int, device: str) -> tuple[Any, float, float]:
    """(uint8 [pool_pages, 2*hkv, 128, 72] NVFP4 pages, k_scale, v_scale) (read only: shared)."""
    import torch

    from ...nvfp4 import quantize_kv_nvfp4

    cg = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(pool_pages, hkv, PAGE, HEAD_DIM, generator=cg, device=device).to(torch.bfloat16)
    v = torch.randn(pool_pages, hkv, PAGE, HEAD_DIM, generator=cg, device=device).to(torch.bfloat16)
    return quantize_kv_nvfp4(k, v)


def make_kv_cache(kv_dtype: str, pages: int, hkv: int, *, seed: int = 0, pool_pages: int = NVFP4_POOL_PAGES,
                  device: str = "cuda") -> tuple[Any, float, float]:
    """(kv_cache, k_scale, v_scale) of `pages` random pages on `device`.

    fp8: [pages, hkv, 128, 256] float8_e4m3fn from N(0, 0.25), scales 1.0. NVFP4: uint8
    [pages, 2*hkv, 128, 72] written by `msa_jit.nvfp4.quantize_kv_nvfp4` from N(0, 1) bf16 K/V,
    its global scales; `pool_pages` pages are quantized and repeated over the cache (what is
    timed is which bytes are read, not their values; quantizing 4 GiB in float64 per layer would
    cost seconds of device time).
    """
    import torch

    if kv_dtype == FP8_KV:
        cg = torch.Generator(device=device).manual_seed(seed)
        kv = (torch.randn(pages, hkv, PAGE, 2 * HEAD_DIM, generator=cg, device=device) * 0.5)
        return kv.to(torch.float8_e4m3fn), 1.0, 1.0
    if kv_dtype == NVFP4_KV:
        pool, ks, vs = _nvfp4_pool(hkv, seed, min(pool_pages, pages), str(device))
        idx = torch.arange(pages, device=device) % pool.shape[0]
        return pool[idx].contiguous(), ks, vs
    raise ValueError(f"kv_dtype: expected one of {KV_DTYPES}, got {kv_dtype!r}")


def make_step(hq: int, hkv: int, batch: int, qlen: int, q_dtype: str, *, ctx_len: int = CTX_LEN,
              shared_blocks: int = 0, topk: int = DEFAULT_TOPK_BLOCKS, seed: int = 0,
              kv_dtype: str = FP8_KV, indices: StepIndices | None = None, device: str = "cuda") -> dict[str, Any]:
    """Random decode step on `device` where every (token, KV head) selects `topk` full blocks.

    indices: a `make_indices(batch, hkv, qlen, ...)` result to reuse (the fp8 and NVFP4 steps
    of a point then read the same blocks); else drawn from `seed`. The query depends on seed
    only, so both cache formats of a point also get the same query.
    Keys: query, kv_cache, topk, block_table, seq_lens, seq_lens_cpu, out, k_scale, v_scale,
    kv_dtype, kv_bytes (distinct), logical_bytes.
    """
    import torch

    # every point starts from the same allocator state, whatever ran before it (this did not
    # move the 64/4 B=256 time, bench-2026-12-02T1623 vs T1618: the warm-up in time_graph did)
    if device == "cuda":
        torch.cuda.empty_cache()
    if indices is None:
        indices = make_indices(batch, hkv, qlen, ctx_len=ctx_len, shared_blocks=shared_blocks, topk=topk, seed=seed)
    T = batch * qlen
    if tuple(indices.topk.shape) != (T, hkv, topk):
        raise ValueError(f"indices: topk is {list(indices.topk.shape)}, this step needs [{T}, {hkv}, {topk}]")
    kv, k_scale, v_scale = make_kv_cache(kv_dtype, indices.block_table.numel(), hkv, seed=seed, device=device)
    qg = torch.Generator(device=device).manual_seed(seed + 1)
    qdt = torch.bfloat16 if q_dtype == "bfloat16" else torch.float8_e4m3fn
    query = torch.randn(T, hq, HEAD_DIM, generator=qg, device=device).to(qdt)
    nbytes = block_bytes(kv_dtype)
    return {
        "query": query, "kv_cache": kv, "topk": indices.topk.to(device), "block_table": indices.block_table.to(device),
        "seq_lens": indices.seq_lens.to(device), "seq_lens_cpu": indices.seq_lens,
        "out": torch.empty(T, hq, HEAD_DIM, dtype=torch.bfloat16, device=device),
        "k_scale": k_scale, "v_scale": v_scale, "kv_dtype": kv_dtype,
        "kv_bytes": indices.distinct_blocks * nbytes, "logical_bytes": indices.logical_blocks * nbytes,
    }


def prepare_args(step: dict[str, Any], hq: int, hkv: int, qlen: int) -> tuple[tuple, dict[str, int]]:
    """(args, kwargs) of `SparseDecodePlanner.prepare` for a `make_step` step."""
    return ((step["block_table"], step["seq_lens"], step["seq_lens_cpu"], qlen),
            dict(num_q_heads=hq, num_kv_heads=hkv, page_size=PAGE, topk_blocks=int(step["topk"].shape[-1])))


def decode(step: dict[str, Any], plan: Any, sm_scale: float = HEAD_DIM ** -0.5) -> None:
    """One `msa_jit.sparse_decode` call of a step (its cache's global scales included)."""
    from ...op import sparse_decode

    sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], plan, sm_scale=sm_scale,
                  k_scale=step["k_scale"], v_scale=step["v_scale"])
