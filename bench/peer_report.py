"""Where msa-jit stands beside FlashInfer in one peer bench result (project tooling, not shipped).

    python bench/peer_report.py bench/results/h200.json      # markdown on stdout

From a `msa-jit bench --compare flashinfer[,vllm]` JSON, per layer, bf16 query:
- fp8, no block shared, grouped by the plan msa-jit's planner chose (kernel, split count, merge), by
  batch, and by T·Hkv with the plan there: the geomean, least and greatest speed-up over FlashInfer and
  how many points are slower;
- the bandwidth end (batch >= 64): % of copy on distinct bytes, msa-jit's and FlashInfer's;
- draft tokens sharing blocks (the rows with shared blocks): msa-jit over FlashInfer;
- NVFP4 (which FlashInfer does not serve on Hopper) over FlashInfer's fp8 at the same point, batch >= 64;
- the eager call's CPU time (median over the rows) of each op.
A speed-up is the peer's time over msa-jit's (> 1: msa-jit faster).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterable

if __name__ == "__main__":  # the checkout's msa_jit, also without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from msa_jit.kernels.constants import FP8_KV as FP8  # noqa: E402
from msa_jit.kernels.constants import NVFP4_KV as NVFP4  # noqa: E402
from msa_jit.tools.bench.report import t_hkv  # noqa: E402

BANDWIDTH_END_BATCH = 64


def _geomean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def plan_name(row: dict) -> str:
    """The planner's choice of a row, as performance.md names it."""
    if row.get("kernel") == "union":
        return "union kernel"
    splits = row.get("num_splits", 1)
    if splits == 1:
        return "one split (token kernel)"
    merge = "cluster merge" if row.get("split_merge") == "cluster" else "merge kernel"
    return f"{splits} splits, {merge}"


def _point(row: dict) -> tuple:
    return row["geometry"], row["batch"], row["qlen"], row.get("shared_blocks", 0)


def _label(row: dict) -> str:
    shared = f" sh{row['shared_blocks']}" if row.get("shared_blocks") else ""
    return f"{row['geometry']} B={row['batch']} q{row['qlen']}{shared}"


def plan_table(result: dict) -> str:
    """performance.md's table of msa-jit's speed-up over FlashInfer by the planner's choice (fp8, bf16
    query, no block shared)."""
    return "\n".join(_speedup_table("msa-jit plan", _by_plan(_plain_fp8(result))))


def grid_table(result: dict) -> str:
    """performance.md's table of msa-jit's speed-up over FlashInfer by T·Hkv (query tokens x KV heads:
    the CTAs of one split) and the plan chosen there, CTAs per SM included (fp8, bf16 query, no block
    shared): a plan's wins and losses follow the shape of its grid more than the batch."""
    return "\n".join(_grid_table([(r, r["speedup_vs_flashinfer"]) for r in _plain_fp8(result)],
                                  "speed-up over FlashInfer", "slower", 1.0))


def nvfp4_grid_table(result: dict, target: float = 1.3) -> str:
    """The same by grid for NVFP4 at batch >= BANDWIDTH_END_BATCH (no block shared), against FlashInfer's
    fp8 at the same point (FlashInfer reads no NVFP4 cache on Hopper), with the points below `target`."""
    pairs = [(r, fi / r["marginal_us"]) for r, fi in _nvfp4_beside_flashinfer_fp8(result) if not r.get("shared_blocks")]
    return "\n".join(_grid_table(pairs, "over FlashInfer's fp8", f"below {target}x", target))


