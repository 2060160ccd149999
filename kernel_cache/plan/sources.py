"""The ``sources`` key component: every project file the compile path can run,
found by reading the imports (``ast``), and the files of a slot implementation.

:func:`source_files` starts at :data:`COMPILE_ROOTS` and follows imports,
function-level ones included, through :data:`HASHED_PACKAGES`;
:func:`kernel_source_files` does the same for a slot implementation's module
within its top-level package and other top-level modules outside the standard
library, torch and the installed distributions. Nothing is imported. The
component (:func:`sources_component`) is part of every key
(:func:`kernel_cache.plan.keys.build_key`); docs/keys.md says what counts.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from kernel_cache.errors import ConfigError
from kernel_cache.plan.file_origin import is_outside_module

#: Where the compile path starts: the module that exports and compiles a
#: variant. :func:`source_files` follows its imports, function-level ones
#: included, through these top-level packages.
COMPILE_ROOTS = ("warmup.builder.compiler",)
HASHED_PACKAGES = ("kernel_cache", "warmup")


def _module_file(name: str, specs: dict | None = None) -> Path | None:
    """The source file of module ``name`` (a package's ``__init__.py``, or a
    top-level single-file module), found without importing it (nor its
    package); None if there is none. ``specs`` keeps the lookups of one
    search (each name, and each top-level package, is looked up once)."""
    specs = {} if specs is None else specs
    memo = ("file", name)
    if memo not in specs:
        specs[memo] = _find_module_file(name, specs)
    return specs[memo]


def _find_module_file(name: str, specs: dict) -> Path | None:
    import importlib.util

    top, *rest = name.split(".")
    if top not in specs:
        try:
            specs[top] = importlib.util.find_spec(top)  # a top-level lookup executes nothing
        except (ImportError, ValueError):
            specs[top] = None
    spec = specs[top]
    if spec is None:
        return None
    if not spec.submodule_search_locations:  # a single-file top-level module
        origin = Path(spec.origin) if spec.origin else None
        ok = not rest and origin is not None and origin.suffix == ".py" and origin.is_file()
        return origin if ok else None
    base = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _rel(name: str, path: Path, specs: dict | None = None) -> str:
    """``path`` as recorded in the key: relative to the folder above its
    top-level package (``mykernels/helpers.py``)."""
    top = _module_file(name.split(".")[0], specs)
    if top is None or top.name != "__init__.py":
        return path.name
    return f"{name.split('.')[0]}/{path.relative_to(top.parent).as_posix()}"


#: What :func:`_read_imports` found, by :func:`scan_key` (the file's bytes and
#: module): parsed in this process, or taken from a local cache's memo
#: (:mod:`kernel_cache.store.imports_memo`, through :func:`remember_imports`).
_SCANNED: dict[str, frozenset[str]] = {}
#: The keys of :data:`_SCANNED` parsed in this process, and those used by it.
_PARSED: set[str] = set()
_USED: set[str] = set()


@functools.cache
def scanner() -> str:
    """sha256 (hex, 16 chars) of this module's source: a memo of import scans is
    valid only for the code that made it (and the Python that parsed it)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def scan_key(digest: str, module: str, path: Path) -> str:
    """``"<sha256 hex of the file's bytes>:<module>:<m|p>"``: what an import scan
    depends on (``p``: a package's ``__init__.py``, whose relative imports
    resolve against the package itself)."""
    return f"{digest}:{module}:{'p' if path.name == '__init__.py' else 'm'}"


def remember_imports(entries: dict[str, list[str]]) -> int:
    """Take import scans made by another process (a memo read by
    :func:`kernel_cache.store.imports_memo.load`, already checked to come from
    this :func:`scanner` and Python version): ``{scan_key: [module, ...]}``.
    Returns how many were new here."""
    new = 0
    for k, names in entries.items():
        if k not in _SCANNED:
            _SCANNED[k] = frozenset(names)
            new += 1
    return new


def scans_to_keep() -> tuple[dict[str, list[str]], set[str]]:
    """``(scans, parsed)``: every import scan this process used, parsed or
    remembered (``{scan_key: sorted module names}``), and the keys of those it
    parsed itself (what a memo does not hold yet)."""
    scans = {k: sorted(_SCANNED[k]) for k in _USED}
    return scans, set(_PARSED & _USED)


def _imports(
    path: Path, module: str, data: bytes | None = None, digest: str | None = None
) -> frozenset[str]:
    """Module names ``path`` (module ``module``, whose bytes are ``data`` with
    sha256 ``digest``) imports anywhere in its body, relative imports resolved;
    ``from X import Y`` yields X and X.Y. Parsed once per content
    (:data:`_SCANNED`); without ``data`` the file is read here."""
    if data is None:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
    k = scan_key(digest, module, path)
    if k not in _SCANNED:
        _SCANNED[k] = frozenset(_read_imports(path, module, data))
        _PARSED.add(k)
    _USED.add(k)
    return _SCANNED[k]


