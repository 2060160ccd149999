"""Import cost: what ``import kernel_cache`` and an engine's start imports cost,
against ``import torch``, each in a fresh process.

    python benchmarks/import_cost.py [--rounds R] [--model NAME] [--baseline DIR] [--out FILE]

Cases, each a fresh ``python -c`` in the checkout (its ``kernel_cache`` first on
``sys.path``), timed inside the process with ``time.perf_counter`` around the
statement (the interpreter's own start is not in it; the garbage collector
runs as it would in an engine):

* ``import torch``;
* ``import kernel_cache``;
* ``make_config``: ``from kernel_cache import load_plan, make_config`` and
  ``make_config(MODEL)``, without torch;
* ``engine imports after torch``: in a process that has imported torch
  (untimed), ``make_config(MODEL)`` and every ``kernel_cache`` module that
  ``load_plan`` imports (found once, before timing, by a ``load_plan`` on an
  empty cache): what kernel_cache adds to an engine's start besides loading
  its kernels.

Each process also reports its wall time (spawn to exit, as the parent saw it);
``python -c pass`` gives the interpreter's start. Rounds interleave the cases;
ratios to ``import torch`` are per round (median, min-max). ``--baseline DIR``
(another checkout, e.g. main before a change) adds its kernel_cache cases, run
with ``DIR`` as the working directory, interleaved in the same rounds.

Bytecode: children run with ``PYTHONDONTWRITEBYTECODE`` unset, after one untimed
round, so every module loads from its ``.pyc`` as an installed package does.
Target: the kernel_cache cases at most 5% of ``import torch``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import OUT_DIR, ROOT, fmt, header, machine, print_table, summary, write_json

#: Prints ``{"s": seconds of STMT, "torch": whether torch is imported}`` last; SETUP is untimed.
CHILD = """
import time, sys
{setup}
t0 = time.perf_counter()
{stmt}
dt = time.perf_counter() - t0
import json
print(json.dumps({{"s": dt, "torch": "torch" in sys.modules}}))
"""

#: Prints the ``kernel_cache`` modules a ``load_plan`` on an empty cache imports.
FIND_ENGINE_MODULES = """
import json, sys
import torch
from kernel_cache import load_plan, make_config
load_plan(make_config({model!r}), cache_dir={cache!r}, strict=False)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("kernel_cache"))))
"""


def child_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTHONPATH", None)  # the working directory decides which checkout runs
    return env


def run_child(code: str, cwd: Path) -> dict:
    """``{"s", "torch", "wall_s"}`` of a fresh ``python -c code`` in ``cwd``.

    Raises:
        RuntimeError: the child failed (its stderr tail is in the message).
    """
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=child_env(),
        timeout=600,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"child in {cwd} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    doc = json.loads(lines[-1]) if lines else {}
    doc["wall_s"] = wall
    return doc


def engine_modules(model: str, cwd: Path) -> list[str]:
    """The ``kernel_cache`` modules ``load_plan`` imports in the checkout at ``cwd``."""
    with tempfile.TemporaryDirectory() as d:
        cache = Path(d) / "cache"
        cache.mkdir(mode=0o700)
        proc = subprocess.run(
            [sys.executable, "-c", FIND_ENGINE_MODULES.format(model=model, cache=str(cache))],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=child_env(),
            timeout=600,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"load_plan on an empty cache in {cwd} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kernel_cache_cases(model: str, cwd: Path, suffix: str = "") -> dict[str, tuple[str, Path]]:
    mods = engine_modules(model, cwd)
    engine = f"from kernel_cache import load_plan, make_config\nmake_config({model!r})\n" + "".join(
        f"import {m}\n" for m in mods
    )
    return {
        f"import kernel_cache{suffix}": (CHILD.format(setup="", stmt="import kernel_cache"), cwd),
        f"make_config{suffix}": (
            CHILD.format(
                setup="",
                stmt=f"from kernel_cache import load_plan, make_config\nmake_config({model!r})",
            ),
            cwd,
        ),
        f"engine imports after torch{suffix}": (
            CHILD.format(setup="import torch", stmt=engine),
            cwd,
        ),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--model", default="llama-3.2-1b", help="make_config's model (a preset)")
    p.add_argument(
        "--baseline",
        default=None,
        help="another checkout: also time its kernel_cache cases, interleaved",
    )
    p.add_argument("--out", default=str(OUT_DIR / "import_cost.json"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be >= 1")

    cases = {
        "python -c pass": (CHILD.format(setup="", stmt="pass"), ROOT),
        "import torch": (CHILD.format(setup="", stmt="import torch"), ROOT),
        **kernel_cache_cases(args.model, ROOT),
    }
    if args.baseline:
        base = Path(args.baseline).resolve()
        if not (base / "kernel_cache" / "__init__.py").is_file():
            raise SystemExit(f"--baseline {base}: not a checkout (no kernel_cache/__init__.py)")
        cases.update(kernel_cache_cases(args.model, base, " @baseline"))

    doc = header("import_cost")
    doc["machine"] = machine("cpu")
    doc["config"] = {
        "rounds": args.rounds,
        "model": args.model,
        "baseline": args.baseline,
        "cases": {name: code for name, (code, _) in cases.items()},
    }
    for code, cwd in cases.values():  # untimed: writes the .pyc files
        run_child(code, cwd)
    samples: dict[str, list[dict]] = {name: [] for name in cases}
    for r in range(args.rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in order:
            samples[name].append(run_child(*cases[name]))

    torch_s = [s["s"] for s in samples["import torch"]]
    results, rows = [], []
    for name, runs in samples.items():
        secs = [s["s"] for s in runs]
        ratios = [a / b for a, b in zip(secs, torch_s, strict=True)]
        res = {
            "case": name,
            "seconds": summary(secs),
            "process_wall_s": summary([s["wall_s"] for s in runs]),
            "ratio_to_import_torch": summary(ratios),
            "imports_torch": any(s["torch"] for s in runs),
        }
        results.append(res)
        rows.append(
            [
                name,
                fmt(res["seconds"], 1000, 1),
                fmt(res["process_wall_s"], 1000, 0),
                fmt(res["ratio_to_import_torch"], 100, 1),
                "yes" if res["imports_torch"] else "no",
            ]
        )
    doc["results"] = results
    print_table(
        f"Import cost, {args.rounds} rounds, fresh processes (load {os.getloadavg()[0]:.1f})",
        ["case", "ms in process", "process wall ms", "% of import torch", "torch imported"],
        rows,
    )
    out = write_json(args.out, doc)
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
