"""A shared store a hostile or careless writer cannot turn against the fleet:
planted leases cost at most about one TTL, every read is bounded before its
body, store text is escaped, and a record's traced paths are checked before
anything they name is read. Against a real SeaweedFS and redis-server."""

from __future__ import annotations

import hashlib
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
from kernel_cache.store.s3 import S3Settings, S3Tier
from kernel_cache.store.s3_objects import manifest_limit, manifest_name, pack

from ..conftest import ROOT
from ..kc_helpers import knowing_cxx
from . import test_redis_tier, test_s3_tier

s3_server = test_s3_tier.s3_server
s3 = test_s3_tier.s3
redis_url = test_redis_tier.redis_url
redis_db = test_redis_tier.redis_db
private_redis = test_redis_tier.private_redis
fleet_keys = test_redis_tier.fleet_keys


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


@pytest.fixture
def unsigned(monkeypatch):
    """The explicit opt-out of signatures (no key set): what a store's writer can
    put past every check but the signature, which these tests are about."""
    for k in ("KERNEL_CACHE_TRUSTED_KEYS", "KERNEL_CACHE_SIGNING_KEY_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED", "1")


@pytest.mark.parametrize("path", ["../secret", "SECRET_ABS"])
def test_a_record_naming_a_file_outside_the_roots_is_corrupt_and_nothing_it_names_is_read(
    redis_db, tiny_config, tmp_path, monkeypatch, path, unsigned
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
    result = lookup.search(key)
    assert result.found is None and result.failed is None
    assert len(result.rejected) == 1 and "must be relative" in str(result.rejected[0].error)
    assert secret.stat().st_atime == 1_000_000
    tier.close()


# -- requests and memory that do not grow with what a writer put there ----------------


def _put_many(tier: S3Tier, paths: list[str], body: bytes, concurrency: int = 64) -> None:
    """PUT ``body`` at every path, ``concurrency`` at a time (obstore's async API)."""
    import asyncio

    import obstore

    async def run():
        gate = asyncio.Semaphore(concurrency)

        async def one(path):
            async with gate:
                await obstore.put_async(tier.store, path, body)

        await asyncio.gather(*(one(p) for p in paths))

    asyncio.run(run())


def _plan(cfg):
    from kernel_cache.plan.buckets import Bucketer
    from kernel_cache.plan.keys import build_key

    return [(v, build_key(cfg, v)) for v in Bucketer(cfg).variants]


@pytest.mark.slow
def test_requests_do_not_grow_with_unrelated_entries(s3, tiny_model, tiny_config, tmp_path):
    """10,000 unrelated objects under ``entries/``: an engine start that misses
    the whole plan makes as many requests as with an empty bucket, and
    ``explain`` of a plan that hits lists nothing (the server's own request
    counter)."""
    from warmup.check.explain import explain

    from .test_s3_hostile import _engine
    from .test_s3_tier import _env

    if not s3["metrics"]:
        pytest.skip("the shared S3 server gives no metrics URL")
    control_url = s3["url"] + "-control"
    env = _env(KERNEL_CACHE_S3_URL=control_url)
    before = _settled(s3["metrics"])
    proc = _engine(tiny_model, tmp_path / "c0", env)
    control = _settled(s3["metrics"]) - before
    assert proc.stdout.split()[0] == "missing", proc.stderr[-2000:]

    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=30))
    _put_many(tier, [f"entries/{i:064x}" for i in range(10_000)], b"x")
    before = _settled(s3["metrics"])
    proc = _engine(tiny_model, tmp_path / "c1", _env(KERNEL_CACHE_S3_URL=s3["url"]))
    grown = _settled(s3["metrics"]) - before
    assert proc.stdout.split()[0] == "missing", proc.stderr[-2000:]
    assert grown == control, (grown, control)

    plan = _plan(tiny_config)
    for variant, key in plan:  # entries that verify (explain loads no code)
        data = key.hexdigest.encode()
        assert tier.put(key.hexdigest, data, make_meta(key, str(variant), data, 1.0)).ok
    before = _settled(s3["metrics"])
    report = explain(tiny_config, [tier])
    sent = _settled(s3["metrics"]) - before
    assert report["hits"] == len(plan) and report["misses"] == 0
    assert sent <= len(plan), sent  # one GET per key, no listing
    tier.close()


#: A plan of more keys than the tiny one's, for the memory test: engine start of
#: it (model argv[1], cache argv[2]) prints "missing N", then its VmHWM (KiB).
WIDE = dict(max_model_len=128, block_size=16, max_num_seqs=8, max_num_batched_tokens=128)
WIDE_ENGINE = f"""
import sys
from kernel_cache import load_plan, make_config
from kernel_cache.errors import MissingVariantsError
cfg = make_config(sys.argv[1], **{WIDE!r})
try:
    load_plan(cfg, sys.argv[2])
except MissingVariantsError as e:
    print("missing", len(e.missing))
print(next(ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM:')))
"""


