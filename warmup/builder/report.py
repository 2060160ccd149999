"""A warmup's report: the row of each variant (:class:`VariantResult`), the
report's schema (:class:`WarmupReport`, ``docs/schemas/warmup-report.schema.json``),
the report built from the rows (:func:`make_report`), and the progress shown on
stderr while it runs (:class:`Reporter`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kernel_cache.config.engine import config_to_cli
from kernel_cache.errors import KernelCacheError
from kernel_cache.plan.launch import LaunchChoice
from kernel_cache.plan.plan import Plan


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
    #: the shared tier holds this run's artifact of it now (stored or present)
    published: bool = False

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
    published: bool = Field(
        False, description="the artifact compiled here is in the shared tier now"
    )


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
    published: int = Field(
        0, description="entries this run put in the shared tier: compiled and published, "
        "plus uploaded"
    )  # fmt: skip
    signed_by: str | None = Field(
        None, description="the key id (16 hex) of the private key that signed them, or None"
    )
    not_published: str | None = Field(
        None, description="with a shared tier: why it did not get every entry of the plan "
        "(no signing key, unavailable, refused), None when it did"
    )  # fmt: skip
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


def make_report(
    config, cache_dir, plan: Plan, items, results, t0, rtier, bad, uploaded, publish=None
) -> dict:
    """The JSON report of :func:`warmup` (see there) from its result rows;
    ``items`` are the plan items warmup was asked for; ``publish``:
    ``{"remote": location or None, "signed_by": key id or None, "held_back":
    why nothing is published (no signing key) or None}``."""

    publish = publish or {}

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
        "remote": rtier.location if rtier is not None else publish.get("remote"),
        "remote_error": rtier.error if rtier is not None else None,
        **_published(results, rtier, uploaded, publish),
        "results": [r.as_dict() for r in results],
        "launch": plan.describe_launch(items),
    }
    WarmupReport.model_validate(out)  # the report is what its model (and schema) says
    return out


def kernel_of(variant: str) -> str:
    """The kernel of a variant's name (``KERNEL:QUERY:BLOCKS:SEQS``)."""
    return variant.split(":", 1)[0]


def eta_seconds(
    remaining: list[str], running: dict[str, float], done: dict[str, list[float]], jobs: int
) -> float | None:
    """Seconds until a warmup ends, estimated from the variants it compiled so far.

    ``remaining``: the variants not started; ``running``: each variant compiling
    now with the seconds it has run; ``done``: per kernel, the seconds of each
    variant of it compiled so far; ``jobs``: the worker processes. A variant
    costs the mean of its kernel's, else of all done; the work left is shared
    by the workers, but no sooner than the longest running variant ends. None
    before any is done.
    """
    every = [s for v in done.values() for s in v]
    if not every:
        return None
    fallback = sum(every) / len(every)

    def cost(variant: str) -> float:
        seen = done.get(kernel_of(variant))
        return sum(seen) / len(seen) if seen else fallback

    now = [max(cost(v) - ran, 0.0) for v, ran in running.items()]
    left = sum(cost(v) for v in remaining) + sum(now)
    return max(left / max(jobs, 1), *now, 0.0)


def _clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


def _published(results, rtier, uploaded: int, publish: dict) -> dict:
    """``{"published", "signed_by", "not_published"}`` of a report: what the
    shared tier got from this run and, where it lacks any of this run's
    entries, why."""
    compiled = [r for r in results if r.status is Status.COMPILED]
    done = sum(r.published for r in compiled)
    why = None
    if publish.get("held_back"):
        why = publish["held_back"]
    elif rtier is not None and rtier.error:
        why = f"{rtier.location} is unavailable: {rtier.error}"
    elif publish.get("upload_failed"):
        failed = publish["upload_failed"]
        why = f"{len(failed)} cached entries were not published to {rtier.location}: {failed[0]}"
    elif rtier is not None and done < len(compiled):
        why = (
            f"{len(compiled) - done} of {len(compiled)} entries compiled here were not "
            f"published to {rtier.location} (unsigned: the trusted keys would refuse them)"
        )
    return {
        "published": done + uploaded,
        "signed_by": publish.get("signed_by") if done + uploaded else None,
        "not_published": why,
    }


class Reporter:
    """Progress on stderr: a rich progress bar in a terminal (the variants
    being compiled, elapsed time, an ETA from the variants compiled so far,
    :func:`eta_seconds`), one line per finished variant otherwise, nothing when
    ``enabled`` is False."""

    def __init__(self, total: int, done: int, enabled: bool, todo: list[str] = ()):
        from rich.console import Console

        self.total, self.done, self.enabled = total, done, enabled
        self.todo = list(todo)  # the variants to build, in plan order
        self.started: dict[str, float] = {}  # compiling now: monotonic start
        self.finished_s: dict[str, list[float]] = {}  # compiled: seconds, by kernel
        self.console = Console(stderr=True)
        self.bar = None
        if enabled and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]warmup[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}"),
                TextColumn("{task.description}"),
                console=self.console,
            )
            self.bar.start()
            self.task = self.bar.add_task("", total=total, completed=done, eta="-:--:--")

    def eta(self, jobs: int) -> float | None:
        """:func:`eta_seconds` for the variants not finished."""
        now = time.monotonic()
        running = {v: now - t for v, t in self.started.items()}
        remaining = [v for v in self.todo if v not in running]
        return eta_seconds(remaining, running, self.finished_s, jobs)

    def running(self, variants: list[str], jobs: int = 1) -> None:
        """``variants`` are compiling now (at most ``jobs`` of them)."""
        now = time.monotonic()
        self.started = {v: self.started.get(v, now) for v in variants}
        if self.bar is not None:
            eta = self.eta(jobs)
            self.bar.update(
                self.task,
                description="compiling " + ", ".join(variants),
                eta="-:--:--" if eta is None else _clock(eta),
            )

    def finished(self, r: VariantResult) -> None:
        self.done += 1
        self.started.pop(r.variant, None)
        with contextlib.suppress(ValueError):
            self.todo.remove(r.variant)
        if r.status is Status.COMPILED:
            self.finished_s.setdefault(kernel_of(r.variant), []).append(r.seconds)
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
