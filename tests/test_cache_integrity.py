"""The cache never serves an entry that is not what its key names, heals a broken layout, and
its maintenance commands touch nothing they were not asked to (docs/cache.md §2, §4, §6).

CPU only, fake builds (random bytes), like tests/test_cache.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import pytest

from msa_jit.jit import cache
from msa_jit import cli
from msa_jit.jit.cache import ArtifactCache, ArtifactMissingError, CacheFallbackWarning, make_key

FP = {"source": "fake", "dsl": "0"}

pytestmark = pytest.mark.usefixtures("isolated_env")  # tests/conftest.py


def fake_build(size: int = 1000):
    def build(tmp: Path) -> dict:
        (tmp / "kernel.so").write_bytes(os.urandom(size))
        return {"artifacts": ["kernel.so"], "extra": {}}

    return build


def get(c: ArtifactCache, config: dict, **kw):
    return c.get_or_build(make_key(config, FP), fake_build(), config=config, fingerprint=FP,
                          describe=f"fake {config}", **kw)


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def cli_logging():
    """cli.main() configures the msa_jit logger: put it back for the other tests."""
    logger = logging.getLogger("msa_jit")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


# =========================================================================== the key check (§4)


def plant_under_other_key(c: ArtifactCache, src: cache.CacheEntry, key: str) -> Path:
    """Copy entry `src` under `key`, its meta.json's "key" rewritten to match the directory
    (what a re-keying tool or a hand copy would leave): only the key check can tell."""
    dest = c.entry_path(key)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src.path, dest)
    meta = json.loads((dest / "meta.json").read_text())
    meta["key"] = key
    (dest / "meta.json").write_text(json.dumps(meta))
    return dest


def test_entry_under_another_key_is_never_served(tmp_path, caplog):
    root = tmp_path / "c"
    three, _ = get(ArtifactCache(root), {"ctas_per_sm": 3})
    two = {"ctas_per_sm": 2}
    dest = plant_under_other_key(ArtifactCache(root), three, make_key(two, FP))

    fresh = ArtifactCache(root)  # a new process: nothing memoized
    res = {e.key: why for e, why in fresh.verify()}
    assert res[three.key] is None
    # verify names both keys: the one the entry's config gives and the directory's
    assert "give key" in res[make_key(two, FP)] and three.key[:12] in res[make_key(two, FP)]
    assert make_key(two, FP)[:12] in res[make_key(two, FP)]
    for verify in (False, True):  # the check is not part of the (optional) hash check
        with caplog.at_level(logging.WARNING, logger="msa_jit.jit.cache"):
            assert ArtifactCache(root).lookup(make_key(two, FP), verify=verify) is None
        if not verify:
            assert not dest.exists()  # a writable root's bad entry is removed ...
            plant_under_other_key(fresh, three, make_key(two, FP))
    assert any("give key" in r.getMessage() for r in caplog.records)
    entry, built = get(ArtifactCache(root), two)  # ... and rebuilt
    assert built and entry.meta["config"] == two
    assert ArtifactCache(root).lookup(three.key) is not None  # the real 3-CTA entry is untouched


def readonly_cache(ro: Path, monkeypatch) -> ArtifactCache:
    """An ArtifactCache on which `ro` is a read-only pre-warmed root (its writability probe
    answers EROFS, a stand-in for a read-only mount)."""
    from msa_jit.jit.cache import location

    real = location.probe_writable
    monkeypatch.setattr(location, "probe_writable", lambda r: "EROFS (simulated)" if Path(r) == ro else real(r))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheFallbackWarning)
        c = ArtifactCache(ro)
    assert c.readonly_roots == (ro,)
    return c


def test_entry_under_another_key_in_a_readonly_root_is_skipped(tmp_path, monkeypatch):
    ro = tmp_path / "prewarmed"
    three, _ = get(ArtifactCache(ro), {"ctas_per_sm": 3})
    dest = plant_under_other_key(ArtifactCache(ro), three, make_key({"ctas_per_sm": 2}, FP))
    c = readonly_cache(ro, monkeypatch)
    assert c.lookup(make_key({"ctas_per_sm": 2}, FP)) is None and dest.exists()  # skipped, never touched
    assert c.lookup(three.key).readonly


def test_meta_without_config_is_corrupt(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    e, _ = get(c, {"g": 1})
    meta = json.loads((e.path / "meta.json").read_text())
    del meta["fingerprint"]
    (e.path / "meta.json").write_text(json.dumps(meta))
    assert "fingerprint" in dict((x.key, why) for x, why in ArtifactCache(tmp_path / "c").verify())[e.key]
    assert ArtifactCache(tmp_path / "c").lookup(e.key) is None


def test_meta_with_an_unkeyable_config_is_corrupt(tmp_path):
    """A meta.json whose config cannot be keyed (a NaN, which json reads back) is a corrupt entry
    that verify names and lookup misses, not a TypeError out of the cache."""
    c = ArtifactCache(tmp_path / "c")
    e, _ = get(c, {"g": 1})
    meta = json.loads((e.path / "meta.json").read_text())
    meta["config"]["g"] = float("nan")
    (e.path / "meta.json").write_text(json.dumps(meta))
    assert "cannot be keyed" in dict((x.key, why) for x, why in ArtifactCache(tmp_path / "c").verify())[e.key]
    assert ArtifactCache(tmp_path / "c").lookup(e.key) is None


# =========================================================================== a broken layout heals (§2)


def test_shard_symlink_loop_heals(tmp_path):
    root = tmp_path / "c"
    config = {"g": "loop"}
    key = make_key(config, FP)
    entry, _ = get(ArtifactCache(root), config)
    shard = root / "v1" / key[:2]
    shutil.rmtree(shard)
    os.symlink(key[:2], shard)  # v1/08 -> 08: a loop in place of the shard dir

    c = ArtifactCache(root)
    bad = [(e, why) for e, why in c.verify() if why]
    assert len(bad) == 1 and bad[0][0].path == shard and "symbolic links" in bad[0][1]
    assert bad[0][0].key == shard.name  # the bad item's key is the shard's name
    entry, built = get(c, config)  # heals: the loop is moved aside, the build is published
    assert built and shard.is_dir() and not shard.is_symlink()
    assert ArtifactCache(root).lookup(key) is not None
    assert get(ArtifactCache(root), config)[1] is False  # and the next run finds it
    assert ArtifactCache(root).verify() == [(ArtifactCache(root).lookup(key), None)]


def make_bad_shard(shard: Path, kind: str) -> None:
    """Put `kind` where the shard dir `shard` belongs: a symlink loop, a dangling link or a file."""
    if shard.is_dir() and not shard.is_symlink():
        shutil.rmtree(shard)
    if kind == "loop":
        os.symlink(shard.name, shard)  # v1/08 -> 08
    elif kind == "dangling":
        os.symlink(shard.parent / "nowhere", shard)
    else:
        shard.write_text("a file where a shard dir belongs")


# each of the four heals on its own (§2): a lookup that fails because of the shard (a loop or a file;
# a dangling link is a plain miss), a publish into it (the lookups stood in for by misses), prune, clear
@pytest.mark.parametrize("via, kind", [
    ("lookup", "loop"), ("lookup", "file"),
    ("publish", "loop"), ("publish", "dangling"), ("publish", "file"),
    ("prune", "loop"), ("prune", "dangling"), ("prune", "file"),
    ("clear", "loop"), ("clear", "dangling"), ("clear", "file"),
])
def test_each_path_heals_a_bad_shard(tmp_path, monkeypatch, via, kind):
    root = tmp_path / "c"
    config = {"g": "heal"}
    key = make_key(config, FP)
    get(ArtifactCache(root), config)
    shard = root / "v1" / key[:2]
    target = root / "v1" / "nowhere"
    make_bad_shard(shard, kind)
    c = ArtifactCache(root)
    if via == "lookup":
        assert c.lookup(key) is None
    elif via == "publish":
        with monkeypatch.context() as m:
            m.setattr(ArtifactCache, "_lookup", lambda self, *a, **k: None)  # stand-in: every lookup misses
            entry, built = get(c, config)
        assert built and entry.path == c.entry_path(key) and (entry.path / "meta.json").is_file()
    else:
        assert shard in getattr(c, via)()
    assert not shard.is_symlink() and not shard.is_file()  # moved aside: the link itself ...
    assert not target.exists()  # ... never what it points to (nothing was created there)
    entry, built = get(ArtifactCache(root), config)  # and a build publishes normally
    assert ArtifactCache(root).lookup(key) == entry and shard.is_dir() and not shard.is_symlink()


LOCK_DAMAGE = ["directory", "loop", "dangling", "link_to_file", "fifo"]


def make_bad_lock(lock: Path, kind: str, victim: Path) -> None:
    """Put `kind` where the lock file `lock` belongs: a directory (with a file in it), a symlink
    loop, a dangling link, a link to the file `victim`, or a FIFO."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    if lock.exists() or lock.is_symlink():
        lock.unlink()
    if kind == "directory":
        lock.mkdir()
        (lock / "stray").write_text("x")
    elif kind == "loop":
        os.symlink(lock.name, lock)  # locks/<key>.lock -> itself
    elif kind == "dangling":
        os.symlink(lock.parent / "nowhere", lock)
    elif kind == "link_to_file":
        os.symlink(victim, lock)
    else:
        os.mkfifo(lock)


