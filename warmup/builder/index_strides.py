"""The stride analysis's results, kept on disk beside the precompiled headers.

Choosing how to vectorize each loop, Inductor's CPU code generator asks for the
stride of every index expression along a loop variable
(:func:`warmup.torch_compat.index_analysis_kept`); ``sympy.simplify`` works it
out: 5-15 s of CPU of a worker's first prefill compile (docs/benchmarks/compile.md).
A process keeps its results in memory; this file keeps them for the next
process: the next worker, warmup, ``verify --rebuild`` or container build that
uses the same folder.

A result is a function of the expression, the variable and the vector length
alone, for one version of torch and sympy: the file is read only by a process
with the versions it names, and a key spells out every function's module and
class and every symbol's assumptions. A result is kept as a tree of JSON
values (:func:`encode`), not as code: an integer, a symbol with its
assumptions, or a node of sympy's ``Add``, ``Mul`` or ``Pow`` or one of torch's
sympy functions, rebuilt unevaluated, and used only if it encodes back to the
same tree. The folder is the precompiled headers' (checked as the cache
directory is: a header is code too), reads are bounded in bytes, and the file
is replaced whole (a temporary file and ``os.replace``) under the folder's lock.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from warmup import torch_compat

#: The file's name in the precompiled headers' folder.
FILE_NAME = "index-strides.json"
#: Results the file holds at most. A prefill variant of the default plan asks for
#: 150-260, a decode variant about 60 (``benchmarks/index_analysis.py``); an
#: entry is about 450 bytes (the tiny plan's three variants: 231 in 101 KB).
MAX_ENTRIES = 1 << 13
#: Bytes read of the file at most; a larger file is not read (and is replaced).
MAX_BYTES = 8 << 20


class IndexStrides(BaseModel):
    """``index-strides.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal["kernel-cache-index-strides/1"] = "kernel-cache-index-strides/1"
    #: ``torch.__version__`` and ``torch.version.git_version``, and ``sympy.__version__``
    #: of the processes that computed the results.
    torch: str
    sympy: str
    #: :meth:`Strides.key` of ``(index, var, vec_length)`` to the stride, :func:`encode`\ d.
    strides: dict[str, StrictInt | list[Any]]


def versions() -> tuple[str, str]:
    """This process's ``(torch, sympy)`` as :class:`IndexStrides` names them."""
    import sympy
    import torch

    return f"{torch.__version__} {torch.version.git_version}", sympy.__version__


def expr_key(expr) -> str | None:
    """A string that two sympy expressions share only if they are the same tree:
    each node as ``module.class(args)``, each atom as ``sympy.srepr`` writes it (a
    symbol with its assumptions); None where a node is of a class a kept stride
    may not hold (:func:`encode`), whose name may not tell it apart (sympy's
    undefined functions have no module)."""
    import sympy

    if not expr.args:
        if isinstance(expr, sympy.Rational) or type(expr) is sympy.Symbol:
            return sympy.srepr(expr)
        return None
    name = _node_name(expr)
    if name is None:
        return None
    args = [expr_key(a) for a in expr.args]
    return None if None in args else f"{name}({','.join(args)})"  # type: ignore[arg-type]


#: The classes a kept stride may be built of besides symbols and numbers: sympy's
#: sum, product and power, and torch's own sympy functions (``FloorDiv``,
#: ``ModularIndexing``, ``Min``, ``Max``, ...:
#: :func:`warmup.torch_compat.torch_sympy_function`), by name.
_SYMPY_NODES = {
    "sympy.core.add.Add": "Add",
    "sympy.core.mul.Mul": "Mul",
    "sympy.core.power.Pow": "Pow",
}


def _node_name(expr) -> str | None:
    """``module.Class`` of ``expr``'s node, None if a kept stride may not hold it."""
    kind = type(expr)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if name in _SYMPY_NODES or torch_compat.is_torch_sympy_function(kind):
        return name
    return None


def encode(expr) -> Any:
    """``expr`` as a tree of JSON values: an ``int``, ``["Rational", p, q]``,
    ``["Symbol", name, {assumption: bool}]``, or ``["module.Class", arg, ...]``;
    None where a node is of another class."""
    import sympy

    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Rational):
        return ["Rational", int(expr.p), int(expr.q)]
    if type(expr) is sympy.Symbol:
        return ["Symbol", expr.name, dict(sorted(expr.assumptions0.items()))]
    name = _node_name(expr)
    if name is None:
        return None
    args = [encode(a) for a in expr.args]
    return None if any(a is None for a in args) else [name, *args]


