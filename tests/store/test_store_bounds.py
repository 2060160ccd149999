"""A shared store a hostile or careless writer cannot turn against the fleet:
planted leases cost at most about one TTL, every read is bounded before its
body, store text is escaped, and a record's traced paths are checked before
anything they name is read. Against a real SeaweedFS and redis-server."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from importlib.metadata import version

import pytest

from kernel_cache.errors import CorruptEntryError, shown
from kernel_cache.plan.traced import MAX_PATH_CHARS, MAX_TRACED_FILES, Manifest
from kernel_cache.store.entry import META_MAX_BYTES, make_meta
from kernel_cache.store.redis import RedisSettings, RedisTier
from kernel_cache.store.remote_base import (
    ACQUIRED,
    BUSY,
    LEASE_MAX_BYTES,
    LEASE_SLACK_S,
    lease_is_live,
)
from kernel_cache.store.s3 import S3Settings, S3Tier, manifest_limit, manifest_name, pack

from ..conftest import ROOT
from . import test_redis_tier, test_s3_tier

s3_server = test_s3_tier.s3_server
s3 = test_s3_tier.s3
redis_url = test_redis_tier.redis_url
redis_db = test_redis_tier.redis_db

pytestmark = pytest.mark.usefixtures("shared_servers")

#: a holder text that, logged raw, would forge a line and recolour a terminal
FORGED = "h:1:x\n2026-01-01 ERROR kernel_cache: \x1b[32msignature OK\x1b[0m"
TTL = 2.0


def _key(i: int = 0) -> str:
    return f"{i:064x}"


# -- the pure rules ------------------------------------------------------------------


def test_shown_escapes_newlines_and_ansi_and_bounds_the_length():
    out = shown(FORGED)
    assert "\n" not in out and "\x1b" not in out
    assert "\\n" in out and "\\x1b" in out
    long = shown("x" * 10_000)
    assert len(long) < 500 and "10000 characters" in long


@pytest.mark.parametrize(
    "expires, live",
    [(1e18, False), (math.nan, False), (math.inf, False), (-math.inf, False),
     ("soon", False), (True, False), (0.0, False), ("now+ttl", True), ("now+ttl+slack+1", False)],
)  # fmt: skip
def test_a_lease_is_live_only_with_a_finite_expiry_within_the_ttl(expires, live):
    now = 1_000_000.0
    if expires == "now+ttl":
        expires = now + TTL
    elif expires == "now+ttl+slack+1":
        expires = now + TTL + LEASE_SLACK_S + 1
    assert lease_is_live(expires, TTL, now) is live


def test_filelock_is_pinned_to_a_version_that_does_not_follow_links():
    from packaging.requirements import Requirement
    from packaging.version import Version

    text = (ROOT / "pyproject.toml").read_text()
    line = next(ln for ln in text.splitlines() if '"filelock' in ln)
    req = Requirement(line.strip().strip(",").strip('"'))
    assert Version("3.20.0") not in req.specifier and Version("3.20.1") in req.specifier
    assert Version(version("filelock")) in req.specifier  # the venv's installed one


# -- S3 leases -----------------------------------------------------------------------


def _plant(tier: S3Tier, key: str, body: bytes) -> None:
    import obstore

    obstore.put(tier.store, f"leases/{key}", body)


@pytest.mark.parametrize(
    "body",
    [
        json.dumps({"holder": FORGED, "expires_at": 1e18}).encode(),
        b'{"holder": "x", "expires_at": NaN}',
        b'{"holder": "x", "expires_at": Infinity}',
        b"not a lease at all",
        json.dumps({"holder": "x" * (LEASE_MAX_BYTES + 10), "expires_at": 1e18}).encode(),
    ],
    ids=["far-future", "nan", "infinite", "garbage", "oversized"],
)
def test_a_planted_s3_lease_is_taken_over_at_once_and_logged_once_escaped(s3, body, caplog):
    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=15, lock_ttl_s=TTL, lock_wait_s=900))
    _plant(tier, _key(), body)
    lease = tier.build_lock(_key())
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        assert lease.acquire() == ACQUIRED
    assert time.monotonic() - t0 < TTL  # not the 900 s wait
    lease.release()
    lines = [r.getMessage() for r in caplog.records if "names no live holder" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "\n" not in lines[0] and "\x1b" not in lines[0]
    tier.close()


def test_a_live_s3_lease_within_the_ttl_still_holds_and_is_read_bounded(s3):
    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=15, lock_ttl_s=TTL, lock_wait_s=900))
    holder = "h" * (LEASE_MAX_BYTES - 64)  # just under the limit: a lease
    doc = {"holder": holder, "expires_at": time.time() + TTL}
    _plant(tier, _key(1), json.dumps(doc).encode())
    assert tier.build_lock(_key(1)).acquire(wait=False) == BUSY
    tier.close()


def test_a_planted_lease_costs_a_waiting_builder_at_most_about_one_ttl(s3):
    """A lease just within the rule (expiry now + TTL + slack) is honoured, so
    the longest a planted lease can stall a builder is TTL + slack, not
    ``lock_wait_s``."""
    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=15, lock_ttl_s=TTL, lock_wait_s=900))
    doc = {"holder": "planted", "expires_at": time.time() + TTL + LEASE_SLACK_S - 0.5}
    _plant(tier, _key(2), json.dumps(doc).encode())
    t0 = time.monotonic()
    assert tier.build_lock(_key(2)).acquire() == ACQUIRED
    assert time.monotonic() - t0 < TTL + LEASE_SLACK_S + 2
    tier.close()


# -- Redis locks and values ----------------------------------------------------------


def _redis(url: str, **kw) -> RedisTier:
    return RedisTier(RedisSettings(url=url, timeout_s=5, lock_ttl_s=TTL, lock_wait_s=900, **kw))


@pytest.mark.parametrize("plant", ["no-expiry", "far-future", "a-hash", "oversized"])
def test_a_planted_redis_lock_is_taken_over_at_once(redis_db, plant, caplog):
    tier = _redis(redis_db)
    c, name = tier.client, tier._name("lock", _key())
    if plant == "no-expiry":
        c.set(name, FORGED)
    elif plant == "far-future":
        c.set(name, FORGED, px=10**15)
    elif plant == "a-hash":
        c.hset(name, "x", "y")
    else:
        c.set(name, b"x" * (LEASE_MAX_BYTES + 1), px=int(TTL * 1000))
    lock = tier.build_lock(_key())
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        assert lock.acquire() == ACQUIRED
    assert time.monotonic() - t0 < TTL
    assert c.get(name) == lock.token.encode() and 0 < c.pttl(name) <= TTL * 1000
    time.sleep(TTL / 3 + 0.3)  # renewed as ours
    assert c.get(name) == lock.token.encode() and not lock.lost
    lock.release()
    assert c.get(name) is None
    lines = [r.getMessage() for r in caplog.records if "names no live holder" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "\x1b" not in lines[0], lines
    tier.close()


def test_a_live_redis_lock_still_holds(redis_db):
    tier = _redis(redis_db)
    tier.client.set(tier._name("lock", _key()), "other:1:x", px=int(TTL * 1000))
    assert tier.build_lock(_key()).acquire(wait=False) == BUSY
    tier.close()


def _redis_entry(tier: RedisTier, key: str, meta: bytes, data: bytes) -> None:
    tier.client.hset(tier._name("entry", key), mapping={"meta": meta, "data": data})


def _tiny_key(cfg):
    from kernel_cache.plan.buckets import Bucketer
    from kernel_cache.plan.keys import build_key

    variant = Bucketer(cfg).variants[0]
    return variant, build_key(cfg, variant)


def test_redis_values_over_their_limits_are_refused_from_their_length(redis_db, tiny_config):
    tier = _redis(redis_db, max_object_bytes=4096)
    variant, key = _tiny_key(tiny_config)
    meta = make_meta(key, str(variant), b"x" * 4096, 1.0)
    raw = json.dumps(meta).encode()
    _redis_entry(tier, meta["key"], raw, b"x" * 4096)  # just at the limit: read
    assert tier.get(meta["key"]).data == b"x" * 4096
    _redis_entry(tier, meta["key"], raw, b"x" * 4097)
    with pytest.raises(CorruptEntryError, match=r"4097 bytes, over the limit of 4096"):
        tier.get(meta["key"])
    big = b" " * (META_MAX_BYTES + 1)
    _redis_entry(tier, _key(7), big, b"")
    with pytest.raises(CorruptEntryError, match="metadata is .* over the limit"):
        tier.get_meta(_key(7))
    assert [m["key"] for m in tier.iter_meta()] == [meta["key"]]  # the big record skipped
    tier.close()


# -- S3 bounds -----------------------------------------------------------------------


def test_an_s3_header_claiming_a_huge_record_is_refused_unread(s3):
    import obstore

    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=15))
    claim = pack(b"", b"{}")[:4] + (1 << 40).to_bytes(8, "big") + b"{" * 100
    obstore.put(tier.store, f"entries/{_key(3)}", claim)
    with pytest.raises(CorruptEntryError, match=r"claims a 1099511627776-byte record"):
        tier.get_meta(_key(3))
    just = pack(b"", b" " * (META_MAX_BYTES - 2) + b"{}")  # at the limit: read, not JSON
    obstore.put(tier.store, f"entries/{_key(4)}", just)
    with pytest.raises(CorruptEntryError, match="metadata"):
        tier.get_meta(_key(4))
    tier.close()


def test_a_manifest_larger_than_the_plan_needs_is_refused_from_its_size(s3, caplog):
    import obstore

    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=15))
    keys = [_key(i) for i in range(6)]
    body = json.dumps({"format": "kc-s3-manifest-1", "keys": keys, "created": 1.0,
                       "pad": "x" * manifest_limit(6)}).encode()  # fmt: skip
    obstore.put(tier.store, manifest_name(keys), body)
    tier.expect(keys)
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        assert tier.get(keys[0]) is None
    assert any(f"over the limit of {manifest_limit(6)}" in r.getMessage() for r in caplog.records)
    tier.close()


# -- paths from a record -------------------------------------------------------------


@pytest.mark.parametrize("path", ["/etc/passwd", "../../x", "a/../../x", "a//b", "a\x1b.py"])
def test_a_traced_path_outside_the_roots_is_refused(path):
    with pytest.raises(ValueError, match="path"):
        Manifest(files={path: "0" * 64})


def test_traced_manifests_are_bounded_in_count_and_path_length():
    Manifest(files={f"m{i}.py": "0" * 64 for i in range(MAX_TRACED_FILES)})
    with pytest.raises(ValueError):
        Manifest(files={f"m{i}.py": "0" * 64 for i in range(MAX_TRACED_FILES + 1)})
    with pytest.raises(ValueError):
        Manifest(files={"a" * (MAX_PATH_CHARS + 1): "0" * 64})
    longest = Manifest(
        files={f"{i:05d}" + "p" * (MAX_PATH_CHARS - 5): "0" * 64 for i in range(MAX_TRACED_FILES)},
        dists={f"{i:05d}" + "d" * 123: "v" * 128 for i in range(1024)},
    )
    assert len(json.dumps(longest.record())) < META_MAX_BYTES  # a record of it still fits


@pytest.mark.parametrize("path", ["../secret", "SECRET_ABS"])
def test_a_record_naming_a_file_outside_the_roots_is_corrupt_and_nothing_it_names_is_read(
    redis_db, tiny_config, tmp_path, monkeypatch, path
):
    """A shared entry whose traced record names ``../secret`` or the absolute
    path of a file that exists (``../secret`` reached from a ``sys.path``
    entry) is refused as corrupt at lookup, a miss, and the file is not
    opened: its access time, set before its modification time so that any
    read updates it, stays as it was."""
    import sys

    from kernel_cache.store.lookup import Lookup

    root = tmp_path / "root" / "pkg"
    root.mkdir(parents=True)
    secret = tmp_path / "root" / "secret"
    secret.write_text("token")
    os.utime(secret, (1_000_000, time.time()))
    probe = tmp_path / "probe"  # does this filesystem record reads at all?
    probe.write_text("x")
    os.utime(probe, (1_000_000, time.time()))
    probe.read_text()
    if probe.stat().st_atime == 1_000_000:
        pytest.skip("this filesystem does not update access times (noatime)")
    monkeypatch.setattr(sys, "path", [str(root), *sys.path])
    path = str(secret) if path == "SECRET_ABS" else path
    tier = _redis(redis_db)
    variant, key = _tiny_key(tiny_config)
    meta = make_meta(key, str(variant), b"code", 1.0)
    meta["traced"] = {"files": {path: "0" * 64}, "dists": {}}  # past the model, as a writer can
    _redis_entry(tier, key.hexdigest, json.dumps(meta).encode(), b"code")
    lookup = Lookup([tier])
    assert lookup.find(key) is None
    assert len(lookup.rejected) == 1 and "must be relative" in str(lookup.rejected[0])
    assert secret.stat().st_atime == 1_000_000
    tier.close()
