"""The `msa-jit` command's conventions and messages (arches, variables, flags, errors).

No kernel is compiled here: where a warm-up would run, `warmup.run_warmup` is replaced by a
stand-in that records its configs (named `fake_run`), or the command must stop before it.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from msa_jit.jit import cache, compiler, registry
from msa_jit import cli, env
from msa_jit.tools import warmup
from msa_jit.cli import common
from msa_jit.geometry import SparseDecodeConfig

ROOT = Path(__file__).resolve().parents[1]


# the msa_jit logger restored after each test (autouse, imported) and the in-process `msa-jit`
from test_cli import _isolated, run_main  # noqa: E402,F401


@pytest.fixture
def fake_run(monkeypatch):
    """Stand-in for warmup.run_warmup: records the configs, returns them all 'cached'."""
    calls: list[list[SparseDecodeConfig]] = []

    def run(configs, **kw):
        calls.append(list(configs))
        return [warmup.WarmupRow(c, status="cached", key="ab" * 32) for c in configs]

    monkeypatch.setattr(warmup, "run_warmup", run)
    return calls


def _subprocess_env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MSA_JIT_")}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    e.update(extra)
    return e


# ----------------------------------------------------------------------------- item 13: conventions
def test_version_and_bare_commands_print_help():
    from msa_jit import __version__

    rc, out, _ = run_main(["--version"])
    assert rc == 0 and out.strip() == f"msa-jit {__version__}"
    rc, out, err = run_main([])
    assert rc == 0 and "usage: msa-jit" in out and "warmup" in out and "selftest" in out and "error" not in err
    rc, out, err = run_main(["cache"])
    assert rc == 0 and "usage: msa-jit cache" in out and "verify" in out and "error" not in err


@pytest.mark.parametrize("jobs", ["0", "-1", "two"])
def test_jobs_must_be_positive(jobs, fake_run):
    rc, _, err = run_main(["warmup", "--heads", "8/1", "--arch", "sm_90a", "--jobs", jobs])
    assert rc == 2 and "--jobs" in err and not fake_run


def test_preset_and_heads_exclude_each_other(fake_run):
    rc, out, err = run_main(["warmup", "--preset", "minimax-m3", "--heads", "8/1", "--arch", "sm_90a"])
    assert rc == 2 and "--preset minimax-m3 and --heads" in err and not fake_run and out == ""


def test_bench_q_dtype_takes_warmups_names():
    parser = cli.build_parser()
    for name, want in (("bf16", "bfloat16"), ("fp8", "float8_e4m3fn"), ("bfloat16", "bfloat16")):
        assert common.q_dtypes_from(parser.parse_args(["bench", "--q-dtype", name])) == [want]
        assert common.parse_q_dtype(name) == want
    rc, _, err = run_main(["bench", "--q-dtype", "fp16"])
    assert rc == 2 and "--q-dtype 'fp16'" in err


def test_json_means_the_same_everywhere(fake_run, tmp_path, monkeypatch):
    """`--json` alone and `--json -` write stdout (no file named '-'); `--json FILE` a file; in
    warmup / inspect / doctor / cache list / cache info alike."""
    monkeypatch.chdir(tmp_path)
    root = str(tmp_path / "c")
    for flag in (["--json"], ["--json", "-"]):
        rc, out, err = run_main(["warmup", "--heads", "8/1", "--q-dtype", "bf16", "--arch", "sm_90a",
                                 "--cache-dir", root, "-q", *flag])
        doc = json.loads(out)  # stdout is the JSON only, the table went to stderr
        # 2 occupancies, the union's 2-CTA build and the cluster-merge build
        assert rc == 0 and doc["cached"] == 4 and "8/1" in err
        for sub in (["cache", "list"], ["cache", "info"], ["doctor"]):
            rc, out, _ = run_main([*sub, "--cache-dir", root, *flag])
            assert rc == 0 and json.loads(out) is not None, sub
    assert not (tmp_path / "-").exists()
    for sub in (["warmup", "--heads", "8/1", "--arch", "sm_90a", "-q"], ["cache", "list"], ["cache", "info"],
                ["doctor"]):
        target = tmp_path / f"{'-'.join(sub[:2])}.json"
        rc, out, _ = run_main([*sub, "--cache-dir", root, "--json", str(target)])
        assert rc == 0 and json.loads(target.read_text()) is not None, sub
        assert not list(tmp_path.glob(f".{target.name}.*")), "the temporary file is left"


@pytest.mark.parametrize("argv", [["cache", "list"], ["cache", "info"], ["doctor"]], ids=" ".join)
def test_json_path_is_checked_by_cache_and_doctor_too(argv, tmp_path):
    """cache list / info and doctor check --json FILE first, as warmup and inspect do: one line
    naming the flag, exit 2 (not the OSError of a write into a directory after the work)."""
    (tmp_path / "c").mkdir()
    rc, out, err = run_main([*argv, "--cache-dir", str(tmp_path / "c"), "--json", str(tmp_path)])
    says = f"msa-jit {' '.join(argv)}: --json {tmp_path}: {tmp_path} is a directory"
    assert rc == 2 and out == "" and err.strip() == says, err


def test_warmup_flags_reach_the_warmup(monkeypatch, tmp_path):
    """--jobs, --quiet and --cache-dir are what run_warmup gets."""
    seen: list[dict] = []

    def run(configs, **kw):
        seen.append(kw)
        return [warmup.WarmupRow(c, status="cached", key="ab" * 32) for c in configs]

    monkeypatch.setattr(warmup, "run_warmup", run)
    for extra, jobs, quiet in ((["--jobs", "3", "-q"], 3, True), ([], None, False)):
        rc, _, err = run_main(["warmup", "--heads", "8/1", "--arch", "sm_90a", "--cache-dir", str(tmp_path), *extra])
        assert rc == 0, err
        assert (seen[-1]["jobs"], seen[-1]["quiet"], seen[-1]["cache_dir"]) == (jobs, quiet, str(tmp_path))


def test_plan_prints_short():
    import torch

    import msa_jit
    from msa_jit.testing import make_case

    c = make_case(4, 2, 64, 4, q_dtype=torch.bfloat16, seed=0)
    plan = msa_jit.SparseDecodePlanner(arch="sm_90a").prepare(*c.prepare_args(), **c.prepare_kwargs())
    text = repr(plan)
    assert len(text) < 400 and "tensor(" not in text and str(plan) == text
    for part in ("batch=4", "qlen=2", "heads=64/4", "page_size=128", "topk_blocks=16", "ctas_per_sm=", "arch=sm_90a",
                 "workspace="):
        assert part in text, text


@pytest.mark.slow
def test_custom_op_exists_after_import_msa_jit():
    code = "import torch, msa_jit; print(hasattr(torch.ops.msa_jit, 'sparse_decode'))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_subprocess_env(), timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr


# ----------------------------------------------------------------------------- item 9: arches
@pytest.mark.parametrize("arch, says", [
    ("sm_80", "not one msa-jit builds for"), ("sm_120a", "not one msa-jit builds for"),
    ("sm_90", "baseline target"), ("9.0", "baseline target"), ("sm_100", "baseline target"),
    ("sm_100f", "family target"), ("hopper", "not a GPU arch"),
])
def test_unsupported_arch_is_refused_up_front(arch, says, fake_run):
    rc, out, err = run_main(["warmup", "--heads", "8/1", "--arch", arch])
    assert rc == 2 and not fake_run and out == ""
    assert says in err and "sm_90a, sm_100a" in err and "\x1b[" not in err and "CUTE_DSL_ARCH" not in err, err
    if says != "not one msa-jit builds for" and arch != "hopper":
        assert "use sm_" in err and "arch-specific" in err


def test_unsupported_msa_jit_arch_is_refused(fake_run, monkeypatch):
    monkeypatch.setenv("MSA_JIT_ARCH", "sm_80")
    rc, _, err = run_main(["warmup", "--heads", "8/1"])
    assert rc == 2 and not fake_run and "MSA_JIT_ARCH='sm_80'" in err and "sm_90a, sm_100a" in err


def test_a_worker_error_has_no_colour_codes():
    assert warmup.plain_text("\x1b[91m^^^\x1b[0m \x1b[92msuggestion:\x1b[0m x") == "^^^ suggestion: x"


# ----------------------------------------------------------------------------- item 10: messages
def test_bench_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    out_dir = tmp_path / "results"
    rc, out, err = run_main(["bench", "--out", str(out_dir)])
    assert rc == 2 and "needs a CUDA GPU" in err and "Traceback" not in err and out == ""
    assert not out_dir.exists()


def test_selftest_without_a_gpu():
    """Like bench: the refusal is an error message on stderr (it went to stdout), exit 2."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    for argv in (["selftest"], ["selftest", "--quick"]):
        rc, out, err = run_main(argv)
        assert rc == 2 and "needs a CUDA GPU" in err and out == "" and "Traceback" not in err, (out, err)