def _peak(model, cache, env) -> float:
    """Peak resident size (MiB) of an engine start of :data:`WIDE` in a child."""
    from .test_s3_hostile import _engine

    proc = _engine(model, cache, env, WIDE_ENGINE)
    assert proc.stdout.split()[0] == "missing", proc.stderr[-2000:]
    return int(proc.stdout.split()[-1]) / 1024


@pytest.mark.slow
def test_a_manifest_of_oversized_entries_does_not_fill_an_engine(s3, tiny_model, tmp_path):
    """Every key of the plan holds an object of ``size`` MiB (under the
    per-object limit, its record accounting for it, its sha256 wrong: read
    whole before it fails) and the bucket holds the plan's manifest: the
    engine fetches them ``PREFETCH`` ahead, never the whole plan at once, so
    its peak (``VmHWM`` from /proc) grows by a few objects' size, not by the
    plan's count of them."""
    import obstore

    from kernel_cache import make_config
    from kernel_cache.store.s3_objects import PREFETCH

    from .test_s3_tier import _env

    size = 32
    plan = _plan(make_config(str(tiny_model), **WIDE))
    assert len(plan) >= 4 * (PREFETCH + 1), len(plan)
    env = _env(KERNEL_CACHE_S3_URL=s3["url"])
    base = _peak(tiny_model, knowing_cxx(tmp_path / "c0"), env)
    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=30))
    keys = [k.hexdigest for _, k in plan]
    data = b"\0" * (size << 20)
    for variant, key in plan:  # records that account for the bytes; a wrong sha256
        meta = {**make_meta(key, str(variant), b"", 1.0), "size": len(data), "sha256": "0" * 64}
        obstore.put(tier.store, f"entries/{key.hexdigest}", pack(data, json.dumps(meta).encode()))
    body = {"format": "kc-s3-manifest-1", "keys": sorted(keys), "created": time.time()}
    obstore.put(tier.store, manifest_name(keys), json.dumps(body).encode())
    peak = _peak(tiny_model, knowing_cxx(tmp_path / "c1"), env)
    # (PREFETCH + 1) objects at a time, each briefly twice (the client's buffer and
    # Python's bytes); the whole plan at once would be len(plan) times size
    assert peak - base < 2 * (PREFETCH + 1) * size < len(plan) * size, (peak, base, len(plan))
    tier.close()


@pytest.mark.slow
def test_with_keys_an_unsigned_planted_entry_is_refused_from_its_record_alone(
    s3, tiny_model, tmp_path
):
    """The default posture, trusted keys set: the plan's first keys (more than
    the fetches ahead hold) hold an unsigned object of ``size`` MiB whose record
    accounts for it, and the manifest lists the plan. The engine refuses each from its record (the
    signature) before the rest of the object arrives or a buffer for it is
    made: its peak (``VmHWM``) stays within one object of an empty bucket's,
    and the miss says the entries were refused."""
    import obstore

    from kernel_cache import make_config
    from kernel_cache.store.s3_objects import PREFETCH

    from ..signing_keys import make_keypair
    from .test_s3_tier import _env

    size = 16
    plan = _plan(make_config(str(tiny_model), **WIDE))
    planted = plan[: PREFETCH + 2]  # more than the fetches ahead hold at once; the store
    # the suite shares is small (SeaweedFS volumes of 64 MiB), so not every key
    keys = make_keypair(tmp_path / "keys")
    env = _env(
        KERNEL_CACHE_S3_URL=s3["url"],
        KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED="",
        **keys.engine_env,
    )
    base = _peak(tiny_model, knowing_cxx(tmp_path / "c0"), env)
    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=30))
    data = b"\0" * (size << 20)
    digest = hashlib.sha256(data).hexdigest()
    for variant, key in planted:  # well-formed, the right sha256, no signature
        meta = {**make_meta(key, str(variant), b"", 1.0), "size": len(data), "sha256": digest}
        obstore.put(tier.store, f"entries/{key.hexdigest}", pack(data, json.dumps(meta).encode()))
    keys_ = [k.hexdigest for _, k in plan]
    body = {"format": "kc-s3-manifest-1", "keys": sorted(keys_), "created": time.time()}
    obstore.put(tier.store, manifest_name(keys_), json.dumps(body).encode())
    from .test_s3_hostile import _engine

    proc = _engine(tiny_model, knowing_cxx(tmp_path / "c1"), env, WIDE_ENGINE)
    assert proc.stdout.split()[:2] == ["missing", str(len(plan))], proc.stderr[-2000:]
    assert "untrusted" in proc.stderr, proc.stderr[-2000:]
    peak = int(proc.stdout.split()[-1]) / 1024
    assert peak - base < size, (peak, base)  # not one object held, let alone the plan's
    for _, key in planted:
        obstore.delete(tier.store, f"entries/{key.hexdigest}")
    tier.close()


