"""The signing keys: a builder's private key, the public keys engines trust,
and the settings that name them.

Who can write what. A builder holds the private key
(``KERNEL_CACHE_SIGNING_KEY_FILE``, made by ``kernel-cache keygen``) and signs
every entry it publishes to Redis or exports to a bundle
(:mod:`kernel_cache.trust.signing`). Engines hold only public keys
(``KERNEL_CACHE_TRUSTED_KEYS``) and hold no secret: a compromised engine can
read the fleet's artifacts but cannot make one the fleet accepts. Several
trusted keys let a fleet rotate (sign with the new key, trust both, then drop
the old one). A builder's own public key is trusted too. ``key_id`` is the
first 16 hex of the sha256 of the raw 32-byte public key.

Key files are read bounded (:data:`KEY_FILE_LIMIT`) and without blocking, and
a private key readable, or a public key writable, by group or others is
warned about once. A shared tier with no key set is refused up front
(:func:`shared_keyring`, naming ``kernel-cache keygen`` and both variables)
unless the one insecure opt-out, ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED``, is set.

HMAC signing (``KERNEL_CACHE_SIGNING_KEY``) is retired: every engine needed
the secret that signs, so any engine could publish code the fleet runs.
Setting it is a :class:`SigningKeyError` that says how to migrate; see
docs/trust.md ("Signed artifacts").
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kernel_cache.config import settings
from kernel_cache.errors import ConfigError

ENV_SIGNING_KEY = settings.var("signing_key")  # retired (HMAC)
ENV_SIGNING_KEY_FILE = settings.var("signing_key_file")
ENV_TRUSTED_KEYS = settings.var("trusted_keys")
ENV_REQUIRE_SIGNED = settings.var("require_signed")
ENV_ALLOW_UNSIGNED = settings.var("insecure_allow_unsigned")

PRIVATE_NAME = "signing.key"
PUBLIC_NAME = "signing.pub"

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


def key_id(public) -> str:
    """16 hex characters naming an Ed25519 public key (sha256 of its raw 32 bytes)."""
    from cryptography.hazmat.primitives import serialization

    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


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
