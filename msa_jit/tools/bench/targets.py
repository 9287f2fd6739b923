"""The latency and NVFP4 targets, checked on a bench result file (no GPU).

`check_targets(result, baseline)` gives one dict per target: group (latency / NVFP4), target,
goal, measured, status; `format_targets` prints them as a markdown table (`msa-jit bench --summary RESULT`).
Per-layer figures (`per_layer` rows: one more layer in an engine's graph) unless a target says
otherwise. Status: "met"; "met at floor" (a small-batch target below the floor probe's
per-layer figure, and ours within FLOOR_RATIO of that floor: the latency targets' acceptance); "NOT MET";
"no data" (the row, the baseline or the host figures are missing, or the baseline does not
compare: another GPU, or an opt-in build the run did not have); "reported" (no goal); "met, not
counted" (met, but the targets' acceptance does not count this file: not an H200, or a kernel
flag off its default, e.g. the opt-in union kernel, so not the op as shipped; the measured
column says which).
"""

from __future__ import annotations

from typing import Any, Iterable

from .report import (REGRESSION_SLACK, compare_with_baseline, device_of, kv_dtype_of, layer_key, opt_in_flags, point_key, run_flags, short_kv, t_hkv)
from .steps import FP8_KV, NVFP4_KV

MET, AT_FLOOR, NOT_MET, NO_DATA, REPORTED = "met", "met at floor", "NOT MET", "no data", "reported"
LATENCY, NVFP4 = "latency", "NVFP4"  # the two groups of targets (a row's "group")
NOT_COUNTED = "met, not counted"
TARGET_GPU = "H200"  # both groups' targets and acceptance: "H200, one run"
FLOOR_RATIO = 1.1
BF16 = "bfloat16"

# latency: per layer, bf16 query, fp8 cache, qlen 1: batch -> geometry -> microseconds
LATENCY_US = {1: {"64/4": 4.5, "16/1": 4.0, "8/1": 4.0},
              4: {"64/4": 6.5, "16/1": 4.5, "8/1": 4.5},
              16: {"64/4": 14.0, "16/1": 6.0, "8/1": 6.0}}
THKV256_POINTS = (("64/4", 64), ("16/1", 256), ("8/1", 256))  # T·Hkv = 256 at qlen 1
THKV256_PCT = 90.0
LARGE_THKV = 1024  # "T·Hkv >= 1024" points
SPEC_POINT = ("64/4", 64, 4)  # geometry, batch, qlen of the speculative-decode target
SPEC_SHARED = 12
SPEC_PCT = 80.0
SPEC_REPORT_QLENS = (2, 8)
OP_CALL_US = 8.0
PREPARE_US = 10.0
# NVFP4: per-layer speed-up over fp8 at the same point
NVFP4_SPEEDUP_B256 = 1.6  # 64/4 B=256 qlen 1
NVFP4_SPEEDUP_THKV256 = 1.4
NVFP4_SPEEDUP_B1 = 1.0  # "no slower"
NVFP4_PCT_LARGE = 85.0  # % of copy on NVFP4 bytes at T·Hkv >= 1024


def find_row(result: dict[str, Any], geometry: str, batch: int, qlen: int = 1, shared_blocks: int = 0,
             kv_dtype: str = FP8_KV, q_dtype: str = BF16) -> dict[str, Any] | None:
    """The per_layer row of that point, or None."""
    for r in result.get("per_layer", []):
        if (r["geometry"], r["batch"], r.get("qlen", 1), r.get("shared_blocks", 0), kv_dtype_of(r),
                r.get("q_dtype", BF16)) == (geometry, batch, qlen, shared_blocks, kv_dtype, q_dtype):
            return r
    return None


def _name(r: dict[str, Any]) -> str:
    shared = f" {r['shared_blocks']}/16 shared" if r.get("shared_blocks") else ""
    return f"{r['geometry']} B={r['batch']} q{r.get('qlen', 1)}{shared}"


def _kernel_tag(r: dict[str, Any]) -> str:
    """' (union kernel)' for a row the union kernel ran (results before session 16 have no "kernel"),
    ' (cluster merge)' for one whose splits merged inside the decode launch (none before session 20)."""
    return (" (union kernel)" if r.get("kernel") == "union" else "") + (
        " (cluster merge)" if r.get("split_merge") == "cluster" else "")


def _row(group: str, target: str, goal: str, measured: str, status: str) -> dict[str, str]:
    return {"group": group, "target": target, "goal": goal, "measured": measured, "status": status}


def _latency(result: dict[str, Any]) -> Iterable[dict[str, str]]:
    for batch, goals in LATENCY_US.items():
        for geo, goal in goals.items():
            target = f"per layer {geo} B={batch} (fp8 cache, bf16 query, qlen 1)"
            goal_text = f"<= {goal} µs (or <= {FLOOR_RATIO}x the floor where it is above)"
            r = find_row(result, geo, batch)
            if r is None:
                yield _row(LATENCY, target, goal_text, "—", NO_DATA)
                continue
            us, floor = r["marginal_us"], r.get("floor_marginal_us")
            measured = f"{us:.2f} µs" + (f" (floor {floor:.2f} µs, {r['ratio_to_floor']:.2f}x)" if floor else "")
            if us <= goal:
                status = MET
            elif floor is not None and floor > goal and us <= FLOOR_RATIO * floor:
                status = AT_FLOOR
            else:
                status = NOT_MET
            yield _row(LATENCY, target, goal_text, measured, status)


