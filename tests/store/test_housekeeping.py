"""ls, stats, gc, clear, KERNEL_CACHE_MAX_SIZE, and best-effort usage records."""

import json
import os
import time

import pytest

import kernel_cache.store.usage as usage
from kernel_cache import load_plan
from kernel_cache.config.settings import parse_size
from kernel_cache.errors import KernelCacheError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.store.disk_tier import DiskTier, make_meta
from kernel_cache.store.housekeeping import (
    ORPHAN_GRACE_S,
    cache_stats,
    gc,
    list_entries,
    plan_digests,
)

from ..conftest import N_TINY, run_cli, tiny_args


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
    """One entry per variant of the tiny plan (3; 1000 bytes each, used at t0+100,
    t0+101, ...) and as many of the same plan under an older torch (1000 bytes
    each, used at t0+0, t0+1, ...)."""
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
    assert len(plan) == len(stale) == 3
    report = gc(tier, 4000, plan_digests(tiny_config))
    assert [r["key"] for r in report["removed"]] == stale[:2]  # oldest last use first
    assert report["after_bytes"] == 4000 and report["under_limit"]
    left = {r["key"] for r in list_entries(tier)}
    assert left == set(plan) | set(stale[2:])
    report = gc(tier, 0, plan_digests(tiny_config))  # the kept plan alone is above 0
    assert not report["under_limit"] and report["kept_bytes"] == 3000
    assert {r["key"] for r in list_entries(tier)} == set(plan)
    assert set(usage.read_usage(tmp_path).last_used) == set(plan)
    tier.close()


def test_gc_cli_keep_plan_as_plan_file_or_engine_options(tmp_path, tiny_config, tiny_model):
    plan, stale = _fill(tmp_path / "c", tiny_config)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(run_cli("plan", *tiny_args(tiny_model), "--json", check=True).stdout)
    proc = run_cli(
        "gc",
        "--max-size",
        "4500",
        "--keep-plan",
        plan_file,
        "--cache-dir",
        tmp_path / "c",
        "--json",
        check=True,
    )
    assert [r["key"] for r in json.loads(proc.stdout)["removed"]] == stale[:2]
    assert "warning" not in proc.stderr
    # a plan that matches nothing in the cache (another dtype): gc says so
    other = " ".join(map(str, tiny_args(tiny_model))) + " --dtype bfloat16"
    proc = run_cli("gc", "--max-size", "1G", "--keep-plan", other, "--cache-dir", tmp_path / "c")
    assert proc.returncode == 0
    assert "--dtype bfloat16' matches none of the entries" in proc.stderr
    opts = " ".join(map(str, tiny_args(tiny_model)))
    proc = run_cli("gc", "--max-size", "1K", "--keep-plan", opts, "--cache-dir", tmp_path / "c")
    assert proc.returncode == 2
    assert "the kept plans alone hold 3000 bytes, above --max-size 1024 bytes" in proc.stderr
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
    assert s["entries"] == N_TINY and s["bytes"] == sum(
        r["size"] for r in list_entries(DiskTier(cache_copy))
    )
    assert (s["hits"] - before["hits"], s["misses"] - before["misses"]) == (N_TINY, N_TINY)
    rows = json.loads(run_cli("ls", "--cache-dir", cache_copy, "--json", check=True).stdout)
    assert len(rows) == N_TINY and all(r["last_used"] and r["compile_seconds"] > 0 for r in rows)
    table = run_cli("ls", "--cache-dir", cache_copy, check=True).stdout
    for col in ("variant", "key", "size", "compile s", "created", "last used"):
        assert col in table
    assert all(r["variant"] in table and r["key"][:12] in table for r in rows)
    proc = run_cli("clear", "--cache-dir", cache_copy, "--json", check=True)
    assert json.loads(proc.stdout)["removed"] == N_TINY
    s = json.loads(run_cli("stats", "--cache-dir", cache_copy, "--json", check=True).stdout)
    assert (s["entries"], s["bytes"], s["hits"], s["misses"]) == (0, 0, 0, 0)
    proc = run_cli("clear", "--cache-dir", cache_copy / "absent")
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
    assert [r["key"] for r in report["gc"]["removed"]] == stale + other[:-2]  # LRU first
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


# -- corrupt entries, orphan files, natural order, a missing directory ----------------


class Key:
    """A stand-in for CacheKey with chosen components (make_meta reads both)."""

    def __init__(self, i: int, geometry: dict, dtype="float32", device="cpu", arch=None):
        self.hexdigest = f"{i:064x}"
        self.comps = {"geometry": json.dumps(geometry), "dtype": dtype, "device": device}
        if arch is not None:
            self.comps["device_arch"] = arch

    def as_dict(self):
        return dict(self.comps)


