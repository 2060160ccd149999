"""One variant's build, in a worker process (:func:`build_variant`), as typed steps:

1. **claim**: take the key's lock (:class:`kernel_cache.store.locks.KeyLock`). The
   first pass does not wait: a key another process holds comes back ``busy``
   and is queued again, waiting, behind the free ones, so N processes spread
   over the plan instead of queueing on its first key.
2. **check**: a verified cached entry (checksum, trust, AOTInductor's loader
   accepts it) ends the work as ``cached``; a bad one is moved to
   ``quarantine/``. With a remote tier (Redis or the object store), a verified
   remote hit is copied in (``fetched``), else the key's remote build lease is
   taken as well.
3. **compile**: ``torch.export`` + AOTInductor (:mod:`warmup.builder.compiler`) in
   the worker, whose environment the recipe pinned
   (:func:`kernel_cache.config.recipe.compile_environment`).
4. **load check**: the new artifact is loaded once in a check process that has
   only what an engine has (:class:`warmup.builder.loadcheck.LoadChecker`); one that
   kills that process or is rejected is reported and never published.
5. **publish**: to the local cache, then to the remote tier.
6. **release** the locks.

A worker stopped with SIGTERM (the warmup stopping its workers on SIGINT or
SIGTERM) gives up the remote build lease it holds before it dies, so another
builder takes the key at once rather than after the lease's TTL; the local
key lock is a file lock, released by the kernel with the process.

The key stays claimed from "missing" until it is published, so a waiter finds
the entry and reports ``cached``: one compile per key, whatever the number of
processes, machines (with a remote tier) or workers. A result row says ``compiled`` if
and only if this process ran the compiler for it and published the artifact;
``compiler_ran`` says whether the compiler ran at all (a compile whose artifact
failed its load check is ``failed`` with ``compiler_ran`` true).
"""

from __future__ import annotations

import atexit
import os
import signal
import time

from kernel_cache.config.engine import EngineConfig
from kernel_cache.config.recipe import required_cpu_features
from kernel_cache.errors import (
    CacheWriteError,
    CompileError,
    CorruptEntryError,
    KernelCacheError,
    LockTimeoutError,
    TorchAPIDriftError,
    UntrustedCacheError,
)
from kernel_cache.plan.buckets import KernelVariant
from kernel_cache.plan.keys import key_from_components
from kernel_cache.runtime.threads import usable_cpus
from kernel_cache.store.disk_tier import DiskTier, Tier, make_meta, verify_entry
from kernel_cache.store.locks import KeyLock, LockBusy
from kernel_cache.store.lookup import Current, Lookup, current_entry
from kernel_cache.store.redis import ACQUIRED, BUSY, PUBLISHED
from kernel_cache.store.remote import settings_from_json
from kernel_cache.trust.keys import load_signer, load_trusted_keys
from kernel_cache.trust.signing import check_untrusted, may_publish, sign_meta
from warmup.builder.loadcheck import LoadChecker, die_with_parent
from warmup.builder.report import Status, VariantResult


def check_cached(
    tier: DiskTier, key: str, device: str, cpu_features: list[str] | None = None
) -> str | None:
    """Why the cached entry of ``key`` cannot be used, or None if it can.

    Returns ``"missing"`` for no entry, a corruption or trust reason for a bad
    one (checksum, truncation, metadata that does not parse, a file others can
    write, a copy of a shared entry (``imported_from``) whose signature the
    keys set here refuse, a package AOTInductor's loader rejects, or, given ``cpu_features``
    (what this key's CPU target records), other recorded CPU features: an entry
    that says it needs instructions its key does not). Never modifies the cache.
    """
    from kernel_cache.runtime.package import load_package

    try:
        entry = tier.get(key)
        if entry is None:
            return "missing"
        digest = verify_entry(entry)
        if entry.meta.get("imported_from"):  # a shared entry's copy: checked again
            keyring = load_trusted_keys(required=False)
            if keyring is not None:
                check_untrusted(entry, keyring, digest=digest)
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


def recorded_cpu_features(config: EngineConfig) -> list[str]:
    """What an artifact of ``config`` records as ``cpu_features`` (its host code's)."""
    return required_cpu_features(config.cpu_target)


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


#: The remote build lease this worker holds while it compiles (at most one),
#: given up by :func:`_on_sigterm`.
_HELD: list = []


