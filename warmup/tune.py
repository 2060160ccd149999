"""``kernel-cache tune``: time launch-config candidates per variant and write a table.

For each chosen variant (``batched_decode`` on any device, ``paged_attention``
on CUDA, where it is the Triton prefill kernel):

1. Candidates (:func:`candidates`), the defaults first:
   ``batched_decode``: every ``num_kv_splits`` in ``--num-kv-splits`` (at most
   ``num_blocks``) times, on the CPU, every ``chunks_per_split`` in
   ``--chunks-per-split`` that divides the split (``blocks_per_chunk =
   ceil(num_blocks / num_kv_splits) / chunks_per_split``); ``paged_attention``:
   every tile of ``--block-m`` x ``--block-n`` x ``--num-warps`` x
   ``--num-stages`` that the kernel can run (``block_m`` from the GQA group up to
   the rows the query bucket fills, the shared memory within the H200's).
2. Every candidate is compiled through the normal warmup path into the artifact
   cache, under the key that holds its launch config (so a resumed tune, or a
   later ``warmup`` with the resulting table, compiles nothing twice). All
   compiles finish before any timing starts.
3. Correctness: each candidate's output on random inputs of the variant's
   shapes is compared with :func:`kernel_cache.kernels.reference.reference_decode`
   or, for prefill, :func:`~kernel_cache.kernels.reference.reference_attention`
   on the real query rows (tolerance :data:`warmup.check.verify.TOLERANCE`); a
   mismatch is never kept.
4. Timing, warm: each loaded artifact runs 3 times first; then ``--rounds``
   rounds, each timing every candidate once in a shuffled order, one sample
   being the mean of ``inner`` back-to-back calls (``inner`` chosen so that a
   sample of the defaults lasts about ``--target-ms``). Per candidate: median,
   min and max milliseconds per call, and the paired ratios
   ``default / candidate`` of each round (both measured within the same round,
   so a load change on a shared machine hits both).
5. The rule (:data:`RULE`): a candidate beats the default beyond noise when the
   median of its paired ratios is at least ``1 + --min-gain`` and their lower
   quartile is above 1 (it was faster in at least three rounds out of four).
   Of the candidates that match the reference and beat the default, the one
   with the lowest median time is kept; else the defaults are kept.

Each variant's measurement is stored as soon as it is done, as a JSON file
beside the artifacts (``<cache-dir>/tune/<key>.json``, :func:`save_result`),
under a key made of the default
artifact's key (kernel source, variant, geometry, dtype, device, versions), the
candidate list and the timing settings; an interrupted tune run again with the
same arguments reuses every finished variant and compiles nothing it has.

The output is a table in the bundled format (:mod:`kernel_cache.plan.tables`), one
entry per tuned variant (the defaults written out where they won; a prefill
entry names its ``query_len``), with the measurements under ``measured``.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from kernel_cache.config.engine import EngineConfig, config_to_cli
from kernel_cache.config.recipe import device_arch
from kernel_cache.errors import CompileError, ConfigError
from kernel_cache.kernels.tiles import (
    PREFILL_SMEM_BYTES,
    prefill_max_block_m,
    prefill_min_block_m,
    prefill_smem_bytes,
)
from kernel_cache.plan.buckets import PAGED_ATTENTION, Bucketer, KernelVariant
from kernel_cache.plan.keys import CacheKey
from kernel_cache.plan.launch import dtype_bytes, variant_defaults
from kernel_cache.plan.plan import Plan, PlanItem
from kernel_cache.plan.tables import TABLE_FORMAT, arch_family, check_launch, parse_table
from kernel_cache.store.tier import DiskTier, Tier, verify_entry

TUNE_FORMAT = "kc-tune1"

RULE = (
    "keep a candidate only if it matches the reference, the median of its per-round paired "
    "ratios default/candidate is >= 1 + min_gain and their lower quartile is > 1; of those, "
    "the lowest median time; otherwise the defaults"
)


class TuneSettings(BaseModel):
    """What is tried and how it is timed (keyed through the candidates and
    :data:`TIMING_FIELDS`: :func:`result_key`).

    ``target_ms``: milliseconds a timing sample of the defaults should last;
    ``min_gain``: the fraction a candidate must beat the defaults by (0.05 = 5 %);
    ``block_m`` ... ``num_stages``: the prefill tiles tried on CUDA (the
    defaults of :func:`~kernel_cache.kernels.tiles.cuda_prefill_defaults` are
    always tried too).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_kv_splits: tuple[int, ...] = (1, 2, 4)
    chunks_per_split: tuple[int, ...] = (1, 2, 4)
    block_m: tuple[int, ...] = (64, 128)
    block_n: tuple[int, ...] = (32, 64, 128)
    num_warps: tuple[int, ...] = (4, 8)
    num_stages: tuple[int, ...] = (2, 3)
    rounds: int = 15
    target_ms: float = 50.0
    min_gain: float = 0.05
    seed: int = 0

    def check(self) -> None:
        if self.rounds < 3:
            raise ConfigError(f"--rounds {self.rounds}: at least 3 rounds are needed")
        if not (math.isfinite(self.target_ms) and self.target_ms > 0):
            raise ConfigError(
                f"--target-ms {self.target_ms}: must be a finite number of milliseconds > 0"
            )
        if not 0 <= self.min_gain < 10:
            raise ConfigError(f"--min-gain {self.min_gain}: must be in [0, 10)")
        for name, vals in (
            ("--num-kv-splits", self.num_kv_splits),
            ("--chunks-per-split", self.chunks_per_split),
        ):
            if not vals or min(vals) < 1:
                raise ConfigError(f"{name} {vals}: a list of integers >= 1")
        for name in ("block_m", "block_n", "num_warps", "num_stages"):
            for v in getattr(self, name):
                check_launch(PAGED_ATTENTION, 1, {name: v}, f"--{name.replace('_', '-')}")


