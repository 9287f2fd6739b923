"""Test setup: Triton interpreter on CPU-only machines, `gpu` marker skipping, import paths."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import tempfile

import pytest
import torch

pytest_plugins = ["pytester"]  # tests/test_vllm_files.py runs pytest on a guarded module

_HAS_CUDA = torch.cuda.is_available()

# Triton kernels run on CPU tensors only in interpreter mode, which must be chosen before
# triton.jit decorates them, i.e. before msa_jit.prologue is imported.
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = Path(__file__).resolve().parents[1]
_TESTS = Path(__file__).resolve().parent
for _p in (str(_ROOT), str(_TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def isolated_env(monkeypatch, tmp_path):
    """No MSA_JIT_* from the outside, a private tempfile.gettempdir(), fresh cache counters."""
    from msa_jit.jit import cache
    from msa_jit import env

    for name in env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    systmp = tmp_path / "systmp"
    systmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))
    cache.reset_stats()


@pytest.fixture
def launched_configs(monkeypatch):
    """The SparseDecodeConfig of every kernel call, in order, with no kernel compiled or run: a
    stand-in kernel records its config, the custom op's arch is sm_90a, and validation resolves the
    kernel backend on a CPU case."""
    from msa_jit.jit import compiler
    from msa_jit import op
    from msa_jit.integrations import torch_op

    events: list = []
    monkeypatch.setattr(compiler, "get_sparse_decode_kernel", lambda cfg: lambda *a: events.append(cfg))
    monkeypatch.setattr(torch_op, "_arch_of", lambda device: "sm_90a")
    monkeypatch.setattr(torch_op, "_KERNELS", {})
    real_validate = op.validate_sparse_decode
    monkeypatch.setattr(op, "validate_sparse_decode", lambda *a: ("kernel", real_validate(*a[:-1], "reference")[1]))
    return events



def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Say it at the end when vLLM's files were not available (the tests that read them skip then,
    and a run that passes has not tested the engine fit), or were downloaded by this run."""
    vf = sys.modules.get("vllm_files")  # imported by the engine tests only: nothing to say otherwise
    if vf is None:
        return
    if vf.DOWNLOADED:
        terminalreporter.write_line(f"NOTE: vLLM {vf.VERSION}'s files for the engine tests: {vf.SOURCE}")
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if vf.SKIP_PREFIX in str(getattr(r, "longrepr", ""))]
    if skipped:
        n = len(skipped)
        terminalreporter.write_line(
            f"NOTE: {n} test{'s' if n != 1 else ''} of the real vLLM engine files skipped: {vf.SKIP_REASON}",
            yellow=True, bold=True)
