"""The objects of the object-store tier (:mod:`kernel_cache.store.s3`): their
names, their layout and the bounds every read of them keeps.

Objects (under ``PREFIX/``), all immutable once written except the leases:

- ``entries/<key>``: one entry, ``KCS3`` + 8-byte big-endian length of the JSON
  metadata + the metadata + the artifact bytes (:func:`pack`). Written with
  ``If-None-Match: *`` (create-once): the first builder's entry stays, a second
  build of the key gets ``412 PreconditionFailed`` and reads what is there; a
  reader sees the whole object or none.
- ``manifests/<sha256 of the sorted keys>.json`` (:func:`manifest_name`,
  :class:`S3Manifest`): ``{"format", "keys"}`` of a whole plan, written
  create-once by a warmup after every key of the plan is published. An engine
  that announced its keys (:meth:`~kernel_cache.store.s3.S3Tier.expect`) reads
  it (at most :func:`manifest_limit` bytes) on its first lookup in this tier
  and then fetches the listed entries ahead of its lookups, :data:`PREFETCH` at
  a time in plan order; without it, one GET per key.
- ``leases/<key>``: ``{"holder", "expires_at"}`` of the builder compiling the
  key (:class:`~kernel_cache.store.s3_lease.S3Lease`).
- ``index/<name>/<digest>/<key>``: empty, written create-once with each
  entry, one per :data:`~kernel_cache.store.lookup.RECORD_INDEXES` digest of
  its record: a miss finds compatible entries by listing one such prefix
  (:meth:`~kernel_cache.store.s3.S3Tier.metas_by`, at most :data:`INDEX_MAX` of
  them), never ``entries/``, so its requests do not grow with the bucket.

Every read is bounded before its body (docs/s3.md, "Bounds and planted
leases"): an object over its limit is an :class:`ObjectTooLargeError`, a
``file://`` object that is no regular file a :class:`NotAFileError`
(:func:`read_file`), and an entry is refused from its first bytes unless its
record accounts for it (:func:`read_entry`). Nothing here sends a request.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import struct
import unicodedata
from collections.abc import Callable, Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kernel_cache.config import settings as env_settings
from kernel_cache.errors import CorruptEntryError
from kernel_cache.store.disk_tier import parse_meta
from kernel_cache.store.entry import META_MAX_BYTES

MAGIC = b"KCS3"
#: the metadata length after :data:`MAGIC` (8 bytes, big-endian)
HEAD = struct.Struct(">Q")
#: bytes read for an entry's metadata alone (a record is about 1-2 KiB)
META_PROBE = 16384
MANIFEST_FORMAT = "kc-s3-manifest-1"
#: index objects read per digest on a miss: builds of one runtime differing in
#: a build-only component (the C++ compiler) or in sources number a handful;
#: more under one digest is a writer's flood, and the rest is not read
INDEX_MAX = 64
#: entries fetched ahead of the lookups once a plan manifest is read: at most
#: this many bodies are in memory beside the one being checked, so an engine's
#: peak stays within a few entries' size however large the listed objects are
PREFETCH = 2


def manifest_limit(n_keys: int) -> int:
    """The largest manifest read for a plan of ``n_keys`` keys (bytes): 80 per
    key (a 64-hex key, quotes, a comma) and 1 KiB for the rest; a larger object
    is not this plan's manifest and is refused before its body is read."""
    return 1024 + 80 * n_keys


#: a plan manifest older than this (seconds) is written again by the next warmup
#: that completes the plan (``kernel-cache gc-remote`` keeps plans by manifest age)
MANIFEST_RENEW_S = 86400.0


class S3Manifest(BaseModel):
    """``manifests/<sha256 of the sorted keys>.json``: a plan whose every key is published."""

    model_config = ConfigDict(frozen=True, extra="allow")

    format: Literal["kc-s3-manifest-1"] = Field(description="the format of this document")
    keys: list[str] = Field(description="the plan's cache keys (64 hex), sorted")
    created: float = Field(description="unix seconds when it was written")


class ObjectTooLargeError(Exception):
    """An object over ``KERNEL_CACHE_S3_MAX_OBJECT``, refused before its body is read."""

    def __init__(self, path: str, size: int, limit: int):
        self.path, self.size, self.limit = path, size, limit
        super().__init__(
            f"object {path} is {size} bytes, over the limit of {limit} "
            f"({env_settings.var('s3_max_object')}); an entry that large is not this "
            "cache's (fix: raise the limit if your kernels are that large)"
        )


