"""TEST-ONLY fault injection. Inert unless a ``KERNEL_CACHE_TEST_*`` variable is set.

The crash and full-disk tests need a process to stop, or fail, at an exact
point of a publish that otherwise lasts milliseconds. Production never sets
these variables; every hook is a dictionary lookup when unset.

- ``KERNEL_CACHE_TEST_PAUSE_AT=point[,point]``: at a named point, write
  ``KERNEL_CACHE_TEST_PAUSE_MARKER`` (a file path, if set: "point pid") and
  sleep for an hour so the test can ``SIGKILL`` the process there.
- ``KERNEL_CACHE_TEST_FAULT=enospc@point``: raise ``OSError(ENOSPC)`` at the
  point (where a real small tmpfs cannot be mounted).

- ``KERNEL_CACHE_TEST_COMPILE_LOG=path``: every run of the compiler appends
  one line (``pid variant``) to that file (``O_APPEND``: lines from
  concurrent processes never interleave), so a test counts compiles without
  trusting warmup's own report.

Points: ``compile`` (between ``torch.export`` and AOTInductor, the lock held),
``publish-write`` (half of the artifact file written, inside the index
transaction), ``publish-commit`` (both rows written, before ``COMMIT``),
``pool-shutdown`` (warmup's process, every variant done, before it waits for
its compile workers to exit), ``s3-put`` (before an entry's PUT to S3).
"""

from __future__ import annotations

import errno
import os
import time

PAUSE_ENV = "KERNEL_CACHE_TEST_PAUSE_AT"
MARKER_ENV = "KERNEL_CACHE_TEST_PAUSE_MARKER"
FAULT_ENV = "KERNEL_CACHE_TEST_FAULT"
COMPILE_LOG_ENV = "KERNEL_CACHE_TEST_COMPILE_LOG"


def record_compile(variant: str) -> None:
    """Append ``pid variant`` to ``KERNEL_CACHE_TEST_COMPILE_LOG`` when a test set it."""
    path = os.environ.get(COMPILE_LOG_ENV)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {variant}\n".encode())
        finally:
            os.close(fd)


def hook(point: str) -> None:
    """Pause or fail at ``point`` when a test asked for it; otherwise nothing."""
    pause = os.environ.get(PAUSE_ENV)
    if pause and point in pause.split(","):
        marker = os.environ.get(MARKER_ENV)
        if marker:
            with open(marker, "a") as f:
                f.write(f"{point} {os.getpid()}\n")
        time.sleep(3600)
    fault = os.environ.get(FAULT_ENV)
    if fault == f"enospc@{point}":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")
