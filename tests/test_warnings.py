"""No warning from msa_jit's own code: the kernels use no deprecated DSL API and nothing the DSL flags
while it traces them (tests/helpers.compile_without_warnings; the NVFP4, union and cluster-merge compile
tests build through it too), and no import of the package warns."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import compile_without_warnings

from msa_jit.geometry import SparseDecodeConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_most_common_build_compiles_without_a_warning(tmp_path):
    """The token kernel's default build (64/4, bf16 query, fp8 cache, sm_90a, 2 CTAs per SM)."""
    compile_without_warnings(SparseDecodeConfig(64, 4, arch="sm_90a"), tmp_path)


def test_a_warning_from_the_kernels_is_caught(tmp_path, monkeypatch):
    """The check itself: a warning raised from a kernel file while compiling fails it."""
    import warnings

    from msa_jit.jit import compiler
    from msa_jit.kernels import token

    def warns(config, out_dir):
        exec(compile("warnings.warn('old API', DeprecationWarning)", token.__file__, "exec"), {"warnings": warnings})
        return {}

    monkeypatch.setattr(compiler, "compile_sparse_decode", warns)
    with pytest.raises(AssertionError, match=r"msa_jit/kernels/token.py:1: DeprecationWarning: old API"):
        compile_without_warnings(SparseDecodeConfig(64, 4), tmp_path)


def test_importing_the_package_warns_nothing():
    """`import msa_jit` (the custom op registered) and its submodules, with every warning an error."""
    code = ("import pkgutil, importlib, msa_jit\n"
            "for m in pkgutil.walk_packages(msa_jit.__path__, 'msa_jit.'):\n"
            "    if m.name != 'msa_jit.__main__':\n"
            "        importlib.import_module(m.name)\n")
    p = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
