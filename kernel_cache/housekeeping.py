"""Housekeeping of a local cache: ls, stats, gc (LRU under a size limit), clear.

Sizes are artifact bytes as recorded in each entry's metadata (``size``); the
metadata records and diskcache's index add a few KiB per cache on top (``stats``
reports the directory's bytes on disk as well). A size limit is given as
``SIZE``: an integer number of bytes or a number with a unit K, M, G, T (powers
of 1024, an optional ``B``/``iB`` suffix): ``500M``, ``1.5GiB``, ``2g``.

``gc`` removes entries least recently used first (last use from
:mod:`kernel_cache.usage`; an entry never used counts from its creation) until
the artifact bytes are at most the limit, and never removes an entry of a kept
plan: one whose runtime digest (:attr:`kernel_cache.keys.CacheKey.runtime_digest`:
every key component but the build-only ``cxx``) is one of the kept plan's, so
a kept plan keeps every artifact engine start could load for it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from . import usage
from .errors import KernelCacheError
from .keys import runtime_digest
from .store import Tier

ENV_MAX_SIZE = "KERNEL_CACHE_MAX_SIZE"

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(?:i?[bB])?\s*")


def parse_size(text: str, name: str = "SIZE") -> int:
    """Bytes from ``"500M"``, ``"1.5GiB"``, ``"1048576"`` (units are powers of 1024).

    Raises:
        KernelCacheError: not a size (names ``name``, the value and the form).
    """
    m = _SIZE_RE.fullmatch(str(text))
    if not m:
        raise KernelCacheError(
            f"{name}={text!r} is not a size; expected bytes or a number with K, M, G or T "
            "(powers of 1024), e.g. 500M or 2G"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: float) -> str:
    """``1536 -> "1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - loop always returns


def max_size_from_env(environ=None) -> int | None:
    """``$KERNEL_CACHE_MAX_SIZE`` in bytes, or None if unset or empty."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_MAX_SIZE, "").strip()
    return parse_size(raw, ENV_MAX_SIZE) if raw else None


def _directory(tier: Tier) -> Path | None:
    d = getattr(tier, "directory", None)
    return Path(d) if d is not None else None


def list_entries(tier: Tier) -> list[dict]:
    """One row per entry: ``variant``, ``key``, ``size`` (bytes),
    ``compile_seconds``, ``created`` and ``last_used`` (unix seconds; None if
    never used), ``runtime_digest``, sorted by variant then creation."""
    d = _directory(tier)
    last = usage.read_usage(d)["last_used"] if d is not None else {}
    rows = []
    for m in tier.iter_meta():
        comps = m.get("components")
        rows.append(
            {
                "variant": m.get("variant", "?"),
                "key": m["key"],
                "size": int(m.get("size") or 0),
                "compile_seconds": m.get("compile_seconds"),
                "created": m.get("created"),
                "last_used": last.get(m["key"]),
                "runtime_digest": runtime_digest(comps) if isinstance(comps, dict) else None,
            }
        )
    rows.sort(key=lambda r: (r["variant"], r["created"] or 0))
    return rows


def dir_bytes(directory: str | os.PathLike) -> int:
    """Bytes of every regular file under ``directory`` (what the cache takes on disk)."""
    total = 0
    for dirpath, _, files in os.walk(directory):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def cache_stats(tier: Tier) -> dict:
    """``{"location", "entries", "bytes" (artifacts), "disk_bytes" (every file),
    "hits", "misses", "since" (unix seconds of the first record or None)}``."""
    rows = list_entries(tier)
    d = _directory(tier)
    u = usage.read_usage(d) if d is not None else {"hits": 0, "misses": 0, "since": None}
    return {
        "location": tier.location,
        "entries": len(rows),
        "bytes": sum(r["size"] for r in rows),
        "disk_bytes": dir_bytes(d) if d is not None else None,
        "hits": int(u["hits"]),
        "misses": int(u["misses"]),
        "since": u["since"],
    }


def plan_digests(config) -> set[str]:
    """The runtime digests of every variant of ``config``'s plan in this environment."""
    from .buckets import Bucketer
    from .keys import build_key, environment

    env = environment(config)
    return {build_key(config, v, env).runtime_digest for v in Bucketer(config).variants}


def gc(tier: Tier, max_size: int, keep: set[str] | frozenset = frozenset()) -> dict:
    """Remove least recently used entries until artifact bytes <= ``max_size``,
    never one whose runtime digest is in ``keep`` (see the module docstring).

    Returns: ``{"removed": [{"variant", "key", "size"}], "removed_bytes",
    "before_bytes", "after_bytes", "kept_bytes" (entries of kept plans),
    "max_size", "under_limit" (bool)}``. ``under_limit`` is False only when
    the kept plans alone exceed ``max_size``.
    """
    if max_size < 0:
        raise KernelCacheError(f"--max-size {max_size}: must be >= 0 bytes")
    rows = list_entries(tier)
    total = sum(r["size"] for r in rows)
    kept = [r for r in rows if r["runtime_digest"] in keep]
    candidates = [r for r in rows if r["runtime_digest"] not in keep]
    candidates.sort(key=lambda r: r["last_used"] or r["created"] or 0)
    removed, size = [], total
    for r in candidates:
        if size <= max_size:
            break
        tier.delete(r["key"])
        removed.append({"variant": r["variant"], "key": r["key"], "size": r["size"]})
        size -= r["size"]
    d = _directory(tier)
    if removed and d is not None:
        usage.record(d, forget=[r["key"] for r in removed])
    return {
        "removed": removed,
        "removed_bytes": total - size,
        "before_bytes": total,
        "after_bytes": size,
        "kept_bytes": sum(r["size"] for r in kept),
        "max_size": max_size,
        "under_limit": size <= max_size,
    }


def clear(tier: Tier) -> dict:
    """Remove every entry of the cache and its usage record (the directory stays).

    Returns ``{"removed": <entries>, "removed_bytes"}``."""
    rows = list_entries(tier)
    for r in rows:
        tier.delete(r["key"])
    d = _directory(tier)
    if d is not None:
        usage.reset(d)
    return {"removed": len(rows), "removed_bytes": sum(r["size"] for r in rows)}
