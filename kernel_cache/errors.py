"""Errors raised by kernel-cache.

Every error names the input, the value, the limit and the fix, so a user never
has to read a traceback from inside torch to know what went wrong.
"""

from __future__ import annotations

#: longest store-provided text :func:`shown` quotes (characters): a lease holder
#: is ~40, a store's XML error body a few hundred; more is a writer's padding
SHOWN_CHARS = 400


def shown(text: object, limit: int = SHOWN_CHARS, *, quote: bool = True) -> str:
    """Text a shared store or another writer provided (a lease holder, a
    server's error body, a record field), as a log line or message may show it:
    ``repr``-quoted, so a newline, an ANSI escape or any other unprintable
    character appears as ``\\n``, ``\\x1b``... and cannot forge a line or
    recolour a terminal; cut to ``limit`` characters, with the full length
    named when cut. Bytes are decoded as UTF-8 with backslash escapes.
    ``quote=False`` leaves the quotes off (for a message of our own that
    carries such text: printable text reads as it is)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "backslashreplace")
    s = str(text)
    if not quote and s.isprintable():
        return s if len(s) <= limit else f"{s[:limit]}... ({len(s)} characters)"
    out = repr(s[:limit]) if quote else repr(s[:limit])[1:-1]
    return out if len(s) <= limit else f"{out}... ({len(s)} characters)"


class KernelCacheError(Exception):
    """Base class of every error kernel-cache raises on purpose."""


class ConfigError(KernelCacheError, ValueError):
    """An engine configuration or bucket override is invalid (names the field)."""


class CpuTargetError(KernelCacheError):
    """A CPU artifact needs an instruction this CPU lacks (names the variant, the
    entry, the missing features and the warmup command that builds one for it)."""


class ShapeError(KernelCacheError, ValueError):
    """A dispatch input has the wrong shape, dtype or device, or exceeds the plan."""


class MissingVariantsError(KernelCacheError):
    """Engine start found variants of the plan that are not in any cache tier.

    ``reasons``: ``{variant: why}`` where a changed file says why (the files
    traced or hashed into the key that differ from a stored entry's); variants
    with one reason are listed together. ``refused``: ``{variant: (why, repair)}``
    for variants whose entry was found but refused (untrusted or corrupt; the
    repair names the tier it was in), said apart from entries that are absent."""

    def __init__(
        self,
        missing,
        command: str,
        reasons: dict | None = None,
        refused: dict[str, tuple[str, str]] | None = None,
    ):
        self.missing = tuple(missing)
        self.command = command
        self.refused = {str(v): r for v, r in (refused or {}).items()}
        self.reasons = {str(v): r for v, r in (reasons or {}).items() if r}
        absent = [v for v in self.missing if str(v) not in self.refused]
        parts = []
        if absent:
            names = ", ".join(str(v) for v in absent[:12])
            more = f" (+{len(absent) - 12} more)" if len(absent) > 12 else ""
            grouped: dict[str, list[str]] = {}
            for v in absent:
                if str(v) in self.reasons:
                    grouped.setdefault(self.reasons[str(v)], []).append(str(v))
            why = "".join(f" {', '.join(vs)}: {r}." for r, vs in grouped.items())
            parts.append(
                f"{len(absent)} variant(s) of the plan are not cached: {names}{more}.{why} "
                f"Warm them with: {command}"
            )
        by_why: dict[tuple[str, str], list[str]] = {}
        for v, r in self.refused.items():
            by_why.setdefault(r, []).append(v)
        for (why, repair), vs in by_why.items():
            more = f" (+{len(vs) - 12} more)" if len(vs) > 12 else ""
            parts.append(
                f"{len(vs)} variant(s) of the plan were refused: {', '.join(vs[:12])}{more}: "
                f"{why}; {repair}"
            )
        super().__init__(". ".join(parts))


class CorruptEntryError(KernelCacheError):
    """A stored entry failed its checksum, its metadata did not parse, or the
    AOTInductor loader rejected its bytes. The entry is never loaded."""

    def __init__(self, key: str, reason: str, where: str = ""):
        self.key = key
        # a reason may quote a record or a store's text: escaped, bounded
        reason = shown(reason, 2000, quote=False)
        self.reason = reason
        self.where = where
        loc = f" in {where}" if where else ""
        super().__init__(f"cache entry {key[:16]}{loc} is corrupt: {reason}")


class TorchAPIDriftError(KernelCacheError):
    """A private torch name kernel-cache uses is missing or has another form in
    the installed torch (:mod:`kernel_cache.torch_compat`, the one place such
    names are reached). Names the torch version, the API's dotted name, what
    differs, the torch versions it was checked on and the fix (pin torch to one
    of them, or upgrade kernel-cache). Never a statement about a cache entry:
    the entry that was being loaded is left as it is."""

    def __init__(self, api: str, why: str, torch_version: str, checked: tuple[str, ...]):
        self.api = api
        self.why = why
        self.torch_version = torch_version
        self.checked = tuple(checked)
        from kernel_cache import __version__

        on = ", ".join(self.checked)
        super().__init__(
            f"torch {torch_version}: {api} {why}. kernel-cache {__version__} reaches this "
            f"private torch API and was checked with torch {on}; the cache entries are not "
            f"at fault. Fix: pin torch to a checked version (pip install 'torch=="
            f"{self.checked[-1]}.*') or upgrade kernel-cache to a release that supports "
            f"torch {torch_version}"
        )


class CompileError(KernelCacheError):
    """torch.export or AOTInductor failed for a variant."""


class BundleError(KernelCacheError):
    """A bundle directory is missing, is not a bundle, cannot be written
    (export), or is incomplete (names the path or the variants and the fix)."""


class DamagedIndexError(KernelCacheError):
    """The cache index (``cache.db``) is not a readable SQLite database (names
    it and the fix)."""


class CacheBusyError(KernelCacheError):
    """The cache's SQLite index stayed locked ("database is locked") by other
    processes for longer than the bounded wait (``KERNEL_CACHE_DB_TIMEOUT``)."""


class CacheWriteError(KernelCacheError):
    """The cache directory could not be written (full disk, quota, read-only
    mount, permissions). Names the directory and the bytes that were needed;
    nothing half-written is left behind."""


class UntrustedCacheError(KernelCacheError):
    """The cache directory, or an entry file in it, is writable by other users or
    owned by another user; its native code is not loaded. Names the path, the
    mode or owner, and the fix."""


class NetworkFilesystemError(KernelCacheError):
    """The local cache directory is on a network or FUSE filesystem, whose locking
    and write ordering SQLite and diskcache cannot rely on. Names the directory,
    the filesystem type and the ``file://`` remote URL to use instead."""


class LockTimeoutError(KernelCacheError):
    """Waiting for another process's per-key compile lock took longer than the
    lock timeout. Names the key, the lock file and the holder's pid if known."""


def describe_errors(e) -> str:
    """A pydantic ``ValidationError``'s errors as ``field a.b: what was wrong
    (got value)``, joined by ``; ``, for the messages of the errors above."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(document)"
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        parts.append(f"field {loc}: {err['msg']} (got {got})")
    return "; ".join(parts)


def _holder(model, loc):
    """The (nested) pydantic model class that holds ``loc``'s last part, or None."""
    import typing

    cur = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if part not in getattr(cur, "model_fields", {}):
            return None
        ann = cur.model_fields[part].annotation
        cands = (ann, *typing.get_args(ann))
        cur = next((a for a in cands if hasattr(a, "model_fields")), None)
        if cur is None:
            return None
    return cur


def _accepted(model, loc) -> list[str] | None:
    """The fields of the (nested) pydantic model that holds ``loc``'s last part."""
    cur = _holder(model, loc)
    return sorted(cur.model_fields) if cur is not None else None


def _described(model, loc) -> str | None:
    """The description of the field ``loc`` names, where its model gives one."""
    cur = _holder(model, loc)
    field = cur.model_fields.get(loc[-1]) if cur is not None and loc else None
    return field.description if field is not None else None


def validation_message(origin: str, e, model=None) -> str:
    """One line per problem of a pydantic ``ValidationError`` ``e``, each naming
    ``origin`` (the file or variable), the field's location
    (``entries[0].config.num_kv_splits``), the value given and the problem;
    for an unknown field, the accepted ones (those of ``model``, the validated
    pydantic model class, where given); for a missing or wrong value, what the
    field holds (its description in ``model``), which says what to write."""
    lines = []
    for err in e.errors(include_url=False):
        where = ""
        for part in err["loc"]:
            where += f"[{part}]" if isinstance(part, int) else f".{part}" if where else str(part)
        # JSON has lists where the models hold tuples (frozen): say what to write.
        msg = str(err["msg"]).removeprefix("Value error, ").replace("a valid tuple", "a list")
        if err["type"] == "missing":
            msg = "required field missing"
        elif err["type"] == "extra_forbidden":
            msg = f"unknown field (value {err['input']!r})"
            accepted = _accepted(model, err["loc"]) if model is not None else None
            if accepted:
                msg += f"; accepted: {', '.join(accepted)}"
        elif err["type"] != "value_error" and not isinstance(err["input"], (dict, list)):
            where += f"={err['input']!r}"
        described = _described(model, err["loc"]) if model is not None else None
        if described and err["type"] not in ("extra_forbidden", "value_error"):
            msg += f" (the field: {described})"
        lines.append(f"{origin}: {where or '(document)'}: {msg}")
    return "\n".join(lines)
