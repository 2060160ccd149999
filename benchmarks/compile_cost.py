"""Measure compile seconds per variant and fit the shard cost model.

Compiles variants of a plan one after another in this process (after one
throw-away compile that absorbs the once-per-process start-up cost), records
each variant's seconds, and fits ``seconds = base[kernel] + per_doubling *
log2(work)`` by least squares (``work = query_len * num_seqs * num_blocks *
block_size``), the form of :data:`warmup.shard.COST_MODEL`. Only the ratios
matter to the shard split; absolute seconds depend on the machine and its load.

    python benchmarks/compile_cost.py --every 2 --json     # built-in default plan

Prints the measurements, the fit and, for each kernel, the median and min-max.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_cache.buckets import Bucketer  # noqa: E402
from warmup.cli import config_from_args, engine_options  # noqa: E402


def fit(rows: list[dict]) -> dict:
    """Least squares for base[kernel] + slope * log2(work), solved in closed form
    (the normal equations of a shared slope with per-kernel intercepts)."""
    kernels = sorted({r["kernel"] for r in rows})
    means = {
        k: (
            statistics.fmean(r["log2_work"] for r in rows if r["kernel"] == k),
            statistics.fmean(r["seconds"] for r in rows if r["kernel"] == k),
        )
        for k in kernels
    }
    sxy = sum(
        (r["log2_work"] - means[r["kernel"]][0]) * (r["seconds"] - means[r["kernel"]][1])
        for r in rows
    )
    sxx = sum((r["log2_work"] - means[r["kernel"]][0]) ** 2 for r in rows)
    slope = sxy / sxx if sxx else 0.0
    base = {k: round(my - slope * mx, 2) for k, (mx, my) in means.items()}
    return {"base": base, "per_doubling": round(slope, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.add_argument("--every", type=int, default=1, help="measure every k-th variant of the plan")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from warmup.compiler import compile_variant

    cfg = config_from_args(args)
    plan = list(Bucketer(cfg).variants)
    picked = plan[:: max(1, args.every)]
    t0 = time.perf_counter()
    compile_variant(cfg, plan[0])  # absorbs the once-per-process start-up cost
    warm_s = time.perf_counter() - t0
    rows = []
    for v in picked:
        t = time.perf_counter()
        compile_variant(cfg, v)
        s = time.perf_counter() - t
        work = v.query_len * v.num_seqs * v.num_blocks * cfg.block_size
        rows.append(
            {
                "variant": str(v),
                "kernel": v.kernel,
                "log2_work": math.log2(work),
                "seconds": round(s, 2),
            }
        )
        print(f"{v}: {s:.1f} s", file=sys.stderr)
    by_kernel = {
        k: {
            "n": len(xs),
            "median_s": statistics.median(xs),
            "min_s": min(xs),
            "max_s": max(xs),
        }
        for k in sorted({r["kernel"] for r in rows})
        for xs in [[r["seconds"] for r in rows if r["kernel"] == k]]
    }
    doc = {
        "first_compile_s": round(warm_s, 1),
        "rows": rows,
        "by_kernel": by_kernel,
        "fit": fit(rows),
    }
    print(json.dumps(doc, indent=2) if args.json else json.dumps(doc["fit"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
