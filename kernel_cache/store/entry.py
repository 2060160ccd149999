"""A cache entry and its metadata record, and the check before its code is loaded.

An entry is the artifact's bytes (an AOTInductor ``.pt2`` package) plus a JSON
metadata record::

    {"key": <sha256 hex>, "variant": "batched_decode:1:8:4",
     "components": {name: value, ...}, "sha256": <sha256 of the bytes>,
     "size": <bytes>, "compile_seconds": <float>, "created": <unix seconds>,
     "format": "kc1"}

Metadata is JSON, never pickle. Every tier returns raw entries;
:func:`verify_entry` checks them before any code is loaded.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from kernel_cache.errors import CorruptEntryError, describe_errors
from kernel_cache.plan.keys import ARTIFACT_FORMAT, CacheKey
from kernel_cache.plan.traced import Manifest, chain_key

#: largest metadata record read from a store (bytes): a record is 1-2 KiB, one
#: listing the most traced files :mod:`kernel_cache.plan.traced` accepts
#: (``MAX_TRACED_FILES`` paths of up to ``MAX_PATH_CHARS``) under 600 KiB; a
#: shared tier refuses a larger one from its length, before reading it
META_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Entry:
    """A stored entry as read from a tier: metadata (parsed JSON) and bytes."""

    key: str
    meta: dict
    data: bytes
    where: str = ""


class EntryMeta(BaseModel):
    """An entry's JSON metadata record (see the module docstring).

    ``key``, ``sha256`` and ``size`` (bytes) are required; the other fields
    are written by :func:`make_meta` and may be absent from older records.
    Fields beyond these (``timings``, ``cpu_target``, ``cpu_features``,
    ``signature``, ``imported_from``, a bundle's ``file``) are kept as stored.

    ``traced``: the files whose code ran while the kernel was built and
    exported, with their sha256, and the distributions, with their versions
    (:mod:`kernel_cache.plan.traced`); checked against the files here before
    the entry is used. ``derived``: for an entry compiled while files its plan
    key's entry recorded had changed, the state of those files at each step,
    so that ``key`` is ``chain_key(hash of components, derived)`` (docs/keys.md).
    """

    model_config = ConfigDict(frozen=True, extra="allow", defer_build=True)

    key: str
    sha256: str
    size: StrictInt = Field(ge=0)
    variant: str | None = None
    components: dict[str, str] | None = None
    # int | float: a number read back is written back unchanged (5 stays 5)
    compile_seconds: int | float | None = None
    created: int | float | None = None
    format: str | None = None
    traced: Manifest | None = None
    derived: list[Manifest] | None = None

    @field_validator("compile_seconds", "created")
    @classmethod
    def _a_float(cls, v):
        """Seconds are compared as floats (newest entry first): an integer past
        the float range (``1`` and 400 zeros) would raise OverflowError there."""
        if v is not None:
            try:
                float(v)
            except OverflowError:
                raise ValueError(f"{str(v)[:16]}... is beyond the float range") from None
        return v

    def record(self) -> dict:
        """The JSON record: the fields it was made or read with, extra ones included."""
        return self.model_dump(mode="json", exclude_unset=True)


def make_meta(
    key: CacheKey,
    variant: str,
    data: bytes,
    compile_seconds: float,
    *,
    traced: Manifest | None = None,
    derived=(),
    **extra,
) -> dict:
    """The JSON metadata record for a new entry (an :class:`EntryMeta` record),
    stored under ``key`` or, given ``derived`` states, under the key they derive
    from it (:func:`kernel_cache.plan.traced.chain_key`)."""
    if traced is not None:
        extra["traced"] = traced
    if derived:
        extra["derived"] = list(derived)
    return EntryMeta(
        key=chain_key(key.hexdigest, derived),
        variant=variant,
        components=key.as_dict(),
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        compile_seconds=round(compile_seconds, 3),
        created=time.time(),
        format=ARTIFACT_FORMAT,
        **extra,
    ).record()


def parse_meta(raw: bytes | str, key: str, where: str = "") -> dict:
    """Parse a metadata record (JSON, validated as :class:`EntryMeta`); returns
    the parsed object as stored.

    Raises:
        CorruptEntryError: over :data:`META_MAX_BYTES`, not JSON (or nested too
            deep to parse), not an object,
            or a field missing or of the wrong type (names the field, what was
            wrong and the value).
    """
    if len(raw) > META_MAX_BYTES:
        raise CorruptEntryError(
            key, f"metadata is {len(raw)} bytes, over the limit of {META_MAX_BYTES}", where
        )
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise CorruptEntryError(key, f"metadata is not JSON ({e})", where) from None
    except RecursionError:  # "[[[[...": json raises it, not ValueError
        raise CorruptEntryError(key, "metadata is not a record (nested too deep)", where) from None
    check_meta(meta, key, where)
    return meta  # as stored: validated, never rewritten


def check_meta(meta, key: str, where: str = "") -> EntryMeta:
    """``meta`` (parsed JSON) as an :class:`EntryMeta`.

    Raises:
        CorruptEntryError: naming the field and what was wrong.
    """
    if not isinstance(meta, dict):
        raise CorruptEntryError(
            key, f"metadata is a JSON {type(meta).__name__}, not an object", where
        )
    try:
        return EntryMeta.model_validate(meta)
    except ValidationError as e:
        raise CorruptEntryError(key, f"metadata: {describe_errors(e)}", where) from None


def verify_entry(entry: Entry) -> str:
    """Check an entry before its code is loaded; returns the sha256 (hex) of its
    bytes, so a signature check need not hash them again.

    Raises:
        CorruptEntryError: the metadata is malformed (names the field), names
            another key, the size differs (truncated bytes), or the sha256 of
            the bytes does not match.
    """
    m = check_meta(entry.meta, entry.key, entry.where)
    if m.key != entry.key:
        raise CorruptEntryError(entry.key, f"metadata is for key {m.key[:16]}", entry.where)
    if m.size != len(entry.data):
        raise CorruptEntryError(
            entry.key,
            f"size {len(entry.data)} bytes != recorded {m.size} (truncated?)",
            entry.where,
        )
    digest = hashlib.sha256(entry.data).hexdigest()
    if digest != m.sha256:
        raise CorruptEntryError(
            entry.key, f"sha256 {digest[:16]} != recorded {m.sha256[:16]}", entry.where
        )
    return digest
