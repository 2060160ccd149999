"""Test-only fault injection, installed by the test suite from outside the product.

The crash, full-disk and compile-count tests need a process to stop, or fail,
at an exact point of a publish or compile that otherwise lasts milliseconds.
No module of ``kernel_cache`` or ``warmup`` imports this one or reads these
variables: :func:`install` wraps the product's functions at the points below,
in the test process (``tests/conftest.py``) and, through
``tests/hooks/sitecustomize.py`` (the suite puts ``tests/hooks`` on
``PYTHONPATH``), in every Python process a test starts that has one of the
variables set (warmup, its compile workers, an engine).

- ``KERNEL_CACHE_TEST_PAUSE_AT=point[,point]``: at a named point, write
  ``KERNEL_CACHE_TEST_PAUSE_MARKER`` (a file path, if set: "point pid") and
  sleep for an hour so the test can ``SIGKILL`` the process there.
- ``KERNEL_CACHE_TEST_FAULT=enospc@point``: raise ``OSError(ENOSPC)`` at the
  point (where a real small tmpfs cannot be mounted).
- ``KERNEL_CACHE_TEST_COMPILE_LOG=path``: every AOTInductor compile appends one
  line (``pid variant``) to that file (``O_APPEND``: lines from concurrent
  processes never interleave), so a test counts compiles without trusting
  warmup's own report.
- ``KERNEL_CACHE_TEST_BAD_COMPILE=variant``: that variant (``str(variant)``)
  compiles with an Inductor option that does not exist, so a real compiler
  error is reported.

Points, and the product function wrapped for each: ``compile`` (between
``torch.export`` and AOTInductor, the lock held: entering
``warmup.builder.compiler.build_paths_mapped``, which opens the AOTInductor
compile), ``publish-write`` (half of the artifact file written, inside the
index transaction: ``kernel_cache.store.safe_disk.write_all``, which writes it),
``publish-commit`` (both rows written, before ``COMMIT``: after
``diskcache.Cache.set`` of an entry's ``meta/`` row), ``pool-shutdown``
(warmup's process, every variant done, before it waits for its compile
workers to exit: ``ProcessPoolExecutor.shutdown`` of ``warmup.builder.pool``),
``s3-put`` (before an entry's PUT to S3: ``S3Tier.put``).
"""

from __future__ import annotations

import errno
import functools
import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
import time

PAUSE_ENV = "KERNEL_CACHE_TEST_PAUSE_AT"
MARKER_ENV = "KERNEL_CACHE_TEST_PAUSE_MARKER"
FAULT_ENV = "KERNEL_CACHE_TEST_FAULT"
COMPILE_LOG_ENV = "KERNEL_CACHE_TEST_COMPILE_LOG"
BAD_COMPILE_ENV = "KERNEL_CACHE_TEST_BAD_COMPILE"
#: Every variable of this module: a process with one set installs the hooks.
VARIABLES = (PAUSE_ENV, MARKER_ENV, FAULT_ENV, COMPILE_LOG_ENV, BAD_COMPILE_ENV)


def record_compile(variant: str) -> None:
    """Append ``pid variant`` to ``KERNEL_CACHE_TEST_COMPILE_LOG`` when a test set it."""
    path = os.environ.get(COMPILE_LOG_ENV)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {variant}\n".encode())
        finally:
            os.close(fd)


def hook(point: str) -> None:
    """Pause or fail at ``point`` when a test asked for it; otherwise nothing."""
    pause = os.environ.get(PAUSE_ENV)
    if pause and point in pause.split(","):
        marker = os.environ.get(MARKER_ENV)
        if marker:
            with open(marker, "a") as f:
                f.write(f"{point} {os.getpid()}\n")
        time.sleep(3600)
    fault = os.environ.get(FAULT_ENV)
    if fault == f"enospc@{point}":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")


# -- the wrapped points ---------------------------------------------------------

_compiling = threading.local()  # the variant of the compile in progress in this thread


