"""The build side of traced files: what an artifact's code came from, recorded
while a kernel is built and exported.

A key's ``sources`` component is found by reading imports
(:func:`kernel_cache.plan.sources.source_files`); code that a kernel reaches
another way (a module loaded by a computed name, a helper module read through
an attribute) is not in it. So warmup also records, for each artifact, the
files whose Python code ran while the kernel was built and exported
(:func:`manifest_of`, called by :mod:`warmup.builder.recorder`), each recorded
as its classification says (:mod:`kernel_cache.plan.file_origin`) under its
path relative to the folder its top-level module was imported from
(``userkern2/dyn_helper.py``, ``nc_outside_helper.py``), never an absolute
path: a pod mounts things elsewhere. A file hashed on its own must be the code
that ran: the bytes imported (:func:`record_imports`), compiled to the code
objects that ran, never a stale ``.pyc`` (:func:`stale_bytecode`).

The record (:class:`~kernel_cache.plan.traced.Manifest`) and its check at
engine start are :mod:`kernel_cache.plan.traced`; the design is in docs/keys.md.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

from kernel_cache.errors import CompileError
from kernel_cache.plan.file_origin import (
    GENERATED,
    OTHER,
    SITE,
    STDLIB,
    TORCH,
    classify,
    dist_of,
    dist_version,
    file_sha256,
    norm_path,
)
from kernel_cache.plan.traced import Manifest, find_path

log = logging.getLogger("kernel_cache")


def _relative(path: str, module: str | None) -> str | None:
    """``path`` relative to the folder its top-level module was imported from
    (``module``: the module whose file it is, if known), else to the longest
    ``sys.path`` entry holding it; None if neither holds it."""
    if module is not None:
        top = module.split(".")[0]
        mod = sys.modules.get(top)
        locations = list(getattr(mod, "__path__", None) or ())
        for loc in locations:
            loc = norm_path(loc)
            if path.startswith(loc + os.sep):
                return f"{top}/{Path(path[len(loc) + 1 :]).as_posix()}"
        if not locations and os.path.basename(path) == f"{top}.py":
            return f"{top}.py"
    roots = sorted((norm_path(p or os.getcwd()) for p in sys.path), key=len, reverse=True)
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
            out.setdefault(norm_path(f), name)
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
            path = norm_path(f)
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
            LOADED_SOURCES[norm_path(path)] = hashlib.sha256(data).hexdigest() if same else None
            _LOADED_BYTES[norm_path(path)] = data
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
    return kind == SITE and dist_of(norm_path(filename)) is None


def code_is_files(code, filename: str) -> bool:
    """Whether module code ``code``, run under the name ``filename``, is that
    file's: compiled from the bytes imported (:data:`LOADED_SOURCES`), else from
    those on disk. False where neither can be read."""
    path = norm_path(filename)
    data = _LOADED_BYTES.get(path)
    try:
        data = Path(path).read_bytes() if data is None else data
    except (OSError, ValueError):  # ValueError: a NUL byte in the name
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
        path = norm_path(filename)
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
        found = find_path(rel)
        if found is None or norm_path(found) != path:
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
            pyc = stale_bytecode(norm_path(f))
            if pyc is not None:
                out.append((norm_path(f), pyc))
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