LLAMA_1B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 64, "block_size": 16}
TINY = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "block_size": 16}


def _put(cache, i, variant, geometry=TINY, size=40_000):
    key = Key(i, geometry)
    data = bytes([i % 256]) * size
    tier = DiskTier(cache)
    tier.put(key.hexdigest, data, make_meta(key, variant, data, 1.0))
    tier.close()
    return key.hexdigest


def test_ls_sorts_variants_naturally_and_names_the_model(tmp_path):
    variants = [
        "paged_attention:1024:64:1",
        "paged_attention:1:2:1",
        "batched_decode:1:8:4",
        "paged_attention:512:32:1",
        "batched_decode:1:8:16",
    ]
    for i, v in enumerate(variants):
        _put(tmp_path, i, v, TINY)
        _put(tmp_path, 100 + i, v, LLAMA_1B)  # the same variants of another model
    rows = json.loads(run_cli("ls", "--cache-dir", tmp_path, "--json", check=True).stdout)
    assert [(r["variant"], r["model"]) for r in rows] == [
        (v, m)
        for v in [
            "batched_decode:1:8:4",
            "batched_decode:1:8:16",
            "paged_attention:1:2:1",
            "paged_attention:512:32:1",
            "paged_attention:1024:64:1",
        ]
        for m in ("4h/2kv/d8 bs16", "llama-3.2-1b bs16")
    ]
    table = run_cli("ls", "--cache-dir", tmp_path, check=True).stdout
    assert "model" in table and "llama-3.2-1b bs16" in table and "4h/2kv/d8 bs16" in table
    assert table.index("paged_attention:1:2:1") < table.index("paged_attention:1024:64:1")


def test_ls_shows_each_entrys_target_and_variant_names_in_full(tmp_path):
    """The key's target (a CPU instruction-set level or a GPU architecture) is a
    column of ``ls`` and a field of ``ls --json``; the variant name is never cut."""
    for i, (variant, arch) in enumerate(
        [("batched_decode:1:128:256", "x86_64/x86-64-v3"), ("paged_attention:1:2:1", "sm_90")]
    ):
        key = Key(i, TINY, arch=arch)
        data = bytes([i]) * 1000
        tier = DiskTier(tmp_path)
        tier.put(key.hexdigest, data, make_meta(key, variant, data, 1.0))
        tier.close()
    rows = json.loads(run_cli("ls", "--cache-dir", tmp_path, "--json", check=True).stdout)
    assert {r["variant"]: r["device_arch"] for r in rows} == {
        "batched_decode:1:128:256": "x86_64/x86-64-v3",
        "paged_attention:1:2:1": "sm_90",
    }
    table = run_cli("ls", "--cache-dir", tmp_path, check=True, env={"COLUMNS": "80"}).stdout
    assert "target" in table and "x86_64/x86-64-v3" in table and "sm_90" in table
    assert "batched_decode:1:128:256" in table


def test_ls_and_stats_list_entries_with_unreadable_metadata_as_corrupt(tmp_path):
    good = _put(tmp_path, 1, "paged_attention:1:1:1")
    garbage = _put(tmp_path, 2, "paged_attention:1:2:1")
    linked = _put(tmp_path, 3, "paged_attention:1:3:1")
    tier = DiskTier(tmp_path)
    tier.cache.set("meta/" + garbage, b"\x00not json{")
    f = tier.artifact_path(linked)
    f.unlink()
    f.symlink_to(f.name)
    tier.close()
    rows = json.loads(run_cli("ls", "--cache-dir", tmp_path, "--json", check=True).stdout)
    by_key = {r["key"]: r for r in rows}
    assert set(by_key) == {good, garbage, linked}
    assert [r["status"] for r in rows] == ["ok", "corrupt", "corrupt"]  # corrupt ones last
    assert by_key[good]["status"] == "ok"
    assert by_key[garbage]["status"] == "corrupt" and "not JSON" in by_key[garbage]["reason"]
    assert by_key[linked]["status"] == "corrupt" and str(f) in by_key[linked]["reason"]
    assert "symbolic link" in by_key[linked]["reason"]
    table = run_cli("ls", "--cache-dir", tmp_path, check=True).stdout
    assert "3 entries, 2 corrupt" in table and f"corrupt {garbage[:12]}: metadata is not" in table
    s = json.loads(run_cli("stats", "--cache-dir", tmp_path, "--json", check=True).stdout)
    assert (s["entries"], s["corrupt"]) == (3, 2)
    assert s["bytes"] == 40_000 * 2  # a link holds no artifact bytes
    proc = run_cli("clear", "--cache-dir", tmp_path, "--json", check=True)
    assert json.loads(proc.stdout)["removed"] == 3
    assert json.loads(run_cli("ls", "--cache-dir", tmp_path, "--json", check=True).stdout) == []


