"""vLLM 0.33.0's own source files that the engine tests read, and where they come from.

tests/vllm_standins.py runs three of them unmodified (four with vLLM's own Triton decode kernels,
common/ops/sparse_attn.py, run by the Triton interpreter), tests/engine_cases.py runs model.py's
wiring (by ast), tests/test_engine_parity.py parses two. They are not part of this repository
(nothing of vLLM is copied into it): the first of these places that holds all five, each
byte-identical to the release (its SHA-256 in the wheel's RECORD, pinned below), is used:

1. $MSA_JIT_TEST_ENGINE_DIR, when set: a folder in the layout of ENGINE_FILES (a relative path is
   taken from the repository root). For a host without network: copy CACHE_DIR there.
2. An installed vLLM 0.33.0: the files of its package folder, read, never imported.
3. CACHE_DIR, this machine's copy: `$XDG_CACHE_HOME/msa-jit-tests/vllm-0.33.0` (else under
   ~/.cache), or $MSA_JIT_TEST_CACHE_DIR/vllm-0.33.0.
4. The pinned wheel, fetched into CACHE_DIR once per machine: `pip download --no-deps vllm==0.33.0`
   (about 340 MB, pip's own cache bypassed), the five files extracted from its zip (nothing is
   installed), the wheel deleted. Two test runs at once download it once (a file lock).

`FILES` maps each name of ENGINE_FILES to the file used. When no place holds them (no network and
no copy), `FILES` is None and the tests that need them skip with `SKIP_REASON` (conftest.py repeats
it with the count at the end of the run). Nothing is looked for until a test module imports this.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.33.0"
ENGINE_DIR_VAR = "MSA_JIT_TEST_ENGINE_DIR"
CACHE_DIR_VAR = "MSA_JIT_TEST_CACHE_DIR"
PACKAGE = "vllm/models/minimax_m3"  # the files' folder in the wheel (and in an installed vLLM)
# name (the layout of $MSA_JIT_TEST_ENGINE_DIR and CACHE_DIR) -> (path in the wheel, its SHA-256 in the
# wheel's vllm-0.33.0.dist-info/RECORD)
ENGINE_FILES: dict[str, tuple[str, str]] = {
    "common/sparse_attention.py": (
        f"{PACKAGE}/common/sparse_attention.py",
        "51e62c789b89d135f5fe0afd1881ea5b704d87de9d5a77b552170e548d46482b"),
    "msa_cutlass_sparse_decode.py": (
        f"{PACKAGE}/nvidia/msa_cutlass_sparse_decode.py",
        "670c89d0268bbf090cec3a796e504656222063fe75d0c61df7a65bea260e8d2c"),
    "sparse_attention_msa.py": (
        f"{PACKAGE}/nvidia/sparse_attention_msa.py",
        "82884bf06dbe6e77565b434a4789d5dbb8fbe1256dd6938db55191a9aa26cdea"),
    "model.py": (
        f"{PACKAGE}/nvidia/model.py",
        "f31f18ed74f260170f1313a8aa49ef279e9564e4e45d57ef634c394fe5aa8f05"),
    "common/ops/sparse_attn.py": (
        f"{PACKAGE}/common/ops/sparse_attn.py",
        "ce426367eba80e32808efb346c6d42eab834099d4db2e134e6525fc27e7704e1"),
}
SKIP_PREFIX = f"vLLM {VERSION}'s source files are not available"
PIP_TIMEOUT_S = 15  # per network read (pip --timeout); a host without network fails in seconds
PIP_TOTAL_S = 900  # the whole download (336 MB; 15-25 s on the CI machines)


def cache_dir() -> Path:
    """Where this machine keeps the extracted files (CACHE_DIR above)."""
    value = os.environ.get(CACHE_DIR_VAR, "").strip()
    if value:
        base = Path(value).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "msa-jit-tests"
    return base / f"vllm-{VERSION}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_dir(folder: Path, names: dict[str, str] | None = None) -> str | None:
    """None if `folder` holds the release's five files (at `names[name]`, default the name itself),
    else what is wrong."""
    for name, (_, digest) in ENGINE_FILES.items():
        path = folder / (names or {}).get(name, name)
        if not path.is_file():
            return f"{path} is missing"
        if _sha256(path) != digest:
            return f"{path} is not vLLM {VERSION}'s (SHA-256 differs)"
    return None


def given_dir() -> Path | None:
    """$MSA_JIT_TEST_ENGINE_DIR as a path (relative: from the repository root), None when unset."""
    value = os.environ.get(ENGINE_DIR_VAR, "").strip()
    if not value:
        return None
    p = Path(value).expanduser()
    return p if p.is_absolute() else ROOT / p


def installed_dir() -> Path | None:
    """The folder holding an installed vLLM 0.33.0's `vllm` package (not imported), else None."""
    try:
        if importlib.metadata.version("vllm") != VERSION:
            return None
        spec = importlib.util.find_spec("vllm")
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def download(dest: Path) -> str:
    """Fetch the wheel with pip into a temporary folder beside `dest`, extract ENGINE_FILES from its
    zip into `dest` (atomically: a complete folder or none), delete the wheel. Returns a note of
    what was fetched; raises RuntimeError with pip's last words when it fails."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
               "--disable-pip-version-check", "--timeout", str(PIP_TIMEOUT_S), "--retries", "2",
               "-d", tmp, f"vllm=={VERSION}"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TOTAL_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`pip download --no-deps vllm=={VERSION}` took over {PIP_TOTAL_S} s") from None
        wheels = sorted(Path(tmp).glob(f"vllm-{VERSION}-*.whl"))
        if r.returncode != 0 or not wheels:
            last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
            raise RuntimeError(f"`pip download --no-deps vllm=={VERSION}` failed (exit {r.returncode}): {last}")
        wheel = wheels[0]
        size = wheel.stat().st_size
        seconds = time.monotonic() - t0
        staged = Path(tmp) / "files"
        with zipfile.ZipFile(wheel) as z:
            for name, (member, _) in ENGINE_FILES.items():
                (staged / name).parent.mkdir(parents=True, exist_ok=True)
                (staged / name).write_bytes(z.read(member))
        wheel.unlink()
        problem = check_dir(staged)
        if problem:
            raise RuntimeError(f"{wheel.name}: {problem}")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staged, dest)
    return f"downloaded {wheel.name} ({size / 1e6:.0f} MB) in {seconds:.0f} s, kept its {len(ENGINE_FILES)} files in {dest}"


def resolve() -> tuple[dict[str, Path] | None, str]:
    """(each of ENGINE_FILES' path, or None when no place holds them; where they were found or why not)."""
    tried = []
    given = given_dir()
    if given is not None:
        problem = check_dir(given)
        if problem is None:
            return {name: given / name for name in ENGINE_FILES}, f"${ENGINE_DIR_VAR} ({given})"
        tried.append(f"${ENGINE_DIR_VAR}: {problem}")
    site = installed_dir()
    if site is not None:  # an installed vLLM keeps the wheel's layout
        names = {name: member for name, (member, _) in ENGINE_FILES.items()}
        problem = check_dir(site, names)
        if problem is None:
            return {name: site / member for name, member in names.items()}, \
                f"the installed vLLM {VERSION} ({site / 'vllm'})"
        tried.append(f"installed vLLM: {problem}")
    dest = cache_dir()
    found = {name: dest / name for name in ENGINE_FILES}
    if check_dir(dest) is None:
        return found, f"this machine's copy ({dest})"
    from filelock import FileLock

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(dest) + ".lock"):
            if check_dir(dest) is None:  # another run fetched it while this one waited
                return found, f"this machine's copy ({dest})"
            return found, download(dest)
    except (RuntimeError, OSError, zipfile.BadZipFile) as e:  # OSError: an unwritable cache folder too
        tried.append(str(e))
    return None, (f"{SKIP_PREFIX} ({'; '.join(tried)}); to run these tests without network, copy {dest} "
                  f"from a machine that has it and set ${ENGINE_DIR_VAR} to the copy")


FILES, SOURCE = resolve()
SKIP_REASON = SOURCE if FILES is None else ""
DOWNLOADED = FILES is not None and SOURCE.startswith("downloaded ")
