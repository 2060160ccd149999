"""Signed artifacts: Ed25519 signatures over an entry's whole record and bytes.

Who can write what. A builder holds the private key
(``KERNEL_CACHE_SIGNING_KEY_FILE``, made by ``kernel-cache keygen``) and signs
every entry it publishes to Redis or exports to a bundle. Engines hold only
public keys (``KERNEL_CACHE_TRUSTED_KEYS``) and hold no secret: a compromised
engine can read the fleet's artifacts but cannot make one the fleet accepts.
Several trusted keys let a fleet rotate (sign with the new key, trust both,
then drop the old one). A builder's own public key is trusted too.

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
or non-matching signatures are refused, logged and never loaded. A shared
tier with no key set is refused up front (:func:`shared_keyring`, naming
``kernel-cache keygen`` and both variables) unless the one insecure opt-out,
``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED``, is set. The local disk cache is
trusted: only this machine's builds and entries that passed this check are
written there, and a copy of a shared entry keeps its signature and its
``imported_from``, so it is checked again wherever keys are set.

HMAC signing (``KERNEL_CACHE_SIGNING_KEY``, ``alg: hmac-sha256``) is retired:
every engine needed the secret that signs, so any engine could publish code the
fleet runs. Setting it is a :class:`SigningKeyError` that says how to migrate;
see docs/trust.md ("Signed artifacts").
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernel_cache.config import settings
from kernel_cache.errors import ConfigError, CorruptEntryError, describe_errors

ENV_SIGNING_KEY = settings.var("signing_key")  # retired (HMAC)
ENV_SIGNING_KEY_FILE = settings.var("signing_key_file")
ENV_TRUSTED_KEYS = settings.var("trusted_keys")
ENV_REQUIRE_SIGNED = settings.var("require_signed")
ENV_ALLOW_UNSIGNED = settings.var("insecure_allow_unsigned")

ALGORITHM = "ed25519"
RETIRED_ALGORITHM = "hmac-sha256"

#: Fields left out of the signed record: the signature itself, a bundle's
#: ``file`` (``artifacts/<sha256>.pt2``, checked against the signed sha256 on
#: every read) and ``imported_from`` (a note the local cache adds to its copy;
#: nothing reads it).
UNSIGNED_FIELDS = frozenset({"signature", "file", "imported_from"})

PRIVATE_NAME = "signing.key"
PUBLIC_NAME = "signing.pub"

_DOMAIN = b"kernel-cache-entry-sig-v2\0"
_KEYGEN = "kernel-cache keygen DIR"
_MIGRATE = (
    f"make a key pair with {_KEYGEN}; builders set {ENV_SIGNING_KEY_FILE}=DIR/{PRIVATE_NAME}, "
    f"engines set {ENV_TRUSTED_KEYS}=DIR/{PUBLIC_NAME} (see the README, Trust)"
)

log = logging.getLogger("kernel_cache")


class SigningKeyError(ConfigError):
    """A key setting is wrong: a key file unreadable or not an Ed25519 key, the
    retired HMAC secret set, none set while required, or keygen refusing to
    overwrite a key."""


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


@dataclass(frozen=True)
class Signer:
    """A builder's private key (read from ``path``) and its key id."""

    private: object  # cryptography Ed25519PrivateKey
    key_id: str
    path: str

    @property
    def public(self):
        return self.private.public_key()


@dataclass(frozen=True)
class Keyring:
    """The public keys entries of untrusted tiers must be signed with:
    ``{key id: Ed25519PublicKey}`` and where each came from."""

    keys: dict = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return ", ".join(f"{k} ({self.sources[k]})" for k in self.keys)


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


def key_id(public) -> str:
    """16 hex characters naming an Ed25519 public key (sha256 of its raw 32 bytes)."""
    from cryptography.hazmat.primitives import serialization

    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


# -- keys from the environment ----------------------------------------------------


def _setting(name: str, environ: Mapping[str, str] | None):
    """:func:`kernel_cache.config.settings.get`, its error as a :class:`SigningKeyError`
    (a misspelt ``KERNEL_CACHE_REQUIRE_SIGNED`` must not mean "off")."""
    try:
        return settings.get(name, environ)
    except ConfigError as e:
        raise SigningKeyError(str(e)) from None


def _refuse_retired(environ: Mapping[str, str] | None) -> None:
    """Raises SigningKeyError: the retired HMAC secret is set."""
    if settings.is_set("signing_key", environ):
        raise SigningKeyError(
            f"{ENV_SIGNING_KEY} is set, but HMAC signing is retired: a shared secret lets "
            "every engine that holds it sign code the whole fleet runs. Unset it and "
            f"migrate to public-key signatures: {_MIGRATE}"
        )


