"""Eager bucketed kernels against the independent SDPA reference."""

import pytest
import torch

from kernel_cache.kernels import BatchedDecode, PagedAttention
from kernel_cache.reference import reference_attention, reference_decode

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
