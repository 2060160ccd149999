"""``tune()``: compile every candidate through the warmup path, measure each
variant once (its result stored beside the artifacts, :func:`save_result`, so a
rerun resumes) and return the table and a report."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from kernel_cache.config.engine import EngineConfig, config_to_cli
from kernel_cache.errors import CompileError, ConfigError
from kernel_cache.plan.buckets import PAGED_ATTENTION, Bucketer, KernelVariant
from kernel_cache.plan.keys import CacheKey
from kernel_cache.plan.plan import Plan, PlanItem
from kernel_cache.store.disk_tier import DiskTier
from warmup.tune.candidates import TUNE_FORMAT, TuneSettings, candidates, result_key
from warmup.tune.measure import measure_variant
from warmup.tune.table import fmt_cfg, make_table


def check_variants(config: EngineConfig, variants: list[KernelVariant]) -> None:
    """Raises ConfigError: a variant not in the plan, or a ``paged_attention``
    variant on the CPU (whose kernel takes no launch parameters)."""
    b = Bucketer(config)
    plan = set(b.variants)
    for v in variants:
        if v.kernel == PAGED_ATTENTION and config.device != "cuda":
            raise ConfigError(
                f"--variants {v}: on the CPU paged_attention has no launch parameters to "
                "tune; give batched_decode variants (prefill tiles are tuned with --device cuda)"
            )
        if v not in plan:
            raise ConfigError(
                f"--variants {v}: not a variant of the plan (num_blocks buckets "
                f"{list(b.num_blocks_buckets)}, num_seqs buckets {list(b.num_seqs_buckets)}, "
                f"query buckets {list(b.query_buckets)}); list them with: kernel-cache plan "
                + config_to_cli(config)
            )


def _result_path(results_dir: Path, key: CacheKey) -> Path:
    return Path(results_dir) / f"{key.hexdigest}.json"


def load_result(results_dir: str | Path, key: CacheKey) -> dict | None:
    """The stored measurement under ``key`` (:func:`result_key`), or None if
    there is none or it cannot be read (a damaged one is removed: measured again)."""
    path = _result_path(Path(results_dir), key)
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        doc = None
    if isinstance(doc, dict) and doc.get("result_key") == key.hexdigest:
        return doc["result"]
    path.unlink(missing_ok=True)
    return None


def save_result(results_dir: str | Path, key: CacheKey, result: dict) -> Path:
    """Store one variant's measurement (a JSON file ``<results_dir>/<key>.json``,
    written to a temporary file beside it and renamed, so a reader sees all of
    it or none). The file names its key, so a file copied under another name
    is not taken for that key's result.

    Raises:
        OSError: the directory cannot be written.
    """
    path = _result_path(Path(results_dir), key)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"result_key": key.hexdigest, "tune_format": TUNE_FORMAT, "result": result}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def tune(
    config: EngineConfig,
    variants: list[KernelVariant],
    cache_dir: str | Path,
    settings: TuneSettings | None = None,
    *,
    jobs: int = 1,
    progress: bool = True,
    echo=None,
) -> dict:
    """Tune ``variants`` (see the module docstring) and return the table and a report.

    Returns: ``{"table": <table doc>, "variants", "measured", "from_cache",
    "compiled", "failed", "seconds", "results": [...]}``.

    Raises:
        ConfigError: a variant that is not in the plan, a ``paged_attention``
            variant on the CPU, or bad settings.
        CompileError: a candidate failed to compile.
    """
    from warmup.builder.planner import compile_items

    t0 = time.perf_counter()
    settings = TuneSettings() if settings is None else settings
    settings.check()
    variants = list(dict.fromkeys(variants))
    check_variants(config, variants)
    echo = echo or (lambda msg: None)
    plan = Plan.build(config, log_launch=False)
    cands = {
        v: [plan.with_launch(v, cfg) for cfg in candidates(v, settings, config)] for v in variants
    }
    results_dir = Path(cache_dir) / "tune"
    keys = {v: _result_key(cands[v], settings) for v in variants}
    done = _cached_results(results_dir, keys)
    todo = [v for v in variants if v not in done]
    items = [item for v in todo for item in cands[v]]
    echo(
        f"tune: {len(variants)} variants, {len(done)} measured before (cached), "
        f"{len(items)} candidate artifacts to check"
    )
    comp = compile_items(config, cache_dir, items, jobs=jobs, progress=progress)
    if comp["failed"]:
        f = comp["failed"][0]
        raise CompileError(f"tune: candidate of {f['variant']} failed to compile: {f['error']}")
    art = DiskTier(cache_dir)
    try:
        for v in todo:
            r = measure_variant(config, cands[v], art, settings)
            save_result(results_dir, keys[v], r)
            done[v] = {**r, "from_cache": False}
            echo(f"measured {v}: kept {fmt_cfg(r['config'])}, x{r['speedup']:.3f}")
    finally:
        art.close()
    ordered = [done[v] for v in variants]
    return {
        "table": make_table(config, plan.env, variants, ordered, settings),
        "variants": len(variants),
        "measured": sum(not r["from_cache"] for r in ordered),
        "from_cache": sum(r["from_cache"] for r in ordered),
        "compiled": comp["compiled"],
        "failed": comp["failed"],
        "seconds": round(time.perf_counter() - t0, 3),
        "results": ordered,
    }


def _result_key(cands: list[PlanItem], settings: TuneSettings) -> CacheKey:
    """:func:`result_key` of a variant's candidates (the defaults first)."""
    return result_key(cands[0].hexdigest, [i.launch for i in cands], settings)


def _cached_results(results_dir: Path, keys: dict) -> dict:
    """``{variant: result}`` of the variants (``keys``: variant -> result key)
    measured before (:func:`load_result`)."""
    done = {}
    for v, key in keys.items():
        r = load_result(results_dir, key)
        if r is not None:
            done[v] = {**r, "from_cache": True}
    return done
