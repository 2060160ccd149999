"""``kernel-cache gc-remote`` against a real SeaweedFS S3 server and a ``file://``
directory: what it removes is read back from the store itself (a listing),
not from the command's report."""

from __future__ import annotations

import json
import os
import time

import obstore
import pytest

from kernel_cache.errors import ConfigError
from kernel_cache.store.remote_gc import parse_age
from kernel_cache.store.s3 import S3Settings, S3Tier

from ..conftest import run_cli
from .test_s3_tier import _env, s3, s3_server  # noqa: F401 - the fixtures

#: the age given to gc-remote on S3: longer than the two commands after the young
#: objects are written take to start (python and obstore imports, a loaded machine)
AGE_S = 12


def _keys(tag: str) -> str:
    import hashlib

    return hashlib.sha256(tag.encode()).hexdigest()


def _listing(tier: S3Tier) -> list[str]:
    return sorted(m["path"] for batch in obstore.list(tier.store, chunk_size=1000) for m in batch)


def test_an_age_reads_as_seconds_and_a_bad_one_names_the_form():
    assert parse_age("30d") == 30 * 86400 and parse_age("90m") == 5400 and parse_age("7s") == 7
    # a bare number (30 meant as days would remove everything over 30 s old) and
    # one too large for a float (inf, written as Infinity in the --json report)
    for bad in ("0", "soon", "-1d", "3y", "30", "9" * 400 + "d"):
        with pytest.raises(ConfigError, match="e.g. 30d"):
            parse_age(bad)


@pytest.mark.slow
def test_gc_remote_on_s3_removes_old_unreferenced_entries_and_keeps_the_rest(s3):  # noqa: F811
    """The server dates its objects: the test waits until they are old enough."""
    url, env = s3["url"], _env(**s3["env"], KERNEL_CACHE_S3_TIMEOUT="15")
    _gc_removes_old_unreferenced_entries(url, env, AGE_S, lambda: time.sleep(AGE_S + 1.2))


def test_gc_remote_on_a_directory_removes_old_unreferenced_entries_and_keeps_the_rest(tmp_path):
    """A file's date is its mtime: the test dates the old files back two hours
    and gives an age of one hour, so the young ones stay young however slowly
    the commands start."""

    def age_them() -> None:
        old = time.time() - 7200
        for f in tmp_path.rglob("*"):
            if f.is_file():
                os.utime(f, (old, old))

    _gc_removes_old_unreferenced_entries(f"file://{tmp_path}", _env(), 3600, age_them)


def _gc_removes_old_unreferenced_entries(url: str, env: dict, age_s: int, age_them) -> None:
    """Three entries (a, b, c), b's lease and the index objects of a and b, then
    ``age_them()`` makes them older than ``age_s``; then a manifest listing a and
    a young entry d. ``gc-remote --older-than age_s`` removes b, c, b's lease and
    b's index object, and keeps the rest: read back from the store."""
    tier = S3Tier(S3Settings(url=url, timeout_s=15), fail_open=False)
    a, b, c, d = (_keys(t) for t in "abcd")
    for k in (a, b, c):
        obstore.put(tier.store, f"entries/{k}", b"x" * 1000, mode="create")
    obstore.put(tier.store, f"leases/{b}", b'{"expires_at": 0}')
    for k in (a, b):  # the index objects a publish writes beside each entry
        obstore.put(tier.store, f"index/runtime/{_keys('r')}/{k}", b"")
    age_them()  # a, b, c and the lease are now older than age_s
    assert tier.publish_manifest([a]).ok  # a recent plan lists a
    obstore.put(tier.store, f"entries/{d}", b"y" * 10, mode="create")  # young

    age = ("--remote-url", url, "--older-than", f"{age_s}s")
    dry = run_cli("gc-remote", *age, "--dry-run", "--json", env=env)
    assert dry.returncode == 0, dry.stderr
    doomed = [f"entries/{b}", f"entries/{c}", f"leases/{b}", f"index/runtime/{_keys('r')}/{b}"]
    assert sorted(r["path"] for r in json.loads(dry.stdout)["removed"]) == sorted(doomed)
    before = _listing(tier)
    assert set(doomed) <= set(before)  # a dry run removes nothing

    done = run_cli("gc-remote", *age, env=env)
    assert done.returncode == 0, done.stderr
    assert "removed 4 objects" in done.stdout and f"entries/{c}" in done.stdout
    assert _listing(tier) == sorted(set(before) - set(doomed))  # read back from the store
    assert f"entries/{a}" in _listing(tier) and f"entries/{d}" in _listing(tier)
    assert f"index/runtime/{_keys('r')}/{a}" in _listing(tier)  # its entry is kept


def test_a_warmup_of_a_plan_renews_its_old_manifest(tmp_path, monkeypatch):
    """A manifest older than MANIFEST_RENEW_S is written again by the next
    publish of its plan (its file's mtime, read from the disk), so gc-remote
    keeps a plan that is still warmed."""
    from kernel_cache.store import s3_manifest
    from kernel_cache.store.s3_objects import manifest_name

    tier = S3Tier(S3Settings(url=f"file://{tmp_path}"), fail_open=False)
    key = _keys("a")
    obstore.put(tier.store, f"entries/{key}", b"x", mode="create")
    assert tier.publish_manifest([key]).ok
    path = tmp_path / manifest_name([key])
    os.utime(path, (time.time() - 7200, time.time() - 7200))  # written two hours ago
    assert tier.publish_manifest([key]).ok
    assert time.time() - path.stat().st_mtime > 7000  # younger than a day: left alone
    monkeypatch.setattr(s3_manifest, "MANIFEST_RENEW_S", 3600.0)  # where the tier reads it
    assert tier.publish_manifest([key]).ok
    assert time.time() - path.stat().st_mtime < 60  # renewed
    assert json.loads(path.read_text())["keys"] == [key]


