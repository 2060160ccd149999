"""The runtime's one door to torch's private API.

Every private torch name the runtime (``kernel_cache``) reaches is reached
here, and listed in :data:`RUNTIME_API` with the torch versions it was checked
on; the build's names are in :mod:`warmup.torch_compat`. A name that is missing
or has another form in the installed torch raises
:class:`~kernel_cache.errors.TorchAPIDriftError` (naming the torch version, the
name and the fix), never a corrupt-entry error and never a silent default:
``tests/runtime/test_torch_compat.py`` takes each one away and checks so, and
scans every other module of ``kernel_cache`` and ``warmup`` for private torch
names.

Nothing heavy is imported here: torch is imported inside the functions that
need it, and torch's compile stack never (:func:`compile_counters` reads it
only where this process has imported it). docs/architecture.md, "Torch's
private API", says what a user sees on drift.
"""

from __future__ import annotations

import re
import sys
from typing import Any, NamedTuple

from kernel_cache.errors import TorchAPIDriftError


class PrivateAPI(NamedTuple):
    """One private torch name: its dotted ``name``, the project code that
    ``uses`` it, and the torch versions (``major.minor``) it was ``checked`` on."""

    name: str
    uses: str
    checked: tuple[str, ...]


#: The torch versions this project is checked with: 2.11 (the GPU host's image;
#: every name and signature found in that release's wheel: its Python sources,
#: type stubs and operator list) and 2.13 (CI: every name resolved and used by
#: the test suite).
CHECKED = ("2.11", "2.13")

#: Every private torch name the runtime uses.
RUNTIME_API: tuple[PrivateAPI, ...] = (
    PrivateAPI(
        "torch._C._aoti.AOTIModelPackageLoader",
        "runtime/package.py load_package: (path, model_name, run_single_threaded, num_runners, "
        "device_index), positional only (a pybind class)",
        CHECKED,
    ),
    PrivateAPI(
        "torch._C._aoti.AOTIModelContainerRunnerCpu",
        "runtime/package.py _load_cpu_library: (so_path, num_models), positional only",
        CHECKED,
    ),
    PrivateAPI(
        "torch._C._cuda_isCurrentStreamCapturing",
        "runtime/dispatch.py: the CUDA-graph capture guard of host lengths",
        CHECKED,
    ),
    PrivateAPI(
        "torch._dynamo.utils.compilation_time_metrics",
        "runtime/compiles.py: Inductor graph compiles ({'compile_fx_inner': [seconds]})",
        CHECKED,
    ),
    PrivateAPI(
        "torch._dynamo.utils.counters",
        "runtime/compiles.py: AOTAutograd cache hits and Dynamo graphs",
        CHECKED,
    ),
    *(
        PrivateAPI(m, "runtime/compiles.py: its import means the compile stack was loaded", CHECKED)
        for m in ("torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.codegen")
    ),
    PrivateAPI("torch._check", "kernels/builtin.py: size facts for export", CHECKED),
    PrivateAPI(
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "kernels/builtin.py: the CPU prefill kernel's flash attention",
        CHECKED,
    ),
    PrivateAPI(
        "torch.ops.higher_order.cond",
        "kernels/builtin.py: torch.cond's operator, called under torch.export (pred, "
        "true_fn, false_fn, operands); each branch returns a tuple",
        CHECKED,
    ),
)

_BY_NAME = {api.name: api for api in RUNTIME_API}

#: Modules whose presence in ``sys.modules`` means torch's compile stack was
#: imported: Dynamo and Inductor's compiler (the AOTInductor runtime loader
#: that engine start uses imports none of them).
COMPILE_STACK = ("torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.codegen")
#: The module holding torch's compile counters.
_COUNTERS_MODULE = "torch._dynamo.utils"


