"""`msa-jit warmup` as processes: where its workers write, what survives it, how it ends.

Each test runs the real command (`tests/warmup_driver.py`: the real cache, pool and signals, a
fake compile that sleeps) in a child process in its own session, so that a signal, a kill or
a leftover process is the test's own. docs/cache.md §11 is the contract.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from msa_jit.jit.cache import ArtifactCache
from msa_jit.geometry import SparseDecodeConfig

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("warmup_driver.py")
# sm_100a: the token kernel at 2 occupancies and nothing else (on sm_90a a warmup adds the union and
# cluster-merge builds, counted in test_cli): 2 geometries x 2 occupancies
FOUR = ["--heads", "8/1,16/1", "--q-dtype", "bf16", "--arch", "sm_100a"]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_env")]


def driver_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MSA_JIT_")}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    e["TMPDIR"] = str(tmp_path / "tmp")
    e["FAKE_MARKS"] = str(tmp_path / "marks")
    e["HOME"] = str(tmp_path / "home")
    for d in ("tmp", "marks", "home"):
        (tmp_path / d).mkdir(exist_ok=True)
    e.update(extra)
    return e


def run_driver(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DRIVER), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def start_driver(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(DRIVER), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def marks(env: dict[str, str]) -> list[str]:
    return sorted(os.listdir(env["FAKE_MARKS"]))


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for init to reap it is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def session_members(sid: int) -> list[int]:
    """Live processes of session `sid` (the driver was started in a session of its own)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                out.append(int(d))
    return out


