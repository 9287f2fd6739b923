"""Ceilings of the bench's measurement on this GPU, beside the copy, in one process.

    python3 bench/ceilings.py --out $OUT        # on the GPU host (Triton + torch; no DSL)

What a kernel with no index chain and no math reaches, measured exactly like a decode step
(`msa_jit.bench.time_graph`: CUDA-graph replay, L2 flushed by reading, warm-up, median):

- `read_2g`: a Triton kernel reading 2 GiB contiguously, events around one launch (like the
  copy): the HBM read ceiling, as a ratio to the copy (which counts read + write bytes).
- `gather`: the same kernel reading N random 32 KiB chunks of a 4 GiB cache (the decode
  step's access pattern without topk / block table / math), at the bytes of the
  T·Hkv = 256 and 1024 points, and contiguous chunks at the same bytes.
- `floor`: a graph of one tiny kernel (the launch + event floor in every step figure).

With `--layers` (needs the compiled kernels, like `msa-jit bench`): the decode op as an engine
runs it, one prologue then L layers, each with its own KV cache, topk and query, in one
graph; `marginal_us` = (time of L layers - time of 1) / (L - 1) is what one more layer costs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

CHUNK = 128 * 256  # one (page, KV head) block: 32 KiB
CACHE_BYTES = 4 << 30


@triton.jit
def _read_chunks(src, chunk_ids, out, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums the int32 words of chunk chunk_ids[p] (all loads issued before the adds)."""
    pid = tl.program_id(0)
    base = src + tl.load(chunk_ids + pid).to(tl.int64) * CHUNK_WORDS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in tl.static_range(0, CHUNK_WORDS, BLOCK):
        acc += tl.load(base + off + tl.arange(0, BLOCK))
    tl.store(out + pid, tl.sum(acc, axis=0))


def _reader(src: torch.Tensor, ids: torch.Tensor):
    out = torch.empty(ids.numel(), dtype=torch.int32, device=src.device)

    def run():
        _read_chunks[(ids.numel(),)](src, ids, out, CHUNK_WORDS=CHUNK // 4, BLOCK=2048, num_warps=4)

    return run


def _event_time(fn, iters: int = 20) -> float:
    """Median seconds of fn between two events (after 3 untimed calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return statistics.median(times)


def ceilings(copy_bw: float, log=print) -> dict[str, Any]:
    from msa_jit.bench import time_graph

    res: dict[str, Any] = {}
    src = torch.randint(-2**31, 2**31 - 1, (CACHE_BYTES // 4,), dtype=torch.int32, device="cuda")
    n_all = CACHE_BYTES // CHUNK
    ids_2g = torch.arange((2 << 30) // CHUNK, dtype=torch.int32, device="cuda")
    t = _event_time(_reader(src, ids_2g))
    res["read_2g"] = {"tbps": round((2 << 30) / t / 1e12, 3), "pct_of_copy": round(100 * (2 << 30) / t / copy_bw, 1)}
    log(f"read 2 GiB contiguous: {res['read_2g']}")
    g = torch.Generator(device="cpu").manual_seed(0)
    res["gather"] = []
    for n in (4096, 16384):
        for kind in ("random", "contiguous"):
            ids = (torch.randperm(n_all, generator=g)[:n] if kind == "random" else torch.arange(n)).to(torch.int32).cuda()
            us = statistics.median(time_graph(_reader(src, ids), iters=50))
            row = {"chunks": n, "bytes": n * CHUNK, "order": kind, "us": round(us, 2),
                   "pct_of_copy": round(100 * n * CHUNK / (us * 1e-6) / copy_bw, 1)}
            res["gather"].append(row)
            log(f"gather {row}")
    tiny = torch.zeros(1, device="cuda")
    res["floor_us"] = round(statistics.median(time_graph(lambda: tiny.add_(1), iters=100)), 2)
    log(f"graph floor (one tiny kernel): {res['floor_us']} us")
    del src
    torch.cuda.empty_cache()
    return res


def layers(copy_bw: float, points=(("64/4", 64), ("8/1", 256), ("64/4", 256), ("64/4", 1)),
           num_layers: int = 4, log=print) -> list[dict[str, Any]]:
    """Per-layer time of the op in a graph of one prologue + L layers (distinct inputs each)."""
    from msa_jit import SparseDecodePlanner, sparse_decode
    from msa_jit.bench import GEOMETRIES, make_step, time_graph

    rows = []
    for geo, batch in points:
        hq, hkv = GEOMETRIES[geo]
        steps = [make_step(hq, hkv, batch, 1, "bfloat16", seed=i) for i in range(num_layers)]
        bt, sl, slc = steps[0]["block_table"], steps[0]["seq_lens"], steps[0]["seq_lens_cpu"]
        planner = SparseDecodePlanner()

        def graph_of(n: int):
            def run():
                plan = planner.prepare(bt, sl, slc, 1, num_q_heads=hq, num_kv_heads=hkv, page_size=128, topk_blocks=16)
                for s in steps[:n]:  # every layer's cache is a permutation of the same pages
                    sparse_decode(s["query"], s["kv_cache"], s["topk"], s["out"], plan, sm_scale=1 / math.sqrt(128))
            return run

        t1 = statistics.median(time_graph(graph_of(1)))
        tl_ = statistics.median(time_graph(graph_of(num_layers)))
        marginal = (tl_ - t1) / (num_layers - 1)
        kv = steps[0]["kv_bytes"]
        row = {"geometry": geo, "batch": batch, "qlen": 1, "layers": num_layers, "one_layer_us": round(t1, 2),
               "all_layers_us": round(tl_, 2), "marginal_us": round(marginal, 2),
               "one_layer_pct_of_copy": round(100 * kv / (t1 * 1e-6) / copy_bw, 1),
               "marginal_pct_of_copy": round(100 * kv / (marginal * 1e-6) / copy_bw, 1)}
        rows.append(row)
        log(f"layers {row}")
        del steps
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", action="store_true", help="also time the op L layers per graph")
    a = ap.parse_args(argv)
    from msa_jit.bench import copy_bandwidth, environment

    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s", flush=True)
    result: dict[str, Any] = {"environment": environment(), "command": " ".join(sys.argv),
                              "copy_tbps": round(copy_bw / 1e12, 4), "ceilings": ceilings(copy_bw)}
    if a.layers:
        result["layers"] = layers(copy_bw)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ceilings-{time.strftime('%Y-%m-%dT%H%M', time.gmtime())}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
