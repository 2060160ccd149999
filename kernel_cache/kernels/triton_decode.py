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
widened in registers (exact: every e4m3 value is a float16 and a float32
value): to float16 for 16-bit queries, to float32 for float32 ones. For 16-bit
queries and an even head dim (padded to at least 32) the pool is read as int16
pairs: pair ``j`` of a head row holds columns ``2j`` and ``2j + 1``, one
``cvt.rn.f16x2.e4m3x2`` turns it into one float16 of each, and the kernel
computes ``q . k`` as ``q_even . k_even + q_odd . k_odd`` and the output's even
and odd columns as ``p . v_even`` and ``p . v_odd``. The tiles then pass
through shared memory as 16-bit matrices (``ldmatrix``); a one-byte ``tl.dot``
operand that is widened after the load is read from shared memory a byte at a
time, which took twice the bf16 kernel's instructions per byte
(docs/benchmarks/gpu-decode.md, FP8 section). Float16, not bfloat16, because
e4m3 to bfloat16 takes two more conversions per pair on the slow conversion
pipe; a bfloat16 query is moved into float16's range by a power of two (exact)
that the score scale takes back, and the probabilities are rounded to float16
for the second product (more precise than bfloat16 on ``[0, 1]``). The scales
are applied to the float32 scores (``k_scale``, folded into the softmax scale)
and the float32 output (``v_scale``), which is ``float(stored) * scale`` moved
out of the sums.

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
#: The same over an fp8 pool, picked on an H100 by ``benchmarks/gpu_fp8_variants.py``
#: (granite-3.3-8b, 32 x 8192, block_size 16, graph replays; 1024 programs):
#: 0.201 ms against 0.209 at 64 tokens, 4 warps, 3 stages (docs/benchmarks/gpu-decode.md,
#: FP8 section).
BLOCK_N_FP8 = 32
NUM_WARPS_FP8 = 1
NUM_STAGES_FP8 = 3
#: An fp8 launch of fewer programs (``num_seqs * num_kv_heads * splits``) than this
#: takes the 16-bit launch (:data:`BLOCK_N`, :data:`NUM_WARPS`, :data:`NUM_STAGES`):
#: one sequence of 8192 tokens (256 programs) took 22.2 us with it against 25.0 with
#: the ``_FP8`` launch, while from 1024 programs on (4 to 32 sequences) the ``_FP8``
#: launch was 3-6% faster. Few programs happen where ``MIN_SPLIT_TOKENS`` holds the
#: split count down (one or two short-batch sequences).
FP8_FEW_PROGRAMS = 512


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
def _f16_pow2(amax):
    """``(2**e, 2**-e)`` for a float32 ``amax >= 0``: ``e`` puts ``amax`` in ``[2**14,
    2**15)``, inside float16's range (65504), read off the float32 exponent bits
    and clamped to ``[-126, 126]`` (``amax`` 0: any ``e``). A bfloat16 tile of
    largest magnitude ``amax`` times ``2**e`` is exact in float16 for every
    element down to ``2**-38`` of the largest."""
    expo = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax))
    e = tl.minimum(tl.maximum(14 - expo, -126), 126)
    up = ((e + 127) << 23).to(tl.float32, bitcast=True)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return up, down


