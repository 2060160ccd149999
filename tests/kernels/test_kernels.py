"""Eager bucketed kernels against the independent SDPA reference."""

import pytest
import torch

from kernel_cache.kernels.plain import BatchedDecode, PagedAttention
from kernel_cache.kernels.reference import reference_attention, reference_decode

CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, max_model_len)
    (4, 2, 8, 16, 64),
    (8, 1, 16, 192, 1024),  # block_size not a power of two, MQA
    (6, 6, 8, 7, 100),  # MHA, odd block size
]


def pool(p, bs, kvh, d, g):
    return torch.randn(p, bs, kvh, d, generator=g), torch.randn(p, bs, kvh, d, generator=g)


@pytest.mark.parametrize("h,kvh,d,bs,max_len", CASES)
def test_paged_attention_matches_reference(h, kvh, d, bs, max_len):
    g = torch.Generator().manual_seed(h * 1000 + bs)
    max_blocks = -(-max_len // bs)
    kc, vc = pool(max_blocks * 2 + 1, bs, kvh, d, g)
    mod = PagedAttention(h, kvh, d)
    lengths = [1, bs, bs + 1, max_len, int(torch.randint(2, max_len, (1,), generator=g))]
    for seq_len in lengths:
        for q_real in sorted({1, min(seq_len, 5), seq_len}):
            nb_real = -(-seq_len // bs)
            nb = min(max_blocks, nb_real + 1)  # one padded block when there is room
            q_bucket = q_real + 3  # padded query rows
            bt = torch.randperm(max_blocks * 2 + 1, generator=g)[:nb].to(torch.int32)
            query = torch.randn(q_bucket, h, d, generator=g)
            out = mod(
                query,
                kc,
                vc,
                bt,
                torch.tensor([seq_len], dtype=torch.int32),
                torch.tensor([q_real], dtype=torch.int32),
            )
            assert torch.isfinite(out).all()
            ref = reference_attention(query[:q_real], kc, vc, bt, seq_len)
            torch.testing.assert_close(out[:q_real], ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("h,kvh,d,bs,max_len", CASES)
def test_batched_decode_matches_reference_and_pads_finite(h, kvh, d, bs, max_len):
    g = torch.Generator().manual_seed(7 + bs)
    max_blocks = -(-max_len // bs)
    p = max_blocks * 4 + 3
    kc, vc = pool(p, bs, kvh, d, g)
    real = [1, bs, max_len, min(max_len, bs * 2 - 1)]  # length 1, a bucket edge, the max
    s_bucket = 8
    bt = torch.randint(0, p, (s_bucket, max_blocks), generator=g, dtype=torch.int32)
    lens = torch.tensor(real + [0] * (s_bucket - len(real)), dtype=torch.int32)
    query = torch.randn(s_bucket, h, d, generator=g)
    out = BatchedDecode(h, kvh, d)(query, kc, vc, bt, lens)
    assert torch.isfinite(out).all()  # padded rows (seq_len 0) included
    ref = reference_decode(query[: len(real)], kc, vc, bt[: len(real)], real)
    torch.testing.assert_close(out[: len(real)], ref, atol=2e-5, rtol=1e-4)


def test_bf16_inputs_keep_dtype():
    g = torch.Generator().manual_seed(0)
    kc, vc = (t.bfloat16() for t in pool(5, 16, 2, 8, g))
    q = torch.randn(4, 4, 8, generator=g).bfloat16()
    bt = torch.arange(8, dtype=torch.int32).reshape(4, 2) % 5
    out = BatchedDecode(4, 2, 8)(q, kc, vc, bt, torch.tensor([3, 17, 32, 0], dtype=torch.int32))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    ref = reference_decode(q[:3], kc, vc, bt[:3], [3, 17, 32])
    torch.testing.assert_close(out[:3].float(), ref, atol=3e-2, rtol=3e-2)


def _todays_decode(mod, query, key_cache, value_cache, block_tables, seq_lens):
    """batched_decode as it was before launch configs (a frozen copy, the bit-exact oracle)."""
    s, nb = block_tables.shape
    bs = key_cache.shape[1]
    kvh, g, d = mod.num_kv_heads, mod.num_heads // mod.num_kv_heads, mod.head_dim
    idx = block_tables.long()
    k = key_cache[idx].reshape(s, nb * bs, kvh, d).float()
    v = value_cache[idx].reshape(s, nb * bs, kvh, d).float()
    q = query.reshape(s, kvh, g, d).float()
    scores = torch.einsum("skgd,stkd->skgt", q, k) * mod.scale
    t = torch.arange(nb * bs, dtype=torch.int32)
    visible = t[None, :] < seq_lens[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], torch.finfo(torch.float32).min)
    out = torch.einsum("skgt,stkd->skgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(s, kvh * g, d).to(query.dtype)


def _decode_case(h, kvh, d, bs, nb, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    p = nb * 6 + 3
    kc, vc = (t.to(dtype) for t in pool(p, bs, kvh, d, g))
    cap = nb * bs
    real = sorted({1, bs, cap, max(1, cap // 2 + 3), min(cap, bs + 1)})
    s = len(real) + 2  # two padded rows (seq_len 0)
    bt = torch.randint(0, p, (s, nb), generator=g, dtype=torch.int32)
    lens = torch.tensor(real + [0, 0], dtype=torch.int32)
    query = torch.randn(s, h, d, generator=g).to(dtype)
    return query, kc, vc, bt, lens, real


def _settings(nb):
    for splits in range(1, nb + 1):
        per_split = -(-nb // splits)
        for bpc in range(1, per_split + 1):
            if per_split % bpc == 0:
                yield splits, bpc


@pytest.mark.parametrize("h,kvh,d,bs,nb", [(4, 2, 8, 16, 1), (8, 2, 16, 16, 5), (6, 3, 8, 7, 8)])
def test_every_launch_setting_matches_reference(h, kvh, d, bs, nb):
    """Every (num_kv_splits, blocks_per_chunk) a table may set, uneven splits included."""
    query, kc, vc, bt, lens, real = _decode_case(h, kvh, d, bs, nb, seed=nb)
    ref = reference_decode(query[: len(real)], kc, vc, bt[: len(real)], real)
    settings = list(_settings(nb))
    assert len(settings) == {1: 1, 5: 9, 8: 18}[nb]
    for splits, bpc in settings:
        mod = BatchedDecode(h, kvh, d, blocks_per_chunk=bpc, num_kv_splits=splits)
        out = mod(query, kc, vc, bt, lens)
        assert torch.isfinite(out).all(), (splits, bpc)  # padded rows included
        assert not out[len(real) :].any(), (splits, bpc)  # padded rows are zeros
        torch.testing.assert_close(out[: len(real)], ref, atol=2e-5, rtol=1e-4)


def test_launch_settings_in_bf16_match_reference():
    query, kc, vc, bt, lens, real = _decode_case(4, 2, 8, 16, 4, seed=3, dtype=torch.bfloat16)
    ref = reference_decode(query[: len(real)], kc, vc, bt[: len(real)], real)
    for splits, bpc in [(2, 1), (3, 1), (4, 1), (1, 2)]:
        out = BatchedDecode(4, 2, 8, blocks_per_chunk=bpc, num_kv_splits=splits)(
            query, kc, vc, bt, lens
        )
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out[: len(real)].float(), ref, atol=3e-2, rtol=3e-2)


def test_default_launch_is_todays_single_pass_bit_exact():
    """Real rows bit for bit as before; a padded row (seq_len 0) is now zeros."""
    query, kc, vc, bt, lens, real = _decode_case(8, 2, 16, 16, 6, seed=11)
    old = _todays_decode(BatchedDecode(8, 2, 16), query, kc, vc, bt, lens)
    n = len(real)
    for mod in (BatchedDecode(8, 2, 16), BatchedDecode(8, 2, 16, blocks_per_chunk=6)):
        out = mod(query, kc, vc, bt, lens)
        assert torch.equal(out[:n], old[:n])
        assert not out[n:].any()


def test_launch_parameters_out_of_range_raise():
    from kernel_cache.errors import ConfigError

    with pytest.raises(ConfigError, match="num_kv_splits=0"):
        BatchedDecode(4, 2, 8, num_kv_splits=0)
    query, kc, vc, bt, lens, _ = _decode_case(4, 2, 8, 16, 4, seed=1)
    with pytest.raises(ConfigError, match=r"num_kv_splits=5 is outside \[1, num_blocks=4\]"):
        BatchedDecode(4, 2, 8, num_kv_splits=5)(query, kc, vc, bt, lens)
    with pytest.raises(ConfigError, match="blocks_per_chunk=3 does not divide the 4 blocks"):
        BatchedDecode(4, 2, 8, blocks_per_chunk=3)(query, kc, vc, bt, lens)
