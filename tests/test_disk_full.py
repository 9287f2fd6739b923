"""A full disk (ENOSPC) or quota (EDQUOT) during a build names where: the cache's build dir
under its root, the compiler's temp dir, the file being written, with their free space, not
just "[Errno 28] No space left on device" or the linker's "final link failed". CPU only: the
failing writes are monkeypatched."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest

from msa_jit.geometry import SparseDecodeConfig
from msa_jit.jit import compiler
from msa_jit.jit.cache import ArtifactCache, make_key
from msa_jit.jit.cache import store as cache_store

FP = {"source": "fake", "dsl": "0"}

pytestmark = pytest.mark.usefixtures("isolated_env")  # tests/conftest.py


def get(c: ArtifactCache, config: dict, build):
    return c.get_or_build(make_key(config, FP), build, config=config, fingerprint=FP, describe=f"fake {config}")


def build_dirs(c: ArtifactCache) -> list[Path]:
    tmp = c.v1 / "tmp"
    return sorted(tmp.iterdir()) if tmp.is_dir() else []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_under_the_cache_names_its_build_dir(tmp_path, monkeypatch, code):
    """meta.json's write fails as a full disk does (no file name in the error): the OSError keeps
    its errno and names the build dir and the cache root, with the free space; nothing is left."""
    c = ArtifactCache(tmp_path / "c")

    def build(tmp: Path) -> dict:
        (tmp / "kernel.so").write_bytes(b"x" * 100)
        return {"artifacts": ["kernel.so"]}

    real_open = open

    class FullFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(code, os.strerror(code))

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(cache_store, "open", lambda *a, **k: FullFile(real_open(*a, **k)), raising=False)
    with pytest.raises(OSError) as ei:
        get(c, {"g": code}, build)
    msg = str(ei.value)
    assert ei.value.errno == code, msg
    assert str(c.v1 / "tmp") in msg and str(c.root) in msg and "free" in msg, msg
    assert ("no space left on device" if code == errno.ENOSPC else "disk quota exceeded") in msg
    assert "fake {'g': " in msg  # what was being built
    assert build_dirs(c) == []


def test_a_full_disk_in_a_build_callback_names_the_file_and_the_cache(tmp_path):
    c = ArtifactCache(tmp_path / "c")

    def build(tmp: Path) -> dict:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "kernel.so"))

    with pytest.raises(OSError, match=r"no space left on device .*writing .*kernel\.so.*the cache's build dir") as ei:
        get(c, {"g": "callback"}, build)
    assert ei.value.errno == errno.ENOSPC and build_dirs(c) == []


def test_other_build_errors_pass_unchanged(tmp_path):
    c = ArtifactCache(tmp_path / "c")
    boom = OSError(errno.EACCES, "Permission denied")

    def build(tmp: Path) -> dict:
        raise boom

    with pytest.raises(OSError) as ei:
        get(c, {"g": "eacces"}, build)
    assert ei.value is boom


@pytest.fixture
def fake_compile(monkeypatch):
    """compile_sparse_decode without the DSL: the kernel object and the linker stood in for, the
    build step replaced by the test's."""
    monkeypatch.setattr(compiler, "make_kernel", lambda config: object())
    monkeypatch.setattr(compiler, "_linker", lambda: "cc")

    def use(step):
        monkeypatch.setattr(compiler.build, "build", step)
    return use


CFG = SparseDecodeConfig(16, 1, q_dtype="bfloat16", arch="sm_90a")


@pytest.mark.parametrize("how", ["linker", "write", "quota"])
def test_a_full_disk_while_compiling_names_the_build_and_temp_dirs(tmp_path, fake_compile, how):
    """The linker's "final link failed: No space left on device" (a RuntimeError carrying its
    stderr), and an object write that fails with ENOSPC / EDQUOT and no file name: an OSError of
    that errno naming the build dir and the temp dir (TMPDIR) the DSL and the linker write to."""
    out = tmp_path / "build"
    out.mkdir()

    def step(kernel, config, out_dir, linker):
        if how == "linker":
            raise RuntimeError("linking sparse_decode.so failed:\n/usr/bin/ld: final link failed: "
                               "No space left on device\ncollect2: error: ld returned 1 exit status")
        raise OSError(errno.EDQUOT if how == "quota" else errno.ENOSPC, "full")

    fake_compile(step)
    with pytest.raises(OSError) as ei:
        compiler.compile_sparse_decode(CFG, out)
    msg = str(ei.value)
    assert ei.value.errno == (errno.EDQUOT if how == "quota" else errno.ENOSPC), msg
    assert str(out) in msg and tempfile.gettempdir() in msg and "TMPDIR" in msg, msg
    assert CFG.describe() in msg and "sm_90a" in msg
    if how == "linker":
        assert "final link failed" in msg  # the linker's own words are kept (its last line)


def test_a_full_disk_while_compiling_through_the_cache_is_named_once(tmp_path, fake_compile):
    """Through ensure_compiled (the warm-up's and the kernel call's path): the compiler's message
    (build and temp dirs) comes out as it is, not wrapped again by the cache."""
    def step(kernel, config, out_dir, linker):
        raise RuntimeError("linking sparse_decode.so failed:\n/usr/bin/ld: final link failed: No space left on device")

    fake_compile(step)
    c = ArtifactCache(tmp_path / "c")
    with pytest.raises(OSError) as ei:
        compiler.ensure_compiled(CFG, c)
    msg = str(ei.value)
    assert msg.count("msa-jit: no space left on device") == 1 and str(c.v1 / "tmp") in msg, msg
    assert tempfile.gettempdir() in msg and build_dirs(c) == []


def test_compile_errors_that_are_not_a_full_disk_pass_unchanged(tmp_path, fake_compile):
    boom = RuntimeError("linking sparse_decode.so failed:\nundefined reference to `foo'")

    def step(*a):
        raise boom

    fake_compile(step)
    with pytest.raises(RuntimeError) as ei:
        compiler.compile_sparse_decode(CFG, tmp_path)
    assert ei.value is boom
