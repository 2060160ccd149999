"""A remote tier on Redis, shared by every machine of a fleet, and a cross-machine
build lock.

Set ``KERNEL_CACHE_REDIS_URL`` (or ``--redis-url``) to ``redis://HOST:PORT/DB``
(``rediss://`` for TLS, ``unix:///path.sock``). The ``redis`` client package is
an optional extra (``pip install 'kernel-cache[redis]'``), imported only when a
URL is set.

Layout. One Redis hash per entry, ``<prefix>entry:<key>``, with two fields:
``meta`` (the JSON metadata record, as on disk) and ``data`` (the artifact's raw
bytes: no base64). Both are written in one ``MULTI``/``EXEC`` transaction and
read with one ``HMGET``, so a reader sees a whole entry or none. With a TTL
(``KERNEL_CACHE_REDIS_TTL`` seconds) the hash expires as one key. Entries from
Redis are untrusted (:attr:`RedisTier.trusted` is False): they pass the
checksum and the signature over the whole record
(:mod:`kernel_cache.trust.signing`) before they are used.

Failure. Every call runs with ``socket_timeout`` and ``socket_connect_timeout``
of ``KERNEL_CACHE_REDIS_TIMEOUT`` seconds (default 2) and no client-side
retries, so no call blocks longer than that. The first failure logs one warning
naming the URL (password hidden) and marks the tier down for ``retry_s``
seconds (default 30), during which every call returns at once as a miss; the
local tiers carry on. ``fail_open=False`` (``kernel-cache verify --redis-url``)
raises :class:`RemoteUnavailableError` instead.

Single flight. :class:`BuildLock` (a
:class:`~kernel_cache.store.remote_base.BuildLease`) is ``SET <prefix>lock:<key> <token> NX PX
<ttl>`` (redis-py's :class:`redis.lock.Lock`), renewed every ``ttl / 3`` by a
thread while the holder compiles, and released by a compare-and-delete script.
A holder that dies stops renewing; its lock expires after at most ``lock_ttl_s``
seconds and the next builder takes over.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from kernel_cache.config import settings as env_settings
from kernel_cache.errors import CorruptEntryError, shown
from kernel_cache.store.disk_tier import Entry, PutOutcome, PutResult, Tier, parse_meta
from kernel_cache.store.entry import META_MAX_BYTES
from kernel_cache.store.redis_watch import ContestedKeyError, watched
from kernel_cache.store.remote_base import (  # noqa: F401 - the outcomes are imported from here too
    ACQUIRED,
    BUSY,
    ENTRY_KEY,
    PUBLISHED,
    TIMEOUT,
    UNAVAILABLE,
    RemoteSettings,
    RemoteTier,
    RemoteUnavailableError,
)

log = logging.getLogger("kernel_cache")

ENV_REDIS_URL = env_settings.var("redis_url")
#: members of an index set read on a miss (as the S3 tier's ``INDEX_MAX``)
INDEX_MAX = 64


#: Fields of an entry's record that describe one build, not its bytes or what
#: they are: two builders of a key differ in them (builds are reproducible).
BUILD_FIELDS = ("created", "compile_seconds", "timings", "signature", "imported_from")


#: Lua: the SHA-1 (hex) of an entry hash's ``data`` field, "" when it has none.
_DATA_SHA1 = (
    "local d = redis.call('HGET', KEYS[1], 'data') "
    "if not d then return '' end return redis.sha1hex(d)"
)

#: Keys of the database one ``SCAN`` call of :meth:`RedisTier.keys` walks (its
#: ``COUNT``): about 90 KiB of entry names a reply at most.
SCAN_COUNT = 1000


#: Keys of the database a listing may walk per entry of its bound: ``SCAN``
#: walks every key of the database, and the cache itself keeps three per entry
#: (the entry and its two index sets, :meth:`RedisTier.put`), with room for
#: its locks and index sets that outlived their entries.
KEYS_WALKED_PER_ENTRY = 4


def scan_calls_max(list_max: int) -> int:
    """The most ``SCAN`` calls a listing of at most ``list_max`` entries makes:
    enough to walk a database of :data:`KEYS_WALKED_PER_ENTRY` times that many
    keys, :data:`SCAN_COUNT` a call, and one more."""
    return KEYS_WALKED_PER_ENTRY * -(-list_max // SCAN_COUNT) + 1


def _glob_escaped(text: str) -> str:
    """``text`` as a Redis glob pattern (``MATCH``) that matches it literally."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


