"""How `msa-jit bench` measures the grid (`grid.grid_rows`) per layer, beside its floor and ceilings, and the host side.

Every row of the grid is the op as an engine runs it (the contract's "How the engine runs the
op"): one prologue (`prepare`), then L layers, each its own KV cache, topk and query, in one
CUDA graph, L2 flushed before the replay (`time_graph`). A row gives the one-layer step
(prologue + one op: the `points` entry of the same point, `us`) and `marginal_us` = (t(L) -
t(1)) / (L - 1), what one more layer costs. Bandwidth = distinct KV bytes / time, as a ratio
to a 2 GiB device-to-device copy measured in the same run; `read_2g` (one launch reading
2 GiB) is the read-only stream's own ceiling beside it. Every point is timed for the fp8 and
the NVFP4 cache, one after the other on the same topk, block table and query.

Small-batch rows also carry the floor probe (`readers.floor_layer`: one launch per layer doing
only the topk -> block table -> KV bytes chain for the same bytes and programs of one block
each), measured the same way: `floor_marginal_us`, `ratio_to_floor`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import platform
import shlex
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ...geometry import HEAD_DIM
from .grid import (FLOOR_BATCHES, GRID_BATCHES, GRID_GEOMETRIES, GRID_KV_DTYPES, GRID_QLENS, NUM_LAYERS, SHARED_BLOCKS, SHARED_POINTS, RowSpec, add_speedups, grid_rows)
from .steps import FP8_KV, GEOMETRIES, NVFP4_KV, decode, make_indices, make_step, prepare_args
from .timing import (copy_bandwidth, interleaved_issue_us, interleaved_per_call_us, median_in_graph, per_call_us, time_graph)


@dataclass
class BenchPoint:
    """One decode step (prepare + one op) as a standalone graph: the figure of the old grid."""

    geometry: str
    q_dtype: str
    batch: int
    qlen: int
    shared_blocks: int  # blocks consecutive tokens of a request share (0: independent draws)
    num_splits: int
    us: float  # median step time (graph replay), microseconds
    us_p10: float
    us_p90: float
    kv_bytes: int  # distinct KV bytes the step must read (in this cache's block size)
    logical_bytes: int  # bytes a per-token kernel would read
    tbps: float  # effective TB/s = kv_bytes / time
    logical_tbps: float
    pct_of_copy: float  # tbps / copy bandwidth
    # the same step timed inside one graph of `iters` steps (time_in_graph, `--in-graph` only):
    # no standalone graph launch in the figure; None where not measured
    us_in_graph: float | None = None
    pct_of_copy_in_graph: float | None = None
    ctas_per_sm: int | None = None  # the kernel build the planner picked (2 or 3 CTAs per SM)
    kv_dtype: str = FP8_KV  # the cache format (result files before NVFP4 had fp8 points only)


def _pct(nbytes: int, us: float, copy_bw: float) -> float:
    return round(100 * nbytes / (us * 1e-6) / copy_bw, 1)


def layer_times(planner, steps: list[dict[str, Any]], hq: int, hkv: int, qlen: int,
               layer: Callable[[dict[str, Any], Any], None], num_layers: int, iters: int) -> tuple[list[float], float]:
    """(times of the one-layer graph, median of the L-layer graph): one prologue, then `layer`."""
    args, kw = prepare_args(steps[0], hq, hkv, qlen)  # every layer's cache is a permutation of the same pages

    def graph_of(n: int):
        def run():
            plan = planner.prepare(*args, **kw)
            for s in steps[:n]:
                layer(s, plan)
        return run

    t1 = time_graph(graph_of(1), iters=iters)
    t_all = statistics.median(time_graph(graph_of(num_layers), iters=iters))
    return t1, t_all


def measure_row(spec: RowSpec, copy_bw: float, *, q_dtype: str = "bfloat16", iters: int = 50,
                num_layers: int = NUM_LAYERS, ctas_per_sm: int | None = None, in_graph: bool = False,
                indices: list | None = None, peers: list | None = None) -> tuple[dict[str, Any], BenchPoint]:
    """Time one row (see the module docstring): (its per_layer row, its one-layer BenchPoint).

    indices: the `make_indices` results of the L layers to reuse (one point's fp8 and NVFP4
    rows then read the same blocks); drawn from seeds 0..L-1 when None.
    peers: `peers.Peer`s timed on the same steps the same way, their figures added to the row.
    """
    import torch

    from ...planner import SparseDecodePlanner

    if num_layers < 2:
        raise ValueError(f"num_layers: the marginal needs at least 2 layers, got {num_layers}")
    hq, hkv = GEOMETRIES[spec.geometry]
    if indices is None:
        indices = [make_indices(spec.batch, hkv, spec.qlen, shared_blocks=spec.shared_blocks, seed=i)
                   for i in range(num_layers)]
    steps = [make_step(hq, hkv, spec.batch, spec.qlen, q_dtype, shared_blocks=spec.shared_blocks, seed=i,
                       kv_dtype=spec.kv_dtype, indices=indices[i]) for i in range(num_layers)]
    planner = SparseDecodePlanner(ctas_per_sm=ctas_per_sm)
    args, kw = prepare_args(steps[0], hq, hkv, spec.qlen)
    t1s, t_all = layer_times(planner, steps, hq, hkv, spec.qlen, decode, num_layers, iters)
    t1s.sort()
    t1 = statistics.median(t1s)
    marginal = (t_all - t1) / (num_layers - 1)
    plan = planner.prepare(*args, **kw)
    launch = plan.launch(spec.kv_dtype)  # the build that ran
    kv, logical = steps[0]["kv_bytes"], steps[0]["logical_bytes"]
    row: dict[str, Any] = {
        "geometry": spec.geometry, "batch": spec.batch, "qlen": spec.qlen, "shared_blocks": spec.shared_blocks,
        "q_dtype": q_dtype, "kv_dtype": spec.kv_dtype, "layers": num_layers, "ctas_per_sm": launch.ctas_per_sm,
        "kernel": launch.kernel, "num_splits": launch.num_splits,
        "split_merge": launch.split_merge, "kv_bytes": kv, "logical_bytes": logical,
        "one_layer_us": round(t1, 2), "all_layers_us": round(t_all, 2), "marginal_us": round(marginal, 2),
        "marginal_tbps": round(kv / (marginal * 1e-6) / 1e12, 3),
        "one_layer_pct_of_copy": _pct(kv, t1, copy_bw), "marginal_pct_of_copy": _pct(kv, marginal, copy_bw),
        "marginal_logical_pct_of_copy": _pct(logical, marginal, copy_bw),
    }
    if peers:
        from .peers import measure_peers

        row.update(measure_peers(peers, steps, hq, hkv, spec.qlen, q_dtype, spec.kv_dtype,
                                 lambda: decode(steps[0], plan), row, iters=iters, num_layers=num_layers))
    med_in = None
    if in_graph:
        med_in = median_in_graph(lambda: decode(steps[0], planner.prepare(*args, **kw)), iters=iters)
    point = BenchPoint(
        spec.geometry, q_dtype, spec.batch, spec.qlen, spec.shared_blocks, launch.num_splits, round(t1, 2),
        round(t1s[len(t1s) // 10], 2), round(t1s[(9 * len(t1s)) // 10], 2), kv, logical,
        round(kv / (t1 * 1e-6) / 1e12, 3), round(logical / (t1 * 1e-6) / 1e12, 3), _pct(kv, t1, copy_bw),
        med_in, _pct(kv, med_in, copy_bw) if med_in else None, launch.ctas_per_sm, spec.kv_dtype)
    if spec.floor:
        row.update(measure_floor(planner, steps, hq, hkv, spec.qlen, num_layers, iters))
        row["ratio_to_floor"] = round(marginal / row["floor_marginal_us"], 3) if row["floor_marginal_us"] > 0 else None
    del steps
    torch.cuda.empty_cache()
    return row, point


def measure_floor(planner, steps: list[dict[str, Any]], hq: int, hkv: int, qlen: int, num_layers: int,
                  iters: int) -> dict[str, Any]:
    """The floor probe on a row's own steps, timed exactly like the row (one prologue, L layers)."""
    from .readers import floor_layer

    probes = {id(s): floor_layer(s) for s in steps}
    t1s, t_all = layer_times(planner, steps, hq, hkv, qlen, lambda s, plan: probes[id(s)](), num_layers, iters)
    t1 = statistics.median(t1s)
    first = probes[id(steps[0])]
    return {"floor_one_layer_us": round(t1, 2), "floor_marginal_us": round((t_all - t1) / (num_layers - 1), 2),
            "floor_programs": first.programs, "floor_pdl": first.pdl}


