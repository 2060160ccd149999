"""The build lock of the Redis tier: ``<prefix>lock:<key>`` names the builder
compiling a key, so that one builder across the fleet compiles it
(:meth:`kernel_cache.store.redis.RedisTier.build_lock`; docs/sharing.md).
"""

from __future__ import annotations

import logging

from kernel_cache.errors import shown
from kernel_cache.store.redis_watch import ContestedKeyError, watched
from kernel_cache.store.remote_base import LEASE_MAX_BYTES, LEASE_SLACK_S, BuildLease, RemoteTier

log = logging.getLogger("kernel_cache")


class BuildLock(BuildLease):
    """:class:`~kernel_cache.store.remote_base.BuildLease` on Redis: redis-py's
    :class:`redis.lock.Lock` on ``<prefix>lock:<key>``, the entry's hash
    checked for a publish while waiting."""

    WHAT = "build lock"

    def __init__(self, tier: RemoteTier, key: str, ttl_s=None, wait_s=None, poll_s: float = 0.25):
        super().__init__(tier, key, ttl_s, wait_s, poll_s)
        self.name = tier._name("lock", key)
        self._lock = None
        self._held = False

    def _redis_lock(self, client):
        if self._lock is None:
            self._lock = client.lock(
                self.name, timeout=self.ttl_s, thread_local=False, raise_on_release_error=False
            )
        return self._lock

    def holder(self) -> str | None:
        """The lock's value: its first :data:`LEASE_MAX_BYTES` (``GETRANGE``)."""
        from redis.exceptions import ResponseError

        def op(c):
            try:
                return c.getrange(self.name, 0, LEASE_MAX_BYTES - 1) or None
            except ResponseError:  # WRONGTYPE: not a string
                return b"(not a lock)"

        raw = self.tier._run("lock holder", op)
        return raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw

    def _take(self) -> bool | None:
        got = self.tier._run(
            "lock", lambda c: self._redis_lock(c).acquire(blocking=False, token=self.token)
        )
        if got is False:
            got = self.tier._run("lock", self._take_over)
        self._held = bool(got)
        return got

    def _take_over(self, c) -> bool | None:
        """Take the lock over if it names no live holder (a writer planted it):
        not a string, longer than :data:`LEASE_MAX_BYTES`, no expiry, or an
        expiry further than TTL + :data:`LEASE_SLACK_S` away. Checked and set
        under ``WATCH``, so a holder that takes it meanwhile keeps it. True taken;
        None when the lock changed during every try (the builder goes on
        without it, as without Redis, and a warning says so once)."""
        limit_ms = (self.ttl_s + LEASE_SLACK_S) * 1000
        why: list[str] = []

        def check(pipe):
            why.clear()
            kind = pipe.type(self.name)
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind == "none":
                return  # released meanwhile: the next try takes it
            pttl = pipe.pttl(self.name)
            if kind != "string":
                why.append(f"a Redis {shown(kind, 20)}, not a lock")
            elif (n := pipe.strlen(self.name)) > LEASE_MAX_BYTES:
                why.append(f"{n} bytes, over {LEASE_MAX_BYTES}")
            elif pttl < 0:
                why.append(f"holder {shown(pipe.getrange(self.name, 0, 79))} with no expiry")
            elif pttl > limit_ms:
                why.append(
                    f"holder {shown(pipe.getrange(self.name, 0, 79))} for {pttl / 1000:.0f} s, "
                    f"beyond the {self.ttl_s:g} s TTL"
                )
            else:
                return
            pipe.multi()
            pipe.set(self.name, self.token, px=int(self.ttl_s * 1000))

        try:
            watched(c, check, self.name)
        except ContestedKeyError as e:  # this lock alone: build without it, as if Redis were down
            self._note_contested(e)
            return None
        if not why:
            return False
        self._note_takeover(why[0])
        self._redis_lock(c).local.token = self.token.encode()
        return True

    def _note_contested(self, e: Exception) -> None:
        if not self._noted:
            self._noted = True
            log.warning("%s for %s: %s; building without it", self.WHAT, self.key[:16], e)

    def _published(self) -> bool | None:
        entry = self.tier._name("entry", self.key)
        return self.tier._run("lock", lambda c: c.exists(entry))

    def _extend(self) -> bool | None:
        from redis.exceptions import LockNotOwnedError

        try:
            self._lock.reacquire()
        except LockNotOwnedError:
            return False
        except Exception as e:  # Redis went away: the lock expires on its own
            self.tier.note_failure(e)
            return None
        return True

    def _drop(self) -> None:
        if self._held:
            self._held = False
            self.tier._run("unlock", lambda c: self._release_quietly(), fail_open=True)

    def _release_quietly(self):
        from redis.exceptions import LockError

        try:
            self._lock.release()
        except LockError:  # expired and maybe taken by another builder: not ours to delete
            pass
