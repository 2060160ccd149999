"""The disk tier under many processes, crashes, full disks, read-only and untrusted
directories. Real processes, real SQLite, real files; no compiles (fast)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernel_cache.errors import (
    CacheBusyError,
    CacheWriteError,
    CorruptEntryError,
    LockTimeoutError,
    UntrustedCacheError,
)
from kernel_cache.store.disk_tier import DiskTier, PutOutcome, make_meta, verify_entry
from kernel_cache.store.locks import KeyLock, LockBusy
from kernel_cache.trust.permissions import ENV_ALLOW_SHARED

from ..conftest import ROOT
from ..fsutil import readonly_bind, tmpfs, tree_state

IS_ROOT = os.geteuid() == 0


class FakeKey:
    """A stand-in for CacheKey (make_meta reads hexdigest and as_dict)."""

    def __init__(self, i: int):
        self.hexdigest = f"{i:064x}"

    def as_dict(self):
        return {"test": self.hexdigest}


def entry(i: int, size: int = 100_000):
    data = os.urandom(size)
    key = FakeKey(i)
    return key.hexdigest, data, make_meta(key, f"v{i}", data, 0.0)


def put(directory, i, size=100_000, **kw):
    key, data, meta = entry(i, size)
    tier = DiskTier(directory, **kw)
    try:
        tier.put(key, data, meta)
    finally:
        tier.close()
    return key, data


def python(script: str, *args, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    )


def wait_for_file(path: Path, proc: subprocess.Popen, timeout=120.0) -> str:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} first: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError(f"{path} not written in {timeout} s")


def sigkill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


# -- reading and writing -------------------------------------------------------------


def test_read_only_tier_writes_nothing_and_reads_what_was_published(tmp_path):
    key, data = put(tmp_path / "c", 1)
    before = tree_state(tmp_path / "c")
    ro = DiskTier(tmp_path / "c", read_only=True)
    e = ro.get(key)
    verify_entry(e)
    assert e.data == data and [m["key"] for m in ro.iter_meta()] == [key]
    assert ro.get("f" * 64) is None
    refused = ro.put(key, data, e.meta)  # refused, and it says so
    assert refused.outcome is PutOutcome.READ_ONLY and not refused.ok
    assert "read-only" in refused.reason and str(tmp_path / "c") in refused.reason
    ro.close()
    assert tree_state(tmp_path / "c") == before
    assert DiskTier(tmp_path / "absent", read_only=True).get(key) is None
    assert not (tmp_path / "absent").exists()


def test_a_truncated_artifact_is_corrupt_for_the_size_it_lost(tmp_path):
    """An artifact file cut short under intact metadata: the read is refused
    for its size, before any checksum or loader sees the bytes."""
    key, data = put(tmp_path / "c", 1)
    tier = DiskTier(tmp_path / "c")
    art = tier.artifact_path(key)
    art.write_bytes(data[:1000])
    with pytest.raises(CorruptEntryError, match=r"size 1000 bytes != recorded 100000 \(truncated"):
        verify_entry(tier.get(key))
    tier.close()


def test_reader_sees_an_entry_published_by_a_live_writer(tmp_path):
    """While a writer holds the index open (a write-ahead log is pending), a
    read-only reader reads through the log and sees the committed entry."""
    writer = DiskTier(tmp_path)
    key, data, meta = entry(2)
    writer.put(key, data, meta)
    assert (tmp_path / "cache.db-wal").exists()
    assert DiskTier(tmp_path, read_only=True).get(key).data == data
    writer.close()


@pytest.mark.parametrize("size", [0, 40, 1 << 16])
def test_small_entries_kept_inline_by_diskcache_read_back_like_files(tmp_path, size):
    """diskcache keeps values under its min_file_size in the index row, not in a
    file; such an entry (a tune result is a few hundred bytes) reads back the same
    as a large one, from a writable and from a read-only tier."""
    key, data, meta = entry(3, size)
    tier = DiskTier(tmp_path)
    tier.put(key, data, meta)
    assert tier.get(key).data == data
    tier.close()
    assert DiskTier(tmp_path, read_only=True).get(key).data == data


def test_pickled_rows_are_refused_never_unpickled(tmp_path):
    key, _ = put(tmp_path, 3)
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    con = sqlite3.connect(tmp_path / "cache.db")
    con.execute(
        "UPDATE Cache SET mode = 4, value = ? WHERE key = ?",
        (pickle.dumps(Boom()), "meta/" + key),
    )
    con.commit()
    con.close()
    for tier in (DiskTier(tmp_path), DiskTier(tmp_path, read_only=True)):
        with pytest.raises(CorruptEntryError, match="pickled"):
            tier.get(key)
        tier.close()
    assert not marker.exists()


def test_many_processes_opening_and_publishing_at_once_never_fail(tmp_path):
    """8 processes, released together once all have imported, each open a fresh
    cache and publish 4 entries: no "database is locked" escapes the retries."""
    script = (
        "import os, sys, time\n"
        "from tests.store.test_disk_tier import entry\n"
        "from kernel_cache.store.disk_tier import DiskTier\n"
        "print('ready', flush=True)\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.001)\n"
        "for j in range(4):\n"
        "    i = int(sys.argv[3]) * 10 + j\n"
        "    t = DiskTier(sys.argv[1])\n"
        "    k, d, m = entry(i, 40_000)\n"
        "    t.put(k, d, m)\n"
        "    assert t.get(k).data == d\n"
        "    t.close()\n"
    )
    go = tmp_path / "go"
    procs = [python(script, tmp_path / "c", go, n) for n in range(8)]
    assert [p.stdout.readline().strip() for p in procs] == ["ready"] * 8
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, outs
    ro = DiskTier(tmp_path / "c", read_only=True)
    assert len(list(ro.iter_meta())) == 32


HOLD_LOCK = r"""
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
con.execute("ROLLBACK")
"""


def test_locked_index_is_retried_then_reported_within_the_bound(tmp_path):
    put(tmp_path, 4)
    db = tmp_path / "cache.db"
    holder = python(HOLD_LOCK, db, 2.0)
    assert holder.stdout.readline().strip() == "locked"
    t0 = time.monotonic()
    put(tmp_path, 5, timeout=30)  # waits out the 2 s hold with backoff, then publishes
    assert time.monotonic() - t0 >= 1.0
    holder.wait(timeout=30)

    holder = python(HOLD_LOCK, db, 120.0)
    try:
        assert holder.stdout.readline().strip() == "locked"
        # engine start is never blocked by a writer: it reads without locking
        assert DiskTier(tmp_path, read_only=True).get(FakeKey(5).hexdigest) is not None
        t0 = time.monotonic()
        with pytest.raises(CacheBusyError) as e:
            put(tmp_path, 6, timeout=1.5)
        elapsed = time.monotonic() - t0
    finally:
        sigkill(holder)
    assert elapsed < 30, "the wait is bounded by the timeout"
    assert str(db) in str(e.value) and "database is locked" in str(e.value)
    assert "KERNEL_CACHE_DB_TIMEOUT" in str(e.value)


# -- crashes ------------------------------------------------------------------------

PUBLISH = r"""
import sys
from tests.store.test_disk_tier import put
put(sys.argv[1], int(sys.argv[2]), 3_000_000)
print("published")
"""


@pytest.mark.parametrize("point", ["publish-write", "publish-commit"])
def test_sigkill_during_publish_leaves_no_entry_and_the_next_publish_works(tmp_path, point):
    key_ok, data_ok = put(tmp_path, 7)
    marker = tmp_path / "paused"
    env = {"KERNEL_CACHE_TEST_PAUSE_AT": point, "KERNEL_CACHE_TEST_PAUSE_MARKER": str(marker)}
    proc = python(PUBLISH, tmp_path, 8, env=env)
    assert wait_for_file(marker, proc).startswith(point)
    sigkill(proc)
    key = FakeKey(8).hexdigest
    for tier in (DiskTier(tmp_path, read_only=True), DiskTier(tmp_path)):
        assert tier.get(key) is None  # no entry, not half of one
        assert tier.get(key_ok).data == data_ok
        tier.close()
    put(tmp_path, 8, 3_000_000)  # the next publish needs no cleanup
    verify_entry(DiskTier(tmp_path, read_only=True).get(key))


# -- full disk ----------------------------------------------------------------------


def test_full_disk_during_publish_leaves_nothing_half_written(tmp_path, monkeypatch):
    """A real 4 MiB tmpfs where mount is allowed (root), else an injected ENOSPC."""
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, 4 * 2**20) as mounted:
        cache = mnt / "c" if mounted else tmp_path / "c"
        key_ok, data_ok = put(cache, 9, 1_000_000)
        before = {k: v for k, v in tree_state(cache).items() if not k.startswith("cache.db")}
        if not mounted:
            monkeypatch.setenv("KERNEL_CACHE_TEST_FAULT", "enospc@publish-write")
        with pytest.raises(CacheWriteError) as e:
            put(cache, 10, 5_000_000)
        msg = str(e.value)
        assert f"no space left in cache directory {cache}" in msg
        assert "needed 5000" in msg and "bytes" in msg
        after = {k: v for k, v in tree_state(cache).items() if not k.startswith("cache.db")}
        assert after == before  # no partial artifact file, no stray directory
        ro = DiskTier(cache, read_only=True)
        assert ro.get(FakeKey(10).hexdigest) is None
        assert ro.get(key_ok).data == data_ok  # what was cached still loads


# -- locks --------------------------------------------------------------------------

HOLD_KEY = r"""
import sys, time
from kernel_cache.store.locks import KeyLock
lock = KeyLock(sys.argv[1], sys.argv[2], variant="paged_attention:1:1:1")
lock.acquire(10)
print("held", flush=True)
time.sleep(600)
"""


def test_key_lock_names_its_holder_and_dies_with_it(tmp_path):
    key = "ab" * 32
    holder = python(HOLD_KEY, tmp_path, key)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockBusy):
            KeyLock(tmp_path, key).acquire(0)
        with pytest.raises(LockTimeoutError) as e:
            KeyLock(tmp_path, key, variant="paged_attention:1:1:1").acquire(0.5)
        msg = str(e.value)
        assert key[:16] in msg and str(tmp_path / "locks" / f"{key}.lock") in msg
        assert f"pid {holder.pid}" in msg and "still running" in msg
    finally:
        sigkill(holder)
    lock = KeyLock(tmp_path, key)
    lock.acquire(5)  # the kernel released the dead holder's flock
    assert json.loads(lock.owner_path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock.owner_path.exists()


# -- trust --------------------------------------------------------------------------


def test_world_writable_cache_dir_is_refused_unless_opted_out(tmp_path, monkeypatch):
    key, data = put(tmp_path / "c", 11)
    (tmp_path / "c").chmod(0o777)
    for tier in (DiskTier(tmp_path / "c", read_only=True), DiskTier(tmp_path / "c")):
        with pytest.raises(UntrustedCacheError) as e:
            tier.get(key)
        msg = str(e.value)
        assert str(tmp_path / "c") in msg and "0777" in msg and "group and others" in msg
        assert f"chmod -R go-w {tmp_path / 'c'}" in msg and "--insecure-allow-shared-dir" in msg
    assert DiskTier(tmp_path / "c", read_only=True, allow_shared=True).get(key).data == data
    monkeypatch.setenv(ENV_ALLOW_SHARED, "1")
    assert DiskTier(tmp_path / "c", read_only=True).get(key).data == data


def test_group_writable_entry_file_is_refused(tmp_path):
    key, _ = put(tmp_path, 12)
    path = DiskTier(tmp_path, read_only=True).artifact_path(key)
    path.chmod(0o664)
    with pytest.raises(UntrustedCacheError) as e:
        DiskTier(tmp_path, read_only=True).get(key)
    assert f"cache entry file {path}" in str(e.value) and "0664" in str(e.value)
    assert f"chmod go-w {path}" in str(e.value)


def test_world_writable_parent_without_sticky_bit_is_refused(tmp_path):
    (tmp_path / "open").mkdir()
    key, _ = put(tmp_path / "open" / "c", 13)
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(UntrustedCacheError, match="directory above it"):
        DiskTier(tmp_path / "open" / "c", read_only=True).get(key)
    (tmp_path / "open").chmod(0o1777)  # sticky, like /tmp: others cannot replace it
    assert DiskTier(tmp_path / "open" / "c", read_only=True).get(key) is not None


@pytest.mark.skipif(not IS_ROOT, reason="chown to another user needs root")
def test_cache_owned_by_another_user_is_refused(tmp_path):
    key, _ = put(tmp_path / "c", 14)
    os.chown(tmp_path / "c", 4242, 4242)
    with pytest.raises(UntrustedCacheError) as e:
        DiskTier(tmp_path / "c", read_only=True).get(key)
    assert "owned by uid 4242" in str(e.value) and f"chown -R 0:0 {tmp_path / 'c'}" in str(e.value)


# -- read-only directories ----------------------------------------------------------


def test_read_only_bind_mount_reads_and_refuses_writes_clearly(tmp_path):
    key, data = put(tmp_path / "c", 15)
    with readonly_bind(tmp_path / "c", tmp_path / "ro") as mounted:
        if not mounted:
            pytest.skip("mount --bind is not permitted here (needs root)")
        before = tree_state(tmp_path / "ro")
        assert DiskTier(tmp_path / "ro", read_only=True).get(key).data == data
        with pytest.raises(CacheWriteError) as e:
            put(tmp_path / "ro", 16)
        assert f"cache directory {tmp_path / 'ro'} is not writable" in str(e.value)
        assert tree_state(tmp_path / "ro") == before
