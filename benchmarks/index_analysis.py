"""Inductor's CPU stride analysis with torch's cache and with the one a warmup
worker keeps across its compiles (``warmup.torch_compat.index_analysis_kept``).

    python benchmarks/index_analysis.py [--out FILE]

Three fresh processes each compile a sequence of the default plan's prefill
variants with ``warmup.builder.compiler.compile_variant``, as a warmup worker
does (run recorder included; precompiled headers built before the first
measured compile, in a process of their own):

* ``torch``: ``paged_attention:512:2:1`` then ``:512:4:1``, torch's 128-entry
  cache alone (the worker's block replaced by a no-op);
* ``kept``: the same two, the worker's kept cache;
* ``kept, other first``: ``paged_attention:1024:8:1`` then ``:512:4:1``, kept;
* ``kept and on disk, first process`` and ``..., next process``: the first two
  again in two processes, each with the kept cache and the stride results the
  folder keeps (``warmup.builder.index_strides``): the first process writes
  them, the next reads them. The other sequences keep nothing on disk.

Per compile: process CPU seconds (user + system) and the compiler's (reaped
children), CPU seconds inside the analysis itself (``stride_at_vec_range``
computing a result, cache misses of every layer), the number of distinct
``(index, var, vec_length)`` it was asked for, and the package's sha256 (the
same variant's must be equal in every sequence). JSON in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from _common import OUT_DIR, header, inductor_env, machine, print_table, run_json_child, write_json

SEQUENCES = {
    "torch": ("torch", ["paged_attention:512:2:1", "paged_attention:512:4:1"]),
    "kept": ("kept", ["paged_attention:512:2:1", "paged_attention:512:4:1"]),
    "kept, other first": ("kept", ["paged_attention:1024:8:1", "paged_attention:512:4:1"]),
    "kept and on disk, first process": (
        "disk",
        ["paged_attention:512:2:1", "paged_attention:512:4:1"],
    ),
    "kept and on disk, next process": (
        "disk",
        ["paged_attention:512:2:1", "paged_attention:512:4:1"],
    ),
}
WARM_HEADERS = "batched_decode:1:1:4"


def child(mode: str, variants: list[str], pch: str) -> None:
    """Compile ``variants`` in this process; print one JSON line."""
    import contextlib
    import functools
    import hashlib
    import time

    from torch._inductor.codegen import cpp

    import warmup.builder.compiler as compiler
    from kernel_cache.config.engine import DEFAULT_MODEL, make_config
    from kernel_cache.plan.buckets import KernelVariant

    real = cpp.stride_at_vec_range.__wrapped__
    spent = {"cpu": 0.0, "keys": set()}

    def timed(index, var, vec_length=None):
        t = time.process_time()
        try:
            return real(index, var, vec_length)
        finally:
            spent["cpu"] += time.process_time() - t
            spent["keys"].add((index, var, vec_length))

    cpp.stride_at_vec_range = functools.lru_cache(maxsize=128)(timed)  # torch's own, timed
    if mode == "torch":
        compiler.torch_compat.index_analysis_kept = lambda *a: contextlib.nullcontext()
    if mode != "disk":  # no results read or written on disk
        compiler.index_strides.load = lambda folder: None
    cfg = make_config(DEFAULT_MODEL, use_env=False)
    rows = []
    for s in variants:
        spent["cpu"], spent["keys"] = 0.0, set()
        t0 = os.times()
        data, _, _ = compiler.compile_variant(cfg, KernelVariant.parse(s), pch_dir=pch)
        t1 = os.times()
        rows.append(
            {
                "variant": s,
                "process_cpu_s": (t1.user + t1.system) - (t0.user + t0.system),
                "compiler_cpu_s": (t1.children_user + t1.children_system)
                - (t0.children_user + t0.children_system),
                "analysis_cpu_s": spent["cpu"],
                "analysis_distinct_computed": len(spent["keys"]),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    print(json.dumps({"mode": mode, "rows": rows}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(OUT_DIR / "index_analysis.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        child(spec["mode"], spec["variants"], spec["pch"])
        return 0
    from kernel_cache.config.recipe import HASH_SEED

    at_start = machine("cpu")
    with tempfile.TemporaryDirectory(prefix="kc-index-analysis-") as work:
        env = {**inductor_env(Path(work) / "inductor"), "PYTHONHASHSEED": str(HASH_SEED)}
        pch = str(Path(work) / "pch")
        me = [sys.executable, str(Path(__file__).resolve()), "--child"]
        run_json_child(
            [*me, json.dumps({"mode": "kept", "variants": [WARM_HEADERS], "pch": pch})], env
        )
        results = {}
        for name, (mode, variants) in SEQUENCES.items():
            print(f"{name}: {', '.join(variants)} ...", file=sys.stderr, flush=True)
            spec = {"mode": mode, "variants": variants, "pch": pch}
            results[name] = run_json_child([*me, json.dumps(spec)], env)["rows"]
    shas = {}
    for rows in results.values():
        for r in rows:
            shas.setdefault(r["variant"], set()).add(r["sha256"])
    doc = header("index_analysis")
    doc["machine"] = at_start
    doc["results"] = results
    doc["same_bytes"] = {v: len(s) == 1 for v, s in shas.items()}
    out = write_json(args.out, doc)
    print_table(
        "Stride analysis: torch's cache against the kept one (CPU seconds)",
        ["sequence", "variant", "process", "compiler", "analysis", "distinct computed", "sha256"],
        [
            [
                name,
                r["variant"],
                f"{r['process_cpu_s']:.2f}",
                f"{r['compiler_cpu_s']:.2f}",
                f"{r['analysis_cpu_s']:.2f}",
                r["analysis_distinct_computed"],
                r["sha256"][:12],
            ]
            for name, rows in results.items()
            for r in rows
        ],
    )
    print(f"same bytes per variant in every sequence: {doc['same_bytes']}")
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
