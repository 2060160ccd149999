"""Best-effort usage records of a local cache: last use per entry, hits and misses.

Kept in ``<cache>/usage.json`` (JSON)::

    {"since": <unix seconds of the first record>, "hits": <int>, "misses": <int>,
     "last_used": {<key>: <unix seconds>}}

Engine start records a hit for each variant it loaded from this cache and a
miss for each variant of the plan found in no tier; warmup records a hit for
each variant already cached and a miss for each it compiled. ``kernel-cache
ls`` shows "last used", ``stats`` the counters, ``gc`` evicts the least
recently used entries (an entry never used counts from its creation).

Recording never fails and never writes where it may not (nor through a
symbolic link at ``usage.json`` or its lock file): a cache directory
that does not exist or is not writable (a read-only image layer or mount,
``os.access(dir, W_OK)`` false) is left untouched, and an error while writing
(a full disk, a lock held longer than :data:`LOCK_TIMEOUT`) is logged at debug
level and dropped. The file is replaced atomically (``os.replace``) under a
``filelock`` so concurrent engines do not lose each other's updates.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernel_cache.errors import describe_errors

log = logging.getLogger("kernel_cache.store.usage")

USAGE_FILE = "usage.json"
LOCK_FILE = "usage.json.lock"
#: Seconds a recorder waits for another process's update before dropping its own.
LOCK_TIMEOUT = 2.0


class UsageRecord(BaseModel):
    """The usage record of a local cache (``usage.json``, see the module docstring):
    ``since`` (unix seconds of the first record, None before), ``hits`` and
    ``misses`` (counts), ``last_used`` (``{key: unix seconds}``)."""

    model_config = ConfigDict(frozen=True, extra="ignore", defer_build=True)

    since: int | float | None = None
    hits: int = Field(default=0, ge=0)
    misses: int = Field(default=0, ge=0)
    last_used: dict[str, int | float] = Field(default_factory=dict)

    def updated(self, hits: list[str], misses: int, forget: list[str], now: float):
        """A new record with ``hits`` used at ``now``, ``misses`` added, ``forget`` dropped."""
        last = {**self.last_used, **dict.fromkeys(hits, now)}
        for k in forget:
            last.pop(k, None)
        return UsageRecord(
            since=now if self.since is None else self.since,
            hits=self.hits + len(hits),
            misses=self.misses + int(misses),
            last_used=last,
        )


def read_usage(directory: str | os.PathLike) -> UsageRecord:
    """The usage record of a cache directory: zeros if there is none or it cannot
    be read (best effort; a malformed one is logged as a warning, naming the
    file and the field, and counts as none: ``gc`` then sees no entry as used)."""
    path = Path(directory) / USAGE_FILE
    try:
        raw = path.read_bytes()
    except OSError:
        return UsageRecord()
    try:
        return UsageRecord.model_validate_json(raw)
    except ValidationError as e:
        log.warning(
            "usage record %s is malformed and ignored (%s); gc treats every entry as "
            "unused until it is written again",
            path,
            describe_errors(e),
        )
        return UsageRecord()


def writable(directory: str | os.PathLike) -> bool:
    """True if ``directory`` exists, this process may write in it, and it has a
    write bit at all: a directory made read-only with ``chmod a-w`` is left
    alone even by root, whom the permission bits do not stop."""
    d = Path(directory)
    try:
        if not d.stat().st_mode & 0o222:
            return False
    except OSError:
        return False
    return d.is_dir() and os.access(d, os.W_OK | os.X_OK)


def record(
    directory: str | os.PathLike,
    *,
    hits: Iterable[str] = (),
    misses: int = 0,
    forget: Iterable[str] = (),
    now: float | None = None,
) -> bool:
    """Add ``hits`` (keys used now), ``misses`` (a count) and drop ``forget``
    (keys removed by gc). Returns True if the record was written, False if it
    was skipped (read-only or missing directory, lock timeout, I/O error)."""
    hits, forget = list(hits), list(forget)
    if not (hits or misses or forget) or not writable(directory):
        return False
    from filelock import FileLock, Timeout

    d = Path(directory)
    if any(os.path.islink(d / n) for n in (LOCK_FILE, USAGE_FILE)):
        log.debug("usage record in %s skipped: a symbolic link is never written through", d)
        return False
    now = time.time() if now is None else now
    try:
        with FileLock(str(d / LOCK_FILE), timeout=LOCK_TIMEOUT):
            doc = read_usage(d).updated(hits, misses, forget, now)
            fd, tmp = tempfile.mkstemp(prefix=".usage-", suffix=".tmp", dir=d)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc.model_dump(mode="json"), f, sort_keys=True)
                os.replace(tmp, d / USAGE_FILE)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return True
    except (OSError, Timeout, ValueError, TypeError) as e:
        log.debug("usage record in %s skipped: %s", d, e)
        return False


def reset(directory: str | os.PathLike) -> None:
    """Remove the usage record (``kernel-cache clear``); best effort. The lock
    file stays: removing a lock another process may hold would break it."""
    try:
        (Path(directory) / USAGE_FILE).unlink(missing_ok=True)
    except OSError as e:
        log.debug("cannot remove %s: %s", USAGE_FILE, e)
