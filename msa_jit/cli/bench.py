"""`msa-jit bench`: the performance grid on a GPU (`msa_jit.tools.bench`), or a result file's tables.

Writes bench-<date>.json/.png into --out (created once the grid has run), compares with the
newest previous result or --baseline (exit 2 without a CUDA GPU, for a bad flag or a --baseline
that is no bench result, nothing written; exit 1 on a point or per-layer row more than 5% slower,
a row that failed, a baseline that could not be compared, or a run stopped by SIGTERM: the rows
done are written). `--compare flashinfer,vllm` times those peers beside msa-jit on every row.
`--table RESULT_JSON` prints a result file's tables (no GPU needed; no other flag goes with it).
The grid's flags are the shared vocabulary (`--heads`, `--q-dtype`, `--kv-dtype`:
see `common`), and `--batch`, `--decode-query-len`, `--floor-batch` take comma lists alike.
Nothing of the bench (torch, triton) is imported until the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ..geometry import KV_DTYPE_SHORT, MAX_QLEN, MIN_QLEN
from .common import add_alias, add_dtype_arguments, add_heads_argument, heads_from, import_holding_interrupts, \
    int_at_least, kv_dtypes_from, one_of, positive_int, q_dtypes_from, split_list

HELP = "benchmark grid on this GPU: JSON + PNG (needs CUDA)"
MIN_LAYERS = 2  # the per-layer figure is (t(L) - t(1)) / (L - 1)


def _ints(flag: str, text: str | list[str], allow_empty: bool = False, low: int = 1, high: int | None = None
          ) -> tuple[int, ...]:
    """A comma list of ints in low..high (no upper bound for None); ValueError naming `flag`."""
    items = split_list(flag, text, allow_empty=allow_empty)
    if not isinstance(text, str):
        text = ",".join(text)
    try:
        values = tuple(int(v) for v in items)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated ints") from None
    if any(v < low or (high is not None and v > high) for v in values):
        raise ValueError(f"{flag} {text!r}: expected ints " + (f"in {low}..{high}" if high is not None else f">= {low}"))
    return values


def out_dir_problem(out: Path) -> str | None:
    """Why --out could not be written once the grid has run (None when it can): checked first.

    A directory is really made (and removed) in it or in its nearest existing ancestor, as the
    result's folder will be: permission bits do not stop root, and a read-only, full or pseudo
    filesystem (/proc) only says no then."""
    if out.exists() and not out.is_dir():
        return f"{out} is not a directory"
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a writable directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".msa-jit-bench-", dir=existing))
    except OSError as e:
        from ..jit.cache.errors import describe_oserror

        return f"{existing} is not a writable directory ({describe_oserror(e)})"
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The grid (--heads, --batch, --decode-query-len, --q-dtype, --kv-dtype, --quick, --floor-batch,
    --no-shared, --layers, --iters, --in-graph, --no-host), --compare, --out, --baseline, --table."""
    from ..tools.bench import grid  # the grid's definition only: no torch

    p.add_argument("--out", default=grid.RESULTS_DIR, help="folder for bench-<date>.json/.png (default: %(default)s)")
    add_heads_argument(p, f"of {', '.join(grid.GEOMETRIES)}; default {','.join(grid.GRID_GEOMETRIES)}")
    add_alias(p, "--geometries", "--heads", "heads")
    p.add_argument("--batch", action="append", metavar="N[,...]",
                   help=f"batch sizes, comma-separated or repeated (default {','.join(map(str, grid.GRID_BATCHES))})")
    add_alias(p, "--batches", "--batch", "batch")
    p.add_argument("--decode-query-len", action="append", metavar="N[,...]",
                   help=f"query tokens per request (qlen) of the grid, each in {MIN_QLEN}..{MAX_QLEN} (default "
                        f"{','.join(map(str, grid.GRID_QLENS))}; --quick: {','.join(map(str, grid.QUICK_QLENS))})")
    add_alias(p, "--decode-query-lens", "--decode-query-len", "decode_query_len")
    add_dtype_arguments(p, "one per run; default bf16",
                        f"default {','.join(KV_DTYPE_SHORT[k] for k in grid.GRID_KV_DTYPES)}")
    add_alias(p, "--kv-dtypes", "--kv-dtype", "kv_dtype")
    p.add_argument("--quick", action="store_true",
                   help="about half the rows: qlen 1 and 4 only, one speculative-decode point (64/4 B=64 qlen 4)")
    p.add_argument("--floor-batch", action="append", metavar="N[,...]",
                   help="batches whose rows get the floor probe (default "
                        f"{','.join(map(str, grid.FLOOR_BATCHES))}; '' for none)")
    add_alias(p, "--floor-batches", "--floor-batch", "floor_batch")
    p.add_argument("--no-shared", action="store_true", help="skip the speculative-decode (shared-block) rows")
    p.add_argument("--layers", type=int_at_least(MIN_LAYERS), default=grid.NUM_LAYERS,
                   help=f"layers per graph of the per-layer figure (>= {MIN_LAYERS}; default %(default)s)")
    p.add_argument("--iters", type=positive_int, default=50, help="timed graph replays per figure (default 50)")
    p.add_argument("--in-graph", action="store_true", help="also time each one-layer step inside one larger graph")
    p.add_argument("--no-host", action="store_true", help="skip the host-side (CPU) figures")
    p.add_argument("--compare", metavar="PEERS", default=None,
                   help="also time these peers on every row, the same way on the same steps, and check their outputs "
                        "agree: a comma list of flashinfer (FlashInfer's SM90 MSA decode), vllm (vLLM 0.33's Triton "
                        "MiniMax-M3 decode); rows get speedup_vs_<peer> = peer time / msa-jit time")
    p.add_argument("--baseline", default="auto",
                   help="result JSON to compare with (default: the newest in --out from this GPU; 'none' to skip); "
                        "exit 1 if a point is >5%% slower")
    p.add_argument("--table", metavar="RESULT_JSON",
                   help="print the markdown tables of a result file and exit (no GPU)")


