"""N cold warmups of one cache directory started together, against one alone.

Counts the compiler runs independently of warmup's reports: a ``CXX`` wrapper
logs every link of a package's ``wrapper.so`` (one per compile), and the
test suite's compile log (``KERNEL_CACHE_TEST_COMPILE_LOG``, written by
``tests/hooks/kc_testhooks.py``) records every AOTInductor compile. Then
checks the reports against those counts.

Usage (the tests' tiny plan, 16 processes; takes minutes on 2 cores)::

    python benchmarks/concurrent_warmups.py --processes 16 --out bench-out/concurrent.json

Prints and writes a JSON document: the plan, wall seconds of the single warmup
and of the N together, links and compile-log lines counted, the reports' sums,
and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--model",
    "llama-3.2-1b",
    "--max-model-len",
    "128",
    "--block-size",
    "64",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "128",
]


def _wrapper(tmp: Path, log: Path) -> Path:
    real = shutil.which(os.environ.get("CXX") or "g++")
    if not real:
        sys.exit("concurrent_warmups.py: needs a C++ compiler (g++ or $CXX)")
    w = tmp / "g++-counting"
    w.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in *.wrapper.so) '
        f'echo "$$ $a" >> {log}; break;; esac; done\n'
        f'exec {real} "$@"\n'
    )
    w.chmod(0o755)
    return w


def _run(n: int, tmp: Path, jobs: int) -> dict:
    cache, links, compiles = tmp / f"cache{n}", tmp / f"links{n}", tmp / f"compiles{n}"
    env = {
        **os.environ,
        "CXX": str(_wrapper(tmp, links)),
        "KERNEL_CACHE_TEST_COMPILE_LOG": str(compiles),
        # the test suite's hooks (tests/hooks/sitecustomize.py) write the compile log
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT / "tests" / "hooks"), str(ROOT), os.environ.get("PYTHONPATH")) if p
        ),
    }
    cmd = [sys.executable, "-m", "warmup.cli.main", "warmup", *TINY, "--cache-dir", str(cache)]
    cmd += ["--jobs", str(jobs), "--json", "--quiet"]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(n)
    ]
    outs = [p.communicate() for p in procs]
    wall = time.perf_counter() - t0
    reports = [json.loads(o) for o, _ in outs if o.strip()]

    def lines(p: Path) -> int:
        return len(p.read_text().splitlines()) if p.exists() else 0

    return {
        "processes": n,
        "jobs_each": jobs,
        "wall_s": round(wall, 1),
        "exit_codes": sorted({p.returncode for p in procs}),
        "variants": reports[0]["variants"] if reports else None,
        "links_counted": lines(links),
        "compile_log_lines": lines(compiles),
        "reported_compiled": sum(r["compiled"] for r in reports),
        "reported_compiler_runs": sum(r["compiler_runs"] for r in reports),
        "reported_failed": sum(len(r["failed"]) for r in reports),
        "per_process_s": sorted(r["seconds"] for r in reports),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=16)
    p.add_argument("--jobs", type=int, default=1, help="--jobs of each warmup (default 1)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.processes < 1 or args.jobs < 1:
        p.error("--processes and --jobs must be >= 1")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kc-concurrent-") as tmp:
        alone = _run(1, Path(tmp), args.jobs)
        together = _run(args.processes, Path(tmp), args.jobs)
    doc = {
        "plan": " ".join(TINY),
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "alone": alone,
        "together": together,
        "slowdown": round(together["wall_s"] / alone["wall_s"], 2),
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    ok = together["links_counted"] == together["variants"] == together["compile_log_lines"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
