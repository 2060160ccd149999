"""Sharded warmup: deterministic, disjoint, covering, balanced by expected compile time."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_cache.config.engine import make_config
from kernel_cache.errors import ConfigError
from kernel_cache.plan.buckets import Bucketer
from warmup.build.shard import (
    COST_MODEL,
    expected_compile_seconds,
    parse_shard,
    shard_costs,
    split_plan,
)

from .conftest import run_cli, tiny_args


@pytest.mark.parametrize("text,expected", [("0/1", (0, 1)), ("2/3", (2, 3)), (" 4 / 16 ", (4, 16))])
def test_parse_shard(text, expected):
    assert parse_shard(text) == expected


@pytest.mark.parametrize(
    "text,match",
    [
        ("3/3", "outside 0..2; shards are 0-based"),
        ("1/0", "at least 1"),
        ("a/b", "expected I/N"),
        ("1", "expected I/N"),
        ("-1/3", "expected I/N"),
    ],
)
def test_parse_shard_rejects_with_the_fix(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_shard(text)


def _plan(max_model_len, block_size, max_num_seqs):
    cfg = make_config(
        "llama-3.2-1b",
        max_model_len=max_model_len,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_model_len,
    )
    return cfg, Bucketer(cfg).variants


@settings(max_examples=60, deadline=None)
@given(
    max_model_len=st.integers(16, 16384),
    block_size=st.sampled_from([16, 32, 128]),
    max_num_seqs=st.integers(1, 256),
    count=st.integers(1, 12),
)
def test_shards_are_disjoint_cover_the_plan_and_are_balanced(
    max_model_len, block_size, max_num_seqs, count
):
    cfg, plan = _plan(max_model_len, block_size, max_num_seqs)
    shards = split_plan(cfg, plan, count)
    assert len(shards) == count
    flat = [v for s in shards for v in s]
    assert len(flat) == len(set(flat)) == len(plan) and set(flat) == set(plan)
    assert shards == split_plan(cfg, list(plan), count)  # deterministic
    order = {v: i for i, v in enumerate(plan)}
    assert all([order[v] for v in s] == sorted(order[v] for v in s) for s in shards)
    # Greedy list scheduling bound: the largest shard is within one variant of the mean.
    costs = shard_costs(cfg, shards)
    biggest = max(expected_compile_seconds(cfg, v) for v in plan)
    assert max(costs) <= sum(costs) / count + biggest + 1e-6


def test_balance_is_by_cost_not_count(monkeypatch):
    """With paged_attention costing 5x batched_decode, shards even out seconds, not counts."""
    cfg, plan = _plan(4096, 128, 64)
    monkeypatch.setitem(COST_MODEL, "base", {"paged_attention": 50.0, "batched_decode": 10.0})
    monkeypatch.setitem(COST_MODEL, "per_doubling", 0.0)
    shards = split_plan(cfg, plan, 3)
    costs = shard_costs(cfg, shards)
    assert max(costs) - min(costs) <= 50.0
    counts = sorted(len(s) for s in shards)
    assert counts[0] < counts[-1]  # unequal counts buy equal seconds


def test_cli_rejects_a_bad_shard_before_compiling(tiny_model, tmp_path):
    proc = run_cli("warmup", *tiny_args(tiny_model), "--cache-dir", tmp_path, "--shard", "3/3")
    assert proc.returncode == 2
    assert "--shard '3/3'" in proc.stderr and "0-based" in proc.stderr
    assert list(tmp_path.iterdir()) == []
