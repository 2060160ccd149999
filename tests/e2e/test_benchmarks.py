"""Smoke runs of every benchmark at tiny sizes: each runs as one command and
writes its JSON fields. Nothing here asserts a speed (speed is measured by the
benchmarks themselves, on purpose not in tests)."""

import csv
import importlib.util
import json
import math
import subprocess
import sys

import pytest

from ..conftest import N_TINY, ROOT, plain_args, tiny_args

BENCH = ROOT / "benchmarks"


def run_bench(name, *args, timeout=900) -> dict:
    out = args[args.index("--out") + 1]
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert "JSON:" in proc.stdout
    doc = json.loads(open(out).read())
    assert doc["benchmark"] == name
    assert {"argv", "machine", "config", "results"} <= set(doc)
    assert {"cpu", "logical_cpus", "torch", "loadavg_at_start", "loadavg_at_end"} <= set(
        doc["machine"]
    )
    return doc


def summary_fields(s, n: int | None = None):
    """A summary (benchmarks/_common.py ``summary``) whose figures are consistent:
    finite, min <= median <= max, over ``n`` samples when given."""
    assert {"median", "min", "max", "n"} <= set(s)
    assert s["n"] >= 1 and (n is None or s["n"] == n), s
    assert all(math.isfinite(s[k]) for k in ("median", "min", "max")), s
    assert s["min"] <= s["median"] <= s["max"], s


def test_padding_smoke(tmp_path):
    trace = tmp_path / "trace.csv"
    with trace.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for i in range(30):
            w.writerow([f"2023-11-16 18:15:{i:02d}", 37 * i + 5, (i * 7) % 40])
    plot = tmp_path / "padding.png"
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    doc = run_bench(
        "padding",
        "--trace",
        trace,
        "--max-model-len",
        "1024",
        "--kv-buckets",
        "256,512,1024",
        "--plot",
        plot if has_mpl else "none",
        "--out",
        tmp_path / "padding.json",
        timeout=300,
    )
    ladders = {r["ladder"] for r in doc["results"]}
    assert {"pow2", "4/3 capped at 4096", "4/3 uncapped", "custom 256,512,1024"} == ladders
    for r in doc["results"]:
        assert {
            "variants",
            "kv_buckets",
            "padded_read_fraction",
            "padded_read_fraction_kv_only",
            "padded_read_fraction_per_sequence",
            "padded_read_fraction_prefill",
            "padded_read_fraction_decode",
        } <= set(r)
    assert "4/3 capped reads less than pow2 for whole-bucket kernels" in doc["target"]
    assert doc["config"]["requests"] == 30
    if has_mpl:
        assert plot.stat().st_size > 0


@pytest.mark.compile
def test_dispatch_smoke(tmp_path, warm_cache, tiny_model):
    doc = run_bench(
        "dispatch",
        *tiny_args(tiny_model),
        "--cache-dir",
        warm_cache[0],
        "--calls",
        "5",
        "--repeats",
        "2",
        "--out",
        tmp_path / "dispatch.json",
        timeout=300,
    )
    assert {r["variant"] for r in doc["results"]} >= {"batched_decode:1:2:4"}
    for r in doc["results"]:
        for k in ("direct_us", "dispatch_us", "overhead_us", "overhead_pct"):
            summary_fields(r[k], n=2)  # one per repeat
        summary_fields(r["host_only_us"])
        assert r["direct_us"]["min"] > 0 and r["dispatch_us"]["min"] > 0
    # the verdicts are the figures' own, not constants
    target, results = doc["target"], doc["results"]
    us = target["target_us"]
    assert target["overhead_under_target"] == all(r["overhead_us"]["median"] < us for r in results)
    assert target["host_only_under_target"] == all(
        r["host_only_us"]["median"] < us for r in results
    )


