"""Split a plan into N disjoint shards of about equal expected compile time.

``kernel-cache warmup --shard I/N`` compiles shard ``I`` (0-based, as a
Kubernetes indexed Job's ``JOB_COMPLETION_INDEX``) of ``N``; ``--shard auto``
takes ``I`` from ``JOB_COMPLETION_INDEX`` and ``N`` from ``--shards N`` or
``KERNEL_CACHE_SHARDS`` (:func:`resolve_shard`). Every builder
computes the same split from the plan alone (no clock, host or Redis state
enters it), so N builders started with ``0/N`` ... ``N-1/N`` cover the plan
exactly once.

Balancing is by expected compile seconds (:func:`expected_compile_seconds`),
not by count: the split is greedy longest-processing-time-first (Graham,
"Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 1969):
variants in decreasing cost (ties by name) each go to the shard with the least
cost so far (ties to the lowest index). Its largest shard is within one
variant's cost of the mean (tested in ``tests/warmup/test_shard.py``).
"""

from __future__ import annotations

import heapq
import math
import os
import re
from collections.abc import Mapping

from kernel_cache.config.engine import EngineConfig
from kernel_cache.errors import ConfigError
from kernel_cache.plan.buckets import PAGED_ATTENTION, KernelVariant

#: Expected compile cost of one variant in CPU seconds:
#: ``base[kernel] + per_doubling * log2(work)``, ``work = query_len * num_seqs *
#: num_blocks * block_size`` (the query-by-KV scores it computes per head).
#: Measured here with ``benchmarks/compile_cost.py --every 2`` (built-in default
#: plan, 13 variants, CPU, torch 2.13.0, Inductor caches off; CPU seconds of the
#: compile and its C++ compiler processes): paged_attention median 11.6 s
#: (min-max 10.9-13.0, n=7), batched_decode median 11.0 s (9.2-12.3, n=6); the
#: least-squares slope was -0.03 s per doubling of ``work``, i.e. no measurable
#: size effect (presumably static shapes change constants in the generated
#: code, not its amount), so ``per_doubling`` is 0 and CPU shards come out
#: nearly equal in count. On another device (a GPU with Triton autotuning) rerun the script and
#: put its fit here. Only the ratios matter to the split.
COST_MODEL = {
    "base": {"paged_attention": 11.6, "batched_decode": 11.0},
    "per_doubling": 0.0,
}


