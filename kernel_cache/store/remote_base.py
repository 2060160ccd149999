"""What the Redis and S3 tiers share: settings read from the ``KERNEL_CACHE_*``
model, failure handling (warn once, stay away ``retry_s`` seconds, fail open or
raise) and the build lease's wait-renew-release loop.

:class:`RemoteSettings`' defaults are the settings model's
(:mod:`kernel_cache.config.settings`), so a default is written once.
:class:`RemoteTier` makes every call through :meth:`RemoteTier._run`; a
subclass supplies the client call (:meth:`RemoteTier._call`) and what counts as
a client failure. :class:`BuildLease` is single flight across machines; a
subclass supplies taking, extending and dropping the lease.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kernel_cache.config import settings as env_settings
from kernel_cache.errors import ConfigError, KernelCacheError, shown
from kernel_cache.store.disk_tier import Tier

log = logging.getLogger("kernel_cache")

# BuildLease.acquire outcomes
ACQUIRED = "acquired"  # we hold the lock: compile and publish
PUBLISHED = "published"  # another builder published the entry meanwhile: fetch it
BUSY = "busy"  # another builder holds the lock (only with wait=False)
TIMEOUT = "timeout"  # waited lock_wait_s for a live holder: compile without the lock
UNAVAILABLE = "unavailable"  # the remote is down: compile without the lock


#: an entry key (64 lowercase hex characters): a name under a shared tier that
#: is not one names no entry
ENTRY_KEY = re.compile(r"[0-9a-f]{64}")

#: largest lease a builder reads (bytes): ``{"holder", "expires_at"}`` is under
#: 200 bytes, a Redis lock value ~40; a larger one is no lease (not read, taken over)
LEASE_MAX_BYTES = 4096
#: how far past now + TTL a lease's expiry may lie and still name a live holder
#: (seconds): the clock skew between builders that the lease tolerates
LEASE_SLACK_S = 5.0


def lease_is_live(expires_at: object, ttl_s: float, now: float | None = None) -> bool:
    """Whether a stored lease expiry (unix seconds) names a live holder: a
    finite number after ``now`` and no further away than ``ttl_s`` plus
    :data:`LEASE_SLACK_S` (a holder renews to now + TTL; one set further ahead,
    NaN or infinite was planted, and waiting for it would stall every builder
    of the key). Anything else is expired or not a lease: taken over."""
    now = time.time() if now is None else now
    if isinstance(expires_at, bool) or not isinstance(expires_at, (int, float)):
        return False
    e = float(expires_at)
    return math.isfinite(e) and now < e <= now + ttl_s + LEASE_SLACK_S


class RemoteUnavailableError(KernelCacheError):
    """A remote tier could not be reached or failed, where the caller asked for
    it to work (``kernel-cache verify --redis-url``)."""


class ListingLimitError(KernelCacheError):
    """A listing of a shared tier's entries (``keys``, ``iter_meta``: what
    ``explain`` names the nearest entries from; ``gc-remote``'s of each prefix)
    went past the bound of ``KERNEL_CACHE_REMOTE_LIST_MAX`` and stopped there,
    rather than return part of the entries as all of them. Names the store,
    what was past the bound, the bound and the fix. Never a failure of the
    store: the tier stays up."""


class RemoteSettings(BaseModel):
    """The fields both remotes have (seconds): ``url``, ``timeout_s`` (of every
    call), ``lock_ttl_s`` (lease expiry, renewed every third of it while
    compiling), ``lock_wait_s`` (longest wait for a live holder before
    compiling anyway), ``retry_s`` (how long a failed remote is left alone,
    default 30), ``list_max`` (the most entries a listing takes, which bounds
    its requests: ``KERNEL_CACHE_REMOTE_LIST_MAX``, default 100,000). A
    subclass sets the defaults from the settings model and :attr:`VARIABLES`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: field -> the settings-model field it is read from by :meth:`from_env`
    VARIABLES: ClassVar[dict[str, str]] = {}
    #: field -> the command-line flag that sets it, for error messages
    FLAGS: ClassVar[dict[str, str]] = {}
    #: older names a field is still read under (named in its errors too)
    ALIASES: ClassVar[dict[str, str]] = {}
    LABEL: ClassVar[str] = "remote"

    url: str
    retry_s: float = 30.0
    #: the most entries a listing takes (it bounds the listing's requests)
    list_max: int = Field(
        env_settings.default("remote_list_max"), ge=1, le=env_settings.LIST_MAX_MAX
    )

    @field_validator("timeout_s", "lock_ttl_s", "lock_wait_s", "retry_s", check_fields=False)
    @classmethod
    def _positive(cls, v: float) -> float:
        if not 0 < v <= 1e9:
            raise ValueError(f"{v}: must be > 0 and <= 1e9 seconds")
        return v

    @classmethod
    def from_env(
        cls, url: str | None = None, environ: Mapping[str, str] | None = None, **overrides
    ):
        """Settings from ``url`` (else the URL variable) and the other variables
        of :attr:`VARIABLES`; ``overrides`` (not None) win. None when no URL is set.

        Raises:
            ConfigError: a malformed URL or number (names the flag or variable and value).
        """
        if not url:
            url = env_settings.get(cls.VARIABLES["url"], environ)
            if url is None:
                return None
        fields: dict = {"url": url}
        for name, var in cls.VARIABLES.items():
            if name != "url":
                fields[name] = env_settings.get(var, environ)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**fields)
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            msgs = "; ".join(
                f"{cls._source(str(x['loc'][0])) if x['loc'] else 'settings'}: "
                f"{x['msg'].removeprefix('Value error, ')}"
                for x in e.errors()
            )
            raise ConfigError(f"{cls.LABEL} settings: {msgs}") from None

    @classmethod
    def _source(cls, field: str) -> str:
        var = cls.VARIABLES.get(field)
        if var is None:
            return field
        variable = env_settings.var(var)
        out = f"{cls.FLAGS[field]} / {variable}" if field in cls.FLAGS else variable
        return f"{out} (or {cls.ALIASES[field]})" if field in cls.ALIASES else out