@triton.jit
def _e4m3x2_to_f16(w):
    """The two e4m3 values packed in each int16 of ``w`` (the first in the low
    byte, as a pool row stores them) as float16 tensors ``(first, second)``: one
    ``cvt.rn.f16x2.e4m3x2`` per pair (sm_89 and later)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
        "=h,=h,h",
        [w],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _online_softmax_step(q, k, v_ptrs, kv_mask, tmask, scale, acc, m_i, l_i, KV_FP8: tl.constexpr):
    """One ``BLOCK_N``-token step of the online softmax: ``q`` ``[G_PAD, D_PAD]``,
    ``k`` ``[BLOCK_N, D_PAD]`` (masked tokens loaded as 0, ``tmask`` false), the
    step's V rows ``v_ptrs`` (loaded here, after the scores, as the kernel always
    did), running ``acc`` ``[G_PAD, D_PAD]``, max ``m_i`` and sum ``l_i``
    ``[G_PAD]``, float32. With ``KV_FP8`` the fp8 ``k`` and V rows are widened to
    ``q``'s dtype (float16 or float32, exact) and their scales applied outside
    (``scale`` holds ``k_scale``; the caller multiplies the output by
    ``v_scale``). Returns the updated ``acc``, ``m_i``, ``l_i``."""
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
    Q_BF16: tl.constexpr,
    PAIRS: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(LENS + s)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    heads = kvh * G + offs_g
    q_rows = Q + s * stride_qs + heads[:, None] * stride_qh
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    # fp8: q . (k * k_scale) = (q . k) * k_scale, sum p (v * v_scale) = v_scale sum p v
    qk_scale = scale
    if KV_FP8:
        qk_scale = (scale * tl.load(K_SCALE)).to(tl.float32)
    bt_row = BT + s * stride_bts
    if PAIRS:
        # An fp8 pool read as int16 pairs (strides in int16 units): pair j of a row
        # holds columns 2j (low byte) and 2j + 1, so q . k = q_e . k_e + q_o . k_o over
        # the even and odd columns, and the output's even and odd columns are
        # p . v_e and p . v_o. The query is loaded as the same two halves.
        offs_j = tl.arange(0, D_PAD // 2)
        jmask = offs_j < D // 2
        gj_mask = gmask[:, None] & jmask[None, :]
        q_e = tl.load(q_rows + 2 * offs_j[None, :], mask=gj_mask, other=0.0)
        q_o = tl.load(q_rows + 2 * offs_j[None, :] + 1, mask=gj_mask, other=0.0)
        if Q_BF16:  # the products in float16: see the module's docstring
            q_e, q_o = q_e.to(tl.float32), q_o.to(tl.float32)
            amax = tl.maximum(tl.max(tl.max(tl.abs(q_e), 1), 0), tl.max(tl.max(tl.abs(q_o), 1), 0))
            up, down = _f16_pow2(amax)
            q_e, q_o = (q_e * up).to(tl.float16), (q_o * up).to(tl.float16)
            qk_scale = qk_scale * down
        acc_e = tl.zeros([G_PAD, D_PAD // 2], tl.float32)
        acc_o = tl.zeros([G_PAD, D_PAD // 2], tl.float32)
        k_head = K.to(tl.pointer_type(tl.int16)) + kvh * stride_kh
        v_head = V.to(tl.pointer_type(tl.int16)) + kvh * stride_vh
        for t0 in range(start, end, BLOCK_N):
            offs_t = t0 + tl.arange(0, BLOCK_N)
            tmask = offs_t < end
            blk = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
            tok = offs_t % BLOCK_SIZE
            kv_mask = tmask[:, None] & jmask[None, :]
            k_rows = (blk * stride_kb + tok * stride_kt)[:, None] + offs_j[None, :]
            v_rows = (blk * stride_vb + tok * stride_vt)[:, None] + offs_j[None, :]
            k_e, k_o = _e4m3x2_to_f16(tl.load(k_head + k_rows, mask=kv_mask, other=0))
            qk = tl.dot(q_o, tl.trans(k_o), tl.dot(q_e, tl.trans(k_e))) * qk_scale
            qk = tl.where(tmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_e, v_o = _e4m3x2_to_f16(tl.load(v_head + v_rows, mask=kv_mask, other=0))
            p = p.to(tl.float16)
            acc_e = tl.dot(p, v_e, acc_e * alpha[:, None])
            acc_o = tl.dot(p, v_o, acc_o * alpha[:, None])
            m_i = m_new
        # An empty split (start >= seq_len) has l_i == 0: its output is 0, its lse -inf.
        norm = tl.load(V_SCALE) / tl.where(l_i > 0, l_i, 1.0)
        o_e = acc_e * norm[:, None]
        o_o = acc_o * norm[:, None]
        cols = 2 * offs_j[None, :]
        if DIRECT:
            out_rows = OUT + s * stride_os + heads[:, None] * stride_oh + cols
            tl.store(out_rows, o_e.to(OUT.dtype.element_ty), mask=gj_mask)
            tl.store(out_rows + 1, o_o.to(OUT.dtype.element_ty), mask=gj_mask)
        else:
            part_rows = PART_O + s * stride_pos + heads[:, None] * stride_poh + split * stride_pop
            tl.store(part_rows + cols, o_e, mask=gj_mask)
            tl.store(part_rows + cols + 1, o_o, mask=gj_mask)
    else:
        offs_d = tl.arange(0, D_PAD)
        gd_mask = gmask[:, None] & (offs_d < D)[None, :]
        q = tl.load(q_rows + offs_d[None, :], mask=gd_mask, other=0.0)
        if KV_FP8:
            if Q_BF16:  # the products in float16: see the module's docstring
                qf = q.to(tl.float32)
                up, down = _f16_pow2(tl.max(tl.max(tl.abs(qf), 1), 0))
                q = (qf * up).to(tl.float16)
                qk_scale = qk_scale * down
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
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
    if not DIRECT:
        lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
        tl.store(PART_LSE + s * stride_pls + heads * stride_plh + split, lse, mask=gmask)


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
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    wrap=wrap_triton,
) -> torch.Tensor:
    """Launch the kernels; shapes as :class:`TritonBatchedDecode`. ``block_n``,
    ``num_warps`` and ``num_stages`` are exposed for the kernel sweep
    (``benchmarks/gpu_kernel.py``); ``wrap`` is :func:`wrap_triton` inside the
    op and the identity for a direct launch. ``k_scale``, ``v_scale``: ``[1]``
    float32 on the device for an fp8 pool (both), else None. ``block_n``,
    ``num_warps``, ``num_stages`` None: :data:`BLOCK_N`, :data:`NUM_WARPS`,
    :data:`NUM_STAGES`, or their ``_FP8`` values for an fp8 pool launched as at
    least :data:`FP8_FEW_PROGRAMS` programs.

    An fp8 pool with a 16-bit query and an even head dim padded to at least 32 is
    read as int16 pairs (``PAIRS``; the strides passed in int16 units): 16-bit
    tiles go through shared memory as 16-bit matrices, where one-byte elements
    of a ``tl.dot`` operand are gathered a byte at a time."""
    s, h, d = query.shape
    nb = block_tables.shape[1]
    bs, kvh = key_cache.shape[1], key_cache.shape[2]
    fp8 = k_scale is not None
    launch = (BLOCK_N, NUM_WARPS, NUM_STAGES)
    if fp8 and s * kvh * split_plan(s, kvh, nb, bs, num_kv_splits, BLOCK_N_FP8)[0] >= (
        FP8_FEW_PROGRAMS
    ):
        launch = (BLOCK_N_FP8, NUM_WARPS_FP8, NUM_STAGES_FP8)
    block_n = launch[0] if block_n is None else block_n
    num_warps = launch[1] if num_warps is None else num_warps
    num_stages = launch[2] if num_stages is None else num_stages
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
    ks, vs = (k_scale, v_scale) if fp8 else (pl, pl)  # not read without KV_FP8
    kv_strides = [*key_cache.stride()[:3], *value_cache.stride()[:3]]
    pairs = (
        fp8
        and query.dtype in (torch.bfloat16, torch.float16)
        and d % 2 == 0
        and d_pad >= 32
        and all(x % 2 == 0 for x in kv_strides)
        and key_cache.storage_offset() % 2 == 0
        and value_cache.storage_offset() % 2 == 0
    )
    if pairs:
        kv_strides = [x // 2 for x in kv_strides]
    wrap(_decode_split_kernel)[(s, kvh, splits)](
        *(query, key_cache, value_cache, block_tables, seq_lens, out, po, pl, ks, vs, scale),
        *query.stride()[:2],
        *kv_strides,
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
        Q_BF16=query.dtype == torch.bfloat16,
        PAIRS=pairs,
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
