"""The device scripts of bench/ without a GPU: every GPU test file is run by a step of
bench/h200_run.sh, the script keeps each bench step's log and files (run with stand-ins for the
GPU host's commands), and merge_ab_summary.py pairs the A/B runs."""

from __future__ import annotations

import os

from msa_jit.tools.bench.steps import FP8_KV


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
    # a caller's MSA_JIT_ENABLE_SM90_UNION does not leak into the steps that measure the defaults
    env = dict(os.environ, OUT=str(out), PATH=f"{stubs}:{os.environ['PATH']}", DEADLINE="60", MSA_JIT_ENABLE_SM90_UNION="0")
    run = subprocess.run(["bash", "bench/h200_run.sh", "bench", "bench_kernel_merge", "bench_union"],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    logs = {p.name: p.read_text() for p in out.glob("*.log")}
    assert set(logs) == {"bench.log", "bench-kernel-merge.log", "bench-union.log"}
    assert "union= cluster=1" in logs["bench.log"]  # unset: the planner's rule
    assert "union= cluster=0" in logs["bench-kernel-merge.log"]
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


def test_union_waves_pairs_the_two_runs_and_reads_a_bench_log(tmp_path):
    """bench/union_waves.py: each point both runs have, the union's grid and its share of a wave, the
    ratio and the planner's default pick; the union side can come from a bench log's progress lines
    (the session 31 H100 run's =1 JSONs did not come back)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "union_waves.py"
    spec = importlib.util.spec_from_file_location("union_waves", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    log = tmp_path / "u1.log"  # two lines as `msa-jit bench` printed them on the H100
    log.write_text("copy bandwidth: 2.983 TB/s (read + write)\n"
                   "[4/24     3 s]  64/4 float q4 B64   sh0  S1  C2U step   156.82 us | per layer   154.84 us  93.0% of copy\n"
                   "[6/24     4 s]  64/4 float q4 B67   sh0  S1  C2U step   203.74 us | per layer   201.39 us  74.9% of copy\n")
    union = mod._rows_of_log(log)
    assert [(r["batch"], r["kernel"], r["marginal_us"], r["marginal_pct_of_copy"]) for r in union] == [
        (64, "union", 154.84, 93.0), (67, "union", 201.39, 74.9)]
    token = [dict(geometry="64/4", qlen=4, batch=b, shared_blocks=0, kernel="token", marginal_us=us, marginal_pct_of_copy=p)
             for b, us, p in ((64, 154.7, 92.4), (67, 161.52, 92.7), (128, 298.37, 95.8))]
    rows = mod.pair(token, union, 132)
    assert [(r["batch"], r["union_grid_ctas"], r["wave_fill"], r["union_over_token"], r["planner_default"]) for r in rows] == [
        (64, 256, 0.97, 1.001, "union"), (67, 268, 1.015, 1.247, "token")]  # B=128: no union row, left out