def torch_version() -> str:
    """The installed torch's version, without importing torch where it is not
    imported yet."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(getattr(torch, "__version__", None), str):
        return str(torch.__version__)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "(not installed)"


def drift(name: str, why: str, table: dict[str, PrivateAPI] | None = None) -> TorchAPIDriftError:
    """The error for private torch API ``name`` (a dotted name of ``table``,
    default :data:`RUNTIME_API`'s) that ``why`` (``"is missing"``, ``"takes other
    arguments (...)"``) in the installed torch."""
    api = (table or _BY_NAME).get(name)
    return TorchAPIDriftError(name, why, torch_version(), api.checked if api else CHECKED)


def attribute(owner: Any, dotted: str, table: dict[str, PrivateAPI] | None = None) -> Any:
    """``owner``'s attribute named by the last part of ``dotted`` (the full
    dotted name, as listed in ``table``).

    Raises:
        TorchAPIDriftError: ``owner`` has no such attribute.
    """
    try:
        return getattr(owner, dotted.rpartition(".")[2])
    except AttributeError:
        raise drift(dotted, "is missing", table) from None


def resolve(dotted: str, table: dict[str, PrivateAPI] | None = None) -> Any:
    """The object a dotted name of the tables names (a module, a class, a
    function, a variable, an operator), importing modules on the way: for tests
    and for checking a new torch against :data:`RUNTIME_API` and
    :data:`warmup.torch_compat.BUILD_API` (it may import the compile stack).

    Raises:
        TorchAPIDriftError: a part of the name is missing.
    """
    import importlib

    parts = dotted.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            continue
        except ImportError:
            pass
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise drift(dotted, "is missing", table) from None
    return obj


def _aoti(name: str) -> Any:
    import torch

    return attribute(attribute(torch._C, "torch._C._aoti"), name)


def _called(name: str, cls: Any, *args: Any) -> Any:
    """``cls(*args)``; a ``TypeError`` (the binding refused these arguments: its
    signature changed) is drift. Other errors are the file's, and pass."""
    try:
        return cls(*args)
    except TypeError as e:
        raise drift(name, f"takes other arguments than kernel-cache passes ({e})") from None


def load_aoti_package(
    path: str, *, model_name: str, run_single_threaded: bool, num_runners: int, device_index: int
) -> Any:
    """AOTInductor's package loader (``torch._C._aoti.AOTIModelPackageLoader``)
    of the ``.pt2`` file ``path``. Its binding takes no keywords; this is the
    one place its positional order is written.

    Raises:
        TorchAPIDriftError: the loader is missing or takes other arguments.
        Exception: the loader's own error for a bad package (``RuntimeError``):
            the caller's to report as a corrupt entry.
    """
    name = "torch._C._aoti.AOTIModelPackageLoader"
    loader = _aoti(name)
    return _called(name, loader, path, model_name, run_single_threaded, num_runners, device_index)


def aoti_loader_takes_folders() -> bool:
    """Whether ``AOTIModelPackageLoader`` loads an unpacked package folder in
    place (torch 2.13). The loader of torch 2.11 (the GPU image's) opens every
    path as a zip archive ("Failed to initialize zip archive: failed finding
    central directory" for a folder) and unpacks it under ``$TMPDIR``."""
    import torch

    parts = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    return parts is None or (int(parts[1]), int(parts[2])) >= (2, 13)


def load_cpu_runner(so_path: str, *, num_models: int) -> Any:
    """AOTInductor's CPU container runner
    (``torch._C._aoti.AOTIModelContainerRunnerCpu``) of the shared library
    ``so_path`` (``dlopen``), with ``num_models`` models.

    Raises:
        TorchAPIDriftError: the runner is missing or takes other arguments.
        Exception: the runner's own error for a bad library (``RuntimeError``).
    """
    name = "torch._C._aoti.AOTIModelContainerRunnerCpu"
    return _called(name, _aoti(name), so_path, num_models)


def _never_capturing() -> bool:
    return False


def stream_capture_query():
    """The function that says whether the current CUDA stream is capturing a
    graph (``torch.cuda.is_current_stream_capturing`` without its Python frame,
    for the hot path). On a torch built without CUDA, where no graph can be
    captured, one that returns False.

    Raises:
        TorchAPIDriftError: a torch built with CUDA has no such function (the
            CUDA-graph guard would otherwise be off, silently).
    """
    import torch

    if not torch.backends.cuda.is_built():
        return _never_capturing
    name = "torch._C._cuda_isCurrentStreamCapturing"
    query = attribute(torch._C, name)
    if not callable(query):
        raise drift(name, f"is not callable (a {type(query).__name__})")
    return query


class CompileCounters(NamedTuple):
    """Torch's compile counters, as :func:`compile_counters` finds them:
    ``metrics`` (``{"compile_fx_inner": [seconds per graph compile], ...}``; a
    reset replaces its lists) and ``counters`` (``{group: {name: count}}``, a
    ``defaultdict``: read it with ``.get`` so as not to grow it)."""

    metrics: dict
    counters: dict


def compile_counters() -> CompileCounters | None:
    """Torch's compile counters, or None where this process has not imported
    ``torch._dynamo.utils`` (then it has compiled nothing through torch's
    compile stack). Never imports anything.

    Raises:
        TorchAPIDriftError: the module is imported and a counter is missing or
            not a dict (a count of 0 would hide every compile).
    """
    utils = sys.modules.get(_COUNTERS_MODULE)
    if utils is None:
        return None
    found = []
    for attr in ("compilation_time_metrics", "counters"):
        name = f"{_COUNTERS_MODULE}.{attr}"
        value = attribute(utils, name)
        if not isinstance(value, dict):
            raise drift(name, f"is a {type(value).__name__}, not a dict")
        found.append(value)
    return CompileCounters(*found)


def check(condition: Any) -> None:
    """``torch._check(condition)``: a fact about unbacked sizes for export (a
    Python bool or a SymBool).

    Raises:
        TorchAPIDriftError: torch has no ``_check``.
    """
    import torch

    attribute(torch, "torch._check")(condition)


def cpu_flash_attention() -> Any:
    """The ATen operator ``_scaled_dot_product_flash_attention_for_cpu``
    (``(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
    scale=None) -> (output, logsumexp)``, tensors ``[B, H, L, D]``).

    Raises:
        TorchAPIDriftError: torch has no such operator.
    """
    import torch

    return attribute(torch.ops.aten, "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu")


def cond_operator() -> Any:
    """The operator behind ``torch.cond`` (``(pred, true_fn, false_fn, operands)
    -> tuple``): called while ``torch.export`` traces, it traces both branches
    with export's own tracer, where ``torch.cond`` first compiles the call with
    Dynamo.

    Raises:
        TorchAPIDriftError: torch has no such operator.
    """
    import torch

    return attribute(torch.ops.higher_order, "torch.ops.higher_order.cond")
