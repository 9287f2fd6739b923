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
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from msa_jit import env
from msa_jit.cli import common
from msa_jit.geometry import DEFAULT_ARCHES, SparseDecodeConfig
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


# ----------------------------------------------------------------------------- start-up cost
def test_version_and_every_help_import_no_torch(tmp_path):
    """--version, --help, `msa-jit` alone and every subcommand's --help, in the command's process:
    none imports torch, triton, the DSL or the bench's measuring code."""
    argvs = [["--version"], ["--help"], []] + [[c, "--help"] for c in
                                                 ("warmup", "cache", "doctor", "inspect", "bench", "selftest")]
    code = textwrap.dedent(f"""
        import sys
        sys.argv[0] = "msa-jit"
        from msa_jit.cli import main
        import contextlib, io
        rcs = []
        for argv in {argvs!r}:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                rcs.append(main(argv))
            assert "usage" in out.getvalue() or "msa-jit 0" in out.getvalue(), (argv, out.getvalue())
        print(rcs, sorted(m for m in {HEAVY!r} if m in sys.modules))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path), timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("] ")[1].strip() == "[]", p.stdout  # no heavy module
    assert p.stdout.startswith("[" + ", ".join(["0"] * len(argvs)) + "]"), p.stdout  # `msa-jit` alone: help, 0


def test_python_m_msa_jit_version_is_quick(tmp_path):
    """`python -m msa_jit --version` imports no torch (-X importtime lists every import) and answers
    well under 2 s here (the start-up time is printed; a loaded CI machine is slow, so the bound is loose)."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "msa_jit", "--version"], capture_output=True,
                       text=True, env=_env(tmp_path), timeout=120, cwd=ROOT)
    took = time.perf_counter() - t0
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert p.returncode == 0 and p.stdout.startswith("msa-jit "), p.stderr[-2000:]
    assert not imported & set(HEAVY), imported & set(HEAVY)
    print(f"python -m msa_jit --version: {took:.3f} s")
    assert took < 2.0, took


def test_bare_command_prints_help_and_exits_0(tmp_path):
    p = subprocess.run([sys.executable, "-m", "msa_jit"], capture_output=True, text=True, env=_env(tmp_path),
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.startswith("usage: msa-jit") and p.stderr == "", p.stderr


# ----------------------------------------------------------------------------- Ctrl-C
def _wait_line(stream, want: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            raise AssertionError(f"the stream ended before {want!r}")
        if want in line:
            return
    raise AssertionError(f"no {want!r} within {timeout} s")


def _interrupted_once(p: subprocess.Popen, err: str, line: str = "interrupted") -> None:
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Exception ignored" not in err, err
    assert len([x for x in err.splitlines() if line in x]) == 1, err


def test_ctrl_c_while_the_package_starts(tmp_path):
    """SIGINT before `main` runs (while the command's modules import): one line, exit 130."""
    code = ("import sys; sys.argv[0] = 'msa-jit'\n"
            "import msa_jit, os, signal, time\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(30)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path), timeout=60)
    assert p.returncode == 130 and p.stderr == "msa-jit: interrupted\n", p.stderr


@pytest.mark.parametrize("delay", [0.0, 0.15, 0.4])
def test_ctrl_c_while_the_command_imports_its_libraries(tmp_path, delay):
    """SIGINT at once, or while `doctor` imports torch (its first ~2 s): `msa-jit doctor: interrupted`, 130."""
    script = _script(tmp_path, """
        import sys
        from msa_jit.cli import main
        print("ready", flush=True)
        sys.exit(main(["doctor"]))
    """)
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(tmp_path, MSA_JIT_CACHE_DIR=str(tmp_path / "c")))
    _wait_line(p.stdout, "ready")
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    if p.returncode == 0:  # doctor finished first (a fast machine): nothing to check
        pytest.skip("doctor ended before the signal")
    _interrupted_once(p, err)
    assert err.strip() in ("msa-jit doctor: interrupted", "msa-jit: interrupted"), err


def test_ctrl_c_while_the_interpreter_exits(tmp_path):
    """SIGINT after the command's work, while an atexit callback runs (as the in-process temporary
    cache's removal does): no traceback from the callback, one line, exit 130."""
    script = _script(tmp_path, """
        import atexit, sys, time
        from msa_jit.cli import main, doctor

        def run(args):
            atexit.register(time.sleep, 5)  # a slow interpreter exit
            print("done", flush=True)
            return 0

        doctor.run = run
        sys.exit(main(["doctor"]))
    """)
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(tmp_path))
    _wait_line(p.stdout, "done")
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    _interrupted_once(p, err)
    assert err == "msa-jit: interrupted\n", err


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


# ----------------------------------------------------------------------------- closed pipes
def _into_head(cmd: list[str], env_: dict[str, str]) -> tuple[int, str]:
    """`cmd | head -1`: (cmd's exit status, its stderr)."""
    p1 = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_, cwd=ROOT)
    p2 = subprocess.Popen(["head", "-1"], stdin=p1.stdout, stdout=subprocess.DEVNULL)
    p1.stdout.close()
    err = p1.stderr.read().decode()
    p1.stderr.close()
    p2.wait(timeout=120)
    return p1.wait(timeout=120), err


