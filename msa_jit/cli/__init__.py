"""The `msa-jit` command: warmup | cache | doctor | inspect | bench | selftest.

One module per command, each with `HELP`, `add_arguments(p)` and `run(args) -> int` (the exit
status); `common.py` holds what several share. The modules stay thin: the work is done by the
library (`msa_jit.warmup`, `msa_jit.doctor`, `msa_jit.bench`, ...), which never imports this
package.
"""

from __future__ import annotations

import argparse

from ..logs import configure_logging
from . import bench, cache, doctor, inspect, selftest, warmup

__all__ = ["build_parser", "main"]

# subcommand name -> module, in the order `msa-jit --help` lists them
COMMANDS = {
    "warmup": warmup,
    "cache": cache,
    "doctor": doctor,
    "inspect": inspect,
    "bench": bench,
    "selftest": selftest,
}


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every subcommand (each sets `func` to its module's `run`)."""
    p = argparse.ArgumentParser(prog="msa-jit", description="JIT-compiled MSA sparse decode kernels")
    sub = p.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        sp = sub.add_parser(name, help=module.HELP)
        module.add_arguments(sp)
        sp.set_defaults(func=module.run)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `msa-jit` / `python -m msa_jit`; returns the exit status."""
    args = build_parser().parse_args(argv)
    configure_logging()
    return args.func(args)
