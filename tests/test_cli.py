"""The `msa-jit` command: warmup / cache / doctor / inspect parsing and output (no GPU needed).

One real compile (8/1 bf16 sm_90a) is shared by the module through the `warm` fixture;
tests that modify a cache work on a copy of it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from msa_jit.jit import cache
from msa_jit import cli, env
from msa_jit.tools import warmup
from msa_jit.cli import common
from msa_jit.geometry import DEFAULT_ARCHES, SparseDecodeConfig

ROOT = Path(__file__).resolve().parents[1]
WARM_ARGS = ["--heads", "8/1", "--q-dtype", "bf16", "--arch", "sm_90a"]


@pytest.fixture(autouse=True)
def _isolated(isolated_env):
    """tests/conftest.py isolation, plus the msa_jit logger restored after each test."""
    logger = logging.getLogger("msa_jit")  # main() configures it: restore it for other tests
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """`msa-jit argv` in this process -> (exit code, stdout, stderr); argparse's exit is a code too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> dict:
    """`msa-jit warmup` of 8/1 bf16 sm_90a into a fresh cache (one real compile, in a worker)."""
    d = tmp_path_factory.mktemp("cli-warm")
    root, js = d / "cache", d / "warm.json"
    with pytest.MonkeyPatch.context() as mp:  # runs before the function-scoped isolation
        for name in env.VARIABLES:
            mp.delenv(name, raising=False)
        rc, out, err = run_main(["warmup", *WARM_ARGS, "--cache-dir", str(root), "--json", str(js)])
    return {"root": root, "rc": rc, "out": out, "err": err, "json": json.loads(js.read_text()) if js.exists() else None}


def cells(line: str) -> list[str]:
    """A table row's cells (columns are 2+ spaces apart; a cell such as '2 cluster merge' has single ones)."""
    return re.split(r"\s{2,}", line.strip())


def copy_of(warm: dict, tmp_path: Path) -> Path:
    dst = tmp_path / "cache"
    shutil.copytree(warm["root"], dst, ignore=shutil.ignore_patterns("locks", "tmp"))
    return dst


# ----------------------------------------------------------------------------- warmup
@pytest.mark.slow
def test_warmup_compiles_and_reports(warm):
    assert warm["rc"] == 0, warm["out"] + warm["err"]
    lines = warm["out"].splitlines()
    assert lines[0].split() == ["geometry", "q", "kv", "arch", "CTAs/SM", "status", "seconds", "key"]
    doc = warm["json"]
    # one geometry: a build for each occupancy the planner may pick (2 and 3 CTAs per SM), the union
    # kernel's at its planned 2 CTAs per SM and the 2-CTA build that merges its splits in a cluster (the
    # planner's defaults on sm_90a)
    builds = ((2, "kernel", "2", "token"), (3, "kernel", "3", "token"), (2, "kernel", "2 union", "union"),
              (2, "cluster", "2 cluster merge", "token"))
    for line, (n, merge, cell, _), r in zip(lines[2:6], builds, doc["rows"]):
        row = cells(line)
        assert row[:6] == ["8/1", "bf16", "fp8", "sm_90a", cell, "compiled"] and row[7] == r["key"][:12]
    # the artifacts' root once, not a full path per row (the table fits a terminal)
    assert lines[6] == f"artifacts in {warm['root']} (`msa-jit cache list` shows every entry)"
    assert max(len(line) for line in lines if str(warm["root"]) not in line) <= 80, warm["out"]
    assert lines[-1] == "4 compiled, 0 cached, 0 failed"
    for n, _, cell, _ in builds:  # not a TTY: one line per item
        assert f"8/1 q bf16 kv fp8 sm_90a {n}/SM{cell[1:]}: compiled" in warm["err"]
    assert "[4/4]" in warm["err"]
    assert doc["compiled"] == 4 and doc["cached"] == 0 and doc["failed"] == 0
    assert len({r["key"] for r in doc["rows"]}) == 4
    for r, (n, merge, _, kernel) in zip(doc["rows"], builds):
        assert (r["num_q_heads"], r["num_kv_heads"], r["q_dtype"], r["kv_dtype"], r["arch"], r["ctas_per_sm"],
                r["split_merge"], r["kernel"], r["status"]) == (8, 1, "bfloat16", "float8_e4m3fn", "sm_90a", n, merge,
                                                                kernel, "compiled")
        assert r["artifact"].startswith(str(warm["root"])) and r["seconds"] > 0 and len(r["key"]) == 64
        assert Path(r["artifact"]).is_file()


@pytest.mark.slow
def test_warmup_again_is_cached_and_quiet(warm, tmp_path):
    js = tmp_path / "again.json"
    rc, out, err = run_main(["warmup", *WARM_ARGS, "--cache-dir", str(warm["root"]), "--json", str(js), "--quiet"])
    assert rc == 0 and out.splitlines()[-1] == "0 compiled, 4 cached, 0 failed"
    assert "[1/4]" not in err
    assert [r["status"] for r in json.loads(js.read_text())["rows"]] == ["cached"] * 4


