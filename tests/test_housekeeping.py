"""ls, stats, gc, clear, KERNEL_CACHE_MAX_SIZE, and best-effort usage records."""

import json
import os

import pytest

from kernel_cache import load_plan, usage
from kernel_cache.buckets import Bucketer
from kernel_cache.errors import KernelCacheError
from kernel_cache.housekeeping import cache_stats, gc, list_entries, parse_size, plan_digests
from kernel_cache.keys import build_key
from kernel_cache.store import DiskTier, make_meta

from .conftest import run_cli, tiny_args


@pytest.mark.parametrize(
    "text,n",
    [("1048576", 1048576), ("500M", 500 * 2**20), ("1.5GiB", int(1.5 * 2**30)), ("2k", 2048)],
)
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "12 parsecs", "-5M", "M"])
def test_parse_size_rejects_with_the_form(text):
    with pytest.raises(KernelCacheError, match="expected bytes or a number with K, M, G or T"):
        parse_size(text, "--max-size")


def _fill(cache, tiny_config, t0=1_000_000.0):
    """6 plan entries (1000 bytes each, used at t0+100..105) and 6 entries of the
    same plan under an older torch (1000 bytes each, used at t0+0..5)."""
    tier = DiskTier(cache)
    plan, stale = [], []
    for i, v in enumerate(Bucketer(tiny_config).variants):
        for overrides, dst, used in (
            (None, plan, t0 + 100 + i),
            ({"torch": "2.9.0"}, stale, t0 + i),
        ):
            key = build_key(tiny_config, v, overrides=overrides)
            data = bytes([i]) * 1000
            tier.put(key.hexdigest, data, make_meta(key, str(v), data, 1.0))
            usage.record(cache, hits=[key.hexdigest], now=used)
            dst.append(key.hexdigest)
    tier.close()
    return plan, stale


def test_gc_removes_least_recently_used_first_never_a_kept_plan(tmp_path, tiny_config):
    plan, stale = _fill(tmp_path, tiny_config)
    tier = DiskTier(tmp_path)
    report = gc(tier, 8000, plan_digests(tiny_config))
    assert [r["key"] for r in report["removed"]] == stale[:4]  # oldest last use first
    assert report["after_bytes"] == 8000 and report["under_limit"]
    left = {r["key"] for r in list_entries(tier)}
    assert left == set(plan) | set(stale[4:])
    report = gc(tier, 0, plan_digests(tiny_config))  # the kept plan alone is above 0
    assert not report["under_limit"] and report["kept_bytes"] == 6000
    assert {r["key"] for r in list_entries(tier)} == set(plan)
    assert set(usage.read_usage(tmp_path)["last_used"]) == set(plan)
    tier.close()


def test_gc_cli_keep_plan_as_plan_file_or_engine_options(tmp_path, tiny_config, tiny_model):
    plan, stale = _fill(tmp_path / "c", tiny_config)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(run_cli("plan", *tiny_args(tiny_model), "--json", check=True).stdout)
    proc = run_cli(
        "gc",
        "--max-size",
        "7000",
        "--keep-plan",
        plan_file,
        "--cache-dir",
        tmp_path / "c",
        "--json",
        check=True,
    )
    assert [r["key"] for r in json.loads(proc.stdout)["removed"]] == stale[:5]
    assert "warning" not in proc.stderr
    # a plan that matches nothing in the cache (another dtype): gc says so
    other = " ".join(map(str, tiny_args(tiny_model))) + " --dtype bfloat16"
    proc = run_cli("gc", "--max-size", "1G", "--keep-plan", other, "--cache-dir", tmp_path / "c")
    assert proc.returncode == 0
    assert "--dtype bfloat16' matches none of the entries" in proc.stderr
    opts = " ".join(map(str, tiny_args(tiny_model)))
    proc = run_cli("gc", "--max-size", "1K", "--keep-plan", opts, "--cache-dir", tmp_path / "c")
    assert proc.returncode == 2
    assert "the kept plans alone hold 6000 bytes, above --max-size 1024 bytes" in proc.stderr
    tier = DiskTier(tmp_path / "c")
    assert {r["key"] for r in list_entries(tier)} == set(plan)
    tier.close()
    proc = run_cli("gc", "--max-size", "1K", "--keep-plan", "nope.json", "--cache-dir", tmp_path)
    assert proc.returncode == 2 and "no such file; give ENGINE OPTIONS" in proc.stderr


