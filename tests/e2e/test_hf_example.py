"""examples/hf_generate.py: a Hugging Face Llama served through the warmed tiny plan.

The served run needs transformers (the ``hf`` extra, which the README's test
command installs); it is skipped only where transformers is missing.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from ..conftest import N_TINY, ROOT, tiny_args
from ..kc_helpers import snapshot

EXAMPLE = ROOT / "examples" / "hf_generate.py"

#: Rows of the Azure LLM inference trace 2023 (conversation; Microsoft Azure
#: Public Dataset, CC BY 4.0), in its CSV format; every one is longer than the
#: tiny plan's max_model_len 32, so the example scales each down.
TRACE_ROWS = [
    ("2023-11-16 18:15:46.6805900", 374, 44),
    ("2023-11-16 18:15:50.9951690", 396, 109),
    ("2023-11-16 18:15:51.2224670", 879, 55),
    ("2023-11-16 18:15:51.3910170", 91, 16),
    ("2023-11-16 18:15:52.9921190", 381, 84),
]


@pytest.fixture
def trace(tmp_path):
    p = tmp_path / "trace.csv"
    rows = [",".join(map(str, r)) for r in TRACE_ROWS]
    p.write_text("\n".join(["TIMESTAMP,ContextTokens,GeneratedTokens", *rows]) + "\n")
    return p


def run_example(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


def load_example():
    spec = importlib.util.spec_from_file_location("hf_generate", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    sys.path.insert(0, str(EXAMPLE.parent))  # it imports replay_trace from its folder
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return mod


@pytest.mark.parametrize(
    "args,says",
    [
        (["--layers", "0"], "--layers: 0: must be at least 1"),
        (["--layers", "-1"], "--layers: -1: must be at least 1"),
        (["--requests", "0"], "--requests: 0: must be at least 1"),
        (["--start", "-5"], "--start: -5: must be at least 0"),
        (["--prefill-chunk", "0"], "--prefill-chunk: 0: must be at least 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens: 0: must be at least 1"),
    ],
)
def test_counts_that_would_serve_nothing_are_refused(trace, tmp_path, capsys, args, says):
    """The argument parser refuses them (exit 2, before any plan is loaded)."""
    with pytest.raises(SystemExit) as e:
        load_example().main(["--trace", str(trace), "--cache-dir", str(tmp_path / "c"), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert says in err and "Traceback" not in err
    assert not (tmp_path / "c").exists()


def test_a_start_past_the_trace_is_refused_before_any_plan_is_loaded(trace, tmp_path):
    """No compile, no vacuous 'identical' with exit 0, in a process of its own."""
    proc = run_example("--trace", trace, "--cache-dir", tmp_path / "cache", "--start", "5")
    assert proc.returncode == 2, proc.stderr
    says = "no rows from --start 5 (nothing to serve)"
    assert says in proc.stderr and "Traceback" not in proc.stderr


def test_an_empty_prompt_in_the_trace_gets_one_token(tmp_path):
    """A trace row with ContextTokens 0 was served with no prompt: an
    UnboundLocalError in serve()."""
    p = tmp_path / "t.csv"
    p.write_text("ContextTokens,GeneratedTokens\n0,5\n3,0\n")
    reqs = load_example().make_requests(p, 2, 0, 32)
    assert [(len(r.prompt), r.new_tokens) for r in reqs] == [(1, 5), (3, 1)]
    assert "0 prompt + 5 output tokens -> 1 + 5 (prompt raised to 1 token)" in reqs[0].note


def test_request_lengths_fit_the_plan(trace):
    """A request that fits is served as the trace has it; a longer one is scaled
    (both lengths, one factor) to prompt + output <= max_model_len, and says so."""
    hf = load_example()
    reqs = hf.make_requests(trace, 5, 0, 1024)
    assert [(len(r.prompt), r.new_tokens, r.note) for r in reqs[:2]] == [
        (374, 44, ""),
        (396, 109, ""),
    ]
    reqs = hf.make_requests(trace, 5, 0, 32, max_new=10)
    for r, (_, ctx, gen) in zip(reqs, TRACE_ROWS, strict=True):
        assert 1 <= len(r.prompt) and 1 <= r.new_tokens <= 10
        assert len(r.prompt) + r.new_tokens <= 32
        assert f"{ctx} prompt + {gen} output tokens -> {len(r.prompt)} + {r.new_tokens}" in r.note
        assert "to fit max_model_len 32" in r.note
    assert "output clipped to --max-new-tokens 10" in reqs[1].note  # 109 -> 10, then scaled
    assert all(0 <= t < hf.VOCAB for r in reqs for t in r.prompt)


def test_a_cold_plan_names_the_warmup_command(tmp_path, tiny_model, trace):
    pytest.importorskip("transformers")
    cache = tmp_path / "empty"
    proc = run_example(*tiny_args(tiny_model), "--cache-dir", cache, "--trace", trace)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{N_TINY} variant(s) of the plan are not cached" in proc.stderr
    assert f"kernel-cache warmup --model {tiny_model} --max-model-len 32" in proc.stderr
    assert f"--cache-dir {cache}" in proc.stderr and "--warmup" in proc.stderr
    assert not cache.exists()


@pytest.mark.compile
def test_llama_through_the_plan_matches_sdpa_with_zero_compiles(
    warm_cache, tiny_model, trace, tmp_path
):
    """5 trace requests (two waves of max_num_seqs 4), prompts in chunks of 12
    tokens: every attention call of the 2-layer float32 Llama runs through the
    plan's prefill and decode, the greedy tokens equal transformers' SDPA
    generation, and nothing is compiled: the compile log stays absent and the
    cache gains no file."""
    pytest.importorskip("transformers")
    cache = warm_cache[0]
    usage = {"usage.json", "usage.json.lock"}  # engine start's best-effort hit records
    before = {k: v for k, v in snapshot(cache).items() if k not in usage}
    log = tmp_path / "compiles.log"
    proc = run_example(
        *tiny_args(tiny_model), "--cache-dir", cache, "--trace", trace, "--requests", 5,
        "--layers", 2, "--prefill-chunk", 12, "--untimed", 0, "--json",
        env={"KERNEL_CACHE_TEST_COMPILE_LOG": str(log)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["identical"] and doc["mismatches"] == [], doc["mismatches"]
    assert doc["max_logit_diff"] < 1e-4
    assert doc["compiles"] == 0 and not log.exists()
    assert {k: v for k, v in snapshot(cache).items() if k not in usage} == before
    calls = doc["calls_per_variant"]
    prefill = sum(n for v, n in calls.items() if v.startswith("paged_attention:"))
    decode = sum(n for v, n in calls.items() if v.startswith("batched_decode:"))
    reqs = doc["requests"]
    assert len(reqs) == 5 and len(doc["notes"]) == 5
    # one call per layer for each prompt chunk, and for each decode step of each wave
    chunks = sum(math.ceil(r["prompt_tokens"] / 12) for r in reqs)
    steps = sum(max(r["new_tokens"] for r in reqs[w : w + 4]) - 1 for w in (0, 4))
    assert (prefill, decode) == (2 * chunks, 2 * steps)
    assert decode > 0 and chunks > len(reqs)  # decoding happened; some prompt took 2 chunks
    assert doc["paged"]["tokens_per_s"] > 0 and doc["sdpa"]["tokens_per_s"] > 0
