"""Opening, creating and removing files below the cache directory without
following a symbolic link.

Every component below the cache directory is opened relative to its parent's
descriptor with ``O_NOFOLLOW`` (``O_DIRECTORY`` for folders), so a link planted
there (to another user's folder or file) is never followed: it raises
:class:`LinkInCacheError`, and nothing is read, created or truncated through it.
The cache directory itself may be or pass through a link: the user chose that
path. The ``O_*`` flags are defined here once (0 where the platform lacks one).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
#: ``open(O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)``: a folder, never through a link.
DIR_FLAGS = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
_NOT_FOLLOWED = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)


class UnsafeValueError(ValueError):
    """An index row that kernel-cache refuses to decode (pickled, or a file name
    that points outside the cache)."""


class LinkInCacheError(UnsafeValueError):
    """A path below the cache directory is a symbolic link (or not the kind of
    file expected there); it was not followed. ``path`` is the offending path."""

    def __init__(self, path: str | os.PathLike, kind: str):
        self.path = str(path)
        self.kind = kind
        st = lstat_or_none(path)
        if st is not None and stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            why = f"is a symbolic link (to {target}); kernel-cache never follows links in the cache"
        else:
            why = "is not a directory" if kind.endswith("folder") else "is not a regular file"
        self.why = why
        super().__init__(f"{kind} {path} {why}")


def lstat_or_none(path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def open_dir_nofollow(
    root: str | os.PathLike, parts, *, create_mode: int | None = None, kind: str = "cache folder"
) -> int:
    """A descriptor of ``root/parts[0]/.../parts[-1]``, each component opened
    relative to its parent with ``O_NOFOLLOW | O_DIRECTORY``, so no symbolic
    link below ``root`` is followed (``root`` itself may be one: the user chose
    that path). With ``create_mode``, missing components are created with it
    (before the umask). The caller closes the descriptor.

    Raises:
        LinkInCacheError: a component is a symbolic link or not a directory.
        FileNotFoundError: ``root`` or a component is missing (without ``create_mode``).
    """
    fd = os.open(root, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    path = Path(root)
    try:
        for name in parts:
            path = path / name
            if create_mode is not None:
                try:
                    os.mkdir(name, create_mode, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in _NOT_FOLLOWED:
                    raise LinkInCacheError(path, kind) from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_entry_file(directory: str | os.PathLike, filename: str):
    """Open the value file ``filename`` (relative, from an index row) for reading,
    following no symbolic link below ``directory`` (``O_NOFOLLOW`` on every
    component; ``O_NONBLOCK`` so a FIFO cannot hang the reader). Returns a
    binary file object whose ``name`` is the full path.

    Raises:
        UnsafeValueError: ``filename`` is absolute or has a ``..`` component.
        LinkInCacheError: the file or a folder holding it is a symbolic link,
            or the file is not a regular file.
        FileNotFoundError: the file or a folder is gone.
    """
    path = safe_relpath(directory, filename)
    parts = Path(filename).parts
    dfd = open_dir_nofollow(directory, parts[:-1], kind="cache entry folder")
    try:
        fd = os.open(parts[-1], os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        if e.errno in _NOT_FOLLOWED:
            raise LinkInCacheError(path, "cache entry file") from None
        raise
    finally:
        os.close(dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a FIFO, a device
        os.close(fd)
        raise LinkInCacheError(path, "cache entry file")
    return open(path, "rb", opener=lambda _p, _f: fd)  # noqa: SIM115 - the caller closes it


def remove_entry_file(directory: str | os.PathLike, filename: str) -> None:
    """Remove the value file ``filename`` and its ``xx/yy`` folders if now empty,
    following no symbolic link below ``directory`` (a link where a folder
    belongs is left alone; a link where the file belongs is removed itself)."""
    parts = Path(filename).parts
    if not parts or os.path.isabs(filename) or ".." in parts:
        return
    fds = []
    try:
        fds.append(os.open(directory, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC))
        for name in parts[:-1]:
            fds.append(os.open(name, DIR_FLAGS, dir_fd=fds[-1]))
        os.unlink(parts[-1], dir_fd=fds[-1])
        for i in range(len(parts) - 1, 0, -1):  # prune empty xx/yy
            os.rmdir(parts[i - 1], dir_fd=fds[i - 1])
    except OSError:
        pass  # gone already, not empty, or a link: nothing more to remove
    finally:
        for fd in fds:
            os.close(fd)


def makedirs(path: Path, mode: int) -> None:
    """Create ``path`` and missing parents, each with ``mode`` (before the umask).

    For the cache directory itself (a user-chosen path, which may be or pass
    through a link); folders inside the cache use :func:`open_dir_nofollow`."""
    missing = []
    p = Path(path)
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            pass


def write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def safe_relpath(directory: str | os.PathLike, filename: str) -> str:
    """``directory/filename`` if ``filename`` is a plain relative path inside it.

    Raises:
        UnsafeValueError: absolute, or with a ``..`` component.
    """
    if not isinstance(filename, str) or os.path.isabs(filename) or ".." in Path(filename).parts:
        raise UnsafeValueError(f"index row names file {filename!r} outside the cache")
    return os.path.join(directory, filename)
