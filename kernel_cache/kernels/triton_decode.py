"""A Triton paged-decode kernel for ``batched_decode`` on CUDA (split-KV, "flash decoding").

The eager plain-PyTorch :class:`kernel_cache.kernels.plain.BatchedDecode` gathers every
KV block of the bucket, padded ones included, into float32 copies and runs a
softmax over them: on an H200 its AOTInductor build took about 2.3 ms at
granite-3.3-8b geometry, 32 sequences x 8192 tokens, roughly a tenth of what the
memory bandwidth allows. This kernel reads each *real* KV token once,
straight from the paged cache, and stops at ``seq_len``: padded blocks of a
bucket, and padded rows (``seq_len == 0``), cost no KV reads.

Algorithm (Dao et al., "Flash-Decoding for long-context inference", 2023; the
online softmax of Milakov & Gimelshein, 2018):

1. ``_decode_split_kernel``, grid ``(num_seqs, num_kv_heads, num_splits)``: one
   program per sequence, KV head and split of ``tokens_per_split`` tokens. It
   loads the query rows of the KV head's GQA group (padded to 16 rows for
   ``tl.dot``), steps through its tokens ``block_n`` at a time (the block table
   maps each token to its physical block), keeps a running max and sum in
   float32, and writes a normalised partial output and its log-sum-exp.
2. ``_decode_combine_kernel``, grid ``(num_seqs, num_heads)``: combines the
   splits with the log-sum-exp rule. With one split the first kernel writes the
   output itself and the second is not launched.

Scores, softmax and accumulators are float32; the probabilities are rounded to
the KV dtype for the second product (as in FlashAttention); float32 inputs use
IEEE products (no TF32).

An fp8 pool (``float8_e4m3fn``, vLLM's ``fp8_e4m3`` with per-tensor
``k_scale`` and ``v_scale``) is read as it is stored, one byte per element, and
widened in registers to the query's dtype (exact: every e4m3 value is a
bfloat16, float16 and float32 value); the scales are applied to the float32
scores (``k_scale``, folded into the softmax scale) and the float32 output
(``v_scale``), which is ``float(stored) * scale`` moved out of the sums.

The op is registered with :func:`torch.library.triton_op`, so ``torch.export``
keeps it and AOTInductor compiles both kernels into the variant's ``.pt2``
package; loading that package needs neither Triton nor this module.

Only the warmup (the compiler) and tests import this module: it imports Triton.
Its bytes are hashed into every cache key (``kernel_cache.plan.sources.source_files``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op, wrap_triton

from kernel_cache.kernels.tiles import cuda_default_splits

#: Launch parameters, picked on an H200 (docs/benchmarks/gpu-decode.md,
#: kernel sweep): tokens per inner step, warps per program, pipeline stages.
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
#: Pipeline stages over an fp8 pool: 2 read a step of 64 one-byte tokens in
#: 0.266 ms against 0.299 ms with 3 (granite-3.3-8b, 32 x 8192, block_size 16,
#: graph replays, one H100: docs/benchmarks/gpu-decode.md, launch sweep).
NUM_STAGES_FP8 = 2


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(n))


def split_plan(
    num_seqs: int,
    num_kv_heads: int,
    num_blocks: int,
    block_size: int,
    num_kv_splits: int | None = None,
    block_n: int = BLOCK_N,
) -> tuple[int, int]:
    """``(num_splits, tokens_per_split)`` for a variant's static shape.

    ``tokens_per_split`` is a multiple of ``block_n`` tokens; ``num_splits *
    tokens_per_split >= num_blocks * block_size``. ``num_kv_splits`` (1 to
    ``num_blocks``; None: :func:`kernel_cache.kernels.tiles.cuda_default_splits`) cuts
    the ``num_blocks`` axis into that many splits of ``ceil(num_blocks /
    num_kv_splits)`` blocks, as in the plain-torch kernel's split-KV.

    Raises:
        ValueError: ``num_kv_splits`` outside ``[1, num_blocks]``.
    """
    cap = num_blocks * block_size
    if num_kv_splits is None:
        num_kv_splits = cuda_default_splits(num_seqs, num_kv_heads, num_blocks, block_size)
    if not 1 <= num_kv_splits <= num_blocks:
        raise ValueError(f"num_kv_splits={num_kv_splits} is outside [1, num_blocks={num_blocks}]")
    per = -(-num_blocks // num_kv_splits) * block_size
    per = -(-per // block_n) * block_n
    return -(-cap // per), per


@triton.jit
def _online_softmax_step(q, k, v_ptrs, kv_mask, tmask, scale, acc, m_i, l_i, KV_FP8: tl.constexpr):
    """One ``BLOCK_N``-token step of the online softmax: ``q`` ``[G_PAD, D_PAD]``,
    ``k`` ``[BLOCK_N, D_PAD]`` (masked tokens loaded as 0, ``tmask`` false), the
    step's V rows ``v_ptrs`` (loaded here, after the scores, as the kernel always
    did), running ``acc`` ``[G_PAD, D_PAD]``, max ``m_i`` and sum ``l_i``
    ``[G_PAD]``, float32. With ``KV_FP8`` the fp8 ``k`` and V rows are widened to
    the query's dtype (exact) and their scales applied outside (``scale`` holds
    ``k_scale``; the caller multiplies the output by ``v_scale``). Returns the
    updated ``acc``, ``m_i``, ``l_i``."""
    if KV_FP8:
        k = k.to(q.dtype)
    # AOTInductor passes ``scale`` as fp64: keep the scores float32.
    qk = (tl.dot(q, tl.trans(k), input_precision="ieee") * scale).to(tl.float32)
    qk = tl.where(tmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_new


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    BT,
    LENS,
    OUT,
    PART_O,
    PART_LSE,
    K_SCALE,
    V_SCALE,
    scale,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    stride_os,
    stride_oh,
    stride_pos,
    stride_poh,
    stride_pop,
    stride_pls,
    stride_plh,
    tokens_per_split,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(LENS + s)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    gd_mask = (offs_g < G)[:, None] & (offs_d < D)[None, :]
    heads = kvh * G + offs_g
    q_rows = Q + s * stride_qs + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=gd_mask, other=0.0)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    # fp8: q . (k * k_scale) = (q . k) * k_scale, sum p (v * v_scale) = v_scale sum p v
    qk_scale = scale
    if KV_FP8:
        qk_scale = (scale * tl.load(K_SCALE)).to(tl.float32)
    bt_row = BT + s * stride_bts
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        tmask = offs_t < end
        blk = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        tok = offs_t % BLOCK_SIZE
        kv_mask = tmask[:, None] & (offs_d < D)[None, :]
        k_rows = (blk * stride_kb + tok * stride_kt)[:, None] + offs_d[None, :]
        v_rows = (blk * stride_vb + tok * stride_vt)[:, None] + offs_d[None, :]
        k = tl.load(k_head + k_rows, mask=kv_mask, other=0.0)
        acc, m_i, l_i = _online_softmax_step(
            q, k, v_head + v_rows, kv_mask, tmask, qk_scale, acc, m_i, l_i, KV_FP8
        )

    # An empty split (start >= seq_len) has l_i == 0: its output is 0, its lse -inf.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * tl.load(V_SCALE)
    if DIRECT:
        out_rows = OUT + s * stride_os + heads[:, None] * stride_oh
        tl.store(out_rows + offs_d[None, :], o.to(OUT.dtype.element_ty), mask=gd_mask)
    else:
        part_rows = PART_O + s * stride_pos + heads[:, None] * stride_poh + split * stride_pop
        tl.store(part_rows + offs_d[None, :], o, mask=gd_mask)
        lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
        tl.store(PART_LSE + s * stride_pls + heads * stride_plh + split, lse, mask=offs_g < G)


@triton.jit
def _decode_combine_kernel(
    PART_O,
    PART_LSE,
    LENS,
    OUT,
    stride_pos,
    stride_poh,
    stride_pop,
    stride_pls,
    stride_plh,
    stride_os,
    stride_oh,
    tokens_per_split,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(LENS + s)
    n_valid = tl.cdiv(seq_len, tokens_per_split)  # splits past seq_len wrote nothing useful
    offs_c = tl.arange(0, SPLIT_CHUNK)
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    lse_row = PART_LSE + s * stride_pls + h * stride_plh
    o_row = PART_O + s * stride_pos + h * stride_poh
    # Pass 1: the largest log-sum-exp; pass 2: the weighted sum (splits in chunks).
    m = tl.full([SPLIT_CHUNK], float("-inf"), tl.float32)
    for c in range(0, n_valid, SPLIT_CHUNK):
        lse = tl.load(lse_row + c + offs_c, mask=c + offs_c < n_valid, other=float("-inf"))
        m = tl.maximum(m, lse)
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # seq_len == 0: every weight is 0
    acc = tl.zeros([D_PAD], tl.float32)
    denom = tl.zeros([SPLIT_CHUNK], tl.float32)
    for c in range(0, n_valid, SPLIT_CHUNK):
        pmask = c + offs_c < n_valid
        w = tl.exp(tl.load(lse_row + c + offs_c, mask=pmask, other=float("-inf")) - m_all)
        o = tl.load(
            o_row + (c + offs_c)[:, None] * stride_pop + offs_d[None, :],
            mask=pmask[:, None] & dmask[None, :],
            other=0.0,
        )
        acc += tl.sum(w[:, None] * o, 0)
        denom += w
    total = tl.sum(denom, 0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(OUT + s * stride_os + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=dmask)


def launch_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    wrap=wrap_triton,
) -> torch.Tensor:
    """Launch the kernels; shapes as :class:`TritonBatchedDecode`. ``block_n``,
    ``num_warps`` and ``num_stages`` are exposed for the kernel sweep
    (``benchmarks/gpu_kernel.py``); ``wrap`` is :func:`wrap_triton` inside the
    op and the identity for a direct launch. ``k_scale``, ``v_scale``: ``[1]``
    float32 on the device for an fp8 pool (both), else None. ``num_stages``
    None: :data:`NUM_STAGES`, :data:`NUM_STAGES_FP8` for an fp8 pool."""
    s, h, d = query.shape
    nb = block_tables.shape[1]
    bs, kvh = key_cache.shape[1], key_cache.shape[2]
    splits, per = split_plan(s, kvh, nb, bs, num_kv_splits, block_n)
    out = torch.empty_like(query)
    direct = splits == 1
    # With one split the partial buffers are unused; keep them tiny but valid.
    po_shape, pl_shape = (
        ((1, 1, 1, 1), (1, 1, 1)) if direct else ((s, h, splits, d), (s, h, splits))
    )
    po = torch.empty(po_shape, dtype=torch.float32, device=query.device)
    pl = torch.empty(pl_shape, dtype=torch.float32, device=query.device)
    d_pad = _pow2_at_least(d, 16)
    fp8 = k_scale is not None
    if num_stages is None:
        num_stages = NUM_STAGES_FP8 if fp8 else NUM_STAGES
    ks, vs = (k_scale, v_scale) if fp8 else (pl, pl)  # not read without KV_FP8
    wrap(_decode_split_kernel)[(s, kvh, splits)](
        *(query, key_cache, value_cache, block_tables, seq_lens, out, po, pl, ks, vs, scale),
        *query.stride()[:2],
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        block_tables.stride(0),
        *out.stride()[:2],
        *po.stride()[:3],
        *pl.stride()[:2],
        per,
        G=h // kvh,
        G_PAD=_pow2_at_least(h // kvh, 16),
        D=d,
        D_PAD=d_pad,
        BLOCK_SIZE=bs,
        BLOCK_N=block_n,
        DIRECT=direct,
        KV_FP8=fp8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not direct:
        wrap(_decode_combine_kernel)[(s, h)](
            *(po, pl, seq_lens, out),
            *po.stride()[:3],
            *pl.stride()[:2],
            *out.stride()[:2],
            per,
            D=d,
            D_PAD=d_pad,
            SPLIT_CHUNK=16,
            num_warps=4,
        )
    return out


@triton_op("kernel_cache::paged_decode", mutates_args={})
def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_splits: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.ops.kernel_cache.paged_decode``: decode attention over a paged cache.

    Shapes as :class:`TritonBatchedDecode`; ``num_kv_splits`` 0 picks the split
    count with :func:`split_plan`'s heuristic; ``k_scale``, ``v_scale`` for an
    fp8 pool.
    """
    return launch_decode(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale,
        num_kv_splits or None,
        k_scale,
        v_scale,
    )


