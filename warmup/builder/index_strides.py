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


def expr_key(expr) -> str:
    """A string that two sympy expressions share only if they are the same tree:
    each function as ``module.class(args)``, each atom as ``sympy.srepr`` writes it
    (a symbol with its assumptions)."""
    import sympy

    if not expr.args:
        return sympy.srepr(expr)
    kind = type(expr)
    return f"{kind.__module__}.{kind.__qualname__}({','.join(map(expr_key, expr.args))})"


#: The classes a kept stride may be built of besides symbols and numbers: sympy's
#: sum, product and power, and torch's own sympy functions (``FloorDiv``,
#: ``ModularIndexing``, ``Min``, ``Max``, ...:
#: :func:`warmup.torch_compat.torch_sympy_function`), by name.
_SYMPY_NODES = {
    "sympy.core.add.Add": "Add",
    "sympy.core.mul.Mul": "Mul",
    "sympy.core.power.Pow": "Pow",
}


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
    kind = type(expr)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if name not in _SYMPY_NODES and not torch_compat.is_torch_sympy_function(kind):
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
    def key(index, var, vec_length) -> str:
        return f"{expr_key(index)}|{expr_key(var)}|{vec_length}"

    def get(self, key: str):
        """The kept stride for ``key``, or None."""
        tree = self.known.get(key)
        return None if tree is None else decode(tree)

    def learn(self, key: str, stride) -> None:
        tree = encode(stride)
        if tree is not None:
            self.known[key] = self.learned[key] = tree


def load(folder: str | os.PathLike) -> dict[str, Any]:
    """The strides kept in ``folder`` for this process's versions; ``{}`` if the
    file is missing, larger than :data:`MAX_BYTES`, not a regular file, not
    :class:`IndexStrides`, or of other versions."""
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
    if (doc.torch, doc.sympy) != (torch_v, sympy_v):
        return {}
    return dict(doc.strides)


def save(folder: str | os.PathLike, new: dict[str, Any]) -> None:
    """Add ``new`` to the file in ``folder`` (up to :data:`MAX_ENTRIES` in all),
    under the folder's lock, replacing the file whole. An ``OSError`` is left
    unsaved: the file only saves time."""
    if not new:
        return
    from filelock import FileLock

    folder = Path(folder)
    torch_v, sympy_v = versions()
    try:
        (folder / "locks").mkdir(exist_ok=True)
        with FileLock(folder / "locks" / f"{FILE_NAME}.lock"):
            kept = load(folder)
            for k, v in new.items():
                if len(kept) >= MAX_ENTRIES:
                    break
                kept.setdefault(k, v)
            doc = IndexStrides(torch=torch_v, sympy=sympy_v, strides=kept)
            tmp = folder / f".{FILE_NAME}.{os.getpid()}.tmp"
            try:
                tmp.write_text(doc.model_dump_json())
                os.replace(tmp, folder / FILE_NAME)
            finally:
                tmp.unlink(missing_ok=True)
    except OSError:
        return
