import json

import pytest

from kernel_cache.config.engine import PRESETS, make_config
from kernel_cache.errors import ConfigError


@pytest.mark.parametrize(
    "name,heads,kv,dim",
    [
        ("granite-3.3-8b", 32, 8, 128),
        ("llama-3.1-8b", 32, 8, 128),
        ("qwen2.5-7b", 28, 4, 128),
        ("llama-3.2-1b", 32, 8, 64),
    ],
)
def test_presets_match_public_configs(name, heads, kv, dim):
    c = make_config(name)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (heads, kv, dim)
    assert name in PRESETS


def test_hf_config_with_head_dim(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(
        json.dumps(
            {
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "head_dim": 96,
                "hidden_size": 2048,
            }
        )
    )
    c = make_config(str(p))
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (16, 4, 96)


def test_hf_config_head_dim_from_hidden_size(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(
        json.dumps({"num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584})
    )
    assert make_config(str(p)).head_dim == 128


def test_hf_config_without_heads_names_field(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        make_config(str(p))


def test_hf_config_not_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON"):
        make_config(str(p))


def test_block_size_zero_names_field():
    with pytest.raises(ConfigError, match=r"block_size=0.*>= 1"):
        make_config("llama-3.1-8b", block_size=0)


def test_heads_not_multiple_of_kv_heads():
    with pytest.raises(
        ConfigError, match=r"num_kv_heads.*accepted num_kv_heads: \[1, 2, 4, 8, 16, 32\]"
    ):
        make_config(None, num_heads=32, num_kv_heads=5, head_dim=64)


def test_unknown_dtype_lists_accepted():
    with pytest.raises(ConfigError, match=r"dtype='fp8'.*float32, bfloat16, float16"):
        make_config("llama-3.1-8b", dtype="fp8")


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="granite-3.3-8b"):
        make_config("no-such-model")


def test_default_dtype_follows_device():
    assert make_config("llama-3.1-8b").dtype == "float32"
    assert make_config("llama-3.1-8b", device="cuda").dtype == "bfloat16"


def test_config_is_frozen():
    c = make_config("llama-3.1-8b")
    with pytest.raises(Exception, match="frozen"):
        c.block_size = 32


def test_make_config_reads_bucket_env_like_the_cli(monkeypatch):
    from kernel_cache.plan.buckets import Bucketer

    monkeypatch.setenv("KERNEL_CACHE_KV_BUCKETS", "256,512")
    c = make_config("llama-3.1-8b", max_model_len=1024, block_size=128)
    assert Bucketer(c).kv_buckets == (256, 512, 1024)
    assert make_config("llama-3.1-8b", use_env=False).kv_buckets is None


def test_model_directory_and_bool_heads(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16})
    )
    assert make_config(str(tmp_path)).num_heads == 8
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": True, "head_dim": 16}))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        make_config(str(tmp_path))


def test_gqa_error_does_not_dump_the_config():
    with pytest.raises(ConfigError) as e:
        make_config(None, num_heads=32, num_kv_heads=5, head_dim=64)
    assert "max_model_len" not in str(e.value)


def test_repair_command_rebuilds_the_config(tmp_path):
    from kernel_cache.config.engine import config_to_cli

    c = make_config("llama-3.2-1b", query_step=256, max_model_len=2048)
    cmd = config_to_cli(c, tmp_path)
    assert "--query-step 256" in cmd and "--max-model-len 2048" in cmd
    assert f"--cache-dir {tmp_path.resolve()}" in cmd


def test_cli_and_make_config_share_the_defaults(capsys):
    """`kernel-cache plan` with no options and make_config(preset) give one plan."""
    from kernel_cache.config.engine import DEFAULT_MODEL
    from kernel_cache.plan.buckets import Bucketer
    from warmup.cli.main import main

    assert main(["plan", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    cfg = make_config(DEFAULT_MODEL)
    assert cli["fingerprint"] == Bucketer(cfg).fingerprint()
    assert len(cli["variants"]) == 17  # the README's main job: minutes on a 2-core CPU


def test_every_engine_field_has_a_flag_and_the_repair_command_round_trips():
    """config_to_cli's command rebuilds a config whose every field differs from the
    default (min_batched_seqs and the bucket lists included)."""
    import argparse
    import shlex

    from kernel_cache.config.engine import ENGINE_OPTION_FIELDS, EngineConfig, config_to_cli
    from warmup.cli.main import config_from_args, engine_options

    c = make_config(
        "llama-3.2-1b",
        max_model_len=512,
        block_size=64,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        dtype="bfloat16",
        kv_cache_dtype="fp8_e4m3",
        kv_ladder="4/3",
        kv_dense_cap=1024,
        query_step=128,
        min_batched_seqs=2,
        kv_buckets=(128, 512),
        query_buckets=(1, 64, 256),
        num_seqs_buckets=(2, 16),
        cpu_target="native",
        kernels={"batched_decode": "pkg.mod:Decode", "paged_attention": "pkg.mod:Prefill"},
        slots=[
            {
                "name": "mlp",
                "factory": "pkg.mod:Mlp",
                "args": {"hidden": 64, "act": "silu"},
                "inputs": [
                    {"name": "x", "shape": ["decode_seqs", 64], "dtype": "bfloat16", "pad": 1.5},
                    {"name": "pool", "shape": ["dynamic:pool", 4], "dtype": "int32"},
                ],
                "output_rows": "decode_seqs",
            }
        ],
        use_env=False,
    )
    defaults = EngineConfig.model_fields
    differ = {f for f in ENGINE_OPTION_FIELDS if getattr(c, f) != defaults[f].default}
    assert differ == set(ENGINE_OPTION_FIELDS) - {"device"}  # no CUDA here
    p = argparse.ArgumentParser()
    engine_options(p)
    again = config_from_args(p.parse_args(shlex.split(config_to_cli(c))))
    assert again == c


def test_readme_states_the_defaults():
    from kernel_cache.config.engine import DEFAULT_MODEL, EngineConfig

    from ..conftest import ROOT

    readme = " ".join((ROOT / "README.md").read_text().split())
    f = EngineConfig.model_fields
    stated = f"`--model {DEFAULT_MODEL} " + " ".join(
        f"--{n.replace('_', '-')} {f[n].default}"
        for n in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens")
    )
    assert stated + "`" in readme
