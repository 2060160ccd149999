"""The intra-op thread count of a serving process (``KERNEL_CACHE_NUM_THREADS``).

torch starts as many OpenMP threads as the CPUs the process's affinity mask
allows, and does not read a cgroup CPU quota: a container limited to 2 CPUs on
a 64-core host runs 64 threads that the kernel throttles to 2 CPUs' worth of
time, and an attention call waits on its slowest thread (docs/usage.md,
"Threads"). :func:`apply` runs once in :func:`~kernel_cache.runtime.load.load_plan`
for a CPU plan.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from kernel_cache.config import settings

log = logging.getLogger("kernel_cache")

#: Where the cgroup v2 hierarchy is mounted.
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_quota(root: Path = CGROUP_ROOT) -> int | None:
    """CPUs the process's cgroup may use, rounded up: ``ceil(quota / period)``
    from cgroup v2's ``cpu.max`` (``"200000 100000"`` -> 2) or v1's
    ``cpu/cpu.cfs_quota_us`` and ``cpu.cfs_period_us``; None without a quota
    (``"max"``, ``-1``) or a readable file."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else max(1, math.ceil(quota / period))


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on: its affinity mask, capped by the cgroup quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cpu_quota(root)
    return n if quota is None else min(n, quota)


def apply(environ=None, root: Path = CGROUP_ROOT) -> int:
    """Set torch's intra-op threads as ``KERNEL_CACHE_NUM_THREADS`` says; returns
    the count in force afterwards.

    * ``auto`` (default): lower the count to :func:`usable_cpus` when it is
      higher, unless ``OMP_NUM_THREADS`` is set (the user chose);
    * ``N``: set N;
    * ``keep``: change nothing.

    Raises:
        SettingError: the variable is not ``auto``, ``keep`` or an integer >= 1.
    """
    import torch

    environ = os.environ if environ is None else environ
    want = settings.get("num_threads", environ)
    have = torch.get_num_threads()
    if want == "keep" or (want == "auto" and environ.get("OMP_NUM_THREADS")):
        return have
    n = min(have, usable_cpus(root)) if want == "auto" else int(want)
    if n != have:
        torch.set_num_threads(n)
        log.info("intra-op threads: %d (was %d; %s=%s)", n, have, settings.var("num_threads"), want)
    return n
