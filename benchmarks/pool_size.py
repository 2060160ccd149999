"""Decode cost against the KV pool size: the compiled CPU decode kernel on the same
call with a small and a large pool.

    python benchmarks/pool_size.py [ENGINE OPTIONS] [--seq-len T] [--pools 1000,200000]
        [--dtypes float32,bfloat16] [--repeats R] [--calls K] [--baseline-rev REV]
        [--cache-dir DIR] [--out FILE]

Default geometry: qwen2.5-7b (28 heads, 4 KV heads, head_dim 128), block_size 16
(vLLM's default), max_num_seqs 8; the call is the largest decode batch, every
sequence at ``--seq-len`` tokens (default 1024), padded to its KV bucket.

The call is the same at every pool size: the same query, block tables (random
distinct blocks among the first ``min(pools)``, so every pool holds them) and
KV data. Each pool is ``torch.empty`` and only the blocks the tables name are
written, so a pool of 200,000 blocks costs address space, not memory, unless the
kernel touches it (``page_faults_per_call`` shows whether a call does: minor
faults of the process per call, counted after the timing).

Ways, timed on the same data, interleaved in R rounds of K calls, one intra-op
thread, the thread's CPU time (as ``benchmarks/kernel_speed.py``; other people's
processes on a shared machine move it little):

* ``compiled@P``: the shipped artifact of the variant (warmed into the cache if
  missing) with a pool of P blocks;
* ``baseline@P`` (with ``--baseline-rev REV``): the decode kernel of
  ``kernel_cache/kernels/builtin.py`` at git revision REV, compiled with the same
  recipe (``benchmarks/_baseline_child.py``), same pools: before and after in
  one run;
* ``sdpa``: ``scaled_dot_product_attention`` on the same real tokens gathered
  into contiguous K/V beforehand (outside the clock), GQA by ``enable_gqa``.

Reported per dtype: ms per call (median, min-max over rounds); per-round
ratios of the largest pool's time over the smallest's (the target: at most
1.05), of each kernel over SDPA and of the shipped kernel over the baseline; the
largest difference from SDPA's output; page faults per call; the load average
before and after. JSON under ``bench-out/`` (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

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
    write_json,
)

from kernel_cache import load_plan
from kernel_cache.kernels.reference import gather_kv
from kernel_cache.plan.buckets import BATCHED_DECODE, Bucketer, KernelVariant
from kernel_cache.runtime.package import load_package
from warmup.builder.planner import warmup
from warmup.cli.main import config_from_args, engine_options


def baseline_package(cfg, variant: KernelVariant, rev: str, work: Path) -> bytes:
    """The ``.pt2`` of revision ``rev``'s decode kernel for ``variant`` (compiled
    in a fresh process by ``_baseline_child.py``; kept under ``work`` by
    revision and variant, so a re-run compiles nothing)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout.strip()
    out = work / f"baseline-{sha[:12]}-{cfg.dtype}-{variant}.pt2".replace(":", "_")
    if out.exists():
        return out.read_bytes()
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"builtin-{sha[:12]}.py"
    src.write_text(
        subprocess.run(
            ["git", "show", f"{sha}:kernel_cache/kernels/builtin.py"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        ).stdout
    )
    spec = {
        "config": cfg.model_dump(mode="json"),
        "variant": str(variant),
        "source": str(src),
        "out": str(out),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "_baseline_child.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(f"compiling the baseline of {rev} failed:\n{proc.stderr[-3000:]}")
    return out.read_bytes()


def make_call(cfg, variant: KernelVariant, seq_len: int, pools: list[int], seed: int = 0):
    """Inputs of one decode call for each pool size (same query, tables and KV
    data), and SDPA's contiguous K/V of the same tokens."""
    g = torch.Generator().manual_seed(seed)
    dt = cfg.torch_dtype()
    h, kvh, d, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    s, nb = variant.num_seqs, variant.num_blocks
    small = min(pools)
    if small < s * nb:
        raise SystemExit(f"--pools: {small} blocks cannot hold {s} x {nb} distinct blocks")
    tables = torch.randperm(small, generator=g)[: s * nb].to(torch.int32).reshape(s, nb)
    used = tables.flatten().long()
    k_used = torch.randn(len(used), bs, kvh, d, generator=g).to(dt)
    v_used = torch.randn(len(used), bs, kvh, d, generator=g).to(dt)
    query = torch.randn(s, h, d, generator=g).to(dt)
    lens = torch.full((s,), seq_len, dtype=torch.int32)
    calls = {}
    for p in pools:
        kc = torch.empty(p, bs, kvh, d, dtype=dt)  # untouched but for the blocks used
        vc = torch.empty(p, bs, kvh, d, dtype=dt)
        kc[used] = k_used
        vc[used] = v_used
        calls[p] = [query, kc, vc, tables, lens]
    kc, vc = calls[small][1], calls[small][2]
    sd_k = torch.stack([gather_kv(kc, tables[i], seq_len) for i in range(s)])
    sd_v = torch.stack([gather_kv(vc, tables[i], seq_len) for i in range(s)])
    sdpa_args = (query.unsqueeze(2), sd_k.transpose(1, 2).contiguous(), sd_v.transpose(1, 2))
    sdpa_args = (sdpa_args[0], sdpa_args[1], sdpa_args[2].contiguous())
    return calls, sdpa_args


def faults_per_call(fn, calls: int) -> float:
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / calls


def ratios(num: list[float], den: list[float]) -> dict:
    return summary([a / b for a, b in zip(num, den, strict=True)])


def run_dtype(args, dtype: str, pools: list[int]) -> dict:
    args.dtype = dtype
    cfg = config_from_args(args)
    b = Bucketer(cfg)
    s = b.num_seqs_buckets[-1]
    nb = b.blocks_bucket(-(-args.seq_len // cfg.block_size))
    v = KernelVariant(kernel=BATCHED_DECODE, query_len=1, num_blocks=nb, num_seqs=s)
    rep = warmup(cfg, args.cache_dir, jobs=args.jobs, variants=[v], progress=True)
    if rep["failed"]:
        raise SystemExit(f"warmup failed: {rep['failed']}")
    runners = {"compiled": load_plan(cfg, args.cache_dir, strict=False)._runners[v]}
    if args.baseline_rev:
        work = Path(args.cache_dir).parent / "pool-size-baselines"
        data = baseline_package(cfg, v, args.baseline_rev, work)
        runners["baseline"] = load_package(data, "cpu", "baseline")
    calls, sdpa_args = make_call(cfg, v, args.seq_len, pools)
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(*sdpa_args, enable_gqa=True)}
    ref = fns["sdpa"]().squeeze(2).float()
    errors = {}
    for name, r in runners.items():
        for p in pools:
            key = f"{name}@{p}"
            fns[key] = lambda r=r, a=calls[p]: r.run(a)
            errors[key] = float((fns[key]()[0].float() - ref).abs().max())
    times = {k: [] for k in fns}
    with torch.no_grad():
        for f in fns.values():
            f()
        gc.disable()
        try:
            for _ in range(args.repeats):
                for k, f in fns.items():
                    t0 = time.thread_time()
                    for _ in range(args.calls):
                        f()
                    times[k].append((time.thread_time() - t0) / args.calls)
            faults = {k: faults_per_call(f, max(10, args.calls)) for k, f in fns.items()}
        finally:
            gc.enable()
    small, large = min(pools), max(pools)
    res = {
        "dtype": dtype,
        "variant": str(v),
        "case": f"{s} seqs x {args.seq_len} tokens (bucket {nb * cfg.block_size})",
        "ms": {k: summary([x * 1e3 for x in t]) for k, t in times.items()},
        "page_faults_per_call": faults,
        "max_abs_err_vs_sdpa": errors,
    }
    for name in runners:
        res[f"{name}_large_over_small"] = ratios(times[f"{name}@{large}"], times[f"{name}@{small}"])
        for p in pools:
            res[f"{name}@{p}_over_sdpa"] = ratios(times[f"{name}@{p}"], times["sdpa"])
    if "baseline" in runners:
        for p in pools:
            res[f"compiled_over_baseline@{p}"] = ratios(
                times[f"compiled@{p}"], times[f"baseline@{p}"]
            )
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.set_defaults(model="qwen2.5-7b", block_size=16, max_model_len=4096, max_num_seqs=8)
    p.add_argument("--seq-len", type=int, default=1024, help="tokens of every sequence")
    p.add_argument("--pools", default="1000,200000", help="pool sizes in blocks, comma list")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma list")
    p.add_argument("--repeats", type=int, default=15, help="rounds")
    p.add_argument("--calls", type=int, default=3, help="calls per timed block")
    p.add_argument(
        "--baseline-rev", default=None, help="also time this git revision's decode kernel"
    )
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="kernel_cache directory")
    p.add_argument("--jobs", type=int, default=1, help="warmup workers if variants are missing")
    p.add_argument("--out", default=str(OUT_DIR / "pool_size.json"))
    args = p.parse_args(argv)
    pools = sorted({int(x) for x in args.pools.split(",")})
    dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    if len(pools) < 2:
        raise SystemExit("--pools: give at least two pool sizes")
    torch.set_num_threads(1)
    doc = header("pool_size")
    doc["machine"] = machine("cpu")
    load_before = [round(x, 2) for x in os.getloadavg()]
    results = [run_dtype(args, dt, pools) for dt in dtypes]
    args.dtype = None
    doc["config"] = {
        "engine": config_from_args(args).model_dump(mode="json"),
        "seq_len": args.seq_len,
        "pools": pools,
        "dtypes": dtypes,
        "repeats": args.repeats,
        "calls_per_block": args.calls,
        "clock": "thread",
        "torch_threads": torch.get_num_threads(),
        "baseline_rev": args.baseline_rev,
        "loadavg_before_after": [load_before, [round(x, 2) for x in os.getloadavg()]],
    }
    doc["results"] = results
    out = write_json(args.out, doc)
    small, large = min(pools), max(pools)
    rows = []
    for r in results:
        for name in ("compiled", "baseline"):
            if f"{name}@{small}" not in r["ms"]:
                continue
            rows.append(
                [
                    f"{r['dtype']} {name}",
                    fmt(r["ms"][f"{name}@{small}"], digits=2),
                    fmt(r["ms"][f"{name}@{large}"], digits=2),
                    fmt(r[f"{name}_large_over_small"], digits=3),
                    fmt(r["ms"]["sdpa"], digits=2),
                    fmt(r[f"{name}@{small}_over_sdpa"], digits=2),
                    f"{r['page_faults_per_call'][f'{name}@{small}']:.0f}, "
                    f"{r['page_faults_per_call'][f'{name}@{large}']:.0f}",
                    f"{r['max_abs_err_vs_sdpa'][f'{name}@{large}']:.1e}",
                ]
            )
    cfg_line = doc["config"]["engine"]
    print_table(
        f"Decode vs pool size, {cfg_line['model']} ({cfg_line['num_heads']} heads, "
        f"{cfg_line['num_kv_heads']} KV heads, head_dim {cfg_line['head_dim']}, block_size "
        f"{cfg_line['block_size']}), {results[0]['case']}, ms per call (thread clock, 1 "
        f"thread), median (min-max) of {args.repeats} rounds; load average "
        f"{doc['config']['loadavg_before_after']}",
        [
            "kernel",
            f"pool {small}",
            f"pool {large}",
            f"{large} / {small}",
            "sdpa",
            f"/ sdpa (pool {small})",
            "faults/call",
            "max err",
        ],
        rows,
    )
    for r in results:
        if f"compiled_over_baseline@{small}" in r:
            print(
                f"{r['dtype']}: compiled / baseline {fmt(r[f'compiled_over_baseline@{small}'])} "
                f"(pool {small}), {fmt(r[f'compiled_over_baseline@{large}'])} (pool {large})"
            )
    print(f"JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