def test_gc_remote_without_a_store_or_age_says_what_it_needs(tmp_path):
    proc = run_cli("gc-remote", "--older-than", "30d", env=_env())
    assert proc.returncode != 0 and "--remote-url" in proc.stderr
    proc = run_cli("gc-remote", "--remote-url", f"file://{tmp_path}", "--older-than", "old",
                   env=_env())  # fmt: skip
    assert proc.returncode != 0 and "--older-than 'old'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_gc_remote_never_deletes_through_a_link_planted_in_a_shared_directory(tmp_path):
    """A writer of a ``file://`` directory plants links (a folder of entries, the
    leases folder, an entry) to files outside the store, all older than the age:
    gc-remote removes the old links themselves and no file outside the store
    (each read back from the disk)."""
    store, outside = tmp_path / "store", tmp_path / "outside"
    old = time.time() - 400 * 86400
    victims = []
    for name in ("a", "b", "c"):
        (outside / name).mkdir(parents=True)
        victim = outside / name / "precious"
        victim.write_text(name)
        os.utime(victim, (old, old))
        victims.append(victim)
    (store / "entries").mkdir(parents=True)
    links = [store / "entries" / "folder", store / "leases", store / "entries" / _keys("e")]
    links[0].symlink_to(outside / "a")  # a folder of entries
    links[1].symlink_to(outside / "b")  # the leases folder
    links[2].symlink_to(victims[2])  # an entry
    for link in links:
        os.utime(link, (old, old), follow_symlinks=False)

    proc = run_cli("gc-remote", "--remote-url", f"file://{store}", "--older-than", "30d",
                   env=_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [v.read_text() for v in victims] == ["a", "b", "c"]  # nothing outside the store
    assert not any(os.path.lexists(link) for link in links)  # the old links are removed


@pytest.mark.parametrize("where", ["s3", "file"])
def test_gc_remote_past_the_listing_bound_stops_and_removes_nothing(where, request, tmp_path):
    """A writer fills ``entries/`` with 12 old objects and gc-remote's bound
    (``KERNEL_CACHE_REMOTE_LIST_MAX``) is 5: it stops with an error naming the
    store, the prefix, the bound and the fix, and the store is as it was (read
    back). On S3 the server's own counter shows the listing stopped at its
    first page (one LIST of ``manifests/``, one of ``entries/``). With a bound
    above the count the same store is collected."""
    from .test_store_bounds import _settled

    if where == "s3":
        s3 = request.getfixturevalue("s3")
        url, env = s3["url"], _env(**s3["env"], KERNEL_CACHE_S3_TIMEOUT="15")
    else:
        s3, url, env = None, f"file://{tmp_path}", _env()
    tier = S3Tier(S3Settings(url=url, timeout_s=15), fail_open=False)
    for i in range(12):
        obstore.put(tier.store, f"entries/{_keys(str(i))}", b"x", mode="create")
    if where == "file":
        old = time.time() - 7200
        for f in tmp_path.rglob("*"):
            os.utime(f, (old, old))
    before = _listing(tier)
    count = _settled(s3["metrics"]) if s3 and s3["metrics"] else None
    proc = run_cli("gc-remote", "--remote-url", url, "--older-than", "1h",
                   env={**env, "KERNEL_CACHE_REMOTE_LIST_MAX": "5"})  # fmt: skip
    if count is not None:  # settled: the server counts a request after answering it
        assert _settled(s3["metrics"]) - count <= 2
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    msg = proc.stderr
    assert "more than 5 names under entries/" in msg and "KERNEL_CACHE_REMOTE_LIST_MAX=5" in msg
    assert "gc-remote removed nothing" in msg and "the store's own tools" in msg
    assert _listing(tier) == before
    proc = run_cli("gc-remote", "--remote-url", url, "--older-than", "1h", "--dry-run", "--json",
                   env={**env, "KERNEL_CACHE_REMOTE_LIST_MAX": "12"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    expected = 12 if where == "file" else 0  # the server's objects are young
    assert len(json.loads(proc.stdout)["removed"]) == expected


def test_gc_remote_leaves_names_the_store_cannot_address_and_removes_the_rest(tmp_path):
    """Old files under ``leases/`` whose names the object store cannot name (a
    control character; bytes that are not UTF-8; a file in a folder so named)
    beside an old lease: gc-remote removes the lease and leaves the rest, with
    no error, in the dry run and the run alike (read back from the disk)."""
    leases = tmp_path / "leases"
    leases.mkdir()
    odd = [b"c\x01tl", b"bad\xffname", b"dir\xff"]
    os.mkdir(os.path.join(os.fsencode(leases), odd[2]))  # a folder so named, a file in it
    for name in [*odd[:2], b"dir\xff/" + b"1" * 64, b"0" * 64]:
        path = os.path.join(os.fsencode(leases), name)
        with open(path, "wb") as f:
            f.write(b"{}")
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    age = ("--remote-url", f"file://{tmp_path}", "--older-than", "1h")
    dry = run_cli("gc-remote", *age, "--dry-run", "--json", env=_env())
    assert dry.returncode == 0, dry.stderr
    assert [r["path"] for r in json.loads(dry.stdout)["removed"]] == [f"leases/{'0' * 64}"]
    done = run_cli("gc-remote", *age, "--json", env=_env())
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert sorted(os.listdir(os.fsencode(leases))) == sorted(odd)
    assert os.listdir(os.path.join(os.fsencode(leases), odd[2])) == [b"1" * 64]
