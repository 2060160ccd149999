"""Lifecycle of a shared object store (``kernel-cache gc-remote``): remove the
entries that no recent plan manifest references and that are older than an age
the user gives, with the manifests and leases older than that age.

Nothing in the store is ever removed by warmup or an engine (entries are
immutable, written create-once), so ``entries/`` grows with every torch,
compiler or kernel change. What is removed (all judged by the store's own
last-modified time, never by a date a writer put in a body):

- ``entries/<key>`` older than ``older_than_s`` whose key no manifest younger
  than ``older_than_s`` lists;
- ``manifests/*.json`` older than ``older_than_s``;
- ``leases/...`` not written for ``older_than_s`` (a held lease is rewritten
  every third of its TTL, seconds);
- ``index/<name>/<digest>/<key>`` older than ``older_than_s`` whose entry is
  not kept (removed now, or gone);
- anything else under those prefixes (a builder's leftover temporary file of
  a ``file://`` directory) older than ``older_than_s``.

A plan keeps its entries while its manifest is younger than the age: a
warmup that completes the plan writes the manifest again when it is over a
day old (:data:`kernel_cache.store.s3_objects.MANIFEST_RENEW_S`), so the age must be
longer than a plan stays in use without a builder warming it
(docs/shared-storage.md). Each prefix's listing is bounded by
``KERNEL_CACHE_REMOTE_LIST_MAX`` (past it gc-remote stops before removing
anything), and each manifest read by ``KERNEL_CACHE_S3_MAX_OBJECT``.
"""

from __future__ import annotations

import math
import re
import time
from datetime import datetime

from pydantic import ValidationError

from kernel_cache.errors import ConfigError

_AGE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_KEY_RE = re.compile(r"[0-9a-f]{64}")


def parse_age(text: str, name: str = "--older-than") -> float:
    """Seconds from ``"30d"``, ``"12h"``, ``"90m"``, ``"3600s"`` or ``"2w"``.

    Raises:
        ConfigError: not an age (a bare number too: ``30`` meant as days would
            remove all but the last 30 s), 0, or too large for a float (names
            ``name``, the value and the form).
    """
    m = _AGE_RE.fullmatch(str(text))
    seconds = float(m.group(1)) * _UNIT_S[m.group(2).lower()] if m else 0.0
    if not 0 < seconds < math.inf:
        raise ConfigError(
            f"{name} {text!r} is not an age: expected a number > 0 followed by s, m, h, d or w "
            "(seconds, minutes, hours, days, weeks), e.g. 30d"
        )
    return seconds


def _stamp(meta) -> float:
    t = meta.get("last_modified")
    return t.timestamp() if isinstance(t, datetime) else float(t or 0)


def gc_remote(tier, older_than_s: float, *, dry_run: bool = False, now: float | None = None):
    """Remove (or with ``dry_run`` only list) what the module docstring says.

    Args:
        tier: an object-store tier (:class:`~kernel_cache.store.s3.S3Tier`),
            not fail-open.
        older_than_s: the age in seconds (> 0).
        now: unix seconds (default: the clock).

    Returns:
        ``{"url", "older_than_s", "dry_run", "removed": [{"path", "size",
        "age_s"}], "removed_bytes", "kept_entries", "kept_by_manifests",
        "manifests_read"}``; ``removed`` lists what was (or would be) removed.

    Each prefix's listing takes at most ``list_max`` names
    (``KERNEL_CACHE_REMOTE_LIST_MAX``): ``ceil((list_max + 1) / 1000)`` LIST
    requests of it at most; the manifests read are among those names, each
    refused over ``KERNEL_CACHE_S3_MAX_OBJECT`` bytes from its size.

    Raises:
        RemoteUnavailableError: the store failed (names it and the fix).
        ListingLimitError: a prefix holds more names than ``list_max``; nothing
            is removed (names the store, the prefix, the bound and the fix).
    """
    from kernel_cache.store.s3 import list_pages
    from kernel_cache.store.s3_objects import S3Manifest, walk_dir

    now = time.time() if now is None else now
    cutoff = now - older_than_s

    limit = tier.settings.list_max

    def listing(prefix: str):
        def past(seen: int) -> Exception:
            return tier.listing_limit(
                f"more than {limit} names under {prefix} ({seen} listed; gc-remote "
                "removed nothing)",
                f"delete the names under {prefix} that are not this cache's with the "
                "store's own tools",
            )

        def op(ob, store):
            if tier.settings.scheme == "file":
                store  # noqa: B018 - refuses a missing directory, naming it
                return walk_dir(tier.settings.directory, prefix, limit, past)
            pages = list_pages(ob, store, prefix, limit, past)
            return [(m["path"], int(m["size"]), _stamp(m)) for batch in pages for m in batch]

        return tier._run(f"LIST {prefix}", op, fail_open=False)

    referenced: set[str] = set()
    old: list[tuple[str, int, float]] = []
    read = 0
    for path, size, t in listing("manifests/"):
        if t < cutoff:
            old.append((path, size, t))
            continue
        try:
            raw = tier._get_bytes(path)
        except Exception as e:  # too large: not a manifest of this cache, keep nothing for it
            if tier._is_failure(e):
                raise
            raw = None
        read += 1
        try:
            referenced |= set(S3Manifest.model_validate_json(raw).keys) if raw else set()
        except ValidationError:
            pass
    kept: set[str] = set()
    for path, size, t in listing("entries/"):
        name = path.rsplit("/", 1)[-1]
        if t >= cutoff or (_KEY_RE.fullmatch(name) and name in referenced):
            kept.add(name)
        else:
            old.append((path, size, t))
    old += [(p, s, t) for p, s, t in listing("leases/") if t < cutoff]
    old += [
        (p, s, t)
        for p, s, t in listing("index/")
        if t < cutoff and p.rsplit("/", 1)[-1] not in kept
    ]
    removed = [{"path": p, "size": s, "age_s": round(now - t, 1)} for p, s, t in sorted(old)]
    if not dry_run:
        for r in removed:
            tier._run(
                f"DELETE {r['path']}",
                lambda ob, store, p=r["path"]: ob.delete(store, p),
                fail_open=False,
            )
    return {
        "url": tier.location,
        "older_than_s": older_than_s,
        "dry_run": dry_run,
        "removed": removed,
        "removed_bytes": sum(r["size"] for r in removed),
        "kept_entries": len(kept),
        "kept_by_manifests": len(referenced),
        "manifests_read": read,
    }
