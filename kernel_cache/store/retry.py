"""The one retry loop of the store: call, and on a retryable error back off and call again."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def retry(
    fn: Callable[[], T],
    *,
    when: Callable[[BaseException], bool],
    timeout: float | None = None,
    attempts: int | None = None,
    delay: float = 0.01,
    max_delay: float = 0.5,
    jitter: float = 0.0,
) -> T:
    """Call ``fn`` until it returns; an exception for which ``when(e)`` is true
    is retried, any other propagates at once.

    Args:
        timeout: seconds after the first call past which the last error propagates.
        attempts: calls in all (None: no limit but ``timeout``).
        delay: seconds slept before the second call; doubled each time up to
            ``max_delay`` (seconds), never past ``timeout``.
        jitter: each sleep is scaled by a random factor in ``1 +- jitter``, so
            processes started together do not retry in lockstep.

    Raises:
        the last exception of ``fn`` once ``attempts`` or ``timeout`` is spent.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    n = 0
    while True:
        n += 1
        try:
            return fn()
        except Exception as e:
            if not when(e) or (attempts is not None and n >= attempts):
                raise
            pause = delay * random.uniform(1 - jitter, 1 + jitter) if jitter else delay
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                pause = min(left, pause)
            if pause > 0:
                time.sleep(pause)
            delay = min(max_delay, delay * 2)
