"""A Triton paged-prefill kernel for ``paged_attention`` on CUDA (FlashAttention-2 style).

The plain-PyTorch :class:`kernel_cache.kernels.plain.PagedAttention` gathers every KV
block of the bucket into float32 copies and materialises the whole score
matrix; through AOTInductor it ran a 512-token chunk over 4096 KV tokens of
granite-3.3-8b in about 1.1 ms on an H200, 9x slower than flash SDPA on
contiguous KV (docs/benchmarks/gpu-dispatch.md, "Kernel speed per variant").
This kernel streams the KV blocks straight from the paged cache with an online
softmax and never reads a token at or past ``seq_len``.

Semantics (exactly :class:`~kernel_cache.kernels.plain.PagedAttention`'s): the chunk's
``real_query_len`` real rows are the last tokens of the sequence; row ``i`` sits
at position ``seq_len - real_query_len + i`` and sees the KV positions up to and
including its own. Rows ``>= real_query_len`` (bucket padding) are written as
zeros. Scale ``1 / sqrt(head_dim)``, GQA (``num_heads`` a multiple of
``num_kv_heads``).

Algorithm (Dao, "FlashAttention-2", 2023; the online softmax of Milakov &
Gimelshein, 2018), grid ``(ceil(query_len / block_q), num_kv_heads)``:

* One program owns ``block_m`` score rows: ``block_q = block_m / g_pad`` query
  tokens times the ``g_pad`` query heads of one KV head's GQA group (``g_pad`` =
  ``num_heads / num_kv_heads`` rounded up to a power of two; rows of the padding
  heads are masked). Each KV tile is therefore loaded once per group, not once
  per query head.
* KV is read ``block_n`` tokens per step; the block table maps each token to
  its physical block. Where ``block_size`` is a multiple of ``block_n`` (the
  engine's default 128 with 128-token tiles) a tile lies inside one page and
  takes one block-table entry, a scalar, instead of one per token, and its rows
  are 32-bit offsets from one 64-bit page pointer: fewer address registers,
  15-17% less time at 512 @ 4096 and 2048 @ 8192 on an H200 than one entry
  and one 64-bit address per token (docs/benchmarks/gpu-prefill.md).
  Tiles entirely below the program's causal diagonal run without masks (the
  softmax scale folded into one multiply-add per score); the remaining tiles up
  to the last visible position are masked.
* Programs are issued from the last query tile to the first (the last tiles see
  the most KV), so that the longest programs start first.

Scores, softmax (base 2) and the accumulator are float32; probabilities are
rounded to the KV dtype for the second product (as in FlashAttention); float32
inputs use IEEE products (no TF32).

An fp8 pool (``float8_e4m3fn`` with per-tensor ``k_scale`` and ``v_scale``,
vLLM's ``fp8_e4m3``) is loaded one byte per element and widened in registers to
the query's dtype (exact); ``k_scale`` multiplies the float32 scores (with the
softmax scale) and ``v_scale`` the float32 output: ``float(stored) * scale``
moved out of the sums, as in ``triton_decode.py``.

Launch parameters (``block_m``, ``block_n``, ``num_warps``, ``num_stages``) come
from :mod:`kernel_cache.plan.launch` (tables, else
:func:`kernel_cache.kernels.tiles.cuda_prefill_defaults`).

The op is registered with :func:`torch.library.triton_op`, so ``torch.export``
keeps it and AOTInductor compiles the kernel into the variant's ``.pt2``
package; loading that package needs neither Triton nor this module. Only the
warmup (the compiler), tests and benchmarks import this module: it imports Triton.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op, wrap_triton


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(n))


@triton.jit
def _load_tile(ptrs, tmask, dmask, MASK_T: tl.constexpr, EVEN_D: tl.constexpr):
    if MASK_T:
        if EVEN_D:
            return tl.load(ptrs, mask=tmask[:, None], other=0.0)
        return tl.load(ptrs, mask=tmask[:, None] & dmask[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=dmask[None, :], other=0.0)


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    bt_ptr,
    n0,
    pos,
    seq_len,
    kv_off,
    offs_n,
    offs_d,
    dmask,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    offs_t = n0 + offs_n
    tmask = offs_t < seq_len
    if BLOCK_SIZE % BLOCK_N == 0:
        # The tile lies inside one page: one block-table entry (n0 < seq_len always), a
        # 64-bit page pointer and 32-bit row offsets inside the page (block_size x
        # stride_kt is far below 2**31).
        blk = tl.load(bt_ptr + n0 // BLOCK_SIZE).to(tl.int64)
        rows = n0 % BLOCK_SIZE + offs_n
        k_base = K + (blk * stride_kb + kv_off)
        v_base = V + (blk * stride_vb + kv_off)
        k_rows = rows * stride_kt
        v_rows = rows * stride_vt
    else:
        if MASKED:
            blk = tl.load(bt_ptr + offs_t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_ptr + offs_t // BLOCK_SIZE).to(tl.int64)
        tok = offs_t % BLOCK_SIZE
        k_base = K
        v_base = V
        k_rows = blk * stride_kb + tok * stride_kt + kv_off
        v_rows = blk * stride_vb + tok * stride_vt + kv_off
    k = _load_tile(k_base + k_rows[:, None] + offs_d[None, :], tmask, dmask, MASKED, EVEN_D)
    if KV_FP8:  # widened exactly; k_scale is in qk_scale
        k = k.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # raw logits
    if MASKED:
        visible = (offs_t[None, :] <= pos[:, None]) & tmask[None, :]
        qk = tl.where(visible, qk * qk_scale, float("-inf"))  # base-2 logits
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
    else:
        # The scale folded into one multiply-add per score (max(s * x) = s * max(x), s > 0).
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(v_base + v_rows[:, None] + offs_d[None, :], tmask, dmask, MASKED, EVEN_D)
    if KV_FP8:  # widened exactly; v_scale multiplies the output
        v = v.to(q.dtype)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    Q,
    K,
    V,
    BT,
    SEQ_LEN,
    REAL_Q,
    OUT,
    K_SCALE,
    V_SCALE,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    QLEN: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QK_SCALE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    EVEN_D: tl.constexpr = D == D_PAD
    # Last query tile first: it sees the most KV.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(SEQ_LEN)
    real_q = tl.load(REAL_Q)
    tok0 = pid_m * BLOCK_Q

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    tok = tok0 + offs_r // G_PAD
    head = kvh * G + offs_r % G_PAD
    row_ok = (offs_r % G_PAD < G) & (tok < QLEN)
    out_ptrs = OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    out_mask = row_ok[:, None] & dmask[None, :]
    if tok0 >= real_q:  # bucket padding only
        tl.store(out_ptrs, tl.zeros([BLOCK_M, D_PAD], OUT.dtype.element_ty), mask=out_mask)
        return

    start = seq_len - real_q  # absolute position of the chunk's first token
    pos = start + tok  # each row's position; padding rows lie at or past seq_len
    q = tl.load(
        Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=out_mask,
        other=0.0,
    )
    kv_k = kvh * stride_kh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    # fp8: q . (k * k_scale) = (q . k) * k_scale, sum p (v * v_scale) = v_scale sum p v
    qk_scale = QK_SCALE
    if KV_FP8:
        qk_scale = QK_SCALE * tl.load(K_SCALE)
    # Every row of the tile sees [0, start + tok0]; tiles below that need no mask.
    full_end = ((start + tok0 + 1) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(seq_len, start + tok0 + BLOCK_Q)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, K, V, BT, n0, pos, seq_len, kv_k, offs_n, offs_d, dmask,
            qk_scale, stride_kb, stride_kt, stride_vb, stride_vt,
            BLOCK_SIZE, BLOCK_N, False, EVEN_D, KV_FP8,
        )  # fmt: skip
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, K, V, BT, n0, pos, seq_len, kv_k, offs_n, offs_d, dmask,
            qk_scale, stride_kb, stride_kt, stride_vb, stride_vt,
            BLOCK_SIZE, BLOCK_N, True, EVEN_D, KV_FP8,
        )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * tl.load(V_SCALE)
    o = tl.where((tok < real_q)[:, None], o, 0.0)
    tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=out_mask)


def check_tiles(num_queries_per_kv: int, block_m: int, block_n: int) -> None:
    """Raise ``ValueError`` unless ``block_m`` and ``block_n`` are powers of two of
    at least 16 and ``block_m`` holds at least one token of a whole GQA group
    (``block_m >= num_queries_per_kv`` rounded up to a power of two)."""
    g_pad = _pow2_at_least(num_queries_per_kv, 1)
    for name, v in (("block_m", block_m), ("block_n", block_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v}: must be a power of two >= 16")
    if block_m < g_pad:
        raise ValueError(
            f"block_m={block_m} is smaller than the GQA group ({num_queries_per_kv} query "
            f"heads per KV head, padded to {g_pad})"
        )


def launch_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    real_query_len: torch.Tensor,
    scale: float,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    wrap=wrap_triton,
) -> torch.Tensor:
    """Launch the kernel; shapes as :class:`TritonPagedAttention`. ``wrap`` is
    :func:`wrap_triton` inside the op and the identity for a direct launch
    (benchmarks). ``k_scale``, ``v_scale``: ``[1]`` float32 on the device for an
    fp8 pool (both), else None. Raises ``ValueError`` for tiles
    :func:`check_tiles` refuses."""
    qlen, h, d = query.shape
    bs, kvh = key_cache.shape[1], key_cache.shape[2]
    g = h // kvh
    g_pad = _pow2_at_least(g, 1)
    check_tiles(g, block_m, block_n)
    out = torch.empty_like(query)
    block_q = block_m // g_pad
    grid = (triton.cdiv(qlen, block_q), kvh)
    fp8 = k_scale is not None
    wrap(_prefill_kernel)[grid](
        query,
        key_cache,
        value_cache,
        block_table,
        seq_len,
        real_query_len,
        out,
        k_scale if fp8 else seq_len,  # not read without KV_FP8
        v_scale if fp8 else seq_len,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        out.stride(0),
        out.stride(1),
        QLEN=qlen,
        G=g,
        G_PAD=g_pad,
        D=d,
        D_PAD=_pow2_at_least(d, 16),
        BLOCK_SIZE=bs,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # A compile-time constant: AOTInductor would pass a float argument as fp64.
        QK_SCALE=float(scale) * 1.4426950408889634,  # log2(e): the softmax runs in base 2
        KV_FP8=fp8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


@triton_op("kernel_cache::paged_prefill", mutates_args={})
def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    real_query_len: torch.Tensor,
    scale: float,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.ops.kernel_cache.paged_prefill``: causal chunk attention over a paged
    cache. Shapes as :class:`TritonPagedAttention`; ``k_scale``, ``v_scale`` for an
    fp8 pool."""
    return launch_prefill(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_len,
        real_query_len,
        scale,
        block_m,
        block_n,
        num_warps,
        num_stages,
        k_scale,
        v_scale,
    )


