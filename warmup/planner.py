"""Warmup: compile every missing variant of a plan and publish it to the cache.

For each variant: build its key; skip it if a verified entry is cached (the
checksum matches and AOTInductor's loader accepts the package); else compile
it in a worker process and publish bytes + JSON metadata atomically.

Many processes may warm one directory at once (one engine per GPU, several
containers on a node). Compiles are single-flight per key
(:class:`kernel_cache.locks.KeyLock`): check, lock, check again, compile,
publish, release; a process that finds the entry published while it waited
loads it instead of compiling. Each worker first tries the keys without
waiting and defers the ones another process is compiling to a second,
waiting pass, so N processes spread over the plan instead of queueing on its
first key.

New artifacts are published only after a fresh child process has loaded them
once (:mod:`warmup.loadcheck`, one process per batch of up to ``check_batch``):
a worker compiles under the key's lock and hands the bytes back; the parent
checks the batch, then publishes each one that loaded under its lock again
(keeping an entry another process published meanwhile). An artifact whose load
kills the child is reported with its variant, the C++ compiler and the fix, and
never reaches an engine.

With a Redis tier (``remote``, :mod:`kernel_cache.redis_tier`) compiles are
single-flight across machines too: after the local check, a verified Redis hit
(checksum, and signature with a signing key set) is copied to the local cache
(``fetched``); otherwise the worker takes the key's Redis build lock (the first
pass does not wait for it either: a key another builder holds comes back
``busy``), checks Redis again and compiles; it hands the lock to the parent,
which renews it through the load check and releases it once the artifact is
published to the local cache and to Redis. Redis failing at any point costs
one warning (from the parent: workers report it back); the local run carries on.

A corrupt or untrusted entry is moved to ``quarantine/`` (under its lock) and
recompiled. A compile failure is reported with the variant and the compiler's
text while the other variants finish; a full or unwritable cache directory
stops the remaining work (naming the directory and the bytes needed).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

from kernel_cache.buckets import Bucketer, KernelVariant
from kernel_cache.config import EngineConfig, config_to_cli
from kernel_cache.errors import (
    CacheWriteError,
    CompileError,
    CorruptEntryError,
    LockTimeoutError,
    UntrustedCacheError,
)
from kernel_cache.keys import COMPILE_OPTIONS, build_key, environment
from kernel_cache.launch import describe_plan, resolve_plan
from kernel_cache.locks import KeyLock, LockBusy, lock_timeout_from_env
from kernel_cache.lookup import Lookup
from kernel_cache.quarantine import quarantine_entry
from kernel_cache.redis_tier import ACQUIRED, BUSY, PUBLISHED, BuildLock, RedisSettings, RedisTier
from kernel_cache.signing import load_signing_key, sign_meta
from kernel_cache.store import DiskTier, make_meta, verify_entry
from kernel_cache.trust import resolve_allow_shared

log = logging.getLogger("kernel_cache.warmup")

#: TEST-ONLY: compile the named variant (``str(variant)``) with an Inductor
#: option that does not exist, so that a real compiler error is reported.
ENV_TEST_BAD_COMPILE = "KERNEL_CACHE_TEST_BAD_COMPILE"


def check_cached(tier: DiskTier, key: str, device: str) -> str | None:
    """Why the cached entry of ``key`` cannot be used, or None if it can.

    Returns ``"missing"`` for no entry, a corruption or trust reason for a bad
    one (checksum, truncation, metadata that does not parse, a file others can
    write, a package AOTInductor's loader rejects). Never modifies the cache.
    """
    from kernel_cache.runtime import load_package

    try:
        entry = tier.get(key)
        if entry is None:
            return "missing"
        verify_entry(entry)
        runner = load_package(entry.data, device, entry.where, key)
        del runner
    except CorruptEntryError as e:
        return e.reason
    except UntrustedCacheError as e:
        return f"untrusted: {e}"
    return None


_REMOTE_TIERS: dict[str, RedisTier] = {}


def _remote_tier(remote_json: str) -> RedisTier:
    """One quiet RedisTier per worker process (its failures go back in the
    result; the parent warns once)."""
    tier = _REMOTE_TIERS.get(remote_json)
    if tier is None:
        settings = RedisSettings.model_validate_json(remote_json)
        tier = _REMOTE_TIERS[remote_json] = RedisTier(settings, warn=False)
    return tier


def compile_and_publish(config_json: str, variant_json: str, cache_dir: str, options: dict) -> dict:
    """Worker body (runs in a child process): lock, check, compile, publish.

    ``options``: ``blocking`` (wait for the lock, else return ``busy`` at once),
    ``lock_timeout`` (seconds), ``allow_shared``, ``launch`` (the variant's
    launch config, resolved once per plan by the parent; absent: resolved here),
    ``stage`` (return the new package's ``data`` and ``meta`` instead of
    publishing it: the parent loads it in a fresh process first, then publishes
    it with :func:`check_and_publish`), ``remote`` (optional: the Redis tier's
    :class:`RedisSettings` as JSON; ``blocking`` applies to its build lock too).

    Returns a JSON-ready dict: ``variant``, ``key``, ``pid``, ``status``
    (compiled, cached, fetched (from Redis), busy or failed), ``seconds``,
    ``lock_wait_s``, and ``timings`` for a compile, ``quarantined`` (the reason
    and folder) when a bad entry was moved away, ``error`` (and ``fatal`` for a
    full or unwritable cache) for a failure, ``remote_token`` (a staged compile
    holding the Redis build lock: the parent adopts it) and ``remote_error``
    (Redis failed).
    """
    from warmup.compiler import compile_variant

    config = EngineConfig.model_validate_json(config_json)
    variant = KernelVariant.model_validate_json(variant_json)
    allow_shared = options["allow_shared"]
    tier = DiskTier(cache_dir, allow_shared=allow_shared)
    launch = options.get("launch")
    key = build_key(config, variant, launch=launch)
    t0 = time.perf_counter()
    result = {"variant": str(variant), "key": key.hexdigest, "pid": os.getpid()}

    remote = _remote_tier(options["remote"]) if options.get("remote") else None
    build_lock = None

    def done(status: str, **extra) -> dict:
        out = {**result, "status": status, "seconds": time.perf_counter() - t0, **extra}
        if remote is not None and remote.error:
            out["remote_error"] = remote.error
        return out

    lock = KeyLock(cache_dir, key.hexdigest, variant=str(variant), shared=allow_shared)
    try:
        lock.acquire(options["lock_timeout"] if options["blocking"] else 0)
    except LockBusy:
        if not options["blocking"]:
            return done("busy")
        return done("failed", error=lock.timeout_message(0))  # --lock-timeout 0
    except LockTimeoutError as e:
        return done("failed", error=str(e))
    try:
        result["lock_wait_s"] = round(lock.waited_s, 3)
        why = check_cached(tier, key.hexdigest, config.device)
        if why is None:
            return done("cached")
        if why != "missing":
            where = quarantine_entry(tier, key.hexdigest, why, str(variant))
            result["quarantined"] = {"reason": why, "path": str(where)}
        if remote is not None:
            remote.promote_into = tier  # a verified Redis hit is copied here
            lookup = Lookup([remote], exact=True)
            for _ in range(2):  # a second round only if a published entry was rejected
                if lookup.find(key) is not None:
                    return done("fetched")
                build_lock = remote.build_lock(key.hexdigest)
                outcome = build_lock.acquire(wait=options["blocking"])
                if outcome == BUSY:
                    return done("busy")
                if outcome == ACQUIRED:  # check again: it may have landed before we locked
                    if lookup.find(key) is not None:
                        return done("fetched")
                    break
                build_lock = None
                if outcome != PUBLISHED:
                    break  # TIMEOUT or UNAVAILABLE: compile without the lock
        opts = dict(COMPILE_OPTIONS)
        if os.environ.get(ENV_TEST_BAD_COMPILE) == str(variant):
            opts["kernel_cache_test_no_such_option"] = True
        data, timings = compile_variant(config, variant, opts, launch=launch)
        meta = make_meta(key, str(variant), data, timings["total_s"], timings=timings)
        meta = sign_meta(meta, data, load_signing_key())
        if options.get("stage"):
            extra = {"remote_token": build_lock.detach()} if build_lock is not None else {}
            return done("compiled", timings=timings, data=data, meta=meta, **extra)
        tier.put(key.hexdigest, data, meta)
        if remote is not None:
            remote.put(key.hexdigest, data, meta)
        return done("compiled", timings=timings)
    except CompileError as e:
        return done("failed", error=str(e))
    except CacheWriteError as e:
        return done("failed", error=str(e), fatal=True)
    except Exception as e:  # report it with the variant; the other variants go on
        return done("failed", error=f"{type(e).__name__}: {e}")
    finally:
        try:
            if build_lock is not None:
                build_lock.release()  # a no-op once detached for the parent
            if remote is not None:
                remote.promote_into = None
            tier.close()
        finally:
            lock.release()


def check_and_publish(config: EngineConfig, batch: list[dict], cache_dir: str, options) -> dict:
    """Load a batch of staged results (``data``, ``meta``) once in a fresh process,
    publish those that load (under the key's lock, keeping an entry another
    process published meanwhile), and mark the others failed. Updates each
    result in place (``status``, ``error``; ``data`` and ``meta`` are dropped)
    and returns the check's info (:func:`warmup.loadcheck.check_loadable`)."""
    from warmup.loadcheck import Staged, check_loadable

    checks, info = check_loadable([Staged(r["variant"], r["data"]) for r in batch], config.device)
    allow_shared = options["allow_shared"]
    for r, c in zip(batch, checks, strict=True):
        data, meta = r.pop("data"), r.pop("meta")
        if not c["ok"]:
            r.update(status="failed", error=c["error"])
            log.error("%s not published: %s", r["variant"], r["error"])
            continue
        lock = KeyLock(cache_dir, r["key"], variant=r["variant"], shared=allow_shared)
        try:
            lock.acquire(options["lock_timeout"])
        except (LockBusy, LockTimeoutError) as e:
            r.update(status="failed", error=f"publish: {e}")
            continue
        tier = DiskTier(cache_dir, allow_shared=allow_shared)
        try:
            why = check_cached(tier, r["key"], config.device)
            if why is None:
                r["status"] = "cached"  # another process published it meanwhile
                continue
            if why != "missing":
                quarantine_entry(tier, r["key"], why, r["variant"])
            tier.put(r["key"], data, meta)
        except CacheWriteError as e:
            r.update(status="failed", error=str(e), fatal=True)
        finally:
            try:
                tier.close()
            finally:
                lock.release()
    return info


def _precheck(config, plan, cache_dir, allow_shared):
    """Sort the plan's ``(variant, launch config)`` items into cached and to-do
    without writing anything if possible.

    Returns (cached, todo, bad, writable) where ``bad`` maps a variant to the
    reason its entry is unusable. Raises CacheWriteError when the directory
    cannot be written and something must be compiled.
    """
    env = environment(config.device)
    write_error = None
    try:
        tier = DiskTier(cache_dir, allow_shared=allow_shared)
        tier.cache  # noqa: B018 - open (and create) it now: fail early if unwritable
    except CacheWriteError as e:  # maybe all is cached: check without writing
        write_error = e
        tier = DiskTier(cache_dir, read_only=True, allow_shared=allow_shared)
    cached, todo, bad = [], [], {}
    try:
        for v, launch in plan:
            key = build_key(config, v, env, launch=launch).hexdigest
            why = check_cached(tier, key, config.device)
            if why is None:
                cached.append((v, launch))
            else:
                todo.append((v, launch))
                if why != "missing":
                    bad[str(v)] = why
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
    check_batch: int = 32,
    remote: RedisSettings | None = None,
) -> dict:
    """Compile what is missing from the plan, skip what is cached.

    Args:
        config: the engine configuration; its :class:`Bucketer` gives the plan.
        cache_dir: the local cache directory.
        jobs: worker processes compiling in parallel (>= 1); 0 compiles in this
            process and publishes without the load check (an engine that warms
            itself, as in ``benchmarks/fleet_load.py``).
        progress: show a progress bar on stderr.
        variants: a subset of the plan (default: all of it; a shard).
        max_size: a size limit in artifact bytes (``--max-size`` or
            ``$KERNEL_CACHE_MAX_SIZE``): before and after compiling, entries
            of other plans are removed, least recently used first
            (:func:`kernel_cache.housekeeping.gc`), never one of this plan.
        lock_timeout: seconds to wait for another process compiling the same
            key (default ``KERNEL_CACHE_LOCK_TIMEOUT`` or 900).
        allow_shared_dir: skip the trust checks (default
            ``KERNEL_CACHE_INSECURE_ALLOW_SHARED_DIR``).
        check_batch: new artifacts loaded per check process (see
            :mod:`warmup.loadcheck`); the last batch may be smaller.
        remote: the shared Redis tier, or None (local only).

    Returns:
        ``{"variants", "compiled", "cached", "failed": [{"variant", "error"}],
        "quarantined": [{"variant", "reason", "path"}], "found_bad", "seconds",
        "fingerprint", "pid", "repair", "load_check": {"batches", "children",
        "checked", "libstdcxx", "seconds"}, "results": [...], "launch": {variant:
        {"config", "source"}} for the variants a launch table sets}``, plus with
        ``max_size`` ``"gc": {"removed", "removed_bytes", "after_bytes",
        "max_size", "under_limit"}`` (``under_limit`` False: this plan alone
        is larger). ``compiled`` counts artifacts that passed the load check
        and were published. With ``remote``: ``"fetched"`` (copied from Redis),
        ``"uploaded"`` (local entries Redis lacked, now published), ``"remote"``
        (its URL, password hidden), ``"remote_error"`` (None or the first failure).

    Raises:
        UntrustedCacheError: the directory is writable by others or owned by another user.
        CacheWriteError: the directory cannot be written and variants are missing.
        CacheBusyError: its index stayed locked past ``KERNEL_CACHE_DB_TIMEOUT``.
        SigningKeyError: signed entries are required and no key is set.
    """
    from kernel_cache import housekeeping, usage

    t0 = time.perf_counter()
    bucketer = Bucketer(config)
    plan = list(bucketer.variants if variants is None else variants)
    allow_shared = resolve_allow_shared(allow_shared_dir)
    lock_timeout = lock_timeout_from_env() if lock_timeout is None else float(lock_timeout)
    env = environment(config.device)
    resolved = resolve_plan(config, plan, env["device_arch"])
    items = [(v, resolved[v].config) for v in plan]
    secret = load_signing_key()
    cached, todo, bad, writable = _precheck(config, items, cache_dir, allow_shared)
    rtier = RedisTier(remote) if remote is not None else None
    fetched, uploaded = [], 0
    if rtier is not None:
        todo, fetched, uploaded = _remote_precheck(
            config, cached, todo, cache_dir, allow_shared, writable, rtier, secret
        )
    keep = housekeeping.plan_digests(config) if max_size is not None else set()
    gc_on = max_size is not None and writable  # a read-only cache has nothing to remove
    first = _gc(cache_dir, max_size, keep, allow_shared) if gc_on else None  # make room first
    results = [{"variant": str(v), "status": "cached"} for v, _ in cached]
    results += [{"variant": str(v), "status": "fetched"} for v, _ in fetched]
    check = {"batches": 0, "children": 0, "checked": 0, "libstdcxx": "", "seconds": 0.0}
    if todo:
        options = {
            "lock_timeout": lock_timeout,
            "allow_shared": allow_shared,
            "stage": True,
            "remote": remote.model_dump_json() if remote is not None else None,
        }
        results += _run_pool(
            config,
            todo,
            str(cache_dir),
            jobs,
            progress,
            len(plan),
            options,
            check_batch,
            check,
            rtier,
        )
    if rtier is not None:
        rtier.close()
    usage.record(
        cache_dir,
        hits=[build_key(config, v, env, launch=launch).hexdigest for v, launch in cached],
        misses=sum(r["status"] == "compiled" for r in results),
    )
    gc_report = None
    if gc_on:
        gc_report = _gc(cache_dir, max_size, keep, allow_shared)
        gc_report["removed"] = first["removed"] + gc_report["removed"]
        gc_report["removed_bytes"] = sum(r["size"] for r in gc_report["removed"])
        gc_report["before_bytes"] = first["before_bytes"]
    failed = [
        {"variant": r["variant"], "error": r.get("error", "")}
        for r in results
        if r["status"] == "failed"
    ]
    quarantined = [
        {"variant": r["variant"], **r["quarantined"]} for r in results if "quarantined" in r
    ]
    return {
        "variants": len(plan),
        "compiled": sum(r["status"] == "compiled" for r in results),
        "cached": sum(r["status"] == "cached" for r in results),
        "fetched": sum(r["status"] == "fetched" for r in results),
        "uploaded": uploaded,
        "failed": failed,
        "quarantined": quarantined,
        "found_bad": bad,
        "seconds": round(time.perf_counter() - t0, 3),
        "fingerprint": bucketer.fingerprint(),
        "pid": os.getpid(),
        "repair": f"kernel-cache warmup {config_to_cli(config, cache_dir)}" if failed else None,
        "load_check": check,
        "remote": rtier.location if rtier is not None else None,
        "remote_error": rtier.error if rtier is not None else None,
        "results": results,
        "launch": describe_plan(resolved),
        **({"gc": gc_report} if gc_report is not None else {}),
    }


