"""The C++ wrapper's optimization level and how it is compiled: the compiler's CPU
per variant and the packages' call time, per side, in one process.

    python benchmarks/wrapper_opt_level.py [ENGINE OPTIONS] [--levels O1,Og]
        [--wrapper split|whole|split,whole] [--rounds R] [--calls C] [--out FILE]

A side is a level and a way to compile the wrapper: ``split`` (the build's:
the runtime's interface compiled once and kept, ``warmup.builder.wrapper_split``)
or ``whole`` (one compile of the whole wrapper, as Inductor does). Each
variant of the plan is compiled once per side (the recipe's options with
``aot_inductor.compile_wrapper_opt_level`` set to the level; the sides in
alternating order from one variant to the next), after compiles that are not
counted: each variant once on the first side (torch's first-use setup, each
kernel's first compile in the process, which costs seconds more, and the kept
interface) and one variant on each other side (its precompiled headers). CPU seconds:
this process and the compiler processes (``os.times``); ``cxx_cpu_s``: the
compiler processes alone. Then, for R rounds, each variant's packages are
called C times each, one after the other in alternating order, on one intra-op
thread; a round's figure is the median thread CPU time per call (us). Reported
per variant and side: the median of the round medians, min and max. A CPU
plan only: the timing is the calling thread's CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time

from _common import OUT_DIR, cpu_all, cpu_children, header, machine, summary, write_json

from warmup.cli.main import config_from_args, engine_options


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.add_argument("--levels", default="O1,Og", help="comma-separated gcc levels")
    p.add_argument("--wrapper", default="split", help="comma-separated: split, whole")
    p.add_argument("--rounds", type=int, default=8, help="even: each level first as often")
    p.add_argument("--calls", type=int, default=300, help="timed calls per package a round")
    p.add_argument("--out", default=str(OUT_DIR / "wrapper_opt_level.json"))
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    if cfg.device != "cpu":
        raise SystemExit("wrapper_opt_level.py times a CPU plan (the thread's CPU time)")

    at_start = machine(cfg.device)
    levels = [
        f"{lv.strip()}/{how.strip()}"
        for lv in args.levels.split(",")
        if lv.strip()
        for how in args.wrapper.split(",")
        if how.strip()
    ]
    if any(side.split("/")[1] not in ("split", "whole") for side in levels):
        raise SystemExit(f"--wrapper {args.wrapper!r}: each must be split or whole")
    scratch = tempfile.mkdtemp(prefix="kc-bench-")
    try:
        return _run(args, cfg, levels, scratch, at_start, argv)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _wrapper(side: str):
    """The wrapper compiled as ``side`` says (``LEVEL/split`` or ``LEVEL/whole``)."""
    from warmup.builder import wrapper_split

    split = wrapper_split.compile_split
    if side.endswith("/whole"):
        wrapper_split.compile_split = lambda *args, **kwargs: False
    try:
        yield
    finally:
        wrapper_split.compile_split = split


def _run(args, cfg, levels, scratch, at_start, argv) -> int:
    import torch

    from kernel_cache.plan.buckets import Bucketer
    from kernel_cache.plan.keys import recipe_options
    from kernel_cache.runtime.inputs import make_inputs
    from kernel_cache.runtime.package import load_package
    from warmup.builder.compiler import compile_with_options, pin_environment

    pin_environment(cfg.device, cfg.cpu_target, scratch)
    pch = os.path.join(scratch, "pch")
    variants = Bucketer(cfg).variants
    sets = {
        lv: {**recipe_options(cfg), "aot_inductor.compile_wrapper_opt_level": lv.split("/")[0]}
        for lv in levels
    }
    # Not counted: each variant's first compile in this process, and each other
    # level's precompiled headers.
    for v in variants:
        with _wrapper(levels[0]):
            compile_with_options(cfg, v, sets[levels[0]], pch_dir=pch)
    for lv in levels[1:]:
        with _wrapper(lv):
            compile_with_options(cfg, variants[0], sets[lv], pch_dir=pch)
    compiles: dict[str, list] = {lv: [] for lv in levels}
    runners = {}
    for n, v in enumerate(variants):
        for lv in levels if n % 2 == 0 else levels[::-1]:
            c, cc = cpu_all(), cpu_children()
            with _wrapper(lv):
                data, _ = compile_with_options(cfg, v, sets[lv], pch_dir=pch)
            compiles[lv].append(
                {
                    "variant": str(v),
                    "cpu_s": cpu_all() - c,
                    "cxx_cpu_s": cpu_children() - cc,
                    "package_bytes": len(data),
                }
            )
            runners[(str(v), lv)] = load_package(data, cfg.device)
    torch.set_num_threads(1)
    rounds: dict = {key: [] for key in runners}
    for r in range(args.rounds):
        for v in variants:
            inputs = list(make_inputs(cfg, v, seed=0))
            for lv in levels if r % 2 == 0 else levels[::-1]:
                run = runners[(str(v), lv)].run
                for _ in range(3):
                    run(inputs)
                times = []
                for _ in range(args.calls):
                    t = time.thread_time()
                    run(inputs)
                    times.append(time.thread_time() - t)
                rounds[(str(v), lv)].append(statistics.median(times) * 1e6)
    calls: dict = {}
    for (v, lv), xs in rounds.items():
        calls.setdefault(v, {})[lv] = {**summary(xs), "rounds_us": xs}
    doc = {
        **header("wrapper_opt_level", argv if argv is not None else sys.argv[1:]),
        "machine": at_start,
        "config": cfg.model_dump(mode="json"),
        "results": {
            "levels": levels,
            "rounds": args.rounds,
            "calls_per_round": args.calls,
            "variants": [str(v) for v in variants],
            "compile": {
                lv: {
                    "cpu_s": summary([x["cpu_s"] for x in rows]),
                    "cxx_cpu_s": summary([x["cxx_cpu_s"] for x in rows]),
                    "rows": rows,
                }
                for lv, rows in compiles.items()
            },
            "calls_us": calls,
        },
    }
    out = write_json(args.out, doc)
    for lv in levels:
        c = doc["results"]["compile"][lv]
        cpu, cxx = c["cpu_s"]["median"], c["cxx_cpu_s"]["median"]
        print(f"{lv}: CPU s/variant {cpu:.2f}, compiler {cxx:.2f}")
    for v, d in calls.items():
        row = ", ".join(
            f"{lv} {x['median']:.1f} ({x['min']:.1f}-{x['max']:.1f})" for lv, x in d.items()
        )
        print(f"{v}: us per call {row}")
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