@pytest.fixture
def fake_gpu_selftest(monkeypatch):
    """A stand-in H100 (sm_90a) for `msa-jit selftest`: its correctness grid returns the rows in
    calls["rows"] (recording `quick`), and the bench records its arguments."""
    import torch

    from msa_jit.tools import bench, selftest
    from msa_jit import geometry

    calls: dict = {"grid": [], "bench": [], "rows": []}

    def grid(*, quick=False, log=print):
        calls["grid"].append(quick)
        return calls["rows"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in H100")
    monkeypatch.setattr(geometry, "device_arch", lambda index=0: "sm_90a")
    monkeypatch.setattr(selftest, "correctness_grid", grid)
    monkeypatch.setattr(bench, "main", lambda out, **kw: calls["bench"].append((out, kw)))
    return calls


def _case(problems=()):
    return {"rel_l2": 1e-3, "worst_row_rel_l2": 2e-3, "problems": list(problems)}


def test_selftest_checks_then_benches(fake_gpu_selftest, tmp_path):
    """All cases pass: exit 0, then the bench into --out with --iters; --quick is the grid's quick;
    --no-bench stops after the grid."""
    calls = fake_gpu_selftest
    calls["rows"] = [_case(), _case()]
    rc, out, err = run_main(["selftest", "--quick", "--iters", "7", "--out", str(tmp_path)])
    assert rc == 0 and calls["grid"] == [True] and calls["bench"] == [(str(tmp_path), {"iters": 7})], err
    assert "correctness: 2/2 cases passed" in out and "Stand-in H100 (sm_90a)" in out
    rc, _, err = run_main(["selftest", "--no-bench", "--arch", "9.0a"])
    assert rc == 0 and calls["grid"] == [True, False] and len(calls["bench"]) == 1, err


def test_selftest_fails_on_a_failed_case_or_another_arch(fake_gpu_selftest, tmp_path):
    """A failed case: exit 1 and no bench. --arch of another GPU: exit 2 before the grid."""
    calls = fake_gpu_selftest
    calls["rows"] = [_case(), dict(_case(["rel L2 too large"]), rel_l2=float("nan"))]
    rc, out, err = run_main(["selftest", "--out", str(tmp_path)])
    assert rc == 1 and "correctness: 1/2 cases passed, worst rel L2 1.00e-03" in out and not calls["bench"], err
    rc, out, err = run_main(["selftest", "--arch", "sm_100a"])
    assert rc == 2 and "--arch sm_100a given, but this GPU is sm_90a" in err and len(calls["grid"]) == 1, err


def test_selftest_grid_quick_and_forced_splits():
    """--quick is qlen 1 and 4 at batch 1 and 16; both grids force 1 split and topk splits on one case."""
    from msa_jit.tools import selftest

    for quick, qlens, batches in ((False, selftest.QLENS, selftest.BATCHES), (True, [1, 4], [1, 16])):
        cases = selftest.grid_cases("sm_90a", quick=quick, union=False)
        plain = [c for c in cases if c[4] is None]
        assert {c[2] for c in plain} == set(qlens) and {c[3] for c in plain} == set(batches)
        assert {c[:5] for c in cases if c[4] is not None} == {
            ((64, 4), "bfloat16", 4, 3, 1), ((64, 4), "bfloat16", 4, 3, selftest.FORCE_SPLITS)}


def test_bench_bad_flags_and_out(tmp_path):
    (tmp_path / "file").write_text("x")
    for argv, says in ((["--out", str(tmp_path / "file")], "is not a directory"),
                       (["--heads", "64/3"], "no bench geometry '64/3'"),
                       (["--batch", "1,x"], "--batch"), (["--iters", "0"], "--iters"),
                       (["--q-dtype", "bf16,fp8"], "--q-dtype: one value only")):
        rc, _, err = run_main(["bench", *argv])
        assert rc == 2 and says in err, (argv, err)


def test_bench_table_of_a_bad_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"points": [{"geometry": "64/4"}]}')
    for path, says in ((tmp_path / "missing.json", "cannot read it"), (tmp_path / "bad.json", "not JSON"),
                       (tmp_path / "other.json", "not a bench result")):
        rc, out, err = run_main(["bench", "--table", str(path)])
        assert rc == 2 and says in err and str(path) in err and out == "", err
    from msa_jit.tools import bench

    good = ROOT / "tests/fixtures/bench-per-step-only.json"
    rc, out, _ = run_main(["bench", "--table", str(good)])
    assert rc == 0 and out.strip() == bench.result_tables(json.loads(good.read_text()))


