"""GPU kernel speed: batched decode at granite-3.3-8b geometry against memory bandwidth.

    python benchmarks/gpu_kernel.py [--sweep] [--inductor] [--out DIR]

Measures, on the current CUDA device:

* the device-to-device copy bandwidth (bytes read + written per second), the
  ceiling used below;
* ``batched_decode`` at 32 sequences x 8192 tokens (bf16; block_size 16 and
  128): the Triton paged-decode kernel (:mod:`kernel_cache.kernels.triton_decode`, the
  code AOTInductor packages for CUDA), the eager plain-PyTorch kernel (the test
  oracle) and, with ``--inductor``, that plain kernel through Inductor
  (``torch.compile``: the code the CUDA artifacts held before the Triton kernel);
  each as median / min-max milliseconds and as KV bytes read per second (the
  fewest bytes the step must read: K and V of every token) over the copy
  bandwidth;
* with ``--sweep``: the Triton kernel's launch parameters (tokens per step,
  warps, pipeline stages, split count) at several batch sizes, to choose the
  defaults in ``kernel_cache/kernels/triton_decode.py``.

Writes ``gpu_kernel.json`` to ``--out``; prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import sys

import torch

if importlib.util.find_spec("triton") is None:  # before the imports that need it
    sys.exit(
        f"{sys.argv[0]}: needs a CUDA GPU and Triton (this torch has no Triton); "
        "run it on the GPU machine: bash benchmarks/gpu_run.sh bench"
    )

from gpu_common import (
    GRANITE,
    copy_bandwidth,
    decode_inputs,
    device_info,
    kv_bytes,
    time_cuda,
    write_json,
)

from kernel_cache.kernels.plain import BatchedDecode
from kernel_cache.kernels.reference import reference_decode
from kernel_cache.kernels.triton_decode import (
    BLOCK_N,
    NUM_STAGES,
    NUM_WARPS,
    launch_decode,
    split_plan,
)

SCALE = 1.0 / math.sqrt(GRANITE["head_dim"])


def _identity(f):
    return f


def triton_call(args, **kw):
    return lambda: launch_decode(*args, SCALE, wrap=_identity, **kw)


def check(args, out) -> float:
    """||out - ref|| / ||ref|| on the first two sequences (reference: float32 SDPA)."""
    q, kc, vc, bt, lens = args
    ref = reference_decode(q[:2], kc, vc, bt[:2], lens[:2].tolist())
    return float((out[:2].float() - ref).norm() / ref.norm())


def row(name, args, t, ceiling) -> dict:
    nbytes = kv_bytes(args[4].tolist())
    bw = nbytes / (t["median_ms"] * 1e-3) / 1e12
    return {"name": name, **t, "kv_bytes": nbytes, "kv_tb_per_s": bw, "of_copy_bw": bw / ceiling}


def headline(ceiling: float, inductor: bool) -> list[dict]:
    rows = []
    for bs in (16, 128):
        nb = 8192 // bs
        args = decode_inputs(32, nb, bs)
        out = launch_decode(*args, SCALE, wrap=_identity)
        err = check(args, out)
        t = time_cuda(triton_call(args), reps=30, graph=True)
        splits = split_plan(32, GRANITE["num_kv_heads"], nb, bs)
        rows.append({**row(f"triton bs={bs}", args, t, ceiling), "rel_err": err, "splits": splits})
        mod = BatchedDecode(**GRANITE)
        with torch.no_grad():
            t = time_cuda(lambda m=mod, a=args: m(*a), reps=5)
        rows.append(row(f"eager torch bs={bs}", args, t, ceiling))
        if inductor and bs == 16:
            compiled = torch.compile(mod, dynamic=False)
            with torch.no_grad():
                compiled(*args)
                t = time_cuda(lambda c=compiled, a=args: c(*a), reps=10, graph=True)
            rows.append(row(f"inductor torch bs={bs}", args, t, ceiling))
        del args
        torch.cuda.empty_cache()
    return rows


def _sweep_configs(num_seqs: int, bs: int):
    """(block_n, num_warps, num_stages, splits) to try for one shape."""
    default = (BLOCK_N, NUM_WARPS, NUM_STAGES)
    if (num_seqs, bs) == (32, 16):
        grid = [(*c, None) for c in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
        return grid + [(*default, s) for s in (1, 4, 16, 64)]
    if num_seqs == 1:
        return [(*default, s) for s in (None, 8, 16, 32, 64, 128)] + [(128, 8, 3, None)]
    others = [default, (64, 4, 2), (64, 8, 4), (128, 4, 2), (128, 8, 3), (128, 8, 4)]
    return [(*c, None) for c in dict.fromkeys(others)]


def sweep(ceiling: float) -> list[dict]:
    rows = []
    for num_seqs, bs in [(32, 16), (32, 128), (1, 16), (8, 16), (64, 16)]:
        nb = 8192 // bs
        args = decode_inputs(num_seqs, nb, bs)
        for block_n, warps, stages, splits in _sweep_configs(num_seqs, bs):
            kw = dict(block_n=block_n, num_warps=warps, num_stages=stages)
            base = {"num_seqs": num_seqs, "block_size": bs, **kw, "splits": splits}
            try:
                out = launch_decode(*args, SCALE, splits, wrap=_identity, **kw)
                err = check(args, out)
                t = time_cuda(triton_call(args, num_kv_splits=splits, **kw), reps=15, graph=True)
            except Exception as e:  # a config Triton cannot build (shared memory)
                rows.append({**base, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            plan = split_plan(num_seqs, GRANITE["num_kv_heads"], nb, bs, splits, block_n)
            rows.append({**base, "plan": plan, "rel_err": err, **row("sweep", args, t, ceiling)})
        del args
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--inductor", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    info = device_info()
    bw = copy_bandwidth()
    doc = {"env": info, "copy_bandwidth": bw}
    doc["headline"] = headline(bw["tb_per_s"], args.inductor)
    if args.sweep:
        doc["sweep"] = sweep(bw["tb_per_s"])
    write_json(doc, args.out, "gpu_kernel.json")
    print(f"{info['device']} torch {info['torch']} triton {info['triton']} cuda {info['cuda']}")
    print(f"copy bandwidth: {bw['tb_per_s']:.2f} TB/s (read + write, {bw['gib']} GiB)")
    print("batched_decode, granite-3.3-8b, 32 seqs x 8192 tokens, bf16:")
    for r in doc["headline"]:
        print(
            f"  {r['name']:24s} {r['median_ms']:8.3f} ms (min {r['min_ms']:.3f}, max "
            f"{r['max_ms']:.3f})  KV {r['kv_tb_per_s']:.2f} TB/s = {r['of_copy_bw']:.0%} of copy"
            + (f"  rel_err {r['rel_err']:.1e}" if "rel_err" in r else "")
        )
    if args.sweep:
        ok = [r for r in doc["sweep"] if "error" not in r]
        for key in sorted({(r["num_seqs"], r["block_size"]) for r in ok}):
            best = sorted(
                (r for r in ok if (r["num_seqs"], r["block_size"]) == key),
                key=lambda r: r["median_ms"],
            )[:4]
            for r in best:
                print(
                    f"  sweep S={key[0]:3d} bs={key[1]:3d} block_n={r['block_n']:3d} "
                    f"warps={r['num_warps']} stages={r['num_stages']} splits={r['splits']} "
                    f"plan={r['plan']} {r['median_ms']:.3f} ms {r['of_copy_bw']:.0%}"
                )
        bad = [r for r in doc["sweep"] if "error" in r]
        if bad:
            print(f"  {len(bad)} sweep configs failed, e.g. {bad[0]['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
