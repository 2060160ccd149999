"""Decode latency per KV bucket, and the trace-weighted decode time of two ladders.

    python benchmarks/gpu_decode_buckets.py [--trace CSV] [--requests N] [--sample K] [--out DIR]

granite-3.3-8b, bf16, block_size 16, max_model_len 8192 (the Triton paged-decode
kernel that the CUDA artifacts hold, launched directly: the same code):

1. Per KV bucket of the ``4/3`` ladder (kv_dense_cap 4096) and at num_seqs 1, 8
   and 64: the latency with every sequence exactly at the bucket's edge ("full")
   and with every sequence one token into the bucket ("min": the previous
   bucket's edge + 1 token, the most padding the bucket ever carries). Their
   difference is what the padded blocks cost this kernel, which stops reading at
   ``seq_len``.
2. Trace-weighted decode time of the ``pow2`` and ``4/3`` ladders: the Azure
   conversation trace's first N requests (``warmup.request_lengths.schedule``: waves
   of max_num_seqs 64, each decode step one call), a uniform random sample of K
   decode calls, each timed as dispatch would run it (rows padded to the
   num_seqs bucket with ``seq_len`` 0, the block table padded to the KV bucket)
   under each ladder; the total is the mean sampled time x the number of decode
   calls. The same sample is also timed with every row at its bucket's edge,
   the cost model of a kernel that reads its whole bucket (the plain-PyTorch one).

Trace data: Microsoft Azure Public Dataset, AzureLLMInferenceTrace_conv (2023),
CC BY 4.0 ("Splitwise", ISCA 2024). Writes ``gpu_decode_buckets.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import statistics
import sys

import torch

if importlib.util.find_spec("triton") is None:  # before the imports that need it
    sys.exit(
        f"{sys.argv[0]}: needs a CUDA GPU and Triton (this torch has no Triton); "
        "run it on the GPU machine: bash benchmarks/gpu_run.sh bench"
    )

from gpu_common import GRANITE, ROOT, device_info, time_cuda, write_json

from kernel_cache import make_config
from kernel_cache.kernels.triton_decode import launch_decode
from kernel_cache.plan.buckets import BATCHED_DECODE, Bucketer
from warmup.request_lengths import kv_blocks_read, read_trace, schedule

DEFAULT_TRACE = ROOT.parent / "shared/data/azure-llm-trace-2023/conv.csv"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
MAX_NUM_SEQS = 64
SCALE = 1.0 / math.sqrt(GRANITE["head_dim"])


def _identity(f):
    return f


class Pool:
    """One KV pool for MAX_NUM_SEQS sequences of MAX_MODEL_LEN tokens (2 GiB in bf16),
    each slot's block table a random permutation of the pool."""

    def __init__(self):
        g = torch.Generator(device="cuda").manual_seed(0)
        h, kvh, d = GRANITE["num_heads"], GRANITE["num_kv_heads"], GRANITE["head_dim"]
        self.max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
        n = MAX_NUM_SEQS * self.max_blocks
        shape = (n, BLOCK_SIZE, kvh, d)
        self.kc = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
        self.vc = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
        perm = torch.randperm(n, generator=g, device="cuda").to(torch.int32)
        self.tables = perm.reshape(MAX_NUM_SEQS, self.max_blocks)
        self.query = torch.randn(MAX_NUM_SEQS, h, d, generator=g, device="cuda").bfloat16()

    def call(self, num_seqs_bucket: int, num_blocks: int, seq_lens: list[int]):
        """The kernel call dispatch makes: rows padded with seq_len 0."""
        lens = torch.zeros(num_seqs_bucket, dtype=torch.int32)
        lens[: len(seq_lens)] = torch.tensor(seq_lens, dtype=torch.int32)
        lens = lens.cuda()
        q = self.query[:num_seqs_bucket].contiguous()
        bt = self.tables[:num_seqs_bucket, :num_blocks].contiguous()
        return lambda: launch_decode(q, self.kc, self.vc, bt, lens, SCALE, wrap=_identity)


def per_bucket(pool: Pool) -> list[dict]:
    cfg = make_config(
        "granite-3.3-8b",
        device="cuda",
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
    )
    ladder = Bucketer(cfg).num_blocks_buckets
    rows, prev = [], 0
    for nb in ladder:
        for s in (1, 8, 64):
            full = [nb * BLOCK_SIZE] * s
            least = [prev * BLOCK_SIZE + 1] * s
            t_full = time_cuda(pool.call(s, nb, full), reps=15, graph=True)
            t_min = time_cuda(pool.call(s, nb, least), reps=15, graph=True)
            rows.append(
                {
                    "num_blocks": nb,
                    "kv_tokens": nb * BLOCK_SIZE,
                    "num_seqs": s,
                    "full_ms": t_full["median_ms"],
                    "full_min_max": [t_full["min_ms"], t_full["max_ms"]],
                    "min_tokens": least[0],
                    "min_ms": t_min["median_ms"],
                    "min_min_max": [t_min["min_ms"], t_min["max_ms"]],
                    "padded_blocks": nb - math.ceil(least[0] / BLOCK_SIZE),
                }
            )
        prev = nb
    return rows


