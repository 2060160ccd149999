"""Storage tiers behind one small interface, and entry verification.

An entry is the artifact's bytes (an AOTInductor ``.pt2`` package) plus a JSON
metadata record::

    {"key": <sha256 hex>, "variant": "batched_decode:1:8:4",
     "components": {name: value, ...}, "sha256": <sha256 of the bytes>,
     "size": <bytes>, "compile_seconds": <float>, "created": <unix seconds>,
     "format": "kc1"}

Metadata is JSON, never pickle. Every tier returns raw entries;
:func:`verify_entry` checks them before any code is loaded.

The interface (:class:`Tier`) follows the shape of Triton's ``CacheManager``
(``python/triton/runtime/cache.py``): get, put, contains, delete and listing.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import CorruptEntryError
from .keys import ARTIFACT_FORMAT, CacheKey

ENV_CACHE_DIR = "KERNEL_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$KERNEL_CACHE_DIR``, else ``~/.cache/kernel_cache``."""
    env = os.environ.get(ENV_CACHE_DIR)
    return Path(env) if env else Path.home() / ".cache" / "kernel_cache"


@dataclass(frozen=True)
class Entry:
    """A stored entry as read from a tier: metadata (parsed JSON) and bytes."""

    key: str
    meta: dict
    data: bytes
    where: str = ""


def make_meta(key: CacheKey, variant: str, data: bytes, compile_seconds: float, **extra) -> dict:
    """The JSON metadata record for a new entry."""
    return {
        "key": key.hexdigest,
        "variant": variant,
        "components": key.as_dict(),
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "compile_seconds": round(compile_seconds, 3),
        "created": time.time(),
        "format": ARTIFACT_FORMAT,
        **extra,
    }


def parse_meta(raw: bytes | str, key: str, where: str = "") -> dict:
    """Parse a metadata record; :class:`CorruptEntryError` if it is not valid JSON
    with the required fields."""
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptEntryError(key, f"metadata is not JSON ({e})", where) from None
    if not isinstance(meta, dict) or not {"key", "sha256", "size"} <= set(meta):
        raise CorruptEntryError(key, "metadata lacks key/sha256/size", where)
    return meta


def verify_entry(entry: Entry) -> None:
    """Check an entry before its code is loaded.

    Raises:
        CorruptEntryError: the metadata names another key, the size differs
            (truncated bytes), or the sha256 of the bytes does not match.
    """
    m = entry.meta
    if m.get("key") != entry.key:
        raise CorruptEntryError(
            entry.key, f"metadata is for key {str(m.get('key'))[:16]}", entry.where
        )
    if m.get("size") != len(entry.data):
        raise CorruptEntryError(
            entry.key,
            f"size {len(entry.data)} bytes != recorded {m.get('size')} (truncated?)",
            entry.where,
        )
    digest = hashlib.sha256(entry.data).hexdigest()
    if digest != m.get("sha256"):
        raise CorruptEntryError(
            entry.key, f"sha256 {digest[:16]} != recorded {str(m.get('sha256'))[:16]}", entry.where
        )


class Tier(abc.ABC):
    """A place entries are stored: memory, a bundle, a local disk cache, Redis."""

    name: str = "tier"
    location: str = ""

    @abc.abstractmethod
    def get(self, key: str) -> Entry | None:
        """The raw (unverified) entry, or None on a miss.

        Raises:
            CorruptEntryError: the entry exists but its metadata cannot be read.
        """

    @abc.abstractmethod
    def get_meta(self, key: str) -> dict | None:
        """The metadata record alone, or None."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes, meta: dict) -> None:
        """Publish an entry atomically: readers see all of it or none of it."""

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def iter_meta(self) -> Iterator[dict]:
        """Every entry's metadata (for ls, stats, explain)."""

    def contains(self, key: str) -> bool:
        return self.get_meta(key) is not None

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class DiskTier(Tier):
    """Local disk cache in a :class:`diskcache.Cache` under ``directory``.

    The artifact bytes are stored under ``art/<key>`` (diskcache keeps values
    above 32 KiB as files) and the JSON metadata under ``meta/<key>``; both are
    written inside one ``Cache.transact()``, so a reader sees both or neither.
    Eviction is off (``eviction_policy="none"``): nothing disappears behind the
    user's back; ``kernel-cache gc`` removes entries explicitly.
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike | None = None):
        import diskcache

        self.directory = Path(directory) if directory else default_cache_dir()
        self.location = str(self.directory)
        self.cache = diskcache.Cache(
            str(self.directory), eviction_policy="none", size_limit=2**62, timeout=60
        )

    def get_meta(self, key: str) -> dict | None:
        raw = self.cache.get("meta/" + key)
        if raw is None:
            return None
        return parse_meta(raw, key, self.location)

    def get(self, key: str) -> Entry | None:
        meta = self.get_meta(key)
        if meta is None:
            return None
        data = self.cache.get("art/" + key)
        if data is None:
            raise CorruptEntryError(
                key, "metadata present but artifact bytes missing", self.location
            )
        return Entry(key=key, meta=meta, data=bytes(data), where=self.location)

    def put(self, key: str, data: bytes, meta: dict) -> None:
        raw_meta = json.dumps(meta, sort_keys=True).encode()
        with self.cache.transact():
            self.cache.set("art/" + key, data)
            self.cache.set("meta/" + key, raw_meta)

    def delete(self, key: str) -> None:
        with self.cache.transact():
            self.cache.delete("meta/" + key)
            self.cache.delete("art/" + key)

    def iter_meta(self) -> Iterator[dict]:
        for k in list(self.cache.iterkeys()):
            if isinstance(k, str) and k.startswith("meta/"):
                raw = self.cache.get(k)
                if raw is None:
                    continue
                try:
                    yield parse_meta(raw, k[5:], self.location)
                except CorruptEntryError:
                    continue

    def close(self) -> None:
        self.cache.close()
