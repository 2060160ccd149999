"""The local disk tier (:class:`DiskTier`), and the names callers import with it.

The tier interface is :mod:`kernel_cache.store.base`'s, an entry and its
metadata record :mod:`kernel_cache.store.entry`'s; both are imported here too,
where most callers take them from. Every tier returns raw entries;
:func:`~kernel_cache.store.entry.verify_entry` checks them before any code is
loaded.

The interface (:class:`Tier`) follows the shape of Triton's ``CacheManager``
(``python/triton/runtime/cache.py``): get, put, contains, delete and listing.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

from kernel_cache.config import settings
from kernel_cache.errors import (
    CacheWriteError,
    CorruptEntryError,
    UntrustedCacheError,
)
from kernel_cache.store.base import (  # noqa: F401 - callers import these from here
    ENV_CACHE_DIR,
    PutOutcome,
    PutResult,
    Tier,
    check_cache_dir_path,
    default_cache_dir,
)
from kernel_cache.store.entry import (  # noqa: F401 - callers import these from here
    Entry,
    EntryMeta,
    check_meta,
    make_meta,
    parse_meta,
    verify_entry,
)


class DiskTier(Tier):
    """Local disk cache: a :class:`diskcache.Cache` under ``directory``.

    The artifact bytes are stored under ``art/<key>`` (diskcache keeps values
    of 32 KiB and more as ``xx/yy/*.val`` files) and the JSON metadata under
    ``meta/<key>``; both are written inside one ``Cache.transact()``, so a
    reader sees both or neither, and the artifact file is fsynced before the
    transaction commits (:mod:`kernel_cache.store.safe_disk`). Eviction is off: nothing
    disappears behind the user's back.

    Args:
        directory: default :func:`default_cache_dir`.
        read_only: read through :class:`~kernel_cache.store.safe_disk.IndexSnapshot` and
            never write, lock or create anything in the directory (engine
            start, verify); :meth:`put` and :meth:`delete` raise.
        allow_shared: skip the trust checks of :mod:`kernel_cache.trust.permissions`
            (default: ``KERNEL_CACHE_INSECURE_ALLOW_SHARED_DIR``).
        timeout: seconds to retry a locked index (default ``KERNEL_CACHE_DB_TIMEOUT``
            or 60).

    Nothing is opened until first use. Reads check that the directory, the
    index and each entry file are trusted (:mod:`kernel_cache.trust.permissions`).

    Raises (from the methods):
        UntrustedCacheError, CacheBusyError, CacheWriteError (a full or
        unwritable directory, naming it and the bytes needed), CorruptEntryError.
    """

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        *,
        read_only: bool = False,
        allow_shared: bool | None = None,
        timeout: float | None = None,
    ):
        from kernel_cache.trust.permissions import EntryFileChecker, resolve_allow_shared

        self.directory = Path(directory) if directory else default_cache_dir()
        self.location = str(self.directory)
        self.read_only = read_only
        self.allow_shared = resolve_allow_shared(allow_shared)
        self.timeout = settings.get("db_timeout") if timeout is None else float(timeout)
        self._files = EntryFileChecker(self.directory, allow_shared=self.allow_shared)
        self._cache = None
        self._snapshot = None
        self._trusted = False

    # -- opening -------------------------------------------------------------
    def check_trust(self) -> None:
        """The directory-level trust checks (once per object).

        Raises:
            UntrustedCacheError: names the path, why and the fix.
            NetworkFilesystemError: the directory is on a network or FUSE
                filesystem (:func:`kernel_cache.store.fs_type.check_local`).
        """
        if not self._trusted:
            from kernel_cache.store.fs_type import check_local
            from kernel_cache.trust.permissions import check_cache_dir

            check_local(self.directory)
            check_cache_dir(self.directory, allow_shared=self.allow_shared)
            self._trusted = True

    @property
    def cache(self):
        """The writable :class:`diskcache.Cache`, opened (and the directory created)
        on first use.

        Raises:
            CacheWriteError: read-only tier, or the directory cannot be written.
            CacheBusyError: the index stayed locked for ``timeout`` seconds.
        """
        if self._cache is None:
            from kernel_cache.store.safe_disk import as_write_error, damaged_index, open_cache

            if self.read_only:
                raise CacheWriteError(f"cache {self.directory} was opened read-only")
            self.check_trust()
            try:
                self._cache = open_cache(
                    self.directory, timeout=self.timeout, shared=self.allow_shared
                )
            except (OSError, sqlite3.DatabaseError) as e:
                err = damaged_index(e, self.directory) or as_write_error(
                    e, self.directory, None, "opening the cache"
                )
                if err is None:
                    raise
                raise err from None
        return self._cache

    def _snap(self):
        if self._snapshot is None:
            from kernel_cache.store.safe_disk import IndexSnapshot

            self.check_trust()
            self._snapshot = IndexSnapshot(self.directory, timeout=self.timeout)
        return self._snapshot

    def _retry(self, fn, what: str):
        from kernel_cache.store.safe_disk import retry_busy

        return retry_busy(fn, directory=self.directory, timeout=self.timeout, what=what)

    # -- reading -------------------------------------------------------------
    def _value(self, k: str, *, as_file: bool = False):
        """Raw stored bytes of index key ``k`` (None if absent); entry files go
        through the trust check first."""
        from kernel_cache.store.safe_disk import UnsafeValueError

        try:
            if self.read_only:
                snap = self._snap()
                data = snap.value(k, self._files.check_open_file)
                if data is None and k in snap.rows and as_file:
                    snap.reload()  # a concurrent warmup replaced the entry's file
                    data = snap.value(k, self._files.check_open_file)
                return data
            handle = self._retry(lambda: self.cache.get(k, read=as_file), "reading an entry")
            if handle is None or not as_file or isinstance(handle, bytes | bytearray):
                return handle  # diskcache keeps small values inline, not as files
            with handle:
                if hasattr(handle, "fileno") and hasattr(handle, "name"):
                    self._files.check_open_file(handle.fileno(), handle.name)
                return handle.read()
        except UnsafeValueError as e:
            raise CorruptEntryError(k.split("/", 1)[-1], str(e), self.location) from None

    def get_meta(self, key: str) -> dict | None:
        raw = self._value("meta/" + key)
        if raw is None:
            return None
        return parse_meta(raw, key, self.location)

    def get(self, key: str) -> Entry | None:
        meta = self.get_meta(key)
        if meta is None:
            return None
        data = self._value("art/" + key, as_file=True)
        if data is None:
            raise CorruptEntryError(
                key, "metadata present but artifact bytes missing", self.location
            )
        return Entry(key=key, meta=meta, data=bytes(data), where=self.location)

    def artifact_filename(self, key: str) -> str | None:
        """The index's file name (relative to the cache directory) of ``key``'s
        artifact bytes, or None if they are not stored as a file. Opens nothing."""
        from kernel_cache.store.safe_disk import IndexSnapshot

        if self.read_only:
            row = self._snap().rows.get("art/" + key)
        else:
            self.cache  # noqa: B018 - open (and check) it first
            row = IndexSnapshot(self.directory, timeout=self.timeout).rows.get("art/" + key)
        return None if row is None or not isinstance(row[1], str) else row[1]

    def artifact_path(self, key: str) -> Path | None:
        """The file holding ``key``'s artifact bytes, if it is stored as a file
        (the path as the index names it; nothing is opened or followed)."""
        name = self.artifact_filename(key)
        return None if name is None else self.directory / name

    def raw_meta(self, key: str) -> bytes | None:
        """The stored metadata bytes, unparsed (for quarantine), or None."""
        try:
            raw = self._value("meta/" + key)
        except CorruptEntryError as e:
            return f"(unreadable: {e.reason})".encode()
        return raw if isinstance(raw, bytes) or raw is None else str(raw).encode()

    def iter_meta(self) -> Iterator[dict]:
        from kernel_cache.store.safe_disk import IndexSnapshot

        # The key list comes from a read-only snapshot in both modes: it skips
        # rows whose key is not a plain string (never unpickled).
        if self.read_only:
            rows = self._snap().rows
        else:
            self.cache  # noqa: B018 - open (and check) it first
            rows = IndexSnapshot(self.directory, timeout=self.timeout).rows
        for k in [k for k in rows if k.startswith("meta/")]:
            try:
                raw = self._value(k)
                if raw is not None:
                    yield parse_meta(raw, k[5:], self.location)
            except (CorruptEntryError, UntrustedCacheError):
                continue

    def iter_records(self) -> Iterator[tuple[str, dict | None, str | None]]:
        """Every entry, readable or not, for ``ls``/``stats``/``gc``/``clear``:
        ``(key, metadata, None)``, or ``(key, None, reason)`` where the
        metadata does not parse, names another key or cannot be read (a link,
        an untrusted file), the artifact row is missing, or its file is
        missing, a link, not a regular file or not the recorded size. Checks
        use ``lstat``; no artifact is read.
        """
        from kernel_cache.store.safe_disk import IndexSnapshot

        if self.read_only:
            rows = self._snap().rows
        else:
            self.cache  # noqa: B018 - open (and check) it first
            rows = IndexSnapshot(self.directory, timeout=self.timeout).rows
        keys = sorted({k.split("/", 1)[1] for k in rows if k.startswith(("meta/", "art/"))})
        for key in keys:
            if "meta/" + key not in rows:
                yield key, None, "artifact bytes without metadata"
                continue
            try:
                raw = self._value("meta/" + key)
                if raw is None:
                    continue  # removed since the index was read
                meta = parse_meta(raw, key, self.location)
            except CorruptEntryError as e:
                yield key, None, e.reason
                continue
            except UntrustedCacheError as e:
                yield key, None, f"untrusted: {e}"
                continue
            why = None
            if meta.get("key") != key:
                why = f"metadata is for key {str(meta.get('key'))[:16]}"
            elif "art/" + key not in rows:
                why = "metadata present but artifact bytes missing"
            else:
                why = self._file_problem(rows["art/" + key][1], meta.get("size"))
            yield (key, None, why) if why else (key, meta, None)

    def _file_problem(self, filename, size) -> str | None:
        """Why the value file ``filename`` cannot hold an entry of ``size`` bytes
        (``lstat`` only), or None (also for bytes kept inline in the index)."""
        if not isinstance(filename, str):
            return None
        path = self.directory / filename
        try:
            st = path.lstat()
        except OSError:
            return f"artifact file {path} is missing"
        if stat.S_ISLNK(st.st_mode):
            return f"artifact file {path} is a symbolic link (never followed)"
        if not stat.S_ISREG(st.st_mode):
            return f"artifact file {path} is not a regular file"
        if st.st_size != size:
            return f"size {st.st_size} bytes != recorded {size} (truncated?)"
        return None

    def record_size(self, key: str) -> int:
        """Bytes of ``key``'s artifact file on disk (``lstat``; 0 if none or not a
        regular file), for an entry whose metadata cannot say."""
        from kernel_cache.store.safe_disk import IndexSnapshot

        rows = (
            self._snap().rows
            if self.read_only
            else IndexSnapshot(self.directory, timeout=self.timeout).rows
        )
        row = rows.get("art/" + key)
        if row is None or not isinstance(row[1], str):
            return 0
        try:
            st = (self.directory / row[1]).lstat()
        except OSError:
            return 0
        return st.st_size if stat.S_ISREG(st.st_mode) else 0

    # -- writing -------------------------------------------------------------
    def put(self, key: str, data: bytes, meta: dict) -> PutResult:
        """Publish bytes and metadata in one transaction (see the class docstring).

        Returns :class:`PutResult`: ``read-only`` (nothing written) for a tier
        opened read-only, ``present`` when the same bytes and metadata are
        stored already, else ``stored``.

        Raises:
            CacheWriteError: a full disk (ENOSPC/EDQUOT) or an unwritable
                directory; names the directory and the bytes needed, and leaves
                no file or row of this entry behind.
            CacheBusyError: the index stayed locked for ``timeout`` seconds.
        """
        from kernel_cache.store.safe_disk import as_write_error

        if self.read_only:
            why = f"cache {self.directory} was opened read-only; nothing is written there"
            return PutResult(PutOutcome.READ_ONLY, self.location, why)
        raw_meta = json.dumps(meta, sort_keys=True).encode()
        if self._holds(key, data, raw_meta):
            return PutResult(PutOutcome.PRESENT, self.location, "the same entry is stored")
        needed = len(data) + len(raw_meta)

        def attempt():
            cache = self.cache
            disk = cache.disk
            mark = len(disk.new_files)
            try:
                with cache.transact():
                    cache.set("art/" + key, bytes(data))
                    cache.set("meta/" + key, raw_meta)
            except BaseException:
                disk.discard_new_files(mark)
                raise
            del disk.new_files[mark:]

        try:
            self._retry(attempt, f"publishing entry {key[:16]}")
        except (OSError, sqlite3.OperationalError) as e:
            err = as_write_error(e, self.directory, needed, f"publishing entry {key[:16]}")
            if err is None:
                raise
            raise err from None
        return PutResult(PutOutcome.STORED, self.location)

    def _holds(self, key: str, data: bytes, raw_meta: bytes) -> bool:
        """True if ``key`` is stored with exactly ``raw_meta`` and bytes of
        ``data``'s size and sha256 (a readable entry; anything else is rewritten)."""
        try:
            if self._value("meta/" + key) != raw_meta:
                return False
            entry = self.get(key)
            return entry is not None and entry.data == data
        except (CorruptEntryError, UntrustedCacheError, OSError):
            return False

    def quarantine(self, key: str, reason: str, variant: str = "") -> str:
        """Move ``key``'s entry into ``<cache>/quarantine/`` with a reason file
        (:mod:`kernel_cache.store.quarantine`), remove it from the index and log
        it once. Returns the quarantine folder.

        Raises:
            UntrustedCacheError: ``quarantine/`` is a symbolic link (or not a folder).
            CacheWriteError, CacheBusyError: the entry then stays where it was.
        """
        from kernel_cache.store.quarantine import log, quarantine_files

        dest = quarantine_files(
            self.directory,
            key,
            reason,
            variant,
            files=lambda: (self.raw_meta(key), self.artifact_filename(key)),
            shared=self.allow_shared,
        )
        self.delete(key)
        log.warning("quarantined cache entry %s (%s): %s -> %s", key[:16], variant, reason, dest)
        return str(dest)

    def note_usage(self, hits, misses: int) -> bool:
        """Best-effort usage record in this cache (:mod:`kernel_cache.store.usage`;
        skipped where the directory is read-only). Returns True: a disk cache
        keeps usage records."""
        from kernel_cache.store import usage

        usage.record(self.directory, hits=hits, misses=misses)
        return True

    def delete(self, key: str) -> None:
        def attempt():
            cache = self.cache
            with cache.transact():
                cache.delete("meta/" + key)
                cache.delete("art/" + key)

        self._retry(attempt, f"deleting entry {key[:16]}")

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        self._snapshot = None
