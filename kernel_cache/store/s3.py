"""A remote tier in an object store (S3 or any S3-compatible store, GCS, Azure
Blob, or a directory on a shared filesystem), shared by a fleet, with build
leases for one compile per key across builders.

Set ``KERNEL_CACHE_REMOTE_URL`` (or ``--remote-url``; the older
``KERNEL_CACHE_S3_URL`` / ``--s3-url`` are read too) to ``s3://BUCKET/PREFIX``,
``gs://BUCKET/PREFIX``, ``az://CONTAINER/PREFIX`` or ``file:///DIRECTORY``
(:class:`S3Settings`). This module is the tier: an entry's read and
create-once write, the index a miss lists, listing, the build lease. The
objects it keeps and the bounds of every read are
:mod:`kernel_cache.store.s3_objects`; the client, its timeouts and failure
handling :mod:`kernel_cache.store.s3_client`; the plan manifest and the fetches
ahead it allows :mod:`kernel_cache.store.s3_manifest`. docs/s3.md gives the
measurements behind the choice of client and the design, docs/shared-storage.md
the URLs and the threat model. A ``file://`` directory has the same objects;
its leases are :class:`~kernel_cache.store.file_lease.FileLease` (no
conditional overwrite there).

Entries are untrusted (:attr:`S3Tier.trusted` is False): the lookup checks
their size, sha256 and, with a signing key, signature before use. An entry is
streamed and refused from its first bytes unless its record accounts for it
(:func:`~kernel_cache.store.s3_objects.read_entry`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from kernel_cache.config import settings as env_settings
from kernel_cache.errors import ConfigError, CorruptEntryError, shown
from kernel_cache.store.disk_tier import Entry, PutOutcome, PutResult, Tier, parse_meta
from kernel_cache.store.entry import META_MAX_BYTES
from kernel_cache.store.remote_base import ENTRY_KEY, RemoteSettings
from kernel_cache.store.s3_lease import S3Lease
from kernel_cache.store.s3_manifest import PlanManifests
from kernel_cache.store.s3_objects import (
    HEAD,
    INDEX_MAX,
    MAGIC,
    META_PROBE,
    ObjectTooLargeError,
    pack,
    split_entry,
)

log = logging.getLogger("kernel_cache")


class S3Settings(RemoteSettings):
    """Where the bucket is and how long anything may wait for it.

    Fields (seconds unless noted), defaults from the ``KERNEL_CACHE_S3_*``
    variables' (:mod:`kernel_cache.config.settings`): ``url``
    (``s3://BUCKET/PREFIX``); ``timeout_s`` (connect and read timeout of every
    call); ``lock_ttl_s`` (lease expiry, renewed every third of it while
    compiling); ``lock_wait_s`` (longest wait for a live holder); ``retry_s``
    (how long a failed store is left alone, default 30); ``max_object_bytes``
    (the largest object read: a larger one is refused from its size header);
    ``list_max`` (the most names :meth:`S3Tier.keys` takes, which bounds its
    LIST requests).
    """

    VARIABLES: ClassVar[dict[str, str]] = {
        "url": "remote_url",
        "timeout_s": "s3_timeout",
        "lock_ttl_s": "s3_lock_ttl",
        "lock_wait_s": "s3_lock_wait",
        "max_object_bytes": "s3_max_object",
        "list_max": "remote_list_max",
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


#: the path of an entry object under the tier's prefix
_ENTRY_PATH = re.compile(rf"entries/({ENTRY_KEY.pattern})")
#: names an object store's LIST page holds (S3's, GCS's most)
LIST_PAGE = 1000


def list_pages(ob, store, prefix: str, limit: int, past) -> Iterator[list[dict]]:
    """obstore's LIST pages of ``prefix`` in ``store`` (``ob``: the obstore
    module), at most ``limit`` names in all: ``ceil((limit + 1) / LIST_PAGE)``
    requests at most, then ``past(count)`` is raised."""
    seen = 0
    for batch in ob.list(store, prefix, chunk_size=min(LIST_PAGE, limit + 1)):
        seen += len(batch)
        if seen > limit:
            raise past(seen)
        yield batch


def _entry_names(directory: str, limit: int, past) -> list[str]:
    """The entry keys in the ``entries`` folder of a ``file://`` directory: its
    names of 64 characters of ``[0-9a-f]`` that are no folder (a link is an
    object itself: not followed, as :func:`~kernel_cache.store.s3_objects.walk_dir`
    does). Neither the folder nor a link in its place is followed; at most
    ``limit`` names are read, of any kind, then ``past(count)`` is raised.

    Raises:
        OSError: the folder cannot be read.
    """
    try:
        fd = os.open(
            os.path.join(directory, "entries"), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        )
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link in its place: no entries there
            return []
        raise
    out, seen = [], 0
    try:
        with os.scandir(fd) as names:
            for e in names:
                seen += 1
                if seen > limit:
                    raise past(seen)
                if ENTRY_KEY.fullmatch(e.name) and not e.is_dir(follow_symlinks=False):
                    out.append(e.name)
    finally:
        os.close(fd)
    return out


def _of(of, meta: dict) -> str | None:
    try:
        return of(meta)
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


class S3Tier(PlanManifests):
    """The shared S3 tier (see the module docstring for objects and failure).

    Args:
        settings: an :class:`S3Settings` or a URL.
        fail_open: on a failure, warn once and act as a miss (default); False
            raises :class:`~kernel_cache.store.remote_base.RemoteUnavailableError`.
        warn: log the one warning (False where the caller reports :attr:`error`).
    """

    name = "s3"

    def __init__(self, settings: S3Settings | str, *, fail_open: bool = True, warn=True):
        if isinstance(settings, str):
            settings = S3Settings.from_env(url=settings, environ={})
        super().__init__(settings, fail_open=fail_open, warn=warn)

    def get(self, key: str) -> Entry | None:
        body = self._body(key)
        if body is None:
            return None
        raw_meta, data = split_entry(key, body, self.location)
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
            n = len(MAGIC) + HEAD.size
            if len(head) >= n and head[:4] == MAGIC:
                size = HEAD.unpack(head[4:n])[0]
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
        return parse_meta(split_entry(key, head, self.location)[0], key, self.location)

    def contains(self, key: str) -> bool:
        from obstore.exceptions import NotFoundError

        def op(ob, store):
            try:
                ob.head(store, f"entries/{key}")
                return True
            except (NotFoundError, FileNotFoundError):
                return False

        return bool(self._run("contains", op, False))

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
        if not ENTRY_KEY.fullmatch(value):
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
            if not ENTRY_KEY.fullmatch(key):
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
        """Every entry key held, sorted: a LIST of ``entries/`` (a ``file://``
        directory: its ``entries`` folder read, links not followed). Names that
        are not ``entries/`` and 64 characters of ``[0-9a-f]`` (a writer's, a
        builder's temporary file) are skipped. At most ``list_max`` names are
        taken, of any kind: ``ceil((list_max + 1) / 1000)`` LIST requests of at
        most 1000 names (S3's page) of at most 1024 bytes each. ``[]`` when the
        store failed (fail-open).

        Raises:
            ListingLimitError: more names under ``entries/`` than ``list_max``
                (names the store, the bound ``KERNEL_CACHE_REMOTE_LIST_MAX`` and
                the fix).
        """
        limit = self.settings.list_max

        def past(seen: int) -> Exception:
            return self.listing_limit(
                f"more than {limit} names under entries/ ({seen} listed, entries or not)",
                "remove old entries and names that are not entries "
                "(kernel-cache gc-remote --older-than AGE)",
            )

        def op(ob, store):
            if self.settings.scheme == "file":
                store  # noqa: B018 - refuses a missing directory, naming it
                return _entry_names(self.settings.directory, limit, past)
            return [
                m.group(1)
                for batch in list_pages(ob, store, "entries/", limit, past)
                for p in batch
                if (m := _ENTRY_PATH.fullmatch(p["path"]))
            ]

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


def tiers_from_env(environ: Mapping[str, str] | None = None) -> list[Tier]:
    """``[S3Tier]`` when ``KERNEL_CACHE_REMOTE_URL`` (or ``KERNEL_CACHE_S3_URL``)
    is set, else ``[]``."""
    settings = S3Settings.from_env(environ=environ)
    return [S3Tier(settings)] if settings else []