def candidates(variant: KernelVariant, settings: TuneSettings, config: EngineConfig) -> list[dict]:
    """The launch configs tried for ``variant``, defaults first, no duplicates.

    On CUDA (``config.device``) the Triton decode kernel takes only
    ``num_kv_splits``: one candidate per split count, ``--chunks-per-split`` is
    not used; ``paged_attention`` takes the tiles of :func:`prefill_candidates`."""
    if variant.kernel == PAGED_ATTENTION:
        return prefill_candidates(variant, settings, config)
    nb = variant.num_blocks
    cuda = config.device == "cuda"
    out = [variant_defaults(config, variant)]
    seen = {json.dumps(out[0], sort_keys=True)}
    for splits in sorted(set(settings.num_kv_splits)):
        if splits > nb:
            continue
        per_split = -(-nb // splits)
        for chunks in (1,) if cuda else sorted(set(settings.chunks_per_split)):
            if per_split % chunks:
                continue
            cfg = check_launch(
                variant.kernel,
                nb,
                {"num_kv_splits": splits, "blocks_per_chunk": per_split // chunks},
                f"candidate for {variant}",
            )
            k = json.dumps(cfg, sort_keys=True)
            if k not in seen:
                seen.add(k)
                out.append(cfg)
    return out


def prefill_candidates(
    variant: KernelVariant, settings: TuneSettings, config: EngineConfig
) -> list[dict]:
    """The CUDA prefill tiles tried for ``variant``: the defaults, then every
    combination of the settings' ``block_m``, ``block_n``, ``num_warps`` and
    ``num_stages`` with ``block_m`` at least the GQA group (padded to a power of
    two) and at most the rows the query bucket fills
    (:func:`~kernel_cache.kernels.tiles.prefill_max_block_m`), and an estimated
    shared memory (:func:`~kernel_cache.kernels.tiles.prefill_smem_bytes`) within
    :data:`~kernel_cache.kernels.tiles.PREFILL_SMEM_BYTES`."""
    out = [variant_defaults(config, variant)]
    low = prefill_min_block_m(config.num_queries_per_kv)
    top = prefill_max_block_m(variant.query_len, config.num_queries_per_kv)
    for bm, bn, warps, stages in itertools.product(
        sorted(set(settings.block_m)),
        sorted(set(settings.block_n)),
        sorted(set(settings.num_warps)),
        sorted(set(settings.num_stages)),
    ):
        smem = prefill_smem_bytes(bm, bn, stages, config.head_dim, dtype_bytes(config))
        if not low <= bm <= top or smem > PREFILL_SMEM_BYTES:
            continue
        cfg = {"block_m": bm, "block_n": bn, "num_stages": stages, "num_warps": warps}
        if cfg not in out:
            out.append(check_launch(PAGED_ATTENTION, variant.num_blocks, cfg, f"for {variant}"))
    return out


#: The settings that shape a measurement beyond its candidate list (which is
#: keyed itself, so the lists it came from, their order and the options a
#: device does not use are not).
TIMING_FIELDS = ("rounds", "target_ms", "min_gain", "seed")


def result_key(default_key: str, cands: list[dict], settings: TuneSettings) -> CacheKey:
    """The key a variant's tuning result is stored under: the default artifact's
    key, the candidates tried and the timing settings (:data:`TIMING_FIELDS`)."""
    return CacheKey(
        (
            ("tune_format", TUNE_FORMAT),
            ("default_artifact", default_key),
            ("candidates", json.dumps(cands, sort_keys=True)),
            ("timing", settings.model_dump_json(include=set(TIMING_FIELDS))),
        )
    )


def _stats(xs: list[float]) -> dict:
    return {
        "median_ms": round(statistics.median(xs) * 1e3, 4),
        "min_ms": round(min(xs) * 1e3, 4),
        "max_ms": round(max(xs) * 1e3, 4),
    }


def measure_variant(
    config: EngineConfig, items: list[PlanItem], tier: Tier, settings: TuneSettings
) -> dict:
    """Check and time every candidate of one variant (artifacts already in ``tier``).

    ``items``: the candidates, defaults first, each the variant under one launch
    config (:meth:`kernel_cache.plan.plan.Plan.with_launch`), keyed.

    Returns the JSON-ready result: ``variant``, ``config`` (kept), ``speedup``
    (default median / kept median), ``paired_ratio_median``, ``inner``,
    ``rounds``, ``candidates`` (per candidate: ``config``, median/min/max ms,
    ``ratio_median``, ``ratio_q25``, ``max_abs_err``, ``ok``, ``beats_default``).

    Raises:
        CompileError: a candidate's artifact is not in ``tier``.
        CorruptEntryError: one fails verification.
    """
    from kernel_cache.runtime.inputs import make_inputs
    from warmup.check.verify import TOLERANCE

    variant, cands = items[0].variant, [i.launch for i in items]
    runners = _load_candidates(config, items, tier)
    args = list(make_inputs(config, variant, seed=settings.seed + 1))
    errs = _errors(args, runners)
    samples, inner = _time_candidates(config, args, runners, settings)
    rows = _rows(cands, samples, errs, TOLERANCE[config.dtype], settings)
    winners = [r for r in rows if r["beats_default"]]
    kept = min(winners, key=lambda r: r["median_ms"]) if winners else rows[0]
    return {
        "variant": str(variant),
        "config": kept["config"],
        "default": cands[0],
        "speedup": round(rows[0]["median_ms"] / kept["median_ms"], 4),
        "paired_ratio_median": kept["ratio_median"],
        "default_ms": [rows[0][k] for k in ("median_ms", "min_ms", "max_ms")],
        "kept_ms": [kept[k] for k in ("median_ms", "min_ms", "max_ms")],
        "inner": inner,
        "rounds": settings.rounds,
        "candidates": rows,
        "default_ok": rows[0]["ok"],
    }


def _load_candidates(config: EngineConfig, items: list[PlanItem], tier: DiskTier) -> list:
    """The loaded runner of each item's artifact, in order.

    Raises:
        CompileError: an artifact is not in ``tier``.
        CorruptEntryError: one fails verification or the loader rejects it.
    """
    from kernel_cache.runtime.load import load_package
    from kernel_cache.store.lookup import current_entry

    runners = []
    for item in items:
        entry = current_entry(tier.get, item.hexdigest).entry  # the one for the files here
        if entry is None:
            raise CompileError(
                f"{item.variant} {item.launch}: the compiled candidate is not in the cache"
            )
        verify_entry(entry)
        runners.append(load_package(entry.data, config.device, entry.where, entry.key))
    return runners


def _errors(args: list, runners: list) -> list[float]:
    """Each runner's max abs difference from the independent reference on
    ``args`` (decode: every row; prefill: the real query rows)."""
    import torch

    from kernel_cache.kernels.reference import reference_attention, reference_decode

    rows = slice(None)
    with torch.no_grad():
        if len(args) == 6:  # paged_attention: query, caches, block table, seq_len, query_len
            q, kc, vc, bt, seq_len, query_len = args
            rows = slice(0, int(query_len[0]))
            ref = reference_attention(q[rows], kc, vc, bt, int(seq_len[0]))
        else:
            q, kc, vc, bt, lens = args
            ref = reference_decode(q, kc, vc, bt, lens.tolist())
    return [float((r.run(args)[0][rows].float() - ref.float()).abs().max()) for r in runners]


def _time_candidates(config: EngineConfig, args: list, runners: list, settings: TuneSettings):
    """Warm timing (module docstring, step 4): ``(samples, inner)`` where
    ``samples[i]`` are runner i's seconds per call, one per round."""
    import torch

    sync = torch.cuda.synchronize if config.device == "cuda" else (lambda: None)

    def timed(r, n: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            r.run(args)
        sync()
        return (time.perf_counter() - t0) / n

    for r in runners:  # warm: first calls allocate and fault pages in
        timed(r, 3)
    one = min(timed(runners[0], 1) for _ in range(3))
    inner = max(1, round(settings.target_ms / 1e3 / max(one, 1e-9)))
    rng = random.Random(settings.seed)
    samples: list[list[float]] = [[] for _ in runners]
    order = list(range(len(runners)))
    for _ in range(settings.rounds):
        rng.shuffle(order)
        for i in order:
            samples[i].append(timed(runners[i], inner))
    return samples, inner


def _rows(cands: list[dict], samples, errs, tol: float, settings: TuneSettings) -> list[dict]:
    """Per candidate: its timing, paired ratios against the defaults (the
    first), correctness and whether it beats the defaults (:data:`RULE`)."""
    rows = []
    base = samples[0]
    for cfg, xs, err in zip(cands, samples, errs, strict=True):
        ratios = [b / x for b, x in zip(base, xs, strict=True)]
        q25 = statistics.quantiles(ratios, n=4)[0]
        rmed = statistics.median(ratios)
        ok = err <= tol
        rows.append(
            {
                "config": cfg,
                **_stats(xs),
                "ratio_median": round(rmed, 4),
                "ratio_q25": round(q25, 4),
                "max_abs_err": err,
                "ok": ok,
                "beats_default": bool(
                    ok and cfg != cands[0] and rmed >= 1 + settings.min_gain and q25 > 1.0
                ),
            }
        )
    return rows


def _check_variants(config: EngineConfig, variants: list[KernelVariant]) -> None:
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
    from warmup.build.planner import compile_items

    t0 = time.perf_counter()
    settings = TuneSettings() if settings is None else settings
    settings.check()
    variants = list(dict.fromkeys(variants))
    _check_variants(config, variants)
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
            echo(f"measured {v}: kept {_fmt_cfg(r['config'])}, x{r['speedup']:.3f}")
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


def _fmt_cfg(cfg: dict) -> str:
    if "num_kv_splits" not in cfg:  # the prefill tiles
        return " ".join(f"{k}={v}" for k, v in sorted(cfg.items()))
    return f"splits={cfg['num_kv_splits']} chunk={cfg['blocks_per_chunk']}"


def _row(r: dict) -> str:
    d, k = r["default_ms"], r["kept_ms"]
    src = " (cached)" if r.get("from_cache") else ""
    return (
        f"  {r['variant']:<24} default {d[0]:8.3f} ms [{d[1]:.3f}-{d[2]:.3f}]  kept "
        f"{_fmt_cfg(r['config']):<20} {k[0]:8.3f} ms [{k[1]:.3f}-{k[2]:.3f}]  "
        f"x{r['speedup']:.3f}{src}"
    )


def table_entry(config: EngineConfig, variant: KernelVariant, result: dict) -> dict:
    """One tuned variant's table entry: its lookup key (with ``query_len`` for
    prefill), the kept config and the measurements."""
    measured = {k: result[k] for k in ("speedup", "paired_ratio_median", "default_ms")}
    keep = ("config", "median_ms", "min_ms", "max_ms", "ratio_median", "ratio_q25", "ok")
    measured |= {
        "kept_ms": result["kept_ms"],
        "inner": result["inner"],
        "candidates": [{k: c[k] for k in keep} for c in result["candidates"]],
    }
    entry = {
        "kernel": variant.kernel,
        "head_dim": config.head_dim,
        "num_queries_per_kv": config.num_queries_per_kv,
        "num_kv_heads": config.num_kv_heads,
        "num_seqs": variant.num_seqs,
        "num_blocks": variant.num_blocks,
    }
    if variant.kernel == PAGED_ATTENTION:
        entry["query_len"] = variant.query_len
    return entry | {"config": result["config"], "measured": measured}


def make_table(
    config: EngineConfig, env: dict, variants: list[KernelVariant], results: list[dict], settings
) -> dict:
    """The table document (bundled format) for the tuned variants."""
    import torch

    return {
        "format": TABLE_FORMAT,
        "device_arch": arch_family(env["device_arch"]),
        "about": {
            "tool": "kernel-cache tune",
            "engine": config_to_cli(config),
            "model": config.model,
            "dtype": config.dtype,
            "block_size": config.block_size,
            "device": env["device"],
            "device_arch": env["device_arch"],
            "torch": torch.__version__,
            "cxx": env["cxx"],
            "cpus": os.cpu_count(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "settings": settings.model_dump(mode="json"),
            "timing": "warm; per round every candidate once in shuffled order; a sample is "
            "the mean of `inner` back-to-back calls; ms are per call (median, min, max over "
            "rounds); ratios are default/candidate within a round",
            "rule": RULE,
        },
        "entries": [table_entry(config, v, r) for v, r in zip(variants, results, strict=True)],
    }


def format_table(doc: dict) -> str:
    """JSON text with one line per entry (readable, and diffs name the entry)."""
    head = {k: v for k, v in doc.items() if k != "entries"}
    lines = ["{"]
    for k, v in head.items():
        lines.append(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)},")
    lines.append(' "entries": [')
    rows = [json.dumps(e) for e in doc.get("entries", [])]
    lines += [f"  {r}," for r in rows[:-1]] + [f"  {r}" for r in rows[-1:]]
    lines += [" ]", "}"]
    return "\n".join(lines) + "\n"


def _out_error(out: Path, e: OSError) -> ConfigError:
    return ConfigError(
        f"--out {str(out)!r}: cannot write the table there ({e.strerror or e}); "
        "give a writable file path whose parent is a directory (or can be created)"
    )


def check_out(out: str | Path) -> Path:
    """Check before any compile that the table can be written to ``out``: its
    parent directory exists or can be created, ``out`` is not a directory and a
    file can be created beside it.

    Raises:
        ConfigError: naming ``--out``, the path and the fix.
    """
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {str(out)!r}: is a directory; give the table's file path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.with_name(f".{out.name}.{os.getpid()}.probe")
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise _out_error(out, e) from None
    return out


def write_table(doc: dict, out: str | Path) -> Path:
    """Write the table atomically (a temporary file beside it, then rename).

    Raises:
        ConfigError: ``out`` cannot be written (the temporary file is removed),
            or ``doc`` is not a valid table (:class:`~kernel_cache.plan.tables.LaunchTableDoc`).
    """
    parse_table(doc, f"--out {str(out)!r} (the tuned table)")
    out = check_out(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(format_table(doc))
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _out_error(out, e) from None
    return out


def print_summary(report: dict, out: Path, file=sys.stdout) -> None:
    print(
        f"tune: {report['variants']} variants ({report['measured']} measured, "
        f"{report['from_cache']} from the tuning cache), {report['compiled']} candidates "
        f"compiled, {report['seconds']:.1f} s -> {out}",
        file=file,
    )
    for r in report["results"]:
        print(_row(r), file=file)


#: The prefill tile options of ``tune`` and their defaults (:class:`TuneSettings`).
PREFILL_TILE_OPTIONS = {
    name: ",".join(map(str, TuneSettings.model_fields[name].default))
    for name in ("block_m", "block_n", "num_warps", "num_stages")
}


def cmd_tune(args) -> int:
    """``kernel-cache tune``: see the module docstring."""
    from kernel_cache.errors import KernelCacheError
    from kernel_cache.plan.buckets import parse_bucket_list
    from warmup.cli.options import _cache_dir, config_from_args

    cfg = config_from_args(args)
    if args.jobs < 1:
        raise KernelCacheError(f"--jobs {args.jobs}: must be >= 1")
    variants = [
        KernelVariant.parse(t, "--variants") for a in args.variants for t in a.split(",") if t
    ]
    tiles = {
        name: parse_bucket_list(getattr(args, name), f"--{name.replace('_', '-')}", example)
        for name, example in PREFILL_TILE_OPTIONS.items()
    }
    settings = TuneSettings(
        num_kv_splits=parse_bucket_list(args.num_kv_splits, "--num-kv-splits", "1,2,4"),
        chunks_per_split=parse_bucket_list(args.chunks_per_split, "--chunks-per-split", "1,2,4"),
        **tiles,
        rounds=args.rounds,
        target_ms=args.target_ms,
        min_gain=args.min_gain,
    )
    settings.check()
    _check_variants(cfg, variants)
    # a device that cannot be used (cuda without a GPU) is refused before --out's
    # directories are created
    device_arch(cfg.device, cfg.cpu_target)
    check_out(args.out)  # before any compiling and timing, which can take hours
    echo = None if args.json else (lambda m: print(m, flush=True))
    report = tune(
        cfg, variants, _cache_dir(args), settings, jobs=args.jobs, progress=not args.json,
        echo=echo,
    )  # fmt: skip
    out = write_table(report["table"], args.out)
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "table"} | {"out": str(out)}))
    else:
        print_summary(report, out)
    return 0


def add_tune_command(sub) -> None:
    """Register ``tune`` on the ``kernel-cache`` subparsers."""
    from warmup.cli.options import CACHE_DIR_HELP, engine_options, jobs_option

    st = sub.add_parser(
        "tune",
        help="time launch-config candidates of decode (and CUDA prefill) variants, write a "
        "launch table",
        description="Compile the candidates of each variant, check them against the "
        "reference, time them warm (medians of interleaved rounds) and write the fastest "
        "that beats the defaults beyond noise to a table in the bundled format "
        "(use it with KERNEL_CACHE_TUNING=FILE). Results are cached; a rerun resumes.",
    )
    engine_options(st)
    st.add_argument(
        "--variants",
        nargs="+",
        required=True,
        metavar="KERNEL:QUERY:BLOCKS:SEQS",
        help="variants of the plan, e.g. batched_decode:1:32:8; on CUDA also "
        "paged_attention ones (the prefill tiles), e.g. paged_attention:512:32:1",
    )
    st.add_argument("--out", required=True, help="the table to write (JSON)")
    st.add_argument("--cache-dir", default=None, metavar="DIR", help=CACHE_DIR_HELP)
    jobs_option(st)
    st.add_argument("--num-kv-splits", default="1,2,4", help="split counts to try (default 1,2,4)")
    st.add_argument(
        "--chunks-per-split",
        default="1,2,4",
        help="online-softmax steps per split to try (default 1,2,4)",
    )
    for name, default in PREFILL_TILE_OPTIONS.items():
        st.add_argument(
            f"--{name.replace('_', '-')}",
            default=default,
            help=f"CUDA prefill: {name} values to try (default {default})",
        )
    st.add_argument("--rounds", type=int, default=15, help="timing rounds (default 15)")
    st.add_argument(
        "--target-ms", type=float, default=50.0, help="ms per timing sample (default 50)"
    )
    st.add_argument(
        "--min-gain",
        type=float,
        default=0.05,
        help="fraction a candidate must beat the defaults by (default 0.05)",
    )
    st.add_argument("--json", action="store_true", help="print the report as JSON")
    st.set_defaults(func=cmd_tune)
