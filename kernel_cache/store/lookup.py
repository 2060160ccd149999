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

The policy for each tier is the lookup's, given as a :class:`Source` (a bare
tier gets its defaults, :attr:`Tier.trusted <kernel_cache.store.tier.Tier.trusted>`
and ``corrupt_is_miss``). An entry of an untrusted source (bundles, Redis) must
also pass :func:`kernel_cache.trust.signing.check_untrusted` (its signature, when a
signing key is set). One that fails is logged as rejected and never returned;
a source whose ``corrupt_is_miss`` is True (Redis: a shared cache that warmup
repairs) then counts as a miss and the lookup goes on, other sources raise. A
hit is copied into the lookup's ``promote_into`` tier (warmup: the local disk
cache), else into its source's ``promote_into`` (engine start: Redis hits into
the local cache), so the next lookup finds it locally. A copy that is refused
or fails is logged and the hit is returned all the same
(:attr:`Found.promoted` holds the :class:`~kernel_cache.store.tier.PutResult`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kernel_cache.errors import CorruptEntryError
from kernel_cache.plan.keys import BUILD_ONLY, CacheKey, key_from_components, runtime_digest
from kernel_cache.store.tier import Entry, PutOutcome, PutResult, Tier, verify_entry
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
    #: the copy into the promotion tier, or None where there is none
    promoted: PutResult | None = None


@dataclass(frozen=True)
class Source:
    """One tier of a :class:`Lookup` with the lookup's policy for it.

    ``trusted``: False makes its entries pass
    :func:`kernel_cache.trust.signing.check_untrusted` too; ``corrupt_is_miss``:
    a rejected entry is a miss and the lookup goes on (else it raises);
    ``promote_into``: where a verified hit is copied. None takes the tier's
    default (:attr:`Tier.trusted`, :attr:`Tier.corrupt_is_miss`).
    """

    tier: Tier
    trusted: bool | None = None
    corrupt_is_miss: bool | None = None
    promote_into: Tier | None = None

    def __post_init__(self):
        if self.trusted is None:
            object.__setattr__(self, "trusted", self.tier.trusted)
        if self.corrupt_is_miss is None:
            object.__setattr__(self, "corrupt_is_miss", self.tier.corrupt_is_miss)


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
    """Exact-then-compatible lookup over ``sources`` (in order): tiers, or
    :class:`Source` for a tier with a policy other than its defaults.

    The per-tier index of runtime digests is built on the first exact miss in
    that tier (one pass over its metadata) and reused for the remaining
    variants, so a plan that hits exactly never lists a tier.
    """

    def __init__(
        self,
        sources: Sequence[Tier | Source],
        *,
        exact: bool = False,
        promote_into: Tier | None = None,
    ):
        self.sources = [s if isinstance(s, Source) else Source(s) for s in sources]
        self.promote_into = promote_into
        self.exact = exact  # True: exact keys only (warmup), no compatible entries
        #: entries of untrusted tiers the last :meth:`find` rejected (and skipped)
        self.rejected: list[CorruptEntryError] = []
        #: the tier whose entry made the last :meth:`find` raise, or None
        self.failed_in: Tier | None = None
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

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, in lookup order."""
        return [s.tier for s in self.sources]

    def find(self, key: CacheKey) -> Found | None:
        """The first verified entry for ``key`` (exact, else compatible), or None.

        Raises:
            CorruptEntryError: the entry found fails verification (it is never
                returned, so its code is never loaded); :attr:`failed_in` is
                its tier.
        """
        self.rejected, self.failed_in = [], None
        for src in self.sources:
            tier = src.tier
            try:
                found = self._find_in(src, key)
            except CorruptEntryError as e:
                if not src.trusted:
                    log.warning("rejected %s entry %s: %s", tier.name, e.key[:16], e)
                    self.rejected.append(e)
                    if src.corrupt_is_miss:
                        continue
                self.failed_in = tier
                raise
            if found is not None:
                return self._promote(found, self.promote_into or src.promote_into)
        return None

    def _promote(self, found: Found, target: Tier | None) -> Found:
        """Copy a hit into ``target``; a refusal or failure is logged, never raised."""
        e = found.entry
        if target is None or target is found.tier:
            return found
        try:
            result = target.put(e.key, e.data, e.meta)
        except Exception as err:  # an unwritable or full cache must not stop the lookup
            result = PutResult(PutOutcome.FAILED, target.location, f"{type(err).__name__}: {err}")
        if not result.ok:
            log.warning("could not copy %s to %s: %s", e.key[:16], target.location, result.reason)
        return replace(found, promoted=result)

    def _check(self, src: Source, entry: Entry) -> None:
        digest = verify_entry(entry)
        if not src.trusted:
            check_untrusted(entry, digest=digest)

    def _find_in(self, src: Source, key: CacheKey) -> Found | None:
        """The verified (and for an untrusted source, checked) entry in one tier."""
        tier = src.tier
        mine = key.as_dict()
        entry = tier.get(key.hexdigest)
        if entry is not None:
            self._check(src, entry)
            return Found(entry, tier)
        if self.exact:
            return None
        for meta in self._runtime_index(tier).get(key.runtime_digest, ()):
            entry = tier.get(meta["key"])
            if entry is None:  # removed since the index was built
                continue
            self._check(src, entry)
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
