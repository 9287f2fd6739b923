"""conftest's session cache: a default run never touches the user's cache, and a run on a host that
cannot compile (the GPU host's, MSA_JIT_NO_COMPILE=1) uses the warmed cache it was given."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PROBE = '''
import os
def test_cache_dir():
    print("CACHE_DIR=" + os.environ["MSA_JIT_CACHE_DIR"])
'''


def _cache_dir_inside_a_run(tmp_path: Path, **env: str) -> str:
    """MSA_JIT_CACHE_DIR as a test of a pytest run with this conftest and `env` sees it."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("MSA_JIT_")}
    run_env.update(env, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_probe.py"],
                         cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return next(line.split("=", 1)[1] for line in run.stdout.splitlines() if line.startswith("CACHE_DIR="))


def test_a_given_cache_is_replaced_by_a_private_one_where_the_host_can_compile(tmp_path):
    users = tmp_path / "users-cache"
    seen = _cache_dir_inside_a_run(tmp_path, MSA_JIT_CACHE_DIR=str(users))
    assert seen != str(users) and "msa-jit-cache" in seen


def test_a_host_that_cannot_compile_keeps_the_warmed_cache_it_was_given(tmp_path):
    warmed = tmp_path / "warmed"
    warmed.mkdir()
    assert _cache_dir_inside_a_run(tmp_path, MSA_JIT_CACHE_DIR=str(warmed), MSA_JIT_NO_COMPILE="1") == str(warmed)
