"""Engine start: find, check and load every artifact of a plan, with zero compiles.

:func:`load_plan` looks every variant of a plan up in the tiers
(:func:`default_lookup`: bundles, the local cache, Redis, S3), checks that this
CPU can run it (:func:`check_cpu_features`), loads it
(:func:`kernel_cache.runtime.package.load_package`, through AOTInductor's
runtime loader, which imports neither Dynamo nor Inductor's compiler) and
returns the dispatcher, :class:`~kernel_cache.runtime.dispatch.AttentionRuntime`.
The texts engine start and ``verify`` share (:func:`repair_hint`,
:func:`refused_reason`, :func:`signature_note`) are here too.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kernel_cache.config.engine import EngineConfig, config_to_cli
from kernel_cache.errors import CorruptEntryError, CpuTargetError, MissingVariantsError
from kernel_cache.plan.keys import CXX_NOT_PROBED
from kernel_cache.plan.plan import Plan
from kernel_cache.runtime.compiles import CompileCounter
from kernel_cache.runtime.package import load_package
from kernel_cache.store.disk_tier import (
    ENV_CACHE_DIR,
    DiskTier,
    Tier,
    check_cache_dir_path,
    default_cache_dir,
)
from kernel_cache.trust.signing import load_trusted_keys

if TYPE_CHECKING:
    from kernel_cache.runtime.dispatch import AttentionRuntime

log = logging.getLogger("kernel_cache")


def default_lookup(cache_dir=None, bundles=None, *, allow_shared_dir: bool | None = None):
    """The :class:`~kernel_cache.store.lookup.Lookup` of engine start: bundles
    (``bundles``, i.e. ``--bundle``, then ``$KERNEL_CACHE_BUNDLE``), then the
    local disk cache, then Redis when ``KERNEL_CACHE_REDIS_URL`` is set
    (:mod:`kernel_cache.store.redis`), then the object store when
    ``KERNEL_CACHE_REMOTE_URL`` is set (:mod:`kernel_cache.store.s3`: S3, GCS,
    Azure Blob, a ``file://`` directory).

    The local cache is opened only if its directory exists: engine start never
    creates a cache directory. It is opened read-only (no lock, database, journal
    or temporary file is created in it) and its trust is checked
    (:mod:`kernel_cache.trust.permissions`; ``allow_shared_dir`` opts out). The one
    exception is a verified hit of a remote tier (Redis or the object store),
    which the lookup copies into the local cache (created if needed) through a
    separate writable handle, opened only then.

    Raises:
        BundleError: a bundle path is not a bundle (names it).
        ConfigError: a malformed ``KERNEL_CACHE_REDIS_*`` setting, or a cache
            directory (or a folder above it) that is a file.
        SigningKeyError: a shared tier (a bundle, Redis, S3) and no key to check
            signatures, without ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED``.
    """
    from kernel_cache.config import settings
    from kernel_cache.store.lookup import Lookup, Source
    from kernel_cache.store.remote import tiers_from_env

    sources: list = []
    if bundles or settings.is_set("bundle"):  # bundle.py (its models) only for a bundle
        from kernel_cache.store.bundle import BundleTier, bundle_paths

        sources += [BundleTier(p) for p in bundle_paths(bundles)]
    directory = Path(cache_dir) if cache_dir else default_cache_dir()
    source = "cache_dir" if cache_dir else f"${ENV_CACHE_DIR}"
    check_cache_dir_path(directory, source, source)
    if directory.is_dir():
        sources.append(DiskTier(directory, read_only=True, allow_shared=allow_shared_dir))
    remote = tiers_from_env()
    if remote:  # a writable handle on the local cache, opened on the first copy
        local = DiskTier(directory, allow_shared=allow_shared_dir)
        sources += [Source(r, promote_into=local) for r in remote]
    return Lookup(sources)


def _take_import_memo(cache_dir, allow_shared: bool | None) -> str | None:
    """Read the local cache's memo of import scans, if any, before the keys are
    computed (:mod:`kernel_cache.store.imports_memo`; engine start only reads it).
    Returns the ``cxx`` key component it records (warmup's compiler), or None."""
    from kernel_cache.store import imports_memo
    from kernel_cache.trust.permissions import resolve_allow_shared

    directory = Path(cache_dir) if cache_dir else default_cache_dir()
    memo, _ = imports_memo.take(directory, allow_shared=resolve_allow_shared(allow_shared))
    return memo.cxx if memo is not None and memo.cxx else None


def _recorded_cxx(config: EngineConfig, lookup) -> str:
    """The ``cxx`` key component for a start without warmup's record: the one
    the tiers' records name for the plan's first variant that has one
    (:meth:`~kernel_cache.store.lookup.Lookup.recorded_build_only`; the runtime
    digest leaves ``cxx`` out), else :data:`~kernel_cache.plan.keys.CXX_NOT_PROBED`,
    under which every entry is found by the compatible lookup. No compiler is run.

    Later variants are asked only where the ones before have no record (a
    variant not yet published, or an index a writer flooded): each index read
    is kept by the lookup, which the compatible lookup of that variant would
    make anyway, so the reads stay one per variant at most."""
    items = Plan.build(config, cxx=CXX_NOT_PROBED, log_launch=False).items
    for item in items:
        found = lookup.recorded_build_only(item.key.runtime_digest)
        if found.get("cxx"):
            return found["cxx"]
    return CXX_NOT_PROBED


def default_tiers(
    cache_dir=None, bundles=None, *, allow_shared_dir: bool | None = None
) -> list[Tier]:
    """The tiers of :func:`default_lookup`, in lookup order (for listings)."""
    return default_lookup(cache_dir, bundles, allow_shared_dir=allow_shared_dir).tiers


def record_lookups(tiers: list[Tier], hits: dict[int, list[str]], misses: int) -> None:
    """Best-effort usage records for the tiers that keep them (the local disk
    cache: :meth:`~kernel_cache.store.disk_tier.Tier.note_usage`): ``hits`` maps
    ``id(tier)`` to the keys it served; misses go to the first such tier.
    Never raises, never writes to a read-only directory."""
    first = True
    for tier in tiers:
        if tier.note_usage(hits.get(id(tier), ()), misses if first else 0):
            first = False


def check_cpu_features(config: EngineConfig, variant, entry) -> None:
    """Refuse an artifact whose recorded ``cpu_features`` (the instruction set
    its host code was built for: :mod:`kernel_cache.config.recipe`; on CUDA the
    package's C++ wrapper) include one this CPU lacks: its first call would die
    of an illegal instruction.

    Raises:
        CpuTargetError: names the variant, the entry, its target, the missing
            features and the warmup command for a target this CPU runs.
        CorruptEntryError: an entry without a list of ``cpu_features``.
    """
    from kernel_cache.config.recipe import cpu_model, missing_cpu_features

    needed = entry.meta.get("cpu_features")
    if not isinstance(needed, list) or not all(isinstance(f, str) for f in needed):
        raise CorruptEntryError(
            entry.key,
            f"variant {variant}: an entry must record its cpu_features (a list of CPU "
            f"flags), it records {needed!r}; repair with: kernel-cache warmup "
            f"{config_to_cli(config)}",
            entry.where,
        )
    missing = missing_cpu_features(needed)
    if missing:
        target = entry.meta.get("cpu_target", "?")
        raise CpuTargetError(
            f"variant {variant} (entry {entry.key[:16]} in {entry.where}) was built for "
            f"cpu_target={target} and uses {', '.join(missing)}, which this CPU "
            f"({cpu_model()}) lacks; its first call would die of an illegal instruction. "
            f"Build for this CPU: kernel-cache warmup {config_to_cli(config)} "
            "(--cpu-target x86-64-v3 needs AVX2; native builds for this CPU)"
        )


def load_plan(
    config: EngineConfig,
    cache_dir=None,
    *,
    tiers: list[Tier] | None = None,
    bundles=None,
    strict: bool = True,
    allow_shared_dir: bool | None = None,
    plan: Plan | None = None,
) -> AttentionRuntime:
    """Engine start: load every variant of ``config``'s plan and return the runtime.

    Lookup (:class:`kernel_cache.store.lookup.Lookup`): each tier in order, the exact
    key first, then an entry equal in every runtime component that was built
    with another C++ compiler (``cxx`` is build-only; the accepted values are
    logged at INFO and reported in ``stats()["build_only_accepted"]``). No
    program is run: the keys take the ``cxx`` that warmup recorded in the local
    cache (:mod:`kernel_cache.store.imports_memo`), else the one the tiers'
    records name for the plan's first variant (:func:`_recorded_cxx`: a
    bundle's manifest, every record of the local cache, a remote tier's
    index of that variant and at most 64 of its records), so the keys are
    the builders' exact keys; else :data:`~kernel_cache.plan.keys.CXX_NOT_PROBED`.

    Args:
        config: the engine configuration (its bucketer defines the plan).
        cache_dir: the local cache (default
            :func:`~kernel_cache.store.base.default_cache_dir`); ignored when ``tiers`` is given.
        bundles: bundle directories searched before the local cache, in
            addition to ``$KERNEL_CACHE_BUNDLE``; ignored when ``tiers`` is given.
        strict: raise on missing variants (default); with False, load what is there.
        allow_shared_dir: skip the trust checks of the cache directory (default
            ``KERNEL_CACHE_INSECURE_ALLOW_SHARED_DIR``; see :mod:`kernel_cache.trust.permissions`).
        plan: ``config``'s :class:`~kernel_cache.plan.plan.Plan` if the caller
            has built it (default: built here, once).

    Raises:
        MissingVariantsError: variants not in any tier, with the warmup command.
        CorruptEntryError: an entry failed verification (names it and the repair).
        CpuTargetError: an artifact needs an instruction this CPU lacks.
        BundleError: a bundle path is not a bundle.
        UntrustedCacheError: the directory or an entry file is writable by other
            users or owned by another user (names the path and the fix).
        SigningKeyError: a shared tier (Redis, S3, a bundle) is set and no key to
            check its signatures (and not ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED``;
            names ``kernel-cache keygen``, both key variables and the opt-out);
            signed entries are required and no trusted key is set; or a key
            setting is wrong (names the variable and the fix).
        SettingError: a ``KERNEL_CACHE_*`` variable does not validate (e.g.
            ``KERNEL_CACHE_NUM_THREADS``, which a CPU plan applies here:
            :mod:`kernel_cache.runtime.threads`).
    """
    from kernel_cache.runtime.dispatch import AttentionRuntime  # imports torch
    from kernel_cache.store.lookup import Lookup

    t0 = time.perf_counter()
    compiles = CompileCounter()  # stats() reports torch's compiles from here on
    load_trusted_keys()  # --require-signed without a key, or a bad key, fails here
    # a shared tier without a key to check signatures (and no opt-out) fails here
    lookup = (
        default_lookup(cache_dir, bundles, allow_shared_dir=allow_shared_dir)
        if tiers is None
        else Lookup(tiers)
    )
    if plan is None:
        cxx = None
        if tiers is None:  # the import scans and compiler warmup kept in the local cache
            cxx = _take_import_memo(cache_dir, allow_shared_dir)
        # a recorded 'cxx' spares the compiler runs (kernel_cache.plan.keys)
        plan = Plan.build(config, cxx=cxx or _recorded_cxx(config, lookup))
    if config.device == "cpu":  # KERNEL_CACHE_NUM_THREADS: see runtime/threads.py
        from kernel_cache.runtime import threads

        threads.apply()
    for tier in lookup.tiers:  # a remote may fetch the plan in one go (S3: its manifest)
        tier.expect([item.hexdigest for item in plan])
    found = _find_plan(plan, lookup, cache_dir)
    record_lookups(lookup.tiers, found.hits, len(found.missing))
    if found.missing and plan.env.get("cxx") == CXX_NOT_PROBED:
        log.warning(
            "no tier (%s) holds a record of this plan that names its builders' C++ compiler "
            "(a signed one, for a shared tier), so its keys use cxx=%r and only entries equal "
            "in every other component were looked for",
            ", ".join(t.location for t in lookup.tiers) or "none", CXX_NOT_PROBED,
        )  # fmt: skip
    if found.missing and strict:
        raise MissingVariantsError(
            found.missing,
            f"kernel-cache warmup {config_to_cli(config, cache_dir)}",
            found.why,
            found.refused,
        )
    rt = AttentionRuntime(
        config,
        plan.bucketer,
        found.runners,
        time.perf_counter() - t0,
        compile_counter=compiles,
        sources=found.sources,
        build_only_accepted=found.accepted,
        launch={i.variant: i.launch for i in plan},
        slot_params=found.slot_params,
    )
    _log_accepted(found.accepted)
    log.info(
        "loaded %d variants in %.3f s from %s; %s", len(found.runners), rt.load_seconds,
        dict(found.sources), signature_note(lookup.keyring),
    )  # fmt: skip
    return rt


@dataclass
class _Found:
    """What :func:`_find_plan` found: ``runners`` by variant, ``missing``
    variants (``why``: the changed files that explain a miss, by variant:
    :meth:`~kernel_cache.store.lookup.Lookup.why_missing`; ``refused``: for a
    miss whose entry was refused, ``(why, repair)`` naming its tier), ``sources`` (tier
    location -> variants), ``accepted`` build-only components, ``hits``
    (``id(tier)`` -> keys it served)."""

    runners: dict = field(default_factory=dict)
    missing: list = field(default_factory=list)
    why: dict = field(default_factory=dict)
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)
    sources: Counter = field(default_factory=Counter)
    accepted: dict = field(default_factory=dict)
    hits: dict[int, list[str]] = field(default_factory=dict)
    #: ``{variant: [[name, shape, dtype], ...]}`` a declared slot's entries record.
    slot_params: dict = field(default_factory=dict)


def _find_plan(plan: Plan, lookup, cache_dir) -> _Found:
    """Look every item of ``plan`` up through ``lookup`` (a
    :class:`~kernel_cache.store.lookup.Lookup`) and load what is found.

    Raises:
        CorruptEntryError: naming the variant and the repair command.
        CpuTargetError: from :func:`check_cpu_features`.
    """
    from kernel_cache.store.lookup import merge_accepted

    config, out = plan.config, _Found()
    for item in plan:
        v = item.variant
        result = lookup.search(item.key)
        if result.failed is not None:
            e, fix = result.failed.error, repair_hint(result.failed.tier, config, cache_dir)
            raise CorruptEntryError(e.key, f"{e.reason} (variant {v}); {fix}", e.where)
        hit = result.found
        if hit is None:
            out.missing.append(v)
            out.why[v] = lookup.why_missing(item.key, result.changes)
            if result.rejected:
                out.refused[str(v)] = refused_reason(result, config, cache_dir)
            continue
        entry = hit.entry
        check_cpu_features(config, v, entry)
        out.runners[v] = load_package(entry.data, config.device, entry.where, entry.key)
        if config.slot(v.kernel) is not None:
            out.slot_params[v] = entry.meta.get("slot_params")
        out.sources[hit.tier.location] += 1
        out.hits.setdefault(id(hit.tier), []).append(entry.key)
        merge_accepted(out.accepted, hit.accepted)
    return out


def repair_hint(tier, config, cache_dir=None) -> str:
    """The command that replaces a bad entry of ``tier`` (by its
    :attr:`~kernel_cache.store.base.Tier.repair`), for error messages
    (``config``: the EngineConfig; ``cache_dir``: the local cache given, if any)."""
    from kernel_cache.config.engine import config_to_cli
    from kernel_cache.trust.signing import ENV_SIGNING_KEY_FILE

    if tier.repair == "export":
        return f"export the bundle again: kernel-cache export {config_to_cli(config)} --out DIR"
    if tier.repair == "publish":
        return (
            f"repair with a builder holding {ENV_SIGNING_KEY_FILE}: kernel-cache warmup "
            f"{config_to_cli(config, cache_dir)} {tier.location_flag} {tier.location}"
        )
    return f"repair with: kernel-cache warmup {config_to_cli(config, cache_dir)}"


def refused_reason(result, config, cache_dir) -> tuple[str, str]:
    """``(why, repair)`` for a miss whose entry was refused (``result``, a
    :class:`~kernel_cache.store.lookup.Search`): the last refusal (the
    furthest tier: a remote after a refused local copy; untrusted: a
    signature; else corrupt) and its tier's repair, which names the tier (a
    remote by its URL)."""
    from kernel_cache.trust.signing import SignatureError

    e, tier = result.rejected[-1].error, result.rejected[-1].tier
    kind = "untrusted" if isinstance(e, SignatureError) else "corrupt"
    return (
        f"their entries in {tier.location} are {kind} ({e.reason})",
        repair_hint(tier, config, cache_dir),
    )


def signature_note(keyring) -> str:
    """What engine start and verify say about signatures: the key ids they were
    checked with, or that they were not (the insecure opt-out)."""
    from kernel_cache.trust.signing import ENV_ALLOW_UNSIGNED

    if keyring is None:
        return f"signatures not checked ({ENV_ALLOW_UNSIGNED}=1 or no shared tier)"
    return f"signatures checked with key {', '.join(keyring.keys)}"


def _log_accepted(accepted: dict) -> None:
    for name, a in accepted.items():
        log.info(
            "build-only component %s: accepted %s recorded at build time (looked up first: %s)",
            name,
            ", ".join(map(repr, a["stored"])),
            repr(a["here"]),
        )
