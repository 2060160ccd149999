"""Launch-config resolver: precedence, validation, logging, keys, bundled tables (no compiles)."""

import json
import logging
import re

import pytest

from kernel_cache.errors import ConfigError
from kernel_cache.plan.buckets import Bucketer, KernelVariant
from kernel_cache.plan.keys import build_key, environment
from kernel_cache.plan.launch import BUNDLED_DIR, ENV_TUNING, Resolver, default_launch, resolve_plan
from kernel_cache.plan.tables import arch_family, load_table, parse_table, table_filename

from ..conftest import run_cli, tiny_args

ARCH = "test_arch/X"  # a fake architecture: the real bundled tables never match it
D8 = KernelVariant(kernel="batched_decode", query_len=1, num_blocks=2, num_seqs=4)
D1 = KernelVariant(kernel="batched_decode", query_len=1, num_blocks=1, num_seqs=4)


def entry(num_blocks=2, num_seqs=4, kernel="batched_decode", **config):
    """A table entry for the tiny geometry (head_dim 8, 2 KV heads, 2 queries per KV head)."""
    return {
        "kernel": kernel,
        "head_dim": 8,
        "num_queries_per_kv": 2,
        "num_kv_heads": 2,
        "num_seqs": num_seqs,
        "num_blocks": num_blocks,
        "config": config,
    }


def table(*entries, arch=None) -> dict:
    doc = {"format": "kernel-cache-launch/1", "entries": list(entries)}
    if arch:
        doc["device_arch"] = arch
    return doc


def bundled_dir(tmp_path, arch, *entries):
    d = tmp_path / "bundled"
    d.mkdir(exist_ok=True)
    (d / table_filename(arch)).write_text(json.dumps(table(*entries, arch=arch)))
    return d


def test_defaults_reproduce_todays_kernels():
    assert default_launch("batched_decode", 11) == {"blocks_per_chunk": 11, "num_kv_splits": 1}
    assert default_launch("paged_attention", 11) == {}
    r = Resolver(environ={}, bundled_dir="/nonexistent").resolve(_cfg(), D8, ARCH)
    assert (r.config, r.source) == ({"blocks_per_chunk": 2, "num_kv_splits": 1}, "default")


def _cfg():
    from kernel_cache.config.engine import make_config

    return make_config(
        None, num_heads=4, num_kv_heads=2, head_dim=8, max_model_len=32, block_size=16,
        max_num_seqs=4, max_num_batched_tokens=32,
    )  # fmt: skip


@pytest.mark.parametrize("form", ["inline", "path"])
def test_precedence_env_then_bundled_then_defaults(tmp_path, form):
    cfg = _cfg()
    d = bundled_dir(
        tmp_path,
        ARCH,
        entry(num_blocks=2, num_kv_splits=2),
        entry(num_blocks=1, blocks_per_chunk=1),
    )
    override = table(entry(num_blocks=2, num_kv_splits=1, blocks_per_chunk=1))
    if form == "inline":
        value = json.dumps(override)
    else:
        value = str(tmp_path / "override.json")
        (tmp_path / "override.json").write_text(json.dumps(override))
    paged = KernelVariant(kernel="paged_attention", query_len=1, num_blocks=2, num_seqs=1)
    res = Resolver({ENV_TUNING: value}, d)
    got = {v: res.resolve(cfg, v, ARCH) for v in (D8, D1, paged)}
    assert (got[D8].source, got[D8].config) == ("env", {"blocks_per_chunk": 1, "num_kv_splits": 1})
    assert (got[D1].source, got[D1].config) == (
        "bundled",
        {"blocks_per_chunk": 1, "num_kv_splits": 1},
    )
    assert (got[paged].source, got[paged].config) == ("default", {})
    # Without the override the bundled entry wins (a field it omits takes its default:
    # blocks_per_chunk = the 1 block of one split).
    got = Resolver({}, d).resolve(cfg, D8, ARCH)
    assert (got.source, got.config) == ("bundled", {"blocks_per_chunk": 1, "num_kv_splits": 2})
    # Another architecture: the bundled table does not apply, the override (no arch) does.
    assert Resolver({}, d).resolve(cfg, D8, "other/ISA").source == "default"
    assert Resolver({ENV_TUNING: value}, d).resolve(cfg, D8, "other/ISA").source == "env"


