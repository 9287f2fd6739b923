"""msa-jit: JIT-compiled MSA block-sparse decode attention kernels.

Typical step::

    plan = msa_jit.prepare(block_table, seq_lens, seq_lens_cpu, qlen,
                           num_q_heads=64, num_kv_heads=4, page_size=128, topk_blocks=16)
    msa_jit.sparse_decode(query, kv_cache, topk, out, plan, sm_scale=128 ** -0.5,
                          q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

Importing the package imports torch only: triton (the prologue) and the kernel compiler are
imported on first use. It registers the custom op `torch.ops.msa_jit.sparse_decode`
(`msa_jit.integrations.torch_op`; ~9 ms of the ~2 s import, measured).

The one exception is the `msa-jit` command's own process (its console script, or `python -m
msa_jit`): there the public names below are imported on first use, so that `msa-jit --version`,
`--help` and the commands that need no GPU library start without importing torch.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# public name -> the module that defines it
_API = {
    "SparseDecodeConfig": "geometry", "SupportResult": "geometry", "supports": "geometry",
    "sparse_decode": "op", "SparseDecodePlan": "plan", "SparseDecodePlanner": "planner", "prepare": "planner",
    "sparse_decode_reference": "reference",
}


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("msa-jit")
        except PackageNotFoundError:
            return "0.1.0"
    except Exception:  # pragma: no cover
        return "0.1.0"


__all__ = [
    "SparseDecodeConfig",
    "SparseDecodePlan",
    "SparseDecodePlanner",
    "SupportResult",
    "__version__",
    "prepare",
    "sparse_decode",
    "sparse_decode_reference",
    "supports",
]


def _load_api() -> None:
    """Import torch and the public API, and register the custom op (what `import msa_jit` does)."""
    import importlib
    import warnings

    # torch warns "Failed to initialize NumPy" when it is imported without numpy installed (the
    # main-job install has none; msa-jit never uses numpy). Silence that one warning of torch's
    # import only; the filter is gone afterwards, and a process that imported torch first sees it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
        import torch  # noqa: F401

    importlib.import_module(".integrations.torch_op", __name__)
    module = sys.modules[__name__]
    for name, where in _API.items():
        setattr(module, name, getattr(importlib.import_module(f".{where}", __name__), name))


def __getattr__(name: str) -> Any:
    """The version and the public API, read and imported on first use (in the `msa-jit` command's
    process only: elsewhere `import msa_jit` has set them)."""
    if name == "__version__":
        globals()["__version__"] = _version()
        return globals()["__version__"]
    if name in _API:
        _load_api()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _command_process() -> bool:
    """Whether this interpreter is starting the `msa-jit` command: its console script
    (argv[0] named msa-jit) or `python -m msa_jit` (argv[0] is '-m' while the package is imported)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) in ("msa-jit", "msa-jit.exe", "msa-jit-script.py"):
        return True
    orig = list(getattr(sys, "orig_argv", ()))
    if argv0 == "-m":
        for i, a in enumerate(orig):
            if a in ("-mmsa_jit", "-mmsa_jit.__main__") or (a == "-m" and orig[i + 1:i + 2] in (["msa_jit"], ["msa_jit.__main__"])):
                return True
    return False


def _interrupted_while_starting(signum: int, frame: Any) -> None:
    """SIGINT before `msa_jit.cli.main` takes over: one line and exit 130, not a traceback from
    the middle of an import (SystemExit leaves quietly; main installs its own handler)."""
    sys.stderr.write("msa-jit: interrupted\n")
    raise SystemExit(130)


_COMMAND_PROCESS = _command_process()  # msa_jit.cli.main owns this process's signals then

if _COMMAND_PROCESS:  # the version too is read on first use (importlib.metadata costs ~50 ms)
    import signal

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when the caller chose another
        signal.signal(signal.SIGINT, _interrupted_while_starting)
else:
    __version__ = _version()
    _load_api()
