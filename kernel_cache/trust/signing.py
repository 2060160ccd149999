"""Signed artifacts: an HMAC-SHA256 over an entry's cache key and bytes.

A shared store (Redis, a bundle copied between machines) is writable by more
parties than the machine that loads from it. With a signing key set, every
entry a builder publishes carries::

    "signature": {"alg": "hmac-sha256", "key_id": <16 hex>, "mac": <64 hex>}

in its JSON metadata, where ``mac = HMAC-SHA256(secret, b"kernel-cache-sig-v1\\0"
+ key + b"\\0" + bytes)`` (stdlib :mod:`hmac`, RFC 2104) and ``key_id`` is
``HMAC-SHA256(secret, b"kernel-cache-key-id")`` cut to 16 hex characters (it
names which secret signed an entry without revealing it). A reader holding the
same secret recomputes the MAC; an entry from an untrusted tier (``Tier.trusted
is False``: Redis, bundles) whose signature is missing or wrong is rejected,
logged and never loaded. The local disk cache is trusted: it is written only by
this machine's builds and by entries that already passed this check.

The secret comes from ``KERNEL_CACHE_SIGNING_KEY`` (the secret itself) or
``KERNEL_CACHE_SIGNING_KEY_FILE`` (a file holding it; surrounding whitespace is
stripped), never both. It must be at least :data:`MIN_KEY_BYTES` bytes.
``KERNEL_CACHE_REQUIRE_SIGNED=1`` (``--require-signed``) makes a missing secret
an error at start rather than a silent fall-back to unsigned entries.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from kernel_cache.config import settings
from kernel_cache.errors import ConfigError, CorruptEntryError, KernelCacheError

ENV_SIGNING_KEY = settings.var("signing_key")
ENV_SIGNING_KEY_FILE = settings.var("signing_key_file")
ENV_REQUIRE_SIGNED = settings.var("require_signed")

ALGORITHM = "hmac-sha256"

#: 16 bytes (128 bits): an HMAC key should carry at least the security strength
#: wanted (NIST SP 800-107 rev. 1, section 5.3.4). ``openssl rand -hex 32``
#: makes a 64-byte one.
MIN_KEY_BYTES = 16

_DOMAIN = b"kernel-cache-sig-v1\0"
_FIX = "make one with: openssl rand -hex 32"


class SigningKeyError(KernelCacheError):
    """The signing key is missing where required, unreadable, or too short."""


class SignatureError(CorruptEntryError):
    """An entry's signature is missing, made with another key, or does not match
    its key and bytes. The entry is never loaded."""


def _setting(name: str, environ: Mapping[str, str] | None):
    """:func:`kernel_cache.config.settings.get`, its error as a :class:`SigningKeyError`
    (a misspelt ``KERNEL_CACHE_REQUIRE_SIGNED`` must not mean "off")."""
    try:
        return settings.get(name, environ)
    except ConfigError as e:
        raise SigningKeyError(str(e)) from None


_warned_paths: set[str] = set()


def _warn_if_shared(path: str) -> None:
    """Warn once per file when the key file is readable by group or others:
    whoever can read the secret can sign artifacts the fleet will load."""
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        return
    if mode & 0o077 and path not in _warned_paths:
        _warned_paths.add(path)
        logging.getLogger("kernel_cache").warning(
            "%s=%s is readable by group or others (mode %04o): anyone who can read "
            "it can sign artifacts; chmod 600 it",
            ENV_SIGNING_KEY_FILE,
            path,
            mode,
        )


def load_signing_key(
    environ: Mapping[str, str] | None = None, *, required: bool | None = None
) -> bytes | None:
    """The signing secret from the environment, or None when none is set.

    Args:
        environ: defaults to :data:`os.environ`.
        required: raise when no key is set; None reads ``KERNEL_CACHE_REQUIRE_SIGNED``.

    Raises:
        SigningKeyError: both variables are set, the key file cannot be read, the
            key is shorter than :data:`MIN_KEY_BYTES`, or none is set while required.
    """
    if required is None:
        required = _setting("require_signed", environ)
    value = _setting("signing_key", environ)
    value = value.get_secret_value() if value is not None else None
    path = _setting("signing_key_file", environ)
    path = str(path) if path is not None else None
    if value and path:
        raise SigningKeyError(
            f"both {ENV_SIGNING_KEY} and {ENV_SIGNING_KEY_FILE} are set; set only one"
        )
    if path:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as e:
            raise SigningKeyError(
                f"{ENV_SIGNING_KEY_FILE}={path}: cannot read it ({e.strerror or e}); "
                "point it at a readable file holding the secret"
            ) from None
        source = f"{ENV_SIGNING_KEY_FILE}={path}"
        _warn_if_shared(path)
    elif value:
        secret = value.encode()
        source = ENV_SIGNING_KEY
    else:
        if required:
            raise SigningKeyError(
                f"signed artifacts are required (--require-signed or {ENV_REQUIRE_SIGNED}) "
                f"but neither {ENV_SIGNING_KEY} nor {ENV_SIGNING_KEY_FILE} is set; {_FIX}"
            )
        return None
    if len(secret) < MIN_KEY_BYTES:
        raise SigningKeyError(
            f"{source}: the key is {len(secret)} bytes, below the minimum of "
            f"{MIN_KEY_BYTES}; {_FIX}"
        )
    return secret


def key_id(secret: bytes) -> str:
    """16 hex characters naming ``secret`` without revealing it."""
    return hmac.new(secret, b"kernel-cache-key-id", hashlib.sha256).hexdigest()[:16]


def mac(secret: bytes, key: str, data: bytes) -> str:
    """HMAC-SHA256 (hex) over the cache key (64 hex characters) and the artifact bytes."""
    h = hmac.new(secret, _DOMAIN, hashlib.sha256)
    h.update(key.encode("ascii"))
    h.update(b"\0")
    h.update(data)
    return h.hexdigest()


def sign_meta(meta: dict, data: bytes, secret: bytes | None) -> dict:
    """``meta`` with a ``signature`` for ``meta["key"]`` and ``data``; unchanged
    (a copy) when ``secret`` is None."""
    out = dict(meta)
    if secret is not None:
        out["signature"] = {
            "alg": ALGORITHM,
            "key_id": key_id(secret),
            "mac": mac(secret, meta["key"], data),
        }
    return out


def check_signature(key: str, meta: dict, data: bytes, secret: bytes, where: str = "") -> None:
    """Check an entry's signature against ``secret``.

    Raises:
        SignatureError: the signature is missing, uses another algorithm or key,
            or does not match ``key`` and ``data`` (forged or altered).
    """
    sig = meta.get("signature")
    if not isinstance(sig, dict):
        raise SignatureError(
            key, f"unsigned, but {ENV_SIGNING_KEY} is set: only signed entries are loaded", where
        )
    if sig.get("alg") != ALGORITHM:
        raise SignatureError(key, f"signature algorithm {sig.get('alg')!r} != {ALGORITHM}", where)
    ours = key_id(secret)
    if sig.get("key_id") != ours:
        raise SignatureError(
            key, f"signed with another key (key id {sig.get('key_id')}, ours {ours})", where
        )
    expected = mac(secret, key, data)
    if not hmac.compare_digest(str(sig.get("mac", "")), expected):
        raise SignatureError(
            key, "signature does not match the key and bytes (forged or altered)", where
        )


def check_untrusted(entry, secret: bytes | None = None, environ=None) -> None:
    """The check every entry from an untrusted tier passes before it is used.

    ``secret`` defaults to :func:`load_signing_key` (None: no key set, nothing to
    check beyond the checksum). ``entry`` is a :class:`kernel_cache.store.tier.Entry`.

    Raises:
        SignatureError: see :func:`check_signature`.
        SigningKeyError: see :func:`load_signing_key`.
    """
    if secret is None:
        secret = load_signing_key(environ)
    if secret is not None:
        check_signature(entry.key, entry.meta, entry.data, secret, entry.where)
