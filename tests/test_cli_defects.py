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
