"""Housekeeping of a local cache: ls, stats, gc (LRU under a size limit), clear.

Sizes are artifact bytes as recorded in each entry's metadata (``size``); the
metadata records and diskcache's index add a few KiB per cache on top (``stats``
reports the directory's bytes on disk as well). A size limit is given as
``SIZE``: an integer number of bytes or a number with a unit K, M, G, T (powers
of 1024, an optional ``B``/``iB`` suffix): ``500M``, ``1.5GiB``, ``2g``.

``gc`` removes entries least recently used first (last use from
:mod:`kernel_cache.store.usage`; an entry never used counts from its creation) until
the artifact bytes are at most the limit, and never removes an entry of a kept
plan: one whose runtime digest (:attr:`kernel_cache.plan.keys.CacheKey.runtime_digest`:
every key component but the build-only ``cxx``) is one of the kept plan's, so
a kept plan keeps every artifact engine start could load for it.

Entries whose metadata cannot be read (garbage, a link, a missing or truncated
artifact file: :meth:`kernel_cache.store.disk_tier.DiskTier.iter_records`) are listed
with ``status`` ``corrupt`` and the reason, never hidden; ``gc`` and ``clear``
remove them like any other entry (their size is their file's).

``gc`` and ``clear`` also remove **orphan** value files: ``xx/yy/*.val`` files
that no index row references (left by a process killed while publishing),
except those modified within :data:`ORPHAN_GRACE_S` (a publish in progress
writes its file before its row commits). ``clear`` removes ``quarantine/``
too. Nothing is removed through a symbolic link.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
from pathlib import Path

import kernel_cache.store.usage as usage
from kernel_cache.errors import KernelCacheError
from kernel_cache.plan.keys import runtime_digest
from kernel_cache.store.disk_tier import Tier

#: Seconds an unreferenced value file is kept by ``gc`` and ``clear``. A
#: publish writes its file and commits its index row within one SQLite write
#: transaction (milliseconds to seconds; its lock wait is bounded by
#: ``KERNEL_CACHE_DB_TIMEOUT``, 60 s by default), so an hour keeps every file
#: still being published, even by a stalled writer.
ORPHAN_GRACE_S = 3600.0

_HEX2 = re.compile(r"[0-9a-f]{2}")


def format_size(n: float) -> str:
    """``1536 -> "1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - loop always returns


def _directory(tier: Tier) -> Path | None:
    d = getattr(tier, "directory", None)
    return Path(d) if d is not None else None


def model_label(components: dict | None) -> str:
    """A short name of the model an entry was built for, from its ``geometry``
    component: the presets with that attention geometry (``llama-3.2-1b``;
    several joined with ``/`` where they share it), else the geometry
    (``4h/2kv/d8``), then the block size (``bs16``); ``?`` if it is unknown."""
    from kernel_cache.config.engine import PRESETS

    try:
        g = json.loads(components["geometry"])
        shape = (int(g["num_heads"]), int(g["num_kv_heads"]), int(g["head_dim"]))
    except (TypeError, KeyError, ValueError):
        return "?"
    names = [n for n, p in PRESETS.items() if (p.num_heads, p.num_kv_heads, p.head_dim) == shape]
    name = "/".join(names) or f"{shape[0]}h/{shape[1]}kv/d{shape[2]}"
    return f"{name} bs{g['block_size']}" if "block_size" in g else name


