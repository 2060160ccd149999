"""Move a corrupt or untrusted cache entry out of the way, keeping it for a post-mortem.

``warmup`` calls :func:`quarantine_entry` while it holds the entry's key lock
(never on a guess made without the lock: another process may just have
published a good entry under that key). The entry leaves the index and its
files go to::

    <cache>/quarantine/<key>.<UTC time>.<pid>/
        reason.json     {"key", "variant", "reason", "quarantined_at", "pid", "host",
                         "source", "files"}
        artifact.pt2    the artifact bytes as stored (moved, not copied), if any
        meta.json       the stored metadata bytes, unparsed, if any

Engine start and ``verify`` never write (the directory may be read-only):
they report the entry as corrupt and name the repair command, ``warmup``.
Nothing reads ``quarantine/`` back; delete it when done looking.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from .disk import makedirs

log = logging.getLogger("kernel_cache")

QUARANTINE_DIR = "quarantine"


def quarantine_entry(tier, key: str, reason: str, variant: str = "") -> Path:
    """Move ``key``'s entry from ``tier`` (a writable :class:`~kernel_cache.store.DiskTier`)
    into ``<cache>/quarantine/`` with a reason file, and log it once.

    Returns:
        The quarantine folder of this entry.

    Raises:
        CacheWriteError, CacheBusyError: from the tier (the entry then stays
            where it was; the next warmup tries again).
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = tier.directory / QUARANTINE_DIR / f"{key}.{stamp}.{os.getpid()}"
    makedirs(dest, 0o777 if tier.allow_shared else 0o755)
    files = []
    meta = tier.raw_meta(key)
    if meta is not None:
        (dest / "meta.json").write_bytes(meta)
        files.append("meta.json")
    src = tier.artifact_path(key)
    if src is not None:
        try:
            os.replace(src, dest / "artifact.pt2")
            files.append("artifact.pt2")
        except FileNotFoundError:
            pass
    record = {
        "key": key,
        "variant": variant,
        "reason": reason,
        "quarantined_at": time.time(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "source": str(src) if src else None,
        "files": files,
    }
    (dest / "reason.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    tier.delete(key)
    log.warning("quarantined cache entry %s (%s): %s -> %s", key[:16], variant, reason, dest)
    return dest


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
