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
    "home_directory",
    "not_a_directory",
    "pinned",
    "preferred_root",
    "probe_writable",
    "readable_v1",
    "resolve",
    "root_problem",
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
    home = home_directory()
    if home is not None:
        return home / ".cache" / "msa-jit", "home directory"
    return user_temp_root(), "per-user temp dir"


def home_directory() -> Path | None:
    """The home directory, or None when it cannot be determined: $HOME, else (unset or empty: an
    empty HOME is no home, though Python's expanduser reads it as "/") the password database's
    entry for this uid. A relative one (HOME=".", a container user without a home) is none
    either: the cache would move with the working directory."""
    home = os.environ.get("HOME")
    if home is not None and home.strip() == "":
        home = None
    if home is None:
        try:
            import pwd

            home = pwd.getpwuid(os.getuid()).pw_dir
        except (ImportError, KeyError, OSError, AttributeError):  # no passwd entry (an arbitrary uid), Windows
            try:
                home = str(Path.home()) if "HOME" not in os.environ else None
            except (RuntimeError, KeyError, OSError):
                home = None
    if not home or not os.path.isabs(home):
        return None
    return Path(home)


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
    """The per-user temp dir must be ours and private (we dlopen what is in it); created (0700)
    when it does not exist."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        return describe_oserror(e)
    return _private_dir_problem(path)


def _private_dir_problem(path: Path) -> str | None:
    """Why the existing ``path`` is no private directory of this user (None when it is one)."""
    try:
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


def _creatable(root: Path) -> str | None:
    """Why ``root``, which does not exist, could not be created by a first use (None when it
    could): its nearest existing ancestor must be a directory in which a directory can be made.
    Asked by making and removing a probe directory there: permission bits do not tell (root
    passes every access check, and still cannot create under /sys or /proc)."""
    p = root
    while not os.path.lexists(p):
        if p.parent == p:
            return f"no ancestor of {root} exists"
        p = p.parent
    why = not_a_directory(p)
    if why is not None:
        return why
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".msa-jit-probe-", dir=p))
    except OSError as e:
        return f"cannot create a directory in {p} ({describe_oserror(e)})"
    return None


def _writable_as_is(root: Path) -> str | None:
    """Why the existing cache tree ``root/v1`` could not be written (None when it could), asked
    without writing: no directory of it may be anything else, the filesystem may not be
    read-only or full, and this process needs write and search access to v1/ and to what of
    tmp/ and locks/ exists."""
    v1 = root / LAYOUT
    for d in (root, v1, v1 / "tmp", v1 / "locks"):
        why = not_a_directory(d)
        if why is not None:
            return why
    try:
        st = os.statvfs(v1)
    except (OSError, AttributeError) as e:
        if isinstance(e, OSError):
            return describe_oserror(e)
        st = None
    if st is not None:
        if st.f_flag & getattr(os, "ST_RDONLY", 1):
            return f"{v1} is on a read-only filesystem"
        if st.f_bavail == 0:
            return f"the filesystem of {v1} is full"
    for d in (v1, v1 / "tmp", v1 / "locks"):
        if os.path.isdir(d) and not os.access(d, os.W_OK | os.X_OK):
            return f"{d} is not writable by this user"
    return None


def _view_problem(c: Path, user_tmp: Path) -> str | None:
    """Why `_view` rejects the candidate root ``c`` (None when it would use it), found without
    creating anything."""
    if c == user_tmp and os.path.lexists(c):
        reason = _private_dir_problem(c)
        if reason is not None:
            return reason
    if os.path.lexists(c / LAYOUT):
        return _writable_as_is(c)
    return not_a_directory(c) if os.path.lexists(c) and not os.path.isdir(c) else _creatable(c / LAYOUT)


def root_problem(root: os.PathLike | str) -> str | None:
    """Why ``root`` could not be the writable cache root (None when it could), judged as
    ``resolve(root, create=False)`` judges it: nothing is created. For a root a person named
    (`msa-jit --cache-dir`), which must be refused rather than replaced by a fallback."""
    return _view_problem(_absolute(root), user_temp_root())


def _view(pref: Path, source: str) -> Resolution:
    """`resolve(create=False)`: the root a process would choose, found without creating anything
    (no root, no per-user temp dir, no v1/ tree, no in-process temp dir): a root that does not
    exist and could be created is reported as it is (``exists=False``: an empty cache); a root
    without a usable tree falls back as at run time, and the message is the one a process
    would print."""
    user_tmp = user_temp_root()
    candidates = [pref] if pref == user_tmp else [pref, user_tmp]
    rejected: list[tuple[Path, str]] = []
    readonly: list[Path] = []
    for c in candidates:
        reason = _view_problem(c, user_tmp)
        if reason is None:
            message = None
            if rejected:
                message = _fallback_message(rejected, c, False, readonly, source)
            return Resolution(pref, source, c, tuple(readonly), False, message, exists=os.path.lexists(c / LAYOUT))
        if readable_v1(c):
            readonly.append(c)
        rejected.append((c, reason))
    where = Path(tempfile.gettempdir()) / "msa-jit-XXXXXXXX"  # what mkdtemp would make: nothing is made here
    return Resolution(pref, source, where, tuple(readonly), True, _fallback_message(rejected, where, True, readonly,
                                                                                     source), exists=False)


def _fallback_message(rejected: list[tuple[Path, str]], chosen: Path, ephemeral: bool, readonly: list[Path],
                      source: str) -> str:
    parts = [f"cannot use {p} ({r})" for p, r in rejected]
    message = f"msa-jit cache: {'; '.join(parts)}; using {chosen} instead"
    if ephemeral:
        message += (
            " (an in-process temporary directory deleted at exit: compiled kernels will "
            "not be reused by other processes)"
        )
    if readonly:
        message += f". Artifacts already in {', '.join(map(str, readonly))} are still used read-only"
    # the variable cannot override a root given as an argument: then only another argument helps
    fix = "Give a writable cache directory" if source == "argument" else f"Set {env.CACHE_DIR} to a writable directory"
    message += f". {fix} to silence this warning."
    return message


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

    ``create=False`` (the maintenance commands, doctor): the same choice, found without
    creating or writing anything (`_view`): a root without a ``v1/`` tree that a first use would
    simply create is reported as it is (``exists=False``: an empty cache); an unusable one
    falls back, as it would at run time, to the per-user temp dir (``exists=False`` when there
    is none yet) or, where neither is usable, to an in-process temp dir (``ephemeral``; its
    name is mkdtemp's pattern, no directory is made)."""
    if requested is None:
        pref, source = preferred_root()
    else:
        pref, source = _absolute(requested), "argument"
    if not create:
        return _view(pref, source)
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
    message = _fallback_message(rejected, chosen, ephemeral, readonly, source) if rejected else None
    return Resolution(pref, source, chosen, tuple(readonly), ephemeral, message)
