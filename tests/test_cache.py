"""Tests of msa_jit.jit.cache (CPU only, fake builds; see docs/cache.md). msa_jit.env: test_env.py."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import filelock
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msa_jit.jit import cache
from msa_jit import env
from msa_jit.jit.cache import entry as cache_entry
from msa_jit.jit.cache import (ArtifactCache, ArtifactMissingError, CacheEntry, CacheLockTimeout, make_key, source_fingerprint)

WORKER = Path(__file__).with_name("cache_worker.py")
FP = {"source": "fake", "dsl": "0"}  # the worker's default fingerprint
ENV_VARS = [name for name, _v, _d in env.describe()]


pytestmark = pytest.mark.usefixtures("isolated_env")  # tests/conftest.py


def key_of(config: dict, fingerprint: dict = FP) -> str:
    return make_key(config, fingerprint)


def fake_build(size: int = 1000, sleep: float = 0.0, counter: list | None = None, name="kernel.so"):
    def build(tmp: Path) -> dict:
        if counter is not None:
            counter.append(tmp)
        if sleep:
            time.sleep(sleep)
        (tmp / name).write_bytes(os.urandom(size))
        return {"artifacts": [name], "extra": {"note": "fake"}}

    return build


def get(c: ArtifactCache, config: dict, build=None, **kw):
    return c.get_or_build(
        key_of(config), build or fake_build(), config=config, fingerprint=FP, describe=f"fake {config}", **kw
    )


def worker_env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MSA_JIT_")}
    return e


def run_worker(root: Path, config: dict, *args: str, check: bool = True) -> dict:
    p = subprocess.run(
        [sys.executable, str(WORKER), "--root", str(root), "--config", json.dumps(config), *args],
        capture_output=True, text=True, timeout=60, env=worker_env(),
    )
    if check:
        assert p.returncode == 0, p.stderr + p.stdout
    return json.loads(p.stdout.strip().splitlines()[-1])


def spawn_worker(root: Path, config: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), "--root", str(root), "--config", json.dumps(config), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(),
    )


def wait_for(pred, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def build_dirs(c: ArtifactCache) -> list[Path]:
    return sorted(p for p in (c.v1 / "tmp").iterdir() if p.name.startswith("build-"))


# =========================================================================== keys


@dataclasses.dataclass(frozen=True)
class Cfg:
    head_dim: int = 128
    num_q_heads: int = 64
    num_kv_heads: int = 4
    page_size: int = 64
    dtype: str = "fp8_e4m3"
    tile: tuple = (64, 128)


class Mode(enum.Enum):
    A = "a"


def test_key_same_config_same_key():
    a = make_key(dataclasses.asdict(Cfg()), FP)
    assert a == make_key(dataclasses.asdict(Cfg()), dict(FP))
    assert len(a) == 64 and int(a, 16) >= 0
    # a dataclass instance is converted with asdict, tuples are lists
    assert make_key(Cfg(), FP) == a
    assert make_key({**dataclasses.asdict(Cfg()), "tile": [64, 128]}, FP) == a


def test_key_changes_with_config_and_fingerprint():
    base = make_key(dataclasses.asdict(Cfg()), FP)
    assert make_key(dataclasses.asdict(Cfg(page_size=32)), FP) != base
    assert make_key(dataclasses.asdict(Cfg()), {**FP, "dsl": "1"}) != base
    assert make_key(dataclasses.asdict(Cfg()), {**FP, "opt": "-O3"}) != base
    # config and fingerprint are separate namespaces
    assert make_key({"x": 1}, {}) != make_key({}, {"x": 1})


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=5), st.booleans()), max_size=8))
def test_key_dict_order_irrelevant(d):
    reordered = dict(reversed(list(d.items())))
    assert make_key(d, {"f": d}) == make_key(reordered, {"f": reordered})


def test_key_rejects_ambiguous_values():
    with pytest.raises(TypeError):
        make_key({"x": object()}, FP)
    with pytest.raises(TypeError):
        make_key({"x": float("nan")}, FP)
    with pytest.raises(TypeError):
        make_key({1: "int key"}, FP)
    with pytest.raises(TypeError):
        make_key([("a", 1)], FP)
    assert make_key({"m": Mode.A}, FP) == make_key({"m": "a"}, FP)


def test_key_tells_bools_from_ints_and_takes_enum_keys():
    """jsonable: True / False are not 1 / 0 (json writes true / 1), and an enum as a mapping key is
    its value, like an enum value."""
    assert make_key({"x": True}, FP) != make_key({"x": 1}, FP)
    assert make_key({"x": False}, FP) != make_key({"x": 0}, FP)
    assert make_key({"x": [True]}, {"f": False}) != make_key({"x": [1]}, {"f": 0})
    assert make_key({Mode.A: 1}, FP) == make_key({"a": 1}, FP)


def test_source_fingerprint(tmp_path):
    a = tmp_path / "a" / "kernels"
    b = tmp_path / "b" / "kernels"
    for d in (a, b):
        (d / "sub").mkdir(parents=True)
        (d / "x.py").write_text("print(1)\n")
        (d / "sub" / "y.py").write_text("print(2)\n")
        (d / "__pycache__").mkdir()
        (d / "__pycache__" / "x.cpython-311.pyc").write_bytes(os.urandom(10))
    fa = source_fingerprint([a])
    assert fa == source_fingerprint([b])  # location and .pyc do not matter
    assert source_fingerprint([a / "sub" / "y.py", a / "x.py"]) == source_fingerprint([a / "x.py", a / "sub" / "y.py"])
    os.utime(a / "x.py", (1, 1))
    assert source_fingerprint([a]) == fa  # nor do mtimes
    (b / "x.py").write_text("print(3)\n")
    assert source_fingerprint([b]) != fa
    (b / "x.py").write_text("print(1)\n")
    (b / "x.py").rename(b / "z.py")
    assert source_fingerprint([b]) != fa  # names matter
    with pytest.raises(FileNotFoundError):
        source_fingerprint([tmp_path / "missing.py"])


def test_source_fingerprint_names_files_relative_to_root(tmp_path):
    """`root` anchors the hashed names: the same tree under two roots hashes alike, and the same
    file named from another anchor ("x.py", not "pkg/x.py") hashes differently."""
    for side in ("a", "b"):
        (tmp_path / side / "pkg").mkdir(parents=True)
        (tmp_path / side / "pkg" / "x.py").write_text("print(1)\n")
    fa = source_fingerprint([tmp_path / "a" / "pkg" / "x.py"], root=tmp_path / "a")
    assert fa == source_fingerprint([tmp_path / "b" / "pkg" / "x.py"], root=tmp_path / "b")
    assert fa != source_fingerprint([tmp_path / "a" / "pkg" / "x.py"])


# =========================================================================== build / hit


def test_miss_build_hit_then_zero_builds_in_second_process(tmp_path):
    root = tmp_path / "cache"
    c = ArtifactCache(root)
    config = {"geometry": "hq64-hkv4", "page": 64}
    key = key_of(config)
    assert c.lookup(key) is None
    calls = []
    entry, built = get(c, config, fake_build(counter=calls))
    assert built and len(calls) == 1
    assert cache.stats()["builds"] == 1 and c.stats["builds"] == 1
    assert entry.path == root / "v1" / key[:2] / key
    meta = json.loads((entry.path / "meta.json").read_text())
    assert meta["key"] == key and meta["config"] == config and meta["fingerprint"] == FP
    assert meta["artifacts"][0]["name"] == "kernel.so" and meta["artifacts"][0]["size"] == 1000
    assert meta["extra"] == {"note": "fake"} and meta["build_seconds"] >= 0 and meta["created"] > 0
    assert entry.artifact_path() == entry.path / "kernel.so" == entry.artifact_path("kernel.so")
    with pytest.raises(KeyError):
        entry.artifact_path("nope.so")
    assert build_dirs(c) == []

    entry2, built2 = get(c, config, fake_build(counter=calls))
    assert not built2 and entry2 == entry and len(calls) == 1
    assert cache.stats()["builds"] == 1 and cache.stats()["hits"] == 1

    out = run_worker(root, config)  # a second process: 0 builds
    assert out["built"] is False and out["stats"]["builds"] == 0 and out["stats"]["hits"] == 1
    assert out["path"] == str(entry.path) and out["sha256"] == meta["artifacts"][0]["sha256"]


def test_worker_builds_then_this_process_hits(tmp_path):
    root = tmp_path / "cache"
    out = run_worker(root, {"g": 1})
    assert out["built"] is True and out["stats"]["builds"] == 1
    entry, built = get(ArtifactCache(root), {"g": 1}, fake_build(size=1))
    assert not built and cache.stats()["builds"] == 0
    assert entry.meta["artifacts"][0]["sha256"] == out["sha256"]


def test_multiple_artifacts_and_extra(tmp_path):
    c = ArtifactCache(tmp_path / "c")

    def build(tmp):
        (tmp / "a.so").write_bytes(b"A" * 10)
        (tmp / "a.ptx").write_text("ptx")
        return {"artifacts": ["a.so", "a.ptx"], "extra": {"arch": "sm_100a", "opts": ["-O3"]}}

    entry, _ = get(c, {"m": 1}, build)
    assert entry.artifacts == ["a.so", "a.ptx"]
    assert entry.artifact_path() == entry.path / "a.so"
    assert entry.artifact_path("a.ptx").read_text() == "ptx"
    assert entry.meta["extra"]["arch"] == "sm_100a"
    assert [e.key for e in c.entries()] == [entry.key]
    assert c.verify() == [(entry, None)]


def test_key_mismatch_and_bad_key_rejected(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    with pytest.raises(ValueError, match="does not match"):
        c.get_or_build(key_of({"a": 1}), fake_build(), config={"a": 2}, fingerprint=FP, describe="x")
    # upper case is not what make_key returns; "$" would take the trailing newline as the end
    for bad in ("../etc", "ABC", "0" * 63, "g" * 64, "A" * 64, "a" * 64 + "\n"):
        with pytest.raises(ValueError):
            c.lookup(bad)


def test_failing_build_leaves_nothing(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    config = {"fail": True}

    def boom(tmp):
        (tmp / "kernel.so").write_bytes(b"partial")
        raise RuntimeError("compiler exploded")

    with pytest.raises(RuntimeError, match="exploded"):
        get(c, config, boom)
    assert build_dirs(c) == [] and c.entries() == [] and c.lookup(key_of(config)) is None
    assert not (c.v1 / key_of(config)[:2] / key_of(config)).exists()
    # lock released, build result validated: each bad result its own error (a broad
    # pytest.raises would let a missing name check pass as the FileNotFoundError that follows it)
    for bad, error, match in (
        (lambda t: None, TypeError, "must return a dict"),
        (lambda t: {"artifacts": "kernel.so"}, TypeError, "non-empty list of file names"),
        (lambda t: {"artifacts": ["missing.so"]}, FileNotFoundError, "did not write artifact 'missing.so'"),
    ):
        with pytest.raises(error, match=match):
            get(c, config, bad)
        assert build_dirs(c) == [] and c.entries() == []
    # names that are no plain file name (docs/cache.md §2), each really written by the build
    # (../x.so lands beside the build dir): only the name check can refuse them
    for name in ("../x.so", "meta.json", ".hidden.so"):
        def writes(t, name=name):
            (t / name).write_bytes(b"x")
            return {"artifacts": [name]}

        with pytest.raises(ValueError, match=f"invalid artifact name '{re.escape(name)}'"):
            get(c, config, writes)
        assert build_dirs(c) == [] and c.entries() == []
        (c.v1 / "tmp" / "x.so").unlink(missing_ok=True)
    entry, built = get(c, config)
    assert built and cache.stats()["builds"] == 1


# =========================================================================== corruption


def flip_byte(p: Path, offset: int = 10) -> None:
    data = bytearray(p.read_bytes())
    data[offset] ^= 0xFF
    p.write_bytes(bytes(data))


def test_corrupted_artifact_detected_and_rebuilt(tmp_path, caplog):
    root = tmp_path / "c"
    config = {"g": "corrupt"}
    entry, _ = get(ArtifactCache(root), config)
    old_sha = entry.meta["artifacts"][0]["sha256"]
    flip_byte(entry.artifact_path())

    c = ArtifactCache(root)  # a new process's view: nothing memoized
    with caplog.at_level(logging.WARNING, logger="msa_jit.jit.cache"):
        assert c.lookup(entry.key) is None
    assert any("corrupt" in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records)
    assert not entry.path.exists()  # removed (renamed aside and deleted)
    assert c.stats["corrupt"] == 1
    assert [p for p in (c.v1 / "tmp").iterdir()] == []

    entry2, built = get(c, config)
    assert built and entry2.meta["artifacts"][0]["sha256"] != old_sha
    assert c.lookup(entry.key) == entry2


def test_corruption_found_inside_get_or_build(tmp_path):
    root = tmp_path / "c"
    entry, _ = get(ArtifactCache(root), {"g": 2})
    flip_byte(entry.artifact_path(), 0)
    entry2, built = get(ArtifactCache(root), {"g": 2})
    assert built and ArtifactCache(root).lookup(entry.key) is not None


def test_corrupt_entry_left_alone_while_its_lock_is_held(tmp_path, caplog):
    """§4: a corrupt entry is removed under its lock taken without waiting; a busy lock means
    someone is rebuilding it, so the reader leaves it alone (and still gets None, at once)."""
    root = tmp_path / "c"
    entry, _ = get(ArtifactCache(root), {"g": "busy-corrupt"})
    flip_byte(entry.artifact_path())
    c = ArtifactCache(root)
    with filelock.FileLock(str(c.lock_path(entry.key))):  # "another process" holds it
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="msa_jit.jit.cache"):
            assert c.lookup(entry.key) is None
        assert time.monotonic() - t0 < 5  # never waits for the lock
        assert entry.path.exists() and (entry.path / "meta.json").exists()  # left alone
    assert any("corrupt" in r.getMessage() for r in caplog.records) and c.stats["corrupt"] == 1
    assert ArtifactCache(root).lookup(entry.key) is None and not entry.path.exists()  # lock free: removed


def test_corrupt_entry_republished_meanwhile_is_kept(tmp_path, monkeypatch):
    """§4: the removal re-checks, under the lock, that the entry is still the one judged corrupt:
    an entry another process published after the check (here: between the check and the removal,
    by a stand-in for that process hooked into the artifact check) is never removed."""
    root = tmp_path / "c"
    config = {"g": "republished"}
    entry, _ = get(ArtifactCache(root), config)
    flip_byte(entry.artifact_path())
    good, _ = get(ArtifactCache(tmp_path / "elsewhere"), config)  # a valid build of the same key
    from msa_jit.jit.cache import store as cache_store

    real_check = cache_store.check_artifacts
    republished = []

    def check_then_republish(d, meta, sig, hash_check):  # stand-in: another process publishes
        try:
            real_check(d, meta, sig, hash_check)
        except cache_entry.CorruptEntry:
            if not republished:
                shutil.rmtree(d)
                shutil.copytree(good.path, d)
                republished.append(d)
            raise

    monkeypatch.setattr(cache_store, "check_artifacts", check_then_republish)
    assert ArtifactCache(root).lookup(entry.key) is None  # this reader judged the old one corrupt ...
    assert republished == [entry.path]
    monkeypatch.setattr(cache_store, "check_artifacts", real_check)
    kept = ArtifactCache(root).lookup(entry.key)  # ... and did not remove the new one
    assert kept is not None and kept.meta["artifacts"][0]["sha256"] == good.meta["artifacts"][0]["sha256"]


def test_truncation_detected_even_without_hash(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    entry, _ = get(c, {"g": 3})
    assert c.lookup(entry.key, verify=False) is not None
    p = entry.artifact_path()
    p.write_bytes(p.read_bytes()[:-1])
    assert c.lookup(entry.key, verify=False) is None


def test_bad_meta_json_and_verify(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    good, _ = get(c, {"g": "good"})
    bad, _ = get(c, {"g": "bad"})
    worse, _ = get(c, {"g": "worse"})
    flip_byte(bad.artifact_path())
    (worse.path / "meta.json").write_text("{not json")
    res = {e.key: reason for e, reason in ArtifactCache(tmp_path / "c").verify()}
    assert res[good.key] is None
    assert "sha256" in res[bad.key] and "JSON" in res[worse.key]
    ArtifactCache(tmp_path / "c").verify(remove=True)
    assert [e.key for e in c.entries()] == [good.key]
    assert c.lookup(worse.key) is None


def test_verified_once_per_process(tmp_path, monkeypatch):
    c = ArtifactCache(tmp_path / "c")
    entry, _ = get(c, {"g": "memo"})
    c2 = ArtifactCache(tmp_path / "c")
    calls = []
    real = cache_entry.sha256_file
    monkeypatch.setattr(cache_entry, "sha256_file", lambda p: calls.append(p) or real(p))
    for _ in range(3):
        assert c2.lookup(entry.key) is not None
    assert len(calls) == 1
    assert c2.lookup(entry.key, verify=False) is not None and len(calls) == 1


def test_lookup_touches_meta_for_lru(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    entry, _ = get(c, {"g": "lru"})
    os.utime(entry.path / "meta.json", (1000, 1000))
    c.lookup(entry.key)
    assert os.stat(entry.path / "meta.json").st_mtime > time.time() - 60


# =========================================================================== concurrency


def test_four_processes_build_once(tmp_path):
    root = tmp_path / "c"
    counter = tmp_path / "builds.txt"
    go = tmp_path / "go"
    config = {"g": "race"}
    procs = [
        spawn_worker(root, config, "--sleep", "0.5", "--counter", str(counter),
                     "--ready", str(tmp_path / f"ready{i}"), "--go", str(go))
        for i in range(4)
    ]
    try:
        wait_for(lambda: all((tmp_path / f"ready{i}").exists() for i in range(4)), what="workers ready")
        go.write_text("go")
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=60)
            assert p.returncode == 0, stderr + stdout
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert len(counter.read_text().splitlines()) == 1
    assert sum(o["stats"]["builds"] for o in outs) == 1
    assert sorted(o["built"] for o in outs) == [False, False, False, True]
    assert len({o["path"] for o in outs}) == 1 and len({o["sha256"] for o in outs}) == 1
    c = ArtifactCache(root)
    assert len(c.entries()) == 1 and c.verify()[0][1] is None and build_dirs(c) == []


def test_threads_build_once(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    calls: list = []
    results: list = []
    config = {"g": "threads"}

    def run():
        results.append(get(c, config, fake_build(sleep=0.2, counter=calls)))

    ts = [threading.Thread(target=run) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert len(calls) == 1 and len(results) == 4
    assert sorted(b for _e, b in results) == [False, False, False, True]


def test_lock_timeout_names_lock_file(tmp_path, monkeypatch):
    c = ArtifactCache(tmp_path / "c")
    config = {"g": "locked"}
    held = filelock.FileLock(str(c.lock_path(key_of(config))))
    held.acquire()
    try:
        monkeypatch.setenv("MSA_JIT_LOCK_TIMEOUT", "0.2")
        t0 = time.monotonic()
        with pytest.raises(CacheLockTimeout) as ei:
            get(c, config)
        assert time.monotonic() - t0 < 10
        assert str(c.lock_path(key_of(config))) in str(ei.value)
        assert isinstance(ei.value, TimeoutError)
    finally:
        held.release()
    assert get(c, config)[1] is True


def test_killed_build_leaves_no_accepted_entry(tmp_path, monkeypatch):
    root = tmp_path / "c"
    config = {"g": "sigkill"}
    key = key_of(config)
    started = tmp_path / "started"
    p = spawn_worker(root, config, "--sleep", "60", "--started", str(started), "--size", "2000")
    try:
        wait_for(started.exists, what="build to start")
        os.kill(p.pid, signal.SIGKILL)
        p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == -signal.SIGKILL
    c = ArtifactCache(root)
    junk = build_dirs(c)
    assert len(junk) == 1 and (junk[0] / "kernel.so").stat().st_size == 1000
    assert c.lookup(key) is None and c.entries() == [] and c.verify() == []
    assert not c.entry_path(key).exists()

    # the dead builder's lock is free at once: no wait for the timeout
    monkeypatch.setenv("MSA_JIT_LOCK_TIMEOUT", "30")
    t0 = time.monotonic()
    entry, built = get(c, config)
    assert built and time.monotonic() - t0 < 5
    assert entry.artifact_path().stat().st_size == 1000  # our fake_build's size

    assert junk[0].exists()  # prune() cleans the dead build's temp dir
    removed = c.prune()
    assert junk[0] in removed and build_dirs(c) == []
    assert c.lookup(key) == entry


def test_prune_keeps_build_in_progress(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    key = key_of({"g": "busy"})
    inprog = c.v1 / "tmp" / f"build-{key}-abc"
    inprog.mkdir()
    (inprog / "kernel.so").write_bytes(b"x")
    os.utime(inprog, (1000, 1000))  # started long ago: a live build is never disturbed, even after an hour
    lock = filelock.FileLock(str(c.lock_path(key)))
    with lock:  # its builder is alive (holds the lock)
        assert c.prune(0) == [] and c.clear() == []
        assert inprog.exists()
    assert c.clear() == [inprog] and not inprog.exists()


def test_prune_collects_an_incomplete_entry_only_while_its_lock_is_free(tmp_path):
    """§6: an entry dir without meta.json is garbage once its lock is free; while its lock is
    held it stays, however old. A complete entry is no garbage."""
    c = ArtifactCache(tmp_path / "c")
    complete, _ = get(c, {"g": "complete"})
    key = key_of({"g": "incomplete"})
    incomplete = c.entry_path(key)
    incomplete.mkdir(parents=True)
    (incomplete / "kernel.so").write_bytes(b"no meta.json")
    os.utime(incomplete, (1000, 1000))  # old: the lock decides, not the age
    with filelock.FileLock(str(c.lock_path(key))):
        assert c.prune() == [] and incomplete.exists()
    assert c.prune() == [incomplete] and not incomplete.exists()
    assert c.lookup(complete.key) is not None


def test_an_entry_appears_whole_in_one_rename(tmp_path, monkeypatch):
    """Lock-free readers rely on it: the entry's path comes into being by one rename of a private
    directory that already holds meta.json and every artifact at its recorded size; nothing is copied
    or written under the entry's own path."""
    from msa_jit.jit.cache import store

    c = ArtifactCache(tmp_path / "cache")
    config = {"g": "atomic"}
    dest = c.entry_path(key_of(config))
    renames = []
    real_rename = store.os.rename

    def rename(src, dst):
        if Path(dst) == dest:
            assert not dest.exists()
            meta = json.loads((Path(src) / "meta.json").read_text())
            assert all((Path(src) / a["name"]).stat().st_size == a["size"] for a in meta["artifacts"])
            renames.append(Path(src))
        return real_rename(src, dst)

    monkeypatch.setattr(store.os, "rename", rename)
    monkeypatch.setattr(store.shutil, "copytree", None)  # a publish by copying fails loudly
    entry, built = get(c, config, fake_build(size=100))
    assert built and entry.path == dest and len(renames) == 1 and c.root in renames[0].parents  # one filesystem


