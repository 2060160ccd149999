"""Per-shape launch configuration: looked up in tables, resolved once per plan, keyed.

How a variant is compiled is not only its shape: ``batched_decode`` also takes
``blocks_per_chunk`` (KV blocks per step of its online softmax) and
``num_kv_splits`` (split-KV with a log-sum-exp combine), see
:class:`kernel_cache.kernels.plain.BatchedDecode`. Production attention backends look
such settings up per shape in a table; so does this module.

A variant's entry is looked up in launch tables (:mod:`kernel_cache.plan.tables`:
the table format, its lookup key and validation).

**Resolution**, per variant, the first source that has an entry wins (the whole
entry; fields it omits take their defaults):

1. ``KERNEL_CACHE_TUNING``: a path to a JSON table, or the JSON text itself
   (a value starting with ``{``).
2. The bundled table of this device architecture, shipped as package data:
   ``kernel_cache/plan/launch_tables/<arch>.json`` (``x86_64-x86-64-v3.json``,
   ``sm_90.json``; see :func:`~kernel_cache.plan.tables.table_filename`).
3. The defaults (:func:`default_launch`): on the CPU ``num_kv_splits = 1`` and
   ``blocks_per_chunk = num_blocks``, today's single-pass kernel exactly; on
   CUDA the split count of :func:`kernel_cache.kernels.tiles.cuda_default_splits`
   (the Triton kernel's heuristic, read through its slot).

On CUDA ``batched_decode`` is the Triton kernel of
:mod:`kernel_cache.kernels.triton_decode`, which streams ``BLOCK_N`` tokens per step and
takes only ``num_kv_splits``: an entry for a CUDA variant must leave
``blocks_per_chunk`` out (or give the blocks of one split), else it is refused
at resolution rather than keyed without changing the code. On CUDA
``paged_attention`` is the Triton prefill kernel of
:mod:`kernel_cache.kernels.triton_prefill`, which takes its tiles (``block_m``,
``block_n``, ``num_warps``, ``num_stages``; defaults
:func:`kernel_cache.kernels.tiles.cuda_prefill_defaults`, per query bucket); an
entry may set some of them and the rest take their defaults. On the CPU ``paged_attention``
takes none, and an entry that sets one is refused at resolution.

The resolved config, defaults written out, is the ``launch_config`` component of
every variant's cache key (:func:`kernel_cache.plan.keys.build_key`): changing one
entry changes exactly one variant's key, so ``warmup`` recompiles that variant
and nothing else. :func:`resolve_plan` resolves a whole plan once and logs it
once as a compact table (logger ``kernel_cache.plan.launch``, INFO).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kernel_cache.config import settings
from kernel_cache.config.engine import EngineConfig
from kernel_cache.errors import ConfigError
from kernel_cache.kernels.slots import SLOTS
from kernel_cache.kernels.tiles import prefill_min_block_m
from kernel_cache.plan.buckets import BATCHED_DECODE, PAGED_ATTENTION, KernelVariant
from kernel_cache.plan.tables import (
    ENV_TUNING,
    LaunchTable,
    arch_family,
    check_launch,
    override_table,
    parse_table,
    read_json,
    table_filename,
)

log = logging.getLogger("kernel_cache.plan.launch")

BUNDLED_DIR = Path(__file__).parent / "launch_tables"

DEFAULT, BUNDLED, OVERRIDE = "default", "bundled", "env"


def dtype_bytes(config: EngineConfig) -> int:
    """Bytes per element of ``config.dtype`` (4 for float32, 2 for bfloat16 and float16)."""
    return 4 if config.dtype == "float32" else 2


def default_launch(
    kernel: str,
    num_blocks: int,
    *,
    device: str = "cpu",
    num_seqs: int = 1,
    num_kv_heads: int = 1,
    block_size: int = 1,
    query_len: int = 1,
    num_queries_per_kv: int = 1,
    head_dim: int = 128,
    itemsize: int = 2,
) -> dict[str, int]:
    """The built-in defaults: today's kernels exactly.

    ``batched_decode`` on the CPU: ``{"blocks_per_chunk": num_blocks,
    "num_kv_splits": 1}`` (one split, one chunk: the single-pass softmax); on
    CUDA: :func:`~kernel_cache.kernels.tiles.cuda_default_splits` splits
    (``num_seqs``, ``num_kv_heads``, ``block_size`` in tokens are used for it),
    ``blocks_per_chunk`` the blocks of one split. ``paged_attention``: ``{}`` on
    the CPU; on CUDA the tiles of
    :func:`~kernel_cache.kernels.tiles.cuda_prefill_defaults` (``query_len``,
    ``num_queries_per_kv``, ``head_dim`` and ``itemsize``, the dtype's bytes,
    are used for it). Both come from the slot
    (:meth:`kernel_cache.kernels.slots.Slot.default_launch`).
    """
    slot = SLOTS.get(kernel)
    values = {}
    if slot is not None:  # the slot's own launch space (an unknown kernel: refused below)
        values = slot.default_launch(
            device,
            num_seqs=num_seqs,
            num_kv_heads=num_kv_heads,
            num_blocks=num_blocks,
            block_size=block_size,
            query_len=query_len,
            num_queries_per_kv=num_queries_per_kv,
            head_dim=head_dim,
            itemsize=itemsize,
        )
    return check_launch(kernel, num_blocks, values, "defaults")


def variant_defaults(config: EngineConfig, variant: KernelVariant) -> dict[str, int]:
    """:func:`default_launch` for ``variant`` of ``config``'s plan (its device,
    batch bucket, KV heads and block size); ``{}`` for a declared slot's variant
    (a declared slot has no launch parameters)."""
    if variant.kernel not in SLOTS:
        return {}
    return default_launch(
        variant.kernel,
        variant.num_blocks,
        device=config.device,
        num_seqs=variant.num_seqs,
        num_kv_heads=config.num_kv_heads,
        block_size=config.block_size,
        query_len=variant.query_len,
        num_queries_per_kv=config.num_queries_per_kv,
        head_dim=config.head_dim,
        itemsize=dtype_bytes(config),
    )


def launch_json(config: Mapping) -> str:
    """The canonical JSON of a resolved config (the ``launch_config`` key component)."""
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"))


def variant_lookup_key(config: EngineConfig, variant: KernelVariant) -> tuple:
    """``(kernel, head_dim, num_queries_per_kv, num_kv_heads, num_seqs, num_blocks,
    query_len)``; ``query_len`` is None for ``batched_decode`` (always 1)."""
    return (
        variant.kernel,
        config.head_dim,
        config.num_queries_per_kv,
        config.num_kv_heads,
        variant.num_seqs,
        variant.num_blocks,
        variant.query_len if variant.kernel == PAGED_ATTENTION else None,
    )


class LaunchChoice(BaseModel):
    """A report's record of one variant a launch table sets (:func:`describe_plan`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    config: dict[str, int] = Field(description="the resolved launch config")
    source: Literal["env", "bundled", "default"] = Field(
        description="env (KERNEL_CACHE_TUNING), bundled or default"
    )