def _read_imports(path: Path, module: str, data: bytes) -> set[str]:
    import ast

    tree = ast.parse(data, str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    # Imports are statements: only statement lists are walked, not expressions
    # (an ast.walk of every node cost most of engine start's key computation).
    todo: list = list(tree.body)
    while todo:
        node = todo.pop()
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                todo.extend(stmts)
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


@functools.cache
def source_files(
    roots: tuple[str, ...] = COMPILE_ROOTS,
    packages: tuple[str, ...] = HASHED_PACKAGES,
    outside: bool = False,
) -> dict[str, str]:
    """Every source file of ``packages`` the compile path can run: ``roots``
    and, transitively, what they import within ``packages`` (function-level
    imports included), as ``{"warmup/builder/compiler.py": sha256 hex (16
    chars)}``, sorted by path. With ``outside``, imports of other top-level
    modules that are neither the standard library, torch nor an installed
    distribution's files (:func:`kernel_cache.plan.file_origin.is_outside_module`:
    a sibling module, another source tree, an editable install) are followed too.

    The set is found by reading the code (``ast``), not kept by hand, so a new
    helper module a kernel imports is covered by the next build. A test runs a
    compile under a profiler and checks that every project file it executed is
    in this set.

    Raises:
        ConfigError: a root module cannot be found (e.g. ``warmup`` is not installed).
    """
    found: dict[str, str] = {}
    todo = list(roots)
    seen: set[str] = set()
    specs: dict = {}
    while todo:
        name = todo.pop()
        top = name.split(".")[0]
        if name in seen or (top not in packages and not (outside and is_outside_module(top))):
            continue
        seen.add(name)
        path = _module_file(name, specs)
        if path is None:
            if name in roots:
                raise ConfigError(
                    f"cannot find module {name!r}, whose sources are part of the cache key; "
                    + (
                        "install kernel-cache whole (kernel_cache and warmup)"
                        if packages == HASHED_PACKAGES
                        else "make it importable here (pip install it or add it to PYTHONPATH)"
                    )
                )
            continue  # "from pkg import name" where name is not a module
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        found[_rel(name, path, specs)] = digest[:16]
        parents = name.split(".")
        # A package's __init__ runs before its modules: its bytes count, but its
        # imports are re-exports, followed only where a module of the compile
        # path imports them itself.
        for i in range(1, len(parents)):
            init = _module_file(".".join(parents[:i]), specs)
            if init is not None:
                found[_rel(parents[0], init, specs)] = hashlib.sha256(
                    init.read_bytes()
                ).hexdigest()[:16]
        if path.name != "__init__.py" or name in roots:
            todo.extend(_imports(path, name, data, digest))
    return dict(sorted(found.items()))


def kernel_source_files(path: str, slot: str | None = None) -> dict[str, str]:
    """The source files of a slot implementation ``path`` (``package.module:Factory``):
    its module and every module it imports of its top-level package and of other
    top-level modules outside the standard library, torch and the installed
    distributions (``source_files(..., outside=True)``), found as
    :func:`source_files` finds the project's (nothing is imported). Code it
    reaches otherwise (a module imported by a computed name) is recorded when
    it is traced (:mod:`kernel_cache.plan.traced`).

    Raises:
        ConfigError: the module cannot be found on ``sys.path``, or one of its
            files cannot be read as Python (names the slot, the path and the error).
    """
    module = path.partition(":")[0]
    where = f"kernel {slot}={path}" if slot else f"kernel {path}"
    try:
        return source_files((module,), (module.split(".")[0],), outside=True)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (SyntaxError, ValueError, OSError) as e:  # the engine's file: ast.parse, read_bytes
        raise ConfigError(
            f"{where}: cannot read its sources, which are part of the cache key: "
            f"{type(e).__name__}: {e}"
        ) from None


def sources_component(
    roots: tuple[str, ...] = COMPILE_ROOTS, kernel: str | None = None, slot: str | None = None
) -> str:
    """The ``sources`` key component: :func:`source_files` (and, given a slot
    implementation's import path ``kernel``, :func:`kernel_source_files`) as
    compact JSON, so a stored entry records which file changed (``kernel-cache
    explain``)."""
    files = dict(source_files(roots))
    if kernel is not None:
        files.update(kernel_source_files(kernel, slot))
    return json.dumps(dict(sorted(files.items())), separators=(",", ":"))
