"""The CPU kernels that read only real KV, against the independent SDPA reference.

Eager: :meth:`RealKVPagedAttention.real_blocks` (the gather of the real blocks
and SDPA that is compiled for prefill) runs eagerly, so it is checked here
without compiling; the modules themselves are the plain kernels when eager.
Compiled (marked ``compile``): small plans (bfloat16 at block_size 16, float32
at 192; float32 at 16 is the tiny plan, head_dim 8, whose compiled variants
``tests/kernels/test_decode_oracle.py`` checks against vLLM's reference
procedure) go through the real warmup path (``torch.export`` + AOTInductor,
``num_pool_blocks`` dynamic), each artifact is checked against the SDPA
reference on chosen lengths (1, a bucket edge, the plan's max_model_len, padded
rows) at two pool sizes, and ``verify_plan`` passes.
"""

import json

import pytest
import torch

from kernel_cache.config.engine import make_config
from kernel_cache.kernels.builtin import RealKVBatchedDecode, RealKVPagedAttention, build_module
from kernel_cache.kernels.reference import reference_attention, reference_decode
from kernel_cache.plan.buckets import BATCHED_DECODE, Bucketer

CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, max_model_len)
    (4, 2, 8, 16, 64),
    (8, 1, 16, 192, 1024),  # block_size not a power of two, MQA
    (6, 6, 8, 7, 100),  # MHA, odd block size
]
TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


