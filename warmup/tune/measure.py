"""Check and time the candidates of one variant (:func:`measure_variant`;
steps 3 to 5 of :mod:`warmup.tune`)."""

from __future__ import annotations

import random
import statistics
import time

from kernel_cache.config.engine import EngineConfig
from kernel_cache.errors import CompileError
from kernel_cache.plan.plan import PlanItem
from kernel_cache.store.disk_tier import DiskTier, Tier, verify_entry
from warmup.tune.candidates import TuneSettings


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
    from kernel_cache.runtime.package import load_package
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