@dataclass(frozen=True)
class Resolved:
    """One variant's resolved launch config and where it came from
    (``env``, ``bundled`` or ``default``)."""

    config: dict
    source: str

    @property
    def json(self) -> str:
        return launch_json(self.config)


class Resolver:
    """Looks launch configs up: ``KERNEL_CACHE_TUNING`` > bundled table > defaults.

    Args:
        environ: where to read ``KERNEL_CACHE_TUNING`` (default ``os.environ``).
        bundled_dir: the bundled tables' directory (default :data:`BUNDLED_DIR`).

    Raises:
        ConfigError: the override or a bundled table is invalid (at construction
            for the override, at first use for a bundled table).
    """

    def __init__(
        self, environ: Mapping | None = None, bundled_dir: str | os.PathLike | None = None
    ):
        self.override = override_table(settings.get("tuning", environ))
        self.bundled_dir = Path(bundled_dir) if bundled_dir is not None else BUNDLED_DIR
        self._bundled: dict[str, LaunchTable | None] = {}

    def bundled(self, device_arch: str) -> LaunchTable | None:
        """The bundled table for ``device_arch``, or None if none ships."""
        fam = arch_family(device_arch)
        if fam not in self._bundled:
            path = self.bundled_dir / table_filename(fam)
            table = None
            if path.is_file():
                table = parse_table(
                    read_json(path, str(path)), f"bundled {path.name}", require_arch=fam
                )
            self._bundled[fam] = table
        return self._bundled[fam]

    def resolve(self, config: EngineConfig, variant: KernelVariant, device_arch: str) -> Resolved:
        """Raises ConfigError: on CUDA, an entry setting ``blocks_per_chunk``
        (the Triton kernel does not take it). A declared slot's variant: no
        launch parameters (``{}``, ``default``)."""
        if variant.kernel not in SLOTS:
            return Resolved({}, DEFAULT)
        key = variant_lookup_key(config, variant)
        found = None
        if self.override is not None:
            hit = self.override.lookup(key, device_arch)
            if hit is not None:
                found = Resolved(hit, OVERRIDE)
        if found is None:
            bundled = self.bundled(device_arch)
            hit = bundled.lookup(key, device_arch) if bundled is not None else None
            if hit is not None:
                found = Resolved(hit, BUNDLED)
        if found is None:
            return Resolved(variant_defaults(config, variant), DEFAULT)
        if variant.kernel == PAGED_ATTENTION:
            if config.device != "cuda" and found.config:
                where = self.override.origin if found.source == OVERRIDE else "bundled table"
                raise ConfigError(
                    f"{where}: entry for {variant} sets {sorted(found.config)}, but on the "
                    "CPU paged_attention is the plain-PyTorch kernel, which takes no launch "
                    "parameters"
                )
            if config.device == "cuda":  # fields the entry leaves out take their defaults
                merged = {**variant_defaults(config, variant), **found.config}
                check_prefill_tiles(config, variant, merged, found.source)
                return Resolved(dict(sorted(merged.items())), found.source)
        if config.device == "cuda" and variant.kernel == BATCHED_DECODE:
            per_split = -(-variant.num_blocks // found.config["num_kv_splits"])
            if found.config["blocks_per_chunk"] != per_split:
                where = self.override.origin if found.source == OVERRIDE else "bundled table"
                raise ConfigError(
                    f"{where}: entry for {variant} sets blocks_per_chunk="
                    f"{found.config['blocks_per_chunk']}, but on CUDA batched_decode is the "
                    "Triton kernel, which takes only num_kv_splits; leave blocks_per_chunk "
                    f"out (or give {per_split}, the blocks of one split)"
                )
        return found

    def sources(self, device_arch: str, used: Mapping[str, int] | None = None) -> str:
        """One line naming the sources consulted, for the log; with ``used``
        (``{source: variants it set}``), how many of a table's entries this plan
        used, so an override entry that matches no variant shows."""

        def n(table, source):
            u = f", {used.get(source, 0)} used by this plan" if used is not None else ""
            return f"{table.origin} ({len(table)} entries{u})"

        o = self.override
        parts = [n(o, OVERRIDE) if o is not None else f"{ENV_TUNING} unset"]
        b = self.bundled(device_arch)
        parts.append(
            n(b, BUNDLED) if b is not None else f"no bundled table for {arch_family(device_arch)}"
        )
        return "; ".join(parts)


def check_prefill_tiles(config: EngineConfig, variant: KernelVariant, cfg: Mapping, where) -> None:
    """A CUDA ``paged_attention`` config must give ``block_m`` at least the GQA
    group padded to a power of two (one query token per program).

    Raises: ConfigError naming the variant."""
    g_pad = prefill_min_block_m(config.num_queries_per_kv)
    if cfg["block_m"] < g_pad:
        raise ConfigError(
            f"{where}: entry for {variant} sets block_m={cfg['block_m']}, below the GQA group "
            f"of {config.num_queries_per_kv} query heads per KV head (padded to {g_pad})"
        )


def resolve_plan(
    config: EngineConfig,
    variants: Iterable[KernelVariant],
    device_arch: str,
    *,
    resolver: Resolver | None = None,
    logger: logging.Logger | None = None,
) -> dict[KernelVariant, Resolved]:
    """Resolve every variant of a plan once, and log the result once.

    Returns: ``{variant: Resolved}`` in the plan's order.

    Raises:
        ConfigError: an invalid override or bundled table.
    """
    resolver = Resolver() if resolver is None else resolver
    out = {v: resolver.resolve(config, v, device_arch) for v in variants}
    (logger or log).info("%s", format_plan(out, resolver.sources(device_arch, source_counts(out))))
    return out


def source_counts(resolved: Mapping[KernelVariant, Resolved]) -> dict[str, int]:
    """``{source: number of variants it set}`` for :meth:`Resolver.sources`."""
    used: dict[str, int] = {}
    for r in resolved.values():
        used[r.source] = used.get(r.source, 0) + 1
    return used


def format_plan(resolved: Mapping[KernelVariant, Resolved], sources: str = "") -> str:
    """The compact table :func:`resolve_plan` logs: one row per variant that a
    table sets, one summary line for the variants at their defaults."""
    rows = [(v, r) for v, r in resolved.items() if r.source != DEFAULT]
    lines = [f"launch config for {len(resolved)} variants ({sources})"]
    if rows:
        w = max(len(str(v)) for v, _ in rows)
        lines.append(f"  {'variant':<{w}}  source   blocks_per_chunk  num_kv_splits")
        for v, r in rows:
            if v.kernel == PAGED_ATTENTION:  # the CUDA prefill tiles
                lines.append(f"  {str(v):<{w}}  {r.source:<7}  {launch_json(r.config)}")
                continue
            bpc = r.config.get("blocks_per_chunk", "-")
            spl = r.config.get("num_kv_splits", "-")
            lines.append(f"  {str(v):<{w}}  {r.source:<7}  {bpc!s:<16}  {spl}")
    n_def = len(resolved) - len(rows)
    lines.append(
        f"  {n_def} variant(s) at defaults (batched_decode: blocks_per_chunk=num_blocks, "
        "num_kv_splits=1, one pass on the CPU, the split heuristic on CUDA; "
        "paged_attention: no launch parameters on the CPU, the default tiles on CUDA)"
    )
    return "\n".join(lines)


def describe_plan(resolved: Mapping[KernelVariant, Resolved]) -> dict:
    """JSON-ready: the variants a table sets, ``{variant: {"config", "source"}}``."""
    return {
        str(v): {"config": r.config, "source": r.source}
        for v, r in resolved.items()
        if r.source != DEFAULT
    }


@functools.lru_cache(maxsize=8)
def _cached_resolver(value: str | None, stamp, bundled_dir: str) -> Resolver:
    return Resolver({ENV_TUNING: value} if value is not None else {}, bundled_dir)


def current_resolver() -> Resolver:
    """A process-wide :class:`Resolver` for the current ``KERNEL_CACHE_TUNING``
    (rebuilt when its value or the file changes: its modification or change time,
    size or inode)."""
    value = settings.get("tuning")
    stamp = None
    if value and not value.lstrip().startswith("{"):
        try:
            st = os.stat(value)
            stamp = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = "missing"
    return _cached_resolver(value, stamp, str(BUNDLED_DIR))


def launch_for(config: EngineConfig, variant: KernelVariant, device_arch: str) -> dict[str, int]:
    """One variant's resolved config, without logging (what
    :func:`kernel_cache.plan.keys.build_key` uses when no config is passed)."""
    return current_resolver().resolve(config, variant, device_arch).config
