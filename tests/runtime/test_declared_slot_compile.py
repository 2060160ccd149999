"""Declared slots warmed, verified and run for real: a tiny MLP slot on the
query axis of the warm tiny plan (2 variants), a slot with a fixed, a bucket
and a shared dynamic dimension (1 variant), and two concurrent warmups of the
MLP slot on an empty cache (3 variants, each compiled once).

Counted from outside the product: compiles by the test hook's compile log
(every AOTInductor compile of a process that has the variable set) and by
torch's own counters in the engine process; artifact sizes from the files on
disk; the engine's output against the module run eagerly in the same process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kernel_cache.store.disk_tier import DiskTier

from ..conftest import ROOT, run_cli, tiny_args
from ..kc_helpers import counting_cxx, lines_of

HIDDEN, INTER = 128, 8192  # weights: 2 x 128 x 8192 float32 = 8 MiB, a buffer of 128

MLP_PY = """\
import torch
from torch import nn

from kc_slotmlp.act import act


class Mlp(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden))

    def forward(self, x):
        return self.down(act(self.up(x))) * self.scale


def make_mlp(hidden, inter):
    return Mlp(hidden, inter)
"""

SPEC = {
    "name": "mlp",
    "factory": "kc_slotmlp.mlp:make_mlp",
    "args": {"hidden": HIDDEN, "inter": INTER},
    "inputs": [{"name": "x", "shape": ["query_tokens", HIDDEN], "dtype": "float32"}],
    "output_rows": "query_tokens",
}

ENGINE = r"""
import json, sys, torch
from kernel_cache import load_plan, make_config
from kernel_cache.errors import ShapeError
spec = json.loads(sys.argv[3])
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,), slots=[spec])
rt = load_plan(cfg, sys.argv[2])
doc = {"imported_at_start": [m for m in sys.modules if m.startswith("kc_slotmlp")]}
from kc_slotmlp.mlp import make_mlp  # the engine's own model code
torch.manual_seed(0)
mod, other = make_mlp(**spec["args"]).eval(), make_mlp(**spec["args"]).eval()
rt.bind("mlp", mod.state_dict())
g = torch.Generator().manual_seed(1)
doc["calls"] = {}
with torch.no_grad():
    for n in (32, 5, 1, 17):  # a full bucket, then padded ones (after a larger call)
        x = torch.randn(n, spec["args"]["hidden"], generator=g)
        out = rt.call("mlp", x)
        doc["calls"][n] = [list(out.shape), float((out - mod(x)).abs().max())]
    out = rt.call("mlp", x, weights=other)  # another checkpoint of the same shapes
    doc["other_err"] = float((out - other(x)).abs().max())
    doc["other_vs_bound"] = float((out - mod(x)).abs().max())
bad = make_mlp(spec["args"]["hidden"], spec["args"]["inter"] // 2).state_dict()
try:
    rt.bind("mlp", bad)
except ShapeError as e:
    doc["refused"] = str(e)
doc["stats"] = rt.stats()
print(json.dumps(doc))
"""


def engine_json(script: str, model, cache, spec: dict, env: dict) -> dict:
    """Run engine script ``script`` (``argv``: model, cache, the slot's spec as
    JSON) in a fresh process with ``env`` added; the JSON of its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", script, str(model), str(cache), json.dumps(spec)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def slot_site(tmp_path):
    site = tmp_path / "site"
    pkg = site / "kc_slotmlp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "act.py").write_text(
        "import torch\n\n\ndef act(x):\n    return torch.nn.functional.silu(x)\n"
    )
    (pkg / "mlp.py").write_text(MLP_PY)
    return site