class RemoteTier(Tier):
    """A remote tier's failure handling.

    Args:
        settings: the remote's settings.
        fail_open: on a failure, warn once and act as a miss (default); False
            raises :class:`RemoteUnavailableError`.
        warn: log the one warning (False where the caller reports
            :attr:`error` itself, e.g. warmup's worker processes).
    """

    trusted = False
    corrupt_is_miss = True
    repair = "publish"
    LABEL = "remote"
    #: the fix named when a call fails and the tier is not fail-open
    CHECK = "check the URL and that the server is reachable"

    def __init__(self, settings: RemoteSettings, *, fail_open: bool = True, warn=True):
        self.settings = settings
        self.location = env_settings.redact_url(settings.url)
        self.location_flag = settings.FLAGS.get("url", "--remote-url")
        self.fail_open = fail_open
        self.warn = warn
        #: the first failure ("ConnectionError: ..."), None while all went well
        self.error: str | None = None
        self._warned = False
        self._down_until = 0.0

    def _call(self, fn):
        """``fn`` called with the client (the subclass's form)."""
        raise NotImplementedError

    def _is_client_error(self, e: BaseException) -> bool:
        """Whether ``e`` is a failure of the client package (not a bug)."""
        return False

    def _is_failure(self, e: BaseException) -> bool:
        return isinstance(e, (OSError, RemoteUnavailableError)) or self._is_client_error(e)

    def note_failure(self, e: BaseException | str) -> None:
        """Record a failure (an exception, or the text another process reported):
        keep :attr:`error`, warn once, leave the remote alone for ``retry_s``
        seconds. Never raises."""
        if isinstance(e, (str, RemoteUnavailableError)):
            text = str(e)
        else:  # the server's own text (a 403's XML body): whole but bounded, escaped
            text = f"{type(e).__name__}: {shown(str(e))}"
        if self.error is None:
            self.error = text
        self._down_until = time.monotonic() + self.settings.retry_s
        if self.warn and self.fail_open and not self._warned:  # else the caller raises
            self._warned = True
            log.warning(
                "%s at %s is unavailable (%s); carrying on with the local tiers "
                "(next try in %.0f s)",
                self.LABEL,
                self.location,
                text,
                self.settings.retry_s,
            )

    def listing_limit(self, past: str, fix: str) -> ListingLimitError:
        """The error of a listing stopped at ``list_max``: ``past`` says what
        went over it (with the counts so far), ``fix`` what to do besides
        raising the bound."""
        name = env_settings.var("remote_list_max")
        limit = self.settings.list_max
        return ListingLimitError(
            f"{self.LABEL} at {self.location}: {past}, over what {name}={limit} allows; "
            f"the listing stopped there and none of it is used; fix: raise {name} "
            f"(e.g. {name}={min(limit * 10, env_settings.LIST_MAX_MAX)}), or {fix}"
        )

    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _run(self, what: str, fn, default=None, *, fail_open: bool | None = None):
        """:meth:`_call` ``(fn)``; on a failure :meth:`note_failure` and ``default``
        (or :class:`RemoteUnavailableError` when not fail-open: ``fail_open``,
        else the tier's). Not-found, already-exists and precondition answers
        are the caller's to handle inside ``fn``."""
        fail_open = self.fail_open if fail_open is None else fail_open
        if self.is_down():
            if not fail_open:
                raise RemoteUnavailableError(
                    f"{self.LABEL} at {self.location} is down: {self.error}"
                )
            return default
        try:
            return self._call(fn)
        except Exception as e:
            if not self._is_failure(e):
                raise
            self.note_failure(e)
            if not fail_open:
                raise RemoteUnavailableError(
                    f"{self.LABEL} at {self.location} failed during {what}: {self.error}; "
                    f"{self.CHECK}"
                ) from None
            return default


