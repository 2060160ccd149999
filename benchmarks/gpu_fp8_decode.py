"""Decode through dispatch with a bf16 KV cache and with an FP8 one.

    python benchmarks/gpu_fp8_decode.py [--out DIR] [--cache-dir DIR] [--reps N]

granite-3.3-8b geometry, bf16 queries, block_size 16, 32 sequences x 8192 tokens
(every sequence at the bucket's edge), block tables a random permutation of a
pool of exactly those blocks. Two plans, warmed here with ``kernel-cache
warmup`` and loaded with ``load_plan``, identical but for ``--kv-cache-dtype``:
``auto`` (the pool in bf16) and ``fp8_e4m3`` (the pool in ``float8_e4m3fn``,
the same values quantized with per-tensor scales ``amax / 448``). Both are timed
the same way, by ``gpu_common.time_cuda`` with L2 flushed before each call:

* ``dispatch``: ``rt.decode(...)`` with host lengths (the scales, for fp8, as
  ``[1]`` float32 device tensors);
* ``graph``: the same call with ``device_seq_lens`` captured in a CUDA graph,
  replayed.

Reported per cache: median ms (min, max), the bytes the step must read (K and V
of every token, ``gpu_common.kv_bytes`` with 2 or 1 bytes per element) over the
time, as a fraction of the device-to-device copy bandwidth
(``gpu_common.copy_bandwidth``); the speedup of fp8 over bf16 per mode; and the
fp8 output's error against the float32 reference on the dequantized pool (two
sequences). Also the Triton decode kernel launched directly (a CUDA graph of
``launch_decode``, the code the artifacts hold) for each pool at ``block_n`` 64
and 128 tokens per step, with the module's default warps and stages for the
pool (``gpu_fp8_variants.py`` sweeps all three for the fp8 pool). Writes
``gpu_fp8_decode.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
from gpu_common import (
    GRANITE,
    ROOT,
    copy_bandwidth,
    device_info,
    flush_l2,
    graphed,
    host_us,
    kv_bytes,
    time_cuda,
    write_json,
)

from kernel_cache import load_plan, make_config
from kernel_cache.kernels.reference import dequantize, fp8_quantize, reference_decode

H, KVH, D = GRANITE["num_heads"], GRANITE["num_kv_heads"], GRANITE["head_dim"]
BS, S, KV = 16, 32, 8192
PLAN = [
    "--model", "granite-3.3-8b", "--device", "cuda", "--max-model-len", str(KV),
    "--block-size", str(BS), "--max-num-seqs", str(S), "--max-num-batched-tokens", "1",
    "--kv-buckets", str(KV), "--query-buckets", "1", "--num-seqs-buckets", str(S),
]  # fmt: skip
LIMITS = dict(
    max_model_len=KV,
    block_size=BS,
    max_num_seqs=S,
    max_num_batched_tokens=1,
    kv_buckets=(KV,),
    query_buckets=(1,),
    num_seqs_buckets=(S,),
)


def warm(cache_dir: str, kv_cache_dtypes) -> float:
    """Warm the plans (a prefill variant and the decode variant each), one warmup
    process per plan, all at once; wall seconds."""
    t = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "warmup.cli.main",
                "warmup",
                *PLAN,
                "--kv-cache-dtype",
                kv,
                "--cache-dir",
                cache_dir,
                "--jobs",
                "2",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        for kv in kv_cache_dtypes
    ]
    for kv, proc in zip(kv_cache_dtypes, procs, strict=True):
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"warmup of {kv} failed:\n{out[-2000:]}\n{err[-3000:]}")
    return time.perf_counter() - t


def kernel_block_n(pools, q, bt, lens, ceiling: float, reps: int) -> list[dict]:
    """The decode kernel launched directly, graph-replayed, per pool and block_n."""
    from kernel_cache.kernels.triton_decode import launch_decode

    rows = []
    for name, (kc, vc, scales) in pools.items():
        sc = (scales["k_scale"], scales["v_scale"]) if scales else (None, None)
        nbytes = kv_bytes([KV] * S, itemsize=kc.element_size())
        for block_n in (64, 128):

            def call(kc=kc, vc=vc, sc=sc, block_n=block_n):
                return launch_decode(
                    q, kc, vc, bt, lens, D**-0.5, None, *sc, block_n=block_n, wrap=_identity
                )

            t = time_cuda(call, reps=reps, graph=True)
            tbs = nbytes / (t["median_ms"] * 1e-3) / 1e12
            rows.append({"pool": name, "block_n": block_n, **t, "of_copy_bw": tbs / ceiling})
            print(
                f"kernel {name:9s} block_n {block_n:3d}: {t['median_ms']:.3f} ms "
                f"({tbs / ceiling:.0%} of copy bw)"
            )
    return rows


def launch_sweep(pools, q, bt, lens, ceiling: float, reps: int) -> list[dict]:
    """The decode kernel launched directly, graph-replayed, for the fp8 pool
    over ``block_n`` 64-256, 4 and 8 warps, 2-4 stages and the default split
    count and twice it; the bf16 pool at the defaults for reference."""
    from kernel_cache.kernels.tiles import cuda_default_splits
    from kernel_cache.kernels.triton_decode import launch_decode

    nb = bt.shape[1]
    base = cuda_default_splits(S, KVH, nb, BS)
    grid = [("auto", 64, 4, 3, base)]
    grid += [
        ("fp8_e4m3", bn, w, st, sp)
        for bn in (64, 128, 256)
        for w in (4, 8)
        for st in (2, 3, 4)
        for sp in (base, min(2 * base, nb))
    ]
    rows = []
    for name, bn, w, st, sp in grid:
        kc, vc, scales = pools[name]
        sc = (scales["k_scale"], scales["v_scale"]) if scales else (None, None)
        nbytes = kv_bytes([KV] * S, itemsize=kc.element_size())

        def call(kc=kc, vc=vc, sc=sc, bn=bn, w=w, st=st, sp=sp):
            return launch_decode(
                q, kc, vc, bt, lens, D**-0.5, sp, *sc, block_n=bn,
                num_warps=w, num_stages=st, wrap=_identity,
            )  # fmt: skip

        try:
            t = time_cuda(call, reps=reps, graph=True)
        except Exception as e:  # a configuration Triton cannot build (shared memory)
            rows.append({"pool": name, "block_n": bn, "num_warps": w, "num_stages": st,
                         "num_kv_splits": sp, "error": str(e)[:200]})  # fmt: skip
            continue
        tbs = nbytes / (t["median_ms"] * 1e-3) / 1e12
        rows.append({"pool": name, "block_n": bn, "num_warps": w, "num_stages": st,
                     "num_kv_splits": sp, **t, "of_copy_bw": tbs / ceiling})  # fmt: skip
        print(f"sweep {name:9s} block_n {bn:3d} warps {w} stages {st} splits {sp:3d}: "
              f"{t['median_ms']:.3f} ms ({tbs / ceiling:.0%} of copy bw)", flush=True)  # fmt: skip
    return rows


def overhead(pools, q, bt, host, dev_lens, cache_dir: str, reps: int) -> dict:
    """Where dispatch's time over the graph's goes, per pool: the call timed with
    host lengths read in place (``map_pinned_lengths = True``), copied to the
    device per call (the default), and with ``device_seq_lens``
    outside a graph; each also ``queued`` (``time_cuda(queued=True)``: the GPU's
    time alone); host µs per call (``gpu_common.host_us``: ``perf_counter`` over
    30 back-to-back calls, fewer than the ring's half, 15 rounds, median); and
    the GPU's work per call from ``torch.profiler`` (kernel and copy names, µs)."""
    from torch.profiler import ProfilerActivity, profile

    res = {}
    for name, (kc, vc, sc) in pools.items():
        cfg = make_config("granite-3.3-8b", device="cuda", kv_cache_dtype=name, **LIMITS)
        rt = load_plan(cfg, cache_dir)
        rt.map_pinned_lengths = True  # where mapped_pinned_reads passes
        rc = load_plan(cfg, cache_dir)
        rc.map_pinned_lengths = False  # the default
        calls = {
            "mapped": lambda rt=rt, kc=kc, vc=vc, sc=sc: rt.decode(q, kc, vc, bt, host, **sc),
            "copied": lambda rc=rc, kc=kc, vc=vc, sc=sc: rc.decode(q, kc, vc, bt, host, **sc),
            "device_lens": lambda rt=rt, kc=kc, vc=vc, sc=sc: rt.decode(
                q, kc, vc, bt, host, device_seq_lens=dev_lens, **sc
            ),
        }
        row = {}
        for mode, fn in calls.items():
            row[mode] = time_cuda(fn, reps=reps)
            row[mode + "_queued"] = time_cuda(fn, reps=reps, queued=True)
        g = graphed(calls["device_lens"])
        row["graph"] = time_cuda(g, reps=reps)
        row["graph_queued"] = time_cuda(g, reps=reps, queued=True)
        for mode, fn in calls.items():
            row[f"host_us_{mode}"] = host_us(fn, 30, 15, warmup=0, gc_off=False)
        # Pieces of the call's host time, same method: the runner alone (the
        # artifact's run, device lengths), the scales' and the pool's checks.
        slot = next(iter(rt._slots.values()))
        args = [q, kc, vc, bt, dev_lens, *rt._scales(sc.get("k_scale"), sc.get("v_scale"))]
        pieces = {
            "runner.run": (lambda slot=slot, args=args: slot.runner.run(args), 30),
            "_scales": (lambda rt=rt, a=args[5:]: rt._scales(*(a or (None, None))), 1000),
            "_check": (lambda rt=rt, kc=kc, vc=vc: rt._check(q, kc, vc), 1000),
        }  # fmt: skip
        for piece, (fn, n) in pieces.items():
            row[f"host_us_piece_{piece}"] = host_us(fn, n, 15, warmup=0, gc_off=False)
        prof_rows = {}
        for mode, fn in (*calls.items(), ("graph", g)):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(3):
                    flush_l2()
                    fn()
                torch.cuda.synchronize()
            gpu = [
                (e.name, round(e.device_time, 2))
                for e in p.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and "fill" not in e.name
            ]
            prof_rows[mode] = gpu
        row["gpu_events_3_calls"] = prof_rows
        res[name] = row
        us = {m: round(v["median_ms"] * 1e3, 1) for m, v in row.items() if "median_ms" in v}
        print(name, "GPU us", us, flush=True)
        host_table = {
            m[8:]: round(v["median"], 1) for m, v in row.items() if m.startswith("host_us_")
        }
        print(name, "host us", host_table, flush=True)
        for mode, ev in prof_rows.items():
            print(" ", mode, ev[:8], flush=True)
    return res


def _identity(f):
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--cache-dir", default=os.environ.get("CACHE", "/tmp/kc-gpu-fp8"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--sweep", action="store_true", help="only the kernel's launch sweep (no warmup)"
    )
    ap.add_argument(
        "--overhead",
        action="store_true",
        help="also where dispatch's time over the graph's goes (lengths in place, copied, "
        "on the device; queued; host time; a profiler trace per mode)",
    )
    args = ap.parse_args(argv)
    info = device_info()
    bw = copy_bandwidth()
    ceiling = bw["tb_per_s"]
    print(f"{info['device']}: copy bandwidth {ceiling:.2f} TB/s (read + write)")
    doc = {"env": info, "copy_bandwidth": bw, "plan": " ".join(PLAN)}
    if not args.sweep:
        doc["warmup_wall_s"] = warm(args.cache_dir, ("auto", "fp8_e4m3"))

    g = torch.Generator(device="cuda").manual_seed(0)
    pool = S * (KV // BS)
    k = torch.randn(pool, BS, KVH, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(pool, BS, KVH, D, generator=g, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(pool, generator=g, device="cuda").to(torch.int32).reshape(S, -1)
    q = torch.randn(S, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
    host = [KV] * S
    dev_lens = torch.full((S,), KV, dtype=torch.int32, device="cuda")
    ks = (k.float().abs().amax() / 448).reshape(1)  # per-tensor scales, on the device
    vs = (v.float().abs().amax() / 448).reshape(1)
    pools = {
        "auto": (k, v, {}),
        "fp8_e4m3": (fp8_quantize(k, ks), fp8_quantize(v, vs), {"k_scale": ks, "v_scale": vs}),
    }
    if args.sweep:
        doc["launch_sweep"] = launch_sweep(pools, q, bt, dev_lens, ceiling, args.reps)
        write_json(doc, args.out, "gpu_fp8_sweep.json")
        return 0
    rows = {}
    for name, (kc, vc, scales) in pools.items():
        rt = load_plan(make_config("granite-3.3-8b", device="cuda", kv_cache_dtype=name, **LIMITS),
                       args.cache_dir)  # fmt: skip

        def call(rt=rt, kc=kc, vc=vc, sc=scales):
            return rt.decode(q, kc, vc, bt, host, **sc)

        def gcall(rt=rt, kc=kc, vc=vc, sc=scales):
            return rt.decode(q, kc, vc, bt, host, device_seq_lens=dev_lens, **sc)

        nbytes = kv_bytes(host, itemsize=kc.element_size())
        row = {"pool_dtype": str(kc.dtype), "bytes_read": nbytes}
        row["dispatch"] = time_cuda(call, reps=args.reps)
        row["graph"] = time_cuda(gcall, reps=args.reps, graph=True)
        for mode in ("dispatch", "graph"):
            tbs = nbytes / (row[mode]["median_ms"] * 1e-3) / 1e12
            row[f"{mode}_tb_per_s"] = tbs
            row[f"{mode}_of_copy_bw"] = tbs / ceiling
        if scales:
            out = call()
            ref = reference_decode(q[:2], dequantize(kc, ks), dequantize(vc, vs), bt[:2], host[:2])
            row["rel_err_vs_dequantized_reference"] = float(
                (out[:2].float() - ref).norm() / ref.norm()
            )
        row["compiles"] = rt.stats()["compiles"]
        rows[name] = row
        print(
            f"{name:9s} {row['pool_dtype']:20s} dispatch {row['dispatch']['median_ms']:.3f} ms "
            f"({row['dispatch_of_copy_bw']:.0%} of copy bw) | graph "
            f"{row['graph']['median_ms']:.3f} ms ({row['graph_of_copy_bw']:.0%})"
        )
    doc["rows"] = rows
    if args.overhead:
        doc["overhead"] = overhead(pools, q, bt, host, dev_lens, args.cache_dir, args.reps)
    doc["kernel_block_n"] = kernel_block_n(pools, q, bt, dev_lens, ceiling, args.reps)
    doc["speedup"] = {
        m: rows["auto"][m]["median_ms"] / rows["fp8_e4m3"][m]["median_ms"]
        for m in ("dispatch", "graph")
    }
    print(
        f"fp8 over bf16: dispatch {doc['speedup']['dispatch']:.2f}x, graph "
        f"{doc['speedup']['graph']:.2f}x; fp8 rel err "
        f"{rows['fp8_e4m3']['rel_err_vs_dequantized_reference']:.2e}"
    )
    write_json(doc, args.out, "gpu_fp8_decode.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
