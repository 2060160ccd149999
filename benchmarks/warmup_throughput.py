"""Warmup throughput: seconds per variant with --jobs 1 and 2, and where a compile's
time goes (export, code generation, the C++ compiler, packaging) per set of
compile options.

    python benchmarks/warmup_throughput.py [ENGINE OPTIONS] [--variants N]
        [--jobs 1,2] [--phase-variants M] [--candidates JSON ...]
        [--kernel-calls K] [--work-dir DIR] [--out FILE]

1. Phases: for the recipe's options (``kernel_cache.config.recipe.compile_options``) and each
   ``--candidates`` set, a fresh process with empty Inductor cache and temp
   directories (torch 2.13 keeps precompiled headers in the temp dir) compiles
   M variants (benchmarks/_compile_child.py). The first compile of a process
   also pays the imports and the precompiled headers (once per machine and
   set of compiler flags); the later ones are the steady state. Each compiled kernel
   is timed (median us per call) so a faster compile that slows the kernel shows.
2. Jobs: ``warmup.build.planner.warmup`` (the code ``kernel-cache warmup`` runs)
   compiles N variants into an empty kernel_cache directory with ``--jobs J``
   worker processes, for each J; the Inductor cache directory is the one the
   current options' phase run left behind, temp dir included (precompiled
   headers built, as on a builder that warmed before; AOTInductor keeps no
   other cache between runs).
   Reported: wall seconds, seconds per variant (wall / N), CPU seconds per
   variant (all workers and their compilers: steadier than wall seconds on a
   shared machine), and the median compile seconds of a variant inside its worker.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from _common import (
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
from kernel_cache.plan.keys import recipe_options
from warmup.build.planner import warmup
from warmup.cli.main import config_from_args, engine_options

CHILD = str(Path(__file__).with_name("_compile_child.py"))

#: Candidate option sets tried by default (see docs/benchmarks.md for the result).
DEFAULT_CANDIDATES = (
    "{}",
    '{"aot_inductor.compile_wrapper_opt_level": "O0"}',
    '{"aot_inductor.enable_line_tables": false}',
    '{"aot_inductor.compile_wrapper_opt_level": "O0", "aot_inductor.enable_line_tables": false}',
)
PHASES = ("export_s", "codegen_s", "cxx_s", "packaging_s")


def phase_run(cfg, variants, opts: dict, inductor_dir: Path, kernel_calls: int) -> dict:
    spec = {
        "config": cfg.model_dump_json(),
        "variants": [str(v) for v in variants],
        "compile_options": opts,
        "kernel_calls": kernel_calls,
    }
    env = inductor_env(inductor_dir)
    doc = run_json_child([sys.executable, CHILD, json.dumps(spec)], env=env)
    rows = doc["rows"]
    steady = rows[1:] or rows
    totals = {p: sum(r[p] for r in steady) for p in PHASES}
    whole = sum(totals.values()) or 1.0
    return {
        "compile_options": opts,
        "first_compile_s": rows[0]["total_s"],
        "first_process_s": doc["process_wall_s"],
        "steady_compile_s": summary([r["total_s"] for r in steady]),
        "steady_cpu_s": summary([r["cpu_s"] for r in steady]),
        "steady_cxx_cpu_s": summary([r["cxx_cpu_s"] for r in steady]),
        "first_cpu_s": rows[0]["cpu_s"],
        "steady_share": {p[:-2]: totals[p] / whole for p in PHASES},
        "steady_phase_s": {p[:-2]: summary([r[p] for r in steady]) for p in PHASES},
        "kernel_us": {r["variant"]: r.get("kernel_us") for r in rows},
        "rows": rows,
        "import_torch_s": doc["import_torch_s"],
        "import_compile_stack_s": doc["import_compile_stack_s"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.add_argument("--variants", type=int, default=6, help="N variants for the jobs runs")
    p.add_argument("--jobs", default="1,2", help="comma-separated worker counts; none: skip")
    p.add_argument("--phase-variants", type=int, default=3, help="M variants per phase run")
    p.add_argument(
        "--candidates",
        nargs="*",
        default=list(DEFAULT_CANDIDATES),
        help="Inductor option sets (JSON) to compare with the recipe's options",
    )
    p.add_argument("--kernel-calls", type=int, default=30, help="timed calls per kernel")
    p.add_argument("--work-dir", default=str(OUT_DIR / "warmup-work"))
    p.add_argument("--out", default=str(OUT_DIR / "warmup_throughput.json"))
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    plan = Bucketer(cfg).variants
    skip_jobs = args.jobs.strip().lower() == "none"
    jobs = [] if skip_jobs else [int(j) for j in args.jobs.split(",") if j.strip()]
    if not skip_jobs and (not jobs or min(jobs) < 1):
        raise SystemExit(f"--jobs {args.jobs!r}: comma-separated integers >= 1, or none")
    option_sets = [recipe_options(cfg)]
    for c in args.candidates:
        opts = json.loads(c)
        if opts not in option_sets:
            option_sets.append(opts)
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)

    # 1. Phases per option set (the first is the recipe's).
    phase_variants = pick_variants(plan, args.phase_variants)
    phases = []
    for i, opts in enumerate(option_sets):
        print(f"phases: options {json.dumps(opts)} ...", file=sys.stderr, flush=True)
        phases.append(
            phase_run(cfg, phase_variants, opts, work / f"inductor-{i}", args.kernel_calls)
        )
    base_kernel = phases[0]["kernel_us"]
    for ph in phases:
        ratios = [
            ph["kernel_us"][v] / base_kernel[v]
            for v in base_kernel
            if base_kernel[v] and ph["kernel_us"].get(v)
        ]
        ph["kernel_time_vs_current"] = summary(ratios)
        ph["steady_compile_vs_current"] = (
            ph["steady_compile_s"]["median"] / phases[0]["steady_compile_s"]["median"]
        )
        ph["steady_cpu_vs_current"] = (
            ph["steady_cpu_s"]["median"] / phases[0]["steady_cpu_s"]["median"]
        )

    # 2. Jobs, with the current options and a warmed precompiled-header cache.
    variants = pick_variants(plan, args.variants)
    os.environ.update(inductor_env(work / "inductor-0"))
    jobs_rows = []
    for j in jobs:
        print(f"jobs {j}: warmup of {len(variants)} variants ...", file=sys.stderr, flush=True)
        t, c = time.perf_counter(), os.times()
        rep = warmup(
            cfg, work / f"kernel-cache-jobs-{j}", jobs=j, variants=variants, progress=False
        )
        wall = time.perf_counter() - t
        c2 = os.times()  # the pool's workers (and their compilers) are reaped by now
        cpu = (c2.children_user + c2.children_system) - (c.children_user + c.children_system)
        if rep["failed"] or rep["compiled"] != len(variants):
            raise SystemExit(f"warmup --jobs {j}: {rep['failed'] or rep}")
        per = [r["timings"]["total_s"] for r in rep["results"] if "timings" in r]
        jobs_rows.append(
            {
                "jobs": j,
                "variants": len(variants),
                "wall_s": wall,
                "s_per_variant": wall / len(variants),
                "cpu_s": cpu,
                "cpu_s_per_variant": cpu / len(variants),
                "compile_s_in_worker": summary(per),
                "worker_compile_sum_s": sum(per),
            }
        )
    for r in jobs_rows:
        r["speedup_vs_first"] = jobs_rows[0]["wall_s"] / r["wall_s"]
        r["cpu_vs_first"] = r["cpu_s"] / jobs_rows[0]["cpu_s"]

    doc = header("warmup_throughput")
    doc["machine"] = machine(cfg.device)
    doc["config"] = {
        "engine": cfg.model_dump(mode="json"),
        "compile_options_current": recipe_options(cfg),
        "jobs_variants": [str(v) for v in variants],
        "phase_variants": [str(v) for v in phase_variants],
    }
    doc["results"] = {"jobs": jobs_rows, "phases": phases}
    out = write_json(args.out, doc)

    print_table(
        f"Warmup throughput: {len(variants)} variants of {cfg.model} ({cfg.dtype}, "
        f"{cfg.device}), compile options {json.dumps(recipe_options(cfg))}",
        [
            "jobs",
            "wall s",
            "s / variant",
            "cpu s / variant",
            "speedup",
            "compile s in worker, median (min-max)",
        ],
        [
            [
                r["jobs"],
                f"{r['wall_s']:.1f}",
                f"{r['s_per_variant']:.1f}",
                f"{r['cpu_s_per_variant']:.1f}",
                f"{r['speedup_vs_first']:.2f}x",
                fmt(r["compile_s_in_worker"], digits=1),
            ]
            for r in jobs_rows
        ],
    )
    print_table(
        f"Where a compile goes: {len(phase_variants)} variants per fresh process; steady "
        "state = compiles after the first",
        [
            "compile options",
            "first s",
            "steady s",
            "steady cpu s",
            "export",
            "codegen",
            "c++",
            "packaging",
            "kernel time",
        ],
        [
            [
                json.dumps(ph["compile_options"]) + (" (current)" if i == 0 else ""),
                f"{ph['first_compile_s']:.1f}",
                fmt(ph["steady_compile_s"], digits=1),
                fmt(ph["steady_cpu_s"], digits=1),
                *(
                    f"{100 * ph['steady_share'][k]:.0f}%"
                    for k in ("export", "codegen", "cxx", "packaging")
                ),
                f"{ph['kernel_time_vs_current']['median']:.2f}x"
                if ph["kernel_time_vs_current"]["median"]
                else "-",
            ]
            for i, ph in enumerate(phases)
        ],
    )
    print(f"JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
