"""Signed artifacts: key loading, HMAC checks, and rejection by untrusted tiers."""

import json
import logging
import shutil

import pytest

from kernel_cache import load_plan
from kernel_cache.errors import CorruptEntryError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.store.bundle import MANIFEST, export_bundle, import_bundle
from kernel_cache.store.lookup import Lookup, Source
from kernel_cache.store.tier import DiskTier, make_meta
from kernel_cache.trust.signing import (
    ENV_REQUIRE_SIGNED,
    ENV_SIGNING_KEY,
    ENV_SIGNING_KEY_FILE,
    SignatureError,
    SigningKeyError,
    check_signature,
    key_id,
    load_signing_key,
    mac,
    sign_meta,
)

from .conftest import run_cli, tiny_args

SECRET = b"0123456789abcdef-test-secret"
OTHER = b"fedcba9876543210-other-secret"


class SharedDisk(DiskTier):
    """A real disk tier named "shared" in reports; the lookup gives it Redis's
    policy (:func:`_as_shared`), so Lookup's rules are tested without Redis."""

    name = "shared"


def _as_shared(tier, **policy) -> Source:
    """``tier`` as a shared store: untrusted, a bad entry is a miss."""
    return Source(tier, trusted=False, corrupt_is_miss=True, **policy)


def _signed(tiny_config, secret=SECRET, index=0, data=b"artifact bytes " * 8000):
    key = build_key(tiny_config, Bucketer(tiny_config).variants[index])
    meta = sign_meta(make_meta(key, "v", data, 1.0), data, secret)
    return key.hexdigest, data, meta


def _ckey(tiny_config, index=0):
    return build_key(tiny_config, Bucketer(tiny_config).variants[index])


def test_no_key_is_none_and_required_is_an_error_naming_both_variables():
    assert load_signing_key({}) is None
    with pytest.raises(SigningKeyError, match=f"{ENV_SIGNING_KEY}.*{ENV_SIGNING_KEY_FILE}"):
        load_signing_key({}, required=True)
    with pytest.raises(SigningKeyError, match="required"):
        load_signing_key({ENV_REQUIRE_SIGNED: "1"})


def test_key_from_env_or_file(tmp_path):
    assert load_signing_key({ENV_SIGNING_KEY: SECRET.decode()}) == SECRET
    f = tmp_path / "key"
    f.write_bytes(SECRET + b"\n")
    f.chmod(0o600)
    assert load_signing_key({ENV_SIGNING_KEY_FILE: str(f)}) == SECRET


def test_a_key_file_others_can_read_is_warned_about_once(tmp_path, caplog):
    f = tmp_path / "shared-key"
    f.write_bytes(SECRET)
    f.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        for _ in range(3):
            assert load_signing_key({ENV_SIGNING_KEY_FILE: str(f)}) == SECRET
    msgs = [r.getMessage() for r in caplog.records]
    warned = [m for m in msgs if "readable by group or others" in m]
    assert len(warned) == 1 and "mode 0644" in warned[0] and "chmod 600" in warned[0]


@pytest.mark.parametrize(
    "environ,match",
    [
        ({ENV_SIGNING_KEY: "short"}, "5 bytes, below the minimum of 16"),
        ({ENV_SIGNING_KEY: SECRET.decode(), ENV_SIGNING_KEY_FILE: "/x"}, "set only one"),
        ({ENV_SIGNING_KEY_FILE: "/nonexistent/kernel-cache-key"}, "cannot read it"),
    ],
)
def test_bad_key_settings_are_clear_errors(environ, match):
    with pytest.raises(SigningKeyError, match=match):
        load_signing_key(environ)


def test_signature_roundtrip_and_each_kind_of_rejection(tiny_config):
    key, data, meta = _signed(tiny_config)
    assert meta["signature"]["alg"] == "hmac-sha256"
    assert meta["signature"]["key_id"] == key_id(SECRET) != key_id(OTHER)
    check_signature(key, meta, data, SECRET)
    with pytest.raises(SignatureError, match="another key"):
        check_signature(key, meta, data, OTHER)
    unsigned = {k: v for k, v in meta.items() if k != "signature"}
    with pytest.raises(SignatureError, match="unsigned"):
        check_signature(key, unsigned, data, SECRET)
    with pytest.raises(SignatureError, match="forged or altered"):
        check_signature(key, meta, data[:-1] + b"!", SECRET)
    other_key = _signed(tiny_config, index=1)[0]
    with pytest.raises(SignatureError, match="forged or altered"):  # moved to another key
        check_signature(other_key, {**meta, "key": other_key}, data, SECRET)
    assert isinstance(SignatureError(key, "x"), CorruptEntryError)


