"""One file from `bench/merge_ab.sh`'s repeated runs: the cluster merge against the merge kernel at
every small-batch point where the default plan takes the cluster merge, each run's per-layer time,
the ratio of the fastest of each, and each side's own spread over its runs (so a difference can be
read against the run-to-run noise of one machine).

    python bench/merge_ab_summary.py <dir with <round>-cluster/ and <round>-kernel/> --out bench/results
writes merge-ab-<date of the first run>-<gpu>.json and prints the table."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any


def _key(row: dict[str, Any]) -> tuple:
    return (row["geometry"], row["batch"], row["qlen"], row["q_dtype"], row["kv_dtype"])


def summarize(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """runs: "<round>-<cluster|kernel>" -> that run's bench result. One row per point whose default
    (cluster) run took the cluster merge."""
    rounds = sorted({name.split("-")[0] for name in runs}, key=int)
    by = {name: {_key(r): r for r in res["per_layer"]} for name, res in runs.items()}
    rows = []
    for key, first in by[f"{rounds[0]}-cluster"].items():
        if first.get("split_merge") != "cluster":
            continue
        cl = [by[f"{i}-cluster"][key]["marginal_us"] for i in rounds]
        km = [by[f"{i}-kernel"][key]["marginal_us"] for i in rounds]
        rows.append(dict(zip(("geometry", "batch", "qlen", "q_dtype", "kv_dtype"), key),
                         cluster_us=cl, kernel_us=km, ratio_of_fastest=round(min(cl) / min(km), 3),
                         cluster_spread=round(max(cl) / min(cl), 3), kernel_spread=round(max(km) / min(km), 3)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    runs = {}
    for d in sorted(p for p in args.dir.iterdir() if re.fullmatch(r"\d+-(cluster|kernel)", p.name)):
        (f,) = d.glob("bench-*.json")
        runs[d.name] = json.loads(f.read_text())
    rows = summarize(runs)
    first = runs[min(runs, key=lambda n: runs[n]["environment"]["date"])]
    env = first["environment"]
    gpu = "h200" if "H200" in env["device"] else "h100" if "H100" in env["device"] else "gpu"
    stamp = env["date"][:16].replace(":", "")
    out = args.out / f"merge-ab-{stamp}-{gpu}.json"
    out.write_text(json.dumps({
        "environment": {k: v for k, v in env.items() if k not in ("command", "msa_jit_env", "msa_jit_flags")},
        "command": "ROUNDS=%d bash bench/merge_ab.sh; python bench/merge_ab_summary.py" % (len(runs) // 2),
        "runs": {n: {"date": r["environment"]["date"], "copy_tbps": r["copy_tbps"],
                     "command": r["environment"]["command"], "msa_jit_flags": r["environment"]["msa_jit_flags"]}
                 for n, r in sorted(runs.items())},
        "rows": rows,
        "worst_ratio_of_fastest": max(r["ratio_of_fastest"] for r in rows),
        "worst_spread": max(max(r["cluster_spread"], r["kernel_spread"]) for r in rows),
    }, indent=1) + "\n")
    print(f"{'point':32} {'cluster us':>14} {'kernel us':>14} {'ratio':>6} {'spread':>7}")
    for r in rows:
        name = f"{r['geometry']} B={r['batch']} q{r['qlen']} {r['kv_dtype'][:5]}"
        print(f"{name:32} {'/'.join(map(str, r['cluster_us'])):>14} {'/'.join(map(str, r['kernel_us'])):>14} "
              f"{r['ratio_of_fastest']:>6} {max(r['cluster_spread'], r['kernel_spread']):>7}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
