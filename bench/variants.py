"""Kernel variant screening: build here (no GPU), check and time there, in one device run.

    python bench/variants.py build --arch sm_90a --dir .variants      # here: compile + export
    python bench/variants.py run --dir .variants --out $OUT           # GPU host: check + time

A variant is a set of constructor options of the portable kernel (`VARIANTS`); each one is
checked against the float64 reference before it is timed, and every variant is timed on the
same inputs, interleaved, in the same process (CUDA-graph replay, L2 flushed by reading,
medians; `msa_jit.tools.bench`). `run` also splits the batch-1 step and the host-side cost into
their parts. Results: one JSON file (device, versions, date, command inside).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Constructor options of the portable kernel to compare. "now" = the defaults at the time of
# the run. Options measured and dropped again (their commits carry them): l2_ahead (T1719),
# copy_pieces and lsu_ahead (T1734), copier="lsu" (2026-12-03 T0750: lsu, c3_lsu and their
# _nomath probes), split_merge="cluster" (2026-12-03 T1102: "now" there is the cluster merge,
# "kmerge" the merge kernel; commit 1d46db4), block stealing (T1102 "steal", kernel family
# "steal", commit 3486932); "s2" = {"stages": 2} and "s2_trace" (T1102, trace T1101) need no
# code. Earlier runs (their JSON files carry their own option sets): 2026-12-02 T1413 / T1425
# "base" (bittrick + 16-byte V loads), "cvt", "cvt_vrot" (now the default); T1453-T1617
# c3_lean, bt_prefetch, the 3-CTA and 6-stage probes; T0854 "scalar_out" (one 2-byte store per
# output element, the default until 2026-12-03, commit 0b2e8da). Probe and retired options
# (probe, pdl, v_loads, prefetch_bt) are bench/kernel_probes.py's, not the shipped kernel's.
# Plan options (PLAN_OPTIONS), not kernel options: "prologue_trigger" False binds the plan's
# Triton prologue without its griddepcontrol.launch_dependents (the default until 2026-12-02
# session 4); "num_splits" forces the split-KV factor where the planner can be made to pick it;
# "prologue" False leaves the prologue kernel out of the timed step.
VARIANTS: dict[str, dict[str, Any]] = {
    "now": {},
    "no_trigger": {"prologue_trigger": False},
    # the step without its Triton prologue kernel (kv_lens stay as the last refresh left them, right
    # for the bench's fixed seq_lens): what a decode kernel reading seq_lens itself would save
    "no_prologue": {"prologue": False},
    "no_pdl": {"pdl": False},  # the default until 2026-12-02 T1511
    # timing probes (kernel `probe` option: one stage left out, results wrong, not checked)
    "now_nomath": {"probe": "no_math"},
    "now_nocopy": {"probe": "no_copy"},
    # more, shorter CTAs at one wave (docs/performance.md, "Ceilings"): splits forced per point
    # where choose_num_splits can give them (3 and 4 at T*Hkv = 256)
    "split3": {"num_splits": 3},
    "split4": {"num_splits": 4},
    "split4_nomath": {"num_splits": 4, "probe": "no_math"},
    # per-CTA timeline (bench/trace_ctas.py): the full kernel plus a few timer stores
    "trace": {"probe": "trace"},
    "trace_pbt": {"probe": "trace", "prefetch_bt": True},  # does the block-table prefetch shorten the chain?
    # the split merge inside the decode launch (row 79): where a batch-1 CTA's time goes with it
    "trace_cm": {"probe": "trace", "split_merge": "cluster"},
    # the same, built in a checkout of 872d03b (the one main's h200_run.sh push_trace loads)
    "s20_trace_cm": {"probe": "trace", "split_merge": "cluster", "checkout": "872d03b"},
    # #12 / #11 again on the current kernel (16-byte stores, prologue trigger): 3 CTAs/SM with
    # the lean softmax was 1.5-3.9% faster at T*Hkv = 256 in T1511 (and 11% slower at 1.3 waves);
    # since T1342 the same options as the planner's 3-per-SM build (occupancy_options(3), #29)
    "c3_lean": {"q_frags": "smem", "smem_reads": "staged", "ctas_per_sm": 3, "stages": 2, "softmax": "lean"},
    "lean": {"softmax": "lean"},
    # the release of a stage before session 10 (sync_warp, then lane 0 arrives) and a named
    # barrier of the warp in its place; every lane arrives since (kernel_probes.py `release`)
    "rel_warp": {"release": "warp"},
    "c3_rel_warp": {"q_frags": "smem", "smem_reads": "staged", "ctas_per_sm": 3, "stages": 2, "softmax": "lean",
                    "release": "warp"},
    "rel_bar": {"release": "bar"},
    # the shipped builds of other commits, built there and copied here under these names: f6bef28
    # (before session 10: sync_warp release, the 3-CTA build's fp8 K read per half of head_dim) and
    # d56929f (session 10's release and K reads, before the FFMA softmax)
    "base": {"checkout": "f6bef28"},
    "c3_base": {"q_frags": "smem", "smem_reads": "staged", "ctas_per_sm": 3, "stages": 2, "softmax": "lean",
                "checkout": "f6bef28"},
    "s10": {"checkout": "d56929f"},
    "c3_s10": {"q_frags": "smem", "smem_reads": "staged", "ctas_per_sm": 3, "stages": 2, "softmax": "lean",
               "checkout": "d56929f"},
}
PLAN_OPTIONS = ("prologue_trigger", "num_splits", "prologue")
# "checkout": the variant's artifacts come from another commit's build (variants.py build there,
# the folder copied here under the variant's name), to time old and new kernels in one process
# options only bench/kernel_probes.py's ProbeMmaKernel has (the shipped kernel has none of them)
PROBE_OPTIONS = {"probe", "pdl", "v_loads", "prefetch_bt", "release", "merge_trigger", "convert", "epilogue_part"}
GEOMETRIES = [(64, 4, "bfloat16"), (8, 1, "bfloat16"), (16, 1, "bfloat16"), (64, 4, "float8_e4m3fn")]
BF16, FP8 = "bfloat16", "float8_e4m3fn"
# (geometry, batch, qlen, shared_blocks, query dtype)
POINTS = [("64/4", 256, 1, 0, BF16), ("64/4", 128, 1, 0, BF16), ("64/4", 64, 1, 0, BF16), ("8/1", 256, 1, 0, BF16),
          ("16/1", 256, 1, 0, BF16), ("64/4", 1, 1, 0, BF16), ("64/4", 64, 4, 12, BF16),
          ("64/4", 256, 1, 0, FP8), ("64/4", 64, 1, 0, FP8),
          ("64/4", 4, 1, 0, BF16), ("64/4", 16, 1, 0, BF16), ("8/1", 16, 1, 0, BF16),  # splits 16, 4, 8
          ("64/4", 80, 1, 0, BF16), ("64/4", 96, 1, 0, BF16),  # 320 / 384 CTAs: one wave only at 3 CTAs/SM
          ("64/4", 40, 1, 0, BF16)]  # 160 CTAs: ~1 per SM, where 2 stages per CTA might starve the stream


def _kernel_options(name: str) -> dict[str, Any]:
    return {k: v for k, v in VARIANTS[name].items() if k not in PLAN_OPTIONS and k != "checkout"}


def _kernel_class(options: dict[str, Any]):
    """The shipped kernel, or the bench's probe subclass when an option needs it (kernel_probes.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if options.get("union_fp8"):
        from union_fp8 import UnionFp8Kernel

        return UnionFp8Kernel
    if options.get("pv_split"):
        from dims_split import DimsLayoutKernel

        return DimsLayoutKernel
    if not set(options) & PROBE_OPTIONS:
        return None
    from kernel_probes import ProbeMmaKernel

    return ProbeMmaKernel


