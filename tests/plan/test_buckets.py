import json
import logging
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_cache.config.engine import make_config
from kernel_cache.errors import ConfigError, ShapeError
from kernel_cache.plan.buckets import Bucketer, KernelVariant, env_overrides, kv_ladder_blocks

from ..conftest import run_cli


def cfg(**kw):
    base = {
        "max_model_len": 8192,
        "block_size": 128,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        "kv_ladder": "4/3",
    }
    return make_config("llama-3.1-8b", **{**base, **kw})


def test_the_default_ladder_is_pow2():
    """The shipped kernels read only real KV, so the default ladder only decides
    how many variants are compiled (docs/benchmarks/padding.md)."""
    assert make_config("llama-3.2-1b").kv_ladder == "pow2"
    assert Bucketer(make_config("llama-3.2-1b")).kv_buckets == (128, 256, 512, 1024)


def test_required_ladders_block_128():
    assert Bucketer(cfg(kv_dense_cap=0)).kv_buckets == (
        128,
        256,
        384,
        512,
        768,
        1024,
        1408,
        1920,
        2560,
        3456,
        4608,
        6144,
        8192,
    )
    assert Bucketer(cfg()).kv_buckets == (
        128,
        256,
        384,
        512,
        768,
        1024,
        1408,
        1920,
        2560,
        3456,
        4096,
        8192,
    )
    assert Bucketer(cfg(kv_ladder="pow2")).kv_buckets == (128, 256, 512, 1024, 2048, 4096, 8192)


def test_required_ladders_block_192():
    assert Bucketer(cfg(block_size=192, max_model_len=2048)).num_blocks_buckets == (
        1,
        2,
        3,
        4,
        6,
        8,
        11,
    )
    assert Bucketer(
        cfg(block_size=192, max_model_len=2048, kv_ladder="pow2")
    ).num_blocks_buckets == (1, 2, 4, 8, 11)


def test_cap_above_max_blocks_has_no_effect():
    a = Bucketer(cfg(max_model_len=2048, kv_dense_cap=0)).num_blocks_buckets
    b = Bucketer(cfg(max_model_len=2048, kv_dense_cap=4096)).num_blocks_buckets
    assert a == b


@settings(max_examples=300, deadline=None)
@given(
    max_model_len=st.integers(1, 40000),
    block_size=st.integers(1, 300),
    cap=st.integers(0, 20000),
    ladder=st.sampled_from(["4/3", "pow2"]),
)
def test_ladder_invariants(max_model_len, block_size, cap, ladder):
    max_blocks = math.ceil(max_model_len / block_size)
    cap_blocks = math.ceil(cap / block_size) if cap else None
    lad = kv_ladder_blocks(max_blocks, ladder, cap_blocks)
    assert lad[0] == 1 and lad[-1] == max_blocks
    assert all(a < b for a, b in zip(lad, lad[1:], strict=False))
    assert all(isinstance(b, int) for b in lad)


@settings(max_examples=200, deadline=None)
@given(
    max_model_len=st.integers(1, 40000), block_size=st.integers(1, 300), cap=st.integers(0, 20000)
)
def test_below_cap_padding_under_a_quarter(max_model_len, block_size, cap):
    b = Bucketer(
        make_config(
            "llama-3.2-1b",
            max_model_len=max_model_len,
            block_size=block_size,
            kv_dense_cap=cap,
            max_num_batched_tokens=max_model_len,
            kv_ladder="4/3",
        )
    )
    cap_blocks = math.ceil(cap / block_size) if cap else b.max_blocks
    for n in range(1, min(cap_blocks, b.max_blocks) + 1):
        bucket = b.blocks_bucket(n)
        assert bucket == min(x for x in b.num_blocks_buckets if x >= n)
        assert (bucket - n) / bucket < 0.25, (n, bucket)


def test_query_and_num_seqs_ladders():
    b = Bucketer(cfg(max_num_batched_tokens=2048, max_num_seqs=48))
    assert b.query_buckets == (1, 512, 1024, 1536, 2048)
    assert b.num_seqs_buckets == (4, 8, 16, 32, 48)
    b = Bucketer(cfg(max_num_batched_tokens=1300, max_model_len=1000))
    assert b.query_buckets == (1, 512, 1000)
    assert Bucketer(cfg(max_num_seqs=3)).num_seqs_buckets == ()


