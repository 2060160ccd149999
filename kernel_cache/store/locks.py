"""Single-flight per key across processes: one compile per key, however many workers.

:class:`KeyLock` is a :class:`filelock.FileLock` (an ``flock(2)``) on
``<cache>/locks/<key>.lock``. The kernel drops an ``flock`` when its holder
exits, however it exits (``SIGKILL``, OOM kill), so a dead holder never blocks
a later start. (``flock`` is not reliable on every network file system; keep
the cache on a local disk.)

No symbolic link is followed: ``locks/`` is opened with ``O_NOFOLLOW |
O_DIRECTORY`` (:func:`~kernel_cache.store.nofollow.open_dir_nofollow`) before
the lock is taken, and filelock opens the lock file with ``O_NOFOLLOW``, so a
link there (to another user's folder or file) is refused with
:class:`~kernel_cache.errors.UntrustedCacheError` naming it and the fix, and
nothing is created or truncated through it.

The holder writes ``<cache>/locks/<key>.owner`` (JSON: ``pid``, ``host``,
``since``, ``variant``) after it acquires the lock and removes it before it
releases, so a waiter that times out can say who holds the key. The lock file
itself is not used for this: a waiter opens it too.

Warmup's protocol per key: check the cache, take the lock, check again (a
waiter finds the entry another process just published and loads it instead of
compiling), compile, publish, release.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kernel_cache.config import settings
from kernel_cache.errors import LockTimeoutError
from kernel_cache.store.nofollow import (
    O_CLOEXEC,
    O_NOFOLLOW,
    LinkInCacheError,
    makedirs,
    open_dir_nofollow,
)

if TYPE_CHECKING:
    import filelock

LOCKS_DIR = "locks"


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


#: The file in each :func:`private_temp_dir` its process holds an ``flock`` on
#: until it exits: the owner's liveness across PID namespaces (containers
#: sharing one ``$TMPDIR`` see each other's pids as dead or as someone else).
#: A plain ``fcntl.flock``, not filelock: engine start makes its load directory
#: here, and importing filelock costs it 10-25 ms (``python -X importtime`` after
#: ``import torch``, on the 2-core machine at load 0.5-2.3).
OWNER_LOCK = ".owner.lock"
#: The descriptors holding this process's owner locks, by directory.
_held: dict[str, int] = {}


def _owner_gone(path: str, pid: int) -> bool:
    """Whether the process that made directory ``path`` (named with ``pid``) is
    gone: its :data:`OWNER_LOCK` is free (the kernel drops an ``flock`` when its
    holder exits, however it exits); without one (a directory not made by
    :func:`private_temp_dir`), :func:`pid_alive` says so."""
    import fcntl

    try:
        fd = os.open(os.path.join(path, OWNER_LOCK), os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return pid_alive(pid) is False
    except OSError:  # a link, or another user's directory: not ours to judge
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its process lives
        return False
    finally:
        os.close(fd)
    return True


def remove_dead_process_dirs(base: str | os.PathLike, pattern: str) -> None:
    """Remove the directories in ``base`` left by processes that died without
    cleaning up (SIGKILL): those whose name fully matches the regular
    expression ``pattern``, whose group 1 is the pid of the process that made
    it, and whose process is gone (:func:`_owner_gone`; cannot tell: kept).
    Never this process's, never a symbolic link; one that cannot be removed
    stays."""
    import re
    import shutil

    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(pattern, name)
        path = os.path.join(base, name)
        if m and int(m.group(1)) != os.getpid() and not os.path.islink(path):
            if _owner_gone(path, int(m.group(1))):
                shutil.rmtree(path, ignore_errors=True)


def private_temp_dir(prefix: str) -> str:
    """A new directory ``<temp dir>/<prefix><pid>-<random>`` for this process,
    whose :data:`OWNER_LOCK` it holds until it exits (or
    :func:`remove_private_temp_dir`).

    Directories of the same prefix left by processes that died are removed
    first (:func:`remove_dead_process_dirs`).
    """
    import fcntl
    import re
    import tempfile

    base = tempfile.gettempdir()
    remove_dead_process_dirs(base, re.escape(prefix) + r"(\d+)-\w+")
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
    fd = os.open(os.path.join(path, OWNER_LOCK), flags, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: free
    _held[path] = fd
    return path


def remove_private_temp_dir(path: str) -> None:
    """Remove a directory of :func:`private_temp_dir` and release its owner lock."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


