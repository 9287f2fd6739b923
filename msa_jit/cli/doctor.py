"""`msa-jit doctor`: GPU / arch, driver, versions, toolchain, cache, environment, readiness.

The report is `msa_jit.tools.doctor.collect()`; exit 0 unless printing itself fails (2 for a --json
FILE that cannot be written). It runs whatever the MSA_JIT_* variables hold: an invalid one
is shown, not refused (the other commands refuse to start with one). It changes nothing on
disk (not even the cache entries' last-used times).
"""

from __future__ import annotations

import argparse
import json

from .common import add_json_argument, emit_json, import_holding_interrupts, json_path_problem, text_stream

HELP = "GPU, driver, versions, compiler/runtime, cache, env, readiness"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--json [FILE], --cache-dir."""
    add_json_argument(p, "the report")
    p.add_argument("--cache-dir", help="cache root to report on")


def run(args: argparse.Namespace) -> int:
    """Handler of `msa-jit doctor` (always exit 0 unless printing itself fails)."""
    from ..tools import doctor

    if json_path_problem(args, "doctor"):
        return 2
    import_holding_interrupts("torch")  # the probes import it; a Ctrl-C inside that import would abort
    report = doctor.collect(getattr(args, "cache_dir", None))
    out = text_stream(args)
    try:
        print(doctor.render(report), file=out)
    except Exception as e:  # a bug in rendering must still show the data
        print(f"(rendering failed: {type(e).__name__}: {e})", file=out)
        if not args.json:
            print(json.dumps(report, indent=1, default=str), file=out)
    if args.json:
        emit_json(args.json, report)
    return 0
