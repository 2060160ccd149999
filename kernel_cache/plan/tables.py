"""Launch tables: the format of a per-shape launch-config table, its validation
and lookup (what ``kernel-cache tune --out`` writes, the bundled tables,
``KERNEL_CACHE_TUNING``). :mod:`kernel_cache.plan.launch` resolves a plan's
variants through them.

**Lookup key** of a table entry: ``(kernel, head_dim, num_queries_per_kv,
num_kv_heads, num_seqs, num_blocks, query_len, device architecture)``, where
``num_seqs``, ``num_blocks`` and ``query_len`` are the variant's buckets
(sequences, KV blocks, query tokens) and the device architecture is
:func:`arch_family` of :func:`kernel_cache.plan.keys.device_arch`
(``x86_64/x86-64-v3`` on a CPU, ``sm_90`` on an H200). ``query_len`` is for
``paged_attention`` entries only and optional: an entry without it applies to
every query bucket of its KV bucket, one with it wins for its query bucket.

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

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kernel_cache.config import settings
from kernel_cache.errors import ConfigError, validation_message
from kernel_cache.kernels.slots import SLOTS
from kernel_cache.plan.buckets import BATCHED_DECODE, PAGED_ATTENTION

ENV_TUNING = settings.var("tuning")
TABLE_FORMAT = "kernel-cache-launch/1"

#: Launch parameters each kernel takes (keyword arguments of its module, on
#: any device; each slot's launch space: :mod:`kernel_cache.kernels.slots`).
FIELDS: dict[str, tuple[str, ...]] = {name: slot.launch_fields() for name, slot in SLOTS.items()}


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
        ranges = SLOTS[kernel].launch_ranges
        for name, value in values.items():
            lo, hi = ranges[name]
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

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

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

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

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


def read_json(path: Path, origin: str):
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
    return parse_table(read_json(Path(path), str(path)), str(path))


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
        doc = read_json(Path(value), origin)
    return parse_table(doc, origin)