def _artifact_variant(name: str) -> str:
    """The first variant with the same kernel options (whose artifacts `name` reuses)."""
    key = (_kernel_options(name), VARIANTS[name].get("checkout"))
    return next(v for v in VARIANTS if (_kernel_options(v), VARIANTS[v].get("checkout")) == key)


def _is_probe(name: str) -> bool:
    """A timing probe leaves a stage out of the kernel: its results are wrong by design."""
    return VARIANTS[name].get("probe", "full") != "full"


def _so(root: Path, variant: str, hq: int, hkv: int, q_dtype: str) -> Path:
    return root / variant / f"{hq}x{hkv}-{q_dtype}" / "sparse_decode.so"


def build(args: argparse.Namespace) -> int:
    from msa_jit.jit.compiler import compile_sparse_decode
    from msa_jit.geometry import SparseDecodeConfig

    root = Path(args.dir)
    for name in args.variants or VARIANTS:
        if _artifact_variant(name) != name:
            continue
        if "checkout" in VARIANTS[name]:  # built by that checkout's own variants.py, copied here
            print(f"{name}: build it in a checkout of {VARIANTS[name]['checkout']} and copy it to "
                  f"{root / name}", flush=True)
            continue
        for hq, hkv, qd in GEOMETRIES:
            cfg = SparseDecodeConfig(num_q_heads=hq, num_kv_heads=hkv, q_dtype=qd, arch=args.arch)
            out = _so(root, name, hq, hkv, qd).parent
            out.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            opts = _kernel_options(name)
            compile_sparse_decode(cfg, out, kernel_options=opts, kernel_class=_kernel_class(opts))
            print(f"{name:>8} {hq}/{hkv} {qd}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def _check(fn, hq: int, hkv: int, qd: str, kv_dtype: str = FP8, lse_atol: float | None = None) -> list[dict[str, Any]]:
    """Reference comparison of one loaded variant on a few small cases (splits forced both ways)
    of its cache format (fp8, or "nvfp4" with the global scales as device tensors); lse_atol:
    the LSE bound (None: msa_jit.testing.LSE_ATOL; the union kernel's is UNION_LSE_ATOL)."""
    import torch

    from msa_jit import SparseDecodePlanner
    from msa_jit.testing import LSE_ATOL, make_case

    rows = []
    # num_sms=1: one split; padded: items of unequal length (CTAs end at different times). Each
    # case runs 3 times on one plan (fresh, poisoned outputs), so state a kernel keeps between
    # launches (the counters of block stealing, #25) is checked on every launch, not the first.
    for batch, qlen, num_sms, padded in ((1, 1, None, False), (3, 4, None, True), (16, 1, 1, False),
                                         (5, 2, 100000, True), (64, 1, 1, True), (8, 4, 1, True)):
        case = make_case(batch, qlen, hq, hkv, q_dtype=getattr(torch, qd), seed=hq * 1000 + batch * 10 + qlen,
                         device="cuda", padded=padded, transposed_topk=batch % 2 == 1,
                         kv_dtype="nvfp4" if kv_dtype == "nvfp4" else "fp8")
        plan = SparseDecodePlanner(num_sms=num_sms).prepare(*case.prepare_args(), **case.prepare_kwargs())
        err, problems, _ = _launch_checked(fn, case, plan, kv_dtype, lse_atol or LSE_ATOL)
        rows.append(dict(batch=batch, qlen=qlen, num_splits=plan.splits(kv_dtype), rel_l2=err, problems=problems))
    return rows


def _launch_checked(fn, case, plan, kv_dtype: str, lse_atol: float) -> tuple[float, list[str], bool]:
    """`fn` as `plan`'s kernel for `case` (msa_jit.testing.make_case), launched 3 times with fresh,
    poisoned outputs, each compared with the float64 reference: (the worst launch's rel L2 and
    problems, a failing launch first; whether the 3 outputs are bitwise identical)."""
    import torch

    from msa_jit import sparse_decode
    from msa_jit.testing import compare_with_reference

    plan.kernels[(case.query.dtype, kv_dtype)] = fn
    worst, outs = (-1.0, []), []
    for _ in range(3):
        out, lse = case.new_out(), case.new_lse()
        sparse_decode(case.query, case.kv_cache, case.topk, out, plan, lse=lse, backend="kernel",
                      **case.scales(scale_tensors=kv_dtype == "nvfp4"))
        torch.cuda.synchronize()
        err, problems = compare_with_reference(case, out, lse, lse_atol=lse_atol)
        worst = max(worst, (err, problems), key=lambda x: (bool(x[1]), x[0]))
        outs.append(out.view(torch.int16).clone())
    return worst[0], worst[1], all(torch.equal(outs[0], o) for o in outs[1:])


def _planner_for_splits(rows: int, topk: int, want: int | None, kv_dtype: str = "float8_e4m3fn"):
    """A planner whose plans for `rows` = T*Hkv get `want` splits for a cache format (None: the default),
    or None when no SM count makes choose_num_splits give it."""
    from msa_jit import SparseDecodePlanner
    from msa_jit.planner import choose_num_splits

    if want is None:
        return SparseDecodePlanner()
    n = next((n for n in range(1, 1 << 16) if choose_num_splits(rows, topk, n, kv_dtype) == want), None)
    return SparseDecodePlanner(num_sms=n) if n else None


def _no_refresh(seq_lens) -> None:
    """A plan's refresh that launches nothing (variant no_prologue)."""


def _time_points(fns: dict[tuple[str, str], Any], copy_bw: float, iters: int, rounds: int) -> list[dict]:
    from msa_jit import sparse_decode
    from msa_jit.tools.bench import GEOMETRIES as BENCH_GEOMS
    from msa_jit.tools.bench import make_step, prepare_args, time_graph
    from msa_jit.prologue import bind_refresh

    rows = []
    for geom, batch, qlen, shared, qd in POINTS:
        hq, hkv = BENCH_GEOMS[geom]
        step = make_step(hq, hkv, batch, qlen, qd, shared_blocks=shared)
        args, kw = prepare_args(step, hq, hkv, qlen)
        # one plan per split choice (each the same object every step; kernels swapped per variant)
        plans, refresh = {}, {}
        for want in {v.get("num_splits") for v in VARIANTS.values()}:
            planner = _planner_for_splits(batch * qlen * hkv, 16, want)
            if planner is None:  # no SM count gives that split factor at this point
                plans[want] = None
                continue
            plan = planner.prepare(*args, **kw)
            plans[want] = (planner, plan)
            refresh[want] = {trig: bind_refresh(step["seq_lens"], plan.kv_lens, plan.qo_offset, qlen,
                                                launch_dependents=trig) for trig in (True, False)}
        times: dict[str, list[float]] = {}
        for _ in range(rounds):  # interleaved, so clock / thermal drift hits every variant alike
            for name in VARIANTS:
                fn = fns.get((name, f"{hq}x{hkv}-{qd}"))
                want = VARIANTS[name].get("num_splits")
                if fn is None or not plans[want]:
                    continue
                planner, plan = plans[want]
                plan.kernels[(step["query"].dtype, "float8_e4m3fn")] = fn
                plan.refresh = refresh[want][VARIANTS[name].get("prologue_trigger", True)]
                if not VARIANTS[name].get("prologue", True):
                    plan.refresh(step["seq_lens"])  # kv_lens right once, then no prologue in the step
                    plan.refresh = _no_refresh

                def run(planner=planner):
                    sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"],
                                  planner.prepare(*args, **kw), sm_scale=0.088)

                times.setdefault(name, []).extend(time_graph(run, iters=iters))
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append(dict(variant=name, geometry=geom, q_dtype=qd, batch=batch, qlen=qlen, shared_blocks=shared,
                             num_splits=plans[VARIANTS[name].get("num_splits")][1].num_splits, us=round(med, 2),
                             pct_of_copy=round(100 * step["kv_bytes"] / (med * 1e-6) / copy_bw, 1),
                             logical_pct_of_copy=round(100 * step["logical_bytes"] / (med * 1e-6) / copy_bw, 1)))
            print(f"{name:>8} {geom} {qd} B={batch} q={qlen} shared={shared} S={rows[-1]['num_splits']}: "
                  f"{med:.2f} us {rows[-1]['pct_of_copy']}% of copy", flush=True)
        del step
    return rows


