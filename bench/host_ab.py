"""CPU cost of the op call and of a cached prepare, old paths against new, interleaved in one
process on the GPU host (issue #19: op call <= 8 us, cached prepare <= 10 us), each also as a
ratio to a trivial torch op's launch (`x.add_(1)`) timed in the same round.

    python3 bench/host_ab.py --out $OUT     # GPU host, warmed cache (msa-jit warmup: 64/4 fp8 KV)

Every figure is the CPU's time per call of `--calls` calls issued while the GPU is held busy
by a spin kernel (`msa_jit.tools.bench.issue_us`: what an eager engine's CPU pays per layer when it
runs ahead of its GPU), the median of `--rounds` interleaved rounds. (Files before 2026-12-05:
calls back to back with one sync at the end, on steps made tiny on the GPU so that it kept up;
`gpu_bound` flagged where it did not.) `gpu_us_op`: the op alone, replayed in a graph.

Old paths: the op and the cached prepare as of commit ccbb811, frozen below (`old_op`,
`old_prepare`, the prologue launched with tensor arguments). New: msa_jit as it is. Also the
floor (the exported function called with a prebuilt argument tuple), the prologue's launch
three ways (pointers as ints, tensors, a CUDA graph of it replayed) and the fp8 views' cost.
`--union`: also a plan pinned to the union kernel (`op_union`, `op_union_fp8q`), whose exported
function encodes its two TMA descriptors on every call (the cache's page count is a runtime size).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from msa_jit import SparseDecodePlanner, sparse_decode  # noqa: E402
from msa_jit.op import LOG2E, _kernel_call_arguments  # noqa: E402
from msa_jit.planner import _plan_key  # noqa: E402
from msa_jit.validation import check_kv_scale, check_scale, validate_prepare_tensors, validate_sparse_decode  # noqa: E402

HQ, HKV, PAGE, TOPK = 64, 4, 128, 16
POINTS = (1, 64)  # batch 1: 16 splits, two launches per op; batch 64: one split, one launch


# ----------------------------------------------------------------------------- the old paths (ccbb811)
def old_op(query, kv_cache, topk, out, plan, *, sm_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0,
           lse=None, backend="auto"):
    """msa_jit.sparse_decode as of ccbb811, kernel branch (frozen for this A/B)."""
    resolved, kv_dtype = validate_sparse_decode(query, kv_cache, topk, out, plan, lse, backend)
    sm = check_scale("sm_scale", sm_scale)
    qs = check_scale("q_scale", q_scale)
    ks, k_dev = check_kv_scale("k_scale", k_scale, plan, resolved)
    vs, v_dev = check_kv_scale("v_scale", v_scale, plan, resolved)
    assert resolved == "kernel"
    fn = plan.kernels.get((query.dtype, kv_dtype))
    if fn is None:
        fn = plan.resolve_kernel(query.dtype, kv_dtype)
    fn(*_kernel_call_arguments()(plan, query, kv_cache, topk, out, lse, k_dev, v_dev, sm * qs * ks * LOG2E, vs))


def old_refresh_of(plan, seq_lens):
    """The plan's bound prologue launch as of ccbb811: the runner called with tensors."""
    import triton

    from msa_jit.prologue import BLOCK_ROWS, _launch_dependents, refresh_plan_tensors

    kv, qo, qlen = plan.kv_lens, plan.qo_offset, plan.qlen
    num_rows, pdl = kv.numel(), _launch_dependents(True)
    runner = plan.refresh.compiled[(triton.cdiv(num_rows, BLOCK_ROWS), 1, 1)]
    aligned = seq_lens.data_ptr() % 16 == 0

    def bound(s):
        if (s.data_ptr() % 16 == 0) != aligned:
            refresh_plan_tensors(s, kv, qo, qlen, pdl)
        else:
            runner(s, kv, qo, num_rows, qlen, BLOCK_ROWS, pdl)

    return bound


