"""Signed artifacts: Ed25519 signatures over an entry's whole record and bytes.

Every entry a builder publishes carries, in its JSON metadata::

    "signature": {"alg": "ed25519", "key_id": <16 hex>, "sig": <base64, 64 bytes>,
                  "fields": {<field>: <8 hex>, ...}}

``sig`` is Ed25519 (RFC 8032, the ``cryptography`` package) over
``b"kernel-cache-entry-sig-v2\\0" + sha256(bytes) (64 hex) + b"\\0" +
canonical JSON of the record``, where the record is the whole metadata except
:data:`UNSIGNED_FIELDS` and the canonical JSON has sorted keys, ``","``/``":"``
separators and UTF-8 text. Every field load, ``verify``, ``ls``, ``explain``
and the CPU check read (``variant``, ``kernel``, ``components``,
``cpu_target``, ``cpu_features``, sizes, build options, and any field added
later) is covered without listing it. ``key_id`` is the first 16 hex of the
sha256 of the raw 32-byte public key. ``fields`` (a short digest per field of
the record) is diagnostic only: it lets a refusal name the field that changed;
the decision is the signature's.

An entry from an untrusted tier (``Tier.trusted is False``: Redis, S3,
bundles) is checked against the trusted keys: missing, unknown-key, malformed
or non-matching signatures are refused, logged and never loaded
(:func:`check_untrusted`); with no key set, only under
``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED``. The local disk cache is trusted: only
this machine's builds and entries that passed this check are written there,
and a copy of a shared entry keeps its signature and its ``imported_from``, so
it is checked again wherever keys are set.

The keys (who holds which, how they are read, the retired HMAC scheme) are
:mod:`kernel_cache.trust.keys`; docs/trust.md ("Signed artifacts") is the design.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernel_cache.errors import CorruptEntryError, describe_errors
from kernel_cache.trust.keys import (
    ENV_ALLOW_UNSIGNED,
    ENV_SIGNING_KEY_FILE,
    ENV_TRUSTED_KEYS,
    Keyring,
    Signer,
    allow_unsigned,
    load_trusted_keys,
)

ALGORITHM = "ed25519"
RETIRED_ALGORITHM = "hmac-sha256"

#: Fields left out of the signed record: the signature itself, a bundle's
#: ``file`` (``artifacts/<sha256>.pt2``, checked against the signed sha256 on
#: every read) and ``imported_from`` (a note the local cache adds to its copy;
#: nothing reads it).
UNSIGNED_FIELDS = frozenset({"signature", "file", "imported_from"})

_DOMAIN = b"kernel-cache-entry-sig-v2\0"


class SignatureError(CorruptEntryError):
    """An entry's signature is missing, by an untrusted key, malformed, or does
    not match its record and bytes. The entry is never loaded. ``signer``: the
    key id it names (``""``: unsigned or unreadable), so a caller reports one
    refusal per signer rather than one per entry."""

    def __init__(self, key: str, reason: str, where: str = "", signer: str = ""):
        super().__init__(key, reason, where)
        self.signer = signer
        loc = f" in {where}" if where else ""
        self.args = (f"cache entry {key[:16]}{loc} is untrusted: {self.reason}",)


class EntrySignature(BaseModel):
    """An entry's ``signature`` field: a builder's Ed25519 signature over the whole
    metadata record (all but ``signature``, ``file`` and ``imported_from``, as
    canonical JSON) and the artifact's sha256 (kernel_cache.trust.signing)."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    alg: Literal["ed25519"] = Field(description="signature algorithm (RFC 8032 Ed25519)")
    key_id: str = Field(
        pattern=r"^[0-9a-f]{16}$",
        description="first 16 hex of the sha256 of the signer's raw 32-byte public key",
    )
    sig: str = Field(
        description="base64 of the 64-byte Ed25519 signature over the domain tag, the "
        "artifact's sha256 (hex) and the canonical JSON of the record"
    )
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="diagnostic: first 8 hex of the sha256 of each signed field's canonical "
        "JSON, so a refusal can name the field that changed (not trusted for the decision)",
    )


# -- the signed bytes ----------------------------------------------------------------


def canonical_json(value) -> bytes:
    """Sorted keys, compact separators, UTF-8; NaN and infinities refused.

    Raises:
        ValueError: a NaN or infinite float.
    """
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def signed_record(meta: Mapping) -> dict:
    """The part of ``meta`` a signature covers: all but :data:`UNSIGNED_FIELDS`."""
    return {k: v for k, v in meta.items() if k not in UNSIGNED_FIELDS}


def payload(meta: Mapping, digest: str) -> bytes:
    """The bytes signed for a record ``meta`` and an artifact whose sha256 is
    ``digest`` (64 hex characters)."""
    return _DOMAIN + digest.encode("ascii") + b"\0" + canonical_json(signed_record(meta))


def field_digests(meta: Mapping) -> dict[str, str]:
    """``{field: first 8 hex of sha256(canonical JSON of its value)}`` of the
    signed record, plus ``"field.name"`` for each member of an object-valued
    field (``components.compile_options``), so a refusal can name the member."""
    out = {}
    for k, v in signed_record(meta).items():
        out[k] = _short_digest(v)
        if isinstance(v, dict):
            out.update({f"{k}.{n}": _short_digest(x) for n, x in v.items()})
    return out


def _short_digest(value) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()[:8]


# -- sign and check --------------------------------------------------------------------


