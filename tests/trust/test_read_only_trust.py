"""Engine start and verify on read-only and untrusted cache directories (no compiles).

Tests run as root in CI, and ``chmod -R a-w`` does not stop root from writing.
So "writes nothing" is checked by listing and hashing every file before and
after, and, where ``mount`` is permitted, again on a read-only bind mount,
where any write fails with EROFS even for root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kernel_cache import load_plan
from kernel_cache.errors import UntrustedCacheError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.store.disk_tier import DiskTier
from kernel_cache.trust.permissions import ENV_ALLOW_SHARED

from ..conftest import N_TINY, ROOT, run_cli, tiny_args
from ..fsutil import readonly_bind, tree_state

pytestmark = pytest.mark.compile  # needs the session's warmed cache

ENGINE = r"""
import json, sys, torch
from kernel_cache import load_plan, make_config
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))
rt = load_plan(cfg, sys.argv[2])
kc = torch.randn(3, 16, 2, 8)
out = rt.decode(torch.randn(2, 4, 8), kc, kc, torch.zeros(2, 2, dtype=torch.int32), [5, 20])
print(json.dumps({"stats": rt.stats(), "shape": list(out.shape)}))
"""


def engine_start(model, cache, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", ENGINE, str(model), str(cache)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def check_loads(model, cache) -> None:
    proc = run_cli("verify", *tiny_args(model), "--cache-dir", cache, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] is True
    proc = engine_start(model, cache)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["stats"]["loads"] == N_TINY and doc["stats"]["compiles"] == 0
    assert doc["shape"] == [2, 4, 8]


def test_read_only_copy_loads_and_is_unchanged(cache_copy, tiny_model):
    subprocess.run(["chmod", "-R", "a-w", str(cache_copy)], check=True)
    try:
        before = tree_state(cache_copy)
        check_loads(tiny_model, cache_copy)
        assert tree_state(cache_copy) == before  # no lock, db, WAL or temp file; same bytes
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(cache_copy)], check=True)


def test_read_only_bind_mount_loads_and_warmup_needs_no_write(
    cache_copy, tmp_path, tiny_model, tiny_config
):
    with readonly_bind(cache_copy, tmp_path / "ro") as mounted:
        if not mounted:
            pytest.skip("mount --bind is not permitted here (needs root); see the chmod test")
        ro = tmp_path / "ro"
        before = tree_state(ro)
        check_loads(tiny_model, ro)
        proc = run_cli("warmup", *tiny_args(tiny_model), "--cache-dir", ro, "--json")
        assert proc.returncode == 0, proc.stderr  # everything cached: nothing to write
        assert json.loads(proc.stdout)["cached"] == N_TINY
        assert tree_state(ro) == before
    # the same read-only directory with a variant missing: warmup says it cannot write
    v = Bucketer(tiny_config).variants[0]
    tier = DiskTier(cache_copy)
    tier.delete(build_key(tiny_config, v).hexdigest)
    tier.close()
    with readonly_bind(cache_copy, tmp_path / "ro") as mounted:
        proc = run_cli("warmup", *tiny_args(tiny_model), "--cache-dir", tmp_path / "ro")
    assert proc.returncode == 2
    assert f"cache directory {tmp_path / 'ro'} is not writable" in proc.stderr
    assert f"1 of the plan's {N_TINY} variants are not cached" in proc.stderr
    assert f"bytes, from the mean size of the {N_TINY - 1} entries" in proc.stderr


def test_world_writable_cache_is_refused_and_the_opt_out_loads(
    cache_copy, tiny_model, tiny_config, monkeypatch
):
    cache_copy.chmod(0o777)
    proc = run_cli("verify", *tiny_args(tiny_model), "--cache-dir", cache_copy)
    assert proc.returncode == 2
    for part in (
        f"refusing cache directory {cache_copy}",
        "writable by group and others",
        "mode 0777",
        f"chmod -R go-w {cache_copy}",
        "--insecure-allow-shared-dir",
    ):
        assert part in proc.stderr
    with pytest.raises(UntrustedCacheError):
        load_plan(tiny_config, cache_copy)
    proc = run_cli("warmup", *tiny_args(tiny_model), "--cache-dir", cache_copy)
    assert proc.returncode == 2 and "refusing cache directory" in proc.stderr

    proc = run_cli(
        "verify", *tiny_args(tiny_model), "--cache-dir", cache_copy, "--insecure-allow-shared-dir"
    )
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setenv(ENV_ALLOW_SHARED, "1")
    assert load_plan(tiny_config, cache_copy).stats()["loads"] == N_TINY
