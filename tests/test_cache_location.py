"""msa_jit.jit.cache: where the cache lives (docs/cache.md §1, §11): the root's precedence, the
fallbacks and their one warning, the private temp dir, a pinned root, read-only pre-warmed roots
(CPU only, fake builds). Split from test_cache.py, whose helpers these share."""

from __future__ import annotations

import os
import re
import stat
import warnings
from pathlib import Path

import pytest
from test_cache import get

from msa_jit.jit import cache
from msa_jit.jit.cache import ArtifactCache, CacheFallbackWarning
from msa_jit.jit.cache import location as cache_location

pytestmark = pytest.mark.usefixtures("isolated_env")  # tests/conftest.py


def test_location_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache.preferred_root()[0] == tmp_path / "home" / ".cache" / "msa-jit"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert cache.preferred_root()[0] == tmp_path / "home" / ".cache" / "msa-jit"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.preferred_root()[0] == tmp_path / "xdg" / "msa-jit"
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache.preferred_root() == (tmp_path / "explicit", "MSA_JIT_CACHE_DIR")
    c = ArtifactCache()
    assert c.root == tmp_path / "explicit"
    assert cache.default_cache() is cache.default_cache()
    assert cache.default_cache().root == tmp_path / "explicit"
    assert cache.user_temp_root() == tmp_path / "systmp" / f"msa-jit-{os.getuid()}"


def _fallbacks(record) -> list:
    return [w for w in record if issubclass(w.category, CacheFallbackWarning)]


def test_unwritable_root_falls_back_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file")
    bad = blocker / "cache"
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(bad))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c = ArtifactCache()
        e1, built = get(c, {"g": "fb"})
        e2, built2 = get(c, {"g": "fb"})
        c.lookup(e1.key)
        c.prune()
    ws = _fallbacks(rec)
    assert len(ws) == 1, [str(w.message) for w in rec]
    msg = str(ws[0].message)
    assert str(bad) in msg and "NotADirectoryError" in msg and str(c.root) in msg
    assert c.root == cache.user_temp_root() and not c.ephemeral
    assert built and not built2 and e1.path.is_relative_to(c.root)
    assert c.fallback_reason == msg
    assert c.readonly_roots == () and "read-only" not in msg  # `bad` holds no v1/ to read from
    assert (os.stat(c.root).st_mode & 0o777) == 0o700
    # default_cache warns once per process for the same configuration
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        cache.default_cache()
        cache.default_cache()
    assert len(_fallbacks(rec)) == 1


def test_fallback_to_in_process_tempdir(tmp_path, monkeypatch):
    """The last resort: an in-process temp dir, registered for removal at exit (otherwise every process
    that falls back to it leaves its compiled kernels behind in the system temp dir)."""
    registered = []
    monkeypatch.setattr(cache_location.atexit, "register", lambda fn, *args: registered.append((fn, args)))
    blocker = tmp_path / "f"
    blocker.write_text("x")
    cache.user_temp_root().write_text("someone else's file")  # per-user temp dir unusable too
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c = ArtifactCache(blocker / "cache")
        entry, built = get(c, {"g": "eph"})
    ws = _fallbacks(rec)
    assert len(ws) == 1
    msg = str(ws[0].message)
    assert str(blocker / "cache") in msg and str(cache.user_temp_root()) in msg and "deleted at exit" in msg
    assert c.ephemeral and built and entry.artifact_path().exists()
    assert c.root.parent == tmp_path / "systmp" and c.root != cache.user_temp_root()
    assert len(registered) == 1, registered
    fn, args = registered[0]
    fn(*args)  # what the interpreter runs at exit
    assert not c.root.exists()


def test_foreign_or_open_user_temp_dir_rejected(tmp_path, monkeypatch):
    d = cache.user_temp_root()
    d.mkdir(mode=0o700)
    assert cache_location.check_private_dir(d) is None  # ours and private: accepted
    for mode, says in ((0o777, "group/world-writable (mode 777)"), (0o770, "group/world-writable (mode 770)"),
                       (0o702, "group/world-writable (mode 702)")):
        os.chmod(d, mode)
        assert says in (cache_location.check_private_dir(d) or "accepted"), mode
    os.chmod(d, 0o700)

    # another user's dir: a stat result stand-in with another owner (chown needs root, and
    # root's uid is what the check compares with), the real one for every other path
    real_lstat = os.lstat
    other = os.getuid() + 4242

    def lstat_foreign_owner(path, *a, **k):  # stand-in: `d` owned by uid `other`
        st = real_lstat(path, *a, **k)
        if os.fspath(path) != os.fspath(d):
            return st
        fields = list(st)
        fields[stat.ST_UID] = other
        return os.stat_result(fields)

    blocker = tmp_path / "f"
    blocker.write_text("x")
    with monkeypatch.context() as m:
        m.setattr(cache_location.os, "lstat", lstat_foreign_owner)
        why = cache_location.check_private_dir(d) or "accepted"
        assert f"owned by uid {other}, not by this user ({os.getuid()})" in why
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            c = ArtifactCache(blocker / "cache")  # the preferred root is unusable: the fallback skips `d`
    assert c.ephemeral and c.root != d and f"owned by uid {other}" in str(_fallbacks(rec)[0].message)

    os.rmdir(d)
    os.symlink(tmp_path, d)
    assert "symlink" in cache_location.check_private_dir(d)