def test_cache_list_into_a_closed_pipe(tmp_path):
    """`msa-jit cache list | head -1` of a cache whose table is far larger than a pipe holds: exit
    141 (or 0, had everything fit), nothing on stderr."""
    root = tmp_path / "c"
    v1 = root / "v1"
    for i in range(1500):  # entries as `cache list` reads them: a meta.json is all it needs
        key = f"{i:064x}"
        d = v1 / key[:2] / key
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({
            "format": 1, "key": key, "artifacts": [{"name": "kernel.so", "size": 0, "sha256": "0" * 64}],
            "config": {"num_q_heads": 8, "num_kv_heads": 1, "arch": "sm_90a", "ctas_per_sm": 2, "q_dtype": "bfloat16"}}))
    assert len(cache.ArtifactCache(root, create=False).entries()) == 1500
    rc, err = _into_head([sys.executable, "-m", "msa_jit", "cache", "list", "--cache-dir", str(root)], _env(tmp_path))
    assert rc == 141 and err == "", err


def _into_a_closed_pipe(cmd: list[str], env_: dict[str, str]) -> tuple[int, str]:
    """`cmd` writing into a pipe whose reader has already gone (`| head -1` that read its line before
    `cmd` flushed what it had buffered): (exit status, stderr)."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(cmd, stdout=w, stderr=subprocess.PIPE, text=True, env=env_, cwd=ROOT, timeout=120)
    finally:
        os.close(w)
    return p.returncode, p.stderr


@pytest.mark.parametrize("argv", [["bench", "--table", "RESULT"], ["cache", "list"], ["--help"]], ids=" ".join)
def test_small_output_into_a_closed_pipe(argv, tmp_path, monkeypatch):
    """Output that fits the buffer is written when it is flushed: into a closed pipe that is exit
    141 (argparse's help too, which would drop a failed write), not 'Exception ignored ...
    BrokenPipeError' at the interpreter's exit (status 120)."""
    result = ROOT / "bench/results/h100.json"
    (tmp_path / "c").mkdir()
    argv = [str(result) if a == "RESULT" else a for a in argv] + (["--cache-dir", str(tmp_path / "c")]
                                                                  if argv[0] == "cache" else [])
    e = _env(tmp_path)
    for unbuffered in ("", "1"):  # stdout buffered, as for a person's shell, and not (each write fails at once)
        e["PYTHONUNBUFFERED"] = unbuffered
        rc, err = _into_a_closed_pipe([sys.executable, "-m", "msa_jit", *argv], e)
        assert rc == 141 and err == "", (unbuffered, rc, err)


# ----------------------------------------------------------------------------- --json
@pytest.mark.parametrize("action", ["list", "info", "verify", "prune", "clear"])
def test_every_cache_action_takes_json(action, tmp_path, monkeypatch):
    """`--json` alone: the JSON on stdout, the text on stderr; `--json FILE`: the JSON in FILE, the
    text on stdout. The same for every cache action (list's stderr table included)."""
    root = tmp_path / "c"
    _entries(root, [SparseDecodeConfig(8, 1, arch="sm_90a")], monkeypatch)
    extra = ["--yes"] if action == "clear" else []
    rc, out, err = run_main(["cache", action, "--cache-dir", str(root), "--json", *extra])
    doc = json.loads(out)
    assert rc == 0 and doc is not None and err.strip(), (out, err)
    if action == "list":
        assert "key" in err.splitlines()[0] and "1 entries in" in err  # the promised table, on stderr
    if action == "clear":
        _entries(root, [SparseDecodeConfig(8, 1, arch="sm_90a")], monkeypatch)
    target = tmp_path / f"{action}.json"
    rc, out, err = run_main(["cache", action, "--cache-dir", str(root), "--json", str(target), *extra])
    assert rc == 0 and json.loads(target.read_text()) is not None and out.strip() and err == "", err


@pytest.mark.parametrize("field, value", [("config", [1, 2]), ("config", "abc"), ("fingerprint", "x"),
                                          ("config.q_dtype", [1]), ("config.kv_dtype", {}), ("created", "yesterday"),
                                          ("created", 1e300), ("created", float("nan"))])
def test_a_malformed_entry_is_listed_and_removed(field, value, tmp_path, monkeypatch):
    """One meta.json field of the wrong type: `list` shows '?' for it (text and JSON), prune and
    clear still remove the entry; a config / fingerprint that is no object is bad to verify."""
    root = tmp_path / "c"
    (entry,) = _entries(root, [SparseDecodeConfig(8, 1, arch="sm_90a")], monkeypatch)
    meta = json.loads((entry.path / cache.META_NAME).read_text())
    where, _, key = field.rpartition(".")
    (meta[where] if where else meta)[key] = value
    (entry.path / cache.META_NAME).write_text(json.dumps(meta))
    rc, out, err = run_main(["cache", "list", "--cache-dir", str(root), "--json", str(tmp_path / "l.json")])
    row = json.loads((tmp_path / "l.json").read_text())[0]
    assert rc == 0 and "1 entries in" in out and "?" in out.splitlines()[2] and err == "", err
    shown = {"config": row["geometry"], "fingerprint": row["dsl_version"], "config.q_dtype": row["q_dtype"],
             "config.kv_dtype": row["kv_dtype"], "created": row["created"]}[field]
    assert shown in ("?", "?/?"), row
    if field in ("config", "fingerprint"):
        assert run_main(["cache", "verify", "--cache-dir", str(root)])[0] == 1
    for argv in (["prune", "--max-bytes", "0", "--yes"], ["clear", "--yes"]):
        shutil.copytree(root, tmp_path / "copy")
        rc, out, err = run_main(["cache", *argv, "--cache-dir", str(tmp_path / "copy")])
        assert rc == 0 and cache.ArtifactCache(tmp_path / "copy").entries() == [], (argv, err)
        shutil.rmtree(tmp_path / "copy")


def test_json_file_gets_the_mode_open_would_give(tmp_path):
    """--json FILE is written aside and renamed onto FILE: a new file gets 0666 less the umask, not
    mkstemp's 0600; an existing one keeps its mode."""
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("{}")
    old.chmod(0o640)
    mask = os.umask(0o022)
    try:
        common.emit_json(str(new), {"a": 1})
        common.emit_json(str(old), {"a": 1})
    finally:
        os.umask(mask)
    assert (new.stat().st_mode & 0o777, old.stat().st_mode & 0o777) == (0o644, 0o640)
    assert json.loads(old.read_text()) == {"a": 1}


def test_json_and_max_bytes_values_that_mean_nothing(tmp_path):
    (tmp_path / "c").mkdir()
    rc, _, err = run_main(["cache", "info", "--cache-dir", str(tmp_path / "c"), "--json", ""])
    assert rc == 2 and err.strip() == "msa-jit cache info: --json '': an empty file name", err
    rc, _, err = run_main(["cache", "prune", "--cache-dir", str(tmp_path / "c"), "--max-bytes", "0.5"])
    assert rc == 2 and "--max-bytes: '0.5' is less than one byte" in err, err


def test_json_help_says_the_same_everywhere():
    """Every command that takes --json documents it with the same words."""
    from msa_jit import cli

    parser = cli.build_parser()
    helps = set()
    for argv in (["warmup"], ["inspect"], ["doctor"], *[["cache", a] for a in ("list", "info", "verify", "prune",
                                                                               "clear")]):
        sub = parser
        for word in argv:
            sub = next(a for a in sub._actions if a.dest in ("command", "cache_command")).choices[word]
        (action,) = [a for a in sub._actions if "--json" in a.option_strings]
        helps.add(re.sub(r"^also write .+? as JSON", "also write X as JSON", action.help))
    assert len(helps) == 1 and "the text output goes to stderr" in helps.pop()


# ----------------------------------------------------------------------------- cache roots
@pytest.mark.parametrize("argv, how", [
    (argv, how) for argv in (["warmup", "--heads", "8/1", "--arch", "sm_90a"], ["cache", "info"], ["cache", "prune"],
                             ["inspect", "--heads", "8/1", "--arch", "sm_90a"], ["bench", "--table", "x.json"])
    for how in ("flag", "variable") if (argv[0], how) != ("bench", "flag")])  # bench has no --cache-dir
def test_a_cache_root_that_is_a_file_is_refused(argv, how, tmp_path, monkeypatch):
    """--cache-dir FILE or MSA_JIT_CACHE_DIR=FILE: exit 2 before any work, naming the flag or the
    variable and the path (not a quiet fallback to the per-user temp dir)."""
    f = tmp_path / "a-file"
    f.write_text("x")
    ran: list = []
    monkeypatch.setattr(warmup, "run_warmup", lambda *a, **k: ran.append(a))
    if how == "flag":
        rc, out, err = run_main([*argv, "--cache-dir", str(f)])
        says = f"--cache-dir {f}: {f} exists and is not a directory"
    else:
        monkeypatch.setenv(env.CACHE_DIR, str(f))
        rc, out, err = run_main(argv)
        says = f"{env.CACHE_DIR}={f}: {f} exists and is not a directory"
    assert rc == 2 and says in err and not ran and out == "", err
    assert not cache.user_temp_root().exists()


def test_cache_commands_show_the_root_a_process_would_use(tmp_path, monkeypatch):
    """A configured root that cannot be created (its parent is a file): info / list / verify name
    the per-user temp dir a process falls back to, say that it is the fallback and why, and create
    nothing (neither the fallback nor a v1/ tree)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv(env.CACHE_DIR, str(blocker / "cache"))
    fallback = cache.user_temp_root()
    rc, out, err = run_main(["cache", "info"])
    assert rc == 0 and f"root:            {fallback} (no cache there yet; the fallback: the configured root " \
                       f"{blocker / 'cache'} is unusable)" in out, out
    assert f"configured:      {blocker / 'cache'} ({env.CACHE_DIR}): unusable" in out
    assert f"cannot use {blocker / 'cache'}" in err and f"using {fallback} instead" in err
    rc, out, _ = run_main(["cache", "verify"])
    assert rc == 0 and out.strip() == f"0 ok, 0 bad in {fallback} (no cache there yet; the fallback: the configured " \
                                      f"root {blocker / 'cache'} is unusable)", out
    info = json.loads(run_main(["cache", "info", "--json"])[1])
    assert info["fallback"] and info["root"] == str(fallback) and info["configured_root"] == str(blocker / "cache")
    assert not fallback.exists()
    # where the per-user temp dir is unusable too: an in-process temporary directory, said, not made
    fallback.symlink_to(tmp_path)
    rc, out, _ = run_main(["cache", "info"])
    assert rc == 0 and "no persistent root" in out and "deleted at exit" in out, out
    assert sorted(p.name for p in Path(os.path.dirname(fallback)).iterdir()) == [fallback.name]
    rc, out, _ = run_main(["cache", "prune"])
    assert rc == 0 and "nothing to do" in out, out


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


# ----------------------------------------------------------------------------- prune
def test_prune_prints_a_summary_and_lists_with_verbose(tmp_path, monkeypatch):
    from msa_jit.jit import registry

    root = tmp_path / "c"
    entries = _entries(root, registry.plannable_configs(SparseDecodeConfig(8, 1, arch="sm_90a")), monkeypatch)
    n = len(entries)
    total = cache.ArtifactCache(root).size_bytes()
    rc, out, _ = run_main(["cache", "prune", "--cache-dir", str(root), "--max-bytes", str(total - 1)])
    assert rc == 0 and len(out.splitlines()) == 1 and out.startswith("pruned 1 entry, ") and "freed" in out, out
    assert f"{n - 1} entries" in out and "left in" in out and "--verbose lists them" in out and "/v1/" not in out
    rc, out, _ = run_main(["cache", "prune", "--cache-dir", str(root), "--max-bytes", "1", "-v"])
    removed = [line for line in out.splitlines() if line.startswith("removed ")]
    assert rc == 0 and len(removed) == n - 1 and all(" 8/1 q bf16 kv fp8 sm_90a " in r for r in removed), out
    assert all(len(r) < 100 for r in removed) and out.splitlines()[-1].startswith(f"pruned {n - 1} entries")
    assert "0 entries" in out.splitlines()[-1]


def test_prune_to_zero_asks_first(tmp_path, monkeypatch):
    """`prune --max-bytes 0` deletes every entry: without --yes and without a terminal to ask on it
    refuses (exit 2, naming --yes), as clear does; with --yes it prunes."""
    root = tmp_path / "c"
    _entries(root, [SparseDecodeConfig(8, 1, arch="sm_90a")], monkeypatch)
    for argv in (["prune", "--max-bytes", "0"], ["clear"]):
        rc, out, err = run_main(["cache", *argv, "--cache-dir", str(root)])
        assert rc == 2 and "--yes" in err and len(cache.ArtifactCache(root).entries()) == 1, (argv, err)
    monkeypatch.setenv(env.CACHE_MAX_BYTES, "0")
    rc, out, err = run_main(["cache", "prune", "--cache-dir", str(root)])
    assert rc == 2 and f"{env.CACHE_MAX_BYTES}=0" in err and "--yes" in err
    rc, out, _ = run_main(["cache", "prune", "--max-bytes", "0", "--yes", "--cache-dir", str(root)])
    assert rc == 0 and out.startswith("pruned 1 entry") and cache.ArtifactCache(root).entries() == []


def test_prune_asks_on_a_terminal(tmp_path, monkeypatch):
    """On a terminal `prune --max-bytes 0` asks; 'n' keeps every entry (exit 0), 'y' prunes."""
    import io

    import msa_jit.cli.cache as cache_cmd

    root = tmp_path / "c"
    _entries(root, [SparseDecodeConfig(8, 1, arch="sm_90a")], monkeypatch)
    monkeypatch.setattr(cache_cmd, "_interactive", lambda: True)
    for answer, left in (("n\n", 1), ("\n", 1), ("y\n", 0)):
        monkeypatch.setattr(sys, "stdin", io.StringIO(answer))
        rc, out, err = run_main(["cache", "prune", "--max-bytes", "0", "--cache-dir", str(root)])
        assert rc == 0 and len(cache.ArtifactCache(root).entries()) == left, (answer, out, err)
        assert err.startswith("msa-jit cache prune: delete every entry (1, ") and err.rstrip().endswith("[y/N]"), err


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


def test_warmup_says_when_it_caps_jobs(monkeypatch):
    monkeypatch.setattr(warmup, "cpu_count", lambda: 64)
    monkeypatch.setattr(warmup, "available_memory_bytes", lambda: 3 * warmup.WORKER_RSS_BYTES)
    seen = []
    monkeypatch.setattr(warmup, "run_warmup", lambda configs, **kw: seen.append(kw["jobs"]) or [
        warmup.WarmupRow(c, status="cached", key="ab" * 32) for c in configs])
    rc, _, err = run_main(["warmup", "--heads", "8/1", "--arch", "sm_90a", "--jobs", "80", "-q"])
    assert rc == 0 and seen == [80]  # run_warmup applies the bound itself (warmup.worker_limit) ...
    # ... and the command says so, once
    assert err.count("--jobs 80: starting at most 3 compile processes") == 1 and "memory available" in err, err
    rc, _, err = run_main(["warmup", "--heads", "8/1", "--arch", "sm_90a", "--jobs", "2", "-q"])
    assert rc == 0 and "compile process" not in err


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


# ----------------------------------------------------------------------------- one flag vocabulary
def test_the_same_flags_on_every_command():
    """--heads / --q-dtype / --kv-dtype (warmup, inspect, bench) and --arch (warmup, inspect,
    selftest): the same names, each a comma list that may be repeated, parsed alike."""
    from msa_jit import cli

    parser = cli.build_parser()
    geometry = ["--heads", "64/4,16/1", "--heads", "8/1", "--q-dtype", "bf16", "--kv-dtype", "fp8,nvfp4"]
    for command in ("warmup", "inspect", "bench"):
        args = parser.parse_args([command, *geometry])
        assert common.heads_from(args) == [(64, 4), (16, 1), (8, 1)], command
        assert common.q_dtypes_from(args) == ["bfloat16"] and common.kv_dtypes_from(args) == ["float8_e4m3fn", "nvfp4"]
    for command in ("warmup", "inspect", "selftest"):
        args = parser.parse_args([command, "--arch", "sm_90a,100a"])
        assert common.arches_from(args) == list(DEFAULT_ARCHES), command
    metavars = {}
    for command in ("warmup", "inspect", "bench", "selftest"):
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        for a in sub._actions:
            if a.option_strings and a.option_strings[0] in ("--heads", "--q-dtype", "--kv-dtype", "--arch"):
                metavars.setdefault(a.option_strings[0], set()).add(a.metavar)
    assert all(len(m) == 1 for m in metavars.values()) and len(metavars) == 4, metavars


def test_old_bench_spellings_still_work_and_say_so():
    from msa_jit import cli

    args = cli.build_parser().parse_args(["bench", "--geometries", "8/1", "--kv-dtypes", "nvfp4", "--batches", "1,4",
                                          "--decode-query-lens", "2", "--floor-batches", ""])
    assert common.heads_from(args) == [(8, 1)] and common.kv_dtypes_from(args) == ["nvfp4"]
    assert (args.batch, args.decode_query_len, args.floor_batch) == (["1,4"], ["2"], [""])
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices["bench"]
    assert "--geometries" not in sub.format_help() and "--heads" in sub.format_help()


# ----------------------------------------------------------------------------- no issue numbers in output
def _string_literals(path: Path):
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def test_no_issue_numbers_or_log_rows_in_output_strings():
    """No string the package prints names an issue number or a row / session of the project's logs
    (docstrings and comments are not output)."""
    pattern = re.compile(r"#\d\d|\brows? \d|\bsession \d")
    found = [f"{path.relative_to(ROOT)}:{line}: {text[:80]!r}"
             for path in sorted((ROOT / "msa_jit").rglob("*.py")) for line, text in _string_literals(path)
             if pattern.search(text)]
    assert found == []


def test_a_ctrl_c_during_a_torch_import_is_held_until_the_import_is_done(tmp_path, monkeypatch):
    """common.import_holding_interrupts: a SIGINT that arrives while the module's import runs (torch's
    import runs C++ that calls back into Python, where a KeyboardInterrupt ends the process in
    std::terminate) is raised once the import is complete, and the previous handler is back."""
    from msa_jit.cli import common

    (tmp_path / "slow_native_like.py").write_text(
        "import os, signal\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "total = sum(range(10000))  # Python code after the signal: an unheld Ctrl-C is raised here\n"
        "DONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_native_like", raising=False)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        common.import_holding_interrupts("slow_native_like")
    assert sys.modules["slow_native_like"].DONE  # the import ran to its end first
    assert signal.getsignal(signal.SIGINT) is before
    monkeypatch.delitem(sys.modules, "slow_native_like")


def test_commands_that_import_torch_import_it_holding_interrupts(monkeypatch, tmp_path):
    """doctor, bench and selftest import torch through import_holding_interrupts before their work;
    bench --table (no GPU, no torch) does not import it at all."""
    from msa_jit import cli
    from msa_jit.cli import bench, common, doctor

    seen = []
    for module in (bench, common, doctor):  # selftest imports it from common when it runs
        monkeypatch.setattr(module, "import_holding_interrupts", lambda name: seen.append(name))
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(tmp_path / "c"))
    assert cli.main(["bench", "--table", str(ROOT / "bench" / "results" / "h100.json")]) == 0
    assert seen == []
    assert cli.main(["doctor", "--json", str(tmp_path / "doctor.json")]) == 0
    assert seen == ["torch"]
    cli.main(["bench", "--heads", "8/1", "--batch", "1", "--out", str(tmp_path / "out")])  # no GPU here: exits 2
    assert seen == ["torch", "torch"]
    cli.main(["selftest", "--quick"])
    assert seen == ["torch", "torch", "torch"]
