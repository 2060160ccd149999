"""A ``paged_attention`` kernel: gather the sequence's blocks, SDPA with a causal mask."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn

from kc_example_kernels.paging import causal_mask, gather_heads


class SdpaPrefill(nn.Module):
    """``forward(query [Q, H, D], key_cache [P, B, KVH, D], value_cache [P, B, KVH, D],
    block_table [NB] int32, seq_len [1] int32, real_query_len [1] int32) -> [Q, H, D]``
    in the query's dtype; rows past ``real_query_len`` are finite padding."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, **launch):
        super().__init__()
        self.groups = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, query, key_cache, value_cache, block_table, seq_len, real_query_len):
        k = gather_heads(key_cache, block_table, self.groups).float()  # [H, T, D]
        v = gather_heads(value_cache, block_table, self.groups).float()
        mask = causal_mask(seq_len, real_query_len, query.shape[0], k.shape[-2])  # [Q, T]
        q = query.float().transpose(0, 1)  # [H, Q, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1).to(query.dtype)
