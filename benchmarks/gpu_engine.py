"""GPU prefill kernel and dispatch at engine speed: granite-3.3-8b, bf16, block_size 16.

    python benchmarks/gpu_engine.py [--sweep] [--cache-dir DIR] [--out DIR]

Measures, on the current CUDA device:

1. **Prefill kernel** (:mod:`kernel_cache.kernels.triton_prefill`, launched directly and
   L2 flushed before each repetition) at 512 query
   tokens over 4096 KV tokens and 2048 over 8192, against
   ``scaled_dot_product_attention`` on the same tokens laid out contiguously
   ``[1, heads, tokens, head_dim]``, with the flash backend and with the cuDNN
   backend (causal, lower-right aligned, as the paged kernel); relative error
   against the float32 SDPA reference; TFLOP/s over the causally visible
   query-key pairs (4 x pairs x heads x head_dim FLOPs). Each side is timed twice, both
   replayed from a CUDA graph (``triton``, ``<sdpa>``, ``triton_over_<sdpa>``) and both
   launched eagerly (``triton_eager``, ``<sdpa>.eager``, ``triton_over_<sdpa>_eager``).
2. With ``--sweep``: the prefill kernel's tiles (block_m, block_n, warps, stages)
   at both shapes.
3. **Through dispatch** (``load_plan`` of an 8-variant plan: prefill 512 and
   2048 tokens, decode 8 and 32 sequences, at 4096 and 8192 KV tokens; warmed
   into ``--cache-dir`` unless it is there), per shape:
   ``dispatch_ms`` events around one call after an L2 flush (the GPU time of the
   call's copies and kernels), ``steady_ms`` 40 calls back to back between two
   events / 40 (what a step costs when the host keeps ahead), ``host_us`` the
   host's time per call (``time.perf_counter`` around each call while the GPU is
   busy), ``graph_ms`` / ``graph_host_us`` the same call captured in a CUDA graph
   (device-side lengths) and replayed; for decode, KV bytes per second over the
   copy bandwidth. Also the host time of the same decode artifact run directly by
   an AOTInductor runner in single-threaded mode and in the thread-safe mode
   (what ``load_package`` created before).

Medians of 20-30 repetitions with min-max, all within one run. Writes
``gpu_engine.json`` to ``--out``; prints tables.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if importlib.util.find_spec("triton") is None or not torch.cuda.is_available():
    sys.exit(f"{sys.argv[0]}: needs a CUDA GPU and Triton; run it on the GPU machine")

from gpu_common import (
    GRANITE,
    ROOT,
    copy_bandwidth,
    device_info,
    kv_bytes,
    prefill_inputs,
    time_cuda,
    write_json,
)

from kernel_cache.kernels.reference import reference_attention
from kernel_cache.kernels.tiles import cuda_prefill_defaults
from kernel_cache.kernels.triton_prefill import launch_prefill

H, KVH, D = GRANITE["num_heads"], GRANITE["num_kv_heads"], GRANITE["head_dim"]
BS = 16
SCALE = 1.0 / math.sqrt(D)
SHAPES = [(512, 4096), (2048, 8192)]  # (query tokens, KV tokens incl. the chunk)
PLAN = [
    "--model", "granite-3.3-8b", "--device", "cuda", "--max-model-len", "8192",
    "--block-size", "16", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048",
    "--kv-buckets", "4096,8192", "--query-buckets", "512,2048", "--num-seqs-buckets", "8,32",
]  # fmt: skip
LIMITS = dict(
    max_model_len=8192,
    block_size=16,
    max_num_seqs=32,
    max_num_batched_tokens=2048,
    kv_buckets=(4096, 8192),
    query_buckets=(512, 2048),
    num_seqs_buckets=(8, 32),
)


def _identity(f):
    return f


def stats(xs) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def causal_pairs(q: int, kv: int) -> int:
    """Query-key pairs a causal chunk of ``q`` tokens ending at ``kv`` sees."""
    start = kv - q
    return sum(start + i + 1 for i in range(q))


def sdpa_calls(query, kc, vc, bt, kv: int):
    """``{name: (callable, how)}``: flash and cuDNN SDPA on contiguous KV."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q_len = query.shape[0]
    qq = query.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, q, D]
    k = kc[bt.long()].reshape(-1, KVH, D)[:kv].transpose(0, 1).unsqueeze(0).contiguous()
    v = vc[bt.long()].reshape(-1, KVH, D)[:kv].transpose(0, 1).unsqueeze(0).contiguous()
    kx, vx = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    bias = causal_lower_right(q_len, kv)
    mask = torch.ones(q_len, kv, dtype=torch.bool, device="cuda").tril(kv - q_len)
    sdpa = F.scaled_dot_product_attention
    out = {}
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        tries = [
            ("causal_lower_right, enable_gqa",
             lambda: sdpa(qq, k, v, attn_mask=bias, enable_gqa=True)),
            ("causal_lower_right, KV heads expanded", lambda: sdpa(qq, kx, vx, attn_mask=bias)),
            ("boolean causal mask, KV heads expanded", lambda: sdpa(qq, kx, vx, attn_mask=mask)),
            ("NOT causal (all pairs), KV heads expanded", lambda: sdpa(qq, kx, vx)),
        ]  # fmt: skip
        for how, fn in tries:

            def call(fn=fn, backend=backend):
                with sdpa_kernel([backend]):
                    return fn()

            try:
                call()
                torch.cuda.synchronize()
            except RuntimeError as e:
                out.setdefault(f"{name}_errors", []).append(f"{how}: {str(e)[:200]}")
                continue
            out[name] = (call, how)
            break
    return out


