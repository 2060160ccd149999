"""Warmup: compile every missing variant of a plan and publish it to the cache.

:func:`warmup` sorts the plan into cached and to-do (:func:`_precheck`; with a
remote tier, :func:`_remote_precheck` copies its hits in and publishes what it
lacks), applies the size limit, builds the to-do items in a worker pool
(:mod:`warmup.builder.pool`), each variant as the steps of
:func:`warmup.builder.worker.build_variant` (claim, check, compile, load check,
publish, release: one compile per key), and returns the report
(:mod:`warmup.builder.report`).

Each artifact is published as soon as it has passed its check, so an
interrupted warmup (SIGINT, SIGTERM) keeps every artifact finished before the
signal: :class:`WarmupInterrupted` carries the partial report.

Redis failing at any point costs one warning (from the parent: workers report
it back); the local run carries on. A compile failure is reported with the
variant and the compiler's text while the other variants finish; a full or
unwritable cache directory stops the remaining work (naming the directory and
the bytes needed).
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

from kernel_cache.config import settings
from kernel_cache.config.engine import EngineConfig
from kernel_cache.errors import CacheWriteError, KernelCacheError
from kernel_cache.plan.buckets import KernelVariant
from kernel_cache.plan.plan import Plan, PlanItem
from kernel_cache.store.disk_tier import DiskTier, PutOutcome, Tier
from kernel_cache.store.lookup import Lookup
from kernel_cache.store.redis import RedisSettings
from kernel_cache.trust.keys import (
    ENV_ALLOW_UNSIGNED,
    ENV_SIGNING_KEY_FILE,
    ENV_TRUSTED_KEYS,
    PRIVATE_NAME,
    allow_unsigned,
    load_signer,
    load_trusted_keys,
)
from kernel_cache.trust.permissions import resolve_allow_shared
from kernel_cache.trust.signing import may_publish, sign_meta
from warmup.builder.pool import ENV_KEEP_SCRATCH, PoolInterrupt, run_pool
from warmup.builder.report import (
    GcSummary,
    Reporter,
    Status,
    VariantResult,
    VariantRow,
    WarmupInterrupted,
    WarmupReport,
    make_report,
)
from warmup.builder.worker import build_variant, check_cached, locate, recorded_cpu_features

__all__ = [
    "ENV_KEEP_SCRATCH",
    "Status",
    "VariantResult",
    "VariantRow",
    "WarmupInterrupted",
    "WarmupReport",
    "build_variant",
    "check_cached",
    "compile_items",
    "locate",
    "warmup",
]

log = logging.getLogger("kernel_cache.warmup")


def _precheck(config, plan: list[PlanItem], cache_dir, allow_shared):
    """Sort the plan's items into cached and to-do without writing anything if
    possible.

    Returns (cached, todo, bad, writable) where ``bad`` maps a variant to the
    reason its entry is unusable. Raises CacheWriteError when the directory
    cannot be written and something must be compiled.
    """
    write_error = None
    try:
        tier = DiskTier(cache_dir, allow_shared=allow_shared)
        tier.cache  # noqa: B018 - open (and create) it now: fail early if unwritable
    except CacheWriteError as e:  # maybe all is cached: check without writing
        write_error = e
        tier = DiskTier(cache_dir, read_only=True, allow_shared=allow_shared)
    cached, todo, bad = [], [], {}
    features = recorded_cpu_features(config)
    try:
        for item in plan:
            why = check_cached(tier, locate(tier, item.key).key, config.device, features)
            if why is None:
                cached.append(item)
            else:
                todo.append(item)
                if why != "missing":
                    bad[str(item.variant)] = why
        sizes = [m.get("size", 0) for m in tier.iter_meta()] if write_error and todo else []
    finally:
        tier.close()
    if write_error and todo:
        est = (
            f"; about {len(todo) * sum(sizes) // len(sizes)} bytes, from the mean size of "
            f"the {len(sizes)} entries it holds"
            if sizes
            else ""
        )
        raise CacheWriteError(
            f"{write_error}. {len(todo)} of the plan's {len(plan)} variants are not cached "
            f"and must be written there{est}"
        ) from None
    return cached, todo, bad, write_error is None


def warmup(
    config: EngineConfig,
    cache_dir: str | Path,
    *,
    jobs: int = 1,
    progress: bool = True,
    variants: list[KernelVariant] | None = None,
    max_size: int | None = None,
    lock_timeout: float | None = None,
    allow_shared_dir: bool | None = None,
    remote: RedisSettings | Any | None = None,
) -> dict:
    """Compile what is missing from the plan, skip what is cached.

    Args:
        config: the engine configuration; its :class:`Bucketer` gives the plan.
        cache_dir: the local cache directory.
        jobs: worker processes compiling in parallel (>= 1); 0 compiles in this
            process and publishes without the load check (an engine that warms
            itself, as in ``benchmarks/fleet_load.py``; refused if this process
            imported Inductor with a pinned variable set; SIGINT is
            ``WarmupInterrupted``, SIGTERM left to the process).
        progress: report progress on stderr: a progress bar in a terminal, one
            line per finished variant otherwise (CI and ``docker build`` logs).
        variants: a subset of the plan (default: all of it; a shard).
        max_size: a size limit in artifact bytes (``--max-size`` or
            ``$KERNEL_CACHE_MAX_SIZE``): before and after compiling, entries
            of other plans are removed, least recently used first
            (:func:`kernel_cache.store.housekeeping.gc`), never one of this plan.
        lock_timeout: seconds to wait for another process compiling the same
            key (default ``KERNEL_CACHE_LOCK_TIMEOUT`` or 900).
        allow_shared_dir: skip the trust checks (default
            ``KERNEL_CACHE_INSECURE_ALLOW_SHARED_DIR``).
        remote: the shared Redis or S3 tier's settings (``RedisSettings``,
            ``S3Settings``), or None (local only). With S3, a plan manifest is
            published once every key of the plan is there.

    Returns:
        ``{"variants", "compiled", "compiler_runs", "cached", "fetched",
        "not_started", "failed": [{"variant", "error"}], "quarantined":
        [{"variant", "reason", "path"}], "found_bad", "seconds", "fingerprint",
        "pid", "repair", "load_check": {"checked", "children", "libstdcxx",
        "seconds"}, "results": [:meth:`VariantResult.as_dict`], "launch":
        {variant: {"config", "source"}} for the variants a launch table sets}``.
        ``compiled`` counts the rows this process compiled and published;
        ``compiler_runs`` the compiles it ran (a compile whose artifact failed
        the load check is counted there and in ``failed``). Plus with
        ``max_size`` ``"gc": {"removed", "removed_bytes", "after_bytes",
        "max_size", "under_limit"}`` (``under_limit`` False: this plan alone
        is larger). With ``remote``: ``"fetched"`` (copied from Redis),
        ``"uploaded"`` (local entries Redis lacked, now published), ``"remote"``
        (its URL, password hidden), ``"remote_error"`` (None or the first failure).

    Raises:
        WarmupInterrupted: SIGINT or SIGTERM; every artifact finished before it
            is kept, and the exception carries the partial report.
        UntrustedCacheError: the directory is writable by others or owned by another user.
        CacheWriteError: the directory cannot be written and variants are missing.
        CacheBusyError: its index stayed locked past ``KERNEL_CACHE_DB_TIMEOUT``.
        SigningKeyError: signed entries are required and no key is set, or a key
            setting is wrong.

    Without the private key (``KERNEL_CACHE_SIGNING_KEY_FILE``) but with trusted
    keys, a warmup with a remote fetches verified entries but publishes only
    entries the trusted keys accept: what it compiles stays in the local cache
    (a warning says so), since engines refuse unsigned entries. With no key at
    all (and not ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED``) the remote is
    neither read nor written: the warmup builds locally and says so once. The
    report's ``published``, ``signed_by`` and ``not_published`` say what the
    remote got.
    """
    import kernel_cache.store.housekeeping as housekeeping
    import kernel_cache.store.usage as usage
    from kernel_cache.store import imports_memo

    t0 = time.perf_counter()
    allow_shared = resolve_allow_shared(allow_shared_dir)
    imports_memo.load(cache_dir, allow_shared=allow_shared)
    plan = Plan.build(config)
    items = list(plan) if variants is None else plan.items_for(variants)
    lock_timeout = settings.get("lock_timeout") if lock_timeout is None else float(lock_timeout)
    secret = load_signer()
    keyring = load_trusted_keys()
    cached, todo, bad, writable = _precheck(config, items, cache_dir, allow_shared)
    if writable:  # for the engine starts that read this cache
        imports_memo.save(cache_dir, allow_shared=allow_shared, cxx=plan.env["cxx"])
    rtier, remote, publish = _remote_policy(remote, secret, keyring, cache_dir)
    fetched, uploaded = [], 0
    if rtier is not None:
        todo, fetched, uploaded = _remote_precheck(
            config, cached, todo, cache_dir, allow_shared, writable, rtier, secret, publish
        )
    keep = housekeeping.plan_digests(plan) if max_size is not None else set()
    gc_on = max_size is not None and writable  # a read-only cache has nothing to remove
    first = _gc(cache_dir, max_size, keep, allow_shared) if gc_on else None  # make room first
    results = [VariantResult(str(i.variant), Status.CACHED) for i in cached]
    results += [VariantResult(str(i.variant), Status.FETCHED) for i in fetched]
    options = {
        "lock_timeout": lock_timeout,
        "allow_shared": allow_shared,
        "remote": remote.model_dump_json() if remote is not None else None,
    }

    def report(results) -> dict:
        return make_report(
            config, cache_dir, plan, items, results, t0, rtier, bad, uploaded, publish
        )

    reporter = Reporter(
        len(items), len(items) - len(todo), progress, [str(i.variant) for i in todo]
    )
    try:
        if todo:
            results += run_pool(config, todo, str(cache_dir), jobs, reporter, options)
    except PoolInterrupt as e:
        results += e.results
        if rtier is not None:
            rtier.close()
        raise WarmupInterrupted(e.signum, report(results)) from None
    finally:
        reporter.close()
    _close_remote(rtier, results, [i.hexdigest for i in plan])
    compiled = sum(r.status is Status.COMPILED for r in results)
    usage.record(cache_dir, hits=[i.hexdigest for i in cached], misses=compiled)
    out = report(results)
    if gc_on:
        gc_report = _gc_after(first, cache_dir, max_size, keep, allow_shared)
        out["gc"] = GcSummary.model_validate(gc_report).model_dump()
    return out


def _remote_policy(remote, secret, keyring, cache_dir) -> tuple[Tier | None, Any, dict]:
    """The shared tier a warmup may read and publish to, given the keys it holds:
    ``(tier or None, remote settings or None, the report's publish fields)``. With
    no key at all (and unsigned not allowed) the remote is left alone; with trusted
    keys but no private key, compiled entries stay local; unsigned publishing is
    warned about."""
    rtier = remote.tier() if remote is not None else None
    publish = {
        "remote": rtier.location if rtier is not None else None,
        "signed_by": secret.key_id if secret is not None else None,
        "held_back": None,
    }
    if rtier is not None and secret is None and keyring is None and not allow_unsigned():
        # no key at all: nothing from the remote can be checked, nothing made
        # here may be published; the remote is left alone
        publish["held_back"] = (
            f"no signing key ({ENV_SIGNING_KEY_FILE}) and no trusted key ({ENV_TRUSTED_KEYS}): "
            f"{rtier.location} was neither read nor published to; builders set "
            f"{ENV_SIGNING_KEY_FILE}=DIR/{PRIVATE_NAME} (kernel-cache keygen DIR)"
        )
        log.warning("building locally in %s only: %s", cache_dir, publish["held_back"])
        rtier.close()
        rtier = remote = None
    elif rtier is not None and secret is None and keyring is not None:
        publish["held_back"] = (
            f"no private key ({ENV_SIGNING_KEY_FILE}): entries compiled here stay in "
            f"{cache_dir} and are not published to {rtier.location}, whose engines trust "
            f"only signed entries ({ENV_TRUSTED_KEYS}); publish from a builder that holds "
            "the private key"
        )
        log.warning("%s", publish["held_back"])
    elif rtier is not None and secret is None:
        log.warning(
            "publishing unsigned entries to %s (%s=1): anyone who can write it can run "
            "code on the engines that load from it",
            rtier.location, ENV_ALLOW_UNSIGNED,
        )  # fmt: skip
    return rtier, remote, publish


def _close_remote(rtier: Tier | None, results: list[VariantResult], plan_keys) -> None:
    """Publish the plan's manifest where the remote keeps one (S3; it checks
    that every key is there), then close it; a worker's failure makes this
    process warn once instead."""
    if rtier is None:
        return
    failure = next((r.remote_error for r in results if r.remote_error), None)
    if failure is not None and rtier.error is None:
        rtier.note_failure(failure)
    if rtier.error is None and not any(r.status is Status.FAILED for r in results):
        rtier.publish_manifest(plan_keys)
    rtier.close()


def _gc_after(first: dict, cache_dir, max_size, keep, allow_shared) -> dict:
    """The size limit applied again after compiling; its report counts the
    entries removed by both passes (``first`` is the pass before compiling)."""
    gc_report = _gc(cache_dir, max_size, keep, allow_shared)
    gc_report["removed"] = first["removed"] + gc_report["removed"]
    gc_report["removed_bytes"] = sum(r["size"] for r in gc_report["removed"])
    gc_report["before_bytes"] = first["before_bytes"]
    return gc_report


def compile_items(
    config: EngineConfig,
    cache_dir: str | Path,
    items: list[PlanItem],
    *,
    jobs: int = 1,
    progress: bool = True,
) -> dict:
    """Compile each item (a variant, its launch config and key:
    :meth:`kernel_cache.plan.plan.Plan.with_launch`) whose artifact is not cached
    (``kernel-cache tune`` compiles several configs of one variant this way),
    with the same single-flight and load-check steps as :func:`warmup`.

    Returns: ``{"variants", "compiled", "compiler_runs", "cached", "failed",
    "results"}`` as :func:`warmup`.

    Raises:
        as :func:`warmup`.
    """
    allow_shared = resolve_allow_shared(None)
    cached, todo, _, _ = _precheck(config, items, cache_dir, allow_shared)
    results = [VariantResult(str(i.variant), Status.CACHED) for i in cached]
    options = {"lock_timeout": settings.get("lock_timeout"), "allow_shared": allow_shared}
    reporter = Reporter(len(items), len(cached), progress, [str(i.variant) for i in todo])
    try:
        if todo:
            results += run_pool(config, todo, str(cache_dir), jobs, reporter, options)
    except PoolInterrupt as e:
        raise KernelCacheError(f"interrupted by {signal.Signals(e.signum).name}") from None
    finally:
        reporter.close()
    return {
        "variants": len(items),
        "compiled": sum(r.status is Status.COMPILED for r in results),
        "compiler_runs": sum(r.compiler_ran for r in results),
        "cached": sum(r.status is Status.CACHED for r in results),
        "failed": [
            {"variant": r.variant, "error": r.error or ""}
            for r in results
            if r.status is Status.FAILED
        ],
        "results": [r.as_dict() for r in results],
    }


def _remote_precheck(
    config, cached, todo, cache_dir, allow_shared, writable, rtier, secret, publish
):
    """With Redis: publish cached entries Redis lacks (signed when ``secret``, the
    private key, is set: the local cache is trusted; without it, only entries the
    trusted keys accept as they are), and copy verified Redis hits of the to-do
    items into the local cache. Returns (todo, fetched, uploaded); why a cached
    entry could not be published goes to ``publish["upload_failed"]``."""
    tier = DiskTier(cache_dir, read_only=not writable, allow_shared=allow_shared)
    lookup = Lookup([rtier], exact=True, promote_into=tier)
    left, fetched, uploaded = [], [], 0
    failed = publish.setdefault("upload_failed", [])
    try:
        for item in cached:
            key = locate(tier, item.key).key
            if rtier.is_down():
                continue
            entry = tier.get(key)
            want = sign_meta(entry.meta, entry.data, secret)
            if secret is None and not may_publish(want, entry.data):
                continue  # the fleet would refuse it, and this node cannot sign
            # put writes only what the remote lacks: missing, unsigned, other bytes
            result = rtier.put(key, entry.data, want)
            uploaded += result.stored
            if result.outcome is PutOutcome.FAILED and not rtier.is_down():
                failed.append(result.reason)
        for item in todo:  # todo is empty when the cache is not writable (_precheck)
            found = lookup.find(item.key)
            (fetched if found else left).append(item)
    finally:
        tier.close()
    return left, fetched, uploaded


def _gc(cache_dir, max_size, keep, allow_shared) -> dict:
    import kernel_cache.store.housekeeping as housekeeping

    tier = DiskTier(cache_dir, allow_shared=allow_shared)
    try:
        return housekeeping.gc(tier, max_size, keep)
    finally:
        tier.close()