def ns(**kw) -> argparse.Namespace:
    base = dict(preset=None, heads=None, q_dtype=None, kv_dtype=None, arch=None, page_size=128, topk_blocks=16)
    base.update(kw)
    return argparse.Namespace(**base)


def test_geometry_flags(monkeypatch):
    assert common.parse_heads(" 64/4") == (64, 4)
    assert [common.parse_q_dtype(x) for x in ("bf16", "FP8", "bfloat16")] == ["bfloat16", "float8_e4m3fn", "bfloat16"]
    assert [common.normalize_arch(a) for a in ("sm_100a", "sm90a", "100a", "10.0a")] == [
        "sm_100a", "sm_90a", "sm_100a", "sm_100a"]
    for bad in (lambda: common.parse_heads("64:4"), lambda: common.parse_q_dtype("fp16"),
                lambda: common.normalize_arch("hopper")):
        with pytest.raises(ValueError):
            bad()
    cfgs = common.configs_from_args(ns(heads=["64/4,16/1"], q_dtype=["bf16,fp8"], arch=["sm_90a,sm_100a"], topk_blocks=8))
    # x 2 occupancies (2 and 3 CTAs per SM: the planner picks per step shape), and on sm_90a the 2-CTA
    # build that merges its splits in a cluster and the union kernel's build at its planned 2 CTAs per SM
    assert len(cfgs) == 24 and all(c.topk_blocks == 8 for c in cfgs)
    assert sorted((c.arch, c.ctas_per_sm) for c in cfgs if c.kernel == "union") == [("sm_90a", 2)] * 4
    assert {c.ctas_per_sm for c in cfgs if c.kernel == "token"} == {2, 3}
    assert sorted((c.arch, c.ctas_per_sm) for c in cfgs if c.split_merge == "cluster") == [("sm_90a", 2)] * 4
    assert SparseDecodeConfig(16, 1, topk_blocks=8, q_dtype="float8_e4m3fn", arch="sm_100a", ctas_per_sm=3) in cfgs
    assert {c.kv_dtype for c in cfgs} == {"float8_e4m3fn"}  # without --kv-dtype: fp8 only
    # --preset minimax-m3: 4 head layouts x bf16,fp8 x kv fp8,nvfp4 x 2 occupancies per arch;
    # --q-dtype / --kv-dtype narrow it
    preset = common.configs_from_args(ns(preset="minimax-m3", arch=["sm_100a"]))
    assert len(preset) == 32 and len(set(preset)) == 32
    assert {(c.q_dtype, c.kv_dtype) for c in preset} == {(q, kv) for q in ("bfloat16", "float8_e4m3fn")
                                                         for kv in ("float8_e4m3fn", "nvfp4")}
    only = common.configs_from_args(ns(preset="minimax-m3", arch=["sm_90a"], q_dtype=["fp8"]))
    # 16 + 8 cluster-merge builds + 4 union builds (fp8 cache only)
    assert len(only) == 28 and {c.q_dtype for c in only} == {"float8_e4m3fn"}
    fp4 = common.configs_from_args(ns(preset="minimax-m3", arch=["sm_90a"], kv_dtype=["nvfp4"], q_dtype=["bf16"]))
    assert len(fp4) == 12 and {(c.q_dtype, c.kv_dtype) for c in fp4} == {("bfloat16", "nvfp4")}
    with pytest.raises(ValueError, match="--heads"):
        common.configs_from_args(ns())
    with pytest.raises(ValueError, match="multiple"):
        common.configs_from_args(ns(heads=["64/3"], arch=["sm_90a"]))


def test_default_arch(monkeypatch):
    monkeypatch.setattr(warmup, "local_gpu_arch", lambda: None)
    assert warmup.default_arches() == list(DEFAULT_ARCHES)
    assert {c.arch for c in common.configs_from_args(ns(heads=["8/1"], q_dtype=["bf16"]))} == set(DEFAULT_ARCHES)
    monkeypatch.setattr(warmup, "local_gpu_arch", lambda: "sm_100a")
    assert warmup.default_arches() == ["sm_100a"]
    monkeypatch.setenv("MSA_JIT_ARCH", "9.0a")
    assert warmup.default_arches() == ["sm_90a"]
    assert [c.arch for c in common.configs_from_args(ns(heads=["8/1"], arch=["sm_100a"]))] == ["sm_100a"] * 4


def test_warmup_bad_geometry_exits_2():
    rc, out, err = run_main(["warmup", "--heads", "12/5", "--arch", "sm_90a", "--quiet"])
    assert rc == 2 and "multiple of num_kv_heads" in err and out == ""


