"""Symbolic links inside a cache are never followed, for reading, writing or
trust decisions: an entry file or folder that is a link makes the entry
corrupt (warmup quarantines the link and rebuilds), a link where ``cache.db``,
``locks/`` or ``quarantine/`` belongs is refused naming the path and the fix.
Real files and real processes (the CLI); only the warmup rebuild compiles."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kernel_cache.errors import CorruptEntryError, UntrustedCacheError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.store.disk_tier import DiskTier, make_meta
from kernel_cache.store.locks import KeyLock
from kernel_cache.store.quarantine import quarantine_entry

from ..conftest import N_TINY, plain_args, run_cli, tiny_args
from ..fsutil import tree_state

DATA = b"\x7fELF-not-a-package" * 4096  # 72 KiB: stored as a value file


def fill_plan(cache: Path, config) -> list[tuple[str, str]]:
    """Dummy entries (never loaded) under the tiny plan's keys: [(variant, key)]."""
    tier = DiskTier(cache)
    out = []
    try:
        for v in Bucketer(config).variants:
            key = build_key(config, v)
            tier.put(key.hexdigest, DATA, make_meta(key, str(v), DATA, 1.0))
            out.append((str(v), key.hexdigest))
    finally:
        tier.close()
    return out


def entry_file(cache: Path, key: str) -> Path:
    return DiskTier(cache, read_only=True).artifact_path(key)


def other_dir(tmp_path: Path) -> Path:
    """A folder outside the cache standing for another user's (owned by nobody as root)."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    (d / "precious").write_text("do not touch\n")
    if os.geteuid() == 0:
        os.chown(d, 65534, 65534)
    return d


def no_traceback(proc) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Too many levels of symbolic links" not in proc.stderr


# -- entry files -----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["link-to-copy", "link-loop", "linked-folder", "fifo"])
def test_linked_entry_is_corrupt_for_readers_and_writers_never_followed(tmp_path, tiny_config, how):
    cache = tmp_path / "c"
    (variant, key), *_ = fill_plan(cache, tiny_config)
    f = entry_file(cache, key)
    outside = other_dir(tmp_path)
    if how == "link-to-copy":  # the bytes behind the link are the right ones
        shutil.copy(f, outside / "copy.val")
        f.unlink()
        f.symlink_to(outside / "copy.val")
        link = f
    elif how == "link-loop":
        f.unlink()
        f.symlink_to(f.name)
        link = f
    elif how == "fifo":  # not a link, not a file: never opened for reading (it would block)
        f.unlink()
        os.mkfifo(f)
        link = f
    else:  # the xx folder holding the file is a link to a copy of it
        xx = f.parent.parent
        shutil.copytree(xx, outside / "xx")
        shutil.rmtree(xx)
        xx.symlink_to(outside / "xx")
        link = xx
    before = tree_state(outside)
    expect = "is not a regular file" if how == "fifo" else "symbolic link"
    for tier in (
        DiskTier(cache, read_only=True),
        DiskTier(cache),
        DiskTier(cache, allow_shared=True),
    ):
        with pytest.raises(CorruptEntryError) as e:
            tier.get(key)
        assert str(link) in str(e.value) and expect in str(e.value)
        tier.close()

    # warmup's check finds it bad; quarantine moves the link itself, not its target
    from warmup.builder.worker import check_cached

    tier = DiskTier(cache)
    why = check_cached(tier, key, "cpu")
    assert why is not None and expect in why and str(link) in why
    dest = quarantine_entry(tier, key, why, variant)
    tier.close()
    moved = dest / ("linked-folder" if how == "linked-folder" else "artifact.pt2")
    assert moved.is_symlink() or how == "fifo"
    assert moved.exists() or moved.is_symlink()
    assert not link.exists() and not link.is_symlink()
    assert json.loads((dest / "reason.json").read_text())["reason"] == why
    assert tree_state(outside) == before  # nothing outside the cache moved or written
    assert DiskTier(cache, read_only=True).get(key) is None  # a miss: warmup rebuilds it


def test_verify_reports_a_linked_entry_as_corrupt_without_a_traceback(
    tmp_path, tiny_config, tiny_model
):
    cache = tmp_path / "c"
    entries = fill_plan(cache, tiny_config)
    variant, key = entries[0]
    f = entry_file(cache, key)
    f.unlink()
    f.symlink_to(f.name)  # "Too many levels of symbolic links" if ever opened following it
    proc = run_cli("verify", *tiny_args(tiny_model), "--cache-dir", cache, "--json")
    no_traceback(proc)
    report = json.loads(proc.stdout)
    assert not report["ok"] and report["repair"].startswith("kernel-cache warmup")
    linked = [c for c in report["corrupt"] if c["variant"] == variant]
    assert len(linked) == 1 and str(f) in linked[0]["reason"]
    assert "symbolic link" in linked[0]["reason"]


ENGINE = r"""
import sys
from kernel_cache import load_plan, make_config
from kernel_cache.errors import CorruptEntryError
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))
try:
    load_plan(cfg, sys.argv[2])