@pytest.mark.compile
def test_a_warmup_past_planted_leases_compiles_each_key_once_without_waiting(
    s3, tiny_model, plain_config, tmp_path
):
    """Every key of the tiny plan holds a planted lease (far-future with a
    forged holder, NaN, oversized) and the lease wait is 900 s: a cold warmup
    takes each over at once (its report's ``lock_wait_s`` per key under one
    TTL), compiles each key once (the compiler hook's log) and logs each
    takeover once, escaped (no forged line reaches stderr)."""
    import subprocess
    import sys

    from ..conftest import plain_args
    from .test_s3_tier import _env

    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=15))
    plan = _plan(plain_config)
    bodies = [
        json.dumps({"holder": FORGED, "expires_at": 1e18}).encode(),
        b'{"holder": "x", "expires_at": NaN}',
        b"x" * (LEASE_MAX_BYTES + 1),
    ]
    for i, (_, key) in enumerate(plan):
        _plant(tier, key.hexdigest, bodies[i % len(bodies)])
    log = tmp_path / "compiles.log"
    env = _env(KERNEL_CACHE_TEST_COMPILE_LOG=str(log), KERNEL_CACHE_S3_LOCK_TTL=str(TTL),
               KERNEL_CACHE_S3_LOCK_WAIT="900")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "warmup.cli.main", "warmup", *plain_args(tiny_model),
         "--cache-dir", str(tmp_path / "b"), "--s3-url", s3["url"], "--jobs", "1", "--json"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    compiled = sorted(line.split(" ", 1)[1] for line in log.read_text().splitlines())
    assert compiled == sorted(str(v) for v, _ in plan), compiled
    assert all(r["lock_wait_s"] < TTL for r in report["results"]), report["results"]
    assert proc.stderr.count("names no live holder") == len(plan), proc.stderr[-3000:]
    assert "\x1b" not in proc.stderr
    assert not any(ln.lstrip().startswith("2026-01-01") for ln in proc.stderr.splitlines())
    tier.close()


def _redis_calls(client) -> dict[str, int]:
    """Commands the Redis server has run since its last ``CONFIG RESETSTAT``,
    by name (``INFO commandstats``: the server's own count)."""
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}


def test_a_redis_miss_does_not_read_unrelated_entries_and_finds_a_compatible_one(
    redis_db, tiny_config, unsigned
):
    """5,000 unrelated entry hashes: a lookup that misses the exact key runs a
    handful of commands, no ``SCAN`` and no read of them (``INFO
    commandstats``); an entry of the same runtime built by another compiler,
    published through the tier, is still found through its index set."""
    from kernel_cache.plan.keys import CacheKey
    from kernel_cache.store.lookup import Lookup

    tier = _redis(redis_db)
    c = tier.client
    p = c.pipeline(transaction=False)
    for i in range(5000):
        p.hset(tier._name("entry", f"{i:064x}"), mapping={"meta": b"{}", "data": b""})
    p.execute()
    variant, key = _tiny_key(tiny_config)
    other = CacheKey(tuple((n, "gcc 99.1.0" if n == "cxx" else v) for n, v in key.components))
    assert other.hexdigest != key.hexdigest and other.runtime_digest == key.runtime_digest
    data = b"code"
    assert tier.put(other.hexdigest, data, make_meta(other, str(variant), data, 1.0)).ok
    c.config_resetstat()
    lookup = Lookup([tier])
    found = lookup.find(key)
    calls = _redis_calls(c)
    assert found is not None and found.entry.key == other.hexdigest
    # an EVAL's own commands (its SRANDMEMBER) are counted by their names too
    assert "scan" not in calls and sum(n for k, n in calls.items() if k != "eval") < 20, calls
    tier.close()


def test_a_stores_error_text_is_shown_whole_but_escaped_and_bounded(caplog):
    """A failure whose text spans lines (a 403's XML body) reaches the one
    warning whole up to the bound, escaped: no line of it starts a log line."""
    tier = S3Tier(S3Settings(url="s3://bucket/p", timeout_s=1))
    body = (
        '403 Forbidden: <?xml version="1.0"?>\n<Error><Code>AccessDenied</Code>\n'
        "<Message>\x1b[32mbucket kc-missing does not exist</Message></Error>"
    )
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        tier.note_failure(PermissionError(body + "x" * 5000))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "\x1b" not in line
    assert "AccessDenied" in line and "does not exist" in line  # past the first line
    assert len(line) < 1000 and "characters)" in line


