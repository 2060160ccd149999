"""Dispatch reuses its buffers across calls without leaking one call into the next
(tiny geometry, the session's warmed cache, real AOTInductor kernels)."""

import pytest
import torch

from kernel_cache import load_plan
from kernel_cache.kernels.reference import reference_attention, reference_decode

pytestmark = pytest.mark.compile


def distinct_tables(n_pool, rows, cols, g):
    """``[rows, cols]`` int32 block tables, no pool block twice in a row (as an
    engine's: the compiled CPU decode kernel relies on it)."""
    return torch.stack([torch.randperm(n_pool, generator=g)[:cols] for _ in range(rows)]).to(
        torch.int32
    )


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
        bt = distinct_tables(n_pool, len(lens), 2, g)
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
    bt = distinct_tables(9, 4, 4, g)[:, ::2]
    lens = [32, 3, 16, 17]
    out = rt.decode(q, kc, vc, bt, lens)
    assert float((out - reference_decode(q, kc, vc, bt, lens)).abs().max()) < 1e-5
    qp = torch.randn(32, 8, 4, generator=g).transpose(1, 2)
    table = torch.tensor([4, 7], dtype=torch.int32)
    out = rt.prefill(qp, kc, vc, table, 32)
    assert float((out - reference_attention(qp, kc, vc, table, 32)).abs().max()) < 1e-5


def test_bad_inputs_that_used_to_pass_are_refused_and_the_runtime_still_works(
    warm_cache, tiny_config
):
    """Strided KV caches (once read with the wrong strides), block ids outside the
    pool (once aborted the process inside the kernel), a value_cache of fewer pool
    blocks than key_cache (once read past its end), and seq_lens of 0, negative
    or non-integer (once accepted) are refused with ShapeError; the next good call
    still matches the reference."""
    from kernel_cache import ShapeError

    rt = load_plan(tiny_config, warm_cache[0])
    g = torch.Generator().manual_seed(9)
    kc, vc = pool(9, 2)
    q = torch.randn(3, 4, 8, generator=g)
    bt = distinct_tables(9, 3, 2, g)
    lens = [32, 5, 17]
    big = torch.randn(18, 16, 2, 8, generator=g)
    cases = [
        ((q, big[::2], vc, bt, lens), "key_cache is not contiguous"),
        ((q, kc, vc.transpose(0, 1).contiguous().transpose(0, 1), bt, lens), "value_cache"),
        ((q, kc, vc, bt.masked_fill(bt == bt[1, 0], 9), lens), "block id 9, outside the KV pool"),
        ((q, kc, vc, bt.masked_fill(bt == bt[0, 1], -1), lens), "block id -1"),
        ((q, kc, vc, bt, [32, 0, 17]), "seq_lens holds 0"),
        ((q, kc, vc, bt, [32, -4, 17]), "seq_lens holds -4"),
        ((q, kc, vc, bt, [32, 5.5, 17]), "seq_lens holds 5.5"),
        ((q, kc, vc, bt, torch.tensor([32.0, 5.0, 17.0])), "seq_lens is torch.float32"),
        ((q, kc, vc, bt, torch.tensor([32, 0, 17])), "seq_lens holds 0"),
        ((q, kc, vc[:2].clone(), bt, lens), "value_cache 2"),  # once read past its end
        ((q, kc[:2].clone(), vc, bt.clamp(max=1), lens), "key_cache has 2 pool blocks"),
    ]  # fmt: skip
    for args, match in cases:
        with pytest.raises(ShapeError, match=match):
            rt.decode(*args)
    with pytest.raises(ShapeError, match="block id 9"):
        rt.prefill(q[:1], kc, vc, torch.tensor([3, 9], dtype=torch.int32), 20)
    with pytest.raises(ShapeError, match="value_cache 2"):
        rt.prefill(q[:1], kc, vc[:2].clone(), torch.tensor([7, 8], dtype=torch.int32), 20)
    with pytest.raises(ShapeError, match="seq_len 20.0 must be an integer"):
        rt.prefill(q[:1], kc, vc, torch.tensor([3, 4], dtype=torch.int32), 20.0)
    assert rt.stats()["calls"] == {}  # a refused call never ran a kernel
    out = rt.decode(q, kc, vc, bt, lens)
    assert float((out - reference_decode(q, kc, vc, bt, lens)).abs().max()) < 1e-5
    assert rt.stats()["compiles"] == 0
    assert rt.stats()["calls"] == {"batched_decode:1:2:4": 1}
