"""The package import graph, function-level imports included: no cycle, and
the runtime (``kernel_cache``) never imports the compiler side (``warmup``);
the test folders' layout; and the order tests/conftest.py runs the test files
in."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kernel_cache.plan.sources import _imports

from . import conftest
from .conftest import ROOT


def import_graph() -> dict[str, set[str]]:
    """``{module: project modules it imports}`` for kernel_cache and warmup
    (``from pkg import name`` resolves to the module ``pkg.name`` when it is one)."""
    files = {}
    for pkg in ("kernel_cache", "warmup"):
        for f in (ROOT / pkg).rglob("*.py"):
            rel = f.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            files[".".join(parts)] = f
    graph = {}
    for name, f in files.items():
        deps = set()
        for d in _imports(Path(f), name):
            while d and d not in files:
                d = d.rpartition(".")[0]
            if d and d != name and "." in d:  # package __init__ re-exports left out
                deps.add(d)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "warmup.cli.main" in graph and "kernel_cache.runtime.load" in graph
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": set()}) == [
        ["a.x", "a.y", "a.z"]
    ]


def test_the_runtime_never_imports_the_compiler_side():
    graph = import_graph()
    leaks = {m: sorted(d for d in deps if d.startswith("warmup")) for m, deps in graph.items()}
    assert {m: d for m, d in leaks.items() if m.startswith("kernel_cache") and d} == {}


#: The layers inside kernel_cache, lowest first: a module may import its own
#: layer and the ones below, never one above (function-level imports included).
#: Config knows no kernel (a slot's name and import path are strings there),
#: kernels own their launch space (kernels/tiles.py), plan reads both.
LAYERS = ("kernel_cache.config", "kernel_cache.kernels", "kernel_cache.plan")


def layer(module: str) -> int | None:
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return None


def upward_edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(importer, imported)`` pairs where a layer imports one above it."""
    out = []
    for m, deps in graph.items():
        lm = layer(m)
        if lm is None:
            continue
        out += [(m, d) for d in sorted(deps) if (ld := layer(d)) is not None and ld > lm]
    return sorted(out)


def test_config_kernels_and_plan_import_only_downward():
    graph = import_graph()
    assert "kernel_cache.kernels.tiles" in graph and "kernel_cache.config.kernel_paths" in graph
    assert upward_edges(graph) == []
    # the edges the layering rests on are there, so the check above checks something
    assert "kernel_cache.kernels.tiles" in graph["kernel_cache.kernels.slots"]
    assert "kernel_cache.config.kernel_paths" in graph["kernel_cache.kernels.slots"]
    assert "kernel_cache.kernels.slots" in graph["kernel_cache.plan.launch"]
    assert "kernel_cache.kernels.tiles" in graph["kernel_cache.kernels.triton_decode"]


def test_the_layer_check_finds_an_upward_import_inside_a_function(tmp_path):
    src = tmp_path / "engine.py"
    src.write_text("def validator():\n    from kernel_cache.kernels.slots import SLOTS\n")
    found = _imports(src, "kernel_cache.config.engine")
    assert "kernel_cache.kernels.slots" in found  # a function-level import is an edge
    graph = {
        "kernel_cache.config.engine": {"kernel_cache.kernels.slots"},  # as a validator once did
        "kernel_cache.kernels.slots": {"kernel_cache.config.engine"},
        "kernel_cache.plan.launch": {"kernel_cache.kernels.slots", "kernel_cache.config.engine"},
        "kernel_cache.kernels.triton_decode": {"kernel_cache.plan.launch"},
    }
    assert upward_edges(graph) == [
        ("kernel_cache.config.engine", "kernel_cache.kernels.slots"),
        ("kernel_cache.kernels.triton_decode", "kernel_cache.plan.launch"),
    ]


def test_test_folders_mirror_the_packages():
    """Each test folder is named after the package it tests (docs/testing.md), and
    every test file sits in one; whole-path tests sit in ``e2e``."""
    tests = ROOT / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages = {p.parent.name for p in (ROOT / "kernel_cache").glob("*/__init__.py")}
    assert folders <= packages | {"warmup", "e2e"}, sorted(folders - packages)
    at_top = sorted(p.name for p in tests.glob("test_*.py"))
    assert at_top == ["test_imports.py", "test_layout.py"], at_top