def assert_lock_healed(lock: Path, victim: Path) -> None:
    assert not lock.is_symlink() and (not lock.exists() or lock.is_file())  # replaced, or gone until used
    assert victim.read_text() == "precious"  # a link's target is never followed, truncated or removed
    assert not (lock.parent / "nowhere").exists()


@pytest.mark.parametrize("kind", LOCK_DAMAGE)
def test_a_damaged_lock_is_replaced_by_the_build(tmp_path, kind, caplog):
    """A lock path that is no regular file (filelock opens it O_NOFOLLOW: a directory is EISDIR,
    any symlink ELOOP) used to fail every build of its key: the warm-up's row, the kernel call.
    The build now replaces it (a warning naming it) and builds."""
    root, victim = tmp_path / "c", tmp_path / "victim"
    victim.write_text("precious")
    config = {"g": f"lock-{kind}"}
    c = ArtifactCache(root)
    lock = c.lock_path(make_key(config, FP))
    make_bad_lock(lock, kind, victim)
    with caplog.at_level(logging.WARNING, logger="msa_jit"):
        entry, built = get(c, config)
    assert built and ArtifactCache(root).lookup(entry.key) == entry
    assert lock.is_file() and not lock.is_symlink()
    assert_lock_healed(lock, victim)
    assert any(str(lock) in r.getMessage() and "replacing it" in r.getMessage() for r in caplog.records)
    make_bad_lock(lock, kind, victim)  # a damaged lock must not keep an entry from being found either
    assert get(ArtifactCache(root), config) == (entry, False)


