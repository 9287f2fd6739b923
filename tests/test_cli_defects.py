"""The `msa-jit` command's edges: start-up cost, interrupts, closed pipes, --json, cache roots that
cannot be one, doctor's hands off the cache, prune's summary and question, the shared flags,
sizes that overflow, --jobs and memory, an empty HOME.

No kernel is compiled: cache entries are built with a stand-in compile (a few random bytes), and
the processes that need a real command (signals, pipes) run `msa-jit` as a script named
`msa-jit`, as its console script is, so that the package imports lazily as it does there.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from msa_jit import env
from msa_jit.cli import common
from msa_jit.geometry import SparseDecodeConfig
from msa_jit.jit import cache
from msa_jit.tools import warmup

# the msa_jit logger restored after each test (autouse, imported) and the in-process `msa-jit`
from test_cli import _isolated, run_main  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "triton", "cutlass", "msa_jit.tools.bench.measure", "msa_jit.tools.bench.steps", "msa_jit.op")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MSA_JIT_")}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    e["TMPDIR"] = str(tmp_path)
    e.update(extra)
    return e


def _script(tmp_path: Path, body: str) -> Path:
    """A script named `msa-jit` (as the console script is: the package imports lazily in it)."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    path = d / "msa-jit"
    path.write_text(textwrap.dedent(body))
    return path


def _fake_compile_code(install: bool = True) -> str:
    """Module code: a stand-in for the DSL compile (a few random bytes as the artifact), installed
    as compiler.compile_sparse_decode unless `install` is False."""
    return textwrap.dedent("""
        import os
        from msa_jit.jit import compiler
        from msa_jit.kernels import convention

        def fake_compile(config, out_dir, kernel_options=None, kernel_class=None):
            name = convention.ARTIFACT_NAME
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(os.urandom(4096))
            return {"artifacts": [name], "extra": {"fake": True}}
    """) + ("compiler.compile_sparse_decode = fake_compile\n" if install else "")


def _entries(root: Path, configs: list[SparseDecodeConfig], monkeypatch) -> list[cache.CacheEntry]:
    """Real cache entries of `configs` in `root`, each built by the stand-in compile (this test's
    only: the real compile is back afterwards)."""
    from msa_jit.jit import compiler

    ns: dict = {}
    exec(_fake_compile_code(install=False), ns)
    monkeypatch.setattr(compiler, "compile_sparse_decode", ns["fake_compile"])
    c = cache.ArtifactCache(root)
    return [compiler.ensure_compiled(cfg, cache=c)[0] for cfg in configs]


# ----------------------------------------------------------------------------- Ctrl-C
def _interrupted_once(p: subprocess.Popen, err: str, line: str = "interrupted") -> None:
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Exception ignored" not in err, err
    assert len([x for x in err.splitlines() if line in x]) == 1, err


WARMUP_SCRIPT = """
    import os, sys, time
    {fake_compile}
    marks = os.environ["FAKE_MARKS"]
    if __name__ == "__mp_main__":  # a compile worker, importing its parent's main module
        open(os.path.join(marks, f"importing-{{os.getpid()}}"), "w").close()
        time.sleep(float(os.environ.get("FAKE_IMPORT_SLEEP", "0")))

    class SlowToFree:
        def __del__(self):  # where a signal's exception cannot propagate (an 'ignored' exception)
            first = not any(m.startswith("del-") for m in os.listdir(marks))
            open(os.path.join(marks, f"del-{{os.getpid()}}"), "w").close()
            if first:  # the first build only
                time.sleep(float(os.environ.get("FAKE_DEL_SLEEP", "0")))

    real = fake_compile

    def compile_slowly(config, out_dir, **kw):
        SlowToFree()
        return real(config, out_dir, **kw)

    compiler.compile_sparse_decode = compile_slowly
    if __name__ == "__main__":
        from msa_jit.cli import main
        sys.exit(main(sys.argv[1:]))
"""


