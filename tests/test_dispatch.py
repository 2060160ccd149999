"""Dispatch reuses its buffers across calls without leaking one call into the next
(tiny geometry, the session's warmed cache, real AOTInductor kernels)."""

import pytest
import torch

from kernel_cache import load_plan
from kernel_cache.reference import reference_attention, reference_decode

pytestmark = pytest.mark.compile


def pool(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, 2, 8, generator=g), torch.randn(n, 16, 2, 8, generator=g)


def test_decode_batches_of_changing_size_and_pool(warm_cache, tiny_config):
    rt = load_plan(tiny_config, warm_cache[0])
    g = torch.Generator().manual_seed(7)
    # Same variant (2 blocks, batch bucket 4) called with 4, then 2, then 3
    # sequences; the 2-sequence call uses a 3-block pool, so a stale block id
    # of the 4-sequence call (up to 10) in a padded row would read past it.
    for n_pool, lens, as_tensor in (
        (11, [32, 17, 30, 20], False),
        (3, [18, 32], False),
        (11, [20, 25, 31], True),
        (11, [32, 32, 17, 19], True),
    ):
        kc, vc = pool(n_pool, n_pool + len(lens))
        bt = torch.randint(0, n_pool, (len(lens), 2), generator=g, dtype=torch.int32)
        q = torch.randn(len(lens), 4, 8, generator=g)
        out = rt.decode(q, kc, vc, bt, torch.tensor(lens) if as_tensor else lens)
        ref = reference_decode(q, kc, vc, bt, lens)
        assert out.shape == (len(lens), 4, 8)
        assert float((out - ref).abs().max()) < 1e-5
    assert rt.stats()["calls"] == {"batched_decode:1:2:4": 4}


def test_non_contiguous_inputs_are_copied_not_misread(warm_cache, tiny_config):
    rt = load_plan(tiny_config, warm_cache[0])
    g = torch.Generator().manual_seed(8)
    kc, vc = pool(9, 1)
    # A full bucket of queries, transposed in memory (same shape, other strides).
    q = torch.randn(4, 8, 4, generator=g).transpose(1, 2)
    assert not q.is_contiguous()
    bt = torch.randint(0, 9, (4, 4), generator=g, dtype=torch.int32)[:, ::2]
    lens = [32, 3, 16, 17]
    out = rt.decode(q, kc, vc, bt, lens)
    assert float((out - reference_decode(q, kc, vc, bt, lens)).abs().max()) < 1e-5
    qp = torch.randn(32, 8, 4, generator=g).transpose(1, 2)
    table = torch.tensor([4, 7], dtype=torch.int32)
    out = rt.prefill(qp, kc, vc, table, 32)
    assert float((out - reference_attention(qp, kc, vc, table, 32)).abs().max()) < 1e-5
