"""Faults over a copy of the run's warm cache: a compile and a publish killed,
the warmup process killed alone, damaged entries, a failing compile, a full
disk, Ctrl-C after the last variant.

Real processes and real compiles of the tiny geometry: each test removes the
entries it needs cold from its copy, so it compiles only those. What these
claims are about is the build around the compiler, whatever it compiles, so
the cache is the tiny plan's build with the plain kernels
(:data:`~tests.conftest.PLAIN_KERNELS`, :func:`~tests.conftest.plain_cache_copy`).
A file apart from ``test_many_workers.py`` so that ``--dist loadfile`` can
give the two to different workers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from kernel_cache import CorruptEntryError, load_plan
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.store.disk_tier import DiskTier, make_meta
from kernel_cache.store.quarantine import list_quarantine

from ..conftest import N_TINY, plain_args, run_cli
from ..fsutil import resize_tmpfs, tmpfs, tree_state
from ..kc_helpers import wait_for_pause
from .warmup_procs import cli, gone, keys_of, remove_entries, verify_json

pytestmark = pytest.mark.compile


def test_sigkill_during_compile_and_publish_then_warmup_completes(
    plain_cache_copy, tiny_model, plain_config
):
    v = Bucketer(plain_config).variants[-1]
    (key,) = keys_of(plain_config, [v])
    remove_entries(plain_cache_copy, [key])
    for point in ("compile", "publish-write"):
        marker = plain_cache_copy.parent / f"paused-{point}"
        env = {"KERNEL_CACHE_TEST_PAUSE_AT": point, "KERNEL_CACHE_TEST_PAUSE_MARKER": str(marker)}
        proc = cli(
            "warmup", *plain_args(tiny_model), "--cache-dir", plain_cache_copy, "--json", env=env
        )
        try:
            wait_for_pause(marker, proc, point)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the warmup and its compile worker
            proc.wait(timeout=60)
        # killed holding the key's lock (and, at publish, inside the index transaction
        # with half an artifact file written): no entry, not half of one
        assert DiskTier(plain_cache_copy, read_only=True).get(key) is None
        owner = json.loads((plain_cache_copy / "locks" / f"{key}.owner").read_text())
        assert owner["pid"] == int(marker.read_text().split()[1])  # a dead holder's record
    proc = run_cli(
        "warmup", *plain_args(tiny_model), "--cache-dir", plain_cache_copy, "--json", check=True
    )
    report = json.loads(proc.stdout)
    assert (report["compiled"], report["cached"], report["failed"]) == (1, N_TINY - 1, [])
    assert verify_json(tiny_model, plain_cache_copy, plain=True)["ok"] is True


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_warmup_process_alone_ends_its_compile_workers(
    plain_cache_copy, tiny_model, plain_config, sig
):
    """Only the warmup process is killed (not its process group): its worker,
    paused inside a compile, must not run on (the kernel kills it with the parent)."""
    v = Bucketer(plain_config).variants[-1]
    remove_entries(plain_cache_copy, keys_of(plain_config, [v]))
    marker = plain_cache_copy.parent / f"paused-{sig.name}"
    env = {"KERNEL_CACHE_TEST_PAUSE_AT": "compile", "KERNEL_CACHE_TEST_PAUSE_MARKER": str(marker)}
    proc = cli("warmup", *plain_args(tiny_model), "--cache-dir", plain_cache_copy, env=env)
    try:
        wait_for_pause(marker, proc, "compile")
        worker = int(marker.read_text().split()[1])
        assert worker != proc.pid
        proc.send_signal(sig)
        proc.wait(timeout=60)
        t0 = time.monotonic()
        while not gone(worker) and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        alive = not gone(worker)
        assert not alive, f"worker {worker} outlived the warmup (killed with {sig.name})"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def test_damaged_entries_are_quarantined_and_repaired(plain_cache_copy, tiny_model, plain_config):
    """One damage per entry of the tiny plan (a truncated artifact:
    tests/store/test_disk_tier.py): verify names each, engine start refuses, warmup
    quarantines and rebuilds all three."""
    variants = Bucketer(plain_config).variants
    keys = keys_of(plain_config, variants)
    tier = DiskTier(plain_cache_copy)
    art = [tier.artifact_path(k) for k in keys]
    data = bytearray(art[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    art[0].write_bytes(bytes(data))
    tier.cache.set("meta/" + keys[1], b'{"key": "garbage')  # metadata that does not parse
    junk = os.urandom(300_000)  # bytes whose checksum matches, but not a package
    cpu = {k: tier.get(keys[2]).meta[k] for k in ("cpu_target", "cpu_features")}
    tier.put(keys[2], junk, make_meta(build_key(plain_config, variants[2]), "x", junk, 0.0, **cpu))
    tier.close()
    reasons = ["sha256", "not JSON", "loader rejected"]

    report = verify_json(tiny_model, plain_cache_copy, expect_rc=1, plain=True)
    assert report["loaded"] == 0
    got = {c["variant"]: c["reason"] for c in report["corrupt"]}
    for v, reason in zip(variants, reasons, strict=True):
        assert reason in got[str(v)]
    with pytest.raises(CorruptEntryError, match="repair with: kernel-cache warmup --model"):
        load_plan(plain_config, plain_cache_copy)

    proc = run_cli(
        "warmup", *plain_args(tiny_model), "--cache-dir", plain_cache_copy, "--jobs", "1", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["compiled"], report["cached"], report["failed"]) == (N_TINY, 0, [])
    moved = {q["variant"]: q for q in report["quarantined"]}
    assert "quarantined cache entry" in proc.stderr  # logged
    for v, reason in zip(variants, reasons, strict=True):
        assert reason in moved[str(v)]["reason"]
    records = list_quarantine(plain_cache_copy)
    assert sorted(r["key"] for r in records) == sorted(keys)
    for r in records:
        assert (Path(r["path"]) / "reason.json").is_file() and r["reason"]
        assert "artifact.pt2" in r["files"] and "meta.json" in r["files"]
    assert verify_json(tiny_model, plain_cache_copy, plain=True)["ok"] is True


def test_compile_failure_is_reported_and_the_other_variants_finish(
    plain_cache_copy, tiny_model, plain_config
):
    # The good variant is the cheaper prefill (query length 1); the bad one costs
    # its export only, since Inductor refuses the option before generating code.
    # One worker takes both: the good one compiles after the other failed there.
    good, bad = Bucketer(plain_config).variants[:2]
    remove_entries(plain_cache_copy, keys_of(plain_config, [bad, good]))
    env = {"KERNEL_CACHE_TEST_BAD_COMPILE": str(bad)}  # a real Inductor error for one variant
    proc = run_cli(
        "warmup", *plain_args(tiny_model), "--cache-dir", plain_cache_copy, "--jobs", "1", "--json",
        env=env,
    )  # fmt: skip
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert (report["compiled"], report["cached"]) == (1, N_TINY - 2)
    (failure,) = report["failed"]
    assert failure["variant"] == str(bad)
    assert f"AOTInductor failed for {bad}" in failure["error"]
    assert "kernel_cache_test_no_such_option does not exist" in failure["error"]
    assert f"failed {bad}: AOTInductor failed" in proc.stderr
    assert (
        DiskTier(plain_cache_copy, read_only=True).get(keys_of(plain_config, [good])[0]) is not None
    )


def test_full_disk_during_warmup_publish_exits_clearly_and_leaves_nothing(
    tmp_path, plain_warm_cache, tiny_model, plain_config
):
    """A real tmpfs sized to hold the cache plus half an artifact where mount is
    allowed (root); elsewhere an injected ENOSPC at the same point."""
    v = Bucketer(plain_config).variants[0]
    (key,) = keys_of(plain_config, [v])
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, 64 * 2**20) as mounted:
        cache = (mnt if mounted else tmp_path) / "cache"
        shutil.copytree(plain_warm_cache[0], cache)
        art_size = DiskTier(cache, read_only=True).get_meta(key)["size"]
        remove_entries(cache, [key])
        env = {}
        if mounted:
            st = os.statvfs(mnt)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            assert resize_tmpfs(mnt, used + art_size // 2)
        else:
            env = {"KERNEL_CACHE_TEST_FAULT": "enospc@publish-write"}

        def entries():
            return {
                k: h
                for k, h in tree_state(cache).items()
                if not k.startswith(("cache.db", "locks", "usage.json"))  # index, locks, usage
            }

        before = entries()
        proc = run_cli("warmup", *plain_args(tiny_model), "--cache-dir", cache, "--json", env=env)
        assert proc.returncode == 1, proc.stderr
        (failure,) = json.loads(proc.stdout)["failed"]
        assert f"no space left in cache directory {cache}" in failure["error"]
        needed = int(re.search(r"it needed (\d+) bytes", failure["error"]).group(1))
        assert needed > art_size // 2  # the new artifact plus its metadata
        assert f"no space left in cache directory {cache}" in proc.stderr
        assert entries() == before  # no partial artifact file or directory
        report = verify_json(tiny_model, cache, expect_rc=1, plain=True)
        assert report["loaded"] == N_TINY - 1 and report["missing"] == [str(v)]
        assert report["corrupt"] == []


def test_sigint_after_the_last_variant_gives_the_summary_not_a_traceback(
    plain_cache_copy, tiny_model, plain_config
):
    """Ctrl-C while warmup waits for its workers to exit, every variant done: exit
    130, the summary line counting the variant compiled, no traceback."""
    v = Bucketer(plain_config).variants[-1]
    remove_entries(plain_cache_copy, keys_of(plain_config, [v]))
    marker = plain_cache_copy.parent / "paused"
    env = {
        "KERNEL_CACHE_TEST_PAUSE_AT": "pool-shutdown",
        "KERNEL_CACHE_TEST_PAUSE_MARKER": str(marker),
    }
    proc = cli(
        "warmup", *plain_args(tiny_model), "--cache-dir", plain_cache_copy, env=env, terminal=True
    )
    try:
        wait_for_pause(marker, proc, "pool-shutdown")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    summary = [line for line in err.splitlines() if "interrupted by SIGINT" in line]
    assert len(summary) == 1 and "1 compiled and kept" in summary[0], err


_IN_PROCESS = """
import json, sys
from kernel_cache.config.engine import make_config
from warmup.builder.planner import WarmupInterrupted, warmup
cfg = make_config(sys.argv[1], **json.loads(sys.argv[2]))
try:
    warmup(cfg, sys.argv[3], jobs=0, progress=False)
