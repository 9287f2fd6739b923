"""Test setup: Triton interpreter on CPU-only machines, `gpu` marker skipping, import paths."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import tempfile

import pytest
import torch

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
    from msa_jit import cache, env

    for name in env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    systmp = tmp_path / "systmp"
    systmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))
    cache.reset_stats()
