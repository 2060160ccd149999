"""Many warmups at once, a held lock, interrupted and killed warmups of cold caches.

Real processes and real compiles of the tiny geometry, with the oracle's plain
kernels (``PLAIN_KERNELS`` of ``tests/conftest.py``: these claims hold for any
kernel, and those compile for less); each test compiles as few variants as it
can. The faults over a copy of the run's warm cache are in ``test_faults.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernel_cache.config.engine import make_config
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.store.disk_tier import DiskTier

from ..conftest import ROOT, TINY_LIMITS, TINY_VARIANTS, plain_args, run_cli, tiny_args
from ..kc_helpers import counting_cxx, lines_of, wait_for_pause
from .warmup_procs import cli, keys_of, verify_json

pytestmark = pytest.mark.compile


HOLD_KEYS = r"""
import sys, time
from kernel_cache.store.locks import KeyLock
locks = [KeyLock(sys.argv[1], k, variant="held by the test") for k in sys.argv[2:]]
for lock in locks:
    lock.acquire(10)
print("held", flush=True)
time.sleep(600)
"""


def test_eight_concurrent_cold_warmups_compile_each_variant_once(tiny_model, tmp_path):
    cache, links, compiles = tmp_path / "cache", tmp_path / "links.log", tmp_path / "compiles"
    env = {
        **os.environ,
        "CXX": str(counting_cxx(tmp_path, links)),
        "KERNEL_CACHE_TEST_COMPILE_LOG": str(compiles),
    }
    subset = ("--query-buckets", "32")  # one variant of each kernel
    cmd = [sys.executable, "-m", "warmup.cli.main", "warmup", *map(str, plain_args(tiny_model))]
    cmd += [*subset, "--cache-dir", str(cache), "--jobs", "1", "--json", "--quiet"]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(8)
    ]
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert "Traceback" not in err, err
    reports = [json.loads(out) for out, _ in outs]
    n = reports[0]["variants"]
    plan = TINY_VARIANTS[1:]  # the tiny plan without its query-length-1 prefill variant
    assert n == len(plan) == 2
    # Independent counts: links of a package's .so, and compile_variant calls.
    linked = [line.split()[1] for line in lines_of(links)]
    assert len(linked) == n, linked
    compiled_variants = [line.split()[1] for line in lines_of(compiles)]
    assert sorted(compiled_variants) == sorted(plan)
    # The reports agree with the counts, row by row.
    assert sum(r["compiled"] for r in reports) == n
    assert sum(r["compiler_runs"] for r in reports) == n
    rows = [x for r in reports for x in r["results"]]
    assert sorted(x["variant"] for x in rows if x["compiler_ran"]) == sorted(compiled_variants)
    for r in reports:
        assert r["compiled"] + r["cached"] == n and not r["failed"], r
        assert r["compiled"] == sum(x["status"] == "compiled" for x in r["results"])
    proc = run_cli("verify", *plain_args(tiny_model), *subset, "--cache-dir", cache, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"]


def test_lock_wait_timeout_names_key_lock_file_and_holder(tmp_path, tiny_model):
    """Another process holds the compile locks of a 2-variant plan: warmup waits
    --lock-timeout seconds for each, then reports both (nothing is compiled)."""
    subset = ["--kv-buckets", "32", "--query-buckets", "32"]
    cfg = make_config(str(tiny_model), **{**TINY_LIMITS, "query_buckets": (32,)})
    variants = Bucketer(cfg).variants  # paged_attention:32:2:1, batched_decode:1:2:4
    keys = keys_of(cfg, variants)
    cache = tmp_path / "cache"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_KEYS, str(cache), *keys],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = run_cli(
            "warmup",
            *tiny_args(tiny_model),
            *subset,
            "--cache-dir",
            cache,
            "--jobs",
            "1",
            "--lock-timeout",
            "2",
            "--json",
        )
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["compiled"] == 0
    errors = {f["variant"]: f["error"] for f in report["failed"]}
    assert sorted(errors) == sorted(map(str, variants))
    for v, key in zip(variants, keys, strict=True):
        msg = errors[str(v)]
        assert "waited 2 s for the compile lock of key " + key[:16] in msg
        assert str(cache / "locks" / f"{key}.lock") in msg and f"pid {holder.pid}" in msg


def test_sigint_keeps_what_is_published_and_a_rerun_compiles_the_rest(tmp_path, tiny_model):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) after
    the first variant is published: exit 130, one summary line, no traceback,
    the published entries kept; a second warmup compiles only the rest. The
    progress lines (stderr is a pipe, not a terminal) arrive one per variant
    while the warmup runs."""
    cache = tmp_path / "cache"
    # Two of the tiny plan's variants (query bucket 32, the decode batch): one to
    # publish before the SIGINT, one for the second warmup.
    n = 2
    args = ("warmup", *plain_args(tiny_model), "--query-buckets", "32")
    args += ("--cache-dir", cache, "--jobs", "1")
    # As a terminal starts it: SIGINT at its default, even where this test runs
    # with SIGINT ignored (a background job of a script inherits that).
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmup.cli.main", *map(str, args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = proc.stderr.readline()  # blocks until the first variant is done
    assert re.match(rf"warmup \[1/{n}\] \S+ compiled [\d.]+ s$", first.strip()), first
    assert proc.poll() is None  # a line per variant before the end
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    summary = [line for line in err.splitlines() if "interrupted by SIGINT" in line]
    assert len(summary) == 1, err
    tier = DiskTier(cache)
    kept = len(list(tier.iter_meta()))
    tier.close()
    assert kept >= 1
    assert f"{kept} compiled and kept" in summary[0]
    proc = run_cli(*args, "--json", "--quiet", check=True)
    report = json.loads(proc.stdout)
    assert report["cached"] == kept and report["compiled"] == n - kept
    assert report["compiler_runs"] == n - kept


