"""A remote tier in an object store (S3 or any S3-compatible store, GCS, Azure
Blob, or a directory on a shared filesystem), shared by a fleet, with build
leases for one compile per key across builders.

Set ``KERNEL_CACHE_REMOTE_URL`` (or ``--remote-url``; the older
``KERNEL_CACHE_S3_URL`` / ``--s3-url`` are read too) to ``s3://BUCKET/PREFIX``,
``gs://BUCKET/PREFIX``, ``az://CONTAINER/PREFIX`` or ``file:///DIRECTORY``. An
S3 endpoint and credentials come from the standard ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_REGION`` variables;
GCS and Azure read their own (``GOOGLE_*``, ``AZURE_*``) through obstore's
``from_url``. The client is obstore (an optional extra: ``pip install
'kernel-cache[s3]'``), imported only when a URL is set; docs/s3.md gives the
measurements behind that choice and the design, docs/shared-storage.md the
URLs and the threat model. A ``file://`` directory has the same objects; its
leases are :class:`~kernel_cache.store.file_lease.FileLease` (no conditional
overwrite there).

Objects (under ``PREFIX/``), all immutable once written except the leases:

- ``entries/<key>``: one entry, ``KCS3`` + 8-byte big-endian length of the JSON
  metadata + the metadata + the artifact bytes. Written with ``If-None-Match: *``
  (create-once): the first builder's entry stays, a second build of the key
  gets ``412 PreconditionFailed`` and reads what is there; a reader sees the
  whole object or none.
- ``manifests/<sha256 of the sorted keys>.json``: ``{"format", "keys"}`` of a
  whole plan, written create-once by a warmup after every key of the plan is
  published. An engine that announced its keys (:meth:`S3Tier.expect`) reads
  it (at most :func:`manifest_limit` bytes) on its first lookup in this tier
  and then fetches the listed entries ahead of its lookups,
  :data:`PREFETCH` at a time in plan order; without it, one GET per key.
- ``leases/<key>``: ``{"holder", "expires_at"}`` of the builder compiling the
  key (:class:`~kernel_cache.store.s3_lease.S3Lease`).
- ``index/<name>/<digest>/<key>``: empty, written create-once with each
  entry, one per :data:`~kernel_cache.store.lookup.RECORD_INDEXES` digest of
  its record: a miss finds compatible entries by listing one such prefix
  (:meth:`S3Tier.metas_by`, at most :data:`INDEX_MAX` of them), never
  ``entries/``, so its requests do not grow with the bucket.

Entries are untrusted (:attr:`S3Tier.trusted` is False): the lookup checks
their size, sha256 and, with a signing key, signature before use. Every read is
bounded before its body (docs/s3.md, "Bounds and planted leases"): an entry is
streamed and refused from its first bytes unless its record accounts for it.

Failure. Every call runs with obstore's ``connect_timeout`` and
``read_timeout`` of ``KERNEL_CACHE_S3_TIMEOUT`` seconds (default 2) and no
retries. The first failure logs one warning naming the URL and marks the tier
down for ``retry_s`` seconds, during which every call is a miss at once.
``fail_open=False`` (``kernel-cache verify --s3-url``) raises
:class:`~kernel_cache.store.remote_base.RemoteUnavailableError` instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import struct
import time
from collections.abc import Iterator, Mapping
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kernel_cache.config import settings as env_settings
from kernel_cache.errors import ConfigError, CorruptEntryError, shown
from kernel_cache.store.disk_tier import Entry, PutOutcome, PutResult, Tier, parse_meta
from kernel_cache.store.entry import META_MAX_BYTES
from kernel_cache.store.remote_base import RemoteSettings, RemoteTier, RemoteUnavailableError
from kernel_cache.store.s3_lease import S3Lease, S3LeaseDoc  # noqa: F401 - S3LeaseDoc re-exported

log = logging.getLogger("kernel_cache")

MAGIC = b"KCS3"
_HEAD = struct.Struct(">Q")
#: bytes read for an entry's metadata alone (a record is about 1-2 KiB)
META_PROBE = 16384
MANIFEST_FORMAT = "kc-s3-manifest-1"
#: index objects read per digest on a miss: builds of one runtime differing in
#: a build-only component (the C++ compiler) or in sources number a handful;
#: more under one digest is a writer's flood, and the rest is not read
INDEX_MAX = 64
#: entries fetched ahead of the lookups once a plan manifest is read: at most
#: this many bodies are in memory beside the one being checked, so an engine's
#: peak stays within a few entries' size however large the listed objects are
PREFETCH = 2


def manifest_limit(n_keys: int) -> int:
    """The largest manifest read for a plan of ``n_keys`` keys (bytes): 80 per
    key (a 64-hex key, quotes, a comma) and 1 KiB for the rest; a larger object
    is not this plan's manifest and is refused before its body is read."""
    return 1024 + 80 * n_keys