def test_pinned_root_never_falls_back(tmp_path):
    """§1: ArtifactCache(root, fallback=False, readonly_roots=...) is exactly `root` with those
    read-only roots (probed): CacheDirError naming it when unusable, never a fallback or a warning."""
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a CacheFallbackWarning would raise
        for bad, says in ((blocker / "cache", "NotADirectoryError"), (blocker, "exists and is not a directory")):
            with pytest.raises(cache.CacheDirError, match=re.escape(str(bad))) as ei:
                ArtifactCache(bad, fallback=False)
            assert says in str(ei.value)
        ro = tmp_path / "ro"
        c = ArtifactCache(tmp_path / "c", fallback=False, readonly_roots=[ro])
    assert c.root == tmp_path / "c" and c.readonly_roots == (ro,) and c.fallback_reason is None
    assert not c.ephemeral and (c.v1 / "tmp").is_dir() and (c.v1 / "locks").is_dir()  # probed
    assert not cache.user_temp_root().exists()
    with pytest.raises(ValueError, match="needs the root"):
        ArtifactCache(fallback=False)


class _WorkerEnd:
    """Stand-in for a warm-up worker's end of its pipe: hands out `jobs`, keeps what is sent."""

    def __init__(self, jobs):
        self.jobs, self.sent = list(jobs), []

    def recv(self):
        return self.jobs.pop(0)

    def send(self, res):
        self.sent.append(res)


def test_warmup_workers_open_exactly_the_parents_root(tmp_path, monkeypatch):
    """§1 / §11: the warm-up's parent hands its workers its root and read-only roots, and a worker
    opens exactly those (pinned): no resolution of its own, no fallback when the root went bad.
    The worker's loop runs here, in this process; its compile is a stand-in that records the cache."""
    from msa_jit.tools import warmup

    opened = []
    monkeypatch.setattr(warmup, "compile_one",  # stand-in: no compiler, record the cache it gets
                        lambda cfg, c=None, corrupt=(): opened.append(c) or {"status": "cached"})
    root, ro = tmp_path / "c", tmp_path / "ro"
    get(ArtifactCache(ro), {"g": "prewarmed"})
    parent = ArtifactCache(root, fallback=False, readonly_roots=[ro])  # what the parent resolved
    pool = warmup._Pool(parent, ["ab" * 32])
    assert pool._args == (str(root), (str(ro),), ("ab" * 32,))  # what each worker is started with
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        end = _WorkerEnd([{"config": {}}, None])
        warmup._serve(end, *pool._args)
    (c,) = opened
    assert c.root == root and c.readonly_roots == (ro,) and c.fallback_reason is None
    assert end.sent == [{"status": "cached"}]

    blocker = tmp_path / "f"  # the parent's root is no longer usable when the worker opens it
    blocker.write_text("x")
    opened.clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        end = _WorkerEnd([{"config": {}}, {"config": {}}, None])
        warmup._serve(end, str(blocker), (), ())
    assert opened == [] and not _fallbacks(rec) and not cache.user_temp_root().exists()
    assert [r["status"] for r in end.sent] == ["failed", "failed"]
    assert end.sent[0]["error"].startswith("CacheDirError:") and str(blocker) in end.sent[0]["error"]


def test_readonly_prewarmed_root_still_used(tmp_path, monkeypatch):
    ro = tmp_path / "prewarmed"
    config = {"g": "ro"}
    warm, _ = get(ArtifactCache(ro), config)
    real_probe = cache_location.probe_writable
    monkeypatch.setattr(
        cache_location, "probe_writable",
        lambda root: "OSError EROFS: Read-only file system (simulated)" if Path(root) == ro else real_probe(root),
    )
    monkeypatch.setenv("MSA_JIT_NO_COMPILE", "1")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c = ArtifactCache(ro)
    ws = _fallbacks(rec)
    assert len(ws) == 1 and "read-only" in str(ws[0].message) and str(ro) in str(ws[0].message)
    assert c.root == cache.user_temp_root() and c.readonly_roots == (ro,)
    entry, built = get(c, config)
    assert not built and entry.readonly and entry.path == warm.path
    assert [e.key for e in c.entries()] == [warm.key]
    assert c.clear() == [] and warm.path.exists()  # read-only roots are never touched


