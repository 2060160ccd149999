"""The object-store tier on other stores than S3, against real emulator
servers: Azure Blob on Azurite (``az://``). Each test skips, saying why, where
its emulator is not installed. ``gs://`` runs only against a bucket a caller
names (``KERNEL_CACHE_TEST_GCS_URL``): no GCS emulator installs here
(docs/shared-storage.md)."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from kernel_cache.store.disk_tier import PutOutcome, verify_entry
from kernel_cache.store.redis import ACQUIRED, BUSY, PUBLISHED
from kernel_cache.store.s3 import S3Settings, S3Tier
from kernel_cache.store.s3_objects import manifest_name

from ..azurite_server import CONTAINER, AzuriteServer, azurite_binary


@pytest.fixture(scope="module")
def azurite():
    if azurite_binary() is None:
        pytest.skip(
            "no azurite-blob: npm install azurite (Microsoft's Azure Storage emulator) and "
            "put it on PATH or in KERNEL_CACHE_TEST_AZURITE"
        )
    server = AzuriteServer()
    yield server
    server.stop()


def _entry(tag: str) -> tuple[str, bytes, dict]:
    data = tag.encode() * 1000
    key = hashlib.sha256(tag.encode()).hexdigest()
    return key, data, {"key": key, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


@pytest.mark.slow  # Azurite takes 10-15 s to start on the 2-core machine
def test_the_tier_on_azurite_publishes_create_once_and_leases_one_builder(azurite, monkeypatch):
    for k, v in azurite.env().items():
        monkeypatch.setenv(k, v)
    _check_tier(f"az://{CONTAINER}/t-{time.monotonic_ns()}", "Azure Blob")


#: Why the gs:// test skips without a bucket named to it.
NO_GCS_EMULATOR = (
    "no GCS emulator installs here: fake-gcs-server is a Go program that neither PyPI, npm "
    "nor Debian ships, and PyPI's gcp-storage-emulator lacks the conditional writes "
    "(ifGenerationMatch) the tier's create-once publish and leases need; set "
    "KERNEL_CACHE_TEST_GCS_URL=gs://BUCKET/PREFIX, with the GOOGLE_* settings obstore "
    "reads, to run it against a bucket"
)


def test_the_tier_on_gcs_publishes_create_once_and_leases_one_builder():
    url = os.environ.get("KERNEL_CACHE_TEST_GCS_URL")
    if not url:
        pytest.skip(NO_GCS_EMULATOR)
    _check_tier(f"{url.rstrip('/')}/t-{time.monotonic_ns()}", "GCS")


def _check_tier(url: str, label: str) -> None:
    """Create-once entries, the manifest and the leases of the tier at ``url``."""
    tier = S3Tier(S3Settings(url=url, timeout_s=15), fail_open=False)
    assert tier.LABEL == label
    key, data, meta = _entry("a")
    assert tier.put(key, data, meta).outcome is PutOutcome.STORED
    _, other, other_meta = _entry("b")
    again = tier.put(key, other, {**other_meta, "key": key})
    assert again.outcome is PutOutcome.PRESENT and "create-once" in again.reason
    e = tier.get(key)
    verify_entry(e)
    assert e.data == data and tier.get_meta(key) == meta and tier.keys() == [key]
    assert tier.publish_manifest([key]).outcome is PutOutcome.STORED
    import obstore

    assert obstore.head(tier.store, manifest_name([key]))["size"] > 0

    # leases: If-None-Match to take, If-Match to take over an expired one and release
    a, b = tier, S3Tier(S3Settings(url=url, timeout_s=15))
    lease_key = "ef" * 32
    first = a.build_lock(lease_key, ttl_s=1.5)
    assert first.acquire(wait=False) == ACQUIRED
    assert b.build_lock(lease_key, ttl_s=1.5).acquire(wait=False) == BUSY
    first._stop.set()  # the holder stalls: its lease expires
    first._thread.join()
    time.sleep(2.0)
    second = b.build_lock(lease_key, ttl_s=30)
    assert second.acquire(wait=False) == ACQUIRED and second.holder() == second.token
    assert first._extend() is False  # the stalled holder's renewal is refused
    second.release()
    last = a.build_lock(lease_key)
    assert last.acquire(wait=False) == ACQUIRED  # released: free at once
    last.release()
    held = a.build_lock(key)
    assert held.acquire(wait=False) == ACQUIRED
    assert b.build_lock(key).acquire(wait=False) == PUBLISHED  # held, and the entry is there
    held.release()