#: a plan manifest older than this (seconds) is written again by the next warmup
#: that completes the plan (``kernel-cache gc-remote`` keeps plans by manifest age)
MANIFEST_RENEW_S = 86400.0


class S3Manifest(BaseModel):
    """``manifests/<sha256 of the sorted keys>.json``: a plan whose every key is published."""

    model_config = ConfigDict(frozen=True, extra="allow")

    format: Literal["kc-s3-manifest-1"] = Field(description="the format of this document")
    keys: list[str] = Field(description="the plan's cache keys (64 hex), sorted")
    created: float = Field(description="unix seconds when it was written")


class S3Settings(RemoteSettings):
    """Where the bucket is and how long anything may wait for it.

    Fields (seconds unless noted), defaults from the ``KERNEL_CACHE_S3_*``
    variables' (:mod:`kernel_cache.config.settings`): ``url``
    (``s3://BUCKET/PREFIX``); ``timeout_s`` (connect and read timeout of every
    call); ``lock_ttl_s`` (lease expiry, renewed every third of it while
    compiling); ``lock_wait_s`` (longest wait for a live holder); ``retry_s``
    (how long a failed store is left alone, default 30); ``max_object_bytes``
    (the largest object read: a larger one is refused from its size header).
    """

    VARIABLES: ClassVar[dict[str, str]] = {
        "url": "remote_url",
        "timeout_s": "s3_timeout",
        "lock_ttl_s": "s3_lock_ttl",
        "lock_wait_s": "s3_lock_wait",
        "max_object_bytes": "s3_max_object",
    }
    FLAGS: ClassVar[dict[str, str]] = {
        "url": "--remote-url",
        "timeout_s": "--s3-timeout",
    }
    ALIASES: ClassVar[dict[str, str]] = {"url": "--s3-url / KERNEL_CACHE_S3_URL"}
    LABEL: ClassVar[str] = "object store"

    kind: Literal["s3"] = "s3"
    timeout_s: float = env_settings.default("s3_timeout")
    lock_ttl_s: float = env_settings.default("s3_lock_ttl")
    lock_wait_s: float = env_settings.default("s3_lock_wait")
    max_object_bytes: int = Field(env_settings.default("s3_max_object"), gt=0)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return env_settings.check_remote_url(v)

    @classmethod
    def from_env(cls, url: str | None = None, environ: Mapping[str, str] | None = None, **kw):
        """As :meth:`RemoteSettings.from_env`; the URL is ``url``, else
        ``KERNEL_CACHE_REMOTE_URL``, else its older name ``KERNEL_CACHE_S3_URL``.

        Raises:
            ConfigError: both variables set to different URLs (names both), or
                a malformed value.
        """
        if not url:
            new = env_settings.get("remote_url", environ)
            old = env_settings.get("s3_url", environ)
            if new and old and new != old:
                raise ConfigError(
                    f"{env_settings.var('remote_url')}={new!r} and its older name "
                    f"{env_settings.var('s3_url')}={old!r} name different stores; "
                    f"fix: unset {env_settings.var('s3_url')}"
                )
            url = new or old
            if url is None:
                return None
        return super().from_env(url=url, environ=environ, **kw)

    @property
    def scheme(self) -> str:
        """``s3``, ``gs``, ``az`` (also ``azure``, ``abfs``, ``abfss``) or ``file``."""
        return self.url.split("://", 1)[0]

    @property
    def bucket(self) -> str:
        return self.url.split("://", 1)[1].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        return self.url.split("://", 1)[1].partition("/")[2].strip("/")

    @property
    def directory(self) -> str:
        """The directory of a ``file://`` URL (``file:///mnt/kc`` -> ``/mnt/kc``)."""
        from urllib.parse import unquote

        rest = self.url.split("://", 1)[1]
        return unquote("/" + rest.partition("/")[2]).rstrip("/") or "/"

    def tier(self, **kw) -> S3Tier:
        return S3Tier(self, **kw)