def _grid_table(pairs: list[tuple[dict, float]], what: str, below_name: str, below: float) -> list[str]:
    """Rows (row, speed-up) grouped by T·Hkv and the plan there: count, geomean (min-max), how many below."""
    groups: dict[tuple, list[tuple[dict, float]]] = defaultdict(list)
    for r, x in pairs:
        groups[(t_hkv(r), r.get("kernel") == "union", -r.get("num_splits", 1), r.get("ctas_per_sm", 2),
                r.get("split_merge") != "cluster")].append((r, x))
    out = [f"| T·Hkv | msa-jit plan | CTAs per SM | points | {what}, geomean (min-max) | {below_name} |",
           "|---|---|---|---|---|---|"]
    for key in sorted(groups):
        s = [x for _, x in groups[key]]
        out.append(f"| {key[0]} | {plan_name(groups[key][0][0])} | {key[3]} | {len(s)} | {_geomean(s):.3f} "
                   f"({min(s):.3f}-{max(s):.3f}) | {sum(x < below for x in s)} |")
    return out


def _nvfp4_beside_flashinfer_fp8(result: dict) -> list[tuple[dict, float]]:
    """(NVFP4 row, FlashInfer's fp8 time at the same point), bf16 query, batch >= BANDWIDTH_END_BATCH."""
    fi_fp8 = {_point(r): r for r in _fp8_beside_flashinfer(result)}
    return [(r, fi_fp8[_point(r)]["flashinfer_marginal_us"]) for r in _bf16_rows(result)
            if r.get("kv_dtype") == NVFP4 and r["batch"] >= BANDWIDTH_END_BATCH and _point(r) in fi_fp8]


def room_table(result: dict) -> str:
    """By batch, the most any kernel could be faster than FlashInfer: a layer cannot take less than its
    distinct bytes at the read ceiling (the run's 2 GiB read), so FlashInfer's time over that read time
    bounds every speed-up over it (fp8, bf16 query, no block shared)."""
    read = result["read_2g"]["tbps"]
    out = [f"| batch | FlashInfer's time over the read time at {read} TB/s: least | geomean | "
           "points below 1.25x |", "|---|---|---|---|"]
    for batch, group in _by_batch(_plain_fp8(result)).items():
        room = [r["flashinfer_marginal_us"] * 1e-6 * read * 1e12 / r["kv_bytes"] for r in group]
        out.append(f"| B={batch} | {min(room):.2f}x | {_geomean(room):.2f}x | {sum(x < 1.25 for x in room)} of "
                   f"{len(room)} |")
    return "\n".join(out)


def _bf16_rows(result: dict) -> list[dict]:
    return [r for r in result["per_layer"] if r.get("q_dtype", "bfloat16") == "bfloat16"]


def _fp8_beside_flashinfer(result: dict) -> list[dict]:
    """The bf16-query fp8 rows FlashInfer was timed on (shared blocks or not)."""
    return [r for r in _bf16_rows(result)
            if r.get("kv_dtype", FP8) == FP8 and r.get("speedup_vs_flashinfer") is not None]


def _plain_fp8(result: dict) -> list[dict]:
    return [r for r in _fp8_beside_flashinfer(result) if not r.get("shared_blocks")]


def _by_batch(rows: list[dict]) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["batch"]):
        groups[r["batch"]].append(r)
    return groups


def _by_plan(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: (r.get("kernel") == "union", r.get("num_splits", 1) > 1,
                                         -r.get("num_splits", 1), r.get("split_merge") != "cluster")):
        groups[plan_name(r)].append(r)
    return groups


def _speedup_table(title: str, groups: dict[str, list[dict]]) -> list[str]:
    out = [f"| {title} | points | speed-up over FlashInfer, geomean (min-max) | slower |", "|---|---|---|---|"]
    for name, rows in groups.items():
        s = [r["speedup_vs_flashinfer"] for r in rows]
        out.append(f"| {name} | {len(s)} | {_geomean(s):.3f} ({min(s):.3f}-{max(s):.3f}) | "
                   f"{sum(x < 1 for x in s)} |")
    return out