def test_home_of_dot_is_no_cache_location(monkeypatch):
    """A HOME of "." (a container user without a home) would put the cache under whatever the working
    directory is: the per-user temp dir is the preferred root then."""
    monkeypatch.setenv("HOME", ".")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache.preferred_root() == (cache.user_temp_root(), "per-user temp dir")


def test_cache_dir_arguments_are_made_absolute(tmp_path, monkeypatch):
    """An argument root (and a pinned root's read-only roots) is expanded ("~") and made absolute
    against the working directory at resolution, so a later chdir cannot move the cache."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert ArtifactCache("~/msa-cache").root == home / "msa-cache"
    assert ArtifactCache("rel").root == tmp_path / "rel"
    c = ArtifactCache("~/p", fallback=False, readonly_roots=["ro", "~/ro2"])
    assert c.root == home / "p" and c.readonly_roots == (tmp_path / "ro", home / "ro2")


def test_preferred_root_that_is_the_user_temp_dir_is_named_once(monkeypatch):
    """Where the configured root is the per-user temp dir itself and it is unusable, the warning
    names it once (it is one candidate, not two) before the in-process temp dir."""
    d = cache.user_temp_root()
    d.write_text("not a directory")
    monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(d))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c = ArtifactCache()
    (w,) = _fallbacks(rec)
    msg = str(w.message)
    assert c.ephemeral and msg.count(f"cannot use {d} ") == 1, msg


def test_readonly_root_needs_a_searchable_v1(tmp_path, monkeypatch):
    """readable_v1: a v1/ that this process may read but not search (no execute permission) is
    no read-only root. The permission answer is a stand-in: these tests may run as root."""
    ro = tmp_path / "ro"
    (ro / "v1").mkdir(parents=True)
    assert cache_location.readable_v1(ro)
    assert not cache_location.readable_v1(tmp_path / "absent")
    monkeypatch.setattr(cache_location.os, "access", lambda path, mode: not mode & os.X_OK)  # r--: no search
    assert not cache_location.readable_v1(ro)


def test_maintenance_view_falls_back_where_the_root_cannot_be_created(tmp_path, monkeypatch):
    """§6: `cache list` / `info` / `clear` (resolve(create=False)) show the root a process would use.
    A missing root whose nearest existing directory refuses a mkdir (root under /sys: every access
    check passes, the mkdir gets EPERM) falls back as at run time; a creatable one is reported empty,
    nothing left behind."""
    import errno

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *a, **k):
        if Path(path).parent == blocked:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    for want in (blocked / "cache", blocked / "cache" / "deeper", blocked):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheFallbackWarning)
            c = cache.open_cache(want, create=False)
        assert c.root != want and c.fallback_reason and f"cannot use {want}" in c.fallback_reason, want
    ok = tmp_path / "fresh" / "cache"
    c = cache.open_cache(ok, create=False)
    assert c.root == ok and not c.fallback_reason and not ok.parent.exists()
    (tmp_path / "empty").mkdir()
    c = cache.open_cache(tmp_path / "empty", create=False)
    assert c.root == tmp_path / "empty" and os.listdir(tmp_path / "empty") == []


@pytest.mark.parametrize("create", [True, False])
def test_fallback_advice_fits_where_the_root_came_from(tmp_path, monkeypatch, create):
    """The fallback message's advice names what can change the root: MSA_JIT_CACHE_DIR for a root
    it (or a default) configured, not for a root given as an argument, which the variable cannot
    override."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheFallbackWarning)
        given = ArtifactCache(blocker / "arg", create=create).fallback_reason
        monkeypatch.setenv("MSA_JIT_CACHE_DIR", str(blocker / "env"))
        configured = ArtifactCache(create=create).fallback_reason
    assert "MSA_JIT_CACHE_DIR" not in given and given.endswith("Give a writable cache directory to silence this "
                                                               "warning."), given
    assert configured.endswith("Set MSA_JIT_CACHE_DIR to a writable directory to silence this warning."), configured
    assert cache_location.root_problem(blocker / "arg") == f"{blocker} exists and is not a directory"
    assert cache_location.root_problem(tmp_path / "fresh") is None and not (tmp_path / "fresh").exists()
