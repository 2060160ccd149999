"""Find a variant's entry across tiers: the exact key first, then a compatible one.

Lookup order is the order of the tiers (engine start: bundles, then the local
disk cache; see :func:`kernel_cache.runtime.load.default_tiers`). In each tier:

1. the exact key (every component equal, the build-only ``cxx`` included);
2. else an entry whose runtime components (all but
   :data:`kernel_cache.plan.keys.BUILD_ONLY`) equal this process's: an artifact
   built with another C++ compiler, or in a build stage while this runtime
   has none. Its build-only values are taken from its record and reported in
   :attr:`Found.accepted` (``{"cxx": (here, stored)}``) so the caller logs them.

Every entry also records the files its code came from (``traced``:
:mod:`kernel_cache.plan.traced`), and it is used only while they are unchanged
here: :func:`current_entry`, the one function through which engine start,
verify, explain, export and warmup find a key's artifact, follows a mismatch
to the key derived from the files' state here (docs/keys.md), and names the
changed files (:attr:`Search.changes`) when nothing is stored there.

A compatible candidate is used only if its recorded key is the hash of its
recorded components (for a derived entry, through its recorded ``derived``
states; a record that disagrees with itself is never trusted),
and, like an exact hit, only after :func:`kernel_cache.store.disk_tier.verify_entry`
has checked its size and sha256.

The policy for each tier is the lookup's, given as a :class:`Source` (a bare
tier gets its defaults, :attr:`Tier.trusted <kernel_cache.store.disk_tier.Tier.trusted>`
and ``corrupt_is_miss``). A lookup over an untrusted source (bundles, Redis,
S3) needs a key to check signatures, or the insecure opt-out: else it is
refused when it is made (:func:`kernel_cache.trust.keys.shared_keyring`).
Each entry of such a source must pass
:func:`kernel_cache.trust.signing.check_untrusted` (its signature). One that
fails is refused and never returned: a signature refusal is logged once per
tier and reason (:attr:`Search.rejected` keeps each), other damage once per
entry; a source whose ``corrupt_is_miss`` is True (Redis, S3: shared caches
that warmup repairs) then counts as a miss and the lookup goes on, other
sources raise. A hit is copied into the lookup's ``promote_into`` tier
(warmup: the local disk cache), else into its source's ``promote_into``
(engine start: remote hits into the local cache), so the next lookup finds
it locally. The copy keeps its signature and records where it came from
(``imported_from``); a local entry with ``imported_from`` is checked as its
source was wherever keys are set, and one refused then is a miss. A copy that
is refused or fails is logged and the hit is returned all the same
(:attr:`Found.promoted` holds the :class:`~kernel_cache.store.disk_tier.PutResult`).

:meth:`Lookup.search` returns what one lookup found and why (:class:`Search`);
a :class:`Lookup` keeps no state of a lookup for its caller to read afterwards,
so one lookup's answer never depends on another's, in any order or thread.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from pydantic import ValidationError

from kernel_cache.errors import CorruptEntryError
from kernel_cache.plan.keys import (
    BUILD_ONLY,
    CacheKey,
    key_from_components,
    runtime_digest,
    source_changes,
)
from kernel_cache.plan.traced import Manifest, chain_key, changes, current, derive_key
from kernel_cache.store.disk_tier import Entry, PutOutcome, PutResult, Tier, verify_entry
from kernel_cache.trust.keys import shared_keyring
from kernel_cache.trust.signing import SignatureError, check_untrusted

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
class Refusal:
    """An entry a lookup refused: the error (its key, reason and where) and its tier."""

    error: CorruptEntryError
    tier: Tier


@dataclass(frozen=True)
class Search:
    """What one :meth:`Lookup.search` found and why.

    ``found``: the verified entry, or None; ``rejected``: the entries refused
    and skipped on the way (untrusted sources, a refused local copy), in
    order; ``failed``: the entry whose refusal ended the lookup (a source
    whose ``corrupt_is_miss`` is False: :meth:`Lookup.find` raises its error),
    else None; ``changes``: for a miss, how the traced files here differ from
    those the plan key's stored entry records (:attr:`Current.changes`).
    """

    found: Found | None
    rejected: tuple[Refusal, ...] = ()
    failed: Refusal | None = None
    changes: tuple[str, ...] = ()


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
    """True if ``meta["key"]`` is the hash of ``meta["components"]`` (followed
    through ``meta["derived"]``, if recorded: :func:`~kernel_cache.plan.traced.chain_key`)."""
    comps = meta.get("components")
    if not isinstance(comps, dict):
        return False
    try:
        return chain_key(key_from_components(comps).hexdigest, meta.get("derived") or ()) == (
            meta.get("key")
        )
    except (ValueError, TypeError, ValidationError):
        return False


def traced_of(meta: dict) -> Manifest | None:
    """An entry's recorded ``traced`` manifest; None if it records none or one
    that does not parse (then :func:`~kernel_cache.store.disk_tier.verify_entry`
    rejects the entry)."""
    raw = meta.get("traced")
    if raw is None:
        return None
    try:
        return Manifest.model_validate(raw)
    except ValidationError:
        return None


@dataclass(frozen=True)
class Current:
    """Where a key's artifact for the files here is (:func:`current_entry`).

    ``entry``: the stored entry whose traced files match here, or None;
    ``key``: its key, or where such an artifact is to be stored; ``derived``:
    the states that derive ``key`` from the plan's key (record them in the new
    entry: :func:`~kernel_cache.store.disk_tier.make_meta`); ``changes``: how the
    traced files here differ from those the plan key's entry records (one line
    each; empty when they match or nothing is stored).
    """

    entry: Entry | None
    key: str
    derived: tuple[Manifest, ...] = ()
    changes: tuple[str, ...] = ()


def current_entry(
    get: Callable[[str], Entry | None],
    key: str,
    check: Callable[[Entry], None] | None = None,
    *,
    stop_on: tuple[type[Exception], ...] = (),
) -> Current:
    """Find the artifact of plan key ``key`` for the files here.

    ``get(key)`` reads an entry (a tier's ``get``); ``check(entry)`` verifies
    each entry read before its record is used (it may raise). An entry whose
    ``traced`` files (:mod:`kernel_cache.plan.traced`) match here is the
    answer; one whose files differ leads to the key derived from the state
    here of exactly the items it lists
    (:func:`~kernel_cache.plan.traced.derive_key`), and so on, until an entry
    matches or a key holds nothing. Each file is hashed once per process.
    An exception of ``stop_on`` from ``get`` or ``check`` ends the search at
    that key, as if it held nothing (warmup then replaces the entry there).

    Raises:
        whatever else ``get`` or ``check`` raises (CorruptEntryError).
    """
    states: list[Manifest] = []
    first: list[str] = []
    seen = set()
    while key not in seen:
        seen.add(key)
        try:
            entry = get(key)
            if entry is not None and check is not None:
                check(entry)
        except stop_on:
            break
        if entry is None:
            break
        stored = traced_of(entry.meta)
        if stored is None:  # nothing recorded, or unreadable (the caller's check rejects it)
            return Current(entry, key, tuple(states))
        here = current(stored)
        diff = changes(stored, here)
        if not diff:
            return Current(entry, key, tuple(states), tuple(first))
        if not states:
            first = diff
        states.append(here)
        key = derive_key(key, here)
    return Current(None, key, tuple(states), tuple(first))


class Lookup:
    """Exact-then-compatible lookup over ``sources`` (in order): tiers, or
    :class:`Source` for a tier with a policy other than its defaults.

    Raises (when made):
        SigningKeyError: an untrusted source and no key to check signatures,
            without ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED`` (names
            ``kernel-cache keygen``, the key variables and the opt-out); a
            key setting is wrong.

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
        #: the keys signatures are checked with (None: none set, and no shared
        #: source or the insecure opt-out)
        self.keyring = shared_keyring([s.tier.location for s in self.sources if not s.trusted])
        for s in self.sources:  # a record the keys refuse: its artifact is never read
            if not s.trusted and self.keyring is not None:
                s.tier.check_records(functools.partial(_check_record, s.tier, self.keyring))
        self._reported: set[tuple[str, str]] = set()  # signature refusals logged once
        self._by: dict[tuple[int, str], Callable[[str], list[dict]]] = {}

    def _records(self, tier: Tier, index: str, value: str) -> list[dict]:
        """The records of ``tier`` whose ``index`` (:data:`RECORD_INDEXES`) is
        ``value``, newest first (:meth:`Tier.metas_by`, one per tier and index)."""
        find = self._by.get((id(tier), index))
        if find is None:
            find = self._by[(id(tier), index)] = tier.metas_by(index, RECORD_INDEXES[index])
        return sorted(find(value), key=lambda m: -float(m.get("created") or 0))

    def recorded_build_only(self, runtime_digest: str) -> dict[str, str]:
        """The build-only components (``{"cxx": ...}``) of the newest record
        whose runtime digest is ``runtime_digest``, in the first tier, in
        lookup order, that holds one, or ``{}``. Read through the index the
        compatible lookup uses (:meth:`Tier.metas_by`, kept for it): a
        bundle's manifest or every record of the local cache, no request; a
        remote tier's index of that one digest and at most ``INDEX_MAX`` of
        its records, a bounded read. A record of an
        untrusted tier counts only with a signature the keys accept (or under
        the insecure opt-out), and names keys only: an entry found under them
        is verified as any other, and a wrong value costs an exact miss, after
        which the compatible lookup runs."""
        for src in self.sources:
            for meta in self._records(src.tier, "runtime", runtime_digest):
                if not (src.trusted or _signed(meta, src.tier, self.keyring)):
                    continue
                comps = meta.get("components")
                if not isinstance(comps, dict):
                    continue
                found = {n: comps.get(n) for n in BUILD_ONLY}
                if all(_plain_value(v) for v in found.values()):
                    return found
        return {}

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, in lookup order."""
        return [s.tier for s in self.sources]

    def find(self, key: CacheKey) -> Found | None:
        """The first verified entry for ``key`` (exact, else compatible), or None
        (:meth:`search`'s ``found``).

        Raises:
            CorruptEntryError: the entry found fails verification (it is never
                returned, so its code is never loaded); :meth:`search` gives
                its tier (:attr:`Search.failed`).
        """
        result = self.search(key)
        if result.failed is not None:
            raise result.failed.error
        return result.found

    def search(self, key: CacheKey) -> Search:
        """What a lookup of ``key`` finds, and why (:class:`Search`): the first
        verified entry (exact, else compatible), the entries refused on the way,
        the refusal that ended it, the traced files that changed. Raises no
        :class:`CorruptEntryError` (it is :attr:`Search.failed`)."""
        rejected: list[Refusal] = []
        changes: tuple[str, ...] = ()
        for src in self.sources:
            tier = src.tier
            try:
                found, missed = self._find_in(src, key)
            except CorruptEntryError as e:
                # kept without its traceback: the traceback holds this frame, whose
                # `rejected` holds the error, a cycle that would keep every refused
                # entry's bytes alive until the garbage collector runs
                e = e.with_traceback(None)
                refused_copy = src.trusted and isinstance(e, SignatureError)
                if not src.trusted or refused_copy:
                    self._report(tier, e)
                    rejected.append(Refusal(e, tier))
                    if src.corrupt_is_miss or refused_copy:
                        continue
                return Search(None, tuple(rejected), Refusal(e, tier), changes)
            changes = changes or missed
            if found is not None:
                found = self._promote(found, self.promote_into or src.promote_into, src)
                return Search(found, tuple(rejected), None, changes)
        return Search(None, tuple(rejected), None, changes)

    def _report(self, tier: Tier, e: CorruptEntryError) -> None:
        """Log a refused entry: a signature refusal as untrusted, once per tier
        and reason (an untrusted key or unsigned entries: one line, naming the
        key id, however many entries it signed), other damage once per entry."""
        if isinstance(e, SignatureError):
            seen = (tier.location, e.reason)
            if seen in self._reported:
                return
            self._reported.add(seen)
            log.warning(
                "rejected %s entry %s as untrusted: %s; other entries of %s refused for this "
                "reason are not logged again",
                tier.name, e.key[:16], e, tier.location,
            )  # fmt: skip
            return
        log.warning("rejected %s entry %s: %s", tier.name, e.key[:16], e)

    def _promote(self, found: Found, target: Tier | None, src: Source) -> Found:
        """Copy a hit into ``target``, its signature kept and, from an untrusted
        source, ``imported_from`` set to the source's location (the copy is
        checked again wherever keys are set); a refusal or failure is logged,
        never raised."""
        e = found.entry
        if target is None or target is found.tier:
            return found
        meta = e.meta if src.trusted else {**e.meta, "imported_from": found.tier.location}
        try:
            result = target.put(e.key, e.data, meta)
        except Exception as err:  # an unwritable or full cache must not stop the lookup
            result = PutResult(PutOutcome.FAILED, target.location, f"{type(err).__name__}: {err}")
        if not result.ok:
            log.warning("could not copy %s to %s: %s", e.key[:16], target.location, result.reason)
        return replace(found, promoted=result)

    def _check(self, src: Source, entry: Entry) -> None:
        """Its checksum, and its signature if its source is untrusted or it is
        a local copy of a shared entry (``imported_from``) and keys are set."""
        digest = verify_entry(entry)
        if not src.trusted or (self.keyring is not None and entry.meta.get("imported_from")):
            check_untrusted(entry, self.keyring, digest=digest)

    def _find_in(self, src: Source, key: CacheKey) -> tuple[Found | None, tuple[str, ...]]:
        """The verified (and for an untrusted source, checked) entry in one tier,
        or None, and how the traced files of the key's stored entry differ here
        (:attr:`Current.changes`)."""
        tier = src.tier
        mine = key.as_dict()
        cur = current_entry(tier.get, key.hexdigest, lambda e: self._check(src, e))
        if cur.entry is not None:
            return Found(cur.entry, tier), ()
        if self.exact:
            return None, cur.changes
        for meta in self._records(tier, "runtime", key.runtime_digest):
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
            stored_files = traced_of(entry.meta)
            if stored_files is not None and changes(stored_files, current(stored_files)):
                continue  # built from other files than these
            stored = entry.meta["components"]
            accepted = {n: (mine[n], stored[n]) for n in BUILD_ONLY if stored.get(n) != mine.get(n)}
            return Found(entry, tier, accepted), cur.changes
        return None, cur.changes

    def why_missing(self, key: CacheKey, changes: Sequence[str] = ()) -> str | None:
        """Why ``key``, just missed by :meth:`search`, has no artifact, where a
        changed file says it: the traced files that changed (``changes``, its
        :attr:`Search.changes`:
        ``"traced files changed since its entry was built: userkern2/dyn_helper.py
        changed (sha256 be17c317808bafd0 stored, c1e54ca660e12271 here)"``),
        else the ``sources`` files that differ from the newest stored entry
        equal to ``key`` in every other runtime component
        (``"sources differ from entry 1a2b... in /cache: userkern2/decode.py
        changed"``); None otherwise. A record of an untrusted source is quoted
        only if it passes :func:`~kernel_cache.trust.signing.check_untrusted`
        (the file names of an unsigned record are a writer's text). Lists each
        tier's metadata once per lookup."""
        if changes:
            return "traced files changed since its entry was built: " + "; ".join(changes)
        mine = key.as_dict()
        near = _without_sources(mine)
        keyring = self.keyring
        for src in self.sources:
            tier = src.tier
            for meta in self._records(tier, "near", near):
                if not (src.trusted or _signed(meta, tier, keyring)):
                    continue
                files = source_changes(mine["sources"], meta["components"].get("sources"))
                if files:
                    return (
                        f"sources differ from entry {str(meta.get('key'))[:16]} in "
                        f"{tier.location}: {files}"
                    )
        return None


def _check_record(tier: Tier, keyring, meta: dict) -> None:
    """:func:`~kernel_cache.trust.signing.check_untrusted` of a record alone,
    against its own ``sha256`` (the artifact, read later, must match it).

    Raises:
        CorruptEntryError: a :class:`~kernel_cache.trust.signing.SignatureError`
            where the keys refuse the record.
    """
    entry = Entry(str(meta.get("key")), meta, b"", tier.location)
    check_untrusted(entry, keyring, digest=str(meta.get("sha256")))


def _signed(meta: dict, tier: Tier, keyring) -> bool:
    """Whether the record ``meta`` of an untrusted tier passes its check: a
    signature by a key of ``keyring`` (None: no keys set, so any record only
    under the insecure opt-out), checked against its own ``sha256`` without
    reading the artifact."""
    entry = Entry(str(meta.get("key")), meta, b"", tier.location)
    try:
        check_untrusted(entry, keyring, digest=str(meta.get("sha256")))
    except (CorruptEntryError, ValueError):
        return False
    return True


#: The longest build-only value :meth:`Lookup.recorded_build_only` takes from
#: a record (a real ``cxx`` is about 60 characters).
MAX_BUILD_ONLY_CHARS = 256


def _plain_value(v) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_BUILD_ONLY_CHARS and v.isprintable()


def _without_sources(components: dict) -> str:
    """A digest of every runtime component but ``sources``."""
    return runtime_digest({**components, "sources": ""})


def _runtime_of(meta: dict) -> str | None:
    """A self-consistent record's runtime digest (the compatible-entry lookup's)."""
    return runtime_digest(meta["components"]) if consistent(meta) else None


def _near_of(meta: dict) -> str | None:
    """A record's digest of every runtime component but ``sources`` (why a key missed)."""
    comps = meta.get("components")
    try:
        return _without_sources(comps) if isinstance(comps, dict) else None
    except (TypeError, ValueError, AttributeError):
        return None


#: The digests a record is found by on a miss (:meth:`Tier.metas_by`), by name:
#: ``runtime`` finds a compatible entry, ``near`` one whose sources differ.
RECORD_INDEXES: dict[str, Callable[[dict], str | None]] = {
    "runtime": _runtime_of,
    "near": _near_of,
}


def record_indexes(meta: dict) -> dict[str, str]:
    """``{index name: value}`` of a record, for a tier that stores an index."""
    out = {}
    for name, of in RECORD_INDEXES.items():
        try:
            value = of(meta)
        except (TypeError, ValueError, KeyError, AttributeError):
            value = None
        if value is not None:
            out[name] = value
    return out


def merge_accepted(into: dict, accepted: dict[str, tuple[str, str]]) -> None:
    """Fold one :attr:`Found.accepted` into a report:
    ``{name: {"here": value, "stored": [distinct stored values]}}``."""
    for name, (here, stored) in accepted.items():
        slot = into.setdefault(name, {"here": here, "stored": []})
        if stored not in slot["stored"]:
            slot["stored"].append(stored)
