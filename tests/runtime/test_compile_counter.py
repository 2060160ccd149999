"""kernel_cache.runtime.compiles reads torch's compile counters without importing
anything, and counts across torch._dynamo.reset(). Torch's counters module is
stood in for here (its objects as torch 2.13 keeps them), except in the test of a
cold and a warm torch.compile; the counts of real compiles beside a loaded plan
are tested in tests/e2e/test_end_to_end.py."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import types

import pytest

from kernel_cache.runtime.compiles import CompileCounter

from ..conftest import ROOT


def _fake_torch_counters(monkeypatch):
    utils = types.ModuleType("torch._dynamo.utils")
    utils.compilation_time_metrics = {}
    utils.counters = collections.defaultdict(collections.Counter)
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", utils)
    return utils


def _compile(utils, seconds=0.1):
    """What Inductor and Dynamo do for one torch.compile'd graph."""
    utils.compilation_time_metrics.setdefault("compile_fx_inner", []).append(seconds)
    utils.counters["stats"]["unique_graphs"] += 1


def _reset(utils):
    """What torch._dynamo.reset() does to them (reset_frame_count)."""
    utils.compilation_time_metrics.clear()


def test_counts_from_the_baseline_across_resets(monkeypatch):
    utils = _fake_torch_counters(monkeypatch)
    early = CompileCounter()  # before any compile: no list yet
    _compile(utils)
    late = CompileCounter()  # after one
    assert (early.compiles(), late.compiles()) == (1, 0)
    _compile(utils)
    _reset(utils)
    assert (early.compiles(), late.compiles()) == (2, 1)  # the reset loses nothing
    _compile(utils)
    _compile(utils)
    assert (early.compiles(), late.compiles()) == (4, 3)
    r = early.read()
    assert (r["compiles"], r["dynamo_graphs"]) == (4, 4)
    assert "stats" in utils.counters and "inductor" not in utils.counters  # nothing added


def test_reading_imports_nothing():
    """In a fresh process, load the runtime and read the counters: no compile
    stack module is imported, and the read says so."""
    code = (
        "import sys\n"
        "from kernel_cache.runtime.compiles import CompileCounter, COMPILE_STACK\n"
        "r = CompileCounter().read()\n"
        "assert r == {'compiles': 0, 'dynamo_graphs': 0, 'compile_stack_imported': []}, r\n"
        "assert not [m for m in sys.modules if m.startswith(('torch._dynamo', "
        "'torch._inductor.compile_fx'))], sorted(sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr


def test_a_graph_served_from_aotautograds_cache_counts(monkeypatch):
    """A warm torch.compile in a new process skips compile_fx_inner: the graph comes
    whole from AOTAutograd's cache, which torch counts as autograd_cache_hit."""
    utils = _fake_torch_counters(monkeypatch)
    c = CompileCounter()
    utils.counters["aot_autograd"]["autograd_cache_hit"] += 1
    utils.counters["stats"]["unique_graphs"] += 1
    assert c.read()["compiles"] == 1
    utils.counters.clear()  # tests of torch do this: what was counted stays counted
    utils.counters["aot_autograd"]["autograd_cache_hit"] += 1
    assert c.read()["compiles"] == 2


_WARM_CHILD = """
import json, torch
from kernel_cache.runtime.compiles import CompileCounter
c = CompileCounter()
f = torch.compile(lambda x: torch.sin(x) * 2 + x.cos())
f(torch.randn(64))
print(json.dumps(c.read()))
"""


@pytest.mark.compile
def test_a_torch_compile_counts_one_cold_and_one_warm(tmp_path):
    """Two processes compile the same function with one TORCHINDUCTOR_CACHE_DIR: the
    second is served from torch's on-disk caches, and still counts its compile."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    counts = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _WARM_CHILD],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        counts.append(json.loads(proc.stdout.strip().splitlines()[-1])["compiles"])
    assert counts == [1, 1]
