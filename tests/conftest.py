"""Shared fixtures: a tiny geometry and one warmed cache per test session.

Compiling is the slow part (10-20 s a variant on a 2-core CPU), so the tiny
plan (3 variants: one KV bucket of 2 blocks, query buckets 1 and 32, a decode
batch of 4) is warmed once per session, and tests that change a cache work on a
copy of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_cache.config.engine import make_config

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "azure-llm-trace-2023" / "conv.csv"

TINY_GEOMETRY = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
TINY_LIMITS = {
    "max_model_len": 32,
    "block_size": 16,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "kv_buckets": (32,),
}
#: The tiny plan's variants, in plan order.
TINY_VARIANTS = ("paged_attention:1:2:1", "paged_attention:32:2:1", "batched_decode:1:2:4")
N_TINY = len(TINY_VARIANTS)


def tiny_args(model_path) -> list[str]:
    """ENGINE OPTIONS for the tiny plan (:data:`TINY_VARIANTS`)."""
    return [
        "--model",
        str(model_path),
        "--max-model-len",
        "32",
        "--block-size",
        "16",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--kv-buckets",
        "32",
    ]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("model") / "config.json"
    p.write_text(json.dumps(TINY_GEOMETRY))
    return p


@pytest.fixture(scope="session")
def tiny_config(tiny_model):
    return make_config(str(tiny_model), **TINY_LIMITS)


def run_cli(*args, env=None, check=False, timeout=600) -> subprocess.CompletedProcess:
    """Run ``kernel-cache ARGS`` in a fresh Python process."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "warmup.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=ROOT,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"kernel-cache {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory, tiny_model) -> tuple[Path, dict]:
    """A cache with the tiny plan compiled, and warmup's JSON report. Read-only use."""
    cache = tmp_path_factory.mktemp("warm") / "cache"
    proc = run_cli(
        "warmup", *tiny_args(tiny_model), "--cache-dir", cache, "--jobs", "2", "--json", check=True
    )
    return cache, json.loads(proc.stdout)


@pytest.fixture
def cache_copy(warm_cache, tmp_path) -> Path:
    """A private, writable copy of the warmed cache."""
    dst = tmp_path / "cache"
    shutil.copytree(warm_cache[0], dst)
    return dst


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Seconds per test file (setup, call and teardown summed), slowest first, and
    the same as JSON in ``$KERNEL_CACHE_TEST_DURATIONS`` when that is set."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            duration = getattr(rep, "duration", None)
            nodeid = getattr(rep, "nodeid", "")
            if duration is None or not nodeid:
                continue
            path = nodeid.split("::")[0]
            per_file[path] = per_file.get(path, 0.0) + duration
    if not per_file:
        return
    ranked = sorted(per_file.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", "seconds per test file")
    for path, seconds in ranked:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    out = os.environ.get("KERNEL_CACHE_TEST_DURATIONS")
    if out:
        Path(out).write_text(json.dumps(dict(ranked), indent=1) + "\n")