def old_prepare(planner, refresh, block_table, seq_lens, seq_lens_cpu, decode_query_len, *,
                num_q_heads, num_kv_heads, page_size, topk_blocks):
    """SparseDecodePlanner.prepare as of ccbb811 on a cached step (frozen; `refresh` = old_refresh_of)."""
    ints = (decode_query_len, num_q_heads, num_kv_heads, page_size, topk_blocks)
    key = None
    if (all(type(v) is int for v in ints)
            and isinstance(seq_lens, torch.Tensor) and isinstance(block_table, torch.Tensor)
            and seq_lens.dim() == 1 and block_table.dim() == 2):
        key = _plan_key(block_table, seq_lens, *ints)
    plan = planner.plans.get(key) if key is not None else None
    if plan is None:
        raise RuntimeError("host_ab: the old prepare is timed on cached steps only")
    validate_prepare_tensors(block_table, seq_lens, seq_lens_cpu)
    plan.block_table = block_table
    plan.seq_lens = seq_lens
    refresh(seq_lens)
    return plan


# ----------------------------------------------------------------------------- the steps
def make_point(batch: int, fused_so: str | None = None, union: bool = False):
    """A 64/4 decode step that costs the GPU little: every request one full block (page i); with
    fused_so, a second plan that runs that artifact (op_fused); with union, a plan pinned to the
    union kernel (op_union: its exported function encodes two TMA descriptors per call)."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(batch)
    kv = (torch.randn(batch, HKV, PAGE, 256, generator=g, device=dev) * 0.5).to(torch.float8_e4m3fn)
    topk = torch.full((batch, HKV, TOPK), -1, dtype=torch.int32, device=dev)
    topk[:, :, 0] = 0
    s = dict(
        query=torch.randn(batch, HQ, 128, generator=g, device=dev).to(torch.bfloat16), kv_cache=kv, topk=topk,
        out=torch.empty(batch, HQ, 128, dtype=torch.bfloat16, device=dev),
        block_table=torch.arange(batch, dtype=torch.int32, device=dev).view(batch, 1),
        seq_lens=torch.full((batch,), PAGE, dtype=torch.int32, device=dev),
        seq_lens_cpu=torch.full((batch,), PAGE, dtype=torch.int32),
    )
    s["kw"] = dict(num_q_heads=HQ, num_kv_heads=HKV, page_size=PAGE, topk_blocks=TOPK)
    s["planner"] = planner = SparseDecodePlanner()
    s["plan"] = planner.prepare(s["block_table"], s["seq_lens"], s["seq_lens_cpu"], 1, **s["kw"])
    s["query_fp8"] = s["query"].to(torch.float8_e4m3fn)
    s["kv_u8"] = kv.view(torch.uint8)
    s["k_dev"] = torch.tensor(1.0, device=dev)  # 0-dim, as vLLM's layer._k_scale
    s["v_dev"] = torch.tensor(1.0, device=dev)
    s["k_dev1"], s["v_dev1"] = s["k_dev"].view(1), s["v_dev"].view(1)
    if fused_so:  # a second plan (its own workspace and arrival counters) running the fused-merge build
        from msa_jit.jit import loader

        s["plan_fused"] = SparseDecodePlanner().prepare(s["block_table"], s["seq_lens"], s["seq_lens_cpu"], 1, **s["kw"])
        s["plan_fused"].kernels[(torch.bfloat16, "float8_e4m3fn")] = loader.load_artifact(fused_so)[0]
    if union:
        s["plan_union"] = SparseDecodePlanner(kernel="union").prepare(s["block_table"], s["seq_lens"],
                                                                      s["seq_lens_cpu"], 1, **s["kw"])
    return s


def variants(s):
    """name -> callable of one timed call."""
    q, q8, kv, kvu, tk, out, plan = (s[k] for k in ("query", "query_fp8", "kv_cache", "kv_u8", "topk", "out", "plan"))
    bt, sl, slc, kw, planner = s["block_table"], s["seq_lens"], s["seq_lens_cpu"], s["kw"], s["planner"]
    sm = 0.088
    # resolve both kernels (the first call of a plan takes the checked path)
    for qq in (q, q8):
        sparse_decode(qq, kv, tk, out, plan, sm_scale=sm)
    fn = plan.kernels[(torch.bfloat16, "float8_e4m3fn")]
    floor_args = _kernel_call_arguments()(plan, q, kvu, tk, out, None, None, None, sm, 1.0)
    old_refresh = old_refresh_of(plan, sl)
    x = torch.zeros(1, device="cuda")
    fused = {}
    if "plan_fused" in s:
        pf = s["plan_fused"]
        sparse_decode(q, kv, tk, out, pf, sm_scale=sm)
        fused = {"op_fused": lambda: sparse_decode(q, kv, tk, out, pf, sm_scale=sm)}
    if "plan_union" in s:
        pu = s["plan_union"]
        for qq in (q, q8):
            sparse_decode(qq, kv, tk, out, pu, sm_scale=sm)
        fused |= {"op_union": lambda: sparse_decode(q, kv, tk, out, pu, sm_scale=sm),
                  "op_union_fp8q": lambda: sparse_decode(q8, kv, tk, out, pu, sm_scale=sm)}
    return fused | {
        "torch_add": lambda: x.add_(1),
        "ffi_floor": lambda: fn(*floor_args),
        "op_old": lambda: old_op(q, kv, tk, out, plan, sm_scale=sm),
        "op_new": lambda: sparse_decode(q, kv, tk, out, plan, sm_scale=sm),
        "op_old_u8kv": lambda: old_op(q, kvu, tk, out, plan, sm_scale=sm),
        "op_new_u8kv": lambda: sparse_decode(q, kvu, tk, out, plan, sm_scale=sm),
        # vLLM's call: an fp8 query and the cache viewed as fp8 (two uint8 views in the op)
        "op_old_fp8q": lambda: old_op(q8, kv, tk, out, plan, sm_scale=sm),
        "op_new_fp8q": lambda: sparse_decode(q8, kv, tk, out, plan, sm_scale=sm),
        "op_new_fp8q_u8kv": lambda: sparse_decode(q8, kvu, tk, out, plan, sm_scale=sm),
        # vLLM's NVFP4 call pattern (0-dim device global scales), here on the fp8 kernel
        "op_old_dev_scales": lambda: old_op(q, kv, tk, out, plan, sm_scale=sm, k_scale=s["k_dev"], v_scale=s["v_dev"]),
        "op_new_dev_scales": lambda: sparse_decode(q, kv, tk, out, plan, sm_scale=sm, k_scale=s["k_dev"],
                                                   v_scale=s["v_dev"]),
        # the same scales as [1] tensors (no view: since session 13 a 0-dim one's view is made once)
        "op_new_dev_scales_1d": lambda: sparse_decode(q, kv, tk, out, plan, sm_scale=sm, k_scale=s["k_dev1"],
                                                      v_scale=s["v_dev1"]),
        "prepare_old": lambda: old_prepare(planner, old_refresh, bt, sl, None, 1, **kw),
        "prepare_new": lambda: planner.prepare(bt, sl, None, 1, **kw),
        "prepare_old_cpu_copy": lambda: old_prepare(planner, old_refresh, bt, sl, slc, 1, **kw),
        "prepare_new_cpu_copy": lambda: planner.prepare(bt, sl, slc, 1, **kw),
        "prologue_tensors": lambda: old_refresh(sl),
        "prologue_ints": lambda: plan.refresh(sl),
        "prologue_graph": prologue_graph(plan, sl),
        "step_old": lambda: (old_prepare(planner, old_refresh, bt, sl, slc, 1, **kw),
                             old_op(q, kv, tk, out, plan, sm_scale=sm)),
        "step_new": lambda: (planner.prepare(bt, sl, slc, 1, **kw), sparse_decode(q, kv, tk, out, plan, sm_scale=sm)),
    }


def prologue_graph(plan, seq_lens):
    """The plan's prologue captured once in a CUDA graph (per plan and seq_lens address): replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.refresh(seq_lens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.refresh(seq_lens)
    return graph.replay