class LockBusy(Exception):
    """A non-blocking :meth:`KeyLock.acquire` found the key locked."""


def _refuse_link(path) -> Exception:
    from kernel_cache.trust.permissions import refuse_link

    return refuse_link("lock path", path, "rm {p} (the link only; warmup creates a real one)")


class KeyLock:
    """The compile lock of one key in one cache directory (a context manager).

    Args:
        cache_dir: the cache directory (``locks/`` is created in it on acquire).
        key: the entry key (sha256 hex).
        variant: for the owner record and error messages.
        shared: create ``locks/`` and lock files group-writable (the umask
            decides; a deliberately shared directory), else ``0755``/``0644``.
    """

    def __init__(self, cache_dir, key: str, *, variant: str = "", shared: bool = False):
        self.root = Path(cache_dir)
        self.dir = self.root / LOCKS_DIR
        self.key = key
        self.variant = variant
        self.shared = shared
        self.path = self.dir / f"{key}.lock"
        self.owner_path = self.dir / f"{key}.owner"
        self._lock: filelock.FileLock | None = None
        self.waited_s = 0.0

    def _open_dir(self) -> int:
        """A descriptor of ``locks/`` (created if missing), never through a link.

        Raises:
            UntrustedCacheError: ``locks/`` is a symbolic link or not a folder.
        """
        mode = 0o777 if self.shared else 0o755
        makedirs(self.root, mode)
        try:
            return open_dir_nofollow(self.root, [LOCKS_DIR], create_mode=mode, kind="lock folder")
        except LinkInCacheError:
            from kernel_cache.trust.permissions import CACHE_PATHS, refuse_link

            kind, fix = CACHE_PATHS[LOCKS_DIR]
            raise refuse_link(kind, self.dir, fix) from None

    def holder(self) -> dict | None:
        """The owner record of the current holder, with ``alive``, or None
        (also when the record is a link: never followed)."""
        try:
            dfd = self._open_dir()
        except Exception:
            return None
        try:
            fd = os.open(self.owner_path.name, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC, dir_fd=dfd)
            with os.fdopen(fd, "rb") as f:
                rec = json.loads(f.read(65536))
        except (OSError, ValueError):
            return None
        finally:
            os.close(dfd)
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
            UntrustedCacheError: ``locks/`` or the lock file is a symbolic link.
        """
        import filelock  # here: engine start imports this module, never a KeyLock

        t0 = time.monotonic()
        dfd = self._open_dir()  # refuses a linked locks/ before filelock opens a file in it
        try:
            # the shared mode is 0666 minus the umask: filelock's default when unset
            mode = {} if self.shared else {"mode": 0o644}
            lock = filelock.FileLock(self.path, thread_local=False, **mode)
            try:
                lock.acquire(timeout=timeout, blocking=timeout != 0)
            except filelock.Timeout:
                if timeout == 0:
                    raise LockBusy(self.key) from None
                raise LockTimeoutError(self.timeout_message(timeout)) from None
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.EMLINK):
                    raise _refuse_link(self.path) from None
                raise
            self._lock = lock
            self.waited_s = time.monotonic() - t0
            self._write_owner(dfd)
        finally:
            os.close(dfd)

    def _write_owner(self, dfd: int) -> None:
        rec = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "variant": self.variant,
        }
        tmp = f"{self.owner_path.name}.{os.getpid()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_NOFOLLOW | O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o644, dir_fd=dfd)
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(rec).encode())
            os.replace(tmp, self.owner_path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:  # the record is a courtesy; the flock is the lock
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass

    def release(self) -> None:
        """Drop the lock (and the owner record if it is this process's); a no-op
        if it is not held."""
        if self._lock is None:
            return
        rec = self.holder()
        if rec is not None and rec.get("pid") == os.getpid():
            try:
                dfd = self._open_dir()
                try:
                    os.unlink(self.owner_path.name, dir_fd=dfd)
                finally:
                    os.close(dfd)
            except Exception:  # noqa: BLE001 - the lock below is what matters
                pass
        lock, self._lock = self._lock, None
        lock.release(force=True)

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
            f"{settings.var('lock_timeout')} (seconds)"
        )

    def __enter__(self):
        self.acquire(settings.get("lock_timeout"))
        return self

    def __exit__(self, *exc):
        self.release()
