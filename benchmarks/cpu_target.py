"""What a portable CPU target costs in kernel speed against ``native``.

Compiles the same variants for each ``--cpu-target`` (through warmup, so with
the pinned recipe), loads each artifact as engine start does, and times the
calls interleaved, round by round, so the machine's load hits every target
alike. Reports per variant and target the median and min-max in ms, and the
ratio of each target's median to ``native``'s.

Usage::

    python benchmarks/cpu_target.py --out bench-out/cpu_target.json

Defaults: granite-3.3-8b geometry (32 heads, 8 KV heads, head_dim 128),
float32, block_size 128, one decode variant (8 sequences x 1024 tokens) and one
prefill variant (512 tokens at 2048), targets x86-64-v3 and native.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="granite-3.3-8b")
    p.add_argument("--targets", default="x86-64-v3,native")
    p.add_argument(
        "--variants",
        default="batched_decode:1:8:8,paged_attention:512:16:1",
        help="kernel:query_len:kv_blocks:num_seqs, comma-separated",
    )
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1, help="torch threads while timing")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from kernel_cache.config.engine import make_config
    from kernel_cache.plan.buckets import KernelVariant
    from kernel_cache.plan.keys import build_key
    from kernel_cache.runtime.inputs import make_inputs
    from kernel_cache.runtime.package import load_package
    from kernel_cache.store.disk_tier import DiskTier
    from warmup.builder.planner import warmup

    targets = args.targets.split(",")
    wanted = []
    for text in args.variants.split(","):
        kernel, q, kv, n = text.split(":")
        wanted.append(
            KernelVariant(kernel=kernel, query_len=int(q), num_blocks=int(kv), num_seqs=int(n))
        )
    runners, compile_s = {}, {}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kc-cpu-target-") as tmp:
        for t in targets:
            cfg = make_config(
                args.model,
                max_model_len=8192,
                block_size=128,
                max_num_seqs=8,
                max_num_batched_tokens=1024,
                cpu_target=t,
            )
            cache = Path(tmp) / t
            r = warmup(cfg, cache, jobs=1, progress=False, variants=wanted)
            if r["failed"]:
                sys.exit(f"cpu_target.py: {t}: {r['failed']}")
            compile_s[t] = {x["variant"]: round(x["seconds"], 1) for x in r["results"]}
            tier = DiskTier(cache)
            for v in wanted:
                e = tier.get(build_key(cfg, v).hexdigest)
                runners[(t, str(v))] = (load_package(e.data, "cpu", e.where), make_inputs(cfg, v))
            tier.close()
        torch.set_num_threads(args.threads)
        times = {k: [] for k in runners}
        for _ in range(args.rounds):
            for k, (runner, inputs) in runners.items():
                t0 = time.perf_counter()
                runner.run(list(inputs))
                times[k].append((time.perf_counter() - t0) * 1e3)
    rows = []
    for v in wanted:
        base = statistics.median(times[("native", str(v))]) if "native" in targets else None
        for t in targets:
            ms = times[(t, str(v))]
            med = statistics.median(ms)
            rows.append(
                {
                    "variant": str(v),
                    "target": t,
                    "median_ms": round(med, 3),
                    "min_ms": round(min(ms), 3),
                    "max_ms": round(max(ms), 3),
                    "vs_native": round(med / base, 3) if base else None,
                    "compile_s": compile_s[t][str(v)],
                }
            )
    doc = {
        "model": args.model,
        "threads": args.threads,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }
    print(json.dumps(doc, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
