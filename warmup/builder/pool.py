"""The worker pool of a warmup (:func:`run_pool`): ``jobs`` spawned worker
processes run :func:`warmup.builder.worker.build_variant` per variant, a worker
that dies is replaced once, and SIGINT/SIGTERM stop every worker
(:class:`PoolInterrupt` carries the rows so far). ``jobs=0`` builds in this
process (:func:`_in_process`). Each warmup compiles in a private scratch
directory (:func:`new_scratch`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from kernel_cache.config import settings
from kernel_cache.config.engine import EngineConfig
from kernel_cache.config.recipe import HASH_SEED
from kernel_cache.plan.buckets import KernelVariant
from kernel_cache.plan.plan import PlanItem
from kernel_cache.store.locks import private_temp_dir, remove_private_temp_dir
from warmup.builder.report import Reporter, Status, VariantResult
from warmup.builder.worker import build_variant, init_worker

log = logging.getLogger("kernel_cache.warmup")

#: Set to 1 to keep the compile scratch directory (Inductor's sources, objects
#: and precompiled headers) for debugging; its path is logged.
ENV_KEEP_SCRATCH = settings.var("keep_scratch")


class PoolInterrupt(Exception):
    """SIGINT/SIGTERM reached :func:`run_pool`; ``results`` are its rows so far
    (unfinished variants as ``not started``)."""

    def __init__(self, signum: int, results: list[VariantResult]):
        super().__init__(signum)
        self.signum = signum
        self.results = results


def _in_process(config, todo, cache_dir, reporter, options) -> list[VariantResult]:
    """``jobs=0``: a pass that never waits, then one that does, in this process.
    SIGINT (a ``KeyboardInterrupt`` here) raises :class:`PoolInterrupt` with the
    rows so far, as :func:`run_pool` does; SIGTERM is left to the process.

    After it the process's environment and temp folder are put back
    (:func:`warmup.builder.compiler.environment_pinned`) and Inductor's cache of
    built headers' paths is cleared, so a later ``jobs=0`` warmup of the
    process compiles as a worker would."""
    from warmup import torch_compat
    from warmup.builder.compiler import environment_pinned

    if sys.flags.hash_randomization:
        log.warning(
            "--jobs 0 compiles in this process, whose string hashing is randomized "
            "(PYTHONHASHSEED is not %s): two builders of one key may write different "
            "bytes; use --jobs 1 or more, or set PYTHONHASHSEED=%s",
            HASH_SEED,
            HASH_SEED,
        )
    tempdir = tempfile.tempdir  # new_scratch's gettempdir() caches one
    scratch = new_scratch()
    results, busy = [], []
    cfg_json = config.model_dump_json()
    try:
        with environment_pinned(config.device, config.cpu_target, scratch):
            for blocking in (False, True):
                for item in busy if blocking else todo:
                    opts = {**_item_options(item, options, blocking), "check": False}
                    r = build_variant(cfg_json, item.variant.model_dump_json(), cache_dir, opts)
                    if r.status is Status.BUSY and not blocking:
                        busy.append(item)
                        continue
                    results.append(r)
                    reporter.finished(r)
    except KeyboardInterrupt:  # SIGINT; SIGTERM is the caller's process's own
        raise PoolInterrupt(signal.SIGINT, _with_not_started(results, todo)) from None
    finally:
        try:
            torch_compat.headers_forgotten()  # their paths are in this warmup's cache
        finally:
            drop_scratch(scratch)
            tempfile.tempdir = tempdir
    return results


_SCRATCH_PREFIX = "kernel_cache-inductor-"


def new_scratch() -> str:
    """A private directory under the system temp dir for one warmup's compiles
    (Inductor's scratch and temp files), removed by :func:`drop_scratch`.
    Those of warmups that died (SIGKILL) are removed here first: the pid is
    in the name."""
    return private_temp_dir(_SCRATCH_PREFIX)


def drop_scratch(scratch: str) -> None:
    if settings.get("keep_scratch"):
        log.warning("kept the compile scratch directory %s (%s=1)", scratch, ENV_KEEP_SCRATCH)
        return
    remove_private_temp_dir(scratch)


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
    raise PoolInterrupt(signum, [])


class _Pool:
    """The worker pools of :func:`run_pool`: a new pool replaces one a dying
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
            initializer=init_worker,
            initargs=(
                os.getpid(),
                self.config.device,
                self.config.cpu_target,
                self.scratch,
                self.jobs,
            ),
        )

    def submit(self, item: PlanItem, blocking: bool):
        opts = _item_options(item, self.options, blocking)
        v_json = item.variant.model_dump_json()
        with _sigint_ignored(), hash_seed_pinned():  # the submit may spawn a worker
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