_warned_paths: set[str] = set()


def _warn_if_shared(path: str, mode: int) -> None:
    """Warn once per file when the private key is readable by group or others:
    whoever can read it can sign artifacts the fleet will load."""
    if mode & 0o077 and path not in _warned_paths:
        _warned_paths.add(path)
        log.warning(
            "%s=%s is readable by group or others (mode %04o): anyone who can read "
            "it can sign artifacts; chmod 600 it",
            ENV_SIGNING_KEY_FILE,
            path,
            mode,
        )


def _warn_if_writable(path: str, mode: int) -> None:
    """Warn once per file when a trusted public key is writable by group or
    others: whoever can write it can swap in their own key and sign code the
    engine then loads."""
    if mode & 0o022 and path not in _warned_paths:
        _warned_paths.add(path)
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if mode & bit)
        log.warning(
            "%s: %s is writable by %s (mode %04o): anyone who can write it can replace "
            "the key and have engines load code they sign; chmod go-w it",
            ENV_TRUSTED_KEYS,
            path,
            who,
            mode,
        )


#: The largest key file read (bytes): a PEM Ed25519 key is about 120.
KEY_FILE_LIMIT = 64 * 1024


def _read(path: Path, variable: str) -> tuple[bytes, os.stat_result]:
    """The bytes and status of key file ``path``: a regular file of at most
    :data:`KEY_FILE_LIMIT` bytes, opened non-blocking, so a FIFO or a device
    (``/dev/zero``) is refused at once instead of hanging engine start or
    filling memory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                why = "not a regular file (a FIFO, device or directory is never read)"
            elif st.st_size > KEY_FILE_LIMIT:
                why = f"{st.st_size} bytes, above the {KEY_FILE_LIMIT}-byte limit for a key"
            else:
                return f.read(KEY_FILE_LIMIT + 1), st
    except OSError as e:
        why = f"cannot read it ({e.strerror or e})"
    raise SigningKeyError(f"{variable}={path}: {why}; point it at the file {_KEYGEN} wrote")


@functools.lru_cache(maxsize=64)
def _parse_private(data: bytes, source: str):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise SigningKeyError(
            f"{source}: the private key is encrypted; kernel-cache reads an unencrypted "
            f"PEM PKCS#8 key (chmod 600 protects it), as {_KEYGEN} writes"
        ) from None
    except ValueError as e:
        raise SigningKeyError(
            f"{source}: not a PEM Ed25519 private key ({e}). HMAC secrets are retired; {_MIGRATE}"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(
            f"{source}: a {type(key).__name__}, not an Ed25519 private key; {_MIGRATE}"
        )
    return key


@functools.lru_cache(maxsize=64)
def _parse_public(data: bytes, source: str):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if b"PRIVATE KEY" in data:
        raise SigningKeyError(
            f"{source}: holds a private key; engines get only the public key "
            f"({PUBLIC_NAME}): whoever holds the private key can sign artifacts"
        )
    if (blocks := data.count(b"-----BEGIN ")) > 1:  # the loader reads the first alone
        raise SigningKeyError(
            f"{source}: holds {blocks} PEM blocks, but a key file holds one key; put each "
            f"builder's {PUBLIC_NAME} in its own file and list them ','-separated"
        )
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as e:
        raise SigningKeyError(
            f"{source}: not a PEM public key ({e}); give the {PUBLIC_NAME} that {_KEYGEN} wrote"
        ) from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"{source}: a {type(key).__name__}, not an Ed25519 public key")
    return key


def load_signer(environ: Mapping[str, str] | None = None) -> Signer | None:
    """The builder's private key from ``KERNEL_CACHE_SIGNING_KEY_FILE``, or None.

    Raises:
        SigningKeyError: the retired ``KERNEL_CACHE_SIGNING_KEY`` is set, or the
            file cannot be read or is not an unencrypted PEM Ed25519 private key.
    """
    _refuse_retired(environ)
    path = _setting("signing_key_file", environ)
    if path is None:
        return None
    data, st = _read(path, ENV_SIGNING_KEY_FILE)
    if b"PUBLIC KEY" in data and b"PRIVATE KEY" not in data:
        raise SigningKeyError(
            f"{ENV_SIGNING_KEY_FILE}={path}: holds a public key, which cannot sign; builders "
            f"set it to the private key ({PRIVATE_NAME} beside it, from {_KEYGEN}); the "
            f"public key goes in {ENV_TRUSTED_KEYS} on engines"
        )
    key = _parse_private(data, f"{ENV_SIGNING_KEY_FILE}={path}")
    _warn_if_shared(str(path), st.st_mode & 0o777)
    return Signer(key, key_id(key.public_key()), str(path))


def load_trusted_keys(
    environ: Mapping[str, str] | None = None, *, required: bool | None = None
) -> Keyring | None:
    """The keys entries of untrusted tiers must be signed with: every file of
    ``KERNEL_CACHE_TRUSTED_KEYS`` plus the builder's own public key; None when
    neither is set (then a shared tier is refused, unless the insecure
    opt-out is set: :func:`shared_keyring`).

    Args:
        environ: defaults to :data:`os.environ`.
        required: raise when no key is set; None reads ``KERNEL_CACHE_REQUIRE_SIGNED``.

    Raises:
        SigningKeyError: see :func:`load_signer`; a trusted-key file cannot be
            read or is not a PEM Ed25519 public key; none is set while required;
            ``KERNEL_CACHE_TRUSTED_KEYS`` holds only commas and blanks.
    """
    if required is None:
        required = _setting("require_signed", environ)
    raw = (os.environ if environ is None else environ).get(ENV_TRUSTED_KEYS)
    if raw is not None and raw.strip() and not raw.replace(",", "").strip():
        # separators only ("," from a template that did not fill in) would
        # otherwise turn every signature check off without a word; blank is
        # unset, as for every variable
        raise SigningKeyError(
            f"{ENV_TRUSTED_KEYS}={raw!r} names no public key file, so no signature would be "
            f"checked; fix: set it to the builders' public keys (DIR/{PUBLIC_NAME}, "
            "','-separated)"
        )
    ring = Keyring()
    for path in _setting("trusted_keys", environ):
        data, st = _read(path, ENV_TRUSTED_KEYS)
        _warn_if_writable(str(path), stat.S_IMODE(st.st_mode))
        key = _parse_public(data, f"{ENV_TRUSTED_KEYS}: {path}")
        kid = key_id(key)
        ring.keys.setdefault(kid, key)
        ring.sources.setdefault(kid, str(path))
    signer = load_signer(environ)
    if signer is not None:
        ring.keys.setdefault(signer.key_id, signer.public)
        ring.sources.setdefault(signer.key_id, f"{signer.path}, this builder's own")
    if ring.keys:
        return ring
    if required:
        raise SigningKeyError(
            f"signed artifacts are required (--require-signed or {ENV_REQUIRE_SIGNED}) but "
            f"no key is set to check them: set {ENV_TRUSTED_KEYS}=DIR/{PUBLIC_NAME} (engines) "
            f"or {ENV_SIGNING_KEY_FILE}=DIR/{PRIVATE_NAME} (builders); make a pair with {_KEYGEN}"
        )
    return None


def allow_unsigned(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the insecure opt-out ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED`` is set.

    Raises:
        SigningKeyError: it does not read as a boolean.
    """
    return bool(_setting("insecure_allow_unsigned", environ))