def sign_meta(meta: dict, data: bytes, signer: Signer | None) -> dict:
    """``meta`` with a ``signature`` over its record and ``data`` by ``signer``;
    unchanged (a copy, any signature kept) when ``signer`` is None.

    Raises:
        ValueError: the record holds a NaN or infinite number.
    """
    out = dict(meta)
    if signer is not None:
        digest = hashlib.sha256(data).hexdigest()
        sig = signer.private.sign(payload(out, digest))
        out["signature"] = EntrySignature(
            alg=ALGORITHM,
            key_id=signer.key_id,
            sig=base64.b64encode(sig).decode("ascii"),
            fields=field_digests(out),
        ).model_dump()
    return out


def _what_changed(meta: Mapping, sig: EntrySignature, digest: str) -> str:
    """Which fields differ from what was signed, by the diagnostic digests."""
    if meta.get("sha256") != digest:
        return "the artifact bytes differ from the record's sha256"
    if not sig.fields:
        return ""
    try:
        have = field_digests(meta)
    except ValueError:  # NaN or infinity: not a record anyone signed
        return "a field holds NaN or infinity"
    changed = {
        name: "added" if name not in sig.fields else "removed" if name not in have else "changed"
        for name in have.keys() | sig.fields.keys()
        if have.get(name) != sig.fields.get(name)
    }

    # name the member that changed (components.cxx), not also the object holding
    # it; an object added or removed whole is named alone
    def shown(name: str) -> bool:
        if "." in name:
            return changed.get(name.split(".", 1)[0]) in (None, "changed")
        return not (changed[name] == "changed" and any(n.startswith(name + ".") for n in changed))

    return ", ".join(f"{n} {how}" for n, how in sorted(changed.items()) if shown(n))


def check_signature(
    key: str, meta: Mapping, data: bytes, keyring: Keyring, where: str = "", digest: str = ""
) -> None:
    """Check an entry's signature against the trusted ``keyring``. ``digest``: the
    sha256 (hex) of ``data`` where the caller has computed it (else hashed here).

    Raises:
        SignatureError: unsigned, signed with the retired HMAC scheme or by a key
            not in ``keyring``, malformed, or not matching the record and bytes
            (names the fields that changed where the diagnostic digests tell).
    """
    raw = meta.get("signature")
    if raw is None:
        raise SignatureError(
            key,
            f"unsigned, but trusted keys are set ({ENV_TRUSTED_KEYS}): only entries "
            "signed by a trusted key are loaded",
            where,
        )
    if isinstance(raw, dict) and raw.get("alg") == RETIRED_ALGORITHM:
        raise SignatureError(
            key,
            "signed with the retired HMAC scheme (hmac-sha256); publish it again from a "
            f"builder holding {ENV_SIGNING_KEY_FILE} (kernel-cache warmup --redis-url, "
            "or kernel-cache export for a bundle)",
            where,
        )
    try:
        sig = EntrySignature.model_validate(raw)
        signature = base64.b64decode(sig.sig, validate=True)
    except ValidationError as e:
        raise SignatureError(key, f"malformed signature: {describe_errors(e)}", where) from None
    except (binascii.Error, ValueError):
        raise SignatureError(key, "malformed signature: sig is not base64", where) from None
    signer = sig.key_id
    public = keyring.keys.get(sig.key_id)
    if public is None:
        raise SignatureError(
            key,
            f"signed by key {sig.key_id}, which is not trusted (trusted: {keyring.describe()}; "
            f"add its public key to {ENV_TRUSTED_KEYS} to accept it)",
            where,
            signer,
        )
    from cryptography.exceptions import InvalidSignature

    digest = digest or hashlib.sha256(data).hexdigest()
    try:
        public.verify(signature, payload(meta, digest))
        return
    except (InvalidSignature, ValueError):
        pass
    changed = _what_changed(meta, sig, digest)
    if changed:
        reason = f"metadata record altered since it was signed ({changed})"
    else:
        reason = "signature does not match the record and bytes (forged or altered)"
    raise SignatureError(key, f"{reason}; signature by key {sig.key_id} refused", where, signer)


def check_untrusted(
    entry, keyring: Keyring | None = None, environ=None, *, digest: str = ""
) -> None:
    """The check every entry from an untrusted tier (and every local copy of
    one: ``imported_from``) passes before it is used.

    ``keyring`` defaults to :func:`load_trusted_keys`. With no key set the
    entry is refused, unless ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED`` is set
    (then the checksum is its only check). ``entry`` is a
    :class:`kernel_cache.store.disk_tier.Entry`; ``digest`` the sha256 of its
    bytes as :func:`~kernel_cache.store.disk_tier.verify_entry` returned it
    (else hashed here).

    Raises:
        SignatureError: see :func:`check_signature`; or no key is set and the
            opt-out is not.
        SigningKeyError: see :func:`load_trusted_keys`.
    """
    if keyring is None:
        keyring = load_trusted_keys(environ, required=False)
    if keyring is not None:
        check_signature(entry.key, entry.meta, entry.data, keyring, entry.where, digest)
    elif not allow_unsigned(environ):
        raise SignatureError(
            entry.key,
            f"no key is set to check its signature (set {ENV_TRUSTED_KEYS}, or "
            f"{ENV_ALLOW_UNSIGNED}=1 to load unsigned entries)",
            entry.where,
        )


def may_publish(meta: Mapping, data: bytes, environ=None) -> bool:
    """Whether an entry (signed or not, as it is) may go to a shared tier: only
    if the trusted keys accept it (a node without the private key never
    publishes what the fleet would refuse); with no key set, only under
    ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED`` (an unsigned fleet)."""
    keyring = load_trusted_keys(environ, required=False)
    if keyring is None:
        return allow_unsigned(environ)
    try:
        check_signature(str(meta.get("key", "")), meta, data, keyring)
    except SignatureError:
        return False
    return True
