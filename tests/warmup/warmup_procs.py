"""Helpers of the warmup process tests (``test_many_workers.py``,
``test_faults.py``): warmups started in their own process group, keys, entries
removed, ``verify --json``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kernel_cache.plan.keys import build_key
from kernel_cache.store.disk_tier import DiskTier

from ..conftest import ROOT, plain_args, run_cli, tiny_args


def cli(*args, env=None, terminal=False) -> subprocess.Popen:
    """``kernel-cache ARGS`` started in its own process group (so a test can kill
    the warmup and its compile workers together, as an OOM killer or a pod
    deletion does); with ``terminal``, as a terminal starts it: SIGINT at its
    default, even where this test runs with SIGINT ignored."""
    return subprocess.Popen(
        [sys.executable, "-m", "warmup.cli.main", *map(str, args)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if terminal else None,
    )


def keys_of(config, variants):
    return [build_key(config, v).hexdigest for v in variants]


def remove_entries(cache: Path, keys) -> None:
    tier = DiskTier(cache)
    for k in keys:
        tier.delete(k)
    tier.close()


def verify_json(model, cache, *extra, expect_rc=0, plain=False) -> dict:
    """``verify --json`` of the tiny plan (with ``plain``, of its
    :data:`~tests.conftest.PLAIN_KERNELS` build) in ``cache``."""
    engine = plain_args(model) if plain else tiny_args(model)
    proc = run_cli("verify", *engine, *extra, "--cache-dir", cache, "--json")
    assert proc.returncode == expect_rc, proc.stderr
    return json.loads(proc.stdout)


def gone(pid: int) -> bool:
    """The process has exited (absent, or a zombie not reaped yet)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text(errors="replace")
    except OSError:
        return True
    return "\nState:\tZ" in status
