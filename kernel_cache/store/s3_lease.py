"""The build lease of the S3 tier: ``leases/<key>`` names the builder compiling
a key, so that one builder across the fleet compiles it
(:meth:`kernel_cache.store.s3.S3Tier.build_lock`; docs/s3.md).
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernel_cache.errors import shown
from kernel_cache.store.remote_base import LEASE_MAX_BYTES, BuildLease, RemoteTier, lease_is_live


class S3LeaseDoc(BaseModel):
    """``leases/<key>``: who compiles the key, until when."""

    model_config = ConfigDict(frozen=True, extra="allow")

    holder: str = Field("", description="host:pid:token of the builder")
    expires_at: float = Field(description="unix seconds; 0 once released")


class S3Lease(BuildLease):
    """:class:`~kernel_cache.store.remote_base.BuildLease` on S3.

    The lease object ``leases/<key>`` holds ``{"holder", "expires_at"}`` (unix
    seconds). Taken with ``If-None-Match: *``; an expired one (its holder died or
    released it), and one that names no live holder (an expiry beyond now + TTL
    + :data:`~kernel_cache.store.remote_base.LEASE_SLACK_S`, NaN or infinite;
    over :data:`~kernel_cache.store.remote_base.LEASE_MAX_BYTES`, or not a lease
    document: a writer planted it; logged once) is taken over by a
    conditional overwrite ``If-Match: <ETag>``
    of the lease read, so of two builders racing for it one wins. Renewed with
    ``If-Match`` on our own ETag (a lease taken over after we stalled is lost,
    not stolen back) and released by overwriting it as expired (``If-Match``
    again). Expiry compares wall clocks of builders: their skew must stay well
    below the TTL. ``tier`` is the :class:`~kernel_cache.store.s3.S3Tier` it
    reads and writes through (this module does not import it: s3.py imports this one).
    """

    WHAT = "S3 build lease"

    def __init__(self, tier: RemoteTier, key: str, ttl_s=None, wait_s=None, poll_s: float = 0.25):
        super().__init__(tier, key, ttl_s, wait_s, poll_s)
        self.path = f"leases/{key}"
        self._etag: str | None = None

    def _body(self, expires_at: float) -> bytes:
        return S3LeaseDoc(holder=self.token, expires_at=expires_at).model_dump_json().encode()

    def _read(self) -> tuple[dict, str] | None | bool:
        """``(lease, etag)``, None if there is none, False on a failure. An
        object over :data:`LEASE_MAX_BYTES` (its size from the response
        headers: the body is not read) or not a lease document reads as
        ``{"invalid": why}``."""
        from obstore.exceptions import NotFoundError

        def op(ob, store):
            try:
                r = ob.get(store, self.path)
            except (NotFoundError, FileNotFoundError):
                return None
            size = int(r.meta["size"])
            if size > LEASE_MAX_BYTES:
                return {"invalid": f"{size} bytes, over {LEASE_MAX_BYTES}"}, r.meta["e_tag"]
            raw = bytes(r.bytes())
            try:
                doc = S3LeaseDoc.model_validate_json(raw).model_dump()
            except ValidationError:
                doc = {"invalid": f"not a lease: {shown(raw, 80)}"}
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

    def _take(self) -> bool | None:
        """Create the lease, else take over one that names no live holder
        (:func:`~kernel_cache.store.remote_base.lease_is_live`: expired, or
        planted with an expiry beyond now + TTL, NaN or infinite; or not a
        lease) with ``If-Match`` on the ETag read."""
        etag = self._put("create", time.time() + self.ttl_s)
        if etag is None:
            got = self._read()
            if got is False:
                return None
            if got is not None:
                doc, now = got[0], time.time()
                expires = doc.get("expires_at")
                if "invalid" in doc:
                    self._note_takeover(doc["invalid"])
                elif not lease_is_live(expires, self.ttl_s, now) and not expires <= now:
                    self._note_takeover(  # NaN, infinite or too far ahead: planted
                        f"holder {shown(doc.get('holder'), 80)} until {expires!r}, beyond now "
                        f"+ the {self.ttl_s:g} s TTL"
                    )
                if not lease_is_live(expires, self.ttl_s, now):
                    etag = self._put({"e_tag": got[1]}, time.time() + self.ttl_s)
        if etag is False:
            return None
        if etag is None:
            return False
        self._etag = etag
        return True

    def _published(self) -> bool | None:
        if self.tier.contains(self.key):
            return True
        return None if self.tier.is_down() else False

    def _extend(self) -> bool | None:
        etag = self._put({"e_tag": self._etag}, time.time() + self.ttl_s)
        if etag is None or etag is False:
            return None if etag is False else False  # failed (noted) / taken over
        self._etag = etag
        return True

    def _drop(self) -> None:
        if self._etag is not None and not self.lost:
            try:
                self._put({"e_tag": self._etag}, 0.0)
            except Exception:  # releasing must not fail a run; the lease expires anyway
                pass
        self._etag = None
