"""The one logging setup of msa_jit's processes: the "msa_jit" loggers to stderr at MSA_JIT_LOG_LEVEL.

The `msa-jit` command calls it once; `msa_jit.tools.warmup`'s compile workers (fresh spawned
processes) call it too, so their log lines look like the parent's. A library that imports
msa_jit never gets a handler installed behind its back: only these two call it.
"""

from __future__ import annotations

import logging
import sys

from . import env

__all__ = ["configure_logging"]

# marks the handler this module installs, so a second call replaces it instead of adding one
_HANDLER_FLAG = "_msa_jit_cli_handler"


def configure_logging() -> None:
    """Send the "msa_jit" loggers to stderr at MSA_JIT_LOG_LEVEL (a bad value: warning + WARNING)."""
    try:
        level = env.log_level()
        problem = None
    except ValueError as e:
        level, problem = logging.WARNING, str(e)
    logger = logging.getLogger("msa_jit")
    for h in list(logger.handlers):
        if getattr(h, _HANDLER_FLAG, False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    setattr(handler, _HANDLER_FLAG, True)
    logger.addHandler(handler)
    logger.setLevel(level)
    if problem:
        logger.warning("%s (using WARNING)", problem)