def _batch1_step(fn):
    """The 64/4 batch-1 bf16 step with its planner, prepare() arguments and plan running `fn`."""
    import torch

    from msa_jit import SparseDecodePlanner
    from msa_jit.tools.bench import make_step, prepare_args

    step = make_step(64, 4, 1, 1, "bfloat16")
    planner = SparseDecodePlanner()
    args, kw = prepare_args(step, 64, 4, 1)
    plan = planner.prepare(*args, **kw)
    plan.kernels[(torch.bfloat16, "float8_e4m3fn")] = fn
    return step, planner, args, kw, plan


def _batch1_parts(fn) -> dict[str, Any]:
    """Graph time of the batch-1 step and of its parts, plus per-kernel GPU durations."""
    import torch

    from msa_jit import sparse_decode
    from msa_jit.tools.bench import time_graph

    step, planner, args, kw, plan = _batch1_step(fn)

    def op():
        sparse_decode(step["query"], step["kv_cache"], step["topk"], step["out"], plan, sm_scale=0.088)

    tiny = torch.zeros(1, device="cuda")
    parts = {
        "step": lambda: (planner.prepare(*args, **kw), op()),
        "prologue_only": lambda: planner.prepare(*args, **kw),
        "op_only": op,
        "one_tiny_kernel": lambda: tiny.add_(1),
    }
    res = {name: round(statistics.median(time_graph(f, iters=100)), 2) for name, f in parts.items()}
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        parts["step"]()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            parts["step"]()
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and ev.count:
            kernels[ev.key[:60]] = round(ev.device_time_total / ev.count, 2) if hasattr(ev, "device_time_total") \
                else round(ev.cuda_time_total / ev.count, 2)
    res["kernel_us"] = kernels
    res["num_splits"] = plan.num_splits
    return res