@pytest.mark.parametrize("command", ["warmup", "inspect"])
def test_json_path_is_checked_before_the_work(command, fake_run, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root passes every mode bit: answer for `ro` as the bits say
        real_access = os.access

        def access_by_mode_bits(path, mode, *a, **k):  # stand-in for os.access as a non-root user
            if os.fspath(path) == str(ro) and mode & os.W_OK:
                return False
            return real_access(path, mode, *a, **k)

        monkeypatch.setattr(common.os, "access", access_by_mode_bits)
    try:
        for bad, says in ((tmp_path / "nodir" / "x.json", "is not a directory"), (tmp_path, "is a directory"),
                          (ro / "x.json", f"--json {ro / 'x.json'}: {ro / 'x.json'} is not writable")):
            rc, _, err = run_main([command, "--heads", "8/1", "--arch", "sm_90a", "--json", str(bad)])
            assert rc == 2 and says in err and f"--json {bad}" in err, err
        assert not fake_run, "the warm-up ran before the --json path was checked"
    finally:
        ro.chmod(0o700)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize("command", ["warmup", "inspect"])
def test_json_path_that_cannot_be_created_is_checked_before_the_work(command, fake_run):
    """A directory that passes the permission bits (root passes them all) but where no file can
    be created (/proc; a read-only or full filesystem alike) is found before the warm-up, not
    after it: the check creates (and removes) a file there."""
    rc, _, err = run_main([command, "--heads", "8/1", "--arch", "sm_90a", "--json", "/proc/x.json"])
    assert rc == 2 and "--json /proc/x.json" in err and "cannot create a file in /proc" in err, err
    assert not fake_run, "the warm-up ran before the --json path was checked"


def test_json_into_a_special_file_or_a_symlink_writes_through(fake_run, tmp_path):
    """`--json /dev/stdout` (a FIFO, /dev/null) is written into, never replaced by a regular file
    (the atomic rename, run as root, replaced /dev/full with one); a symlink keeps pointing
    where it did and its target gets the JSON. A FIFO stands for the device files here."""
    import stat
    import threading

    args = ["warmup", "--heads", "8/1", "--q-dtype", "bf16", "--arch", "sm_90a", "-q",
            "--cache-dir", str(tmp_path / "c")]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    try:
        rc, _, err = run_main([*args, "--json", str(fifo)])
    finally:
        if reader.is_alive():  # the command did not open the FIFO: unblock the reader
            with open(fifo, "w"):
                pass
        reader.join(10)
    assert rc == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced by a regular file"
    assert json.loads(got[0])["cached"] == 4
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    rc, _, err = run_main([*args, "--json", str(link)])
    assert rc == 0 and link.is_symlink() and os.readlink(link) == str(real), err
    assert json.loads(real.read_text())["cached"] == 4
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


@pytest.mark.parametrize("argv", [["cache", "info"], ["cache", "list"], ["warmup", "--heads", "8/1", "--arch", "sm_90a"]])
def test_garbage_cache_cap_is_refused(argv, fake_run, monkeypatch, tmp_path):
    monkeypatch.setenv("MSA_JIT_CACHE_MAX_BYTES", "garbage")
    rc, out, err = run_main([*argv, "--cache-dir", str(tmp_path / "c")])
    assert rc == 2 and "MSA_JIT_CACHE_MAX_BYTES='garbage' is not a size" in err and "Traceback" not in err
    assert not fake_run and out == ""
    rc, out, _ = run_main(["doctor", "--cache-dir", str(tmp_path / "c")])  # doctor shows it instead
    assert rc == 0 and "MSA_JIT_CACHE_MAX_BYTES='garbage'  INVALID" in out


def test_cache_errors_are_one_line(monkeypatch, tmp_path):
    def boom(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "entry"))

    monkeypatch.setattr(cache.ArtifactCache, "entries", boom)
    (tmp_path / "c").mkdir()  # a --cache-dir that does not exist is refused before entries() runs
    rc, out, err = run_main(["cache", "list", "--cache-dir", str(tmp_path / "c")])
    assert rc == 2 and err.strip().splitlines() == [
        f"msa-jit cache list: PermissionError: [Errno 13] Permission denied: '{tmp_path / 'entry'}'"]


