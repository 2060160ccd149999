"""``kernel-cache keygen``: a new Ed25519 key pair for signing entries
(:mod:`kernel_cache.trust.signing` signs and checks with it).

The private key is written mode 600, the public key 644, each whole (a
temporary file of a random name renamed or linked into place), into a
directory only its owner can write.
"""

from __future__ import annotations

import os
from pathlib import Path

from kernel_cache.trust.keys import PRIVATE_NAME, PUBLIC_NAME, SigningKeyError, key_id


def _write_new(path: Path, data: bytes, mode: int, replace: bool) -> None:
    """Write ``path`` whole (a temporary file renamed or linked into place):
    replacing it only when ``replace``. The temporary file gets a random name
    and is created exclusively (``tempfile.mkstemp``: ``O_EXCL``), so a file or
    link planted under a predictable name is never written through.

    Raises:
        FileExistsError: ``path`` exists and ``replace`` is False.
        OSError: it cannot be written.
    """
    import tempfile

    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    tmp = Path(name)
    try:
        os.fchmod(fd, mode)  # the umask must not widen or narrow it
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # atomic: fails if path exists
    finally:
        if tmp.exists():
            tmp.unlink()


def _refuse_shared_dir(d: Path) -> None:
    """Raises SigningKeyError: ``d`` is writable by group or others, so another
    user could replace ``signing.pub`` (engines would trust their key) or plant
    files where the private key is written."""
    mode = d.stat().st_mode & 0o777
    if mode & 0o022:
        raise SigningKeyError(
            f"keygen {d}: refusing a directory writable by group or others (mode {mode:04o}): "
            "another user could replace the public key engines will trust; fix: "
            f"chmod go-w {d}, or give a directory only you can write"
        )


def generate_keypair(directory: str | os.PathLike, *, force: bool = False) -> dict:
    """Write a new Ed25519 key pair: ``DIR/signing.key`` (PEM PKCS#8, unencrypted,
    mode 600) and ``DIR/signing.pub`` (PEM SubjectPublicKeyInfo, mode 644).

    Returns: ``{"private", "public", "key_id"}``.

    Raises:
        SigningKeyError: ``DIR/signing.key`` exists and ``force`` is False (a key
            whose entries the fleet trusts is never replaced by accident),
            ``DIR`` is writable by group or others, or ``DIR`` cannot be written.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    d = Path(directory).absolute()
    private_path, public_path = d / PRIVATE_NAME, d / PUBLIC_NAME
    if private_path.exists() and not force:
        raise SigningKeyError(
            f"{private_path} exists; refusing to overwrite a signing key (entries signed "
            "with it would need its public key to load): pass --force to replace it, "
            "or give another DIR"
        )
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        d.mkdir(parents=True, exist_ok=True)
        _refuse_shared_dir(d)
        _write_new(private_path, private_pem, 0o600, replace=force)
        _write_new(public_path, public_pem, 0o644, replace=True)
    except FileExistsError:
        raise SigningKeyError(
            f"{private_path} appeared while the key was made; refusing to overwrite it "
            "(pass --force to replace it)"
        ) from None
    except OSError as e:
        raise SigningKeyError(
            f"keygen {d}: cannot write the key pair ({e.strerror or e}); give a writable DIR"
        ) from None
    return {
        "private": str(private_path),
        "public": str(public_path),
        "key_id": key_id(key.public_key()),
    }