def test_stats_and_ls_on_a_missing_directory_show_zeros_and_create_nothing(tmp_path):
    proc = run_cli("stats", "--cache-dir", tmp_path / "absent", "--json", check=True)
    s = json.loads(proc.stdout)
    assert (s["entries"], s["bytes"], s["hits"], s["misses"], s["exists"]) == (0, 0, 0, 0, False)
    proc = run_cli("stats", "--cache-dir", tmp_path / "absent", check=True)
    assert "0 entries" in proc.stdout and "no cache directory there yet" in proc.stdout
    assert json.loads(run_cli("ls", "--cache-dir", tmp_path / "absent", "--json").stdout) == []
    assert not (tmp_path / "absent").exists()


def test_gc_and_clear_remove_orphan_files_but_keep_young_ones_and_quarantine(tmp_path):
    cache = tmp_path / "c"
    key = _put(cache, 1, "paged_attention:1:1:1")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "precious.val").write_bytes(b"x" * 100)
    old = time.time() - 2 * ORPHAN_GRACE_S

    def orphan(rel, data=b"o" * 50_000, age=old, link=None):
        p = cache / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if link:
            p.symlink_to(link)
            os.utime(p, (age, age), follow_symlinks=False)
        else:
            p.write_bytes(data)
            os.utime(p, (age, age))
        return p

    stale = orphan("aa/bb/" + "1" * 28 + ".val")  # a publisher killed before its row
    young = orphan("aa/cc/" + "2" * 28 + ".val", age=time.time())  # being published now
    link = orphan("dd/ee/" + "3" * 28 + ".val", link=outside / "precious.val")
    other = orphan("aa/bb/notes.txt")  # not a value file: not ours to judge
    proc = run_cli("gc", "--max-size", "1G", "--cache-dir", cache, "--json", check=True)
    report = json.loads(proc.stdout)
    assert report["removed"] == []  # under the limit: no entry removed
    assert report["orphans"] == {"removed": 2, "removed_bytes": 50_000, "kept_young": 1}
    assert not stale.exists() and not link.is_symlink() and young.exists() and other.exists()
    assert not (cache / "dd").exists()  # emptied xx/yy folders pruned
    assert (outside / "precious.val").read_bytes() == b"x" * 100  # never followed
    assert DiskTier(cache, read_only=True).get(key) is not None  # referenced file kept

    stale2 = orphan("ab/cd/" + "4" * 28 + ".val")
    (cache / "quarantine" / f"{key}.20260101T000000Z.1").mkdir(parents=True)
    (cache / "quarantine" / f"{key}.20260101T000000Z.1" / "reason.json").write_text("{}")
    proc = run_cli("clear", "--cache-dir", cache, check=True)
    assert "removed 1 entries" in proc.stdout and "1 quarantined" in proc.stdout
    assert "removed 1 orphan artifact files" in proc.stdout
    assert "kept 1 unreferenced artifact files younger than 60 minutes" in proc.stdout
    assert not stale2.exists() and young.exists() and not (cache / "quarantine").exists()
    assert DiskTier(cache, read_only=True).get(key) is None


@pytest.mark.slow
def test_a_damaged_index_is_a_clear_error_for_every_command(tmp_path, tiny_model):
    """cache.db that is not an SQLite database: every command names it and the
    fix (move it away, warm up again) instead of a traceback."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "cache.db").write_bytes(b"not a database, not even close" * 10)
    cmds = [
        ("verify", *tiny_args(tiny_model)),
        ("warmup", *tiny_args(tiny_model), "--quiet"),
        ("explain", *tiny_args(tiny_model)),
        ("ls",),
        ("stats",),
        ("clear",),
        ("gc", "--max-size", "1"),
    ]
    for cmd in cmds:
        proc = run_cli(*cmd, "--cache-dir", cache)
        assert proc.returncode == 2, (cmd, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert f"the cache index {cache / 'cache.db'} is damaged" in proc.stderr
        assert f"mv {cache / 'cache.db'} {cache / 'cache.db'}.damaged" in proc.stderr