def _on_sigterm(signum, frame) -> None:
    """SIGTERM in a compile worker: give up a held remote build lease (one
    bounded request: ``BuildLease.release`` never raises), then die of the
    signal as a worker without this handler does."""
    for lease in list(_HELD):
        lease.release()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def init_worker(parent: int, device: str, cpu_target: str, scratch: str, jobs: int = 1) -> None:
    """Compile worker initializer: die with the warmup process, leave Ctrl-C to
    it, give up a remote build lease on SIGTERM, and pin the compile environment
    before torch's compile stack is imported, with Inductor's compile threads the
    usable CPUs over ``jobs``, the workers of the warmup.

    Measured on a 16-CPU host (H100, torch 2.11, a 17-variant CUDA plan, each
    worker with Inductor's default of 16 compile processes): ``--jobs 16`` took
    6.0x the CPU seconds of ``--jobs 1`` and was slower than ``--jobs 4``."""
    from kernel_cache.plan.traced_build import record_imports
    from warmup.builder.compiler import pin_environment

    record_imports()  # before the engine's modules are imported
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    die_with_parent(parent)
    pin_environment(device, cpu_target, scratch, max(1, usable_cpus() // max(1, jobs)))


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
    why = check_cached(tier, key, config.device, recorded_cpu_features(config))
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
    """Step 2 with a remote tier: copy its verified hit of plan key ``key`` in
    (``fetched``, returns None), or take its build lease of ``target``
    (the key the artifact is stored under: :func:`locate`; returns it; None with
    ``res.status`` set when another builder holds it on the first pass, or
    when the remote tier is down or slow: then this process compiles without it)."""
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


def pch_dir(cache_dir: str, allow_shared: bool) -> str:
    """The folder of the compile workers' precompiled headers: ``KERNEL_CACHE_PCH_DIR``,
    else ``<cache_dir>/pch``. A header is code every later compile includes, so
    the folder is checked as the cache directory is (owner, mode, no links:
    :func:`kernel_cache.trust.permissions.check_cache_dir`).

    Raises:
        UntrustedCacheError: names the setting, the folder, why and the fix.
        ConfigError: the path, or a folder above it, is a file (names it).
    """
    from pathlib import Path

    from kernel_cache.config import settings
    from kernel_cache.errors import ConfigError, UntrustedCacheError
    from kernel_cache.trust.permissions import check_cache_dir

    path = settings.get("pch_dir") or Path(cache_dir) / "pch"
    var = settings.var("pch_dir")
    for p in (path, *path.parents):  # the nearest that exists must be a folder
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                raise ConfigError(
                    f"the precompiled headers' folder {path} ({var}, default <cache dir>/pch): "
                    f"{p} is not a directory; fix: set {var} to a directory (a new one is "
                    "made), or unset it"
                )
            break
    try:
        check_cache_dir(path, allow_shared=allow_shared)
    except UntrustedCacheError as e:
        raise UntrustedCacheError(
            f"the precompiled headers' folder {path} ({var}, default <cache dir>/pch) is "
            f"checked as a cache directory is: {e}; or set {var} to a folder only this "
            "user can write"
        ) from None
    return str(path)


def _compile(
    config, variant, key, derived, launch, pch: str, res: VariantResult
) -> tuple[bytes, dict]:
    """Step 3: run the compiler (precompiled headers kept in ``pch``);
    returns the package bytes and its metadata, keyed by ``key`` followed
    through ``derived`` (:attr:`Current.derived`)."""
    from warmup.builder.compiler import compile_variant

    res.compiler_ran = True
    info: dict = {}
    data, timings, traced = compile_variant(config, variant, launch=launch, pch_dir=pch, info=info)
    res.timings = timings
    extra = {"timings": timings, "kernel": key.as_dict()["kernel"], **info}
    extra["cpu_target"] = config.cpu_target  # CUDA too: the C++ wrapper's host target
    extra["cpu_features"] = recorded_cpu_features(config)
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


def _publish(tier: DiskTier, remote: Tier | None, key: str, data: bytes, meta: dict) -> bool:
    """Step 5: local cache first (atomic), then the remote tier (a failure there is
    noted), unless the trusted keys would refuse the entry there (no private key
    here to sign it: it stays local, see :func:`warmup`). Returns whether the
    remote holds it now."""
    stored = tier.put(key, data, meta)
    if not stored.ok:  # the writable handle of a warmup never refuses; say so if it does
        raise CacheWriteError(f"cannot publish {key[:16]} to {stored.where}: {stored.reason}")
    if remote is not None and may_publish(meta, data):
        return remote.put(key, data, meta).ok  # a failure is kept in remote.error
    return False


def build_variant(config_json: str, variant_json: str, cache_dir: str, options: dict):
    """Worker body: claim, check, compile, load check, publish, release.

    ``options``: ``key`` (the variant's key components, computed once per
    plan by the parent), ``blocking`` (wait for the locks, else return
    ``busy`` at once), ``lock_timeout`` (seconds), ``allow_shared``, ``launch``
    (the variant's launch config, resolved once per plan by the parent), ``check``
    (load-check new artifacts before publishing; default True), ``remote``
    (optional: the remote tier's settings as JSON,
    :func:`kernel_cache.store.remote.settings_from_json`).

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
            if build_lock is not None:
                _HELD.append(build_lock)
            if res.status in (Status.FETCHED, Status.BUSY):
                return res
        pch = pch_dir(cache_dir, allow_shared)
        data, meta = _compile(config, variant, key, target.derived, options.get("launch"), pch, res)
        if options.get("check", True):
            _load_check(config.device, res, data)
        res.published = _publish(tier, remote, target.key, data, meta)
        res.status = Status.COMPILED
    except _Rejected as e:
        res.status, res.error = Status.FAILED, f"not published: {e}"
    except CompileError as e:
        res.status, res.error = Status.FAILED, str(e)
    except (CacheWriteError, TorchAPIDriftError) as e:  # every later variant would fail too
        res.status, res.error, res.fatal = Status.FAILED, str(e), True
    except Exception as e:  # report it with the variant; the other variants go on
        res.status, res.error = Status.FAILED, f"{type(e).__name__}: {e}"
    finally:
        try:
            if build_lock is not None:
                build_lock.release()
                _HELD.clear()
            tier.close()
        finally:
            lock.release()
        res.seconds = time.perf_counter() - t0
        if remote is not None and remote.error:
            res.remote_error = str(remote.error)
    return res