def test_inspect_shows_a_failed_builds_first_line(monkeypatch, tmp_path):
    error = "DSLUserCodeError: \nerror[PHASE]: Cannot use a Runtime value\n   --> msa_jit/kernels/x.py:560:14"

    def run(configs, **kw):
        return [warmup.WarmupRow(c, status="failed", error=error) for c in configs]

    monkeypatch.setattr(warmup, "run_warmup", run)
    js = tmp_path / "i.json"
    rc, out, _ = run_main(["inspect", "--heads", "8/1", "--q-dtype", "bf16", "--arch", "sm_90a", "--json", str(js)])
    assert rc == 1 and "ERROR" in out and "DSLUserCodeError: ..." in out and "PHASE" not in out
    assert max(len(line) for line in out.splitlines()) < 120
    # 2/SM, 3/SM, the union's 2/SM, 2/SM cluster
    assert [k["error"] for k in json.loads(js.read_text())["kernels"]] == [error] * 4


# ----------------------------------------------------------------------------- item 11: inspect
def test_readme_inspect_line_inspects_the_preset(monkeypatch):
    """`msa-jit inspect --arch sm_100a`, as the README writes it, failed with "no geometry":
    without --heads it inspects the minimax-m3 preset (32 builds per arch)."""
    seen: list[list[SparseDecodeConfig]] = []

    def run(configs, **kw):
        seen.append(list(configs))
        return [warmup.WarmupRow(c, status="failed", error="stand-in: nothing built") for c in configs]

    monkeypatch.setattr(warmup, "run_warmup", run)
    rc, out, err = run_main(["inspect", "--arch", "sm_100a", "-q"])
    assert "no geometry" not in err and seen, err
    assert len(seen[0]) == 32 and {c.arch for c in seen[0]} == {"sm_100a"}
    from msa_jit.geometry import MINIMAX_M3_GEOMETRIES

    assert {(c.num_q_heads, c.num_kv_heads) for c in seen[0]} == set(MINIMAX_M3_GEOMETRIES)
    assert rc == 1 and "stand-in: nothing built" in out  # the stand-in's failed rows, shown


