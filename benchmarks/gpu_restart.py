"""GPU restart and kernel speed: a warmed plan loads vs torch.compile (cold, warm).

    python benchmarks/gpu_restart.py [--cache-dir DIR] [--repeats N] [--out DIR]

The plan (6 variants, granite-3.3-8b, bf16, block_size 16, max_model_len 8192):
``--kv-buckets 4096,8192 --query-buckets 512 --num-seqs-buckets 8,32``: 2
``paged_attention`` variants (512 query tokens) and 4 ``batched_decode`` variants.

1. ``kernel-cache warmup`` of the plan (its seconds and per-variant compile times).
2. "Ready to serve" in a fresh process, three ways, each run in its own process:
   (a) ``load_plan`` from the cache, then one call of every variant through
   dispatch; (b) ``torch.compile(dynamic=False)`` of the same modules (the Triton
   decode op and the plain-PyTorch prefill) and one call each, with empty
   Inductor and Triton cache directories (cold); (c) the same with the
   directories that (b) filled (warm). Seconds from after ``import torch`` to the
   last call's completion (inputs are built before the clock starts), the import
   itself, and the whole process as the parent saw it; whether the process
   imported Dynamo / Inductor.
3. Kernel speed, in a process of kind (a): per variant, at every sequence's bucket
   edge, the loaded artifact through dispatch against the eager plain-PyTorch
   kernel on the same padded inputs and against ``scaled_dot_product_attention``
   on the same tokens laid out densely (no paging, no padding).

Writes ``gpu_restart.json`` to ``--out``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_common import ROOT, write_json

PLAN = [
    "--model", "granite-3.3-8b", "--device", "cuda", "--max-model-len", "8192",
    "--block-size", "16", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
    "--kv-buckets", "4096,8192", "--query-buckets", "512", "--num-seqs-buckets", "8,32",
]  # fmt: skip

CHILD = r"""
import json, sys, time
t_start = time.perf_counter()
import torch
mode, cache_dir, speed = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
sys.path.insert(0, sys.argv[4])
from kernel_cache import make_config
from kernel_cache.plan.buckets import Bucketer, PAGED_ATTENTION
t_import = time.perf_counter()
cfg = make_config("granite-3.3-8b", device="cuda", max_model_len=8192, block_size=16,
                  max_num_seqs=32, max_num_batched_tokens=512, kv_buckets=(4096, 8192),
                  query_buckets=(512,), num_seqs_buckets=(8, 32))
variants = Bucketer(cfg).variants
g = torch.Generator(device="cuda").manual_seed(0)
dev, dt = "cuda", torch.bfloat16
H, KVH, D, BS = 32, 8, 128, 16
P = 32 * 512
kc = torch.randn(P, BS, KVH, D, generator=g, device=dev, dtype=dt)
vc = torch.randn(P, BS, KVH, D, generator=g, device=dev, dtype=dt)
tables = torch.randperm(P, generator=g, device=dev).to(torch.int32).reshape(32, 512)
inputs = {}
for v in variants:
    cap = v.num_blocks * BS
    if v.kernel == PAGED_ATTENTION:
        q = torch.randn(v.query_len, H, D, generator=g, device=dev, dtype=dt)
        inputs[v] = (q, tables[0, :v.num_blocks].contiguous(), cap)
    else:
        q = torch.randn(v.num_seqs, H, D, generator=g, device=dev, dtype=dt)
        inputs[v] = (q, tables[:v.num_seqs, :v.num_blocks].contiguous(), [cap] * v.num_seqs)
torch.cuda.synchronize()
t0 = time.perf_counter()
calls = {}
t_lib = t_loaded = None
if mode == "aoti":
    from kernel_cache import load_plan
    t_lib = time.perf_counter()
    rt = load_plan(cfg, cache_dir)
    t_loaded = time.perf_counter()
    for v in variants:
        q, bt, lens = inputs[v]
        if v.kernel == PAGED_ATTENTION:
            calls[v] = lambda q=q, bt=bt, n=lens: rt.prefill(q, kc, vc, bt, n)
        else:
            calls[v] = lambda q=q, bt=bt, n=lens: rt.decode(q, kc, vc, bt, n)
        calls[v]()
else:
    from warmup.builder.compiler import module_for
    for v in variants:
        q, bt, lens = inputs[v]
        m = torch.compile(module_for(cfg, v), dynamic=False, fullgraph=True)
        if v.kernel == PAGED_ATTENTION:
            a = (q, kc, vc, bt, torch.tensor([lens], dtype=torch.int32, device=dev),
                 torch.tensor([v.query_len], dtype=torch.int32, device=dev))
        else:
            a = (q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device=dev))
        calls[v] = lambda m=m, a=a: m(*a)
        with torch.no_grad():
            calls[v]()
torch.cuda.synchronize()
t_ready = time.perf_counter()
doc = {"mode": mode, "import_s": t_import - t_start, "ready_s": t_ready - t0,
       "variants": len(variants),
       # The split of (a)'s ready time: importing load_plan, load_plan, the first calls.
       "split_s": None if t_lib is None else {"import_load_plan": t_lib - t0,
                  "load_plan": t_loaded - t_lib, "first_calls": t_ready - t_loaded},
       "dynamo_imported": "torch._dynamo" in sys.modules,
       "inductor_imported": "torch._inductor.compile_fx" in sys.modules}
if mode != "aoti":
    from torch._dynamo.utils import counters
    doc["fxgraph_cache"] = {k: v for k, v in counters["inductor"].items() if "fxgraph" in k}