class NotAFileError(ObjectTooLargeError):
    """A ``file://`` object that is no file this process can read (a FIFO, a
    socket or a device, a link that loops, a file it may not open: planted in
    the shared directory), refused before it is read; handled where
    :class:`ObjectTooLargeError` is."""

    def __init__(self, path: str, why: str):
        Exception.__init__(
            self,
            f"object {path} {why} (planted in the shared directory?); it is not this "
            "cache's (fix: remove it)",
        )


def pack(data: bytes, raw_meta: bytes) -> bytes:
    """One entry object: magic, metadata length, metadata JSON, artifact bytes."""
    return MAGIC + HEAD.pack(len(raw_meta)) + raw_meta + data


def split_entry(key: str, body: bytes, where: str) -> tuple[bytes, memoryview]:
    """``(metadata JSON, artifact bytes)`` of an entry object.

    Raises:
        CorruptEntryError: not an entry object, or cut short.
    """
    n = len(MAGIC) + HEAD.size
    if len(body) < n or bytes(body[:4]) != MAGIC:
        raise CorruptEntryError(key, "not a kernel-cache S3 entry (bad magic)", where)
    (size,) = HEAD.unpack(bytes(body[4:n]))
    if len(body) < n + size:
        raise CorruptEntryError(key, f"metadata cut short ({len(body) - n} of {size})", where)
    view = memoryview(body)
    return bytes(view[n : n + size]), view[n + size :]


def manifest_name(keys) -> str:
    """The manifest object of a plan: ``manifests/<sha256 of its sorted keys>.json``."""
    digest = hashlib.sha256("\n".join(sorted(set(keys))).encode()).hexdigest()
    return f"manifests/{digest}.json"


