"""Start and stop a real, private ``redis-server`` on a free loopback port.

Used by the tests (when ``KERNEL_CACHE_TEST_REDIS_URL`` is not set, or when a
test must kill its server) and by ``benchmarks/fleet_load.py``. Loopback only,
no persistence, every wait bounded.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time

from .ports import free_port

ENV_TEST_REDIS_URL = "KERNEL_CACHE_TEST_REDIS_URL"


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A ``redis-server`` child process on ``127.0.0.1:port``.

    Raises:
        RuntimeError: no ``redis-server`` binary, or it did not answer PING
            within ``start_timeout`` seconds (after 3 port attempts).
    """

    def __init__(self, start_timeout: float = 15.0):
        exe = redis_server_binary()
        if exe is None:
            raise RuntimeError("no redis-server binary (Debian: apt-get install -y redis-server)")
        self.dir = tempfile.mkdtemp(prefix="kernel_cache-redis-")
        self.proc = None
        for _ in range(3):  # a free port can be taken between probe and bind
            self.port = free_port()
            self.proc = subprocess.Popen(
                [
                    exe,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self.dir,
                    "--protected-mode",
                    "yes",
                    "--loglevel",
                    "warning",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + start_timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _answers(self.port):
                    return
                time.sleep(0.05)
            self._terminate()
        shutil.rmtree(self.dir, ignore_errors=True)
        raise RuntimeError(f"redis-server did not start within {start_timeout} s")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-conversation, as a crashed host would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def _terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def stop(self) -> None:
        self._terminate()
        shutil.rmtree(self.dir, ignore_errors=True)