def per_layer(copy_bw: float, points=(("64/4", 64), ("8/1", 256), ("64/4", 256), ("64/4", 1)),
              num_layers: int = NUM_LAYERS, log=print, ctas_per_sm: int | None = None,
              kv_dtypes=(FP8_KV,), floor: bool = False, q_dtype: str = "bfloat16",
              iters: int = 50) -> list[dict[str, Any]]:
    """`per_layer` rows at a few points (for A/B comparisons of builds in one process).

    points: (geometry, batch) or (geometry, batch, qlen) or (geometry, batch, qlen, shared_blocks).
    ctas_per_sm: pin the kernel build (None: the planner's choice, reported per row).
    """
    rows = []
    for p in points:
        geo, batch, qlen, shared = {2: (*p, 1, 0), 3: (*p, 0), 4: tuple(p)}[len(p)]
        hkv = GEOMETRIES[geo][1]
        indices = [make_indices(batch, hkv, qlen, shared_blocks=shared, seed=i) for i in range(num_layers)]
        for kv in kv_dtypes:
            row, _ = measure_row(RowSpec(geo, batch, qlen, shared, kv, floor), copy_bw, q_dtype=q_dtype,
                                 iters=iters, num_layers=num_layers, ctas_per_sm=ctas_per_sm, indices=indices)
            rows.append(row)
            log(f"layers {row}")
    add_speedups(rows)
    return rows


