"""The files an artifact's code came from, as recorded when it was traced, and
their check against the files here.

A key's ``sources`` component is found by reading imports
(:func:`kernel_cache.plan.sources.source_files`); code that a kernel reaches another
way (a module loaded by a computed name, a helper module read through an
attribute) is not in it. So warmup also records, for each artifact, the files
whose Python code ran while the kernel was built and exported
(:func:`manifest_of`, called by :mod:`warmup.builder.compiler`), and engine start
checks that record against the files on disk (:func:`changes`). The design
(keys derived from a changed record, what is not covered) is in docs/keys.md.

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
  installs, kernel_cache and warmup themselves): its sha256, under its path
  relative to the folder its top-level module was imported from
  (``userkern2/dyn_helper.py``, ``nc_outside_helper.py``), never an absolute
  path: a pod mounts things elsewhere.

Nothing here imports torch or a module being checked: files are found with
:func:`importlib.util.find_spec` on top-level names, versions with
:mod:`importlib.metadata`, and hashes and versions are cached per process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import sysconfig
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kernel_cache.errors import CompileError, shown

log = logging.getLogger("kernel_cache")

#: The value recorded for a listed file that is not found here, or a
#: distribution that is not installed.
MISSING = "missing"

#: How many manifest mismatches a lookup follows through derived keys
#: (docs/keys.md): each level is an artifact compiled under another state of
#: the files its parent recorded.
MAX_DERIVED = 8


#: Bounds of a recorded manifest (a record is a writer's text: one over them is
#: corrupt, and nothing it names is read). A build records tens to a few
#: hundred files, each path relative to its import root and well under 200
#: characters; at these bounds a record still fits
#: :data:`kernel_cache.store.entry.META_MAX_BYTES`.
MAX_TRACED_FILES = 2048
MAX_PATH_CHARS = 256
MAX_DISTS = 1024
MAX_DIST_CHARS = 128


def shown_short(text: object) -> str:
    """Record text quoted for a message (:func:`kernel_cache.errors.shown`, 80 characters)."""
    return shown(text, 80)


def check_path(path: str) -> str:
    """``path`` if it is a recorded file path this module may look up: relative
    (no leading ``/``, no drive or backslash), no ``.``, ``..`` or empty part,
    no NUL or other control character, at most :data:`MAX_PATH_CHARS`.

    Raises:
        ValueError: naming the path (quoted) and the rule it breaks.
    """
    if not path or len(path) > MAX_PATH_CHARS:
        raise ValueError(f"path {shown(path, 80)} must have 1 to {MAX_PATH_CHARS} characters")
    if any(not c.isprintable() for c in path) or "\\" in path or ":" in path:
        raise ValueError(f"path {shown(path, 80)} has a control character, \\ or :")
    if path.startswith("/") or any(p in ("", ".", "..") for p in path.split("/")):
        raise ValueError(
            f"path {shown(path, 80)} must be relative to an import root, without . or .."
        )
    return path


class Manifest(BaseModel):
    """What an artifact's code came from beyond its key's static sources.

    ``files``: ``{path relative to its import root: sha256 hex (64)}``;
    ``dists``: ``{distribution name: version}``. Also the state of those same
    items here, when a key is derived (:func:`derive_key`); then a value may be
    :data:`MISSING`. Bounded (:data:`MAX_TRACED_FILES`, :data:`MAX_PATH_CHARS`,
    :data:`MAX_DISTS`, :data:`MAX_DIST_CHARS`) and every path checked by
    :func:`check_path`: validation raises ``ValidationError`` otherwise.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    files: dict[str, str] = Field(default_factory=dict, max_length=MAX_TRACED_FILES)
    dists: dict[str, str] = Field(default_factory=dict, max_length=MAX_DISTS)

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        for path, digest in v.items():
            check_path(path)
            if digest != MISSING and (
                len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest)
            ):
                raise ValueError(f"{shown_short(path)}: {shown_short(digest)} is not a sha256")
        return v

    @field_validator("dists")
    @classmethod
    def _dists(cls, v: dict[str, str]) -> dict[str, str]:
        for name, version in v.items():
            if not 0 < len(name) <= MAX_DIST_CHARS or len(version) > MAX_DIST_CHARS:
                raise ValueError(
                    f"distribution {shown_short(name)} {shown_short(version)}: name and "
                    f"version must have at most {MAX_DIST_CHARS} characters"
                )
        return v

    def record(self) -> dict:
        return {
            "files": dict(sorted(self.files.items())),
            "dists": dict(sorted(self.dists.items())),
        }