def peer_report(result: dict) -> str:
    rows = _bf16_rows(result)
    fp8 = _fp8_beside_flashinfer(result)
    plain = [r for r in fp8 if not r.get("shared_blocks")]
    if not plain:
        raise SystemExit("no fp8 row of this result was timed beside FlashInfer (run with --compare flashinfer)")
    env = result.get("environment", {})
    copy = result.get("copy_tbps")
    out = [f"{env.get('device', '?')}, {env.get('date', '?')}; copy {copy} TB/s; `{env.get('command', '?')}`", ""]

    s = [r["speedup_vs_flashinfer"] for r in plain]
    slowest = min(plain, key=lambda r: r["speedup_vs_flashinfer"])
    out += [f"fp8, no block shared: {len(s)} points, geomean {_geomean(s):.3f}x FlashInfer, least "
            f"{min(s):.3f}x ({_label(slowest)}), slower at {sum(x < 1 for x in s)}.", ""]

    out += _speedup_table("msa-jit plan", _by_plan(plain)) + [""]
    out += _speedup_table("batch", {f"B={b}": group for b, group in _by_batch(plain).items()}) + [""]
    out += [grid_table(result), ""]
    if (result.get("read_2g") or {}).get("tbps"):
        out += [room_table(result), ""]

    wide = sorted((r for r in plain if r["batch"] >= BANDWIDTH_END_BATCH and copy),
                  key=lambda r: (r["qlen"], -int(r["geometry"].split("/")[0]), r["batch"]))
    if wide:
        out += [f"Batch >= {BANDWIDTH_END_BATCH}, % of copy on distinct bytes:", "",
                "| point | msa-jit µs | % of copy | FlashInfer µs | % of copy |", "|---|---|---|---|---|"]
        for r in wide:
            fi_pct = 100 * r["kv_bytes"] / (r["flashinfer_marginal_us"] * 1e-6) / (copy * 1e12)
            out.append(f"| {_label(r)} | {r['marginal_us']:.1f} | {r['marginal_pct_of_copy']:.0f}% | "
                       f"{r['flashinfer_marginal_us']:.1f} | {fi_pct:.0f}% |")
        out.append("")

    shared = [r for r in fp8 if r.get("shared_blocks")]
    if shared:
        out += ["Draft tokens sharing blocks (fp8):", "",
                "| point | msa-jit plan | msa-jit µs | FlashInfer µs | speed-up |", "|---|---|---|---|---|"]
        out += [f"| {_label(r)} | {plan_name(r)} | {r['marginal_us']:.1f} | {r['flashinfer_marginal_us']:.1f} | "
                f"{r['speedup_vs_flashinfer']:.2f}x |" for r in shared]
        out.append("")

    nvfp4 = _nvfp4_beside_flashinfer_fp8(result)
    if nvfp4:
        ratios = [fi / r["marginal_us"] for r, fi in nvfp4]
        out += [f"NVFP4 at batch >= {BANDWIDTH_END_BATCH} over FlashInfer's fp8 (same point): geomean "
                f"{_geomean(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}), {len(ratios)} points; "
                f"an NVFP4 cache holds {32 / 18:.2f}x the tokens of an fp8 one per byte.", "",
                "| point | NVFP4 µs | FlashInfer fp8 µs | speed-up |", "|---|---|---|---|"]
        out += [f"| {_label(r)} | {r['marginal_us']:.1f} | {fi:.1f} | {x:.2f}x |" for (r, fi), x in zip(nvfp4, ratios)]
        out += ["", nvfp4_grid_table(result), ""]

    cpu = {name: [r[key] for r in rows if r.get(key) is not None]
           for name, key in (("msa-jit", "msa_call_cpu_us"), ("FlashInfer", "flashinfer_call_cpu_us"),
                             ("vLLM Triton", "vllm_call_cpu_us"))}
    cpu = {k: v for k, v in cpu.items() if v}
    if cpu:
        out.append("Eager call, CPU µs (median over the rows): "
                   + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in cpu.items()) + ".")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/peer_report.py RESULT.json")
    print(peer_report(json.loads(Path(sys.argv[1]).read_text())))
