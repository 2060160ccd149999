"""The warmup's progress: an ETA from the variants compiled so far, per kernel,
and the variants named as compiling are at most the workers'."""

from __future__ import annotations

import time

from warmup.builder.report import Reporter, Status, VariantResult, eta_seconds


def test_eta_is_the_remaining_work_by_kernel_over_the_workers():
    done = {"paged_attention": [20.0, 24.0], "batched_decode": [15.0]}
    remaining = ["paged_attention:32:2:1", "batched_decode:1:4:4", "batched_decode:1:8:4"]
    running = {"paged_attention:1:8:1": 10.0, "batched_decode:1:2:4": 20.0}
    # 22 + 15 + 15 left to start, 22 - 10 and 0 (past its mean) left running, on 2 workers
    assert eta_seconds(remaining, running, done, jobs=2) == (22 + 15 + 15 + 12 + 0) / 2


def test_a_kernel_not_compiled_yet_costs_the_mean_of_all_and_none_before_any():
    assert eta_seconds(["batched_decode:1:2:4"], {}, {}, jobs=1) is None
    done = {"paged_attention": [10.0, 30.0]}
    assert eta_seconds(["batched_decode:1:2:4"], {}, done, jobs=1) == 20.0


def test_the_last_variant_running_alone_is_not_shared_by_idle_workers():
    done = {"paged_attention": [30.0]}
    assert eta_seconds([], {"paged_attention:32:2:1": 10.0}, done, jobs=2) == 20.0


def test_the_reporter_counts_only_compiled_variants_and_names_only_those_running():
    todo = ["paged_attention:1:2:1", "paged_attention:32:2:1", "batched_decode:1:2:4"]
    rep = Reporter(len(todo), 0, enabled=False, todo=todo)
    rep.running(todo[:2], jobs=2)
    assert set(rep.started) == set(todo[:2])
    assert rep.eta(2) is None  # nothing compiled yet
    rep.finished(VariantResult(todo[0], Status.COMPILED, seconds=12.0))
    rep.finished(VariantResult(todo[2], Status.CACHED, seconds=0.01))  # no compile: not counted
    assert rep.finished_s == {"paged_attention": [12.0]}
    assert rep.todo == [todo[1]] and set(rep.started) == {todo[1]}
    start = rep.started[todo[1]]
    rep.running([todo[1]], jobs=2)
    assert rep.started[todo[1]] == start  # its start is kept across refreshes
    eta = rep.eta(2)
    assert eta is not None and 0 <= eta <= 12.0  # the last one left: not shared
    time.sleep(0.01)
    assert rep.eta(2) <= eta  # time passes, less is left
