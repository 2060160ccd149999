"""Storage tiers behind one small interface, and entry verification.

An entry is the artifact's bytes (an AOTInductor ``.pt2`` package) plus a JSON
metadata record::

    {"key": <sha256 hex>, "variant": "batched_decode:1:8:4",
     "components": {name: value, ...}, "sha256": <sha256 of the bytes>,
     "size": <bytes>, "compile_seconds": <float>, "created": <unix seconds>,
     "format": "kc1"}

Metadata is JSON, never pickle. Every tier returns raw entries;
:func:`verify_entry` checks them before any code is loaded.

The interface (:class:`Tier`) follows the shape of Triton's ``CacheManager``
(``python/triton/runtime/cache.py``): get, put, contains, delete and listing.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from kernel_cache.config import settings
from kernel_cache.errors import (
    CacheWriteError,
    CorruptEntryError,
    UntrustedCacheError,
    describe_errors,
)
from kernel_cache.plan.keys import ARTIFACT_FORMAT, CacheKey
from kernel_cache.plan.traced import Manifest, chain_key

ENV_CACHE_DIR = settings.var("dir")


def default_cache_dir() -> Path:
    """``$KERNEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/kernel_cache``, else
    ``~/.cache/kernel_cache`` (a relative ``XDG_CACHE_HOME`` is ignored, as the
    XDG Base Directory spec says)."""
    env = settings.get("dir")
    if env is not None:
        return env
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / "kernel_cache"


def check_cache_dir_path(directory: Path, source: str, fix: str) -> None:
    """Raise :class:`~kernel_cache.errors.ConfigError` when ``directory``, or a
    folder above it, exists and is not a directory, naming both, ``source``
    (where the path came from) and ``fix`` (what to point at a directory)."""
    for p in (directory, *directory.parents):
        try:
            if not p.exists():
                continue
        except OSError:
            return
        if not p.is_dir():
            from kernel_cache.errors import ConfigError

            what = "it is" if p == directory else f"{p} is"
            raise ConfigError(
                f"cache directory {directory} (from {source}): {what} a file, not a directory; "
                f"fix: point {fix} at a directory (a new one or a kernel-cache cache), "
                f"or move {p} out of the way"
            )
        return


@dataclass(frozen=True)
class Entry:
    """A stored entry as read from a tier: metadata (parsed JSON) and bytes."""

    key: str
    meta: dict
    data: bytes
    where: str = ""


class EntryMeta(BaseModel):
    """An entry's JSON metadata record (see the module docstring).

    ``key``, ``sha256`` and ``size`` (bytes) are required; the other fields
    are written by :func:`make_meta` and may be absent from older records.
    Fields beyond these (``timings``, ``cpu_target``, ``cpu_features``,
    ``signature``, ``imported_from``, a bundle's ``file``) are kept as stored.

    ``traced``: the files whose code ran while the kernel was built and
    exported, with their sha256, and the distributions, with their versions
    (:mod:`kernel_cache.plan.traced`); checked against the files here before
    the entry is used. ``derived``: for an entry compiled while files its plan
    key's entry recorded had changed, the state of those files at each step,
    so that ``key`` is ``chain_key(hash of components, derived)`` (docs/keys.md).
    """

    model_config = ConfigDict(frozen=True, extra="allow")

    key: str
    sha256: str
    size: StrictInt = Field(ge=0)
    variant: str | None = None
    components: dict[str, str] | None = None
    # int | float: a number read back is written back unchanged (5 stays 5)
    compile_seconds: int | float | None = None
    created: int | float | None = None
    format: str | None = None
    traced: Manifest | None = None
    derived: list[Manifest] | None = None

    def record(self) -> dict:
        """The JSON record: the fields it was made or read with, extra ones included."""
        return self.model_dump(mode="json", exclude_unset=True)


def make_meta(
    key: CacheKey,
    variant: str,
    data: bytes,
    compile_seconds: float,
    *,
    traced: Manifest | None = None,
    derived=(),
    **extra,
) -> dict:
    """The JSON metadata record for a new entry (an :class:`EntryMeta` record),
    stored under ``key`` or, given ``derived`` states, under the key they derive
    from it (:func:`kernel_cache.plan.traced.chain_key`)."""
    if traced is not None:
        extra["traced"] = traced
    if derived:
        extra["derived"] = list(derived)
    return EntryMeta(
        key=chain_key(key.hexdigest, derived),
        variant=variant,
        components=key.as_dict(),
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        compile_seconds=round(compile_seconds, 3),
        created=time.time(),
        format=ARTIFACT_FORMAT,
        **extra,
    ).record()


def parse_meta(raw: bytes | str, key: str, where: str = "") -> dict:
    """Parse a metadata record (JSON, validated as :class:`EntryMeta`); returns
    the parsed object as stored.

    Raises:
        CorruptEntryError: not JSON (or nested too deep to parse), not an object,
            or a field missing or of the wrong type (names the field, what was
            wrong and the value).
    """
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise CorruptEntryError(key, f"metadata is not JSON ({e})", where) from None
    except RecursionError:  # "[[[[...": json raises it, not ValueError
        raise CorruptEntryError(key, "metadata is not a record (nested too deep)", where) from None
    check_meta(meta, key, where)
    return meta  # as stored: validated, never rewritten


def check_meta(meta, key: str, where: str = "") -> EntryMeta:
    """``meta`` (parsed JSON) as an :class:`EntryMeta`.

    Raises:
        CorruptEntryError: naming the field and what was wrong.
    """
    if not isinstance(meta, dict):
        raise CorruptEntryError(
            key, f"metadata is a JSON {type(meta).__name__}, not an object", where
        )
    try:
        return EntryMeta.model_validate(meta)
    except ValidationError as e:
        raise CorruptEntryError(key, f"metadata: {describe_errors(e)}", where) from None


def verify_entry(entry: Entry) -> str:
    """Check an entry before its code is loaded; returns the sha256 (hex) of its
    bytes, so a signature check need not hash them again.

    Raises:
        CorruptEntryError: the metadata is malformed (names the field), names
            another key, the size differs (truncated bytes), or the sha256 of
            the bytes does not match.
    """
    m = check_meta(entry.meta, entry.key, entry.where)
    if m.key != entry.key:
        raise CorruptEntryError(entry.key, f"metadata is for key {m.key[:16]}", entry.where)
    if m.size != len(entry.data):
        raise CorruptEntryError(
            entry.key,
            f"size {len(entry.data)} bytes != recorded {m.size} (truncated?)",
            entry.where,
        )
    digest = hashlib.sha256(entry.data).hexdigest()
    if digest != m.sha256:
        raise CorruptEntryError(
            entry.key, f"sha256 {digest[:16]} != recorded {m.sha256[:16]}", entry.where
        )
    return digest


class PutOutcome(str, Enum):
    """What :meth:`Tier.put` did."""

    STORED = "stored"  #: the entry is now in the tier
    PRESENT = "present"  #: the same record was there already; nothing was written
    READ_ONLY = "read-only"  #: refused: the tier is read-only (``reason`` says which)
    FAILED = "failed"  #: a fail-open tier could not store it (``reason`` says why)


@dataclass(frozen=True)
class PutResult:
    """The typed result of :meth:`Tier.put`: the outcome, the tier's location
    (for reports) and, unless stored, why."""

    outcome: PutOutcome
    where: str = ""
    reason: str = ""

    @property
    def ok(self) -> bool:
        """True if the tier holds the entry now (stored or already present)."""
        return self.outcome in (PutOutcome.STORED, PutOutcome.PRESENT)

    @property
    def stored(self) -> bool:
        """True if this call wrote the entry."""
        return self.outcome is PutOutcome.STORED


class Tier(abc.ABC):
    """A place entries are stored: a bundle, a local disk cache, Redis.

    The interface is get, put, contains and iteration over metadata. Whether a
    tier's entries are trusted, whether a bad one is a miss and where a hit is
    copied are the policy of the lookup that orders the tiers
    (:class:`kernel_cache.store.lookup.Source`); :attr:`trusted` and
    :attr:`corrupt_is_miss` are only the defaults it starts from. :attr:`name`
    and :attr:`location` are for reports (where an entry came from).
    """

    name: str = "tier"
    location: str = ""
    #: Default policy: False for shared stores others can write (Redis, bundles),
    #: whose entries must also pass :func:`kernel_cache.trust.signing.check_untrusted`.
    trusted: bool = True
    #: Default policy: True where an entry failing its checks is a miss rather
    #: than an error (Redis: a shared cache that warmup repairs).
    corrupt_is_miss: bool = False

    @abc.abstractmethod
    def get(self, key: str) -> Entry | None:
        """The raw (unverified) entry, or None on a miss.

        Raises:
            CorruptEntryError: the entry exists but its metadata cannot be read.
        """

    @abc.abstractmethod
    def get_meta(self, key: str) -> dict | None:
        """The metadata record alone, or None."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes, meta: dict) -> PutResult:
        """Publish an entry atomically: readers see all of it or none of it.

        Returns the outcome (:class:`PutResult`): stored, already present,
        refused as read-only, or failed (a fail-open tier) with the reason.
        A fail-closed tier raises instead of failing (the disk tier:
        CacheWriteError, CacheBusyError).
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def iter_meta(self) -> Iterator[dict]:
        """Every entry's metadata (for ls, stats, explain)."""

    def iter_records(self) -> Iterator[tuple[str, dict | None, str | None]]:
        """Every entry for listing: ``(key, metadata, None)``, or ``(key, None,
        reason)`` for one whose metadata cannot be read (the default lists
        :meth:`iter_meta`, which has none of the latter)."""
        for m in self.iter_meta():
            yield m["key"], m, None

    def contains(self, key: str) -> bool:
        return self.get_meta(key) is not None

    def quarantine(self, key: str, reason: str, variant: str = "") -> str:
        """Move ``key``'s bad entry out of the way; returns where it was kept, or
        ``""`` where the tier keeps nothing (this default deletes it)."""
        self.delete(key)
        return ""

    def note_usage(self, hits, misses: int) -> bool:
        """Record ``hits`` (keys served now) and ``misses`` (a count) where the
        tier keeps usage records; returns whether it does (this default: no).
        Best effort, never raises."""
        return False

    def repair_hint(self, config, cache_dir=None) -> str:
        """How a corrupt entry of this tier is replaced, for error messages
        (``config``: the EngineConfig; ``cache_dir``: the local cache given, if any)."""
        from kernel_cache.config.engine import config_to_cli

        return f"repair with: kernel-cache warmup {config_to_cli(config, cache_dir)}"

    def expect(self, keys) -> None:  # noqa: B027 - optional hook
        """The keys the caller is about to look up (a plan); a tier may fetch them
        together (S3: its plan manifest). Sends nothing by itself."""

    def publish_manifest(self, keys) -> PutResult | None:
        """Record that every key of ``keys`` (a whole plan) is published, where
        the tier keeps such records (S3); None where it does not (this default)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class DiskTier(Tier):
    """Local disk cache: a :class:`diskcache.Cache` under ``directory``.

    The artifact bytes are stored under ``art/<key>`` (diskcache keeps values
    of 32 KiB and more as ``xx/yy/*.val`` files) and the JSON metadata under
    ``meta/<key>``; both are written inside one ``Cache.transact()``, so a
    reader sees both or neither, and the artifact file is fsynced before the
    transaction commits (:mod:`kernel_cache.store.disk`). Eviction is off: nothing
    disappears behind the user's back.

    Args:
        directory: default :func:`default_cache_dir`.
        read_only: read through :class:`~kernel_cache.store.disk.IndexSnapshot` and
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
        from kernel_cache.store.disk import db_timeout_from_env
        from kernel_cache.trust.permissions import EntryFileChecker, resolve_allow_shared

        self.directory = Path(directory) if directory else default_cache_dir()
        self.location = str(self.directory)
        self.read_only = read_only
        self.allow_shared = resolve_allow_shared(allow_shared)
        self.timeout = db_timeout_from_env() if timeout is None else float(timeout)
        self._files = EntryFileChecker(self.directory, allow_shared=self.allow_shared)
        self._cache = None
        self._snapshot = None
        self._trusted = False

    # -- opening -------------------------------------------------------------
    def check_trust(self) -> None:
        """The directory-level trust checks (once per object).

        Raises:
            UntrustedCacheError: names the path, why and the fix.
        """
        if not self._trusted:
            from kernel_cache.trust.permissions import check_cache_dir

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
            from kernel_cache.store.disk import as_write_error, damaged_index, open_cache

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
            from kernel_cache.store.disk import IndexSnapshot

            self.check_trust()
            self._snapshot = IndexSnapshot(self.directory, timeout=self.timeout)
        return self._snapshot

    def _retry(self, fn, what: str):
        from kernel_cache.store.disk import retry_busy

        return retry_busy(fn, directory=self.directory, timeout=self.timeout, what=what)

    # -- reading -------------------------------------------------------------
    def _value(self, k: str, *, as_file: bool = False):
        """Raw stored bytes of index key ``k`` (None if absent); entry files go
        through the trust check first."""
        from kernel_cache.store.disk import UnsafeValueError

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
        from kernel_cache.store.disk import IndexSnapshot

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
        from kernel_cache.store.disk import IndexSnapshot

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
        from kernel_cache.store.disk import IndexSnapshot

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
        from kernel_cache.store.disk import IndexSnapshot

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
        from kernel_cache import _testhooks
        from kernel_cache.store.disk import as_write_error

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
                    _testhooks.hook("publish-commit")
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
