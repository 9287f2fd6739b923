"""The union kernel against the token kernel by the size of the union's grid, with no block shared (the
case a plan cannot tell from MTP drafts): the data of the planner's union rule (`planner.choose_kernel`,
UNION_WAVE_FILL). `msa-jit bench` runs twice per geometry, MSA_JIT_ENABLE_SM90_UNION=0 (the token kernel)
and =1 (the union wherever its grid fills the GPU once), then one JSON pairs them per point: the union's
grid, its share of one wave at 2 CTAs per SM, both per-layer times, their ratio and what the planner's
default picks there.

    python bench/union_waves.py run --out $OUT              # on the GPU (bench/h200_run.sh union_waves)
    python bench/union_waves.py summarize --token T.json --union U.json [--union-log U.log] --out DIR
writes union-waves-<date>-<gpu>.json and prints the table. --union-log takes the union side from a
bench log's progress lines where its JSON did not come back from the device (session 31's H100 run)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# geometry -> batches around one wave of the union's grid on 132 SMs (264 CTAs at 2 per SM: 64/4 B=66,
# 8/1 B=264), a partial wave on either side, and two waves; qlens: one tile per request (and two at 64/4 qlen 8)
GRID = {"64/4": ("33,48,56,60,62,63,64,66,67,96,128", "2,4,8"), "8/1": ("132,192,240,248,251,256,264,265,384", "2,4,8")}
_PROGRESS = re.compile(r"\]\s+(\S+) \S+ q(\d+) B(\d+)\s+sh(\d+)\s+S\s*(\d+)\s+C(\d)(U?)\s+step\s+([\d.]+) us \| "
                       r"per layer\s+([\d.]+) us\s+([\d.]+)% of copy")


def _bench(flag: str, geometry: str, batches: str, qlens: str, out: Path) -> None:
    cmd = [sys.executable, "-m", "msa_jit", "bench", "--out", str(out), "--geometries", geometry, "--batches", batches,
           "--decode-query-lens", qlens, "--kv-dtypes", "fp8", "--no-shared", "--no-host", "--baseline", "none",
           "--floor-batches", ""]
    subprocess.run(cmd, env=dict(os.environ, MSA_JIT_ENABLE_SM90_UNION=flag), check=True, stdout=subprocess.DEVNULL)


def _rows_of_log(path: Path) -> list[dict[str, Any]]:
    """The per-layer rows of a `msa-jit bench` log (its progress lines)."""
    rows = []
    for line in path.read_text().splitlines():
        m = _PROGRESS.search(line)
        if m:
            rows.append(dict(geometry=m[1], qlen=int(m[2]), batch=int(m[3]), shared_blocks=int(m[4]), ctas_per_sm=int(m[6]),
                             kernel="union" if m[7] else "token", marginal_us=float(m[9]), marginal_pct_of_copy=float(m[10])))
    return rows


def pair(token_rows: list[dict[str, Any]], union_rows: list[dict[str, Any]], num_sms: int) -> list[dict[str, Any]]:
    """One row per point both runs have: the union's grid and wave share, both times, ratio, the planner's pick."""
    from msa_jit.geometry import UNION_PLANNED_CTAS_PER_SM
    from msa_jit.planner import choose_kernel, union_grid_ctas

    key = lambda r: (r["geometry"], r["qlen"], r["batch"])
    union = {key(r): r for r in union_rows if not r.get("shared_blocks")}
    out = []
    for t in sorted((r for r in token_rows if not r.get("shared_blocks")), key=key):
        u = union.get(key(t))
        if u is None or u.get("kernel") != "union" or t.get("kernel") != "token":
            continue
        hq, hkv = (int(x) for x in t["geometry"].split("/"))
        grid = union_grid_ctas(t["batch"], t["qlen"], hq, hkv)
        out.append(dict(geometry=t["geometry"], qlen=t["qlen"], batch=t["batch"], union_grid_ctas=grid,
                        wave_fill=round(grid / (UNION_PLANNED_CTAS_PER_SM * num_sms), 3), token_us=t["marginal_us"], union_us=u["marginal_us"],
                        union_over_token=round(u["marginal_us"] / t["marginal_us"], 3),
                        token_pct_of_copy=t["marginal_pct_of_copy"], union_pct_of_copy=u["marginal_pct_of_copy"],
                        planner_default=choose_kernel(t["batch"], t["qlen"], hq, hkv, 128, "sm_90a", num_sms, None)))
    return out


def write(token: dict[str, Any], union_env: dict[str, Any] | None, rows: list[dict[str, Any]], num_sms: int,
          command: str, out_dir: Path) -> Path:
    env = token["environment"]
    gpu = "h200" if "H200" in env["device"] else "h100" if "H100" in env["device"] else "gpu"
    path = out_dir / f"union-waves-{env['date'][:16].replace(':', '')}-{gpu}.json"
    doc = dict(environment=env, union_environment=union_env, copy_tbps=token.get("copy_tbps"), num_sms=num_sms,
               command=command, rows=rows)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'point':<16} {'grid':>5} {'fill':>6} {'token us':>9} {'union us':>9} {'ratio':>6}  default")
    for r in rows:
        print(f"{r['geometry']} q{r['qlen']} B{r['batch']:<5} {r['union_grid_ctas']:>5} {r['wave_fill']:>6} "
              f"{r['token_us']:>9} {r['union_us']:>9} {r['union_over_token']:>6}  {r['planner_default']}")
    print(f"wrote {path}")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", required=True)
    summ = sub.add_parser("summarize")
    summ.add_argument("--token", nargs="+", required=True, help="bench JSONs of MSA_JIT_ENABLE_SM90_UNION=0")
    summ.add_argument("--union", nargs="*", default=[], help="bench JSONs of MSA_JIT_ENABLE_SM90_UNION=1")
    summ.add_argument("--union-log", nargs="*", default=[], help="bench logs of =1 (their progress lines)")
    summ.add_argument("--num-sms", type=int, default=132)
    summ.add_argument("--command", default="", help="the device command that made the files")
    summ.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.cmd == "run":
        import torch

        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        with tempfile.TemporaryDirectory() as tmp:
            runs = {flag: Path(tmp) / f"u{flag}" for flag in ("0", "1")}
            for geometry, (batches, qlens) in GRID.items():
                for flag, d in runs.items():
                    _bench(flag, geometry, batches, qlens, d)
            docs = {f: [json.loads(p.read_text()) for p in sorted(d.glob("bench-*.json"))] for f, d in runs.items()}
        rows = pair([r for doc in docs["0"] for r in doc["per_layer"]], [r for doc in docs["1"] for r in doc["per_layer"]],
                    num_sms)
        write(docs["0"][0], docs["1"][0]["environment"], rows, num_sms, "python bench/union_waves.py run", Path(a.out))
        return
    token = [json.loads(Path(p).read_text()) for p in a.token]
    union_docs = [json.loads(Path(p).read_text()) for p in a.union]
    union_rows = [r for doc in union_docs for r in doc["per_layer"]]
    union_rows += [r for p in a.union_log for r in _rows_of_log(Path(p))]
    rows = pair([r for doc in token for r in doc["per_layer"]], union_rows, a.num_sms)
    write(token[0], union_docs[0]["environment"] if union_docs else None, rows, a.num_sms, a.command, Path(a.out))


if __name__ == "__main__":
    main()