@pytest.mark.compile
def test_a_declared_mlp_slot_warms_verifies_and_runs_with_weights_as_inputs(
    tiny_model, cache_copy, slot_site, tmp_path
):
    log = tmp_path / "compiles.log"
    path = tmp_path / "slots.json"
    path.write_text(json.dumps([SPEC]))
    pythonpath = os.pathsep.join([str(slot_site), os.environ.get("PYTHONPATH", "")])
    env = {"KERNEL_CACHE_TEST_COMPILE_LOG": str(log), "PYTHONPATH": pythonpath}
    args = [*tiny_args(tiny_model), "--slot", f"@{path}", "--cache-dir", cache_copy]

    warm = run_cli("warmup", *args, "--jobs", "1", "--json", env=env, check=True)
    compiled = sorted(line.split()[1] for line in log.read_text().splitlines())
    assert compiled == ["mlp:1:0:0", "mlp:32:0:0"]  # the attention variants were cached
    report = json.loads(warm.stdout)
    assert sorted(r["variant"] for r in report["results"] if r["status"] == "compiled") == compiled

    # the artifacts hold the code, not the weights: read from the files on disk
    tier = DiskTier(cache_copy, read_only=True)
    try:
        metas = [m for m in tier.iter_meta() if m.get("variant", "").startswith("mlp:")]
        sizes = [tier.artifact_path(m["key"]).stat().st_size for m in metas]
    finally:
        tier.close()
    weights = (2 * HIDDEN * INTER + HIDDEN) * 4
    print(f"artifact bytes {sorted(sizes)} against weights {weights} bytes")
    assert len(sizes) == 2 and max(sizes) * 10 < weights, (sizes, weights)
    assert metas[0]["slot_params"] == [
        ["up.weight", [INTER, HIDDEN], "float32"],
        ["down.weight", [HIDDEN, INTER], "float32"],
        ["scale", [HIDDEN], "float32"],
    ]

    verify = json.loads(run_cli("verify", *args, "--json", env=env, check=True).stdout)
    assert verify["ok"] and verify["kernels"]["mlp"] == SPEC["factory"], verify
    assert verify["max_abs_err"] <= 1e-4

    doc = engine_json(ENGINE, tiny_model, cache_copy, SPEC, env)
    assert doc["imported_at_start"] == []  # engine start never imports the slot's module
    for n, (shape, err) in doc["calls"].items():
        assert shape == [int(n), HIDDEN] and err <= 1e-4, doc["calls"]
    assert doc["other_err"] <= 1e-4 and doc["other_vs_bound"] > 1e-2  # its own weights ran
    assert "parameter 'up.weight' is [4096, 128] float32" in doc["refused"]
    assert "the slot was built for [8192, 128] float32" in doc["refused"]
    stats = doc["stats"]
    assert stats["compiles"] == 0 and stats["compile_stack_imported"] == [], stats
    assert stats["calls"] == {"mlp:1:0:0": 1, "mlp:32:0:0": 4}
    # no compile in verify or the engine either, by the hook's log
    assert sorted(line.split()[1] for line in log.read_text().splitlines()) == compiled


@pytest.mark.compile
def test_two_concurrent_warmups_of_a_declared_slot_compile_it_once(
    tiny_model, slot_site, cache_copy, tmp_path
):
    """Two warmups started together on one cache directory that holds the tiny
    plan's attention variants (a copy of the suite's warm cache) but not the
    slot's, the plan cut to one query bucket (attention's two variants and the
    slot's ``mlp:32:0:0``): the slot's variant is compiled once, attention's
    not again. Counted three ways outside their reports: links of a package's
    ``wrapper.so`` by a counting ``CXX``, AOTInductor compiles by the compile
    log, artifact files in the cache."""
    cache, links, log = cache_copy, tmp_path / "links.log", tmp_path / "compiles.log"
    path = tmp_path / "slots.json"
    path.write_text(json.dumps([SPEC]))
    pythonpath = os.pathsep.join([str(slot_site), os.environ.get("PYTHONPATH", "")])
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath,
        "CXX": str(counting_cxx(tmp_path, links)),
        "KERNEL_CACHE_TEST_COMPILE_LOG": str(log),
    }
    cmd = [sys.executable, "-m", "warmup.cli.main", "warmup", *map(str, tiny_args(tiny_model))]
    cmd += ["--query-buckets", "32", "--slot", f"@{path}", "--cache-dir", str(cache)]
    cmd += ["--jobs", "1", "--json", "--quiet"]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and "Traceback" not in err, err
    plan = ["batched_decode:1:2:4", "mlp:32:0:0", "paged_attention:32:2:1"]
    assert len(lines_of(links)) == 1, lines_of(links)
    assert [line.split()[1] for line in lines_of(log)] == ["mlp:32:0:0"]
    tier = DiskTier(cache, read_only=True)
    try:
        metas = list(tier.iter_meta())
        files = {tier.artifact_path(m["key"]) for m in metas}
    finally:
        tier.close()
    assert sorted(m["variant"] for m in metas) == sorted([*plan, "paged_attention:1:2:1"])
    assert all(f.is_file() for f in files) and len(files) == len(plan) + 1
    reports = [json.loads(out) for out, _ in outs]
    assert sum(r["compiled"] for r in reports) == 1  # they agree with the counts
    assert all(r["compiled"] + r["cached"] == len(plan) and not r["failed"] for r in reports)