def variant_sort_key(variant: str) -> tuple:
    """Natural order of variant names: the kernel, then each numeric field as a
    number (``paged_attention:1:...`` before ``paged_attention:1024:...``)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in str(variant).split(":"))


def list_entries(tier: Tier) -> list[dict]:
    """One row per entry: ``variant``, ``model`` (:func:`model_label`),
    ``dtype``, ``device``, ``key``, ``size`` (bytes), ``compile_seconds``,
    ``created`` and ``last_used`` (unix seconds; None if never used),
    ``runtime_digest``, ``device_arch`` (the key's target: the GPU
    architecture, or the CPU's instruction-set target, e.g. ``x86_64/x86-64-v3``),
    ``kernel`` (the import path of the kernel the entry
    holds, None if not recorded), ``status`` (``ok`` or ``corrupt``) and, for a corrupt
    entry, ``reason`` (its size is its artifact file's, its other fields None).
    Sorted naturally by variant (:func:`variant_sort_key`), then model, dtype,
    device and creation; corrupt entries last."""
    d = _directory(tier)
    last = usage.read_usage(d).last_used if d is not None else {}
    rows = []
    for key, m, reason in tier.iter_records():
        if m is None:
            size = tier.record_size(key)
            rows.append(_corrupt_row(key, size, reason, last.get(key)))
        else:
            rows.append(_entry_row(m, last.get(m["key"])))
    rows.sort(
        key=lambda r: (
            r["status"] != "ok",
            variant_sort_key(r["variant"]),
            r["model"],
            r["dtype"] or "",
            r["device"] or "",
            r["created"] or 0,
        )
    )
    return rows


def _entry_row(m: dict, last_used: float | None) -> dict:
    """:func:`list_entries`' row of a readable entry's record ``m``, last used
    at ``last_used`` (unix seconds, None if never)."""
    comps = m.get("components")
    comps = comps if isinstance(comps, dict) else {}
    return {
        "variant": str(m.get("variant", "?")),
        "model": model_label(comps),
        "dtype": comps.get("dtype"),
        "device": comps.get("device"),
        "device_arch": comps.get("device_arch"),
        "key": m["key"],
        "size": int(m.get("size") or 0),
        "compile_seconds": m.get("compile_seconds"),
        "created": m.get("created"),
        "last_used": last_used,
        "runtime_digest": runtime_digest(comps) if comps else None,
        "kernel": m.get("kernel") or comps.get("kernel"),
        "status": "ok",
    }


def _corrupt_row(key: str, size: int, reason: str, last_used: float | None) -> dict:
    """:func:`list_entries`' row of the unreadable entry ``key``: its artifact
    file's ``size`` (bytes), why it is corrupt (``reason``), ``last_used``
    (unix seconds, None if never); its other fields None."""
    return {
        "variant": "?",
        "model": "?",
        "dtype": None,
        "device": None,
        "device_arch": None,
        "key": key,
        "size": size,
        "compile_seconds": None,
        "created": None,
        "last_used": last_used,
        "runtime_digest": None,
        "kernel": None,
        "status": "corrupt",
        "reason": reason,
    }


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
    """``{"location", "entries" (corrupt ones included), "corrupt", "bytes"
    (artifacts), "disk_bytes" (every file), "hits", "misses", "since" (unix
    seconds of the first record or None)}``."""
    rows = list_entries(tier)
    d = _directory(tier)
    u = usage.read_usage(d) if d is not None else usage.UsageRecord()
    return {
        "location": tier.location,
        "entries": len(rows),
        "corrupt": sum(r["status"] == "corrupt" for r in rows),
        "bytes": sum(r["size"] for r in rows),
        "disk_bytes": dir_bytes(d) if d is not None else None,
        "hits": u.hits,
        "misses": u.misses,
        "since": u.since,
    }


def empty_stats(location: str | os.PathLike) -> dict:
    """What :func:`cache_stats` reports for a cache directory that does not
    exist yet: zeros, and ``exists`` False."""
    return {
        "location": str(location),
        "exists": False,
        "entries": 0,
        "corrupt": 0,
        "bytes": 0,
        "disk_bytes": 0,
        "hits": 0,
        "misses": 0,
        "since": None,
    }


def _value_files(directory: Path) -> list[str]:
    """The ``xx/yy/*.val`` names under ``directory`` (diskcache's value-file
    layout), links included, never descending through a link."""
    out = []
    for a in os.scandir(directory):
        if not (_HEX2.fullmatch(a.name) and a.is_dir(follow_symlinks=False)):
            continue
        for b in os.scandir(a.path):
            if not (_HEX2.fullmatch(b.name) and b.is_dir(follow_symlinks=False)):
                continue
            for f in os.scandir(b.path):
                if f.name.endswith(".val") and not f.is_dir(follow_symlinks=False):
                    out.append(f"{a.name}/{b.name}/{f.name}")
    return out


def remove_orphans(tier: Tier, *, grace_s: float = ORPHAN_GRACE_S, now: float | None = None):
    """Remove the value files of ``tier`` (a writable local cache) that no index
    row references and that were last modified more than ``grace_s`` seconds
    ago (see the module docstring). The files are listed before the index is
    read, so a file whose row commits meanwhile is seen as referenced.

    Returns ``{"removed": <files>, "removed_bytes", "kept_young": <files>}``
    (zeros for a tier that is not a writable local cache).
    """
    from kernel_cache.store.safe_disk import IndexSnapshot, remove_entry_file

    out = {"removed": 0, "removed_bytes": 0, "kept_young": 0}
    d = _directory(tier)
    if d is None or getattr(tier, "read_only", True) or not d.is_dir():
        return out
    tier.cache  # noqa: B018 - open (and trust-check) it: refuses links where the index belongs
    files = _value_files(d)
    referenced = IndexSnapshot(d, timeout=tier.timeout).filenames
    now = time.time() if now is None else now
    for name in files:
        if name in referenced:
            continue
        try:
            st = os.lstat(d / name)
        except OSError:
            continue
        if now - st.st_mtime < grace_s:
            out["kept_young"] += 1
            continue
        remove_entry_file(d, name)
        out["removed"] += 1
        out["removed_bytes"] += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return out


def plan_digests(plan) -> set[str]:
    """The runtime digests of every variant of a plan in this environment.

    ``plan``: a :class:`~kernel_cache.plan.plan.Plan`, or an ``EngineConfig``
    whose plan is built here.
    """
    from kernel_cache.plan.plan import Plan

    if not isinstance(plan, Plan):
        plan = Plan.build(plan, log_launch=False)
    return {item.key.runtime_digest for item in plan}


def gc(
    tier: Tier,
    max_size: int,
    keep: set[str] | frozenset = frozenset(),
    *,
    orphan_grace_s: float = ORPHAN_GRACE_S,
) -> dict:
    """Remove least recently used entries until artifact bytes <= ``max_size``,
    never one whose runtime digest is in ``keep`` (see the module docstring),
    then the orphan value files older than ``orphan_grace_s`` seconds.

    Returns: ``{"removed": [{"variant", "key", "size"}], "removed_bytes",
    "before_bytes", "after_bytes", "kept_bytes" (entries of kept plans),
    "max_size", "under_limit" (bool), "orphans" (:func:`remove_orphans`)}``.
    ``under_limit`` is False only when the kept plans alone exceed ``max_size``.

    Raises:
        KernelCacheError: ``max_size`` is negative.
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
        "orphans": remove_orphans(tier, grace_s=orphan_grace_s),
    }


def clear(tier: Tier, *, orphan_grace_s: float = ORPHAN_GRACE_S) -> dict:
    """Remove every entry of the cache (corrupt ones included), its usage
    record and import memo, ``quarantine/`` and the orphan value files older than
    ``orphan_grace_s`` seconds. The directory and ``locks/`` stay (a running
    warmup may hold a lock).

    Returns ``{"removed": <entries>, "removed_bytes", "quarantine_removed":
    <quarantined entries>, "orphans" (:func:`remove_orphans`)}``.

    Raises:
        UntrustedCacheError: ``quarantine/`` (or another path of the cache) is
            a symbolic link (refused when the cache is opened; never followed).
    """
    from kernel_cache.store import imports_memo
    from kernel_cache.store.quarantine import QUARANTINE_DIR

    rows = list_entries(tier)
    for r in rows:
        tier.delete(r["key"])
    d = _directory(tier)
    quarantined = 0
    if d is not None:
        usage.reset(d)
        imports_memo.remove(d)
        q = d / QUARANTINE_DIR
        if q.is_dir() and not q.is_symlink():
            quarantined = sum(1 for p in q.iterdir() if not p.name.startswith("."))
            shutil.rmtree(q)  # removes links inside, never follows them
    return {
        "removed": len(rows),
        "removed_bytes": sum(r["size"] for r in rows),
        "quarantine_removed": quarantined,
        "orphans": remove_orphans(tier, grace_s=orphan_grace_s),
    }
