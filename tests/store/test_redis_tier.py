"""A fleet shares one cache: the Redis tier, cross-machine locks, shards, signing.

Every test here talks to a real ``redis-server``: the one ``.ci/run`` starts
(``KERNEL_CACHE_TEST_REDIS_URL``), else one this module starts on a free
loopback port. Tests that kill Redis start their own. Without a
``redis-server`` binary they are skipped with that reason. The tests that
compile entries again build them with the plain kernels, their claims holding
for any kernel (:data:`~tests.conftest.PLAIN_KERNELS`,
:func:`~tests.conftest.plain_cache_copy`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from kernel_cache import MissingVariantsError, load_plan
from kernel_cache.errors import ConfigError, CorruptEntryError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.store.disk_tier import DiskTier, PutOutcome, make_meta, verify_entry
from kernel_cache.store.redis import (
    ACQUIRED,
    BUSY,
    ENV_REDIS_URL,
    RedisSettings,
    RedisTier,
)
from kernel_cache.trust.keys import (
    ENV_SIGNING_KEY,
    ENV_SIGNING_KEY_FILE,
    ENV_TRUSTED_KEYS,
    load_trusted_keys,
)
from kernel_cache.trust.signing import check_signature, sign_meta
from warmup.builder.planner import warmup

from ..conftest import N_TINY, ROOT, plain_args, run_cli, tiny_args
from ..kc_helpers import publish_to_redis, wait_for_pause
from ..redis_server import ENV_TEST_REDIS_URL, RedisServer, free_port, redis_server_binary
from ..signing_keys import make_keypair


@pytest.fixture(scope="module")
def fleet_keys(tmp_path_factory):
    """The fleet's key pair, a rotated-out old one and an attacker's."""
    d = tmp_path_factory.mktemp("fleet-keys")
    return {name: make_keypair(d / name) for name in ("fleet", "old", "attacker")}


needs_redis_binary = pytest.mark.skipif(
    redis_server_binary() is None,
    reason="no redis-server binary (Debian: apt-get install -y redis-server; .ci/run installs it)",
)


@pytest.fixture(scope="session")
def redis_url():
    """The shared test Redis: ``$KERNEL_CACHE_TEST_REDIS_URL`` or a private server."""
    url = os.environ.get(ENV_TEST_REDIS_URL)
    if url:
        yield url
        return
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary (Debian: apt-get install -y redis-server)")
    server = RedisServer()
    yield server.url
    server.stop()


@pytest.fixture
def redis_db(shared_servers, redis_url, monkeypatch):
    """An empty Redis database for one test, and no fleet settings leaking in;
    the servers' lock held (also when a test asks for this fixture at run time)."""
    for var in (ENV_REDIS_URL, ENV_SIGNING_KEY, ENV_SIGNING_KEY_FILE, ENV_TRUSTED_KEYS):
        monkeypatch.delenv(var, raising=False)
    tier = RedisTier(redis_url, fail_open=False)
    tier.client.flushdb()
    tier.close()
    return redis_url


@pytest.fixture
def private_redis():
    """A redis-server of this test's own, to kill."""
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary (Debian: apt-get install -y redis-server)")
    server = RedisServer()
    yield server
    server.stop()


def _plan_keys(cfg) -> dict[str, str]:
    return {str(v): build_key(cfg, v).hexdigest for v in Bucketer(cfg).variants}


# -- the tier itself --------------------------------------------------------


def test_entry_is_raw_bytes_plus_json_meta_with_ttl(redis_db, tiny_config):
    tier = RedisTier(RedisSettings(url=redis_db, ttl_s=300), fail_open=False)
    key = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    data = bytes(range(256)) * 4000  # 1 MB of every byte value
    meta = make_meta(key, "v", data, 1.0)
    assert tier.put(key.hexdigest, data, meta).stored
    name = f"kernel_cache:entry:{key.hexdigest}"
    c = tier.client
    assert c.hstrlen(name, "data") == len(data)  # raw, not base64 (which is 4/3 larger)
    assert json.loads(c.hget(name, "meta"))["sha256"] == meta["sha256"]
    assert 0 < c.ttl(name) <= 300
    e = tier.get(key.hexdigest)
    verify_entry(e)
    assert e.data == data and e.where == redis_db
    assert tier.contains(key.hexdigest) and tier.keys() == [key.hexdigest]
    assert [m["key"] for m in tier.iter_meta()] == [key.hexdigest]
    tier.delete(key.hexdigest)
    assert tier.get(key.hexdigest) is None and not tier.contains(key.hexdigest)