# -- where a file comes from --------------------------------------------------------


def _norm(path: str) -> str:
    return os.path.normcase(os.path.abspath(path))


@functools.cache
def _site_dirs() -> tuple[str, ...]:
    """Folders distributions are installed into (``site-packages``, ``dist-packages``)."""
    import site

    dirs = set(site.getsitepackages()) | {site.getusersitepackages()}
    dirs |= {p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")}
    return tuple(sorted({_norm(d) + os.sep for d in dirs if d}))


@functools.cache
def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(sorted({_norm(paths[k]) + os.sep for k in ("stdlib", "platstdlib")}))


@functools.cache
def _torch_dir() -> str | None:
    """torch's package folder, found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return _norm(list(spec.submodule_search_locations)[0]) + os.sep


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
    path = _norm(filename)
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
    loc = _norm(str(dist.locate_file("")))
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
    first 16 hex of the sha256 of its ``RECORD`` (``"0.1.0 (RECORD
    1a2b3c4d5e6f7a8b)"``; the version alone where it has none), or
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
    return f"{dist.version} (RECORD {hashlib.sha256(record.encode()).hexdigest()[:16]})"


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


def _relative(path: str, module: str | None) -> str | None:
    """``path`` relative to the folder its top-level module was imported from
    (``module``: the module whose file it is, if known), else to the longest
    ``sys.path`` entry holding it; None if neither holds it."""
    if module is not None:
        top = module.split(".")[0]
        mod = sys.modules.get(top)
        locations = list(getattr(mod, "__path__", None) or ())
        for loc in locations:
            loc = _norm(loc)
            if path.startswith(loc + os.sep):
                return f"{top}/{Path(path[len(loc) + 1 :]).as_posix()}"
        if not locations and os.path.basename(path) == f"{top}.py":
            return f"{top}.py"
    roots = sorted((_norm(p or os.getcwd()) for p in sys.path), key=len, reverse=True)
    for root in roots:
        if path.startswith(root + os.sep):
            return Path(path[len(root) + 1 :]).as_posix()
    return None


def _module_files() -> dict[str, str]:
    """``{normalized file: module name}`` of the modules imported in this process."""
    out: dict[str, str] = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and f.endswith(".py"):
            out.setdefault(_norm(f), name)
    return out


#: sha256 of the bytes each source file held when this process imported it, by
#: path, for files hashed on their own (:data:`OTHER`); None where the code the
#: import ran was not those bytes compiled (a stale ``.pyc``, or the file changed
#: while it was read). Filled by :func:`record_imports` (the compile worker), and
#: preferred by :func:`manifest_of` to hashing the file again: an edit while the
#: kernel compiles then misses at engine start, instead of naming code that did
#: not run.
LOADED_SOURCES: dict[str, str | None] = {}
#: The bytes behind each hash of :data:`LOADED_SOURCES`, by path: code that ran
#: under such a file's name must compile from them (:func:`_hash_checked`), which
#: refuses code compiled from other text under that name (``compile(text,
#: __file__, ...)``, a loader that names one file and reads another).
_LOADED_BYTES: dict[str, bytes] = {}


def record_imports() -> None:
    """From now on, record in :data:`LOADED_SOURCES` every import of a source
    file hashed on its own (:data:`OTHER`): the sha256 of its bytes, checked by
    compiling them and comparing with the code the import runs. Modules loaded
    already (a compile worker's own, imported as it started) are recorded as
    their files are now, None for one whose bytecode is stale
    (:func:`stale_bytecode`). Idempotent."""
    from importlib.machinery import SourceFileLoader

    original = SourceFileLoader.get_code
    if getattr(original, "_kernel_cache_records", False):
        return
    for module in list(sys.modules.values()):
        f = getattr(module, "__file__", None)
        if isinstance(f, str) and f.endswith(".py") and classify(f) == OTHER:
            path = _norm(f)
            try:
                data = Path(path).read_bytes()
            except OSError:
                continue
            digest = hashlib.sha256(data).hexdigest()
            LOADED_SOURCES[path] = None if stale_bytecode(path) else digest
            _LOADED_BYTES[path] = data

    def get_code(self, fullname):
        code = original(self, fullname)
        path = self.get_filename(fullname)
        if code is not None and path.endswith(".py") and classify(path) == OTHER:
            try:
                with open(path, "rb") as f:
                    data = f.read()
                same = compile(data, path, "exec", dont_inherit=True) == code
            except (OSError, SyntaxError, ValueError):
                data, same = b"", False
            LOADED_SOURCES[_norm(path)] = hashlib.sha256(data).hexdigest() if same else None
            _LOADED_BYTES[_norm(path)] = data
        return code

    get_code._kernel_cache_records = True
    SourceFileLoader.get_code = get_code


def changed_source_error(path: str) -> CompileError:
    """The error for code of ``path`` that is not the compiled bytes this process
    read from it when importing it (:data:`LOADED_SOURCES` holds None)."""
    return CompileError(
        f"the code this compile ran from {path} is not that file's contents: it changed "
        "while it was imported, or Python ran a stale .pyc of it (one whose recorded "
        "modification time and size match the edited file); touch the file and warm again"
    )


def _code_objects(code, out: set) -> set:
    """``code`` and every code object nested in its constants, into ``out``."""
    out.add(code)
    for c in code.co_consts:
        if isinstance(c, type(code)):
            _code_objects(c, out)
    return out


def _hash_checked(path: str, ran, data: bytes | None = None) -> str:
    """sha256 of file ``path``'s bytes (``data`` if given: the bytes imported),
    which must compile to every code object in ``ran`` (code of it that ran:
    read by ``runpy``, ``exec`` or a loader the import recording does not see,
    or imported before it started).

    Raises:
        CompileError: a code object that ran is not the file's: the file changed
            since (while the kernel compiled), or the code came from elsewhere
            (a ``.pyc`` beside it, other text compiled under the file's name).
    """
    if data is None:
        data = Path(path).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    fresh = _compiled(path, digest, data)
    if any(c not in fresh for c in ran):
        raise changed_source_error(path)
    return digest


def is_own_source(filename: str) -> bool:
    """Whether code that ran inside an import from ``filename`` counts: a file
    classified :data:`OTHER`, or one in a site folder that no distribution lists
    with its sha256 (a module copied there, an ``.egg-info``'s), which no version
    stands for either."""
    kind = classify(filename)
    if kind == OTHER:
        return True
    return kind == SITE and dist_of(_norm(filename)) is None


def code_is_files(code, filename: str) -> bool:
    """Whether module code ``code``, run under the name ``filename``, is that
    file's: compiled from the bytes imported (:data:`LOADED_SOURCES`), else from
    those on disk. False where neither can be read."""
    path = _norm(filename)
    data = _LOADED_BYTES.get(path)
    try:
        data = Path(path).read_bytes() if data is None else data
    except OSError:
        return False
    return code in _compiled(path, hashlib.sha256(data).hexdigest(), data)


@functools.lru_cache(maxsize=256)
def _compiled(path: str, digest: str, data: bytes) -> frozenset:
    """Every code object of ``data`` (file ``path``, sha256 ``digest``) compiled as
    the import system compiles it, and as ``compile(data, path, "exec")`` does in
    a module with ``from __future__ import annotations`` (it inherits that flag,
    and code objects compare their flags); for a file that holds one expression,
    also as ``compile(data, path, "eval")``. Cached per version (a worker builds
    many manifests of the same files)."""
    import __future__

    out: set = set()
    for mode in ("exec", "eval"):
        for flags in (0, __future__.annotations.compiler_flag):
            try:
                _code_objects(compile(data, path, mode, flags=flags, dont_inherit=True), out)
            except (SyntaxError, ValueError):
                pass
    return frozenset(out)


def manifest_of(filenames, ran: dict | None = None) -> Manifest:
    """The manifest of the code files ``filenames`` (``co_filename`` of code
    that ran): each classified (:func:`classify`; the module docstring says
    what is recorded how). A file outside every import root (a script run by
    its path) cannot be found by another process and is left out, with a
    warning. ``ran``: the code objects that ran, by file; a file hashed on its
    own must compile to them (:func:`_hash_checked`), unless its bytes were
    recorded when imported (:data:`LOADED_SOURCES`).

    Raises:
        CompileError: code ran from a file outside the standard library, torch and
            the distributions that is not on disk (a ``.pyc``-only module), or
            whose recorded path engine start would find as another file (a
            package that adds a folder to its ``__path__`` at import): its
            identity cannot be recorded, so no entry is built from it.
    """
    modules = _module_files()
    files: dict[str, str] = {}
    dists: dict[str, str] = {}
    for filename in sorted(set(filenames)):
        kind = classify(filename)
        if kind in (GENERATED, STDLIB, TORCH):
            continue
        path = _norm(filename)
        if not os.path.isfile(path):
            # a sourceless module of a distribution (its RECORD lists the .pyc
            # beside where the .py would be): recorded by the distribution
            dist = dist_of(path + "c") if kind == SITE and os.path.isfile(path + "c") else None
            if dist is not None:
                dists[dist] = dist_version(dist)
            elif os.path.isabs(path) and (kind == OTHER or os.path.isfile(path + "c")):
                raise CompileError(
                    f"code from {filename} ran while the kernel was built, and that file "
                    "is not on disk (a module shipped as .pyc only, or a file removed "
                    "since): its code cannot be part of the entry's identity; ship the "
                    ".py source, or install the package as a distribution (recorded "
                    "by name and version)"
                )
            continue
        if kind == SITE:
            dist = dist_of(path)
            if dist is not None:
                dists[dist] = dist_version(dist)
                continue
        rel = _relative(path, modules.get(path))
        if rel is None:
            log.warning("traced file %s is outside every import root: not recorded", filename)
            continue
        found = _find(rel)
        if found is None or _norm(found) != path:
            # engine start would hash another file (or none) for this record: a
            # package that edits its __path__ in __init__, which find_spec does not run
            raise CompileError(
                f"code from {filename} ran while the kernel was built, but its recorded "
                f"path {rel} names {found or 'no file'} when found as engine start finds "
                "it (the top-level module along sys.path, then its package folders, "
                "without running __init__): its code cannot be part of the entry's "
                "identity; put the module in its package's own folder or on sys.path "
                "rather than adding folders to __path__ at import"
            )
        codes = (ran or {}).get(filename)
        if path in LOADED_SOURCES:  # the bytes imported, whatever the file holds now
            if LOADED_SOURCES[path] is None:
                raise changed_source_error(path)
            if codes:  # and every code that ran under its name is theirs
                _hash_checked(path, codes, _LOADED_BYTES[path])
            files[rel] = LOADED_SOURCES[path]
            continue
        pyc = stale_bytecode(path)
        if pyc is not None:
            raise stale_bytecode_error(path, pyc)
        files[rel] = _hash_checked(path, codes) if codes else file_sha256(path)
    return Manifest(files=files, dists=dists)


def stale_bytecode_error(path: str, pyc: str) -> CompileError:
    """The error for code of source file ``path`` that ran from ``pyc``, bytecode
    of an earlier version of it (:func:`stale_bytecode`)."""
    return CompileError(
        f"code from {path} ran from {pyc}, bytecode Python cached for an earlier "
        "version of that file: Python reuses a .pyc whose source has the same "
        "modification time and size, and the file was changed keeping both. The entry "
        f"would not hold this file's code; remove {pyc} (or touch {path}) and warm again"
    )


def stale_loaded_modules() -> list[tuple[str, str]]:
    """``(source file, .pyc)`` of each module loaded in this process from a file
    hashed on its own (:data:`OTHER`: the project, the engine's source trees)
    whose code came from bytecode of an earlier version of it
    (:func:`stale_bytecode`): also those imported before a trace whose
    module-level values it read."""
    out = []
    for module in list(sys.modules.values()):
        f = getattr(module, "__file__", None)
        if isinstance(f, str) and f.endswith(".py") and classify(f) == OTHER:
            pyc = stale_bytecode(_norm(f))
            if pyc is not None:
                out.append((_norm(f), pyc))
    return out


def stale_bytecode(path: str) -> str | None:
    """The ``.pyc`` Python loads for source file ``path`` without compiling it
    (a timestamp ``.pyc`` whose recorded modification time and size are the
    source's, or a hash ``.pyc`` it does not check) when that bytecode is not
    the compiled current source; None when the import compiles the source, or
    the cached bytecode is the source's. Compares code objects
    (``marshal`` of the ``.pyc`` against :func:`compile` of the source, as the
    import system compiles it), memoized per process by the two files' stats.
    """
    import importlib.util

    try:
        pyc = importlib.util.cache_from_source(path)
        st, pst = os.stat(path), os.stat(pyc)
    except (OSError, NotImplementedError, ValueError):
        return None
    key = (
        (path, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino),
        (pst.st_mtime_ns, pst.st_ctime_ns, pst.st_size, pst.st_ino),
    )
    return _stale_bytecode(key, pyc)


@functools.lru_cache(maxsize=4096)
def _stale_bytecode(key: tuple, pyc: str) -> str | None:
    import _imp
    import importlib.util
    import marshal

    path, mtime_ns, _, size = key[0][:4]
    try:
        with open(pyc, "rb") as f:
            data = f.read()
        with open(path, "rb") as f:
            source = f.read()
    except OSError:
        return None
    if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER:
        return None  # not loadable: the import compiles the source
    flags = int.from_bytes(data[4:8], "little")
    if flags & ~0b11:
        return None
    if flags & 0b1:  # hash-based: checked against the source unless told not to
        mode = _imp.check_hash_based_pycs
        if mode != "never" and (flags & 0b10 or mode == "always"):
            return None
    elif (
        int.from_bytes(data[8:12], "little") != (mtime_ns // 10**9) & 0xFFFFFFFF
        or int.from_bytes(data[12:16], "little") != size & 0xFFFFFFFF
    ):
        return None  # its stamp is not the source's: the import compiles the source
    try:
        cached = marshal.loads(data[16:])
        fresh = compile(source, path, "exec", dont_inherit=True)
    except Exception:  # noqa: BLE001 - unreadable either way: the import fails, not us
        return None
    return None if cached == fresh else pyc


# -- the check at engine start ----------------------------------------------------


def _fresh_spec(name: str):
    """The spec of top-level module ``name`` as a process that has not imported
    it finds it (:data:`sys.meta_path`, ignoring :data:`sys.modules`: a package
    imported here may have edited its ``__path__``); None if not found."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(name, None)
        if spec is not None:
            return spec
    return None


def _search(rel: str) -> str | None:
    top, _, rest = rel.partition("/")
    name = top[:-3] if not rest and top.endswith(".py") else top
    try:
        spec = _fresh_spec(name) if name.isidentifier() else None
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        if rest and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                cand = os.path.join(loc, rest)
                if os.path.isfile(cand):
                    return cand
        elif not rest and spec.origin and os.path.basename(spec.origin) == top:
            return spec.origin
    for entry in sys.path:
        cand = os.path.join(entry or os.getcwd(), rel)
        if os.path.isfile(cand):
            return cand
    return None


#: ``{(recorded path, sys.path): file found}``: where each recorded path was found.
_FOUND: dict[tuple, str | None] = {}


def find_file(rel: str) -> Path | None:
    """The file a recorded path names here, found as import finds it: the top-level
    module (``userkern2``, ``nc_outside_helper`` for ``nc_outside_helper.py``)
    along ``sys.path`` (:func:`importlib.util.find_spec`, which executes
    nothing), then the rest of the path inside its package folder(s); else the
    first ``sys.path`` entry holding the path. None if not found."""
    found = _find(rel)
    return None if found is None else Path(found)


def _find(rel: str, fresh: bool = False) -> str | None:
    """:func:`find_file` as a string, remembered per process and ``sys.path``."""
    key = (rel, tuple(sys.path))
    if fresh or key not in _FOUND:
        _FOUND[key] = _search(rel)
    return _FOUND[key]


def _state(rel: str) -> str:
    """The sha256 of the file ``rel`` names here, or :data:`MISSING`."""
    for fresh in (False, True):  # a remembered file that is gone: search again
        path = _find(rel, fresh)
        if path is None:
            continue
        try:
            return file_sha256(path)
        except OSError:
            continue
    return MISSING


def current(manifest: Manifest) -> Manifest:
    """The state here of exactly the items ``manifest`` lists: each file's
    sha256 (:data:`MISSING` if not found), each distribution's version. Where
    a file is found is remembered and its hash cached (by inode, size and
    modification time), so a check costs a ``stat`` per file after the first."""
    return Manifest(
        files={rel: _state(rel) for rel in manifest.files},
        dists={d: dist_version(d) for d in manifest.dists},
    )


def _short(v: str) -> str:
    return v if v == MISSING else v[:16]


def changes(stored: Manifest, here: Manifest) -> list[str]:
    """What differs between a recorded manifest and the state here
    (:func:`current`), one line per item: ``"userkern2/dyn_helper.py changed
    (sha256 1a2b... stored, 9f8e... here)"``, ``"nc_helper.py not found on
    sys.path"``, ``"distribution numpy 2.1.0 stored, 2.2.0 here"``."""
    out = []
    for rel, old in sorted(stored.files.items()):
        new = here.files.get(rel, MISSING)
        if new == old:
            continue
        if new == MISSING:
            out.append(f"{rel} not found on sys.path (sha256 {_short(old)} stored)")
        else:
            out.append(f"{rel} changed (sha256 {_short(old)} stored, {_short(new)} here)")
    for name, old in sorted(stored.dists.items()):
        new = here.dists.get(name, MISSING)
        if new != old:
            shown = "not installed" if new == MISSING else new
            out.append(f"distribution {name} {old} stored, {shown} here")
    return out


def derive_key(parent: str, state: Manifest) -> str:
    """The key (sha256 hex) of an artifact compiled where the items recorded
    by the entry at ``parent`` are in ``state`` (:func:`current`)."""
    body = json.dumps(state.record(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"kc-derived\n{parent}\n{body}".encode()).hexdigest()


def chain_key(base: str, states) -> str:
    """``base`` followed through :func:`derive_key` for each state of ``states``."""
    key = base
    for s in states:
        key = derive_key(key, s if isinstance(s, Manifest) else Manifest.model_validate(s))
    return key