def test_failed_rows_exit_1(monkeypatch, tmp_path):
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "1")
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(tmp_path / "empty"))
    cfg = SparseDecodeConfig(8, 1, arch="sm_90a")
    res = warmup.compile_one(cfg.to_dict())  # what a worker returns
    assert res["status"] == "failed" and "ArtifactMissingError" in res["error"] and "msa-jit warmup" in res["error"]

    def fake_run(configs, **kw):
        rows = [warmup.WarmupRow(c) for c in configs]
        rows[0].status, rows[0].error = "failed", res["error"]
        rows[1].status, rows[1].error = "failed", "RuntimeError: boom"
        return rows

    monkeypatch.setattr(warmup, "run_warmup", fake_run)
    js = tmp_path / "f.json"
    rc, out, _ = run_main(["warmup", *WARM_ARGS, "--json", str(js)])
    assert rc == 1 and "0 compiled, 0 cached, 2 failed" in out
    # a miss under MSA_JIT_NO_COMPILE=1 in one line, and one hint that is not the warmup that just ran
    assert "FAILED 8/1 q bf16 kv fp8 sm_90a 2/SM: not in the cache\n" in out and "msa-jit warmup --heads" not in out
    assert out.splitlines()[-1].startswith("MSA_JIT_NO_COMPILE=1: this warmup only looked the kernels up; unset it "
                                           "to build the 1 missing here")
    assert "FAILED 8/1 q bf16 kv fp8 sm_90a 3/SM: RuntimeError: boom" in out  # other failures as they are
    assert json.loads(js.read_text())["rows"][0]["error"] == res["error"]