def test_password_is_hidden_in_location():
    tier = RedisTier("redis://user:hunter2@127.0.0.1:1/0")
    assert tier.location == "redis://user:***@127.0.0.1:1/0"


@pytest.mark.parametrize(
    "environ,match",
    [
        ({"KERNEL_CACHE_REDIS_TTL": "0"}, "TTL must be >= 1 second"),
        ({"KERNEL_CACHE_REDIS_TIMEOUT": "soon"}, "KERNEL_CACHE_REDIS_TIMEOUT='soon'"),
        ({"KERNEL_CACHE_REDIS_LOCK_TTL": "-1"}, "KERNEL_CACHE_REDIS_LOCK_TTL=.-1.*seconds > 0"),
    ],
)
def test_bad_redis_settings_name_the_variable(environ, match):
    with pytest.raises(ConfigError, match=match):
        RedisSettings.from_env("redis://127.0.0.1:6379/0", environ)
    assert RedisSettings.from_env(None, {}) is None  # no URL: no Redis tier


@pytest.mark.parametrize(
    "url,match",
    [
        ("redis://127.0.0.1:notaport/0", "the port is not a number"),
        ("redis://127.0.0.1:99999/0", "the port is not a number"),
        ("redis://127.0.0.1:6379/zero", "the database 'zero' is not a number"),
    ],
)
def test_malformed_redis_url_is_a_config_error_naming_the_flag(url, match):
    """Caught when the settings are read, not as a ValueError traceback from
    redis-py at the first call."""
    with pytest.raises(ConfigError, match=match) as e:
        RedisSettings.from_env(url, {})
    assert "--redis-url / KERNEL_CACHE_REDIS_URL" in str(e.value)


def test_bad_redis_url_is_a_clear_error(tiny_model, tmp_path):
    proc = run_cli(
        "warmup",
        *tiny_args(tiny_model),
        "--cache-dir",
        tmp_path,
        "--redis-url",
        "http://127.0.0.1:6379",
    )
    assert proc.returncode == 2 and "must start with one of redis://" in proc.stderr


# -- read-through, promote, write-through ------------------------------------


def test_read_through_promotes_into_the_local_cache(
    redis_db, warm_cache, tiny_config, tmp_path, monkeypatch, fleet_keys
):
    publish_to_redis(warm_cache[0], redis_db, signer=fleet_keys["fleet"].signer)
    monkeypatch.setenv(ENV_REDIS_URL, redis_db)
    monkeypatch.setenv(ENV_TRUSTED_KEYS, str(fleet_keys["fleet"].public))  # an engine
    local = tmp_path / "empty"
    rt = load_plan(tiny_config, local)  # default tiers: disk, then Redis
    assert rt.stats()["loads"] == N_TINY and rt.stats()["compiles"] == 0
    disk = DiskTier(local)
    for key in _plan_keys(tiny_config).values():
        verify_entry(disk.get(key))  # promoted: the next start is local
    monkeypatch.setenv(ENV_REDIS_URL, f"redis://127.0.0.1:{free_port()}/0")  # Redis gone
    assert load_plan(tiny_config, local).stats()["loads"] == N_TINY


