"""examples/hf_slots.py: one command, no arguments, on a cold cache.

The example warms its plan (attention and two declared slots) in a child
process, then serves hf_generate's Llama with each layer's MLP and RMSNorms
through the slots. Counted outside the example's own report: compiles by the
test hook's compile log (``pid variant`` per AOTInductor compile of any
process), files by a snapshot of the cache directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ..conftest import ROOT
from ..kc_helpers import snapshot

EXAMPLE = ROOT / "examples" / "hf_slots.py"
#: The example's plan: the tiny limits' attention variants on llama-3.2-1b's
#: geometry with one query bucket (32), and both slots on it.
PLAN = sorted(
    ["paged_attention:32:2:1", "batched_decode:1:2:4", "llama_mlp:32:0:0", "llama_rms_norm:32:0:0"]
)
MLP_WEIGHTS = 3 * 2048 * 4096 * 4  # gate, up and down projections, float32


def run_example(cache, log) -> tuple[subprocess.Popen, str, str]:
    """``python examples/hf_slots.py`` with no argument, its cache through
    ``$KERNEL_CACHE_DIR``; the process (its pid), stdout and stderr."""
    env = {**os.environ, "KERNEL_CACHE_DIR": str(cache), "KERNEL_CACHE_TEST_COMPILE_LOG": str(log)}
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=1200)
    return proc, out, err


def compiles(log) -> list[tuple[int, str]]:
    return [(int(p), v) for p, v in (ln.split() for ln in log.read_text().splitlines())]


@pytest.mark.compile
def test_the_slots_example_warms_a_cold_cache_then_matches_eager_with_zero_compiles(tmp_path):
    pytest.importorskip("transformers")
    cache, log = tmp_path / "cache", tmp_path / "compiles.log"
    proc, out, err = run_example(cache, log)
    assert proc.returncode == 0, out + err
    assert "greedy tokens vs transformers' eager generate: identical" in out, out
    said = re.search(r"compiles after warmup: (\d+) .*processes started while serving: (\d+)", out)
    assert said and said.groups() == ("0", "0"), out
    # the warmup child compiled each variant once; the example's own process nothing
    logged = compiles(log)
    assert sorted(v for _, v in logged) == PLAN
    assert proc.pid not in {p for p, _ in logged}
    # artifacts hold no weights: each MLP artifact is well under one MLP's weights
    # (read from the files, not from the example's line)
    sizes = {m[0]: int(m[1]) for m in re.findall(r"^(llama_\w+:\d+:0:0)\s+\d+\s+(\d+)$", out, re.M)}
    assert sorted(sizes) == [v for v in PLAN if v.startswith("llama_")], out
    files = sorted(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    assert all(s in files for s in sizes.values())
    assert max(sizes.values()) * 50 < MLP_WEIGHTS, sizes
    assert f"weights of llama_mlp: 2 modules of {MLP_WEIGHTS} bytes" in out

    # the same command again: warm, it compiles nothing and writes no entry
    usage = {"usage.json", "usage.json.lock"}  # engine start's best-effort hit records
    before = {k: v for k, v in snapshot(cache).items() if k not in usage}
    proc, out, err = run_example(cache, log)
    assert proc.returncode == 0, out + err
    assert "missing" not in err and len(compiles(log)) == len(PLAN), err
    assert {k: v for k, v in snapshot(cache).items() if k not in usage} == before