def test_progress_bar_on_a_tty(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    fake = Tty()
    monkeypatch.setattr(sys, "stderr", fake)
    advance, close = warmup._progress(2, quiet=False)
    row = warmup.WarmupRow(SparseDecodeConfig(8, 1), status="cached")
    advance(row)
    advance(row)
    close()
    assert "msa-jit warmup" in fake.getvalue() and "2/2" in fake.getvalue() and "[1/2]" not in fake.getvalue()
    monkeypatch.setattr(sys, "stderr", Tty())
    advance, close = warmup._progress(1, quiet=True)
    advance(row)
    close()
    assert sys.stderr.getvalue() == ""


def test_logging_follows_env(monkeypatch, tmp_path):
    (tmp_path / "c").mkdir()  # a --cache-dir that does not exist is exit 2
    monkeypatch.setenv("MSA_JIT_LOG_LEVEL", "info")
    run_main(["cache", "info", "--cache-dir", str(tmp_path / "c")])
    logger = logging.getLogger("msa_jit")
    assert logger.level == logging.INFO
    assert sum(getattr(h, "_msa_jit_cli_handler", False) for h in logger.handlers) == 1
    monkeypatch.setenv("MSA_JIT_LOG_LEVEL", "chatty")
    rc, _, err = run_main(["cache", "info", "--cache-dir", str(tmp_path / "c")])
    assert rc == 0 and "MSA_JIT_LOG_LEVEL" in err and logger.level == logging.WARNING
    # one line, in the format every msa_jit log line has (the compile workers' included)
    line = r"^WARNING msa_jit: MSA_JIT_LOG_LEVEL='chatty' is not a log level .*\(using WARNING\)$"
    assert re.search(line, err, re.M), err


# ----------------------------------------------------------------------------- cache
@pytest.mark.slow
def test_cache_list_and_info(warm, tmp_path):
    root = copy_of(warm, tmp_path)
    rc, out, _ = run_main(["cache", "list", "--cache-dir", str(root)])
    # one geometry: 2 occupancies, the union's 2-CTA build and the 2-CTA cluster-merge build
    keys = {r["key"]: r["ctas_per_sm"] for r in warm["json"]["rows"]}
    cell = {r["key"]: f"{r['ctas_per_sm']}{' cluster merge' if r['split_merge'] == 'cluster' else ''}"
                      f"{' union' if r['kernel'] == 'union' else ''}" for r in warm["json"]["rows"]}
    assert rc == 0 and out.splitlines()[0].split()[:7] == ["key", "geometry", "arch", "q", "kv", "CTAs/SM", "dsl"]
    rows = sorted(cells(line)[:7] for line in out.splitlines()[2:6])
    # the dsl column: what each entry was built with (its meta.json), a real version on this host
    dsl = {k: json.loads((root / "v1" / k[:2] / k / "meta.json").read_text())["fingerprint"]["cutlass_dsl"]
           for k in cell}
    assert all(v and v != "unknown" for v in dsl.values()), dsl
    assert rows == sorted([k[:12], "8/1", "sm_90a", "bf16", "fp8", c, dsl[k]] for k, c in cell.items())
    assert "4 entries in" in out
    rc, out, _ = run_main(["cache", "list", "--json", "--cache-dir", str(root)])
    entries = json.loads(out)
    assert {e["key"]: e["ctas_per_sm"] for e in entries} == keys
    assert all(e["size"] > 0 and e["created"] and e["last_used"] for e in entries)
    rc, out, _ = run_main(["cache", "info", "--cache-dir", str(root)])
    assert rc == 0 and str(root) in out and "entries:         4" in out and "cap:" in out and "fallback:        none" in out
    rc, out, _ = run_main(["cache", "info", "--json", "--cache-dir", str(root)])
    info = json.loads(out)
    assert info["entries"] == 4 and info["cap_bytes"] == 2 << 30 and info["fallback_reason"] is None  # the 2 GiB default


@pytest.mark.slow
def test_cache_verify_prune_clear(warm, tmp_path):
    root = copy_of(warm, tmp_path)
    rc, out, _ = run_main(["cache", "verify", "--cache-dir", str(root)])
    assert rc == 0 and "4 ok, 0 bad" in out
    so = Path(warm["json"]["rows"][0]["artifact"].replace(str(warm["root"]), str(root)))
    data = bytearray(so.read_bytes())
    data[100] ^= 1
    so.write_bytes(bytes(data))
    rc, out, _ = run_main(["cache", "verify", "--cache-dir", str(root)])
    assert rc == 1 and "BAD" in out and "sha256" in out and so.exists()
    rc, out, _ = run_main(["cache", "verify", "--remove", "--cache-dir", str(root)])
    assert rc == 1 and "(removed)" in out and not so.exists()
    assert run_main(["cache", "verify", "--cache-dir", str(root)])[0] == 0

    root2 = copy_of(warm, tmp_path / "b")
    rc, out, _ = run_main(["cache", "prune", "--cache-dir", str(root2)])  # default cap: 2 GiB
    assert rc == 0 and out.startswith("pruned 0 entries, 0 B freed; 4 entries")
    rc, out, _ = run_main(["cache", "prune", "--max-bytes", "0", "--yes", "--cache-dir", str(root2)])
    assert rc == 0 and out.startswith("pruned 4 entries") and cache.ArtifactCache(root2).entries() == []

    root3 = copy_of(warm, tmp_path / "c")
    rc, out, err = run_main(["cache", "clear", "--cache-dir", str(root3)])
    assert rc == 2 and "--yes" in err and len(cache.ArtifactCache(root3).entries()) == 4
    rc, out, _ = run_main(["cache", "clear", "--yes", "--cache-dir", str(root3)])
    assert rc == 0 and out.startswith("cleared 4 entries") and cache.ArtifactCache(root3).entries() == []


def test_cache_list_row_of_an_old_or_odd_entry(tmp_path):
    """`cache list` of an entry written before kernel / split_merge / kv_dtype joined the config
    (a token, merge-kernel, fp8 build), and of one with a non-default page size or top-k (named in
    the geometry cell, as warmup names it)."""
    from msa_jit.cli.cache import entry_row

    old = {"config": {"num_q_heads": 8, "num_kv_heads": 1, "arch": "sm_90a", "ctas_per_sm": 2,
                      "q_dtype": "bfloat16", "page_size": 128, "topk_blocks": 16}}
    row = entry_row(cache.CacheEntry(tmp_path, "ab" * 32, old))
    assert (row["geometry"], row["kernel"], row["split_merge"], row["q_dtype"], row["kv_dtype"]) == (
        "8/1", "token", "kernel", "bf16", "fp8")
    for page, topk in ((64, 16), (128, 8)):
        odd = {"config": {**old["config"], "page_size": page, "topk_blocks": topk, "kv_dtype": "nvfp4"}}
        row = entry_row(cache.CacheEntry(tmp_path, "cd" * 32, odd))
        assert row["geometry"] == f"8/1 page{page} top{topk}" and row["kv_dtype"] == "nvfp4"
        assert row["geometry"] == warmup.WarmupRow(SparseDecodeConfig(8, 1, page_size=page, topk_blocks=topk)).geometry


def test_cache_verify_remove_keeps_a_read_only_entry(monkeypatch, tmp_path):
    """`cache verify --remove` says "(removed)" only for a bad entry of the writable root: one of a
    read-only (pre-warmed) root is reported, and left where it is."""
    ro, rw = tmp_path / "ro" / "ee", tmp_path / "c" / "ff"
    bad = [(cache.CacheEntry(ro, "ee" * 32, {}, readonly=True), "sha256 mismatch"),
           (cache.CacheEntry(rw, "ff" * 32, {}), "sha256 mismatch")]
    monkeypatch.setattr(cache.ArtifactCache, "verify", lambda self, remove=False: bad)
    (tmp_path / "c").mkdir()
    rc, out, _ = run_main(["cache", "verify", "--remove", "--cache-dir", str(tmp_path / "c")])
    lines = [line for line in out.splitlines() if line.startswith("BAD")]
    assert rc == 1 and len(lines) == 2 and "0 ok, 2 bad" in out, out
    assert lines[0] == f"BAD {'ee' * 6} {ro}: sha256 mismatch" and lines[1].endswith("sha256 mismatch (removed)")


def test_parse_size():
    assert [common.parse_size(s) for s in ("0", "1024", "512M", "2G", "2GiB", "1.5k")] == [
        0, 1024, 512 << 20, 2 << 30, 2 << 30, 1536]
    with pytest.raises(argparse.ArgumentTypeError):
        common.parse_size("lots")


def test_human_size_and_when():
    """The size and time cells of `cache list` / `cache info`: binary units, '-' for no time."""
    assert [common.human_size(n) for n in (0, 1023, 1024, 1536, 5 << 20, 3 << 30, 5 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.0 MiB", "3.0 GiB", "5120.0 GiB"]
    assert common.when(None) == "-" and common.when(0) == "-"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", common.when(1_700_000_000.0))


# ----------------------------------------------------------------------------- doctor
@pytest.mark.slow
def test_doctor_without_gpu(warm, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("MSA_JIT_ARCH", "sm_90a")
    monkeypatch.setenv("MSA_JIT_LOCK_TIMEOUT", "soon")  # invalid values are shown, not raised
    rc, out, _ = run_main(["doctor", "--cache-dir", str(warm["root"])])
    assert rc == 0
    assert "no CUDA GPU" in out
    assert "the token kernel (mma.sync) is compiled for sm_100a" in out
    for name in env.VARIABLES:
        assert name in out
    assert "MSA_JIT_LOCK_TIMEOUT='soon'  INVALID" in out
    assert "cute-dsl" in out and "libcute_dsl_runtime.so: /" in out and "DSL compiler (cutlass): importable" in out
    assert "8/1   q bf16 kv fp8   sm_90a   2/SM ready" in out and "8/1   q bf16 kv fp8   sm_90a   3/SM ready" in out
    assert "8/1   q bf16 kv fp8   sm_90a   2/SM cluster merge ready" in out
    assert "8/1   q bf16 kv fp8   sm_90a   2/SM union ready" in out and "1/SM union" not in out
    assert "8/1   q bf16 kv nvfp4 sm_90a   2/SM missing" in out  # the preset has both KV formats
    assert "4/56 ready" in out and "sm_100a" not in out.split("readiness")[1].split("Kernel")[0]
    rc, out, _ = run_main(["doctor", "--json", "--cache-dir", str(warm["root"])])
    rep = json.loads(out)
    assert rc == 0 and rep["gpu"]["available"] is False and rep["target_arches"] == ["sm_90a"]
    assert rep["kernel_selection"]["families"] == {"sm_90a": "token"}
    assert "drafts_share_blocks" in rep["kernel_selection"]["union_policy"]
    assert sum(r["ready"] for r in rep["presets"]) == 4 and rep["cache"]["entries"] == 4


def test_doctor_survives_broken_probes(monkeypatch):
    from msa_jit.tools import doctor

    def boom():
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(doctor, "probe_versions", boom)
    monkeypatch.setattr(doctor, "probe_toolchain", boom)
    rc, out, _ = run_main(["doctor"])
    assert rc == 0 and out.count("probe failed: RuntimeError: probe exploded") == 2


def test_doctor_target_arches_and_env_values(monkeypatch):
    """The arches readiness is checked for: MSA_JIT_ARCH, else the GPUs' that msa-jit builds for,
    else all of them; env rows keep a parsed bool / int as such (JSON true, 1024), a path as text."""
    from msa_jit.tools import doctor

    gpus = {"devices": [{"arch": "sm_90a", "arch_problem": None}, {"arch": "sm_120a", "arch_problem": "not built for"}]}
    assert doctor.target_arches(gpus) == ["sm_90a"]
    assert doctor.target_arches({"devices": gpus["devices"][1:]}) == doctor.target_arches({}) == list(DEFAULT_ARCHES)
    monkeypatch.setenv("MSA_JIT_ARCH", "10.0a")
    assert doctor.target_arches(gpus) == ["sm_100a"]
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "1")
    monkeypatch.setenv("MSA_JIT_CACHE_MAX_BYTES", "1K")
    rows = {r["name"]: r for r in doctor.probe_env()}
    assert rows["MSA_JIT_NO_COMPILE"]["parsed"] is True and rows["MSA_JIT_CACHE_MAX_BYTES"]["parsed"] == 1024
    assert rows["MSA_JIT_ARCH"]["parsed"] == "sm_100a" and "error" not in rows["MSA_JIT_ARCH"]


def test_doctor_marks_a_cache_dir_that_is_a_file_invalid(monkeypatch, tmp_path):
    """What every other command refuses (exit 2) doctor reports, under the variable, as INVALID."""
    from msa_jit.tools import doctor

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(blocker))
    rows = {r["name"]: r for r in doctor.probe_env()}
    assert "exists and is not a directory" in rows["MSA_JIT_CACHE_DIR"]["error"]
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(tmp_path / "not-yet"))  # a root to be made is fine
    assert "error" not in {r["name"]: r for r in doctor.probe_env()}["MSA_JIT_CACHE_DIR"]


def test_doctor_names_a_fallback_cache_and_a_failed_version_probe(monkeypatch, tmp_path):
    """The Cache section says the root is a fallback and why; a version that could not be read
    shows its error, not a dict."""
    from msa_jit.jit import compiler

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(blocker / "cache"))

    def no_dsl():
        raise RuntimeError("no DSL here")

    monkeypatch.setattr(compiler, "dsl_version", no_dsl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc, out, _ = run_main(["doctor"])
        rep = json.loads(run_main(["doctor", "--json"])[1])
    assert rc == 0 and rep["cache"]["state"] == "fallback"
    # the per-user temp dir a process would fall back to, not created by doctor
    assert rep["cache"]["root"] == str(cache.user_temp_root()) and not cache.user_temp_root().exists()
    assert f"  root: {rep['cache']['root']} (fallback)" in out
    assert f"  fallback: {rep['cache']['fallback_reason']}" in out
    assert str(blocker) in rep["cache"]["fallback_reason"]
    assert "  cute-dsl  RuntimeError: no DSL here" in out
    assert "  sm_90a: token kernel (mma.sync)" in out  # no GPU, no MSA_JIT_ARCH: every arch


def test_doctor_gpu_and_toolchain_messages(monkeypatch):
    """Without a GPU the message says whether torch is a CPU-only build; without the DSL compiler the
    toolchain says this host can only load pre-warmed artifacts (not when it is there)."""
    import importlib.util
    import types

    import torch

    from msa_jit.tools import doctor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cuda, cpu_only in ((None, True), ("12.8", False)):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        gpu = doctor.probe_gpu()
        assert gpu["available"] is False and gpu["message"].endswith("(this torch is a CPU-only build)") is cpu_only
    monkeypatch.delitem(sys.modules, "cutlass", raising=False)
    for spec, says in ((None, True), (types.SimpleNamespace(origin="/site/cutlass/__init__.py"), False)):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, spec=spec: spec)
        dc = doctor.probe_toolchain()["dsl_compiler"]
        assert dc["importable"] is (spec is not None) and ("pre-warmed artifacts" in dc.get("message", "")) is says


