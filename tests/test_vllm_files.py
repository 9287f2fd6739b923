"""tests/vllm_files.py: where the engine tests get vLLM 0.33.0's files. The variable's folder first,
then an installed vLLM, then this machine's copy, then the wheel; a file that is not the release's
is never used; without any, the reason says what was tried. No network here: pip is stood in for."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import vllm_files as vf

CONTENT = {name: f"# {name} of the stand-in release\n".encode() for name in vf.ENGINE_FILES}


@pytest.fixture
def release(monkeypatch, tmp_path):
    """A stand-in release: ENGINE_FILES pinned to CONTENT's digests, no installed vLLM, no variable,
    an empty machine cache under tmp_path, and a pip that must not be called (a test says otherwise)."""
    monkeypatch.setattr(vf, "ENGINE_FILES", {name: (member, hashlib.sha256(CONTENT[name]).hexdigest())
                                             for name, (member, _) in vf.ENGINE_FILES.items()})
    monkeypatch.delenv(vf.ENGINE_DIR_VAR, raising=False)
    monkeypatch.setenv(vf.CACHE_DIR_VAR, str(tmp_path / "cache"))
    monkeypatch.setattr(vf, "installed_dir", lambda: None)

    def no_pip(*a, **k):
        raise AssertionError("pip was run although a copy was there")

    monkeypatch.setattr(vf.subprocess, "run", no_pip)
    return tmp_path


def write_files(folder: Path, layout: str = "flat", **changed: bytes) -> Path:
    for name, (member, _) in vf.ENGINE_FILES.items():
        path = folder / (name if layout == "flat" else member)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(changed.get(Path(name).stem, CONTENT[name]))
    return folder


def fake_pip(monkeypatch, calls: list, *, fail: str | None = None, extra: dict[str, bytes] | None = None):
    """pip download stood in for: records the command, writes a wheel (a zip in the wheel's layout
    holding the ENGINE_FILES and `extra`) into its -d folder, or fails with `fail` on stderr."""
    def run(cmd, **kw):
        calls.append(cmd)
        if fail is not None:
            return SimpleNamespace(returncode=1, stdout="", stderr=f"Looking in indexes\n{fail}\n")
        out = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(out / f"vllm-{vf.VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as z:
            for name, (member, _) in vf.ENGINE_FILES.items():
                z.writestr(member, CONTENT[name])
            for member, data in (extra or {}).items():
                z.writestr(member, data)
        return SimpleNamespace(returncode=0, stdout="Saved\n", stderr="")

    monkeypatch.setattr(vf.subprocess, "run", run)


def test_the_real_files_are_pinned_to_the_release():
    """The digests are the wheel RECORD's, and the files in use (when found) match them."""
    assert set(vf.ENGINE_FILES) == {"common/sparse_attention.py", "msa_cutlass_sparse_decode.py",
                                    "sparse_attention_msa.py", "model.py", "common/ops/sparse_attn.py"}
    assert all(member.startswith("vllm/models/minimax_m3/") and len(digest) == 64
               for member, digest in vf.ENGINE_FILES.values())
    if vf.FILES is None:
        pytest.skip(vf.SKIP_REASON)
    for name, path in vf.FILES.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == vf.ENGINE_FILES[name][1], path


def test_the_variable_comes_first_and_a_relative_one_is_from_the_repository(release, monkeypatch):
    copy = write_files(release / "copy")
    write_files(vf.cache_dir())
    monkeypatch.setenv(vf.ENGINE_DIR_VAR, str(copy))
    files, source = vf.resolve()
    assert files == {name: copy / name for name in vf.ENGINE_FILES} and vf.ENGINE_DIR_VAR in source
    monkeypatch.setenv(vf.ENGINE_DIR_VAR, "some/where")
    assert vf.given_dir() == vf.ROOT / "some" / "where"


