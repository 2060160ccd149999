"""Shared tiers are signed by default, against a real SeaweedFS and redis-server.

Each claim is counted outside the product: objects in the bucket (an S3
LIST), keys in Redis (``DBSIZE``), requests by the server's own metrics, the
lines a real process writes. The entries are the suite's warm tiny plan
(compiled once per session), published to the store as each test needs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from kernel_cache.store.disk_tier import DiskTier
from kernel_cache.store.s3 import S3Settings, S3Tier
from kernel_cache.trust.signing import sign_meta

from ..conftest import N_TINY, ROOT, run_cli, tiny_args
from ..s3_server import request_count
from ..signing_keys import make_keypair
from ..store import test_redis_tier, test_s3_tier

# the S3 and Redis tiers' fixtures: the shared servers, a fresh prefix / database
s3_server = test_s3_tier.s3_server
s3 = test_s3_tier.s3
redis_url = test_redis_tier.redis_url
redis_db = test_redis_tier.redis_db


OPT_OUT = "KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """The fleet's key pair and an attacker's."""
    d = tmp_path_factory.mktemp("keys")
    return {name: make_keypair(d / name) for name in ("fleet", "evil")}


@pytest.fixture
def bucket(s3, monkeypatch):
    """A fresh prefix of the test bucket, with the default trust settings (no
    key, no opt-out) in this process."""
    monkeypatch.delenv(OPT_OUT, raising=False)
    return s3


def _env(**extra) -> dict[str, str]:
    """This process's environment without any kernel-cache setting (the test
    hooks and the AWS variables stay), plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KERNEL_CACHE_") or k.startswith("KERNEL_CACHE_TEST_")
    }
    return {**env, **extra}


def _objects(url: str) -> list[str]:
    """Every object under the prefix of ``url``, by an S3 LIST."""
    import obstore

    tier = S3Tier(S3Settings(url=url, timeout_s=15))
    try:
        return sorted(m["path"] for batch in obstore.list(tier.store) for m in batch)
    finally:
        tier.close()


def _publish(cache, url: str, signer=None) -> list[str]:
    """Put every entry of the local cache ``cache`` in S3 (signed by ``signer``)."""
    local = DiskTier(cache, read_only=True)
    tier = S3Tier(S3Settings(url=url, timeout_s=15), fail_open=False)
    keys = []
    for meta in local.iter_meta():
        e = local.get(meta["key"])
        assert tier.put(e.key, e.data, sign_meta(e.meta, e.data, signer)).ok
        keys.append(e.key)
    local.close()
    tier.close()
    return keys


#: Engine start of the tiny plan (model argv[1], cache argv[2]) in a fresh
#: process: one JSON line, the loaded sources or the error's type and text.
ENGINE = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from kernel_cache import load_plan, make_config
from kernel_cache.errors import KernelCacheError
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))
try:
    rt = load_plan(cfg, sys.argv[2])
except KernelCacheError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
else:
    print(json.dumps({"sources": rt.stats()["sources"], "loads": rt.stats()["loads"]}))
