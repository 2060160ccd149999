"""Inductor's compile processes per warmup worker: the usable CPUs over the
workers, so ``--jobs N`` does not start N pools the size of the machine. Real
spawned workers, their environment read back; nothing is compiled."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from kernel_cache.config.recipe import compile_environment
from kernel_cache.runtime.threads import usable_cpus
from warmup.builder.worker import init_worker


def test_the_recipe_sets_compile_threads_only_when_given():
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "64", "PATH": "/bin"}
    assert (
        compile_environment(env, "cuda", "x86-64-v3", None, 3)["TORCHINDUCTOR_COMPILE_THREADS"]
        == "3"
    )
    assert (
        compile_environment(env, "cuda", "x86-64-v3", None, 0)["TORCHINDUCTOR_COMPILE_THREADS"]
        == "1"
    )
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in compile_environment(env, "cuda", "x86-64-v3")


@pytest.mark.parametrize("jobs", [1, 2, 64])
def test_each_worker_gets_the_usable_cpus_over_the_jobs(tmp_path, monkeypatch, jobs):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "99")  # the builder's own: replaced
    with ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=init_worker,
        initargs=(os.getpid(), "cpu", "x86-64-v3", str(tmp_path), jobs),
    ) as pool:
        got = pool.submit(os.getenv, "TORCHINDUCTOR_COMPILE_THREADS").result(timeout=120)
    assert got == str(max(1, usable_cpus() // jobs))