@pytest.mark.compile
def test_load_plan_smoke(tmp_path, warm_cache, tiny_model):
    out = tmp_path / "load_plan.json"
    args = ["--cache-dir", warm_cache[0], "--baseline", ROOT, "--repeats", "2", "--out", out]
    args += ["--baseline-cache-dir", warm_cache[0]]  # the baseline's own cache (here the same)
    doc = run_bench("load_plan", *tiny_args(tiny_model), *args, timeout=300)
    for way in ("now", "baseline"):
        r = doc["results"][way]
        assert r["variants"] == N_TINY and len(r["runs"]) == 2
        for k in ("wall_s", "cpu_s", "wall_ms_per_variant", "cpu_ms_per_variant"):
            summary_fields(r[k], n=2)
        assert all(x["kernel_cache"].startswith(str(ROOT)) for x in r["runs"])
    per = doc["results"]["now"]["wall_ms_per_variant"]["median"]
    assert doc["target"]["wall_ms_per_variant_median_at_most_5"] == (per <= 5)


@pytest.mark.compile
def test_kernel_speed_smoke(tmp_path, warm_cache, tiny_model):
    doc = run_bench(
        "kernel_speed",
        *tiny_args(tiny_model),
        "--cache-dir",
        warm_cache[0],
        "--calls",
        "2",
        "--repeats",
        "2",
        "--out",
        tmp_path / "kernel_speed.json",
        timeout=300,
    )
    assert len(doc["results"]) == 4
    for r in doc["results"]:
        for k in ("compiled_ms", "eager_ms", "sdpa_ms", "compiled_speedup_vs_eager"):
            summary_fields(r[k])
        assert r["max_abs_err_vs_sdpa"] < 1e-4


@pytest.mark.compile
def test_pool_size_smoke(tmp_path, warm_cache, tiny_model):
    doc = run_bench(
        "pool_size",
        *tiny_args(tiny_model),
        "--cache-dir",
        warm_cache[0],
        "--seq-len",
        "20",
        "--pools",
        "8,5000",
        "--dtypes",
        "float32",
        "--calls",
        "2",
        "--repeats",
        "2",
        "--out",
        tmp_path / "pool_size.json",
        timeout=300,
    )
    (r,) = doc["results"]
    assert r["variant"] == "batched_decode:1:2:4"
    for k in ("compiled@8", "compiled@5000", "sdpa"):
        summary_fields(r["ms"][k])
    summary_fields(r["compiled_large_over_small"])
    assert max(r["max_abs_err_vs_sdpa"].values()) < 1e-4
    assert doc["config"]["pools"] == [8, 5000]


@pytest.mark.compile
def test_restart_smoke(tmp_path, warm_cache, tiny_model):
    doc = run_bench(
        "restart",
        *tiny_args(tiny_model),
        "--cache-dir",
        warm_cache[0],
        "--variants",
        "1",
        "--repeats",
        "1",
        "--work-dir",
        tmp_path / "work",
        "--out",
        tmp_path / "restart.json",
    )
    assert set(doc["results"]) == {"a", "b", "c", "d"}
    for r in doc["results"].values():
        for k in ("ready_excl_import_torch_s", "ready_incl_import_torch_s", "second_calls_s"):
            summary_fields(r[k])
        summary_fields(r["start_cost_excl_import_torch_s"])
        assert {
            "ratio_to_a_excl_import",
            "ratio_to_a_start_cost",
            "traced_at_start",
            "inductor_codegen_at_start",
            "cxx_builds_at_start",
            "compiled_at_start",
        } <= set(r)
    assert doc["results"]["a"]["compile_stack_imported"] == []
    assert doc["results"]["b"]["traced_at_start"] is True
    assert {
        "a_at_least_100x_faster_than_c_excl_import",
        "a_at_least_100x_faster_than_c_start_cost",
        "a_no_trace_no_compile",
    } <= set(doc["target"])


