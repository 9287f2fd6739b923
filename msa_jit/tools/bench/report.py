"""A result file's README tables, its plot, and its comparison with a previous result (no GPU).

Result files before the per-layer grid (bench-2026-12-03T1342.json and older) have per-step
`points` of the fp8 cache and a few `per_layer` rows without `kv_dtype`, `q_dtype`, `qlen` or
`shared_blocks`: every reader here takes those as fp8, bfloat16, 1 and 0, so old and new files
compare like with like (only keys present in both).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from ...geometry import KV_DTYPE_SHORT
from .grid import GRID_BATCHES, GRID_GEOMETRIES, GRID_QLENS
from .steps import FP8_KV, GEOMETRIES

REGRESSION_SLACK = 1.05
# keys every bench result has (the oldest files included), then one of which it has at least: the
# A/B scripts' files (variants-*.json ...) have the first three too, but neither of these
RESULT_KEYS = ("environment", "copy_tbps", "points")
RESULT_ANY_KEYS = ("per_layer", "host")
# what the tables and the comparison read from a row (a `points` or `per_layer` entry), by the
# type it must have where the row has it: a figure of another type would fail there, far from
# the file's name (a missing one is said as missing)
ROW_TEXT = ("geometry", "q_dtype", "kv_dtype")
ROW_INTS = ("batch", "qlen", "shared_blocks")
ROW_FIGURES = ("us", "pct_of_copy", "marginal_us", "marginal_pct_of_copy", "marginal_logical_pct_of_copy")
ROW_OPTIONAL_FIGURES = ("floor_marginal_us",)  # and every speedup_vs_*: a number or null


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _row_problem(where: str, r: Any) -> str | None:
    """Why row `r` of the file (`where`: 'points[3]') cannot be read by the tables, or None."""
    if not isinstance(r, dict):
        return f"{where} is not a JSON object"
    for keys, ok, what in ((ROW_TEXT, lambda v: isinstance(v, str), "a string"),
                           (ROW_INTS, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
                           (ROW_FIGURES, _number, "a number")):
        for k in keys:
            if k in r and not ok(r[k]):
                return f"{where}.{k} is {json.dumps(r[k])[:40]}, not {what}"
    for k, v in r.items():
        if (k in ROW_OPTIONAL_FIGURES or k.startswith("speedup_vs_")) and v is not None and not _number(v):
            return f"{where}.{k} is {json.dumps(v)[:40]}, not a number"
    return None


def result_problem(doc: Any) -> str | None:
    """Why `doc` (a parsed JSON file) is not a bench result (None when it is one): what `--table`
    and `--baseline` check before reading it."""
    if not isinstance(doc, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(doc), "a number")
        return f"{kind}, not a JSON object"
    missing = [k for k in RESULT_KEYS if k not in doc]
    if missing:
        return f"missing {', '.join(map(repr, missing))}"
    if not any(k in doc for k in RESULT_ANY_KEYS):
        return f"missing {' or '.join(map(repr, RESULT_ANY_KEYS))}"
    for k, kind in (("environment", dict), ("points", list), ("per_layer", list), ("grid", dict)):
        if k in doc and not isinstance(doc[k], kind):
            return f"{k!r} is not a JSON {'object' if kind is dict else 'array'}"
    for k in ("geometries", "batches", "qlens"):
        if k in doc.get("grid", {}) and not isinstance(doc["grid"][k], list):
            return f"'grid.{k}' is not a JSON array"
    for rows in ("points", "per_layer"):
        for i, r in enumerate(doc.get(rows, [])):
            why = _row_problem(f"{rows}[{i}]", r)
            if why:
                return why
    return None


def device_of(result: dict[str, Any]) -> str | None:
    """The GPU a result file was measured on (`environment.device`), None if it does not say."""
    return (result.get("environment") or {}).get("device")


def kv_dtype_of(r: dict[str, Any]) -> str:
    """A row's cache format (files before NVFP4: fp8)."""
    return r.get("kv_dtype", FP8_KV)


def short_kv(kv_dtype: str) -> str:
    """"fp8" / "nvfp4": the name in tables."""
    return KV_DTYPE_SHORT.get(kv_dtype, kv_dtype)


def t_hkv(r: dict[str, Any]) -> int:
    """T·Hkv of a row or point: query tokens x KV heads (the decode kernel's one-wave count)."""
    return r["batch"] * r.get("qlen", 1) * GEOMETRIES[r["geometry"]][1]


def point_key(p: dict[str, Any]) -> tuple:
    return ("step", p["geometry"], p.get("q_dtype", "bfloat16"), kv_dtype_of(p), p["batch"], p.get("qlen", 1),
            p.get("shared_blocks", 0))


def layer_key(r: dict[str, Any]) -> tuple:
    return ("layer", r["geometry"], r.get("q_dtype", "bfloat16"), kv_dtype_of(r), r["batch"], r.get("qlen", 1),
            r.get("shared_blocks", 0))