def expected_compile_seconds(config: EngineConfig, variant: KernelVariant) -> float:
    """Expected seconds to compile ``variant`` (see :data:`COST_MODEL`)."""
    work = variant.query_len * variant.num_seqs * variant.num_blocks * config.block_size
    base = COST_MODEL["base"].get(variant.kernel, COST_MODEL["base"][PAGED_ATTENTION])
    return base + COST_MODEL["per_doubling"] * math.log2(max(1, work))


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``.

    Raises:
        ConfigError: not of the form I/N, N < 1, or I outside 0..N-1.
    """
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m:
        raise ConfigError(
            f"--shard {text!r}: expected I/N (0-based shard I of N builders), e.g. --shard 0/3"
        )
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1:
        raise ConfigError(f"--shard {text!r}: N is {count}; there must be at least 1 shard")
    if index >= count:
        raise ConfigError(
            f"--shard {text!r}: I is {index}, outside 0..{count - 1}; shards are 0-based"
        )
    return index, count


#: The variable a Kubernetes Indexed Job (``completionMode: Indexed``) sets in
#: each pod: its 0-based completion index, as decimal text.
ENV_JOB_INDEX = "JOB_COMPLETION_INDEX"

_AUTO_HELP = (
    "--shard auto is for a Kubernetes Indexed Job (completionMode: Indexed), which sets "
    f"{ENV_JOB_INDEX} in each pod"
)


def resolve_shard(
    spec: str, shards: int | None = None, environ: Mapping[str, str] | None = None
) -> tuple[int, int]:
    """``(index, count)`` of ``--shard SPEC`` with ``--shards SHARDS``.

    ``SPEC`` is ``I/N`` (:func:`parse_shard`; ``shards``, if given, must equal
    ``N``) or ``auto``: the index is ``$JOB_COMPLETION_INDEX`` of ``environ``
    (default :data:`os.environ`), the count ``shards``, else
    ``$KERNEL_CACHE_SHARDS``; set it to the Job's ``completions``.

    Raises:
        ConfigError: a malformed ``I/N``; ``shards`` < 1 or unlike ``N``; auto
            without a count, outside an Indexed Job (no index), with an index
            that is not a non-negative integer or not below the count. The
            message names the input, its value, the limit and the fix.
        SettingError: ``KERNEL_CACHE_SHARDS`` is not an integer >= 1.
    """
    from kernel_cache.config import settings

    if shards is not None and shards < 1:
        raise ConfigError(
            f"--shards {shards}: the shard count must be >= 1; give the number of builders "
            "(an Indexed Job's completions), e.g. --shards 4"
        )
    if (spec or "").strip().lower() != "auto":
        index, count = parse_shard(spec)
        if shards is not None and shards != count:
            raise ConfigError(
                f"--shards {shards} disagrees with --shard {spec!r} (N = {count}); "
                f"drop --shards, or use --shard auto to read the index from {ENV_JOB_INDEX}"
            )
        return index, count
    environ = os.environ if environ is None else environ
    var = settings.var("shards")
    if shards is not None:
        count, count_from = shards, f"--shards {shards}"
    else:
        count = settings.get("shards", environ)
        count_from = f"{var}={count}"
    if count is None:
        raise ConfigError(
            f"--shard auto: no shard count (neither --shards nor {var} is set); give the "
            f"Job's completions as --shards N or {var}=N"
        )
    raw = environ.get(ENV_JOB_INDEX)
    if raw is None or not raw.strip():
        raise ConfigError(
            f"--shard auto: {ENV_JOB_INDEX} is not set; {_AUTO_HELP}. Outside one, give "
            f"the index yourself: --shard I/{count}"
        )
    if not re.fullmatch(r"\s*[0-9]+\s*", raw):
        raise ConfigError(
            f"--shard auto: {ENV_JOB_INDEX}={raw!r} is not a non-negative integer "
            f"(0..{count - 1} for {count_from}); {_AUTO_HELP}, or give --shard I/{count}"
        )
    index = int(raw)
    if index >= count:
        raise ConfigError(
            f"--shard auto: {ENV_JOB_INDEX}={index} is outside 0..{count - 1} for "
            f"{count_from}; set the count to the Job's completions (spec.completions, "
            f"at least {index + 1})"
        )
    return index, count


def split_plan(
    config: EngineConfig, variants: list[KernelVariant] | tuple, count: int
) -> list[list[KernelVariant]]:
    """The plan's variants in ``count`` disjoint shards covering it, each in plan
    order (see the module docstring for the rule)."""
    if count < 1:
        raise ConfigError(f"shard count {count}: must be >= 1")
    order = {v: i for i, v in enumerate(variants)}
    ranked = sorted(variants, key=lambda v: (-expected_compile_seconds(config, v), str(v)))
    heap = [(0.0, i) for i in range(count)]
    shards: list[list[KernelVariant]] = [[] for _ in range(count)]
    for v in ranked:
        load, i = heapq.heappop(heap)
        shards[i].append(v)
        heapq.heappush(heap, (load + expected_compile_seconds(config, v), i))
    return [sorted(s, key=order.__getitem__) for s in shards]


def shard_variants(
    config: EngineConfig, variants: list[KernelVariant] | tuple, index: int, count: int
) -> list[KernelVariant]:
    """Shard ``index`` of ``count`` (see :func:`split_plan`)."""
    return split_plan(config, variants, count)[index]


def shard_costs(config: EngineConfig, shards: list[list[KernelVariant]]) -> list[float]:
    """Expected compile seconds of each shard."""
    return [round(sum(expected_compile_seconds(config, v) for v in s), 3) for s in shards]