def prefill_kernel(sweep: bool) -> dict:
    doc = {"rows": [], "sweep": []}
    for q, kv in SHAPES:
        args = prefill_inputs(q, kv, BS)
        query, kc, vc, bt, lens = args
        flops = 4 * causal_pairs(q, kv) * H * D
        ref = reference_attention(query, kc, vc, bt, kv)
        tiles = cuda_prefill_defaults(q, H // KVH, D)

        def run(t=tiles, a=args):
            return launch_prefill(*a[:4], *a[4], SCALE, **t, wrap=_identity)

        err = float((run().float() - ref).norm() / ref.norm())
        # Both sides are timed both ways: replayed from a CUDA graph (the kernels alone)
        # and launched eagerly (launch cost included); ratios pair like with like.
        t = time_cuda(run, reps=30, graph=True)
        te = time_cuda(run, reps=30, graph=False)
        row = {"shape": f"{q}@{kv}", "tiles": tiles, "triton": t, "triton_eager": te}
        row["rel_err"] = err
        row["triton_tflops"] = flops / (t["median_ms"] * 1e-3) / 1e12
        for name, val in sdpa_calls(query, kc, vc, bt, kv).items():
            if name.endswith("_errors"):
                row[name] = val
                continue
            fn, how = val
            o = fn()
            st = time_cuda(fn, reps=30, graph=True)
            se = time_cuda(fn, reps=30, graph=False)
            row[name] = {**st, "how": how, "tflops": flops / (st["median_ms"] * 1e-3) / 1e12}
            row[name]["eager"] = se
            row[name]["rel_err"] = float((o[0].transpose(0, 1).float() - ref).norm() / ref.norm())
            row[f"triton_over_{name}"] = t["median_ms"] / st["median_ms"]
            row[f"triton_over_{name}_eager"] = te["median_ms"] / se["median_ms"]
        doc["rows"].append(row)
        if sweep:
            for bm, bn, w, s in [
                (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2),
                (128, 128, 8, 3), (128, 32, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                (64, 128, 4, 2), (64, 32, 4, 3), (256, 64, 16, 2), (128, 128, 16, 2),
            ]:  # fmt: skip
                cfg = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": s}
                try:
                    e = float((run(cfg).float() - ref).norm() / ref.norm())
                    st = time_cuda(lambda c=cfg: run(c), reps=15, graph=True)
                except Exception as ex:  # a config Triton cannot build (shared memory)
                    doc["sweep"].append({"shape": f"{q}@{kv}", **cfg, "error": str(ex)[:200]})
                    continue
                doc["sweep"].append(
                    {"shape": f"{q}@{kv}", **cfg, **st, "rel_err": e,
                     "tflops": flops / (st["median_ms"] * 1e-3) / 1e12}
                )  # fmt: skip
        del args, ref
        torch.cuda.empty_cache()
    return doc


def host_times(call, reps: int = 30) -> dict:
    """Host microseconds per call, each timed alone while the GPU is kept busy."""
    busy = torch.empty(64 * 2**20, dtype=torch.int8, device="cuda")
    xs = []
    for _ in range(reps):
        busy.fill_(1)  # about 30 us of GPU work ahead of the call
        t = time.perf_counter()
        call()
        xs.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return stats(xs)


def steady_ms(call, n: int = 40) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        call()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def capture(call):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    return g


def dispatch(cache_dir: str, ceiling: float) -> dict:
    from kernel_cache import load_plan, make_config

    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "warmup.cli.main", "warmup", *PLAN, "--cache-dir", cache_dir,
         "--jobs", os.environ.get("JOBS", "8"), "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"warmup failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    doc = {"plan": " ".join(PLAN), "warmup_wall_s": time.perf_counter() - t}
    cfg = make_config("granite-3.3-8b", device="cuda", **LIMITS)
    rt = load_plan(cfg, cache_dir)
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = 32 * 512
    kc = torch.randn(pool, BS, KVH, D, generator=g, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(pool, BS, KVH, D, generator=g, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(pool, generator=g, device="cuda").to(torch.int32).reshape(32, 512)
    rows = []
    cases = [
        ("decode", 8, 4096),
        ("decode", 32, 8192),
        ("prefill", 512, 4096),
        ("prefill", 2048, 8192),
    ]
    for kind, n, kv in cases:
        nb = kv // BS
        q = torch.randn(n, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
        if kind == "decode":
            tables = bt[:n, :nb].contiguous()
            host_lens = [kv] * n
            dev_lens = torch.full((n,), kv, dtype=torch.int32, device="cuda")

            def call(q=q, t=tables, h=host_lens):
                return rt.decode(q, kc, vc, t, h)

            def gcall(q=q, t=tables, h=host_lens, d=dev_lens):
                return rt.decode(q, kc, vc, t, h, device_seq_lens=d)
        else:
            tables = bt[0, :nb].contiguous()
            dev_lens = [torch.tensor([x], dtype=torch.int32, device="cuda") for x in (kv, n)]

            def call(q=q, t=tables, kv=kv):
                return rt.prefill(q, kc, vc, t, kv)

            def gcall(q=q, t=tables, kv=kv, d=dev_lens):
                return rt.prefill(q, kc, vc, t, kv, device_seq_len=d[0], device_query_len=d[1])

        row = {"kind": kind, "shape": f"{n}x{kv}" if kind == "decode" else f"{n}@{kv}"}
        row["dispatch"] = time_cuda(call, reps=30)
        row["steady_ms"] = steady_ms(call)
        row["host_us"] = host_times(call)
        graph = capture(gcall)
        row["graph"] = time_cuda(graph.replay, reps=30)
        row["graph_host_us"] = host_times(graph.replay)
        if kind == "decode":
            nbytes = kv_bytes([kv] * n)
            for k in ("dispatch", "graph"):
                bw = nbytes / (row[k]["median_ms"] * 1e-3) / 1e12
                row[f"{k}_of_copy_bw"] = bw / ceiling
            row["steady_of_copy_bw"] = nbytes / (row["steady_ms"] * 1e-3) / 1e12 / ceiling
        rows.append(row)
        del graph
    doc["rows"] = rows
    doc["runner_modes"] = runner_modes(cfg, cache_dir, kc, vc, bt)
    doc["stats"] = rt.stats()
    return doc


def runner_modes(cfg, cache_dir, kc, vc, bt) -> dict:
    """Host time per call of the 32 x 8192 decode artifact run directly, in
    AOTInductor's single-threaded and thread-safe modes."""
    from kernel_cache.plan.buckets import BATCHED_DECODE, KernelVariant
    from kernel_cache.plan.keys import build_key, environment
    from kernel_cache.plan.launch import launch_for
    from kernel_cache.store.disk_tier import DiskTier

    v = KernelVariant(kernel=BATCHED_DECODE, query_len=1, num_blocks=512, num_seqs=32)
    env = environment("cuda")
    key = build_key(cfg, v, env, launch=launch_for(cfg, v, env["device_arch"])).hexdigest
    tier = DiskTier(cache_dir)
    try:
        data = tier.get(key).data
    finally:
        tier.close()
    q = torch.randn(32, H, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((32,), 8192, dtype=torch.int32, device="cuda")
    args = [q, kc, vc, bt.contiguous(), lens]
    out = {}
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "v.pt2")
        Path(path).write_bytes(data)
        for name, single in (("single_threaded", True), ("thread_safe", False)):
            r = torch._C._aoti.AOTIModelPackageLoader(path, "model", single, 1, 0)
            out[name] = {"host_us": host_times(lambda r=r: r.run(args))}
            out[name]["steady_ms"] = steady_ms(lambda r=r: r.run(args))
            try:
                capture(lambda r=r: r.run(args))
                out[name]["graph_capture"] = "ok"
            except Exception as e:
                out[name]["graph_capture"] = f"{type(e).__name__}: {str(e)[:160]}"
                torch.cuda.synchronize()
            del r
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--cache-dir", default=os.environ.get("CACHE", "/tmp/kc-gpu-engine"))
    p.add_argument("--out", default=None)
    p.add_argument("--skip-dispatch", action="store_true")
    args = p.parse_args(argv)
    info = device_info()
    bw = copy_bandwidth()
    doc = {"env": info, "copy_bandwidth": bw}
    doc["prefill"] = prefill_kernel(args.sweep)
    write_json(doc, args.out, "gpu_engine.json")
    print(f"{info['device']} torch {info['torch']} triton {info['triton']} cuda {info['cuda']}")
    print(f"copy bandwidth: {bw['tb_per_s']:.2f} TB/s (read + write, {bw['gib']} GiB)")
    print("prefill, granite-3.3-8b bf16, ms median (min-max), graph replay | eager:")
    for r in doc["prefill"]["rows"]:
        t, te = r["triton"], r["triton_eager"]
        line = (
            f"  {r['shape']:10s} triton {t['median_ms']:.3f} ({t['min_ms']:.3f}-{t['max_ms']:.3f})"
            f" {r['triton_tflops']:.0f} TFLOP/s err {r['rel_err']:.1e}"
            f" | eager {te['median_ms']:.3f}"
        )
        for n in ("flash", "cudnn"):
            if n in r:
                line += (
                    f" | {n} graph {r[n]['median_ms']:.3f} x{r[f'triton_over_{n}']:.2f}"
                    f" eager {r[n]['eager']['median_ms']:.3f} x{r[f'triton_over_{n}_eager']:.2f}"
                )
        print(line)
    for r in sorted(doc["prefill"]["sweep"], key=lambda r: (r["shape"], r.get("median_ms", 1e9))):
        print(f"  sweep {r}")
    if not args.skip_dispatch:
        doc["dispatch"] = dispatch(args.cache_dir, bw["tb_per_s"])
        write_json(doc, args.out, "gpu_engine.json")
        print("through dispatch (ms median; host us median (min-max)):")
        for r in doc["dispatch"]["rows"]:
            print(
                f"  {r['kind']:8s} {r['shape']:10s} dispatch {r['dispatch']['median_ms']:.3f}"
                f" steady {r['steady_ms']:.3f} host {r['host_us']['median']:.1f}"
                f" ({r['host_us']['min']:.1f}-{r['host_us']['max']:.1f}) graph "
                f"{r['graph']['median_ms']:.3f} graph host {r['graph_host_us']['median']:.1f}"
                + (
                    f" | copy bw: dispatch {r['dispatch_of_copy_bw']:.0%} steady "
                    f"{r['steady_of_copy_bw']:.0%} graph {r['graph_of_copy_bw']:.0%}"
                    if r["kind"] == "decode"
                    else ""
                )
            )
        print(f"  runner modes (32x8192 decode artifact): {doc['dispatch']['runner_modes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