GATHER_PY = """\
import torch
from torch import nn


class Gather(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, width))

    def forward(self, x, idx, pool, scale):
        return x * self.w + (pool * scale[:, None])[idx]
"""

#: One slot with each kind of dimension: fixed (8), a bucket axis
#: (decode_seqs: the tiny plan's one decode bucket, 4, so one variant) and a
#: dynamic one shared by two inputs (dynamic:pool).
GATHER = {
    "name": "gather",
    "factory": "kc_slotmlp.gather:Gather",
    "args": {"width": 8},
    "inputs": [
        {"name": "x", "shape": ["decode_seqs", 8], "dtype": "float32", "pad": 0},
        {"name": "idx", "shape": ["decode_seqs"], "dtype": "int64", "pad": 0},
        {"name": "pool", "shape": ["dynamic:pool", 8], "dtype": "float32"},
        {"name": "scale", "shape": ["dynamic:pool"], "dtype": "float32"},
    ],
    "output_rows": "decode_seqs",
}

GATHER_ENGINE = r"""
import json, sys, torch
from kernel_cache import load_plan, make_config
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,), slots=[json.loads(sys.argv[3])])
rt = load_plan(cfg, sys.argv[2])
from kc_slotmlp.gather import Gather
mod = Gather(8).eval()
rt.bind("gather", mod)
g, errs = torch.Generator().manual_seed(0), []
with torch.no_grad():
    for pool_rows in (1, 2, 7, 40, 3):  # the dynamic size, up and down
        for seqs in (4, 1, 3):  # the bucket axis: full, then padded
            x = torch.randn(seqs, 8, generator=g)
            idx = torch.randint(0, pool_rows, (seqs,), generator=g)
            pool, scale = torch.randn(pool_rows, 8, generator=g), torch.rand(pool_rows, generator=g)
            out = rt.call("gather", x, idx, pool, scale)
            want = mod(x, idx, pool, scale)
            errs.append([pool_rows, seqs, list(out.shape), float((out - want).abs().max())])
print(json.dumps({"errs": errs, "stats": rt.stats()}))
"""


@pytest.mark.compile
def test_a_slot_with_fixed_bucket_and_shared_dynamic_dimensions_runs_any_pool_size(
    tiny_model, cache_copy, slot_site, tmp_path
):
    """Warmed once (one variant), then called with pool sizes from 1 to 40 and
    1 to 4 sequences through the one artifact: every output equals the module
    run eagerly, and nothing compiles in the engine (compile log by pid)."""
    (slot_site / "kc_slotmlp" / "gather.py").write_text(GATHER_PY)
    log = tmp_path / "compiles.log"
    pythonpath = os.pathsep.join([str(slot_site), os.environ.get("PYTHONPATH", "")])
    env = {"KERNEL_CACHE_TEST_COMPILE_LOG": str(log), "PYTHONPATH": pythonpath}
    args = [*tiny_args(tiny_model), "--slot", json.dumps(GATHER), "--cache-dir", cache_copy]
    run_cli("warmup", *args, "--jobs", "1", "--quiet", env=env, check=True)
    assert [line.split()[1] for line in lines_of(log)] == ["gather:0:0:4"]
    doc = engine_json(GATHER_ENGINE, tiny_model, cache_copy, GATHER, env)
    for pool_rows, seqs, shape, err in doc["errs"]:
        assert shape == [seqs, 8] and err <= 1e-5, (pool_rows, seqs, shape, err)
    assert doc["stats"]["calls"] == {"gather:0:0:4": 15} and doc["stats"]["compiles"] == 0
    assert len(lines_of(log)) == 1  # the engine compiled nothing
