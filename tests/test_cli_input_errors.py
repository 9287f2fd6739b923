"""Bad `msa-jit` input refused up front (exit 2, one line naming the flag), no GPU needed.

bench's --layers / --decode-query-len / --kv-dtype, empty comma lists, non-bench JSON for
--table, and doctor's cap line with an invalid MSA_JIT_CACHE_MAX_BYTES. Where a
command would get past its checks, the work (`bench.main`, `warmup.run_warmup`) is a stand-in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from msa_jit.tools import bench, warmup
from msa_jit.cli import common
from msa_jit.geometry import KV_DTYPES, MAX_QLEN, MIN_QLEN

# the msa_jit logger restored after each test (autouse, imported) and the in-process `msa-jit`
from test_cli import _isolated, run_main  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
GOOD_RESULT = ROOT / "bench/results/h100.json"
NOT_BENCH = ROOT / "tests/fixtures/variants.json"  # a `bench/variants.py` result: JSON, but no bench result


@pytest.fixture
def fake_bench(monkeypatch) -> list[dict[str, Any]]:
    """A "GPU" and a stand-in for bench.main that records its keywords: a bench that gets past
    its checks returns 0 without timing anything."""
    import torch

    calls: list[dict[str, Any]] = []

    def main(out_dir, baseline="auto", **kw):
        calls.append(kw)
        return {}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "main", main)
    return calls


@pytest.fixture
def fake_run(monkeypatch) -> list[list]:
    """Stand-in for warmup.run_warmup: records the configs, returns them all 'cached'."""
    calls: list[list] = []

    def run(configs, **kw):
        calls.append(list(configs))
        return [warmup.WarmupRow(c, status="cached", key="ab" * 32) for c in configs]

    monkeypatch.setattr(warmup, "run_warmup", run)
    return calls


# ----------------------------------------------------------------------------- bench --layers
@pytest.mark.parametrize("layers", ["1", "0"])
def test_bench_refuses_fewer_than_two_layers(layers, fake_bench, tmp_path):
    rc, out, err = run_main(["bench", "--layers", layers, "--out", str(tmp_path)])
    assert rc == 2 and "--layers" in err and ">= 2" in err and not fake_bench and out == "", err


def test_bench_takes_two_layers(fake_bench, tmp_path):
    rc, _, err = run_main(["bench", "--layers", "2", "--out", str(tmp_path)])
    assert rc == 0 and fake_bench[0]["num_layers"] == 2, err


# ----------------------------------------------------------------------------- bench --decode-query-len
@pytest.mark.parametrize("qlens", [str(MAX_QLEN + 1), f"1,{MAX_QLEN + 1}", str(MIN_QLEN - 1)])
def test_bench_refuses_qlens_out_of_range(qlens, fake_bench, tmp_path):
    rc, _, err = run_main(["bench", "--decode-query-len", qlens, "--out", str(tmp_path)])
    assert rc == 2 and "--decode-query-len" in err and f"{MIN_QLEN}..{MAX_QLEN}" in err and not fake_bench, err


def test_bench_takes_qlens_in_range(fake_bench, tmp_path):
    rc, _, err = run_main(["bench", "--decode-query-len", f"{MIN_QLEN},{MAX_QLEN}", "--out", str(tmp_path)])
    assert rc == 0 and fake_bench[0]["qlens"] == (MIN_QLEN, MAX_QLEN), err


# ----------------------------------------------------------------------------- bench --kv-dtype
@pytest.mark.parametrize("text, want", [
    ("fp8", ("float8_e4m3fn",)), ("nvfp4", ("nvfp4",)), ("fp8,nvfp4", KV_DTYPES), ("float8_e4m3fn", ("float8_e4m3fn",)),
    (" FP8 , nvfp4 ", KV_DTYPES),
])
def test_bench_kv_dtypes_take_warmups_names(text, want, fake_bench, tmp_path):
    rc, _, err = run_main(["bench", "--kv-dtype", text, "--out", str(tmp_path)])
    assert rc == 0 and fake_bench[0]["kv_dtypes"] == want, err


def test_bench_default_kv_dtypes_are_the_grids(fake_bench, tmp_path):
    rc, _, err = run_main(["bench", "--out", str(tmp_path)])
    assert rc == 0 and fake_bench[0]["kv_dtypes"] == tuple(bench.GRID_KV_DTYPES), err


def test_bench_unknown_kv_dtype_names_the_flag(fake_bench, tmp_path):
    rc, _, err = run_main(["bench", "--kv-dtype", "fp4", "--out", str(tmp_path)])
    assert rc == 2 and "--kv-dtype 'fp4'" in err and "fp8 or nvfp4" in err and not fake_bench, err


# ----------------------------------------------------------------------------- bench: what reaches the grid
def test_bench_flags_reach_the_grid(fake_bench, tmp_path):
    """--quick's qlens and shared point, --no-shared, --no-host, --in-graph, --iters and
    --floor-batch are what bench.main gets; without them the full grid."""
    rc, _, err = run_main(["bench", "--out", str(tmp_path)])
    assert rc == 0, err
    kw = fake_bench[-1]
    assert (kw["qlens"], kw["shared_points"], kw["floor_batches"], kw["host"], kw["in_graph"], kw["iters"]) == (
        bench.GRID_QLENS, bench.SHARED_POINTS, bench.FLOOR_BATCHES, True, False, 50)
    rc, _, err = run_main(["bench", "--quick", "--no-host", "--in-graph", "--iters", "7", "--floor-batch", "1,4",
                           "--out", str(tmp_path)])
    assert rc == 0, err
    kw = fake_bench[-1]
    assert (kw["qlens"], kw["shared_points"], kw["floor_batches"], kw["host"], kw["in_graph"], kw["iters"]) == (
        bench.QUICK_QLENS, bench.QUICK_SHARED_POINTS, (1, 4), False, True, 7)
    for flags in (["--no-shared"], ["--quick", "--no-shared"]):
        assert run_main(["bench", *flags, "--out", str(tmp_path)])[0] == 0 and fake_bench[-1]["shared_points"] == ()


@pytest.mark.parametrize("result, rc", [({}, 0), ({"regressions": ["step ...: 2.0 us vs 1.0 us before"]}, 1),
                                        ({"errors": [{"kv_dtype": "nvfp4"}]}, 1),
                                        ({"incomplete": {"rows_done": 1, "rows": 2}}, 1)],
                         ids=["clean", "regression", "error", "stopped"])
def test_bench_exit_status_and_baseline(result, rc, monkeypatch, tmp_path):
    """Exit 1 on a regression, a failed row or a run stopped early (SIGTERM); --baseline is passed on."""
    import torch

    seen: list[tuple] = []

    def main(out_dir, baseline="auto", **kw):
        seen.append((out_dir, baseline))
        return result

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "main", main)
    got, _, err = run_main(["bench", "--out", str(tmp_path), "--baseline", "none"])
    assert got == rc and seen == [(str(tmp_path), "none")], err


def test_bench_out_that_is_not_writable_is_refused(fake_bench, tmp_path, monkeypatch):
    """--out under a directory this user cannot write is refused before the grid runs."""
    from msa_jit.cli import bench as bench_cli

    ro = tmp_path / "ro"
    ro.mkdir()
    real_mkdtemp = bench_cli.tempfile.mkdtemp

    def mkdtemp(*a, dir=None, **k):  # as a non-root user meets 0o500 (root passes every bit)
        if os.fspath(dir) == str(ro):
            raise PermissionError(13, "Permission denied")
        return real_mkdtemp(*a, dir=dir, **k)

    monkeypatch.setattr(bench_cli.tempfile, "mkdtemp", mkdtemp)
    rc, _, err = run_main(["bench", "--out", str(ro / "results")])
    assert rc == 2 and f"{ro} is not a writable directory" in err and not fake_bench, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_bench_out_where_nothing_can_be_made_is_refused(fake_bench, monkeypatch):
    """A folder that passes the permission bits (root passes them all) but where nothing can be
    created (/proc; a read-only or full filesystem alike) is refused before the grid runs: the
    check makes a directory there, it does not ask os.access."""
    monkeypatch.setattr(os, "access", lambda *a, **k: True)  # what root is told
    rc, _, err = run_main(["bench", "--out", "/proc/msa-jit-bench"])
    assert rc == 2 and "--out /proc/msa-jit-bench: /proc is not a writable directory" in err and not fake_bench, err


# ----------------------------------------------------------------------------- bench --baseline
@pytest.mark.parametrize("content, says", [
    (None, "cannot read it"), ("", "not JSON"), ("{}", "not a bench result"),
    ('{"environment": {}, "copy_tbps": 3, "points": [{"us": "fast"}], "per_layer": []}',
     'not a bench result (points[0].us is "fast", not a number)')])
def test_bench_baseline_is_read_before_the_grid(content, says, fake_bench, tmp_path):
    """An explicit --baseline that cannot be compared is exit 2 before any GPU work, not after
    the grid, when the run would be lost."""
    path = tmp_path / "base.json"
    if content is not None:
        path.write_text(content)
    rc, out, err = run_main(["bench", "--out", str(tmp_path / "out"), "--baseline", str(path)])
    assert rc == 2 and f"--baseline {path}: {says}" in err and len(err.strip().splitlines()) == 1, err
    assert not fake_bench and not (tmp_path / "out").exists()
    rc, _, err = run_main(["bench", "--out", str(tmp_path / "out"), "--baseline", str(GOOD_RESULT)])
    assert rc == 0 and len(fake_bench) == 1, err


def test_bench_result_is_written_before_the_baseline_comparison(monkeypatch, tmp_path):
    """A baseline that fails the comparison (here: one with broken rows, as `auto` may pick) costs
    no result: the file is written, says why it was not compared, and the run exits 1."""
    from msa_jit.tools.bench import measure, report

    result = json.loads(GOOD_RESULT.read_text())
    monkeypatch.setattr(measure, "run_grid", lambda **kw: json.loads(json.dumps(result)))
    monkeypatch.setattr(report, "plot", lambda result, path: None)
    base = tmp_path / "base.json"
    base.write_text(json.dumps({**result, "points": [{**result["points"][0], "us": "fast"}]}))
    got = measure.main(str(tmp_path / "out"), baseline=str(base))
    (written,) = (tmp_path / "out").glob("bench-*.json")
    doc = json.loads(written.read_text())
    assert "points[0].us" in got["baseline_error"] and doc["baseline_error"] == got["baseline_error"]
    assert doc["per_layer"] == result["per_layer"] and doc["baseline"] == str(base)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "main", lambda out_dir, baseline="auto", **kw: got)
    assert run_main(["bench", "--out", str(tmp_path / "out"), "--baseline", "none"])[0] == 1


# ----------------------------------------------------------------------------- bench --table
@pytest.mark.parametrize("flag", ["--table"])
@pytest.mark.parametrize("content", [None, "{}", "[1]", '"text"', "3", "null", '{"points": []}',
                                     '{"environment": {}, "copy_tbps": 3.0, "points": {}, "host": {}}'])
def test_summary_and_table_refuse_what_is_no_bench_result(flag, content, tmp_path):
    path = NOT_BENCH if content is None else tmp_path / "other.json"
    if content is not None:
        path.write_text(content)
    rc, out, err = run_main(["bench", flag, str(path), "--baseline", "none"])
    assert rc == 2 and f"{flag} {path}: not a bench result" in err and out == "", err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--table"])
def test_summary_and_table_of_a_bench_result(flag):
    rc, out, err = run_main(["bench", flag, str(GOOD_RESULT), "--baseline", "none"])
    assert rc == 0 and out.strip() and err == "", err


@pytest.mark.parametrize("flag", ["--table"])
def test_summary_and_table_of_a_result_with_broken_rows(flag, tmp_path):
    """A file with a bench result's keys but rows missing theirs: exit 2 and one line, no traceback."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"environment": {"device": "NVIDIA H200", "date": "2026-12-05"}, "copy_tbps": 3.0,
                                "points": [], "per_layer": [{"kv_dtype": "nvfp4"}]}))
    rc, out, err = run_main(["bench", flag, str(path), "--baseline", "none"])
    assert rc == 2 and f"{flag} {path}: not a bench result (missing " in err and out == "", err
    assert len(err.strip().splitlines()) == 1


