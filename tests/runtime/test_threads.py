"""KERNEL_CACHE_NUM_THREADS: the intra-op thread count a serving process gets,
read from torch in fresh processes (a real cgroup quota cannot be set here, so
the cgroup files are real files in a temporary root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kernel_cache.runtime.threads import cpu_quota

from ..conftest import ROOT, TINY_LIMITS


@pytest.mark.parametrize(
    "files, quota",
    [
        ({"cpu.max": "200000 100000\n"}, 2),
        ({"cpu.max": "150000 100000\n"}, 2),
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_cpu_quota_reads_cgroup_v2_and_v1(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(tmp_path) == quota


APPLY = r"""
import json, os, sys
from pathlib import Path
import torch
default = torch.get_num_threads()
from kernel_cache.runtime.threads import apply
try:
    n = apply(root=Path(sys.argv[1]))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
else:
    print(json.dumps({"default": default, "returned": n, "now": torch.get_num_threads()}))
"""


def _apply(root, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    base.pop("KERNEL_CACHE_NUM_THREADS", None)
    proc = subprocess.run(
        [sys.executable, "-c", APPLY, str(root)],
        capture_output=True, text=True, cwd=ROOT, env={**base, **env}, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_auto_lowers_torch_threads_to_the_cgroup_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # one CPU's worth of time
    got = _apply(tmp_path)
    assert got["now"] == got["returned"] == 1, got
    # OMP_NUM_THREADS is the user's choice; keep leaves torch alone
    default = got["default"]
    assert _apply(tmp_path, OMP_NUM_THREADS=str(default))["now"] == default
    assert _apply(tmp_path, KERNEL_CACHE_NUM_THREADS="keep")["now"] == default
    # without a quota, auto changes nothing
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _apply(tmp_path)["now"] == default


def test_a_number_sets_it_and_a_bad_value_names_the_variable(tmp_path):
    assert _apply(tmp_path, KERNEL_CACHE_NUM_THREADS="1")["now"] == 1
    for bad, says in (
        ("0", "must be at least 1"),
        ("99999", "must be at most 4096"),
        ("many", "not auto, keep or an integer"),
    ):
        err = _apply(tmp_path, KERNEL_CACHE_NUM_THREADS=bad)["error"]
        assert err.startswith("SettingError") and "KERNEL_CACHE_NUM_THREADS" in err, err
        assert says in err, err


LOAD = r"""
import json, sys
import torch
from kernel_cache import load_plan, make_config
cfg = make_config(sys.argv[1], **json.loads(sys.argv[2]))
load_plan(cfg, sys.argv[3])
print(torch.get_num_threads())
"""


def test_engine_start_applies_it(warm_cache, tiny_model):
    limits = {k: list(v) if isinstance(v, tuple) else v for k, v in TINY_LIMITS.items()}
    env = {**os.environ, "KERNEL_CACHE_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", LOAD, str(tiny_model), json.dumps(limits), str(warm_cache[0])],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "1"