def check_results(s, fns) -> dict[str, bool]:
    """Every prologue path writes the formula; the old and new op paths write the same bits."""
    from msa_jit.prologue import refresh_plan_tensors_torch

    plan, sl = s["plan"], s["seq_lens"]
    ok = {}
    want_kv, want_qo = plan.kv_lens.clone(), plan.qo_offset.clone()
    for name in ("prologue_tensors", "prologue_ints", "prologue_graph"):
        sl.sub_(7)
        refresh_plan_tensors_torch(sl, want_kv, want_qo, plan.qlen)
        plan.kv_lens.fill_(-5)
        fns[name]()
        torch.cuda.synchronize()
        ok[name] = bool(torch.equal(plan.kv_lens, want_kv) and torch.equal(plan.qo_offset, want_qo))
    sl.fill_(PAGE)
    plan.refresh(sl)
    bits = {}
    for name in ("op_old", "op_new", "op_new_u8kv", "op_new_dev_scales", "op_new_dev_scales_1d"):
        s["out"].fill_(math.nan)
        fns[name]()
        torch.cuda.synchronize()
        bits[name] = s["out"].view(torch.int16).clone()
    ok["op_paths_same_bits"] = all(torch.equal(bits["op_old"], b) for b in bits.values())
    if "op_fused" in fns:  # another merge order: close, not the same bits
        s["out"].fill_(math.nan)
        fns["op_fused"]()
        torch.cuda.synchronize()
        ok["op_fused_close"] = bool(torch.allclose(s["out"].float(), bits["op_old"].view(torch.bfloat16).float(),
                                                   rtol=2e-2, atol=2e-3))
    if "op_union" in fns:  # another kernel (S from fp8 Q halves): close, not the same bits
        s["out"].fill_(math.nan)
        fns["op_union"]()
        torch.cuda.synchronize()
        ok["op_union_close"] = bool(torch.allclose(s["out"].float(), bits["op_old"].view(torch.bfloat16).float(),
                                                   rtol=2e-2, atol=5e-3))
    ok["op_out_finite"] = bool(torch.isfinite(bits["op_old"].view(torch.bfloat16).float()).all())
    return ok