def _mutated(change) -> dict:
    doc = json.loads(GOOD_RESULT.read_text())
    change(doc)
    return doc


@pytest.mark.parametrize("change, says", [
    (lambda d: d["points"][0].update(us="fast"), 'points[0].us is "fast", not a number'),
    (lambda d: d["points"][0].update(us=None), "points[0].us is null, not a number"),
    (lambda d: d["per_layer"][2].update(marginal_us="x"), 'per_layer[2].marginal_us is "x", not a number'),
    (lambda d: d["per_layer"][0].update(batch="1"), 'per_layer[0].batch is "1", not an integer'),
    (lambda d: d["points"][0].update(kv_dtype=[1]), "points[0].kv_dtype is [1], not a string"),
    (lambda d: d["per_layer"][0].update(speedup_vs_vllm="x"), 'per_layer[0].speedup_vs_vllm is "x", not a number'),
    (lambda d: d.update(points=1), "'points' is not a JSON array"),
    (lambda d: d.update(points=[1]), "points[0] is not a JSON object"),
    (lambda d: d.update(grid="x"), "'grid' is not a JSON object"),
    (lambda d: d["grid"].update(batches="x"), "'grid.batches' is not a JSON array"),
    (lambda d: [d.pop(k) for k in ("per_layer", "host", "host_b256")], "missing 'per_layer' or 'host'"),
])
def test_table_of_a_result_with_contents_of_the_wrong_type(change, says, tmp_path):
    """Well-formed JSON whose contents the tables cannot read: one line naming what is wrong,
    exit 2, no traceback ("missing" only for what is missing)."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_mutated(change)))
    rc, out, err = run_main(["bench", "--table", str(path)])
    assert rc == 2 and err.strip() == f"msa-jit bench: --table {path}: not a bench result ({says})" and out == "", err


def test_table_of_a_result_without_rows_shows_empty_cells(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_mutated(lambda d: d.update(points=[], per_layer=[]))))
    rc, out, err = run_main(["bench", "--table", str(path)])
    assert rc == 0 and "| 64/4 | 1 | — |" in out and err == "", err


@pytest.mark.parametrize("flags", [["--heads", "99/1"], ["--batch=-3"], ["--compare", "bogus"], ["--out", "afile"],
                                   ["--quick", "--no-host"], ["--baseline", "other.json"], ["--geometries", "8/1"]])
def test_table_refuses_the_flags_of_a_run(flags, fake_bench):
    """--table runs nothing: a grid or run flag beside it is named and refused, not ignored."""
    rc, out, err = run_main(["bench", "--table", str(GOOD_RESULT), *flags])
    named = {"--geometries": "--heads", "--no-host": "--quick"}.get(flags[0], flags[0].split("=")[0])
    assert rc == 2 and out == "" and "--table" in err and named in err and "cannot go with it" in err, err
    assert not fake_bench


def test_stored_files_bench_or_not():
    from msa_jit.tools.bench.report import result_problem

    stored = sorted((ROOT / "bench/results").glob("h[12]00.json"))
    assert stored, "no bench result in bench/results"
    for path in stored:
        assert result_problem(json.loads(path.read_text())) is None, path
    assert result_problem(json.loads(NOT_BENCH.read_text())) is not None, NOT_BENCH


# ----------------------------------------------------------------------------- empty comma lists
@pytest.mark.parametrize("command", ["warmup", "inspect"])
@pytest.mark.parametrize("flags, flag", [
    (["--arch", ""], "--arch"), (["--arch", ","], "--arch"), (["--arch", "sm_90a", "--arch", " "], "--arch"),
    (["--q-dtype", ""], "--q-dtype"), (["--kv-dtype", ","], "--kv-dtype"),
])
def test_geometry_flags_refuse_an_empty_list(command, flags, flag, fake_run):
    rc, out, err = run_main([command, "--heads", "8/1", *flags, "-q"])
    assert rc == 2 and f"{flag} " in err and "empty" in err and not fake_run and out == "", err


@pytest.mark.parametrize("command", ["warmup", "inspect"])
def test_empty_heads_is_refused(command, fake_run):
    rc, _, err = run_main([command, "--heads", "", "--arch", "sm_90a", "-q"])
    assert rc == 2 and "--heads" in err and "empty" in err and not fake_run, err


def test_a_trailing_comma_is_still_fine(fake_run):
    rc, _, err = run_main(["warmup", "--heads", "8/1,", "--q-dtype", "bf16, ", "--arch", "sm_90a,", "-q"])
    assert rc == 0 and {c.arch for c in fake_run[0]} == {"sm_90a"}, err


@pytest.mark.parametrize("flag", ["--heads", "--batch", "--kv-dtype", "--q-dtype", "--decode-query-len"])
@pytest.mark.parametrize("value", ["", ","])
def test_bench_lists_refuse_empty(flag, value, fake_bench, tmp_path):
    rc, _, err = run_main(["bench", flag, value, "--out", str(tmp_path)])
    assert rc == 2 and f"{flag} " in err and "empty" in err and not fake_bench, err


def test_bench_floor_batches_may_be_empty(fake_bench, tmp_path):
    rc, _, err = run_main(["bench", "--floor-batch", "", "--out", str(tmp_path)])
    assert rc == 0 and fake_bench[0]["floor_batches"] == (), err


def test_split_list():
    assert common.split_list("--x", None) == []
    assert common.split_list("--x", "a, b,") == ["a", "b"]
    assert common.split_list("--x", ["a", "b,c"]) == ["a", "b", "c"]
    assert common.split_list("--x", ",", allow_empty=True) == []
    with pytest.raises(ValueError, match="--x ','"):
        common.split_list("--x", ["a", ","])


# ----------------------------------------------------------------------------- doctor
def test_doctor_cap_line_with_an_invalid_cap(monkeypatch, tmp_path):
    monkeypatch.setenv("MSA_JIT_CACHE_MAX_BYTES", "abc")
    rc, out, _ = run_main(["doctor", "--cache-dir", str(tmp_path / "c")])
    cap = [line for line in out.splitlines() if line.strip().startswith("entries:")]
    assert rc == 0 and len(cap) == 1 and cap[0].endswith("cap invalid (see Environment)"), cap
    assert "{'error'" not in out and "MSA_JIT_CACHE_MAX_BYTES='abc'  INVALID" in out


def test_doctor_cap_line_with_a_valid_cap(monkeypatch, tmp_path):
    monkeypatch.setenv("MSA_JIT_CACHE_MAX_BYTES", "1K")
    rc, out, _ = run_main(["doctor", "--cache-dir", str(tmp_path / "c")])
    assert rc == 0 and "cap 1024 bytes" in out


