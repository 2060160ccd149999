"""A remote tier on S3 (or any S3-compatible store), shared by a fleet, with
build leases for one compile per key across builders.

Set ``KERNEL_CACHE_S3_URL`` (or ``--s3-url``) to ``s3://BUCKET/PREFIX``. The
endpoint and credentials come from the standard ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_REGION`` variables.
The client is obstore (an optional extra: ``pip install 'kernel-cache[s3]'``),
imported only when a URL is set; docs/s3.md gives the measurements behind
that choice and the design.

Objects (under ``PREFIX/``), all immutable once written except the leases:

- ``entries/<key>``: one entry, ``KCS3`` + 8-byte big-endian length of the JSON
  metadata + the metadata + the artifact bytes. Written with ``If-None-Match: *``
  (create-once): the first builder's entry stays, a second build of the key
  gets ``412 PreconditionFailed`` and reads what is there; a reader sees the
  whole object or none.
- ``manifests/<sha256 of the sorted keys>.json``: ``{"format", "keys"}`` of a
  whole plan, written create-once by a warmup after every key of the plan is
  published. An engine that announced its keys (:meth:`S3Tier.expect`) reads
  it on its first lookup in this tier and fetches the listed entries in
  parallel; without it, one GET per key.
- ``leases/<key>``: ``{"holder", "expires_at"}`` of the builder compiling the
  key (:class:`S3Lease`).

Entries are untrusted (:attr:`S3Tier.trusted` is False): the lookup checks
their size, sha256 and, with a signing key, signature before use.

Failure. Every call runs with obstore's ``connect_timeout`` and
``read_timeout`` of ``KERNEL_CACHE_S3_TIMEOUT`` seconds (default 2) and no
retries. The first failure logs one warning naming the URL and marks the tier
down for ``retry_s`` seconds, during which every call is a miss at once.
``fail_open=False`` (``kernel-cache verify --s3-url``) raises
:class:`~kernel_cache.store.redis.RemoteUnavailableError` instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kernel_cache.config import settings as env_settings
from kernel_cache.errors import ConfigError, CorruptEntryError
from kernel_cache.store.redis import (
    ACQUIRED,
    BUSY,
    PUBLISHED,
    TIMEOUT,
    UNAVAILABLE,
    RemoteUnavailableError,
)
from kernel_cache.store.tier import Entry, PutOutcome, PutResult, Tier, parse_meta

log = logging.getLogger("kernel_cache")

ENV_S3_URL = env_settings.var("s3_url")
MAGIC = b"KCS3"
_HEAD = struct.Struct(">Q")
#: bytes read for an entry's metadata alone (a record is about 1-2 KiB)
META_PROBE = 16384
MANIFEST_FORMAT = "kc-s3-manifest-1"

_ENV_FIELDS = {
    "timeout_s": "s3_timeout",
    "lock_ttl_s": "s3_lock_ttl",
    "lock_wait_s": "s3_lock_wait",
}
_SOURCES = {
    "url": f"--s3-url / {ENV_S3_URL}",
    "timeout_s": f"--s3-timeout / {env_settings.var('s3_timeout')}",
    "lock_ttl_s": env_settings.var("s3_lock_ttl"),
    "lock_wait_s": env_settings.var("s3_lock_wait"),
}


class S3Manifest(BaseModel):
    """``manifests/<sha256 of the sorted keys>.json``: a plan whose every key is published."""

    model_config = ConfigDict(frozen=True, extra="allow")

    format: Literal["kc-s3-manifest-1"] = Field(description="the format of this document")
    keys: list[str] = Field(description="the plan's cache keys (64 hex), sorted")
    created: float = Field(description="unix seconds when it was written")


class S3LeaseDoc(BaseModel):
    """``leases/<key>``: who compiles the key, until when."""

    model_config = ConfigDict(frozen=True, extra="allow")

    holder: str = Field("", description="host:pid:token of the builder")
    expires_at: float = Field(description="unix seconds; 0 once released")


class S3Settings(BaseModel):
    """Where the bucket is and how long anything may wait for it.

    Fields (seconds unless noted): ``url`` (``s3://BUCKET/PREFIX``);
    ``timeout_s`` (connect and read timeout of every call, default 2);
    ``lock_ttl_s`` (lease expiry, renewed every third of it while compiling,
    default 30); ``lock_wait_s`` (longest wait for a live holder, default 900);
    ``retry_s`` (how long a failed store is left alone, default 30).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["s3"] = "s3"
    url: str
    timeout_s: float = 2.0
    lock_ttl_s: float = 30.0
    lock_wait_s: float = 900.0
    retry_s: float = 30.0

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return env_settings.check_s3_url(v)

    @field_validator("timeout_s", "lock_ttl_s", "lock_wait_s", "retry_s")
    @classmethod
    def _positive(cls, v: float) -> float:
        if not 0 < v <= 1e9:
            raise ValueError(f"{v}: must be > 0 and <= 1e9 seconds")
        return v

    @property
    def bucket(self) -> str:
        return self.url[5:].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        return self.url[5:].partition("/")[2].strip("/")

    @classmethod
    def from_env(
        cls, url: str | None = None, environ: Mapping[str, str] | None = None, **overrides
    ) -> S3Settings | None:
        """Settings from ``url`` (else ``KERNEL_CACHE_S3_URL``) and the
        ``KERNEL_CACHE_S3_*`` variables; ``overrides`` (not None) win. None
        when no URL is set.

        Raises:
            ConfigError: a malformed URL or number (names the flag or variable).
        """
        if not url:
            url = env_settings.get("s3_url", environ)
            if url is None:
                return None
        fields: dict = {"url": url}
        for name, env_name in _ENV_FIELDS.items():
            if env_settings.is_set(env_name, environ):
                fields[name] = env_settings.get(env_name, environ)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**fields)
        except ValueError as e:
            msgs = "; ".join(
                f"{_SOURCES.get(str(x['loc'][0]), x['loc'][0]) if x['loc'] else 'settings'}: "
                f"{x['msg'].removeprefix('Value error, ')}"
                for x in e.errors()
            )
            raise ConfigError(f"S3 settings: {msgs}") from None

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