def _pct_target(group: str, result: dict[str, Any], target: str, goal: float, geometry: str, batch: int,
                qlen: int = 1, shared: int = 0, kv: str = FP8_KV) -> dict[str, str]:
    r = find_row(result, geometry, batch, qlen, shared, kv)
    if r is None:
        return _row(group, target, f">= {goal:.0f}% of copy", "—", NO_DATA)
    pct = r["marginal_pct_of_copy"]
    return _row(group, target, f">= {goal:.0f}% of copy", f"{pct:.1f}% ({r['marginal_us']:.1f} µs){_kernel_tag(r)}",
                MET if pct >= goal else NOT_MET)


def _no_regression(group: str, target: str, result: dict[str, Any], baseline: dict[str, Any] | None,
                   select) -> dict[str, str]:
    goal = f"no row > {REGRESSION_SLACK:.2f}x its time in the baseline"
    if baseline is None:
        return _row(group, target, goal, "no baseline file", NO_DATA)
    dev, base_dev = device_of(result), device_of(baseline)
    if dev and base_dev and dev != base_dev:  # an H100's timings do not compare with an H200's
        return _row(group, target, goal, f"the baseline ran on {base_dev}, this file on {dev}: no comparison", NO_DATA)
    base_opt = opt_in_flags(baseline)
    if base_opt and run_flags(baseline) != run_flags(result):  # not the build this run had
        return _row(group, target, goal, f"the baseline ran with {', '.join(base_opt)}, this run with "
                    f"{', '.join(opt_in_flags(result)) or 'the defaults'}: other builds, no comparison", NO_DATA)
    cmp = [c for c in compare_with_baseline(result, baseline) if select(c["row"])]
    if not cmp:
        return _row(group, target, goal, "no point in both files", NO_DATA)
    gone = new = 0  # rows of the baseline this file lacks (failed, or a smaller grid), and the reverse
    for rows, key in (("points", point_key), ("per_layer", layer_key)):
        here = {key(r) for r in result.get(rows, []) if select(r)}
        there = {key(o) for o in baseline.get(rows, []) if select(o)}
        gone, new = gone + len(there - here), new + len(here - there)
    parts, status = [], MET
    for kind in ("layer", "step"):
        cs = [c for c in cmp if c["kind"] == kind]
        if cs:
            worst = max(cs, key=lambda c: c["ratio"])
            slow = sum(c["ratio"] > REGRESSION_SLACK for c in cs)
            parts.append(f"{'per layer' if kind == 'layer' else 'per step'}: {len(cs)} compared, {slow} slower, "
                         f"worst {worst['ratio']:.3f}x ({_name(worst['row'])} {short_kv(kv_dtype_of(worst['row']))})")
            status = NOT_MET if slow else status
    if gone:
        parts.append(f"{gone} rows of the baseline missing here")
        status = NO_DATA if status == MET else status
    if new:
        parts.append(f"{new} rows not in the baseline")
    opt = opt_in_flags(result)
    if opt and status != MET:  # (a "met" says it below: not counted)
        parts.append(f"this run with {', '.join(opt)}, the baseline with the defaults")
    return _row(group, target, goal, "; ".join(parts), status)


def _not_counted(result: dict[str, Any]) -> list[str]:
    """Why the targets' acceptance would not count a target met in this file (empty: it would)."""
    why = []
    dev = device_of(result)
    if dev is not None and TARGET_GPU not in dev:
        why.append(f"{dev}, not an {TARGET_GPU}")
    opt = opt_in_flags(result)
    if opt:
        why.append(f"not the shipped defaults: {', '.join(opt)}")
    return why


def _speedup(result: dict[str, Any], target: str, goal: float, geometry: str, batch: int) -> dict[str, str]:
    r = find_row(result, geometry, batch, kv_dtype=NVFP4_KV)
    if r is None or r.get("speedup_vs_fp8") is None:
        return _row(NVFP4, target, f">= {goal:.2f}x", "—", NO_DATA)
    o = find_row(result, geometry, batch)
    sp = r["speedup_vs_fp8"]
    return _row(NVFP4, target, f">= {goal:.2f}x", f"{sp:.3f}x ({o['marginal_us']:.2f} -> {r['marginal_us']:.2f} µs)",
                MET if sp >= goal else NOT_MET)