def test_a_lock_damaged_after_the_check_is_healed_on_acquire(tmp_path):
    """Damage that appears between the lock path's check and the acquire (another process, a
    user) is healed once more on the acquire's failure."""
    root, victim = tmp_path / "c", tmp_path / "victim"
    victim.write_text("precious")
    c = ArtifactCache(root)
    key = make_key({"g": "race"}, FP)
    for kind in ("directory", "loop"):
        lock = c._file_lock(key, 1.0)
        make_bad_lock(Path(lock.lock_file), kind, victim)
        c._acquire(lock)
        try:
            assert Path(lock.lock_file).is_file() and not Path(lock.lock_file).is_symlink()
        finally:
            lock.release()


@pytest.mark.parametrize("kind", LOCK_DAMAGE)
@pytest.mark.parametrize("via", ["verify", "verify_remove", "prune", "clear", "cli_verify"])
def test_verify_reports_and_maintenance_repairs_a_damaged_lock(tmp_path, kind, via, capsys, cli_logging):
    """`verify` used to say all is well (exit 0) and prune / clear left the damage: verify now
    reports the lock path (key = its key), `verify --remove`, `prune` and `clear` replace it."""
    root, victim = tmp_path / "c", tmp_path / "victim"
    victim.write_text("precious")
    good, _ = get(ArtifactCache(root), {"g": "good"})
    config = {"g": f"lock-{kind}"}
    key = make_key(config, FP)
    c = ArtifactCache(root)
    lock = c.lock_path(key)
    make_bad_lock(lock, kind, victim)
    if via == "cli_verify":
        rc, out, _err = run_main(["cache", "verify", "--cache-dir", str(root)], capsys)
        assert rc == 1 and f"BAD {key[:12]} {lock}: lock file is " in out, out
        return
    if via in ("verify", "verify_remove"):
        res = c.verify(remove=via == "verify_remove")
        bad = [(e, why) for e, why in res if why]
        assert len(bad) == 1 and bad[0][0].path == lock and bad[0][0].key == key, res
        assert bad[0][1].startswith("lock file is ") and "not a regular file" in bad[0][1]
        assert (good, None) in res
        if via == "verify":
            assert os.path.lexists(lock)  # reported only
            return
    else:
        assert lock in getattr(c, via)()
    assert_lock_healed(lock, victim)
    assert [why for _, why in ArtifactCache(root).verify()] == [None] * (via != "clear")
    assert get(ArtifactCache(root), config)[1]  # and the key builds


