"""Acceptance of the real compile -> cache -> runtime-only load path (no GPU needed).

Every test has its own cache root. The expensive part (CuTe DSL compiles, ~1-4 s each) is
shared through one module-scoped warm cache that tests copy before touching it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from msa_jit.kernels import convention
from msa_jit.jit import cache, compiler, registry, sass
from msa_jit import env
from msa_jit.jit.cache import ArtifactCache, ArtifactMissingError
from msa_jit.geometry import DEFAULT_ARCHES, SparseDecodeConfig

ROOT = Path(__file__).resolve().parents[1]
CFG16 = {arch: SparseDecodeConfig(16, 1, q_dtype="bfloat16", arch=arch) for arch in DEFAULT_ARCHES}

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _isolated(isolated_env):
    """tests/conftest.py: no MSA_JIT_* from outside, private temp dir, fresh counters."""


def sub_env(cache_dir: Path, **extra: str) -> dict[str, str]:
    """Environment of a child process: this checkout importable, its own cache and temp dir."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("MSA_JIT_")}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e["MSA_JIT_CACHE_DIR"] = str(cache_dir)
    e["TMPDIR"] = str(Path(cache_dir).parent / "child-tmp")
    Path(e["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    e.update(extra)
    return e


@pytest.fixture(scope="module")
def warm16(tmp_path_factory) -> Path:
    """A cache holding 16/1 bf16 for sm_90a and sm_100a, compiled in this process."""
    root = tmp_path_factory.mktemp("warm16") / "cache"
    with pytest.MonkeyPatch.context() as mp:  # runs before the function-scoped isolation
        for name in env.VARIABLES:
            mp.delenv(name, raising=False)
        c = ArtifactCache(root)
        for cfg in CFG16.values():
            t0 = time.perf_counter()
            _, built = compiler.ensure_compiled(cfg, cache=c)
            print(f"compiled {cfg.describe()} for {cfg.arch} in {time.perf_counter() - t0:.2f} s")
            assert built
    return root


def copy_cache(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "cache"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("locks", "tmp"))
    return dst


def test_compile_both_arches_artifacts(warm16):
    c = ArtifactCache(warm16)
    for arch, sm in (("sm_90a", 90), ("sm_100a", 100)):
        entry = c.lookup(compiler.cache_key(CFG16[arch]))
        assert entry is not None, arch
        so = entry.artifact_path(convention.ARTIFACT_NAME)
        assert so.is_file() and so.stat().st_size > 0
        assert entry.meta["config"]["arch"] == arch and entry.meta["fingerprint"]["kernel_family"] == "token"
        kernels = sass.summarize(so)
        assert kernels, f"no cubin in {so}"
        assert {k["sm"] for k in kernels} == {sm}
        assert any(k["mma_ops"].get("HMMA", 0) > 0 for k in kernels), kernels
        assert all(k["local_ops"] == 0 for k in kernels), kernels  # no LDL/STL: nothing spills


LOADER = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    from msa_jit.jit import cache, compiler, loader
    from msa_jit.kernels import convention
    from msa_jit.geometry import SparseDecodeConfig
    import_ms = (time.perf_counter() - t0) * 1e3
    out = {"import_ms": import_ms, "load_ms": {}, "lookup_ms": {}}
    for arch in ("sm_90a", "sm_100a"):
        t = time.perf_counter()
        entry, built = compiler.ensure_compiled(SparseDecodeConfig(16, 1, q_dtype="bfloat16", arch=arch))
        out["lookup_ms"][arch] = (time.perf_counter() - t) * 1e3
        fn, seconds = loader.load_artifact(entry.artifact_path(convention.ARTIFACT_NAME))
        out["load_ms"][arch] = seconds * 1e3
        assert callable(fn) and not built
    out["stats"] = cache.stats()
    out["cutlass_loaded"] = "cutlass" in sys.modules or any(m.startswith("cutlass.") for m in sys.modules)
    print(json.dumps(out))
""")


def test_second_process_loads_without_compiling(warm16, tmp_path):
    root = copy_cache(warm16, tmp_path)  # a shipped copy of the warm cache
    p = subprocess.run([sys.executable, "-c", LOADER], capture_output=True, text=True, timeout=300,
                       env=sub_env(root, MSA_JIT_NO_COMPILE="1"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"runtime-only load: {out}")
    assert out["stats"]["builds"] == 0 and out["stats"]["hits"] == 2, out
    assert out["cutlass_loaded"] is False
    for arch in DEFAULT_ARCHES:
        assert out["load_ms"][arch] + out["lookup_ms"][arch] < 1000.0, out


def test_corrupted_artifact_detected_and_rebuilt(warm16, tmp_path):
    root = copy_cache(warm16, tmp_path)
    cfg = CFG16["sm_90a"]
    key = compiler.cache_key(cfg)
    so = ArtifactCache(root).entry_path(key) / convention.ARTIFACT_NAME
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the hash can tell
    so.write_bytes(bytes(data))
    fresh = ArtifactCache(root)  # a new instance has not memoized the hash check
    assert fresh.lookup(key) is None
    assert fresh.stats["corrupt"] == 1
    entry, built = compiler.ensure_compiled(cfg, cache=fresh)
    assert built
    rebuilt = entry.artifact_path()
    assert hashlib.sha256(rebuilt.read_bytes()).hexdigest() == entry.meta["artifacts"][0]["sha256"]
    assert ArtifactCache(root).lookup(key) is not None
    assert all(k["local_ops"] == 0 for k in sass.summarize(rebuilt))


def test_four_concurrent_warmups_compile_once(tmp_path):
    root = tmp_path / "shared-cache"
    cmd = [sys.executable, "-m", "msa_jit", "warmup", "--heads", "8/1", "--q-dtype", "bf16", "--arch", "sm_100a",
           "--cache-dir", str(root), "--jobs", "1"]
    e = sub_env(tmp_path / "unused", MSA_JIT_LOG_LEVEL="info")
    del e["MSA_JIT_CACHE_DIR"]  # --cache-dir alone must route the workers
    procs = [subprocess.Popen(cmd + ["--json", str(tmp_path / f"out_{i}.json")], env=e, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (so, se) in zip(procs, outs):
        assert p.returncode == 0, se
    docs = [json.loads((tmp_path / f"out_{i}.json").read_text()) for i in range(4)]
    # one geometry = one row per occupancy the planner may pick (2 and 3 CTAs per SM)
    assert [[r["ctas_per_sm"] for r in d["rows"]] for d in docs] == [[2, 3]] * 4
    for i in range(2):  # each build compiled by exactly one of the four, found by the rest
        statuses = sorted(d["rows"][i]["status"] for d in docs)
        assert statuses == ["cached", "cached", "cached", "compiled"], statuses
        assert len({d["rows"][i]["artifact"] for d in docs}) == 1
    for d, (so, se) in zip(docs, outs):
        n = sum(r["status"] == "compiled" for r in d["rows"])
        assert se.count("msa-jit compiled") == n, se  # the compile's log line, at MSA_JIT_LOG_LEVEL=info
        assert f"{n} compiled, {2 - n} cached" in so
    print("concurrent warmup seconds:", [[r["seconds"] for r in d["rows"]] for d in docs])


def test_unusable_cache_dir_falls_back_compiles_and_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("not a directory")  # root is under a file: uncreatable even for root
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(cache.CacheFallbackWarning):
        c = ArtifactCache()
    assert c.root == cache.user_temp_root() and c.fallback_reason
    entry, built = compiler.ensure_compiled(CFG16["sm_90a"], cache=c)
    assert built and entry.path.is_relative_to(c.root)
    from msa_jit.jit.loader import load_artifact

    fn, seconds = load_artifact(entry.artifact_path())
    assert callable(fn) and seconds < 1.0


SLOW_BUILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from msa_jit.jit import compiler
    from msa_jit.kernels import convention
    from msa_jit.geometry import SparseDecodeConfig

    def slow(config, out_dir):
        (Path(out_dir) / convention.ARTIFACT_NAME).write_bytes(b"\\x7fELF partial artifact")
        Path(sys.argv[1]).touch()
        time.sleep(600)

    compiler.compile_sparse_decode = slow
    compiler.ensure_compiled(SparseDecodeConfig(16, 1, q_dtype="bfloat16", arch="sm_90a"))
""")


def test_sigkilled_compile_leaves_nothing_accepted(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    started = tmp_path / "started"
    p = subprocess.Popen([sys.executable, "-c", SLOW_BUILD, str(started)], env=sub_env(root), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert p.poll() is None, "builder exited early"
            assert time.monotonic() < deadline, "build never started"
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    cfg = CFG16["sm_90a"]
    key = compiler.cache_key(cfg)
    c = ArtifactCache(root)
    assert list((root / "v1" / "tmp").glob(f"build-{key}-*")), "the killed build left no temp dir?"
    assert c.lookup(key) is None and not c.entry_path(key).exists()
    monkeypatch.setenv("MSA_JIT_LOCK_TIMEOUT", "60")  # a stale lock would fail, not hang
    t0 = time.perf_counter()
    entry, built = compiler.ensure_compiled(cfg, cache=c)
    took = time.perf_counter() - t0
    print(f"rebuild after SIGKILL: {took:.2f} s")
    assert built and took < 60
    assert c.lookup(key) is not None and entry.artifact_path().read_bytes()[:4] == b"\x7fELF"
    assert any(str(x).startswith(str(root / "v1" / "tmp")) for x in c.prune())  # the dead build's dir


def test_no_compile_empty_cache_names_warmup_command(tmp_path, monkeypatch):
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "1")
    cfg = SparseDecodeConfig(32, 2, q_dtype="float8_e4m3fn", arch="sm_100a")
    with pytest.raises(ArtifactMissingError) as ei:
        compiler.ensure_compiled(cfg)
    msg = str(ei.value)
    hint = compiler.warmup_command(cfg)
    assert hint in msg and "msa-jit warmup --heads 32/2 --q-dtype fp8 --kv-dtype fp8 --arch sm_100a" in msg
    assert cache.stats()["builds"] == 0
    # the printed command is a valid `msa-jit warmup` line naming exactly this geometry
    from msa_jit.cli import build_parser
    from msa_jit.cli.common import configs_from_args

    args = build_parser().parse_args(shlex.split(hint.splitlines()[0])[1:])
    assert cfg in configs_from_args(args)  # with the geometry's other occupancy (warmup builds both)


def test_accepted_local_ops_most_specific_key_wins():
    """registry.accepted_local_ops: (arch, ctas, q dtype) before (arch, ctas) before ctas."""
    from msa_jit.jit import compiler

    def cfg(arch, ctas, q):
        return SparseDecodeConfig(16, 1, arch=arch, ctas_per_sm=ctas, q_dtype=q)

    assert registry.accepted_local_ops(cfg("sm_90a", 2, "bfloat16")) == 0
    assert registry.accepted_local_ops(cfg("sm_90a", 3, "bfloat16")) == 0
    assert registry.accepted_local_ops(cfg("sm_90a", 3, "float8_e4m3fn")) == 0
    assert registry.accepted_local_ops(cfg("sm_100a", 3, "float8_e4m3fn")) == 6
    assert registry.accepted_local_ops(cfg("sm_100a", 2, "float8_e4m3fn")) == 0
    with pytest.MonkeyPatch.context() as mp:  # the lookup order itself, on a table with every key kind
        table = {3: 1, ("sm_90a", 3): 2, ("sm_90a", 3, "float8_e4m3fn"): 3}
        mp.setitem(registry.KERNEL_REGISTRY, "token",
                   dataclasses.replace(registry.KERNEL_REGISTRY["token"], accepted_local_ops=table))
        assert [registry.accepted_local_ops(cfg("sm_100a", 3, "bfloat16")),
                registry.accepted_local_ops(cfg("sm_90a", 3, "bfloat16")),
                registry.accepted_local_ops(cfg("sm_90a", 3, "float8_e4m3fn"))] == [1, 2, 3]