def _host_parts(fn, iters: int = 3000) -> dict[str, float]:
    """CPU microseconds of each piece of prepare() and sparse_decode() on the batch-1 step."""
    import torch

    from msa_jit import sparse_decode
    from msa_jit.tools.bench import per_call_us
    from msa_jit.jit.compiler import convention
    from msa_jit.prologue import refresh_plan_tensors
    from msa_jit.validation import validate_prepare, validate_sparse_decode

    step, planner, args, kw, plan = _batch1_step(fn)
    q, kv, tk, out = step["query"], step["kv_cache"], step["topk"], step["out"]
    call_args = convention().call_arguments(plan, q, kv, tk, out, None, None, None, 0.1, 1.0)
    pieces = {
        "prepare": lambda: planner.prepare(*args, **kw),
        "validate_prepare": lambda: validate_prepare(*args, **kw),
        "triton_refresh_launch": lambda: refresh_plan_tensors(step["seq_lens"], plan.kv_lens, plan.qo_offset, 1),
        "bound_refresh_launch": lambda: plan.refresh(step["seq_lens"]),
        "sparse_decode": lambda: sparse_decode(q, kv, tk, out, plan, sm_scale=0.088),
        "validate_sparse_decode": lambda: validate_sparse_decode(q, kv, tk, out, plan, None, "auto"),
        # the exported function alone, on the convention's arguments (kernels/convention.py)
        "tvm_ffi_call": lambda: fn(*call_args),
        "empty_torch_op": lambda: out.data_ptr(),
    }
    res = {name: round(per_call_us(f, iters, warmup=100), 2) for name, f in pieces.items()}
    torch.cuda.synchronize()
    return res