def test_verify_remove_drops_a_bad_shard(tmp_path):
    root = tmp_path / "c"
    good, _ = get(ArtifactCache(root), {"g": 1})
    other = next(f"{i:02x}" for i in range(256) if f"{i:02x}" != good.key[:2])
    (root / "v1" / other).write_text("a file where a shard dir belongs")
    res = ArtifactCache(root).verify(remove=True)
    assert [why is None for _, why in res].count(False) == 1
    assert not (root / "v1" / other).exists()
    assert ArtifactCache(root).verify() == [(good, None)]


# §1: a root, v1, tmp or locks that exists but is no directory is named as what it is, never as
# the EEXIST that creating it would report
@pytest.mark.parametrize("part", ["root", "v1", "v1/tmp", "v1/locks"])
@pytest.mark.parametrize("kind, says", [("loop", "ELOOP"), ("file", "exists and is not a directory"),
                                        ("dangling", "is a broken symlink")])
def test_a_layout_dir_that_is_no_directory_is_named_as_such(tmp_path, part, kind, says):
    root = tmp_path / "c"
    bad = root if part == "root" else root / part
    bad.parent.mkdir(parents=True, exist_ok=True)
    if kind == "loop":
        os.symlink(bad.name, bad)
    elif kind == "dangling":
        os.symlink(tmp_path / "nowhere", bad)
    else:
        bad.write_text("a file")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c = ArtifactCache(root)
    (msg,) = [str(w.message) for w in rec if issubclass(w.category, CacheFallbackWarning)]
    assert f"cannot use {root} ({bad} " in msg and says in msg and "EEXIST" not in msg, msg
    assert c.root == cache.user_temp_root() and not (tmp_path / "nowhere").exists()


# =========================================================================== no-compile (§5.2)


def flip_byte(p: Path, offset: int = 7) -> None:
    """Corrupt one byte of an artifact (its sha256 no longer matches)."""
    data = bytearray(p.read_bytes())
    data[offset] ^= 0xFF
    p.write_bytes(bytes(data))


