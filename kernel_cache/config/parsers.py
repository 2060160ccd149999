"""Parsers and checkers of ``KERNEL_CACHE_*`` values (text from the environment),
used by the fields of :mod:`kernel_cache.config.settings`. Each raises
:class:`ValueError` saying what is wrong; the settings model turns it into an
error naming the variable.
"""

from __future__ import annotations

import re

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_UNIT_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt])(?:i?b)?\s*", re.IGNORECASE)
_PASSWORD_RE = re.compile(r"(//[^:/@]*:)[^@/]*@")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False (any case, blanks around).

    Raises:
        ValueError: anything else.
    """
    raw = str(text).strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean")


def binary_units(v):
    """``"500M"``, ``"2g"``, ``"1GB"`` -> ``"500MiB"``, ``"2GiB"``, ``"1GiB"``: a
    unit letter means a power of 1024, with or without ``i``/``B`` (pydantic's
    :class:`~pydantic.ByteSize` reads ``GB`` as 10**9 and has no bare ``G``)."""
    m = _UNIT_RE.fullmatch(v) if isinstance(v, str) else None
    return f"{m.group(1)}{m.group(2).upper()}iB" if m else v


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (``redis://u:***@host``)."""
    return _PASSWORD_RE.sub(r"\1***@", url)


def parse_int_list(text: str) -> tuple[int, ...]:
    """``"128, 256,512"`` -> ``(128, 256, 512)``; empty items are skipped.

    Raises:
        ValueError: an item that is not a positive integer, or no item at all.
    """
    out = []
    for tok in str(text).split(","):
        tok = tok.strip()
        if not tok:
            continue
        if not tok.isdigit() or int(tok) < 1:
            raise ValueError(f"entry {tok!r} is not a positive integer")
        out.append(int(tok))
    if not out:
        raise ValueError("empty list")
    return tuple(out)


def check_redis_url(v: str) -> str:
    """A Redis URL that redis-py's ``from_url`` accepts (scheme, port, database).

    Raises:
        ValueError: naming the URL (password hidden) and what is wrong.
    """
    from urllib.parse import urlsplit

    shown = redact_url(v)
    if not v.startswith(_REDIS_SCHEMES):
        raise ValueError(
            f"Redis URL {shown!r} must start with one of {', '.join(_REDIS_SCHEMES)}, "
            "e.g. redis://10.0.0.5:6379/0"
        )
    if not v.startswith("unix://"):
        parts = urlsplit(v)
        try:
            parts.port  # noqa: B018 (raises ValueError for a port that is not 0-65535)
        except ValueError:
            raise ValueError(
                f"Redis URL {shown!r}: the port is not a number in 0..65535, "
                "e.g. redis://10.0.0.5:6379/0"
            ) from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(
                f"Redis URL {shown!r}: the database {db!r} is not a number, "
                "e.g. redis://10.0.0.5:6379/0"
            )
    return v


_S3_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def check_s3_url(v: str) -> str:
    """An ``s3://BUCKET/PREFIX`` URL (the prefix may be empty; the bucket follows
    S3's naming rules: 3-63 characters of a-z, 0-9, '.' and '-').

    Raises:
        ValueError: naming the URL and what is wrong.
    """
    eg = "e.g. s3://kernel-cache/fleet-a"
    if not v.startswith("s3://"):
        raise ValueError(f"S3 URL {v!r} must start with s3://, {eg}")
    bucket = v[5:].split("/", 1)[0]
    if not _S3_BUCKET_RE.fullmatch(bucket):
        raise ValueError(
            f"S3 URL {v!r}: the bucket {bucket!r} is not a valid bucket name "
            f"(3-63 characters: a-z, 0-9, '.', '-'), {eg}"
        )
    return v


#: the schemes of :func:`check_remote_url` (obstore's ``from_url`` takes each)
REMOTE_SCHEMES = ("s3://", "gs://", "az://", "azure://", "abfs://", "abfss://", "file://")


def check_remote_url(v: str) -> str:
    """An object-store URL: ``s3://BUCKET/PREFIX`` (:func:`check_s3_url`),
    ``gs://BUCKET/PREFIX``, ``az://CONTAINER/PREFIX`` (also ``azure://``,
    ``abfs[s]://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX``) or
    ``file:///ABSOLUTE/PATH`` (a directory, e.g. on a shared filesystem).

    Raises:
        ValueError: naming the URL and what is wrong.
    """
    eg = "e.g. s3://kernel-cache/fleet-a, gs://kernel-cache/fleet-a or file:///mnt/shared/kc"
    if not v.startswith(REMOTE_SCHEMES):
        raise ValueError(
            f"object-store URL {v!r} must start with {', '.join(REMOTE_SCHEMES[:-1])} "
            f"or {REMOTE_SCHEMES[-1]}, {eg}"
        )
    if v.startswith("s3://"):
        return check_s3_url(v)
    if any(c.isspace() for c in v):
        raise ValueError(f"object-store URL {v!r} holds a blank, {eg}")
    scheme, rest = v.split("://", 1)
    if scheme == "file":
        from urllib.parse import unquote

        host, slash, path = rest.partition("/")
        path = unquote(path).strip("/")  # as the tier reads it: %2F is the root too
        if host not in ("", "localhost") or not slash or not path or "\0" in path:
            raise ValueError(
                f"file URL {v!r} must name an absolute directory path and no host, "
                "e.g. file:///mnt/shared/kc (three slashes)"
            )
        return v
    if not rest.split("/", 1)[0]:
        what = "bucket" if scheme == "gs" else "container"
        raise ValueError(f"object-store URL {v!r} names no {what}, {eg}")
    return v
