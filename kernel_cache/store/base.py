"""The interface every storage tier has (:class:`Tier`), what a put did
(:class:`PutResult`), and where the local cache is by default.

The interface follows the shape of Triton's ``CacheManager``
(``python/triton/runtime/cache.py``): get, put, contains, delete and listing.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from kernel_cache.config import settings
from kernel_cache.store.entry import Entry

ENV_CACHE_DIR = settings.var("dir")


def default_cache_dir() -> Path:
    """``$KERNEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/kernel_cache``, else
    ``~/.cache/kernel_cache`` (a relative ``XDG_CACHE_HOME`` is ignored, as the
    XDG Base Directory spec says)."""
    env = settings.get("dir")
    if env is not None:
        return env
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / "kernel_cache"


#: The longest file name a folder of the cache path may have (Linux's NAME_MAX).
NAME_MAX = 255
#: SQLite's longest database path (``SQLITE_MAX_PATHNAME``, 512): the cache's
#: index ``<dir>/cache.db`` and its ``-wal`` must stay shorter.
DB_PATH_MAX = 511


def check_cache_dir_path(directory: Path, source: str, fix: str) -> None:
    """Raise :class:`~kernel_cache.errors.ConfigError` when ``directory`` is
    too long to hold the cache (a folder name over :data:`NAME_MAX`
    characters, or an index path over :data:`DB_PATH_MAX`), or it or a folder
    above it exists and is not a directory, naming both, ``source`` (where the
    path came from) and ``fix`` (what to point at a directory)."""
    longest = max(directory.parts, key=len, default="")
    index = len(os.path.abspath(directory)) + len("/cache.db-wal")
    if len(longest) > NAME_MAX or index > DB_PATH_MAX:
        from kernel_cache.errors import ConfigError

        why = (
            f"its folder name {longest[:40]!r}... is {len(longest)} characters, over the "
            f"{NAME_MAX} a file system takes"
            if len(longest) > NAME_MAX
            else f"its index path would be {index} characters, over the {DB_PATH_MAX} SQLite opens"
        )
        text = str(directory)
        text = text if len(text) <= 120 else text[:120] + "..."
        raise ConfigError(
            f"cache directory {text} (from {source}): {why}; fix: point {fix} at a shorter path"
        )
    for p in (directory, *directory.parents):
        try:
            if not p.exists():
                continue
        except OSError:
            return
        if not p.is_dir():
            from kernel_cache.errors import ConfigError

            what = "it is" if p == directory else f"{p} is"
            raise ConfigError(
                f"cache directory {directory} (from {source}): {what} a file, not a directory; "
                f"fix: point {fix} at a directory (a new one or a kernel-cache cache), "
                f"or move {p} out of the way"
            )
        return


class PutOutcome(str, Enum):
    """What :meth:`Tier.put` did."""

    STORED = "stored"  #: the entry is now in the tier
    PRESENT = "present"  #: the same record was there already; nothing was written
    READ_ONLY = "read-only"  #: refused: the tier is read-only (``reason`` says which)
    FAILED = "failed"  #: a fail-open tier could not store it (``reason`` says why)


@dataclass(frozen=True)
class PutResult:
    """The typed result of :meth:`Tier.put`: the outcome, the tier's location
    (for reports) and, unless stored, why."""

    outcome: PutOutcome
    where: str = ""
    reason: str = ""

    @property
    def ok(self) -> bool:
        """True if the tier holds the entry now (stored or already present)."""
        return self.outcome in (PutOutcome.STORED, PutOutcome.PRESENT)

    @property
    def stored(self) -> bool:
        """True if this call wrote the entry."""
        return self.outcome is PutOutcome.STORED


class Tier(abc.ABC):
    """A place entries are stored: a bundle, a local disk cache, Redis, an
    object store (S3, GCS, Azure Blob, a ``file://`` directory).

    The interface is get, put, contains and iteration over metadata. Whether a
    tier's entries are trusted, whether a bad one is a miss and where a hit is
    copied are the policy of the lookup that orders the tiers
    (:class:`kernel_cache.store.lookup.Source`); :attr:`trusted` and
    :attr:`corrupt_is_miss` are only the defaults it starts from. :attr:`name`
    and :attr:`location` are for reports (where an entry came from).
    """

    name: str = "tier"
    location: str = ""
    #: Default policy: False for shared stores others can write (Redis, bundles),
    #: whose entries must also pass :func:`kernel_cache.trust.signing.check_untrusted`.
    trusted: bool = True
    #: Default policy: True where an entry failing its checks is a miss rather
    #: than an error (Redis: a shared cache that warmup repairs).
    corrupt_is_miss: bool = False
    #: How a bad entry here is replaced, for the caller's messages: ``"warmup"``
    #: (compile it again into this cache), ``"publish"`` (a builder holding the
    #: private key publishes it again to this shared tier), ``"export"`` (the
    #: bundle is exported again). :func:`kernel_cache.runtime.load.repair_hint`
    #: writes the command.
    repair: str = "warmup"
    #: The command-line flag that takes :attr:`location` (a shared tier's URL
    #: flag, for a repair command that names it); empty where none does.
    location_flag: str = ""

    @abc.abstractmethod
    def get(self, key: str) -> Entry | None:
        """The raw (unverified) entry, or None on a miss.

        Raises:
            CorruptEntryError: the entry exists but its metadata cannot be read.
        """

    @abc.abstractmethod
    def get_meta(self, key: str) -> dict | None:
        """The metadata record alone, or None."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes, meta: dict) -> PutResult:
        """Publish an entry atomically: readers see all of it or none of it.

        Returns the outcome (:class:`PutResult`): stored, already present,
        refused as read-only, or failed (a fail-open tier) with the reason.
        A fail-closed tier raises instead of failing (the disk tier:
        CacheWriteError, CacheBusyError).
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def iter_meta(self) -> Iterator[dict]:
        """Every entry's metadata (for ls, stats, explain)."""

    def check_records(self, check) -> None:
        """Have ``check(meta)`` run on each entry's record before the entry's
        artifact is read, where this tier reads the record first (the object
        store's entries: a record refused there costs its bytes alone); it
        raises :class:`~kernel_cache.errors.CorruptEntryError` to refuse the
        entry. Other tiers read an entry whole, and the lookup checks it after
        (default: nothing to do)."""
        return None

    def iter_records(self) -> Iterator[tuple[str, dict | None, str | None]]:
        """Every entry for listing: ``(key, metadata, None)``, or ``(key, None,
        reason)`` for one whose metadata cannot be read (the default lists
        :meth:`iter_meta`, which has none of the latter)."""
        for m in self.iter_meta():
            yield m["key"], m, None

    def contains(self, key: str) -> bool:
        return self.get_meta(key) is not None

    def metas_by(self, index: str, of: Callable[[dict], str | None]) -> Callable[[str], list[dict]]:
        """A lookup from a value to the records whose ``of(record)`` is that
        value (``index`` names ``of``: the lookup's ``runtime`` and ``near``
        digests, :data:`kernel_cache.store.lookup.RECORD_INDEXES`). This
        default reads every record once (:meth:`iter_meta`), on the first
        call; a shared tier finds them by key instead, so its requests do
        not grow with what else it holds (S3: its ``index/`` objects)."""
        groups: dict[str, list[dict]] | None = None

        def find(value: str) -> list[dict]:
            nonlocal groups
            if groups is None:
                groups = {}
                for meta in self.iter_meta():
                    try:
                        v = of(meta)
                    except (TypeError, ValueError, KeyError, AttributeError):
                        continue
                    if v is not None:
                        groups.setdefault(v, []).append(meta)
            return groups.get(value, [])

        return find

    def quarantine(self, key: str, reason: str, variant: str = "") -> str:
        """Move ``key``'s bad entry out of the way; returns where it was kept, or
        ``""`` where the tier keeps nothing (this default deletes it)."""
        self.delete(key)
        return ""

    def note_usage(self, hits, misses: int) -> bool:
        """Record ``hits`` (keys served now) and ``misses`` (a count) where the
        tier keeps usage records; returns whether it does (this default: no).
        Best effort, never raises."""
        return False

    def record_size(self, key: str) -> int:
        """Bytes stored for ``key`` where its record cannot say (a listing's
        corrupt row); 0 where the tier cannot tell (this default)."""
        return 0

    def expect(self, keys) -> None:  # noqa: B027 - optional hook
        """The keys the caller is about to look up (a plan); a tier may fetch them
        together (S3: its plan manifest). Sends nothing by itself."""

    def publish_manifest(self, keys) -> PutResult | None:
        """Record that every key of ``keys`` (a whole plan) is published, where
        the tier keeps such records (S3); None where it does not (this default)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