def test_untrusted_tier_forged_entry_rejected_logged_not_promoted(
    tiny_config, tmp_path, monkeypatch, caplog
):
    """Right key, right checksum, wrong signature: never returned, never copied."""
    monkeypatch.setenv(ENV_SIGNING_KEY, SECRET.decode())
    local, shared = DiskTier(tmp_path / "local"), SharedDisk(tmp_path / "shared")
    promoted = _as_shared(shared, promote_into=local)  # the lookup's policy, not the tier's
    key, data, meta = _signed(tiny_config)
    forged_data = b"malicious package " * 8000
    forged = make_meta(_ckey(tiny_config), "v", forged_data, 1)
    forged["signature"] = {**meta["signature"], "mac": mac(OTHER, key, forged_data)}
    shared.put(key, forged_data, forged)
    lookup = Lookup([local, promoted])
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        assert lookup.find(_ckey(tiny_config)) is None
    assert "rejected shared entry" in caplog.text and "forged or altered" in caplog.text
    assert len(lookup.rejected) == 1 and isinstance(lookup.rejected[0], SignatureError)
    assert local.get(key) is None

    shared.put(key, data, meta)  # the genuine signed entry is used and promoted
    found = Lookup([local, promoted]).find(_ckey(tiny_config))
    assert found.entry.data == data and found.tier is shared and found.promoted.stored
    assert local.get(key).data == data and local.get(key).meta["signature"] == meta["signature"]
    assert Lookup([local, promoted]).find(_ckey(tiny_config)).tier is local


def test_untrusted_tier_without_key_checks_checksum_only(tiny_config, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_SIGNING_KEY, raising=False)
    monkeypatch.delenv(ENV_SIGNING_KEY_FILE, raising=False)
    shared = SharedDisk(tmp_path / "shared")
    key, data, meta = _signed(tiny_config, secret=None)
    assert "signature" not in meta
    shared.put(key, data, meta)
    assert Lookup([_as_shared(shared)]).find(_ckey(tiny_config)).entry.data == data
    shared.put(key, data + b"x", meta)  # wrong size: rejected as a miss, not raised
    lookup = Lookup([_as_shared(shared)])
    assert lookup.find(_ckey(tiny_config)) is None and "size" in lookup.rejected[0].reason


def test_signed_bundle_loads_and_a_forged_one_is_refused(
    warm_cache, tiny_config, tmp_path, monkeypatch
):
    """Bundles are untrusted too: exported signed; a wrong MAC in the manifest
    makes engine start and import refuse that entry (a bundle error, not a miss)."""
    monkeypatch.setenv(ENV_SIGNING_KEY, SECRET.decode())
    out = tmp_path / "bundle"
    export_bundle(tiny_config, out, [DiskTier(warm_cache[0])])
    doc = json.loads((out / MANIFEST).read_text())
    assert all(e["signature"]["key_id"] == key_id(SECRET) for e in doc["entries"])
    assert load_plan(tiny_config, tmp_path / "none", bundles=[out]).stats()["loads"] == 6

    forged = tmp_path / "forged"
    shutil.copytree(out, forged)
    for p in [forged, *forged.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    victim = doc["entries"][0]
    victim["signature"]["mac"] = mac(OTHER, victim["key"], b"anything")
    (forged / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(CorruptEntryError, match="forged or altered") as e:
        load_plan(tiny_config, tmp_path / "none", bundles=[forged])
    assert "export the bundle again" in str(e.value)
    with pytest.raises(SignatureError):
        import_bundle(forged, DiskTier(tmp_path / "imported"))
    monkeypatch.setenv(ENV_SIGNING_KEY, OTHER.decode())  # another fleet's key: all refused
    with pytest.raises(CorruptEntryError, match="another key"):
        load_plan(tiny_config, tmp_path / "none", bundles=[out])


def test_require_signed_without_key_fails_at_start(tiny_model, tmp_path):
    env = {ENV_SIGNING_KEY: "", ENV_SIGNING_KEY_FILE: ""}
    for cmd in ("warmup", "verify"):
        proc = run_cli(
            cmd, *tiny_args(tiny_model), "--cache-dir", tmp_path, "--require-signed", env=env
        )
        assert proc.returncode == 2, proc.stderr
        assert "--require-signed" in proc.stderr and ENV_SIGNING_KEY in proc.stderr
    assert list(tmp_path.iterdir()) == []  # failed before touching the cache


def test_a_misspelt_require_signed_is_an_error_not_off():
    from kernel_cache.trust.signing import ENV_REQUIRE_SIGNED, SigningKeyError, load_signing_key

    for value in ("1", "yes", "on"):
        with pytest.raises(SigningKeyError, match="required"):
            load_signing_key({ENV_REQUIRE_SIGNED: value})
    assert load_signing_key({ENV_REQUIRE_SIGNED: "0"}) is None
    with pytest.raises(SigningKeyError, match=f"{ENV_REQUIRE_SIGNED}='ture'"):
        load_signing_key({ENV_REQUIRE_SIGNED: "ture"})