def _spawned_workers(pid: int) -> list[int]:
    """The multiprocessing workers (``spawn_main`` in their command line) that
    process ``pid`` started."""
    kids = Path(f"/proc/{pid}/task/{pid}/children")
    out = []
    for kid in kids.read_text().split() if kids.exists() else []:
        try:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            out.append(int(kid))
    return out


def test_sigint_while_the_workers_start_leaves_no_fatal_python_error(tmp_path, tiny_model):
    """Ctrl-C in the first second, while the spawned workers import: they start
    with SIGINT ignored, and the warmup exits 130 with the summary; no worker
    prints ``Fatal Python error`` or a traceback."""
    cache = tmp_path / "cache"
    args = ("warmup", *plain_args(tiny_model), "--cache-dir", cache, "--jobs", "2")
    proc = cli(*args, terminal=True)
    try:
        t0 = time.monotonic()  # until the warmup process has spawned a compile worker
        while time.monotonic() - t0 < 300 and not _spawned_workers(proc.pid):
            time.sleep(0.005)
        workers = _spawned_workers(proc.pid)
        assert workers, "no compile worker started"
        # From its first instant, long before its initializer runs (its imports
        # take seconds), the worker ignores SIGINT: a Ctrl-C cannot catch it halfway.
        status = Path(f"/proc/{workers[0]}/status").read_text()
        masks = [
            int(re.search(rf"^{field}:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
            for field in ("SigIgn", "SigBlk")
        ]
        assert any(m & (1 << (signal.SIGINT - 1)) for m in masks), status
        time.sleep(0.5)  # its spawn data sent, the worker is importing
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Fatal Python error" not in err and "Traceback" not in err, err
    assert "interrupted by SIGINT" in err


def test_sigterm_stops_a_warmup_with_143_and_no_traceback(tmp_path, tiny_model):
    cache = tmp_path / "cache"
    marker = tmp_path / "marker"
    env = {"KERNEL_CACHE_TEST_PAUSE_AT": "compile", "KERNEL_CACHE_TEST_PAUSE_MARKER": str(marker)}
    proc = cli("warmup", *plain_args(tiny_model), "--cache-dir", cache, "--jobs", "1", env=env)
    wait_for_pause(marker, proc, "compile")
    proc.send_signal(signal.SIGTERM)  # the warmup process alone, as `kill` or a pod stop
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (out, err)
    assert "Traceback" not in err and "interrupted by SIGTERM" in err
    pid = int(marker.read_text().split()[1])  # the paused compile worker
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the compile worker outlived the warmup"


def test_a_killed_worker_costs_a_retry_not_the_run(tmp_path, tiny_model):
    """SIGKILL one compile worker (as the OOM killer would) in the middle of its
    compile: the variants in flight are built again in a new pool, the run
    ends with every variant compiled once and published, exit 0."""
    cache, log = tmp_path / "cache", tmp_path / "compiles"
    env = {"KERNEL_CACHE_TEST_COMPILE_LOG": str(log)}
    n = 2  # two of the tiny plan's variants (query bucket 32, the decode batch): both in flight
    proc = cli(
        "warmup", *plain_args(tiny_model), "--query-buckets", "32", "--cache-dir", cache,
        "--jobs", "2", "--json", env=env,
    )  # fmt: skip
    t0 = time.monotonic()
    while not (log.exists() and log.read_text().strip()):
        assert proc.poll() is None and time.monotonic() - t0 < 600, proc.communicate()
        time.sleep(0.05)
    victim_pid, victim = log.read_text().split("\n")[0].split()
    os.kill(int(victim_pid), signal.SIGKILL)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["compiled"] == n and report["failed"] == [], report["failed"]
    lines = log.read_text().split("\n")
    assert sum(line.endswith(" " + victim) for line in lines) == 2  # killed once, then rebuilt
    assert verify_json(tiny_model, cache, "--query-buckets", "32", plain=True)["ok"] is True