def compile_items(
    config: EngineConfig,
    cache_dir: str | Path,
    items: list[tuple[KernelVariant, dict]],
    *,
    jobs: int = 1,
    progress: bool = True,
) -> dict:
    """Compile each ``(variant, launch config)`` whose artifact is not cached
    (``kernel-cache tune`` compiles several configs of one variant this way).

    Returns: ``{"variants", "compiled", "cached", "failed", "results"}`` as :func:`warmup`.

    Raises:
        as :func:`warmup`.
    """
    allow_shared = resolve_allow_shared(None)
    cached, todo, _, _ = _precheck(config, items, cache_dir, allow_shared)
    results = [{"variant": str(v), "status": "cached"} for v, _ in cached]
    if todo:
        options = {"lock_timeout": lock_timeout_from_env(), "allow_shared": allow_shared}
        results += _run_pool(config, todo, str(cache_dir), jobs, progress, len(items), options)
    return {
        "variants": len(items),
        "compiled": sum(r["status"] == "compiled" for r in results),
        "cached": sum(r["status"] == "cached" for r in results),
        "failed": [
            {"variant": r["variant"], "error": r.get("error", "")}
            for r in results
            if r["status"] == "failed"
        ],
        "results": results,
    }


def _same_published(have: dict | None, want: dict, signed: bool) -> bool:
    """Whether Redis's metadata ``have`` records the bytes (checksum, size) and,
    with a signing key (``signed``), the signature of the local entry about to be
    published as ``want`` (a builder without a key never replaces a signed entry)."""
    fields = ("sha256", "size", "signature") if signed else ("sha256", "size")
    return have is not None and all(have.get(f) == want.get(f) for f in fields)