def compare_with_baseline(result: dict[str, Any], baseline: dict[str, Any]) -> list[dict[str, Any]]:
    """Every per-step point (`us`) and per-layer row (`marginal_us`) present in both files:
    dicts with kind ("step" / "layer"), the row of `result`, new, old and ratio (new / old)."""
    out = []
    for kind, field, rows, key in (("step", "us", "points", point_key), ("layer", "marginal_us", "per_layer", layer_key)):
        old = {key(o): o for o in baseline.get(rows, [])}
        for r in result.get(rows, []):
            o = old.get(key(r))
            if o and o.get(field) and r.get(field) is not None:
                out.append({"kind": kind, "row": r, "key": key(r)[1:], "new": r[field], "old": o[field],
                            "ratio": r[field] / o[field]})
    return out


def regressions(result: dict[str, Any], baseline: dict[str, Any], slack: float = REGRESSION_SLACK) -> list[str]:
    """Points (step time) and per-layer rows (marginal) slower than in a previous result file by more than `slack`."""
    return [f"{c['kind']} {c['key']}: {c['new']} us vs {c['old']} us before"
            for c in compare_with_baseline(result, baseline) if c["ratio"] > slack]


def latest_result(out_dir: str | Path, device: str | None = None) -> Path | None:
    """The newest bench-*.json in out_dir (by its recorded date), or None. device: only files measured
    on a GPU of that name (`environment.device`, torch.cuda.get_device_name()): timings of an H100 and
    an H200 do not compare."""
    best, best_date = None, ""
    for path in Path(out_dir).glob("bench-*.json"):
        try:
            doc = json.loads(path.read_text())
            env = doc["environment"]
            date = env["date"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if device is not None and env.get("device") != device:
            continue
        if date > best_date:
            best, best_date = path, date
    return best


def has_layer_grid(result: dict[str, Any]) -> bool:
    """Whether the file has the per-layer grid (rows with kv_dtype), else it is an old per-step file."""
    return any("kv_dtype" in r for r in result.get("per_layer", []))


def _old_table(result: dict[str, Any], geometries, batches, qlens) -> str:
    points = {(p["geometry"], p["qlen"], p["batch"]): p for p in result["points"] if not p["shared_blocks"]}
    lines = ["| geometry | qlen | " + " | ".join(f"B={b}" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    for geo in geometries:
        for qlen in qlens:
            cells = [_step_cell(points.get((geo, qlen, b))) for b in batches]  # "—" where the file has none
            lines.append(f"| {geo} | {qlen} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _layer_cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "—"
    extra = [f"{r['marginal_pct_of_copy']:.0f}%"]
    if r.get("floor_marginal_us") is not None:
        extra.append(f"floor {r['floor_marginal_us']:.1f}")
    if r.get("speedup_vs_fp8") is not None:
        extra.append(f"{r['speedup_vs_fp8']:.2f}x")
    if r.get("kernel") == "union":
        extra.append("union")
    if r.get("split_merge") == "cluster":
        extra.append("cluster merge")
    for key, value in r.items():  # a peer timed in the same run: its time over msa-jit's
        if key.startswith("speedup_vs_") and key != "speedup_vs_fp8" and value is not None:
            extra.append(f"{value:.2f}x vs {key[len('speedup_vs_'):]}")
    return f"{r['marginal_us']:.1f} µs ({', '.join(extra)})"


def _step_cell(p: dict[str, Any] | None) -> str:
    return "—" if p is None else f"{p['us']:.1f} µs ({p['pct_of_copy']:.0f}%)"


def _grid_table(index: dict[tuple, dict], cell, geometries, kv_dtypes, qlens, batches) -> list[str]:
    lines = ["| geometry | KV cache | qlen | " + " | ".join(f"B={b}" for b in batches) + " |",
             "|---|---|---|" + "---|" * len(batches)]
    for geo in geometries:
        for kv in kv_dtypes:
            for qlen in qlens:
                cells = [cell(index.get((geo, kv, qlen, b))) for b in batches]
                lines.append(f"| {geo} | {short_kv(kv)} | {qlen} | " + " | ".join(cells) + " |")
    return lines


def result_tables(result: dict[str, Any], geometries=None, batches=None, qlens=None) -> str:
    """The markdown tables of a result file (`msa-jit bench --table`; docs/performance.md shows them).

    A file with the per-layer grid: the per-layer table first (`marginal_us`, % of copy on
    distinct bytes, the floor probe's per-layer figure at small batches, NVFP4's speed-up over
    fp8), then the shared-block rows, then the per-step table. An older file: its per-step table.
    geometries / batches / qlens: default the file's grid (older files: the grid constants).
    """
    grid = result.get("grid", {})
    geometries = tuple(geometries or grid.get("geometries") or GRID_GEOMETRIES)
    batches = tuple(batches or grid.get("batches") or GRID_BATCHES)
    if not has_layer_grid(result):
        return _old_table(result, geometries, batches, tuple(qlens or (1, 4)))
    qlens = tuple(qlens or grid.get("qlens") or GRID_QLENS)
    rows = result["per_layer"]
    kv_dtypes = tuple(dict.fromkeys(kv_dtype_of(r) for r in rows))
    q_dtypes = {r.get("q_dtype", "bfloat16") for r in rows}
    layers = {(r["geometry"], kv_dtype_of(r), r["qlen"], r["batch"]): r for r in rows if not r["shared_blocks"]}
    steps = {(p["geometry"], kv_dtype_of(p), p["qlen"], p["batch"]): p for p in result["points"]
             if not p["shared_blocks"]}
    L = rows[0]["layers"] if rows else "L"
    out = [f"Per layer ({', '.join(sorted(q_dtypes))} query; one prologue, then {L} layers in one graph: "
           f"(t({L}) - t(1)) / {L - 1 if isinstance(L, int) else 'L - 1'}; % of copy on distinct KV bytes; "
           "floor: the floor probe per layer, same run; NVFP4: speed-up over fp8"
           + ("; union: the union kernel ran" if any(r.get("kernel") == "union" for r in rows) else "")
           + ("; cluster merge: the splits merged inside the decode launch"
              if any(r.get("split_merge") == "cluster" for r in rows) else "") + "):", ""]
    out += _grid_table(layers, _layer_cell, geometries, kv_dtypes, qlens, batches)
    shared = [r for r in rows if r["shared_blocks"]]
    if shared:
        step_of = {(p["geometry"], kv_dtype_of(p), p["qlen"], p["batch"], p["shared_blocks"]): p
                   for p in result["points"] if p["shared_blocks"]}
        out += ["", "Speculative decode (consecutive tokens share "
                f"{shared[0]['shared_blocks']} of their 16 blocks), per layer:", "",
                "| geometry | KV cache | qlen | B | per layer | % of copy (distinct bytes) | % of copy (logical bytes) "
                "| step |", "|---|---|---|---|---|---|---|---|"]
        for r in shared:
            p = step_of.get((r["geometry"], kv_dtype_of(r), r["qlen"], r["batch"], r["shared_blocks"]))
            sp = f", {r['speedup_vs_fp8']:.2f}x" if r.get("speedup_vs_fp8") is not None else ""
            sp += ", union" if r.get("kernel") == "union" else ""
            sp += ", cluster merge" if r.get("split_merge") == "cluster" else ""
            out.append(f"| {r['geometry']} | {short_kv(kv_dtype_of(r))} | {r['qlen']} | {r['batch']} | "
                       f"{r['marginal_us']:.1f} µs{sp} | {r['marginal_pct_of_copy']:.0f}% | "
                       f"{r['marginal_logical_pct_of_copy']:.0f}% | {_step_cell(p)} |")
    out += ["", "Per step (prepare + one op as a standalone graph; % of copy on distinct KV bytes):", ""]
    out += _grid_table(steps, _step_cell, geometries, kv_dtypes, qlens, batches)
    return "\n".join(out)


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Effective TB/s against batch, one line per geometry x qlen; copy (and 2 GiB read) = ceilings.

    A file with the per-layer grid: one panel per cache format, per-layer figures; an older
    file: its per-step points.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    copy = result["copy_tbps"]
    if has_layer_grid(result):
        kvs = list(dict.fromkeys(kv_dtype_of(r) for r in result["per_layer"]))
        panels = [(f"per layer, {short_kv(kv)} cache",
                   [(r, r["marginal_tbps"]) for r in result["per_layer"] if kv_dtype_of(r) == kv]) for kv in kvs]
    else:
        panels = [("per step", [(p, p["tbps"]) for p in result["points"]])]
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5), squeeze=False)
    for ax, (title, pts) in zip(axes[0], panels):
        series: dict[tuple, list] = {}
        for r, tbps in pts:
            if not r["shared_blocks"]:
                series.setdefault((r["geometry"], r.get("qlen", 1), r.get("q_dtype", "bfloat16")), []).append(
                    (r["batch"], tbps))
        for (geo, qlen, qd), xy in sorted(series.items()):
            xy.sort()
            ax.plot([b for b, _ in xy], [t for _, t in xy], marker="o", label=f"{geo} qlen={qlen} {qd}")
        ax.axhline(copy, color="k", ls="--", label=f"D2D copy {copy:.2f} TB/s")
        if "read_2g" in result:
            ax.axhline(result["read_2g"]["tbps"], color="grey", ls=":",
                       label=f"2 GiB read {result['read_2g']['tbps']:.2f} TB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("effective TB/s (distinct KV bytes / time)")
        sec = ax.secondary_yaxis("right", functions=(lambda y: 100 * y / copy, lambda p: p * copy / 100))
        sec.set_ylabel("% of copy bandwidth")
        env = result["environment"]
        ax.set_title(f"MSA sparse decode {title}, {env['device']}, {env['date'][:10]}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    # a palette PNG: a line plot's few colours in 8 bits a pixel take about a third of the bytes of
    # the RGBA file, and the reference plots travel with the repository
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    Image.open(buf).convert("RGB").quantize(colors=256).save(path, format="PNG", optimize=True)