class TritonBatchedDecode(nn.Module):
    """``batched_decode`` on CUDA through the Triton kernels above.

    The same function and interface as :class:`kernel_cache.kernels.plain.BatchedDecode`
    (the eager oracle), except that a padded row (``seq_len == 0``) returns zeros:

    Inputs:
        query: ``[num_seqs, num_heads, head_dim]``, contiguous.
        key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous in their last dimension.
        block_tables: ``[num_seqs, num_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32 on the device, KV tokens per sequence; only
            the first ``seq_len`` tokens' blocks are read.
        k_scale, v_scale: ``[1]`` float32 on the device for an fp8
            (``float8_e4m3fn``) pool, else omitted: keys read as
            ``float(stored) * k_scale``, values as ``float(stored) * v_scale``.

    Args:
        num_kv_splits: the split-KV count (1 to ``num_blocks``); default: the
            :func:`split_plan` heuristic.
        blocks_per_chunk: accepted as the slot's launch keyword and not used:
            the kernel streams ``BLOCK_N`` tokens per step.

    Returns: ``[num_seqs, num_heads, head_dim]`` in the query's dtype.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_kv_splits: int | None = None,
        blocks_per_chunk: int | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.num_kv_splits = num_kv_splits

    def forward(
        self, query, key_cache, value_cache, block_tables, seq_lens, k_scale=None, v_scale=None
    ):
        return paged_decode(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            self.scale,
            self.num_kv_splits or 0,
            k_scale,
            v_scale,
        )
