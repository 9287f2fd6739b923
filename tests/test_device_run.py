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


def _fake_host(tmp_path: Path, python3: str) -> tuple[Path, Path, dict[str, str]]:
    """(repo, OUT, env) of a GPU host made of stand-ins (infrastructure only): the bundle's setup,
    nvidia-smi, compute-sanitizer and the given python3 script."""
    repo, out, stubs = tmp_path / "repo", tmp_path / "out", tmp_path / "bin"
    for d in (repo / "bench", repo / "tests", repo / ".gpu-bundle", out, stubs):
        d.mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "bench")
    (repo / ".gpu-bundle" / "setup.sh").write_text("")
    (stubs / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 0'\n")
    (stubs / "compute-sanitizer").write_text('#!/bin/sh\necho "sanitizer $*"\n')
    (stubs / "python3").write_text(python3)
    for f in stubs.iterdir():
        f.chmod(0o755)
    return repo, out, dict(os.environ, OUT=str(out), PATH=f"{stubs}:{os.environ['PATH']}", DEADLINE="60")


def test_steps_write_their_logs_and_an_unknown_step_exits_2(tmp_path):
    repo, out, env = _fake_host(
        tmp_path, '#!/bin/sh\necho "ran $* cache=$MSA_JIT_CACHE_DIR nocompile=$MSA_JIT_NO_COMPILE"\n')
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


def test_plan_ab_step_sources_flashinfer_in_its_own_shell_and_ends_before_the_deadline(tmp_path):
    """plan_ab runs bench/plan_ab.py with its JSON in $OUT and a deadline inside the step's timeout,
    FlashInfer's setup sourced for it alone when .fi-bundle is carried (the step after it does not see
    it), and PLAN_AB_ARGS passed on; plan_ab_nvfp4 the same for the NVFP4 cache, into its own files."""
    repo, out, env = _fake_host(tmp_path, '#!/bin/sh\necho "ran $* fi=${FI_SOURCED:-no} nocompile=$MSA_JIT_NO_COMPILE"\n')
    run = subprocess.run(["bash", "bench/device_run.sh", "plan_ab"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and "plan_ab: rc=0" in run.stdout, run.stdout + run.stderr
    log = (out / "plan_ab.log").read_text()
    m = re.search(rf"ran bench/plan_ab.py --json {re.escape(str(out))}/plan_ab.json --deadline-s (\d+) fi=no "
                  "nocompile=1", log)
    assert m and 5 <= int(m.group(1)) < 60, log
    (repo / ".fi-bundle").mkdir()
    (repo / ".fi-bundle" / "setup.sh").write_text("export FI_SOURCED=1\n")
    run = subprocess.run(["bash", "bench/device_run.sh", "plan_ab", "bench"], cwd=repo, capture_output=True, text=True,
                         env=dict(env, PLAN_AB_ARGS="--points 64/4:B4:q1"), timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"--deadline-s \d+ --points 64/4:B4:q1 fi=1", (out / "plan_ab.log").read_text())
    assert "fi=no" in (out / "bench.log").read_text()
    # the NVFP4 plans: their own JSON and log beside fp8's, each step capped by PLAN_AB_S
    run = subprocess.run(["bash", "bench/device_run.sh", "plan_ab", "plan_ab_nvfp4"], cwd=repo, capture_output=True,
                         text=True, env=dict(env, PLAN_AB_S="100", PLAN_AB_NVFP4_ARGS="--points 16/1:B64:q1"), timeout=60)
    assert run.returncode == 0 and "plan_ab_nvfp4: rc=0" in run.stdout, run.stdout + run.stderr
    m = re.search(rf"ran bench/plan_ab.py --json {re.escape(str(out))}/plan_ab_nvfp4.json --deadline-s (\d+) "
                  r"--kv-dtype nvfp4 --points 16/1:B64:q1 fi=1", (out / "plan_ab_nvfp4.log").read_text())
    assert m and int(m.group(1)) <= 80
    assert "/plan_ab.json --deadline-s" in (out / "plan_ab.log").read_text()


def test_peers_step_runs_the_bench_through_vllms_decode_file_with_flashinfer_sourced(tmp_path):
    """peers: the bench with both peers (vLLM's Triton decode from its one file, FlashInfer's setup
    sourced for that step alone) over the performance grid, both cache formats; PEERS_ARGS replaces the grid."""
    repo, out, env = _fake_host(tmp_path, '#!/bin/sh\necho "ran $* fi=${FI_SOURCED:-no}"\n')
    (repo / ".fi-bundle").mkdir()
    (repo / ".fi-bundle" / "setup.sh").write_text("export FI_SOURCED=1\n")
    run = subprocess.run(["bash", "bench/device_run.sh", "peers", "bench"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and "peers: rc=0" in run.stdout, run.stdout + run.stderr
    log = (out / "peers.log").read_text()
    assert (f"ran bench/peers/vllm_decode_file.py bench --compare flashinfer,vllm --out {out} --baseline none "
            "--heads 64/4,32/2,16/1,8/1 --batch 1,2,4,8,16,32,64,128,256 --decode-query-len 1,2,4,8 "
            "--kv-dtype fp8,nvfp4 --floor-batch  --iters 20 fi=1") in log, log
    assert "fi=no" in (out / "bench.log").read_text()
    run = subprocess.run(["bash", "bench/device_run.sh", "peers"], cwd=repo, capture_output=True, text=True,
                         env=dict(env, PEERS_ARGS="--heads 8/1 --batch 1"), timeout=60)
    assert run.returncode == 0 and "--baseline none --heads 8/1 --batch 1 fi=1" in (out / "peers.log").read_text()


def test_suite_runs_the_correctness_steps_at_once_and_fails_when_one_does(tmp_path):
    """suite: the GPU tests beside the union and cluster tests in two concurrent streams, every log written,
    each stream's summary printed, and exit 1 when a step of either stream failed (the other still runs)."""
    repo, out, env = _fake_host(
        tmp_path, '#!/bin/sh\necho "ran $*"\ncase "$*" in *test_union_gpu.py*) exit ${UNION_RC:-0};; esac\n')
    run = subprocess.run(["bash", "bench/device_run.sh", "suite"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    logs = {p.name for p in out.glob("*.log")}
    assert logs == {"gpu-tests.log", "union-tests.log", "cluster-tests.log"}
    for step in ("gpu-tests.log", "union-tests.log", "cluster-tests.log"):
        assert f"{step}: rc=0" in run.stdout, run.stdout
    run = subprocess.run(["bash", "bench/device_run.sh", "suite"], cwd=repo, env=dict(env, UNION_RC="1"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "union-tests.log: rc=1" in run.stdout and "gpu-tests.log: rc=0" in run.stdout


def test_tree_ab_step_alternates_the_trees_each_on_its_own_sources_and_cache(tmp_path):
    """tree_ab: base and the carried .variant-<name> alternately, AB_ROUNDS times, each run with its own tree
    first on PYTHONPATH and its own cache, FlashInfer sourced, everything in $OUT/tree_ab.tar.gz; without a
    carried variant it fails and says what to carry."""
    import tarfile

    repo, out, env = _fake_host(
        tmp_path, '#!/bin/sh\necho "ran $* pwd=$PWD path=${PYTHONPATH%%:*} cache=$MSA_JIT_CACHE_DIR fi=${FI_SOURCED:-no}"\n')
    run = subprocess.run(["bash", "bench/device_run.sh", "tree_ab"], cwd=repo, env=dict(env, VARIANT="l2"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "tree_ab: rc=2" in run.stdout and ".variant-l2 not carried" in run.stdout
    run = subprocess.run(["bash", "bench/device_run.sh", "tree_ab"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 1 and "VARIANT=<name>[,<name>...]" in run.stdout
    (repo / ".variant-l2").mkdir()
    (repo / ".fi-bundle").mkdir()
    (repo / ".fi-bundle" / "setup.sh").write_text("export FI_SOURCED=1\n")
    run = subprocess.run(["bash", "bench/device_run.sh", "tree_ab"], cwd=repo, capture_output=True, text=True,
                         env=dict(env, VARIANT="l2", AB_ROUNDS="2", AB_GRID="--heads 8/1 --batch 1"), timeout=60)
    assert run.returncode == 0 and "tree_ab: rc=0" in run.stdout, run.stdout + run.stderr
    assert [line.split(":")[0] for line in run.stdout.splitlines() if line.startswith("tree_ab ")] == [
        "tree_ab base-1", "tree_ab l2-1", "tree_ab base-2", "tree_ab l2-2"]
    with tarfile.open(out / "tree_ab.tar.gz") as tar:
        logs = {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert set(logs) == {"gpu.txt", "base-1.log", "l2-1.log", "base-2.log", "l2-2.log"}
    variant = repo / ".variant-l2"
    assert (f"--out {out}/tree_ab/l2-2 --baseline none --compare flashinfer --no-host --floor-batch  --iters 20 "
            f"--heads 8/1 --batch 1 pwd={variant} path={variant} cache={variant}/.artifacts fi=1") in logs["l2-2.log"]
    assert f"pwd={repo} path={repo} cache={repo}/.artifacts fi=1" in logs["base-1.log"]
    assert not (out / "tree_ab").exists()


def test_tree_ab_step_runs_every_variant_beside_one_base(tmp_path):
    """VARIANT=a,b: base, a, b in each round, one archive."""
    import tarfile

    repo, out, env = _fake_host(tmp_path, '#!/bin/sh\necho "ran $* pwd=$PWD"\n')
    for v in ("a", "b"):
        (repo / f".variant-{v}").mkdir()
    run = subprocess.run(["bash", "bench/device_run.sh", "tree_ab"], cwd=repo, capture_output=True, text=True,
                         env=dict(env, VARIANT="a,b", AB_ROUNDS="2"), timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [line.split(":")[0] for line in run.stdout.splitlines() if line.startswith("tree_ab ")] == [
        "tree_ab base-1", "tree_ab a-1", "tree_ab b-1", "tree_ab base-2", "tree_ab a-2", "tree_ab b-2"]
    with tarfile.open(out / "tree_ab.tar.gz") as tar:
        logs = {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert f"pwd={repo / '.variant-b'}" in logs["b-2.log"]