def run(args: argparse.Namespace) -> int:
    from msa_jit.tools.bench import copy_bandwidth, environment
    from msa_jit.jit.loader import load_artifact

    root = Path(args.dir)
    unknown = set(args.variants or ()) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    fns, loaded = {}, {}
    for name in args.variants or VARIANTS:
        for hq, hkv, qd in GEOMETRIES:
            geom, art = f"{hq}x{hkv}-{qd}", _artifact_variant(name)
            so = _so(root, art, hq, hkv, qd)
            if (art, geom) not in loaded and so.is_file():  # same artifact: one load
                loaded[(art, geom)] = load_artifact(so)[0]
            if (art, geom) in loaded:
                fns[(name, geom)] = loaded[(art, geom)]
    result: dict[str, Any] = {"environment": environment(), "command": " ".join(sys.argv),
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "variants": {k: VARIANTS[k] for k in args.variants or VARIANTS}, "checks": {}}
    bad = 0
    for (name, geom), fn in loaded.items():  # each artifact checked once, under its own variant
        if _is_probe(name):  # probes compute wrong results by design
            continue
        hq, rest = geom.split("x")
        hkv, qd = rest.split("-", 1)
        rows = _check(fn, int(hq), int(hkv), qd)
        result["checks"][f"{name} {geom}"] = rows
        worst = max(r["rel_l2"] for r in rows)
        fails = [p for r in rows for p in r["problems"]]
        bad += bool(fails)
        print(f"check {name:>8} {geom}: worst rel L2 {worst:.2e} {'FAIL ' + '; '.join(fails) if fails else 'ok'}",
              flush=True)
    ok = {k: v for k, v in fns.items()
          if _is_probe(k[0]) or not any(r["problems"] for r in result["checks"][f"{_artifact_variant(k[0])} {k[1]}"])}
    result["copy_tbps"] = round(copy_bandwidth() / 1e12, 3)
    print(f"copy bandwidth {result['copy_tbps']} TB/s", flush=True)
    result["points"] = _time_points({} if args.host_only else ok, result["copy_tbps"] * 1e12, args.iters, args.rounds)
    base = ok.get((next(iter(VARIANTS)), "64x4-bfloat16"))
    if base is not None:
        result["batch1_parts_us"] = _batch1_parts(base)
        print("batch-1 parts:", json.dumps(result["batch1_parts_us"]), flush=True)
        result["host_parts_us"] = _host_parts(base)
        print("host parts:", json.dumps(result["host_parts_us"]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"variants-{time.strftime('%Y-%m-%dT%H%M', time.gmtime())}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--arch", default="sm_90a")
    b.add_argument("--dir", default=".variants")
    b.add_argument("--variants", nargs="*")
    r = sub.add_parser("run")
    r.add_argument("--dir", default=".variants")
    r.add_argument("--out", required=True)
    r.add_argument("--iters", type=int, default=30)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--host-only", action="store_true", help="skip the variant timing (batch-1 and host parts only)")
    r.add_argument("--variants", nargs="*", help="time only these (default: every variant with artifacts)")
    a = ap.parse_args(argv)
    return build(a) if a.cmd == "build" else run(a)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
