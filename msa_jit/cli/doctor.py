"""`msa-jit doctor`: GPU / arch, driver, versions, toolchain, cache, environment, readiness.

The report is `msa_jit.tools.doctor.collect()`; exit 0 unless printing itself fails (2 for a --json
FILE that cannot be written). It runs whatever the MSA_JIT_* variables hold: an invalid one
is shown, not refused (the other commands refuse to start with one).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..tools import doctor
from .common import add_json_argument, check_output_path, emit_json

HELP = "GPU, driver, versions, compiler/runtime, cache, env, readiness"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--json [FILE], --cache-dir."""
    add_json_argument(p, "the report")
    p.add_argument("--cache-dir", help="cache root to report on")


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit doctor` (always exit 0 unless printing itself fails)."""
    problem = check_output_path(getattr(args, "json", None))
    if problem:
        print(f"msa-jit doctor: --json {args.json}: {problem}", file=sys.stderr)
        return 2
    report = doctor.collect(getattr(args, "cache_dir", None))
    if getattr(args, "json", None):
        emit_json(args.json, report)
    else:
        try:
            print(doctor.render(report))
        except Exception as e:  # a bug in rendering must still show the data
            print(f"(rendering failed: {type(e).__name__}: {e})")
            print(json.dumps(report, indent=1, default=str))
    return 0
