"""Redis transactions a writer cannot hold: :func:`watched`, redis-py's
``transaction`` with a bounded number of tries, for the Redis tier
(:mod:`kernel_cache.store.redis`) and its build lock
(:mod:`kernel_cache.store.redis_lease`)."""

from __future__ import annotations

from kernel_cache.errors import shown

#: Tries of a read or a lock takeover whose watched keys change between its
#: ``WATCH`` and ``EXEC``. redis-py's ``transaction`` tries again without end,
#: so a writer that rewrites the key in a loop would hold the reader there; a
#: builder writes an entry once, so even a second try is rare.
WATCH_TRIES = 5


class ContestedKeyError(Exception):
    """The keys a :func:`watched` transaction read changed before its ``EXEC``
    in each of :data:`WATCH_TRIES` tries. About those keys alone: the tier is
    not failing (a writer could otherwise switch the tier off fleet-wide by
    rewriting one key), so it is not a Redis error and ``_run`` passes it on."""


def watched(c, fn, *names: str) -> list:
    """redis-py's ``c.transaction(fn, *names)`` (``WATCH`` ``names``; ``fn(pipe)``
    reads, then queues commands after ``pipe.multi()``; ``EXEC``), tried at most
    :data:`WATCH_TRIES` times; returns ``EXEC``'s replies. Only an aborted
    ``EXEC`` is tried again: a connection that fails or times out while
    watching (redis-py's ``WatchError`` raised from that error) is raised at
    once, as the tier's failure.

    Raises:
        ContestedKeyError: the keys changed during every try (the message names
            them, escaped, and the count).
    """
    from redis.exceptions import WatchError

    with c.pipeline(transaction=True) as pipe:
        for _ in range(WATCH_TRIES):
            try:
                pipe.watch(*names)
                fn(pipe)
                return pipe.execute()
            except WatchError as e:
                if e.__context__ is not None:  # the connection, not a writer
                    raise
    raise ContestedKeyError(
        f"{shown(' '.join(names), 200)} changed between WATCH and EXEC in each of "
        f"{WATCH_TRIES} tries: another client keeps rewriting it"
    )
