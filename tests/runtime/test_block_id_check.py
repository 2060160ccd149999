"""The CPU block-id range check, on small (memoryview) and large (numpy) tables."""

import pytest
import torch

from kernel_cache import ShapeError, make_config
from kernel_cache.plan.buckets import KernelVariant
from kernel_cache.runtime.buffers import SMALL_TABLE, VariantSlot
from kernel_cache.runtime.dispatch import AttentionRuntime


@pytest.mark.parametrize("num_seqs,num_blocks", [(4, 2), (8, 64)])
def test_block_ids_outside_the_pool_are_found_in_small_and_large_tables(num_seqs, num_blocks):
    cfg = make_config("llama-3.2-1b", max_num_seqs=8)
    v = KernelVariant(
        kernel="batched_decode", query_len=1, num_blocks=num_blocks, num_seqs=num_seqs
    )
    slot = VariantSlot(v, None, cfg, torch.float32, torch.device("cpu"))
    small = num_seqs * num_blocks <= SMALL_TABLE
    assert small == ((num_seqs, num_blocks) == (4, 2))  # both paths are covered
    pool = torch.empty(10, 1)
    check = AttentionRuntime._check_block_ids
    slot.btbuf.fill_(9)
    check("block_tables", slot, pool)  # 9 is the last block of a 10-block pool
    for bad in (10, -1, 2**31 - 1):
        slot.btbuf[num_seqs - 1, num_blocks - 1] = bad
        with pytest.raises(ShapeError, match=f"block id {bad}, outside the KV pool"):
            check("block_tables", slot, pool)
    slot.btbuf.zero_()  # the check reads the buffer itself, not a copy
    check("block_tables", slot, pool)