def _remote_precheck(config, cached, todo, cache_dir, allow_shared, writable, rtier, secret):
    """With Redis: publish cached entries Redis lacks (signed when a key is
    set: the local cache is trusted), and copy verified Redis hits of the
    to-do items into the local cache. Returns (todo, fetched, uploaded)."""
    env = environment(config.device)
    tier = DiskTier(cache_dir, read_only=not writable, allow_shared=allow_shared)
    rtier.promote_into = tier
    lookup = Lookup([rtier], exact=True)
    left, fetched, uploaded = [], [], 0
    try:
        for v, launch in cached:
            key = build_key(config, v, env, launch=launch).hexdigest
            if rtier.is_down():
                continue
            entry = tier.get(key)
            want = sign_meta(entry.meta, entry.data, secret)
            try:
                have = rtier.get_meta(key)
            except CorruptEntryError:
                have = None
            if not _same_published(
                have, want, secret is not None
            ):  # missing, unsigned, other key, other bytes
                uploaded += rtier.put(key, entry.data, want)
        for item in todo:  # todo is empty when the cache is not writable (_precheck)
            found = lookup.find(build_key(config, item[0], env, launch=item[1]))
            (fetched if found else left).append(item)
    finally:
        rtier.promote_into = None
        tier.close()
    return left, fetched, uploaded


