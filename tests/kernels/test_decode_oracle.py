"""Randomized oracle for the compiled CPU kernels, following vLLM's reference procedure.

vLLM's kernel tests (``tests/kernels/attention/test_attention.py``,
``ref_single_query_cached_kv_attention``) draw every block-table entry at random
from the pool, with replacement, so one sequence may list a pool block twice,
and compute the reference token by token: token ``j`` of a sequence is offset
``j % block_size`` of pool block ``table[j // block_size]``, the KV heads repeated
(``repeat_interleave``) for GQA. The same here, in float64, against the
artifacts of a real warmup called through the engine API (``decode`` and
``prefill``: bucket padding, padded rows and block-0 padding columns included):

* the tiny plan (4 heads / 2 KV heads, the session's warmed cache, all its variants);
* 4/4 (MHA), one decode and one prefill variant, and 64/1, one decode
  variant (64 query heads per KV head: the compiled decode splits them into
  flex heads of 32 rows; see ``_FLEX_MAX_ROWS`` in
  ``kernel_cache/kernels/builtin.py``): 3 more compiles. Other ratios below
  64 take the tiny plan's code path (decode: one flex head per KV head;
  prefill: the CPU flash kernel's own GQA), so none is compiled here.

Pools are small (1 to 5 blocks, and 40), so repeats within a row and block 0
both real and padding are common. In half the batches every KV slot the
reference does not read (the tail of a last block, padding columns, unlisted
blocks) holds NaN, inf or -inf.

Also here: the compiled decode does no work in proportion to the pool. Its
exported graph holds no pool-sized tensor but views of the caches and one
uninitialized placeholder only flex reads the shape of, and the artifact's minor
page faults per call (memory it touches afresh) are the same with a 200,000-block
pool as with a 1,000-block one.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from kernel_cache.config.engine import make_config
from kernel_cache.plan.buckets import BATCHED_DECODE, PAGED_ATTENTION, KernelVariant

from ..conftest import N_TINY, ROOT

TOL = {"atol": 2e-5, "rtol": 1e-4}  # float32 kernels against a float64 reference
TRIALS = 120  # random batches per slot and geometry


def vllm_reference(query, key_cache, value_cache, table: list[int], seq_len: int):
    """``query [q, H, D]`` (the chunk ending at ``seq_len``; decode: q = 1) over the
    sequence's KV, token by token as vLLM's reference gathers it; causal, each
    row over its own positions only (vLLM's ``ref_paged_attn`` multiplies the
    masked weights, 0, by every value, so a NaN that only later rows see would
    reach the earlier ones, which decoding the tokens one by one never does).
    Returns ``[q, H, D]`` float64."""
    q_len, h, d = query.shape
    bs, kvh = key_cache.shape[1], key_cache.shape[2]
    keys = torch.stack([key_cache[table[j // bs], j % bs] for j in range(seq_len)])
    values = torch.stack([value_cache[table[j // bs], j % bs] for j in range(seq_len)])
    keys = keys.double().repeat_interleave(h // kvh, dim=1)  # [T, H, D]
    values = values.double().repeat_interleave(h // kvh, dim=1)
    rows = []
    for i in range(q_len):
        end = seq_len - q_len + i + 1  # positions 0 .. the row's own
        scores = torch.einsum("hd,khd->hk", query[i].double(), keys[:end]) / d**0.5
        rows.append(torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), values[:end]))
    return torch.stack(rows)


def _pool(cfg, rng: random.Random, g: torch.Generator):
    blocks = rng.choice([1, 2, 3, 5, 40])
    shape = (blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    return blocks, torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def _table(rng: random.Random, blocks: int, width: int) -> list[int]:
    return [rng.randrange(blocks) for _ in range(width)]  # with replacement


def _poison(rng: random.Random, kc, vc, reads: list[tuple[list[int], int]]) -> None:
    """In half the trials, fill every KV slot that no ``(table, seq_len)`` of
    ``reads`` reaches with NaN, inf or -inf (in place): the tail of a last block,
    padding columns, blocks no row lists. vLLM's reference never reads them (a
    reused block's leftovers, a pool from ``torch.empty``), so they must not
    change the result."""
    if rng.random() < 0.5:
        return
    bs = kc.shape[1]
    used = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for table, seq_len in reads:
        for j in range(seq_len):
            used[table[j // bs], j % bs] = True
    garbage = rng.choice([float("nan"), float("inf"), float("-inf")])
    kc[~used] = garbage
    vc[~used] = garbage


def check_decode(rt, cfg, seed: int, min_longest: int = 1) -> int:
    """Random decode batches through ``rt.decode``; returns the rows checked.
    ``min_longest``: the longest sequence of a batch is at least this (picks
    the KV bucket when only some variants were compiled)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    bs, max_blocks = cfg.block_size, -(-cfg.max_model_len // cfg.block_size)
    rows = 0
    for _ in range(TRIALS):
        blocks, kc, vc = _pool(cfg, rng, g)
        s = rng.randint(1, cfg.max_num_seqs)
        lens = [rng.randint(1, cfg.max_model_len) for _ in range(s)]
        lens[rng.randrange(s)] = rng.randint(min_longest, cfg.max_model_len)
        width = rng.randint(-(-max(lens) // bs), max_blocks)  # engines pass wider tables too
        tables = [_table(rng, blocks, width) for _ in range(s)]
        _poison(rng, kc, vc, list(zip(tables, lens, strict=True)))
        query = torch.randn(s, cfg.num_heads, cfg.head_dim, generator=g)
        out = rt.decode(query, kc, vc, torch.tensor(tables, dtype=torch.int32), lens)
        for i in range(s):
            ref = vllm_reference(query[i : i + 1], kc, vc, tables[i], lens[i])
            torch.testing.assert_close(
                out[i : i + 1].double(),
                ref,
                **TOL,
                msg=lambda m, c=f"row {i}, len {lens[i]}, table {tables[i]}": f"{c}: {m}",
            )
        rows += s
    return rows


def check_prefill(rt, cfg, seed: int, min_seq: int = 1, min_query: int = 1) -> int:
    """Random chunks through ``rt.prefill``; returns the chunks checked."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    bs, max_blocks = cfg.block_size, -(-cfg.max_model_len // cfg.block_size)
    for _ in range(TRIALS):
        blocks, kc, vc = _pool(cfg, rng, g)
        seq_len = rng.randint(min_seq, cfg.max_model_len)
        q_len = rng.randint(min(min_query, seq_len), min(seq_len, cfg.max_num_batched_tokens))
        table = _table(rng, blocks, rng.randint(-(-seq_len // bs), max_blocks))
        _poison(rng, kc, vc, [(table, seq_len)])
        query = torch.randn(q_len, cfg.num_heads, cfg.head_dim, generator=g)
        out = rt.prefill(query, kc, vc, torch.tensor(table, dtype=torch.int32), seq_len)
        ref = vllm_reference(query, kc, vc, table, seq_len)
        torch.testing.assert_close(
            out.double(), ref, **TOL, msg=lambda m, c=f"len {seq_len}, table {table}": f"{c}: {m}"
        )
    return TRIALS


# --- the tiny plan (4/2), the session's warmed cache ----------------------------------


@pytest.mark.compile
def test_tiny_plan_decode_and_prefill_match_vllm_reference(tiny_config, warm_cache):
    from kernel_cache.runtime.load import load_plan

    rt = load_plan(tiny_config, warm_cache[0])
    assert check_decode(rt, tiny_config, seed=1) > TRIALS
    assert check_prefill(rt, tiny_config, seed=2) == TRIALS
    calls = rt.stats()["calls"]
    # every variant of the plan ran
    assert len(calls) == N_TINY and all(n > 0 for n in calls.values()), calls


@pytest.mark.compile
def test_a_nan_key_in_the_real_kv_is_nan_as_in_the_reference(tiny_config, warm_cache):
    """A NaN in a key the sequence really has (one position, one KV head; or the
    tail of a last block that the row also lists earlier, which the reference
    reads there) makes that KV head's query heads NaN, as in vLLM's reference,
    and so does a row whose only score is -inf: torch 2.13's CPU flex template
    returns zeros for a row with a NaN score or only -inf ones."""
    from kernel_cache.runtime.load import load_plan

    rt = load_plan(tiny_config, warm_cache[0])
    g = torch.Generator().manual_seed(5)
    nan, inf = float("nan"), float("inf")
    cases = [
        ([0, 1], 21, (1, 2, 0), nan),
        ([1, 0], 5, (1, 4, 1), nan),
        ([1, 1], 20, (1, slice(10, 16)), nan),
        ([1, 0], 1, (1, 0), -inf),  # the row's only score -inf (query > 0): NaN
    ]
    for table, seq_len, at, value in cases:
        kc, vc = (torch.randn(2, 16, 2, 8, generator=g) for _ in "kv")
        kc[at] = value
        query = torch.randn(1, 4, 8, generator=g).abs()
        out = rt.decode(query, kc, vc, torch.tensor([table], dtype=torch.int32), [seq_len])
        ref = vllm_reference(query, kc, vc, table, seq_len)
        assert ref.isnan().any()
        assert torch.equal(out.isnan(), ref.isnan()), (table, seq_len, out[0, :, 0])
        finite = ~ref.isnan()
        torch.testing.assert_close(out.double()[finite], ref[finite], **TOL)


@pytest.mark.compile
def test_a_nan_or_inf_in_the_real_kv_of_a_prefill_is_as_in_the_reference(tiny_config, warm_cache):
    """A NaN or inf among the positions a chunk really sees or in its query, or
    values whose weighted sum passes the float range before it is normalized,
    give vLLM's reference, NaN where it is NaN and the finite values elsewhere:
    torch 2.13's CPU flash kernel returns 0 (and a log-sum-exp of 0) for a row
    whose visible scores are all NaN or -inf, which the two-call merge would
    weigh as a real result."""
    from kernel_cache.runtime.load import load_plan

    rt = load_plan(tiny_config, warm_cache[0])
    g = torch.Generator().manual_seed(7)
    nan, inf = float("nan"), float("inf")
    # (table, seq_len, chunk, which cache, where, value, query made positive)
    cases = [
        ([1, 0], 2, 1, "k", (1, 0), nan, False),  # the prefix is position 0 alone
        ([1, 0], 5, 2, "k", (1, 3), nan, False),  # diagonal row 0 sees position 3 alone
        ([1, 0], 5, 2, "k", (1, 3), -inf, True),  # its score -inf: the reference is finite
        ([1, 0], 3, 3, "v", (1, 0, 0, 0), inf, False),  # a fresh prompt, an inf value
        ([0, 0], 20, 4, "k", (0, 2), nan, False),  # a block listed twice
        ([1, 0], 5, 5, "k", (1, 0), -inf, True),  # row 0's only score -inf: NaN
        ([1, 0], 5, 5, "q", (2, 1, 3), nan, False),  # a NaN query row of a fresh prompt
        ([1, 0], 5, 5, "v", slice(None), 1e38, False),  # sums past the float range
        # a value only the chunk's later rows see: the rows before it stay finite
        ([1, 0], 8, 8, "v", (1, 6, 0, 3), nan, False),
        ([1, 0], 8, 8, "v", (1, 6, 1, 3), -inf, False),
        ([1, 0], 20, 6, "v", (0, 2, 0, 3), inf, False),  # a later chunk
    ]
    for table, seq_len, chunk, which, at, value, positive in cases:
        kc, vc = (torch.randn(2, 16, 2, 8, generator=g) for _ in "kv")
        query = torch.randn(chunk, 4, 8, generator=g)
        query = query.abs() if positive else query
        {"k": kc, "v": vc, "q": query}[which][at] = value
        out = rt.prefill(query, kc, vc, torch.tensor(table, dtype=torch.int32), seq_len)
        ref = vllm_reference(query, kc, vc, table, seq_len)
        case = (table, seq_len, chunk, which, at, value)
        assert torch.equal(out.isnan(), ref.isnan()), case
        assert torch.equal(out.isinf(), ref.isinf()), case
        finite = ref.isfinite()
        torch.testing.assert_close(out.double()[finite], ref[finite], **TOL, msg=str(case))


# --- other GQA ratios: a few variants each ---------------------------------------------

#: (num_heads, num_kv_heads) -> slots compiled (bucket of 2 blocks: 17-32 tokens)
RATIOS = {(4, 4): ("decode", "prefill"), (64, 1): ("decode",)}


@pytest.fixture(scope="module")
def ratio_runtimes(tmp_path_factory):
    """``{(H, KVH): (config, runtime)}``, each warmed with only its variants."""
    from kernel_cache.runtime.load import load_plan
    from warmup.builder.planner import warmup

    out = {}
    for (h, kvh), slots in RATIOS.items():
        d = tmp_path_factory.mktemp(f"gqa{h}x{kvh}")
        (d / "config.json").write_text(
            json.dumps({"num_attention_heads": h, "num_key_value_heads": kvh, "head_dim": 8})
        )
        cfg = make_config(
            str(d / "config.json"),
            max_model_len=32,
            block_size=16,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            use_env=False,
        )
        variants = [KernelVariant(kernel=BATCHED_DECODE, query_len=1, num_blocks=2, num_seqs=4)]
        if "prefill" in slots:
            variants.append(
                KernelVariant(kernel=PAGED_ATTENTION, query_len=32, num_blocks=2, num_seqs=1)
            )
        rep = warmup(cfg, d / "cache", jobs=1, progress=False, variants=variants)
        assert rep["failed"] == [] and rep["compiled"] == len(variants), rep
        out[(h, kvh)] = (cfg, load_plan(cfg, d / "cache", strict=False))
    return out


@pytest.mark.compile
@pytest.mark.parametrize("ratio", list(RATIOS), ids=lambda r: f"{r[0]}x{r[1]}")
def test_gqa_ratios_match_vllm_reference(ratio_runtimes, ratio):
    cfg, rt = ratio_runtimes[ratio]
    assert check_decode(rt, cfg, seed=3, min_longest=17) > TRIALS
    if "prefill" in RATIOS[ratio]:
        assert check_prefill(rt, cfg, seed=4, min_seq=17, min_query=2) == TRIALS


# --- no work in proportion to the pool -------------------------------------------------


def test_decode_graph_has_no_pool_sized_tensor_but_the_caches(tiny_config):
    """Every tensor of the exported decode graph whose storage grows with
    ``num_pool_blocks`` is a view of the KV caches or the uninitialized
    placeholder ``aten.empty`` that only the flex call uses (for the shape its
    CPU template checks; it is never written or read)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from warmup.builder.compiler import export_variant

    v = KernelVariant(kernel=BATCHED_DECODE, query_len=1, num_blocks=2, num_seqs=4)
    ep = export_variant(tiny_config, v)
    nodes = list(ep.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    caches = [placeholders[1].meta["val"], placeholders[2].meta["val"]]
    pool = caches[0].shape[0].node.expr
    cache_storage = {StorageWeakRef(t.untyped_storage()) for t in caches}
    placeholders_seen = []
    for n in nodes:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        nbytes = val.untyped_storage().nbytes()
        if not isinstance(nbytes, torch.SymInt) or pool not in nbytes.node.expr.free_symbols:
            continue
        if StorageWeakRef(val.untyped_storage()) in cache_storage:
            continue  # the pool itself, viewed
        assert n.target is torch.ops.aten.empty.memory_format, f"pool-sized: {n.format_node()}"
        users = {u.target for u in n.users}
        assert users == {torch.ops.higher_order.flex_attention}, (n.format_node(), users)
        placeholders_seen.append(n)
    assert len(placeholders_seen) == 1


FAULTS = r"""
import json, resource, sys, torch
from kernel_cache import load_plan, make_config
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))
rt = load_plan(cfg, sys.argv[2])
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
tables = torch.randint(0, 1000, (4, 2), generator=g, dtype=torch.int32)
query = torch.randn(4, 4, 8, generator=g)
per_call = {}
for pool in (1000, 200000, 1000, 200000):
    kc, vc = torch.empty(pool, 16, 2, 8), torch.empty(pool, 16, 2, 8)  # untouched pages
    kc[:1000] = 1.0
    vc[:1000] = 1.0
    for _ in range(3):
        rt.decode(query, kc, vc, tables, [32, 17, 5, 32])
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        rt.decode(query, kc, vc, tables, [32, 17, 5, 32])
    f = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20
    per_call[pool] = min(per_call.get(pool, f), f)
print(json.dumps(per_call))
"""


@pytest.mark.compile
def test_compiled_decode_touches_no_memory_in_proportion_to_the_pool(tiny_model, warm_cache):
    """Minor page faults per decode call (memory the call touches afresh) with a
    200,000-block pool against a 1,000-block pool, in a fresh process whose
    allocations of 64 KiB and more are fresh mappings (``MALLOC_MMAP_THRESHOLD_``):
    a buffer the call wrote in proportion to the pool would fault its pages in
    on every call (two ``[4, 2 + pool]`` int32 block indices, as the decode
    kernel once built, are 6.4 MB at this pool: about 1,560 pages)."""
    proc = subprocess.run(
        [sys.executable, "-c", FAULTS, str(tiny_model), str(warm_cache[0])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    assert proc.returncode == 0, proc.stderr
    per_call = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    assert per_call[200000] <= per_call[1000] + 20, per_call