def _prefill_cases(bs, max_len, g):
    lengths = [1, bs, bs + 1, max_len, int(torch.randint(2, max_len, (1,), generator=g))]
    for seq_len in lengths:
        for q_real in sorted({1, min(seq_len, 5), seq_len}):
            yield seq_len, q_real


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kvh,d,bs,max_len", CASES)
def test_real_kv_prefill_eager_matches_reference(h, kvh, d, bs, max_len, dtype):
    g = torch.Generator().manual_seed(h * 1000 + bs)
    max_blocks = -(-max_len // bs)
    p = max_blocks * 2 + 1
    kc = torch.randn(p, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(p, bs, kvh, d, generator=g).to(dtype)
    mod = RealKVPagedAttention(h, kvh, d)
    for seq_len, q_real in _prefill_cases(bs, max_len, g):
        nb = min(max_blocks, -(-seq_len // bs) + 1)  # one padded block when there is room
        bt = torch.randperm(p, generator=g)[:nb].to(torch.int32)
        query = torch.randn(q_real + 3, h, d, generator=g).to(dtype)  # 3 padded rows
        lens = torch.tensor([seq_len, q_real], dtype=torch.int32)
        out = mod.real_blocks(query, kc, vc, bt, lens[:1], lens[1:])
        assert out.dtype == dtype and torch.isfinite(out.float()).all()
        ref = reference_attention(query[:q_real], kc, vc, bt, seq_len)
        torch.testing.assert_close(out[:q_real].float(), ref, **TOL[dtype])


@pytest.mark.parametrize("q_real", [1, 5, 191, 192, 193, 384, 450])
@pytest.mark.parametrize("before", [0, 1, 300])
def test_real_kv_prefill_chunks_of_a_large_query_bucket(q_real, before):
    """A 450-row query bucket cuts its real rows in two chunks (450 // 192): one
    real row (the second chunk has none and recomputes the last row), a few,
    about a chunk, and all, for a fresh prompt and after 1 or 300 earlier
    positions."""
    from kernel_cache.kernels.builtin import _PREFILL_CHUNK_ROWS

    assert _PREFILL_CHUNK_ROWS == 192
    g = torch.Generator().manual_seed(q_real * 7 + before)
    h, kvh, d, bs = 4, 2, 8, 16
    seq_len = before + q_real
    nb = -(-seq_len // bs) + 1
    kc = torch.randn(2 * nb, bs, kvh, d, generator=g)
    vc = torch.randn(2 * nb, bs, kvh, d, generator=g)
    bt = torch.randperm(2 * nb, generator=g)[:nb].to(torch.int32)
    query = torch.randn(450, h, d, generator=g)
    lens = torch.tensor([seq_len, q_real], dtype=torch.int32)
    out = RealKVPagedAttention(h, kvh, d).real_blocks(query, kc, vc, bt, lens[:1], lens[1:])
    ref = reference_attention(query[:q_real], kc, vc, bt, seq_len)
    torch.testing.assert_close(out[:q_real], ref, **TOL[torch.float32])
    assert (out[q_real:] == 0).all()


def test_real_kv_prefill_seq_len_zero_is_finite():
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(3, 16, 2, 8, generator=g), torch.randn(3, 16, 2, 8, generator=g)
    lens = torch.tensor([0, 0], dtype=torch.int32)
    out = RealKVPagedAttention(4, 2, 8).real_blocks(
        torch.randn(4, 4, 8), kc, vc, torch.tensor([1, 2], dtype=torch.int32), lens[:1], lens[1:]
    )
    assert torch.isfinite(out).all()


def test_eager_modules_are_the_plain_kernels():
    """Eagerly (verify's oracle) build_module's modules are the plain kernels, bit
    for bit: verify compares each artifact with an independent formulation."""
    from kernel_cache.kernels.plain import BatchedDecode, PagedAttention

    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(9, 16, 2, 8, generator=g), torch.randn(9, 16, 2, 8, generator=g)
    bt = torch.randint(0, 9, (4, 2), generator=g, dtype=torch.int32)
    lens = torch.tensor([1, 16, 32, 0], dtype=torch.int32)
    q = torch.randn(4, 4, 8, generator=g)
    mod = build_module(BATCHED_DECODE, 4, 2, 8)
    assert isinstance(mod, RealKVBatchedDecode)
    assert torch.equal(mod(q, kc, vc, bt, lens), BatchedDecode(4, 2, 8)(q, kc, vc, bt, lens))
    pre = build_module("paged_attention", 4, 2, 8)
    assert isinstance(pre, RealKVPagedAttention)
    qp, sl = torch.randn(8, 4, 8, generator=g), torch.tensor([20, 7], dtype=torch.int32)
    args = (qp, kc, vc, bt[0], sl[:1], sl[1:])
    assert torch.equal(pre(*args), PagedAttention(4, 2, 8)(*args))


def test_make_inputs_covers_the_edge_lengths_with_distinct_blocks(tmp_path):
    """verify's inputs: a bucket edge, length 1 and a padded row for decode, a
    padded query row for prefill, and no pool block twice in one table."""
    from kernel_cache.plan.buckets import KernelVariant
    from kernel_cache.runtime.inputs import make_inputs

    cfg = _config(tmp_path, 16)
    dec = KernelVariant(kernel=BATCHED_DECODE, query_len=1, num_blocks=2, num_seqs=4)
    _, _, _, bt, lens = make_inputs(cfg, dec, seed=1)
    assert lens.tolist()[0] == 32 and lens.tolist()[1] == 1 and lens.tolist()[-1] == 0
    assert all(len(set(row)) == len(row) for row in bt.tolist())
    pre = KernelVariant(kernel="paged_attention", query_len=32, num_blocks=2, num_seqs=1)
    q, _, _, bt, seq_len, real_q = make_inputs(cfg, pre, seed=1)
    assert int(real_q) == 31 and len(set(bt.tolist())) == bt.numel()


# --- compiled through the real warmup path -------------------------------------------

GEOMETRY = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
#: block_size -> plan limits: one KV bucket of 2 blocks (lengths from 1 token to 2
#: full blocks), 3 variants each (2 paged_attention, 1 batched_decode).
PLANS = {
    16: {"max_model_len": 32, "max_num_batched_tokens": 32, "kv_buckets": (32,)},
    192: {"max_model_len": 384, "max_num_batched_tokens": 16, "kv_buckets": (384,)},
}


def _config(tmp_path, bs, dtype="float32"):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(GEOMETRY))
    return make_config(
        str(model), block_size=bs, max_num_seqs=4, dtype=dtype, use_env=False, **PLANS[bs]
    )


def _check_runner(cfg, v, runner, seed):
    """The artifact against the SDPA reference at two pool sizes."""
    g = torch.Generator().manual_seed(seed)
    dt = cfg.torch_dtype()
    h, kvh, d, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    cap = v.num_blocks * bs
    lengths = sorted({1, bs, min(cap, bs + 1), cap, min(cap, cfg.max_model_len)})
    tol = TOL[dt]
    for pool in (v.num_blocks * v.num_seqs + 3, 4 * v.num_blocks * v.num_seqs + 11):
        kc = torch.randn(pool, bs, kvh, d, generator=g).to(dt)
        vc = torch.randn(pool, bs, kvh, d, generator=g).to(dt)
        if v.kernel == BATCHED_DECODE:
            real = [n for n in lengths if n <= cap][: v.num_seqs - 1]
            lens = torch.tensor(real + [0] * (v.num_seqs - len(real)), dtype=torch.int32)
            perm = torch.randperm(pool, generator=g)[: v.num_seqs * v.num_blocks]
            bt = perm.to(torch.int32).reshape(v.num_seqs, v.num_blocks)
            q = torch.randn(v.num_seqs, h, d, generator=g).to(dt)
            out = runner.run([q, kc, vc, bt, lens])[0]
            assert out.dtype == dt and torch.isfinite(out.float()).all()  # padded rows too
            assert not out[len(real) :].any()  # a padded row reads nothing: zeros
            ref = reference_decode(q[: len(real)], kc, vc, bt[: len(real)], real)
            torch.testing.assert_close(out[: len(real)].float(), ref, **tol)
            continue
        bt = torch.randperm(pool, generator=g)[: v.num_blocks].to(torch.int32)
        for seq_len in lengths:
            q_real = min(v.query_len, seq_len)
            q = torch.randn(v.query_len, h, d, generator=g).to(dt)
            sl = torch.tensor([seq_len, q_real], dtype=torch.int32)
            out = runner.run([q, kc, vc, bt, sl[:1], sl[1:]])[0]
            assert out.dtype == dt and torch.isfinite(out.float()).all()
            ref = reference_attention(q[:q_real], kc, vc, bt, seq_len)
            torch.testing.assert_close(out[:q_real].float(), ref, **tol)


@pytest.mark.compile
@pytest.mark.parametrize("bs,dtype", [(16, "bfloat16"), (192, "float32")])
def test_compiled_plan_matches_reference_and_verifies(tmp_path, bs, dtype):
    from kernel_cache.runtime.load import load_plan
    from warmup.builder.planner import warmup
    from warmup.check.verify import verify_plan

    cfg = _config(tmp_path, bs, dtype)
    cache = tmp_path / "cache"
    rep = warmup(cfg, cache, jobs=1, progress=False)
    assert rep["failed"] == [], rep["failed"]
    rt = load_plan(cfg, cache)
    variants = Bucketer(cfg).variants
    assert {v.kernel for v in variants} == {"paged_attention", BATCHED_DECODE}
    for i, v in enumerate(variants):
        _check_runner(cfg, v, rt._runners[v], seed=i)
    report = verify_plan(cfg, cache)
    assert report["ok"], report
