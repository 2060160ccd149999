"""The build lease of an object-store tier on a ``file://`` directory (a shared
filesystem), where obstore's ``LocalStore`` has create-once writes but no
conditional overwrite (``PutMode::Update`` is not implemented there), so the
S3 lease's ``If-Match`` take-over and renewal cannot be used (docs/shared-storage.md).

The lease of a key is a series of generations ``leases/<key>/<n>`` (``n``
zero-padded to at least 20 digits), each one ``{"holder", "expires_at"}``
(:class:`~kernel_cache.store.s3_lease.S3LeaseDoc`). The highest generation is
the lease. Every change (take, take over, renew, release) creates generation
``n + 1`` with ``O_CREAT | O_EXCL``, so of two builders changing generation
``n`` at once one gets ``EEXIST``: the compare-and-swap of ``If-Match`` on S3.
Not every shared filesystem keeps ``O_EXCL`` exclusive across hosts (a FUSE
mount of SeaweedFS lets both creates succeed, the last write winning), so a
builder that created a generation reads it back after :data:`SETTLE_S` and
holds the lease only if the holder there is its own token: of two racers both
read the same last write. The holder then deletes generation ``n``.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

from pydantic import ValidationError

from kernel_cache.errors import shown
from kernel_cache.store.remote_base import LEASE_MAX_BYTES, BuildLease, RemoteTier, lease_is_live
from kernel_cache.store.s3_lease import S3LeaseDoc

log = logging.getLogger("kernel_cache")

#: digits of a generation's name, zero-padded (a larger number takes more)
_DIGITS = 20
#: seconds between creating a generation and reading it back to confirm it is
#: ours (longer than a shared filesystem takes to show one host's write to another)
SETTLE_S = 0.5


#: Names a lease folder may hold. A builder leaves one or two generations there
#: (it deletes the one below each it confirms; racing builders may leave a few);
#: a folder with more was filled by a writer of the directory, and a builder
#: never lists more than this of it: it compiles without the lease.
GENERATIONS_MAX = 64


def _names(folder: Path, limit: int) -> list[str] | None:
    """The names in ``folder`` (``[]`` if it is gone), or None past ``limit``
    (read as counted, never whole)."""
    names: list[str] = []
    try:
        with os.scandir(folder) as found:
            for e in found:
                if len(names) == limit:
                    return None
                names.append(e.name)
    except FileNotFoundError:
        return []
    return names


def _gen_of(name: str) -> int | None:
    """The generation a file name is, None if it is not one as :meth:`FileLease._name`
    writes it (zero-padded to at least :data:`_DIGITS` ASCII digits: the successor
    of 99...9 has 21)."""
    if not (name.isascii() and name.isdigit()):
        return None
    gen = int(name)
    return gen if name == f"{gen:0{_DIGITS}d}" else None


class FileLease(BuildLease):
    """:class:`~kernel_cache.store.remote_base.BuildLease` in a shared directory
    (see the module docstring). A lease that names no live holder
    (:func:`~kernel_cache.store.remote_base.lease_is_live`: an expiry that is
    not a finite number or lies beyond now + TTL + slack; over
    :data:`~kernel_cache.store.remote_base.LEASE_MAX_BYTES`; not a lease
    document; a link) is taken over and logged once, so a planted lease costs
    a builder nothing. Expiry compares the
    builders' wall clocks, as on S3."""

    WHAT = "shared-directory build lease"

    def __init__(self, tier: RemoteTier, key: str, ttl_s=None, wait_s=None, poll_s: float = 0.25):
        super().__init__(tier, key, ttl_s, wait_s, poll_s)
        self.dir = f"leases/{key}/"
        self._gen: int | None = None

    def _name(self, gen: int) -> str:
        return f"{self.dir}{gen:0{_DIGITS}d}"

    def _path(self, gen: int | None = None) -> Path:
        """``leases/<key>/`` or a generation in it.

        Raises:
            OSError: ``leases`` or ``leases/<key>`` is a symbolic link (planted
                by a writer of the directory to send lease files elsewhere):
                the lease is unavailable, the builder compiles without it.
        """
        base = Path(self.tier.settings.directory)
        root = base / self.dir
        for d in (base / "leases", root):
            if d.is_symlink():
                raise OSError(f"{d} is a symbolic link, not a lease directory")
        return root if gen is None else root / f"{gen:0{_DIGITS}d}"

    def _read_gen(self, gen: int) -> dict | None:
        """Generation ``gen``'s lease, None if it is gone; one that is not a
        lease (a link, over :data:`LEASE_MAX_BYTES`, not a lease document)
        reads as ``{"invalid": why}`` (taken over)."""
        try:
            # not blocking: a FIFO planted as a generation reads as empty (not a lease)
            fd = os.open(self._path(gen), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError:  # a link planted as a generation: not a lease
            return {"invalid": "a link, not a lease"}
        if stat.S_ISDIR(os.fstat(fd).st_mode):  # a folder planted as a generation
            os.close(fd)
            return {"invalid": "a folder, not a lease"}
        with os.fdopen(fd, "rb") as f:
            raw = f.read(LEASE_MAX_BYTES + 1)
        if len(raw) > LEASE_MAX_BYTES:
            return {"invalid": f"over {LEASE_MAX_BYTES} bytes"}
        try:
            return S3LeaseDoc.model_validate_json(raw).model_dump()
        except ValidationError:
            return {"invalid": f"not a lease: {shown(raw, 80)}"}

    def _current(self) -> tuple[int, dict] | None | bool:
        """``(generation, lease)`` of the highest generation, None if there is
        none, False on a failure."""

        def op(ob, store):
            for _ in range(5):  # a generation deleted between the listing and the read
                names = _names(self._path(), GENERATIONS_MAX)
                if names is None:  # filled by a writer: no lease to read
                    return False
                gens = [g for g in map(_gen_of, names) if g is not None]
                if not gens:
                    return None
                doc = self._read_gen(max(gens))
                if doc is not None:
                    return max(gens), doc
            return None

        return self.tier._run("lease read", op, False)

    def _write(self, gen: int, expires_at: float) -> bool | None:
        """Create generation ``gen`` and confirm it after :data:`SETTLE_S`: True
        ours, False another builder changed the lease first, None on a failure.
        Once confirmed, the generation below is deleted."""
        body = S3LeaseDoc(holder=self.token, expires_at=expires_at).model_dump_json().encode()

        def op(ob, store):
            path = self._path(gen)
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                return False
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            time.sleep(SETTLE_S)
            doc = self._read_gen(gen)
            if doc is None or doc.get("holder") != self.token:
                return False
            if gen > 1:
                try:
                    os.unlink(self._path(gen - 1))
                except (FileNotFoundError, IsADirectoryError):  # a planted folder stays
                    pass
            return True

        out = self.tier._run("lease write", op, None)
        if out:
            self._gen = gen
        return out

    def _live(self, doc: dict) -> bool:
        """Whether ``doc`` names a live holder; one that was planted (not
        merely expired) is logged once, escaped."""
        now, expires = time.time(), doc.get("expires_at")
        if "invalid" in doc:
            self._note_takeover(doc["invalid"])
            return False
        if lease_is_live(expires, self.ttl_s, now):
            return True
        if not expires <= now:  # NaN, infinite or too far ahead: planted
            self._note_takeover(
                f"holder {shown(doc.get('holder'), 80)} until {expires!r}, beyond now "
                f"+ the {self.ttl_s:g} s TTL"
            )
        return False

    def holder(self) -> str | None:
        got = self._current()
        return got[1].get("holder") if got else None

    def _planted(self) -> tuple[Path, str] | None:
        """``(folder, why)`` when ``leases`` or ``leases/<key>`` was planted by a
        writer of the directory (a link or a file in its place, or a lease
        folder of more than :data:`GENERATIONS_MAX` names), else None."""
        base = Path(self.tier.settings.directory)
        for d in (base / "leases", base / self.dir):
            if d.is_symlink() or (d.exists() and not d.is_dir()):
                return d, "a link or a file planted there"
        if _names(base / self.dir, GENERATIONS_MAX) is None:
            return base / self.dir, f"more than {GENERATIONS_MAX} names in it"
        return None

    def _take(self) -> bool | None:
        planted = self._planted()
        if planted is not None:  # the lease is unavailable; the tier is not down
            log.warning(
                "%s is not a lease folder (%s); compiling %s without the %s",
                planted[0],
                planted[1],
                self.key[:16],
                self.WHAT,
            )
            return None
        got = self._current()
        if got is False:
            return None
        if got is not None and self._live(got[1]):
            return False
        out = self._write((got[0] if got else 0) + 1, time.time() + self.ttl_s)
        return None if out is None else out

    def _published(self) -> bool | None:
        if self.tier.contains(self.key):
            return True
        return None if self.tier.is_down() else False

    def _extend(self) -> bool | None:
        if self._gen is None:
            return False
        return self._write(self._gen + 1, time.time() + self.ttl_s)

    def _drop(self) -> None:
        if self._gen is not None and not self.lost:
            try:
                self._write(self._gen + 1, 0.0)
            except Exception:  # releasing must not fail a run; the lease expires anyway
                pass
        self._gen = None
