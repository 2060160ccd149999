"""Text an untrusted store controls (a signature's diagnostic field names)
never reaches a log line or an error's text unescaped."""

from __future__ import annotations

import hashlib

import pytest

from kernel_cache.trust.signing import (
    ENV_TRUSTED_KEYS,
    SignatureError,
    check_signature,
    load_trusted_keys,
    sign_meta,
)

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