class TritonPagedAttention(nn.Module):
    """``paged_attention`` on CUDA through the Triton kernel above.

    The same function and interface as :class:`kernel_cache.kernels.plain.PagedAttention`
    (the eager oracle), except that bucket-padding rows (``>= real_query_len``)
    are zeros:

    Inputs:
        query: ``[query_len, num_heads, head_dim]``, contiguous in its last dimension.
        key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous in their last dimension.
        block_table: ``[num_blocks]`` int32.
        seq_len: ``[1]`` int32 on the device, KV tokens of the sequence including
            this chunk (``real_query_len <= seq_len <= num_blocks * block_size``).
        real_query_len: ``[1]`` int32 on the device, real rows of the chunk
            (``1 <= real_query_len <= query_len``).
        k_scale, v_scale: ``[1]`` float32 on the device for an fp8
            (``float8_e4m3fn``) pool, else omitted: keys read as
            ``float(stored) * k_scale``, values as ``float(stored) * v_scale``.

    Args:
        block_m: score rows per program (query tokens x the padded GQA group), a
            power of two >= 16; block_n: KV tokens per step, a power of two >= 16;
            num_warps, num_stages: Triton's. Defaults:
            :func:`kernel_cache.kernels.tiles.cuda_prefill_defaults` for ``query_len``
            (the query bucket) and ``itemsize`` (bytes per element of the dtype).

    Returns: ``[query_len, num_heads, head_dim]`` in the query's dtype.

    Raises:
        ValueError: at construction, tiles :func:`check_tiles` refuses or a
            ``num_heads`` that is not a multiple of ``num_kv_heads``.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        query_len: int = 1,
        itemsize: int = 2,
        block_m: int | None = None,
        block_n: int | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
    ):
        super().__init__()
        from kernel_cache.kernels.tiles import cuda_prefill_defaults

        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        g = num_heads // num_kv_heads
        d = cuda_prefill_defaults(query_len, g, head_dim, itemsize)
        self.block_m = block_m or d["block_m"]
        self.block_n = block_n or d["block_n"]
        self.num_warps = num_warps or d["num_warps"]
        self.num_stages = num_stages or d["num_stages"]
        check_tiles(g, self.block_m, self.block_n)
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
        return paged_prefill(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_len,
            real_query_len,
            self.scale,
            self.block_m,
            self.block_n,
            self.num_warps,
            self.num_stages,
            k_scale,
            v_scale,
        )