def _gc(cache_dir, max_size, keep, allow_shared) -> dict:
    from kernel_cache import housekeeping

    tier = DiskTier(cache_dir, allow_shared=allow_shared)
    try:
        return housekeeping.gc(tier, max_size, keep)
    finally:
        tier.close()


def _die_with_parent(parent: int) -> None:
    """Worker initializer: on Linux, have the kernel SIGKILL this worker when the
    warmup process dies (SIGKILL, SIGTERM, a crash), so no compile outlives it
    (``prctl(PR_SET_PDEATHSIG)``; elsewhere a worker finishes its current compile
    and then exits on the broken pipe)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _run_pool(
    config, todo, cache_dir, jobs, progress, total, options, check_batch=32, check=None, rtier=None
) -> list[dict]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cfg_json = config.model_dump_json()
    ctx = multiprocessing.get_context("spawn")
    results = []
    adopted: dict[str, BuildLock] = {}  # key -> Redis build lock taken over from a worker

    def settle(r: dict) -> dict:
        """A worker's Redis failure becomes this process's one warning; a staged
        compile's Redis build lock is renewed here until it is published."""
        if rtier is not None and r.get("remote_error") and rtier.error is None:
            rtier.note_failure(r["remote_error"])
        if rtier is not None and r.get("remote_token"):
            adopted[r["key"]] = BuildLock.adopt(rtier, r["key"], r.pop("remote_token"))
        return r

    if jobs == 0:  # in this process: a pass that never waits, then one that does
        busy = []
        for blocking in (False, True):
            for v, launch in todo if not blocking else busy:
                opts = {**options, "blocking": blocking, "launch": launch, "stage": False}
                r = settle(compile_and_publish(cfg_json, v.model_dump_json(), cache_dir, opts))
                if r["status"] == "busy" and not blocking:
                    busy.append((v, launch))
                else:
                    results.append(r)
        return results
    bar = Progress(
        TextColumn("[bold]warmup[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=Console(stderr=True),
        disable=not progress,
        transient=False,
    )
    fatal = None
    batch: list[dict] = []
    if check is None:
        check = {"batches": 0, "children": 0, "checked": 0, "libstdcxx": "", "seconds": 0.0}

    def flush():
        nonlocal fatal
        bar.update(task, description=f"loading {len(batch)} new artifacts in a fresh process")
        staged = {r["key"]: (r["data"], r["meta"]) for r in batch if r["key"] in adopted}
        info = check_and_publish(config, batch, cache_dir, options)
        for r in batch:  # publish to Redis what passed the load check, then unlock
            lk = adopted.pop(r["key"], None)
            if lk is None:
                continue
            if r["status"] in ("compiled", "cached") and r["key"] in staged:
                data, meta = staged[r["key"]]
                rtier.put(r["key"], data, meta)
            lk.release()
        check["batches"] += 1
        check["children"] += info["children"]
        check["checked"] += len(batch)
        check["libstdcxx"] = check["libstdcxx"] or info["libstdcxx"]
        check["seconds"] = round(check["seconds"] + info["seconds"], 3)
        for r in batch:
            if r["status"] == "failed":
                bar.console.print(f"[red]failed[/] {r['variant']}: {r['error']}")
                if r.get("fatal") and fatal is None:
                    fatal = r["error"]
            bar.advance(task)
        batch.clear()

    with (
        bar,
        ProcessPoolExecutor(
            max_workers=max(1, jobs),
            mp_context=ctx,
            initializer=_die_with_parent,
            initargs=(os.getpid(),),
        ) as pool,
    ):
        task = bar.add_task("", total=total, completed=total - len(todo))

        def submit(item, blocking):
            v, launch = item
            opts = {**options, "blocking": blocking, "launch": launch}
            return pool.submit(compile_and_publish, cfg_json, v.model_dump_json(), cache_dir, opts)

        # First pass: never wait for a lock; keys other processes hold come back
        # "busy" and are queued again, waiting, behind the free ones.
        futs = {submit(item, False): item for item in todo}
        pending = set(futs)
        waiting: set = set()  # second-pass futures: they may wait for another builder
        while pending:
            running = [str(futs[f][0]) for f in pending if f.running()][:3]
            bar.update(task, description="compiling " + ", ".join(running))
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for f in done:
                item = futs[f]
                v = item[0]
                if f.cancelled():
                    r = {"variant": str(v), "status": "failed", "error": f"not attempted: {fatal}"}
                else:
                    try:
                        r = f.result()
                    except Exception as e:  # a worker died (segfault, OOM kill)
                        r = {
                            "variant": str(v),
                            "status": "failed",
                            "error": f"worker process died: {type(e).__name__}: {e}",
                        }
                settle(r)
                if r["status"] == "busy" and fatal is not None:
                    r = {"variant": str(v), "status": "failed", "error": f"not attempted: {fatal}"}
                elif r["status"] == "busy":
                    nf = submit(item, True)
                    futs[nf] = item
                    waiting.add(nf)
                    pending.add(nf)
                    continue
                results.append(r)
                if r["status"] == "compiled" and "data" in r:
                    batch.append(r)  # checked, published and advanced in flush()
                    continue
                if r["status"] == "failed":
                    bar.console.print(f"[red]failed[/] {r['variant']}: {r['error']}")
                    if r.get("fatal") and fatal is None:
                        fatal = r["error"]
                        for p in pending:
                            p.cancel()
                bar.advance(task)
            # With Redis, publish (and unlock) the staged compiles once only waits are
            # left: holding their build locks while waiting for another builder's
            # lock deadlocks two builders that wait for each other (until lock_wait_s).
            only_waits = rtier is not None and pending <= waiting
            if len(batch) >= max(1, check_batch) or (batch and (not pending or only_waits)):
                flush()
        bar.update(task, description="done")
    for lk in adopted.values():  # not published (the run stopped): let others build it
        lk.release()
    return results
