"""A local cache's memo of import scans, so engine start parses no source file.

The ``sources`` key component follows the imports of the compile path's files
(:func:`kernel_cache.plan.sources.source_files`), which takes an
``ast.parse`` of each file: about half of ``load_plan``'s time on a 2-core
CPU (docs/benchmarks/engine-start.md). What a scan finds depends only on the file's bytes,
its module name, the scanning code and the Python version, so warmup keeps
the scans in ``<cache>/imports.json`` and engine start reads them::

    {"python": "3.11", "scanner": "<sha256 of sources.py, 16 hex>",
     "cxx": "gcc 12.2.0 (build 5d1c33a0); libstdc++ 6.0.30",
     "files": {"<sha256 of the file>:<module>:<m|p>": ["kernel_cache.errors", ...]}}

A later process still reads and hashes every file (the key needs the
hashes); only the parse of a file whose bytes it has seen is skipped.

The memo also names the C++ compiler warmup built with (``cxx``, the
build-only key component: :func:`kernel_cache.plan.keys.cxx_compiler_id`,
``"gcc 12.2.0 (build 5d1c33a0); libstdc++ 6.0.30"``). Engine start runs no
compiler: it looks up first the keys with that value, which an entry warmed
into this cache by that compiler has, and accepts another value as it
accepts any build-only one (:mod:`kernel_cache.store.lookup`). A memo
without it means ``"none"`` (what a runtime image without a compiler has).

The memo is read only from the local cache directory, which engine start
already trusts for the code it loads, and only as a regular file owned by
this user and writable by no one else (:func:`kernel_cache.trust.permissions.problem`);
never from a bundle or a remote tier. A memo that is missing, unreadable,
malformed, untrusted or made by another scanner or Python is ignored: every
file is parsed, as without one. Writing is best effort, as for ``usage.json``:
only where the directory is writable, atomically (``os.replace``), never
through a symbolic link, and only when this process parsed a file the memo
lacked. Two writers at once may drop each other's additions, which costs a
later parse, not a wrong key.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from kernel_cache.plan import sources

log = logging.getLogger("kernel_cache.store.imports_memo")

MEMO_FILE = "imports.json"
#: Most scans a memo keeps: beyond it, a write keeps only this process's.
MAX_SCANS = 4096
#: Largest memo read, in bytes (a few hundred scans take about 100 KB).
MAX_BYTES = 8 << 20


class ImportsMemo(BaseModel):
    """A local cache's ``imports.json`` (see the module docstring): ``python``
    (major.minor), ``scanner`` (:func:`kernel_cache.plan.sources.scanner`),
    ``cxx`` (the ``cxx`` key component of the warmup that wrote it; ``""``:
    not recorded) and ``files`` (``{scan key: module names}``,
    :func:`kernel_cache.plan.sources.scan_key`)."""

    model_config = ConfigDict(frozen=True, extra="ignore", defer_build=True)

    python: str
    scanner: str
    cxx: str = ""
    files: dict[str, list[str]] = {}


def _python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _read(directory: Path, allow_shared: bool) -> ImportsMemo | None:
    from kernel_cache.store.nofollow import UnsafeValueError, open_entry_file
    from kernel_cache.trust.permissions import problem

    path = directory / MEMO_FILE
    try:  # no link followed, a FIFO not waited on, only a regular file
        f = open_entry_file(directory, MEMO_FILE)
    except (OSError, UnsafeValueError):
        return None
    with f:
        try:
            st = os.fstat(f.fileno())
            if st.st_size > MAX_BYTES:
                log.debug("import memo %s ignored: over %d B", path, MAX_BYTES)
                return None
            why = None if allow_shared else problem(st)
            if why:
                log.debug("import memo %s ignored: %s", path, why)
                return None
            raw = f.read(MAX_BYTES + 1)
        except OSError:
            return None
    try:
        memo = ImportsMemo.model_validate_json(raw)
    except ValidationError as e:
        log.debug("import memo %s ignored: %s", path, e.errors()[:1])
        return None
    if memo.python != _python() or memo.scanner != sources.scanner():
        return None
    return memo


def take(
    directory: str | os.PathLike, *, allow_shared: bool = False
) -> tuple[ImportsMemo | None, int]:
    """Take the scans of ``<directory>/imports.json`` for this process's key
    computations (:func:`kernel_cache.plan.sources.remember_imports`).
    Returns ``(memo, scans new here)``: the memo gives engine start its
    ``cxx``; ``(None, 0)`` where there is no usable memo, or the directory
    fails the cache's trust checks
    (:func:`kernel_cache.trust.permissions.check_cache_dir`, which the caller's
    own reads then report). Never raises."""
    from kernel_cache.errors import KernelCacheError
    from kernel_cache.trust.permissions import check_cache_dir

    try:
        check_cache_dir(directory, allow_shared=allow_shared)
    except (KernelCacheError, OSError):
        return None, 0
    memo = _read(Path(directory), allow_shared)
    return memo, 0 if memo is None else sources.remember_imports(memo.files)


def load(directory: str | os.PathLike, *, allow_shared: bool = False) -> int:
    """:func:`take`; returns how many scans were taken (0 without a usable memo)."""
    return take(directory, allow_shared=allow_shared)[1]


def remove(directory: str | os.PathLike) -> bool:
    """Remove ``<directory>/imports.json`` (``kernel-cache clear``; a link is
    removed, never followed). Returns True if it was removed; False if there
    was none or it could not be removed (a directory of that name, say)."""
    try:
        os.unlink(Path(directory) / MEMO_FILE)
        return True
    except OSError:
        return False


def save(directory: str | os.PathLike, *, allow_shared: bool = False, cxx: str = "") -> bool:
    """Write the scans this process used into ``<directory>/imports.json`` if it
    parsed one the memo lacks, merged with the memo's (up to
    :data:`MAX_SCANS`), or if ``cxx`` (this warmup's ``cxx`` key component;
    ``""``: keep the memo's) differs from the memo's. Returns True if the file
    was written; False if nothing was new, the directory is missing or
    read-only, or writing failed (logged at debug level). Never raises."""
    from kernel_cache.store.usage import writable

    scans, parsed = sources.scans_to_keep()
    d = Path(directory)
    if not writable(d) or os.path.islink(d / MEMO_FILE):
        return False
    old = _read(d, allow_shared)
    new_cxx = bool(cxx) and (old is None or old.cxx != cxx)
    if old is not None:
        if all(k in old.files for k in parsed) and not new_cxx:
            return False
        if len(old.files) + len(parsed) <= MAX_SCANS:
            scans = {**old.files, **scans}
        cxx = cxx or old.cxx
    elif not parsed and not new_cxx:
        return False
    files = dict(sorted(scans.items()))
    doc = ImportsMemo(python=_python(), scanner=sources.scanner(), cxx=cxx, files=files)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".imports-", suffix=".tmp", dir=d)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc.model_dump(), separators=(",", ":")))
        os.replace(tmp, d / MEMO_FILE)
        tmp = None
        return True
    except OSError as e:
        log.debug("import memo in %s not written: %s", d, e)
        return False
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
