"""Run at the start of every Python process a test starts (the suite puts this
folder on ``PYTHONPATH``): installs the test-only fault injection
(:mod:`kc_testhooks`) where a test set one of its variables, then runs the
``sitecustomize`` this file shadows, if the interpreter has one."""

import importlib.machinery
import importlib.util
import os
import sys

_VARIABLES = (
    "KERNEL_CACHE_TEST_PAUSE_AT",
    "KERNEL_CACHE_TEST_FAULT",
    "KERNEL_CACHE_TEST_COMPILE_LOG",
    "KERNEL_CACHE_TEST_BAD_COMPILE",
)
if any(k in os.environ for k in _VARIABLES):
    import kc_testhooks

    kc_testhooks.install()


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_shadowed()