#: The longest index-set member :meth:`RedisTier.metas_by` takes (an entry
#: key is 64 hex characters): a longer one names no entry and is never sent.
INDEX_MEMBER_MAX_CHARS = 256

#: Lua: at most ``ARGV[1]`` random members of the set ``KEYS[1]``, those over
#: ``ARGV[2]`` characters left in Redis, so the reply is bounded whatever a
#: writer of the set put in it.
_INDEX_MEMBERS = (
    "local out = {} "
    "for _, m in ipairs(redis.call('SRANDMEMBER', KEYS[1], tonumber(ARGV[1]))) do "
    "if #m <= tonumber(ARGV[2]) then out[#out + 1] = m end end return out"
)


def _sha1_of_data_read_bounded(c, name: str, size: int) -> str | None:
    """SHA-1 (hex) of the ``data`` field of hash ``name`` read back only when
    it is ``size`` bytes long (``HSTRLEN`` under ``WATCH``, then ``HGET`` in
    the same transaction), so a writer's oversized field is never downloaded;
    None when it is absent or of another length."""

    def measured(pipe):
        n = pipe.hstrlen(name, "data")
        pipe.multi()
        if n == size:
            pipe.hget(name, "data")

    try:
        got = watched(c, measured, name)
    except ContestedKeyError:  # not known to hold them: the put writes them again
        return None
    raw = got[0] if got else None
    return None if raw is None else hashlib.sha1(raw).hexdigest()


def same_published(have: dict | None, want: dict) -> bool:
    """Whether a published entry's record ``have`` already stands for the entry
    ``want`` about to be published: the same fields but for :data:`BUILD_FIELDS`
    (sha256, size, variant, key components, CPU features, traced files...) and,
    when ``want`` is signed, a signature the trusted keys accept over ``have``
    (another builder's of the same bytes does: nothing is re-uploaded; an altered
    record or a forged signature does not: it is replaced). An unsigned entry
    never replaces a signed one."""
    if have is None:
        return False
    if {k: v for k, v in have.items() if k not in BUILD_FIELDS} != {
        k: v for k, v in want.items() if k not in BUILD_FIELDS
    }:
        return False
    if not want.get("signature"):
        return True
    from kernel_cache.trust.keys import load_trusted_keys
    from kernel_cache.trust.signing import SignatureError, check_signature

    keyring = load_trusted_keys(required=False)
    if keyring is None or not have.get("signature"):
        return False
    try:  # the bytes are the local entry's (same sha256): its digest stands for them
        check_signature(str(have.get("key", "")), have, b"", keyring, digest=want["sha256"])
    except SignatureError:
        return False
    return True