def test_an_s3_entry_is_refused_from_its_first_bytes_when_its_record_does_not_fit(
    s3, tiny_config, caplog
):
    """An entry object whose header or record does not account for its size
    is refused from its first chunk, naming why; one whose record fits is read."""
    import obstore

    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=15))
    variant, key = _tiny_key(tiny_config)
    k = key.hexdigest
    cases = {
        b"\0" * (8 << 20): "bad magic",
        pack(b"\0" * (8 << 20), b"{}"): "metadata: ",
        pack(b"", b"[" * 200_000): "nested too deep",
        pack(b"", b"{}")[:4] + (1 << 40).to_bytes(8, "big") + b"{}": "1099511627776-byte record",
    }
    data = b"code"
    meta = make_meta(key, str(variant), data, 1.0)
    cases[pack(data + b"\0" * (8 << 20), json.dumps(meta).encode())] = "accounts for"
    for body, why in cases.items():
        obstore.put(tier.store, f"entries/{k}", body)
        with pytest.raises(CorruptEntryError, match=why) as e:
            tier.get(k)
        assert "not read" in str(e.value)
    obstore.put(tier.store, f"entries/{k}", pack(data, json.dumps(meta).encode()))
    assert tier.get(k).data == data
    tier.close()


def test_explain_text_escapes_what_a_stored_record_says(redis_db, tiny_config, unsigned):
    """A shared entry whose record's variant carries a newline and ANSI codes:
    explain names it among the nearest entries of a miss, escaped, and no
    line of its text output is one the record wrote."""
    from kernel_cache.plan.keys import CacheKey
    from warmup.check.explain import explain, render

    tier = _redis(redis_db)
    variant, key = _tiny_key(tiny_config)
    other = CacheKey(tuple((n, "2.0.0" if n == "torch" else v) for n, v in key.components))
    data = b"code"
    meta = make_meta(other, FORGED, data, 1.0)
    _redis_entry(tier, other.hexdigest, json.dumps(meta).encode(), data)
    text = render(explain(tiny_config, [tier]))
    assert "\x1b" not in text and "\\x1b[32msignature OK" in text
    assert not any(line.startswith("2026-01-01") for line in text.splitlines())
    tier.close()


def _bytes_sent_by_lookups_over_a_junk_index(tier: RedisTier, key) -> int:
    """Fill the runtime index set of ``key`` with 64 members of 2 MiB each (no
    entry has such a key), run engine start's two lookups through it (both
    must find nothing) and return the bytes the server sent meanwhile (its own
    ``total_net_output_bytes``)."""
    from kernel_cache.store.lookup import Lookup

    c = tier.client
    index = tier._name("index:runtime", key.runtime_digest)
    for i in range(64):
        c.sadd(index, f"{i:064x}".encode() + b"x" * (2 << 20))
    c.config_resetstat()
    before = c.info("stats")["total_net_output_bytes"]
    lookup = Lookup([tier])
    assert lookup.recorded_build_only(key.runtime_digest) == {}
    assert lookup.find(key) is None
    return c.info("stats")["total_net_output_bytes"] - before


def test_a_redis_index_of_oversized_members_is_read_bounded(redis_db, tiny_config, unsigned):
    """A writer of the shared Redis fills the runtime index set of a variant
    with 64 members of 2 MiB each (no entry has such a key): the read engine
    start makes of it for its ``cxx`` (:meth:`Lookup.recorded_build_only`) and
    the compatible lookup send at most a few KiB back (the server's own
    ``total_net_output_bytes``), never the 128 MiB of members, and find
    nothing."""
    tier = _redis(redis_db)
    sent = _bytes_sent_by_lookups_over_a_junk_index(tier, _tiny_key(tiny_config)[1])
    assert sent < 64 << 10, f"{sent} bytes sent for an index of junk members"
    tier.close()


def test_where_redis_refuses_scripting_an_index_of_oversized_members_is_not_read(
    private_redis, tiny_config, unsigned, caplog
):
    """The same junk index on a Redis whose ACL refuses EVAL (the bounded read is
    a Lua script): no member is read at all (``SRANDMEMBER`` would send the
    128 MiB back), lookups find nothing, and one warning names the fix."""
    from kernel_cache.store.lookup import Lookup

    tier = _redis(private_redis.url)
    c = tier.client
    c.execute_command("ACL", "SETUSER", "default", "-@scripting")
    _, key = _tiny_key(tiny_config)
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        sent = _bytes_sent_by_lookups_over_a_junk_index(tier, key)
    assert sent < 64 << 10, f"{sent} bytes sent for an index of junk members"
    calls = c.info("commandstats")
    assert "cmdstat_srandmember" not in calls and "cmdstat_smembers" not in calls, calls
    warned = [r.getMessage() for r in caplog.records if "refused EVAL" in r.getMessage()]
    assert len(warned) == 1 and "ACL +@scripting" in warned[0], warned
    assert not tier.is_down()
    refused = c.info("commandstats")["cmdstat_eval"]["rejected_calls"]
    assert Lookup([tier]).recorded_build_only(key.runtime_digest) == {}
    assert c.info("commandstats")["cmdstat_eval"]["rejected_calls"] == refused  # not sent again
    tier.close()


