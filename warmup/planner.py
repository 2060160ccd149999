"""Warmup: compile every missing variant of a plan and publish it to the cache.

For each variant: build its key, skip it if a verified entry is cached, else
compile it in a worker process and publish bytes + JSON metadata atomically.
Compiles are single-flight per key across processes: a ``filelock.FileLock``
per key under ``<cache>/locks/``; check, lock, check again, compile, publish.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

from kernel_cache.buckets import Bucketer, KernelVariant
from kernel_cache.config import EngineConfig
from kernel_cache.errors import CompileError, CorruptEntryError
from kernel_cache.keys import build_key, environment
from kernel_cache.store import DiskTier, make_meta, verify_entry

log = logging.getLogger("kernel_cache.warmup")


def _cached_ok(tier: DiskTier, key: str) -> bool:
    """True if a verified entry is cached; a corrupt one is deleted (a miss)."""
    try:
        entry = tier.get(key)
        if entry is None:
            return False
        verify_entry(entry)
        return True
    except CorruptEntryError as e:
        log.warning("removing corrupt entry for recompilation: %s", e)
        tier.delete(key)
        return False


def compile_and_publish(config_json: str, variant_json: str, cache_dir: str) -> dict:
    """Worker body (runs in a child process): lock, check, compile, publish.

    Returns a JSON-ready dict: ``variant``, ``key``, ``status`` (compiled, cached
    or failed), ``seconds``, ``timings`` and, for a failure, ``error``.
    """
    from filelock import FileLock

    from warmup.compiler import compile_variant

    config = EngineConfig.model_validate_json(config_json)
    variant = KernelVariant.model_validate_json(variant_json)
    tier = DiskTier(cache_dir)
    key = build_key(config, variant)
    locks = Path(cache_dir) / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = {"variant": str(variant), "key": key.hexdigest}
    try:
        with FileLock(str(locks / f"{key.hexdigest}.lock")):
            if _cached_ok(tier, key.hexdigest):
                return {**result, "status": "cached", "seconds": time.perf_counter() - t0}
            data, timings = compile_variant(config, variant)
            meta = make_meta(key, str(variant), data, timings["total_s"], timings=timings)
            tier.put(key.hexdigest, data, meta)
        return {
            **result,
            "status": "compiled",
            "seconds": time.perf_counter() - t0,
            "timings": timings,
        }
    except CompileError as e:
        return {**result, "status": "failed", "error": str(e), "seconds": time.perf_counter() - t0}
    finally:
        tier.close()


def warmup(
    config: EngineConfig,
    cache_dir: str | Path,
    *,
    jobs: int = 1,
    progress: bool = True,
    variants: list[KernelVariant] | None = None,
    max_size: int | None = None,
) -> dict:
    """Compile what is missing from the plan, skip what is cached.

    Args:
        config: the engine configuration; its :class:`Bucketer` gives the plan.
        cache_dir: the local cache directory.
        jobs: worker processes compiling in parallel (>= 1).
        progress: show a progress bar on stderr.
        variants: a subset of the plan (default: all of it).
        max_size: a size limit in artifact bytes (``--max-size`` or
            ``$KERNEL_CACHE_MAX_SIZE``): before and after compiling, entries
            of other plans are removed, least recently used first
            (:func:`kernel_cache.housekeeping.gc`), never one of this plan.

    Returns:
        ``{"variants", "compiled", "cached", "failed": [{"variant", "error"}],
        "seconds", "fingerprint", "results": [...]}``, plus with ``max_size``
        ``"gc": {"removed", "removed_bytes", "after_bytes", "max_size",
        "under_limit"}`` (``under_limit`` False: this plan alone is larger).
    """
    from kernel_cache import housekeeping, usage

    t0 = time.perf_counter()
    bucketer = Bucketer(config)
    plan = list(bucketer.variants if variants is None else variants)
    tier = DiskTier(cache_dir)
    env = environment(config.device)
    todo, cached = [], []
    for v in plan:
        key = build_key(config, v, env).hexdigest
        (cached if _cached_ok(tier, key) else todo).append(v)
    keep = housekeeping.plan_digests(config) if max_size is not None else set()
    first = None
    if max_size is not None:  # make room before compiling
        first = housekeeping.gc(tier, max_size, keep)
    tier.close()
    results = [{"variant": str(v), "status": "cached"} for v in cached]
    if todo:
        results += _run_pool(config, todo, str(cache_dir), jobs, progress, len(plan), len(cached))
    usage.record(
        cache_dir,
        hits=[build_key(config, v, env).hexdigest for v in cached],
        misses=sum(r["status"] == "compiled" for r in results),
    )
    gc_report = None
    if max_size is not None:
        tier = DiskTier(cache_dir)
        try:
            gc_report = housekeeping.gc(tier, max_size, keep)
        finally:
            tier.close()
        gc_report["removed"] = first["removed"] + gc_report["removed"]
        gc_report["removed_bytes"] = sum(r["size"] for r in gc_report["removed"])
        gc_report["before_bytes"] = first["before_bytes"]
    failed = [
        {"variant": r["variant"], "error": r.get("error", "")}
        for r in results
        if r["status"] == "failed"
    ]
    return {
        "variants": len(plan),
        "compiled": sum(r["status"] == "compiled" for r in results),
        "cached": sum(r["status"] == "cached" for r in results),
        "failed": failed,
        "seconds": round(time.perf_counter() - t0, 3),
        "fingerprint": bucketer.fingerprint(),
        "results": results,
        **({"gc": gc_report} if gc_report is not None else {}),
    }


def _run_pool(config, todo, cache_dir, jobs, progress, total, done0) -> list[dict]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cfg_json = config.model_dump_json()
    ctx = multiprocessing.get_context("spawn")
    results = []
    bar = Progress(
        TextColumn("[bold]warmup[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=Console(stderr=True),
        disable=not progress,
        transient=False,
    )
    with bar, ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx) as pool:
        task = bar.add_task("", total=total, completed=done0)
        futs = {
            pool.submit(compile_and_publish, cfg_json, v.model_dump_json(), cache_dir): v
            for v in todo
        }
        pending = set(futs)
        while pending:
            running = [str(futs[f]) for f in pending if f.running()][:3]
            bar.update(task, description="compiling " + ", ".join(running))
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for f in done:
                v = futs[f]
                try:
                    r = f.result()
                except Exception as e:  # a worker died (segfault, OOM kill)
                    r = {
                        "variant": str(v),
                        "status": "failed",
                        "error": f"worker process died: {type(e).__name__}: {e}",
                    }
                results.append(r)
                if r["status"] == "failed":
                    bar.console.print(f"[red]failed[/] {r['variant']}: {r['error']}")
                bar.advance(task)
        bar.update(task, description="done")
    return results