def _host(result: dict[str, Any], field: str, goal: float, what: str) -> dict[str, str]:
    h = result.get("host") or {}
    if field not in h:
        return _row(LATENCY, what, f"<= {goal:.0f} µs CPU", "—", NO_DATA)
    ratio = h.get(field.replace("_cpu_us", "_vs_torch_add"))
    measured = f"{h[field]:.2f} µs" + (f" ({ratio:.2f}x a torch.add launch: {h['torch_add_us']:.2f} µs)" if ratio else "")
    if "calls" not in h:  # files before 2026-12-04 timed the CPU issue only, 2000 calls, no sync
        measured += " (older file: CPU issue time, no sync)"
    elif "method" not in h:  # 2026-12-04: back to back, one sync: the GPU's time where it is longer
        measured += " (older file: calls back to back with one sync, bounded below by the op's GPU time)"
    return _row(LATENCY, what, f"<= {goal:.0f} µs CPU", measured, MET if h[field] <= goal else NOT_MET)


def check_targets(result: dict[str, Any], baseline: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """Every latency and NVFP4 target on `result` (a bench JSON); baseline: the previous result file
    for the no-regression targets (None: those are "no data")."""
    out = list(_latency(result))
    for geo, batch in THKV256_POINTS:
        out.append(_pct_target(LATENCY, result, f"per layer T·Hkv = 256: {geo} B={batch} (fp8, qlen 1)", THKV256_PCT,
                               geo, batch))
    out.append(_no_regression(LATENCY, f"T·Hkv >= {LARGE_THKV}: no regression (fp8 and NVFP4, every qlen)", result,
                              baseline, lambda r: not r.get("shared_blocks") and t_hkv(r) >= LARGE_THKV))
    out.append(_no_regression(LATENCY, "every point: no regression (acceptance: none slower than the previous file)",
                              result, baseline, lambda r: True))
    geo, batch, qlen = SPEC_POINT
    out.append(_pct_target(LATENCY, result, f"spec decode {geo} B={batch} qlen {qlen}, {SPEC_SHARED}/16 shared "
                           "(distinct bytes)", SPEC_PCT, geo, batch, qlen, SPEC_SHARED))
    out.append(_no_regression(LATENCY, f"spec decode {geo} B={batch} qlen {qlen}, 0/16 shared: no regression", result,
                              baseline, lambda r: (r["geometry"], r["batch"], r.get("qlen", 1), r.get("shared_blocks", 0),
                                                   kv_dtype_of(r)) == (geo, batch, qlen, 0, FP8_KV)))
    for q in SPEC_REPORT_QLENS:
        for kv in (FP8_KV, NVFP4_KV):
            r = find_row(result, geo, batch, q, SPEC_SHARED, kv)
            target = f"spec decode {geo} B={batch} qlen {q}, {SPEC_SHARED}/16 shared, {short_kv(kv)}"
            measured = ("—" if r is None else f"{r['marginal_pct_of_copy']:.1f}% distinct, "
                        f"{r['marginal_logical_pct_of_copy']:.1f}% logical ({r['marginal_us']:.1f} µs){_kernel_tag(r)}")
            out.append(_row(LATENCY, target, "report", measured, REPORTED if r else NO_DATA))
    out.append(_host(result, "op_call_cpu_us", OP_CALL_US, "eager op call (64/4 B=1, CPU issue, GPU held busy)"))
    out.append(_host(result, "prepare_cpu_us", PREPARE_US, "cached prepare (64/4 B=1)"))
    out.append(_speedup(result, "NVFP4 speed-up per layer, 64/4 B=256 qlen 1", NVFP4_SPEEDUP_B256, "64/4", 256))
    for geo, batch in THKV256_POINTS:
        out.append(_speedup(result, f"NVFP4 speed-up per layer, T·Hkv = 256: {geo} B={batch}", NVFP4_SPEEDUP_THKV256,
                            geo, batch))
    for geo in LATENCY_US[1]:
        out.append(_speedup(result, f"NVFP4 batch 1 no slower: {geo} B=1", NVFP4_SPEEDUP_B1, geo, 1))
    large = [r for r in result.get("per_layer", [])
             if kv_dtype_of(r) == NVFP4_KV and not r.get("shared_blocks") and t_hkv(r) >= LARGE_THKV]
    target = f"NVFP4 % of copy per layer on NVFP4 bytes, every T·Hkv >= {LARGE_THKV} point"
    if large:
        worst = min(large, key=lambda r: r["marginal_pct_of_copy"])
        out.append(_row(NVFP4, target, f">= {NVFP4_PCT_LARGE:.0f}% of copy",
                        f"{len(large)} rows, lowest {worst['marginal_pct_of_copy']:.1f}% ({_name(worst)})",
                        MET if worst["marginal_pct_of_copy"] >= NVFP4_PCT_LARGE else NOT_MET))
    else:
        out.append(_row(NVFP4, target, f">= {NVFP4_PCT_LARGE:.0f}% of copy", "—", NO_DATA))
    why = _not_counted(result)
    if why:
        for r in out:
            if r["status"] in (MET, AT_FLOOR):
                r["status"] = NOT_COUNTED
                r["measured"] += f" (not counted: {'; '.join(why)})"
    return out


def format_targets(rows: list[dict[str, str]]) -> str:
    """The targets as a markdown table, then a count per status."""
    lines = ["| group | target | goal | measured | status |", "|---|---|---|---|---|"]
    lines += [f"| {r['group']} | {r['target']} | {r['goal']} | {r['measured']} | {r['status']} |" for r in rows]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines.append("")
    lines.append("targets: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)