@pytest.mark.parametrize("junk", ["not-utf-8", "not-a-set"])
def test_a_redis_index_that_is_junk_finds_nothing_and_fails_no_engine_start(
    redis_db, tiny_config, unsigned, caplog, junk
):
    """A writer's index member that is not text, or an index key that is not a
    set: engine start's lookups find nothing, raise nothing, leave the tier up."""
    from kernel_cache.store.lookup import Lookup

    tier = _redis(redis_db)
    c = tier.client
    _, key = _tiny_key(tiny_config)
    index = tier._name("index:runtime", key.runtime_digest)
    if junk == "not-utf-8":
        c.sadd(index, b"\xff\xfe", b"\x80" * 64)
    else:
        c.set(index, b"a string, not a set")
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        lookup = Lookup([tier])
        assert lookup.recorded_build_only(key.runtime_digest) == {}
        assert lookup.find(key) is None
    assert not tier.is_down() and tier.error is None
    assert not [r for r in caplog.records if "refused EVAL" in r.getMessage()]
    tier.close()


def test_where_redis_refuses_scripting_a_put_reads_no_oversized_bytes_back(
    private_redis, tiny_config, monkeypatch, fleet_keys
):
    """A writer keeps a genuine signed record and puts 64 MiB of junk under it
    on a Redis that refuses EVAL: the next builder's put of the genuine entry
    measures the junk (``HSTRLEN``) instead of downloading it, and replaces it."""
    from kernel_cache.store.disk_tier import PutOutcome
    from kernel_cache.trust.signing import sign_meta

    for var in ("KERNEL_CACHE_SIGNING_KEY", "KERNEL_CACHE_SIGNING_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KERNEL_CACHE_TRUSTED_KEYS", str(fleet_keys["fleet"].public))
    tier = _redis(private_redis.url)
    c = tier.client
    c.execute_command("ACL", "SETUSER", "default", "-@scripting")
    _, key = _tiny_key(tiny_config)
    data = b"package bytes" * 100
    signed = sign_meta(make_meta(key, "v", data, 1.0), data, fleet_keys["fleet"].signer)
    assert tier.put(key.hexdigest, data, signed).outcome is PutOutcome.STORED
    c.hset(tier._name("entry", key.hexdigest), "data", b"x" * (64 << 20))
    c.config_resetstat()
    before = c.info("stats")["total_net_output_bytes"]
    assert tier.put(key.hexdigest, data, signed).outcome is PutOutcome.STORED
    sent = c.info("stats")["total_net_output_bytes"] - before
    assert sent < 64 << 10, f"{sent} bytes sent back to a put"
    assert c.hget(tier._name("entry", key.hexdigest), "data") == data
    tier.close()


def _after_each_watch(tier: RedisTier, url: str, name: str, act: str) -> list[int]:
    """Make another client act right after every ``WATCH`` the tier's
    connection sends: ``rewrite`` ``name`` (the worst timing a writer looping
    on ``HSET`` or ``SET`` can reach: each of the tier's ``EXEC`` then
    aborts), or ``pause`` the server for 1.5 s (``CLIENT PAUSE``: the tier's
    next command times out while it watches). Returns the list the actions are
    counted in."""
    import redis

    other = redis.Redis.from_url(url)
    done: list[int] = []
    pipeline = tier.client.pipeline

    def acting_pipeline(*a, **kw):
        pipe = pipeline(*a, **kw)
        watch = pipe.watch

        def watch_then_act(*names):
            out = watch(*names)
            if act == "pause":
                other.execute_command("CLIENT", "PAUSE", 1500, "ALL")
            elif other.type(name) == b"hash":
                other.hset(name, "x", len(done))
            else:
                other.set(name, f"w:{len(done)}")
            done.append(1)
            return out

        pipe.watch = watch_then_act
        return pipe

    tier.client.pipeline = acting_pipeline
    return done