def host_overheads(calls: int = 200, batch: int = 1, rounds: int = 15, nvfp4: bool = True,
                   wall_calls: int = 3000) -> dict[str, Any]:
    """CPU cost of an eager op call and of a cached prepare (64/4, bf16 query), per the contract.

    `*_cpu_us`: host time per call, `calls` calls issued while the GPU is held busy
    (`timing.issue_us`), so the figure is the CPU's even where the op's GPU time is longer; the
    median of `rounds` interleaved rounds, under `torch.inference_mode()` as vLLM runs its model:
    - `op_call_cpu_us` / `prepare_cpu_us`: `msa_jit.sparse_decode` and a cached
      `SparseDecodePlanner.prepare`;
    - `engine_call_cpu_us` / `engine_prepare_cpu_us`: what vLLM pays through the engine adapter,
      `msa_jit.integrations.engine.msa_cutlass_sparse_decode` (fp8 query and cache, float scales, vLLM's call)
      per layer and `prepare_decode_metadata` (cached) per step;
    - `op_call_cpu_us_nvfp4`: the op on an NVFP4 cache with its global scales as [1] device
      tensors; `op_call_cpu_us_nvfp4_0d`: as 0-dim ones (vLLM's `layer._k_scale` / `_v_scale`);
    - `torch_add_us`: `torch.add(x, 1, out=y)` on a small CUDA tensor, timed the same way; the
      `*_vs_torch_add` ratios compare hosts (their CPUs differ by up to 2.5x).
    `op_call_wall_us` / `torch_add_wall_us`: files before 2026-12-05 called this `*_cpu_us`:
    `wall_calls` calls back to back with one sync at the end, which is the GPU's time per call wherever that
    is longer (it was: 64/4 batch 1 on T1715's, T1717's and T2133's hosts). The eager-step
    figures (`eager_*`, `op_pipelined_*`: 200 steps, GPU time by graph replay) are kept.
    """
    import torch

    from ...integrations.engine import MSACutlassDecodePlanCache, msa_cutlass_sparse_decode, prepare_decode_metadata
    from ...planner import SparseDecodePlanner

    step = make_step(64, 4, batch, 1, "bfloat16")
    planner = SparseDecodePlanner()
    args, kw = prepare_args(step, 64, 4, 1)
    plan = planner.prepare(*args, **kw)

    def op_call():
        decode(step, plan)

    def eager_step():
        decode(step, planner.prepare(*args, **kw))

    engine_cache = MSACutlassDecodePlanCache()
    metadata = prepare_decode_metadata(*args, plan_cache=engine_cache, **kw)
    q_fp8 = step["query"].to(torch.float8_e4m3fn)

    def engine_call():
        msa_cutlass_sparse_decode(q_fp8, step["kv_cache"], step["topk"], step["out"], metadata,
                                  scale=HEAD_DIM ** -0.5, q_scale_float=1.0, k_scale_float=step["k_scale"],
                                  v_scale_float=step["v_scale"])

    x = torch.zeros(16, device="cuda")
    y = torch.empty_like(x)
    fns = {"op_call": op_call, "prepare": lambda: planner.prepare(*args, **kw),
           "engine_call": engine_call,
           "engine_prepare": lambda: prepare_decode_metadata(*args, plan_cache=engine_cache, **kw),
           "torch_add": lambda: torch.add(x, 1, out=y)}
    nvfp4_error = None
    if nvfp4:
        try:
            s4 = make_step(64, 4, batch, 1, "bfloat16", kv_dtype=NVFP4_KV)
            s4["k_scale"] = torch.tensor([s4["k_scale"]], dtype=torch.float32, device="cuda")
            s4["v_scale"] = torch.tensor([s4["v_scale"]], dtype=torch.float32, device="cuda")
            s0 = dict(s4, k_scale=s4["k_scale"].view(()), v_scale=s4["v_scale"].view(()))
            decode(s4, plan)
            decode(s0, plan)
            fns["op_call_nvfp4"] = lambda: decode(s4, plan)
            fns["op_call_nvfp4_0d"] = lambda: decode(s0, plan)
        except Exception as e:  # noqa: BLE001 - e.g. no NVFP4 artifact: the fp8 figures still count
            nvfp4_error = f"{type(e).__name__}: {e}"
    eager_step()
    engine_call()
    with torch.inference_mode():
        us = interleaved_issue_us(fns, calls, rounds=rounds)
        wall = interleaved_per_call_us({"op_call": op_call, "torch_add": fns["torch_add"]}, wall_calls, rounds=3)
    res: dict[str, Any] = {"batch": batch, "calls": calls, "rounds": rounds, "method": "issue_held_gpu"}
    res["torch_add_us"] = round(us["torch_add"], 2)
    for name in ("op_call", "prepare", "engine_call", "engine_prepare"):
        res[f"{name}_cpu_us"] = round(us[name], 2)
        res[f"{name}_vs_torch_add"] = round(us[name] / us["torch_add"], 2)
    if "op_call_nvfp4" in us:
        res["op_call_cpu_us_nvfp4"] = round(us["op_call_nvfp4"], 2)
        res["op_call_cpu_us_nvfp4_0d"] = round(us["op_call_nvfp4_0d"], 2)
    elif nvfp4_error:
        res["op_call_nvfp4_error"] = nvfp4_error
    res["op_call_wall_us"] = round(wall["op_call"], 2)
    res["torch_add_wall_us"] = round(wall["torch_add"], 2)
    eager_us = per_call_us(eager_step, 200, sync="each")
    pipelined_us = per_call_us(eager_step, 200, sync="end")
    gpu_us = statistics.median(time_graph(eager_step, iters=50))
    op_gpu_us = statistics.median(time_graph(op_call, iters=50))
    res.update({"eager_step_wall_us": round(eager_us, 2), "graph_step_gpu_us": round(gpu_us, 2),
                "eager_overhead_us": round(eager_us - gpu_us, 2),
                "eager_pipelined_step_us": round(pipelined_us, 2),
                "eager_pipelined_overhead_us": round(pipelined_us - gpu_us, 2),
                "graph_op_gpu_us": round(op_gpu_us, 2),
                "op_pipelined_overhead_us": round(wall["op_call"] - op_gpu_us, 2)})
    return res


