"""Software-pipelined and longest-first variants of the paged prefill kernel, graph against graph.

    python benchmarks/gpu_prefill_pipeline.py [--out DIR] [--reps 30]

granite-3.3-8b geometry (32 heads, 8 KV heads, head_dim 128, bf16) at block_size 128
(the engine's default), one sequence's chunk of ``q`` query tokens, the last ``q`` of
``kv`` KV tokens, causal, random block table; flash and cuDNN SDPA on the same tokens
laid out contiguously. Every side is replayed from a CUDA graph, L2 flushed before
each repetition (``gpu_common.time_cuda``); median (min-max) of ``--reps`` in ms.
TFLOP/s count 4 x 128 x 32 FLOPs per causally visible query-key pair and head.

The scratch kernel ``_prefill_p`` is the shipped kernel's one-page path
(``kernel_cache.kernels.triton_prefill``, ``block_size % block_n == 0``) with two
switches:

* ``PIPE``: the unmasked KV loop issues the next tile's ``Q Kᵀ`` before the
  softmax of the current one (FlashAttention-3's intra-warpgroup overlap, written
  in the source), so that Triton's asynchronous ``wgmma`` can run it on the tensor
  cores while the CUDA cores compute ``exp2``; it holds two score tiles.
* ``LPT``: the grid is ``(num_kv_heads, query tiles)``, so programs are issued
  longest first across all heads (the shipped grid is longest first within a head).

Per variant it records registers, spills and shared memory, and counts in its TTGIR
the asynchronous ``warp_group_dot`` ops and their waits (whether the overlap was
generated). Writes ``prefill_pipeline.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ROOT, device_info, prefill_inputs, time_cuda  # noqa: E402
from gpu_prefill_variants import KVH, LOG2E, SCALE, D, G, _identity, flops, fmt, sdpa  # noqa: E402

sys.path.insert(0, str(ROOT))
from kernel_cache.kernels.reference import reference_attention  # noqa: E402
from kernel_cache.kernels.triton_prefill import launch_prefill  # noqa: E402


@triton.jit
def _page_ptrs(X, bt_ptr, n0, kv_off, offs_n, offs_d, stride_b, stride_t,
               BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """Pointers of a ``[block_n, D]`` tile that lies inside one page."""
    blk = tl.load(bt_ptr + n0 // BLOCK_SIZE).to(tl.int64)
    rows = n0 % BLOCK_SIZE + offs_n
    return X + (blk * stride_b + kv_off) + (rows * stride_t)[:, None] + offs_d[None, :]


@triton.jit
def _prefill_p(
    Q, K, V, BT, SEQ_LEN, REAL_Q, OUT,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_vb, stride_vt, stride_ot, stride_oh,
    QLEN: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QK_SCALE: tl.constexpr,
    PIPE: tl.constexpr, LPT: tl.constexpr,
):  # fmt: skip
    BLOCK_Q: tl.constexpr = BLOCK_M // G
    if LPT:
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
        kvh = tl.program_id(0)
    else:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
        kvh = tl.program_id(1)
    seq_len = tl.load(SEQ_LEN)
    real_q = tl.load(REAL_Q)
    tok0 = pid_m * BLOCK_Q
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    tok = tok0 + offs_r // G
    head = kvh * G + offs_r % G
    row_ok = tok < QLEN
    out_ptrs = OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if tok0 >= real_q:
        tl.store(out_ptrs, tl.zeros([BLOCK_M, D], OUT.dtype.element_ty), mask=row_ok[:, None])
        return
    start = seq_len - real_q
    pos = start + tok
    q = tl.load(
        Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    kv_off = kvh * D
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    n_full = (start + tok0 + 1) // BLOCK_N
    kv_end = tl.minimum(seq_len, start + tok0 + BLOCK_Q)
    if PIPE:
        if n_full > 0:
            k = tl.load(_page_ptrs(K, BT, 0, kv_off, offs_n, offs_d, stride_kb, stride_kt,
                                   BLOCK_SIZE))  # fmt: skip
            qk = tl.dot(q, tl.trans(k))
            for j in range(1, n_full):
                k = tl.load(_page_ptrs(K, BT, j * BLOCK_N, kv_off, offs_n, offs_d, stride_kb,
                                       stride_kt, BLOCK_SIZE))  # fmt: skip
                qk_next = tl.dot(q, tl.trans(k))
                m_new = tl.maximum(m_i, tl.max(qk, 1) * QK_SCALE)
                p = tl.math.exp2(qk * QK_SCALE - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(_page_ptrs(V, BT, (j - 1) * BLOCK_N, kv_off, offs_n, offs_d,
                                       stride_vb, stride_vt, BLOCK_SIZE))  # fmt: skip
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
                m_i = m_new
                qk = qk_next
            m_new = tl.maximum(m_i, tl.max(qk, 1) * QK_SCALE)
            p = tl.math.exp2(qk * QK_SCALE - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(_page_ptrs(V, BT, (n_full - 1) * BLOCK_N, kv_off, offs_n, offs_d,
                                   stride_vb, stride_vt, BLOCK_SIZE))  # fmt: skip
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    else:
        for j in range(0, n_full):
            k = tl.load(_page_ptrs(K, BT, j * BLOCK_N, kv_off, offs_n, offs_d, stride_kb,
                                   stride_kt, BLOCK_SIZE))  # fmt: skip
            qk = tl.dot(q, tl.trans(k))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * QK_SCALE)
            p = tl.math.exp2(qk * QK_SCALE - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(_page_ptrs(V, BT, j * BLOCK_N, kv_off, offs_n, offs_d, stride_vb,
                                   stride_vt, BLOCK_SIZE))  # fmt: skip
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    for n0 in range(n_full * BLOCK_N, kv_end, BLOCK_N):
        offs_t = n0 + offs_n
        tmask = offs_t < seq_len
        k = tl.load(_page_ptrs(K, BT, n0, kv_off, offs_n, offs_d, stride_kb, stride_kt,
                               BLOCK_SIZE), mask=tmask[:, None], other=0.0)  # fmt: skip
        qk = tl.dot(q, tl.trans(k))
        visible = (offs_t[None, :] <= pos[:, None]) & tmask[None, :]
        qk = tl.where(visible, qk * QK_SCALE, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(_page_ptrs(V, BT, n0, kv_off, offs_n, offs_d, stride_vb, stride_vt,
                               BLOCK_SIZE), mask=tmask[:, None], other=0.0)  # fmt: skip
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o = tl.where((tok < real_q)[:, None], o, 0.0)
    tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def launch_p(query, kc, vc, bt, seq_len, real_q, *, block_m, block_n, num_warps, num_stages,
             pipe=False, lpt=False):  # fmt: skip
    qlen = query.shape[0]
    bs = kc.shape[1]
    if bs % block_n:
        raise ValueError(f"block_size {bs} % block_n {block_n} != 0")
    out = torch.empty_like(query)
    m_tiles = triton.cdiv(qlen, block_m // G)
    grid = (KVH, m_tiles) if lpt else (m_tiles, KVH)
    launch_p.last = _prefill_p[grid](
        query, kc, vc, bt, seq_len, real_q, out,
        query.stride(0), query.stride(1), kc.stride(0), kc.stride(1),
        vc.stride(0), vc.stride(1), out.stride(0), out.stride(1),
        QLEN=qlen, G=G, D=D, BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_N=block_n,
        QK_SCALE=SCALE * LOG2E, PIPE=pipe, LPT=lpt,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


CANDIDATES = [
    # name, (block_m, block_n, num_warps, num_stages), switches
    ("plain", (128, 128, 8, 3), dict()),
    ("lpt", (128, 128, 8, 3), dict(lpt=True)),
    ("pipe", (128, 128, 8, 3), dict(pipe=True)),
    ("pipe_s2", (128, 128, 8, 2), dict(pipe=True)),
    ("pipe_lpt", (128, 128, 8, 3), dict(pipe=True, lpt=True)),
    ("pipe_n64", (128, 64, 8, 3), dict(pipe=True)),
    ("pipe_n64_s4", (128, 64, 8, 4), dict(pipe=True)),
    ("pipe_n64_lpt", (128, 64, 8, 3), dict(pipe=True, lpt=True)),
    ("pipe_m64_w4", (64, 128, 4, 2), dict(pipe=True)),
    ("pipe_m64_n64_w4", (64, 64, 4, 3), dict(pipe=True)),
]


def ir_facts(kern) -> dict:
    ttgir = kern.asm.get("ttgir", "")
    return {
        "regs": getattr(kern, "n_regs", None),
        "spills": getattr(kern, "n_spills", None),
        "shared": kern.metadata.shared,
        "wgmma_ops": len(re.findall(r"warp_group_dot ", ttgir)),
        "wgmma_async": len(re.findall(r"isAsync = true", ttgir)),
        "wgmma_waits": re.findall(r"warp_group_dot_wait .*?\{pendings = (\d+)", ttgir),
    }


def bench_shape(q: int, kv: int, cands, reps: int) -> dict:
    args = prefill_inputs(q, kv, 128)
    query, kc, vc, bt, lens = args
    fl = flops(q, kv)
    ref = reference_attention(query, kc, vc, bt, kv)
    row = {"shape": f"{q}@{kv}", "block_size": 128, "results": {}}
    res = row["results"]

    def add(name, fn, extra=None):
        try:
            e = float((fn().float() - ref).norm() / ref.norm())
            t = time_cuda(fn, reps=reps, graph=True)
        except Exception as ex:  # noqa: BLE001 - a variant Triton cannot build
            res[name] = {"error": f"{type(ex).__name__}: {str(ex)[:600]}"}
            print(f"  {q}@{kv} {name}: ERROR {res[name]['error'][:300]}", flush=True)
            return
        res[name] = {**t, "rel_err": e, "tflops": fl / (t["median_ms"] * 1e-3) / 1e12}
        res[name].update(extra or {})
        print(f"  {q}@{kv} {name:16s} {fmt(t)} ms {res[name]['tflops']:6.1f} TFLOP/s "
              f"err {e:.2e} {extra or ''}", flush=True)  # fmt: skip

    for name, fn in sdpa(query, kc, vc, bt, kv).items():
        if isinstance(fn, str):
            res[name] = {"error": fn}
            continue
        add(name, lambda fn=fn: fn()[0].transpose(0, 1))
    add("shipped", lambda: launch_prefill(
        *args[:4], *lens, SCALE, block_m=128, block_n=128, num_warps=8, num_stages=3,
        wrap=_identity))  # fmt: skip
    for name, (bm, bn, w, s), sw in cands:
        tiles = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
        try:
            launch_p(*args[:4], *lens, **tiles, **sw)
            facts = {"tiles": tiles, **sw, **ir_facts(launch_p.last)}
        except Exception as ex:  # noqa: BLE001
            facts = {"tiles": tiles, **sw, "build_error": str(ex)[:300]}
        add(name, lambda t=tiles, sw=sw: launch_p(*args[:4], *lens, **t, **sw), facts)
    flash = res.get("flash", {})
    for r in res.values():
        if "median_ms" in r and "median_ms" in flash:
            r["over_flash"] = r["median_ms"] / flash["median_ms"]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--shapes", default="512@4096,2048@8192")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated candidate names")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cands = CANDIDATES
    if a.only:
        keep = set(a.only.split(","))
        cands = [c for c in CANDIDATES if c[0] in keep]
    doc = {"device": device_info(), "rows": []}
    for s in a.shapes.split(","):
        q, kv = (int(x) for x in s.split("@"))
        doc["rows"].append(bench_shape(q, kv, cands, a.reps))
        torch.cuda.empty_cache()
    (out / "prefill_pipeline.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
