"""Free TCP ports for the test servers, taken outside the kernel's ephemeral range.

A port the kernel hands out for ``bind(0)`` comes from ``ip_local_port_range``, the
same range every outgoing connection draws from. Between releasing such a port and a
server binding it, any client in the run (boto3, redis, the suite's other servers) can
take it, and the server dies with "address already in use". Ports below that range
are never handed to an outgoing connection, so only another server can race for them;
a random pick among about 20,000 makes that rare, and :class:`S3Server` retries it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOW = 10_000
_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now and this process has not
    handed out before, below the ephemeral range (falls back to ``bind(0)``)."""
    high = _ephemeral_low()
    rng = random.SystemRandom()
    if high - _LOW > 1000:
        for _ in range(200):
            port = rng.randrange(_LOW, high)
            if port in _given:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _given.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _given.add(port)
    return port
