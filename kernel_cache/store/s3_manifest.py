"""The plan manifest of the object-store tier (:class:`~kernel_cache.store.s3.S3Tier`):
written by a warmup once every key of its plan is published, read by an
engine that announced its keys, and the entry fetches ahead of the lookups it
allows.

An engine calls :meth:`PlanManifests.expect` with its plan's keys, in lookup
order; its first lookup reads ``manifests/<sha256 of the sorted keys>.json``
(at most :func:`~kernel_cache.store.s3_objects.manifest_limit` bytes). If it
lists exactly these keys, entries are fetched ahead,
:data:`~kernel_cache.store.s3_objects.PREFETCH` at a time in plan order, so at
most that many bodies are in memory beside the one being checked; without it,
one GET per key. Every entry object is streamed and checked as it arrives
(:func:`~kernel_cache.store.s3_objects.read_entry`). A warmup writes the
manifest create-once and writes it again when the one there is older than
:data:`~kernel_cache.store.s3_objects.MANIFEST_RENEW_S`, so ``kernel-cache
gc-remote`` keeps a plan still warmed.
"""

from __future__ import annotations

import logging
import time

from pydantic import ValidationError

from kernel_cache.errors import CorruptEntryError
from kernel_cache.store.base import PutOutcome, PutResult
from kernel_cache.store.remote_base import RemoteSettings
from kernel_cache.store.s3_client import ObjectStoreClient
from kernel_cache.store.s3_objects import (
    MANIFEST_FORMAT,
    MANIFEST_RENEW_S,
    PREFETCH,
    NotAFileError,
    ObjectTooLargeError,
    S3Manifest,
    manifest_limit,
    manifest_name,
    read_entry,
)

log = logging.getLogger("kernel_cache")


class PlanManifests(ObjectStoreClient):
    """The plan-manifest layer of :class:`~kernel_cache.store.s3.S3Tier`: an
    entry object read (:meth:`_body`) from the fetches ahead or by one GET,
    and the manifest read and published. Not a tier by itself.

    Args:
        settings, fail_open, warn: as :class:`~kernel_cache.store.s3_client.ObjectStoreClient`.
    """

    def __init__(self, settings: RemoteSettings, *, fail_open: bool = True, warn=True):
        super().__init__(settings, fail_open=fail_open, warn=warn)
        self._record_check = None  # check_records
        self._order: list[str] = []
        self._expected: list[str] = []
        self._manifest_read = False
        self._listed = False
        self._ahead: dict = {}  # key -> Future of _fetch
        self._done: set[str] = set()
        self._pool = None

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
        comes (:func:`~kernel_cache.store.s3_objects.read_entry`): its size
        (response headers) within ``max_object_bytes``, then its header and
        record, which must pass :meth:`check_records`' check, before a buffer of
        the object's size is made. An object failing a check is returned as the
        error with the rest of its body unread. None: absent, or the store
        failed (fail-open)."""
        path = f"entries/{key}"
        limit = self.settings.max_object_bytes

        def op(ob, store):
            got = self._open(ob, store, path, limit)
            if not isinstance(got, tuple):
                return got
            size, chunks = got
            return read_entry(key, size, chunks, self.location, self._record_check)

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

    def _body(self, key: str) -> bytes | bytearray | None:
        self._read_manifest()
        body = self._fetched(key)
        if isinstance(body, ObjectTooLargeError):
            raise CorruptEntryError(key, str(body), self.location)
        if isinstance(body, CorruptEntryError):
            raise body
        return body

    def close(self) -> None:
        """Cancel the fetches ahead and stop their threads; forget the store."""
        for f in self._ahead.values():
            f.cancel()
        self._ahead = {}
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        super().close()