def test_arch_specific_override_entry_wins_over_wildcard():
    e_any = entry(num_kv_splits=2)
    e_arch = {**entry(num_kv_splits=1, blocks_per_chunk=1), "device_arch": ARCH}
    res = Resolver({ENV_TUNING: json.dumps(table(e_any, e_arch))}, "/nonexistent")
    assert res.resolve(_cfg(), D8, ARCH).config == {"blocks_per_chunk": 1, "num_kv_splits": 1}
    assert res.resolve(_cfg(), D8, "other/ISA").config["num_kv_splits"] == 2


def test_bundled_lookup_is_ready_for_an_sm_90_table(tmp_path):
    d = bundled_dir(tmp_path, "sm_90", entry(num_kv_splits=2))
    assert (d / "sm_90.json").is_file()
    h200 = "sm_90 cuda 13.0 triton 3.6.0"
    assert arch_family(h200) == "sm_90" and table_filename(h200) == "sm_90.json"
    res = Resolver({}, d)
    assert res.resolve(_cfg(), D8, h200).source == "bundled"
    assert res.resolve(_cfg(), D8, "sm_80 cuda 13.0 triton 3.6.0").source == "default"
    assert "bundled sm_90.json (1 entries)" in res.sources(h200)


def _cuda_cfg():
    return _cfg().model_copy(update={"device": "cuda", "dtype": "bfloat16"})


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "num_blocks", "block_size", "splits"),
    [
        (32, 8, 64, 128, 4),  # granite-3.3-8b, 32 x 8192 tokens: 2048 tokens per split
        (1, 8, 64, 128, 32),  # one sequence: 256 tokens (MIN_SPLIT_TOKENS) per split
        (64, 8, 64, 128, 2),  # 512 programs already: 4096 tokens per split
        (4, 2, 2, 16, 1),  # the tiny plan: under 256 tokens, one split
        (1, 1, 5, 100, 2),  # 256 tokens -> 3 blocks per split: 3 + 2 blocks
    ],
)
def test_cuda_default_splits_whole_blocks_of_at_least_256_tokens(
    num_seqs, num_kv_heads, num_blocks, block_size, splits
):
    from kernel_cache.kernels.tiles import MIN_SPLIT_TOKENS, cuda_default_splits

    got = cuda_default_splits(num_seqs, num_kv_heads, num_blocks, block_size)
    assert got == splits
    per_split = -(-num_blocks // got)
    assert per_split * block_size >= min(MIN_SPLIT_TOKENS, num_blocks * block_size)


def test_cuda_defaults_are_the_triton_heuristic_and_blocks_per_chunk_is_refused(tmp_path):
    big = KernelVariant(kernel="batched_decode", query_len=1, num_blocks=2, num_seqs=1)
    cpu = Resolver({}, "/nonexistent").resolve(_cfg(), big, ARCH)
    assert cpu.config == {"blocks_per_chunk": 2, "num_kv_splits": 1}
    cuda = Resolver({}, "/nonexistent").resolve(_cuda_cfg(), big, "sm_90 cuda 13.0")
    assert cuda.source == "default" and cuda.config["num_kv_splits"] == 1  # 32 tokens: 1 split
    # a table entry for a CUDA variant may set num_kv_splits only
    ok = Resolver({ENV_TUNING: json.dumps(table(entry(num_kv_splits=2)))}, "/nonexistent")
    assert ok.resolve(_cuda_cfg(), D8, "sm_90").config == {
        "blocks_per_chunk": 1,
        "num_kv_splits": 2,
    }
    bad = Resolver(
        {ENV_TUNING: json.dumps(table(entry(num_kv_splits=1, blocks_per_chunk=1)))},
        "/nonexistent",
    )
    with pytest.raises(ConfigError, match=r"sets blocks_per_chunk=1, but on CUDA.*leave"):
        bad.resolve(_cuda_cfg(), D8, "sm_90")
    assert bad.resolve(_cfg(), D8, ARCH).config == {"blocks_per_chunk": 1, "num_kv_splits": 1}


def test_cuda_prefill_tiles_default_per_query_bucket_and_merge_table_entries():
    """On CUDA paged_attention is the Triton prefill kernel: its tiles default per
    query bucket, a table entry may set some of them (the rest take defaults); on
    the CPU the plain kernel takes none, and an entry setting one is refused."""
    from kernel_cache.kernels.tiles import cuda_prefill_defaults

    p1 = KernelVariant(kernel="paged_attention", query_len=1, num_blocks=2, num_seqs=1)
    p32 = KernelVariant(kernel="paged_attention", query_len=32, num_blocks=2, num_seqs=1)
    none = Resolver({}, "/nonexistent")
    assert none.resolve(_cfg(), p32, ARCH).config == {}  # the CPU keys are unchanged
    # tiny geometry: 2 query heads per KV head; 1 token -> 16 rows, 32 tokens -> 64 rows
    assert none.resolve(_cuda_cfg(), p1, "sm_90").config == cuda_prefill_defaults(1, 2, 8)
    assert none.resolve(_cuda_cfg(), p1, "sm_90").config["block_m"] == 16
    assert none.resolve(_cuda_cfg(), p32, "sm_90").config["block_m"] == 64
    assert cuda_prefill_defaults(512, 4, 128)["block_m"] == 128
    doc = table(entry(kernel="paged_attention", num_seqs=1, block_n=32))
    got = Resolver({ENV_TUNING: json.dumps(doc)}, "/nonexistent").resolve(_cuda_cfg(), p32, "sm_90")
    assert got.source == "env" and got.config == {**cuda_prefill_defaults(32, 2, 8), "block_n": 32}
    with pytest.raises(ConfigError, match=r"on the CPU paged_attention is the plain-PyTorch"):
        Resolver({ENV_TUNING: json.dumps(doc)}, "/nonexistent").resolve(_cfg(), p32, ARCH)


BAD = [
    (
        table(entry(kernel="flash")),
        r"entries\[0\]\.kernel='flash': Input should be 'paged_attention' or 'batched_decode'",
    ),
    (
        table({**entry(), "tile": 4}),
        r"entries\[0\]\.tile: unknown field \(value 4\); accepted: config, device_arch",
    ),
    (table(entry(tile_n=64)), r"unknown field\(s\) \['tile_n'\] for kernel batched_decode"),
    (
        table(entry(kernel="paged_attention", num_seqs=1, num_kv_splits=2)),
        r"unknown field\(s\) \['num_kv_splits'\] for kernel paged_attention; accepted fields: "
        "block_m, block_n, num_stages, num_warps",
    ),
    (
        table(entry(kernel="paged_attention", num_seqs=1, block_m=48)),
        r"block_m=48 must be a power of two in \[16, 256\]",
    ),
    (
        table(entry(num_blocks=8, blocks_per_chunk=3)),
        r"num_blocks=8\).*blocks_per_chunk=3 does not divide the 8 blocks of one KV split",
    ),
    (
        table(entry(num_blocks=5, num_kv_splits=2, blocks_per_chunk=2)),
        r"blocks_per_chunk=2 does not divide the 3 blocks of one KV split.*accepted: \[1, 3\]",
    ),
    (
        table(entry(num_blocks=8, num_kv_splits=0)),
        r"num_kv_splits=0 is outside \[1, num_blocks=8\]",
    ),
    (
        table(entry(num_blocks=8, num_kv_splits=9)),
        r"num_kv_splits=9 is outside \[1, num_blocks=8\]",
    ),
    (
        table(entry(num_kv_splits="2")),
        r"entries\[0\]\.config\.num_kv_splits='2': Input should be a valid integer",
    ),
    (table(entry(), entry()), r"entries\[1\].*a second entry for the same key"),
    (
        {**table(), "tables": []},
        r"tables: unknown field \(value \[\]\); accepted: about, device_arch, entries, format",
    ),
    (
        table({k: v for k, v in entry().items() if k != "num_seqs"}),
        r"entries\[0\]\.num_seqs: required field missing",
    ),
    (
        table(entry(num_blocks=0)),
        r"entries\[0\]\.num_blocks=0: Input should be greater than or equal to 1",
    ),
]


@pytest.mark.parametrize("doc,match", BAD)
def test_invalid_tables_name_the_entry_and_the_rule(doc, match):
    with pytest.raises(ConfigError, match=match) as e:
        Resolver({ENV_TUNING: json.dumps(doc)}, "/nonexistent")
    assert str(e.value).startswith("KERNEL_CACHE_TUNING (inline JSON): ")


def test_bad_override_sources(tmp_path):
    with pytest.raises(ConfigError, match=r"KERNEL_CACHE_TUNING \(inline JSON\): not valid JSON"):
        Resolver({ENV_TUNING: "{not json"})
    with pytest.raises(ConfigError, match=r"KERNEL_CACHE_TUNING=.*no such file"):
        Resolver({ENV_TUNING: str(tmp_path / "missing.json")})


def test_bundled_table_must_hold_its_files_architecture(tmp_path):
    d = tmp_path / "b"
    d.mkdir()
    (d / "sm_90.json").write_text(json.dumps(table(entry(), arch="sm_80")))
    with pytest.raises(ConfigError, match=r"bundled sm_90.json: device_arch='sm_80' does not"):
        Resolver({}, d).resolve(_cfg(), D8, "sm_90 cuda 13.0 triton 3.6.0")


def test_resolve_plan_logs_one_compact_table(caplog, tiny_config):
    plan = Bucketer(tiny_config).variants
    res = Resolver({ENV_TUNING: json.dumps(table(entry(num_kv_splits=2)))}, "/nonexistent")
    with caplog.at_level(logging.INFO, logger="kernel_cache.plan.launch"):
        out = resolve_plan(tiny_config, plan, ARCH, resolver=res)
    records = [r for r in caplog.records if r.name == "kernel_cache.plan.launch"]
    assert len(records) == 1
    text = records[0].getMessage()
    assert f"launch config for {len(plan)} variants" in text
    assert "batched_decode:1:2:4  env" in text
    assert f"{len(plan) - 1} variant(s) at defaults" in text
    assert [v for v, r in out.items() if r.source != "default"] == [D8]
    assert "(1 entries, 1 used by this plan)" in text
    # an entry for a bucket the plan does not have shows as unused
    res = Resolver({ENV_TUNING: json.dumps(table(entry(num_blocks=7)))}, "/nonexistent")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kernel_cache.plan.launch"):
        resolve_plan(tiny_config, plan, ARCH, resolver=res)
    assert "(1 entries, 0 used by this plan)" in caplog.records[-1].getMessage()


def test_one_entry_changes_exactly_one_key(monkeypatch, tiny_config):
    plan = Bucketer(tiny_config).variants
    env = environment("cpu")

    def keys():
        return {v: build_key(tiny_config, v, env).hexdigest for v in plan}

    monkeypatch.delenv(ENV_TUNING, raising=False)
    base = keys()
    # An entry that spells out the defaults: same keys (the key holds the resolved config).
    monkeypatch.setenv(ENV_TUNING, json.dumps(table(entry(num_kv_splits=1, blocks_per_chunk=2))))
    assert keys() == base
    monkeypatch.setenv(ENV_TUNING, json.dumps(table(entry(num_kv_splits=2))))
    changed = {v for v, k in keys().items() if k != base[v]}
    assert changed == {D8}
    comp = build_key(tiny_config, D8, env).as_dict()["launch_config"]
    assert json.loads(comp) == {"blocks_per_chunk": 1, "num_kv_splits": 2}


def test_shipped_tables_are_valid_and_measured():
    files = sorted(BUNDLED_DIR.glob("*.json"))
    assert any(f.name == "x86_64-x86-64-v3.json" for f in files), "the CPU table ships"
    for f in files:
        doc = json.loads(f.read_text())
        assert table_filename(doc["device_arch"]) == f.name
        t = parse_table(doc, f.name, require_arch=doc["device_arch"])
        assert len(t) == len(doc["entries"]) > 0
        for e in doc["entries"]:
            m = e["measured"]
            assert m["speedup"] > 0 and m["default_ms"][1] <= m["default_ms"][0]
            assert all(c["ok"] for c in m["candidates"] if c["config"] == e["config"])
        assert load_table(f).device_arch == doc["device_arch"]


def test_cli_rejects_a_bad_table_with_exit_2(tiny_model):
    bad = json.dumps(table(entry(num_kv_splits=3)))
    proc = run_cli("plan", *tiny_args(tiny_model), env={ENV_TUNING: bad})
    assert proc.returncode == 2
    assert "kernel-cache plan: error: KERNEL_CACHE_TUNING (inline JSON): entries[0]" in proc.stderr
    assert "num_kv_splits=3 is outside [1, num_blocks=2]" in proc.stderr


@pytest.mark.parametrize("where", ["under_a_file", "a_directory"])
def test_tune_refuses_an_unwritable_out_before_compiling(tiny_model, tmp_path, where):
    """``--out`` is checked before any compile: a file in the way of its parent,
    or a directory, is a clear error (exit 2), and nothing is compiled or written."""
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    out = tmp_path / "afile" / "t.json" if where == "under_a_file" else tmp_path / "adir"
    cache = tmp_path / "cache"
    proc = run_cli(
        "tune", *tiny_args(tiny_model), "--variants", "batched_decode:1:2:4",
        "--num-kv-splits", "1,2", "--chunks-per-split", "1", "--rounds", "3",
        "--out", out, "--cache-dir", cache,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"kernel-cache tune: error: --out '{out}'" in proc.stderr
    assert not cache.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile", "cache"][:2]
    assert list((tmp_path / "adir").iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["paged_attention:32:2:1", "batched_decode:1:2:4"])
def test_tune_for_cuda_without_a_gpu_is_refused_before_out_is_touched(
    tiny_model, tmp_path, variant
):
    """``--device cuda`` where no GPU is usable: a clear error (exit 2), and
    neither --out's directories nor the cache directory are created."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is usable here")
    out, cache = tmp_path / "tables" / "t.json", tmp_path / "cache"
    proc = run_cli(
        "tune", *tiny_args(tiny_model), "--device", "cuda", "--variants", variant,
        "--out", out, "--cache-dir", cache,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "kernel-cache tune: error: device='cuda'" in proc.stderr
    assert "use --device cpu" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"rounds": 1}, "--rounds 1: at least 3"),
        ({"target_ms": float("inf")}, "--target-ms inf: must be a finite"),
        ({"target_ms": float("nan")}, "--target-ms nan: must be a finite"),
        ({"target_ms": 0.0}, "--target-ms 0.0: must be a finite"),
        ({"min_gain": -0.1}, "--min-gain -0.1"),
    ],
)
def test_tune_settings_are_checked(kw, match):
    from warmup.tune import TuneSettings

    with pytest.raises(ConfigError, match=re.escape(match)):
        TuneSettings(**kw).check()


def test_tune_split_lists_are_checked_with_a_fitting_example(tiny_model, tmp_path):
    proc = run_cli(
        "tune", *tiny_args(tiny_model), "--variants", "batched_decode:1:2:4",
        "--num-kv-splits", "0", "--out", tmp_path / "t.json", "--cache-dir", tmp_path / "c",
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--num-kv-splits: entry '0' is not a positive integer" in proc.stderr
    assert "such as 1,2,4" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_field_given_twice_is_refused_not_last_wins(tmp_path):
    entry = (
        '{"kernel": "batched_decode", "head_dim": 8, "num_queries_per_kv": 2, '
        '"num_kv_heads": 2, "num_seqs": 4, "num_blocks": 2, '
        '"config": {"num_kv_splits": 1, "num_kv_splits": 2}}'
    )
    doc = '{"entries": [' + entry + "]}"
    with pytest.raises(ConfigError, match=r"inline JSON\): field 'num_kv_splits' is given twice"):
        Resolver({ENV_TUNING: doc})
    path = tmp_path / "t.json"
    path.write_text(doc)
    with pytest.raises(ConfigError, match=r"t.json: field 'num_kv_splits' is given twice"):
        Resolver({ENV_TUNING: str(path)})


def test_prefill_entry_for_a_query_bucket_wins_over_one_for_every_bucket():
    """On CUDA a paged_attention entry may name its query bucket: it wins for that
    bucket; an entry without one still sets every other bucket of its KV bucket;
    an arch-less entry for the bucket wins over an arch entry for every bucket."""
    from kernel_cache.kernels.tiles import cuda_prefill_defaults

    p32 = KernelVariant(kernel="paged_attention", query_len=32, num_blocks=2, num_seqs=1)
    p16 = KernelVariant(kernel="paged_attention", query_len=16, num_blocks=2, num_seqs=1)
    every = entry(kernel="paged_attention", num_seqs=1, block_n=32)
    only32 = {**entry(kernel="paged_attention", num_seqs=1, block_n=64), "query_len": 32}
    res = Resolver({ENV_TUNING: json.dumps(table(every, only32))}, "/nonexistent")
    assert res.resolve(_cuda_cfg(), p32, "sm_90").config["block_n"] == 64
    assert res.resolve(_cuda_cfg(), p16, "sm_90").config == {
        **cuda_prefill_defaults(16, 2, 8),
        "block_n": 32,
    }
    doc = table({**only32, "config": {"block_n": 16}}, {**every, "device_arch": "sm_90"})
    res = Resolver({ENV_TUNING: json.dumps(doc)}, "/nonexistent")
    assert res.resolve(_cuda_cfg(), p32, "sm_90").config["block_n"] == 16


@pytest.mark.parametrize(
    "entries, match",
    [
        (
            [{**entry(), "query_len": 4}],
            "query_len=4: batched_decode variants have one query token",
        ),
        (
            [{**entry(kernel="paged_attention", num_seqs=1), "query_len": 32}] * 2,
            r"a second entry for the same key",
        ),
        (
            [{**entry(kernel="paged_attention", num_seqs=1), "query_len": 0}],
            r"entries\[0\]\.query_len=0: Input should be greater than or equal to 1 "
            r"\(the field: query bucket in tokens \(paged_attention only\); leave it out",
        ),
    ],
)
def test_query_len_entries_are_checked(entries, match):
    with pytest.raises(ConfigError, match=match):
        parse_table(table(*entries), "t.json")
    # one entry per query bucket, and one for every bucket, may stand side by side
    p = entry(kernel="paged_attention", num_seqs=1)
    ok = parse_table(table(p, {**p, "query_len": 32}, {**p, "query_len": 16}), "t.json")
    assert len(ok) == 3


def test_tune_prefill_candidates_fit_the_kernel_and_the_query_bucket():
    """CUDA prefill candidates: the defaults first, no duplicates, block_m from
    the GQA group to the rows the query bucket fills, shared memory within the
    limit; the tile lists are checked like table entries."""
    from kernel_cache.kernels.tiles import (
        PREFILL_SMEM_BYTES,
        cuda_prefill_defaults,
        prefill_smem_bytes,
    )
    from warmup.tune import TuneSettings, candidates

    cfg = _cuda_cfg().model_copy(update={"head_dim": 256, "num_heads": 16, "num_kv_heads": 2})
    settings = TuneSettings(block_m=(16, 64, 256), block_n=(64, 128), num_stages=(2, 4))
    p8 = KernelVariant(kernel="paged_attention", query_len=8, num_blocks=2, num_seqs=1)
    got = candidates(p8, settings, cfg)
    assert got[0] == cuda_prefill_defaults(8, 8, 256)
    assert len({json.dumps(c, sort_keys=True) for c in got}) == len(got) > 2
    for c in got[1:]:
        assert 16 <= c["block_m"] <= 64  # 8 tokens x 8 heads per KV head
        assert prefill_smem_bytes(c["block_m"], c["block_n"], c["num_stages"], 256) <= (
            PREFILL_SMEM_BYTES
        )
    # (4 * 2 * 128 + 64) * 256 * 2 bytes is over the limit: that tile is left out
    assert {"block_m": 64, "block_n": 128, "num_stages": 4, "num_warps": 8} not in got
    assert {"block_m": 64, "block_n": 64, "num_stages": 2, "num_warps": 8} in got
    with pytest.raises(ConfigError, match=r"--block-m: block_m=24 must be a power of two"):
        TuneSettings(block_m=(24,)).check()
    with pytest.raises(ConfigError, match=r"--num-stages: num_stages=9 must be"):
        TuneSettings(num_stages=(9,)).check()


def test_tuned_prefill_entry_names_its_query_bucket_and_is_a_valid_table():
    from warmup.tune import table_entry

    p32 = KernelVariant(kernel="paged_attention", query_len=32, num_blocks=2, num_seqs=1)
    kept = {"block_m": 32, "block_n": 16, "num_stages": 2, "num_warps": 4}
    cand = {"config": kept, "median_ms": 0.01, "min_ms": 0.01, "max_ms": 0.02,
            "ratio_median": 1.2, "ratio_q25": 1.1, "ok": True, "max_abs_err": 0.0}  # fmt: skip
    result = {"config": kept, "speedup": 1.2, "paired_ratio_median": 1.2,
              "default_ms": [0.012, 0.011, 0.013], "kept_ms": [0.01, 0.01, 0.02], "inner": 5,
              "candidates": [cand]}  # fmt: skip
    e = table_entry(_cuda_cfg(), p32, result)
    assert e["query_len"] == 32 and "max_abs_err" not in e["measured"]["candidates"][0]
    t = parse_table(table(e, arch="sm_90"), "tuned")
    res_cfg = t.lookup(("paged_attention", 8, 2, 2, 1, 2, 32), "sm_90 cuda 13.0")
    assert res_cfg == kept
    assert t.lookup(("paged_attention", 8, 2, 2, 1, 2, 16), "sm_90") is None
    assert "query_len" not in table_entry(_cuda_cfg(), D8, result)


def test_tune_result_key_follows_the_candidates_and_timing_not_the_option_lists():
    """A resumed tune reuses a finished variant when the candidates it tries are
    the same, however the lists were written; new timing settings measure again."""
    from warmup.tune import TuneSettings, candidates, result_key

    d = KernelVariant(kernel="batched_decode", query_len=1, num_blocks=4, num_seqs=4)
    a = TuneSettings(num_kv_splits=(1, 2), block_m=(64, 128))
    b = TuneSettings(num_kv_splits=(2, 1, 2), block_m=(16,))  # tiles: unused for decode
    ca, cb = candidates(d, a, _cfg()), candidates(d, b, _cfg())
    assert ca == cb
    assert result_key("k", ca, a).hexdigest == result_key("k", cb, b).hexdigest
    slower = a.model_copy(update={"rounds": 21})
    assert result_key("k", ca, slower).hexdigest != result_key("k", ca, a).hexdigest
    more = TuneSettings(num_kv_splits=(1, 2, 4))
    assert result_key("k", candidates(d, more, _cfg()), more).hexdigest != (
        result_key("k", ca, a).hexdigest
    )
