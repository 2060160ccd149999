"""The Plan: one immutable list of (variant, launch config, key) that every
consumer reads (warmup, verify, engine start, export, explain, tune, gc)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from kernel_cache.config.engine import make_config
from kernel_cache.plan.buckets import KernelVariant
from kernel_cache.plan.launch import ENV_TUNING, variant_defaults
from kernel_cache.plan.plan import GIVEN, Plan
from kernel_cache.store.bundle import export_bundle, read_manifest
from kernel_cache.store.disk_tier import DiskTier, make_meta
from kernel_cache.store.housekeeping import plan_digests
from warmup.check.explain import explain
from warmup.check.verify import verify_plan

from ..conftest import TINY_LIMITS, run_cli, tiny_args

TARGET = "batched_decode:1:2:4"
#: A launch table that sets TARGET to a config other than its default
#: (blocks_per_chunk 2 -> 1).
TUNED = json.dumps(
    {
        "entries": [
            {
                "kernel": "batched_decode",
                "head_dim": 8,
                "num_queries_per_kv": 2,
                "num_kv_heads": 2,
                "num_seqs": 4,
                "num_blocks": 2,
                "config": {"num_kv_splits": 1, "blocks_per_chunk": 1},
            }
        ]
    }
)


def disk_keys(cache) -> dict[str, str]:
    """``{key: sha256 of its artifact file}`` of every entry on disk, read from
    the artifact files the index names (not from any report)."""
    tier = DiskTier(cache, read_only=True)
    try:
        out = {}
        for meta in tier.iter_meta():
            path = tier.artifact_path(meta["key"])
            out[meta["key"]] = hashlib.sha256(path.read_bytes()).hexdigest()
        return out
    finally:
        tier.close()


def fake_cache(directory, plan: Plan) -> None:
    """A cache holding a (non-loadable) entry under every key of ``plan``:
    lookups hit, loading fails; enough to read which key each consumer asks for."""
    tier = DiskTier(directory)
    try:
        for item in plan:
            data = f"not a package: {item.variant}".encode()
            meta = make_meta(item.key, str(item.variant), data, 0.0)
            meta.update(cpu_target="x86-64-v3", cpu_features=[])
            tier.put(item.hexdigest, data, meta)
    finally:
        tier.close()


# -- the plan itself ---------------------------------------------------------------------


def test_plan_items_follow_the_bucketer_and_accessors_agree(tiny_config, monkeypatch):
    monkeypatch.delenv(ENV_TUNING, raising=False)
    plan = Plan.build(tiny_config)
    assert plan.variants == plan.bucketer.variants and len(plan) == len(plan.bucketer.variants)
    assert len({i.hexdigest for i in plan}) == len(plan)  # one key per variant
    for item in plan:
        assert plan.key(item.variant) is item.key
        assert plan.find(str(item.variant)) is item and plan.find(item.variant) is item
        assert item.launch == variant_defaults(tiny_config, item.variant)
        assert item.source == "default"
    missing = KernelVariant.parse("batched_decode:1:3:4")
    assert plan.find("batched_decode:1:3:4") is None and missing not in plan
    with pytest.raises(KeyError):
        plan.key(missing)


def test_plan_is_immutable(tiny_config):
    plan = Plan.build(tiny_config)
    item = plan.items[-1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.items = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.key = plan.items[0].key
    with pytest.raises(TypeError):
        plan._by_variant[item.variant] = plan.items[0]
    changed = item.launch
    changed["num_kv_splits"] = 99
    assert item.launch != changed  # a copy: the item is unchanged
    env = plan.env
    env["torch"] = "0.0"
    assert plan.env["torch"] != "0.0"


def test_equal_configs_give_equal_hashable_plans(tiny_config, tiny_model):
    a = Plan.build(tiny_config)
    b = Plan.build(make_config(str(tiny_model), **TINY_LIMITS), a.env, log_launch=False)
    assert a is not b and a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    c = Plan.build(make_config(str(tiny_model), **{**TINY_LIMITS, "dtype": "bfloat16"}), a.env)
    assert c != a and len({a, c}) == 2


def test_a_field_that_counts_changes_every_key_one_that_does_not_changes_none(
    tiny_config, tiny_model
):
    base = Plan.build(tiny_config)
    bf16 = Plan.build(make_config(str(tiny_model), **{**TINY_LIMITS, "dtype": "bfloat16"}))
    assert bf16.variants == base.variants
    assert all(x.key != y.key for x, y in zip(base, bf16, strict=True))
    assert all(
        dict(x.key.components)["dtype"] != dict(y.key.components)["dtype"]
        for x, y in zip(base, bf16, strict=True)
    )
    # max_num_seqs chooses which variants exist, not how one compiles (keys.EXCLUDED)
    wider = Plan.build(make_config(str(tiny_model), **{**TINY_LIMITS, "max_num_seqs": 8}))
    assert set(wider.variants) > set(base.variants)
    assert all(wider.key(i.variant) == i.key for i in base)


def test_a_launch_table_changes_exactly_the_keys_it_sets(tiny_config, monkeypatch):
    monkeypatch.delenv(ENV_TUNING, raising=False)
    default = Plan.build(tiny_config)
    monkeypatch.setenv(ENV_TUNING, TUNED)
    tuned = Plan.build(tiny_config)
    changed = [str(a.variant) for a, b in zip(default, tuned, strict=True) if a.key != b.key]
    assert changed == [TARGET]
    assert tuned.find(TARGET).source == "env"
    assert tuned.find(TARGET).launch == {"num_kv_splits": 1, "blocks_per_chunk": 1}
    assert tuned.describe_launch() == {
        TARGET: {"config": {"blocks_per_chunk": 1, "num_kv_splits": 1}, "source": "env"}
    }
    # a tuning candidate keyed by the plan equals the plan's own item of that config
    given = default.with_launch(tuned.find(TARGET).variant, tuned.find(TARGET).launch)
    assert given.key == tuned.find(TARGET).key and given.source == GIVEN


def test_plan_digests_are_the_plans_runtime_digests(tiny_config, monkeypatch):
    monkeypatch.setenv(ENV_TUNING, TUNED)
    plan = Plan.build(tiny_config)
    want = {i.key.runtime_digest for i in plan}
    assert plan_digests(tiny_config) == want == plan_digests(plan)


# -- every consumer asks for the plan's keys, under a non-default launch table ------------


def test_explain_export_and_verify_ask_for_the_plans_keys_under_a_launch_table(
    tiny_config, tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV_TUNING, TUNED)
    monkeypatch.setenv("KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED", "1")  # an unsigned bundle
    plan = Plan.build(tiny_config)
    want = {str(i.variant): i.hexdigest for i in plan}
    assert plan.find(TARGET).source == "env"
    cache = tmp_path / "cache"
    fake_cache(cache, plan)
    tier = DiskTier(cache, read_only=True)
    try:
        doc = explain(tiny_config, [tier], list(plan.variants))
        assert {r["variant"]: r["key"] for r in doc["results"]} == want
        assert doc["hits"] == len(plan) and doc["misses"] == 0
        export_bundle(tiny_config, tmp_path / "bundle", [tier])
        manifest = read_manifest(tmp_path / "bundle")
        assert {e.variant: e.key for e in manifest.entries} == want
    finally:
        tier.close()
    report = verify_plan(tiny_config, cache)  # every entry is found, none loads
    assert report["missing"] == [] and report["loaded"] == 0
    assert {c["variant"]: c["key"] for c in report["corrupt"]} == want
    assert report["launch"] == plan.describe_launch()


# -- warmup publishes exactly the plan's keys ------------------------------------------


@pytest.mark.compile
def test_warmup_publishes_exactly_the_plans_keys(warm_cache, tiny_config, monkeypatch):
    monkeypatch.delenv(ENV_TUNING, raising=False)
    cache, _ = warm_cache
    plan = Plan.build(tiny_config)
    on_disk = disk_keys(cache)
    assert set(on_disk) == {i.hexdigest for i in plan}
    assert len([p for p in cache.rglob("*.val")]) == len(plan)


@pytest.mark.compile
def test_under_a_launch_table_warmup_explain_export_and_load_agree_on_every_key(
    cache_copy, tiny_model, tiny_config, tmp_path, monkeypatch
):
    from kernel_cache.runtime.load import load_plan

    monkeypatch.setenv("KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED", "1")  # an unsigned bundle
    monkeypatch.delenv(ENV_TUNING, raising=False)
    before = set(disk_keys(cache_copy))
    proc = run_cli(
        "warmup", *tiny_args(tiny_model), "--cache-dir", cache_copy, "--json",
        env={ENV_TUNING: TUNED}, check=True,
    )  # fmt: skip
    assert json.loads(proc.stdout)["compiled"] == 1
    monkeypatch.setenv(ENV_TUNING, TUNED)
    plan = Plan.build(tiny_config)
    want = {str(i.variant): i.hexdigest for i in plan}
    new = set(disk_keys(cache_copy)) - before
    assert new == {want[TARGET]}  # warmup published the plan's key of the tuned variant
    assert set(want.values()) <= before | new
    tier = DiskTier(cache_copy, read_only=True)
    try:
        doc = explain(tiny_config, [tier], list(plan.variants))
        assert {r["variant"]: r["key"] for r in doc["results"]} == want
        assert {r["status"] for r in doc["results"]} == {"hit"}
        export_bundle(tiny_config, tmp_path / "bundle", [tier])
    finally:
        tier.close()
    manifest = read_manifest(tmp_path / "bundle")
    assert {e.variant: e.key for e in manifest.entries} == want
    rt = load_plan(tiny_config, tiers=[DiskTier(cache_copy, read_only=True)])
    assert rt.stats()["loads"] == len(plan)
    assert {str(v): c for v, c in rt.launch.items()} == {str(i.variant): i.launch for i in plan}
