"""Kernel speed: the compiled bucketed kernels against the plain eager kernels on the
same padded inputs and against scaled_dot_product_attention on unpadded inputs.

    python benchmarks/kernel_speed.py [ENGINE OPTIONS] [--repeats R] [--calls K]
        [--cache-dir DIR] [--out FILE]

Default geometry: granite-3.3-8b (32 heads, 8 KV heads, head_dim 128; public
config.json of ibm-granite/granite-3.3-8b-instruct), float32 on the CPU,
block_size 128, max_model_len 4096, max_num_seqs 8, max_num_batched_tokens 512.
Cases (lengths scale with max_model_len and the query buckets):

* decode: the largest decode batch, every sequence at the same KV length
  (a quarter and about half of max_model_len), padded to its KV bucket;
* prefill: a chunk a little shorter than the first query bucket, from an empty
  sequence; and a full chunk at the end of a longer sequence (chunked prefill).

Ways, each timed on the same data, interleaved in R rounds of K calls:

* ``compiled``: the AOTInductor kernel of the variant (loaded from the
  kernel_cache directory; warmed first if missing) on bucket-padded inputs;
* ``eager``: the module of ``kernel_cache.kernels.builtin.build_module`` run eagerly on
  the same padded inputs: the plain kernels, which read the whole bucket (what
  the artifacts held before, and verify's oracle);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on unpadded,
  contiguous K/V (gathered from the paged cache beforehand, outside the clock;
  GQA with ``enable_gqa=True``; a causal mask for prefill).

Clock: on the CPU, by default, one intra-op thread (``--threads 1``) and that
thread's CPU time (``time.thread_time``), which other people's processes on a
shared machine barely move; ``--clock wall --threads N`` measures wall time
with N threads (CUDA: always wall time, synchronized); ``--clock process
--threads N`` measures the CPU time of all of the process's threads (the work
N threads spend, spin-waits included; robust to other load, but not latency).
With several threads on a loaded machine, set ``OMP_WAIT_POLICY=PASSIVE``: the
AOTInductor kernels and torch run separate OpenMP thread pools (the system's
libgomp and torch's), and their threads spinning after each parallel region
take the cores from each other (recorded in the JSON).

Reported: milliseconds per call (median, min-max); the compiled kernel's time
over sdpa's (the target's measure: median and min-max of per-round ratios) and
speed-ups of compiled over eager and over sdpa; the largest difference between
compiled and sdpa outputs; minor page faults per call (``ru_minflt`` of the
process over 10 calls or ``--calls`` if more, after the timing: memory the call maps afresh);
and the same real lengths run through the largest bucket of the same kernel
among the cases (its ms and page faults per call: they should not grow with
the bucket). The load average is recorded before and after the run.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F
from _common import (
    DEFAULT_CACHE,
    OUT_DIR,
    ROOT,
    fmt,
    header,
    machine,
    print_table,
    summary,
    sync,
    write_json,
)

from kernel_cache import load_plan
from kernel_cache.kernels.builtin import build_module
from kernel_cache.kernels.reference import gather_kv
from kernel_cache.plan.buckets import BATCHED_DECODE, PAGED_ATTENTION, Bucketer, KernelVariant
from warmup.builder.planner import warmup
from warmup.cli.main import config_from_args, engine_options


def make_cases(cfg, b: Bucketer, g: torch.Generator) -> list[dict]:
    dev, dt = torch.device(cfg.device), cfg.torch_dtype()
    h, kvh, d, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    cases = []
    specs = []
    if b.num_seqs_buckets:
        s = b.num_seqs_buckets[-1]
        for f in (0.25, 0.55):
            specs.append(("decode", s, 1, max(1, round(cfg.max_model_len * f))))
    qb = b.query_buckets[1] if len(b.query_buckets) > 1 else b.query_buckets[0]
    q0 = min(qb - qb // 40, cfg.max_model_len)
    specs.append(("prefill", 1, q0, q0))
    specs.append(("prefill", 1, qb, min(cfg.max_model_len, max(qb, 4 * qb))))
    for kind, s, q, seq_len in specs:
        need = -(-seq_len // bs)
        nb = b.blocks_bucket(need)
        pool = s * nb + 3
        kc = torch.randn(pool, bs, kvh, d, generator=g).to(dev, dt)
        vc = torch.randn(pool, bs, kvh, d, generator=g).to(dev, dt)
        perm = torch.randperm(pool, generator=g)[: s * nb].to(torch.int32).reshape(s, nb)
        if kind == "decode":
            v = KernelVariant(kernel=BATCHED_DECODE, query_len=1, num_blocks=nb, num_seqs=s)
            query = torch.randn(s, h, d, generator=g).to(dev, dt)
            lens = torch.full((s,), seq_len, dtype=torch.int32)
            padded = (query, kc, vc, perm.to(dev), lens.to(dev))
            kk = torch.stack([gather_kv(kc, perm[i], seq_len) for i in range(s)])
            vv = torch.stack([gather_kv(vc, perm[i], seq_len) for i in range(s)])
            sd_q = query.unsqueeze(2)  # [S, H, 1, D]
            mask = None
            name = f"decode: {s} seqs x {seq_len} tokens (bucket {nb * bs})"
        else:
            qbk = b.query_bucket(q)
            v = KernelVariant(kernel=PAGED_ATTENTION, query_len=qbk, num_blocks=nb, num_seqs=1)
            query = torch.randn(qbk, h, d, generator=g).to(dev, dt)
            lens = torch.tensor([seq_len, q], dtype=torch.int32, device=dev)
            padded = (query, kc, vc, perm[0].to(dev), lens[0:1], lens[1:2])
            kk = gather_kv(kc, perm[0], seq_len).unsqueeze(0)
            vv = gather_kv(vc, perm[0], seq_len).unsqueeze(0)
            sd_q = query[:q].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            pos = torch.arange(q, device=dev)[:, None] + (seq_len - q)
            mask = torch.arange(seq_len, device=dev)[None, :] <= pos  # [q, T]
            name = f"prefill: {q} new tokens at kv {seq_len} (buckets q {qbk}, kv {nb * bs})"
        sd_k = kk.transpose(1, 2).contiguous()  # [S, KVH, T, D]
        sd_v = vv.transpose(1, 2).contiguous()
        cases.append(
            {
                "name": name,
                "kind": kind,
                "variant": v,
                "padded": padded,
                "sdpa": (sd_q, sd_k, sd_v, mask),
                "real_rows": s if kind == "decode" else q,
            }
        )
    return cases


def in_bucket(case: dict, nb: int) -> list:
    """``case``'s padded inputs with the block table(s) padded to ``nb`` blocks
    (block 0; the kernel must not read them), for the variant of ``nb`` blocks."""
    args = list(case["padded"])
    bt = args[3]
    extra = nb - bt.shape[-1]
    args[3] = torch.cat([bt, bt.new_zeros((*bt.shape[:-1], extra))], dim=-1)
    return args


def faults_per_call(fn, calls: int) -> float:
    """Minor page faults of this process per call of ``fn`` (ru_minflt)."""
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / calls


def sdpa(q, k, v, mask):
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def time_block(fn, calls: int, device: str, clock=time.perf_counter) -> float:
    sync(device)
    t0 = clock()
    for _ in range(calls):
        fn()
    sync(device)
    return (clock() - t0) / calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.set_defaults(model="granite-3.3-8b", max_model_len=4096, max_num_batched_tokens=512)
    p.add_argument("--repeats", type=int, default=5, help="rounds")
    p.add_argument("--calls", type=int, default=3, help="calls per timed block")
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="kernel_cache directory")
    p.add_argument("--jobs", type=int, default=2, help="warmup workers if variants are missing")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument(
        "--clock",
        choices=("thread", "wall", "process"),
        default=None,
        help="thread CPU time (CPU default), wall time (CUDA default) or the "
        "process's CPU time (all threads)",
    )
    p.add_argument("--out", default=str(OUT_DIR / "kernel_speed.json"))
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    clock_name = args.clock or ("wall" if cfg.device == "cuda" else "thread")
    if clock_name == "thread" and args.threads != 1:
        raise SystemExit("--clock thread counts one thread: use it with --threads 1")
    clock = {"wall": time.perf_counter, "thread": time.thread_time, "process": time.process_time}[
        clock_name
    ]
    b = Bucketer(cfg)
    g = torch.Generator().manual_seed(0)
    cases = make_cases(cfg, b, g)
    needed = list(dict.fromkeys(c["variant"] for c in cases))
    rep = warmup(cfg, args.cache_dir, jobs=args.jobs, variants=needed, progress=True)
    if rep["failed"]:
        raise SystemExit(f"warmup failed: {rep['failed']}")
    rt = load_plan(cfg, args.cache_dir, strict=False)
    if cfg.device == "cpu":
        torch.set_num_threads(args.threads)
    modules = {
        k: build_module(k, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        for k in (PAGED_ATTENTION, BATCHED_DECODE)
    }
    largest = {}  # (kernel, query_len, num_seqs) -> the variant of the most blocks
    for c in cases:
        v = c["variant"]
        k = (v.kernel, v.query_len, v.num_seqs)
        if k not in largest or v.num_blocks > largest[k].num_blocks:
            largest[k] = v
    load_before = [round(x, 2) for x in os.getloadavg()]
    results = []
    with torch.no_grad():
        for c in cases:
            v = c["variant"]
            runner = rt._runners[v]  # the loaded AOTInductor kernel of this variant
            big = largest[(v.kernel, v.query_len, v.num_seqs)]
            big_args = in_bucket(c, big.num_blocks)
            mod = modules[v.kernel]
            fns = {
                "compiled": lambda r=runner, a=list(c["padded"]): r.run(a),
                "eager": lambda m=mod, a=c["padded"]: m(*a),
                "sdpa": lambda a=c["sdpa"]: sdpa(*a),
                "compiled_largest_bucket": lambda r=rt._runners[big], a=big_args: r.run(a),
            }
            out = runner.run(list(c["padded"]))[0][: c["real_rows"]]
            ref = sdpa(*c["sdpa"])
            ref = ref.squeeze(2) if c["kind"] == "decode" else ref[0].transpose(0, 1)
            err = float((out.float() - ref.float()).abs().max())
            big_out = fns["compiled_largest_bucket"]()[0][: c["real_rows"]]
            err_big = float((big_out.float() - ref.float()).abs().max())
            for f in fns.values():
                f()
            t = {k: [] for k in fns}
            gc.disable()
            try:
                for _ in range(args.repeats):
                    for k, f in fns.items():
                        t[k].append(time_block(f, args.calls, cfg.device, clock))
                faults = {k: faults_per_call(fns[k], max(10, args.calls)) for k in fns}
            finally:
                gc.enable()
            results.append(
                {
                    "case": c["name"],
                    "variant": str(v),
                    "largest_bucket_variant": str(big),
                    **{f"{k}_ms": summary([x * 1e3 for x in t[k]]) for k in fns},
                    "compiled_over_sdpa": summary(
                        [x / s for s, x in zip(t["sdpa"], t["compiled"], strict=True)]
                    ),
                    "compiled_speedup_vs_eager": summary(
                        [e / x for e, x in zip(t["eager"], t["compiled"], strict=True)]
                    ),
                    "compiled_speedup_vs_sdpa": summary(
                        [s / x for s, x in zip(t["sdpa"], t["compiled"], strict=True)]
                    ),
                    "page_faults_per_call": faults,
                    "max_abs_err_vs_sdpa": err,
                    "max_abs_err_vs_sdpa_largest_bucket": err_big,
                }
            )
    doc = header("kernel_speed")
    doc["machine"] = machine(cfg.device)
    doc["config"] = {
        "engine": cfg.model_dump(mode="json"),
        "repeats": args.repeats,
        "calls_per_block": args.calls,
        "clock": clock_name,
        "torch_threads": torch.get_num_threads(),
        "loadavg_before_after": [load_before, [round(x, 2) for x in os.getloadavg()]],
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
    }
    doc["results"] = results
    out = write_json(args.out, doc)
    print_table(
        f"Kernel speed, {cfg.model} ({cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, "
        f"head_dim {cfg.head_dim}, {cfg.dtype}, {cfg.device}), ms per call ({clock_name} clock, "
        f"{torch.get_num_threads()} thread(s)), median (min-max); load average "
        f"{doc['config']['loadavg_before_after']}",
        [
            "case",
            "compiled",
            "eager (padded)",
            "sdpa (unpadded)",
            "compiled / sdpa",
            "vs eager",
            "faults/call",
            "in largest bucket: ms, faults",
            "max err",
        ],
        [
            [
                r["case"],
                fmt(r["compiled_ms"], digits=2),
                fmt(r["eager_ms"], digits=2),
                fmt(r["sdpa_ms"], digits=2),
                fmt(r["compiled_over_sdpa"], digits=2),
                f"{r['compiled_speedup_vs_eager']['median']:.2f}x",
                f"{r['page_faults_per_call']['compiled']:.0f}",
                f"{r['compiled_largest_bucket_ms']['median']:.2f}, "
                f"{r['page_faults_per_call']['compiled_largest_bucket']:.0f}",
                f"{r['max_abs_err_vs_sdpa']:.1e}",
            ]
            for r in results
        ],
    )
    print("compiled / sdpa = compiled time / sdpa time per round (below 1: compiled is faster)")
    print(f"JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