def invocation() -> str:
    """The command line of this process as typed: `msa-jit ...` for the CLI (its console script or
    `python -m msa_jit`), else `python <script> ...` (the bench/ scripts that record environment())."""
    prog = Path(sys.argv[0])
    if prog.name == "msa-jit" or prog.parts[-2:] == ("msa_jit", "__main__.py"):
        return shlex.join(["msa-jit", *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])


def environment() -> dict[str, str]:
    import torch

    from ...jit.compiler import dsl_version

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "cutlass_dsl": dsl_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": invocation(),
    }


class Stopped(BaseException):  # not an Exception: a per-row `except Exception` must not swallow it
    """SIGTERM while a grid runs (a device script's timeout): keep the rows done."""


@contextlib.contextmanager
def stop_on_sigterm():
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped()

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def ceilings() -> tuple[float, float, dict[str, Any]]:
    """(copy bandwidth, 2 GiB read bandwidth, the one-tiny-kernel graph's times): the run's ceilings."""
    import torch

    from .readers import read_bandwidth

    copy_bw = copy_bandwidth()
    read_bw = read_bandwidth()
    tiny = torch.zeros(1, device="cuda")
    floor = {"graph_us": round(statistics.median(time_graph(lambda: tiny.add_(1), iters=100)), 2),
             "in_graph_us": median_in_graph(lambda: tiny.add_(1), iters=100)}
    return copy_bw, read_bw, floor