def no_key_message(shared: Sequence[str]) -> str:
    """Why a shared tier (its locations ``shared``) is refused with no key set,
    and the two fixes: keys, or the insecure opt-out."""
    return (
        f"{', '.join(shared)}: a shared tier, and its entries load only with a valid "
        "signature, but no key to check one is set. Make a key pair with "
        f"`{_KEYGEN}`, then set {ENV_TRUSTED_KEYS}=DIR/{PUBLIC_NAME} on engines and "
        f"{ENV_SIGNING_KEY_FILE}=DIR/{PRIVATE_NAME} on builders (docs/trust.md). To load "
        f"and publish unsigned entries instead, set {ENV_ALLOW_UNSIGNED}=1 "
        "(--insecure-allow-unsigned): anyone who can write the shared store can then run "
        "code on every engine"
    )


def shared_keyring(
    shared: Sequence[str], environ: Mapping[str, str] | None = None
) -> Keyring | None:
    """The keys entries of the shared tiers ``shared`` (their locations) are
    checked with: :func:`load_trusted_keys`. None when no key is set and
    either ``shared`` is empty or ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED`` is set.

    Raises:
        SigningKeyError: ``shared`` is not empty, no key is set and the opt-out
            is not (:func:`no_key_message`); or see :func:`load_trusted_keys`.
    """
    keyring = load_trusted_keys(environ)
    if keyring is None and shared and not allow_unsigned(environ):
        raise SigningKeyError(no_key_message(shared))
    return keyring


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