def test_publish_first_valid_writer_wins(tmp_path):
    # Even if mutual exclusion failed (e.g. a lock file deleted by hand), a
    # valid entry already published is never replaced by a second build.
    config = {"g": "race2"}
    other, _ = get(ArtifactCache(tmp_path / "other"), config)
    c = ArtifactCache(tmp_path / "c")

    def build(tmp):
        import shutil

        c.entry_path(other.key).parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(other.path, c.entry_path(other.key))  # "another process" published meanwhile
        (tmp / "kernel.so").write_bytes(b"second")
        return {"artifacts": ["kernel.so"]}

    entry, built = get(c, config, build)
    assert built and entry.path == c.entry_path(other.key)
    assert entry.meta["artifacts"][0]["sha256"] == other.meta["artifacts"][0]["sha256"]
    assert entry.artifact_path().read_bytes() == other.artifact_path().read_bytes()
    assert build_dirs(c) == [] and c.verify()[0][1] is None


def test_clear_removes_incomplete_and_junk(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    entry, _ = get(c, {"g": 1})
    key2 = key_of({"g": 2})
    incomplete = c.entry_path(key2)
    incomplete.mkdir(parents=True)
    (incomplete / "kernel.so").write_bytes(b"no meta")
    assert ArtifactCache(tmp_path / "c").lookup(key2) is None
    # a later build of that key replaces the incomplete dir
    e2, built = get(c, {"g": 2})
    assert built and e2.path == incomplete and (incomplete / "meta.json").exists()
    trash = c.v1 / "tmp" / "trash-1-deadbeef"
    trash.mkdir()
    old_junk = c.v1 / "tmp" / ".probe-old"
    old_junk.write_text("x")
    os.utime(old_junk, (1000, 1000))
    fresh_junk = c.v1 / "tmp" / ".probe-fresh"
    fresh_junk.write_text("x")
    assert set(c.prune()) == {trash, old_junk} and fresh_junk.exists()
    fresh_junk.unlink()
    removed = c.clear()
    assert set(removed) == {entry.path, e2.path}
    assert c.entries() == [] and c.size_bytes() == 0


# =========================================================================== no-compile


def test_no_compile_raises_with_geometry(tmp_path, monkeypatch):
    c = ArtifactCache(tmp_path / "c")
    config = {"hq": 64, "hkv": 4, "topk": 2048, "page": 64, "dtype": "fp8"}
    geometry = "SparseDecode(hq=64, hkv=4, topk=2048, page=64, q=fp8, sm_100a)"
    calls: list = []
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "1")
    with pytest.raises(ArtifactMissingError) as ei:
        c.get_or_build(key_of(config), fake_build(counter=calls), config=config, fingerprint=FP, describe=geometry)
    msg = str(ei.value)
    assert geometry in msg and key_of(config) in msg and "msa-jit warmup" in msg
    assert "MSA_JIT_NO_COMPILE" in msg and str(c.root) in msg
    assert ei.value.describe == geometry and ei.value.key == key_of(config)
    assert calls == [] and cache.stats()["builds"] == 0 and c.entries() == []
    # picklable (e.g. raised in a worker process)
    import pickle

    assert str(pickle.loads(pickle.dumps(ei.value))) == msg

    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "0")  # warm it...
    get(c, config)
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "yes")  # ...then a production host hits
    entry, built = c.get_or_build(key_of(config), fake_build(counter=calls), config=config,
                                  fingerprint=FP, describe=geometry)
    assert not built and len(calls) == 0


