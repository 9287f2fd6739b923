"""Quickstart: one MSA block-sparse decode step with msa_jit, checked and timed.

    python examples/quickstart.py [--batch 8] [--qlen 2] [--heads 64/4] [--q-dtype bf16|fp8] [--iters N]

Builds a random decode step that follows the operator contract (paged fp8 KV cache, per
token and KV head the top-16 logical blocks of 128 tokens), plans it, compiles (or loads
from the disk cache) the kernel for this GPU, runs it, compares with the float64 reference
and times it with CUDA events (median). Without a GPU it runs the float64 reference
backend instead, and says so.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

try:
    import msa_jit
except ImportError:  # a source checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import msa_jit

import torch
from msa_jit.geometry import MAX_QLEN, MIN_QLEN, geometry_problems

PAGE = 128
TOPK = 16
HEAD_DIM = 128
FP8 = torch.float8_e4m3fn


def random_step(
    batch: int,
    qlen: int,
    num_q_heads: int,
    num_kv_heads: int,
    *,
    ctx_lens: list[int] | None = None,
    max_ctx: int = 4096,
    q_dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """A random decode step per the contract; tensors on `device`, seq_lens_cpu on the CPU.

    Returns query [T, Hq, 128] (bf16 or fp8), kv_cache [P, Hkv, 128, 256] fp8, topk
    [T, Hkv, 16] int32 (ascending logical blocks, -1 padded, the current block always in),
    block_table [B, max_blocks] int32 (a random permutation of pages), seq_lens [B] int32,
    seq_lens_cpu, the scales and `distinct_blocks` (distinct (request, head, block) read).
    """
    g = torch.Generator().manual_seed(seed)
    if ctx_lens is None:
        ctx_lens = torch.randint(qlen, max_ctx + 1, (batch,), generator=g).tolist()
    nblocks = [max(1, -(-n // PAGE)) for n in ctx_lens]
    max_blocks = max(nblocks)
    pages = torch.randperm(sum(nblocks), generator=g).to(torch.int32)
    block_table = torch.zeros(batch, max_blocks, dtype=torch.int32)
    start = 0
    for r, nb in enumerate(nblocks):
        block_table[r, :nb] = pages[start:start + nb]
        start += nb

    T = batch * qlen
    topk = torch.full((T, num_kv_heads, TOPK), -1, dtype=torch.int32)
    distinct = 0
    for r in range(batch):
        for h in range(num_kv_heads):
            seen: set[int] = set()
            for j in range(qlen):
                kv_len = max(ctx_lens[r] - qlen + j + 1, 0)
                nvis = -(-kv_len // PAGE)
                if nvis == 0:
                    continue
                cur = nvis - 1
                others = torch.randperm(nvis, generator=g)
                others = others[others != cur][: min(TOPK, nvis) - 1].tolist()
                row = sorted(others + [cur])
                topk[r * qlen + j, h, : len(row)] = torch.tensor(row, dtype=torch.int32)
                seen.update(row)
            distinct += len(seen)

    kv_cache = (torch.randn(len(pages), num_kv_heads, PAGE, 2 * HEAD_DIM, generator=g) * 0.5).to(FP8)
    query = torch.randn(T, num_q_heads, HEAD_DIM, generator=g)
    q_scale = 1.0
    if q_dtype == FP8:
        q_scale = float(query.abs().amax()) / 448.0
        query = query / q_scale
    seq_lens_cpu = torch.tensor(ctx_lens, dtype=torch.int32)
    dev = torch.device(device)
    return dict(
        query=query.to(q_dtype).to(dev), kv_cache=kv_cache.to(dev), topk=topk.to(dev),
        block_table=block_table.to(dev), seq_lens=seq_lens_cpu.to(dev), seq_lens_cpu=seq_lens_cpu,
        qlen=qlen, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        sm_scale=1.0 / math.sqrt(HEAD_DIM), q_scale=q_scale, k_scale=1.0, v_scale=1.0,
        distinct_blocks=distinct,
    )


def errors(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> dict[str, float]:
    """Relative L2 and max abs error of out [T, Hq, 128] and max abs error of finite lse [T, Hq]."""
    o = out.detach().cpu().double()
    finite = torch.isfinite(ref_lse)
    lse_err = (lse.detach().cpu().double() - ref_lse)[finite].abs().max() if finite.any() else torch.tensor(0.0)
    return {
        "rel_l2": float((o - ref_out).norm() / ref_out.norm().clamp_min(1e-30)),
        "max_abs": float((o - ref_out).abs().max()),
        "lse_max_abs": float(lse_err),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--qlen", type=int, default=2)
    ap.add_argument("--heads", default="64/4", help="Hq/Hkv, e.g. 64/4, 32/2, 16/1, 8/1")
    ap.add_argument("--q-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=None,
                    help="timed steps (default 50 on a GPU, 3 with the CPU reference backend)")
    args = ap.parse_args(argv)
    for flag, value in (("--iters", args.iters), ("--batch", args.batch), ("--max-ctx", args.max_ctx)):
        if value is not None and value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    if not MIN_QLEN <= args.qlen <= MAX_QLEN:
        ap.error(f"--qlen must be in {MIN_QLEN}..{MAX_QLEN}, got {args.qlen}")
    try:
        hq, hkv = (int(x) for x in args.heads.split("/"))
    except ValueError:
        ap.error(f"--heads: expected Hq/Hkv such as 64/4, got {args.heads!r}")
    problems = geometry_problems(num_q_heads=hq, num_kv_heads=hkv, page_size=PAGE, topk_blocks=TOPK)
    if problems:
        ap.error(f"--heads {args.heads}: " + "; ".join(f"{field}: {why}" for field, why in problems))
    q_dtype = FP8 if args.q_dtype == "fp8" else torch.bfloat16

    cuda = torch.cuda.is_available()
    iters = args.iters if args.iters is not None else (50 if cuda else 3)
    device = "cuda" if cuda else "cpu"
    backend = "kernel" if cuda else "reference"
    print(f"msa_jit {msa_jit.__version__}, torch {torch.__version__}, device: "
          + (torch.cuda.get_device_name() if cuda else "CPU"))
    if not cuda:
        print("no CUDA device: running the float64 REFERENCE backend (backend='reference'); "
              "the compiled kernel needs a GPU, and the timing below is not the kernel's")

    s = random_step(args.batch, args.qlen, hq, hkv, max_ctx=args.max_ctx, q_dtype=q_dtype, device=device)
    T = args.batch * args.qlen
    print(f"step: batch={args.batch} qlen={args.qlen} T={T} Hq/Hkv={hq}/{hkv} q={args.q_dtype} "
          f"seq_lens={s['seq_lens_cpu'].tolist()}")

    planner = msa_jit.SparseDecodePlanner()

    def prepare() -> msa_jit.SparseDecodePlan:
        return planner.prepare(s["block_table"], s["seq_lens"], s["seq_lens_cpu"], s["qlen"],
                               num_q_heads=hq, num_kv_heads=hkv, page_size=PAGE, topk_blocks=TOPK)

    plan = prepare()
    print(f"plan: num_splits={plan.launch().num_splits} arch={plan.arch}")
    if cuda:
        from msa_jit import env

        t0 = time.perf_counter()
        plan.resolve_kernel(q_dtype)
        print(f"kernel ready in {time.perf_counter() - t0:.2f} s (compiled, or loaded from "
              f"{env.cache_dir()})")

    out = torch.empty(T, hq, HEAD_DIM, dtype=torch.bfloat16, device=device)
    lse = torch.empty(T, hq, dtype=torch.float32, device=device)
    scales = dict(sm_scale=s["sm_scale"], q_scale=s["q_scale"], k_scale=s["k_scale"], v_scale=s["v_scale"])

    def step() -> None:
        msa_jit.sparse_decode(s["query"], s["kv_cache"], s["topk"], out, prepare(), lse=lse,
                              backend=backend, **scales)

    step()
    ref_out, ref_lse = msa_jit.sparse_decode_reference(
        s["query"], s["kv_cache"], s["topk"], s["block_table"], s["seq_lens"], s["qlen"], **scales)
    err = errors(out, lse, ref_out, ref_lse)
    ok = err["rel_l2"] < 1e-2
    print(f"vs float64 reference: rel L2 {err['rel_l2']:.2e}, max abs {err['max_abs']:.2e}, "
          f"lse max abs {err['lse_max_abs']:.2e} -> {'OK' if ok else 'FAIL'} (bound 1e-2)")

    if cuda:
        for _ in range(5):
            step()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        us = statistics.median(times)
        tbps = s["distinct_blocks"] * PAGE * 2 * HEAD_DIM / (us * 1e-6) / 1e12
        print(f"time (prepare + kernel, eager, CUDA events, median of {iters}): {us:.1f} us, "
              f"{tbps:.3f} TB/s effective (distinct KV bytes / time)")
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        print(f"time (reference backend on CPU, median of {iters}): {statistics.median(times) * 1e3:.1f} ms "
              "(float64 reference, not the kernel)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