def test_put_of_the_published_bytes_writes_nothing(redis_db, tiny_config, fleet_keys, monkeypatch):
    """A re-publish of the same entry (another builder of the key: builds are
    reproducible, only timings and creation time differ, and with them the
    signature) is ``present`` and sends no write to Redis (its own command
    counters); other bytes, a signature over unsigned bytes, an altered record or
    a signature the trusted keys refuse are written over; an unsigned put never
    replaces a signed entry."""
    tier = RedisTier(redis_db, fail_open=False)
    ck = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    key, data = ck.hexdigest, b"package bytes"

    def hsets() -> int:
        return tier.client.info("commandstats").get("cmdstat_hset", {}).get("calls", 0)

    meta = make_meta(ck, "v", data, 1.0)
    assert tier.put(key, data, meta).outcome is PutOutcome.STORED
    n = hsets()
    later = {**meta, "compile_seconds": 9.0, "created": meta["created"] + 60}  # another build
    assert tier.put(key, data, later).outcome is PutOutcome.PRESENT
    assert hsets() == n
    monkeypatch.setenv(ENV_TRUSTED_KEYS, str(fleet_keys["fleet"].public))
    signer = fleet_keys["fleet"].signer
    signed = sign_meta(meta, data, signer)
    assert tier.put(key, data, signed).outcome is PutOutcome.STORED  # adds the signature
    assert tier.put(key, data, sign_meta(later, data, signer)).outcome is PutOutcome.PRESENT
    assert tier.put(key, data, meta).outcome is PutOutcome.PRESENT  # unsigned: keeps it
    assert hsets() == n + 1 and tier.get_meta(key)["signature"] == signed["signature"]
    # Redis's record relabelled under the genuine signature: a builder's put repairs it
    tier.client.hset(
        tier._name("entry", key), "meta", json.dumps({**signed, "variant": "evil"}).encode()
    )
    assert tier.put(key, data, signed).outcome is PutOutcome.STORED
    assert tier.get_meta(key)["variant"] == "v"
    # signed by a key the trusted keys do not hold: replaced too
    forged = sign_meta(meta, data, fleet_keys["attacker"].signer)
    tier.client.hset(tier._name("entry", key), "meta", json.dumps(forged).encode())
    assert tier.put(key, data, signed).outcome is PutOutcome.STORED
    other = make_meta(ck, "v", b"x", 1.0)
    assert tier.put(key, b"x", other).outcome is PutOutcome.STORED
    tier.close()


def _alter_bytes_under_the_record(url: str, tier, key: str, data: bytes, scripting: bool):
    """Flip a bit, then cut the bytes, under Redis's intact signed record: each
    time a reader rejects the entry, and a builder's put of the genuine entry
    writes it again (it did not: the record alone said "present")."""
    name = tier._name("entry", key)
    for bad in (data[:-1] + bytes([data[-1] ^ 1]), data[:-3]):
        tier.client.hset(name, "data", bad)
        with pytest.raises(CorruptEntryError):
            verify_entry(tier.get(key))
        calls = tier.client.info("commandstats")
        assert tier.put(key, data, tier.get_meta(key)).outcome is PutOutcome.STORED
        verify_entry(tier.get(key))
        after = tier.client.info("commandstats")
        used = after.get("cmdstat_eval", {}).get("calls", 0) - calls.get("cmdstat_eval", {}).get(
            "calls", 0
        )
        assert used == (1 if scripting else 0)
    # intact: present, nothing written
    n = tier.client.info("commandstats").get("cmdstat_hset", {}).get("calls", 0)
    assert tier.put(key, data, tier.get_meta(key)).outcome is PutOutcome.PRESENT
    assert tier.client.info("commandstats").get("cmdstat_hset", {}).get("calls", 0) == n


def test_a_put_replaces_bytes_altered_under_an_intact_signed_record(
    redis_db, tiny_config, monkeypatch, fleet_keys
):
    monkeypatch.setenv(ENV_TRUSTED_KEYS, str(fleet_keys["fleet"].public))
    tier = RedisTier(redis_db, fail_open=False)
    ck = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    data = b"package bytes" * 100
    signed = sign_meta(make_meta(ck, "v", data, 1.0), data, fleet_keys["fleet"].signer)
    assert tier.put(ck.hexdigest, data, signed).outcome is PutOutcome.STORED
    _alter_bytes_under_the_record(redis_db, tier, ck.hexdigest, data, scripting=True)
    tier.close()


