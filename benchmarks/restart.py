"""Restart: seconds from a fresh process to "ready to serve" a plan, four ways.

    python benchmarks/restart.py [ENGINE OPTIONS] [--variants N] [--repeats R]
        [--cold-repeats C] [--cache-dir DIR] [--work-dir DIR] [--out FILE]

The same N variants of a plan (default: the built-in default plan, 17 variants;
``--variants N`` takes N of them, spread over the plan) are brought to ready in
a fresh Python process by:

  (a) kernel_cache: ``load_plan`` from its disk cache, then one dispatch per variant;
  (b) torch.compile cold: ``torch.compile(module, dynamic=False)`` per bucket and
      one call each, with an empty ``TORCHINDUCTOR_CACHE_DIR`` (and an empty
      ``TMPDIR``: torch 2.13 keeps precompiled C++ headers in the temp dir);
  (c) torch.compile warm: the same with the Inductor cache (b) left behind;
  (d) mega-cache: ``torch.compiler.load_cache_artifacts`` of the bytes that
      ``save_cache_artifacts`` wrote after (b), into empty Inductor cache and
      temp directories (a new machine or pod), then the same compiles and calls.

``--ways a`` runs only (a) (the others compile, minutes per round on a CPU).
``--baseline DIR`` adds (a) as another checkout (e.g. main before a change)
does it, interleaved with (a) round by round: a before/after in one run. The
baseline warms its own cache (its keys differ) with its own CLI, and its
starts run its own ``benchmarks/_restart_child.py`` with ``PYTHONPATH=DIR``.

Each start is a fresh process (benchmarks/_restart_child.py). Reported per way:
seconds to ready excluding and including ``import torch`` (median, min-max over
repeats), the ratio to (a) (ratio of medians, and the min-max of per-round
ratios: the ways are run interleaved, round by round), and what it traced and
compiled at start. The first call of a variant also does the kernel's work
(the same work in every way), so each start also times one more, warm call of
every variant; ``start cost`` is ready minus that. Setup (warming kernel_cache,
the first cold run) is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

from _common import (
    DEFAULT_CACHE,
    OUT_DIR,
    ROOT,
    fmt,
    header,
    inductor_env,
    machine,
    pick_variants,
    print_table,
    run_json_child,
    summary,
    write_json,
)

from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.store.disk_tier import DiskTier
from warmup.builder.planner import warmup
from warmup.cli.main import config_from_args, engine_options

CHILD = str(Path(__file__).with_name("_restart_child.py"))
WAYS = {
    "a": "kernel_cache load_plan",
    "b": "torch.compile, cold Inductor cache",
    "c": "torch.compile, warm Inductor cache",
    "d": "torch.compile + load_cache_artifacts",
}
BASELINE = "a@baseline"


def baseline_setup(cfg, base: Path, cache: Path) -> None:
    """Warm ``cfg``'s whole plan with the baseline checkout's own CLI into
    ``cache`` (untimed).

    Raises:
        SystemExit: the baseline is not a checkout, or its warmup failed.
    """
    import subprocess

    from kernel_cache.config.engine import config_to_cli

    if not (base / "benchmarks" / "_restart_child.py").is_file():
        raise SystemExit(f"--baseline {base}: no benchmarks/_restart_child.py there")
    cmd = [sys.executable, "-m", "warmup.cli", "warmup", "--jobs", "2", "--quiet"]
    cmd += shlex.split(config_to_cli(cfg, cache))
    proc = subprocess.run(cmd, cwd=base, env={**os.environ, "PYTHONPATH": str(base)})
    if proc.returncode != 0:
        raise SystemExit(f"--baseline {base}: its warmup exited {proc.returncode}: {cmd}")


def subset_cache(cfg, variants, src: Path, dst: Path) -> Path:
    """A kernel_cache directory holding exactly ``variants`` (copied from ``src``)."""
    if dst.exists():
        shutil.rmtree(dst)
    a, b = DiskTier(src), DiskTier(dst)
    try:
        for v in variants:
            key = build_key(cfg, v).hexdigest
            e = a.get(key)
            if e is None:
                raise SystemExit(f"variant {v} missing from {src} after warmup")
            b.put(key, e.data, e.meta)
    finally:
        a.close()
        b.close()
    return dst


def child(spec: dict, env: dict) -> dict:
    return run_json_child([sys.executable, CHILD, json.dumps(spec)], env=env)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.add_argument("--variants", type=int, default=None, help="N variants of the plan (all)")
    p.add_argument("--repeats", type=int, default=3, help="starts per way for (a), (c), (d)")
    p.add_argument(
        "--cold-repeats", type=int, default=1, help="cold starts (b); each compiles everything"
    )
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="kernel_cache directory")
    p.add_argument("--work-dir", default=str(OUT_DIR / "restart-work"))
    p.add_argument("--jobs", type=int, default=2, help="warmup workers for the setup")
    p.add_argument("--out", default=str(OUT_DIR / "restart.json"))
    p.add_argument("--ways", default="abcd", help="which of (a)-(d) to run, e.g. 'a'")
    p.add_argument("--baseline", default=None, help="another checkout: its (a), interleaved")
    args = p.parse_args(argv)
    if not set(args.ways) <= set(WAYS) or "a" not in args.ways:
        raise SystemExit(f"--ways {args.ways!r}: letters of 'abcd', 'a' included")
    if args.baseline and args.variants is not None:
        raise SystemExit("--baseline loads the whole plan: leave out --variants")
    if args.repeats < 1 or args.cold_repeats < 1:
        raise SystemExit("--repeats and --cold-repeats must be >= 1")

    cfg = config_from_args(args)
    plan = Bucketer(cfg).variants
    variants = pick_variants(plan, args.variants)
    names = [str(v) for v in variants]
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)

    # Setup (untimed): every variant in kernel_cache's cache.
    rep = warmup(cfg, args.cache_dir, jobs=args.jobs, variants=variants, progress=True)
    if rep["failed"]:
        raise SystemExit(f"warmup failed: {rep['failed']}")
    kc_dir = Path(args.cache_dir)
    if len(variants) < len(plan):
        kc_dir = subset_cache(cfg, variants, kc_dir, work / "kernel-cache-subset")

    base = {"config": cfg.model_dump_json(), "variants": names}
    warm_dir = work / "inductor-warm"
    artifacts = work / "mega-cache.bin"
    ways = {k: v for k, v in WAYS.items() if k in args.ways}
    runs: dict[str, list[dict]] = {k: [] for k in ways}
    base_dir = None
    if args.baseline:
        base_dir = Path(args.baseline).resolve()
        base_cache = work / "baseline-cache"
        baseline_setup(cfg, base_dir, base_cache)
        ways[BASELINE] = f"kernel_cache load_plan, {base_dir}"
        runs[BASELINE] = []
        base_spec = {
            "config": cfg.model_dump_json(exclude_defaults=True),
            "variants": names,
            "path": "kernel_cache",
            "cache_dir": str(base_cache),
        }
        base_cmd = [sys.executable, str(base_dir / "benchmarks" / "_restart_child.py")]

    # (b) cold; the first leaves the warm directory and the artifacts behind.
    for r in range(args.cold_repeats if "b" in ways else 0):
        d = warm_dir if r == 0 else work / f"inductor-cold-{r}"
        spec = {**base, "path": "torch_compile", "seed": r}
        if r == 0:
            spec["save_artifacts"] = str(artifacts)
        print(f"(b) cold start {r + 1}/{args.cold_repeats} ...", file=sys.stderr, flush=True)
        runs["b"].append(child(spec, inductor_env(d)))
        if r:
            shutil.rmtree(d, ignore_errors=True)

    # (a), (c), (d), interleaved round by round.
    for r in range(args.repeats):
        print(f"round {r + 1}/{args.repeats}: (a) (c) (d)", file=sys.stderr, flush=True)
        empty = work / "kc-empty-inductor"
        runs["a"].append(
            child({**base, "path": "kernel_cache", "cache_dir": str(kc_dir)}, inductor_env(empty))
        )
        if base_dir is not None:
            env = {**inductor_env(empty), "PYTHONPATH": str(base_dir)}
            runs[BASELINE].append(run_json_child([*base_cmd, json.dumps(base_spec)], env=env))
        if "c" in ways:
            runs["c"].append(
                child({**base, "path": "torch_compile", "seed": r}, inductor_env(warm_dir))
            )
        if "d" in ways:
            fresh = work / f"inductor-mega-{r}"
            spec = {**base, "path": "torch_compile", "load_artifacts": str(artifacts), "seed": r}
            runs["d"].append(child(spec, inductor_env(fresh)))
            shutil.rmtree(fresh, ignore_errors=True)

    for rs in runs.values():
        for x in rs:
            x["start_cost_s"] = x["ready_s"] - x["second_calls_s"]
    results = {}
    a_ex = summary([x["ready_s"] for x in runs["a"]])
    a_in = summary([x["ready_incl_import_s"] for x in runs["a"]])
    a_sc = summary([x["start_cost_s"] for x in runs["a"]])
    for k, label in ways.items():
        rs = runs[k]
        ex = summary([x["ready_s"] for x in rs])
        inc = summary([x["ready_incl_import_s"] for x in rs])
        sc = summary([x["start_cost_s"] for x in rs])
        per_round_ex = [x["ready_s"] / a["ready_s"] for x, a in zip(rs, runs["a"], strict=False)]
        per_round_in = [
            x["ready_incl_import_s"] / a["ready_incl_import_s"]
            for x, a in zip(rs, runs["a"], strict=False)
        ]
        traced = any(x.get("dynamo_graphs", 0) for x in rs)
        codegen = any(x.get("fxgraph_cache_miss", 0) for x in rs)
        # A preprocessor run (header.i: Inductor hashes its precompiled header in
        # every process) is not a compile; a built .so/.o/.gch is.
        builds = [[b for b in x.get("cxx_builds", []) if not b.endswith(".i")] for x in rs]
        compiled = codegen or any(builds)
        results[k] = {
            "way": label,
            "ready_excl_import_torch_s": ex,
            "ready_incl_import_torch_s": inc,
            "import_torch_s": summary([x["import_torch_s"] for x in rs]),
            "second_calls_s": summary([x["second_calls_s"] for x in rs]),
            "start_cost_excl_import_torch_s": sc,
            "ratio_to_a_excl_import": ex["median"] / a_ex["median"],
            "ratio_to_a_start_cost": sc["median"] / a_sc["median"],
            "ratio_to_a_incl_import": inc["median"] / a_in["median"],
            "ratio_to_a_excl_import_per_round": summary(per_round_ex),
            "ratio_to_a_incl_import_per_round": summary(per_round_in),
            "traced_at_start": traced,
            "inductor_codegen_at_start": codegen,
            "cxx_builds_at_start": max(len(b) for b in builds),
            "compiled_at_start": compiled,
            "compile_stack_imported": sorted({m for x in rs for m in x["compile_stack_imported"]}),
            "runs": rs,
        }

    doc = header("restart")
    doc["machine"] = machine(cfg.device)
    doc["config"] = {
        "engine": cfg.model_dump(mode="json"),
        "variants": names,
        "num_variants": len(names),
        "plan_variants": len(plan),
        "repeats": args.repeats,
        "cold_repeats": args.cold_repeats,
        "kernel_cache_warmup": {k: rep[k] for k in ("compiled", "cached", "seconds")},
    }
    doc["results"] = results
    doc["target"] = {
        "a_no_trace_no_compile": not results["a"]["traced_at_start"]
        and not results["a"]["compiled_at_start"]
        and not results["a"]["compile_stack_imported"],
    }
    if "c" in results:
        ratio = results["c"]
        doc["target"]["a_at_least_100x_faster_than_c_excl_import"] = (
            ratio["ratio_to_a_excl_import"] >= 100
        )
        doc["target"]["a_at_least_100x_faster_than_c_start_cost"] = (
            ratio["ratio_to_a_start_cost"] >= 100
        )
    out = write_json(args.out, doc)

    rows = []
    for k, r in results.items():
        rs = r["runs"]
        rows.append(
            [
                f"({k}) {r['way']}",
                fmt(r["ready_excl_import_torch_s"], digits=2),
                fmt(r["ready_incl_import_torch_s"], digits=2),
                fmt(r["second_calls_s"], digits=2),
                fmt(r["start_cost_excl_import_torch_s"], digits=2),
                f"{r['ratio_to_a_excl_import']:.1f}x",
                f"{r['ratio_to_a_incl_import']:.1f}x",
                f"{r['ratio_to_a_start_cost']:.1f}x",
                "yes" if r["traced_at_start"] else "no",
                "yes" if r["inductor_codegen_at_start"] else "no",
                r["cxx_builds_at_start"],
            ]
        )
    print_table(
        f"Restart: {len(names)} variants of {cfg.model} ({cfg.dtype}, {cfg.device}), "
        f"seconds to ready, median (min-max)",
        [
            "way",
            "ready",
            "ready + import torch",
            "kernels (2nd calls)",
            "start cost",
            "/(a) ready",
            "/(a) +import",
            "/(a) start",
            "traced",
            "codegen",
            "c++ builds",
        ],
        rows,
    )
    print(
        "ready: after `import torch` until every variant ran once; start cost: ready minus "
        "one warm call of every variant (the kernels' own work, timed right after); traced: "
        "Dynamo traced; codegen: Inductor generated code (FX graph cache miss); c++ builds: "
        "C++ compiler runs that built a binary"
    )
    print(f"JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