class BuildLease:
    """Cross-machine single flight for compiling one key.

    :meth:`acquire` returns :data:`ACQUIRED` (compile, publish, then
    :meth:`release`), :data:`PUBLISHED` (another builder published the entry
    while we waited: fetch it), :data:`BUSY` (held elsewhere, ``wait=False``),
    :data:`TIMEOUT` (a live holder kept it ``lock_wait_s`` seconds) or
    :data:`UNAVAILABLE` (the remote failed). Only ACQUIRED holds the lease,
    renewed every ``ttl / 3`` by a thread. The token stored is
    ``host:pid:random`` so a waiter can name the holder.
    """

    #: for log messages ("build lock", "S3 build lease")
    WHAT = "build lease"

    def __init__(self, tier: RemoteTier, key: str, ttl_s=None, wait_s=None, poll_s: float = 0.25):
        self.tier = tier
        self.key = key
        self.ttl_s = float(ttl_s or tier.settings.lock_ttl_s)
        self.wait_s = float(tier.settings.lock_wait_s if wait_s is None else wait_s)
        self.poll_s = poll_s
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.lost = False
        self.waited_s = 0.0
        self._noted = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the subclass's part -------------------------------------------------
    def _take(self) -> bool | None:
        """Try once to take the lease: True taken, False held elsewhere, None failed."""
        raise NotImplementedError

    def _published(self) -> bool | None:
        """Whether the entry is published; None when the remote failed."""
        raise NotImplementedError

    def _extend(self) -> bool | None:
        """Renew the held lease: True renewed, False lost (taken over), None failed."""
        raise NotImplementedError

    def _drop(self) -> None:
        """Give the held lease up (never raises)."""
        raise NotImplementedError

    def holder(self) -> str | None:
        """The token of the current holder (at most :data:`LEASE_MAX_BYTES`,
        store text: quote it with :func:`~kernel_cache.errors.shown`), or None."""
        raise NotImplementedError

    def _note_takeover(self, why: str) -> None:
        """Log, once per lease, that a stored lease was no live holder's and is
        taken over (``why``: what it held, already quoted)."""
        if not self._noted:
            self._noted = True
            log.warning(
                "%s for %s names no live holder (%s); taking it over", self.WHAT, self.key[:16], why
            )

    # -- the loop ---------------------------------------------------------------
    def acquire(self, wait: bool = True) -> str:
        t0 = time.monotonic()
        deadline = t0 + (self.wait_s if wait else 0.0)
        try:
            while True:
                got = self._take()
                if got is None:
                    return UNAVAILABLE
                if got:
                    self._start_renewal()
                    return ACQUIRED
                present = self._published()
                if present is None:
                    return UNAVAILABLE
                if present:
                    return PUBLISHED
                if not wait:
                    return BUSY
                if time.monotonic() >= deadline:
                    log.warning(
                        "%s for %s still held by %s after %.0f s; compiling anyway",
                        self.WHAT,
                        self.key[:16],
                        shown(self.holder()),
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
            ok = self._extend()
            if ok is False:
                self.lost = True
                log.warning(
                    "lost the %s for %s (it expired: was this process paused longer than "
                    "%.1f s?); another builder may compile it too",
                    self.WHAT,
                    self.key[:16],
                    self.ttl_s,
                )
                return
            if ok is None:  # the remote failed (noted): the lease expires on its own
                return

    def release(self) -> None:
        """Stop renewing and give the lease up if we still hold it. Never raises."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.tier.settings.timeout_s + 1)
            self._thread = None
        self._drop()