def test_inspect_json_on_stdout_leaves_the_table_on_stderr(fake_run):
    """`msa-jit inspect --json` (no FILE): stdout is the JSON only, as in every command."""
    rc, out, err = run_main(["inspect", "--heads", "8/1", "--q-dtype", "bf16", "--arch", "sm_90a", "-q", "--json"])
    doc = json.loads(out)  # fake_run's rows have no artifact: error rows, exit 1
    assert rc == 1 and len(doc["kernels"]) == 4 and "geometry" in err and "4 kernel(s)" in err


def test_inspect_kernel_names_are_short():
    """The kernel column: the kernels module of a DSL symbol, with a method other than `kernel`
    appended; any other long name cut to 40 characters."""
    from msa_jit.cli.inspect import short_kernel_name

    tail = "_object_at_0x7f3a2c1d"
    symbol = "kernel_cutlass_{}_msa_jitkernelssplit_mergeSplitMergeKernel" + tail
    assert short_kernel_name(symbol.format("kernel")) == "split_merge"
    assert short_kernel_name(symbol.format("merge")) == "split_merge.merge"
    assert short_kernel_name("x" * 50) == "x" * 37 + "..." and short_kernel_name("short") == "short"


def _inspected(monkeypatch, local_ops: int) -> tuple[int, str]:
    """`msa-jit inspect` of the sm_100a fp8 3-CTA build (6 local-memory instructions accepted) whose
    SASS summary says `local_ops`; no compile, no nvdisasm run."""
    from msa_jit.jit import sass

    def run(configs, **kw):
        return [warmup.WarmupRow(c, status="cached", key="ab" * 32, artifact="/nowhere/sparse_decode.so")
                for c in configs if c.ctas_per_sm == 3]

    kernel = {"kernel": "kernel_cutlass_kernel_msa_jitkernelstokenSparseDecodeTokenKernel_object_at_0",
              "sm": 100, "registers": 128, "static_smem": 1024, "local_ops": local_ops, "mma_ops": {"HMMA": 8},
              "bulk_copy_ops": 0}
    monkeypatch.setattr(warmup, "run_warmup", run)
    monkeypatch.setattr(sass, "find_nvdisasm", lambda: "/usr/bin/nvdisasm")
    monkeypatch.setattr(sass, "summarize", lambda path, with_sass=True: [dict(kernel)])
    monkeypatch.setattr(compiler, "dynamic_smem_bytes", lambda cfg: 100_000)
    rc, out, _ = run_main(["inspect", "--heads", "64/4", "--q-dtype", "fp8", "--arch", "sm_100a", "-q"])
    return rc, out


