"""Per-shape launch configuration: looked up in tables, resolved once per plan, keyed.

How a variant is compiled is not only its shape: ``batched_decode`` also takes
``blocks_per_chunk`` (KV blocks per step of its online softmax) and
``num_kv_splits`` (split-KV with a log-sum-exp combine), see
:class:`kernel_cache.kernels.builtin.BatchedDecode`. Production attention backends look
such settings up per shape in a table; so does this module.

**Lookup key** of a table entry: ``(kernel, head_dim, num_queries_per_kv,
num_kv_heads, num_seqs, num_blocks, query_len, device architecture)``, where
``num_seqs``, ``num_blocks`` and ``query_len`` are the variant's buckets
(sequences, KV blocks, query tokens) and the device architecture is
:func:`arch_family` of :func:`kernel_cache.plan.keys.device_arch`
(``x86_64/x86-64-v3`` on a CPU, ``sm_90`` on an H200). ``query_len`` is for
``paged_attention`` entries only and optional: an entry without it applies to
every query bucket of its KV bucket, one with it wins for its query bucket.

**Resolution**, per variant, the first source that has an entry wins (the whole
entry; fields it omits take their defaults):

1. ``KERNEL_CACHE_TUNING``: a path to a JSON table, or the JSON text itself
   (a value starting with ``{``).
2. The bundled table of this device architecture, shipped as package data:
   ``kernel_cache/plan/launch_tables/<arch>.json`` (``x86_64-x86-64-v3.json``,
   ``sm_90.json``; see :func:`table_filename`).
3. The defaults (:func:`default_launch`): on the CPU ``num_kv_splits = 1`` and
   ``blocks_per_chunk = num_blocks``, today's single-pass kernel exactly; on
   CUDA the split count of :func:`cuda_default_splits` (the Triton kernel's
   heuristic).

On CUDA ``batched_decode`` is the Triton kernel of
:mod:`kernel_cache.kernels.triton_decode`, which streams ``BLOCK_N`` tokens per step and
takes only ``num_kv_splits``: an entry for a CUDA variant must leave
``blocks_per_chunk`` out (or give the blocks of one split), else it is refused
at resolution rather than keyed without changing the code. On CUDA
``paged_attention`` is the Triton prefill kernel of
:mod:`kernel_cache.kernels.triton_prefill`, which takes its tiles (``block_m``,
``block_n``, ``num_warps``, ``num_stages``; defaults
:func:`cuda_prefill_defaults`, per query bucket); an entry may set some of them
and the rest take their defaults. On the CPU ``paged_attention``
takes none, and an entry that sets one is refused at resolution.

The resolved config, defaults written out, is the ``launch_config`` component of
every variant's cache key (:func:`kernel_cache.plan.keys.build_key`): changing one
entry changes exactly one variant's key, so ``warmup`` recompiles that variant
and nothing else. :func:`resolve_plan` resolves a whole plan once and logs it
once as a compact table (logger ``kernel_cache.plan.launch``, INFO).

**Table format** (what ``kernel-cache tune --out`` writes)::

    {"format": "kernel-cache-launch/1",
     "device_arch": "x86_64/x86-64-v3",            # optional in KERNEL_CACHE_TUNING
     "about": {...},                           # optional, free-form provenance
     "entries": [
       {"kernel": "batched_decode", "head_dim": 128, "num_queries_per_kv": 4,
        "num_kv_heads": 8, "num_seqs": 8, "num_blocks": 32,
        "query_len": 512,                      # paged_attention only, optional
        "device_arch": "x86_64/x86-64-v3",          # optional, overrides the table's
        "config": {"blocks_per_chunk": 8, "num_kv_splits": 2},
        "measured": {...}}                     # optional, free-form
     ]}

An entry without a device architecture (none on the entry, none on the table;
allowed in ``KERNEL_CACHE_TUNING`` only) applies on every device; one with an
architecture wins over it. The order of lookups: the variant's query bucket
with its architecture, then with none, then an entry without a query bucket
with its architecture, then with none.

**Validation** by the frozen pydantic models :class:`LaunchTableDoc` and
:class:`LaunchEntry` (JSON Schema: ``docs/schemas/launch-table.schema.json``),
errors as :class:`~kernel_cache.errors.ConfigError` naming the source, the
field's location (``entries[0].config.num_kv_splits``), the value and the rule:
an unknown kernel, top-level field, entry field or config field; a value that
is not an integer; a prefill tile that is not a
power of two in ``[16, 256]`` (``block_m``, ``block_n``), ``num_warps`` not a
power of two in ``[1, 16]``, ``num_stages`` outside ``[1, 8]``; ``num_kv_splits`` outside
``[1, num_blocks]``; ``blocks_per_chunk`` that does not divide the blocks of one
split (``ceil(num_blocks / num_kv_splits)``); two entries for one key; a bundled
table whose ``device_arch`` is not its file's.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kernel_cache.config import settings
from kernel_cache.config.engine import EngineConfig
from kernel_cache.errors import ConfigError, validation_message
from kernel_cache.plan.buckets import BATCHED_DECODE, PAGED_ATTENTION, KernelVariant

log = logging.getLogger("kernel_cache.plan.launch")

ENV_TUNING = settings.var("tuning")
TABLE_FORMAT = "kernel-cache-launch/1"
BUNDLED_DIR = Path(__file__).parent / "launch_tables"

#: Launch parameters each kernel takes (keyword arguments of its module).
FIELDS: dict[str, tuple[str, ...]] = {
    PAGED_ATTENTION: ("block_m", "block_n", "num_stages", "num_warps"),
    BATCHED_DECODE: ("blocks_per_chunk", "num_kv_splits"),
}

#: ``paged_attention`` takes launch parameters on CUDA only (the Triton kernel of
#: :mod:`kernel_cache.kernels.triton_prefill`); the CPU kernel takes none.
PREFILL_RANGES = {
    "block_m": (16, 256),
    "block_n": (16, 256),
    "num_warps": (1, 16),
    "num_stages": (1, 8),
}

#: The lookup key of an entry, besides the device architecture.
KEY_FIELDS = (
    "kernel",
    "head_dim",
    "num_queries_per_kv",
    "num_kv_heads",
    "num_seqs",
    "num_blocks",
    "query_len",
)

DEFAULT, BUNDLED, OVERRIDE = "default", "bundled", "env"

#: CUDA split-KV heuristic of the Triton decode kernel: aim for about this many
#: programs per launch (8 per streaming multiprocessor on a 132-SM H100/H200), but
#: never split below ``MIN_SPLIT_TOKENS`` tokens per program. A pure function of
#: the variant's shape, so the artifact does not depend on which GPU warmed it.
#: (Picked on an H200: docs/benchmarks.md, "GPU (H200)", kernel sweep.)
TARGET_PROGRAMS = 1024
MIN_SPLIT_TOKENS = 256


def cuda_default_splits(num_seqs: int, num_kv_heads: int, num_blocks: int, block_size: int) -> int:
    """The Triton decode kernel's default ``num_kv_splits`` for a variant.

    Splits of whole KV blocks, at least ``MIN_SPLIT_TOKENS`` tokens each, enough
    of them that ``num_seqs * num_kv_heads * splits`` is about
    ``TARGET_PROGRAMS``. Returns an integer in ``[1, num_blocks]``.
    """
    want = max(1, -(-TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads)))
    tokens = max(MIN_SPLIT_TOKENS, -(-(num_blocks * block_size) // want))
    per_split = min(num_blocks, max(1, -(-tokens // block_size)))
    return -(-num_blocks // per_split)


#: Default tiles of the Triton prefill kernel (picked on an H200 with the tile
#: sweep of benchmarks/gpu_engine.py, granite-3.3-8b bf16: 128 x 128 tiles, 8
#: warps, 3 stages took 0.112 ms at 512 query tokens over 4096 KV tokens and
#: 0.653 ms at 2048 over 8192, the fastest of 12 configurations at 2048 @ 8192
#: and 2-4% behind the fastest at 512 @ 4096; docs/benchmarks.md, "Prefill kernel").
PREFILL_BLOCK_M = 128
PREFILL_BLOCK_N = 128
PREFILL_NUM_WARPS = 8
PREFILL_NUM_STAGES = 3
#: Shared memory per program on sm_90 (227 KiB of opt-in dynamic shared memory).
PREFILL_SMEM_BYTES = 227 * 1024


def cuda_prefill_defaults(
    query_len: int, num_queries_per_kv: int, head_dim: int, itemsize: int = 2
) -> dict[str, int]:
    """The Triton prefill kernel's default launch config for a variant.

    ``block_m`` score rows per program (query tokens x the GQA group padded to a
    power of two): :data:`PREFILL_BLOCK_M`, but no more rows than the query
    bucket fills (a 1-token bucket of a 4-head group gets 16), with 8 warps from
    128 rows on, else 4. ``block_n`` (KV tokens per step) and the pipeline stages
    start at :data:`PREFILL_BLOCK_N` and :data:`PREFILL_NUM_STAGES` and shrink
    (stages to 2 first, then ``block_n`` by halves, not below 16) until the
    estimated shared memory, ``(stages * 2 * block_n + block_m) * head_dim_pad *
    itemsize`` bytes (``itemsize``: bytes per element), fits
    :data:`PREFILL_SMEM_BYTES`. Returns ``{"block_m", "block_n", "num_stages",
    "num_warps"}``.
    """
    block_m = max(
        prefill_min_block_m(num_queries_per_kv),
        min(PREFILL_BLOCK_M, prefill_max_block_m(query_len, num_queries_per_kv)),
    )
    block_n, stages = PREFILL_BLOCK_N, PREFILL_NUM_STAGES
    while prefill_smem_bytes(block_m, block_n, stages, head_dim, itemsize) > PREFILL_SMEM_BYTES:
        if stages > 2:
            stages = 2
        elif block_n > 16:
            block_n //= 2
        else:
            break
    warps = PREFILL_NUM_WARPS if block_m >= 128 else 4
    return {"block_m": block_m, "block_n": block_n, "num_stages": stages, "num_warps": warps}


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def dtype_bytes(config: EngineConfig) -> int:
    """Bytes per element of ``config.dtype`` (4 for float32, 2 for bfloat16 and float16)."""
    return 4 if config.dtype == "float32" else 2


def prefill_min_block_m(num_queries_per_kv: int) -> int:
    """The fewest score rows a prefill program can hold: one query token's GQA
    group, padded to a power of two."""
    return _pow2(num_queries_per_kv)


def prefill_max_block_m(query_len: int, num_queries_per_kv: int) -> int:
    """The most score rows a prefill program of this query bucket can fill: the
    query bucket times the GQA group, each padded to a power of two (at least 16
    rows, the smallest ``tl.dot`` tile)."""
    return max(16, prefill_min_block_m(num_queries_per_kv) * _pow2(query_len))


def prefill_smem_bytes(
    block_m: int, block_n: int, num_stages: int, head_dim: int, itemsize: int = 2
) -> int:
    """Estimated shared memory of one prefill program, in bytes: ``(num_stages *
    2 * block_n + block_m) * head_dim_pad * itemsize`` (the pipelined K and V
    tiles and the query tile; ``head_dim_pad``: a power of two, at least 16)."""
    d_pad = max(16, _pow2(head_dim))
    return (num_stages * 2 * block_n + block_m) * d_pad * itemsize


def arch_family(device_arch: str) -> str:
    """The device-architecture axis of the lookup key.

    ``"sm_90 cuda 13.0 triton 3.6.0"`` → ``"sm_90"`` (the compute capability: a
    table measured on an H200 holds across CUDA and Triton versions, which the
    cache key tracks on its own); ``"x86_64/x86-64-v3"`` is kept whole.
    """
    return device_arch.split()[0] if device_arch.strip() else device_arch


def table_filename(device_arch: str) -> str:
    """The bundled table's file name: ``"x86_64/x86-64-v3"`` → ``"x86_64-x86-64-v3.json"``,
    ``"sm_90 cuda 13.0 triton 3.6.0"`` → ``"sm_90.json"``."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", arch_family(device_arch)) + ".json"


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
    CUDA: :func:`cuda_default_splits` splits (``num_seqs``, ``num_kv_heads``,
    ``block_size`` in tokens are used for it), ``blocks_per_chunk`` the blocks of
    one split. ``paged_attention``: ``{}`` on the CPU; on CUDA the tiles of
    :func:`cuda_prefill_defaults` (``query_len``, ``num_queries_per_kv``,
    ``head_dim`` and ``itemsize``, the dtype's bytes, are used for it).
    """
    values = {}
    if device == "cuda" and kernel == BATCHED_DECODE:
        values["num_kv_splits"] = cuda_default_splits(
            num_seqs, num_kv_heads, num_blocks, block_size
        )
    if device == "cuda" and kernel == PAGED_ATTENTION:
        values = cuda_prefill_defaults(query_len, num_queries_per_kv, head_dim, itemsize)
    return check_launch(kernel, num_blocks, values, "defaults")


def variant_defaults(config: EngineConfig, variant: KernelVariant) -> dict[str, int]:
    """:func:`default_launch` for ``variant`` of ``config``'s plan (its device,
    batch bucket, KV heads and block size)."""
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


def check_launch(kernel: str, num_blocks: int, values: Mapping, where: str) -> dict[str, int]:
    """Validate a (partial) launch config for one variant and fill in defaults.

    Args:
        kernel: ``paged_attention`` or ``batched_decode``.
        num_blocks: the variant's KV bucket in blocks.
        values: the fields given (a subset of :data:`FIELDS` ``[kernel]``).
        where: names the entry in error messages.

    Returns: every field of the kernel, explicit (keys sorted).

    Raises:
        ConfigError: unknown kernel or field, a non-integer, ``num_kv_splits``
            outside ``[1, num_blocks]``, or a ``blocks_per_chunk`` that does not
            divide the ``ceil(num_blocks / num_kv_splits)`` blocks of one split.
    """
    if kernel not in FIELDS:
        raise ConfigError(
            f"{where}: unknown kernel {kernel!r}; accepted kernels: {', '.join(FIELDS)}"
        )
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: 'config' must be a JSON object, got {values!r}")
    unknown = sorted(set(values) - set(FIELDS[kernel]))
    if unknown:
        accepted = ", ".join(FIELDS[kernel]) or "none"
        raise ConfigError(
            f"{where}: unknown field(s) {unknown} for kernel {kernel}; accepted fields: {accepted}"
        )
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where}: {name}={value!r} must be an integer")
    if kernel == PAGED_ATTENTION:
        for name, value in values.items():
            lo, hi = PREFILL_RANGES[name]
            pow2 = name.startswith("block_") or name == "num_warps"
            if not lo <= value <= hi or (pow2 and value & (value - 1)):
                kind = "a power of two" if pow2 else "an integer"
                raise ConfigError(f"{where}: {name}={value} must be {kind} in [{lo}, {hi}]")
        return dict(sorted(values.items()))
    splits = values.get("num_kv_splits", 1)
    if not 1 <= splits <= num_blocks:
        raise ConfigError(
            f"{where}: num_kv_splits={splits} is outside [1, num_blocks={num_blocks}]; "
            f"the rule: 1 <= num_kv_splits <= num_blocks"
        )
    per_split = -(-num_blocks // splits)
    bpc = values.get("blocks_per_chunk", per_split)
    if bpc < 1 or per_split % bpc:
        divisors = [d for d in range(1, per_split + 1) if per_split % d == 0]
        raise ConfigError(
            f"{where}: blocks_per_chunk={bpc} does not divide the {per_split} blocks of one "
            f"KV split (ceil(num_blocks={num_blocks} / num_kv_splits={splits})); "
            f"accepted: {divisors}"
        )
    return {"blocks_per_chunk": bpc, "num_kv_splits": splits}


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


PositiveInt = Annotated[int, Field(strict=True, ge=1)]
LaunchValue = Annotated[int, Field(strict=True)]


def _arch(v: str | None) -> str | None:
    if v is not None and not v.strip():
        raise ValueError(f"device_arch={v!r} must be a non-empty string")
    return v


class LaunchEntry(BaseModel):
    """One entry of a launch table: the lookup key (buckets in sequences and KV
    blocks), an optional device architecture, the launch config (a subset of
    :data:`FIELDS` of the kernel; the rest take their defaults) and free-form
    measurements.

    Raises (as a ``ValidationError``): a key field that is not an integer >= 1,
    a ``paged_attention`` entry with ``num_seqs`` other than 1, a config that
    :func:`check_launch` refuses."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kernel: Literal["paged_attention", "batched_decode"] = Field(description="the kernel")
    head_dim: PositiveInt = Field(description="head dimension")
    num_queries_per_kv: PositiveInt = Field(description="query heads per KV head (GQA group)")
    num_kv_heads: PositiveInt = Field(description="KV heads")
    num_seqs: PositiveInt = Field(description="batch bucket in sequences (1 for paged_attention)")
    num_blocks: PositiveInt = Field(description="KV bucket in blocks")
    query_len: PositiveInt | None = Field(
        None,
        description="query bucket in tokens (paged_attention only); "
        "leave it out to cover every query bucket",
    )
    device_arch: str | None = Field(
        None, description="device architecture (arch_family); default: the table's"
    )
    config: dict[str, LaunchValue] = Field(
        description="launch parameters: blocks_per_chunk, num_kv_splits (batched_decode); "
        "block_m, block_n, num_warps, num_stages (paged_attention on CUDA)"
    )
    measured: dict[str, Any] | None = Field(None, description="free-form measurements")

    _device_arch = field_validator("device_arch")(_arch)

    def label(self) -> str:
        """``batched_decode head_dim=8 ... num_blocks=2``, for error messages."""
        fields = [(k, getattr(self, k)) for k in KEY_FIELDS[1:]]
        return " ".join([self.kernel, *(f"{k}={v}" for k, v in fields if v is not None)])

    @model_validator(mode="after")
    def _rules(self) -> LaunchEntry:
        if self.kernel == PAGED_ATTENTION and self.num_seqs != 1:
            raise ValueError(f"paged_attention variants have num_seqs 1, got {self.num_seqs}")
        if self.kernel == BATCHED_DECODE and self.query_len is not None:
            raise ValueError(
                f"query_len={self.query_len}: batched_decode variants have one query token; "
                "leave query_len out (it selects a paged_attention query bucket)"
            )
        check_launch(self.kernel, self.num_blocks, self.config, f"({self.label()})")
        return self