def test_ls_stats_and_clear_after_a_real_engine_start(cache_copy, tiny_config):
    before = cache_stats(DiskTier(cache_copy))
    load_plan(tiny_config, cache_copy)
    with pytest.raises(KernelCacheError):
        load_plan(tiny_config.model_copy(update={"dtype": "bfloat16"}), cache_copy)
    s = json.loads(run_cli("stats", "--cache-dir", cache_copy, "--json", check=True).stdout)
    assert s["entries"] == 6 and s["bytes"] == sum(
        r["size"] for r in list_entries(DiskTier(cache_copy))
    )
    assert (s["hits"] - before["hits"], s["misses"] - before["misses"]) == (6, 6)
    rows = json.loads(run_cli("ls", "--cache-dir", cache_copy, "--json", check=True).stdout)
    assert len(rows) == 6 and all(r["last_used"] and r["compile_seconds"] > 0 for r in rows)
    table = run_cli("ls", "--cache-dir", cache_copy, check=True).stdout
    for col in ("variant", "key", "size", "compile s", "created", "last used"):
        assert col in table
    assert all(r["variant"] in table and r["key"][:12] in table for r in rows)
    proc = run_cli("clear", "--cache-dir", cache_copy, "--json", check=True)
    assert json.loads(proc.stdout)["removed"] == 6
    s = json.loads(run_cli("stats", "--cache-dir", cache_copy, "--json", check=True).stdout)
    assert (s["entries"], s["bytes"], s["hits"], s["misses"]) == (0, 0, 0, 0)
    proc = run_cli("stats", "--cache-dir", cache_copy / "absent")
    assert proc.returncode == 2 and "no cache at" in proc.stderr
    assert not (cache_copy / "absent").exists()


@pytest.mark.compile
def test_warmup_respects_kernel_cache_max_size(cache_copy, tiny_config, tiny_model):
    plan_bytes = sum(r["size"] for r in list_entries(DiskTier(cache_copy)))
    other, stale = _fill(cache_copy, tiny_config.model_copy(update={"head_dim": 16}))
    limit = plan_bytes + 2500  # room for two of the other plans' 1000-byte entries
    proc = run_cli(
        "warmup",
        *tiny_args(tiny_model),
        "--cache-dir",
        cache_copy,
        "--json",
        env={"KERNEL_CACHE_MAX_SIZE": str(limit)},
        check=True,
    )
    report = json.loads(proc.stdout)
    assert report["compiled"] == 0 and report["gc"]["under_limit"]
    assert [r["key"] for r in report["gc"]["removed"]] == stale + other[:4]  # LRU first
    assert report["gc"]["after_bytes"] == plan_bytes + 2000 <= limit
    proc = run_cli(
        "warmup",
        *tiny_args(tiny_model),
        "--cache-dir",
        cache_copy,
        env={"KERNEL_CACHE_MAX_SIZE": "1M"},
    )
    assert proc.returncode == 1 and "above the size limit 1048576 bytes" in proc.stderr
    keys = {build_key(tiny_config, v).hexdigest for v in Bucketer(tiny_config).variants}
    assert keys <= {r["key"] for r in list_entries(DiskTier(cache_copy))}  # plan untouched


def test_usage_records_are_best_effort(tmp_path):
    assert usage.record(tmp_path / "absent", hits=["k"]) is False
    assert not (tmp_path / "absent").exists()
    (tmp_path / "usage.json").mkdir()  # os.replace onto a directory fails, even for root
    assert usage.record(tmp_path, hits=["k"], misses=1) is False
    assert list(tmp_path.glob(".usage-*")) == []  # no temp file left behind
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("this user can write a 0555 directory (root)")
        assert usage.record(ro, hits=["k"]) is False and list(ro.iterdir()) == []
    finally:
        os.chmod(ro, 0o755)