def test_no_compile_miss_names_the_fingerprint_the_cache_was_warmed_for(tmp_path, monkeypatch):
    """A cache warmed for this config under another fingerprint (a runtime this host cannot import, another
    DSL, edited kernel sources): the miss says which fields differ, so "warm the cache" is not the only
    reading of the error."""
    c = ArtifactCache(tmp_path / "c")
    config, other = {"hq": 64, "q": "fp8"}, {"hq": 16, "q": "fp8"}
    get(c, config)
    get(c, other)
    here = {"source": "fake", "dsl": "unknown"}
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "1")
    with pytest.raises(ArtifactMissingError) as ei:
        c.get_or_build(key_of(config, here), fake_build(), config=config, fingerprint=here, describe="geom")
    assert ei.value.near == ("dsl 0 (this host: unknown)",)  # the other config's entry is no near miss
    msg = str(ei.value)
    assert "built for another fingerprint: dsl 0 (this host: unknown)" in msg and "not importable" in msg
    import pickle

    assert str(pickle.loads(pickle.dumps(ei.value))) == msg
    # nothing near: the message stays as before
    with pytest.raises(ArtifactMissingError) as ei:
        c.get_or_build(key_of({"hq": 8}), fake_build(), config={"hq": 8}, fingerprint=FP, describe="geom")
    assert ei.value.near == () and "another fingerprint" not in str(ei.value)


