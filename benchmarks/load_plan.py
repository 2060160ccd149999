"""``load_plan`` alone: milliseconds per variant in a fresh process, before/after.

    python benchmarks/load_plan.py [ENGINE OPTIONS] --cache-dir DIR [--baseline DIR
        [--baseline-cache-dir DIR]] [--repeats R] [--out FILE] [--profile FILE]

Each start is a fresh Python process that imports torch and the engine config
(as an engine has before it loads), then times one ``load_plan(config,
cache_dir)`` of the whole plan: wall seconds (``time.perf_counter``) and this
thread's CPU seconds (``time.thread_time``; less sensitive than wall time to
other processes on a loaded machine). ``--baseline DIR`` (another checkout,
e.g. a ``git archive`` of main) runs its own ``kernel_cache`` (first on
``sys.path``, ahead of an editable install), interleaved round by round, on
the same cache directory or, where its keys differ, on its own
(``--baseline-cache-dir``, warmed by that checkout). Each cache must hold the
whole plan (``kernel-cache warmup`` first): a start that misses a variant fails.
Reports median (min-max) per way and per variant; the machine's
load average is recorded before and after. ``--profile FILE``: one more start
of this checkout, after the timed ones, under cProfile (its stats to FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from _common import (
    OUT_DIR,
    ROOT,
    fmt,
    header,
    machine,
    print_table,
    run_json_child,
    summary,
    write_json,
)

from warmup.cli.main import config_from_args, engine_options

CHILD = r"""
import json, sys, time
# The checkout's own kernel_cache: ahead of an editable install's import finder.
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path.insert(0, sys.argv[3])
import torch
from kernel_cache.config.engine import EngineConfig
cfg = EngineConfig.model_validate_json(sys.argv[1])
import kernel_cache
from kernel_cache import load_plan
prof = None
if len(sys.argv) > 4:  # --profile: this start under cProfile, its stats to that file
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
w0, c0 = time.perf_counter(), time.thread_time()
rt = load_plan(cfg, sys.argv[2])
w, c = time.perf_counter() - w0, time.thread_time() - c0
if prof is not None:
    prof.disable()
    import io, pstats
    text = io.StringIO()
    print(f"load_plan {w:.4f} s wall, {rt.stats()['loads']} variants (under cProfile)", file=text)
    for order in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(30)
    open(sys.argv[4], "w").write(text.getvalue())
print(json.dumps({"wall_s": w, "cpu_s": c, "loads": rt.stats()["loads"],
                  "compiles": rt.stats().get("compiles"), "kernel_cache": kernel_cache.__file__}))
"""


def start(cfg_json: str, cache: str, checkout: str, profile: str | None = None) -> dict:
    extra = [profile] if profile else []
    return run_json_child([sys.executable, "-c", CHILD, cfg_json, cache, checkout, *extra])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.add_argument("--cache-dir", required=True, help="a cache holding the whole plan")
    p.add_argument("--baseline", default=None, help="another checkout: its load_plan, interleaved")
    p.add_argument(
        "--baseline-cache-dir",
        default=None,
        help="the baseline's cache, where its keys differ (default: --cache-dir)",
    )
    p.add_argument("--repeats", type=int, default=7, help="starts per way")
    p.add_argument("--out", default=str(OUT_DIR / "load_plan.json"))
    p.add_argument(
        "--profile",
        default=None,
        help="after the timed starts, one more of this checkout under cProfile; "
        "its stats (by own time and by cumulative time) to this text file",
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: must be >= 1")
    cfg = config_from_args(args)
    cfg_json = cfg.model_dump_json()
    ways = {"now": str(ROOT)}
    if args.baseline:
        base = Path(args.baseline).resolve()
        if not (base / "kernel_cache" / "runtime" / "load.py").is_file():
            raise SystemExit(f"--baseline {base}: not a kernel-cache checkout")
        ways["baseline"] = str(base)
    doc = header("load_plan")
    doc["machine"] = machine(cfg.device)
    runs: dict[str, list[dict]] = {k: [] for k in ways}
    for r in range(args.repeats):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        print(f"round {r + 1}/{args.repeats}: {' '.join(order)}", file=sys.stderr, flush=True)
        for k in order:
            cache = args.baseline_cache_dir if k == "baseline" and args.baseline_cache_dir else None
            x = start(cfg_json, cache or args.cache_dir, ways[k])
            if not x["kernel_cache"].startswith(ways[k] + os.sep):
                raise SystemExit(
                    f"{k}: loaded kernel_cache from {x['kernel_cache']}, not {ways[k]}"
                )
            runs[k].append(x)
    doc["machine"]["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    if args.profile:  # untimed above: cProfile slows every call it sees
        start(cfg_json, args.cache_dir, ways["now"], str(Path(args.profile).resolve()))
    n = runs["now"][0]["loads"]
    results = {}
    for k, rs in runs.items():
        results[k] = {
            "checkout": ways[k],
            "variants": rs[0]["loads"],
            "wall_s": summary([x["wall_s"] for x in rs]),
            "cpu_s": summary([x["cpu_s"] for x in rs]),
            "wall_ms_per_variant": summary([1e3 * x["wall_s"] / x["loads"] for x in rs]),
            "cpu_ms_per_variant": summary([1e3 * x["cpu_s"] / x["loads"] for x in rs]),
            "compiles": sorted({json.dumps(x["compiles"]) for x in rs}),
            "runs": rs,
        }
    doc["config"] = {"engine": cfg.model_dump(mode="json"), "repeats": args.repeats}
    doc["results"] = results
    doc["target"] = {
        "wall_ms_per_variant_median_at_most_5": results["now"]["wall_ms_per_variant"]["median"] <= 5
    }
    out = write_json(args.out, doc)
    rows = [
        [
            k,
            r["variants"],
            fmt(r["wall_s"], 1e3, 1),
            fmt(r["wall_ms_per_variant"], 1, 2),
            fmt(r["cpu_s"], 1e3, 1),
            fmt(r["cpu_ms_per_variant"], 1, 2),
        ]
        for k, r in results.items()
    ]
    print_table(
        f"load_plan of {n} variants ({cfg.model}, {cfg.device}), fresh process, "
        f"median (min-max) of {args.repeats}",
        ["way", "variants", "wall ms", "wall ms/variant", "CPU ms", "CPU ms/variant"],
        rows,
    )
    print(
        f"load average {doc['machine']['loadavg_at_start']} -> {doc['machine']['loadavg_at_end']}"
    )
    print(f"JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
