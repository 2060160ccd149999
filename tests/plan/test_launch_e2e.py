"""Launch configs end to end with real warmups on the tiny plan (real compiles)."""

import json

import pytest
import torch

from kernel_cache import load_plan
from kernel_cache.kernels.reference import reference_decode
from kernel_cache.plan.tables import ENV_TUNING, load_table

from ..conftest import N_TINY, TINY_VARIANTS, run_cli, tiny_args

pytestmark = pytest.mark.compile

TARGET = "batched_decode:1:2:4"


def one_entry(**config) -> str:
    """KERNEL_CACHE_TUNING (inline JSON) setting one variant of the tiny plan."""
    return json.dumps(
        {
            "entries": [
                {
                    "kernel": "batched_decode",
                    "head_dim": 8,
                    "num_queries_per_kv": 2,
                    "num_kv_heads": 2,
                    "num_seqs": 4,
                    "num_blocks": 2,
                    "config": config,
                }
            ]
        }
    )


def test_changed_entry_recompiles_exactly_one_variant_and_runtime_loads_it(
    cache_copy, tiny_model, tiny_config, monkeypatch
):
    tuning = one_entry(num_kv_splits=1, blocks_per_chunk=1)
    proc = run_cli(
        "warmup", *tiny_args(tiny_model), "--cache-dir", cache_copy, "--json",
        env={ENV_TUNING: tuning}, check=True,
    )  # fmt: skip
    report = json.loads(proc.stdout)
    assert (report["compiled"], report["cached"], report["failed"]) == (1, N_TINY - 1, [])
    compiled = [r["variant"] for r in report["results"] if r["status"] == "compiled"]
    assert compiled == [TARGET]
    assert report["launch"] == {
        TARGET: {"config": {"blocks_per_chunk": 1, "num_kv_splits": 1}, "source": "env"}
    }

    # verify in a fresh process loads the artifact of the resolved config and checks it
    proc = run_cli(
        "verify", *tiny_args(tiny_model), "--cache-dir", cache_copy, "--json",
        env={ENV_TUNING: tuning}, check=True,
    )  # fmt: skip
    v = json.loads(proc.stdout)
    assert v["ok"] and v["loaded"] == N_TINY and v["compiled"] == 0
    assert v["launch"][TARGET]["config"]["blocks_per_chunk"] == 1

    # engine start under the table: dispatch to the chunked artifact matches the reference
    monkeypatch.setenv(ENV_TUNING, tuning)
    rt = load_plan(tiny_config, cache_copy)
    assert {str(k): c for k, c in rt.launch.items()}[TARGET] == {
        "blocks_per_chunk": 1,
        "num_kv_splits": 1,
    }
    g = torch.Generator().manual_seed(5)
    kc, vc = torch.randn(9, 16, 2, 8, generator=g), torch.randn(9, 16, 2, 8, generator=g)
    lens = [32, 17, 3]
    # No pool block twice in a row, as in an engine (the CPU decode kernel relies on it).
    bt = torch.stack([torch.randperm(9, generator=g)[:2] for _ in range(3)]).to(torch.int32)
    q = torch.randn(3, 4, 8, generator=g)
    out = rt.decode(q, kc, vc, bt, lens)
    torch.testing.assert_close(out, reference_decode(q, kc, vc, bt, lens), atol=1e-5, rtol=1e-4)
    assert rt.stats()["calls"] == {TARGET: 1} and rt.stats()["compiles"] == 0

    # and without the table the default artifact is still there: nothing to compile
    monkeypatch.delenv(ENV_TUNING)
    rt = load_plan(tiny_config, cache_copy)
    assert rt.stats()["loads"] == N_TINY
    assert {str(k): c for k, c in rt.launch.items()}[TARGET] == {
        "blocks_per_chunk": 2,
        "num_kv_splits": 1,
    }


def test_tune_writes_a_table_resumes_and_warmup_with_it_compiles_nothing(
    cache_copy, tiny_model, tmp_path
):
    out = tmp_path / "table.json"
    opts = ["--cache-dir", cache_copy, "--out", out, "--num-kv-splits", "1,2",
            "--chunks-per-split", "1", "--rounds", "3", "--target-ms", "2", "--json"]  # fmt: skip
    proc = run_cli("tune", *tiny_args(tiny_model), "--variants", TARGET, *opts, check=True)
    first = json.loads(proc.stdout)
    # the default candidate is in the warmed cache; only splits=2 is compiled
    assert (first["compiled"], first["measured"], first["from_cache"]) == (1, 1, 0)
    (res,) = first["results"]
    cands = [c["config"] for c in res["candidates"]]
    assert cands == [
        {"blocks_per_chunk": 2, "num_kv_splits": 1},
        {"blocks_per_chunk": 1, "num_kv_splits": 2},
    ]
    assert all(c["ok"] and c["max_abs_err"] < 1e-4 for c in res["candidates"])
    assert res["config"] in cands and res["rounds"] == 3
    table = load_table(out)
    assert table.device_arch and len(table) == 1

    # a second run resumes: the variant comes from the tuning cache, nothing is measured
    proc = run_cli("tune", *tiny_args(tiny_model), "--variants", TARGET, *opts, check=True)
    second = json.loads(proc.stdout)
    assert (second["compiled"], second["measured"], second["from_cache"]) == (0, 0, 1)
    assert second["results"][0]["candidates"] == res["candidates"]
    assert len(load_table(out)) == 1

    # the tuned table is usable as is, and every config it picked is already compiled
    proc = run_cli(
        "warmup", *tiny_args(tiny_model), "--cache-dir", cache_copy, "--json",
        env={ENV_TUNING: str(out)}, check=True,
    )  # fmt: skip
    assert json.loads(proc.stdout)["compiled"] == 0


def test_tune_rejects_variants_it_cannot_tune(tiny_model, tmp_path):
    proc = run_cli("tune", *tiny_args(tiny_model), "--variants", TINY_VARIANTS[0],
                   "--out", tmp_path / "t.json", "--cache-dir", tmp_path / "c")  # fmt: skip
    assert proc.returncode == 2 and "no launch parameters to tune" in proc.stderr
    proc = run_cli("tune", *tiny_args(tiny_model), "--variants", "batched_decode:1:3:4",
                   "--out", tmp_path / "t.json", "--cache-dir", tmp_path / "c")  # fmt: skip
    assert proc.returncode == 2 and "not a variant of the plan" in proc.stderr
    proc = run_cli("tune", *tiny_args(tiny_model), "--variants", "foo",
                   "--out", tmp_path / "t.json", "--cache-dir", tmp_path / "c")  # fmt: skip
    assert proc.returncode == 2 and "--variants 'foo': expected KERNEL:QUERY" in proc.stderr
    assert not (tmp_path / "t.json").exists()
