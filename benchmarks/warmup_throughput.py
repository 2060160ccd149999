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
2. Jobs: ``warmup.builder.planner.warmup`` (the code ``kernel-cache warmup`` runs)
   compiles N variants into an empty kernel_cache directory with ``--jobs J``
   worker processes, for each J; the Inductor cache directory is the one the
   current options' phase run left behind, temp dir included (precompiled
   headers built, as on a builder that warmed before; AOTInductor keeps no
   other cache between runs).
   Reported: wall seconds, seconds per variant (wall / N), CPU seconds per
   variant (all workers and their compilers: steadier than wall seconds on a
   shared machine), and the median compile seconds of a variant inside its worker.
3. Before/after (``--before REF``): ``kernel-cache warmup --jobs 1 --json`` of the
   whole plan, as a user runs it, from the source tree of the git revision
   REF and from this checkout, one after the other, each into an empty cache
   directory (precompiled headers built in it). ``CXX`` is a wrapper that records
   each compiler run's CPU seconds by output file. Reported per side: CPU seconds
   per variant (the warmup's process tree: ``getrusage`` of children), and the
   phase table: export (the factory and ``torch.export`` in the run recorder) and
   AOTInductor from the worker's timings (wall), and the compiler's CPU seconds
   on the precompiled headers, the wrapper's kept interface, the wrapper, the
   kernels and the link; the
   after/before ratio of CPU seconds per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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
from warmup.builder.planner import warmup
from warmup.cli.main import config_from_args, engine_options

CHILD = str(Path(__file__).with_name("_compile_child.py"))

#: Candidate option sets tried by default (see docs/benchmarks/compile.md for the result).
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


#: The ``CXX`` of the before/after runs: the compiler's CPU seconds per run,
#: appended to ``$KC_BENCH_CXX_LOG`` as ``<user+system s> <output file name>``.
CXX_WRAPPER = """#!{python}
import os, resource, subprocess, sys
args = sys.argv[1:]
out = args[args.index("-o") + 1] if "-o" in args[:-1] else ""
before = resource.getrusage(resource.RUSAGE_CHILDREN)
rc = subprocess.call([{cxx!r}, *args])
after = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
with open(os.environ["KC_BENCH_CXX_LOG"], "a") as f:
    f.write(f"{{cpu:.3f}} {{os.path.basename(out)}}\\n")
sys.exit(rc)
"""

#: Compiler outputs by phase (:data:`CXX_WRAPPER`'s file names): the precompiled
#: headers (``NAME.h.gch``, built as ``NAME.h.gch.PID.part``), the wrapper's kept
#: interface (``HASH.o.PID.part``, ``warmup.builder.wrapper_split``), the wrapper
#: (whole, or its own part ``...wrapper.o.own.o`` and the join into ``...wrapper.o``).
CXX_PHASES = {
    "pch": lambda n: ".gch" in n or n == "header.i",
    "interface": lambda n: ".gch" not in n and n.endswith(".part"),
    "wrapper": lambda n: n.endswith(("wrapper.o", "wrapper.o.own.o")),
    "kernel": lambda n: n.endswith("kernel.o"),
    "link": lambda n: n.endswith("wrapper.so"),
}


def _source_tree(ref: str, dest: Path) -> Path:
    """The files of git revision ``ref`` of this checkout, extracted to ``dest``."""
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def before_after_run(tree: Path, engine_args: list[str], work: Path) -> dict:
    """``kernel-cache warmup --jobs 1 --json`` of the plan of ``engine_args`` from
    source ``tree`` into an empty cache under ``work``: CPU seconds and phases
    (module docstring)."""
    import shutil as _shutil

    work.mkdir(parents=True)
    log = work / "cxx.log"
    cxx = os.environ.get("CXX") or _shutil.which("g++") or "g++"
    wrapper = work / "bin" / os.path.basename(cxx)  # torch knows compilers by name
    wrapper.parent.mkdir()
    wrapper.write_text(CXX_WRAPPER.format(python=sys.executable, cxx=cxx))
    wrapper.chmod(0o755)
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "CXX": str(wrapper),
        "KC_BENCH_CXX_LOG": str(log),
    }
    env.pop("KERNEL_CACHE_PCH_DIR", None)  # the cache's own: built once in the run
    cmd = [sys.executable, "-m", "warmup.cli.main", "warmup", *engine_args]
    cmd += ["--cache-dir", str(work / "cache"), "--jobs", "1", "--json", "--quiet"]
    t, c = time.perf_counter(), os.times()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
    wall = time.perf_counter() - t
    c2 = os.times()
    if proc.returncode != 0:
        raise SystemExit(f"warmup from {tree} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rep = json.loads(proc.stdout)
    n = rep["compiled"]
    if rep["failed"] or not n:
        raise SystemExit(f"warmup from {tree}: {n} compiled, failed: {rep['failed']}")
    cpu = (c2.children_user + c2.children_system) - (c.children_user + c.children_system)
    runs = [line.split(" ", 1) for line in log.read_text().splitlines()]
    cxx_s = {k: sum(float(s) for s, name in runs if f(name.strip())) for k, f in CXX_PHASES.items()}
    rows = [r for r in rep["results"] if r.get("timings")]
    return {
        "variants": n,
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_s_per_variant": cpu / n,
        "export_s": sum(r["timings"]["export_s"] for r in rows) / n,
        "aotinductor_s": sum(r["timings"]["compile_s"] for r in rows) / n,
        "load_check_s": rep["load_check"]["seconds"] / n,
        "cxx_cpu_s": {k: v / n for k, v in cxx_s.items()},
        "cxx_runs": len(runs),
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
    p.add_argument(
        "--before",
        metavar="REF",
        help="also warm the phase variants up from git revision REF and from this "
        "checkout, and compare their CPU seconds per variant and phases",
    )
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
    at_start = machine(cfg.device)  # its load average is the one before the runs
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

    # 3. Before/after: REF's source tree against this checkout's, as a user runs warmup.
    before_after = None
    if args.before:
        engine_args = _engine_args(list(argv if argv is not None else sys.argv[1:]))
        sides = {}
        for side, tree in (
            ("before", _source_tree(args.before, work / "before-src")),
            ("after", ROOT),
        ):
            print(f"{side}: warmup from {tree} ...", file=sys.stderr, flush=True)
            sides[side] = before_after_run(tree, engine_args, work / side)
        before_after = {
            "before_ref": args.before,
            **sides,
            "cpu_per_variant_after_vs_before": sides["after"]["cpu_s_per_variant"]
            / sides["before"]["cpu_s_per_variant"],
        }

    doc = header("warmup_throughput")
    doc["machine"] = at_start
    doc["config"] = {
        "engine": cfg.model_dump(mode="json"),
        "compile_options_current": recipe_options(cfg),
        "jobs_variants": [str(v) for v in variants],
        "phase_variants": [str(v) for v in phase_variants],
    }
    doc["results"] = {"jobs": jobs_rows, "phases": phases, "before_after": before_after}
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
    if before_after is not None:
        ba = before_after
        print_table(
            f"Before ({ba['before_ref']}) and after: kernel-cache warmup --jobs 1 of "
            f"{ba['after']['variants']} variants into an empty cache, per variant",
            ["side", "CPU s", "export s", "AOTInductor s", "g++ CPU s: pch / interface / "
             "wrapper / kernel / link", "load check s"],
            [
                [
                    side,
                    f"{r['cpu_s_per_variant']:.1f}",
                    f"{r['export_s']:.1f}",
                    f"{r['aotinductor_s']:.1f}",
                    " / ".join(f"{r['cxx_cpu_s'][k]:.1f}" for k in CXX_PHASES),
                    f"{r['load_check_s']:.1f}",
                ]
                for side, r in (("before", ba["before"]), ("after", ba["after"]))
            ],
        )  # fmt: skip
        print(f"CPU s per variant, after / before: {ba['cpu_per_variant_after_vs_before']:.2f}")
    print(f"JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


def _engine_args(argv: list[str]) -> list[str]:
    """``argv`` less this benchmark's own options (each with its value)."""
    own = {"--variants", "--jobs", "--phase-variants", "--kernel-calls", "--work-dir", "--out"}
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name == "--candidates":  # takes any number of values
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
            continue
        if name in own or name == "--before":
            i += 1 if "=" in a else 2
            continue
        out.append(a)
        i += 1
    return out


if __name__ == "__main__":
    sys.exit(main())
