"""The device scripts of bench/ without a GPU: every GPU test file is run by a step of
bench/h200_run.sh, the script keeps each bench step's log and files (run with stand-ins for the
GPU host's commands), and merge_ab_summary.py pairs the A/B runs."""

from __future__ import annotations

import os

from msa_jit.bench.steps import FP8_KV


def test_every_file_with_gpu_tests_is_run_by_a_device_step():
    """A GPU test file that no step of bench/h200_run.sh names never runs anywhere (CI has no GPU):
    test_examples.py was such a file until session 23."""
    import glob
    import re
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    script = (tests.parent / "bench" / "h200_run.sh").read_text()
    gpu_tests = re.search(r'^GPU_TESTS="([^"]+)"', script, re.M).group(1).split()
    selected = {Path(f).name for pattern in gpu_tests for f in glob.glob(str(tests / pattern))}
    # the steps that run one file of their own (union_tests, cluster_tests)
    selected |= set(re.findall(r"python3 -m pytest (test_\w+\.py) -m gpu", script))
    with_gpu = {p.name for p in tests.glob("test_*.py")
                if re.search(r"pytest\.mark\.gpu", p.read_text())}
    assert {"test_kernel_gpu.py", "test_union_gpu.py", "test_examples.py"} <= with_gpu
    assert with_gpu - selected == set(), "GPU tests no device step runs"


def test_device_script_keeps_each_bench_steps_log_and_files(tmp_path):
    """`h200_run.sh bench bench_kernel_merge bench_union` in one call: each step keeps its own log and
    result files, run under its own flags. Until session 24 every bench step wrote bench.log and the
    flagged steps renamed theirs afterwards, so the default run's log was overwritten by the next step.
    Stand-ins (for the infrastructure only): `nvidia-smi`, the bundle's setup, and `python3`, which
    answers the baseline query with `none` and writes a result pair as `msa_jit bench` does."""
    import shutil
    import subprocess
    from pathlib import Path

    repo, out, stubs = tmp_path / "repo", tmp_path / "out", tmp_path / "bin"
    for d in (repo / "bench", repo / ".gpu-bundle", out, stubs):
        d.mkdir(parents=True)
    for script in ("h200_run.sh", "device_env.sh"):
        shutil.copy(Path(__file__).resolve().parents[1] / "bench" / script, repo / "bench")
    (repo / ".gpu-bundle" / "setup.sh").write_text("")
    (stubs / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 0, 0, 0'\n")
    (stubs / "python3").write_text(
        "#!/bin/sh\n"
        '[ "$1" = -c ] && { echo none; exit 0; }\n'
        'n=$(ls "$OUT" | grep -c json); d="$OUT/bench-2026-12-05T160$n"\n'
        'echo "{}" > "$d.json"; echo png > "$d.png"\n'
        'echo "ran $* union=$MSA_JIT_ENABLE_SM90_UNION cluster=$MSA_JIT_ENABLE_CLUSTER_MERGE"\n')
    for f in stubs.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, OUT=str(out), PATH=f"{stubs}:{os.environ['PATH']}", DEADLINE="60")
    run = subprocess.run(["bash", "bench/h200_run.sh", "bench", "bench_kernel_merge", "bench_union"],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    logs = {p.name: p.read_text() for p in out.glob("*.log")}
    assert set(logs) == {"bench.log", "bench-kernel-merge.log", "bench-union.log"}
    assert "union=0 cluster=1" in logs["bench.log"]
    assert "union=0 cluster=0" in logs["bench-kernel-merge.log"]
    assert "union=1 cluster=1" in logs["bench-union.log"]
    assert all("bench rc=0" in text for text in logs.values())
    assert sorted(p.name for p in out.glob("*.json")) == [
        "bench-2026-12-05T1600.json", "bench-2026-12-05T1601-kernel-merge.json",
        "bench-2026-12-05T1602-union.json"]
    assert len(list(out.glob("*.png"))) == 3 and not (out / ".step-start").exists()


def test_merge_ab_summary_pairs_each_cluster_point_with_its_merge_kernel_runs():
    """bench/merge_ab_summary.py: only the points the default gave the cluster merge, both sides'
    runs in round order, the ratio of the fastest of each and each side's spread."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "merge_ab_summary.py"
    spec = importlib.util.spec_from_file_location("merge_ab_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def run(us_split, us_big, merge):
        rows = [dict(geometry="8/1", batch=1, qlen=1, q_dtype="bfloat16", kv_dtype=FP8_KV,
                     split_merge=merge, marginal_us=us_split),
                dict(geometry="8/1", batch=256, qlen=1, q_dtype="bfloat16", kv_dtype=FP8_KV,
                     split_merge=None, marginal_us=us_big)]
        return {"per_layer": rows}

    runs = {"1-cluster": run(5.0, 30.0, "cluster"), "1-kernel": run(5.5, 30.0, "kernel"),
            "2-cluster": run(5.2, 31.0, "cluster"), "2-kernel": run(5.4, 29.0, "kernel")}
    (row,) = mod.summarize(runs)
    assert (row["batch"], row["cluster_us"], row["kernel_us"]) == (1, [5.0, 5.2], [5.5, 5.4])
    assert row["ratio_of_fastest"] == round(5.0 / 5.4, 3)
    assert (row["cluster_spread"], row["kernel_spread"]) == (1.04, round(5.5 / 5.4, 3))