def _one_row(n: int, spec: RowSpec, specs: list[RowSpec], copy_bw: float, indices: dict, rows: list,
             points: list, errors: list, t_start: float, log, **kw) -> None:
    """Time row n of run_grid's specs and log it, or record its failure."""
    if spec.point not in indices:  # the fp8 and NVFP4 rows of a point share their indices
        hkv = GEOMETRIES[spec.geometry][1]
        indices.clear()
        indices[spec.point] = [make_indices(spec.batch, hkv, spec.qlen, shared_blocks=spec.shared_blocks, seed=i)
                               for i in range(kw["num_layers"])]
    head = f"[{n}/{len(specs)} {time.perf_counter() - t_start:5.0f} s]"
    try:
        row, point = measure_row(spec, copy_bw, indices=indices[spec.point], **kw)
    except Exception as e:  # noqa: BLE001 - one row's failure (a missing artifact) must not lose the run
        errors.append({**asdict(spec), "error": f"{type(e).__name__}: {e}"})
        log(f"{head} FAILED {spec}: {type(e).__name__}: {e}")
        return
    rows.append(row)
    points.append(point)
    floor_txt = (f" | floor {row['floor_marginal_us']} us, x{row['ratio_to_floor']}" if "floor_marginal_us" in row
                 else "")
    if kw.get("peers"):
        from .peers import row_text

        floor_txt += row_text(row, [p.name for p in kw["peers"]])
    log(f"{head} {spec.geometry:>5} {spec.kv_dtype[:5]:<5} q{spec.qlen} B{spec.batch:<4} sh{spec.shared_blocks:<2} "
        f"S{row['num_splits']:<2} C{row['ctas_per_sm']}{'U' if row.get('kernel') == 'union' else ' '} step {row['one_layer_us']:8.2f} us | per layer "
        f"{row['marginal_us']:8.2f} us {row['marginal_pct_of_copy']:5.1f}% of copy{floor_txt}")


def run_grid(geometries=GRID_GEOMETRIES, batches=GRID_BATCHES, qlens=GRID_QLENS, q_dtype="bfloat16",
             kv_dtypes=GRID_KV_DTYPES, shared_points=SHARED_POINTS, floor_batches=FLOOR_BATCHES,
             iters: int = 50, num_layers: int = NUM_LAYERS, in_graph: bool = False, host: bool = True,
             log=print, peers: list | None = None) -> dict[str, Any]:
    """Time every row of `grid_rows(...)` plus the ceilings and the host side; the result dict.

    A row that fails (e.g. no NVFP4 artifact in a cache warmed for fp8 only) is logged and
    listed in result["errors"]; the other rows still run. On SIGTERM (a timeout) the grid stops
    after the rows done, skips the host figures and says so in result["incomplete"].
    peers: `peers.make_peers(...)`: each row also times them (`peers.measure_peers`); result["peers"]
    says which ran, result["peer_summary"] their ratios; a row whose outputs disagree is an error.
    """
    specs = grid_rows(geometries, batches, qlens, kv_dtypes, shared_points, floor_batches)
    t_start = time.perf_counter()
    copy_bw, read_bw, floor = ceilings()
    log(f"copy bandwidth: {copy_bw / 1e12:.3f} TB/s (read + write); 2 GiB read: {read_bw / 1e12:.3f} TB/s "
        f"= {100 * read_bw / copy_bw:.1f}% of copy; {len(specs)} rows")
    log(f"one tiny kernel: {floor['graph_us']} us as a graph, {floor['in_graph_us']} us inside a graph")
    rows, points, errors = [], [], []
    indices: dict[tuple, list] = {}
    if peers:
        from .peers import describe

        for name, info in describe(peers).items():
            log(f"peer {name}: " + (f"{info['version']}" if info["available"] else f"not run: {info['reason']}"))
    stopped = False
    with stop_on_sigterm():
        try:
            for n, spec in enumerate(specs, 1):
                _one_row(n, spec, specs, copy_bw, indices, rows, points, errors, t_start, log, q_dtype=q_dtype,
                         iters=iters, num_layers=num_layers, in_graph=in_graph, **({"peers": peers} if peers else {}))
        except Stopped:
            stopped = True
            log(f"SIGTERM: stopped after {len(rows)} of {len(specs)} rows")
    add_speedups(rows)
    result: dict[str, Any] = {
        "environment": environment(), "copy_tbps": round(copy_bw / 1e12, 4),
        "read_2g": {"tbps": round(read_bw / 1e12, 3), "pct_of_copy": round(100 * read_bw / copy_bw, 1)},
        "tiny_kernel": floor,
        "grid": {"geometries": list(geometries), "batches": list(batches), "qlens": list(qlens),
                 "kv_dtypes": list(kv_dtypes), "q_dtype": q_dtype, "shared_blocks": SHARED_BLOCKS,
                 "shared_points": [list(p) for p in shared_points], "floor_batches": list(floor_batches),
                 "layers": num_layers, "iters": iters},
        "per_layer": rows, "points": [asdict(p) for p in points], "errors": errors,
    }
    if peers:
        from .peers import describe, disagreements, summarize

        names = [p.name for p in peers]
        result["peers"], result["peer_summary"] = describe(peers), summarize(rows, names)
        errors += [{"geometry": r["geometry"], "batch": r["batch"], "qlen": r["qlen"], "kv_dtype": r["kv_dtype"],
                    "error": f"outputs disagree: {', '.join(bad)}"} for r in rows if (bad := disagreements(r, names))]
    if stopped:
        result["incomplete"] = {"rows_done": len(rows), "rows": len(specs)}
    elif host:
        for name, kw in (("host", {}), ("host_b256", dict(calls=100, wall_calls=500, batch=256, nvfp4=False))):
            try:
                result[name] = host_overheads(**kw)
            except Exception as e:  # noqa: BLE001 - the grid's rows must still be written
                errors.append({"host": name, "error": f"{type(e).__name__}: {e}"})
                log(f"FAILED {name}: {type(e).__name__}: {e}")
                continue
            log(f"{name}: {result[name]}")
    result["gpu_wall_s"] = round(time.perf_counter() - t_start, 1)
    return result