def test_a_put_compares_the_bytes_where_scripting_is_refused(
    private_redis, tiny_config, monkeypatch, fleet_keys
):
    """A Redis whose ACL refuses EVAL: the bytes are read back instead, and the
    tier is not marked down."""
    for var in (ENV_REDIS_URL, ENV_SIGNING_KEY, ENV_SIGNING_KEY_FILE):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(ENV_TRUSTED_KEYS, str(fleet_keys["fleet"].public))
    tier = RedisTier(private_redis.url, fail_open=True)
    tier.client.execute_command("ACL", "SETUSER", "default", "-@scripting")
    ck = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    data = b"package bytes" * 100
    signed = sign_meta(make_meta(ck, "v", data, 1.0), data, fleet_keys["fleet"].signer)
    assert tier.put(ck.hexdigest, data, signed).outcome is PutOutcome.STORED
    _alter_bytes_under_the_record(private_redis.url, tier, ck.hexdigest, data, scripting=False)
    assert not tier.is_down() and tier.error is None
    tier.close()


def test_warmup_publishes_local_entries_redis_lacks(
    redis_db, cache_copy, tiny_config, monkeypatch, fleet_keys
):
    monkeypatch.setenv(ENV_SIGNING_KEY_FILE, str(fleet_keys["fleet"].private))  # a builder
    report = warmup(tiny_config, cache_copy, progress=False, remote=RedisSettings(url=redis_db))
    assert (report["compiled"], report["cached"], report["uploaded"]) == (0, N_TINY, N_TINY)
    assert report["remote"] == redis_db and report["remote_error"] is None
    tier = RedisTier(redis_db, fail_open=False)
    assert set(tier.keys()) == set(_plan_keys(tiny_config).values())
    again = warmup(tiny_config, cache_copy, progress=False, remote=RedisSettings(url=redis_db))
    assert again["uploaded"] == 0


def test_warmup_republishes_redis_entries_signed_with_another_key(
    redis_db, cache_copy, tiny_config, monkeypatch, fleet_keys
):
    """After a key rotation the builders' local caches hold the plan: warmup must
    replace Redis's entries signed with the old key (engines reject them), and a
    builder without a key must not replace signed entries."""
    remote = RedisSettings(url=redis_db)
    new = fleet_keys["fleet"]
    keys = [m["key"] for m in publish_to_redis(cache_copy, redis_db, fleet_keys["old"].signer)]
    monkeypatch.setenv(ENV_SIGNING_KEY_FILE, str(new.private))
    report = warmup(tiny_config, cache_copy, progress=False, remote=remote)
    assert (report["compiled"], report["uploaded"]) == (0, len(keys))
    tier = RedisTier(redis_db, fail_open=False)
    ring = load_trusted_keys({ENV_TRUSTED_KEYS: str(new.public)})
    for k in keys:
        e = tier.get(k)
        assert e.meta["signature"]["key_id"] == new.key_id
        check_signature(k, e.meta, e.data, ring)
    # Ed25519 is deterministic: the same record and key sign the same, nothing to upload
    assert warmup(tiny_config, cache_copy, progress=False, remote=remote)["uploaded"] == 0
    monkeypatch.delenv(ENV_SIGNING_KEY_FILE)
    assert warmup(tiny_config, cache_copy, progress=False, remote=remote)["uploaded"] == 0
    assert all(tier.get_meta(k)["signature"]["key_id"] == new.key_id for k in keys)


# -- signing ------------------------------------------------------------------


