"""An independent reference: one sequence at a time, contiguous KV, SDPA.

Used as the test oracle for the bucketed kernels (eager and compiled). It shares
no code with :mod:`kernel_cache.kernels.plain` or :mod:`kernel_cache.kernels.builtin`:
it gathers exactly ``seq_len`` tokens, expands KV heads for GQA with
``repeat_interleave`` and calls
``torch.nn.functional.scaled_dot_product_attention`` with an explicit mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Largest finite ``torch.float8_e4m3fn`` value.
FP8_E4M3_MAX = 448.0


def fp8_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` stored in an fp8 KV pool with per-tensor ``scale`` (vLLM's
    semantics): ``float8_e4m3fn(x / scale)``, saturated to +-448."""
    y = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.to(torch.float8_e4m3fn)


def dequantize(cache: torch.Tensor, scale=None) -> torch.Tensor:
    """A pool as the kernels read it, in float32: ``float(stored) * scale`` for an
    fp8 pool (``scale`` a float or a 1-element tensor), ``cache.float()`` when
    ``scale`` is None. The reference of an fp8 kernel is computed on this."""
    if scale is None:
        return cache.float()
    s = scale.float().reshape(()).cpu() if isinstance(scale, torch.Tensor) else scale
    return cache.float() * s.to(cache.device) if isinstance(s, torch.Tensor) else cache.float() * s


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[seq_len, num_kv_heads, head_dim]`` from a paged cache and a 1-D block table."""
    bs = cache.shape[1]
    nblocks = -(-seq_len // bs)
    blocks = [cache[int(b)] for b in block_table[:nblocks].tolist()]
    if not blocks:
        return cache.new_zeros((0, cache.shape[2], cache.shape[3]))
    return torch.cat(blocks, dim=0)[:seq_len]


def reference_attention(query, key_cache, value_cache, block_table, seq_len: int):
    """Causal attention of a chunk ``query [q, H, D]`` ending at ``seq_len`` KV tokens.

    Returns ``[q, H, D]`` in float32.
    """
    q_len, h, d = query.shape
    k = gather_kv(key_cache, block_table, seq_len).float()
    v = gather_kv(value_cache, block_table, seq_len).float()
    g = h // k.shape[1]
    k = k.repeat_interleave(g, dim=1).transpose(0, 1)  # [H, T, D]
    v = v.repeat_interleave(g, dim=1).transpose(0, 1)
    qf = query.float().transpose(0, 1)  # [H, q, D]
    start = seq_len - q_len
    pos = torch.arange(q_len)[:, None] + start
    mask = torch.arange(seq_len)[None, :] <= pos  # [q, T]
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask.to(query.device))
    return out.transpose(0, 1)


def reference_decode(query, key_cache, value_cache, block_tables, seq_lens):
    """Decode for each real sequence: ``query [S, H, D]`` → ``[S, H, D]`` float32."""
    outs = [
        reference_attention(query[i : i + 1], key_cache, value_cache, block_tables[i], int(n))
        for i, n in enumerate(seq_lens)
    ]
    return torch.cat(outs, dim=0)
