"""Who may have written the cache: refuse native code other users could have changed.

A cache entry is a shared library that engine start loads and executes, so the
cache is only as trustworthy as the set of users who can write it. The rules
(the same idea as OpenSSH's ``StrictModes`` for ``~/.ssh``):

- the cache directory, the directories inside it that hold entry files, the
  SQLite index (``cache.db``, ``cache.db-wal``) and every entry file must be
  owned by the user this process runs as (its effective uid) or by root, and
  must not be writable by group or others (mode bits ``0o022``);
- no directory above the cache directory may be writable by group or others
  unless it has the sticky bit (``/tmp`` is ``1777``: others cannot rename or
  replace what they do not own there).

A violation raises :class:`~kernel_cache.errors.UntrustedCacheError` naming the
path, its mode or owner and the fix (``chmod go-w`` / ``chown``). A
deliberately shared group directory opts out with ``--insecure-allow-shared-dir``
or ``KERNEL_CACHE_INSECURE_ALLOW_SHARED_DIR=1`` (the checksum still catches
accidents, nothing catches a malicious group member).

Ownership of the directories *above* the cache is not checked (containers
often mount volumes owned by another uid); only their write bits are.

Symbolic links are never followed inside the cache, opt-out or not: a link
where the index (``cache.db``, ``-wal``, ``-shm``), ``locks/``,
``quarantine/`` or the usage record belongs is refused
(:func:`check_no_links`), and entry files and their folders are opened
component by component with ``O_NOFOLLOW`` (:mod:`kernel_cache.store.safe_disk`).
Writing through such a link (warmup often runs as root) would change files
elsewhere, and a trust check of the link would judge the wrong file. The
cache directory itself may be a link: that path is the user's choice, and the
checks apply to what it names.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from kernel_cache.config import settings
from kernel_cache.errors import UntrustedCacheError

log = logging.getLogger("kernel_cache")

ENV_ALLOW_SHARED = settings.var("insecure_allow_shared_dir")
FLAG_ALLOW_SHARED = "--insecure-allow-shared-dir"
_warned: set[str] = set()


def resolve_allow_shared(allow_shared: bool | None) -> bool:
    """An explicit argument wins; None reads the environment."""
    return settings.get("insecure_allow_shared_dir") if allow_shared is None else bool(allow_shared)


def _user(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def problem(st: os.stat_result) -> str | None:
    """Why a file or directory with this stat is untrusted, or None."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"it is owned by {_user(st.st_uid)}, not by {_user(me)} (this process) or root"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if mode & bit)
        return f"it is writable by {who} (mode {mode:04o})"
    return None


def _fix(path: Path, st: os.stat_result, recursive: bool) -> str:
    r = "-R " if recursive else ""
    if st.st_uid not in (os.geteuid(), 0):
        fix = f"chown {r}{os.geteuid()}:{os.getegid()} {path}"
    else:
        fix = f"chmod {r}go-w {path}"
    return (
        f"fix: {fix} (or, for a deliberately shared group directory, pass "
        f"{FLAG_ALLOW_SHARED} or set {ENV_ALLOW_SHARED}=1)"
    )


def _refuse(kind: str, path: Path, st: os.stat_result, why: str, recursive: bool):
    raise UntrustedCacheError(
        f"refusing {kind} {path}: {why}; the cache holds native code that engine start "
        f"executes, so only its owner may be able to change it; {_fix(path, st, recursive)}"
    )


def _opted_out(root: Path, allow_shared: bool) -> bool:
    if allow_shared and str(root) not in _warned:
        _warned.add(str(root))
        log.warning(
            "trust checks of cache %s are off (%s / %s=1): anyone who can write it can "
            "run code in this process",
            root,
            FLAG_ALLOW_SHARED,
            ENV_ALLOW_SHARED,
        )
    return allow_shared


#: The files and folders of a cache that must never be symbolic links, with
#: the kind named in the error and the fix (``{p}``: the path, ``{t}``: the
#: link's target).
CACHE_PATHS: dict[str, tuple[str, str]] = {
    "cache.db": (
        "cache index",
        "replace the link with the file it names (cp --remove-destination {t} {p}), or "
        "remove the link (rm {p}) and warm up again",
    ),
    "cache.db-wal": ("cache index log", "rm {p} (SQLite creates a real one)"),
    "cache.db-shm": ("cache index log", "rm {p} (SQLite creates a real one)"),
    "locks": ("lock folder", "rm {p} (the link only; warmup creates a real folder)"),
    "quarantine": ("quarantine folder", "rm {p} (the link only; warmup creates a real folder)"),
    "usage.json": ("usage record", "rm {p} (the link only; usage counts start again)"),
    "usage.json.lock": ("usage record lock", "rm {p} (the link only)"),
    "imports.json": ("import memo", "rm {p} (the link only; warmup writes a real one)"),
}


