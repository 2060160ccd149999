"""Helpers shared by the example kernels: gather paged KV, build the masks.

Shapes: ``P`` pool blocks, ``B`` tokens per block, ``KVH`` KV heads, ``D``
head_dim, ``NB`` blocks per table, ``T = NB * B`` tokens.
"""

from __future__ import annotations

import torch


def gather_heads(cache: torch.Tensor, table: torch.Tensor, groups: int) -> torch.Tensor:
    """``cache [P, B, KVH, D]`` gathered along ``table [..., NB]`` (int32) into
    ``[..., KVH * groups, T, D]``: every block of the table, KV heads repeated
    ``groups`` times for grouped-query attention."""
    blocks = cache[table.long()]  # [..., NB, B, KVH, D]
    *lead, nb, bs, kvh, d = blocks.shape
    kv = blocks.reshape(*lead, nb * bs, kvh, d).repeat_interleave(groups, dim=-2)
    return kv.transpose(-2, -3)  # [..., H, T, D]


def length_mask(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``[N, T]`` bool: position ``t < lengths[n]`` (``lengths [N]`` int32). A row
    with length 0 sees position 0 so that softmax stays finite; callers zero it."""
    t = torch.arange(total, device=lengths.device, dtype=torch.int32)
    mask = t[None, :] < lengths[:, None]
    mask[:, 0] = True
    return mask


def causal_mask(seq_len: torch.Tensor, real_len: torch.Tensor, rows: int, total: int):
    """``[rows, T]`` bool: chunk row ``i`` at position ``seq_len - real_len + i``
    sees KV positions up to its own and below ``seq_len`` (both ``[1]`` int32)."""
    dev = seq_len.device
    t = torch.arange(total, device=dev, dtype=torch.int32)
    pos = (seq_len - real_len) + torch.arange(rows, device=dev, dtype=torch.int32)
    mask = (t[None, :] <= pos[:, None]) & (t[None, :] < seq_len)
    mask[:, 0] = True  # a padded row past seq_len stays finite
    return mask
