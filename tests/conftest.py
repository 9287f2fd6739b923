"""Test setup: Triton interpreter on CPU-only machines, GPU tests left out without a GPU, import paths,
one compiled-artifact cache per session, and the closing notes of what did not run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import tempfile

import pytest
import torch

pytest_plugins = ["pytester"]  # tests/test_vllm_files.py runs pytest on a guarded module

_HAS_CUDA = torch.cuda.is_available()

# One intra-op thread: the CPU tests run many small tensor ops, for which a second thread only adds
# its wake-ups, and on a busy 2-core machine the threads' spin-waits take the other core's time (the
# whole run: 217 s of CPU instead of 292 s). Child processes keep torch's default.
torch.set_num_threads(1)

# Triton kernels run on CPU tensors only in interpreter mode, which must be chosen before
# triton.jit decorates them, i.e. before msa_jit.prologue is imported.
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = Path(__file__).resolve().parents[1]
_TESTS = Path(__file__).resolve().parent
for _p in (str(_ROOT), str(_TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


NO_GPU_REASON = "no CUDA GPU here (torch.cuda.is_available() is False)"
_left_out: dict[str, int] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without a GPU the `gpu` tests are deselected (not run, not reported one by one: a GPU host runs
    them); the closing note says how many."""
    if _HAS_CUDA:
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        items[:] = [item for item in items if "gpu" not in item.keywords]
        config.hook.pytest_deselected(items=gpu)
        _left_out["gpu"] = len(gpu)


@pytest.fixture(scope="session", autouse=True)
def session_artifact_cache(tmp_path_factory) -> Path:
    """MSA_JIT_CACHE_DIR for the whole run (child processes inherit it): what a test compiles into the
    default cache is found by the next test that needs it, and the user's own cache is neither read
    nor written. A test that needs another cache sets its own.

    Except on a host that cannot compile (MSA_JIT_NO_COMPILE set, as the GPU host's run is): there every
    kernel comes from the warmed cache the run was given (MSA_JIT_CACHE_DIR), and nothing can be
    compiled into it; an empty temporary cache would fail every GPU test with ArtifactMissingError."""
    from msa_jit import env

    given = env.cache_dir()
    if given is not None and env.no_compile():
        yield given
        return
    root = tmp_path_factory.mktemp("msa-jit-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MSA_JIT_CACHE_DIR", str(root))
        yield root


@pytest.fixture
def isolated_env(monkeypatch, tmp_path):
    """No MSA_JIT_* from the outside, a private tempfile.gettempdir(), fresh cache counters, and a
    private $XDG_CACHE_HOME: the cache's default root without MSA_JIT_CACHE_DIR is under tmp_path,
    never the user's ~/.cache/msa-jit (tests of the root's resolution set HOME and XDG_CACHE_HOME)."""
    from msa_jit.jit import cache
    from msa_jit import env

    for name in env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
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
    """What did not run, said at the end: the GPU tests on a host without one, the `sweep` tests
    (left out by default: `-m sweep` runs them), and vLLM's files when not available (the tests that
    read them skip, so a run that passes has not tested the engine fit) or downloaded by this run."""
    write = terminalreporter.write_line
    if _left_out.get("gpu"):
        write(f"NOTE: {_left_out['gpu']} GPU tests not run: {NO_GPU_REASON}")
    sweep = sum("sweep" in item.keywords and (_HAS_CUDA or "gpu" not in item.keywords)
                for item in terminalreporter.stats.get("deselected", []))
    if sweep:
        write(f"NOTE: {sweep} sweep tests not run (the default run leaves them out): python -m pytest -m sweep")
    vf = sys.modules.get("vllm_files")  # imported by the engine tests only: nothing to say otherwise
    if vf is None:
        return
    if vf.DOWNLOADED:
        write(f"NOTE: vLLM {vf.VERSION}'s files for the engine tests: {vf.SOURCE}")
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if vf.SKIP_PREFIX in str(getattr(r, "longrepr", ""))]
    if skipped:
        n = len(skipped)
        write(f"NOTE: {n} test{'s' if n != 1 else ''} of the real vLLM engine files skipped: {vf.SKIP_REASON}",
              yellow=True, bold=True)