def decode(tree: Any):
    """The sympy expression :func:`encode` gave ``tree`` for, built unevaluated;
    None if ``tree`` is not such a tree or does not encode back to itself."""
    try:
        expr = _build(tree)
        return expr if encode(expr) == tree else None
    except Exception:  # a tree this process cannot build: computed again
        return None


def _build(tree: Any):
    import sympy

    if isinstance(tree, int) and not isinstance(tree, bool):
        return sympy.Integer(tree)
    if not isinstance(tree, list) or not tree or not isinstance(tree[0], str):
        raise ValueError("not a kept stride")
    head, rest = tree[0], tree[1:]
    if head == "Rational":
        return sympy.Rational(*rest)
    if head == "Symbol":
        name, assumptions = rest
        if not (isinstance(name, str) and name.isidentifier()):  # printed into C++ as is
            raise ValueError(f"{name!r} is not a symbol's name")
        return sympy.Symbol(name, **assumptions)
    if head in _SYMPY_NODES:
        kind = getattr(sympy, _SYMPY_NODES[head])
    else:
        kind = torch_compat.torch_sympy_function(*head.rsplit(".", 1))
    return kind(*map(_build, rest), evaluate=False)


class Strides:
    """The strides a compile reads and adds (``known``) and those it computed
    (``learned``, for :func:`save`), as :func:`warmup.torch_compat.index_analysis_kept`
    asks for them."""

    def __init__(self, known: dict[str, Any]):
        self.known = known
        self.learned: dict[str, Any] = {}

    @staticmethod
    def key(index, var, vec_length) -> str | None:
        """None where :func:`expr_key` has none for ``index`` or ``var``: not kept."""
        index_key, var_key = expr_key(index), expr_key(var)
        if index_key is None or var_key is None:
            return None
        return f"{index_key}|{var_key}|{vec_length}"

    def get(self, key: str | None):
        """The kept stride for ``key``, or None."""
        tree = None if key is None else self.known.get(key)
        return None if tree is None else decode(tree)

    def learn(self, key: str | None, stride) -> None:
        tree = None if key is None else encode(stride)
        if tree is not None:
            self.known[key] = self.learned[key] = tree


def load(folder: str | os.PathLike) -> dict[str, Any]:
    """The strides kept in ``folder`` for this process's versions; ``{}`` if the
    file is missing, larger than :data:`MAX_BYTES`, not a regular file, not
    :class:`IndexStrides`, of other versions, or of more than :data:`MAX_ENTRIES`
    results."""
    path = Path(folder, FILE_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # a FIFO, a device
                return {}
            raw = f.read(MAX_BYTES + 1)
    except OSError:
        return {}
    if len(raw) > MAX_BYTES:
        return {}
    try:
        doc = IndexStrides.model_validate_json(raw)
    except ValidationError:
        return {}
    torch_v, sympy_v = versions()
    if (doc.torch, doc.sympy) != (torch_v, sympy_v) or len(doc.strides) > MAX_ENTRIES:
        return {}
    return dict(doc.strides)


def save(folder: str | os.PathLike, new: dict[str, Any]) -> None:
    """Add ``new`` to the file in ``folder`` under the folder's lock, a value of
    ``new`` replacing a kept one, the oldest results dropped past
    :data:`MAX_ENTRIES`; the file is replaced whole, through a temporary file
    created anew. Nothing is saved where the lock's folder or file is a link; an
    ``OSError`` is left unsaved: the file only saves time."""
    if not new:
        return
    import tempfile

    from filelock import FileLock

    folder = Path(folder)
    torch_v, sympy_v = versions()
    locks = folder / "locks"
    lock = locks / f"{FILE_NAME}.lock"
    try:
        locks.mkdir(exist_ok=True)
        if locks.is_symlink() or lock.is_symlink():
            return
        with FileLock(lock):
            kept = {k: v for k, v in load(folder).items() if k not in new}
            kept.update(new)
            kept = dict(list(kept.items())[-MAX_ENTRIES:])
            doc = IndexStrides(torch=torch_v, sympy=sympy_v, strides=kept)
            fd, tmp = tempfile.mkstemp(prefix=f".{FILE_NAME}.", suffix=".tmp", dir=folder)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(doc.model_dump_json())
                os.replace(tmp, folder / FILE_NAME)
            finally:
                Path(tmp).unlink(missing_ok=True)
    except OSError:
        return
