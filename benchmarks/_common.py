"""Shared helpers of the benchmarks: statistics, the machine, tables, JSON.

Every benchmark prints a table and writes one JSON document with the same
top-level fields: ``benchmark``, ``argv``, ``machine``, ``config`` (what ran)
and ``results``. Timings are medians over repeats with min and max, because the
machines these run on are shared and noisy; ratios are taken inside one run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Default output folder (git-ignored).
OUT_DIR = ROOT / "bench-out"
#: The Azure LLM inference trace beside the checkout (CC BY 4.0, Splitwise, ISCA 2024).
DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "azure-llm-trace-2023" / "conv.csv"
#: The kernel-cache directory the benchmarks share (content-addressed, so one
#: directory serves every benchmark and a re-run compiles nothing).
DEFAULT_CACHE = OUT_DIR / "kernel-cache"


def cpu_children() -> float:
    """CPU seconds of this process's finished (reaped) child processes."""
    t = os.times()
    return t.children_user + t.children_system


def cpu_all() -> float:
    """CPU seconds of this process and its finished (reaped) children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def summary(values) -> dict:
    """``{"median", "min", "max", "n"}`` of a list of numbers (empty: all None)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
    }


def fmt(s: dict, scale: float = 1.0, digits: int = 3) -> str:
    """``median (min-max)`` of a :func:`summary`, each value times ``scale``."""
    if s.get("median") is None:
        return "-"
    if s["n"] == 1:
        return f"{s['median'] * scale:.{digits}f}"
    return (
        f"{s['median'] * scale:.{digits}f} "
        f"({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine(device: str = "cpu") -> dict:
    """What the numbers were measured on: CPU, cores, memory, load, versions."""
    import torch

    from kernel_cache.plan.keys import cxx_compiler_id, device_arch

    doc = {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_gib": _mem_gib(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cxx": cxx_compiler_id(),
        "device": device,
        "device_arch": device_arch(device),
    }
    if device == "cuda":
        doc["gpu"] = torch.cuda.get_device_name()
    return doc


def sync(device: str) -> None:
    """Wait for queued device work (a no-op on the CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def write_json(path: str | os.PathLike, doc: dict) -> Path:
    """Write ``doc`` (plus the load average at the end) to ``path``; returns it."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    doc.setdefault("machine", {})["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    p.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return p


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    """A table on stdout (rich), wide enough not to wrap numbers."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*(str(x) for x in r))
    Console(width=max(100, sum(len(c) + 14 for c in columns))).print(t)


def run_json_child(cmd: list[str], env: dict | None = None, timeout: float = 3600) -> dict:
    """Run a child Python process that prints one JSON line last; return it with
    ``process_wall_s`` (spawn to exit, as the parent saw it) added.

    Raises:
        RuntimeError: the child failed (its stderr tail is in the message).
    """
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:3])} ... exited {proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    doc["process_wall_s"] = wall
    return doc


def pick_variants(variants, n: int | None) -> list:
    """``n`` variants spread evenly over the plan's list (all of them when n is None)."""
    if n is None or n >= len(variants):
        return list(variants)
    if n < 1:
        raise SystemExit(f"--variants {n}: must be >= 1")
    return [variants[(i * len(variants)) // n] for i in range(n)]


def inductor_env(d: Path) -> dict:
    """Environment that points every torch compile cache at ``d`` (created).

    ``TORCHINDUCTOR_CACHE_DIR`` moves Inductor's cache, but in torch 2.13 the
    precompiled C++ headers stay in ``<tempdir>/torchinductor_<user>/precompiled_headers``
    (``torch._inductor.codecache._HEADER_DIR``), shared by every process of the
    machine; ``TMPDIR`` moves the temp dir and so those headers too.
    """
    tmp = Path(d) / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(d),
        "TRITON_CACHE_DIR": str(Path(d) / "triton"),
        "TMPDIR": str(tmp),
    }


def header(name: str, argv: list[str] | None = None) -> dict:
    return {"benchmark": name, "argv": list(sys.argv if argv is None else argv)}


def nearest_rank(xs, p: float) -> float:
    """The ``p``-th percentile of ``xs`` by the nearest-rank method (a value of ``xs``)."""
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def engine_ready(spec_json: str):
    """A child of :func:`start_together` (``--engine SPEC``, SPEC a JSON object with
    ``launched``, the ``time.time()`` of its launch, and ``config``, an
    ``EngineConfig`` as JSON): import the runtime, print ``ready``, wait for ``go``.
    Call it after the engine's other imports, so they count in ``import_s``.

    Returns:
        ``(spec, config, import_s)``, import_s in seconds from launch to ready;
        None when the line read is not ``go``.
    """
    from kernel_cache.config.engine import EngineConfig

    spec = json.loads(spec_json)
    cfg = EngineConfig.model_validate_json(spec["config"])
    import_s = time.time() - float(spec["launched"])
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return None
    return spec, cfg, import_s


def start_together(
    cmds: list[list[str]], envs: list[dict], log_dir: str | os.PathLike, timeout: float
) -> list[dict]:
    """Start one process per command and let them go at once; their JSON results.

    The protocol of a child: import what it needs, print ``ready``, read one
    line from stdin and go on only if it is ``go``, print one JSON line last.
    Every child is started, then each one's ``ready`` awaited (the barrier:
    Python and torch imports are behind it), then ``go`` is written to all.
    ``envs[i]`` is child ``i``'s whole environment; its stderr goes to
    ``log_dir/engine<i>.err``.

    Raises:
        RuntimeError: a child did not get ready or failed (its stderr tail is in
            the message), or ``timeout`` seconds passed in all. Every child still
            running is killed.
    """
    log_dir = Path(log_dir)
    procs, logs = [], []

    def tail(i: int) -> str:
        logs[i].seek(0)
        return logs[i].read()[-3000:]

    try:
        for i, (cmd, env) in enumerate(zip(cmds, envs, strict=True)):
            logs.append(open(log_dir / f"engine{i}.err", "w+"))
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=logs[-1],
                    text=True,
                    cwd=ROOT,
                    env=env,
                )
            )
        deadline = time.monotonic() + timeout
        for i, p in enumerate(procs):  # every child imported and waiting: the barrier
            line = p.stdout.readline().strip()
            if line != "ready" or time.monotonic() > deadline:
                raise RuntimeError(f"engine {i} did not get ready: {line!r}\n{tail(i)}")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for i, p in enumerate(procs):
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"engine {i} failed (exit {p.returncode}):\n{tail(i)}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for f in logs:
            f.close()
