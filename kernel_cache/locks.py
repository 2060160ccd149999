"""Single-flight per key across processes: one compile per key, however many workers.

:class:`KeyLock` is a :class:`filelock.FileLock` (``flock(2)`` on Linux) on
``<cache>/locks/<key>.lock``. The kernel drops an ``flock`` when its holder
exits, however it exits (``SIGKILL``, OOM kill), so a dead holder never blocks
a later start. (``flock`` is not reliable on every network file system; keep
the cache on a local disk.)

The holder writes ``<cache>/locks/<key>.owner`` (JSON: ``pid``, ``host``,
``since``, ``variant``) after it acquires the lock and removes it before it
releases, so a waiter that times out can say who holds the key. The lock file
itself is not used for this: a waiter opens it too.

Warmup's protocol per key: check the cache, take the lock, check again (a
waiter finds the entry another process just published and loads it instead of
compiling), compile, publish, release.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from .disk import makedirs
from .errors import ConfigError, LockTimeoutError

LOCKS_DIR = "locks"
ENV_LOCK_TIMEOUT = "KERNEL_CACHE_LOCK_TIMEOUT"
#: Seconds a warmup waits for another process compiling the same key. A CPU
#: compile of one variant takes about 8 s here (2-core CPU, tiny geometry); a
#: large GPU kernel can take minutes, hence 15 minutes.
DEFAULT_LOCK_TIMEOUT = 900.0


def lock_timeout_from_env() -> float:
    """``KERNEL_CACHE_LOCK_TIMEOUT`` in seconds (default 900).

    Raises:
        ConfigError: not a number >= 0.
    """
    raw = os.environ.get(ENV_LOCK_TIMEOUT)
    if raw is None or raw.strip() == "":
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"{ENV_LOCK_TIMEOUT}={raw!r}: expected seconds >= 0")
    return value


def pid_alive(pid: int) -> bool | None:
    """Whether process ``pid`` exists on this machine (None: cannot tell)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return None
    return True


class LockBusy(Exception):
    """A non-blocking :meth:`KeyLock.acquire` found the key locked."""


class KeyLock:
    """The compile lock of one key in one cache directory (a context manager).

    Args:
        cache_dir: the cache directory (``locks/`` is created in it).
        key: the entry key (sha256 hex).
        variant: for the owner record and error messages.
        shared: create ``locks/`` group-writable (a deliberately shared directory).
    """

    def __init__(self, cache_dir, key: str, *, variant: str = "", shared: bool = False):
        from filelock import FileLock

        self.dir = Path(cache_dir) / LOCKS_DIR
        self.key = key
        self.variant = variant
        self.path = self.dir / f"{key}.lock"
        self.owner_path = self.dir / f"{key}.owner"
        makedirs(self.dir, 0o777 if shared else 0o755)
        # A shared directory's lock files must be openable read-write by the group:
        # there the umask decides; otherwise 0644.
        self._lock = FileLock(str(self.path)) if shared else FileLock(str(self.path), mode=0o644)
        self.waited_s = 0.0

    def holder(self) -> dict | None:
        """The owner record of the current holder, with ``alive``, or None."""
        try:
            rec = json.loads(self.owner_path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(rec, dict):
            return None
        if rec.get("host") == socket.gethostname() and isinstance(rec.get("pid"), int):
            rec["alive"] = pid_alive(rec["pid"])
        return rec

    def acquire(self, timeout: float) -> None:
        """Take the lock, waiting up to ``timeout`` seconds (0: do not wait).

        Raises:
            LockBusy: ``timeout`` is 0 and another process holds the key.
            LockTimeoutError: waited ``timeout`` seconds; names the key, the lock
                file and the holder's pid if known.
        """
        from filelock import Timeout

        t0 = time.monotonic()
        try:
            self._lock.acquire(timeout=timeout, poll_interval=0.05)
        except Timeout:
            if timeout == 0:
                raise LockBusy(self.key) from None
            raise LockTimeoutError(self.timeout_message(timeout)) from None
        self.waited_s = time.monotonic() - t0
        rec = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "variant": self.variant,
        }
        tmp = self.owner_path.with_name(f"{self.owner_path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, self.owner_path)
        except OSError:  # the record is a courtesy; the flock is the lock
            tmp.unlink(missing_ok=True)

    def release(self) -> None:
        rec = self.holder()
        if rec is not None and rec.get("pid") == os.getpid():
            self.owner_path.unlink(missing_ok=True)
        self._lock.release()

    def timeout_message(self, timeout: float) -> str:
        """The error text for a wait of ``timeout`` seconds: key, lock file, holder."""
        rec = self.holder()
        if rec is None:
            who = "its holder is unknown (no owner record)"
        else:
            since = time.strftime("%H:%M:%S", time.localtime(rec.get("since", 0)))
            who = (
                f"held by pid {rec.get('pid')} on host {rec.get('host')} since {since}"
                f" (variant {rec.get('variant') or '?'})"
            )
            if rec.get("alive") is False:
                who += (
                    "; that pid is not running, yet the lock is held: the file system may "
                    "not support flock (keep the cache on a local disk)"
                )
            elif rec.get("alive"):
                who += ", still running: another warmup is compiling this key"
        return (
            f"waited {timeout:g} s for the compile lock of key {self.key[:16]}"
            f"{f' (variant {self.variant})' if self.variant else ''}: lock file {self.path} "
            f"is {who}; let it finish, stop it, or raise --lock-timeout / "
            f"{ENV_LOCK_TIMEOUT} (seconds)"
        )

    def __enter__(self):
        self.acquire(lock_timeout_from_env())
        return self

    def __exit__(self, *exc):
        self.release()