def trace_weighted(pool: Pool, trace, requests: int, sample: int) -> dict:
    reqs = read_trace(trace, limit=requests)
    out = {"trace": str(trace), "requests": len(reqs), "sample": sample, "ladders": {}}
    base = None
    for ladder in ("4/3", "pow2"):
        cfg = make_config(
            "granite-3.3-8b",
            device="cuda",
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            max_num_seqs=MAX_NUM_SEQS,
            kv_ladder=ladder,
        )
        b = Bucketer(cfg)
        calls = [c for c in schedule(reqs, b) if c.kernel == BATCHED_DECODE]
        if base is None:
            base = calls
            rng = random.Random(0)
            picks = sorted(rng.sample(range(len(calls)), min(sample, len(calls))))
        assert len(calls) == len(base)  # the schedule does not depend on the ladder
        read = real = 0
        for c in calls:
            r, n = kv_blocks_read(b, c)
            read, real = read + r, real + n
        real_ms, whole_ms = [], []
        for i in picks:
            c = calls[i]
            nb = b.blocks_bucket(max(1, -(-max(c.seq_lens) // BLOCK_SIZE)))
            sb = b.num_seqs_bucket(len(c.seq_lens))
            real_ms.append(
                time_cuda(pool.call(sb, nb, list(c.seq_lens)), reps=5, graph=True)["median_ms"]
            )
            edge = [nb * BLOCK_SIZE] * sb
            whole_ms.append(time_cuda(pool.call(sb, nb, edge), reps=5, graph=True)["median_ms"])
        out["ladders"][ladder] = {
            "kv_buckets": len(b.num_blocks_buckets),
            "decode_variants": sum(v.kernel == BATCHED_DECODE for v in b.variants),
            "decode_calls": len(calls),
            "padded_read_fraction": round(1 - real / read, 4),
            "mean_call_ms": statistics.mean(real_ms),
            "total_s": statistics.mean(real_ms) * len(calls) / 1e3,
            "whole_bucket_mean_call_ms": statistics.mean(whole_ms),
            "whole_bucket_total_s": statistics.mean(whole_ms) * len(calls) / 1e3,
        }
    a, p = out["ladders"]["4/3"], out["ladders"]["pow2"]
    out["pow2_over_4_3"] = p["total_s"] / a["total_s"]
    out["whole_bucket_pow2_over_4_3"] = p["whole_bucket_total_s"] / a["whole_bucket_total_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--sample", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    pool = Pool()
    doc = {"env": device_info(), "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN}
    doc["per_bucket"] = per_bucket(pool)
    doc["trace_weighted"] = trace_weighted(pool, args.trace, args.requests, args.sample)
    write_json(doc, args.out, "gpu_decode_buckets.json")
    print("decode latency per KV bucket (4/3 ladder, bs 16), ms median: full | min (1 token in)")
    print(f"{'kv tokens':>9s} " + " ".join(f"{'S=' + str(s):>17s}" for s in (1, 8, 64)))
    by = {}
    for r in doc["per_bucket"]:
        by.setdefault(r["kv_tokens"], {})[r["num_seqs"]] = r
    for kv, rs in by.items():
        cells = " ".join(f"{rs[s]['full_ms']:7.3f} | {rs[s]['min_ms']:7.3f}" for s in (1, 8, 64))
        print(f"{kv:9d} {cells}")
    tw = doc["trace_weighted"]
    print(f"trace-weighted decode ({tw['requests']} requests, {tw['sample']} sampled calls):")
    for name, r in tw["ladders"].items():
        print(
            f"  {name:5s} {r['decode_variants']:3d} decode variants, {r['decode_calls']} calls, "
            f"padded reads {r['padded_read_fraction']:.1%}: {r['total_s']:.3f} s "
            f"(whole-bucket kernel {r['whole_bucket_total_s']:.3f} s)"
        )
    print(
        f"  pow2 / 4/3: {tw['pow2_over_4_3']:.3f} (whole-bucket kernel "
        f"{tw['whole_bucket_pow2_over_4_3']:.3f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