if speed:
    import math, statistics
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    from kernel_cache.kernels.builtin import build_module
    def bench(fn, reps=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts), min(ts), max(ts)
    rows = []
    with torch.no_grad():
        for v in variants:
            q, bt, lens = inputs[v]
            mod = build_module(v.kernel, H, KVH, D)
            if v.kernel == PAGED_ATTENTION:
                n = lens
                ea = (q, kc, vc, bt, torch.tensor([n], dtype=torch.int32, device=dev),
                      torch.tensor([v.query_len], dtype=torch.int32, device=dev))
                k = kc[bt.long()].reshape(1, -1, KVH, D)[:, :n].transpose(1, 2).contiguous()
                vv = vc[bt.long()].reshape(1, -1, KVH, D)[:, :n].transpose(1, 2).contiguous()
                qq = q.unsqueeze(0).transpose(1, 2).contiguous()
                mask = causal_lower_right(v.query_len, n)
            else:
                ea = (q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device=dev))
                k = kc[bt.long()].reshape(v.num_seqs, -1, KVH, D).transpose(1, 2).contiguous()
                vv = vc[bt.long()].reshape(v.num_seqs, -1, KVH, D).transpose(1, 2).contiguous()
                qq = q.unsqueeze(2)
                mask = None
            def sdpa(qq=qq, k=k, vv=vv, mask=mask):
                return F.scaled_dot_product_attention(qq, k, vv, attn_mask=mask, enable_gqa=True)
            try:
                sdpa()
            except RuntimeError:  # this torch cannot do GQA with that mask: expand the heads
                k, vv = k.repeat_interleave(H // KVH, 1), vv.repeat_interleave(H // KVH, 1)
                def sdpa(qq=qq, k=k, vv=vv, mask=mask):
                    return F.scaled_dot_product_attention(qq, k, vv, attn_mask=mask)
            cached = bench(calls[v])
            eager = bench(lambda m=mod, ea=ea: m(*ea), reps=5)
            dense = bench(sdpa)
            rows.append({"variant": str(v), "cached_ms": cached, "eager_ms": eager,
                         "sdpa_dense_ms": dense})
            del k, vv
    doc["speed"] = rows
print(json.dumps(doc))
"""


def child(mode: str, cache_dir: str, env: dict, speed: bool = False) -> dict:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, cache_dir, "1" if speed else "0", str(ROOT)],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=900,
    )  # fmt: skip
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"{mode} child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_wall_s": wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="kc-gpu-restart-")
    cache = args.cache_dir or str(Path(tmp) / "cache")
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "warmup.cli.main", "warmup", *PLAN, "--cache-dir", cache,
         "--jobs", "2", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=1200,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"warmup failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    warm = json.loads(proc.stdout)
    doc = {
        "plan": " ".join(PLAN),
        "warmup": {
            "wall_s": time.perf_counter() - t,
            "seconds": warm["seconds"],
            "compiled": warm["compiled"],
            "load_check": warm["load_check"],
            "compile_s": {r["variant"]: r.get("timings") for r in warm["results"]},
        },
    }
    runs = {"aoti": [], "compile_cold": [], "compile_warm": []}
    runs["aoti"].append(child("aoti", cache, {}, speed=True))
    for _ in range(args.repeats - 1):
        runs["aoti"].append(child("aoti", cache, {}))
    dirs = {"TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),
            "TRITON_CACHE_DIR": str(Path(tmp) / "triton")}  # fmt: skip
    runs["compile_cold"].append(child("compile", cache, dirs))
    for _ in range(args.repeats - 1):
        runs["compile_warm"].append(child("compile", cache, dirs))
    doc["runs"] = runs
    summary = {}
    for k, rs in runs.items():
        ready = [r["ready_s"] for r in rs]
        summary[k] = {
            "ready_s_median": statistics.median(ready),
            "ready_s_min_max": [min(ready), max(ready)],
            "with_import_s_median": statistics.median(r["ready_s"] + r["import_s"] for r in rs),
            "process_wall_s_median": statistics.median(r["process_wall_s"] for r in rs),
            "runs": len(rs),
            "dynamo_imported": any(r["dynamo_imported"] for r in rs),
        }
    base = summary["aoti"]["ready_s_median"]
    for k in summary:
        summary[k]["ratio_to_load_plan"] = summary[k]["ready_s_median"] / base
    doc["summary"] = summary
    write_json(doc, args.out, "gpu_restart.json")
    print(f"plan: {doc['plan']}")
    w = doc["warmup"]
    print(f"warmup: {w['compiled']} variants compiled in {w['seconds']:.1f} s (--jobs 2), "
          f"load check {w['load_check']['seconds']:.1f} s")  # fmt: skip
    print(f"{'ready to serve':16s} {'median s':>9s} {'min-max':>15s} {'+import':>8s} "
          f"{'process':>8s} {'x load_plan':>11s} dynamo")  # fmt: skip
    for k, s in summary.items():
        lo, hi = s["ready_s_min_max"]
        print(
            f"{k:16s} {s['ready_s_median']:9.3f} {lo:7.3f}-{hi:7.3f} "
            f"{s['with_import_s_median']:8.3f} {s['process_wall_s_median']:8.2f} "
            f"{s['ratio_to_load_plan']:11.1f} {s['dynamo_imported']}"
        )
    for r in runs["aoti"]:
        print("  (a) split, s: " + ", ".join(f"{k} {v:.3f}" for k, v in r["split_s"].items()))
    print("kernel speed at the bucket edge, ms median (cached artifact via dispatch | eager "
          "plain torch | SDPA dense):")  # fmt: skip
    for r in runs["aoti"][0]["speed"]:
        print(f"  {r['variant']:30s} {r['cached_ms'][0]:8.3f} {r['eager_ms'][0]:8.3f} "
              f"{r['sdpa_dense_ms'][0]:8.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