def _patch_safe_disk(module) -> None:
    write_all = module.write_all

    @functools.wraps(write_all)
    def write_half_then_hook(fd, view):
        view = memoryview(view)
        half = len(view) // 2
        write_all(fd, view[:half])
        hook("publish-write")
        write_all(fd, view[half:])

    module.write_all = write_half_then_hook


def _patch_disk_tier(module) -> None:
    import diskcache

    set_ = diskcache.Cache.set

    @functools.wraps(set_)
    def set_then_hook(self, key, *args, **kwargs):
        out = set_(self, key, *args, **kwargs)
        if isinstance(key, str) and key.startswith("meta/"):  # the entry's second row
            hook("publish-commit")
        return out

    diskcache.Cache.set = set_then_hook


def _patch_s3(module) -> None:
    put = module.S3Tier.put

    @functools.wraps(put)
    def hook_then_put(self, key, data, meta):
        hook("s3-put")
        return put(self, key, data, meta)

    module.S3Tier.put = hook_then_put


def _patch_pool(module) -> None:
    executor = module.ProcessPoolExecutor

    first = [True]

    class Executor(executor):
        def shutdown(self, *args, **kwargs):
            # the point is the run's wait for its workers: the first shutdown only
            # (an interrupted run's clean-up shuts the pools down again)
            if first[0]:
                first[0] = False
                hook("pool-shutdown")
            return super().shutdown(*args, **kwargs)

    module.ProcessPoolExecutor = Executor


def _patch_compiler(module) -> None:
    export_and_compile = module._export_and_compile
    paths_mapped = module.build_paths_mapped

    @functools.wraps(export_and_compile)
    def note_variant(config, variant, opts, *args, **kwargs):
        if os.environ.get(BAD_COMPILE_ENV) == str(variant):
            opts = {**opts, "kernel_cache_test_no_such_option": True}
        _compiling.variant = str(variant)
        try:
            return export_and_compile(config, variant, opts, *args, **kwargs)
        finally:
            _compiling.variant = None

    @functools.wraps(paths_mapped)
    def count_then_map(*args, **kwargs):
        variant = getattr(_compiling, "variant", None)
        if variant is not None:
            record_compile(variant)
            hook("compile")
        return paths_mapped(*args, **kwargs)

    module._export_and_compile = note_variant
    module.build_paths_mapped = count_then_map


#: module -> what wraps its points. The modules that import no torch are
#: imported and wrapped when the hooks are installed; ``warmup.builder.compiler``
#: (which imports torch) when it is imported (:class:`_PatchOnImport`).
PATCHES = {
    "kernel_cache.store.safe_disk": _patch_safe_disk,
    "kernel_cache.store.disk_tier": _patch_disk_tier,
    "kernel_cache.store.s3": _patch_s3,
    "warmup.builder.pool": _patch_pool,
    "warmup.builder.compiler": _patch_compiler,
}
LAZY = "warmup.builder.compiler"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps :data:`LAZY` right after its code has run, then leaves
    ``sys.meta_path``: a compile worker imports it at its start, so no code of
    this file runs inside a compile's trace window (which would record it
    among the files the kernel's code came from, docs/keys.md)."""

    kc_testhooks = True  # marks this finder, whichever copy of the module made it

    def find_spec(self, name, path, target=None):
        if name != LAZY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _patch_compiler(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def install() -> None:
    """Wrap the points above: now, or for :data:`LAZY` when it is imported.
    Once per process, even where this module is imported under two names
    (``kc_testhooks`` by ``sitecustomize``, ``tests.hooks.kc_testhooks`` by the
    suite's conftest: a flag on ``sys``); the hooks stay inert until a
    variable of :data:`VARIABLES` is set."""
    if getattr(sys, "_kc_testhooks_installed", False):
        return
    sys._kc_testhooks_installed = True
    for name, patch in PATCHES.items():
        if name != LAZY:
            patch(importlib.import_module(name))
    if LAZY in sys.modules:
        _patch_compiler(sys.modules[LAZY])
    else:
        sys.meta_path.insert(0, _PatchOnImport())
