"""The attention kernels, in plain PyTorch, over vLLM's paged KV layout.

Layout (as in vLLM):
    key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``
    block tables: int32 indices into ``num_pool_blocks``.

Both kernels use GQA (``num_heads`` a multiple of ``num_kv_heads``), scale
``1 / sqrt(head_dim)``, and compute scores and softmax in float32 whatever the
input dtype. Masked scores use the float32 minimum rather than ``-inf`` so a row
with nothing visible (a padded decode row, ``seq_len == 0``) yields a finite
average instead of NaN.

The bytes of this file are hashed into every cache key
(:func:`kernel_cache.keys.kernel_source_hash`): any edit here misses the cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

_NEG = torch.finfo(torch.float32).min


class PagedAttention(nn.Module):
    """One sequence's query chunk over its KV blocks, causal.

    Inputs:
        query: ``[query_len, num_heads, head_dim]`` (bucket-padded rows allowed).
        key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: ``[num_blocks]`` int32.
        seq_len: ``[1]`` int32, KV tokens of the sequence including this chunk.
        real_query_len: ``[1]`` int32, real (unpadded) tokens in the chunk.

    Token ``i`` of the chunk sits at absolute position ``seq_len - real_query_len + i``
    and sees KV positions up to and including its own, none at or past ``seq_len``.

    Returns: ``[query_len, num_heads, head_dim]`` in the query's dtype; rows
    ``>= real_query_len`` are finite padding to be sliced off.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, query, key_cache, value_cache, block_table, seq_len, real_query_len):
        q_len = query.shape[0]
        nb = block_table.shape[0]
        bs = key_cache.shape[1]
        kvh, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        idx = block_table.long()
        k = key_cache[idx].reshape(nb * bs, kvh, d).float()
        v = value_cache[idx].reshape(nb * bs, kvh, d).float()
        q = query.reshape(q_len, kvh, g, d).float()
        scores = torch.einsum("qkgd,tkd->kgqt", q, k) * self.scale  # [kvh, g, q, t]
        t = torch.arange(nb * bs, device=query.device, dtype=torch.int32)
        start = seq_len - real_query_len
        pos = start + torch.arange(q_len, device=query.device, dtype=torch.int32)
        visible = (t[None, :] <= pos[:, None]) & (t[None, :] < seq_len)  # [q, t]
        scores = scores.masked_fill(~visible, _NEG)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("kgqt,tkd->qkgd", probs, v)
        return out.reshape(q_len, kvh * g, d).to(query.dtype)


class BatchedDecode(nn.Module):
    """One query token per sequence, a batch of sequences.

    Inputs:
        query: ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, num_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32; the query token is at position ``seq_len - 1``
            and sees KV positions ``< seq_len``. Padded rows have ``seq_len == 0``
            and produce finite output.

    Returns: ``[num_seqs, num_heads, head_dim]`` in the query's dtype.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, query, key_cache, value_cache, block_tables, seq_lens):
        s, nb = block_tables.shape
        bs = key_cache.shape[1]
        kvh, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        idx = block_tables.long()
        k = key_cache[idx].reshape(s, nb * bs, kvh, d).float()
        v = value_cache[idx].reshape(s, nb * bs, kvh, d).float()
        q = query.reshape(s, kvh, g, d).float()
        scores = torch.einsum("skgd,stkd->skgt", q, k) * self.scale  # [s, kvh, g, t]
        t = torch.arange(nb * bs, device=query.device, dtype=torch.int32)
        visible = t[None, :] < seq_lens[:, None]  # [s, t]
        scores = scores.masked_fill(~visible[:, None, None, :], _NEG)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("skgt,stkd->skgd", probs, v)
        return out.reshape(s, kvh * g, d).to(query.dtype)


def build_module(kernel: str, num_heads: int, num_kv_heads: int, head_dim: int) -> nn.Module:
    """The eager module for ``kernel`` ("paged_attention" or "batched_decode")."""
    cls = {"paged_attention": PagedAttention, "batched_decode": BatchedDecode}[kernel]
    return cls(num_heads, num_kv_heads, head_dim).eval()
