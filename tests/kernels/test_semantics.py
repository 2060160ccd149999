"""The attention semantics docs/usage.md states, checked on the eager kernels with
explicit loops (no compile): causal prefill whose chunk is the sequence's last
query_len positions, scale 1/sqrt(head_dim), query head h reading KV head
h // (num_heads // num_kv_heads); and the replay's padded-read arithmetic."""

import math

import pytest
import torch

from kernel_cache.kernels.plain import BatchedDecode, PagedAttention

from ..conftest import TRACE

H, KVH, D, BS = 6, 2, 8, 4  # 3 query heads per KV head


def stated(query, kc, vc, table, seq_len):
    """docs/usage.md's words as loops: query i of a chunk of q sits at position
    seq_len - q + i and attends to positions 0..that, head h to KV head h // (H // KVH)."""
    q_len = query.shape[0]
    out = torch.zeros(q_len, H, D, dtype=torch.float64)
    for i in range(q_len):
        pos = seq_len - q_len + i
        for h in range(H):
            kv = h // (H // KVH)
            keys = [kc[table[t // BS], t % BS, kv].double() for t in range(pos + 1)]
            vals = [vc[table[t // BS], t % BS, kv].double() for t in range(pos + 1)]
            scores = torch.stack([query[i, h].double() @ k for k in keys]) / math.sqrt(D)
            out[i, h] = (torch.softmax(scores, 0)[:, None] * torch.stack(vals)).sum(0)
    return out


@pytest.mark.parametrize("seq_len,q_len", [(10, 10), (10, 3), (13, 1)])
def test_prefill_is_causal_over_the_sequences_last_positions(seq_len, q_len):
    g = torch.Generator().manual_seed(seq_len * 7 + q_len)
    pool = 9
    kc, vc = torch.randn(pool, BS, KVH, D, generator=g), torch.randn(pool, BS, KVH, D, generator=g)
    table = torch.randperm(pool, generator=g)[:4].to(torch.int32)
    query = torch.randn(q_len, H, D, generator=g)
    lens = (torch.tensor([seq_len], dtype=torch.int32), torch.tensor([q_len], dtype=torch.int32))
    got = PagedAttention(H, KVH, D)(query, kc, vc, table, *lens)
    want = stated(query, kc, vc, table.tolist(), seq_len)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_decode_is_the_last_position_of_each_sequence():
    g = torch.Generator().manual_seed(5)
    pool = 9
    kc, vc = torch.randn(pool, BS, KVH, D, generator=g), torch.randn(pool, BS, KVH, D, generator=g)
    tables = torch.stack([torch.randperm(pool, generator=g)[:4] for _ in range(3)]).to(torch.int32)
    seq_lens = [1, 7, 16]
    query = torch.randn(3, H, D, generator=g)
    got = BatchedDecode(H, KVH, D)(query, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32))
    for s, n in enumerate(seq_lens):
        want = stated(query[s : s + 1], kc, vc, tables[s].tolist(), n)
        torch.testing.assert_close(got[s : s + 1].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
def test_replays_padded_reads_are_batch_padding_not_rounding():
    """docs/usage.md's numbers ("Replay a real trace"), first 64 requests: the
    default (pow2) plan and the 4/3 ladder; most of what the bucket shapes read
    beyond the real blocks is batch padding, not each sequence's rounding."""
    from kernel_cache import Bucketer, make_config
    from warmup.request_lengths import kv_blocks_read, read_trace, schedule

    for ladder, total, rounding in (("pow2", 0.535, 0.112), ("4/3", 0.501, 0.009)):
        b = Bucketer(make_config("llama-3.2-1b", kv_ladder=ladder))
        read = real = own = 0
        for call in schedule(read_trace(TRACE, limit=64), b):
            r, n = kv_blocks_read(b, call)
            read, real = read + r, real + n
            own += sum(b.blocks_bucket(-(-x // b.block_size)) for x in call.seq_lens)
        assert round(1 - real / read, 3) == total  # what replay_trace.py prints
        assert round(1 - real / own, 3) == rounding  # each sequence to its own bucket