def endpoint_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, else None (AWS S3).

    Raises:
        ConfigError: the value is not an ``http://`` or ``https://`` URL with a
            host (obstore would panic on the first request, e.g. on
            ``minio.internal:9000`` without a scheme); names the variable,
            the value and the fix.
    """
    from urllib.parse import urlsplit

    environ = os.environ if environ is None else environ
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        value = environ.get(name)
        if not value:
            continue
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError: not a number in 0..65535
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            ok = ok and not parts.netloc.endswith(":") and not any(c.isspace() for c in value)
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(
                f"{name}={value!r} is not an S3 endpoint URL: it must be http:// or "
                f"https:// followed by a host and an optional port; fix: set it like "
                f"{name}=https://s3.internal:9000, or unset it for AWS S3"
            )
        return value
    return None


class ObjectTooLargeError(Exception):
    """An object over ``KERNEL_CACHE_S3_MAX_OBJECT``, refused before its body is read."""

    def __init__(self, path: str, size: int, limit: int):
        self.path, self.size, self.limit = path, size, limit
        super().__init__(
            f"object {path} is {size} bytes, over the limit of {limit} "
            f"({env_settings.var('s3_max_object')}); an entry that large is not this "
            "cache's (fix: raise the limit if your kernels are that large)"
        )


class NotAFileError(ObjectTooLargeError):
    """A ``file://`` object that is a FIFO, a socket or a device (planted in the
    shared directory), refused before it is read; handled
    where :class:`ObjectTooLargeError` is."""

    def __init__(self, path: str, kind: str):
        Exception.__init__(
            self,
            f"object {path} is not a regular file but a {kind} (planted in the shared "
            "directory?); it is not this cache's (fix: remove it)",
        )


def pack(data: bytes, raw_meta: bytes) -> bytes:
    """One entry object: magic, metadata length, metadata JSON, artifact bytes."""
    return MAGIC + _HEAD.pack(len(raw_meta)) + raw_meta + data


def _split(key: str, body: bytes, where: str) -> tuple[bytes, memoryview]:
    """``(metadata JSON, artifact bytes)`` of an entry object.

    Raises:
        CorruptEntryError: not an entry object, or cut short.
    """
    n = len(MAGIC) + _HEAD.size
    if len(body) < n or bytes(body[:4]) != MAGIC:
        raise CorruptEntryError(key, "not a kernel-cache S3 entry (bad magic)", where)
    (size,) = _HEAD.unpack(bytes(body[4:n]))
    if len(body) < n + size:
        raise CorruptEntryError(key, f"metadata cut short ({len(body) - n} of {size})", where)
    view = memoryview(body)
    return bytes(view[n : n + size]), view[n + size :]


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _of(of, meta: dict) -> str | None:
    try:
        return of(meta)
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def manifest_name(keys) -> str:
    """The manifest object of a plan: ``manifests/<sha256 of its sorted keys>.json``."""
    digest = hashlib.sha256("\n".join(sorted(set(keys))).encode()).hexdigest()
    return f"manifests/{digest}.json"


def walk_dir(directory: str, prefix: str) -> list[tuple[str, int, float]]:
    """``(path, size, mtime)`` under ``prefix`` of a ``file://`` directory, links
    not followed: a link (to a file or a folder, the prefix's own folder
    included) is an object itself, judged by its own mtime and removed alone,
    so a link planted by a writer of the directory never makes a listing (the
    tier's, gc-remote's) walk or delete files outside it (obstore's listing
    follows links, to ``/`` as well).

    Raises:
        OSError: a folder cannot be read.
    """
    top = os.path.join(directory, prefix.rstrip("/"))
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        return [(prefix.rstrip("/"), st.st_size, st.st_mtime)]
    out = []

    def fail(e: OSError):
        raise e

    for root, dirs, files in os.walk(top, onerror=fail):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            out.append((os.path.relpath(path, directory), st.st_size, st.st_mtime))
    return out


class S3Tier(RemoteTier):
    """The shared S3 tier (see the module docstring for objects and failure).

    Args:
        settings: an :class:`S3Settings` or a URL.
        fail_open: on a failure, warn once and act as a miss (default); False
            raises :class:`~kernel_cache.store.remote_base.RemoteUnavailableError`.
        warn: log the one warning (False where the caller reports :attr:`error`).
    """

    name = "s3"
    LABEL = "S3"
    CHECK = "check the URL, AWS_ENDPOINT_URL and the credentials, and that the store is reachable"
    #: per URL scheme: (label in messages, the fix named when a call fails)
    KINDS: ClassVar[dict[str, tuple[str, str]]] = {
        "s3": (LABEL, CHECK),
        "gs": ("GCS", "check the URL, the GOOGLE_* credentials and that the store is reachable"),
        "file": (
            "shared directory",
            "check that the directory exists and is writable on this host (a mounted "
            "shared filesystem)",
        ),
    }
    _AZURE = (
        "Azure Blob",
        "check the URL, the AZURE_* credentials and that the store is reachable",
    )

    def __init__(self, settings: S3Settings | str, *, fail_open: bool = True, warn=True):
        if isinstance(settings, str):
            settings = S3Settings.from_env(url=settings, environ={})
        super().__init__(settings, fail_open=fail_open, warn=warn)
        self.LABEL, self.CHECK = self.KINDS.get(settings.scheme, self._AZURE)
        self._store = None
        self._record_check = None  # check_records
        self._order: list[str] = []
        self._expected: list[str] = []
        self._manifest_read = False
        self._listed = False
        self._ahead: dict = {}  # key -> Future of _fetch
        self._done: set[str] = set()
        self._pool = None

    # -- plumbing ----------------------------------------------------------
    @property
    def store(self):
        """The obstore store of the URL (made on first use; nothing is sent yet).

        Raises:
            RemoteUnavailableError: obstore is not installed, or a ``file://``
                directory does not exist (names it and the fix).
        """
        if self._store is None:
            try:
                from obstore.store import LocalStore, S3Store, from_url
            except ImportError:
                raise RemoteUnavailableError(
                    f"an object-store URL is set ({self.location}) but the obstore package "
                    "is not installed; install it with: pip install 'kernel-cache[s3]'"
                ) from None
            # fixed-point: obstore cannot parse Python's "1e-05s" for small timeouts
            t = f"{self.settings.timeout_s:.9f}s"
            if self.settings.scheme == "file":
                directory = self.settings.directory
                if not os.path.isdir(directory):
                    raise RemoteUnavailableError(
                        f"the shared directory {directory} of {self.location} does not exist "
                        "or is not a directory; create it on the shared filesystem "
                        f"(mkdir -p {directory}) and check that it is mounted on this host"
                    )
                self._store = LocalStore(directory)
                return self._store
            if self.settings.scheme != "s3":
                self._store = from_url(
                    self.settings.url,
                    client_options={"connect_timeout": t, "read_timeout": t},
                    retry_config={"max_retries": 0},
                )
                return self._store
            endpoint = endpoint_from_env()
            config = {"endpoint": endpoint} if endpoint else {}
            if not os.environ.get("AWS_REGION") and not os.environ.get("AWS_DEFAULT_REGION"):
                config["region"] = "us-east-1"
            self._store = S3Store(
                self.settings.bucket,
                prefix=self.settings.prefix or None,
                config=config,
                client_options={
                    "connect_timeout": t,
                    "read_timeout": t,
                    "allow_http": bool(endpoint and endpoint.startswith("http://")),
                },
                retry_config={"max_retries": 0},
            )
        return self._store

    def _call(self, fn):
        import obstore

        return fn(obstore, self.store)

    def _is_client_error(self, e: BaseException) -> bool:
        try:
            from obstore.exceptions import BaseError
        except ImportError:
            return False
        return isinstance(e, BaseError)

    def _read_file(self, path: str, length: int | None = None, limit: int | None = None):
        """``file://`` only: the first ``length`` bytes of ``path`` (all of it
        when None, refused over ``limit``, default ``max_object_bytes``), None
        if absent (a folder is no object, as for obstore), or the error to raise
        (:class:`NotAFileError`, :class:`ObjectTooLargeError`). Opened without
        blocking and checked to be a regular file first: opening a FIFO planted
        there waits for a writer forever, as obstore's read does."""
        full = os.path.join(self.settings.directory, path)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                return None
            if not stat.S_ISREG(st.st_mode):
                return NotAFileError(path, "FIFO, socket or device")
            limit = self.settings.max_object_bytes if limit is None else limit
            if length is None and st.st_size > limit:
                return ObjectTooLargeError(path, st.st_size, limit)
            want = min(limit, st.st_size if length is None else length)
            chunks, got = [], 0
            while got < want:
                chunk = os.read(fd, want - got)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _open(self, ob, store, path: str, limit: int):
        """``(size, chunks)`` of the object ``path``: a streamed GET whose size
        (response headers) is checked first, or in a ``file://`` directory the
        file read whole without blocking (:meth:`_read_file`); None if absent;
        or the error (:class:`ObjectTooLargeError` over ``limit``,
        :class:`NotAFileError`) with its body unread."""
        from obstore.exceptions import NotFoundError

        if self.settings.scheme == "file":
            store  # noqa: B018 - refuses a missing directory, naming it
            data = self._read_file(path, limit=limit)
            return (len(data), [data]) if isinstance(data, bytes) else data
        try:
            got = ob.get(store, path)
        except (NotFoundError, FileNotFoundError):
            return None
        size = int(got.meta["size"])
        if size > limit:
            return ObjectTooLargeError(path, size, limit)
        return size, got.stream(min_chunk_size=1 << 16)

    def _get_bytes(self, path: str, limit: int | None = None) -> bytes | None:
        """The object's bytes, None if absent (or on a fail-open failure).

        Raises:
            ObjectTooLargeError: the object's size (from the response headers,
                before the body is read) is over ``limit`` (default
                ``max_object_bytes``).
        """
        limit = self.settings.max_object_bytes if limit is None else limit

        def op(ob, store):
            got = self._open(ob, store, path, limit)
            return b"".join(got[1]) if isinstance(got, tuple) else got

        out = self._run(f"GET {path}", op)
        if isinstance(out, ObjectTooLargeError):
            raise out
        return out

    # -- manifest ----------------------------------------------------------
    def expect(self, keys) -> None:
        """The keys the caller will look up, in the order it looks them up (a
        plan): the first lookup reads their manifest and, if it lists exactly
        these keys, entries are fetched ahead of the lookups (:data:`PREFETCH`
        at a time, in this order). Sends nothing."""
        self._order = list(dict.fromkeys(keys))
        self._expected = sorted(self._order)
        self._manifest_read = False
        self._listed = False
        self._ahead = {}
        self._done = set()

    def _read_manifest(self) -> None:
        if self._manifest_read or not self._expected:
            return
        self._manifest_read = True
        name = manifest_name(self._expected)
        try:
            raw = self._get_bytes(name, manifest_limit(len(self._expected)))
        except NotAFileError as e:
            log.warning("ignored S3 manifest: %s", e)
            return
        except ObjectTooLargeError as e:
            # the limit comes from the plan's size, not KERNEL_CACHE_S3_MAX_OBJECT
            log.warning(
                "ignored S3 manifest: object %s is %d bytes, over the limit of %d for a "
                "manifest of this plan's %d keys; it is not this plan's (fix: remove it; "
                "entries are still found without it)",
                e.path, e.size, e.limit, len(self._expected),
            )  # fmt: skip
            return
        if raw is None:
            return
        try:
            listed = sorted(S3Manifest.model_validate_json(raw).keys)
        except ValidationError:
            listed = None
        if listed != self._expected:
            log.warning("ignored S3 manifest %s: not this plan's", name)
            return
        self._listed = True

    def check_records(self, check) -> None:
        """``check(meta)`` runs on each entry's record as soon as it has
        arrived, before the rest of the object is read or a buffer for it is
        made (:meth:`_fetch`)."""
        self._record_check = check

    def _fetch(self, key: str) -> bytearray | ObjectTooLargeError | CorruptEntryError | None:
        """The entry object of ``key``, read as a stream and checked as it
        comes: its size (response headers) within ``max_object_bytes``, then,
        from its first bytes, the magic, a record length within
        :data:`~kernel_cache.store.entry.META_MAX_BYTES`, a record whose
        ``size`` accounts for the whole object and that passes
        :meth:`check_records`' check. Only then is a buffer of the object's
        size made. An object failing a check is returned as the error with the
        rest of its body unread. None: absent, or the store failed (fail-open)."""

        path = f"entries/{key}"
        limit = self.settings.max_object_bytes
        n = len(MAGIC) + _HEAD.size

        def refused(why: str) -> CorruptEntryError:
            return CorruptEntryError(key, f"{why}; the rest of it was not read", self.location)

        def op(ob, store):
            got = self._open(ob, store, path, limit)
            if not isinstance(got, tuple):
                return got
            size, chunks = got
            head, buf, pos = bytearray(), None, 0  # the record's bytes, then the object's
            for chunk in chunks:
                if pos + len(chunk) > size:
                    return refused(f"more bytes arrived than its size of {size}")
                if buf is not None:  # filled in place: one copy
                    buf[pos : pos + len(chunk)] = chunk
                    pos += len(chunk)
                    continue
                head += chunk
                pos = len(head)
                if pos < n:
                    continue
                if bytes(head[:4]) != MAGIC:
                    return refused("not a kernel-cache S3 entry (bad magic)")
                (meta_len,) = _HEAD.unpack(bytes(head[4:n]))
                if meta_len > META_MAX_BYTES:
                    return refused(
                        f"its header claims a {meta_len}-byte record, over the limit of "
                        f"{META_MAX_BYTES}"
                    )
                if pos < n + meta_len:
                    continue
                try:
                    meta = parse_meta(bytes(head[n : n + meta_len]), key)
                except CorruptEntryError as e:
                    return refused(e.reason)
                if n + meta_len + meta["size"] != size:
                    return refused(
                        f"the object is {size} bytes, its record accounts for "
                        f"{n + meta_len + meta['size']}"
                    )
                if self._record_check is not None:
                    try:
                        self._record_check(meta)
                    except CorruptEntryError as e:
                        return e
                buf = bytearray(size)
                buf[:pos] = head
                head = None
            if buf is None:
                return refused("not a kernel-cache S3 entry (shorter than its header says)")
            if pos != size:
                return refused(f"cut short: {pos} of its {size} bytes arrived")
            return buf

        return self._run(f"GET {path}", op)

    def _fetched(self, key: str) -> bytearray | ObjectTooLargeError | CorruptEntryError | None:
        """``key``'s object: from the fetches ahead when the manifest listed the
        plan (starting the next :data:`PREFETCH` of the plan's order and
        dropping any for keys before it), else one GET now."""
        if not self._listed or key not in self._order:
            return self._fetch(key)
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=PREFETCH, thread_name_prefix="kc-s3")
        i = self._order.index(key)
        for k in list(self._ahead):
            if self._order.index(k) < i:  # looked up out of order: not waited for again
                self._ahead.pop(k).cancel()
        for k in self._order[i : i + PREFETCH]:
            if k not in self._ahead and k not in self._done:
                self._ahead[k] = self._pool.submit(self._fetch, k)
        self._done.add(key)
        fut = self._ahead.pop(key, None)
        return self._fetch(key) if fut is None else fut.result()

    def publish_manifest(self, keys) -> PutResult:
        """Write the manifest of ``keys`` (create-once) if every key is
        published; else ``failed`` naming how many are missing. A manifest
        that is there already and older than :data:`MANIFEST_RENEW_S` is
        written again (the same keys), so that ``kernel-cache gc-remote``
        sees a plan still warmed as recent."""
        keys = sorted(set(keys))
        missing = [k for k in keys if not self.contains(k)]
        if self.is_down():
            return PutResult(
                PutOutcome.FAILED, self.location, f"{self.LABEL} unavailable: {self.error}"
            )
        if missing:
            why = f"{len(missing)} of the plan's {len(keys)} keys are not published"
            return PutResult(PutOutcome.FAILED, self.location, why)
        body = S3Manifest(format=MANIFEST_FORMAT, keys=keys, created=time.time())
        raw = body.model_dump_json().encode()
        result = self._create(manifest_name(keys), raw)
        if result.outcome is PutOutcome.PRESENT:
            self._renew(manifest_name(keys), raw)
        return result

    def _renew(self, path: str, body: bytes) -> None:
        """Overwrite ``path`` with ``body`` if it was last written more than
        :data:`MANIFEST_RENEW_S` ago (fail-open: a failure is noted, never raised)."""

        def op(ob, store):
            from obstore.exceptions import NotFoundError

            try:
                modified = ob.head(store, path)["last_modified"]
            except (NotFoundError, FileNotFoundError):  # removed since, or a planted folder
                return False
            if time.time() - modified.timestamp() > MANIFEST_RENEW_S:
                ob.put(store, path, body, mode="overwrite", use_multipart=False)
                return True
            return False

        self._run(f"renew {path}", op, False, fail_open=True)

    # -- Tier --------------------------------------------------------------
    def _body(self, key: str) -> bytes | bytearray | None:
        self._read_manifest()
        body = self._fetched(key)
        if isinstance(body, ObjectTooLargeError):
            raise CorruptEntryError(key, str(body), self.location)
        if isinstance(body, CorruptEntryError):
            raise body
        return body

    def get(self, key: str) -> Entry | None:
        body = self._body(key)
        if body is None:
            return None
        raw_meta, data = _split(key, body, self.location)
        meta = parse_meta(raw_meta, key, self.location)
        return Entry(key=key, meta=meta, data=bytes(data), where=self.location)

    def get_meta(self, key: str) -> dict | None:
        """The metadata alone: a ranged GET of the entry's first bytes."""
        from obstore.exceptions import NotFoundError

        def op(ob, store):
            path = f"entries/{key}"
            local = self.settings.scheme == "file"
            if local:
                store  # noqa: B018 - refuses a missing directory, naming it
                head = self._read_file(path, META_PROBE)
                if not isinstance(head, bytes):
                    return head
            else:
                try:
                    head = bytes(ob.get_range(store, path, start=0, length=META_PROBE))
                except (NotFoundError, FileNotFoundError):
                    return None
                except Exception as e:  # a range past a short object's end
                    if not self._is_failure(e) or "range" not in str(e).lower():
                        raise
                    head = bytes(ob.get(store, path).bytes())
            n = len(MAGIC) + _HEAD.size
            if len(head) >= n and head[:4] == MAGIC:
                size = _HEAD.unpack(head[4:n])[0]
                if size > META_MAX_BYTES:  # never allocated: the header is a writer's
                    return size
                if len(head) < n + size and local:
                    head = self._read_file(path, n + size)
                elif len(head) < n + size:
                    head = bytes(ob.get_range(store, path, start=0, length=n + size))
            return head

        head = self._run("get_meta", op)
        if head is None:
            return None
        if isinstance(head, int):
            raise CorruptEntryError(
                key, f"its header claims a {head}-byte record, over the limit of "
                f"{META_MAX_BYTES}; not read", self.location,
            )  # fmt: skip
        if isinstance(head, ObjectTooLargeError):
            raise CorruptEntryError(key, str(head), self.location)
        return parse_meta(_split(key, head, self.location)[0], key, self.location)

    def contains(self, key: str) -> bool:
        from obstore.exceptions import NotFoundError

        def op(ob, store):
            try:
                ob.head(store, f"entries/{key}")
                return True
            except (NotFoundError, FileNotFoundError):
                return False

        return bool(self._run("contains", op, False))

    def _create(self, path: str, body: bytes) -> PutResult:
        """PUT ``path`` with ``If-None-Match: *``: ``stored``, ``present`` (an
        object is there: it is kept) or ``failed``."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        local = self.settings.scheme == "file"

        def op(ob, store):
            # a shared directory: skip the create when the object is there (a FUSE
            # mount of SeaweedFS loses sight of an object after a failed link(2) onto it);
            # a link to nothing in its place is no object (the tier writes no links):
            # removed, else it would keep the object out for good
            if local:
                full = os.path.join(self.settings.directory, path)
                if os.path.exists(full):
                    return PutOutcome.PRESENT
                if os.path.islink(full):
                    with contextlib.suppress(FileNotFoundError):  # another builder's unlink
                        os.unlink(full)
            try:
                ob.put(store, path, body, mode="create", use_multipart=False)
                return PutOutcome.STORED
            except (AlreadyExistsError, PreconditionError):
                return PutOutcome.PRESENT

        outcome = self._run(f"PUT {path}", op)
        if outcome is None:
            why = f"{self.LABEL} at {self.location} is unavailable: {self.error}"
            return PutResult(PutOutcome.FAILED, self.location, why)
        why = f"{path} exists (create-once: kept)" if outcome is PutOutcome.PRESENT else ""
        return PutResult(outcome, self.location, why)

    def put(self, key: str, data: bytes, meta: dict) -> PutResult:
        """Publish create-once (one ``PUT`` with ``If-None-Match: *``).

        Returns ``stored``; ``present`` when an entry is there already (a valid
        one is never replaced, ``reason`` says whether it holds the same bytes;
        one failing its checks is deleted and written again); ``failed``
        (fail-open) with the S3 error.
        """
        raw_meta = json.dumps(meta, sort_keys=True).encode()
        body = pack(data, raw_meta)
        path = f"entries/{key}"
        result = self._create(path, body)
        if result.outcome is not PutOutcome.FAILED:
            self._index(key, meta)
        if result.outcome is not PutOutcome.PRESENT:
            return result
        have = self._valid(key)
        if have is None:
            log.warning("replacing the S3 entry %s: it fails its checks", key[:16])
            self.delete(key)
            return self._create(path, body)
        if not have and not self.is_down():
            # there, yet no entry reads from it: a folder planted in a file:// directory
            # (or removed since): engines cannot load it, so it is not published
            why = f"{path} is there but holds no entry (a folder planted there?); fix: remove it"
            return PutResult(PutOutcome.FAILED, self.location, why)
        if have.get("sha256") == meta.get("sha256"):
            return PutResult(PutOutcome.PRESENT, self.location, "the same bytes are stored")
        why = f"{path} holds another build of this key (create-once: kept)"
        return PutResult(PutOutcome.PRESENT, self.location, why)

    def _index(self, key: str, meta: dict) -> None:
        """Write ``key``'s index objects (create-once; one already there is kept)."""
        from kernel_cache.store.lookup import record_indexes

        for name, value in record_indexes(meta).items():
            self._create(f"index/{name}/{value}/{key}", b"")

    def metas_by(self, index: str, of):
        """Records found through ``index/<index>/<value>/`` (one LIST, then a
        ranged GET per listed key, at most :data:`INDEX_MAX`); a record whose
        own ``of(record)`` is not ``value`` (a planted index object) is dropped.
        Entries published before index objects existed are not found here."""
        found: dict[str, list[dict]] = {}

        def find(value: str) -> list[dict]:
            if value not in found:
                found[value] = [m for m in self._indexed(index, value) if _of(of, m) == value]
            return found[value]

        return find

    def _indexed(self, index: str, value: str) -> list[dict]:
        if not _HEX64.fullmatch(value):
            return []
        prefix = f"index/{index}/{value}/"

        def op(ob, store):
            from obstore.exceptions import InvalidPathError

            try:
                for batch in ob.list(store, prefix, chunk_size=INDEX_MAX):
                    return [m["path"].rsplit("/", 1)[-1] for m in batch][:INDEX_MAX]
            except InvalidPathError as e:
                # a name no writer of this cache makes (planted in a file:// directory):
                # this index reads as empty; the rest of the store stays in use
                log.warning(
                    "ignored %s in %s: it holds an object with an invalid name (%s); "
                    "fix: remove it",
                    prefix, self.location, shown(str(e), 200),
                )  # fmt: skip
            return []

        metas = []
        for key in self._run("list index", op, []):
            if not _HEX64.fullmatch(key):
                continue
            try:
                meta = self.get_meta(key)
            except CorruptEntryError:
                continue
            if meta is not None:
                metas.append(meta)
        return metas

    def _valid(self, key: str) -> dict | None:
        """The metadata of the stored entry of ``key`` if it passes the lookup's
        checks (or cannot be read now: left alone), else None. With no key set
        here its signature cannot be judged: only its checksum is."""
        from kernel_cache.store.disk_tier import verify_entry
        from kernel_cache.trust.keys import allow_unsigned, load_trusted_keys
        from kernel_cache.trust.signing import check_untrusted

        try:
            entry = self.get(key)
            if entry is None:
                return {}  # gone again, or the store is down: leave it alone
            verify_entry(entry)
            keyring = load_trusted_keys(required=False)
            if keyring is not None or allow_unsigned():
                check_untrusted(entry, keyring)
            return entry.meta
        except CorruptEntryError:
            return None

    def delete(self, key: str) -> None:
        self._run("delete", lambda ob, store: ob.delete(store, f"entries/{key}"))

    def keys(self) -> list[str]:
        """Every entry key held (a LIST of ``entries/``)."""

        def op(ob, store):
            if self.settings.scheme == "file":
                store  # noqa: B018 - refuses a missing directory, naming it
                names = [
                    p.rsplit("/", 1)[-1]
                    for p, _, _ in walk_dir(self.settings.directory, "entries/")
                ]
                return [n for n in names if "#" not in n]  # not a writer's temporary file
            out = []
            for batch in ob.list(store, "entries/", chunk_size=1000):
                out += [m["path"].rsplit("/", 1)[-1] for m in batch]
            return out

        return sorted(self._run("list", op, []))

    def iter_meta(self) -> Iterator[dict]:
        """Every entry's metadata (a LIST, then one ranged GET per entry)."""
        for key in self.keys():
            try:
                meta = self.get_meta(key)
            except CorruptEntryError:
                continue
            if meta is not None:
                yield meta

    def build_lock(self, key: str, ttl_s: float | None = None, wait_s: float | None = None):
        """An :class:`S3Lease` for ``key`` (a :class:`~kernel_cache.store.file_lease.FileLease`
        in a ``file://`` directory, which has no conditional overwrite)."""
        if self.settings.scheme == "file":
            from kernel_cache.store.file_lease import FileLease

            return FileLease(self, key, ttl_s, wait_s)
        return S3Lease(self, key, ttl_s, wait_s)

    def close(self) -> None:
        for f in self._ahead.values():
            f.cancel()
        self._ahead = {}
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._store = None


def tiers_from_env(environ: Mapping[str, str] | None = None) -> list[Tier]:
    """``[S3Tier]`` when ``KERNEL_CACHE_REMOTE_URL`` (or ``KERNEL_CACHE_S3_URL``)
    is set, else ``[]``."""
    settings = S3Settings.from_env(environ=environ)
    return [S3Tier(settings)] if settings else []