@pytest.mark.parametrize("what", ["entry", "planted lock"])
def test_a_key_rewritten_during_every_watched_read_stops_the_reader_after_a_few_tries(
    redis_db, tiny_config, what, caplog
):
    """A writer that rewrites the key between the reader's ``WATCH`` and
    ``EXEC`` every time: redis-py's ``transaction`` would try forever. The
    tier gives up after :data:`~kernel_cache.store.redis_watch.WATCH_TRIES` tries
    (the server's own count of ``EXEC``) for that key alone: the entry is
    refused, named (a lookup takes it as a miss); the lock is built without,
    with one warning; the tier is not down, and other keys are read."""
    from kernel_cache.store.redis import UNAVAILABLE
    from kernel_cache.store.redis_watch import WATCH_TRIES

    tier = _redis(redis_db)
    _variant, key = _tiny_key(tiny_config)
    k = key.hexdigest
    _redis_entry(tier, _key(7), b"{}", b"other")
    if what == "entry":
        name = tier._name("entry", k)
        _redis_entry(tier, k, b"{}", b"code")
    else:
        name = tier._name("lock", k)
        tier.client.set(name, FORGED)  # no expiry: a takeover is tried, under WATCH
    done = _after_each_watch(tier, redis_db, name, "rewrite")
    tier.client.config_resetstat()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        if what == "entry":
            with pytest.raises(CorruptEntryError) as e:
                tier.get(k)
            said = str(e.value)
        else:
            assert tier.build_lock(k).acquire() == UNAVAILABLE
            (said,) = [r.getMessage() for r in caplog.records if "WATCH" in r.getMessage()]
            assert said.endswith("building without it") and "\x1b" not in said
    assert time.monotonic() - t0 < 5
    assert _redis_calls(tier.client).get("exec") == WATCH_TRIES == len(done)
    assert name in said and f"each of {WATCH_TRIES} tries" in said, said
    assert not tier.is_down() and tier.error is None
    tier.client.pipeline = type(tier.client).pipeline.__get__(tier.client)
    assert tier._read(_key(7), "data") == [b"other"]  # another key, read as before
    tier.close()


def test_a_server_that_stalls_while_a_read_watches_is_a_failure_at_once(redis_db, tiny_config):
    """A ``WATCH`` whose next command times out (the server paused) is the
    tier failing, not a contested key: one timeout, no second try, the tier
    down and saying why."""
    tier = RedisTier(RedisSettings(url=redis_db, timeout_s=0.4))
    _variant, key = _tiny_key(tiny_config)
    k = key.hexdigest
    _redis_entry(tier, k, b"{}", b"code")
    done = _after_each_watch(tier, redis_db, tier._name("entry", k), "pause")
    t0 = time.monotonic()
    assert tier.get(k) is None
    assert time.monotonic() - t0 < 1.4 and len(done) == 1
    assert tier.is_down() and "TimeoutError occurred while watching" in tier.error, tier.error
    time.sleep(1.6)  # the pause ends
    tier.close()


def test_a_redis_key_name_that_is_not_text_is_not_listed(redis_db):
    """A writer's hash named by bytes no entry key has (not UTF-8): ``keys``
    and ``iter_meta`` leave it out instead of raising."""
    tier = _redis(redis_db)
    _redis_entry(tier, _key(1), b"{}", b"x")
    tier.client.hset(tier._name("entry", "").encode() + b"\xff\xfe", "meta", b"{}")
    assert tier.keys() == [_key(1)]
    assert list(tier.iter_meta()) == []  # the one record, "{}", is not a valid record
    tier.close()


# -- listings (keys, iter_meta: explain's nearest entries) -----------------------------


def _fill_redis(tier: RedisTier, names: list[str | bytes]) -> None:
    """An entry hash of a one-byte record at each of ``names`` (after the prefix)."""
    p = tier.client.pipeline(transaction=False)
    for n in names:
        name = tier._name("entry", "").encode() + (n if isinstance(n, bytes) else n.encode())
        p.hset(name, mapping={"meta": b"{}", "data": b""})
    p.execute()


#: names under ``entries/`` (Redis: after ``<prefix>entry:``) that are no entry key
NOT_KEYS = ["A" * 64, "g" * 64, "0" * 63, "0" * 65, "0" * 64 + ".tmp", "sub/" + "0" * 64]


def test_a_redis_listing_leaves_names_that_are_not_entry_keys_in_redis(redis_db):
    """A 20 MiB name, names of 63 and 65 characters, of capitals or of letters
    past ``f``: ``keys`` does not return them, and the server sends none of
    them (its own ``total_net_output_bytes``: about a KiB for the listing, not
    the 20 MiB name); entries whose prefix only matches as a glob pattern are
    another tier's."""
    from kernel_cache.store.redis import SCAN_COUNT

    tier = _redis(redis_db)
    c = tier.client
    _fill_redis(tier, [*NOT_KEYS, b"x" * (20 << 20), b"\xff" * 64, _key(1), _key(2)])
    c.config_resetstat()
    before = c.info("stats")["total_net_output_bytes"]
    assert tier.keys() == [_key(1), _key(2)]
    sent = c.info("stats")["total_net_output_bytes"] - before
    calls = _redis_calls(c)
    assert sent < 16 << 10, f"{sent} bytes sent for a listing of two entries"
    assert calls["scan"] == 1 < SCAN_COUNT, calls
    globbed = RedisTier(RedisSettings(url=redis_db, prefix="k*[c]?\\:"))
    _fill_redis(globbed, [_key(3)])
    _redis_entry(tier, _key(4), b"{}", b"")  # "kernel_cache:" would match "k*[c]?\:" unescaped
    assert globbed.keys() == [_key(3)] and tier.keys() == [_key(1), _key(2), _key(4)]
    tier.close()
    globbed.close()


