"""Ceilings of the bench's measurement on this GPU, beside the copy, in one process.

    python3 bench/ceilings.py --out $OUT        # on the GPU host (Triton + torch; no DSL)

What a kernel with no index chain and no math reaches, measured exactly like a decode step
(`msa_jit.tools.bench.time_graph`: CUDA-graph replay, L2 flushed by reading, warm-up, median):

- `read_2g`: a Triton kernel reading 2 GiB contiguously, events around one launch (like the
  copy): the HBM read ceiling, as a ratio to the copy (which counts read + write bytes).
  `msa-jit bench` measures the same (`msa_jit.tools.bench.readers.read_bandwidth`) in its own run.
- `gather`: the same kernel reading N random 32 KiB chunks of a 4 GiB cache (the decode
  step's access pattern without topk / block table / math), at the bytes of the
  T·Hkv = 256 and 1024 points, and contiguous chunks at the same bytes.
- `rows`: the same chunks, but one program reads 16 of them one after another (the decode
  kernel's shape: one long-lived CTA per (token, KV head)); `indexed`: one program per chunk
  whose id takes two dependent loads (topk slot -> block table), like the kernel's.
- `floor`: a graph of one tiny kernel (the launch + event floor in every step figure);
  `batch1_floor`: the index chain and one chunk per program for 64 chunks, then a tiny kernel
  (the least a batch-1 step can cost here), as a standalone graph and inside a graph. The
  bench's per-layer floor probe (`floor_marginal_us` beside every small-batch row of
  `msa-jit bench`, `msa_jit.tools.bench.readers.floor_layer`) supersedes it for the targets.

With `--layers` (needs the compiled kernels, like `msa-jit bench`): `msa_jit.tools.bench.per_layer`,
the op as an engine runs it (one prologue, then L layers in one graph).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the checkout's msa_jit, also without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import triton
import triton.language as tl

# the readers the bench also runs (one source): sum_chunk / read_chunks, the 2 GiB read
from msa_jit.tools.bench.readers import read_bandwidth, read_chunks, sum_chunk

CHUNK = 128 * 256  # one (page, KV head) block: 32 KiB
CACHE_BYTES = 4 << 30


@triton.jit
def _read_rows(src, chunk_ids, out, SLOTS: tl.constexpr, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Program r reads chunks chunk_ids[r*SLOTS : (r+1)*SLOTS] one after another (the decode
    kernel's shape: one long-lived CTA per (token, KV head))."""
    r = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(SLOTS):
        acc += sum_chunk(src + tl.load(chunk_ids + r * SLOTS + i).to(tl.int64) * CHUNK_WORDS, CHUNK_WORDS, BLOCK)
    tl.store(out + r, tl.sum(acc, axis=0))


