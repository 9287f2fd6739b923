"""`msa-jit bench`: the performance grid on a GPU (`msa_jit.bench`), or a result file's table.

Writes bench-<date>.json/.png into --out (created once the grid has run) and compares with the
newest previous result; exit 1 on a point more than 5% slower, 2 without a CUDA GPU or for a
bad flag. `--table RESULT_JSON` prints the README's table of a result file and needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .. import bench
from .common import positive_int, q_dtype_arg

HELP = "benchmark grid on this GPU: JSON + PNG (needs CUDA)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The grid (--geometries, --batches, --decode-query-lens, --q-dtype, --iters), --out, --baseline, --table."""
    p.add_argument("--out", default=bench.RESULTS_DIR, help="folder for bench-<date>.json/.png")
    p.add_argument("--geometries", default=",".join(bench.GRID_GEOMETRIES),
                   help=f"Hq/Hkv layouts, comma-separated, of {', '.join(bench.GEOMETRIES)}")
    p.add_argument("--batches", default=",".join(map(str, bench.GRID_BATCHES)))
    p.add_argument("--decode-query-lens", default=",".join(map(str, bench.GRID_QLENS)),
                   help="query tokens per request (qlen) of the grid")
    p.add_argument("--q-dtype", default="bfloat16", type=q_dtype_arg, help="bf16 or fp8 (as warmup's --q-dtype)")
    p.add_argument("--iters", type=positive_int, default=50)
    p.add_argument("--baseline", default="auto",
                   help="result JSON to compare with (default: the newest in --out; 'none' to skip); "
                        "exit 1 if a point is >5%% slower")
    p.add_argument("--table", metavar="RESULT_JSON",
                   help="print the README's markdown table of a result file and exit (no GPU)")


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated ints") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} {text!r}: expected ints >= 1")
    return values


def out_dir_problem(out: Path) -> str | None:
    """Why --out could not be written once the grid has run (None when it can): checked first."""
    if out.exists() and not out.is_dir():
        return f"{out} is not a directory"
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not a writable directory"
    return None


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit bench`."""
    if args.table:  # no GPU: print the README table of a result file
        try:
            print(bench.readme_table(json.loads(Path(args.table).read_text(encoding="utf-8"))))
        except OSError as e:
            print(f"msa-jit bench: --table {args.table}: cannot read it ({e.strerror or e})", file=sys.stderr)
            return 2
        except ValueError as e:
            print(f"msa-jit bench: --table {args.table}: not JSON ({e})", file=sys.stderr)
            return 2
        except (KeyError, TypeError) as e:
            print(f"msa-jit bench: --table {args.table}: not a bench result with the README's grid "
                  f"(missing {e})", file=sys.stderr)
            return 2
        return 0
    try:
        geos = tuple(args.geometries.split(","))
        unknown = [g for g in geos if g not in bench.GEOMETRIES]
        if unknown:
            raise ValueError(f"--geometries {args.geometries!r}: {', '.join(unknown)} not in {', '.join(bench.GEOMETRIES)}")
        batches = _ints("--batches", args.batches)
        qlens = _ints("--decode-query-lens", args.decode_query_lens)
        problem = out_dir_problem(Path(args.out).absolute())
        if problem:
            raise ValueError(f"--out {args.out}: {problem}")
    except ValueError as e:
        print(f"msa-jit bench: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("msa-jit bench needs a CUDA GPU (torch.cuda.is_available() is False); nothing was written. "
              "`msa-jit bench --table RESULT_JSON` prints a result's table without one", file=sys.stderr)
        return 2
    result = bench.main(args.out, geometries=geos, batches=batches, qlens=qlens, q_dtype=args.q_dtype,
                        iters=args.iters, baseline=args.baseline)
    return 1 if result.get("regressions") else 0