def test_no_compile_names_the_corrupt_entry(tmp_path, monkeypatch, caplog):
    root = tmp_path / "c"
    config = {"g": "prod"}
    entry, _ = get(ArtifactCache(root), config)
    flip_byte(entry.artifact_path())
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "1")
    with caplog.at_level(logging.WARNING, logger="msa_jit.jit.cache"), pytest.raises(ArtifactMissingError) as ei:
        get(ArtifactCache(root), config)
    msg = str(ei.value)
    assert "corrupt" in msg and "sha256" in msg and str(entry.path) in msg
    assert f"{entry.path} (" in msg and "; removed)" in msg and not entry.path.exists()  # what was done
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "corrupt" in logged and "so that it is rebuilt" not in logged and "not rebuilt on this host" in logged
    import pickle

    assert str(pickle.loads(pickle.dumps(ei.value))) == msg  # raised in warm-up workers too


def test_no_compile_names_a_corrupt_readonly_entry_as_skipped(tmp_path, monkeypatch):
    """§5.2: a corrupt entry of a read-only root is named with why and `read-only, skipped`, and left."""
    ro = tmp_path / "prewarmed"
    config = {"g": "prod-ro"}
    entry, _ = get(ArtifactCache(ro), config)
    flip_byte(entry.artifact_path())
    c = readonly_cache(ro, monkeypatch)
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "1")
    with pytest.raises(ArtifactMissingError) as ei:
        get(c, config)
    msg = str(ei.value)
    assert f"{entry.path} (" in msg and "sha256" in msg and "; read-only, skipped)" in msg, msg
    assert "; removed" not in msg and entry.path.exists()  # never touched
    assert len(ei.value.corrupt) == 1 and ei.value.corrupt[0].endswith("; read-only, skipped)")


# =========================================================================== maintenance commands (§6)


def test_cache_commands_create_nothing_on_a_mistyped_path(tmp_path, monkeypatch, capsys, cli_logging):
    typo = tmp_path / "cahce"
    for argv in (["list"], ["info"], ["verify"], ["prune"], ["clear", "--yes"]):
        rc, out, err = run_main(["cache", *argv, "--cache-dir", str(typo)], capsys)
        assert rc == 2 and "does not exist" in err and str(typo) in err, (argv, out, err)
        assert not typo.exists()
    # the configured default root that does not exist yet: empty, and still not created
    fresh = tmp_path / "fresh"
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(fresh))
    for argv in (["list"], ["info"], ["verify"], ["prune"], ["clear", "--yes"]):
        rc, out, err = run_main(["cache", *argv], capsys)
        assert rc == 0 and not fresh.exists(), (argv, out, err)
        assert "no cache there yet" in out, (argv, out)


def test_cache_clear_refuses_a_fallback_root(tmp_path, capsys, cli_logging):
    shared = cache.user_temp_root()  # the per-user temp dir: other configurations' entries live here
    kept, _ = get(ArtifactCache(shared), {"g": "someone else's"})
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheFallbackWarning)
        # a configured root that cannot be made (its parent is a file): a process falls back to `shared`
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MSA_JIT_CACHE_DIR", str(blocker / "c"))
            rc, out, err = run_main(["cache", "clear", "--yes"], capsys)
    assert rc == 2 and "refusing" in err and str(shared) in err and str(blocker) in err
    assert kept.path.exists()
    rc, out, err = run_main(["cache", "clear", "--yes", "--cache-dir", str(shared)], capsys)  # asked for by name
    assert rc == 0 and not kept.path.exists()


def test_cache_prune_below_the_cap_refuses_a_fallback_root(tmp_path, capsys, cli_logging):
    """A prune below the run-time cap removes what no automatic prune would there: on the shared
    fallback it is refused as clear is; at the cap it only does what the automatic prune does."""
    shared = cache.user_temp_root()
    kept, _ = get(ArtifactCache(shared), {"g": "someone else's"})
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
        warnings.simplefilter("ignore", CacheFallbackWarning)
        mp.setenv("MSA_JIT_CACHE_DIR", str(blocker / "c"))
        rc, out, err = run_main(["cache", "prune", "--max-bytes", "0", "--yes"], capsys)
        assert rc == 2 and "refusing" in err and str(shared) in err and str(blocker) in err, err
        assert f"msa-jit cache prune --max-bytes 0 --cache-dir {shared}" in err and kept.path.exists()
        rc, out, err = run_main(["cache", "prune"], capsys)
        assert rc == 0 and kept.path.exists(), err
    rc, out, err = run_main(["cache", "prune", "--max-bytes", "0", "--yes", "--cache-dir", str(shared)], capsys)
    assert rc == 0 and not kept.path.exists(), err


