"""What ``kernel-cache tune`` tries: the settings (:class:`TuneSettings`), the
launch configs of a variant (:func:`candidates`, defaults first), the rule that keeps
one (:data:`RULE`) and the key a measurement is stored under (:func:`result_key`)."""

from __future__ import annotations

import itertools
import json
import math

from pydantic import BaseModel, ConfigDict

from kernel_cache.config.engine import EngineConfig
from kernel_cache.errors import ConfigError
from kernel_cache.kernels.tiles import (
    PREFILL_SMEM_BYTES,
    prefill_max_block_m,
    prefill_min_block_m,
    prefill_smem_bytes,
)
from kernel_cache.plan.buckets import PAGED_ATTENTION, KernelVariant
from kernel_cache.plan.keys import CacheKey
from kernel_cache.plan.launch import dtype_bytes, variant_defaults
from kernel_cache.plan.tables import check_launch

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
