"""Where the disk cache lives: the preferred root (``preferred_root``), the
per-user temp dir (``user_temp_root``), and the probes that decide whether a
root is usable (writability probe, private-dir check, readable ``v1/``).

The fallback policy that combines them (``_resolve``, which builds the
``_Resolution`` defined here) lives in ``msa_jit.cache``, next to
``ArtifactCache`` which calls it, and looks these probes up through that
module's namespace (tests patch ``msa_jit.cache._probe_writable``).
``msa_jit.cache`` re-exports every public name; the contract is
``cache_dir_policy.md`` §1. Only the standard library and ``msa_jit.env`` are imported.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import env
from .cache_entry import LAYOUT

__all__ = [
    "preferred_root",
    "user_temp_root",
]


def preferred_root() -> tuple[Path, str]:
    """The configured cache root and where it came from (cache_dir_policy.md §1)."""
    d = env.cache_dir()
    if d is not None:
        return d, env.CACHE_DIR
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "msa-jit", "XDG_CACHE_HOME"
    try:
        home = Path.home()
    except Exception:  # no HOME and no passwd entry (containers with arbitrary uids)
        home = None
    if home is not None and str(home) not in ("", "."):
        return home / ".cache" / "msa-jit", "home directory"
    return user_temp_root(), "per-user temp dir"


def _user_tag() -> str:
    if hasattr(os, "getuid"):
        return str(os.getuid())
    import getpass

    return re.sub(r"[^A-Za-z0-9_.-]", "_", getpass.getuser())


def user_temp_root() -> Path:
    """``tempfile.gettempdir()/msa-jit-<uid>`` (evaluated live)."""
    return Path(tempfile.gettempdir()) / f"msa-jit-{_user_tag()}"


def _describe_oserror(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    text = e.strerror or str(e)
    return f"{type(e).__name__}{' ' + name if name else ''}: {text}"


def _probe_writable(root: Path) -> str | None:
    """None if ``root/v1`` can be created and written (a probe file written,
    fsynced and removed), else the reason."""
    try:
        v1 = root / LAYOUT
        for d in (v1, v1 / "tmp", v1 / "locks"):
            d.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".probe-", dir=v1 / "tmp")
        try:
            os.write(fd, b"msa-jit write probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as e:
        return _describe_oserror(e)
    return None


def _check_private_dir(path: Path) -> str | None:
    """The per-user temp dir must be ours and private (we dlopen what is in it)."""
    try:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    except OSError as e:
        return _describe_oserror(e)
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it exists and is not a directory"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"it is group/world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _readable_v1(root: Path) -> bool:
    v1 = root / LAYOUT
    try:
        return v1.is_dir() and os.access(v1, os.R_OK | os.X_OK)
    except OSError:
        return False


@dataclass(frozen=True)
class _Resolution:
    requested: Path
    source: str
    root: Path
    readonly: tuple[Path, ...]
    ephemeral: bool
    message: str | None