def test_inspect_accepts_a_builds_known_local_memory_use(monkeypatch):
    """registry.accepted_local_ops is what a build may use without it being a spill: up to it exit 0
    (the table says so), one more is a SPILL, exit 1."""
    cfg = SparseDecodeConfig(64, 4, q_dtype="float8_e4m3fn", arch="sm_100a", ctas_per_sm=3)
    assert registry.accepted_local_ops(cfg) == 6
    rc, out = _inspected(monkeypatch, 6)
    assert rc == 0 and "6 (<= 6 accepted)" in out and "SPILL" not in out, out
    assert "1 kernel(s), 0 with local-memory ops beyond the accepted" in out and "101024" in out
    rc, out = _inspected(monkeypatch, 7)
    assert rc == 1 and "SPILL 64/4 q fp8 kv fp8 sm_100a 3/SM token: 7 LDL/STL (accepted: 6)" in out, out


# ----------------------------------------------------------------------------- item 12: output
def test_cache_fallback_is_said_without_python_warnings(fake_run, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    # a --cache-dir that cannot be used is refused (exit 2), so the fallback comes from the env root
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(blocker / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what PYTHONWARNINGS=ignore does
        for argv in (["cache", "info"], ["warmup", "--heads", "8/1", "--arch", "sm_90a", "-q"]):
            rc, out, err = run_main(argv)
            assert rc == 0, err
            lines = [line for line in err.splitlines() if "using" in line and "instead" in line]
            assert len(lines) == 1 and str(blocker) in lines[0], err


def test_compile_log_names_the_cache_entry(monkeypatch, tmp_path, caplog):
    """The INFO line of a build names the published entry, not the temporary build dir."""
    def fake_build(config, out_dir):  # stand-in for the DSL compile
        (Path(out_dir) / "sparse_decode.so").write_bytes(b"\x7fELF stand-in")
        return {"artifacts": ["sparse_decode.so"], "extra": {"kernel_family": "token", "total_s": 1.25}}

    monkeypatch.setattr(compiler, "compile_sparse_decode", fake_build)
    c = cache.ArtifactCache(tmp_path / "c")
    with caplog.at_level(logging.INFO, logger="msa_jit"):
        entry, built = compiler.ensure_compiled(SparseDecodeConfig(8, 1, arch="sm_90a"), c)
    assert built
    lines = [r.getMessage() for r in caplog.records if "compiled" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith(str(entry.path)) and "in 1.25s" in lines[0], lines
    assert "build-" not in lines[0] and "/tmp/" not in lines[0].replace(str(tmp_path), "")


NO_NUMPY = textwrap.dedent("""
    # stand-in for a Python without numpy (the main-job install): `import numpy` fails
    import sys

    class _NoNumpy:
        def find_spec(self, name, path=None, target=None):
            if name == "numpy" or name.startswith("numpy."):
                raise ModuleNotFoundError("No module named 'numpy'", name=name)
            return None

    sys.meta_path.insert(0, _NoNumpy())
""")


@pytest.mark.slow
def test_no_numpy_warning_without_numpy(tmp_path):
    """torch warns "Failed to initialize NumPy" when imported without numpy: the command (and its
    spawned workers, which import msa_jit first too) must not print it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_NUMPY)
    e = _subprocess_env(MSA_JIT_CACHE_DIR=str(tmp_path / "c"), MSA_JIT_NO_COMPILE="1")
    e["PYTHONPATH"] = os.pathsep.join((str(site), e["PYTHONPATH"]))
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=e, timeout=120)
    assert "Failed to initialize NumPy" in probe.stderr, "the stand-in does not reproduce torch's warning"
    # a warm-up whose two workers start (and fail: no-compile mode, empty cache)
    p = subprocess.run([sys.executable, "-m", "msa_jit", "warmup", "--heads", "8/1", "--q-dtype", "bf16", "--arch",
                        "sm_90a", "--jobs", "2"], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 1 and ": not in the cache" in p.stdout, p.stdout + p.stderr
    assert "NumPy" not in p.stderr, p.stderr


# ----------------------------------------------------------------------------- --kv-dtype
def test_kv_dtype_flag(fake_run):
    rc, out, _ = run_main(["warmup", "--heads", "64/4", "--q-dtype", "bf16", "--kv-dtype", "fp8,nvfp4",
                           "--arch", "sm_90a", "-q"])
    assert rc == 0 and len(fake_run[0]) == 7  # the union's build: an fp8 cache only
    assert [(c.kv_dtype, c.kernel, c.ctas_per_sm, c.split_merge) for c in fake_run[0]] == [
        ("float8_e4m3fn", "token", 2, "kernel"), ("float8_e4m3fn", "token", 3, "kernel"),
        ("float8_e4m3fn", "union", 2, "kernel"), ("float8_e4m3fn", "token", 2, "cluster"),
        ("nvfp4", "token", 2, "kernel"), ("nvfp4", "token", 3, "kernel"), ("nvfp4", "token", 2, "cluster")]
    assert [line.split()[2] for line in out.splitlines()[2:9]] == ["fp8"] * 4 + ["nvfp4"] * 3
    rc, _, err = run_main(["warmup", "--heads", "64/4", "--kv-dtype", "int4", "--arch", "sm_90a"])
    assert rc == 2 and "--kv-dtype 'int4'" in err and "fp8 or nvfp4" in err
    rc, _, _ = run_main(["warmup", "--preset", "minimax-m3", "--arch", "sm_90a,sm_100a", "-q"])
    # 4 geometries x 2 q x 2 kv x 2 occupancies x 2 arches, and sm_90a's cluster-merge builds (4 x 2 x 2) and
    # union builds (4 x 2 q, fp8 cache, its planned occupancy)
    assert rc == 0 and len(fake_run[-1]) == 88


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "nvfp4"])
def test_warmup_command_builds_exactly_its_config(kv, fake_run):
    """The hint of ArtifactMissingError, run as written, builds the missing config (--kv-dtype included)."""
    cfg = SparseDecodeConfig(32, 2, page_size=64, topk_blocks=8, q_dtype="float8_e4m3fn", kv_dtype=kv, arch="sm_100a",
                             ctas_per_sm=3)
    cmd = compiler.warmup_command(cfg).splitlines()[0]
    assert "--kv-dtype " + ("fp8" if kv == "float8_e4m3fn" else "nvfp4") in cmd
    argv = shlex.split(cmd)
    assert argv[:2] == ["msa-jit", "warmup"]
    rc, _, err = run_main([*argv[1:], "-q"])
    assert rc == 0, err
    assert cfg in fake_run[0] and {c.kv_dtype for c in fake_run[0]} == {kv}


@pytest.mark.parametrize("cfg", [SparseDecodeConfig(64, 4, arch="sm_90a", split_merge="cluster"),
                                 SparseDecodeConfig(64, 4, arch="sm_90a", kernel="union", ctas_per_sm=2)],
                         ids=["cluster", "union"])
def test_warmup_command_of_a_planned_build_builds_it(cfg, fake_run, monkeypatch):
    """A cluster-merge or union build the planner may pick is warmed by the hint as printed, with no
    environment flag to set."""
    argv = shlex.split(compiler.warmup_command(cfg).splitlines()[0])
    assert argv[:2] == ["msa-jit", "warmup"] and not [a for a in argv if a.startswith("MSA_JIT_")]
    rc, _, err = run_main([*argv[1:], "-q"])
    assert rc == 0, err
    assert cfg in fake_run[0]


def test_warmup_command_says_to_set_the_dsl_version_where_it_is_unknown(monkeypatch):
    """On a host without CuTe DSL metadata the hint also says to set MSA_JIT_DSL_VERSION (else the
    keys of the warmed cache are not the ones this host computes); with metadata it does not."""
    cfg = SparseDecodeConfig(64, 4)
    monkeypatch.setattr(compiler, "dsl_version", lambda: "unknown")
    hint = compiler.warmup_command(cfg)
    assert hint.startswith("msa-jit warmup --heads 64/4") and env.DSL_VERSION in hint.splitlines()[1]
    monkeypatch.setattr(compiler, "dsl_version", lambda: "4.8.1")
    assert env.DSL_VERSION not in compiler.warmup_command(cfg)


# every MSA_JIT_* variable a command checks, each with a value that does not parse (docs/cache.md §8)
BAD_VALUES = {
    env.NO_COMPILE: "perhaps", env.CACHE_MAX_BYTES: "garbage", env.LOCK_TIMEOUT: "soon", env.ARCH: "sm_80",
}


def test_the_commands_check_every_variable_but_three():
    """§8: every variable but the log level (falls back with a warning) and the two vLLM ones; those
    without a value that can fail to parse (a path, a version string) are checked all the same."""
    assert set(cli.CHECKED_VARIABLES) == set(env.VARIABLES) - {env.LOG_LEVEL, env.VLLM_PLUGIN, env.VLLM_SM100}
    parsed_strictly = {v for v in cli.CHECKED_VARIABLES if v not in (env.CACHE_DIR, env.DSL_VERSION, env.DSL_RUNTIME)}
    assert parsed_strictly == set(BAD_VALUES)


@pytest.mark.parametrize("argv", [
    ["cache", "list"], ["cache", "info"], ["cache", "verify"], ["cache", "prune"], ["cache", "clear", "--yes"],
    ["warmup", "--heads", "8/1", "--arch", "sm_90a"], ["inspect", "--heads", "8/1", "--arch", "sm_90a"],
    ["bench"], ["selftest"],
], ids=lambda a: " ".join(a[:2]))
def test_every_bad_variable_is_named_up_front(argv, fake_run, monkeypatch, tmp_path):
    """§8: every command but doctor exits 2 before any work, naming each bad variable (a typo in
    MSA_JIT_NO_COMPILE must not compile on a production host)."""
    root = tmp_path / "c"
    root.mkdir()  # a --cache-dir that exists: the `cache` commands would run
    for name, value in BAD_VALUES.items():
        monkeypatch.setenv(name, value)
    if argv[0] in ("cache", "warmup", "inspect"):
        argv = [*argv, "--cache-dir", str(root)]
    rc, out, err = run_main(argv)
    assert rc == 2 and out == "" and not fake_run, err
    for name, value in BAD_VALUES.items():
        assert f"{name}={value!r}" in err, (name, err)
    assert "fix or unset the variable" in err and "Traceback" not in err
    rc, out, _ = run_main(["doctor", "--cache-dir", str(root)])  # doctor shows them instead
    assert rc == 0 and all(f"{name}={value!r}  INVALID" in out for name, value in BAD_VALUES.items()), out


@pytest.mark.parametrize("command, ephemeral", [("inspect", True), ("warmup", False)])
def test_only_inspect_lets_the_warmup_use_a_temporary_cache(command, ephemeral, monkeypatch):
    """§11: `msa-jit inspect` reads the artifacts before it exits, so it passes allow_ephemeral=True;
    `msa-jit warmup` does not (nothing would be kept)."""
    seen: list[dict] = []

    def run(configs, **kw):  # stand-in for warmup.run_warmup: records its keyword arguments
        seen.append(kw)
        return [warmup.WarmupRow(c, status="failed", error="stand-in: nothing built") for c in configs]

    monkeypatch.setattr(warmup, "run_warmup", run)
    run_main([command, "--heads", "8/1", "--q-dtype", "bf16", "--arch", "sm_90a", "-q"])
    assert len(seen) == 1 and seen[0]["allow_ephemeral"] is ephemeral


def test_env_problems_lists_each_bad_variable(monkeypatch):
    assert env.problems() == []
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "perhaps")
    monkeypatch.setenv("MSA_JIT_ARCH", "sm_90")
    found = env.problems()
    assert len(found) == 2 and found[0].startswith("MSA_JIT_NO_COMPILE=") and found[1].startswith("MSA_JIT_ARCH=")


def test_a_reader_that_goes_away_is_no_error(tmp_path):
    """`msa-jit ... | head`: when stdout's reader closes the pipe the command ends quietly with 141 (128 +
    SIGPIPE, what a shell reports for a Unix tool), not 'msa-jit doctor: BrokenPipeError' and exit 2."""
    code = ("import sys, msa_jit.cli as c, msa_jit.cli.doctor as d\n"
            "d.run = lambda args: [print('x' * 100) for _ in range(100000)] and 0\n"
            "sys.exit(c.main(['doctor']))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_subprocess_env(MSA_JIT_CACHE_DIR=str(tmp_path / "c")))
    assert p.stdout.readline() == b"x" * 100 + b"\n"
    p.stdout.close()
    err = p.stderr.read()
    p.stderr.close()
    assert p.wait(timeout=120) == 141 and err == b"", err
