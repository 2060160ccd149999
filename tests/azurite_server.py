"""Start and stop a private Azurite Blob server (Microsoft's Azure Storage
emulator, the npm package ``azurite``) on a free loopback port, with one
container made.

The ``azurite-blob`` program is found in ``$KERNEL_CACHE_TEST_AZURITE`` (a path;
``.ci/run`` installs it with npm when npm is there), else on PATH. Azurite
takes the well-known development account ``devstoreaccount1`` and its key;
the container is made with one Shared Key signed request (obstore makes no
containers). Every wait is bounded.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from .s3_server import free_port

ENV_TEST_AZURITE = "KERNEL_CACHE_TEST_AZURITE"
ACCOUNT = "devstoreaccount1"
#: Azurite's published development key (not a secret)
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "kc-test"


def azurite_binary() -> str | None:
    """``$KERNEL_CACHE_TEST_AZURITE``, else ``azurite-blob`` on PATH."""
    path = os.environ.get(ENV_TEST_AZURITE)
    if path:
        return path if os.access(path, os.X_OK) else None
    return shutil.which("azurite-blob")


class AzuriteServer:
    """``azurite-blob`` on ``127.0.0.1`` with :data:`CONTAINER` made.

    Raises:
        RuntimeError: no binary, or it did not answer within ``timeout`` seconds.
    """

    def __init__(self, timeout: float = 60.0):
        exe = azurite_binary()
        if exe is None:
            raise RuntimeError(f"no azurite-blob (npm install azurite, or set {ENV_TEST_AZURITE})")
        self.dir = tempfile.mkdtemp(prefix="kernel_cache-azurite-")
        self.port = free_port()
        self.log = open(os.path.join(self.dir, "azurite.log"), "wb")
        self.proc = subprocess.Popen(
            [exe, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location",
             self.dir, "--loose", "--skipApiVersionCheck", "--silent"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._make_container():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"azurite-blob did not start within {timeout} s")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """obstore's Azure variables pointing at this emulator."""
        return {
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": KEY,
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": self.endpoint,
        }

    def _make_container(self) -> bool:
        """PUT the container (Shared Key signed); True once it exists."""
        date = email.utils.formatdate(usegmt=True)
        ctype = "application/octet-stream"
        ms = {"x-ms-date": date, "x-ms-version": "2021-08-06"}
        to_sign = "\n".join(["PUT", "", "", "", "", ctype, "", "", "", "", "", ""]) + "\n"
        to_sign += "".join(f"{k}:{v}\n" for k, v in sorted(ms.items()))
        to_sign += f"/{ACCOUNT}/{ACCOUNT}/{CONTAINER}\nrestype:container"
        digest = hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()
        headers = {
            **ms,
            "Content-Type": ctype,
            "Authorization": f"SharedKey {ACCOUNT}:{base64.b64encode(digest).decode()}",
        }
        url = f"{self.endpoint}/{ACCOUNT}/{CONTAINER}?restype=container"
        req = urllib.request.Request(url, method="PUT", headers=headers, data=b"")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status < 300
        except urllib.error.HTTPError as e:
            return e.code == 409  # already there
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
