"""Warm up once, restart, load, dispatch with zero compiles (tiny geometry, real compiles)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from kernel_cache import MissingVariantsError, ShapeError, load_plan
from kernel_cache.plan.buckets import Bucketer

from ..conftest import N_TINY, ROOT, TRACE, run_cli, tiny_args

pytestmark = pytest.mark.compile


def test_warmup_compiles_the_plan_once(warm_cache, tiny_config):
    _, report = warm_cache
    n = len(Bucketer(tiny_config).variants)
    assert (report["variants"], report["compiled"], report["cached"]) == (n, n, 0)
    assert report["failed"] == []


def test_second_warmup_reports_everything_cached(cache_copy, tiny_model, tiny_config):
    proc = run_cli(
        "warmup", *tiny_args(tiny_model), "--cache-dir", cache_copy, "--json", check=True
    )
    report = json.loads(proc.stdout)
    n = len(Bucketer(tiny_config).variants)
    assert (report["compiled"], report["cached"], report["failed"]) == (0, n, [])


def test_verify_in_new_process_ok_with_zero_compiles(warm_cache, tiny_model, tiny_config):
    proc = run_cli(
        "verify", *tiny_args(tiny_model), "--cache-dir", warm_cache[0], "--json", check=True
    )
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    assert report["compiled"] == 0 and report["compile_stack_imported"] == []
    assert report["loaded"] == len(Bucketer(tiny_config).variants)
    assert report["missing"] == [] and report["corrupt"] == []


ENGINE_SCRIPT = r"""
import json, sys, torch
from kernel_cache import load_plan, make_config
from kernel_cache.kernels.reference import reference_attention, reference_decode
from warmup.check.verify import compile_stack_loaded
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))
rt = load_plan(cfg, sys.argv[2])
g = torch.Generator().manual_seed(3)
P = 11
kc = torch.randn(P, 16, 2, 8, generator=g); vc = torch.randn(P, 16, 2, 8, generator=g)
err = 0.0
for seq_len, q in [(1, 1), (16, 16), (17, 5), (32, 32), (30, 1)]:
    bt = torch.randperm(P, generator=g)[:2].to(torch.int32)
    query = torch.randn(q, 4, 8, generator=g)
    out = rt.prefill(query, kc, vc, bt, seq_len)
    assert out.shape == (q, 4, 8)
    err = max(err, float((out - reference_attention(query, kc, vc, bt, seq_len)).abs().max()))
for lens in ([5], [1, 16, 32], [32, 17, 2, 9]):
    bt = torch.stack([torch.randperm(P, generator=g)[:3] for _ in lens]).to(torch.int32)
    query = torch.randn(len(lens), 4, 8, generator=g)
    for form in (lens, torch.tensor(lens)):
        out = rt.decode(query, kc, vc, bt, form)
        assert out.shape == (len(lens), 4, 8)
        err = max(err, float((out - reference_decode(query, kc, vc, bt, lens)).abs().max()))
doc = {"max_abs_err": err, "stats": rt.stats(), "compile_stack": compile_stack_loaded()}
print(json.dumps(doc))
"""


def test_engine_start_dispatch_matches_reference_without_compiling(warm_cache, tiny_model):
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT, str(tiny_model), str(warm_cache[0])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["max_abs_err"] < 1e-5
    assert doc["stats"]["compiles"] == 0 and doc["compile_stack"] == []
    assert doc["stats"]["compile_stack_imported"] == [] and doc["stats"]["dynamo_graphs"] == 0
    assert doc["stats"]["loads"] == N_TINY
    assert sum(doc["stats"]["calls"].values()) == 5 + 3 * 2


COUNTING_SCRIPT = r"""
import json, sys, torch
from kernel_cache import load_plan, make_config
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))
kc = torch.randn(9, 16, 2, 8)
def serve(rt):
    rt.decode(torch.randn(3, 4, 8), kc, kc, torch.zeros(3, 2, dtype=torch.int32), [5, 17, 32])