def test_no_compile_in_second_process(tmp_path):
    p = subprocess.run(
        [sys.executable, str(WORKER), "--root", str(tmp_path / "c"), "--config", '{"g": 9}',
         "--describe", "geom hq=64"],
        capture_output=True, text=True, timeout=60, env={**worker_env(), "MSA_JIT_NO_COMPILE": "1"},
    )
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 3 and out["type"] == "ArtifactMissingError" and "geom hq=64" in out["error"]
    assert out["stats"]["builds"] == 0


# =========================================================================== prune


def test_prune_keeps_most_recently_used(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    es = [get(c, {"i": i}, fake_build(size=1000))[0] for i in range(5)]
    for i, e in enumerate(es):  # e0 oldest ... e4 newest
        os.utime(e.path / "meta.json", (1000 + i, 1000 + i))
    for e in (es[0], es[1]):  # used now: most recent
        assert c.lookup(e.key) is not None
    size = {e.key: cache_entry.tree_size(e.path) for e in es}
    cap = size[es[4].key] + size[es[0].key] + size[es[1].key]
    removed = c.prune(cap)
    assert set(removed) == {es[2].path, es[3].path}
    assert {e.key for e in c.entries()} == {es[0].key, es[1].key, es[4].key}
    assert c.size_bytes() <= cap
    assert c.prune(cap) == []
    assert c.prune(0) and c.entries() == []


def test_prune_default_cap_from_env_and_auto_prune(tmp_path, monkeypatch):
    c = ArtifactCache(tmp_path / "c")
    es = [get(c, {"i": i}, fake_build(size=1000))[0] for i in range(3)]
    for i, e in enumerate(es):
        os.utime(e.path / "meta.json", (1000 + i, 1000 + i))
    assert c.prune() == []  # default 2 GiB
    monkeypatch.setenv("MSA_JIT_CACHE_MAX_BYTES", "2500")
    new, built = get(c, {"i": "new"}, fake_build(size=1000))  # auto prune after the build
    assert built
    keys = {e.key for e in c.entries()}
    assert new.key in keys and es[0].key not in keys and c.size_bytes() <= 2500
    monkeypatch.setenv("MSA_JIT_CACHE_MAX_BYTES", "1")  # cap below one entry: the new one stays
    newest, _ = get(c, {"i": "newest"}, fake_build(size=1000))
    assert [e.key for e in c.entries()] == [newest.key]


# =========================================================================== locations: test_cache_location.py


def test_cache_entry_is_hashable(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    entry, _ = get(c, {"g": "h"})
    assert isinstance(entry, CacheEntry) and len({entry, c.lookup(entry.key)}) == 1