except WarmupInterrupted as e:
    print(json.dumps({"signum": e.signum, "report": e.report}))
"""


def test_ctrl_c_in_a_jobs_0_warmup_is_warmup_interrupted_with_its_rows(
    plain_cache_copy, tiny_model, plain_config, tmp_path
):
    """A warmup in the caller's own process (``jobs=0``), paused inside its one
    compile: SIGINT raises ``WarmupInterrupted`` carrying the partial report,
    as a worker pool's warmup does, and leaves no entry of the variant."""
    import subprocess
    import sys

    from kernel_cache.config.recipe import HASH_SEED

    from ..conftest import PLAIN_LIMITS, ROOT

    v = Bucketer(plain_config).variants[-1]
    (key,) = keys_of(plain_config, [v])
    remove_entries(plain_cache_copy, [key])
    marker = tmp_path / "paused"
    env = {
        **os.environ,
        "PYTHONHASHSEED": str(HASH_SEED),
        "KERNEL_CACHE_TEST_PAUSE_AT": "compile",
        "KERNEL_CACHE_TEST_PAUSE_MARKER": str(marker),
    }
    args = [str(tiny_model), json.dumps(PLAIN_LIMITS), str(plain_cache_copy)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _IN_PROCESS, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_for_pause(marker, proc, "compile")
        assert int(marker.read_text().split()[1]) == proc.pid  # paused in the caller's process
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    got = json.loads(out.splitlines()[-1])
    assert got["signum"] == signal.SIGINT
    report = got["report"]
    assert (report["compiled"], report["cached"], report["not_started"]) == (0, N_TINY - 1, 1)
    assert DiskTier(plain_cache_copy, read_only=True).get(key) is None
