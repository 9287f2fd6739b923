"""The `msa-jit` command: warmup | cache | doctor | bench | inspect."""

from __future__ import annotations

import argparse
import sys


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    geos = tuple(args.geometries.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    qlens = tuple(int(q) for q in args.qlens.split(","))
    result = bench.main(args.out, geometries=geos, batches=batches, qlens=qlens, q_dtype=args.q_dtype,
                        iters=args.iters, baseline=args.baseline)
    return 1 if result.get("regressions") else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="msa-jit", description="JIT-compiled MSA sparse decode kernels")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="benchmark grid on this GPU: JSON + PNG (needs CUDA)")
    b.add_argument("--out", default="bench/results", help="folder for bench-<date>.json/.png")
    b.add_argument("--geometries", default="64/4,16/1,8/1")
    b.add_argument("--batches", default="1,4,16,64,256")
    b.add_argument("--qlens", default="1,4")
    b.add_argument("--q-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    b.add_argument("--iters", type=int, default=50)
    b.add_argument("--baseline", default=None, help="previous result JSON: flag points slower than it")
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