except CorruptEntryError as e:
    print(e)
"""


def test_engine_start_names_the_linked_entry_and_the_repair(tmp_path, tiny_config, tiny_model):
    import subprocess
    import sys

    from ..conftest import ROOT

    cache = tmp_path / "c"
    variant, key = fill_plan(cache, tiny_config)[0]
    f = entry_file(cache, key)
    f.unlink()
    f.symlink_to(f.name)
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, str(tiny_model), str(cache)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert str(f) in proc.stdout and "symbolic link" in proc.stdout
    assert f"(variant {variant})" in proc.stdout and "kernel-cache warmup" in proc.stdout


@pytest.mark.compile
def test_warmup_quarantines_a_linked_entry_and_rebuilds_it(plain_cache_copy, tmp_path, tiny_model):
    tier = DiskTier(plain_cache_copy, read_only=True)
    key = next(iter(tier.iter_meta()))["key"]
    f = tier.artifact_path(key)
    outside = other_dir(tmp_path)
    shutil.copy(f, outside / "copy.val")  # the right bytes, behind a link
    f.unlink()
    f.symlink_to(outside / "copy.val")
    before = tree_state(outside)
    proc = run_cli("warmup", *plain_args(tiny_model), "--cache-dir", plain_cache_copy, "--json")
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["compiled"] == 1 and report["cached"] == N_TINY - 1
    (q,) = report["quarantined"]
    assert "symbolic link" in q["reason"] and (Path(q["path"]) / "artifact.pt2").is_symlink()
    assert tree_state(outside) == before
    proc = run_cli("verify", *plain_args(tiny_model), "--cache-dir", plain_cache_copy, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"], proc.stderr


# -- locks/, quarantine/, cache.db ---------------------------------------------------


@pytest.mark.parametrize("name", ["locks", "quarantine"])
def test_warmup_refuses_a_linked_locks_or_quarantine_folder(tmp_path, tiny_model, name):
    cache = tmp_path / "c"
    cache.mkdir()
    outside = other_dir(tmp_path)
    (cache / name).symlink_to(outside)
    before = tree_state(outside)
    proc = run_cli("warmup", *tiny_args(tiny_model), "--cache-dir", cache)
    no_traceback(proc)
    assert proc.returncode == 2
    msg = proc.stderr
    assert f"{cache / name}: it is a symbolic link (to {outside})" in msg
    assert f"fix: rm {cache / name}" in msg
    assert tree_state(outside) == before  # no lock, owner or quarantine file written there


def test_key_lock_and_quarantine_never_write_through_a_link(tmp_path, tiny_config):
    cache = tmp_path / "c"
    (variant, key), *_ = fill_plan(cache, tiny_config)
    outside = other_dir(tmp_path)
    before = tree_state(outside)
    # a lock file that is a link to another file: never opened (O_TRUNC would empty it)
    (cache / "locks").mkdir()
    (cache / "locks" / f"{key}.lock").symlink_to(outside / "precious")
    with pytest.raises(UntrustedCacheError, match="refusing lock path .* symbolic link"):
        KeyLock(cache, key).acquire(0)
    # locks/ itself a link
    shutil.rmtree(cache / "locks")
    (cache / "locks").symlink_to(outside)
    with pytest.raises(UntrustedCacheError, match="refusing lock folder .* symbolic link"):
        KeyLock(cache, key).acquire(0)
    # quarantine/ a link: refused before anything is moved
    (cache / "quarantine").symlink_to(outside)
    tier = DiskTier(cache, allow_shared=True)  # the opt-out does not allow links
    with pytest.raises(UntrustedCacheError, match="refusing quarantine folder .* symbolic link"):
        quarantine_entry(tier, key, "test", variant)
    tier.close()
    assert tree_state(outside) == before


def test_linked_index_is_refused_as_a_link_not_for_its_mode(tmp_path, tiny_config, tiny_model):
    cache = tmp_path / "c"
    fill_plan(cache, tiny_config)
    real = tmp_path / "elsewhere.db"
    shutil.move(cache / "cache.db", real)
    (cache / "cache.db").symlink_to(real)
    for cmd in (["verify", *tiny_args(tiny_model)], ["ls"], ["warmup", *tiny_args(tiny_model)]):
        proc = run_cli(*cmd, "--cache-dir", cache)
        no_traceback(proc)
        assert proc.returncode == 2, (cmd, proc.stderr)
        msg = proc.stderr
        assert (
            f"refusing cache index {cache / 'cache.db'}: it is a symbolic link (to {real})" in msg
        )
        assert f"cp --remove-destination {real} {cache / 'cache.db'}" in msg
        assert "0777" not in msg and "go-w" not in msg
    # the suggested fix works: the cache is whole again
    os.unlink(cache / "cache.db")
    shutil.copy(real, cache / "cache.db")
    assert len(list(DiskTier(cache, read_only=True).iter_meta())) == N_TINY


@pytest.mark.parametrize("name", ["usage.json", "usage.json.lock"])
def test_usage_record_never_written_through_a_link(tmp_path, tiny_config, name):
    import kernel_cache.store.usage as usage

    cache = tmp_path / "c"
    (_, key), *_ = fill_plan(cache, tiny_config)
    outside = other_dir(tmp_path)
    (cache / name).symlink_to(outside / "precious")
    before = tree_state(outside)
    assert usage.record(cache, hits=[key]) is False  # filelock would truncate the target
    proc = run_cli("stats", "--cache-dir", cache)
    no_traceback(proc)
    assert proc.returncode == 2
    assert f"refusing usage record{' lock' if name.endswith('lock') else ''} {cache / name}" in (
        proc.stderr
    )
    assert f"fix: rm {cache / name}" in proc.stderr
    assert tree_state(outside) == before


def test_publish_never_writes_through_a_linked_value_folder(tmp_path):
    cache = tmp_path / "c"
    tier = DiskTier(cache)
    tier.cache  # noqa: B018 - create it
    outside = other_dir(tmp_path)
    for i in range(256):  # every xx folder a value file can land in is a link
        (cache / f"{i:02x}").symlink_to(outside)
    before = tree_state(outside)
    key = "cd" * 32

    class K:
        hexdigest = key

        def as_dict(self):
            return {}

    with pytest.raises(UntrustedCacheError, match=r"refusing cache entry folder .* symbolic link"):
        tier.put(key, DATA, make_meta(K(), "v", DATA, 0.0))
    tier.close()
    assert tree_state(outside) == before
    assert DiskTier(cache, read_only=True).get(key) is None  # nothing half-published