class LaunchTableDoc(BaseModel):
    """A launch table file (``kernel-cache tune --out``, the bundled tables,
    ``KERNEL_CACHE_TUNING``); see the module docstring."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["kernel-cache-launch/1"] = Field(TABLE_FORMAT, description="table format")
    device_arch: str | None = Field(
        None, description="device architecture of every entry without its own "
        "(required in a bundled table)"
    )  # fmt: skip
    about: dict[str, Any] = Field(default_factory=dict, description="free-form provenance")
    entries: tuple[LaunchEntry, ...] = Field((), description="the entries, one per key and arch")

    _device_arch = field_validator("device_arch")(_arch)


@dataclass(frozen=True)
class LaunchTable:
    """A validated table. ``entries`` maps ``(lookup key, arch or None)`` to the
    full (defaults filled in) config; ``origin`` names where it came from."""

    origin: str
    device_arch: str | None
    entries: dict = field(default_factory=dict)
    about: dict = field(default_factory=dict)

    def lookup(self, key: tuple, device_arch: str) -> dict[str, int] | None:
        """The entry for ``key`` (:func:`variant_lookup_key`): the exact query
        bucket before an entry for every query bucket, this architecture before
        none."""
        fam = arch_family(device_arch)
        keys = [key] if key[-1] is None else [key, (*key[:-1], None)]
        for k in keys:
            for arch in (fam, None):
                hit = self.entries.get((k, arch))
                if hit is not None:
                    return hit
        return None

    def __len__(self) -> int:
        return len(self.entries)


def parse_table(doc, origin: str, *, require_arch: str | None = None) -> LaunchTable:
    """Validate a table (parsed JSON) from ``origin``.

    Args:
        require_arch: for a bundled file, the architecture its name stands for;
            the table's ``device_arch`` must be that one.

    Raises:
        ConfigError: see the module docstring's validation rules.
    """
    try:
        model = LaunchTableDoc.model_validate(doc)
    except ValidationError as e:
        raise ConfigError(validation_message(origin, e, LaunchTableDoc)) from None
    arch = arch_family(model.device_arch) if model.device_arch is not None else None
    if require_arch is not None and arch != arch_family(require_arch):
        raise ConfigError(
            f"{origin}: device_arch={arch!r} does not match the file's architecture "
            f"{arch_family(require_arch)!r}; a bundled table holds one architecture"
        )
    table = LaunchTable(origin=origin, device_arch=arch, about=dict(model.about))
    for i, e in enumerate(model.entries):
        label = f"{origin}: entries[{i}] ({e.label()})"
        entry_arch = arch_family(e.device_arch) if e.device_arch is not None else arch
        if require_arch is not None and entry_arch != arch:
            raise ConfigError(
                f"{label}: device_arch={entry_arch!r} in the bundled table of {arch!r}"
            )
        key = tuple(getattr(e, k) for k in KEY_FIELDS)
        if (key, entry_arch) in table.entries:
            raise ConfigError(f"{label}: a second entry for the same key and device_arch")
        table.entries[(key, entry_arch)] = check_launch(e.kernel, e.num_blocks, e.config, label)
    return table


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"field {k!r} is given twice in one object ({out[k]!r}, {v!r})")
        out[k] = v
    return out


def _loads(text: str, origin: str):
    """``json.loads`` that refuses an object with a repeated field (JSON would keep
    the last silently)."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        raise ConfigError(f"{origin}: {e}; give each field once") from None