class RedisSettings(RemoteSettings):
    """Where the shared cache is and how long anything may wait for it.

    Fields (seconds unless noted), defaults from the ``KERNEL_CACHE_REDIS_*``
    variables' (:mod:`kernel_cache.config.settings`): ``url``; ``timeout_s``
    (socket connect and read timeout of every call); ``ttl_s`` (entry expiry,
    None keeps entries until deleted); ``max_object_bytes`` (the largest
    artifact value read: a larger one is refused from its ``HSTRLEN``);
    ``lock_ttl_s`` (build-lock expiry,
    renewed every third of it while compiling: a dead builder's variant is
    taken over at most that long after it died); ``lock_wait_s`` (longest wait
    for a live holder before compiling anyway); ``retry_s`` (how long a failed
    Redis is left alone before the next try, default 30); ``list_max`` (the
    most entries :meth:`RedisTier.keys` takes, which bounds its ``SCAN`` calls);
    ``prefix`` (of every Redis key, default ``kernel_cache:``).
    """

    VARIABLES: ClassVar[dict[str, str]] = {
        "url": "redis_url",
        "timeout_s": "redis_timeout",
        "ttl_s": "redis_ttl",
        "lock_ttl_s": "redis_lock_ttl",
        "lock_wait_s": "redis_lock_wait",
        "max_object_bytes": "redis_max_object",
        "list_max": "remote_list_max",
    }
    FLAGS: ClassVar[dict[str, str]] = {
        "url": "--redis-url",
        "timeout_s": "--redis-timeout",
        "ttl_s": "--redis-ttl",
    }
    LABEL: ClassVar[str] = "Redis"

    kind: Literal["redis"] = "redis"
    timeout_s: float = env_settings.default("redis_timeout")
    ttl_s: int | None = env_settings.default("redis_ttl")
    lock_ttl_s: float = env_settings.default("redis_lock_ttl")
    lock_wait_s: float = env_settings.default("redis_lock_wait")
    max_object_bytes: int = Field(env_settings.default("redis_max_object"), gt=0)
    prefix: str = "kernel_cache:"

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return env_settings.check_redis_url(v)  # what redis-py's from_url would fail on later

    @field_validator("ttl_s")
    @classmethod
    def _ttl(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"{v}: an entry TTL must be >= 1 second (or unset: no expiry)")
        return v

    def tier(self, **kw) -> RedisTier:
        return RedisTier(self, **kw)


