"""The fp8 decode kernel's variants and probes, and its launch sweep, at 32 x 8192.

    python benchmarks/gpu_fp8_variants.py [--out DIR] [--reps N] [--sass]  # the sweep
    python benchmarks/gpu_fp8_variants.py --ncu-target       # one launch each, for ncu
    python benchmarks/gpu_fp8_variants.py --apply-best JSON  # fp8 launch defaults from a sweep

granite-3.3-8b geometry, bf16 queries, block_size 16, 32 sequences x 8192 tokens,
block tables a random permutation of a pool of exactly those blocks, the pool in
bf16 and the same values in ``float8_e4m3fn`` with per-tensor scales ``amax /
448`` (as ``gpu_fp8_decode.py``). Every row is the kernel launched directly
(the split kernel and, with more than one split, the combine kernel) captured in
a CUDA graph and replayed by ``gpu_common.time_cuda`` (L2 flushed before each
replay), medians (min-max) of ``--reps``; bytes = K and V of every token at the
pool's element size, against the device-to-device copy bandwidth measured in
the same run. Each row's output is checked against the float32 reference on
the dequantized pool (two sequences): ``rel_err`` = ‖out − ref‖ / ‖ref‖.

Rows:

* ``shipped``: :func:`kernel_cache.kernels.triton_decode.launch_decode` as the
  module stands, a bf16 pool at its defaults, and an fp8 pool (read as int16
  pairs, converted to float16) at its defaults and over a grid of tokens per
  step x warps x stages, and of split counts;
* ``widen_bf16``: the kernel as it was before the pairs: the fp8 tiles loaded as
  bytes and widened to the query's dtype (bfloat16: three conversion
  instructions per two values);
* ``widen_f16``: the same with the query in float16 (one conversion per two
  values, the tiles still loaded as bytes);
* ``pairs_pure``: the int16-pairs kernel with the bytes split by integer
  operations and Triton's own fp8 conversion instead of the inline
  ``cvt.rn.f16x2.e4m3x2``;
* ``fp8_dot`` (probe, approximate): both products asked of fp8 operands (the
  query and the probabilities rounded to e4m3), to see what Triton makes of it;
* ``load_only`` (probe, no attention): the same block-table gather and K/V reads,
  the pool viewed as int32 and XOR-folded: what this access pattern reaches.

Also each compiled split kernel's registers, spills and shared memory, and for
the baselines a histogram of SASS opcodes (``cuobjdump -sass``; static counts;
``--sass`` also writes the listings to ``fp8_sass.txt``). Writes
``gpu_fp8_variants.json`` to ``--out``.

``--apply-best`` sets ``BLOCK_N_FP8``, ``NUM_WARPS_FP8`` and ``NUM_STAGES_FP8`` in
``kernel_cache/kernels/triton_decode.py`` to the fastest ``shipped`` fp8 row of
a sweep at the default split count whose ``rel_err`` is below 5e-3.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from gpu_common import GRANITE, copy_bandwidth, device_info, kv_bytes, time_cuda, write_json

from kernel_cache.kernels.reference import dequantize, fp8_quantize, reference_decode
from kernel_cache.kernels.tiles import cuda_default_splits
from kernel_cache.kernels.triton_decode import (
    _decode_combine_kernel,
    launch_decode,
    split_plan,
)

H, KVH, D = GRANITE["num_heads"], GRANITE["num_kv_heads"], GRANITE["head_dim"]
BS, S, KV = 16, 32, 8192
SCALE = D**-0.5


@triton.jit
def _split_v(
    Q,
    K,
    V,
    BT,
    LENS,
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
    stride_pos,
    stride_poh,
    stride_pop,
    stride_pls,
    stride_plh,
    tokens_per_split,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MODE: tl.constexpr,
    V_EARLY: tl.constexpr,
):
    """The split kernel over an fp8 pool, always writing partials. ``MODE`` 0:
    K/V widened to the query's dtype (bfloat16); 1: both products on fp8 tensor
    cores (the query scaled to e4m3's range and rounded to e4m3, the
    probabilities times 256 rounded to e4m3). ``V_EARLY``: the V tile is loaded
    with the K tile, before the scores."""
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(LENS + s)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(
        Q + s * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=gmask[:, None],
        other=0.0,
    )
    qk_scale = (scale * tl.load(K_SCALE)).to(tl.float32)
    if MODE == 1:
        qf = q.to(tl.float32)
        qmax = tl.maximum(tl.max(tl.max(tl.abs(qf), 1), 0), 1e-30)
        q = (qf * (448.0 / qmax)).to(tl.float8e4nv)
        qk_scale = qk_scale * (qmax / 448.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    bt_row = BT + s * stride_bts
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        tmask = offs_t < end
        blk = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        tok = offs_t % BLOCK_SIZE
        k = tl.load(
            k_head + (blk * stride_kb + tok * stride_kt)[:, None] + offs_d[None, :],
            mask=tmask[:, None],
            other=0.0,
        )
        v_ptrs = v_head + (blk * stride_vb + tok * stride_vt)[:, None] + offs_d[None, :]
        if V_EARLY:
            v = tl.load(v_ptrs, mask=tmask[:, None], other=0.0)
        if MODE == 0:
            k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        qk = tl.where(tmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if not V_EARLY:
            v = tl.load(v_ptrs, mask=tmask[:, None], other=0.0)
        if MODE == 0:
            v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot((p * 256.0).to(tl.float8e4nv), v) * (1.0 / 256)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * tl.load(V_SCALE)
    tl.store(
        PART_O
        + s * stride_pos
        + heads[:, None] * stride_poh
        + split * stride_pop
        + offs_d[None, :],
        o,
        mask=gmask[:, None],
    )
    lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
    tl.store(PART_LSE + s * stride_pls + heads * stride_plh + split, lse, mask=gmask)


@triton.jit
def _split_pairs_v(
    Q,
    K,
    V,
    BT,
    LENS,
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
    stride_pos,
    stride_poh,
    stride_pop,
    stride_pls,
    stride_plh,
    tokens_per_split,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The shipped kernel's int16-pairs loop (a float16 query, K/V as int16 views,
    strides in int16 units, always writing partials) with each int16 split into
    its two bytes by integer operations and converted by Triton's fp8 cast."""
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(LENS + s)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    offs_g = tl.arange(0, G_PAD)
    offs_j = tl.arange(0, D // 2)
    gmask = offs_g < G
    heads = kvh * G + offs_g
    q_rows = Q + s * stride_qs + heads[:, None] * stride_qh + 2 * offs_j[None, :]
    q_e = tl.load(q_rows, mask=gmask[:, None], other=0.0)
    q_o = tl.load(q_rows + 1, mask=gmask[:, None], other=0.0)
    qk_scale = (scale * tl.load(K_SCALE)).to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc_e = tl.zeros([G_PAD, D // 2], tl.float32)
    acc_o = tl.zeros([G_PAD, D // 2], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        tmask = offs_t < end
        blk = tl.load(BT + s * stride_bts + offs_t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        tok = offs_t % BLOCK_SIZE
        wk = tl.load(
            K + kvh * stride_kh + (blk * stride_kb + tok * stride_kt)[:, None] + offs_j[None, :],
            mask=tmask[:, None],
            other=0,
        )
        k_e = (wk & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        k_o = ((wk >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        qk = tl.dot(q_o, tl.trans(k_o), tl.dot(q_e, tl.trans(k_e))) * qk_scale
        qk = tl.where(tmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        wv = tl.load(
            V + kvh * stride_vh + (blk * stride_vb + tok * stride_vt)[:, None] + offs_j[None, :],
            mask=tmask[:, None],
            other=0,
        )
        v_e = (wv & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        v_o = ((wv >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        p = p.to(tl.float16)
        acc_e = tl.dot(p, v_e, acc_e * alpha[:, None])
        acc_o = tl.dot(p, v_o, acc_o * alpha[:, None])
        m_i = m_new
    norm = tl.load(V_SCALE) / tl.where(l_i > 0, l_i, 1.0)
    part = PART_O + s * stride_pos + heads[:, None] * stride_poh + split * stride_pop
    tl.store(part + 2 * offs_j[None, :], acc_e * norm[:, None], mask=gmask[:, None])
    tl.store(part + 2 * offs_j[None, :] + 1, acc_o * norm[:, None], mask=gmask[:, None])
    lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
    tl.store(PART_LSE + s * stride_pls + heads * stride_plh + split, lse, mask=gmask)


@triton.jit
def _load_probe(
    K,
    V,
    BT,
    LENS,
    OUT,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    tokens_per_split,
    W: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The decode kernel's K/V reads alone: the pool as int32 (``W`` words per
    head row), the same block-table gather, XOR-folded into one word per program."""
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(LENS + s)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    offs_w = tl.arange(0, W)
    acc = tl.zeros([BLOCK_N, W], tl.int32)
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        tmask = offs_t < end
        blk = tl.load(BT + s * stride_bts + offs_t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        tok = offs_t % BLOCK_SIZE
        k = tl.load(
            K + kvh * stride_kh + (blk * stride_kb + tok * stride_kt)[:, None] + offs_w[None, :],
            mask=tmask[:, None],
            other=0,
        )
        v = tl.load(
            V + kvh * stride_vh + (blk * stride_vb + tok * stride_vt)[:, None] + offs_w[None, :],
            mask=tmask[:, None],
            other=0,
        )
        acc = acc ^ k ^ v
    r = tl.reduce(acc, None, _xor)
    tl.store(OUT + (s * tl.num_programs(1) + kvh) * tl.num_programs(2) + split, r)


@triton.jit
def _xor(a, b):
    return a ^ b


def _identity(f):
    return f


class Capture:
    """A ``wrap`` for the launchers that records the compiled kernels they launch."""

    def __init__(self):
        self.kernels = []

    def __call__(self, fn):
        cap = self

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    k = fn[grid](*args, **kw)
                    cap.kernels.append(k)
                    return k

                return launch

        return _Grid()


def launch_v(
    q,
    kc,
    vc,
    bt,
    lens,
    ks,
    vs,
    splits,
    *,
    block_n=64,
    num_warps=4,
    num_stages=2,
    mode=0,
    v_early=False,
    pairs_pure=False,
    wrap=_identity,
):
    """``_split_v`` (or ``_split_pairs_v``, on int16 views of the pool and a
    float16 query) then the shipped combine kernel; returns the output."""
    s, h, d = q.shape
    nb = bt.shape[1]
    n_splits, per = split_plan(s, KVH, nb, BS, splits, block_n)
    po = torch.empty((s, h, n_splits, d), dtype=torch.float32, device=q.device)
    pl = torch.empty((s, h, n_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    g = h // KVH
    g_pad = max(16, triton.next_power_of_2(g))
    if pairs_pure:
        kc, vc, q = kc.view(torch.int16), vc.view(torch.int16), q.half()
    args = (q, kc, vc, bt, lens, po, pl, ks, vs, SCALE, *q.stride()[:2], *kc.stride()[:3])
    args += (*vc.stride()[:3], bt.stride(0), *po.stride()[:3], *pl.stride()[:2], per)
    launch = dict(num_warps=num_warps, num_stages=num_stages)
    if pairs_pure:
        wrap(_split_pairs_v)[(s, KVH, n_splits)](
            *args, G=g, G_PAD=g_pad, D=d, BLOCK_SIZE=BS, BLOCK_N=block_n, **launch
        )
    else:
        wrap(_split_v)[(s, KVH, n_splits)](
            *args,
            G=g,
            G_PAD=g_pad,
            D=d,
            BLOCK_SIZE=BS,
            BLOCK_N=block_n,
            MODE=mode,
            V_EARLY=v_early,
            **launch,
        )
    wrap(_decode_combine_kernel)[(s, h)](
        po,
        pl,
        lens,
        out,
        *po.stride()[:3],
        *pl.stride()[:2],
        *out.stride()[:2],
        per,
        D=d,
        D_PAD=d,
        SPLIT_CHUNK=16,
        num_warps=4,
    )
    return out


def launch_probe(
    kc, vc, bt, lens, splits, *, block_n=64, num_warps=4, num_stages=2, wrap=_identity
):
    """``_load_probe`` over a pool viewed as int32; returns its per-program words."""
    k32, v32 = kc.view(torch.int32), vc.view(torch.int32)
    s, nb = bt.shape
    n_splits, per = split_plan(s, KVH, nb, BS, splits, block_n)
    out = torch.empty(s * KVH * n_splits, dtype=torch.int32, device=kc.device)
    wrap(_load_probe)[(s, KVH, n_splits)](
        k32,
        v32,
        bt,
        lens,
        out,
        *k32.stride()[:3],
        *v32.stride()[:3],
        bt.stride(0),
        per,
        W=k32.shape[-1],
        BLOCK_SIZE=BS,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def inputs(S=S, KV=KV):
    """``(q, pools, bt, lens)``: pools ``{"bf16": (k, v, None, None), "fp8": (k8,
    v8, k_scale, v_scale)}``, ``S`` sequences of ``KV`` tokens."""
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = S * (KV // BS)
    k = torch.randn(pool, BS, KVH, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(pool, BS, KVH, D, generator=g, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(pool, generator=g, device="cuda").to(torch.int32).reshape(S, -1)
    q = torch.randn(S, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((S,), KV, dtype=torch.int32, device="cuda")
    ks = (k.float().abs().amax() / 448).reshape(1)
    vs = (v.float().abs().amax() / 448).reshape(1)
    pools = {"bf16": (k, v, None, None), "fp8": (fp8_quantize(k, ks), fp8_quantize(v, vs), ks, vs)}
    return q, pools, bt, lens


def _cuobjdump() -> str | None:
    for c in (shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"):
        if c and os.path.exists(c):
            return c
    return None


def sass(kernel) -> str:
    """The SASS of a compiled Triton kernel (``cuobjdump -sass``), or ''."""
    tool = _cuobjdump()
    cubin = kernel.asm.get("cubin") if hasattr(kernel, "asm") else None
    if not tool or not cubin:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def opcodes(text: str) -> dict:
    """Static opcode counts of a SASS listing, the most frequent first."""
    c = collections.Counter(m.group(1) for m in _OP.finditer(text))
    return dict(c.most_common())


def kernel_facts(kernel) -> dict:
    meta = getattr(kernel, "metadata", None)
    return {
        "regs": getattr(kernel, "n_regs", None),
        "spills": getattr(kernel, "n_spills", None),
        "shared": getattr(meta, "shared", None),
    }


def row(name, call, nbytes, ceiling, reps, ref=None, want_sass=False, **cfg) -> dict:
    """Time ``call`` (graph replays), check it against ``ref`` on two sequences,
    and record its split kernel's registers, spills and shared memory."""
    cap = Capture()
    try:
        out = call(cap)
        torch.cuda.synchronize()
        t = time_cuda(lambda: call(_identity), reps=reps, graph=True)
    except Exception as e:  # a configuration Triton cannot build
        print(f"{name} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return {"name": name, **cfg, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    tbs = nbytes / (t["median_ms"] * 1e-3) / 1e12
    r = {"name": name, **cfg, **t, "tb_per_s": tbs, "of_copy_bw": tbs / ceiling}
    if ref is not None:
        r["rel_err"] = float((out[:2].float() - ref).norm() / ref.norm())
    if cap.kernels:
        r["split_kernel"] = kernel_facts(cap.kernels[0])
        r["_kernel"] = cap.kernels[0]
        r["want_sass"] = want_sass
    err = f" err {r['rel_err']:.1e}" if "rel_err" in r else ""
    print(
        f"{name:11s} {cfg}: {t['median_ms']:.4f} ms ({t['min_ms']:.4f}-{t['max_ms']:.4f}) "
        f"{tbs / ceiling:.0%} of copy bw{err} {r.get('split_kernel', '')}",
        flush=True,
    )
    return r


def sweep(args) -> None:
    info = device_info()
    bw = copy_bandwidth()
    ceiling = bw["tb_per_s"]
    print(f"{info['device']}: copy bandwidth {ceiling:.2f} TB/s (read + write)", flush=True)
    q, pools, bt, lens = inputs()
    host = [KV] * S
    k8, v8, ks, vs = pools["fp8"]
    ref8 = reference_decode(q[:2], dequantize(k8, ks), dequantize(v8, vs), bt[:2], host[:2])
    ref16 = reference_decode(q[:2], pools["bf16"][0], pools["bf16"][1], bt[:2], host[:2])
    b16, b8 = kv_bytes(host, itemsize=2), kv_bytes(host, itemsize=1)
    base = cuda_default_splits(S, KVH, KV // BS, BS)
    reps = args.reps
    doc = {
        "env": info,
        "copy_bandwidth": bw,
        "shape": {
            "num_seqs": S,
            "kv_tokens": KV,
            "block_size": BS,
            "heads": H,
            "kv_heads": KVH,
            "head_dim": D,
        },
    }

    class Rows(list):
        """The rows so far, written out after each one (a run cut short keeps them)."""

        def append(self, r):
            super().append(r)
            public = [{k: x for k, x in y.items() if not k.startswith("_")} for y in self]
            write_json({**doc, "rows": public}, args.out, "gpu_fp8_variants.json")

    rows = Rows()

    def shipped(pool, bn=None, w=None, st=None, sp=base):
        kc, vc, a, b = pools[pool]
        return lambda wrap: launch_decode(
            q, kc, vc, bt, lens, SCALE, sp, a, b, block_n=bn, num_warps=w, num_stages=st, wrap=wrap
        )

    def variant(mode, bn=64, w=4, st=2, sp=base, qq=q, **kw):
        return lambda wrap: launch_v(
            qq, k8, v8, bt, lens, ks, vs, sp, block_n=bn, num_warps=w, num_stages=st, mode=mode,
            wrap=wrap, **kw,
        )  # fmt: skip

    def probe(pool, bn=64, w=4, st=2, sp=base):
        kc, vc = pools[pool][:2]
        return lambda wrap: launch_probe(
            kc, vc, bt, lens, sp, block_n=bn, num_warps=w, num_stages=st, wrap=wrap
        )

    def add(name, call, pool, bn, w, st, sp=base, sass=False, **extra):
        nbytes, ref = (b16, ref16) if pool == "bf16" else (b8, ref8)
        if name == "load_only":
            ref = None
        cfg = dict(pool=pool, block_n=bn, num_warps=w, num_stages=st, splits=sp, **extra)
        rows.append(row(name, call, nbytes, ceiling, reps, ref, want_sass=sass, **cfg))

    import kernel_cache.kernels.triton_decode as td

    fp8_default = (td.BLOCK_N_FP8, td.NUM_WARPS_FP8, td.NUM_STAGES_FP8)
    # Baselines: the bf16 pool as shipped; the fp8 pool as shipped; the kernel before
    # the pairs (bytes widened to bfloat16, at its launch then: 64 tokens, 4 warps,
    # 2 stages; and widened to float16 at the best launch it had).
    add("shipped", shipped("bf16"), "bf16", td.BLOCK_N, td.NUM_WARPS, td.NUM_STAGES, sass=True)
    add("shipped", shipped("fp8"), "fp8", *fp8_default, sass=True)
    add("widen_bf16", variant(0), "fp8", 64, 4, 2, sass=True)
    add("widen_f16", variant(0, w=2, st=3, qq=q.half()), "fp8", 64, 2, 3, sass=True)
    add("widen_bf16", variant(0, w=2, st=3), "fp8", 64, 2, 3)
    add("pairs_pure", variant(0, w=2, st=3, pairs_pure=True), "fp8", 64, 2, 3, sass=True)
    add("pairs_pure", variant(0, pairs_pure=True), "fp8", 64, 4, 2)
    # Probes.
    for pool in ("fp8", "bf16"):
        add("load_only", probe(pool), pool, 64, 4, 2, sass=pool == "fp8")
    add("fp8_dot", variant(1), "fp8", 64, 4, 2)
    # The shipped kernel over the fp8 pool: tokens per step x warps x stages at the
    # default split count, then split counts at the default launch.
    for bn in (32, 64, 128):
        for w in (1, 2, 4):
            for st in (2, 3, 4):
                add("shipped", shipped("fp8", bn, w, st), "fp8", bn, w, st)
    for sp in (1, 2, 2 * base, 4 * base):
        add("shipped", shipped("fp8", *fp8_default, sp), "fp8", *fp8_default, sp)

    # SASS of the split kernels of the baselines and probes (static opcode counts).
    texts = []
    for r in rows:
        k = r.pop("_kernel", None)
        if k is None or not r.pop("want_sass", False):
            continue
        text = sass(k)
        r["sass_opcodes"] = opcodes(text)
        texts.append(
            f"===== {r['name']} pool={r['pool']} block_n={r['block_n']} "
            f"warps={r['num_warps']} stages={r['num_stages']}\n{text}"
        )
    write_json({**doc, "rows": list(rows)}, args.out, "gpu_fp8_variants.json")
    if args.out and texts and args.sass:
        with open(os.path.join(args.out, "fp8_sass.txt"), "w") as f:
            f.write("\n".join(texts))
    ok = [r for r in rows if "median_ms" in r and r["name"] == "shipped" and r["pool"] == "fp8"]
    best = min(ok, key=lambda r: r["median_ms"])
    bf16 = rows[0]["median_ms"]
    print(
        f"fastest shipped fp8: {best['median_ms']:.4f} ms, {best['of_copy_bw']:.0%} of copy bw, "
        f"{bf16 / best['median_ms']:.2f}x the bf16 pool; {best}"
    )


def ncu_target() -> None:
    """One launch each, in this order: the bf16 pool as shipped (split + combine);
    the fp8 pool widened to bf16 (``_split_v`` + combine); the fp8 pool as shipped
    (split + combine); the load-only probe over the fp8 pool. 64 tokens per step,
    4 warps, the default split count; stages: 3 for bf16, 2 for fp8."""
    q, pools, bt, lens = inputs()
    k, v = pools["bf16"][:2]
    k8, v8, ks, vs = pools["fp8"]
    base = cuda_default_splits(S, KVH, KV // BS, BS)
    launch_decode(q, k, v, bt, lens, SCALE, base, wrap=_identity)
    torch.cuda.synchronize()
    del k, v, pools
    torch.cuda.empty_cache()
    launch_v(q, k8, v8, bt, lens, ks, vs, base, mode=0)
    launch_decode(q, k8, v8, bt, lens, SCALE, base, ks, vs, wrap=_identity)
    launch_probe(k8, v8, bt, lens, base)
    torch.cuda.synchronize()
    print("ncu target: launched bf16 shipped, fp8 widen_bf16, fp8 shipped, fp8 load_only")


#: The smaller decode shapes a launch default must not slow down: (sequences, KV tokens).
SMALL_SHAPES = ((1, 8192), (4, 8192), (8, 8192), (32, 1024))


def _fp8_candidates(doc: dict) -> list[dict]:
    """The sweep's ``shipped`` fp8 rows at the default split count with ``rel_err``
    below 5e-3, fastest first."""
    base = cuda_default_splits(S, KVH, KV // BS, BS)
    ok = [
        r
        for r in doc["rows"]
        if r["name"] == "shipped"
        and r["pool"] == "fp8"
        and r["splits"] == base
        and r.get("rel_err", 1.0) < 5e-3
        and isinstance(r.get("num_stages"), int)
    ]
    return sorted(ok, key=lambda r: r["median_ms"])


def _time_shape(n: int, kv: int, cands, reps: int) -> list[dict]:
    """The fp8 kernel at ``n`` sequences x ``kv`` tokens for each ``(block_n,
    num_warps, num_stages)`` of ``cands``, the default split count."""
    q, pools, bt, lens = inputs(n, kv)
    k8, v8, ks, vs = pools["fp8"]
    rows = []
    for bn, w, st in cands:

        def call(bn=bn, w=w, st=st):
            return launch_decode(q, k8, v8, bt, lens, SCALE, None, ks, vs, block_n=bn,
                                 num_warps=w, num_stages=st, wrap=_identity)  # fmt: skip

        t = time_cuda(call, reps=reps, graph=True)
        rows.append({"num_seqs": n, "kv_tokens": kv, "block_n": bn, "num_warps": w,
                     "num_stages": st, **t})  # fmt: skip
        print(f"S={n:2d} KV={kv:5d} {bn}/{w}/{st}: {t['median_ms']:.4f} ms "
              f"({t['min_ms']:.4f}-{t['max_ms']:.4f})", flush=True)  # fmt: skip
    return rows


def shapes(args) -> None:
    """The sweep's ``--shapes-top`` fastest fp8 launches, 64 tokens / 4 warps / 3
    stages and the module's defaults (``None``) at :data:`SMALL_SHAPES`, the kernel
    alone from graph replays, each shape at its default split count; writes
    ``gpu_fp8_shapes.json``."""
    import json

    doc = json.loads(Path(args.shapes).read_text())
    top = _fp8_candidates(doc)[: args.shapes_top]
    cands = [(r["block_n"], r["num_warps"], r["num_stages"]) for r in top]
    cands += [c for c in [(64, 4, 3)] if c not in cands] + [(None, None, None)]
    out = {"env": device_info(), "sweep_32x8192": {}, "rows": []}
    for r in _fp8_candidates(doc):
        out["sweep_32x8192"][f"{r['block_n']}/{r['num_warps']}/{r['num_stages']}"] = r["median_ms"]
    for n, kv in SMALL_SHAPES:
        out["rows"] += _time_shape(n, kv, cands, args.reps)
        torch.cuda.empty_cache()
    write_json(out, args.out, "gpu_fp8_shapes.json")


def apply_best(path: str, shapes_path: str | None = None) -> dict:
    """Set the fp8 launch defaults in ``triton_decode.py`` to the fastest
    ``shipped`` fp8 row of the sweep at ``path`` (default split count, ``rel_err``
    below 5e-3); with ``shapes_path`` (``--shapes``' JSON), the fastest of those
    within 5% of the best launch at every smaller shape. Returns that row."""
    import json

    from gpu_common import ROOT

    ok = _fp8_candidates(json.loads(Path(path).read_text()))
    if shapes_path:
        small = json.loads(Path(shapes_path).read_text())["rows"]
        key = lambda r: (r["block_n"], r["num_warps"], r["num_stages"])  # noqa: E731
        best_at = {}
        for r in small:
            shape = (r["num_seqs"], r["kv_tokens"])
            best_at[shape] = min(best_at.get(shape, float("inf")), r["median_ms"])
        small = [r for r in small if r["block_n"] is not None]
        fine = {key(r) for r in small}
        for r in small:
            if r["median_ms"] > 1.05 * best_at[(r["num_seqs"], r["kv_tokens"])]:
                fine.discard(key(r))
        ok = [r for r in ok if key(r) in fine] or ok
    best = ok[0]
    src = ROOT / "kernel_cache" / "kernels" / "triton_decode.py"
    text = src.read_text()
    for name, value in (
        ("BLOCK_N_FP8", best["block_n"]),
        ("NUM_WARPS_FP8", best["num_warps"]),
        ("NUM_STAGES_FP8", best["num_stages"]),
    ):
        text, n = re.subn(rf"^{name} = \d+$", f"{name} = {value}", text, flags=re.M)
        assert n == 1, name
    src.write_text(text)
    print(f"fp8 launch defaults: block_n {best['block_n']}, {best['num_warps']} warps, "
          f"{best['num_stages']} stages ({best['median_ms']:.4f} ms)")  # fmt: skip
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sass", action="store_true", help="also write fp8_sass.txt")
    ap.add_argument("--ncu-target", action="store_true", help="one launch each, for ncu")
    ap.add_argument("--apply-best", metavar="JSON", help="set the fp8 launch defaults")
    ap.add_argument("--shapes", metavar="JSON", help="a sweep's fastest launches at smaller shapes")
    ap.add_argument("--shapes-json", metavar="JSON", help="--shapes' output, for --apply-best")
    ap.add_argument("--shapes-top", type=int, default=6, help="--shapes: how many launches")
    args = ap.parse_args(argv)
    if args.apply_best:
        apply_best(args.apply_best, args.shapes_json)
    elif args.shapes:
        shapes(args)
    elif args.ncu_target:
        ncu_target()
    else:
        sweep(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