def test_a_file_that_is_not_the_releases_is_passed_over(release, monkeypatch):
    """The variable's folder with one edited file, then an installed vLLM with one: neither is used,
    this machine's copy is."""
    copy = write_files(release / "copy", model=b"# edited\n")
    site = write_files(release / "site", layout="wheel", sparse_attention_msa=b"# edited\n")
    cache = write_files(vf.cache_dir())
    monkeypatch.setenv(vf.ENGINE_DIR_VAR, str(copy))
    monkeypatch.setattr(vf, "installed_dir", lambda: site)
    files, source = vf.resolve()
    assert files == {name: cache / name for name in vf.ENGINE_FILES} and str(cache) in source
    assert "SHA-256 differs" in vf.check_dir(copy) and "model.py" in vf.check_dir(copy)


def test_an_installed_vllm_is_read_in_its_own_layout(release, monkeypatch):
    site = write_files(release / "site", layout="wheel")
    monkeypatch.setattr(vf, "installed_dir", lambda: site)
    files, source = vf.resolve()
    assert files == {name: site / member for name, (member, _) in vf.ENGINE_FILES.items()}
    assert "installed vLLM" in source


def test_the_wheel_is_fetched_once_and_only_the_engine_files_kept(release, monkeypatch):
    calls: list = []
    fake_pip(monkeypatch, calls, extra={"vllm/__init__.py": b"import torch\n", "vllm/big.so": b"\0" * 1000})
    files, source = vf.resolve()
    dest = vf.cache_dir()
    assert source.startswith("downloaded vllm-0.33.0-") and str(dest) in source
    assert files == {name: dest / name for name in vf.ENGINE_FILES}
    kept = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert kept == sorted(vf.ENGINE_FILES)
    assert not list(dest.parent.glob("*.whl")) and not list(dest.parent.glob(".download-*"))
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and cmd[-1] == "vllm==0.33.0"
    assert vf.resolve() == (files, f"this machine's copy ({dest})")  # no second download
    assert len(calls) == 1


def test_a_wheel_whose_files_differ_is_not_kept(release, monkeypatch):
    calls: list = []
    fake_pip(monkeypatch, calls)
    monkeypatch.setitem(CONTENT, "model.py", b"# not the release's\n")
    files, reason = vf.resolve()
    assert files is None and reason.startswith(vf.SKIP_PREFIX) and "SHA-256 differs" in reason
    assert not vf.cache_dir().exists()


def test_without_network_the_reason_says_what_was_tried(release, monkeypatch):
    calls: list = []
    fake_pip(monkeypatch, calls, fail="ERROR: No matching distribution found for vllm==0.33.0")
    monkeypatch.setenv(vf.ENGINE_DIR_VAR, str(release / "nowhere"))
    files, reason = vf.resolve()
    assert files is None and reason.startswith(vf.SKIP_PREFIX)
    for part in (f"${vf.ENGINE_DIR_VAR}: {release / 'nowhere'}", "pip download", "exit 1",
                 "No matching distribution found", str(vf.cache_dir())):
        assert part in reason, part
    assert len(calls) == 1 and not vf.cache_dir().exists()


def test_offline_the_tests_that_read_the_files_skip_and_say_why(pytester, monkeypatch, tmp_path):
    """A real pip that cannot reach an index, no copy: a module guarded like the engine tests skips,
    the reason in -ra's summary and in conftest.py's closing note; nothing fails."""
    tests = Path(__file__).resolve().parent
    for f in ("conftest.py", "vllm_files.py", "vllm_standins.py"):
        (pytester.path / f).write_bytes((tests / f).read_bytes())
    pytester.makepyfile(test_guarded="""
        import pytest
        import vllm_standins as vs
        pytestmark = pytest.mark.skipif(not vs.engine_files_present(), reason=vs.ENGINE_SKIP_REASON)
        def test_reads_them():
            assert vs.engine_file("model.py").read_text()
    """)
    monkeypatch.setenv(vf.CACHE_DIR_VAR, str(tmp_path / "empty-cache"))
    monkeypatch.delenv(vf.ENGINE_DIR_VAR, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no index or wheel folder from pip.conf
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # refuses connections at once
    r = pytester.runpytest_subprocess("-ra", "-p", "no:cacheprovider")
    r.assert_outcomes(skipped=1)
    out = " ".join(r.stdout.str().split())
    assert f"SKIPPED [1] test_guarded.py:4: {vf.SKIP_PREFIX}" in out and "pip download" in out
    assert f"NOTE: 1 test of the real vLLM engine files skipped: {vf.SKIP_PREFIX}" in out
