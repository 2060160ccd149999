"""The plain PyTorch attention kernels over vLLM's paged KV layout: the readable
formulation the other kernels are checked against.

Layout (as in vLLM):
    key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``
    block tables: int32 indices into ``num_pool_blocks``.

:class:`PagedAttention` (prefill: one sequence's query chunk) and
:class:`BatchedDecode` (decode: one query token per sequence) gather a float32
copy of every block of the bucket (padded blocks and padded rows included) and
compute on all of it. They are the eager oracle of ``verify`` and the base
classes of the built-in CPU kernels (:mod:`kernel_cache.kernels.builtin`),
which run them eagerly and off the CPU.

All kernels use GQA (``num_heads`` a multiple of ``num_kv_heads``), scale
``1 / sqrt(head_dim)``, and accumulate scores and softmax in float32 whatever
the input dtype. Masked scores are ``-inf`` (a row with nothing visible is NaN,
as in the reference), except in :class:`BatchedDecode`'s split-KV path, whose
online softmax uses the float32 minimum so that it stays finite. Every decode
kernel (plain, flex, and the CUDA one in ``triton_decode.py``) returns zeros
for a padded row (``seq_len == 0``).

The bytes of this file are hashed into every cache key: the compile path
imports it through :mod:`kernel_cache.kernels.builtin`
(:func:`kernel_cache.plan.sources.source_files`), so any edit here misses the cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernel_cache.errors import ConfigError

_NEG = torch.finfo(torch.float32).min


def dequant(x, scale):
    """``x`` (KV gathered from the pool) in float32: ``x.float() * scale`` for an
    fp8 pool (``scale``: the ``[1]`` float32 per-tensor scale, vLLM's ``k_scale``
    or ``v_scale``), ``x.float()`` for a pool in the model dtype (``scale`` None)."""
    return x.float() if scale is None else x.float() * scale


class PagedAttention(nn.Module):
    """One sequence's query chunk over its KV blocks, causal.

    Inputs:
        query: ``[query_len, num_heads, head_dim]`` (bucket-padded rows allowed).
        key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: ``[num_blocks]`` int32.
        seq_len: ``[1]`` int32, KV tokens of the sequence including this chunk.
        real_query_len: ``[1]`` int32, real (unpadded) tokens in the chunk.
        k_scale, v_scale: ``[1]`` float32 for an fp8 pool (``float8_e4m3fn``):
            a key reads as ``float(stored) * k_scale``, a value as
            ``float(stored) * v_scale`` (vLLM's per-tensor scales); None for a
            pool in the model dtype.

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

    def forward(
        self,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_len,
        real_query_len,
        k_scale=None,
        v_scale=None,
    ):
        q_len = query.shape[0]
        nb = block_table.shape[0]
        bs = key_cache.shape[1]
        kvh, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        idx = block_table.long()
        k = dequant(key_cache[idx].reshape(nb * bs, kvh, d), k_scale)
        v = dequant(value_cache[idx].reshape(nb * bs, kvh, d), v_scale)
        q = query.reshape(q_len, kvh, g, d).float()
        scores = torch.einsum("qkgd,tkd->kgqt", q, k) * self.scale  # [kvh, g, q, t]
        t = torch.arange(nb * bs, device=query.device, dtype=torch.int32)
        start = seq_len - real_query_len
        pos = start + torch.arange(q_len, device=query.device, dtype=torch.int32)
        visible = (t[None, :] <= pos[:, None]) & (t[None, :] < seq_len)  # [q, t]
        visible = visible | ((t == 0) & (seq_len == 0))[None, :]  # seq_len 0: position 0
        # -inf, not the lowest float: a row whose visible scores are all -inf is NaN,
        # as in the reference, instead of a mean over the masked positions.
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        v = torch.where((t < seq_len)[:, None, None], v, 0.0)  # 0 * NaN past seq_len is NaN
        # A row reads only the positions it sees, and 0 * NaN (or inf) of a value
        # that only later rows see would be NaN: the sum runs over the finite
        # values, and where a row sees a non-finite one the reference's sum is
        # put back (NaN, or the inf whose weight is not 0).
        finite = v.isfinite()
        out = torch.einsum("kgqt,tkd->qkgd", probs, torch.where(finite, v, 0.0))
        seen = probs > 0  # False where masked, and for a NaN row (NaN already)
        nan_v = torch.einsum("qt,tkd->qkd", visible.float(), v.isnan().float())[:, :, None]
        inf_0 = torch.einsum("kgqt,tkd->qkgd", (visible & ~seen).float(), v.isinf().float())
        pinf = torch.einsum("kgqt,tkd->qkgd", seen.float(), (v == float("inf")).float())
        ninf = torch.einsum("kgqt,tkd->qkgd", seen.float(), (v == float("-inf")).float())
        out = torch.where(pinf > 0, float("inf"), out)
        out = torch.where(ninf > 0, float("-inf"), out)
        nan = (nan_v > 0) | (inf_0 > 0) | ((pinf > 0) & (ninf > 0))
        out = torch.where(nan, float("nan"), out)
        return out.reshape(q_len, kvh * g, d).to(query.dtype)


def _zero_padded_rows(out, seq_lens):
    """``out [num_seqs, ...]`` with the rows of ``seq_len == 0`` set to 0 (what the
    CUDA and the compiled CPU decode kernels return for a padded row)."""
    keep = (seq_lens > 0).reshape(-1, *([1] * (out.dim() - 1)))
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


class BatchedDecode(nn.Module):
    """One query token per sequence, a batch of sequences.

    Inputs:
        query: ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, num_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32; the query token is at position ``seq_len - 1``
            and sees KV positions ``< seq_len``. Padded rows have ``seq_len == 0``
            and return zeros.
        k_scale, v_scale: ``[1]`` float32 for an fp8 pool, None otherwise (as in
            :class:`PagedAttention`).

    Launch parameters (set per variant by :mod:`kernel_cache.plan.launch`):
        num_kv_splits: the ``num_blocks`` axis is cut into this many KV splits of
            ``ceil(num_blocks / num_kv_splits)`` blocks each (the last split is
            padded with masked blocks); each split is reduced on its own and the
            splits are combined with the log-sum-exp rule (split-KV, "flash
            decoding"). 1 to ``num_blocks``; default 1.
        blocks_per_chunk: KV blocks processed per step of the online softmax
            (Milakov & Gimelshein 2018) within a split; must divide the blocks of
            one split. Default (``None``): the whole split in one step.

    With the defaults (one split, one chunk) the kernel is the single-pass
    softmax it always was, operation for operation.

    Returns: ``[num_seqs, num_heads, head_dim]`` in the query's dtype.

    Raises:
        ConfigError: at construction, a non-positive ``num_kv_splits`` or
            ``blocks_per_chunk``; at trace/run time, a split count above
            ``num_blocks`` or a chunk that does not divide its split.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        blocks_per_chunk: int | None = None,
        num_kv_splits: int = 1,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        if num_kv_splits < 1:
            raise ConfigError(f"num_kv_splits={num_kv_splits}: must be >= 1")
        if blocks_per_chunk is not None and blocks_per_chunk < 1:
            raise ConfigError(f"blocks_per_chunk={blocks_per_chunk}: must be >= 1")
        self.blocks_per_chunk = blocks_per_chunk
        self.num_kv_splits = num_kv_splits

    def forward(
        self, query, key_cache, value_cache, block_tables, seq_lens, k_scale=None, v_scale=None
    ):
        nb = block_tables.shape[1]
        splits = self.num_kv_splits
        if splits > nb:
            raise ConfigError(
                f"num_kv_splits={splits} is outside [1, num_blocks={nb}]; use at most {nb}"
            )
        per_split = -(-nb // splits)
        bpc = per_split if self.blocks_per_chunk is None else self.blocks_per_chunk
        if per_split % bpc:
            raise ConfigError(
                f"blocks_per_chunk={bpc} does not divide the {per_split} blocks of one KV "
                f"split (num_blocks={nb}, num_kv_splits={splits})"
            )
        scales = (k_scale, v_scale)
        if splits == 1 and bpc == nb:
            return self._single_pass(query, key_cache, value_cache, block_tables, seq_lens, *scales)
        return self._split_kv(
            query, key_cache, value_cache, block_tables, seq_lens, per_split, bpc, *scales
        )

    def _single_pass(
        self, query, key_cache, value_cache, block_tables, seq_lens, k_scale=None, v_scale=None
    ):
        s, nb = block_tables.shape
        bs = key_cache.shape[1]
        kvh, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        idx = block_tables.long()
        k = dequant(key_cache[idx].reshape(s, nb * bs, kvh, d), k_scale)
        v = dequant(value_cache[idx].reshape(s, nb * bs, kvh, d), v_scale)
        q = query.reshape(s, kvh, g, d).float()
        scores = torch.einsum("skgd,stkd->skgt", q, k) * self.scale  # [s, kvh, g, t]
        t = torch.arange(nb * bs, device=query.device, dtype=torch.int32)
        visible = t[None, :] < seq_lens[:, None]  # [s, t]
        # -inf, not the lowest float: see PagedAttention.forward (padded rows, all
        # masked, are NaN here and zeroed below).
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        v = torch.where(visible[:, :, None, None], v, 0.0)  # 0 * NaN past seq_len is NaN
        out = torch.einsum("skgt,stkd->skgd", probs, v).reshape(s, kvh * g, d)
        return _zero_padded_rows(out, seq_lens).to(query.dtype)

    def _split_kv(
        self,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        per_split,
        bpc,
        k_scale=None,
        v_scale=None,
    ):
        s, nb = block_tables.shape
        bs = key_cache.shape[1]
        splits = self.num_kv_splits
        kvh, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        idx = block_tables.long()
        pad = splits * per_split - nb
        if pad:  # masked blocks: their positions are >= num_blocks * block_size >= seq_len
            idx = torch.cat([idx, idx.new_zeros((s, pad))], dim=1)
        idx = idx.reshape(s, splits, per_split)
        q = query.reshape(s, kvh, g, d).float()
        span = bpc * bs  # tokens per chunk
        lens = seq_lens[:, None, None]
        first = torch.arange(splits, device=query.device, dtype=torch.int32) * (per_split * bs)
        t = torch.arange(span, device=query.device, dtype=torch.int32)
        m = torch.full((s, splits, kvh, g), _NEG, device=query.device)
        l_sum = torch.zeros((s, splits, kvh, g), device=query.device)
        acc = torch.zeros((s, splits, kvh, g, d), device=query.device)
        for c in range(per_split // bpc):  # online softmax over chunks, all splits at once
            blk = idx[:, :, c * bpc : (c + 1) * bpc]
            k = dequant(key_cache[blk].reshape(s, splits, span, kvh, d), k_scale)
            v = dequant(value_cache[blk].reshape(s, splits, span, kvh, d), v_scale)
            scores = torch.einsum("skgd,sptkd->spkgt", q, k) * self.scale
            pos = first[:, None] + (c * span) + t[None, :]  # [splits, span]
            visible = pos[None] < lens  # [s, splits, span]
            scores = scores.masked_fill(~visible[:, :, None, None, :], _NEG)
            v = torch.where(visible[:, :, :, None, None], v, 0.0)  # NaN past seq_len stays out
            m_new = torch.maximum(m, scores.amax(dim=-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(scores - m_new[..., None])
            l_sum = l_sum * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.einsum("spkgt,sptkd->spkgd", p, v)
            m = m_new
        # Combine the splits: out = sum_p exp(lse_p - LSE) * out_p, lse_p = m_p + log l_p.
        lse = m + torch.log(l_sum)  # [s, splits, kvh, g]; l_sum >= 1
        weights = torch.softmax(lse, dim=1)
        out = (weights[..., None] * (acc / l_sum[..., None])).sum(dim=1)  # [s, kvh, g, d]
        return _zero_padded_rows(out.reshape(s, kvh * g, d), seq_lens).to(query.dtype)
