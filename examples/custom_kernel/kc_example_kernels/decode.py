"""A ``batched_decode`` kernel: gather each sequence's blocks, SDPA with a padding mask."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn

from kc_example_kernels.paging import gather_heads, length_mask


class SdpaDecode(nn.Module):
    """``forward(query [S, H, D], key_cache [P, B, KVH, D], value_cache [P, B, KVH, D],
    block_tables [S, NB] int32, seq_lens [S] int32) -> [S, H, D]`` in the query's
    dtype; a padded row (``seq_len == 0``) returns zeros. Launch keywords
    (``num_kv_splits``, ``blocks_per_chunk``) are accepted and ignored."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, **launch):
        super().__init__()
        self.groups = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, query, key_cache, value_cache, block_tables, seq_lens):
        k = gather_heads(key_cache, block_tables, self.groups).float()  # [S, H, T, D]
        v = gather_heads(value_cache, block_tables, self.groups).float()
        mask = length_mask(seq_lens, k.shape[-2])[:, None, None, :]  # [S, 1, 1, T]
        q = query.float().unsqueeze(2)  # [S, H, 1, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        out = out.squeeze(2) * (seq_lens > 0)[:, None, None]
        return out.to(query.dtype)
