"""`msa-jit doctor`: GPU / arch, driver, versions, toolchain, cache, environment, readiness.

The report is `msa_jit.doctor.collect()`; exit 0 unless printing itself fails.
"""

from __future__ import annotations

import argparse
import json

from .. import doctor

HELP = "GPU, driver, versions, compiler/runtime, cache, env, readiness"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--json, --cache-dir."""
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--cache-dir", help="cache root to report on")


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit doctor` (always exit 0 unless printing itself fails)."""
    report = doctor.collect(getattr(args, "cache_dir", None))
    if getattr(args, "json", False):
        print(json.dumps(report, indent=1, default=str))
    else:
        try:
            print(doctor.render(report))
        except Exception as e:  # a bug in rendering must still show the data
            print(f"(rendering failed: {type(e).__name__}: {e})")
            print(json.dumps(report, indent=1, default=str))
    return 0