def test_variants_drop_pairs_that_cannot_fit():
    b = Bucketer(cfg(max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=8))
    pa = [(v.query_len, v.num_blocks) for v in b.variants if v.kernel == "paged_attention"]
    # query bucket 1024 holds 513..1024 tokens: needs >= 5 blocks of 128
    assert [nb for q, nb in pa if q == 1024] == [6, 8]
    assert [nb for q, nb in pa if q == 512] == [1, 2, 3, 4, 6, 8]
    bd = [v for v in b.variants if v.kernel == "batched_decode"]
    assert {(v.num_seqs, v.query_len) for v in bd} == {(4, 1), (8, 1)}
    assert len(bd) == 2 * len(b.num_blocks_buckets)


def test_lookups_and_limits():
    b = Bucketer(cfg(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024))
    assert b.blocks_bucket(5) == 6 and b.blocks_bucket(8) == 8
    assert b.query_bucket(513) == 1024 and b.num_seqs_bucket(5) == 8
    with pytest.raises(ShapeError, match="max_model_len=1024"):
        b.blocks_bucket(9)
    with pytest.raises(ShapeError, match="max_num_seqs=8"):
        b.num_seqs_bucket(9)


def test_override_not_integer_names_variable():
    with pytest.raises(ConfigError, match=r"KERNEL_CACHE_KV_BUCKETS.*'12a'"):
        env_overrides({"KERNEL_CACHE_KV_BUCKETS": "128,12a"})
    with pytest.raises(ConfigError, match=r"KERNEL_CACHE_NUM_SEQS_BUCKETS.*'0'"):
        env_overrides({"KERNEL_CACHE_NUM_SEQS_BUCKETS": "0,4"})


def test_kv_override_must_be_multiple_of_block_size():
    with pytest.raises(ConfigError, match=r"KERNEL_CACHE_KV_BUCKETS.*300.*block_size 128.*384"):
        Bucketer(cfg(kv_buckets=(128, 300)))


def test_override_above_limit_is_an_error():
    with pytest.raises(ConfigError, match=r"16384.*limit 8192"):
        Bucketer(cfg(kv_buckets=(128, 16384)))
    with pytest.raises(ConfigError, match=r"num_seqs_buckets.*128.*limit 64"):
        Bucketer(cfg(num_seqs_buckets=(8, 128)))


def test_short_override_gets_limit_appended(caplog):
    with caplog.at_level(logging.INFO, logger="kernel_cache"):
        b = Bucketer(cfg(kv_buckets=(1024, 128)))
    assert b.kv_buckets == (128, 1024, 8192)
    assert "appending 8192" in caplog.text


def test_variant_parse_roundtrip():
    v = KernelVariant(kernel="batched_decode", query_len=1, num_blocks=8, num_seqs=4)
    assert KernelVariant.parse(str(v)) == v
    with pytest.raises(ConfigError, match="KERNEL:QUERY:BLOCKS:SEQS"):
        KernelVariant.parse("decode:1:2")


def test_fingerprint_changes_with_ladder():
    assert Bucketer(cfg()).fingerprint() == Bucketer(cfg()).fingerprint()
    assert Bucketer(cfg()).fingerprint() != Bucketer(cfg(kv_ladder="pow2")).fingerprint()


def test_plan_cli_reads_env_override():
    proc = run_cli("plan", "--json", env={"KERNEL_CACHE_KV_BUCKETS": "256,512"}, check=True)
    doc = json.loads(proc.stdout)
    assert doc["kv_buckets"] == [256, 512, 1024]
    assert set(doc) >= {
        "num_blocks_buckets",
        "query_buckets",
        "num_seqs_buckets",
        "variants",
        "fingerprint",
    }


def test_plan_cli_bad_override_is_a_clear_error():
    proc = run_cli("plan", env={"KERNEL_CACHE_KV_BUCKETS": "100"})
    assert proc.returncode == 2
    assert "KERNEL_CACHE_KV_BUCKETS" in proc.stderr and "Traceback" not in proc.stderr
