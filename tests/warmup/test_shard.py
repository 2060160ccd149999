"""Sharded warmup: deterministic, disjoint, covering, balanced by expected compile time;
``--shard auto`` in a Kubernetes Indexed Job."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_cache.config.engine import make_config
from kernel_cache.config.settings import SettingError
from kernel_cache.errors import ConfigError
from kernel_cache.plan.buckets import Bucketer
from warmup.builder.shard import (
    COST_MODEL,
    expected_compile_seconds,
    parse_shard,
    resolve_shard,
    shard_costs,
    split_plan,
)
from warmup.cli.main import main

from ..conftest import run_cli, tiny_args


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


# -- --shard auto: a Kubernetes Indexed Job's JOB_COMPLETION_INDEX ---------------------


@pytest.mark.parametrize(
    "shards,environ,expected",
    [
        (3, {"JOB_COMPLETION_INDEX": "0"}, (0, 3)),
        (3, {"JOB_COMPLETION_INDEX": " 2 "}, (2, 3)),
        (None, {"JOB_COMPLETION_INDEX": "5", "KERNEL_CACHE_SHARDS": "8"}, (5, 8)),
        (2, {"JOB_COMPLETION_INDEX": "1", "KERNEL_CACHE_SHARDS": "8"}, (1, 2)),  # flag wins
    ],
)
def test_auto_reads_the_job_completion_index(shards, environ, expected):
    assert resolve_shard("auto", shards, environ) == expected
    assert resolve_shard("AUTO", shards, environ) == expected


def test_an_explicit_shard_ignores_the_job_index():
    env = {"JOB_COMPLETION_INDEX": "2", "KERNEL_CACHE_SHARDS": "9"}
    assert resolve_shard("1/3", None, env) == (1, 3)
    assert resolve_shard("1/3", 3, env) == (1, 3)


@pytest.mark.parametrize(
    "spec,shards,environ,needles",
    [
        # auto without a count: names both inputs and the fix
        (
            "auto",
            None,
            {"JOB_COMPLETION_INDEX": "0"},
            ["no shard count", "--shards N", "KERNEL_CACHE_SHARDS=N"],
        ),
        # outside an Indexed Job
        (
            "auto",
            4,
            {},
            ["JOB_COMPLETION_INDEX is not set", "completionMode: Indexed", "--shard I/4"],
        ),
        ("auto", 4, {"JOB_COMPLETION_INDEX": "  "}, ["JOB_COMPLETION_INDEX is not set"]),
        # not a non-negative integer
        (
            "auto",
            4,
            {"JOB_COMPLETION_INDEX": "two"},
            ["JOB_COMPLETION_INDEX='two'", "non-negative integer", "0..3"],
        ),
        ("auto", 4, {"JOB_COMPLETION_INDEX": "-1"}, ["JOB_COMPLETION_INDEX='-1'", "0..3"]),
        ("auto", 4, {"JOB_COMPLETION_INDEX": "1.0"}, ["JOB_COMPLETION_INDEX='1.0'"]),
        # index >= count: the value, the limit, where the count came from, the fix
        (
            "auto",
            4,
            {"JOB_COMPLETION_INDEX": "4"},
            ["JOB_COMPLETION_INDEX=4", "outside 0..3", "--shards 4", "completions", "at least 5"],
        ),
        (
            "auto",
            None,
            {"JOB_COMPLETION_INDEX": "7", "KERNEL_CACHE_SHARDS": "3"},
            ["JOB_COMPLETION_INDEX=7", "outside 0..2", "KERNEL_CACHE_SHARDS=3"],
        ),
        # a bad count
        ("auto", 0, {"JOB_COMPLETION_INDEX": "0"}, ["--shards 0", ">= 1"]),
        ("1/3", 4, {}, ["--shards 4 disagrees with --shard '1/3'", "N = 3"]),
    ],
)
def test_bad_shard_input_names_input_value_limit_and_fix(spec, shards, environ, needles):
    with pytest.raises(ConfigError) as e:
        resolve_shard(spec, shards, environ)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_a_bad_shards_variable_is_a_setting_error():
    with pytest.raises(SettingError, match=r"KERNEL_CACHE_SHARDS='0'.*an integer >= 1"):
        resolve_shard("auto", None, {"JOB_COMPLETION_INDEX": "0", "KERNEL_CACHE_SHARDS": "0"})


def _main(monkeypatch, capsys, *argv, **env):
    """``kernel-cache ARGV`` in this process (the real parser and command) with only
    ``env`` of the shard variables set: ``(exit status, stdout, stderr)``."""
    for var in ("JOB_COMPLETION_INDEX", "KERNEL_CACHE_SHARDS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_shows_the_shard_an_indexed_job_pod_gets(tiny_model, tiny_config, monkeypatch, capsys):
    """``kernel-cache plan --shard auto`` in N pods (JOB_COMPLETION_INDEX 0..N-1)
    lists N disjoint shards covering the plan, the ones ``--shard I/N`` names."""
    plan = [str(v) for v in Bucketer(tiny_config).variants]

    def shard(*args, **env):
        rc, out, err = _main(
            monkeypatch, capsys, "plan", *tiny_args(tiny_model), *args, "--json", **env
        )
        assert rc == 0, err
        return json.loads(out)["shard"]

    got = [
        shard("--shard", "auto", JOB_COMPLETION_INDEX=str(i), KERNEL_CACHE_SHARDS="3")
        for i in range(3)
    ]
    assert [(s["index"], s["count"]) for s in got] == [(0, 3), (1, 3), (2, 3)]
    assert sorted(v for s in got for v in s["variants"]) == sorted(plan)
    assert shard("--shard", "1/3")["variants"] == got[1]["variants"]
    flag = shard("--shard", "auto", "--shards", "3", JOB_COMPLETION_INDEX="1")
    assert flag["variants"] == got[1]["variants"]
    rc, out, _ = _main(monkeypatch, capsys, "plan", *tiny_args(tiny_model), "--shard", "1/3")
    listed = [line.strip() for line in out.splitlines() if line.startswith("  ") and ":" in line]
    assert rc == 0 and "shard 1/3:" in out
    assert [v for v in listed if v in plan] == got[1]["variants"]


@pytest.mark.parametrize(
    "args,env,needle",
    [
        (["--shard", "auto"], {"JOB_COMPLETION_INDEX": "0"}, "no shard count"),
        (["--shard", "auto", "--shards", "3"], {}, "JOB_COMPLETION_INDEX is not set"),
        (
            ["--shard", "auto", "--shards", "3"],
            {"JOB_COMPLETION_INDEX": "3"},
            "JOB_COMPLETION_INDEX=3 is outside 0..2",
        ),
        (
            ["--shard", "auto", "--shards", "3"],
            {"JOB_COMPLETION_INDEX": "x"},
            "JOB_COMPLETION_INDEX='x'",
        ),
        (
            ["--shard", "auto"],
            {"JOB_COMPLETION_INDEX": "0", "KERNEL_CACHE_SHARDS": "many"},
            "KERNEL_CACHE_SHARDS='many'",
        ),
        (["--shards", "3"], {}, "--shards 3 without --shard"),
    ],
)
def test_cli_rejects_bad_auto_shards_before_compiling(
    tiny_model, tmp_path, monkeypatch, capsys, args, env, needle
):
    """warmup and plan exit 2 (a config error) with the message; warmup has
    created nothing."""
    for cmd in ("warmup", "plan"):
        more = ["--cache-dir", tmp_path / "cache"] if cmd == "warmup" else []
        rc, _, err = _main(monkeypatch, capsys, cmd, *tiny_args(tiny_model), *more, *args, **env)
        assert rc == 2 and needle in err and err.startswith(f"kernel-cache {cmd}: error: "), err
    assert not (tmp_path / "cache").exists()


def test_cli_auto_outside_an_indexed_job_in_a_real_process(tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JOB_COMPLETION_INDEX"}
    proc = run_cli(
        "warmup",
        *tiny_args(tiny_model),
        "--cache-dir",
        tmp_path,
        "--shard",
        "auto",
        "--shards",
        "4",
        env=env,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "JOB_COMPLETION_INDEX is not set" in proc.stderr and "--shard I/4" in proc.stderr
    assert list(tmp_path.iterdir()) == []