@triton.jit
def _read_indexed(src, slots, table, out, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Like read_chunks, but the chunk id takes two dependent loads (topk slot -> block table)."""
    pid = tl.program_id(0)
    page = tl.load(table + tl.load(slots + pid))
    acc = sum_chunk(src + page.to(tl.int64) * CHUNK_WORDS, CHUNK_WORDS, BLOCK)
    tl.store(out + pid, tl.sum(acc, axis=0))


def _reader(src: torch.Tensor, ids: torch.Tensor):
    out = torch.empty(ids.numel(), dtype=torch.int32, device=src.device)

    def run():
        read_chunks[(ids.numel(),)](src, ids, out, CHUNK_WORDS=CHUNK // 4, BLOCK=2048, num_warps=4)

    return run


def ceilings(copy_bw: float, log=print) -> dict[str, Any]:
    from msa_jit.tools.bench import median_in_graph, time_graph

    def pct(nbytes: int, us: float) -> float:
        return round(100 * nbytes / (us * 1e-6) / copy_bw, 1)

    res: dict[str, Any] = {}
    read_bw = read_bandwidth(2 << 30)
    res["read_2g"] = {"tbps": round(read_bw / 1e12, 3), "pct_of_copy": round(100 * read_bw / copy_bw, 1)}
    src = torch.randint(-2**31, 2**31 - 1, (CACHE_BYTES // 4,), dtype=torch.int32, device="cuda")
    n_all = CACHE_BYTES // CHUNK
    log(f"read 2 GiB contiguous: {res['read_2g']}")
    g = torch.Generator(device="cpu").manual_seed(0)
    res["gather"] = []
    for n in (4096, 16384):
        for kind in ("random", "contiguous"):
            ids = (torch.randperm(n_all, generator=g)[:n] if kind == "random" else torch.arange(n)).to(torch.int32).cuda()
            us = statistics.median(time_graph(_reader(src, ids), iters=50))
            row = {"chunks": n, "bytes": n * CHUNK, "order": kind, "us": round(us, 2), "pct_of_copy": pct(n * CHUNK, us)}
            res["gather"].append(row)
            log(f"gather {row}")
    for n in (4096, 16384):  # one program per 16 chunks, like the decode kernel's CTAs
        ids = torch.randperm(n_all, generator=g)[:n].to(torch.int32).cuda()
        out = torch.empty(n // 16, dtype=torch.int32, device="cuda")
        for warps, stages in ((4, 1), (4, 3), (8, 3)):
            us = statistics.median(time_graph(
                lambda: _read_rows[(n // 16,)](src, ids, out, SLOTS=16, CHUNK_WORDS=CHUNK // 4, BLOCK=2048,
                                                num_warps=warps, num_stages=stages), iters=50))
            row = {"chunks": n, "programs": n // 16, "num_warps": warps, "num_stages": stages, "us": round(us, 2),
                   "pct_of_copy": pct(n * CHUNK, us)}
            res.setdefault("rows", []).append(row)
            log(f"rows {row}")
        # the same chunks through a topk -> block-table chain (two dependent loads first)
        table = torch.randperm(n_all, generator=g).to(torch.int32).cuda()
        inv = torch.empty_like(table)
        inv[table.long()] = torch.arange(n_all, dtype=torch.int32, device="cuda")
        slots = inv[ids.long()].contiguous()  # table[slots[p]] == ids[p]
        out = torch.empty(n, dtype=torch.int32, device="cuda")
        us = statistics.median(time_graph(
            lambda: _read_indexed[(n,)](src, slots, table, out, CHUNK_WORDS=CHUNK // 4, BLOCK=2048, num_warps=4),
            iters=50))
        row = {"chunks": n, "us": round(us, 2), "pct_of_copy": pct(n * CHUNK, us)}
        res.setdefault("indexed", []).append(row)
        log(f"indexed {row}")
    tiny = torch.zeros(1, device="cuda")
    res["floor_us"] = round(statistics.median(time_graph(lambda: tiny.add_(1), iters=100)), 2)
    log(f"graph floor (one tiny kernel): {res['floor_us']} us")
    # The least any batch-1 step (64/4: 64 chunks of 32 KiB) costs in this measurement: the
    # topk -> block-table chain and one chunk per program, then a second tiny kernel in the
    # split merge's place; no prologue, no math. As a standalone graph and inside a graph.
    table = torch.randperm(n_all, generator=g).to(torch.int32).cuda()
    slots = torch.randperm(n_all, generator=g)[:64].to(torch.int32).cuda()
    out = torch.empty(64, dtype=torch.int32, device="cuda")

    def batch1_floor():
        _read_indexed[(64,)](src, slots, table, out, CHUNK_WORDS=CHUNK // 4, BLOCK=2048, num_warps=4)
        tiny.add_(1)

    res["batch1_floor"] = {"graph_us": round(statistics.median(time_graph(batch1_floor, iters=100)), 2),
                           "in_graph_us": median_in_graph(batch1_floor, iters=100)}
    log(f"batch-1 floor (index chain + one chunk per program, then a tiny kernel): {res['batch1_floor']}")
    del src
    torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", action="store_true", help="also time the op L layers per graph")
    a = ap.parse_args(argv)
    from msa_jit.tools.bench import copy_bandwidth, environment

    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s", flush=True)
    result: dict[str, Any] = {"environment": environment(), "command": " ".join(sys.argv),
                              "copy_tbps": round(copy_bw / 1e12, 4), "ceilings": ceilings(copy_bw)}
    if a.layers:
        from msa_jit.tools.bench import per_layer

        result["layers"] = per_layer(copy_bw)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ceilings-{time.strftime('%Y-%m-%dT%H%M', time.gmtime())}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