def _addressable(name: str) -> bool:
    """Whether the object store can name a file called ``name``: UTF-8 (a name
    that is not decodes with surrogates) without control characters (obstore
    refuses both)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not any(unicodedata.category(c) == "Cc" for c in name)


def walk_dir(directory: str, prefix: str, limit: int, past) -> list[tuple[str, int, float]]:
    """``(path, size, mtime)`` under ``prefix`` of a ``file://`` directory, links
    not followed: a link (to a file or a folder, the prefix's own folder
    included) is an object itself, judged by its own mtime and removed alone,
    so a link planted by a writer of the directory never makes a listing (the
    tier's, gc-remote's) walk or delete files outside it (obstore's listing
    follows links, to ``/`` as well); a folder replaced by a link or removed
    while the walk runs is left out, and so is a file the store cannot name
    (:func:`_addressable`: gc-remote leaves it). At most ``limit`` names are
    read, folders and those included, then ``past(count)`` is raised.

    Raises:
        OSError: a folder cannot be read (the prefix's own: also a link put in
            its place during the walk).
    """
    top = os.path.join(directory, prefix.rstrip("/"))
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        return [(prefix.rstrip("/"), st.st_size, st.st_mtime)]
    out, seen, folders = [], 0, [top]
    while folders:
        folder = folders.pop()
        try:  # a folder swapped for a link since it was listed is not entered
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            if folder != top and e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                continue  # gone or replaced meanwhile: the next run sees what is there
            raise
        try:
            with os.scandir(fd) as names:  # read as counted, not whole first
                for e in names:
                    seen += 1
                    if seen > limit:
                        raise past(seen)
                    if not _addressable(e.name):  # nor anything in such a folder
                        continue
                    path = os.path.join(folder, e.name)
                    if e.is_dir(follow_symlinks=False):
                        folders.append(path)
                        continue
                    try:
                        st = os.lstat(path)
                    except FileNotFoundError:
                        continue
                    out.append((os.path.relpath(path, directory), st.st_size, st.st_mtime))
        finally:
            os.close(fd)
    return out


#: The ``file://`` tier's read size: an entry's first chunk holds its header and
#: record (as a streamed GET's ``min_chunk_size``).
FILE_CHUNK = 1 << 16


def open_file(directory: str, path: str, limit: int, length: int | None = None):
    """``(size, chunks)`` of ``path`` in the ``file://`` directory ``directory``:
    its size, and its bytes as an iterator of :data:`FILE_CHUNK`-byte reads, so
    that a caller who refuses the first chunk reads no more (the file is closed
    once the iterator is done or dropped). None if absent (a folder is no
    object, as for obstore), or the error to raise, nothing read:
    :class:`ObjectTooLargeError` over ``limit`` bytes, :class:`NotAFileError`
    for a FIFO, socket or device (opened without blocking: opening a FIFO
    planted there waits for a writer forever, as obstore's read does), a link
    that loops or a file this user may not read. A planted name is refused
    alone, never as the tier's failure. ``length``: read no more than its
    first ``length`` bytes (the size stays the file's)."""
    full = os.path.join(directory, path)
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return NotAFileError(path, "is a link that loops")
        if e.errno in (errno.EACCES, errno.EPERM):
            return NotAFileError(path, "is a file this user may not read")
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if stat.S_ISREG(st.st_mode) and st.st_size <= limit:  # closed with its file object
        want = st.st_size if length is None else min(length, st.st_size)
        return st.st_size, _reads(os.fdopen(fd, "rb", buffering=0), want)
    os.close(fd)
    if stat.S_ISDIR(st.st_mode):
        return None
    if not stat.S_ISREG(st.st_mode):
        return NotAFileError(path, "is not a regular file but a FIFO, socket or device")
    return ObjectTooLargeError(path, st.st_size, limit)


def _reads(f, want: int):
    """At most ``want`` bytes of the unbuffered file ``f`` in
    :data:`FILE_CHUNK`-byte reads; closes it (an iterator dropped before its
    first read leaves ``f`` to be closed with it)."""
    with f:
        got = 0
        while got < want:
            chunk = f.read(min(FILE_CHUNK, want - got))
            if not chunk:
                break
            got += len(chunk)
            yield chunk


def read_file(directory: str, path: str, length: int | None, limit: int):
    """The first ``length`` bytes of ``path`` in the ``file://`` directory
    ``directory`` (all of it when None), None if absent, or the error to raise
    (as :func:`open_file`'s; over ``limit`` bytes only when all of it is asked
    for)."""
    if length is None:
        opened = open_file(directory, path, limit)
    else:
        opened = open_file(directory, path, 1 << 62, min(length, limit))
    return b"".join(opened[1]) if isinstance(opened, tuple) else opened


def read_entry(
    key: str,
    size: int,
    chunks: Iterable[bytes],
    where: str,
    check: Callable[[dict], None] | None = None,
) -> bytearray | CorruptEntryError:
    """The entry object of ``key`` (``size`` bytes by its response headers),
    read from ``chunks`` and checked as they come: from its first bytes, the
    magic, a record length within
    :data:`~kernel_cache.store.entry.META_MAX_BYTES`, a record whose ``size``
    accounts for the whole object and that passes ``check`` (which raises
    :class:`~kernel_cache.errors.CorruptEntryError`). Only then is a buffer of
    the object's size made. An object failing a check is returned as the error
    (``where``: the tier's location) with the rest of its chunks unread."""
    n = len(MAGIC) + HEAD.size

    def refused(why: str) -> CorruptEntryError:
        return CorruptEntryError(key, f"{why}; the rest of it was not read", where)

    head, buf, pos = bytearray(), None, 0  # the record's bytes, then the object's
    for chunk in chunks:
        if pos + len(chunk) > size:
            return refused(f"more bytes arrived than its size of {size}")
        if buf is not None:  # filled in place: one copy
            buf[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
            continue
        head += chunk
        pos = len(head)
        if pos < n:
            continue
        if bytes(head[:4]) != MAGIC:
            return refused("not a kernel-cache S3 entry (bad magic)")
        (meta_len,) = HEAD.unpack(bytes(head[4:n]))
        if meta_len > META_MAX_BYTES:
            return refused(
                f"its header claims a {meta_len}-byte record, over the limit of {META_MAX_BYTES}"
            )
        if pos < n + meta_len:
            continue
        try:
            meta = parse_meta(bytes(head[n : n + meta_len]), key)
        except CorruptEntryError as e:
            return refused(e.reason)
        if n + meta_len + meta["size"] != size:
            return refused(
                f"the object is {size} bytes, its record accounts for {n + meta_len + meta['size']}"
            )
        if check is not None:
            try:
                check(meta)
            except CorruptEntryError as e:
                return e
        buf = bytearray(size)
        buf[:pos] = head
        head = None
    if buf is None:
        return refused("not a kernel-cache S3 entry (shorter than its header says)")
    if pos != size:
        return refused(f"cut short: {pos} of its {size} bytes arrived")
    return buf