def link_target(path: str | os.PathLike) -> str:
    """What the symbolic link ``path`` points to (``?`` if it cannot be read)."""
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def refuse_link(kind: str, path: str | os.PathLike, fix: str) -> UntrustedCacheError:
    """The error for a symbolic link found where ``kind`` belongs (names the
    path, the target and ``fix``; ``{p}`` and ``{t}`` in ``fix`` are filled in),
    or for a file where a folder belongs (and the reverse)."""
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        is_link = True
    if not is_link:  # opened with O_NOFOLLOW | O_DIRECTORY and found a file
        what = "a folder" if "folder" in kind else "a regular file"
        return UntrustedCacheError(
            f"refusing {kind} {path}: it is not {what}; fix: rm {path} (warmup creates it again)"
        )
    target = link_target(path)
    absolute = os.path.normpath(os.path.join(os.path.dirname(path), target))
    return UntrustedCacheError(
        f"refusing {kind} {path}: it is a symbolic link (to {target}); kernel-cache never "
        f"follows a link inside the cache (writing through it would change files elsewhere, "
        f"and a trust check would judge the wrong file); fix: {fix.format(p=path, t=absolute)}"
    )


def check_no_links(root: str | os.PathLike) -> None:
    """Refuse a symbolic link where a file or folder of :data:`CACHE_PATHS` belongs.

    Applies with the shared-directory opt-out too. A missing path passes.

    Raises:
        UntrustedCacheError: names the path, the link's target and the fix.
    """
    root = Path(root)
    for name, (kind, fix) in CACHE_PATHS.items():
        p = root / name
        try:
            st = p.lstat()
        except (FileNotFoundError, NotADirectoryError):
            continue
        if stat.S_ISLNK(st.st_mode):
            raise refuse_link(kind, p, fix)


def check_cache_dir(root: str | os.PathLike, *, allow_shared: bool = False) -> None:
    """Check the cache directory, its SQLite index and the directories above it,
    and that no file or folder of the cache is a symbolic link (:func:`check_no_links`,
    also with ``allow_shared``).

    A directory that does not exist passes (nothing to load from it).

    Raises:
        UntrustedCacheError: names the path, why and the fix.
    """
    root = Path(root)
    if root.is_dir():
        check_no_links(root)
    if _opted_out(root, allow_shared):
        return
    try:
        st = root.stat()
    except FileNotFoundError:
        st = None
    if st is not None:
        _check_root(root, st)
        above = list(root.resolve().parents)
    else:  # warmup will create it: check the directories it will be created in
        above = [p.resolve() for p in root.parents if p.exists()][:1]
        above = [*above, *above[0].parents] if above else []
    _check_ancestors(root, above)


def _check_root(root: Path, st: os.stat_result) -> None:
    why = problem(st)
    if why:
        _refuse("cache directory", root, st, why, recursive=True)
    for name in ("cache.db", "cache.db-wal"):  # links: refused by check_no_links
        p = root / name
        try:
            fst = p.lstat()
        except FileNotFoundError:
            continue
        why = problem(fst) or (None if stat.S_ISREG(fst.st_mode) else "it is not a regular file")
        if why:
            _refuse("cache index", p, fst, why, recursive=False)


def _check_ancestors(root: Path, above: list[Path]) -> None:
    for parent in above:
        pst = parent.stat()
        mode = stat.S_IMODE(pst.st_mode)
        if mode & 0o022 and not mode & stat.S_ISVTX:
            raise UntrustedCacheError(
                f"refusing cache directory {root}: the directory above it, {parent}, is "
                f"writable by other users without the sticky bit (mode {mode:04o}), so they "
                f"could replace the cache; fix: chmod go-w {parent} (or chmod +t {parent}), "
                f"or move the cache (--cache-dir / KERNEL_CACHE_DIR); for a deliberately "
                f"shared group directory pass {FLAG_ALLOW_SHARED} or set {ENV_ALLOW_SHARED}=1"
            )


class EntryFileChecker:
    """Checks entry files and the directories between them and the cache root.

    Directory results are remembered for the life of the object (one load).
    """

    def __init__(self, root: str | os.PathLike, *, allow_shared: bool = False):
        self.root = Path(root)
        self.allow_shared = allow_shared
        self._dirs_ok: set[Path] = set()

    def check_open_file(self, fd: int, path: str | os.PathLike) -> None:
        """Check an entry file already opened as ``fd`` (``fstat``: no race with a swap).

        Raises:
            UntrustedCacheError: the file or a directory holding it is untrusted.
        """
        if self.allow_shared:
            return
        path = Path(path)
        st = os.fstat(fd)
        why = problem(st) or (None if stat.S_ISREG(st.st_mode) else "it is not a regular file")
        if why:
            _refuse("cache entry file", path, st, why, recursive=False)
        d = path.parent
        while d != self.root and self.root in d.parents and d not in self._dirs_ok:
            dst = d.lstat()
            why = problem(dst) or (None if stat.S_ISDIR(dst.st_mode) else "it is not a directory")
            if why:
                _refuse("cache directory", d, dst, why, recursive=True)
            self._dirs_ok.add(d)
            d = d.parent