@pytest.mark.compile
def test_forged_entry_in_redis_is_rejected_and_never_loaded(
    redis_db, plain_warm_cache, plain_config, tiny_model, tmp_path, monkeypatch, caplog, fleet_keys
):
    """Right key, right checksum, wrong signature (another key's, under our key id)."""
    fleet = fleet_keys["fleet"]
    publish_to_redis(plain_warm_cache[0], redis_db, fleet.signer)
    keys = _plan_keys(plain_config)
    plan = Bucketer(plain_config).variants
    victim, donor = str(plan[0]), str(plan[1])
    tier = RedisTier(redis_db, fail_open=False)
    good = tier.get(keys[victim])
    payload = tier.get(keys[donor]).data  # a valid package, for the wrong shape
    forged = make_meta(build_key(plain_config, plan[0]), victim, payload, 1.0)
    forged = sign_meta(forged, payload, fleet_keys["attacker"].signer)
    forged["signature"]["key_id"] = good.meta["signature"]["key_id"]  # posing as ours
    tier.put(keys[victim], payload, forged)

    monkeypatch.setenv(ENV_REDIS_URL, redis_db)
    monkeypatch.setenv(ENV_TRUSTED_KEYS, str(fleet.public))  # an engine: public key only
    local = tmp_path / "local"
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        with pytest.raises(MissingVariantsError) as e:
            load_plan(plain_config, local)
    assert [str(v) for v in e.value.missing] == [victim]
    assert "rejected redis entry" in caplog.text and "forged or altered" in caplog.text
    assert DiskTier(local).get(keys[victim]) is None  # never copied, never loaded
    assert DiskTier(local).get(keys[donor]) is not None

    proc = run_cli(
        "verify",
        *plain_args(tiny_model),
        "--redis-url",
        redis_db,
        "--json",
        env={ENV_TRUSTED_KEYS: str(fleet.public)},
    )
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert [c["variant"] for c in report["corrupt"]] == [victim]
    assert "signature" in report["corrupt"][0]["reason"] and report["loaded"] == N_TINY - 1

    # a builder's warmup recompiles the rejected variant and replaces the forged entry
    monkeypatch.setenv(ENV_SIGNING_KEY_FILE, str(fleet.private))
    fix = warmup(plain_config, local, progress=False, remote=RedisSettings(url=redis_db))
    assert (fix["compiled"], fix["cached"]) == (1, N_TINY - 1) and fix["failed"] == []
    assert tier.get(keys[victim]).data != payload
    assert load_plan(plain_config, tmp_path / "another").stats()["loads"] == N_TINY


def test_unsigned_redis_entries_are_rejected_when_a_key_is_set(
    redis_db, warm_cache, tiny_config, tmp_path, monkeypatch, fleet_keys
):
    publish_to_redis(warm_cache[0], redis_db, signer=None)
    monkeypatch.setenv(ENV_REDIS_URL, redis_db)
    monkeypatch.setenv(ENV_TRUSTED_KEYS, str(fleet_keys["fleet"].public))
    with pytest.raises(MissingVariantsError) as e:
        load_plan(tiny_config, tmp_path / "local")
    assert len(e.value.missing) == N_TINY


# -- Redis down or failing ------------------------------------------------------


def test_engine_start_with_redis_down_uses_local_and_warns_once(
    warm_cache, cache_copy, tiny_config, monkeypatch, caplog, fleet_keys
):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setenv(ENV_REDIS_URL, dead)
    monkeypatch.setenv(ENV_TRUSTED_KEYS, str(fleet_keys["fleet"].public))  # an engine's key
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        assert load_plan(tiny_config, warm_cache[0]).stats()["loads"] == N_TINY
    assert caplog.text == ""  # the local tier held the plan: Redis never asked
    disk = DiskTier(cache_copy)
    keys = list(_plan_keys(tiny_config).values())
    disk.delete(keys[0])
    disk.delete(keys[1])
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        with pytest.raises(MissingVariantsError) as e:
            load_plan(tiny_config, cache_copy)
    assert len(e.value.missing) == 2
    warnings = [r for r in caplog.records if dead in r.getMessage()]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()