def _free_stamp(out: Path, date: str) -> str:
    """The result's name stamp: the minute (2026-12-05T1618), with seconds when a file of that minute
    exists (a short run after another: a result is never overwritten), then -2, -3, ..."""
    for stamp in (date[:16].replace(":", ""), date[:19].replace(":", "")):
        if not (out / f"bench-{stamp}.json").exists():
            return stamp
    n = 2
    while (out / f"bench-{stamp}-{n}.json").exists():
        n += 1
    return f"{stamp}-{n}"


def main(out_dir: str, baseline: str | None = "auto", **kw) -> dict[str, Any]:
    """Run the grid, write bench-<date>T<time>.json/.png into out_dir and compare with a baseline.

    baseline: a result JSON, "auto" (the newest result already in out_dir from a GPU of this name) or
    None/"none".
    Points and per-layer rows slower than the baseline by more than 5% are listed in
    result["regressions"]; a baseline that cannot be compared is result["baseline_error"] (the
    result file is written before the comparison, and again with it).
    """
    from .report import device_of, latest_result, plot, regressions, result_problem

    out = Path(out_dir)
    if baseline == "auto":
        import torch

        baseline = latest_result(out, torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    elif baseline in (None, "none"):
        baseline = None
    result = run_grid(**kw)
    out.mkdir(parents=True, exist_ok=True)  # only now: a run that fails leaves no empty folder
    stamp = _free_stamp(out, result["environment"]["date"])
    path = out / f"bench-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))  # first: nothing the comparison meets may lose the run
    if baseline:
        result["baseline"] = str(baseline)
        try:
            base = json.loads(Path(baseline).read_text())
            problem = result_problem(base)
            if problem:
                raise ValueError(f"not a bench result ({problem})")
            here, there = device_of(result), device_of(base)
            if here and there and here != there:  # an H100's timings say nothing against an H200's
                print(f"NOTE: the baseline {baseline} ran on {there}, this run on {here}: no regression check")
                result["regressions"] = []
            else:
                result["regressions"] = regressions(result, base)
        except (OSError, ValueError, TypeError, KeyError, ZeroDivisionError) as e:
            result["baseline_error"] = f"{type(e).__name__}: {e}"
            print(f"FAILED the comparison with the baseline {baseline}: {result['baseline_error']}; "
                  f"the result is in {path}")
        for line in result.get("regressions", []):
            print("REGRESSION", line)
    if result.get("peers"):
        from .peers import format_summary

        print(format_summary(result))
    path.write_text(json.dumps(result, indent=1))  # with the comparison
    try:
        plot(result, out / f"bench-{stamp}.png")
    except ImportError:
        print("matplotlib missing: no plot written")
    return result
