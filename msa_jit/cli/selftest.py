"""`msa-jit selftest`: hardware check of the GPU it runs on.

The correctness grid (`msa_jit.tools.selftest.correctness_grid`: every MiniMax-M3 geometry x qlen
x query dtype x batch on every occupancy, against the float64 reference), then the bench.
Exit 0 only if every case passes; 2 without a GPU or on an --arch that is not this GPU's.
"""

from __future__ import annotations

import argparse
import sys
import time

HELP = "hardware check of this GPU: correctness on the full grid, then bench"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--arch, --quick, --no-bench, --out, --iters."""
    from ..tools.bench.grid import RESULTS_DIR
    from .common import add_arch_argument, positive_int

    add_arch_argument(p, "expected arch of this GPU (sm_90a or sm_100a, one: the selftest checks the GPU it runs "
                         "on); refuse if it differs")
    p.add_argument("--quick", action="store_true", help="a subset of the grid (qlen 1/4, batch 1/16)")
    p.add_argument("--no-bench", action="store_true", help="stop after the correctness grid")
    p.add_argument("--out", default=RESULTS_DIR, help="folder for the bench JSON/PNG (default: %(default)s)")
    p.add_argument("--iters", type=positive_int, default=50, help="timed graph replays per bench figure (default 50)")


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit selftest`."""
    from .common import arches_from, import_holding_interrupts, one_of

    try:
        expected = one_of("--arch", arches_from(args), "the selftest checks the GPU it runs on")
    except ValueError as e:
        print(f"msa-jit selftest: {e}", file=sys.stderr)
        return 2
    import_holding_interrupts("torch")  # a Ctrl-C inside torch's import would abort the process
    import torch

    from ..tools import selftest
    from ..jit.registry import kernel_family
    from ..geometry import SparseDecodeConfig, device_arch

    if not torch.cuda.is_available():
        print("msa-jit selftest needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    arch = device_arch(0)
    if expected and expected != arch:
        print(f"msa-jit selftest: --arch {expected} given, but this GPU is {arch} ({torch.cuda.get_device_name()}): "
              "the selftest checks the GPU it runs on", file=sys.stderr)
        return 2
    family = kernel_family(SparseDecodeConfig(num_q_heads=64, num_kv_heads=4, arch=arch))
    print(f"selftest on {torch.cuda.get_device_name()} ({arch}), kernel family: {family}")
    t0 = time.time()
    rows = selftest.correctness_grid(quick=args.quick)
    failed = [r for r in rows if r["problems"]]
    def worst(key: str) -> float:  # over the cases that got a figure (a failed launch has nan)
        return max((r[key] for r in rows if r[key] == r[key]), default=float("nan"))

    print(f"correctness: {len(rows) - len(failed)}/{len(rows)} cases passed, worst rel L2 {worst('rel_l2'):.2e}, "
          f"worst row {worst('worst_row_rel_l2'):.2e} ({time.time() - t0:.0f} s)")
    if failed:
        return 1
    if not args.no_bench:
        from ..tools import bench

        bench.main(args.out, iters=args.iters)
    return 0