def _load_result(flag: str, path: str) -> dict:
    """The bench result in file `path`, or exit 2 with a message naming `flag` and `path`."""
    from ..tools.bench.report import result_problem

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


def _flags_beside_table(args: argparse.Namespace) -> list[str]:
    """The flags given with --table, which ignores them all (`--baseline none` asks for nothing)."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_arguments(defaults)
    given = []
    for action in defaults._actions:
        flag = action.option_strings[0]
        if action.dest == "table" or action.default is argparse.SUPPRESS or flag in given:
            continue  # a deprecated spelling stores into its flag's dest: that flag names it
        value = getattr(args, action.dest, action.default)
        if value != action.default and not (action.dest == "baseline" and value == "none"):
            given.append(flag)
    return given


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit bench`."""
    from ..tools import bench
    from ..tools.bench import grid

    if args.table:
        others = _flags_beside_table(args)
        if others:
            print(f"msa-jit bench: --table prints a result file's tables and runs nothing: {', '.join(others)} "
                  "cannot go with it", file=sys.stderr)
            return 2
        result = _load_result("--table", args.table)  # no GPU: the tables of a result file
        try:
            print(bench.result_tables(result))
        except KeyError as e:
            print(f"msa-jit bench: --table {args.table}: not a bench result (missing {e})", file=sys.stderr)
            return 2
        except (TypeError, ValueError) as e:  # what result_problem does not foresee: still one line
            print(f"msa-jit bench: --table {args.table}: not a bench result ({e})", file=sys.stderr)
            return 2
        return 0
    try:
        geos = tuple(f"{hq}/{hkv}" for hq, hkv in heads_from(args)) or grid.GRID_GEOMETRIES
        bad = [g for g in geos if g not in grid.GEOMETRIES]
        if bad:
            raise ValueError(f"--heads: no bench geometry {', '.join(map(repr, bad))}; the bench has "
                             f"{', '.join(grid.GEOMETRIES)}")
        kvs = tuple(kv_dtypes_from(args)) or grid.GRID_KV_DTYPES
        q_dtype = one_of("--q-dtype", q_dtypes_from(args), "a run times one query dtype") or "bfloat16"
        batches = _ints("--batch", args.batch) if args.batch is not None else grid.GRID_BATCHES
        floor_batches = (_ints("--floor-batch", args.floor_batch, allow_empty=True) if args.floor_batch is not None
                         else grid.FLOOR_BATCHES)
        qlens = (_ints("--decode-query-len", args.decode_query_len, low=MIN_QLEN, high=MAX_QLEN)
                 if args.decode_query_len is not None else grid.QUICK_QLENS if args.quick else grid.GRID_QLENS)
        from ..tools.bench.peers import make_peers, parse_compare

        compare = parse_compare(args.compare) if args.compare is not None else ()
        problem = out_dir_problem(Path(args.out).absolute())
        if problem:
            raise ValueError(f"--out {args.out}: {problem}")
    except ValueError as e:
        print(f"msa-jit bench: {e}", file=sys.stderr)
        return 2
    if args.baseline not in ("auto", "none"):  # read now: after the grid a bad one would cost the run
        _load_result("--baseline", args.baseline)
    import_holding_interrupts("torch")  # a Ctrl-C inside torch's import would abort the process
    import torch

    if not torch.cuda.is_available():
        print("msa-jit bench needs a CUDA GPU (torch.cuda.is_available() is False); nothing was written. "
              "`msa-jit bench --table RESULT_JSON` prints a result's table without one", file=sys.stderr)
        return 2
    shared = () if args.no_shared else bench.QUICK_SHARED_POINTS if args.quick else bench.SHARED_POINTS
    result = bench.main(args.out, geometries=geos, batches=batches, qlens=qlens, kv_dtypes=kvs,
                        q_dtype=q_dtype, shared_points=shared, floor_batches=floor_batches,
                        iters=args.iters, num_layers=args.layers, in_graph=args.in_graph, host=not args.no_host,
                        baseline=args.baseline, **({"peers": make_peers(compare)} if compare else {}))
    return 1 if (result.get("regressions") or result.get("errors") or result.get("incomplete")
                 or result.get("baseline_error")) else 0