class RedisTier(RemoteTier):
    """The shared remote tier (see the module docstring for layout and failure).

    Args:
        settings: a :class:`RedisSettings` or a URL.
        fail_open: on a Redis failure, warn once and act as a miss (default);
            False raises :class:`RemoteUnavailableError`.
        warn: log the one warning (False where the caller reports
            :attr:`error` itself, e.g. warmup's worker processes).
    """

    name = "redis"
    LABEL = "Redis"
    CHECK = "check the URL and that redis-server is running and reachable"

    def __init__(self, settings: RedisSettings | str, *, fail_open: bool = True, warn=True):
        if isinstance(settings, str):
            settings = RedisSettings.from_env(url=settings, environ={})
        super().__init__(settings, fail_open=fail_open, warn=warn)
        self._client = None
        self._index_refused = False  # warned that EVAL is refused (_index_members)

    # -- plumbing ----------------------------------------------------------
    @property
    def client(self):
        """The ``redis.Redis`` client (created on first use, no connection yet)."""
        if self._client is None:
            try:
                import redis
                from redis.backoff import NoBackoff
                from redis.retry import Retry
            except ImportError:
                raise RemoteUnavailableError(
                    f"a Redis URL is set ({self.location}) but the redis package is not "
                    "installed; install it with: pip install 'kernel-cache[redis]'"
                ) from None
            t = self.settings.timeout_s
            self._client = redis.Redis.from_url(
                self.settings.url,
                socket_timeout=t,
                socket_connect_timeout=t,
                retry_on_timeout=False,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
        return self._client

    def _name(self, kind: str, key: str) -> str:
        return f"{self.settings.prefix}{kind}:{key}"

    def _call(self, fn):
        return fn(self.client)

    def _is_client_error(self, e: BaseException) -> bool:
        try:
            from redis.exceptions import RedisError
        except ImportError:
            return False
        return isinstance(e, RedisError)

    def ping(self) -> bool:
        """True if Redis answers within the timeout."""
        return bool(self._run("ping", lambda c: c.ping(), False))

    def _read(self, key: str, *fields: str) -> list | None:
        """``HMGET`` of ``fields`` (``meta``, ``data``) of the entry hash of
        ``key``, each one's length checked first (``HSTRLEN`` under ``WATCH``,
        so the values read are the ones measured); None when Redis failed
        (fail-open).

        Raises:
            CorruptEntryError: a field is longer than its limit (the metadata
                :data:`~kernel_cache.store.entry.META_MAX_BYTES`, the artifact
                ``max_object_bytes``); it was not read.
        """
        name = self._name("entry", key)
        limits = {"meta": META_MAX_BYTES, "data": self.settings.max_object_bytes}
        over: list = []

        def measured(pipe):
            over.clear()
            for f in fields:
                n = pipe.hstrlen(name, f)
                if n > limits[f]:
                    over.append((f, n, limits[f]))
                    return
            pipe.multi()
            pipe.hmget(name, *fields)

        try:
            got = self._run("get", lambda c: watched(c, measured, name))
        except ContestedKeyError as e:
            raise CorruptEntryError(key, f"not read: {e}", self.location) from None
        if over:
            f, n, limit = over[0]
            what = "metadata" if f == "meta" else "artifact"
            var = "" if f == "meta" else f" ({env_settings.var('redis_max_object')})"
            raise CorruptEntryError(
                key, f"its {what} is {n} bytes, over the limit of {limit}{var}; not read",
                self.location,
            )  # fmt: skip
        return None if got is None else got[0]

    # -- Tier --------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        raw = self._read(key, "meta", "data")
        if raw is None or raw[0] is None:
            return None
        meta = parse_meta(raw[0], key, self.location)
        if raw[1] is None:
            raise CorruptEntryError(
                key, "metadata present but artifact bytes missing", self.location
            )
        return Entry(key=key, meta=meta, data=bytes(raw[1]), where=self.location)

    def get_meta(self, key: str) -> dict | None:
        raw = self._read(key, "meta")
        return None if raw is None or raw[0] is None else parse_meta(raw[0], key, self.location)

    def contains(self, key: str) -> bool:
        return bool(self._run("contains", lambda c: c.exists(self._name("entry", key)), 0))

    def put(self, key: str, data: bytes, meta: dict) -> PutResult:
        """Publish atomically (one ``MULTI``/``EXEC``), unless Redis holds these
        bytes already (:func:`same_published`: one ``HGET`` of the metadata,
        and the stored bytes' SHA-1 computed in Redis, :meth:`_holds_bytes`; no
        write), as it does when another builder of the key published first:
        builds are reproducible (docs/reproducible.md).

        Returns ``stored``, ``present`` (nothing written), or (fail-open)
        ``failed`` with the Redis error.

        Raises:
            RemoteUnavailableError: Redis failed and the tier is not fail-open.
        """
        import json

        name = self._name("entry", key)
        raw_meta = json.dumps(meta, sort_keys=True).encode()
        try:
            have = self.get_meta(key)
        except CorruptEntryError:
            have = None
        if same_published(have, meta) and self._holds_bytes(name, data):
            return PutResult(PutOutcome.PRESENT, self.location, "the same bytes are stored")

        from kernel_cache.store.lookup import record_indexes

        indexes = [self._name(f"index:{n}", v) for n, v in record_indexes(meta).items()]

        def op(c):
            p = c.pipeline(transaction=True)
            p.delete(name)
            p.hset(name, mapping={"meta": raw_meta, "data": data})
            for index in indexes:
                p.sadd(index, key)
            if self.settings.ttl_s:
                p.expire(name, self.settings.ttl_s)
                for index in indexes:
                    p.expire(index, self.settings.ttl_s)
            p.execute()
            return True

        if self._run("put", op, False):
            return PutResult(PutOutcome.STORED, self.location)
        why = f"Redis at {self.location} is unavailable: {self.error}"
        return PutResult(PutOutcome.FAILED, self.location, why)

    def _holds_bytes(self, name: str, data: bytes) -> bool:
        """Whether the hash ``name`` holds ``data`` as its artifact bytes: the
        record alone does not say so (bytes altered or cut under an intact,
        signed record would never be replaced, and every reader would reject
        them). Compared by SHA-1 computed inside Redis (:data:`_DATA_SHA1`: no
        bytes move); where scripting is refused (ACL, a proxy), by reading the
        bytes back when their length is ``len(data)``
        (:func:`_sha1_of_data_read_bounded`). False when Redis fails (then the
        write fails too)."""

        def op(c):
            from redis.exceptions import ResponseError

            try:
                got = c.eval(_DATA_SHA1, 1, name)
            except ResponseError:
                got = _sha1_of_data_read_bounded(c, name, len(data))
            return got.decode() if isinstance(got, bytes) else got

        return self._run("put", op) == hashlib.sha1(data).hexdigest()

    def delete(self, key: str) -> None:
        self._run("delete", lambda c: c.delete(self._name("entry", key)))

    def metas_by(self, index: str, of):
        """Records found through the set ``<prefix>index:<index>:<value>``
        (written with each entry): at most :data:`INDEX_MAX` members
        (:meth:`_index_members`, the reply bounded), each record read
        bounded (:meth:`get_meta`); one whose own ``of(record)`` is not
        ``value`` is dropped. Entries
        published before these sets existed are not found here."""
        found: dict[str, list[dict]] = {}

        def find(value: str) -> list[dict]:
            if value not in found:
                name = self._name(f"index:{index}", value)
                keys = self._run("index", lambda c: self._index_members(c, name), []) or []
                metas = []
                for raw in keys:
                    try:  # a writer's member need not be text: skipped, as any junk
                        key = raw.decode("ascii") if isinstance(raw, bytes) else str(raw)
                        meta = self.get_meta(key)
                        ok = meta is not None and of(meta) == value
                    except (CorruptEntryError, TypeError, ValueError, KeyError, AttributeError):
                        continue
                    if ok:
                        metas.append(meta)
                found[value] = metas
            return found[value]

        return find

    def _index_members(self, c, name: str) -> list:
        """At most :data:`INDEX_MAX` random members of the set ``name``, each
        at most :data:`INDEX_MEMBER_MAX_CHARS` long, filtered inside Redis
        (:data:`_INDEX_MEMBERS`: the reply is at most 16 KiB). Where the server
        refuses the script (an ACL without ``+@scripting``, a proxy) no member
        is read, then or later: Redis has no other command whose reply is
        bounded whatever a writer put in the set (``SRANDMEMBER`` returns the
        members whole). The index then finds nothing, which costs an
        explanation or a compatible entry, never a wrong load; a warning,
        once per tier, names the fix. A key that is not a set (a writer's) is
        an empty index. Other errors go to the caller (:meth:`_run`)."""
        from redis.exceptions import NoPermissionError, ResponseError

        if self._index_refused:
            return []
        try:
            return c.eval(_INDEX_MEMBERS, 1, name, INDEX_MAX, INDEX_MEMBER_MAX_CHARS)
        except ResponseError as e:
            text = str(e)
            if text.startswith("WRONGTYPE"):
                return []
            refused = isinstance(e, NoPermissionError) and "to run the" in text
            if not (refused or text.lower().startswith("unknown command")):
                raise
            self._index_refused = True
            log.warning(
                "Redis at %s refused EVAL (%s): its index sets are not read, since no "
                "other read of a set is bounded in bytes; lookups by runtime or build "
                "find nothing there. Builders' leases need scripting too (EVALSHA). "
                "Fix: allow scripting for this user (ACL +@scripting)",
                self.location,
                shown(text),
            )
            return []

    def keys(self) -> list[str]:
        """Every entry key held, sorted: ``SCAN`` with a ``MATCH`` pattern of the
        prefix and 64 characters of ``[0-9a-f]``, so names that are not entry
        keys (a writer's, of any length) are left in Redis, never sent. At most
        ``list_max`` entries and :func:`scan_calls_max` ``SCAN`` calls of
        :data:`SCAN_COUNT` keys; ``[]`` when Redis failed (fail-open).

        Raises:
            ListingLimitError: more entries than ``list_max``, or a database
                too large to walk in the calls allowed (names both, the bound
                ``KERNEL_CACHE_REMOTE_LIST_MAX`` and the fix).
        """
        pattern = _glob_escaped(self._name("entry", "")) + "[0-9a-f]" * 64
        cut = len(self._name("entry", ""))
        limit = self.settings.list_max
        calls = scan_calls_max(limit)

        def op(c):
            found: set[bytes | str] = set()
            cursor, made = 0, 0
            while True:
                if made == calls:
                    raise self.listing_limit(
                        f"its database did not fit in {calls} SCAN calls of {SCAN_COUNT} keys "
                        f"({len(found)} entries found in them; SCAN walks every key of the "
                        f"database: the cache's, about {KEYS_WALKED_PER_ENTRY - 1} per entry "
                        "with its index sets, and any other application's)",
                        "keep the cache in a Redis database of its own",
                    )
                cursor, names = c.scan(cursor, match=pattern, count=SCAN_COUNT)
                made += 1
                found.update(names)
                if len(found) > limit:
                    raise self.listing_limit(
                        f"it holds more than {limit} entries",
                        f"let old entries expire ({env_settings.var('redis_ttl')})",
                    )
                if not cursor:
                    return found

        out = []
        for n in self._run("scan", op, ()):
            try:
                name = (n.decode() if isinstance(n, bytes) else n)[cut:]
            except UnicodeDecodeError:  # the pattern leaves none: a proxy's or a bug's
                continue
            if ENTRY_KEY.fullmatch(name):
                out.append(name)
        return sorted(out)

    def iter_meta(self) -> Iterator[dict]:
        """Every entry's metadata, fetched 500 records per round trip, each
        one's length checked first (``HSTRLEN``, under ``WATCH``): a record
        over :data:`~kernel_cache.store.entry.META_MAX_BYTES` is skipped unread."""
        keys = self.keys()
        for i in range(0, len(keys), 500):
            batch = keys[i : i + 500]
            names = [self._name("entry", k) for k in batch]
            read: list[str] = []

            def op(c, names=names, batch=batch, read=read):
                def measured(pipe):
                    lengths = c.pipeline(transaction=False)
                    for n in names:
                        lengths.hstrlen(n, "meta")
                    sizes = lengths.execute()
                    read[:] = [k for k, n in zip(batch, sizes, strict=True) if n <= META_MAX_BYTES]
                    pipe.multi()
                    for k in read:
                        pipe.hget(self._name("entry", k), "meta")

                return watched(c, measured, *names)

            try:
                raws = self._run("iter_meta", op, [])
            except ContestedKeyError as e:  # these 500 are left out, not the tier
                log.warning("%s: %d entries not listed: %s", self.location, len(batch), e)
                continue
            for key, raw in zip(read, raws, strict=False):
                if raw is None:
                    continue
                try:
                    yield parse_meta(raw, key, self.location)
                except CorruptEntryError:
                    continue

    def build_lock(self, key: str, ttl_s: float | None = None, wait_s: float | None = None):
        """A :class:`~kernel_cache.store.redis_lease.BuildLock` for ``key``."""
        from kernel_cache.store.redis_lease import BuildLock

        return BuildLock(self, key, ttl_s, wait_s)

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # closing a broken connection must not fail a run
                pass
            self._client = None


def tiers_from_env(environ: Mapping[str, str] | None = None) -> list[Tier]:
    """``[RedisTier]`` when ``KERNEL_CACHE_REDIS_URL`` is set, else ``[]``."""
    settings = RedisSettings.from_env(environ=environ)
    return [RedisTier(settings)] if settings else []