def test_a_silent_server_costs_at_most_the_timeout():
    """A peer that accepts and never answers (a hung Redis): calls give up after
    ``timeout_s`` and the tier then answers misses at once."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    url = f"redis://127.0.0.1:{srv.getsockname()[1]}/0"
    result = {}

    def calls():
        tier = RedisTier(RedisSettings(url=url, timeout_s=0.5), warn=False)
        result["first"] = tier.get("0" * 64)
        result["error"] = tier.error
        result["second"] = tier.contains("0" * 64)

    t = threading.Thread(target=calls, daemon=True)
    t.start()
    t.join(timeout=20)  # without the socket timeout this would hang
    srv.close()
    assert not t.is_alive(), "a Redis call blocked past its timeout"
    assert result["first"] is None and result["second"] is False
    assert "Timeout" in result["error"]


def test_verify_redis_url_with_redis_down_is_an_error_naming_it(tiny_model):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    proc = run_cli("verify", *tiny_args(tiny_model), "--redis-url", dead)
    assert proc.returncode == 2 and dead in proc.stderr
    assert "carrying on" not in proc.stderr  # verify does not carry on: one error, no warning


def test_verify_redis_url_repair_publishes_to_redis(redis_db, tiny_model, tmp_path, fleet_keys):
    """An empty Redis: verify fails and its repair command warms Redis, not only
    the local cache."""
    proc = run_cli(
        "verify", *tiny_args(tiny_model), "--cache-dir", tmp_path, "--redis-url", redis_db,
        env={ENV_TRUSTED_KEYS: str(fleet_keys["fleet"].public)},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    repair = [line for line in proc.stderr.splitlines() if "repair:" in line]
    assert repair and repair[0].endswith(f"--redis-url {redis_db}")


# -- cross-machine single flight ------------------------------------------------

HOLDER = r"""
import sys, time
from kernel_cache.store.redis import RedisSettings, RedisTier
tier = RedisTier(RedisSettings(url=sys.argv[1], lock_ttl_s=float(sys.argv[3])))
lock = tier.build_lock(sys.argv[2])
print(lock.acquire(wait=False), lock.token, flush=True)
time.sleep(120)
"""


@needs_redis_binary
def test_lock_of_a_killed_builder_expires_and_is_taken_over(redis_db):
    ttl = 1.0
    key = "ab" * 32
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, redis_db, key, str(ttl)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        status, token = holder.stdout.readline().split()
        assert status == ACQUIRED
        tier = RedisTier(RedisSettings(url=redis_db, lock_ttl_s=ttl), fail_open=False)
        time.sleep(3 * ttl)  # the holder renews: still held after 3 TTLs
        assert tier.build_lock(key).acquire(wait=False) == BUSY
        assert tier.build_lock(key).holder() == token
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    waiter = tier.build_lock(key, wait_s=30)
    assert waiter.acquire() == ACQUIRED  # after the dead holder's lock expired
    assert waiter.waited_s <= ttl + 5  # bounded by the TTL, not by lock_wait_s
    assert waiter.holder() == waiter.token and str(os.getpid()) in waiter.token
    waiter.release()
    assert waiter.holder() is None


# -- warmup against Redis (real compiles) --------------------------------------


@pytest.mark.compile
def test_three_shard_builders_cover_the_plan_once(
    redis_db, tiny_model, plain_config, tmp_path, fleet_keys
):
    """Three ``--shard I/3`` builders and one unsharded builder, in parallel, one
    Redis, empty local caches, signed: every variant compiled exactly once."""
    env = {ENV_SIGNING_KEY_FILE: str(fleet_keys["fleet"].private)}
    cmds = [["--shard", f"{i}/3"] for i in range(3)] + [[]]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "warmup.cli.main",
                "warmup",
                *plain_args(tiny_model),
                "--cache-dir",
                str(tmp_path / f"builder{i}"),
                "--redis-url",
                redis_db,
                "--jobs",
                "1",
                "--json",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, **env},
        )
        for i, extra in enumerate(cmds)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err
        reports.append(json.loads(out))
    plan = {str(v) for v in Bucketer(plain_config).variants}
    shards = [set(r["shard"]["variants"]) for r in reports[:3]]
    assert set().union(*shards) == plan and sum(map(len, shards)) == len(plan)
    compiled = [[x["variant"] for x in r["results"] if x["status"] == "compiled"] for r in reports]
    flat = [v for c in compiled for v in c]
    assert sorted(flat) == sorted(plan), f"compiled twice or not at all: {compiled}"
    for i, r in enumerate(reports):
        assert r["failed"] == [] and r["remote_error"] is None
        assert r["compiled"] + r["fetched"] + r["cached"] == r["variants"]
        local = DiskTier(tmp_path / f"builder{i}")  # write-through: local has its shard
        for v in shards[i] if i < 3 else plan:
            verify_entry(local.get(_plan_keys(plain_config)[v]))
    engine = {ENV_TRUSTED_KEYS: str(fleet_keys["fleet"].public)}  # an engine's: public only
    proc = run_cli(
        "verify", *plain_args(tiny_model), "--redis-url", redis_db, "--json", "--require-signed",
        env=engine,
    )  # fmt: skip
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"] and report["loaded"] == len(plan), proc.stderr


@pytest.mark.compile
def test_redis_killed_mid_warmup_local_run_completes(
    private_redis, plain_cache_copy, tiny_model, plain_config, fleet_keys
):
    """Two variants to compile; Redis is SIGKILLed while the first compiles
    (its build lock is held). Staged compiles are published in one batch at the
    end, so waiting for the first published entry killed Redis after the last
    Redis call, and the warmup never saw a failure."""
    keys = list(_plan_keys(plain_config).values())
    disk = DiskTier(plain_cache_copy)
    for k in keys[:2]:
        disk.delete(k)
    disk.close()
    url = private_redis.url
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "warmup.cli.main",
            "warmup",
            *plain_args(tiny_model),
            "--cache-dir",
            str(plain_cache_copy),
            "--redis-url",
            url,
            "--redis-timeout",
            "1",
            "--jobs",
            "1",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, ENV_SIGNING_KEY_FILE: str(fleet_keys["fleet"].private)},  # a builder
    )
    watcher = RedisTier(url, fail_open=False)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if len(watcher.keys()) >= 1 and any(watcher.client.scan_iter(match="*lock:*")):
            break  # the cached one uploaded at start, and the first compile holds its lock
        time.sleep(0.1)
    assert len(watcher.keys()) >= 1 and proc.poll() is None
    private_redis.kill()
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["compiled"] == 2 and report["failed"] == []
    assert report["remote_error"] is not None
    assert err.count(url) == 1 and "unavailable" in err  # one warning naming the URL
    local = DiskTier(plain_cache_copy)
    for k in keys:
        verify_entry(local.get(k))


# -- the load test, tiny ----------------------------------------------------------


@pytest.mark.compile
def test_fleet_load_smoke_warm_redis_needs_no_compile(redis_db, warm_cache, tiny_model):
    publish_to_redis(warm_cache[0], redis_db)
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/fleet_load.py",
            *tiny_args(tiny_model),
            "--engines",
            "3",
            "--redis-url",
            redis_db,
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["engines"] == 3 and doc["all_loaded"] is True
    assert doc["total_compiles"] == 0 and doc["expected_compiles"] == 0
    assert doc["start_s"]["p50"] <= doc["start_s"]["max"]


@pytest.mark.compile
def test_a_warmup_stopped_with_sigterm_gives_its_build_lock_up(
    redis_db, plain_cache_copy, tiny_model, plain_config, tmp_path, fleet_keys
):
    """SIGTERM to the warmup process alone (a pod stop) while its worker compiles
    under the key's Redis build lock: the lock key, read raw from Redis, is gone
    once the warmup has exited, so another builder takes the key at once
    instead of waiting out the lock's TTL."""
    import redis

    key = build_key(plain_config, Bucketer(plain_config).variants[-1]).hexdigest
    disk = DiskTier(plain_cache_copy)
    disk.delete(key)
    disk.close()
    marker = tmp_path / "paused"
    args = ["warmup", *plain_args(tiny_model), "--cache-dir", str(plain_cache_copy), "--jobs", "1"]
    env = {
        **os.environ,
        "KERNEL_CACHE_TEST_PAUSE_AT": "compile",
        ENV_SIGNING_KEY_FILE: str(fleet_keys["fleet"].private),  # a builder
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmup.cli.main", *args, "--redis-url", redis_db],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**env, "KERNEL_CACHE_TEST_PAUSE_MARKER": str(marker)},
    )  # fmt: skip
    raw = redis.Redis.from_url(redis_db)
    try:
        wait_for_pause(marker, proc, "compile")
        assert raw.pttl(f"kernel_cache:lock:{key}") > 5000  # held for most of its TTL
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        raw.close()
    assert proc.returncode == 143, err
    assert "Traceback" not in err, err
    assert redis.Redis.from_url(redis_db).exists(f"kernel_cache:lock:{key}") == 0
