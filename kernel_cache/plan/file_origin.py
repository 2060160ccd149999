"""Where a file comes from, and what identifies it: the classification the
traced files of an entry (:mod:`kernel_cache.plan.traced`) are recorded by.

Each file is classified (:func:`classify`):

- the standard library: ignored (the ``python`` component pins it);
- torch's own package: ignored (the ``torch`` component pins it);
- a file listed with its sha256 in an installed distribution's ``RECORD``:
  recorded as the distribution's name, version and a digest of its ``RECORD``
  (which holds the sha256 of every file installed: :func:`dist_version`);
  hashing every file of a large library on every engine start would cost more.
  A file a distribution lists without a sha256 (an ``.egg-info``) is hashed
  as below: the version alone would not see a reinstall with other code;
- anything else (the engine's source trees, top-level modules, editable
  installs, kernel_cache and warmup themselves): its sha256
  (:func:`file_sha256`).

Nothing here imports torch or a module being classified: files are found with
:func:`importlib.util.find_spec` on top-level names, versions with
:mod:`importlib.metadata`, and hashes and versions are cached per process.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

#: The value recorded for a listed file that is not found here, or a
#: distribution that is not installed.
MISSING = "missing"


def norm_path(path: str) -> str:
    """``path`` absolute and normalized (:func:`os.path.normcase` of
    :func:`os.path.abspath`): the form every path is compared in here."""
    return os.path.normcase(os.path.abspath(path))


@functools.cache
def _site_dirs() -> tuple[str, ...]:
    """Folders distributions are installed into (``site-packages``, ``dist-packages``)."""
    import site

    dirs = set(site.getsitepackages()) | {site.getusersitepackages()}
    dirs |= {p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")}
    return tuple(sorted({norm_path(d) + os.sep for d in dirs if d}))


@functools.cache
def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(sorted({norm_path(paths[k]) + os.sep for k in ("stdlib", "platstdlib")}))


@functools.cache
def _torch_dir() -> str | None:
    """torch's package folder, found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return norm_path(list(spec.submodule_search_locations)[0]) + os.sep


def _under(path: str, dirs) -> bool:
    return any(path.startswith(d) for d in dirs)


STDLIB, TORCH, SITE, OTHER, GENERATED = "stdlib", "torch", "site", "other", "generated"


def classify(filename: str) -> str:
    """Where the file ``filename`` (a code object's ``co_filename``) comes from:
    :data:`GENERATED` (``<string>``, frozen modules: no file), :data:`TORCH`,
    :data:`SITE` (under a folder distributions are installed into),
    :data:`STDLIB` or :data:`OTHER`. A site folder inside the standard
    library's (``/usr/local/lib/python3.11/site-packages``) counts as site."""
    if not filename or filename.startswith("<"):
        return GENERATED
    path = norm_path(filename)
    torch_dir = _torch_dir()
    if torch_dir is not None and path.startswith(torch_dir):
        return TORCH
    if _under(path, _site_dirs()):
        return SITE
    if _under(path, _stdlib_dirs()):
        return STDLIB
    return OTHER


def is_outside_module(name: str) -> bool:
    """Whether top-level module ``name`` is Python source outside the standard
    library, torch and the installed distributions (a sibling module, another
    source tree on ``PYTHONPATH``, an editable install): one whose files a key
    must hash. Imports nothing."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if spec.submodule_search_locations:
        locations = list(spec.submodule_search_locations)
        return bool(locations) and classify(os.path.join(locations[0], "__init__.py")) == OTHER
    origin = spec.origin or ""
    return origin.endswith(".py") and classify(origin) == OTHER


# -- distributions ---------------------------------------------------------------


@functools.cache
def _dist_files(name: str) -> frozenset[str]:
    """Normalized paths of the files distribution ``name`` lists in its RECORD
    with a sha256. A file listed without one (an ``.egg-info``'s
    ``SOURCES.txt`` or ``installed-files.txt``, which a distro package or a
    ``setup.py install`` writes; a RECORD line ``path,,``) is not covered by
    :func:`dist_version`, so it is not the distribution's: it is hashed itself."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return frozenset()
    loc = norm_path(str(dist.locate_file("")))
    return frozenset(
        os.path.normpath(os.path.join(loc, str(f)))
        for f in dist.files or ()
        if f.hash is not None and f.hash.value
    )


@functools.cache
def _top_level_dists() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.cache
def _all_dists() -> tuple[str, ...]:
    return tuple(sorted({d.metadata["Name"] for d in importlib.metadata.distributions()}))


def dist_of(path: str) -> str | None:
    """The installed distribution whose RECORD lists the file ``path``
    (normalized), or None. The distributions providing the file's top-level
    name are tried first (:func:`importlib.metadata.packages_distributions`),
    then all (reading every RECORD costs about 1 s with torch installed)."""
    site = next((d for d in _site_dirs() if path.startswith(d)), None)
    if site is None:
        return None
    top = path[len(site) :].split(os.sep)[0].removesuffix(".py")
    first = _top_level_dists().get(top, [])
    for name in [*first, *(d for d in _all_dists() if d not in first)]:
        if path in _dist_files(name):
            return name
    return None


@functools.cache
def dist_version(name: str) -> str:
    """What identifies the installed distribution ``name``: its version and the
    first 16 hex of the sha256 of its ``RECORD``'s rows for its own files
    (:func:`_code_rows`; ``"0.1.0 (RECORD 1a2b3c4d5e6f7a8b)"``; the version
    alone where it has none), or
    :data:`MISSING`. Read from its metadata; cached per process.

    ``RECORD`` lists the sha256 of every file the installer wrote, so a
    reinstall of changed code under the same version (``pip install ./pkg``
    again) changes it; an edit made in place after installing does not."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return MISSING
    record = dist.read_text("RECORD")
    if not record:
        return dist.version
    return f"{dist.version} (RECORD {hashlib.sha256(_code_rows(record)).hexdigest()[:16]})"


#: Files of a ``.dist-info`` folder that say how, by whom or from where a
#: distribution was installed, not what it holds (``INSTALLER``: pip or uv;
#: ``REQUESTED``: asked for or pulled in; ``direct_url.json``: a local path).
_INSTALL_ONLY = frozenset({"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"})


def _code_rows(record: str) -> bytes:
    """The rows of a ``RECORD`` that name the distribution's own files, sorted,
    as hashed by :func:`dist_version`: without files installed outside its
    folder (``../../../bin/isympy``: a script whose first line holds the venv's
    interpreter path), the install-only files of :data:`_INSTALL_ONLY`, and
    rows with no hash (``.pyc``), so that the same distribution installed in
    another venv, by another installer, hashes the same. A row is kept whole
    (path, hash, size); a quoted path (a comma in it) is read as CSV."""

    def kept(line: str) -> bool:
        if line.endswith(",,") or line.lstrip('"').startswith(("../", "/")):
            return False
        if ".dist-info/" not in line:
            return True
        path = next(csv.reader([line]))[0] if line.startswith('"') else line.split(",", 1)[0]
        folder, _, name = path.rpartition("/")
        return not (folder.endswith(".dist-info") and name in _INSTALL_ONLY)

    return "\n".join(sorted(filter(kept, record.splitlines()))).encode()


# -- files --------------------------------------------------------------------------

_HASHES: dict[tuple, str] = {}


def file_sha256(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes, computed once per process per version of
    the file (cached by path, inode, size, modification and change time: an
    edit that puts the modification time back, ``os.utime``, still moves the
    change time, which no user can set)."""
    st = os.stat(path)
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    digest = _HASHES.get(key)
    if digest is None:
        digest = _HASHES[key] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return digest