def _warmup_script(tmp_path: Path) -> Path:
    return _script(tmp_path, WARMUP_SCRIPT.format(fake_compile=textwrap.indent(_fake_compile_code(), "    ").strip()))


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _kill_session(sid: int) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the workers' signal masks in /proc")
def test_ctrl_c_while_a_worker_starts_prints_no_worker_traceback(tmp_path):
    """A terminal's Ctrl-C (the whole process group) while the compile workers are still starting
    (importing): they must not die with a KeyboardInterrupt traceback of their own. They start
    with SIGINT blocked, also the first one, which starts multiprocessing's resource tracker (which
    unblocks SIGINT in the parent once it runs)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = _warmup_script(tmp_path)
    e = _env(tmp_path, FAKE_MARKS=str(marks), FAKE_IMPORT_SLEEP="20")
    p = subprocess.Popen([sys.executable, str(script), "warmup", "--heads", "8/1,16/1", "--q-dtype", "bf16", "--arch",
                          "sm_90a", "-j", "2", "--cache-dir", str(tmp_path / "c")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=e, start_new_session=True)
    try:
        _wait_for(lambda: len(list(marks.glob("importing-*"))) >= 2 or p.poll() is not None, 60, "two workers")
        assert p.poll() is None, p.communicate()
        for m in marks.glob("importing-*"):  # each worker, still importing, has SIGINT blocked
            status = Path(f"/proc/{m.name.split('-')[1]}/status").read_text()
            blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
            assert blocked & (1 << (signal.SIGINT - 1)), (m.name, status)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        _kill_session(p.pid)
    _interrupted_once(p, err)
    assert "msa-jit warmup: interrupted:" in err and "not started" in err, err


@pytest.mark.slow
def test_sigterm_of_a_worker_in_a_finalizer_ends_it_quietly(tmp_path):
    """SIGTERM of a compile worker while it runs a __del__ (the compiler's objects have them): the
    SystemExit cannot propagate there; the worker ends (exit 143) instead of printing 'Exception
    ignored ... SystemExit: 143' and building on."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = _warmup_script(tmp_path)
    e = _env(tmp_path, FAKE_MARKS=str(marks), FAKE_DEL_SLEEP="30")
    p = subprocess.Popen([sys.executable, str(script), "warmup", "--heads", "8/1", "--q-dtype", "bf16", "--arch",
                          "sm_90a", "-j", "1", "--cache-dir", str(tmp_path / "c"), "-q"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=e, start_new_session=True)
    try:
        _wait_for(lambda: list(marks.glob("del-*")) or p.poll() is not None, 60, "a build in __del__")
        assert p.poll() is None, p.communicate()
        worker = int(next(marks.glob("del-*")).name.split("-")[1])
        os.kill(worker, signal.SIGTERM)
        _wait_for(lambda: not os.path.exists(f"/proc/{worker}") or open(f"/proc/{worker}/stat").read().rpartition(")")[2]
                  .split()[0] in "ZX", 20, "the worker to end at once, not after its 30 s __del__")
        out, err = p.communicate(timeout=90)
    finally:
        _kill_session(p.pid)
    assert "SystemExit" not in err and "Exception ignored" not in err and "Traceback" not in err, err
    assert "the worker process died (exit status 143)" in out, out + err


def test_compile_one_ends_the_worker_when_sigterm_was_wrapped(monkeypatch):
    """A compiler that catches SIGTERM's SystemExit and raises its own error must not keep the worker
    serving builds after SIGTERM: compile_one turns it back into SystemExit."""
    from msa_jit.jit import compiler

    def wrapped(config, cache=None):
        raise RuntimeError("DSLRuntimeError: compilation interrupted")

    monkeypatch.setattr(compiler, "ensure_compiled", wrapped)
    cfg = SparseDecodeConfig(8, 1, arch="sm_90a").to_dict()
    assert warmup.compile_one(cfg)["status"] == "failed"  # an ordinary failure: reported
    monkeypatch.setattr(warmup, "_terminating", True)
    with pytest.raises(SystemExit):
        warmup.compile_one(cfg)


# ----------------------------------------------------------------------------- doctor
def _snapshot(root: Path) -> dict[str, tuple]:
    """Every path under `root` with its modification and change times (ns), and the artifacts' access times."""
    out = {}
    for p in [root, *root.rglob("*")]:
        st = os.lstat(p)
        out[str(p.relative_to(root))] = (st.st_mtime_ns, st.st_ctime_ns,
                                         st.st_atime_ns if p.name.endswith(".so") else None)
    return out


def test_doctor_changes_nothing_on_disk(tmp_path, monkeypatch):
    """doctor reads the cache (preset readiness included) without refreshing an entry's last-used
    time (meta.json's mtime: the LRU prune's clock) or creating anything."""
    monkeypatch.setenv(env.ARCH, "sm_90a")
    from msa_jit.jit import registry

    base = SparseDecodeConfig(8, 1, arch="sm_90a")
    root = tmp_path / "c"
    entries = _entries(root, registry.plannable_configs(base), monkeypatch)
    past = time.time() - 3600
    for e in entries:
        os.utime(e.path / cache.META_NAME, (past, past))
    before = _snapshot(root)
    time.sleep(0.01)
    rc, out, _ = run_main(["doctor", "--cache-dir", str(root)])
    assert rc == 0, out
    assert f"8/1   q bf16 kv fp8   sm_90a   {base.ctas_per_sm}/SM ready" in out, out
    assert _snapshot(root) == before
    # and a root that does not exist stays so
    rc, out, _ = run_main(["doctor", "--cache-dir", str(tmp_path / "none")])
    assert rc == 0 and "no cache there yet" in out and not (tmp_path / "none").exists()


# ----------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("text", ["1" * 400, "1" * 400 + ".5", "9" * 30 + "P", "9223372036854775808"])
def test_huge_sizes_are_refused_not_overflowed(text, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="too large a size"):
        env.parse_size(text)
    (tmp_path / "c").mkdir()
    rc, out, err = run_main(["cache", "prune", "--cache-dir", str(tmp_path / "c"), "--max-bytes", text])
    assert rc == 2 and "--max-bytes" in err and "too large a size" in err and "Traceback" not in err, err
    monkeypatch.setenv(env.CACHE_MAX_BYTES, text)
    rc, out, err = run_main(["cache", "info", "--cache-dir", str(tmp_path / "c")])
    assert rc == 2 and f"{env.CACHE_MAX_BYTES}=" in err and "too large a size" in err, err
    assert len(err.splitlines()[0]) < 200  # the value is named, cut short


def test_sizes_still_parse():
    assert [env.parse_size(s) for s in ("0", "1024", "512M", "2G", "2GiB", "1.5k", ".5K", "0" * 500 + "7",
                                        "9223372036854775807", "8191P")] == [
        0, 1024, 512 << 20, 2 << 30, 2 << 30, 1536, 512, 7, 2**63 - 1, 8191 << 50]


# ----------------------------------------------------------------------------- --jobs
def test_jobs_are_bounded_by_memory_and_cpus(monkeypatch):
    gib = 1024**3
    monkeypatch.setattr(warmup, "cpu_count", lambda: 16)
    monkeypatch.setattr(warmup, "available_memory_bytes", lambda: 4 * gib)  # 8 workers' worth
    assert warmup.worker_limit(None) == (4, None)  # the default: min(4, CPUs)
    n, why = warmup.worker_limit(80)
    assert n == 4 * gib // warmup.WORKER_RSS_BYTES == 8 and "4.0 GiB of memory available" in why and "CPU" not in why
    monkeypatch.setattr(warmup, "cpu_count", lambda: 2)
    n, why = warmup.worker_limit(80)
    assert n == 2 and "2 CPUs" in why
    monkeypatch.setattr(warmup, "available_memory_bytes", lambda: 100 * 1024**2)  # less than one worker's
    assert warmup.worker_limit(3)[0] == 1 and warmup.worker_limit(None)[0] == 1
    monkeypatch.setattr(warmup, "available_memory_bytes", lambda: None)  # no /proc/meminfo
    assert warmup.worker_limit(2) == (2, None)


def test_run_warmup_starts_no_more_workers_than_the_bound(monkeypatch, tmp_path):
    started = []

    class Pool(warmup._Pool):
        def start(self):
            started.append(1)
            raise OSError("stand-in: no worker started")

    monkeypatch.setattr(warmup, "_Pool", Pool)
    monkeypatch.setattr(warmup, "worker_limit", lambda jobs: (1, "a stand-in bound"))
    configs = warmup.warmup_configs([(8, 1), (16, 1)], ["bfloat16"], ["sm_90a"])
    monkeypatch.setattr(warmup, "_keys_and_cached", lambda rows, c: [])
    rows = warmup.run_warmup(configs, jobs=8, cache_dir=str(tmp_path / "c"), quiet=True)
    assert len(started) == 1 and all(r.status == "failed" for r in rows)


# ----------------------------------------------------------------------------- HOME
def test_an_empty_home_is_no_home(monkeypatch):
    """HOME='' (Python expands it to '/'): read as unset: the password database's home, and without
    one the per-user temp dir; never /.cache/msa-jit."""
    import pwd

    from msa_jit.jit.cache import location

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "")
    root, source = location.preferred_root()
    assert root == Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "msa-jit" and source == "home directory"
    assert root != Path("/.cache/msa-jit") or pwd.getpwuid(os.getuid()).pw_dir == "/"

    def no_entry(uid):
        raise KeyError(uid)

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    for home in ("", "  "):
        monkeypatch.setenv("HOME", home)
        assert location.preferred_root() == (cache.user_temp_root(), "per-user temp dir")
    monkeypatch.setenv("HOME", "relative/home")
    assert location.preferred_root() == (cache.user_temp_root(), "per-user temp dir")


# ----------------------------------------------------------------------------- no issue numbers in output
def test_bench_summary_names_no_issue():
    from msa_jit.tools.bench import targets

    text = targets.format_targets(targets.check_targets({"per_layer": [], "points": []}))
    assert text.startswith("| group | target |") and not re.search(r"#\d", text)
    assert {r["group"] for r in targets.check_targets({"per_layer": [], "points": []})} == {"latency", "NVFP4"}