def _read_json(path: Path, origin: str):
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{origin}: no such file {str(path)!r}") from None
    except OSError as e:
        raise ConfigError(f"{origin}: cannot read {str(path)!r}: {e}") from None
    try:
        return _loads(text, origin)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{origin}: {str(path)!r} is not valid JSON: {e}") from None


def load_table(path: str | os.PathLike) -> LaunchTable:
    """Read and validate a table file (for example one ``kernel-cache tune`` wrote)."""
    return parse_table(_read_json(Path(path), str(path)), str(path))


def override_table(value: str | None) -> LaunchTable | None:
    """The ``KERNEL_CACHE_TUNING`` table: ``value`` is a path or inline JSON.

    Raises:
        ConfigError: a missing file, invalid JSON or an invalid table, naming
            ``KERNEL_CACHE_TUNING``.
    """
    if value is None or not value.strip():
        return None
    if value.lstrip().startswith("{"):
        origin = f"{ENV_TUNING} (inline JSON)"
        try:
            doc = _loads(value, origin)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{origin}: not valid JSON ({e}); give a table or a path to a table file"
            ) from None
    else:
        origin = f"{ENV_TUNING}={value}"
        doc = _read_json(Path(value), origin)
    return parse_table(doc, origin)


class LaunchChoice(BaseModel):
    """A report's record of one variant a launch table sets (:func:`describe_plan`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

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
                    _read_json(path, str(path)), f"bundled {path.name}", require_arch=fam
                )
            self._bundled[fam] = table
        return self._bundled[fam]

    def resolve(self, config: EngineConfig, variant: KernelVariant, device_arch: str) -> Resolved:
        """Raises ConfigError: on CUDA, an entry setting ``blocks_per_chunk``
        (the Triton kernel does not take it)."""
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
    (rebuilt when its value or the file's modification time changes)."""
    value = settings.get("tuning")
    stamp = None
    if value and not value.lstrip().startswith("{"):
        try:
            stamp = os.stat(value).st_mtime_ns
        except OSError:
            stamp = "missing"
    return _cached_resolver(value, stamp, str(BUNDLED_DIR))


def launch_for(config: EngineConfig, variant: KernelVariant, device_arch: str) -> dict[str, int]:
    """One variant's resolved config, without logging (what
    :func:`kernel_cache.plan.keys.build_key` uses when no config is passed)."""
    return current_resolver().resolve(config, variant, device_arch).config
