"""The filesystem a path is on, from the mount table, and the refusal of a local
cache directory on a network or FUSE filesystem (docs/shared-storage.md).

The local tier is a SQLite index and files written by diskcache: SQLite's
locking and the ordering of writes between processes on different hosts do
not hold on NFS, SMB, CephFS, Lustre or a FUSE mount shared by several nodes.
Two warmups of one plan through two mounts of one shared directory destroyed
the index ("file is not a database") and compiled variants twice. A fleet
shares a directory through the object-store tier instead
(``KERNEL_CACHE_REMOTE_URL=file:///DIRECTORY``), whose objects are immutable
and written create-once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kernel_cache.errors import NetworkFilesystemError

MOUNTINFO = "/proc/self/mountinfo"

#: filesystem types (the mount table's type field) refused for the local cache;
#: any ``fuse.*`` type is refused too (sshfs, s3fs, gcsfuse, seaweedfs, ...)
NETWORK_TYPES = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb", "smb3", "smbfs", "ceph", "lustre", "glusterfs",
        "9p", "afs", "gpfs", "beegfs", "ocfs2", "gfs2", "davfs", "efs", "fuse", "fuseblk",
        "orangefs", "pvfs2", "ncpfs", "coda", "cvfs", "panfs", "wekafs", "quobyte",
    }
)  # fmt: skip

_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """A mount table path: ``\\040`` is a blank, ``\\011`` a tab, and so on."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def mounts(table: str | None = None) -> list[tuple[str, str]]:
    """``(mount point, filesystem type)`` of every line of ``/proc/self/mountinfo``
    (or of ``table``, its text); [] where there is no such file."""
    if table is None:
        try:
            table = Path(MOUNTINFO).read_text()
        except OSError:
            return []
    out = []
    for line in table.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            out.append((_unescape(fields[4]), fields[sep + 1]))
        except (ValueError, IndexError):
            continue
    return out


def filesystem_type(path: str | os.PathLike, table: str | None = None) -> tuple[str, str] | None:
    """``(filesystem type, mount point)`` of ``path``: the mount whose mount
    point is the longest prefix of the path resolved (the links of the part
    that exists followed; a directory not made yet is judged where it will be
    made). None where the mount table cannot be read."""
    resolved = os.path.realpath(os.path.abspath(path))  # links of the part that exists
    best: tuple[str, str] | None = None
    for point, fstype in mounts(table):
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[1])):
            best = (fstype, point)  # a later mount over the same point hides an earlier one
    return best


def is_network(fstype: str) -> bool:
    """Whether a filesystem type is a network or FUSE filesystem."""
    t = fstype.lower()
    return t in NETWORK_TYPES or t.startswith("fuse.")


def check_local(directory: str | os.PathLike, table: str | None = None) -> None:
    """Refuse a local cache directory on a network or FUSE filesystem, before
    anything is written there.

    Raises:
        NetworkFilesystemError: names the directory, the filesystem type, its
            mount point and the ``file://`` remote URL to share it instead.
    """
    found = filesystem_type(directory, table)
    if found is None or not is_network(found[0]):
        return
    fstype, point = found
    raise NetworkFilesystemError(
        f"the cache directory {directory} is on a {fstype} filesystem (mounted at {point}): "
        "the local cache's SQLite index and files are not safe on a network or FUSE "
        "filesystem (shared by several hosts, the index is destroyed and entries are lost); "
        "fix: set KERNEL_CACHE_DIR (--cache-dir) to a local disk, and share this directory "
        f"through the object-store tier instead: KERNEL_CACHE_REMOTE_URL=file://{directory} "
        "(--remote-url); see docs/shared-storage.md"
    )