def gpu_us_per_op(fn, n: int = 20) -> float:
    """GPU time of one op call: n calls captured in a graph, replayed between two events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--fused-so", help="a one-launch build, 64x4 (the merge inside the decode launch: "
                    "kv_format_ab.py's f_c2_fused of row 53, s19p_f_c2_cm of row 79): op_fused")
    ap.add_argument("--union", action="store_true", help="also the union kernel's call (op_union, op_union_fp8q)")
    a = ap.parse_args(argv)
    from msa_jit.tools.bench import environment, issue_us

    t_start = time.perf_counter()
    result = {"environment": environment(), "command": " ".join(sys.argv), "calls": a.calls,
              "rounds": a.rounds, "method": "issue_held_gpu", "points": {}}
    for batch in POINTS:
        s = make_point(batch, a.fused_so, a.union)
        fns = variants(s)
        checks = check_results(s, fns)
        rounds: dict[str, list[float]] = {k: [] for k in fns}
        ratios: dict[str, list[float]] = {k: [] for k in fns}
        for fn in fns.values():
            for _ in range(200):
                fn()
        for _ in range(a.rounds):
            for name, fn in fns.items():
                rounds[name].append(issue_us(fn, a.calls))
            for name in fns:
                ratios[name].append(rounds[name][-1] / rounds["torch_add"][-1])
        gpu = gpu_us_per_op(fns["op_new"])
        gpu_fused = gpu_us_per_op(fns["op_fused"]) if "op_fused" in fns else None
        gpu_union = gpu_us_per_op(fns["op_union"]) if "op_union" in fns else None
        med = {k: round(statistics.median(v), 2) for k, v in rounds.items()}
        point = {
            "batch": batch, "num_splits": s["plan"].num_splits, "ctas_per_sm": s["plan"].ctas_per_sm,
            "checks": checks, "us_per_call": med,
            "us_rounds": {k: [round(x, 2) for x in v] for k, v in rounds.items()},
            "ratio_to_torch_add": {k: round(statistics.median(v), 2) for k, v in ratios.items()},
            "gpu_us_op": round(gpu, 2), "gpu_us_op_fused": gpu_fused and round(gpu_fused, 2),
            "gpu_us_op_union": gpu_union and round(gpu_union, 2),
            "targets": {"op_call_le_8us": med["op_new"] <= 8.0, "prepare_le_10us": med["prepare_new"] <= 10.0},
        }
        result["points"][f"64/4 B={batch}"] = point
        print(f"64/4 B={batch} (splits {point['num_splits']}, GPU {gpu:.2f} us/op) checks {checks}", flush=True)
        for k in fns:
            print(f"  {k:22s} {med[k]:7.2f} us  x{point['ratio_to_torch_add'][k]:.2f} of torch_add"
                  f"  rounds {point['us_rounds'][k]}", flush=True)
        del s, fns
        torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"host-ab-{time.strftime('%Y-%m-%dT%H%M', time.gmtime())}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} ({result['seconds']} s)")
    ok = all(all(p["checks"].values()) for p in result["points"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
