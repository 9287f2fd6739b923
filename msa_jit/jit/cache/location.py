"""Where the disk cache lives: the preferred root (``preferred_root``), the
per-user temp dir (``user_temp_root``), the probes that decide whether a root is
usable (writability probe, private-dir check, readable ``v1/``), and the fallback
policy that combines them (``resolve``, which ``ArtifactCache`` calls once).

Part of the disk cache (``msa_jit.jit.cache`` exports the public names; the contract
is ``docs/cache.md`` §1). Only the standard library, ``msa_jit.env`` and
the cache's leaf modules are imported.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ... import env
from .entry import LAYOUT
from .errors import CacheDirError, describe_oserror

__all__ = [
    "Resolution",
    "check_private_dir",
    "not_a_directory",
    "pinned",
    "preferred_root",
    "probe_writable",
    "readable_v1",
    "resolve",
    "user_temp_root",
]


def preferred_root() -> tuple[Path, str]:
    """The configured cache root and where it came from (docs/cache.md §1)."""
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


def not_a_directory(path: Path) -> str | None:
    """Why ``path`` exists but is no directory (a file, a dangling symlink, a symlink loop);
    None when it is a directory (a symlink to one included) or does not exist."""
    if os.path.isdir(path) or not os.path.lexists(path):
        return None
    if os.path.islink(path):
        try:
            os.stat(path)
        except OSError as e:
            return f"{path} is a broken symlink ({describe_oserror(e)})"
    return f"{path} exists and is not a directory"


def probe_writable(root: Path) -> str | None:
    """None if ``root/v1`` can be created and written (a probe file written,
    fsynced and removed), else the reason."""
    v1 = root / LAYOUT
    for d in (root, v1, v1 / "tmp", v1 / "locks"):
        why = not_a_directory(d)  # else mkdir(exist_ok=True) reports a symlink loop as EEXIST
        if why is not None:
            return why
    try:
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
        return describe_oserror(e)
    return None


def check_private_dir(path: Path) -> str | None:
    """The per-user temp dir must be ours and private (we dlopen what is in it)."""
    try:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    except OSError as e:
        return describe_oserror(e)
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it exists and is not a directory"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"it is group/world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def readable_v1(root: Path) -> bool:
    """Whether ``root/v1`` is a directory this process can list (a read-only root)."""
    v1 = root / LAYOUT
    try:
        return v1.is_dir() and os.access(v1, os.R_OK | os.X_OK)
    except OSError:
        return False


@dataclass(frozen=True)
class Resolution:
    """What `resolve` chose: the requested root and where it came from, the root used, the
    read-only roots kept, whether the root is an in-process temp dir, the warning text, and
    whether the root holds a cache at all (False only for ``resolve(create=False)``)."""

    requested: Path
    source: str
    root: Path
    readonly: tuple[Path, ...]
    ephemeral: bool
    message: str | None
    exists: bool = True


def _absolute(path: os.PathLike | str) -> Path:
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def _creatable(root: Path) -> bool:
    """Whether ``root``, or its nearest existing ancestor, is a directory in which a
    directory can be made (so that creating it is what a first use would do, not a fallback).
    Asked by making and removing a probe directory there: permission bits do not tell (root
    passes every access check, and still cannot create under /sys or /proc)."""
    p = root
    while not os.path.lexists(p):
        if p.parent == p:
            return False
        p = p.parent
    if not os.path.isdir(p):
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".msa-jit-probe-", dir=p))
    except OSError:
        return False
    return True


def pinned(root: os.PathLike | str, readonly: tuple[os.PathLike | str, ...] = ()) -> Resolution:
    """The resolution of ``ArtifactCache(root, fallback=False)``: exactly ``root`` (one another
    process already resolved, e.g. the warm-up's parent for its workers) with those read-only
    roots; CacheDirError when ``root`` is no longer usable, never a fallback."""
    root = _absolute(root)
    reason = probe_writable(root)
    if reason is not None:
        raise CacheDirError(f"msa-jit: cache root {root} is unusable ({reason})")
    return Resolution(root, "pinned", root, tuple(_absolute(r) for r in readonly), False, None)


def resolve(requested: os.PathLike | str | None, *, create: bool = True) -> Resolution:
    """Choose the cache root for ``ArtifactCache(requested)`` (docs/cache.md §1): the
    preferred root, else the private per-user temp dir, else an in-process temp dir.

    ``create=False`` (the maintenance commands): a preferred root without a ``v1/`` tree that
    a first use would simply create is reported as it is (``exists=False``: an empty cache)
    instead of being created; an unusable one still falls back, as it would at run time."""
    if requested is None:
        pref, source = preferred_root()
    else:
        pref, source = _absolute(requested), "argument"
    if not create and not os.path.lexists(pref / LAYOUT) and _creatable(pref):
        return Resolution(pref, source, pref, (), False, None, exists=False)
    user_tmp = user_temp_root()
    candidates = [pref] if pref == user_tmp else [pref, user_tmp]
    rejected: list[tuple[Path, str]] = []
    readonly: list[Path] = []
    chosen: Path | None = None
    for c in candidates:
        reason = check_private_dir(c) if c == user_tmp else None
        if reason is None:
            reason = probe_writable(c)
            if reason is not None and readable_v1(c):
                readonly.append(c)
        if reason is None:
            chosen = c
            break
        rejected.append((c, reason))
    ephemeral = False
    if chosen is None:
        try:
            chosen = Path(tempfile.mkdtemp(prefix="msa-jit-"))
        except OSError as e:
            raise CacheDirError(
                "msa-jit: no usable cache directory: "
                + "; ".join(f"{p} ({r})" for p, r in rejected)
                + f"; a temporary directory could not be created either ({describe_oserror(e)}). "
                f"Set {env.CACHE_DIR} to a writable directory."
            ) from e
        atexit.register(shutil.rmtree, str(chosen), True)
        ephemeral = True
        reason = probe_writable(chosen)
        if reason is not None:
            raise CacheDirError(f"msa-jit: temporary cache directory {chosen} is unusable ({reason})")
    message = None
    if rejected:
        parts = [f"cannot use {p} ({r})" for p, r in rejected]
        message = f"msa-jit cache: {'; '.join(parts)}; using {chosen} instead"
        if ephemeral:
            message += (
                " (an in-process temporary directory deleted at exit: compiled kernels will "
                "not be reused by other processes)"
            )
        if readonly:
            message += f". Artifacts already in {', '.join(map(str, readonly))} are still used read-only"
        message += f". Set {env.CACHE_DIR} to a writable directory to silence this warning."
    return Resolution(pref, source, chosen, tuple(readonly), ephemeral, message)