def test_no_product_module_reaches_a_test_hook():
    """Fault injection lives in the test suite (``tests/hooks/kc_testhooks.py``,
    installed by the tests into their own processes): no module of
    ``kernel_cache`` or ``warmup`` imports a test-hook or test module (function-level
    imports included) or names a ``KERNEL_CACHE_TEST_*`` variable, so no setting
    can make a production process pause or fail."""
    import ast

    found = []
    for pkg in ("kernel_cache", "warmup"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if "KERNEL_CACHE_TEST_" in node.value:
                        found.append(f"{f.relative_to(ROOT)}:{node.lineno} names {node.value!r}")
                for n in names:
                    if "testhook" in n.lower() or n.split(".")[0] in ("tests", "conftest"):
                        found.append(f"{f.relative_to(ROOT)}:{node.lineno} imports {n}")
    assert found == []
    assert not (ROOT / "kernel_cache" / "_testhooks.py").exists()


def test_the_test_hook_scan_finds_an_import(tmp_path):
    import ast

    tree = ast.parse("def f():\n    from kernel_cache import _testhooks\n")
    names = [
        f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
        for a in n.names
    ]  # fmt: skip
    assert any("testhook" in n for n in names)


def _private_reaches(files: dict[str, str]) -> list[str]:
    """``module: line: what`` for each private name (``_x``, not dunder) that a
    module of ``files`` (module name -> source) takes from another module of
    ``files``: ``from m import _x``, or ``m._x`` where ``m`` was imported."""
    import ast

    found = []
    for name, text in files.items():
        tree = ast.parse(text)
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if node.module in files and node.module != name and a.name[:1] == "_":
                        if not a.name.startswith("__"):
                            found.append(
                                f"{name}:{node.lineno}: from {node.module} import {a.name}"
                            )
                    if f"{node.module}.{a.name}" in files:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in files:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id)
                if target and target != name and node.attr[:1] == "_":
                    if not node.attr.startswith("__"):
                        found.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    """What one module of ``kernel_cache`` or ``warmup`` uses of another is that
    module's public surface: no ``from m import _x`` and no ``m._x`` between
    them (a test may; the product may not)."""
    files = {}
    for pkg in ("kernel_cache", "warmup"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = f.read_text()
    assert _private_reaches(files) == []


def test_the_private_name_scan_finds_both_forms():
    files = {
        "pkg.a": "def _x():\n    pass\n",
        "pkg.b": "from pkg.a import _x\n",
        "pkg.c": "from pkg import a\n\na._x()\n",
        "pkg.d": "from pkg.a import __doc__\nfrom pkg import a\n\na.__name__\n",
    }
    assert _private_reaches(files) == ["pkg.b:1: from pkg.a import _x", "pkg.c:3: a._x"]


# -- the order tests/conftest.py gives the test files (_file_order) and the rows
# of tests/file_seconds.json it reads (_seconds)
def _item(nodeid: str, *fixtures: str):
    return SimpleNamespace(nodeid=nodeid, fixturenames=fixtures)


@pytest.fixture
def seconds(tmp_path, monkeypatch):
    """Writes the file-seconds table the order reads."""

    def write(table) -> None:
        path = tmp_path / "file_seconds.json"
        path.write_text(json.dumps(table))
        monkeypatch.setattr(conftest, "FILE_SECONDS", path)

    return write


def test_cold_files_first_then_warm_each_longest_first_unknown_counted_longest(seconds):
    seconds({"a.py": 10, "b.py": {"wall_s": 50, "cpu_s": 1}, "w1.py": 5, "w2.py": 90, "p.py": 60})
    items = [
        _item("a.py::t"),
        _item("b.py::t"),
        _item("new.py::t"),
        _item("w1.py::t", "warm_cache"),
        _item("w2.py::t"),
        _item("w2.py::u", "warm_cache"),
        _item("p.py::t", "plain_cache_copy", "plain_warm_cache"),  # the plain kernels' build
    ]
    order = conftest._file_order(items)
    assert sorted(order, key=order.get) == ["new.py", "b.py", "a.py", "w2.py", "p.py", "w1.py"]


def test_a_server_file_is_not_followed_by_another_while_one_without_is_left(seconds):
    seconds({"s1.py": 100, "s2.py": 90, "c.py": 10, "w.py": 200})
    items = [
        _item("s1.py::t", "s3_server"),  # a fixture of the servers: holds them
        _item("s2.py::t", "redis_db", "redis_url"),
        _item("c.py::t"),
        _item("w.py::t", "warm_cache"),  # another group: never pulled forward
    ]
    order = conftest._file_order(items)
    assert sorted(order, key=order.get) == ["s1.py", "c.py", "s2.py", "w.py"]


@pytest.mark.parametrize(
    "table", [None, [], "text", {"a.py": True}, {"a.py": "9"}, {"a.py": 1e999}, {"a.py": -1}]
)
def test_an_unusable_table_or_row_counts_the_file_as_longest(seconds, table):
    seconds(table)
    rows = table if isinstance(table, dict) else {}
    assert all(conftest._seconds(v) is None for v in rows.values())
    items = [_item("z.py::t"), _item("a.py::t")]
    order = conftest._file_order(items)
    assert set(order) == {"a.py", "z.py"}


def test_a_huge_integer_is_not_a_number_of_seconds():
    assert conftest._seconds(10**400) is None
    assert conftest._seconds({"wall_s": 3}) == 3.0