def test_doctor_shows_the_report_when_rendering_fails(monkeypatch, tmp_path):
    """A bug in doctor.render must not hide the report: one line says so, the JSON follows, exit 0."""
    from msa_jit.tools import doctor

    def broken(report):
        raise KeyError("gpu")

    monkeypatch.setattr(doctor, "render", broken)
    rc, out, _ = run_main(["doctor", "--cache-dir", str(tmp_path / "c")])
    head, _, rest = out.partition("\n")
    assert rc == 0 and head == "(rendering failed: KeyError: 'gpu')", out
    rep = json.loads(rest)
    assert rep["cache"]["root"] == str(tmp_path / "c") and {"gpu", "env", "presets"} <= set(rep)


@pytest.mark.slow
def test_doctor_process_never_imports_cutlass(tmp_path):
    code = ("import sys; from msa_jit.cli import main; rc = main(['doctor', '--json']); "
            "assert rc == 0 and 'cutlass' not in sys.modules, sorted(m for m in sys.modules if 'cutlass' in m)")
    e = {k: v for k, v in os.environ.items() if not k.startswith("MSA_JIT_")}
    e.update(MSA_JIT_CACHE_DIR=str(tmp_path / "c"),
             PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert set(rep["kernel_selection"]["families"].values()) <= {"token"}


# ----------------------------------------------------------------------------- inspect
@pytest.mark.slow
def test_inspect_one_geometry(warm, tmp_path, monkeypatch):
    js = tmp_path / "inspect.json"
    rc, out, _ = run_main(["inspect", *WARM_ARGS, "--cache-dir", str(warm["root"]), "--json", str(js), "-q"])
    assert rc == 0, out
    assert out.splitlines()[0].split() == ["geometry", "q", "kv", "arch", "CTAs/SM", "kernel", "sm", "regs", "smem",
                                           "LDL/STL", "MMA"]
    assert "HMMA:" in out and "0 with local-memory ops beyond the accepted" in out
    kernels = json.loads(js.read_text())["kernels"]
    assert kernels and all(k["sm"] == 90 and k["registers"] > 0 for k in kernels)
    assert any(k["mma_ops"].get("HMMA") for k in kernels)
    # sm_90a: no local memory in any build; 3 per SM: 128 registers or fewer
    assert {k["ctas_per_sm"] for k in kernels} == {2, 3}
    assert all(k["local_ops"] == 0 == k["accepted_local_ops"] for k in kernels)
    assert all(k["registers"] <= 128 for k in kernels if k["ctas_per_sm"] == 3)
    # the cluster-merge build's two decode kernels (cluster and plain launch) are numbered, not twin rows; the
    # fp8 cluster build is the dims-split kernel (msa_jit/kernels/token_dims.py)
    cluster_rows = [line for line in out.splitlines() if "cluster merge" in line and "token_dims" in line]
    assert [re.search(r"token_dims( \(\d\))?", line).group(0) for line in cluster_rows] == [
        "token_dims (1)", "token_dims (2)"], out
    assert "(1) / (2): a cluster-merge build compiles its decode kernel for two launches" in out
    assert not re.search(r"(?<!cluster merge)  (token|token_dims|union) \(", out)  # other builds: one kernel

    from msa_jit.jit import sass

    spilled = [dict(k, local_ops=7) for k in kernels]
    monkeypatch.setattr(sass, "summarize", lambda path, with_sass=True: spilled)
    rc, out, _ = run_main(["inspect", *WARM_ARGS, "--cache-dir", str(warm["root"]), "-q"])
    assert rc == 1 and "SPILL 8/1 q bf16 kv fp8 sm_90a 2/SM" in out and "SPILL 8/1 q bf16 kv fp8 sm_90a 3/SM" in out
    spill_lines = [line for line in out.splitlines() if line.startswith("SPILL")]
    assert all(len(line) < 100 and ": 7 LDL/STL" in line and "kernel_cutlass" not in line for line in spill_lines)
    assert any("token: 7 LDL/STL" in line for line in spill_lines), spill_lines


@pytest.mark.slow
def test_inspect_smem_is_what_the_launch_uses(warm, tmp_path):
    """The "smem" column: it was the static shared memory only (1024 B for every kernel); the decode
    kernel runs on its dynamic Storage struct: >= 2 KV stages of a 128-token page (2 x 32 KiB),
    within the SM's 228 KiB at its occupancy."""
    js = tmp_path / "inspect.json"
    rc, out, _ = run_main(["inspect", *WARM_ARGS, "--cache-dir", str(warm["root"]), "--json", str(js), "-q"])
    assert rc == 0, out
    kernels = json.loads(js.read_text())["kernels"]
    decode = [k for k in kernels if "split_merge" not in k["kernel"] and k["config_kernel"] == "token"]
    merge = [k for k in kernels if "split_merge" in k["kernel"]]
    union = [k for k in kernels if "split_merge" not in k["kernel"] and k["config_kernel"] == "union"]
    # the 2- and 3-CTA builds, and the cluster-merge build's two (with and without its cluster launch)
    assert sorted((k["ctas_per_sm"], k["split_merge"]) for k in decode) == [(2, "cluster"), (2, "cluster"), (2, "kernel"),
                                                                           (3, "kernel")] and merge
    # the union's 2-CTA build: 2 stages of a 128-token page's K and V tiles, within half the SM's 228 KiB
    assert [k["ctas_per_sm"] for k in union] == [2] and 2 * 128 * 256 <= union[0]["smem"] <= 114 * 1024, union
    for k in decode:
        assert k["smem"] == k["dynamic_smem"] + k["static_smem"]
        assert 2 * 128 * 256 <= k["smem"] and k["smem"] * k["ctas_per_sm"] <= 228 * 1024, k
    smem = {(k["ctas_per_sm"], k["split_merge"]): k["smem"] for k in decode}
    # 2-CTA: 3 stages against the 3-CTA build's 2; the fp8 cluster build (the dims split): 2 padded stages, P's
    # fragments and the receive buffer
    assert smem[2, "kernel"] > smem[2, "cluster"] > smem[3, "kernel"]
    assert all(k["dynamic_smem"] == 0 and k["smem"] == k["static_smem"] for k in merge)
    for k in decode:  # the table shows the same number
        assert any(cells(line)[8] == str(k["smem"]) for line in out.splitlines()[2:]
                   if cells(line)[4].startswith(str(k["ctas_per_sm"])))


@pytest.mark.slow
def test_inspect_without_nvdisasm_shows_resources(warm, monkeypatch):
    """Without nvdisasm (the main-job install had none) every row was an ERROR; now
    registers and shared memory are shown, and one line says what is missing."""
    from msa_jit.jit import sass

    monkeypatch.setattr(sass, "find_nvdisasm", lambda: None)
    rc, out, _ = run_main(["inspect", *WARM_ARGS, "--cache-dir", str(warm["root"]), "-q"])
    assert rc == 0, out
    assert "ERROR" not in out and "nvdisasm was not found: pip install nvidia-cuda-nvdisasm" in out
    rows = [cells(line) for line in out.splitlines()[2:] if line.startswith("8/1")]
    assert len(rows) >= 2 and all(int(r[7]) > 0 and int(r[8]) >= 1024 and r[9] == "n/a" for r in rows), out
    assert "(not checked)" in out


@pytest.mark.parametrize("mode, found", [(0o755, True), (0o644, False)], ids=["executable", "not-executable"])
def test_nvdisasm_of_the_core_install(mode, found, monkeypatch, tmp_path):
    """Triton (a core dependency) ships nvdisasm: found when neither the wheel nor a toolkit is there,
    and only where it can run (a copy without its execute bit is none)."""
    from msa_jit.jit import sass

    tool = tmp_path / "site" / "triton" / "backends" / "nvidia" / "bin" / "nvdisasm"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    tool.chmod(mode)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    for v in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(v, raising=False)
    if Path("/usr/local/cuda/bin/nvdisasm").is_file():
        pytest.skip("this host has a CUDA toolkit's nvdisasm, found before Triton's")
    assert sass.find_nvdisasm() == (str(tool) if found else None)


@pytest.mark.slow
def test_warmup_nvfp4_compiles(tmp_path):
    """`msa-jit warmup --heads 64/4 --q-dtype bf16 --kv-dtype nvfp4 --arch sm_90a` builds the
    NVFP4 kernel (both occupancies, and the 2-CTA cluster-merge build); the cache lists it as kv nvfp4."""
    root, js = tmp_path / "cache", tmp_path / "w.json"
    rc, out, err = run_main(["warmup", "--heads", "64/4", "--q-dtype", "bf16", "--kv-dtype", "nvfp4", "--arch", "sm_90a",
                             "--cache-dir", str(root), "--json", str(js)])
    assert rc == 0, out + err
    doc = json.loads(js.read_text())
    assert [(r["kv_dtype"], r["ctas_per_sm"], r["split_merge"], r["status"]) for r in doc["rows"]] == [
        ("nvfp4", 2, "kernel", "compiled"), ("nvfp4", 3, "kernel", "compiled"), ("nvfp4", 2, "cluster", "compiled")]
    assert [cells(line)[:6] for line in out.splitlines()[2:5]] == [
        ["64/4", "bf16", "nvfp4", "sm_90a", n, "compiled"] for n in ("2", "3", "2 cluster merge")]
    rc, out, _ = run_main(["cache", "list", "--cache-dir", str(root)])
    assert rc == 0 and sorted(line.split()[4] for line in out.splitlines()[2:5]) == ["nvfp4"] * 3
    assert {e["kv_dtype"] for e in json.loads(run_main(["cache", "list", "--json", "--cache-dir", str(root)])[1])} == {
        "nvfp4"}


# ----------------------------------------------------------------------------- warmup without builds
def _stub_lookups(monkeypatch, tmp_path, cached: bool):
    """Cache keys without the DSL; every lookup a hit (an artifact outside the cache) or a miss."""
    from types import SimpleNamespace

    from msa_jit.jit import compiler

    monkeypatch.setattr(compiler, "cache_key", lambda cfg: f"{abs(hash(repr(cfg.to_dict()))):064d}"[-64:])
    hit = SimpleNamespace(artifact_path=lambda: tmp_path / "elsewhere" / "kernel.so")
    monkeypatch.setattr(cache.ArtifactCache, "lookup",
                        lambda self, key, verify=True, corrupt=None: hit if cached else None)


def test_warmup_configs_are_listed_once():
    """A geometry, query dtype or arch named twice builds each config once."""
    once = warmup.warmup_configs([(8, 1)], ["bfloat16"], ["sm_90a"])
    assert warmup.warmup_configs([(8, 1), (8, 1)], ["bfloat16", "bfloat16"], ["sm_90a", "sm_90a"]) == once
    assert len(set(once)) == len(once)


def test_warmup_progress_counts_cached_rows(monkeypatch, tmp_path, capsys):
    """Without a TTY every row has its `[i/N] label: status` line, cached ones included, so the count
    reaches N on a partly warm cache."""
    cfgs = warmup.warmup_configs([(8, 1)], ["bfloat16"], ["sm_90a"])
    _stub_lookups(monkeypatch, tmp_path, cached=True)
    rows = warmup.run_warmup(cfgs, cache_dir=str(tmp_path / "cache"), quiet=False)
    err = capsys.readouterr().err
    assert [r.status for r in rows] == ["cached"] * len(cfgs)
    for i, r in enumerate(rows, 1):
        assert f"[{i}/{len(cfgs)}] {r.label}: cached" in err, err


def test_warmup_whose_workers_cannot_start_fails_and_exits_1(monkeypatch, tmp_path):
    """A worker pool that cannot start fails every build not done, and `msa-jit warmup` exits 1."""
    _stub_lookups(monkeypatch, tmp_path, cached=False)

    def cannot_fork(self):
        raise OSError("cannot fork")

    monkeypatch.setattr(warmup._Pool, "start", cannot_fork)
    cfgs = warmup.warmup_configs([(8, 1)], ["bfloat16"], ["sm_90a"])
    rows = warmup.run_warmup(cfgs, cache_dir=str(tmp_path / "c1"), quiet=True)
    assert {r.status for r in rows} == {"failed"} and all("worker pool failed" in r.error for r in rows)
    rc, out, err = run_main(["warmup", *WARM_ARGS, "--quiet", "--cache-dir", str(tmp_path / "c2")])
    assert rc == 1, out + err
    assert f"0 compiled, 0 cached, {len(cfgs)} failed" in out
