"""Compiles this process ran, read from torch's own counters without importing
torch's compile stack.

Torch keeps its compile counters in Dynamo's utilities module (imported by
Dynamo and by every Inductor compile, ``torch.compile`` and AOTInductor alike);
:func:`kernel_cache.torch_compat.compile_counters` reads them only where that
module is already imported, so asking imports nothing. Where it is not, this
process has compiled nothing through torch's compile stack. Where it is and a
counter is missing, that raises
:class:`~kernel_cache.errors.TorchAPIDriftError`: a renamed counter is never
read as 0 compiles.

What is counted (torch 2.13):

- ``compiles``: Inductor graph compiles, the entries Inductor's
  ``compile_fx_inner`` appends to the compile-time metrics
  (:attr:`~kernel_cache.torch_compat.CompileCounters.metrics`) when it finishes
  a graph. ``torch.compile`` with the default backend adds one
  per graph it compiles (two for a training graph: forward and backward),
  AOTInductor (``aoti_compile_and_package``, what warmup runs) one per package,
  an FX-graph-cache hit one too (the compile stack ran, no C++ compiler did).
  Plus the graphs served whole from AOTAutograd's cache
  (``counters["aot_autograd"]["autograd_cache_hit"]``), which skip
  ``compile_fx_inner``: a second process's ``torch.compile`` with a warm
  ``TORCHINDUCTOR_CACHE_DIR`` counts one per graph, as the first did.
  Dynamo's ``reset()`` empties the metrics; :class:`CompileCounter` keeps
  every list (and counter) it has seen, so a reset between two reads loses
  nothing (two resets between two reads lose the compiles between them).
- ``dynamo_graphs``: graphs Dynamo captured (``counters["stats"]["unique_graphs"]``),
  whatever the backend (``torch.compile(backend="eager")`` included);
  ``torch.export`` does not count here.
"""

from __future__ import annotations

import sys

from kernel_cache.torch_compat import COMPILE_STACK, compile_counters

__all__ = ["COMPILE_STACK", "CompileCounter", "compile_stack_loaded"]

#: The metrics entry Inductor appends to once per graph compile.
_INDUCTOR_COMPILE = "compile_fx_inner"


def compile_stack_loaded() -> list[str]:
    """The modules of :data:`COMPILE_STACK` this process has imported (in that order)."""
    return [m for m in COMPILE_STACK if m in sys.modules]


def _inductor_runs() -> list | None:
    """Inductor's list of graph-compile times (one float per compile), or None
    where no Inductor compile has run since the last reset (or ever)."""
    found = compile_counters()
    return None if found is None else found.metrics.get(_INDUCTOR_COMPILE)


def _autograd_cache() -> dict | None:
    """Torch's ``counters["aot_autograd"]`` (it holds ``autograd_cache_hit``), or None
    where it does not exist yet (never creates it)."""
    found = compile_counters()
    return None if found is None else found.counters.get("aot_autograd")


def _dynamo_graphs() -> int:
    """Graphs Dynamo captured in this process (0 where Dynamo was never imported)."""
    found = compile_counters()
    if found is None:
        return 0
    stats = found.counters.get("stats")  # .get: the defaultdict is not grown
    return int(stats.get("unique_graphs", 0)) if stats else 0


class CompileCounter:
    """Torch's compile counters from a baseline (taken at construction) on.

    :meth:`read` is process-wide: a compile in any thread of this process
    counts. Inductor's list of compile times is replaced by an empty one at
    each reset of Dynamo; every list seen (at the baseline or at a
    read) is kept and summed, so only a list made and dropped between two
    reads (two resets between them) goes uncounted.
    """

    __slots__ = ("_seen", "_hits", "_graphs")

    def __init__(self):
        runs = _inductor_runs()
        #: ``[(list, its length at the baseline)]``: Inductor's lists seen so far.
        self._seen: list[tuple[list, int]] = [] if runs is None else [(runs, len(runs))]
        hits = _autograd_cache()
        #: ``[(counter, its cache hits at the baseline)]``: AOTAutograd's counters seen.
        self._hits: list[tuple[dict, int]] = (
            [] if hits is None else [(hits, hits.get("autograd_cache_hit", 0))]
        )
        self._graphs = _dynamo_graphs()

    def compiles(self) -> int:
        """Inductor graph compiles and AOTAutograd cache hits since the baseline
        (module docstring)."""
        now = _inductor_runs()
        if now is not None and not any(now is runs for runs, _ in self._seen):
            self._seen.append((now, 0))  # made since: by the first compile, or a reset
        hits = _autograd_cache()
        if hits is not None and not any(hits is c for c, _ in self._hits):
            self._hits.append((hits, 0))  # made since (torch's counters.clear())
        return sum(len(runs) - base for runs, base in self._seen) + sum(
            max(0, c.get("autograd_cache_hit", 0) - base) for c, base in self._hits
        )

    def read(self) -> dict:
        """``{"compiles": int, "dynamo_graphs": int, "compile_stack_imported": [module]}``:
        the first two since the baseline, the last the compile-stack modules
        imported in this process now (whenever they were imported)."""
        return {
            "compiles": self.compiles(),
            # max: torch's counters.clear() (tests do it) would make it negative
            "dynamo_graphs": max(0, _dynamo_graphs() - self._graphs),
            "compile_stack_imported": compile_stack_loaded(),
        }
