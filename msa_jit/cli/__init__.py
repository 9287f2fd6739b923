"""The `msa-jit` command: warmup | cache | doctor | inspect | bench | selftest.

One module per command, each with `HELP`, `add_arguments(p)` and `run(args) -> int` (the exit
status); `common.py` holds what several share. The modules stay thin: the work is done by the
library (`msa_jit.tools.warmup`, `msa_jit.tools.doctor`, `msa_jit.tools.bench`, ...), which never imports this
package.

Conventions of every command: `msa-jit` or `msa-jit cache` alone prints its help (exit 2, a
usage error); `--json [FILE]` writes JSON into FILE, or onto stdout; exit 2 for a bad flag or
an MSA_JIT_* variable that does not parse (checked before any work; `msa-jit doctor` shows
them instead), and for a cache or file error, which is printed as one line, not a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .. import __version__, env
from ..jit.cache import CacheError
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
# variables the commands other than doctor refuse to start with when they do not parse (the log
# level falls back to WARNING with a warning instead; the vLLM ones are read by vLLM processes only)
CHECKED_VARIABLES = tuple(v for v in env.VARIABLES if v not in (env.LOG_LEVEL, env.VLLM_PLUGIN, env.VLLM_SM100))


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every subcommand (each sets `func` to its module's `run`)."""
    p = argparse.ArgumentParser(prog="msa-jit", description="JIT-compiled MSA sparse decode kernels")
    p.add_argument("--version", action="version", version=f"msa-jit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    p.set_defaults(func=None, help_of=p)
    for name, module in COMMANDS.items():
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sp)
        sp.set_defaults(func=module.run, help_of=sp)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `msa-jit` / `python -m msa_jit`; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.func is None or (args.command == "cache" and args.cache_command is None):
        args.help_of.print_help()
        return 2
    configure_logging()
    name = args.command if args.command != "cache" else f"cache {args.cache_command}"
    if args.command != "doctor":
        problems = env.problems(CHECKED_VARIABLES)
        for problem in problems:
            print(f"msa-jit {name}: {problem}", file=sys.stderr)
        if problems:
            print(f"msa-jit {name}: fix or unset the variable (`msa-jit doctor` lists them all)", file=sys.stderr)
            return 2
    try:
        return args.func(args)
    except BrokenPipeError:  # `msa-jit ... | head`: the reader is gone, as for any Unix tool (no message)
        try:  # so the interpreter's final flush of stdout does not raise again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
    except (CacheError, OSError) as e:  # the cache, a file, a disk: a message, not a traceback
        logging.getLogger("msa_jit").debug("msa-jit %s failed", name, exc_info=True)
        print(f"msa-jit {name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
