"""Run at the start of every Python process a test starts (the suite puts this
folder on ``PYTHONPATH``): installs the test-only fault injection
(:mod:`kc_testhooks`) where a test set one of its variables; does nothing else."""

import os

if any(
    k in os.environ
    for k in (
        "KERNEL_CACHE_TEST_PAUSE_AT",
        "KERNEL_CACHE_TEST_FAULT",
        "KERNEL_CACHE_TEST_COMPILE_LOG",
        "KERNEL_CACHE_TEST_BAD_COMPILE",
    )
):
    import kc_testhooks

    kc_testhooks.install()
