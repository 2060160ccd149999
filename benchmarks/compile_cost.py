"""Measure compile cost per variant and fit the shard cost model.

Compiles variants of a plan one after another in this process (after one
throw-away compile that absorbs the once-per-process start-up cost) and
records each variant's wall seconds and CPU seconds: this process plus the C++
compiler processes it waited for (``resource.getrusage``), with Inductor's
compile threads set to 1 so all the work is counted and Inductor's caches off
so nothing is a cache hit. It fits ``cpu_s = base[kernel] + per_doubling *
log2(work)`` by least squares, ``work = query_len * num_seqs * num_blocks *
block_size``: the form of :data:`warmup.builder.shard.COST_MODEL`. CPU seconds are
fitted because wall seconds on a shared machine mostly measure the other users.
Only the ratios matter to the shard split.

    python benchmarks/compile_cost.py --every 2 --json     # built-in default plan

Prints each measurement, per-kernel median and min-max, and the fit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_cache.plan.buckets import Bucketer  # noqa: E402
from warmup.cli.main import config_from_args, engine_options  # noqa: E402


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def fit(rows: list[dict]) -> dict:
    """Least squares for ``base[kernel] + slope * log2(work)`` (per-kernel
    intercepts, one shared slope), solved in closed form."""
    kernels = sorted({r["kernel"] for r in rows})
    means = {}
    for k in kernels:
        mine = [r for r in rows if r["kernel"] == k]
        means[k] = (
            statistics.fmean(r["log2_work"] for r in mine),
            statistics.fmean(r["cpu_s"] for r in mine),
        )
    sxy = sxx = 0.0
    for r in rows:
        mx, my = means[r["kernel"]]
        sxy += (r["log2_work"] - mx) * (r["cpu_s"] - my)
        sxx += (r["log2_work"] - mx) ** 2
    slope = sxy / sxx if sxx else 0.0
    return {
        "base": {k: round(my - slope * mx, 2) for k, (mx, my) in means.items()},
        "per_doubling": round(slope, 3),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.add_argument("--every", type=int, default=1, help="measure every k-th variant of the plan")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # Inductor's own caches (shared under /tmp/torchinductor_$USER) would turn a
    # repeat into a cache hit; a fresh builder compiles from scratch.
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    from warmup.builder.compiler import compile_variant

    cfg = config_from_args(args)
    plan = list(Bucketer(cfg).variants)
    picked = plan[:: max(1, args.every)]
    t0 = time.perf_counter()
    # The precompiled headers are built once, in a folder kept for the run, as a
    # warmup worker keeps them (without one each compile builds its own).
    with tempfile.TemporaryDirectory(prefix="kc-compile-cost-pch-") as pch:
        compile_variant(cfg, plan[-1], pch_dir=pch)  # absorbs the once-per-process start-up cost
        first_s = time.perf_counter() - t0
        rows = []
        for v in picked:
            c, t = cpu_seconds(), time.perf_counter()
            compile_variant(cfg, v, pch_dir=pch)
            cpu, wall = cpu_seconds() - c, time.perf_counter() - t
            work = v.query_len * v.num_seqs * v.num_blocks * cfg.block_size
            rows.append(
                {
                    "variant": str(v),
                    "kernel": v.kernel,
                    "log2_work": round(math.log2(work), 3),
                    "cpu_s": round(cpu, 2),
                    "wall_s": round(wall, 2),
                }
            )
            print(f"{v}: {cpu:.1f} cpu s, {wall:.1f} wall s", file=sys.stderr)
    by_kernel = {}
    for k in sorted({r["kernel"] for r in rows}):
        xs = [r["cpu_s"] for r in rows if r["kernel"] == k]
        by_kernel[k] = {
            "n": len(xs),
            "median_cpu_s": statistics.median(xs),
            "min_cpu_s": min(xs),
            "max_cpu_s": max(xs),
        }
    doc = {"first_compile_wall_s": round(first_s, 1), "rows": rows, "by_kernel": by_kernel}
    doc["fit"] = fit(rows)
    print(json.dumps(doc, indent=2) if args.json else json.dumps(doc["fit"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