def kill_session(sid: int) -> None:
    for pid in session_members(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def slow_warmup(tmp_path):
    """Start a warm-up of 4 builds on 2 workers whose builds sleep 60 s; yields (proc, env,
    worker pids) once both workers are building; kills whatever is left of it afterwards."""
    env = driver_env(tmp_path, FAKE_SLEEP="60")
    p = start_driver(["warmup", *FOUR, "--jobs", "2", "--cache-dir", str(tmp_path / "cache")], env)
    try:
        wait_for(lambda: len(marks(env)) >= 2 or p.poll() is not None, 90, "two builds to start")
        assert p.poll() is None, p.communicate()
        yield p, env, sorted({int(m.split("-")[0]) for m in marks(env)})
    finally:
        kill_session(p.pid)  # first: a leftover worker would hold the pipes open
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


# ----------------------------------------------------------------------------- item 1: what persists
def test_warmup_refuses_a_cache_that_would_not_outlive_it(tmp_path):
    env = driver_env(tmp_path)
    (tmp_path / "f").write_text("x")  # MSA_JIT_CACHE_DIR cannot be created: its parent is a file
    os.symlink("/", Path(env["TMPDIR"]) / f"msa-jit-{os.getuid()}")  # the per-user temp dir is a symlink
    env["MSA_JIT_CACHE_DIR"] = str(tmp_path / "f" / "cache")
    p = run_driver(["warmup", "--heads", "8/1", "--q-dtype", "bf16", "--arch", "sm_100a"], env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "compiled" not in p.stdout and "nothing would be kept" in p.stderr and "MSA_JIT_CACHE_DIR" in p.stderr
    assert marks(env) == []  # refused before any build
    assert sorted(os.listdir(env["TMPDIR"])) == [f"msa-jit-{os.getuid()}"]  # no temp cache left behind


def test_workers_write_where_the_parent_resolved(tmp_path):
    env = driver_env(tmp_path)
    (tmp_path / "f").write_text("x")
    env["MSA_JIT_CACHE_DIR"] = str(tmp_path / "f" / "cache")  # unusable: falls back to the per-user temp dir
    p = run_driver(["warmup", *FOUR, "--jobs", "2", "--json", str(tmp_path / "w.json")], env)
    assert p.returncode == 0, p.stderr
    fallback = Path(env["TMPDIR"]) / f"msa-jit-{os.getuid()}"
    rows = json.loads((tmp_path / "w.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["compiled"] * 4
    assert all(r["artifact"].startswith(str(fallback) + "/") and Path(r["artifact"]).is_file() for r in rows)
    fallback_lines = [line for line in p.stderr.splitlines() if "cannot use" in line and "instead" in line]
    assert len(fallback_lines) == 1, p.stderr  # the parent resolved once; the workers did not


def test_in_process_temp_root_is_shared_with_the_workers(tmp_path):
    """allow_ephemeral=True (what `msa-jit inspect` needs): the workers build into the
    parent's temporary root, so the artifacts exist while the parent runs."""
    env = driver_env(tmp_path)
    (tmp_path / "f").write_text("x")
    os.symlink("/", Path(env["TMPDIR"]) / f"msa-jit-{os.getuid()}")
    env["MSA_JIT_CACHE_DIR"] = str(tmp_path / "f")
    p = run_driver(["run_warmup", "8/1"], env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ephemeral"] and [r["status"] for r in out["rows"]] == ["compiled", "compiled"]
    assert all(r["exists"] and r["artifact"].startswith(out["root"] + "/") for r in out["rows"]), out
    assert not Path(out["root"]).exists()  # and the parent's exit removed it
    assert sorted(os.listdir(env["TMPDIR"])) == [f"msa-jit-{os.getuid()}"]


def test_a_dying_worker_fails_only_its_build(tmp_path):
    env = driver_env(tmp_path, FAKE_CRASH="8-1-3")  # e.g. the OOM killer, mid-build
    p = run_driver(["warmup", *FOUR, "--jobs", "2", "--cache-dir", str(tmp_path / "cache"),
                    "--json", str(tmp_path / "w.json")], env)
    assert p.returncode == 1, p.stderr
    rows = {(r["num_q_heads"], r["ctas_per_sm"]): r for r in json.loads((tmp_path / "w.json").read_text())["rows"]}
    assert rows[(8, 3)]["status"] == "failed" and "died (killed by SIGKILL)" in rows[(8, 3)]["error"]
    assert [rows[k]["status"] for k in ((8, 2), (16, 2), (16, 3))] == ["compiled"] * 3
    assert "0 compiled" not in p.stdout and "3 compiled, 0 cached, 1 failed" in p.stdout


# ----------------------------------------------------------------------------- item 6: no-compile
def test_no_compile_warmup_names_the_corrupt_entry(tmp_path):
    """MSA_JIT_NO_COMPILE=1: the parent's lookup finds the corrupt entry (and removes it); the
    failed row's ArtifactMissingError must still say so, not read like a plain miss."""
    root = tmp_path / "cache"
    args = ["warmup", "--heads", "8/1", "--q-dtype", "bf16", "--arch", "sm_100a", "--cache-dir", str(root)]
    env = driver_env(tmp_path)
    assert run_driver(args, env).returncode == 0
    entries = {e.meta["config"]["ctas_per_sm"]: e for e in ArtifactCache(root).entries()}
    data = bytearray(entries[2].artifact_path().read_bytes())
    data[7] ^= 0xFF
    entries[2].artifact_path().write_bytes(bytes(data))
    p = run_driver([*args, "--json", str(tmp_path / "w.json")], dict(env, MSA_JIT_NO_COMPILE="1"))
    assert p.returncode == 1, p.stdout + p.stderr
    rows = {r["ctas_per_sm"]: r for r in json.loads((tmp_path / "w.json").read_text())["rows"]}
    assert rows[3]["status"] == "cached" and rows[2]["status"] == "failed"
    err = rows[2]["error"]
    assert err.startswith("ArtifactMissingError") and "corrupt" in err and "sha256" in err, err
    assert str(entries[2].path) in err and "removed" in err, err
    assert "so that it is rebuilt" not in p.stderr and "not rebuilt on this host" in p.stderr


# ----------------------------------------------------------------------------- item 2: the cap
def test_auto_prune_never_undoes_the_warmup(tmp_path):
    env = driver_env(tmp_path, MSA_JIT_CACHE_MAX_BYTES="5000", FAKE_SIZE="4096")  # below one entry + meta
    root = tmp_path / "cache"
    args = ["warmup", *FOUR, "--jobs", "2", "--cache-dir", str(root)]
    p = run_driver([*args, "--json", str(tmp_path / "1.json")], env)
    assert p.returncode == 0, p.stderr
    rows = json.loads((tmp_path / "1.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["compiled"] * 4
    c = ArtifactCache(root)
    assert all(c.lookup(r["key"]) is not None for r in rows)  # all four kept
    assert "MSA_JIT_CACHE_MAX_BYTES" in p.stderr and "smaller than" in p.stderr
    again = run_driver([*args, "--json", str(tmp_path / "2.json")], env)
    assert again.returncode == 0 and "0 compiled, 4 cached, 0 failed" in again.stdout
    assert "smaller than" in again.stderr  # said again: the next build elsewhere would prune them


# ----------------------------------------------------------------------------- item 5: orphans
def test_workers_die_with_a_killed_parent(slow_warmup):
    p, env, workers = slow_warmup
    assert len(workers) == 2 and p.pid not in workers
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)
    wait_for(lambda: not any(alive(w) for w in workers), 10, f"workers {workers} to die with their parent")
    wait_for(lambda: session_members(p.pid) == [], 10, "the warm-up's session to be empty")
    assert len(marks(env)) == 2  # the queued builds never started


# ----------------------------------------------------------------------------- item 8: Ctrl-C
@pytest.mark.parametrize("to", ["group", "parent", "group twice"])
def test_ctrl_c_cancels_ends_workers_and_exits_130(slow_warmup, to):
    p, env, workers = slow_warmup
    t0 = time.monotonic()
    if to == "parent":  # kill -INT <pid>
        os.kill(p.pid, signal.SIGINT)
    else:  # a terminal's Ctrl-C: the whole foreground process group
        os.killpg(p.pid, signal.SIGINT)
        if to == "group twice":  # impatient: again while the workers end, and while it exits
            for pause in (0.1, 0.7):
                time.sleep(pause)
                try:
                    os.killpg(p.pid, signal.SIGINT)
                except ProcessLookupError:
                    break
    out, err = p.communicate(timeout=30)
    took = time.monotonic() - t0
    assert p.returncode == 130, err
    assert took < 10, took
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    said = [line for line in err.splitlines() if "interrupted" in line]
    assert len(said) == 1 and out == "", err
    assert "0 compiled" in said[0] and "2 interrupted" in said[0] and "2 not started" in said[0], said
    assert len(marks(env)) == 2  # the queued builds were cancelled, not run
    wait_for(lambda: session_members(p.pid) == [], 10, "no process of the warm-up to survive")
    c = ArtifactCache(Path(env["FAKE_MARKS"]).parent / "cache")
    assert c.entries() == []
    assert [d.name for d in (c.v1 / "tmp").iterdir() if d.name.startswith("build-")] == []  # builds cleaned up


def test_interrupt_line_names_what_finished(tmp_path):
    """A finished build is kept and counted; the line says what did not finish."""
    from msa_jit.tools import warmup

    rows = [warmup.WarmupRow(SparseDecodeConfig(8, 1), status=s)
            for s in ("compiled", "cached", "interrupted", "cancelled", "cancelled")]
    line = warmup.interrupted_summary(rows)
    assert line == "1 compiled, 1 cached, 1 interrupted, 2 not started", line