@pytest.mark.parametrize("over", ["entries", "other keys"])
def test_a_redis_listing_over_its_bound_stops_after_a_bounded_number_of_scans(redis_db, over):
    """``KERNEL_CACHE_REMOTE_LIST_MAX`` = 100: a database of 150 entries, or of
    20,000 keys that are no entry (SCAN walks every key), is listed with at
    most ``scan_calls_max(100)`` = 5 ``SCAN`` calls (the server's count; the
    whole database takes 20) and refused with an error naming Redis, the bound
    and the fix, not turned into an empty or partial list; the tier stays up.
    At the bound, or with a bound above the database, every entry is listed."""
    from kernel_cache.store.redis import scan_calls_max
    from kernel_cache.store.remote_base import ListingLimitError

    tier = _redis(redis_db)
    c = tier.client
    if over == "entries":
        entries, enough = [_key(i) for i in range(150)], 150
        _fill_redis(tier, entries)
        said, scans = "holds more than 100 entries", 1
    else:
        entries, enough = [_key(i) for i in range(10)], 20_000
        _fill_redis(tier, [f"junk{i}" for i in range(20_000)] + entries)
        said, scans = "did not fit in 5 SCAN calls of 1000 keys", 5
    # fail-open, as engines and explain make it: a failure would read as no entries
    bounded = RedisTier(
        RedisSettings.from_env(url=redis_db, environ={"KERNEL_CACHE_REMOTE_LIST_MAX": "100"})
    )
    assert bounded.fail_open and bounded.settings.list_max == 100 and scan_calls_max(100) == 5
    c.config_resetstat()
    with pytest.raises(ListingLimitError) as e:
        bounded.keys()
    assert _redis_calls(c)["scan"] == scans, _redis_calls(c)
    text = str(e.value)
    assert said in text and bounded.location in text, text
    assert "KERNEL_CACHE_REMOTE_LIST_MAX=100 allows" in text and "fix: raise" in text, text
    with pytest.raises(ListingLimitError):
        list(bounded.iter_meta())
    assert not bounded.is_down() and bounded.error is None
    c.config_resetstat()
    assert RedisTier(RedisSettings(url=redis_db, list_max=enough)).keys() == entries
    assert _redis_calls(c)["scan"] <= scan_calls_max(enough), _redis_calls(c)
    bounded.close()
    tier.close()


def test_a_redis_database_the_cache_alone_fills_is_listed_up_to_the_bound(redis_db):
    """The cache keeps three keys per entry (the entry and its two index sets),
    and ``SCAN`` walks them all: 1,900 entries with their index sets (5,700
    keys) under a bound of 2,000 are listed, in at most ``scan_calls_max(2000)``
    ``SCAN`` calls (the server's count)."""
    from kernel_cache.store.redis import scan_calls_max

    tier = _redis(redis_db)
    c = tier.client
    entries = [_key(i) for i in range(1900)]
    _fill_redis(tier, entries)
    p = c.pipeline(transaction=False)
    for i, k in enumerate(entries):
        for index in ("runtime", "near"):
            p.sadd(tier._name(f"index:{index}", f"{index}{i:06d}"), k)
    p.execute()
    assert c.dbsize() == 3 * len(entries)
    c.config_resetstat()
    bounded = RedisTier(RedisSettings(url=redis_db, list_max=2000))
    assert bounded.keys() == sorted(entries)
    assert _redis_calls(c)["scan"] <= scan_calls_max(2000), _redis_calls(c)
    bounded.close()
    tier.close()


def _settled(metrics_url: str) -> int:
    """The S3 server's request count once it has settled: it counts a request
    after answering it, so a read right after a client's last request can miss it."""
    from ..s3_server import request_count

    last = request_count(metrics_url)
    while True:
        time.sleep(0.3)
        now = request_count(metrics_url)
        if now == last:
            return now
        last = now