@pytest.mark.compile
def test_warmup_throughput_smoke(tmp_path, tiny_model):
    """The benchmark's runs and fields, on the plain kernels (``PLAIN_KERNELS``:
    its phases and timings are the same for any kernel, and those compile for less)."""
    doc = run_bench(
        "warmup_throughput",
        *plain_args(tiny_model),
        "--variants",
        "1",
        "--jobs",
        "1",
        "--phase-variants",
        "1",
        "--candidates",
        "--kernel-calls",
        "2",
        "--work-dir",
        tmp_path / "work",
        "--out",
        tmp_path / "warmup.json",
    )
    jobs = doc["results"]["jobs"]
    assert [r["jobs"] for r in jobs] == [1]
    for r in jobs:
        assert {"wall_s", "s_per_variant", "cpu_s_per_variant", "speedup_vs_first"} <= set(r)
    (ph,) = doc["results"]["phases"]
    assert set(ph["steady_share"]) == {"export", "codegen", "cxx", "packaging"}
    assert {"first_compile_s", "steady_cpu_s", "kernel_time_vs_current"} <= set(ph)


@pytest.mark.compile
def test_fleet_start_smoke(tmp_path, cache_copy, tiny_model, tiny_config):
    """1 and 2 engines from each source the machine has a server for; each engine
    cost, as the servers count it, one GET per variant on S3 (plus the manifest's
    and the first variant's index: a LIST and a GET),
    one bounded read per variant on Redis (``WATCH``, ``HSTRLEN`` of both fields,
    then ``MULTI``/``HMGET``/``EXEC``; plus ``HELLO``, and the first variant's
    index and record) and about the plan's bytes."""
    import shutil

    from kernel_cache.plan.buckets import Bucketer

    from ..s3_server import weed_binary

    sources = ["bundle"]
    sources += ["s3"] if weed_binary() else []
    sources += ["redis"] if shutil.which("redis-server") else []
    doc = run_bench(
        "fleet_start",
        *tiny_args(tiny_model),
        "--cache-dir",
        cache_copy,
        "--engines",
        "1,2",
        "--sources",
        ",".join(sources),
        "--remote-timeout",
        "30",
        "--out",
        tmp_path / "fleet_start.json",
    )
    n = len(Bucketer(tiny_config).variants)
    runs = doc["results"]["runs"]
    assert [(r["source"], r["engines"]) for r in runs] == [(s, k) for s in sources for k in (1, 2)]
    plan_bytes = doc["config"]["publish"]["bundle"]["bytes"]
    for r in runs:
        assert r["all_loaded"] and r["compiles"] == 0 and len(r["per_engine"]) == r["engines"]
        assert {"median", "min", "max", "n", "p99"} <= set(r["ready_s"])
        if r["source"] == "bundle":
            assert r["rchar_per_engine"]["min"] >= plan_bytes  # every artifact read
            assert r["local_cache_bytes_per_engine"]["max"] == 0
            continue
        kinds = r["server"]["requests_by_kind_per_engine"]
        if r["source"] == "s3":
            # the first variant's index (a LIST, its record: the builders' compiler),
            # the manifest, then one GET per entry
            assert kinds == {"LIST": 1, "GET": 1 + 1 + n}
        else:
            # one bounded read of both fields per variant, and the first variant's
            # index (one EVAL) and its record alone (the builders' compiler)
            assert kinds.get("eval") == 1, kinds
            assert kinds.get("hmget") == n + 1 and kinds.get("hstrlen") == 2 * n + 1, kinds
            assert r["server"]["requests_per_engine"] <= 6 * (n + 1) + 3
        assert plan_bytes <= r["server"]["sent_bytes_per_engine"] <= 1.2 * plan_bytes
        assert r["local_cache_bytes_per_engine"]["min"] >= plan_bytes  # written through
    assert set(doc["results"]["ratio_largest_to_smallest"]) == set(sources)


@pytest.mark.slow
def test_import_cost_smoke(tmp_path):
    doc = run_bench("import_cost", "--rounds", "1", "--out", tmp_path / "import_cost.json")
    by_case = {r["case"]: r for r in doc["results"]}
    assert {"python -c pass", "import torch", "import kernel_cache", "make_config"} <= set(by_case)
    assert not by_case["import kernel_cache"]["imports_torch"]
    assert not by_case["make_config"]["imports_torch"]
    assert by_case["engine imports after torch"]["imports_torch"]
    for r in doc["results"]:
        summary_fields(r["seconds"])
        summary_fields(r["ratio_to_import_torch"])
