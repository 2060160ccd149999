"""The disk tier's storage engine: diskcache, hardened for many processes, crashes,
full disks and read-only directories.

Layout (diskcache's own, unchanged): ``<dir>/cache.db`` is diskcache's SQLite
index (table ``Cache``: ``key, raw, mode, filename, value``, documented in
diskcache's ``core.py``); values of 32 KiB and more live in ``<dir>/xx/yy/*.val``
files named by the row's ``filename``.

Writers (warmup) open a :class:`diskcache.Cache` through :func:`open_cache`:

- "database is locked": every index operation is retried with exponential
  backoff and jitter for at most ``KERNEL_CACHE_DB_TIMEOUT`` seconds (default
  60), then :class:`~kernel_cache.errors.CacheBusyError` names the index.
  diskcache's own constructor retries each statement for 60 s (its issue #85),
  so a probe takes the write lock once, within our bound, before it runs.
- Symbolic links are never followed below the cache directory: value files and
  their ``xx/yy`` folders are opened, created and removed one component at a
  time relative to the parent's descriptor, with ``O_NOFOLLOW``
  (:func:`open_dir_nofollow`, :func:`open_entry_file`). A link there raises
  :class:`LinkInCacheError`: a read makes the entry corrupt (warmup quarantines
  and rebuilds it), a write is refused.
- :class:`SafeDisk` writes a value file with ``O_EXCL``, mode ``0644``, fsyncs
  it before the row that names it can commit, removes it if the write fails,
  and remembers it so a rolled back publish removes it too. It never pickles
  or unpickles (a pickled row is refused as corrupt: the cache is data, not code).

Readers (engine start, verify) use :class:`IndexSnapshot`: the rows are read
once through SQLite's read-only URI (``immutable=1`` when no write-ahead log is
pending), which creates no lock, journal or temporary file, so a read-only
directory (a container layer, a ``ro`` bind mount) loads and stays unchanged.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sqlite3
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import diskcache
from diskcache.core import MODE_BINARY, MODE_PICKLE, MODE_RAW, MODE_TEXT, UNKNOWN

from kernel_cache.config import settings
from kernel_cache.errors import CacheBusyError, CacheWriteError, DamagedIndexError
from kernel_cache.store.nofollow import (
    O_CLOEXEC,
    O_NOFOLLOW,
    LinkInCacheError,
    UnsafeValueError,
    lstat_or_none,
    makedirs,
    open_dir_nofollow,
    open_entry_file,
    remove_entry_file,
    write_all,
)
from kernel_cache.store.retry import retry

log = logging.getLogger("kernel_cache")

DBNAME = "cache.db"

T = TypeVar("T")


class _Unreadable(Exception):
    """No way of opening the index worked this time (:meth:`IndexSnapshot._read`)."""


# -- errors ---------------------------------------------------------------------


def _is_busy(exc: BaseException) -> bool:
    if isinstance(exc, diskcache.Timeout):
        return True
    if isinstance(exc, sqlite3.OperationalError):
        msg = str(exc).lower()
        return "locked" in msg or "busy" in msg
    return False


def _is_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, sqlite3.OperationalError) and "disk is full" in str(exc).lower()


def _is_unwritable(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return True
    msg = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and (
        "readonly database" in msg or "unable to open database" in msg
    )


def _mib(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


def as_write_error(
    exc: BaseException, directory: Path, needed: int | None, what: str
) -> CacheWriteError | None:
    """A :class:`CacheWriteError` for a full or unwritable cache, else None."""
    need = f"; it needed {_mib(needed)}" if needed else ""
    if _is_full(exc):
        try:
            free = f", {_mib(shutil.disk_usage(directory).free)} free"
        except OSError:
            free = ""
        return CacheWriteError(
            f"no space left in cache directory {directory} while {what}{need}{free} "
            f"({exc}); nothing was half-written and the entries already cached still load; "
            f"fix: free space there, or point --cache-dir / KERNEL_CACHE_DIR at a larger disk"
        )
    if _is_unwritable(exc):
        return CacheWriteError(
            f"cache directory {directory} is not writable while {what}{need} ({exc}); "
            f"fix: make it writable by this user (chown/chmod), or point --cache-dir / "
            f"KERNEL_CACHE_DIR at a writable directory"
        )
    return None


_DAMAGED = ("file is not a database", "database disk image is malformed")


def damaged_index(e: BaseException, directory: Path) -> DamagedIndexError | None:
    """A :class:`DamagedIndexError` naming the index and the fix when SQLite's
    error ``e`` says the file is not a database or is malformed, else None."""
    if not isinstance(e, sqlite3.DatabaseError) or not any(m in str(e) for m in _DAMAGED):
        return None
    db = Path(directory) / DBNAME
    return DamagedIndexError(
        f"the cache index {db} is damaged ({e}); nothing in {directory} can be looked up "
        f"through it. Fix: move it away (mv {db} {db}.damaged), then run kernel-cache "
        "warmup, which rebuilds the index and the entries (kernel-cache gc removes the "
        "artifact files the old index referenced)"
    )


def retry_busy(fn: Callable[[], T], *, directory: Path, timeout: float, what: str) -> T:
    """Call ``fn``; while SQLite says the index is locked, back off and retry
    (:func:`~kernel_cache.store.retry.retry`: 10 ms doubling to 0.5 s, +-50 %
    jitter so that processes started together do not retry in lockstep).

    Raises:
        CacheBusyError: still locked after ``timeout`` seconds.
        DamagedIndexError: the index is not a database or is malformed.
    """
    try:
        return retry(fn, when=_is_busy, timeout=timeout, jitter=0.5)
    except (sqlite3.DatabaseError, diskcache.Timeout) as e:
        damaged = damaged_index(e, directory)
        if damaged is not None:
            raise damaged from None
        if not _is_busy(e):
            raise
        db = Path(directory) / DBNAME
        raise CacheBusyError(
            f"the cache index {db} stayed locked by other processes ('database is "
            f"locked') for {timeout:g} s while {what}; a process may be stuck inside "
            f"a write to {directory} (find it with: fuser -v {db}); retry, stop it, "
            f"or raise {settings.var('db_timeout')} (seconds)"
        ) from None


# -- writer -----------------------------------------------------------------------


class SafeDisk(diskcache.Disk):
    """diskcache's :class:`~diskcache.Disk` for kernel-cache's bytes-only values.

    Keys are ``str`` (stored raw), values ``bytes``. Never pickles, never
    unpickles. Value files are created ``O_EXCL`` with mode ``0644`` (group and
    others can never write them, whatever the umask), fsynced, and removed when
    the write fails. Value files and their folders are created, read and
    removed without following a symbolic link (:func:`open_dir_nofollow`): a
    read through one raises :class:`LinkInCacheError`, a write
    :class:`~kernel_cache.errors.UntrustedCacheError`. :attr:`new_files` lists
    the files (relative names) written since the owner last cleared it, so a
    publish whose transaction rolls back removes them.
    """

    #: Mode for the ``xx/yy`` directories (0755, or 0777 minus the umask for a
    #: deliberately shared group directory); set by :func:`open_cache`.
    dir_mode = 0o755

    def __init__(self, directory, **kwargs):
        super().__init__(directory, **kwargs)
        self.new_files: list[str] = []

    def get(self, key, raw):
        if not raw:
            raise UnsafeValueError("index row has a pickled key (refused: never unpickled)")
        return super().get(key, raw)

    def store(self, value, read, key=UNKNOWN):
        if type(value) is not bytes:
            raise TypeError(f"kernel-cache stores bytes, not {type(value).__name__}")
        if len(value) < self.min_file_size:
            return 0, MODE_RAW, None, sqlite3.Binary(value)
        filename, _ = self.filename(key, value)
        self._write_value(filename, value)
        self.new_files.append(filename)
        return len(value), MODE_BINARY, filename, None

    def _write_value(self, filename: str, data: bytes) -> None:
        from kernel_cache.trust.permissions import refuse_link

        parts = Path(filename).parts
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC

        def create() -> int:
            dfd = open_dir_nofollow(self._directory, parts[:-1], create_mode=self.dir_mode)
            try:
                return os.open(parts[-1], flags, 0o644, dir_fd=dfd)
            finally:
                os.close(dfd)

        try:  # FileNotFoundError: another process's remove() pruned the empty xx/yy
            fd = retry(create, when=lambda e: type(e) is FileNotFoundError, attempts=10, delay=0)
        except LinkInCacheError as e:
            raise refuse_link("cache entry folder", e.path, "rm {p} (the link only)") from None
        try:
            try:
                write_all(fd, memoryview(data))
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            remove_entry_file(self._directory, filename)
            raise

    def discard_new_files(self, start: int = 0) -> None:
        """Remove the files written since index ``start`` of :attr:`new_files`."""
        for filename in self.new_files[start:]:
            remove_entry_file(self._directory, filename)
        del self.new_files[start:]

    def fetch(self, mode, filename, value, read):
        """A row's value: bytes, or with ``read`` an open file for a value file.

        Raises:
            UnsafeValueError: a pickled value or an unsafe file name.
            LinkInCacheError: the value file or a folder holding it is a link.
            OSError: the file cannot be read (diskcache treats it as a miss).
        """
        if mode == MODE_PICKLE:
            raise UnsafeValueError("index row holds a pickled value (refused: never unpickled)")
        if mode in (MODE_BINARY, MODE_TEXT) and filename is not None:
            f = open_entry_file(self._directory, filename)
            if read:
                return f
            with f:
                return f.read()
        return super().fetch(mode, filename, value, read)

    def remove(self, file_path):
        remove_entry_file(self._directory, file_path)


def open_cache(directory: Path, *, timeout: float, shared: bool = False) -> diskcache.Cache:
    """Open (creating if needed) the writable :class:`diskcache.Cache` in ``directory``.

    Eviction is off (``eviction_policy="none"``): nothing disappears behind the
    user's back. Directories are created ``0755`` (``0777`` minus the umask when
    ``shared``).

    Raises:
        CacheBusyError: the index stayed locked for ``timeout`` seconds.
        OSError, sqlite3.OperationalError: the directory cannot be written
            (the caller maps them with :func:`as_write_error`).
    """
    directory = Path(directory)
    dir_mode = 0o777 if shared else 0o755
    makedirs(directory, dir_mode)
    db = directory / DBNAME
    conn_timeout = min(1.0, timeout)
    deadline = time.monotonic() + timeout

    def probe() -> None:
        con = sqlite3.connect(str(db), timeout=conn_timeout, isolation_level=None)
        try:
            con.execute("BEGIN IMMEDIATE")
            con.execute("ROLLBACK")
        finally:
            con.close()

    def make() -> diskcache.Cache:
        probe()
        return diskcache.Cache(
            str(directory),
            disk=SafeDisk,
            eviction_policy="none",
            size_limit=2**62,
            timeout=conn_timeout,
        )

    cache = retry_busy(make, directory=directory, timeout=timeout, what="opening the cache")
    cache.disk.dir_mode = dir_mode
    left = max(0.0, deadline - time.monotonic())
    log.debug("opened %s (%.3f s of the %g s lock budget left)", directory, left, timeout)
    return cache


# -- reader -----------------------------------------------------------------------


class IndexSnapshot:
    """The index rows of a cache directory, read once without writing anything.

    SQLite is opened through a read-only URI. With no write-ahead log pending
    (the state every cleanly closed writer leaves, and the only state of a
    prewarmed image) it is opened ``immutable=1``: no lock, no ``-shm``, no
    ``-wal``, no journal. When a non-empty ``cache.db-wal`` exists (a writer is
    running, or one was killed), ``mode=ro`` reads it through the existing
    ``-shm`` so that just-published entries are seen; where that cannot open (a
    read-only copy of a killed writer's directory) the main file is read
    ``immutable`` and the log's entries are missing (a warning says so).

    ``rows``: ``{key: (mode, filename, value)}`` for rows with raw ``str`` keys;
    ``filenames``: the value file names of every row (raw key or not), the
    files the index references.
    """

    def __init__(self, directory: Path, *, timeout: float | None = None):
        self.directory = Path(directory)
        self.timeout = settings.get("db_timeout") if timeout is None else timeout
        self.rows: dict[str, tuple] = {}
        self.filenames: set[str] = set()
        self.reload()

    def reload(self) -> None:
        db = self.directory / DBNAME
        st = lstat_or_none(db)
        if st is None or not stat.S_ISREG(st.st_mode):  # a link: refused by the trust check
            self.rows, self.filenames = {}, set()
            return
        rows = retry_busy(
            lambda: self._read(db),
            directory=self.directory,
            timeout=self.timeout,
            what="reading the cache index",
        )
        self.rows = {
            k: (mode, filename, value)
            for k, raw, mode, filename, value in rows
            if raw and isinstance(k, str)
        }
        self.filenames = {r[3] for r in rows if isinstance(r[3], str)}

    def _read(self, db: Path) -> list[tuple]:
        wal = db.with_name(DBNAME + "-wal")
        try:
            wal_pending = wal.stat().st_size > 0
        except FileNotFoundError:
            wal_pending = False
        uri = (db.parent.resolve() / DBNAME).as_uri()  # never resolves a link at cache.db
        attempts = (["?mode=ro"] if wal_pending else []) + ["?mode=ro&immutable=1"]
        errors: list[Exception] = []

        def read_once() -> list[tuple]:
            for q in attempts:
                try:
                    con = sqlite3.connect(uri + q, uri=True, timeout=1.0)
                    try:
                        return self._select(con, db, q, wal_pending, errors)
                    finally:
                        con.close()
                except sqlite3.OperationalError as e:
                    if "no such table" in str(e):
                        return []
                    if _is_busy(e) and "immutable" not in q:
                        raise
                    errors.append(e)
                except sqlite3.DatabaseError as e:  # a page read torn by a checkpoint
                    errors.append(e)
            raise _Unreadable()

        try:
            return retry(
                read_once, when=lambda e: isinstance(e, _Unreadable), attempts=3, delay=0.05
            )
        except _Unreadable:
            raise sqlite3.DatabaseError(
                f"cannot read the cache index {db}: {errors[-1] if errors else '?'}"
            ) from None

    @staticmethod
    def _select(con, db: Path, q: str, wal_pending: bool, errors: list) -> list[tuple]:
        rows = con.execute("SELECT key, raw, mode, filename, value FROM Cache").fetchall()
        if wal_pending and "immutable" in q:
            log.warning(
                "%s has a pending write-ahead log that cannot be read here (%s); "
                "entries published after its last checkpoint are not visible",
                db,
                errors[-1] if errors else None,
            )
        return rows

    def value(self, key: str, check_fd: Callable[[int, str], None] | None = None) -> bytes | None:
        """The stored bytes of ``key`` (a file read through ``check_fd(fd, path)``
        first), or None if the row or its file is gone.

        Raises:
            UnsafeValueError: a pickled value, an unknown mode or an unsafe file name.
            LinkInCacheError: the value file or a folder holding it is a symbolic
                link (not followed).
        """
        row = self.rows.get(key)
        if row is None:
            return None
        mode, filename, value = row
        if mode == MODE_RAW:
            return value.encode() if isinstance(value, str) else bytes(value)
        if mode in (MODE_BINARY, MODE_TEXT) and filename is not None:
            try:
                f = open_entry_file(self.directory, filename)
            except FileNotFoundError:
                return None
            with f:
                if check_fd is not None:
                    check_fd(f.fileno(), f.name)
                return f.read()
        if mode == MODE_PICKLE:
            raise UnsafeValueError("index row holds a pickled value (refused: never unpickled)")
        raise UnsafeValueError(f"index row has unknown storage mode {mode!r}")

    def file_of(self, key: str) -> str | None:
        row = self.rows.get(key)
        return None if row is None or row[1] is None else os.path.join(self.directory, row[1])
