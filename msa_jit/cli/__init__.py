"""The `msa-jit` command: warmup | cache | doctor | inspect | bench | selftest.

One module per command, each with `HELP`, `add_arguments(p)` and `run(args) -> int` (the exit
status); `common.py` holds what several share. The modules stay thin: the work is done by the
library (`msa_jit.tools.warmup`, `msa_jit.tools.doctor`, `msa_jit.tools.bench`, ...), which never
imports this package. Building the parser imports no torch, triton, cutlass or bench code: a
command module imports what its work needs inside `run`, so `msa-jit --version` and every
`--help` answer at once (the package itself is imported lazily in the command's process: see
`msa_jit/__init__.py`).

Exit status of every command:

    0    done
    1    the work failed: a build, a bad cache entry, a bench regression, a selftest case
    2    a usage or configuration error, found before any work: a bad flag, an MSA_JIT_*
         variable that does not parse (`msa-jit doctor` shows them instead), a --cache-dir,
         --json or --out path that cannot be used; also a cache or file error met during the
         work (one line, not a traceback)
    130  interrupted (Ctrl-C / SIGINT), at any moment: one line on stderr, no traceback
    141  stdout's reader went away (`msa-jit cache list | head`): no message, as any Unix tool

Conventions: `msa-jit` or `msa-jit cache` alone prints its help (exit 0); `--json [FILE]` means
the same wherever it is accepted (`common.add_json_argument`).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import signal
import sys
import threading

from .. import env
from . import common

__all__ = ["build_parser", "main"]

# subcommand name -> module (msa_jit.cli.<name>), in the order `msa-jit --help` lists them
COMMANDS = ("warmup", "cache", "doctor", "inspect", "bench", "selftest")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PIPE = 0, 1, 2, 141

EPILOG = ("exit status: 0 done, 1 the work failed, 2 a usage or configuration error (before any work), "
          "130 interrupted, 141 stdout closed by its reader")


# variables the commands other than doctor refuse to start with when they do not parse (the log
# level falls back to WARNING with a warning instead; the vLLM ones are read by vLLM processes only)
CHECKED_VARIABLES = tuple(v for v in env.VARIABLES if v not in (env.LOG_LEVEL, env.VLLM_PLUGIN, env.VLLM_SM100))


class _VersionAction(argparse.Action):
    """`--version`: 'msa-jit X.Y.Z' on stdout, exit 0 (the version is read only when asked for)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default,
                         help="show the version and exit" if help is None else help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import msa_jit

        sys.stdout.write(f"msa-jit {msa_jit.__version__}\n")
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a help or usage text that cannot be written to a closed stdout
    raises (BrokenPipeError: exit 141 in `main`, as any other output) instead of being dropped
    silently, which made `msa-jit --help | true` look like a success."""

    def _print_message(self, message: str, file=None) -> None:
        if message and file is sys.stdout:
            file.write(message)
            return
        super()._print_message(message, file)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argparse tree of every subcommand (each sets `func` to its module's `run`).

    `only`: the command about to run; the other subcommands get their name and help line but not
    their flags (what `msa-jit --help` shows), so that a command builds only its own flags."""
    p = _Parser(prog="msa-jit", description="JIT-compiled MSA sparse decode kernels", epilog=EPILOG)
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    p.set_defaults(func=None, help_of=p)
    for name in COMMANDS:
        module = importlib.import_module(f".{name}", __name__)
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP, epilog=EPILOG)
        if only is None or only == name:
            module.add_arguments(sp)
        sp.set_defaults(func=module.run, help_of=sp)
    return p


def _command_process() -> bool:
    import msa_jit

    return bool(getattr(msa_jit, "_COMMAND_PROCESS", False))


if _command_process():
    # registered when the command's process starts, so it runs after every atexit callback registered
    # later (the in-process temporary cache's removal among them)
    atexit.register(common.exit_at_the_end)


# ----------------------------------------------------------------------------- main
def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null, so the interpreter's final flush of what is
    still buffered does not raise again (as 'Exception ignored ... BrokenPipeError')."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor
        pass


def _run(argv: list[str] | None, name: list[str]) -> int:
    from ..logs import configure_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    # the top-level parser has options only: the first other word names the command
    command = next((a for a in argv if not a.startswith("-")), "")
    try:
        args = build_parser(only=command).parse_args(argv)
    except SystemExit as e:  # --help, --version, a usage error: argparse has printed what it had to
        if isinstance(e.code, int) or e.code is None:
            sys.stdout.flush()
            return e.code or EXIT_OK
        raise
    if args.func is None or (args.command == "cache" and args.cache_command is None):
        args.help_of.print_help()
        return EXIT_OK
    configure_logging()
    name[0] = "msa-jit " + (args.command if args.command != "cache" else f"cache {args.cache_command}")
    if args.command != "doctor":
        problems = env.problems(CHECKED_VARIABLES)
        for problem in problems:
            print(f"{name[0]}: {problem}", file=sys.stderr)
        if problems:
            print(f"{name[0]}: fix or unset the variable (`msa-jit doctor` lists them all)", file=sys.stderr)
            return EXIT_USAGE
        reads_only = args.command == "cache" and (args.cache_command in ("list", "info")
                                                  or args.cache_command == "verify" and not args.remove)
        problem = common.cache_dir_problem(getattr(args, "cache_dir", None), reads_only)
        if problem:  # a root that cannot be one: refused, not a silent fallback elsewhere
            print(f"{name[0]}: {problem}", file=sys.stderr)
            return EXIT_USAGE
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `msa-jit` / `python -m msa_jit`; returns the exit status (module docstring)."""
    main_thread = threading.current_thread() is threading.main_thread()
    old_handler = signal.getsignal(signal.SIGINT) if main_thread else None
    if main_thread:
        common.reset_interrupts()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the work sees KeyboardInterrupt
    name = ["msa-jit"]
    rc = EXIT_FAILED
    try:
        try:
            rc = _run(argv, name)
            sys.stdout.flush()  # here, so that a closed pipe is seen by the handler below
        except KeyboardInterrupt:
            if main_thread:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # first: a second Ctrl-C must not land in here
            common.say_interrupted(f"{name[0]}: interrupted")
            rc = common.EXIT_INTERRUPTED
        except BrokenPipeError:  # `msa-jit ... | head`: the reader is gone, as for any Unix tool (no message)
            _quiet_stdout()
            rc = EXIT_PIPE
        except Exception as e:
            from ..jit.cache.errors import CacheError

            if not isinstance(e, (CacheError, OSError)):
                raise
            # the cache, a file, a disk: a message, not a traceback
            import logging

            logging.getLogger("msa_jit").debug("%s failed", name[0], exc_info=True)
            print(f"{name[0]}: {type(e).__name__}: {e}", file=sys.stderr)
            rc = EXIT_USAGE
        common.set_exit_status(rc)
        return rc
    finally:
        if main_thread:
            if _command_process() or common.interrupted_already():  # exiting (after an interrupt, whoever called)
                common.ignore_further_interrupts()
            else:  # called as a function (tests, scripts): give the caller its handler back
                signal.signal(signal.SIGINT, old_handler if old_handler is not None else signal.default_int_handler)
