"""What a writer of a shared store plants is reported truthfully: text it
controls (a signature's diagnostic field names) never reaches a log line or an
error unescaped, and an oversized object is refused with the limit that applies."""

from __future__ import annotations

import hashlib

import pytest

from kernel_cache.trust.keys import ENV_TRUSTED_KEYS, load_trusted_keys
from kernel_cache.trust.signing import SignatureError, check_signature, sign_meta

from ..signing_keys import make_keypair


def test_a_planted_field_name_in_a_signature_is_escaped_in_the_refusal(tmp_path):
    pair = make_keypair(tmp_path / "a")
    ring = load_trusted_keys({ENV_TRUSTED_KEYS: str(pair.public)})
    data = b"artifact bytes"
    record = {"key": "k" * 64, "sha256": hashlib.sha256(data).hexdigest(), "cpu_target": "v3"}
    meta = sign_meta(record, data, pair.signer)
    # a writer of the store alters a field and plants a diagnostic digest whose
    # name carries an ANSI escape and a newline (a forged log line)
    planted = "cpu\x1b[31m_target\nWARNING forged line"
    meta["cpu_target"] = "x86-64"
    meta["signature"] = {**meta["signature"], "fields": {planted: "00000000"}}
    with pytest.raises(SignatureError) as info:
        check_signature(meta["key"], meta, data, ring, "file:///shared")
    text = str(info.value)
    assert "\x1b" not in text and "\n" not in text, text
    assert "\\x1b" in text and "\\n" in text  # still named, escaped


def test_an_oversized_manifest_is_refused_with_the_manifest_limit_not_the_entry_one(
    tmp_path, caplog
):
    import logging

    from kernel_cache.store.s3 import S3Settings, S3Tier
    from kernel_cache.store.s3_objects import manifest_limit, manifest_name

    keys = [f"{i:064x}" for i in range(3)]
    path = tmp_path / manifest_name(keys)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: a planted 1 GiB manifest
    tier = S3Tier(S3Settings(url=f"file://{tmp_path}", timeout_s=15))
    tier.expect(keys)
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        assert tier.get(keys[0]) is None
    tier.close()
    (msg,) = [r.getMessage() for r in caplog.records if "manifest" in r.getMessage()]
    assert f"over the limit of {manifest_limit(3)}" in msg and str(1 << 30) in msg
    # raising the entry limit would not change the manifest's: the advice must not say so
    assert "S3_MAX_OBJECT" not in msg and "raise the limit" not in msg, msg
    assert "remove it" in msg


def test_a_public_key_given_as_the_signing_key_is_named_as_such_without_a_mode_warning(
    tmp_path, caplog
):
    import logging

    from kernel_cache.trust.keys import ENV_SIGNING_KEY_FILE, SigningKeyError, load_signer

    pair = make_keypair(tmp_path / "a")
    pair.public.chmod(0o644)  # as keygen writes it: a public key is meant to be read
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        with pytest.raises(SigningKeyError) as info:
            load_signer({ENV_SIGNING_KEY_FILE: str(pair.public)})
    assert "public key" in str(info.value) and "signing.key" in str(info.value)
    assert "HMAC" not in str(info.value)
    assert not [r for r in caplog.records if "readable by group" in r.getMessage()]


def test_a_planted_odd_name_in_a_shared_index_does_not_take_the_tier_down(tmp_path, caplog):
    import logging

    from kernel_cache.store.s3 import S3Settings, S3Tier

    value = "ab" * 32
    index = tmp_path / "index" / "runtime" / value
    index.mkdir(parents=True)
    (index / "evil\x1b[31m\nFAKE").touch()  # a name the object store's paths refuse
    tier = S3Tier(S3Settings(url=f"file://{tmp_path}", timeout_s=15))
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        assert tier.metas_by("runtime", lambda m: m.get("key"))(value) == []
    # the rest of the tier is still read: one planted name is no outage
    assert not tier.is_down()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "\x1b" not in text and "index/runtime" in text, text
    tier.close()


def test_a_folder_planted_as_a_lease_generation_is_taken_over_not_an_outage(tmp_path):
    from kernel_cache.store.s3 import S3Settings, S3Tier

    key = "ab" * 32
    (tmp_path / "leases" / key / f"{99:020d}").mkdir(parents=True)  # not a lease file
    tier = S3Tier(S3Settings(url=f"file://{tmp_path}", timeout_s=15))
    lease = tier.build_lock(key, 5, 2)
    assert lease.acquire(wait=False) != "unavailable"
    assert not tier.is_down()
    lease.release()
    tier.close()


def test_a_folder_planted_as_a_plan_manifest_is_no_outage_for_the_builder(tmp_path):
    from kernel_cache.store.s3 import S3Settings, S3Tier
    from kernel_cache.store.s3_objects import manifest_name

    tier = S3Tier(S3Settings(url=f"file://{tmp_path}", timeout_s=15))
    keys = ["ab" * 32]
    (tmp_path / manifest_name(keys)).mkdir(parents=True)
    tier._renew(manifest_name(keys), b"{}")  # what publish_manifest does to a present one
    assert not tier.is_down()
    tier.close()


def test_two_public_keys_in_one_file_are_refused_not_one_silently_dropped(tmp_path):
    from kernel_cache.trust.keys import SigningKeyError

    a, b = make_keypair(tmp_path / "a"), make_keypair(tmp_path / "b")
    both = tmp_path / "both.pub"  # as one would for rotation, authorized_keys-style
    both.write_bytes(a.public.read_bytes() + b.public.read_bytes())
    with pytest.raises(SigningKeyError, match="2 PEM blocks") as info:
        load_trusted_keys({ENV_TRUSTED_KEYS: str(both)})
    assert "','-separated" in str(info.value)


def test_a_trusted_key_file_others_can_write_is_warned_about(tmp_path, caplog):
    import logging

    pair = make_keypair(tmp_path / "a")
    pair.public.chmod(0o666)  # anyone on the host could swap in their own key
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        load_trusted_keys({ENV_TRUSTED_KEYS: str(pair.public)})
    (msg,) = [r.getMessage() for r in caplog.records if str(pair.public) in r.getMessage()]
    assert "writable by group and others (mode 0666)" in msg and "chmod go-w" in msg


def test_a_folder_planted_as_an_entry_makes_its_publish_fail_not_pass_as_present(tmp_path):
    from kernel_cache.store.disk_tier import PutOutcome
    from kernel_cache.store.s3 import S3Settings, S3Tier

    key = "ab" * 32
    (tmp_path / "entries" / key).mkdir(parents=True)
    tier = S3Tier(S3Settings(url=f"file://{tmp_path}", timeout_s=15))
    data = b"artifact bytes"
    result = tier.put(key, data, {"key": key, "sha256": hashlib.sha256(data).hexdigest()})
    # engines cannot load it, so --require-publish must not count it as published
    assert result.outcome is PutOutcome.FAILED, result
    assert f"entries/{key}" in result.reason and "remove it" in result.reason
    assert not tier.is_down()
    tier.close()