def manifest_name(keys) -> str:
    """The manifest object of a plan: ``manifests/<sha256 of its sorted keys>.json``."""
    digest = hashlib.sha256("\n".join(sorted(set(keys))).encode()).hexdigest()
    return f"manifests/{digest}.json"


class S3Tier(Tier):
    """The shared S3 tier (see the module docstring for objects and failure).

    Args:
        settings: an :class:`S3Settings` or a URL.
        fail_open: on a failure, warn once and act as a miss (default); False
            raises :class:`~kernel_cache.store.redis.RemoteUnavailableError`.
        warn: log the one warning (False where the caller reports :attr:`error`).
    """

    name = "s3"
    trusted = False
    corrupt_is_miss = True

    def __init__(self, settings: S3Settings | str, *, fail_open: bool = True, warn=True):
        if isinstance(settings, str):
            settings = S3Settings.from_env(url=settings, environ={})
        self.settings = settings
        self.location = settings.url
        self.fail_open = fail_open
        self.warn = warn
        #: the first failure ("GenericError: ..."), None while all went well
        self.error: str | None = None
        self._warned = False
        self._down_until = 0.0
        self._store = None
        self._expected: list[str] = []
        self._manifest_read = False
        self._prefetched: dict[str, bytes] = {}

    # -- plumbing ----------------------------------------------------------
    @property
    def store(self):
        """The ``obstore.store.S3Store`` (made on first use; nothing is sent yet)."""
        if self._store is None:
            try:
                from obstore.store import S3Store
            except ImportError:
                raise RemoteUnavailableError(
                    f"an S3 URL is set ({self.location}) but the obstore package is not "
                    "installed; install it with: pip install 'kernel-cache[s3]'"
                ) from None
            # fixed-point: obstore cannot parse Python's "1e-05s" for small timeouts
            t = f"{self.settings.timeout_s:.9f}s"
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

    @staticmethod
    def _is_failure(e: BaseException) -> bool:
        if isinstance(e, (OSError, RemoteUnavailableError)):
            return True
        try:
            from obstore.exceptions import BaseError
        except ImportError:
            return False
        return isinstance(e, BaseError)

    def note_failure(self, e: BaseException | str) -> None:
        """Record a failure: keep :attr:`error`, warn once, leave the store alone
        for ``retry_s`` seconds. Never raises."""
        if isinstance(e, (str, RemoteUnavailableError)):
            text = str(e)
        else:
            text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if self.error is None:
            self.error = text
        self._down_until = time.monotonic() + self.settings.retry_s
        if self.warn and self.fail_open and not self._warned:
            self._warned = True
            log.warning(
                "S3 at %s is unavailable (%s); carrying on with the local tiers "
                "(next try in %.0f s)",
                self.location,
                text,
                self.settings.retry_s,
            )

    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _run(self, what: str, fn, default=None, *, fail_open: bool | None = None):
        """``fn(obstore, store)``; on a failure :meth:`note_failure` and ``default``
        (or raise when not fail-open). Not-found, already-exists and
        precondition answers are the caller's to handle inside ``fn``."""
        fail_open = self.fail_open if fail_open is None else fail_open
        if self.is_down():
            if not fail_open:
                raise RemoteUnavailableError(f"S3 at {self.location} is down: {self.error}")
            return default
        try:
            import obstore

            return fn(obstore, self.store)
        except Exception as e:
            if not self._is_failure(e):
                raise
            self.note_failure(e)
            if not fail_open:
                raise RemoteUnavailableError(
                    f"S3 at {self.location} failed during {what}: {self.error}; check the URL, "
                    "AWS_ENDPOINT_URL and the credentials, and that the store is reachable"
                ) from None
            return default

    def _get_bytes(self, path: str) -> bytes | None:
        """The object's bytes, None if absent (or on a fail-open failure)."""
        from obstore.exceptions import NotFoundError

        def op(ob, store):
            try:
                return bytes(ob.get(store, path).bytes())
            except (NotFoundError, FileNotFoundError):
                return None

        return self._run(f"GET {path}", op)

    # -- manifest ----------------------------------------------------------
    def expect(self, keys) -> None:
        """The keys the caller will look up (a plan): the first lookup reads
        their manifest and fetches the listed entries in parallel. Sends nothing."""
        self._expected = sorted(set(keys))
        self._manifest_read = False

    def _read_manifest(self) -> None:
        if self._manifest_read or not self._expected:
            return
        self._manifest_read = True
        raw = self._get_bytes(manifest_name(self._expected))
        if raw is None:
            return
        try:
            listed = sorted(S3Manifest.model_validate_json(raw).keys)
        except ValidationError:
            listed = None
        if listed != self._expected:
            log.warning("ignored S3 manifest %s: not this plan's", manifest_name(self._expected))
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(8, len(listed))) as pool:
            bodies = pool.map(lambda k: self._get_bytes(f"entries/{k}"), listed)
            self._prefetched = {k: b for k, b in zip(listed, bodies, strict=True) if b is not None}

    def publish_manifest(self, keys) -> PutResult:
        """Write the manifest of ``keys`` (create-once) if every key is
        published; else ``failed`` naming how many are missing."""
        keys = sorted(set(keys))
        missing = [k for k in keys if not self.contains(k)]
        if self.is_down():
            return PutResult(PutOutcome.FAILED, self.location, f"S3 unavailable: {self.error}")
        if missing:
            why = f"{len(missing)} of the plan's {len(keys)} keys are not published"
            return PutResult(PutOutcome.FAILED, self.location, why)
        body = S3Manifest(format=MANIFEST_FORMAT, keys=keys, created=time.time())
        return self._create(manifest_name(keys), body.model_dump_json().encode())

    # -- Tier --------------------------------------------------------------
    def _body(self, key: str) -> bytes | None:
        self._read_manifest()
        body = self._prefetched.pop(key, None)
        return body if body is not None else self._get_bytes(f"entries/{key}")

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

        if key in self._prefetched:
            return parse_meta(_split(key, self._prefetched[key], self.location)[0], key)

        def op(ob, store):
            path = f"entries/{key}"
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
                if len(head) < n + size:
                    head = bytes(ob.get_range(store, path, start=0, length=n + size))
            return head

        head = self._run("get_meta", op)
        if head is None:
            return None
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

        def op(ob, store):
            try:
                ob.put(store, path, body, mode="create", use_multipart=False)
                return PutOutcome.STORED
            except (AlreadyExistsError, PreconditionError):
                return PutOutcome.PRESENT

        outcome = self._run(f"PUT {path}", op)
        if outcome is None:
            why = f"S3 at {self.location} is unavailable: {self.error}"
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
        from kernel_cache import _testhooks

        raw_meta = json.dumps(meta, sort_keys=True).encode()
        body = pack(data, raw_meta)
        path = f"entries/{key}"
        _testhooks.hook("s3-put")
        result = self._create(path, body)
        if result.outcome is not PutOutcome.PRESENT:
            return result
        have = self._valid(key)
        if have is None:
            log.warning("replacing the S3 entry %s: it fails its checks", key[:16])
            self.delete(key)
            return self._create(path, body)
        if have.get("sha256") == meta.get("sha256"):
            return PutResult(PutOutcome.PRESENT, self.location, "the same bytes are stored")
        why = f"{path} holds another build of this key (create-once: kept)"
        return PutResult(PutOutcome.PRESENT, self.location, why)

    def _valid(self, key: str) -> dict | None:
        """The metadata of the stored entry of ``key`` if it passes the lookup's
        checks (or cannot be read now: left alone), else None."""
        from kernel_cache.store.tier import verify_entry
        from kernel_cache.trust.signing import check_untrusted

        try:
            entry = self.get(key)
            if entry is None:
                return {}  # gone again, or the store is down: leave it alone
            verify_entry(entry)
            check_untrusted(entry)
            return entry.meta
        except CorruptEntryError:
            return None

    def delete(self, key: str) -> None:
        self._prefetched.pop(key, None)
        self._run("delete", lambda ob, store: ob.delete(store, f"entries/{key}"))

    def keys(self) -> list[str]:
        """Every entry key held (a LIST of ``entries/``)."""

        def op(ob, store):
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
        """An :class:`S3Lease` for ``key``."""
        return S3Lease(self, key, ttl_s, wait_s)

    def close(self) -> None:
        self._store = None
        self._prefetched = {}