def run_pool(config, todo, cache_dir, jobs, reporter: Reporter, options) -> list[VariantResult]:
    """Build ``todo`` (:class:`~kernel_cache.plan.plan.PlanItem` s) in ``jobs``
    worker processes.

    A worker that dies (SIGKILL, out of memory, a crash) breaks the pool and
    fails every variant in flight; those are tried once more in a new pool, and
    only a variant whose second try also dies is reported failed.

    Raises:
        PoolInterrupt: SIGINT or SIGTERM; the workers are stopped first (their
            finished artifacts are published already).
    """
    if jobs == 0:
        return _in_process(config, todo, cache_dir, reporter, options)
    scratch = new_scratch()
    results: list[VariantResult] = []
    pool = _Pool(config, cache_dir, jobs, scratch, options)
    old = signal.signal(signal.SIGTERM, _raise_interrupt) if _main_thread() else None
    pending: set = set()
    try:
        pending = {pool.submit(item, False) for item in todo}  # a Ctrl-C here stops them too
        while pending:
            # The executor marks one queued call running ahead of the workers: the
            # first ``jobs`` running ones, in submission order, are those compiling.
            running = [str(i.variant) for f, i in pool.futs.items() if f in pending and f.running()]
            reporter.running(running[:jobs], jobs)
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
    except (KeyboardInterrupt, PoolInterrupt) as e:
        raise _stopped(e, pool, todo, results) from None
    finally:
        try:
            for p in pool.pools:
                p.shutdown(wait=True, cancel_futures=True)
        except (KeyboardInterrupt, PoolInterrupt) as e:  # a signal while the workers exit
            raise _stopped(e, pool, todo, results) from None
        finally:
            if old is not None:
                signal.signal(signal.SIGTERM, old)
            drop_scratch(scratch)
    return results


def _stopped(e: BaseException, pool: _Pool, todo, results: list[VariantResult]) -> PoolInterrupt:
    """The :class:`PoolInterrupt` to raise for the signal ``e`` (KeyboardInterrupt is
    SIGINT): every worker of ``pool`` stopped, and ``results`` completed with a
    ``not started`` row for each item of ``todo`` that has none."""
    signum = e.signum if isinstance(e, PoolInterrupt) else signal.SIGINT
    for p in pool.pools:
        _stop_workers(p)
    return PoolInterrupt(signum, _with_not_started(results, todo))


def _with_not_started(results: list[VariantResult], todo) -> list[VariantResult]:
    """``results`` and a ``not started`` row for each item of ``todo`` that has none."""
    seen = {r.variant for r in results}
    left = [VariantResult(str(i.variant), Status.NOT_STARTED) for i in todo]
    return results + [r for r in left if r.variant not in seen]


@contextlib.contextmanager
def hash_seed_pinned():
    """``PYTHONHASHSEED`` set to the recipe's for the block: a worker spawned
    meanwhile starts with that string-hash seed (Python reads it only at start;
    with a random one, Inductor's runtime-assert messages name their symbols in
    an order that varies between builders, and so do the package's bytes)."""
    saved = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = HASH_SEED
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = saved


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
    :func:`warmup.builder.loadcheck.die_with_parent`) and cancel what is queued."""
    pool.shutdown(wait=False, cancel_futures=True)
    for p in multiprocessing.active_children():
        p.terminate()
    for p in multiprocessing.active_children():
        p.join(timeout=10)
