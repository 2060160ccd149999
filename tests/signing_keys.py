"""Ed25519 key pairs for the signing tests, written by the same code as ``kernel-cache keygen``."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from kernel_cache.trust.keygen import generate_keypair
from kernel_cache.trust.keys import ENV_SIGNING_KEY_FILE, ENV_TRUSTED_KEYS, Signer, load_signer


@dataclass(frozen=True)
class KeyPair:
    """A key pair's files and its key id (computed here from the public key file)."""

    private: Path
    public: Path
    key_id: str

    @property
    def signer(self) -> Signer:
        return load_signer({ENV_SIGNING_KEY_FILE: str(self.private)})

    @property
    def builder_env(self) -> dict[str, str]:
        """A builder's environment: the private key, no trusted-key list."""
        return {ENV_SIGNING_KEY_FILE: str(self.private), ENV_TRUSTED_KEYS: ""}

    @property
    def engine_env(self) -> dict[str, str]:
        """An engine's environment: the public key only, no private key."""
        return {ENV_TRUSTED_KEYS: str(self.public), ENV_SIGNING_KEY_FILE: ""}


def raw_key_id(public_pem: bytes) -> str:
    """sha256 of the raw 32-byte public key, first 16 hex (computed independently)."""
    key = serialization.load_pem_public_key(public_pem)
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def make_keypair(directory) -> KeyPair:
    out = generate_keypair(directory)
    public = Path(out["public"])
    return KeyPair(Path(out["private"]), public, raw_key_id(public.read_bytes()))