class S3Lease:
    """Cross-machine single flight for compiling one key, with the same
    outcomes as :class:`kernel_cache.store.redis.BuildLock`.

    The lease object ``leases/<key>`` holds ``{"holder", "expires_at"}`` (unix
    seconds). Taken with ``If-None-Match: *``; an expired one (its holder died or
    released it) is taken over by a conditional overwrite ``If-Match: <ETag>``
    of the lease read, so of two builders racing for it one wins. Renewed every
    ``ttl / 3`` by a thread (``If-Match`` on our own ETag: a lease taken over
    after we stalled is lost, not stolen back) and released by overwriting it
    as expired (``If-Match`` again). Expiry compares wall clocks of builders:
    their skew must stay well below the TTL.
    """

    def __init__(self, tier: S3Tier, key: str, ttl_s=None, wait_s=None, poll_s: float = 0.25):
        self.tier = tier
        self.key = key
        self.ttl_s = float(ttl_s or tier.settings.lock_ttl_s)
        self.wait_s = float(tier.settings.lock_wait_s if wait_s is None else wait_s)
        self.poll_s = poll_s
        self.path = f"leases/{key}"
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.lost = False
        self.waited_s = 0.0
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self, expires_at: float) -> bytes:
        return S3LeaseDoc(holder=self.token, expires_at=expires_at).model_dump_json().encode()

    def _read(self) -> tuple[dict, str] | None | bool:
        """``(lease, etag)``, None if there is none, False on a failure."""
        from obstore.exceptions import NotFoundError

        def op(ob, store):
            try:
                r = ob.get(store, self.path)
            except (NotFoundError, FileNotFoundError):
                return None
            try:
                doc = S3LeaseDoc.model_validate_json(bytes(r.bytes())).model_dump()
            except ValidationError:  # not a lease: treat as expired, take it over
                doc = {"expires_at": 0}
            return doc, r.meta["e_tag"]

        return self.tier._run("lease read", op, False)

    def _put(self, mode, expires_at: float) -> str | None | bool:
        """PUT the lease with ``mode``; its new ETag, None if the precondition
        failed, False on a failure."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        def op(ob, store):
            try:
                r = ob.put(store, self.path, self._body(expires_at), mode=mode, use_multipart=False)
                return r["e_tag"] or ""
            except (AlreadyExistsError, PreconditionError):
                return None

        return self.tier._run("lease write", op, False)

    def holder(self) -> str | None:
        got = self._read()
        return got[0].get("holder") if got else None

    def acquire(self, wait: bool = True) -> str:
        t0 = time.monotonic()
        deadline = t0 + (self.wait_s if wait else 0.0)
        try:
            while True:
                etag = self._put("create", time.time() + self.ttl_s)
                if etag is False:
                    return UNAVAILABLE
                if etag is None:
                    got = self._read()
                    if got is False:
                        return UNAVAILABLE
                    if got is not None and float(got[0].get("expires_at", 0)) < time.time():
                        etag = self._put({"e_tag": got[1]}, time.time() + self.ttl_s)
                        if etag is False:
                            return UNAVAILABLE
                if etag is not None and etag is not False:
                    self._etag = etag
                    self._start_renewal()
                    return ACQUIRED
                if self.tier.contains(self.key):
                    return PUBLISHED
                if self.tier.is_down():
                    return UNAVAILABLE
                if not wait:
                    return BUSY
                if time.monotonic() >= deadline:
                    log.warning(
                        "S3 build lease for %s still held by %s after %.0f s; compiling anyway",
                        self.key[:16],
                        self.holder(),
                        self.wait_s,
                    )
                    return TIMEOUT
                time.sleep(self.poll_s)
        finally:
            self.waited_s = time.monotonic() - t0

    def _start_renewal(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._renew, name=f"kernel-cache-lease-{self.key[:8]}", daemon=True
        )
        self._thread.start()

    def _renew(self) -> None:
        interval = max(0.05, self.ttl_s / 3)
        while not self._stop.wait(interval):
            etag = self._put({"e_tag": self._etag}, time.time() + self.ttl_s)
            if etag is None:
                self.lost = True
                log.warning(
                    "lost the S3 build lease for %s (it expired: was this process paused "
                    "longer than %.1f s?); another builder may compile it too",
                    self.key[:16],
                    self.ttl_s,
                )
                return
            if etag is False:
                return  # the store failed (noted): the lease expires on its own
            self._etag = etag

    def release(self) -> None:
        """Stop renewing and mark the lease expired if we still hold it. Never raises."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.tier.settings.timeout_s + 1)
            self._thread = None
        if self._etag is not None and not self.lost:
            try:
                self._put({"e_tag": self._etag}, 0.0)
            except Exception:  # releasing must not fail a run; the lease expires anyway
                pass
        self._etag = None


def tiers_from_env(environ: Mapping[str, str] | None = None) -> list[Tier]:
    """``[S3Tier]`` when ``KERNEL_CACHE_S3_URL`` is set, else ``[]``."""
    settings = S3Settings.from_env(environ=environ)
    return [S3Tier(settings)] if settings else []
