"""The package import graph, function-level imports included: no cycle, and
the runtime (``kernel_cache``) never imports the compiler side (``warmup``)."""

from __future__ import annotations

from pathlib import Path

from kernel_cache.plan.sources import _imports

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
