"""Find a variant's entry across tiers: the exact key first, then a compatible one.

Lookup order is the order of the tiers (engine start: bundles, then the local
disk cache; see :func:`kernel_cache.runtime.load.default_tiers`). In each tier:

1. the exact key (every component equal, the build-only ``cxx`` included);
2. else an entry whose runtime components (all but
   :data:`kernel_cache.plan.keys.BUILD_ONLY`) equal this process's: an artifact
   built with another C++ compiler, or in a build stage while this runtime
   has none. Its build-only values are taken from its record and reported in
   :attr:`Found.accepted` (``{"cxx": (here, stored)}``) so the caller logs them.

A compatible candidate is used only if its recorded key is the hash of its
recorded components (a record that disagrees with itself is never trusted),
and, like an exact hit, only after :func:`kernel_cache.store.tier.verify_entry`
has checked its size and sha256.

An entry of an untrusted tier (``Tier.trusted`` False: bundles, Redis) must
also pass :func:`kernel_cache.trust.signing.check_untrusted` (its signature, when a
signing key is set). One that fails is logged as rejected and never returned;
a tier whose ``corrupt_is_miss`` is True (Redis: a shared cache that warmup
repairs) then counts as a miss and the lookup goes on, other tiers raise. A hit
is copied into the lookup's ``promote_into`` tier (warmup: the local disk
cache), else into its own tier's ``promote_into`` (engine start sets Redis's to
the local cache), so the next lookup finds it locally.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kernel_cache.errors import CorruptEntryError
from kernel_cache.plan.keys import BUILD_ONLY, CacheKey, key_from_components, runtime_digest
from kernel_cache.store.tier import Entry, Tier, verify_entry
from kernel_cache.trust.signing import check_untrusted

log = logging.getLogger("kernel_cache")


@dataclass(frozen=True)
class Found:
    """A verified entry, the tier it came from, and the build-only components
    accepted from its record: ``{name: (this process, stored)}`` (empty on an
    exact hit)."""

    entry: Entry
    tier: Tier
    accepted: dict[str, tuple[str, str]] = field(default_factory=dict)


def consistent(meta: dict) -> bool:
    """True if ``meta["key"]`` is the hash of ``meta["components"]``."""
    comps = meta.get("components")
    if not isinstance(comps, dict):
        return False
    try:
        return key_from_components(comps).hexdigest == meta.get("key")
    except ValueError:
        return False


class Lookup:
    """Exact-then-compatible lookup over ``tiers`` (in order).

    The per-tier index of runtime digests is built on the first exact miss in
    that tier (one pass over its metadata) and reused for the remaining
    variants, so a plan that hits exactly never lists a tier.
    """

    def __init__(self, tiers: list[Tier], *, exact: bool = False, promote_into: Tier | None = None):
        self.tiers = list(tiers)
        self.promote_into = promote_into
        self.exact = exact  # True: exact keys only (warmup), no compatible entries
        #: entries of untrusted tiers the last :meth:`find` rejected (and skipped)
        self.rejected: list[CorruptEntryError] = []
        self._index: dict[int, dict[str, list[dict]]] = {}

    def _runtime_index(self, tier: Tier) -> dict[str, list[dict]]:
        idx = self._index.get(id(tier))
        if idx is None:
            idx = {}
            for meta in tier.iter_meta():
                if consistent(meta):
                    idx.setdefault(runtime_digest(meta["components"]), []).append(meta)
            for metas in idx.values():  # newest first
                metas.sort(key=lambda m: -float(m.get("created") or 0))
            self._index[id(tier)] = idx
        return idx

    def find(self, key: CacheKey) -> Found | None:
        """The first verified entry for ``key`` (exact, else compatible), or None.

        Raises:
            CorruptEntryError: the entry found fails verification (it is never
                returned, so its code is never loaded).
        """
        self.rejected = []
        for tier in self.tiers:
            try:
                found = self._find_in(tier, key)
            except CorruptEntryError as e:
                if tier.trusted:
                    raise
                log.warning("rejected %s entry %s: %s", tier.name, e.key[:16], e)
                self.rejected.append(e)
                if tier.corrupt_is_miss:
                    continue
                raise
            if found is not None:
                target = self.promote_into or tier.promote_into
                e = found.entry
                if target is not None and target is not tier:
                    try:
                        target.put(e.key, e.data, e.meta)
                    except Exception as err:  # an unwritable or full cache must not stop it
                        log.warning("could not copy %s to %s: %s", e.key[:16], target.location, err)
                return found
        return None

    def _check(self, tier: Tier, entry: Entry) -> None:
        verify_entry(entry)
        if not tier.trusted:
            check_untrusted(entry)

    def _find_in(self, tier: Tier, key: CacheKey) -> Found | None:
        """The verified (and for an untrusted tier, checked) entry in one tier."""
        mine = key.as_dict()
        entry = tier.get(key.hexdigest)
        if entry is not None:
            self._check(tier, entry)
            return Found(entry, tier)
        if self.exact:
            return None
        for meta in self._runtime_index(tier).get(key.runtime_digest, ()):
            entry = tier.get(meta["key"])
            if entry is None:  # removed since the index was built
                continue
            self._check(tier, entry)
            if (
                not consistent(entry.meta)
                or runtime_digest(entry.meta["components"]) != key.runtime_digest
            ):
                raise CorruptEntryError(
                    meta["key"], "its record changed while it was read", entry.where
                )
            stored = entry.meta["components"]
            accepted = {n: (mine[n], stored[n]) for n in BUILD_ONLY if stored.get(n) != mine.get(n)}
            return Found(entry, tier, accepted)
        return None


def merge_accepted(into: dict, accepted: dict[str, tuple[str, str]]) -> None:
    """Fold one :attr:`Found.accepted` into a report:
    ``{name: {"here": value, "stored": [distinct stored values]}}``."""
    for name, (here, stored) in accepted.items():
        slot = into.setdefault(name, {"here": here, "stored": []})
        if stored not in slot["stored"]:
            slot["stored"].append(stored)
