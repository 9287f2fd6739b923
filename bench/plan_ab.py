"""Plan A/B beside FlashInfer: every plan today's builds serve, timed where FlashInfer wins.

At the points where msa-jit's planner loses to FlashInfer's SM90 decode: does another PLAN of today's
kernels close the gap (before any new kernel is designed)?

    python bench/plan_ab.py --json plan_ab.json [--deadline-s 540]        # on the GPU host
    python bench/plan_ab.py --list [--cache-dir .artifacts]               # no GPU: the plans and their artifacts
    python bench/plan_ab.py --points 64/4:B4:q1,16/1:B4:q8 ...            # these points instead
    python bench/plan_ab.py --kv-dtype nvfp4 --below 1.3 ...              # the NVFP4 cache's plans

Points: by default every per-layer row of `--from` (bench/results/h100.json) of the `--kv-dtype`
cache (fp8 by default; bf16 query) whose speed-up over FlashInfer is below `--below`, worst first,
so a deadline keeps the points that matter most; or `--points` (geometry:B<batch>:q<qlen>[:sh<shared
blocks>]). FlashInfer reads no NVFP4 cache: an NVFP4 row's figure is FlashInfer's fp8 time over
msa-jit's NVFP4 time (speedup_vs_flashinfer_fp8), so `--below 1.0` takes the NVFP4 rows slower than
FlashInfer's fp8 and `--below 1.3` those short of the NVFP4 target (1.3x FlashInfer's fp8).

Plans of a point, each a planner pinned to one LaunchChoice of the `--kv-dtype` cache
(SparseDecodePlanner(launches=...)), named kernel/C<ctas per SM>/S<splits>/<merge>:
- the planner's own choice ("planner"), timed first and again last (their spread is the run's noise
  at that point; its figure is their mean);
- the token kernel at every split count of `--splits` (1, 2, 4, 8, 16) x every occupancy it is built
  for (2, 3 CTAs per SM) merged by the merge kernel ("kernel"; at S1 nothing merges: the plain build),
  and its cluster build (2 CTAs per SM: "cluster"; the fp8 cache's is the dims-split build; at S1
  the cluster build's plain launch, which no rule picks);
- fp8 only (it reads no NVFP4 cache): the union kernel (one CTA per tile of a request's tokens; the
  planner gives it draft steps of one full wave) at both of its occupancies (1, 2) x every split
  count, qlen 1 included.
The split count is a launch argument, not a build: every plan runs on the builds
bench/warm_device_cache.py already warms (no extra artifact; `--list` names each plan's cache key and
whether the cache holds it).

Each plan is timed as `msa-jit bench` times a row (msa_jit/tools/bench: the same random steps per
layer, seeds 0..L-1; one prologue then L layers in one CUDA graph, L2 flushed before each replay;
per-layer figure (t(L) - t(1)) / (L - 1)), after its output was checked: the output poisoned with
NaN, one eager call, every row written and the first `--ref-requests` requests within 1e-2 relative
L2 of the float64 reference (msa_jit.reference). FlashInfer (peers.FlashInferPeer) is timed the same
way on the same steps (fp8 only: at an NVFP4 point it is skipped and every speed-up over it is None;
the best plan and its gain over the planner still come out). The JSON (`--json`, rewritten after
every point) holds per point FlashInfer's figure, each plan's, their speed-ups and the best plan;
the table at the end says where a plan closes the gap. `--deadline-s` stops before a plan that
would not finish in time (a 600 s device call then still returns what was done).

The JSON: environment (device, torch, cuda, python, cutlass_dsl, msa_jit, flashinfer, date, command),
settings (kv_dtype among them), peers, summary (geomeans of the planner's and the best plan's speed-up
over FlashInfer, the points a plan closes, the best plan per point), `incomplete` when the deadline or
SIGTERM cut the run, and per point: point, geometry, batch, qlen, shared_blocks, q_dtype, kv_dtype,
source (the source result's figures; at an NVFP4 point FlashInfer's are its fp8 cache's, with
speedup_vs_fp8 beside), flashinfer (marginal_us, one_layer_us, rel_l2 to msa-jit's output, ...; or
skipped: why), plans (name, requested and ran launches, all_rows_written, ref_rel_l2, one_layer_us,
marginal_us, speedup_vs_flashinfer, gain_vs_planner; error where it failed; the planner's also runs
and spread_pct), best, planner_speedup_vs_flashinfer, complete.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

T0 = time.monotonic()  # before torch is imported: --deadline-s counts from here, as the step's timeout does
ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # the checkout's msa_jit, also without PYTHONPATH
    sys.path.insert(0, str(ROOT))

from msa_jit.geometry import (DEFAULT_PAGE_SIZE, DEFAULT_TOPK_BLOCKS, KV_DTYPE_SHORT, SparseDecodeConfig,  # noqa: E402
                              check_config, cluster_merge_problems, union_problems)
from msa_jit.cli.common import parse_kv_dtype  # noqa: E402
from msa_jit.jit import registry  # noqa: E402
from msa_jit.plan import LaunchChoice  # noqa: E402
from msa_jit.tools.bench.grid import FP8_KV, GEOMETRIES, NUM_LAYERS, NVFP4_KV  # noqa: E402
from msa_jit.tools.bench.measure import Stopped, stop_on_sigterm  # noqa: E402
from msa_jit.tools.bench.peers import geomean  # noqa: E402

DEFAULT_FROM = ROOT / "bench" / "results" / "h100.json"
SPLITS = (1, 2, 4, 8, 16)
KERNELS = ("token", "union")
Q_DTYPE = "bfloat16"  # FlashInfer's SM90 route takes a bf16 query only
# a source row's speed-up over FlashInfer: an NVFP4 row has FlashInfer's fp8 time over its own
# (grid.add_speedups), FlashInfer reading no NVFP4 cache
SOURCE_SPEEDUP = {FP8_KV: "speedup_vs_flashinfer", NVFP4_KV: "speedup_vs_flashinfer_fp8"}
ARCH, NUM_SMS = "sm_90a", 132  # what --list plans for (an H100 / H200); the GPU run asks its device
ITERS = 20  # the H100 comparison's `--iters`
REF_TOL = 1e-2  # relative L2 to the float64 reference (bf16 out; peers.AGREE_TOL)
REF_REQUESTS = 4
PLANNER = "planner"
FIRST_PLAN_S = 2.0  # what a plan is assumed to cost before one was timed (the deadline's margin)


# ----------------------------------------------------------------------------- points and plans
@dataclass(frozen=True)
class Point:
    geometry: str
    batch: int
    qlen: int
    shared_blocks: int = 0

    @property
    def label(self) -> str:
        return f"{self.geometry}:B{self.batch}:q{self.qlen}" + (f":sh{self.shared_blocks}" if self.shared_blocks else "")

    @classmethod
    def parse(cls, text: str) -> "Point":
        """'64/4:B4:q1' or '64/4:B64:q4:sh12' (the letters in either case)."""
        geometry, *parts = text.strip().split(":")
        fields: dict[str, int] = {}
        for part in parts:
            tag = "sh" if part[:2].lower() == "sh" else part[:1].lower()
            value = part[len(tag):]
            if tag not in ("b", "q", "sh") or tag in fields or not value.isdigit():
                fields = {}
                break
            fields[tag] = int(value)
        if geometry not in GEOMETRIES or not {"b", "q"} <= set(fields):
            raise ValueError(f"point {text!r}: expected <{'|'.join(GEOMETRIES)}>:B<batch>:q<qlen>[:sh<shared>], "
                             "e.g. 64/4:B4:q1")
        point = cls(geometry, fields["b"], fields["q"], fields.get("sh", 0))
        if point.batch < 1 or not 1 <= point.qlen <= 32 or point.shared_blocks > DEFAULT_TOPK_BLOCKS:
            raise ValueError(f"point {text!r}: batch >= 1, qlen 1..32, shared blocks 0..{DEFAULT_TOPK_BLOCKS}")
        return point


def source_rows(result: dict[str, Any], kv_dtype: str = FP8_KV) -> list[dict[str, Any]]:
    """The per-layer rows of a bench result this script can rerun: `kv_dtype` cache, bf16 query."""
    return [r for r in result.get("per_layer", []) if r.get("kv_dtype", FP8_KV) == kv_dtype
            and r.get("q_dtype", Q_DTYPE) == Q_DTYPE and r.get("geometry") in GEOMETRIES]


def losing_rows(result: dict[str, Any], below: float = 1.0, kv_dtype: str = FP8_KV) -> list[dict[str, Any]]:
    """The per-layer rows of a `msa-jit bench --compare flashinfer` result of the `kv_dtype` cache (bf16
    query) whose speed-up over FlashInfer (its fp8 cache's, for NVFP4: SOURCE_SPEEDUP) is below
    `below`, worst first."""
    key = SOURCE_SPEEDUP[kv_dtype]
    rows = [r for r in source_rows(result, kv_dtype) if r.get(key) is not None and r[key] < below]
    return sorted(rows, key=lambda r: r[key])


def point_of(row: dict[str, Any]) -> Point:
    return Point(row["geometry"], int(row["batch"]), int(row["qlen"]), int(row.get("shared_blocks", 0)))


def source_figures(row: dict[str, Any] | None, fp8_row: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """What the source result measured at a point (msa-jit's planner and FlashInfer, per layer). An
    NVFP4 row's FlashInfer figures are its fp8 cache's: the time from the point's fp8 row `fp8_row`,
    the speed-up from the row's speedup_vs_flashinfer_fp8; its speed-up over msa-jit's fp8 beside."""
    if row is None:
        return None
    keys = ("marginal_us", "flashinfer_marginal_us", "speedup_vs_flashinfer", "kernel", "ctas_per_sm",
            "num_splits", "split_merge")
    out = {k: row.get(k) for k in keys}
    if row.get("kv_dtype") == NVFP4_KV:
        out["flashinfer_marginal_us"] = (fp8_row or {}).get("flashinfer_marginal_us")
        out["speedup_vs_flashinfer"] = row.get(SOURCE_SPEEDUP[NVFP4_KV])
        out["speedup_vs_fp8"] = row.get("speedup_vs_fp8")
    return out


def plan_name(c: LaunchChoice | None) -> str:
    return PLANNER if c is None else f"{c.kernel}/C{c.ctas_per_sm}/S{c.num_splits}/{c.split_merge}"


def config_of(point: Point, c: LaunchChoice, arch: str, kv_dtype: str = FP8_KV) -> SparseDecodeConfig:
    """The build a plan runs (the point's geometry, bf16 query, `kv_dtype` cache)."""
    hq, hkv = GEOMETRIES[point.geometry]
    return SparseDecodeConfig(hq, hkv, page_size=DEFAULT_PAGE_SIZE, topk_blocks=DEFAULT_TOPK_BLOCKS, q_dtype=Q_DTYPE,
                              kv_dtype=kv_dtype, arch=arch, ctas_per_sm=c.ctas_per_sm, kernel=c.kernel,
                              split_merge=c.split_merge)


def enumerate_plans(point: Point, arch: str = ARCH, splits: Iterable[int] = SPLITS,
                    kernels: Iterable[str] = KERNELS, kv_dtype: str = FP8_KV) -> list[LaunchChoice]:
    """Every pinned launch of the `kv_dtype` cache the existing builds serve at `point` on `arch` (see
    the module docstring), in timing order; each passes check_config and has at most topk splits."""
    hq, hkv = GEOMETRIES[point.geometry]
    splits = [s for s in splits if 1 <= s <= DEFAULT_TOPK_BLOCKS]
    out: list[LaunchChoice] = []
    if "token" in kernels:
        for s in splits:
            for c in registry.supported_ctas_per_sm(arch):
                out.append(LaunchChoice("token", c, s, "kernel"))
                if not cluster_merge_problems(kernel="token", ctas_per_sm=c, arch=arch):
                    out.append(LaunchChoice("token", c, s, "cluster"))
    if "union" in kernels and not union_problems(num_q_heads=hq, num_kv_heads=hkv, page_size=DEFAULT_PAGE_SIZE,
                                                  kv_dtype=kv_dtype, arch=arch):
        out += [LaunchChoice("union", c, s, "kernel") for c in registry.supported_ctas_per_sm(arch, "union")
                for s in splits]
    return [c for c in out if check_config(config_of(point, c, arch, kv_dtype)) is None]


def planner_choice(point: Point, arch: str = ARCH, num_sms: int = NUM_SMS, kv_dtype: str = FP8_KV) -> LaunchChoice:
    """The unpinned planner's launch of the `kv_dtype` cache at `point` for `num_sms` SMs of `arch` (a
    CPU plan: no GPU)."""
    import torch

    from msa_jit import SparseDecodePlanner

    hq, hkv = GEOMETRIES[point.geometry]
    blocks = 16384 // DEFAULT_PAGE_SIZE  # the bench's 16K-token context (steps.CTX_LEN)
    bt = torch.zeros(point.batch, blocks, dtype=torch.int32)
    sl = torch.full((point.batch,), 16384, dtype=torch.int32)
    plan = SparseDecodePlanner(num_sms=num_sms, arch=arch).prepare(
        bt, sl, None, point.qlen, num_q_heads=hq, num_kv_heads=hkv, page_size=DEFAULT_PAGE_SIZE,
        topk_blocks=DEFAULT_TOPK_BLOCKS)
    return plan.launch(kv_dtype)


# ----------------------------------------------------------------------------- --list
def _cached(config: SparseDecodeConfig, cache: Any) -> tuple[str, bool]:
    """(cache key, whether `cache` holds an intact entry of it)."""
    from msa_jit.jit import compiler

    key = compiler.cache_key(config)
    return key, cache.lookup(key) is not None


def list_plans(points: list[Point], sources: dict[Point, dict], *, arch: str, num_sms: int, splits, kernels,
               cache_dir: str | None, kv_dtype: str = FP8_KV, log: Callable[[str], object] = print) -> int:
    """Print each point's plans and the artifact each needs; 1 when the cache misses one."""
    from msa_jit.jit.cache import open_cache

    cache = open_cache(cache_dir, create=False)
    status: dict[SparseDecodeConfig, tuple[str, bool]] = {}
    total = 0
    fi = "flashinfer" if kv_dtype == FP8_KV else "flashinfer fp8"  # FlashInfer reads no NVFP4 cache
    for p in points:
        own = planner_choice(p, arch, num_sms, kv_dtype)
        src = sources.get(p)
        hkv = GEOMETRIES[p.geometry][1]
        log(f"{p.label}  T*Hkv={p.batch * p.qlen * hkv}" + (f"  source: msa-jit {src['marginal_us']} us, {fi} "
            f"{src['flashinfer_marginal_us']} us, x{src['speedup_vs_flashinfer']}" if src else ""))
        for c in [None, *[c for c in enumerate_plans(p, arch, splits, kernels, kv_dtype) if c != own]]:
            cfg = config_of(p, c or own, arch, kv_dtype)
            if cfg not in status:
                status[cfg] = _cached(cfg, cache)
            key, ok = status[cfg]
            name = f"{PLANNER} = {plan_name(own)}" if c is None else plan_name(c)
            log(f"  {name:<32} {registry.kernel_family(cfg):<10} key {key[:12]}  {'cached' if ok else 'MISSING'}")
            total += 1
    missing = [cfg for cfg, (_, ok) in status.items() if not ok]
    log(f"{total} plans at {len(points)} points need {len(status)} artifacts: "
        + (f"all in {cache.root}" if not missing else f"{len(missing)} missing from {cache.root} "
           "(python bench/warm_device_cache.py --cache-dir DIR builds every one)"))
    for cfg in missing:
        log(f"  missing: {cfg.describe()} for {cfg.arch}")
    return 1 if missing else 0


# ----------------------------------------------------------------------------- the run
class Runner(Protocol):
    """What run_points needs from the GPU (GpuRunner; tests give a fake)."""

    arch: str  # the device's ("sm_90a"): which plans exist
    kv_dtype: str  # the cache every step and plan uses
    def peers(self) -> dict[str, Any]: ...
    def setup(self, point: Point) -> Any: ...
    def time_plan(self, ctx: Any, launch: LaunchChoice | None) -> dict[str, Any]: ...
    def flashinfer(self, ctx: Any, planner_row: dict[str, Any]) -> dict[str, Any]: ...
    def teardown(self, ctx: Any) -> None: ...


class Clock:
    """The deadline: `fits()` says whether one more plan (the slowest so far) ends before it."""

    def __init__(self, deadline_s: float | None, now: Callable[[], float] = time.monotonic, start: float | None = None):
        self.now, self.deadline_s = now, deadline_s
        self.start = now() if start is None else start
        self.slowest = FIRST_PLAN_S

    def elapsed(self) -> float:
        return self.now() - self.start

    def fits(self) -> bool:
        return self.deadline_s is None or self.elapsed() + self.slowest <= self.deadline_s

    def timed(self, fn: Callable[[], Any]) -> Any:
        t0 = self.now()
        try:
            return fn()
        finally:
            self.slowest = max(self.slowest, self.now() - t0)


def _attempt(clock: Clock, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return clock.timed(fn)
    except Exception as e:  # noqa: BLE001 - one plan's failure (a missing artifact, a bad pin) is a result
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b and a > 0 and b > 0 else None


def _planner_entry(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The planner's entry: its first run's fields, the mean of the runs that timed, their spread."""
    entry = {"name": PLANNER, **runs[0], "runs": [r.get("marginal_us") for r in runs]}
    timed = [r for r in runs if r.get("marginal_us") is not None]
    if timed:
        entry["marginal_us"] = round(statistics.fmean(r["marginal_us"] for r in timed), 2)
        entry["one_layer_us"] = round(statistics.fmean(r["one_layer_us"] for r in timed), 2)
        entry.pop("error", None)
    if len(timed) == 2:
        a, b = (r["marginal_us"] for r in timed)
        entry["spread_pct"] = round(100 * abs(a - b) / ((a + b) / 2), 2)
    return entry


def finish_point(entry: dict[str, Any]) -> dict[str, Any]:
    """Speed-ups of every plan (FlashInfer's per-layer time / the plan's; the planner's / the plan's)
    and the best plan among those that passed the check and timed."""
    fi = entry.get("flashinfer", {}).get("marginal_us")
    planner = next((p for p in entry["plans"] if p["name"] == PLANNER), {})
    for p in entry["plans"]:
        p["speedup_vs_flashinfer"] = _ratio(fi, p.get("marginal_us"))
        p["gain_vs_planner"] = _ratio(planner.get("marginal_us"), p.get("marginal_us"))
    timed = [p for p in entry["plans"] if p.get("marginal_us") is not None and "error" not in p]
    best = min(timed, key=lambda p: p["marginal_us"], default=None)
    entry["best"] = None if best is None else {k: best.get(k) for k in (
        "name", "ran", "note", "marginal_us", "speedup_vs_flashinfer", "gain_vs_planner")}
    entry["planner_speedup_vs_flashinfer"] = planner.get("speedup_vs_flashinfer")
    return entry


def _note_fallback(row: dict[str, Any]) -> dict[str, Any]:
    """A pinned cluster the GPU cannot hold ran on the merge kernel (SparseDecodePlan.resolve_kernel): say so."""
    if row.get("ran") and row.get("requested") and row["ran"] != row["requested"]:
        row["note"] = f"ran as {plan_name(LaunchChoice(**row['ran']))}"
    return row


def measure_point(point: Point, runner: Runner, clock: Clock, plans: list[LaunchChoice],
                  source: dict | None, log: Callable[[str], object] = print) -> dict[str, Any]:
    """One point of the runner's cache: the planner, FlashInfer, every plan but the planner's own, the
    planner again. On SIGTERM the plans done are kept and the entry says `interrupted`."""
    entry: dict[str, Any] = {"point": point.label, **asdict(point), "q_dtype": Q_DTYPE, "kv_dtype": runner.kv_dtype,
                             "source": source, "flashinfer": {}, "plans": [], "complete": False}
    runs: list[dict[str, Any]] = []
    ctx = clock.timed(lambda: runner.setup(point))
    try:
        runs.append(_attempt(clock, lambda: runner.time_plan(ctx, None)))
        own = runs[0].get("ran")
        log(f"{point.label}: planner {plan_name(LaunchChoice(**own)) if own else '?'} "
            f"{runs[0].get('marginal_us', runs[0].get('error'))}")
        if clock.fits():
            entry["flashinfer"] = _attempt(clock, lambda: runner.flashinfer(ctx, runs[0]))
        fi = entry["flashinfer"].get("marginal_us")
        log(f"  flashinfer {fi if fi is not None else entry['flashinfer']}")
        for c in [c for c in plans if own is None or asdict(c) != own]:
            if not clock.fits():
                break
            row = _note_fallback({"name": plan_name(c), "requested": asdict(c),
                                  **_attempt(clock, lambda c=c: runner.time_plan(ctx, c))})
            entry["plans"].append(row)
            us = row.get("marginal_us")
            # without FlashInfer's figure (an NVFP4 cache), the speed-up over the planner's first run
            vs = f"x{_ratio(fi, us)}" if fi is not None else f"x{_ratio(runs[0].get('marginal_us'), us)} of the planner"
            log(f"  {row['name']:<22} " + (f"{us:8.2f} us {vs} {row.get('note', '')}" if us is not None
                                           else f"FAILED {row.get('error')}"))
        else:
            if clock.fits():
                runs.append(_attempt(clock, lambda: runner.time_plan(ctx, None)))
                entry["complete"] = True
    except Stopped:
        entry["interrupted"] = True
    finally:
        runner.teardown(ctx)
    if runs:
        entry["plans"].insert(0, _planner_entry(runs))
    return finish_point(entry)


def summarize(entries: list[dict[str, Any]]) -> dict[str, Any]:
    with_fi = [e for e in entries if e.get("best") and e["planner_speedup_vs_flashinfer"]]
    return {
        "points_done": len(entries), "points_complete": sum(e["complete"] for e in entries),
        "geomean_planner_speedup_vs_flashinfer": geomean([e["planner_speedup_vs_flashinfer"] for e in with_fi]),
        "geomean_best_speedup_vs_flashinfer": geomean([e["best"]["speedup_vs_flashinfer"] for e in with_fi]),
        "geomean_best_gain_vs_planner": geomean([e["best"]["gain_vs_planner"] for e in entries if e.get("best")]),
        # points where some plan of today's builds is at least FlashInfer's speed
        "closed": [e["point"] for e in with_fi if (e["best"]["speedup_vs_flashinfer"] or 0) >= 1.0],
        "best_plans": {e["point"]: e["best"]["name"] for e in entries if e.get("best")},
    }


def _write(path: str | None, result: dict[str, Any]) -> None:
    if path:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)


def run_points(points: list[Point], runner: Runner, *, plans_of: Callable[[Point], list[LaunchChoice]],
               sources: dict[Point, dict], clock: Clock, header: dict[str, Any], json_path: str | None,
               log: Callable[[str], object] = print) -> dict[str, Any]:
    """Every point of the runner's cache in turn until the deadline; the result (also written to
    json_path after each point)."""
    result: dict[str, Any] = {**header, "peers": runner.peers(), "points": [], "summary": {}}
    stopped = None
    for n, point in enumerate(points):
        if not clock.fits():
            stopped = f"deadline: {len(points) - n} of {len(points)} points not started"
            break
        try:
            entry = measure_point(point, runner, clock, plans_of(point), sources.get(point), log)
        except Stopped:
            stopped = f"SIGTERM while making the steps of {point.label}"
            break
        except Exception as e:  # noqa: BLE001 - the point's steps could not be made: the next one still runs
            entry = {"point": point.label, **asdict(point), "kv_dtype": runner.kv_dtype,
                     "error": f"{type(e).__name__}: {e}"[:500], "plans": [], "complete": False}
        result["points"].append(entry)
        result["summary"] = summarize([e for e in result["points"] if "error" not in e])
        result["wall_s"] = round(clock.elapsed(), 1)
        _write(json_path, result)
        if entry.get("interrupted"):
            stopped = f"SIGTERM during {point.label}"
            break
    if stopped or any(not e["complete"] for e in result["points"]):
        result["incomplete"] = stopped or "deadline inside a point"
    result["summary"] = summarize([e for e in result["points"] if "error" not in e])
    result["wall_s"] = round(clock.elapsed(), 1)
    _write(json_path, result)
    return result


def _x(v: float | None) -> str:
    return "-" if v is None else f"x{v}"


def table(result: dict[str, Any]) -> str:
    """One line per point: FlashInfer, the planner, the best plan, and whether the gap closes."""
    lines = [f"{'point':<18} {'FI us':>7} | {'planner':<22} {'us':>7} {'xFI':>6} {'spread':>6} | "
             f"{'best plan':<22} {'us':>7} {'xFI':>6} {'gain':>6}"]
    for e in result["points"]:
        if "error" in e:
            lines.append(f"{e['point']:<18} FAILED {e['error']}")
            continue
        own = e["plans"][0] if e["plans"] else {}
        best = e.get("best") or {}
        ran = own.get("ran")
        lines.append(
            f"{e['point']:<18} {e.get('flashinfer', {}).get('marginal_us') or '-':>7} | "
            f"{plan_name(LaunchChoice(**ran)) if ran else '?':<22} {own.get('marginal_us') or '-':>7} "
            f"{own.get('speedup_vs_flashinfer') or '-':>6} {own.get('spread_pct', '-'):>6} | "
            f"{best.get('name', '-'):<22} {best.get('marginal_us') or '-':>7} {best.get('speedup_vs_flashinfer') or '-':>6} "
            f"{best.get('gain_vs_planner') or '-':>6}" + ("" if e["complete"] else "  (partial)"))
    s = result.get("summary", {})
    lines.append(f"geomean vs FlashInfer: planner {_x(s.get('geomean_planner_speedup_vs_flashinfer'))}, best plan "
                 f"{_x(s.get('geomean_best_speedup_vs_flashinfer'))}; best over planner "
                 f"{_x(s.get('geomean_best_gain_vs_planner'))}; "
                 f"closed at {len(s.get('closed', []))} of {s.get('points_done', 0)} points")
    skipped = {e["flashinfer"]["skipped"] for e in result["points"] if (e.get("flashinfer") or {}).get("skipped")}
    lines += [f"FlashInfer skipped: {why}" for why in sorted(skipped)]
    if result.get("incomplete"):
        lines.append(f"INCOMPLETE: {result['incomplete']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- on the GPU
@dataclass
class StepContext:
    """One point's steps (L layers) and what every plan of it shares."""

    point: Point
    hq: int
    hkv: int
    steps: list
    args: tuple
    kw: dict
    ref: Any  # float64 reference output of the first `ref_rows` rows of steps[0]
    ref_rows: int
    planner_plan: Any = None  # the unpinned planner's plan (FlashInfer's check runs it)


class GpuRunner:
    """Times plans and FlashInfer as `msa-jit bench` times a row (msa_jit/tools/bench)."""

    device = "cuda"  # where the steps live (a test checks the plumbing on CPU tensors, timing replaced)
    kv_dtype = FP8_KV  # the cache every step and plan uses

    def __init__(self, *, layers: int, iters: int, ref_requests: int, flashinfer: bool = True,
                 kv_dtype: str = FP8_KV):
        import torch

        from msa_jit.geometry import device_arch
        from msa_jit.tools.bench.peers import FlashInferPeer

        if not torch.cuda.is_available():
            raise SystemExit("plan_ab: timing needs a CUDA GPU (--list runs without one)")
        if layers < 2:
            raise SystemExit(f"--layers: the per-layer figure needs at least 2, got {layers}")
        self.layers, self.iters, self.ref_requests, self.kv_dtype = layers, iters, ref_requests, kv_dtype
        self.arch = device_arch(torch.device("cuda", torch.cuda.current_device()))
        # FlashInfer reads no NVFP4 cache: not even looked for then (flashinfer() says why it is skipped)
        self.fi = FlashInferPeer() if flashinfer and kv_dtype == FP8_KV else None

    def peers(self) -> dict[str, Any]:
        from msa_jit.tools.bench.peers import describe

        return describe([self.fi]) if self.fi else {}

    def setup(self, point: Point) -> StepContext:
        from msa_jit.geometry import HEAD_DIM
        from msa_jit.reference import sparse_decode_reference
        from msa_jit.tools.bench.steps import make_indices, make_step, prepare_args

        hq, hkv = GEOMETRIES[point.geometry]
        # the bench's steps: layer i drawn from seed i (the same bytes as the source result's row)
        steps = [make_step(hq, hkv, point.batch, point.qlen, Q_DTYPE, shared_blocks=point.shared_blocks, seed=i,
                           kv_dtype=self.kv_dtype, device=self.device,
                           indices=make_indices(point.batch, hkv, point.qlen, shared_blocks=point.shared_blocks, seed=i))
                 for i in range(self.layers)]
        args, kw = prepare_args(steps[0], hq, hkv, point.qlen)
        n = min(point.batch, self.ref_requests) if self.ref_requests > 0 else point.batch
        s, rows = steps[0], n * point.qlen
        ref, _ = sparse_decode_reference(s["query"][:rows], s["kv_cache"], s["topk"][:rows], s["block_table"][:n],
                                         s["seq_lens"][:n], point.qlen, sm_scale=HEAD_DIM ** -0.5,
                                         k_scale=s["k_scale"], v_scale=s["v_scale"])
        return StepContext(point, hq, hkv, steps, args, kw, ref, rows)

    def time_plan(self, ctx: StepContext, launch: LaunchChoice | None) -> dict[str, Any]:
        """One plan: checked on a poisoned output, then timed (one prologue + L layers per graph)."""
        import torch

        from msa_jit import SparseDecodePlanner
        from msa_jit.tools.bench.measure import layer_times
        from msa_jit.tools.bench.peers import rel_l2
        from msa_jit.tools.bench.steps import decode

        planner = SparseDecodePlanner() if launch is None else SparseDecodePlanner(launches={self.kv_dtype: launch})
        step = ctx.steps[0]
        plan = planner.prepare(*ctx.args, **ctx.kw)
        step["out"].fill_(float("nan"))
        decode(step, plan)
        if plan.is_cuda:
            torch.cuda.synchronize()
        # after the first call: a cluster the GPU cannot hold has fallen back to the merge kernel
        row: dict[str, Any] = {"ran": asdict(plan.launch(self.kv_dtype)),
                               "all_rows_written": bool(torch.isfinite(step["out"]).all())}
        err = rel_l2(step["out"][:ctx.ref_rows].double().cpu(), ctx.ref)
        row["ref_rel_l2"] = float(f"{err:.3g}") if math.isfinite(err) else None
        if not row["all_rows_written"] or not err <= REF_TOL:
            row["error"] = (f"wrong output: rel L2 {err:.3g} to the reference" if row["all_rows_written"]
                            else "wrong output: rows left unwritten (NaN)")
            return row
        if launch is None:
            ctx.planner_plan = plan
        t1s, t_all = layer_times(planner, ctx.steps, ctx.hq, ctx.hkv, ctx.point.qlen, decode, self.layers, self.iters)
        t1 = statistics.median(t1s)
        row.update(one_layer_us=round(t1, 2), marginal_us=round((t_all - t1) / (self.layers - 1), 2))
        return row

    def flashinfer(self, ctx: StepContext, planner_row: dict[str, Any]) -> dict[str, Any]:
        """FlashInfer on the same steps, timed and checked as `msa-jit bench --compare flashinfer` does."""
        from msa_jit.tools.bench.peers import measure_peers
        from msa_jit.tools.bench.steps import decode

        if self.kv_dtype != FP8_KV:
            return {"skipped": f"no {self.kv_dtype} cache on FlashInfer's SM90 route (a source row's FlashInfer "
                               "figures are its fp8 cache's)"}
        if self.fi is None:
            return {"skipped": "--no-flashinfer"}
        if ctx.planner_plan is None or "marginal_us" not in planner_row:
            return {"skipped": "the planner's plan did not run: nothing to check FlashInfer's output against"}
        step, plan = ctx.steps[0], ctx.planner_plan
        fields = measure_peers([self.fi], ctx.steps, ctx.hq, ctx.hkv, ctx.point.qlen, Q_DTYPE, self.kv_dtype,
                               lambda: decode(step, plan), planner_row, iters=self.iters, num_layers=self.layers,
                               eager=False, log=print)
        prefix = f"{self.fi.name}_"
        # its speed-ups there are against the planner's first run only: finish_point computes every plan's
        return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in fields.items()
                if not k.endswith(f"speedup_vs_{self.fi.name}")}

    def teardown(self, ctx: StepContext) -> None:
        import torch

        ctx.steps.clear()
        ctx.planner_plan = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def header(settings: dict[str, Any], peers: dict[str, Any]) -> dict[str, Any]:
    """The result's environment (device, versions, date, command) and settings."""
    import msa_jit
    from msa_jit.tools.bench.measure import environment

    env = environment()
    env["msa_jit"] = str(msa_jit.__version__)
    env.update({name: info.get("version") for name, info in peers.items()})  # "flashinfer": "0.7.4"
    return {"environment": env, "settings": settings}


# ----------------------------------------------------------------------------- argv
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", default=str(DEFAULT_FROM),
                    help="a `msa-jit bench --compare flashinfer` result: its losing points, and their figures")
    ap.add_argument("--points", default=None, help="comma list of geometry:B<batch>:q<qlen>[:sh<shared>]")
    ap.add_argument("--kv-dtype", default=KV_DTYPE_SHORT[FP8_KV],
                    help="the cache whose plans are timed: fp8 or nvfp4 (nvfp4: FlashInfer skipped, the "
                         "source's is its fp8)")
    ap.add_argument("--below", type=float, default=1.0,
                    help="a point loses below this speed-up over FlashInfer (nvfp4: over its fp8; 1.3 is the target)")
    ap.add_argument("--max-points", type=int, default=None)
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)))
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--layers", type=int, default=None, help="layers per graph (default: the source's, else 4)")
    ap.add_argument("--iters", type=int, default=None, help="timed replays (default: the source's, else 20)")
    ap.add_argument("--ref-requests", type=int, default=REF_REQUESTS,
                    help="requests checked against the float64 reference (0: all)")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no plan that would end later")
    ap.add_argument("--json", default="plan_ab.json")
    ap.add_argument("--list", action="store_true", help="print the plans and their artifacts (no GPU), exit")
    ap.add_argument("--arch", default=ARCH, help="--list: the arch planned for")
    ap.add_argument("--num-sms", type=int, default=NUM_SMS, help="--list: the SM count planned for")
    ap.add_argument("--cache-dir", default=None, help="--list: the cache to look in (default: MSA_JIT_CACHE_DIR's)")
    a = ap.parse_args(argv)
    a.splits = tuple(int(s) for s in a.splits.split(",") if s.strip())
    a.kernels = tuple(k.strip() for k in a.kernels.split(",") if k.strip())
    try:  # the SparseDecodeConfig / bench JSON name, spelt as every msa-jit command takes it
        a.kv_dtype = parse_kv_dtype(a.kv_dtype)
    except ValueError as e:
        ap.error(str(e))
    if not a.splits or any(not 1 <= s <= DEFAULT_TOPK_BLOCKS for s in a.splits):
        ap.error(f"--splits: counts in 1..{DEFAULT_TOPK_BLOCKS}")
    if not a.kernels or set(a.kernels) - set(KERNELS):
        ap.error(f"--kernels: a comma list of {', '.join(KERNELS)}")
    return a


def select_points(a: argparse.Namespace) -> tuple[list[Point], dict[Point, dict], dict[str, Any]]:
    """(points, the source's figures per point, the source's grid settings)."""
    src = Path(a.source)
    result = json.loads(src.read_text()) if src.is_file() else {}
    by_point = {point_of(r): r for r in source_rows(result, a.kv_dtype)}
    fp8_rows = {point_of(r): r for r in source_rows(result, FP8_KV)}  # FlashInfer's figures of an NVFP4 point
    if a.points:
        points = [Point.parse(t) for t in a.points.split(",") if t.strip()]
    elif result:
        points = [point_of(r) for r in losing_rows(result, a.below, a.kv_dtype)]
    else:
        raise SystemExit(f"--from {a.source}: no such result file; give --points")
    points = list(dict.fromkeys(points))[: a.max_points]
    return (points, {p: source_figures(by_point[p], fp8_rows.get(p)) for p in points if p in by_point},
            result.get("grid", {}))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    points, sources, grid = select_points(a)
    if a.list:
        return list_plans(points, sources, arch=a.arch, num_sms=a.num_sms, splits=a.splits, kernels=a.kernels,
                          cache_dir=a.cache_dir, kv_dtype=a.kv_dtype)
    layers = a.layers or grid.get("layers") or NUM_LAYERS
    iters = a.iters or grid.get("iters") or ITERS
    runner = GpuRunner(layers=layers, iters=iters, ref_requests=a.ref_requests, flashinfer=not a.no_flashinfer,
                       kv_dtype=a.kv_dtype)
    clock = Clock(a.deadline_s, start=T0)
    with stop_on_sigterm():
        settings = {"source": a.source if not a.points else None, "points_given": a.points, "kv_dtype": a.kv_dtype,
                    "below": a.below if not a.points else None, "layers": layers,
                    "iters": iters, "splits": list(a.splits), "kernels": list(a.kernels),
                    "ref_requests": a.ref_requests, "ref_tol": REF_TOL, "deadline_s": a.deadline_s}
        result = run_points(points, runner,
                            plans_of=lambda p: enumerate_plans(p, runner.arch, a.splits, a.kernels, a.kv_dtype),
                            sources=sources, clock=clock, header=header(settings, runner.peers()), json_path=a.json)
    print(table(result))
    print(f"wrote {a.json}" if a.json else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
