"""bench/device_run.sh without a GPU: every file with GPU tests is run by one of its steps, and a
run with stand-ins for the GPU host's commands writes each step's log."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "device_run.sh"


def test_every_file_with_gpu_tests_is_run_by_a_device_step():
    """A GPU test file that no step names never runs anywhere (CI has no GPU)."""
    text = SCRIPT.read_text()
    listed = re.search(r'^GPU_TESTS="([^"]+)"', text, re.M).group(1).split()
    selected = {Path(f).name for pattern in listed for f in glob.glob(str(ROOT / "tests" / pattern))}
    selected |= set(re.findall(r"gpu_pytest \S+ \d+ (test_\w+\.py)", text))
    with_gpu = {p.name for p in (ROOT / "tests").glob("test_*.py") if re.search(r"pytest\.mark\.gpu", p.read_text())}
    assert {"test_kernel_gpu.py", "test_union_gpu.py", "test_cluster_merge_gpu.py"} <= with_gpu
    assert with_gpu - selected == set(), "GPU tests no device step runs"


def test_steps_write_their_logs_and_an_unknown_step_exits_2(tmp_path):
    """Stand-ins (infrastructure only): the bundle's setup, nvidia-smi, compute-sanitizer and python3."""
    repo, out, stubs = tmp_path / "repo", tmp_path / "out", tmp_path / "bin"
    for d in (repo / "bench", repo / "tests", repo / ".gpu-bundle", out, stubs):
        d.mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "bench")
    (repo / ".gpu-bundle" / "setup.sh").write_text("")
    (stubs / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 0'\n")
    (stubs / "compute-sanitizer").write_text('#!/bin/sh\necho "sanitizer $*"\n')
    (stubs / "python3").write_text('#!/bin/sh\necho "ran $* cache=$MSA_JIT_CACHE_DIR nocompile=$MSA_JIT_NO_COMPILE"\n')
    for f in stubs.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, OUT=str(out), PATH=f"{stubs}:{os.environ['PATH']}", DEADLINE="60")
    run = subprocess.run(["bash", "bench/device_run.sh", "tests", "memcheck", "selftest", "bench"],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    logs = {p.name: p.read_text() for p in out.glob("*.log")}
    assert set(logs) == {"gpu-tests.log", "memcheck.log", "selftest.log", "bench.log"}
    assert "-m pytest test_kernel_gpu.py" in logs["gpu-tests.log"] and "-m gpu" in logs["gpu-tests.log"]
    assert f"cache={repo}/.artifacts nocompile=1" in logs["bench.log"]
    assert "--tool memcheck" in logs["memcheck.log"] and "memcheck: rc=0" in logs["memcheck.log"]
    (repo / ".engine-src").mkdir()
    run = subprocess.run(["bash", "bench/device_run.sh", "host_path"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    log = (out / "host_path.log").read_text()
    assert "ran bench/host_path.py --modes msa,msa_merge_kernel,msa_op,triton" in log and "host_path: rc=0" in run.stdout
    bad = subprocess.run(["bash", "bench/device_run.sh", "variants"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unknown step variants" in bad.stdout
