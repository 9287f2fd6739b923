"""`msa-jit bench`: the performance grid on a GPU (`msa_jit.bench`), or a result file's table.

Writes bench-<date>.json/.png into --out and compares with the newest previous result;
exit 1 on a point more than 5% slower. `--table RESULT_JSON` prints the README's table of a
result file and needs no GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import bench
from ..geometry import Q_DTYPES

HELP = "benchmark grid on this GPU: JSON + PNG (needs CUDA)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The grid (--geometries, --batches, --decode-query-lens, --q-dtype, --iters), --out, --baseline, --table."""
    p.add_argument("--out", default=bench.RESULTS_DIR, help="folder for bench-<date>.json/.png")
    p.add_argument("--geometries", default=",".join(bench.GRID_GEOMETRIES))
    p.add_argument("--batches", default=",".join(map(str, bench.GRID_BATCHES)))
    p.add_argument("--decode-query-lens", default=",".join(map(str, bench.GRID_QLENS)),
                   help="query tokens per request (qlen) of the grid")
    p.add_argument("--q-dtype", default="bfloat16", choices=list(Q_DTYPES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--baseline", default="auto",
                   help="result JSON to compare with (default: the newest in --out; 'none' to skip); "
                        "exit 1 if a point is >5%% slower")
    p.add_argument("--table", metavar="RESULT_JSON",
                   help="print the README's markdown table of a result file and exit (no GPU)")


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit bench`."""
    if args.table:  # no GPU: print the README table of a result file
        print(bench.readme_table(json.loads(Path(args.table).read_text())))
        return 0
    geos = tuple(args.geometries.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    qlens = tuple(int(q) for q in args.decode_query_lens.split(","))
    result = bench.main(args.out, geometries=geos, batches=batches, qlens=qlens, q_dtype=args.q_dtype,
                        iters=args.iters, baseline=args.baseline)
    return 1 if result.get("regressions") else 0