@pytest.mark.parametrize("argv", [["warmup", "--heads", "8/1", "--arch", "sm_90a"], ["cache", "info"],
                                  ["cache", "prune"], ["inspect", "--heads", "8/1", "--arch", "sm_90a"]])
def test_an_unusable_cache_dir_flag_is_refused_not_replaced(argv, tmp_path, capsys, cli_logging, monkeypatch):
    """--cache-dir names the root the person wants: one that cannot be made (here under a file)
    is exit 2 naming the flag, before any work, not a quiet fallback to the per-user temp dir
    (whose advice to set MSA_JIT_CACHE_DIR could not override the flag)."""
    from msa_jit.tools import warmup

    ran: list = []
    monkeypatch.setattr(warmup, "run_warmup", lambda *a, **k: ran.append(a))
    blocker = tmp_path / "f"
    blocker.write_text("x")
    rc, out, err = run_main([*argv, "--cache-dir", str(blocker / "c")], capsys)
    assert rc == 2 and err.strip() == (f"msa-jit {' '.join(argv[:2]) if argv[0] == 'cache' else argv[0]}: "
                                       f"--cache-dir {blocker / 'c'}: cannot be used as the cache root "
                                       f"({blocker} exists and is not a directory)"), err
    assert not ran and out == "" and not cache.user_temp_root().exists()


def test_a_read_only_cache_dir_is_still_read(tmp_path, capsys, cli_logging, monkeypatch):
    """A --cache-dir that holds a cache but cannot be written (a pre-warmed read-only mount) is
    read by list / info / verify, as the read-only root it is; the commands that write refuse it."""
    from msa_jit.jit.cache import location

    ro = tmp_path / "ro"
    entry, _ = get(ArtifactCache(ro), {"g": 1})
    real = location._writable_as_is
    monkeypatch.setattr(location, "_writable_as_is",  # a stand-in for a read-only mount (these tests may run as root)
                        lambda root: f"{root / 'v1'} is on a read-only filesystem" if root == ro else real(root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheFallbackWarning)
        rc, out, err = run_main(["cache", "list", "--cache-dir", str(ro)], capsys)
        assert rc == 0 and entry.key[:12] + " (ro)" in out, (out, err)
        rc, out, err = run_main(["cache", "verify", "--remove", "--cache-dir", str(ro)], capsys)
        assert rc == 2 and f"--cache-dir {ro}: cannot be used" in err and "read-only filesystem" in err, err


def test_list_and_info_say_how_many_entries_they_cannot_show(tmp_path, capsys):
    """An entry whose meta.json is damaged is not listed (nothing in it can be trusted); list and info say how
    many there are and what removes them, so none is silently left out."""
    root = tmp_path / "c"
    c = ArtifactCache(root)
    get(c, {"hq": 8})
    entry, _ = get(c, {"hq": 16})
    damaged = entry.path / cache.META_NAME
    damaged.write_text(damaged.read_text()[:20])
    assert c.unreadable_entries() == [entry.path]
    rc, out, err = run_main(["cache", "list", "--cache-dir", str(root)], capsys)
    assert rc == 0 and "1 entries in" in out and "1 unreadable entries" in out and "verify --remove" in out, err
    rc, out, _ = run_main(["cache", "info", "--cache-dir", str(root), "--json", str(tmp_path / "i.json")], capsys)
    assert rc == 0 and "1 unreadable entries" in out
    assert json.loads((tmp_path / "i.json").read_text())["unreadable_entries"] == 1
    assert run_main(["cache", "verify", "--remove", "--cache-dir", str(root)], capsys)[0] == 1
    assert ArtifactCache(root).unreadable_entries() == []
