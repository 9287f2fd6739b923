"""`msa-jit bench`: the performance grid on a GPU (`msa_jit.tools.bench`), or a result file's table / targets.

Writes bench-<date>.json/.png into --out (created once the grid has run), compares with the
newest previous result (exit 2 without a CUDA GPU or for a bad flag, nothing written; exit 1 on
a point or per-layer row more than 5% slower, a row that failed, or a run stopped by SIGTERM:
the rows done are written) and prints the latency and NVFP4 targets. `--table RESULT_JSON`
prints the README's tables of a result file, `--summary RESULT_JSON` its targets; neither
needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..tools import bench
from ..tools.bench.report import result_problem
from ..geometry import KV_DTYPE_SHORT, MAX_QLEN, MIN_QLEN
from .common import int_at_least, parse_kv_dtype, positive_int, q_dtype_arg, split_list

HELP = "benchmark grid on this GPU: JSON + PNG (needs CUDA)"
MIN_LAYERS = 2  # the per-layer figure is (t(L) - t(1)) / (L - 1)


def _ints(flag: str, text: str, allow_empty: bool = False, low: int = 1, high: int | None = None
          ) -> tuple[int, ...]:
    """A comma list of ints in low..high (no upper bound for None); ValueError naming `flag`."""
    items = split_list(flag, text, allow_empty=allow_empty)
    try:
        values = tuple(int(v) for v in items)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated ints") from None
    if any(v < low or (high is not None and v > high) for v in values):
        raise ValueError(f"{flag} {text!r}: expected ints " + (f"in {low}..{high}" if high is not None else f">= {low}"))
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The grid (--geometries, --batches, --decode-query-lens, --kv-dtypes, --q-dtype, --quick,
    --floor-batches, --no-shared, --layers, --iters, --in-graph, --no-host), --out, --baseline,
    --table, --summary."""
    p.add_argument("--out", default=bench.RESULTS_DIR, help="folder for bench-<date>.json/.png")
    p.add_argument("--geometries", default=",".join(bench.GRID_GEOMETRIES),
                   help="comma list of Hq/Hkv (default: %(default)s)")
    p.add_argument("--batches", default=",".join(map(str, bench.GRID_BATCHES)),
                   help="comma list of batch sizes (default: %(default)s)")
    p.add_argument("--decode-query-lens", default=None,
                   help=f"query tokens per request (qlen) of the grid, each in {MIN_QLEN}..{MAX_QLEN} (default "
                        f"{','.join(map(str, bench.GRID_QLENS))}; --quick: {','.join(map(str, bench.QUICK_QLENS))})")
    p.add_argument("--kv-dtypes", default=",".join(KV_DTYPE_SHORT[k] for k in bench.GRID_KV_DTYPES),
                   help=f"cache formats to time, of {','.join(KV_DTYPE_SHORT.values())} (as warmup's --kv-dtype)")
    p.add_argument("--q-dtype", default="bfloat16", type=q_dtype_arg, help="bf16 or fp8 (as warmup's --q-dtype)")
    p.add_argument("--quick", action="store_true",
                   help="about half the rows: qlen 1 and 4 only, one speculative-decode point (64/4 B=64 qlen 4)")
    p.add_argument("--floor-batches", default=",".join(map(str, bench.FLOOR_BATCHES)),
                   help="batches whose rows get the floor probe ('' for none)")
    p.add_argument("--no-shared", action="store_true", help="skip the speculative-decode (shared-block) rows")
    p.add_argument("--layers", type=int_at_least(MIN_LAYERS), default=bench.NUM_LAYERS,
                   help=f"layers per graph of the per-layer figure (>= {MIN_LAYERS})")
    p.add_argument("--iters", type=positive_int, default=50, help="timed graph replays per figure")
    p.add_argument("--in-graph", action="store_true", help="also time each one-layer step inside one larger graph")
    p.add_argument("--no-host", action="store_true", help="skip the host-side (CPU) figures")
    p.add_argument("--baseline", default="auto",
                   help="result JSON to compare with (default: the newest in --out, or with --summary the file the "
                        "result names; 'none' to skip); exit 1 if a point is >5%% slower")
    p.add_argument("--table", metavar="RESULT_JSON",
                   help="print the README's markdown tables of a result file and exit (no GPU)")
    p.add_argument("--summary", metavar="RESULT_JSON",
                   help="print the latency and NVFP4 targets of a result file, measured vs goal, and exit (no GPU)")


def _load_result(flag: str, path: str) -> dict:
    """The bench result in file `path`, or exit 2 with a message naming `flag` and `path`."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        problem = f"cannot read it ({e.strerror or e})"
    except ValueError as e:
        problem = f"not JSON ({e})"
    else:
        why = result_problem(doc)
        if why is None:
            return doc
        problem = f"not a bench result ({why})"
    print(f"msa-jit bench: {flag} {path}: {problem}", file=sys.stderr)
    raise SystemExit(2)


def _summary_baseline(args: argparse.Namespace, result: dict) -> dict | None:
    if args.baseline in (None, "none"):
        return None
    path = result.get("baseline") if args.baseline == "auto" else args.baseline
    if not path or not Path(path).is_file():
        if args.baseline != "auto":
            print(f"msa-jit bench: --baseline {path}: no such file", file=sys.stderr)
            raise SystemExit(2)  # a bad flag: exit 2 with a message, as every other
        return None
    return _load_result("--baseline", path)


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit bench`."""
    for flag, path in (("--table", args.table), ("--summary", args.summary)):
        if not path:
            continue
        result = _load_result(flag, path)  # no GPU: the README tables or the targets of a result file
        try:
            if flag == "--table":
                print(bench.readme_table(result))
            else:
                print(bench.format_targets(bench.check_targets(result, _summary_baseline(args, result))))
        except (KeyError, TypeError) as e:
            print(f"msa-jit bench: {flag} {path}: not a bench result (missing {e})", file=sys.stderr)
            return 2
        return 0
    try:
        geos = tuple(split_list("--geometries", args.geometries))
        bad = [g for g in geos if g not in bench.GEOMETRIES]
        if bad:
            raise ValueError(f"--geometries: unknown {', '.join(map(repr, bad))}; geometries are "
                             f"{', '.join(bench.GEOMETRIES)}")
        kvs = tuple(parse_kv_dtype(k, "--kv-dtypes") for k in split_list("--kv-dtypes", args.kv_dtypes))
        batches = _ints("--batches", args.batches)
        floor_batches = _ints("--floor-batches", args.floor_batches, allow_empty=True)
        qlens = (_ints("--decode-query-lens", args.decode_query_lens, low=MIN_QLEN, high=MAX_QLEN)
                 if args.decode_query_lens is not None else bench.QUICK_QLENS if args.quick else bench.GRID_QLENS)
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
    shared = () if args.no_shared else bench.QUICK_SHARED_POINTS if args.quick else bench.SHARED_POINTS
    result = bench.main(args.out, geometries=geos, batches=batches, qlens=qlens, kv_dtypes=kvs,
                        q_dtype=args.q_dtype, shared_points=shared, floor_batches=floor_batches,
                        iters=args.iters, num_layers=args.layers, in_graph=args.in_graph, host=not args.no_host,
                        baseline=args.baseline)
    return 1 if result.get("regressions") or result.get("errors") or result.get("incomplete") else 0