doc = {}
first = load_plan(cfg, sys.argv[2]); serve(first)
doc["plain"] = first.stats()
flat = torch.compile(lambda x: x.reshape(-1))  # an Inductor graph without a kernel
flat(torch.randn(2, 3))
doc["first_after_one"] = first.stats()
second = load_plan(cfg, sys.argv[2]); serve(second)  # its baseline: after that compile
doc["second_at_start"] = second.stats()
sine = torch.compile(lambda x: (x * 2).sin() + 1)  # a C++ kernel
sine(torch.randn(8)); sine(torch.randn(8))  # the second call runs the compiled code
doc["first_after_two"], doc["second_after_one"] = first.stats(), second.stats()
torch._dynamo.reset()  # empties torch's compile-time metrics; counts since load stay
doc["first_after_reset"] = first.stats()
print(json.dumps(doc))
"""


def test_stats_count_the_compiles_this_process_runs_beside_a_loaded_plan(
    warm_cache, tiny_model, tmp_path
):
    """A fresh process loads the plan and dispatches (0 compiles, compile stack
    not imported), then torch.compiles two functions beside it, one before a
    second load_plan: each runtime counts the compiles since its own start."""
    inductor = tmp_path / "inductor"
    proc = subprocess.run(
        [sys.executable, "-c", COUNTING_SCRIPT, str(tiny_model), str(warm_cache[0])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor)},
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    # The sine kernel was compiled by g++ in this run (an empty Inductor cache):
    # its shared object is there.
    assert list(inductor.rglob("*.so")), sorted(p.name for p in inductor.rglob("*"))

    def counts(name):
        s = doc[name]
        return s["compiles"], s["dynamo_graphs"], bool(s["compile_stack_imported"])

    assert doc["plain"]["compile_stack_imported"] == []
    assert counts("plain") == (0, 0, False)
    assert "torch._dynamo" in doc["first_after_one"]["compile_stack_imported"]
    assert counts("first_after_one") == (1, 1, True)
    assert counts("second_at_start") == (0, 0, True)
    assert counts("first_after_two") == (2, 2, True)
    assert counts("second_after_one") == (1, 1, True)
    assert counts("first_after_reset") == (2, 2, True)


def test_missing_variant_names_variants_and_command(tmp_path, tiny_config, tiny_model):
    with pytest.raises(MissingVariantsError) as e:
        load_plan(tiny_config, tmp_path / "empty")
    assert len(e.value.missing) == N_TINY
    assert "kernel-cache warmup --model" in str(e.value)
    proc = run_cli("verify", *tiny_args(tiny_model), "--cache-dir", tmp_path / "empty2")
    assert proc.returncode == 1 and "missing" in proc.stderr


def test_dispatch_rejects_bad_inputs(warm_cache, tiny_config):
    rt = load_plan(tiny_config, warm_cache[0])
    kc = torch.zeros(5, 16, 2, 8)
    bt = torch.zeros(4, 2, dtype=torch.int32)
    q = torch.zeros(4, 4, 8)
    with pytest.raises(ShapeError, match="max_model_len 32"):
        rt.decode(q, kc, kc, bt, [33, 1, 1, 1])
    with pytest.raises(ShapeError, match="max_num_seqs 4"):
        rt.decode(torch.zeros(5, 4, 8), kc, kc, torch.zeros(5, 2, dtype=torch.int32), [1] * 5)
    with pytest.raises(ShapeError, match="num_heads"):
        rt.decode(torch.zeros(4, 3, 8), kc, kc, bt, [1] * 4)
    with pytest.raises(ShapeError, match="key_cache"):
        rt.decode(q, torch.zeros(5, 8, 2, 8), kc, bt, [1] * 4)
    with pytest.raises(ShapeError, match="float32"):
        rt.decode(q.double(), kc, kc, bt, [1] * 4)
    with pytest.raises(ShapeError, match="block_tables"):
        rt.decode(q, kc, kc, torch.zeros(4, 1, dtype=torch.int32), [20, 1, 1, 1])
    with pytest.raises(ShapeError, match="query_len 2 must be between 1 and seq_len 1"):
        rt.prefill(torch.zeros(2, 4, 8), kc, kc, torch.zeros(2, dtype=torch.int32), 1)
    assert rt.stats()["compiles"] == 0


@pytest.mark.skipif(not TRACE.exists(), reason="Azure trace not beside the checkout")
def test_replay_on_trace_slice_has_zero_compiles(warm_cache, tiny_model):
    proc = subprocess.run(
        [
            sys.executable,
            "examples/replay_trace.py",
            *tiny_args(tiny_model),
            "--cache-dir",
            str(warm_cache[0]),
            "--trace",
            str(TRACE),
            "--limit",
            "40",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["requests"] == 40 and doc["compiles"] == 0
    assert doc["kernel_calls"] == sum(doc["calls_per_variant"].values()) > 40
    assert 0 <= doc["padded_read_fraction"] < 1


@pytest.mark.compile
def test_warmup_leaves_no_compile_scratch_in_the_temp_dir(tmp_path, tiny_model):
    """Inductor's scratch (sources, objects, precompiled headers) goes to a
    private directory under the temp dir that warmup removes; nothing named
    torchinductor_* or kernel_cache-inductor-* is left there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    one = ["--kv-buckets", "16", "--query-buckets", "1", "--num-seqs-buckets", "4"]
    one += ["--shard", "0/6", "--jobs", "1"]  # one of the plan's six variants, one worker
    proc = run_cli(
        "warmup",
        *tiny_args(tiny_model),
        *one,
        "--cache-dir",
        tmp_path / "cache",
        "--json",
        "--quiet",
        env={"TMPDIR": str(tmp)},
        check=True,
    )
    assert json.loads(proc.stdout)["compiled"] == 1
    left = sorted(p.name for p in tmp.iterdir())
    assert not [n for n in left if n.startswith(("torchinductor_", "kernel_cache-inductor-"))], left
