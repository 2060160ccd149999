"""Move a corrupt or untrusted cache entry out of the way, keeping it for a post-mortem.

``warmup`` calls :meth:`DiskTier.quarantine <kernel_cache.store.disk_tier.DiskTier.quarantine>`
(which uses :func:`quarantine_files`) while it holds the entry's key lock
(never on a guess made without the lock: another process may just have
published a good entry under that key). The entry leaves the index and its
files go to::

    <cache>/quarantine/<key>.<UTC time>.<pid>/
        reason.json     {"key", "variant", "reason", "quarantined_at", "pid", "host",
                         "source", "files"}
        artifact.pt2    the artifact bytes as stored (moved, not copied), if any
        meta.json       the stored metadata bytes, unparsed, if any

No symbolic link is followed: ``quarantine/`` and the new folder are opened
with ``O_NOFOLLOW | O_DIRECTORY`` and files are created in them ``O_EXCL |
O_NOFOLLOW``; ``quarantine/`` being a link is refused (naming it and the fix).
An entry file that is itself a link is moved as the link (its target is left
alone); where a folder holding it is a link, that link is moved instead
(``linked-folder``), so nothing outside the cache is moved or written.

Engine start and ``verify`` never write (the directory may be read-only):
they report the entry as corrupt and name the repair command, ``warmup``.
Nothing reads ``quarantine/`` back; delete it when done looking.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from kernel_cache.store.nofollow import (
    DIR_FLAGS,
    O_CLOEXEC,
    O_DIRECTORY,
    O_NOFOLLOW,
    LinkInCacheError,
    makedirs,
    open_dir_nofollow,
)

log = logging.getLogger("kernel_cache")

QUARANTINE_DIR = "quarantine"


def _write_new(dfd: int, name: str, data: bytes) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
    fd = os.open(name, flags, 0o644, dir_fd=dfd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _open_dirs(root: Path, parts) -> tuple[list[int], str | None]:
    """Descriptors of ``root`` and each folder of ``parts`` opened without
    following a link; stops at the first component that is a link and returns
    its name (the caller moves that link), else None."""
    fds = [os.open(root, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)]
    try:
        for name in parts:
            try:
                fds.append(os.open(name, DIR_FLAGS, dir_fd=fds[-1]))
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    return fds, name
                raise
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds, None


def _move_artifact(root: Path, filename: str, dfd: int) -> str | None:
    """Move the entry file ``filename`` (relative to ``root``) into the folder
    ``dfd`` as ``artifact.pt2``, or the link standing for a folder on its way as
    ``linked-folder``. Returns the name it got there, or None if it was gone."""
    parts = Path(filename).parts
    fds, link = _open_dirs(root, parts[:-1])
    try:
        src, dst = (parts[-1], "artifact.pt2") if link is None else (link, "linked-folder")
        try:
            os.replace(src, dst, src_dir_fd=fds[-1], dst_dir_fd=dfd)
        except FileNotFoundError:
            return None
        return dst
    finally:
        for fd in fds:
            os.close(fd)


def quarantine_entry(tier, key: str, reason: str, variant: str = "") -> Path | None:
    """Move ``key``'s bad entry out of ``tier``'s way (:meth:`Tier.quarantine
    <kernel_cache.store.disk_tier.Tier.quarantine>`): a disk tier keeps it under
    ``<cache>/quarantine/``. Returns that folder, or None where the tier keeps
    nothing."""
    where = tier.quarantine(key, reason, variant)
    return Path(where) if where else None


def _make_folder(root: Path, key: str, mode: int) -> tuple[int, str]:
    """Create ``quarantine/<key>.<UTC time>.<pid>[.n]`` under ``root`` without
    following a link; returns its descriptor and name.

    Raises:
        UntrustedCacheError: ``quarantine/`` is a symbolic link (or not a folder).
    """
    from kernel_cache.trust.permissions import CACHE_PATHS, refuse_link

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    makedirs(root, mode)
    try:
        qfd = open_dir_nofollow(root, [QUARANTINE_DIR], create_mode=mode, kind="quarantine folder")
    except LinkInCacheError:
        kind, fix = CACHE_PATHS[QUARANTINE_DIR]
        raise refuse_link(kind, root / QUARANTINE_DIR, fix) from None
    try:
        name = f"{key}.{stamp}.{os.getpid()}"
        for n in range(100):
            try:
                os.mkdir(name, mode, dir_fd=qfd)
                break
            except FileExistsError:
                if n == 99:
                    raise
                name = f"{key}.{stamp}.{os.getpid()}.{n + 1}"
        return os.open(name, DIR_FLAGS, dir_fd=qfd), name
    finally:
        os.close(qfd)


def quarantine_files(
    root: str | os.PathLike,
    key: str,
    reason: str,
    variant: str = "",
    *,
    files: Callable[[], tuple[bytes | None, str | None]],
    shared: bool = False,
) -> Path:
    """Move an entry's files into ``<root>/quarantine/<key>.<time>.<pid>/`` with a
    reason file (see the module docstring); the caller removes the entry from
    its index afterwards. Follows no symbolic link.

    Args:
        root: the cache directory.
        files: called once the quarantine folder exists: the stored metadata
            bytes, unparsed (written as ``meta.json``), or None, and the
            artifact's value file relative to ``root`` (moved), or None.
        shared: a deliberately shared cache (folders 0777 minus the umask, else 0755).

    Returns:
        The quarantine folder of this entry.

    Raises:
        UntrustedCacheError: ``quarantine/`` is a symbolic link (or not a folder).
    """
    root = Path(root)
    dfd, name = _make_folder(root, key, 0o777 if shared else 0o755)
    try:
        meta, artifact = files()
        kept = []
        if meta is not None:
            _write_new(dfd, "meta.json", meta)
            kept.append("meta.json")
        if artifact:
            moved = _move_artifact(root, artifact, dfd)
            if moved:
                kept.append(moved)
        record = {
            "key": key,
            "variant": variant,
            "reason": reason,
            "quarantined_at": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "source": str(root / artifact) if artifact else None,
            "files": kept,
        }
        _write_new(
            dfd, "reason.json", (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()
        )
    finally:
        os.close(dfd)
    return root / QUARANTINE_DIR / name


def list_quarantine(cache_dir: str | os.PathLike) -> list[dict]:
    """The reason records under ``<cache>/quarantine/``, oldest first."""
    root = Path(cache_dir) / QUARANTINE_DIR
    out = []
    for p in sorted(root.glob("*/reason.json")):
        try:
            out.append({**json.loads(p.read_text()), "path": str(p.parent)})
        except (OSError, ValueError):
            out.append({"path": str(p.parent), "reason": "(unreadable reason.json)"})
    return sorted(out, key=lambda r: r.get("quarantined_at", 0))
