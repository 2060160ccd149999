"""Warmup: compile every missing variant of a plan and publish it to the cache.

Per variant, in a worker process (:func:`build_variant`), as typed steps:

1. **claim**: take the key's lock (:class:`kernel_cache.store.locks.KeyLock`). The
   first pass does not wait: a key another process holds comes back ``busy``
   and is queued again, waiting, behind the free ones, so N processes spread
   over the plan instead of queueing on its first key.
2. **check**: a verified cached entry (checksum, trust, AOTInductor's loader
   accepts it) ends the work as ``cached``; a bad one is moved to
   ``quarantine/``. With Redis, a verified Redis hit is copied in (``fetched``),
   else the key's Redis build lock is taken as well.
3. **compile**: ``torch.export`` + AOTInductor (:mod:`warmup.build.compiler`) in
   the worker, whose environment the recipe pinned
   (:func:`kernel_cache.config.recipe.compile_environment`).
4. **load check**: the new artifact is loaded once in a check process that has
   only what an engine has (:class:`warmup.build.loadcheck.LoadChecker`); one that
   kills that process or is rejected is reported and never published.
5. **publish**: to the local cache, then to Redis.
6. **release** the locks.

The key stays claimed from "missing" until it is published, so a waiter finds
the entry and reports ``cached``: one compile per key, whatever the number of
processes, machines (with Redis) or workers. A result row says ``compiled`` if
and only if this process ran the compiler for it and published the artifact;
``compiler_ran`` says whether the compiler ran at all (a compile whose artifact
failed its load check is ``failed`` with ``compiler_ran`` true).

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

import atexit
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kernel_cache._testhooks import hook
from kernel_cache.config import settings
from kernel_cache.config.engine import EngineConfig, config_to_cli
from kernel_cache.errors import (
    CacheWriteError,
    CompileError,
    CorruptEntryError,
    KernelCacheError,
    LockTimeoutError,
    UntrustedCacheError,
)
from kernel_cache.plan.buckets import KernelVariant
from kernel_cache.plan.keys import key_from_components
from kernel_cache.plan.launch import LaunchChoice
from kernel_cache.plan.plan import Plan, PlanItem
from kernel_cache.store.locks import KeyLock, LockBusy, private_temp_dir
from kernel_cache.store.lookup import Current, Lookup, current_entry
from kernel_cache.store.redis import ACQUIRED, BUSY, PUBLISHED, RedisSettings
from kernel_cache.store.remote import settings_from_json
from kernel_cache.store.tier import DiskTier, Tier, make_meta, verify_entry
from kernel_cache.trust.permissions import resolve_allow_shared
from kernel_cache.trust.signing import (
    ENV_SIGNING_KEY_FILE,
    ENV_TRUSTED_KEYS,
    load_signer,
    load_trusted_keys,
    may_publish,
    sign_meta,
)
from warmup.build.loadcheck import LoadChecker, die_with_parent

log = logging.getLogger("kernel_cache.warmup")

#: Set to 1 to keep the compile scratch directory (Inductor's sources, objects
#: and precompiled headers) for debugging; its path is logged.
ENV_KEEP_SCRATCH = settings.var("keep_scratch")


def check_cached(
    tier: DiskTier, key: str, device: str, cpu_features: list[str] | None = None
) -> str | None:
    """Why the cached entry of ``key`` cannot be used, or None if it can.

    Returns ``"missing"`` for no entry, a corruption or trust reason for a bad
    one (checksum, truncation, metadata that does not parse, a file others can
    write, a package AOTInductor's loader rejects, or, given ``cpu_features``
    (what this key's CPU target records), other recorded CPU features: an entry
    that says it needs instructions its key does not). Never modifies the cache.
    """
    from kernel_cache.runtime.load import load_package

    try:
        entry = tier.get(key)
        if entry is None:
            return "missing"
        verify_entry(entry)
        if cpu_features is not None and entry.meta.get("cpu_features") != cpu_features:
            return (
                f"its recorded cpu_features {entry.meta.get('cpu_features')!r} are not its "
                f"key's CPU target's {cpu_features!r}"
            )
        runner = load_package(entry.data, device, entry.where, key)
        del runner
    except CorruptEntryError as e:
        return e.reason
    except UntrustedCacheError as e:
        return f"untrusted: {e}"
    return None


def locate(tier, key) -> Current:
    """The artifact of plan key ``key`` (a :class:`CacheKey`) for the files here
    in ``tier``, or where to store it (:func:`kernel_cache.store.lookup.current_entry`,
    engine start's function). An entry that cannot be read ends the search at
    its key: :func:`check_cached` then says why and warmup replaces it there."""
    return current_entry(tier.get, key.hexdigest, stop_on=(CorruptEntryError, UntrustedCacheError))


def _cpu_features(config: EngineConfig) -> list[str] | None:
    """What an artifact of ``config`` records as ``cpu_features`` (its host code's)."""
    from warmup.build.compiler import required_cpu_features

    return required_cpu_features(config)


class Status(str, Enum):
    """The outcome of one variant in a warmup report."""

    COMPILED = "compiled"  #: this process compiled, checked and published it
    CACHED = "cached"  #: a verified entry was there (maybe published while we waited)
    FETCHED = "fetched"  #: copied from Redis
    FAILED = "failed"  #: see ``error``; ``compiler_ran`` says if a compile was discarded
    BUSY = "busy"  #: first pass only: another process holds the key (queued again)
    NOT_STARTED = "not started"  #: the run stopped first (interrupt or a full cache)


@dataclass
class VariantResult:
    """One variant's row of a warmup report (:meth:`as_dict` is its JSON)."""

    variant: str
    status: Status
    key: str = ""
    pid: int = 0
    compiler_ran: bool = False
    seconds: float = 0.0
    lock_wait_s: float = 0.0
    timings: dict | None = None
    check_s: float | None = None
    check_processes: int = 0
    libstdcxx: str = ""
    error: str | None = None
    fatal: bool = False
    quarantined: dict | None = None
    remote_error: str | None = None

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        out["status"] = self.status.value
        return out


_FROZEN = ConfigDict(frozen=True, extra="forbid")


class VariantRow(BaseModel):
    """A :class:`VariantResult` in the report (fields left None are left out)."""

    model_config = _FROZEN

    variant: str = Field(description="the variant, e.g. batched_decode:1:2:4")
    status: Status = Field(description="the outcome")
    key: str = Field("", description="the cache key (64 hex)")
    pid: int = Field(0, description="the process that handled it")
    compiler_ran: bool = Field(False, description="the compiler ran for it in this run")
    seconds: float = Field(0.0, description="wall time of its work (s)")
    lock_wait_s: float = Field(0.0, description="time spent waiting for its key's lock (s)")
    timings: dict[str, float] | None = Field(None, description="compile phases (s)")
    check_s: float | None = Field(None, description="load check time (s)")
    check_processes: int = Field(0, description="load-check processes started for it")
    libstdcxx: str = Field("", description="libstdc++ the load check ran with")
    error: str | None = Field(None, description="why it failed or was not started")
    fatal: bool = Field(False, description="its error stopped the remaining work")
    quarantined: dict[str, str] | None = Field(None, description="{reason, path} of a bad entry")
    remote_error: str | None = Field(None, description="the first Redis failure it saw")


class FailedRow(BaseModel):
    model_config = _FROZEN

    variant: str
    error: str


class QuarantinedRow(BaseModel):
    model_config = _FROZEN

    variant: str
    reason: str = Field(description="why the cached entry was bad")
    path: str = Field(description="where it was moved (quarantine/)")


class LoadCheckSummary(BaseModel):
    model_config = _FROZEN

    checked: int = Field(description="artifacts load-checked")
    children: int = Field(description="check processes started")
    libstdcxx: str = Field(description="libstdc++ of the check processes")
    seconds: float = Field(description="total load-check time (s)")


class GcSummary(BaseModel):
    """The size-limit pass (:func:`kernel_cache.store.housekeeping.gc`)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    removed: list[dict[str, Any]] = Field(description="{variant, key, size} removed")
    removed_bytes: int
    before_bytes: int
    after_bytes: int
    max_size: int = Field(description="the limit (bytes)")
    under_limit: bool = Field(description="False: this plan alone is larger than the limit")


class ShardInfo(BaseModel):
    model_config = _FROZEN

    index: int
    count: int
    variants: list[str]
    expected_compile_s: float


class WarmupReport(BaseModel):
    """What ``kernel-cache warmup --json`` prints (:func:`warmup` returns it as a dict)."""

    model_config = _FROZEN

    variants: int = Field(description="variants in the plan (or shard)")
    compiled: int = Field(description="variants this process compiled and published")
    compiler_runs: int = Field(description="compiles run (including discarded ones)")
    cached: int
    fetched: int = Field(description="copied from Redis")
    not_started: int
    uploaded: int = Field(description="local entries Redis lacked, now published")
    failed: list[FailedRow]
    quarantined: list[QuarantinedRow]
    found_bad: dict[str, str] = Field(description="{variant: why its cached entry was bad}")
    seconds: float
    fingerprint: str = Field(description="the plan's fingerprint (16 hex)")
    pid: int
    repair: str | None = Field(description="the command that finishes the work, if any failed")
    load_check: LoadCheckSummary
    remote: str | None = Field(description="the Redis URL (password hidden)")
    remote_error: str | None
    results: list[VariantRow]
    launch: dict[str, LaunchChoice] = Field(description="the variants a launch table sets")
    gc: GcSummary | None = Field(None, description="with a size limit")
    shard: ShardInfo | None = Field(None, description="with --shard (set by the CLI)")
    interrupted: str | None = Field(None, description="the signal that stopped it (CLI)")


class WarmupInterrupted(KernelCacheError):
    """SIGINT or SIGTERM stopped a warmup. ``report`` is the partial report
    (rows of unfinished variants are ``not started``); ``signum`` the signal."""

    def __init__(self, signum: int, report: dict):
        self.signum = signum
        self.report = report
        super().__init__(
            f"interrupted by {signal.Signals(signum).name}: {report['compiled']} compiled and "
            f"kept, {report['cached'] + report['fetched']} already cached, "
            f"{report['not_started']} not finished"
        )


class _Rejected(Exception):
    """The load check refused a new artifact."""


_REMOTE_TIERS: dict[str, Tier] = {}
_CHECKER: LoadChecker | None = None


def _remote_tier(remote_json: str) -> Tier:
    """One quiet remote tier (Redis or S3) per worker process (its failures go
    back in the result; the parent warns once)."""
    tier = _REMOTE_TIERS.get(remote_json)
    if tier is None:
        tier = _REMOTE_TIERS[remote_json] = settings_from_json(remote_json).tier(warn=False)
    return tier


def _checker(device: str) -> LoadChecker:
    """This worker's load-check process (started on first use, closed at exit)."""
    global _CHECKER
    if _CHECKER is None:
        _CHECKER = LoadChecker(device)
        atexit.register(_CHECKER.close)
    return _CHECKER


def _init_worker(parent: int, device: str, cpu_target: str, scratch: str) -> None:
    """Compile worker initializer: die with the warmup process, leave Ctrl-C to
    it, and pin the compile environment before torch's compile stack is imported."""
    from warmup.build.compiler import pin_environment

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)
    pin_environment(device, cpu_target, scratch)


def _claim(lock: KeyLock, blocking: bool, timeout: float, res: VariantResult) -> bool:
    """Step 1: take the key's lock; on failure set ``res`` (busy or failed)."""
    try:
        lock.acquire(timeout if blocking else 0)
    except LockBusy:
        if blocking:  # --lock-timeout 0
            res.status, res.error = Status.FAILED, lock.timeout_message(0)
        else:
            res.status = Status.BUSY
        return False
    except LockTimeoutError as e:
        res.status, res.error = Status.FAILED, str(e)
        return False
    res.lock_wait_s = round(lock.waited_s, 3)
    return True


def _check_local(tier: DiskTier, key: str, config: EngineConfig, res: VariantResult) -> bool:
    """Step 2: True if a verified entry is cached; a bad one is quarantined."""
    why = check_cached(tier, key, config.device, _cpu_features(config))
    if why is None:
        res.status = Status.CACHED
        return True
    if why != "missing":
        where = tier.quarantine(key, why, res.variant)
        res.quarantined = {"reason": why, "path": where}
    return False


def _claim_remote(
    remote: Tier, tier: DiskTier, key, target: str, blocking: bool, res: VariantResult
):
    """Step 2 with Redis: copy a verified Redis hit of plan key ``key`` in
    (``fetched``, returns None), or take the Redis build lock of ``target``
    (the key the artifact is stored under: :func:`locate`; returns it; None with
    ``res.status`` set when another builder holds it on the first pass, or
    when Redis is down or slow: then this process compiles without it)."""
    lookup = Lookup([remote], exact=True, promote_into=tier)
    for _ in range(2):  # a second round only if a published entry was rejected
        if lookup.find(key) is not None:
            res.status = Status.FETCHED
            return None
        build_lock = remote.build_lock(target)
        outcome = build_lock.acquire(wait=blocking)
        if outcome == BUSY:
            res.status = Status.BUSY
            return None
        if outcome == ACQUIRED:  # check again: it may have landed before we locked
            if lookup.find(key) is not None:
                build_lock.release()
                res.status = Status.FETCHED
                return None
            return build_lock
        if outcome != PUBLISHED:
            return None  # TIMEOUT or UNAVAILABLE: compile without the lock
    return None


def _target(cache_dir, key, allow_shared) -> Current:
    """Where the artifact of plan key ``key`` is, or is to be stored, in the
    local cache (:func:`locate`)."""
    tier = DiskTier(cache_dir, read_only=True, allow_shared=allow_shared)
    try:
        return locate(tier, key)
    finally:
        tier.close()


def _compile(config, variant, key, derived, launch, res: VariantResult) -> tuple[bytes, dict]:
    """Step 3: run the compiler; returns the package bytes and its metadata,
    keyed by ``key`` followed through ``derived`` (:attr:`Current.derived`)."""
    from warmup.build.compiler import compile_variant, required_cpu_features

    res.compiler_ran = True
    data, timings, traced = compile_variant(config, variant, launch=launch)
    res.timings = timings
    extra = {"timings": timings, "kernel": key.as_dict()["kernel"]}
    extra["cpu_target"] = config.cpu_target  # CUDA too: the C++ wrapper's host target
    extra["cpu_features"] = required_cpu_features(config)
    meta = make_meta(
        key, str(variant), data, timings["total_s"], traced=traced, derived=derived, **extra
    )
    return data, sign_meta(meta, data, load_signer())


def _load_check(device: str, res: VariantResult, data: bytes) -> None:
    """Step 4: load the artifact once in this worker's check process.

    Raises:
        _Rejected: it killed that process or the loader refused it.
    """
    checker = _checker(device)
    before, t0 = checker.started, time.perf_counter()
    verdict = checker.check(res.variant, data)
    res.check_s = round(time.perf_counter() - t0, 3)
    res.check_processes = checker.started - before
    res.libstdcxx = checker.libstdcxx
    if not verdict["ok"]:
        raise _Rejected(verdict["error"])


def _publish(tier: DiskTier, remote: Tier | None, key: str, data: bytes, meta: dict) -> None:
    """Step 5: local cache first (atomic), then the remote tier (a failure there is
    noted), unless the trusted keys would refuse the entry there (no private key
    here to sign it: it stays local, see :func:`warmup`)."""
    stored = tier.put(key, data, meta)
    if not stored.ok:  # the writable handle of a warmup never refuses; say so if it does
        raise CacheWriteError(f"cannot publish {key[:16]} to {stored.where}: {stored.reason}")
    if remote is not None and may_publish(meta, data):
        remote.put(key, data, meta)  # a failure is kept in remote.error


def build_variant(config_json: str, variant_json: str, cache_dir: str, options: dict):
    """Worker body: claim, check, compile, load check, publish, release.

    ``options``: ``key`` (the variant's key components, computed once per
    plan by the parent), ``blocking`` (wait for the locks, else return
    ``busy`` at once), ``lock_timeout`` (seconds), ``allow_shared``, ``launch``
    (the variant's launch config, resolved once per plan by the parent), ``check``
    (load-check new artifacts before publishing; default True), ``remote``
    (optional: the Redis tier's :class:`RedisSettings` as JSON).

    Returns:
        a :class:`VariantResult`. Never raises for one variant's failure.
    """
    config = EngineConfig.model_validate_json(config_json)
    variant = KernelVariant.model_validate_json(variant_json)
    allow_shared = options["allow_shared"]
    # The parent computed the key once for the plan: a worker never re-probes
    # the toolchain, so every process of a warmup agrees on every key.
    key = key_from_components(options["key"])
    res = VariantResult(str(variant), Status.FAILED, key=key.hexdigest, pid=os.getpid())
    t0 = time.perf_counter()
    remote = _remote_tier(options["remote"]) if options.get("remote") else None
    try:
        target = _target(cache_dir, key, allow_shared)
        res.key = target.key
        lock = KeyLock(cache_dir, target.key, variant=str(variant), shared=allow_shared)
        claimed = _claim(lock, options["blocking"], options["lock_timeout"], res)
    except KernelCacheError as e:  # e.g. locks/ became a link: refused, never followed
        res.status, res.error = Status.FAILED, str(e)
        claimed = False
    if not claimed:
        res.seconds = time.perf_counter() - t0
        return res
    tier = DiskTier(cache_dir, allow_shared=allow_shared)
    build_lock = None
    try:
        if _check_local(tier, target.key, config, res):
            return res
        if remote is not None:
            build_lock = _claim_remote(remote, tier, key, target.key, options["blocking"], res)
            if res.status in (Status.FETCHED, Status.BUSY):
                return res
        data, meta = _compile(config, variant, key, target.derived, options.get("launch"), res)
        if options.get("check", True):
            _load_check(config.device, res, data)
        _publish(tier, remote, target.key, data, meta)
        res.status = Status.COMPILED
    except _Rejected as e:
        res.status, res.error = Status.FAILED, f"not published: {e}"
    except CompileError as e:
        res.status, res.error = Status.FAILED, str(e)
    except CacheWriteError as e:
        res.status, res.error, res.fatal = Status.FAILED, str(e), True
    except Exception as e:  # report it with the variant; the other variants go on
        res.status, res.error = Status.FAILED, f"{type(e).__name__}: {e}"
    finally:
        try:
            if build_lock is not None:
                build_lock.release()
            tier.close()
        finally:
            lock.release()
        res.seconds = time.perf_counter() - t0
        if remote is not None and remote.error:
            res.remote_error = str(remote.error)
    return res


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
    features = _cpu_features(config)
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
            imported Inductor with a pinned variable set).
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
    keys, a warmup with Redis fetches verified entries but publishes only
    entries the trusted keys accept: what it compiles stays in the local cache
    (a warning says so), since engines refuse unsigned entries.
    """
    import kernel_cache.store.housekeeping as housekeeping
    import kernel_cache.store.usage as usage

    t0 = time.perf_counter()
    plan = Plan.build(config)
    items = list(plan) if variants is None else plan.items_for(variants)
    allow_shared = resolve_allow_shared(allow_shared_dir)
    lock_timeout = settings.get("lock_timeout") if lock_timeout is None else float(lock_timeout)
    secret = load_signer()
    keyring = load_trusted_keys()
    cached, todo, bad, writable = _precheck(config, items, cache_dir, allow_shared)
    rtier = remote.tier() if remote is not None else None
    if rtier is not None and secret is None and keyring is not None:
        log.warning(
            "no private key (%s): entries compiled here stay in %s and are not published "
            "to %s, whose engines trust only signed entries (%s); publish from a "
            "builder that holds the private key",
            ENV_SIGNING_KEY_FILE, cache_dir, rtier.location, ENV_TRUSTED_KEYS,
        )  # fmt: skip
    fetched, uploaded = [], 0
    if rtier is not None:
        todo, fetched, uploaded = _remote_precheck(
            config, cached, todo, cache_dir, allow_shared, writable, rtier, secret
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
        return _report(config, cache_dir, plan, items, results, t0, rtier, bad, uploaded)

    reporter = _Reporter(len(items), len(items) - len(todo), progress)
    try:
        if todo:
            results += _run_pool(config, todo, str(cache_dir), jobs, reporter, options)
    except _Interrupt as e:
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


def _report(config, cache_dir, plan: Plan, items, results, t0, rtier, bad, uploaded) -> dict:
    """The JSON report of :func:`warmup` (see there) from its result rows;
    ``items`` are the plan items warmup was asked for."""

    def count(status: Status) -> int:
        return sum(r.status is status for r in results)

    failed = [
        {"variant": r.variant, "error": r.error or ""} for r in results if r.status is Status.FAILED
    ]
    checked = [r for r in results if r.check_s is not None]
    out = {
        "variants": len(items),
        "compiled": count(Status.COMPILED),
        "compiler_runs": sum(r.compiler_ran for r in results),
        "cached": count(Status.CACHED),
        "fetched": count(Status.FETCHED),
        "not_started": count(Status.NOT_STARTED),
        "uploaded": uploaded,
        "failed": failed,
        "quarantined": [{"variant": r.variant, **r.quarantined} for r in results if r.quarantined],
        "found_bad": bad,
        "seconds": round(time.perf_counter() - t0, 3),
        "fingerprint": plan.fingerprint(),
        "pid": os.getpid(),
        "repair": f"kernel-cache warmup {config_to_cli(config, cache_dir)}" if failed else None,
        "load_check": {
            "checked": len(checked),
            "children": sum(r.check_processes for r in checked),
            "libstdcxx": next((r.libstdcxx for r in checked if r.libstdcxx), ""),
            "seconds": round(sum(r.check_s for r in checked), 3),
        },
        "remote": rtier.location if rtier is not None else None,
        "remote_error": rtier.error if rtier is not None else None,
        "results": [r.as_dict() for r in results],
        "launch": plan.describe_launch(items),
    }
    WarmupReport.model_validate(out)  # the report is what its model (and schema) says
    return out


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
    reporter = _Reporter(len(items), len(cached), progress)
    try:
        if todo:
            results += _run_pool(config, todo, str(cache_dir), jobs, reporter, options)
    except _Interrupt as e:
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


def _remote_precheck(config, cached, todo, cache_dir, allow_shared, writable, rtier, secret):
    """With Redis: publish cached entries Redis lacks (signed when ``secret``, the
    private key, is set: the local cache is trusted; without it, only entries the
    trusted keys accept as they are), and copy verified Redis hits of the to-do
    items into the local cache. Returns (todo, fetched, uploaded)."""
    tier = DiskTier(cache_dir, read_only=not writable, allow_shared=allow_shared)
    lookup = Lookup([rtier], exact=True, promote_into=tier)
    left, fetched, uploaded = [], [], 0
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
            uploaded += rtier.put(key, entry.data, want).stored
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


class _Interrupt(Exception):
    """SIGINT/SIGTERM reached :func:`_run_pool`; ``results`` are its rows so far
    (unfinished variants as ``not started``)."""

    def __init__(self, signum: int, results: list[VariantResult]):
        super().__init__(signum)
        self.signum = signum
        self.results = results


class _Reporter:
    """Progress on stderr: a rich progress bar in a terminal (the variants
    being compiled, elapsed time, ETA), one line per finished variant
    otherwise, nothing when ``enabled`` is False."""

    def __init__(self, total: int, done: int, enabled: bool):
        from rich.console import Console

        self.total, self.done, self.enabled = total, done, enabled
        self.console = Console(stderr=True)
        self.bar = None
        if enabled and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]warmup[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=self.console,
            )
            self.bar.start()
            self.task = self.bar.add_task("", total=total, completed=done)

    def running(self, variants: list[str]) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description="compiling " + ", ".join(variants[:3]))

    def finished(self, r: VariantResult) -> None:
        self.done += 1
        if r.status is Status.FAILED:
            self.console.print(f"[red]failed[/] {r.variant}: {r.error}", highlight=False)
        if self.bar is not None:
            self.bar.advance(self.task)
        elif self.enabled:
            print(
                f"warmup [{self.done}/{self.total}] {r.variant} {r.status.value} {r.seconds:.1f} s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description="")
            self.bar.stop()
            self.bar = None


def _in_process(config, todo, cache_dir, reporter, options) -> list[VariantResult]:
    """``jobs=0``: a pass that never waits, then one that does, in this process."""
    from warmup.build.compiler import pin_environment

    scratch = _new_scratch()
    saved = dict(os.environ)
    results, busy = [], []
    try:
        pin_environment(config.device, config.cpu_target, scratch)
        cfg_json = config.model_dump_json()
        for blocking in (False, True):
            for item in busy if blocking else todo:
                opts = {**_item_options(item, options, blocking), "check": False}
                r = build_variant(cfg_json, item.variant.model_dump_json(), cache_dir, opts)
                if r.status is Status.BUSY and not blocking:
                    busy.append(item)
                    continue
                results.append(r)
                reporter.finished(r)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        _drop_scratch(scratch)
    return results


_SCRATCH_PREFIX = "kernel_cache-inductor-"


def _new_scratch() -> str:
    """A private directory under the system temp dir for one warmup's compiles
    (Inductor's scratch and temp files), removed by :func:`_drop_scratch`.
    Those of warmups that died (SIGKILL) are removed here first: the pid is
    in the name."""
    return private_temp_dir(_SCRATCH_PREFIX)


def _drop_scratch(scratch: str) -> None:
    if settings.get("keep_scratch"):
        log.warning("kept the compile scratch directory %s (%s=1)", scratch, ENV_KEEP_SCRATCH)
        return
    shutil.rmtree(scratch, ignore_errors=True)


def _worker_failure(v: KernelVariant, e: BaseException) -> VariantResult:
    """The row of a variant whose worker raised instead of returning a result."""
    if isinstance(e, BrokenProcessPool):
        why = f"its worker process died (killed, out of memory or crashed): {e}"
    else:
        why = f"the worker raised {type(e).__name__}: {e}"
    return VariantResult(str(v), Status.FAILED, error=why)


def _item_options(item: PlanItem, options: dict, blocking: bool) -> dict:
    """A worker's options for ``item``: its key (computed once, in the plan)
    and launch config, and whether to wait for the locks."""
    return {**options, "blocking": blocking, "launch": item.launch, "key": item.key.as_dict()}


def _raise_interrupt(signum, frame):
    raise _Interrupt(signum, [])


class _Pool:
    """The worker pools of :func:`_run_pool`: a new pool replaces one a dying
    worker broke; each future remembers its item and the pool it went to."""

    def __init__(self, config: EngineConfig, cache_dir: str, jobs: int, scratch: str, options):
        self.config, self.cache_dir, self.jobs, self.scratch = config, cache_dir, jobs, scratch
        self.options, self.cfg_json = options, config.model_dump_json()
        self.pools = [self._new()]
        self.futs: dict = {}  # future -> PlanItem
        self.pool_of: dict = {}  # future -> index in pools of the pool it was sent to
        self.retried: set[str] = set()
        self.fatal: str | None = None

    def _new(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self.jobs,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(os.getpid(), self.config.device, self.config.cpu_target, self.scratch),
        )

    def submit(self, item: PlanItem, blocking: bool):
        opts = _item_options(item, self.options, blocking)
        v_json = item.variant.model_dump_json()
        with _sigint_ignored():  # the submit may spawn a worker
            f = self.pools[-1].submit(build_variant, self.cfg_json, v_json, self.cache_dir, opts)
        self.futs[f], self.pool_of[f] = item, len(self.pools) - 1
        return f

    def _not_started(self, v) -> VariantResult:
        return VariantResult(str(v), Status.NOT_STARTED, error=f"not attempted: {self.fatal}")

    def outcome(self, f, pending: set) -> VariantResult | None:
        """The row of a finished future, or None when its item went back into
        ``pending`` (a first death of its worker, or busy on the first pass)."""
        item = self.futs[f]
        v = item.variant
        if f.cancelled():
            return self._not_started(v)
        try:
            r = f.result()
        except BrokenProcessPool as e:
            if str(v) not in self.retried and self.fatal is None:
                self.retried.add(str(v))
                if self.pool_of[f] == len(self.pools) - 1:  # the newest pool broke
                    self.pools.append(self._new())
                pending.add(self.submit(item, True))
                return None
            r = _worker_failure(v, e)
        except Exception as e:
            r = _worker_failure(v, e)
        if r.status is Status.BUSY:
            if self.fatal is None:
                pending.add(self.submit(item, True))
                return None
            r = self._not_started(v)
        return r


def _run_pool(config, todo, cache_dir, jobs, reporter: _Reporter, options) -> list[VariantResult]:
    """Build ``todo`` (:class:`~kernel_cache.plan.plan.PlanItem` s) in ``jobs``
    worker processes.

    A worker that dies (SIGKILL, out of memory, a crash) breaks the pool and
    fails every variant in flight; those are tried once more in a new pool, and
    only a variant whose second try also dies is reported failed.

    Raises:
        _Interrupt: SIGINT or SIGTERM; the workers are stopped first (their
            finished artifacts are published already).
    """
    if jobs == 0:
        return _in_process(config, todo, cache_dir, reporter, options)
    scratch = _new_scratch()
    results: list[VariantResult] = []
    pool = _Pool(config, cache_dir, jobs, scratch, options)
    old = signal.signal(signal.SIGTERM, _raise_interrupt) if _main_thread() else None
    pending: set = set()
    try:
        pending = {pool.submit(item, False) for item in todo}  # a Ctrl-C here stops them too
        while pending:
            reporter.running([str(pool.futs[f].variant) for f in pending if f.running()])
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for f in done:
                r = pool.outcome(f, pending)
                if r is None:
                    continue
                results.append(r)
                reporter.finished(r)
                if r.fatal and pool.fatal is None:
                    pool.fatal = r.error
                    for p in pending:
                        p.cancel()
    except (KeyboardInterrupt, _Interrupt) as e:
        raise _stopped(e, pool, todo, results) from None
    finally:
        try:
            hook("pool-shutdown")
            for p in pool.pools:
                p.shutdown(wait=True, cancel_futures=True)
        except (KeyboardInterrupt, _Interrupt) as e:  # a signal while the workers exit
            raise _stopped(e, pool, todo, results) from None
        finally:
            if old is not None:
                signal.signal(signal.SIGTERM, old)
            _drop_scratch(scratch)
    return results


def _stopped(e: BaseException, pool: _Pool, todo, results: list[VariantResult]) -> _Interrupt:
    """The :class:`_Interrupt` to raise for the signal ``e`` (KeyboardInterrupt is
    SIGINT): every worker of ``pool`` stopped, and ``results`` completed with a
    ``not started`` row for each item of ``todo`` that has none."""
    signum = e.signum if isinstance(e, _Interrupt) else signal.SIGINT
    for p in pool.pools:
        _stop_workers(p)
    seen = {r.variant for r in results}
    left = [VariantResult(str(i.variant), Status.NOT_STARTED) for i in todo]
    return _Interrupt(signum, results + [r for r in left if r.variant not in seen])


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT blocked in this thread for the block (main thread only): a worker
    spawned meanwhile starts with it blocked, which ``exec`` keeps, so a Ctrl-C
    while it imports cannot kill it half-started (``Fatal Python error:
    init_import_site``); a Ctrl-C meanwhile stays pending here and is delivered
    when the block ends, and the warmup process stops its workers itself."""
    if not _main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """SIGTERM every worker of this process (their check processes follow them:
    :func:`warmup.build.loadcheck.die_with_parent`) and cancel what is queued."""
    pool.shutdown(wait=False, cancel_futures=True)
    for p in multiprocessing.active_children():
        p.terminate()
    for p in multiprocessing.active_children():
        p.join(timeout=10)