"""


def _engine(model, cache, env) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, str(model), str(cache)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _names_the_fix(message: str) -> None:
    for needed in (
        "kernel-cache keygen",
        "KERNEL_CACHE_TRUSTED_KEYS=DIR/signing.pub",
        "KERNEL_CACHE_SIGNING_KEY_FILE=DIR/signing.key",
        f"{OPT_OUT}=1",
    ):
        assert needed in message, (needed, message)


def test_engine_start_with_a_shared_tier_and_no_key_refuses_before_any_request(
    bucket, tiny_model, tmp_path
):
    before = request_count(bucket["metrics"])
    doc, _ = _engine(tiny_model, tmp_path / "c", _env(KERNEL_CACHE_S3_URL=bucket["url"]))
    assert doc["error"] == "SigningKeyError" and bucket["url"] in doc["message"]
    _names_the_fix(doc["message"])
    assert request_count(bucket["metrics"]) == before  # refused before it asked the store
    # a command that reads the shared tier refuses the same way
    proc = run_cli(
        "verify", *tiny_args(tiny_model), "--cache-dir", tmp_path / "c",
        "--s3-url", bucket["url"], env=_env(),
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    _names_the_fix(proc.stderr)


def test_the_opt_out_loads_unsigned_and_keys_set_later_refuse_the_copies_fetched(
    bucket, warm_cache, tiny_model, tmp_path, keys
):
    _publish(warm_cache[0], bucket["url"])  # unsigned
    local = tmp_path / "engine"
    doc, _ = _engine(tiny_model, local, _env(KERNEL_CACHE_S3_URL=bucket["url"], **{OPT_OUT: "1"}))
    assert doc == {"sources": {bucket["url"]: N_TINY}, "loads": N_TINY}
    disk = DiskTier(local, read_only=True)
    copies = [disk.get(m["key"]).meta for m in disk.iter_meta()]
    disk.close()
    assert len(copies) == N_TINY
    assert all(m["imported_from"] == bucket["url"] and "signature" not in m for m in copies)
    # keys turned on, no shared tier: the unsigned copies are refused, said as such
    doc, err = _engine(tiny_model, local, _env(KERNEL_CACHE_TRUSTED_KEYS=str(keys["fleet"].public)))
    assert doc["error"] == "MissingVariantsError", doc
    msg = doc["message"]
    assert f"{N_TINY} variant(s) of the plan were refused" in msg and "untrusted" in msg
    assert "unsigned" in msg and "not cached" not in msg and "Warm them with" not in msg
    refusals = [ln for ln in err.splitlines() if ln.startswith("WARNING") and "refused" in ln]
    assert len(refusals) == 1, err  # once, not once per entry
    # and with the bucket too: still refused (unsigned there as well); the repair names it
    env = _env(
        KERNEL_CACHE_TRUSTED_KEYS=str(keys["fleet"].public), KERNEL_CACHE_S3_URL=bucket["url"]
    )
    doc, err = _engine(tiny_model, local, env)
    assert doc["error"] == "MissingVariantsError" and "were refused" in doc["message"]
    assert doc["message"].rstrip().endswith(f"--remote-url {bucket['url']}")
    refusals = [ln for ln in err.splitlines() if ln.startswith("WARNING") and "refused" in ln]
    assert len(refusals) == 2, err  # one per store (the local copies, the bucket)


def test_a_refused_miss_names_the_untrusted_key_and_the_remote(
    bucket, warm_cache, tiny_model, tmp_path, keys
):
    evil = keys["evil"]
    _publish(warm_cache[0], bucket["url"], signer=evil.signer)
    env = _env(
        KERNEL_CACHE_TRUSTED_KEYS=str(keys["fleet"].public), KERNEL_CACHE_S3_URL=bucket["url"]
    )
    doc, err = _engine(tiny_model, tmp_path / "engine", env)
    assert doc["error"] == "MissingVariantsError", doc
    msg = doc["message"]
    assert f"{N_TINY} variant(s) of the plan were refused" in msg
    assert f"their entries in {bucket['url']} are untrusted" in msg
    assert f"signed by key {evil.key_id}, which is not trusted" in msg
    assert msg.rstrip().endswith(f"--remote-url {bucket['url']}")  # the repair names the remote
    assert "KERNEL_CACHE_SIGNING_KEY_FILE" in msg and "Warm them with" not in msg
    warned = [ln for ln in err.splitlines() if ln.startswith("WARNING") and evil.key_id in ln]
    assert len(warned) == 1 and "untrusted" in warned[0], err
    assert "corrupt" not in warned[0]
    # verify says the same per variant, and which key checked the signatures
    proc = run_cli(
        "verify", *tiny_args(tiny_model), "--cache-dir", tmp_path / "v", "--s3-url",
        bucket["url"], "--json", env=env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["signatures"] == f"signatures checked with key {keys['fleet'].key_id}"
    reasons = [c["reason"] for c in report["corrupt"]]
    assert len(reasons) == N_TINY
    assert all(r.startswith(f"untrusted: signed by key {evil.key_id}") for r in reasons)


def _redis_keys(url: str) -> int:
    from kernel_cache.store.redis import RedisTier

    tier = RedisTier(url, fail_open=False)
    try:
        return tier.client.dbsize()
    finally:
        tier.close()


@pytest.mark.parametrize("store", ["s3", "redis"])
def test_warmup_without_a_key_never_publishes_and_says_so_once(
    store, request, cache_copy, tiny_model, monkeypatch
):
    """An engine host without keys runs warmup with the fleet's store set: its
    cache holds the whole (unsigned) plan, which warmup used to upload."""
    if store == "s3":  # each fixture takes the servers' lock
        url = request.getfixturevalue("bucket")["url"]
        flag, count = "--s3-url", lambda: len(_objects(url))
    else:
        url = request.getfixturevalue("redis_db")
        flag, count = "--redis-url", lambda: _redis_keys(url)
    args = ("warmup", *tiny_args(tiny_model), "--cache-dir", cache_copy, flag, url, "-q")
    proc = run_cli(*args, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert count() == 0  # nothing reached the store: no entry, no manifest
    said = [ln for ln in proc.stderr.splitlines() if "building locally" in ln]
    assert len(said) == 1 and "KERNEL_CACHE_SIGNING_KEY_FILE" in said[0], proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"published nothing to {url}: no signing key"), proc.stdout
    # a builder step that must publish fails instead
    proc = run_cli(*args, "--require-publish", env=_env())
    assert proc.returncode == 1 and "--require-publish" in proc.stderr, proc.stderr
    assert count() == 0


def test_require_publish_fails_against_a_missing_bucket(
    s3_server, cache_copy, tiny_model, keys, monkeypatch
):
    monkeypatch.delenv(OPT_OUT, raising=False)
    url = f"s3://kc-missing-{uuid.uuid4().hex[:8]}/fleet"
    env = _env(KERNEL_CACHE_SIGNING_KEY_FILE=str(keys["fleet"].private))
    args = ("warmup", *tiny_args(tiny_model), "--cache-dir", cache_copy, "--s3-url", url, "-q")
    proc = run_cli(*args, env=env)
    assert proc.returncode == 0, proc.stderr  # carries on locally, and says so last
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"published nothing to {url}") and "unavailable" in last, last
    for required in (["--require-publish"], []):
        extra = {} if required else {"KERNEL_CACHE_REQUIRE_PUBLISH": "1"}
        proc = run_cli(*args, *required, env={**env, **extra})
        assert proc.returncode == 1, (required, proc.stdout, proc.stderr)
        assert "the shared tier did not get every entry" in proc.stderr
        assert "unavailable" in proc.stderr


def test_a_signed_publish_is_counted_and_names_its_key(bucket, cache_copy, tiny_model, keys):
    fleet = keys["fleet"]
    proc = run_cli(
        "warmup", *tiny_args(tiny_model), "--cache-dir", cache_copy, "--s3-url", bucket["url"],
        "--require-publish", "-q", env=_env(KERNEL_CACHE_SIGNING_KEY_FILE=str(fleet.private)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last == f"published {N_TINY} entries to {bucket['url']}, signed by key {fleet.key_id}"
    entries = [p for p in _objects(bucket["url"]) if p.startswith("entries/")]
    assert len(entries) == N_TINY
    # an engine with the public key loads them and says which key checked them
    doc, err = _engine(
        tiny_model,
        cache_copy.parent / "engine",
        _env(KERNEL_CACHE_S3_URL=bucket["url"], KERNEL_CACHE_TRUSTED_KEYS=str(fleet.public)),
    )
    assert doc == {"sources": {bucket["url"]: N_TINY}, "loads": N_TINY}
    assert f"signatures checked with key {fleet.key_id}" in err


def test_export_needs_a_key_and_require_publish_the_private_one(
    cache_copy, tiny_model, tmp_path, keys
):
    base = ("export", *tiny_args(tiny_model), "--cache-dir", cache_copy)
    proc = run_cli(*base, "--out", tmp_path / "b1", env=_env())
    assert proc.returncode == 2 and not (tmp_path / "b1").exists()
    _names_the_fix(proc.stderr)
    engine_only = _env(KERNEL_CACHE_TRUSTED_KEYS=str(keys["fleet"].public))
    proc = run_cli(*base, "--out", tmp_path / "b2", "--require-publish", env=engine_only)
    assert proc.returncode == 2 and "no private key" in proc.stderr
    assert not (tmp_path / "b2").exists()
    builder = _env(KERNEL_CACHE_SIGNING_KEY_FILE=str(keys["fleet"].private))
    proc = run_cli(*base, "--out", tmp_path / "b3", "--require-publish", env=builder)
    assert proc.returncode == 0, proc.stderr
    assert f"every entry by key {keys['fleet'].key_id}" in proc.stdout
