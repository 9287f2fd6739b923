"""Triton kernels that only read: the bench's ceilings, measured in the same run as the op.

- `read_bandwidth`: one launch reading 2 GiB contiguously (one program per 32 KiB chunk),
  events around it like the copy: the physical ceiling of a read-only stream.
- `floor_layer`: the per-layer floor probe. One launch does what a decode layer cannot avoid
  and nothing else: one program per (token, KV head, topk slot) loads its topk entry, then the
  block-table entry it names, then that (page, KV head) block of the cache (32 KiB fp8 or
  18 KiB NVFP4: the step's own bytes and block size), and keeps the data alive with an XOR
  and a store that never happens. No math, no partials, no merge, no kv_len (the bench's rows
  are full). Like the decode kernel it is launched with programmatic dependent launch: it
  waits for the kernel before it (`griddepcontrol.wait`, so layers do not overlap, as they
  cannot in a model) and lets the next launch be scheduled at once.

Importing this module imports triton: `msa_jit.tools.bench` imports it on first use. On CPU
tensors the kernels need TRITON_INTERPRET=1 set before the import (tests/conftest.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

from .steps import BLOCK_BYTES, block_bytes

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: no programmatic dependent launch
    gdc_launch_dependents = gdc_wait = None

__all__ = ["FLOOR_MAGIC", "floor_layer", "read_bandwidth", "read_chunks", "sum_chunk"]

WORDS = 512  # int32 words per load round: one 16-byte load per thread of a 4-warp program
FLOOR_WARPS = 4
# the floor's "store that never happens": a word-XOR of random data equal to this is a 2**-32 event
FLOOR_MAGIC = 0x5A17F00D


@triton.jit
def sum_chunk(base, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Sum of the int32 words at base[0 : CHUNK_WORDS] as a [BLOCK] vector (all loads issued first)."""
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in tl.static_range(0, CHUNK_WORDS, BLOCK):
        acc += tl.load(base + off + tl.arange(0, BLOCK))
    return acc


@triton.jit
def read_chunks(src, chunk_ids, out, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums the int32 words of chunk chunk_ids[p]."""
    pid = tl.program_id(0)
    acc = sum_chunk(src + tl.load(chunk_ids + pid).to(tl.int64) * CHUNK_WORDS, CHUNK_WORDS, BLOCK)
    tl.store(out + pid, tl.sum(acc, axis=0))


@triton.jit
def _floor_layer_kernel(kv, topk, block_table, out, bt_stride, qlen, magic,
                        HKV: tl.constexpr, TOPK: tl.constexpr, CHUNK_WORDS: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr, STORE_ALL: tl.constexpr):
    # program id == the topk entry's offset in a contiguous [T, Hkv, TOPK] tensor
    pid = tl.program_id(0)
    if PDL:
        gdc_wait()  # the previous layer is done, as the decode kernel waits for it
        gdc_launch_dependents()
    t = pid // (HKV * TOPK)
    h = (pid // TOPK) % HKV
    r = t // qlen
    b = tl.load(topk + pid)  # round trip 1
    page = tl.load(block_table + r * bt_stride + b)  # round trip 2
    base = kv + (page.to(tl.int64) * HKV + h) * CHUNK_WORDS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in tl.static_range(0, CHUNK_WORDS, BLOCK):  # round trip 3: every load issued at once
        acc ^= tl.load(base + off + tl.arange(0, BLOCK))
    if STORE_ALL:  # tests: the XOR of the block, to check which bytes were read
        tl.store(out + pid, tl.xor_sum(acc, axis=0))
    else:  # no reduction across threads, no store in practice, yet no load can be dropped; every
        # program shares out[0:BLOCK], so the store keeps the loads' layout (no shared-memory shuffle)
        tl.store(out + tl.arange(0, BLOCK), acc, mask=acc == magic)


def _interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(_floor_layer_kernel, InterpretedFunction)


def pdl_supported() -> bool:
    """Whether this Triton can launch the probe with programmatic dependent launch (on a GPU)."""
    if gdc_wait is None or _interpreted():
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def _words(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as a flat int32 tensor (fp8 or uint8 storage, contiguous)."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache: must be contiguous")
    return kv_cache.reshape(-1).view(torch.uint8).view(torch.int32)


def floor_layer(step: dict[str, Any], *, pdl: bool | None = None,
                store_all: bool = False) -> Callable[[], None]:
    """fn() launching the floor probe once on a `msa_jit.tools.bench.make_step` step (see module doc).

    step: kv_cache (fp8 [P, Hkv, 128, 256] or NVFP4 uint8 [P, 2*Hkv, 128, 72]), kv_dtype,
    topk [T, Hkv, k] int32 contiguous, block_table [B, nblk] int32 (stride(1) == 1) whose
    entries the topk values index, T = B * qlen. Every topk entry must be a valid block (the
    bench's steps have no -1 padding). pdl: None = when `pdl_supported()`.
    store_all: write each program's XOR of its block into step["floor_out"][pid] (tests); else
    step["floor_out"] is a [512] int32 buffer that stays zero (in all likelihood).
    """
    topk, bt, kv = step["topk"], step["block_table"], step["kv_cache"]
    if topk.dtype != torch.int32 or topk.dim() != 3 or not topk.is_contiguous():
        raise ValueError("topk: expected a contiguous [T, Hkv, k] int32 tensor")
    if bt.dtype != torch.int32 or bt.dim() != 2 or bt.stride(1) != 1:
        raise ValueError("block_table: expected a [B, max_blocks] int32 tensor with stride(1) == 1")
    T, hkv, k = topk.shape
    if T % bt.shape[0]:
        raise ValueError(f"topk: {T} tokens is not a multiple of the block table's {bt.shape[0]} requests")
    chunk = block_bytes(step["kv_dtype"])
    words = _words(kv)
    if words.numel() * 4 % (chunk * hkv):
        raise ValueError(f"kv_cache: {words.numel() * 4} bytes is not a whole number of pages of "
                         f"{hkv} x {chunk}-byte blocks")
    qlen = T // bt.shape[0]
    programs = T * hkv * k
    out = torch.zeros(programs if store_all else WORDS, dtype=torch.int32, device=kv.device)
    step["floor_out"] = out
    use_pdl = pdl_supported() if pdl is None else pdl
    launch = dict(launch_pdl=True) if use_pdl else {}
    grid = (programs,)

    def run() -> None:
        _floor_layer_kernel[grid](words, topk, bt, out, bt.stride(0), qlen, FLOOR_MAGIC,
                                  HKV=hkv, TOPK=k, CHUNK_WORDS=chunk // 4, BLOCK=WORDS, PDL=use_pdl,
                                  STORE_ALL=store_all, num_warps=FLOOR_WARPS, **launch)

    run.programs = programs  # type: ignore[attr-defined]
    run.pdl = use_pdl  # type: ignore[attr-defined]
    return run


def read_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes per second of one launch reading `nbytes` contiguously (median of iters, events)."""
    from .timing import event_seconds

    if nbytes % BLOCK_BYTES:
        raise ValueError(f"nbytes: expected a multiple of {BLOCK_BYTES}, got {nbytes}")
    src = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
    ids = torch.arange(nbytes // BLOCK_BYTES, dtype=torch.int32, device="cuda")
    out = torch.empty(ids.numel(), dtype=torch.int32, device="cuda")
    seconds = event_seconds(lambda: read_chunks[(ids.numel(),)](src, ids, out, CHUNK_WORDS=BLOCK_BYTES // 4,
                                                                 BLOCK=2048, num_warps=4), iters)
    del src, ids, out
    return nbytes / seconds