def test_an_s3_listing_skips_names_that_are_not_entry_keys(s3):
    """Names under ``entries/`` of the wrong length or alphabet, in a folder
    below it, and the longest name part SeaweedFS takes (255 bytes) are not
    listed. SeaweedFS itself refuses an object name over S3's 1024 bytes, or a
    part over 255 (``KeyTooLongError``)."""
    import obstore
    from obstore.exceptions import BaseError

    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=15))
    for name in [*NOT_KEYS, "z" * 255, _key(1), _key(2)]:
        obstore.put(tier.store, f"entries/{name}", b"x")
    for name in ["z" * 256, "/".join(["z" * 250] * 4) + "/" + _key(3)]:
        with pytest.raises(BaseError, match="KeyTooLong"):
            obstore.put(tier.store, f"entries/{name}", b"x")
    assert tier.keys() == [_key(1), _key(2)]
    tier.close()


def test_an_s3_listing_over_its_bound_stops_after_a_bounded_number_of_lists(s3):
    """2,100 objects under ``entries/`` (three LIST pages of 1000 names): with
    ``KERNEL_CACHE_REMOTE_LIST_MAX`` = 100 the listing sends one LIST request
    (the server's count) and is refused with an error naming the store, the
    bound and the fix; with 1,500, two; with the default, the whole listing
    takes three and returns the entries alone."""
    from kernel_cache.store.remote_base import ListingLimitError

    if not s3["metrics"]:
        pytest.skip("the shared S3 server gives no metrics URL")
    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=30))
    names = [_key(i) for i in range(1600)] + [f"junk{i}" for i in range(500)]
    _put_many(tier, [f"entries/{n}" for n in names], b"x")
    for bound, lists in ((100, 1), (1500, 2)):
        limited = S3Tier(
            S3Settings.from_env(
                url=s3["url"], environ={"KERNEL_CACHE_REMOTE_LIST_MAX": str(bound)}, timeout_s=30
            )
        )
        before = _settled(s3["metrics"])
        with pytest.raises(ListingLimitError) as e:
            limited.keys()
        assert _settled(s3["metrics"]) - before == lists
        text = str(e.value)
        assert f"more than {bound} names under entries/" in text and limited.location in text
        assert f"KERNEL_CACHE_REMOTE_LIST_MAX={bound} allows" in text, text
        assert "gc-remote" in text and not limited.is_down()
    before = _settled(s3["metrics"])
    assert tier.keys() == [_key(i) for i in range(1600)]
    assert _settled(s3["metrics"]) - before == 3
    tier.close()


def test_a_shared_directory_listing_is_bounded_and_skips_what_is_no_entry(tmp_path):
    """A ``file://`` directory: names that are no entry key, a folder and a
    builder's temporary file are not listed, a link is (not followed); past
    ``list_max`` names the listing is refused; an ``entries`` that is a link
    lists nothing."""
    from kernel_cache.store.remote_base import ListingLimitError

    entries = tmp_path / "store" / "entries"
    (entries / _key(9)).mkdir(parents=True)  # a folder: no entry
    for name in [n for n in NOT_KEYS if "/" not in n] + [f"{_key(8)}#tmp", _key(1), _key(2)]:
        (entries / name).write_bytes(b"x")
    (entries / _key(3)).symlink_to(tmp_path)
    url = f"file://{tmp_path / 'store'}"
    assert S3Tier(S3Settings(url=url)).keys() == [_key(1), _key(2), _key(3)]
    assert len(os.listdir(entries)) == 10
    assert S3Tier(S3Settings(url=url, list_max=10)).keys() == [_key(1), _key(2), _key(3)]
    with pytest.raises(ListingLimitError, match=r"more than 9 names under entries/ \(10 listed"):
        S3Tier(S3Settings(url=url, list_max=9)).keys()
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(entries, other / "entries")
    assert S3Tier(S3Settings(url=f"file://{other}")).keys() == []


def test_explain_over_a_listing_bound_says_so_without_a_traceback(
    redis_db, tiny_model, tmp_path, unsigned
):
    """``kernel-cache explain`` of a plan that misses, with a Redis of more
    entries than ``KERNEL_CACHE_REMOTE_LIST_MAX``: the report of every variant
    still, and one line naming Redis, the bound and the fix instead of Redis's
    nearest entries, not a listing that looks empty, and no traceback."""
    from ..conftest import N_TINY, run_cli, tiny_args

    tier = _redis(redis_db)
    _fill_redis(tier, [_key(i) for i in range(6)])
    env = {"KERNEL_CACHE_REDIS_URL": redis_db, "KERNEL_CACHE_REMOTE_LIST_MAX": "5"}
    proc = run_cli("explain", *tiny_args(tiny_model), "--cache-dir", tmp_path / "c", env=env)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{N_TINY} variant(s) checked, 0 hit, {N_TINY} miss" in proc.stdout, proc.stdout
    (line,) = [ln for ln in proc.stdout.splitlines() if "nearest entries not searched" in ln]
    assert "holds more than 5 entries" in line and "KERNEL_CACHE_REMOTE_LIST_MAX=5 allows" in line
    tier.close()
