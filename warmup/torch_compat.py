"""The build's one door to torch's private API (Inductor's and Dynamo's).

Every private torch name that ``warmup`` reaches is reached here, and listed
in :data:`BUILD_API` with the torch versions it was checked on; the runtime's
are in :mod:`kernel_cache.torch_compat`, whose error this module raises: a
name missing or of another form in the installed torch is a
:class:`~kernel_cache.errors.TorchAPIDriftError` naming the torch version, the
name and the fix, never a compile error of one variant. The compile options
passed to ``aoti_compile_and_package`` by name (``cpp.vec_isa_ok``,
``aot_inductor.*``: :mod:`kernel_cache.config.recipe`) are Inductor's
documented configuration and are left out of the table; the configuration
modules themselves are in it.

Torch's compile stack is imported inside the functions, never at import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from kernel_cache.errors import TorchAPIDriftError
from kernel_cache.torch_compat import CHECKED, PrivateAPI, attribute, drift

#: The modules whose import reads the compile environment (``TORCHINDUCTOR_*``):
#: one imported before the environment is pinned has read another.
READS_ENV_AT_IMPORT = ("torch._inductor.config", "torch._dynamo.config")
#: torch's process-global compiler settings (``get_config_copy`` / ``load_config``).
CONFIG_MODULES = ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config")

_RUN = "torch._inductor.cpp_builder._run_compile_cmd"
_CFLAGS = "torch._inductor.cpp_builder._get_optimization_cflags"
_HEADER_DIR = "torch._inductor.codecache._HEADER_DIR"
_HEADER_LOCK_DIR = "torch._inductor.codecache._HEADER_LOCK_DIR"
#: Builds a precompiled header in ``_HEADER_DIR`` and returns its path, cached
#: per process (``functools.cache``) on arguments that do not name the folder.
_BUILT_HEADERS = "torch._inductor.codecache._precompile_header"
#: How Inductor tells a C++ compiler's family, from the name ``CXX`` gives alone
#: (``functools.cache``, ``(cpp_compiler: str) -> bool``): it picks flags and
#: pragmas by it (``#pragma GCC unroll`` for gcc, ``#pragma unroll`` otherwise).
_IS_GCC = "torch._inductor.cpp_builder._is_gcc"
_IS_CLANG = "torch._inductor.cpp_builder._is_clang"
_PICK = "torch._inductor.cpu_vec_isa.pick_vec_isa"
_ISA_LIST = "torch._inductor.cpu_vec_isa.supported_vec_isa_list"
_VALID_ISAS = "torch._inductor.cpu_vec_isa.valid_vec_isa_list"
_AOTI = "torch._inductor.aoti_compile_and_package"
_GPU_KERNELS = "torch._inductor.codecache.CudaKernelParamCache"
_CUBIN_OBJECT = "torch._inductor.codecache.convert_cubin_to_obj"
#: The CPU code generator's stride analysis (``index_analysis_kept``): defined in
#: ``torch._inductor.sizevars`` and imported by name in 2.13, defined here in 2.11.
_STRIDE = "torch._inductor.codegen.cpp.stride_at_vec_range"
#: Torch's sympy functions (``FloorDiv``, ``ModularIndexing``, ``Min``, ...): the
#: classes besides sympy's own a kept stride may be built of (``builder/index_strides.py``).
_SYMPY_FUNCTIONS = "torch.utils._sympy.functions"
#: The CPU wrapper's writer: it pastes ``aoti_runtime/interface.cpp``, a file of
#: its folder, at the top of every CPU wrapper (``builder/wrapper_split.py``).
_AOTI_INTERFACE = "torch._inductor.codegen.cpp_wrapper_cpu"

#: Every private torch name the build uses.
BUILD_API: tuple[PrivateAPI, ...] = (
    PrivateAPI(
        _AOTI,
        "builder/compiler.py: (exported_program, *, package_path, inductor_configs)",
        CHECKED,
    ),
    *(
        PrivateAPI(
            m,
            "builder/compiler.py: its settings (get_config_copy, load_config, patch, and "
            "attribute reads of option names) and its import reading TORCHINDUCTOR_*",
            CHECKED,
        )
        for m in CONFIG_MODULES
    ),
    PrivateAPI(_PICK, "builder/compiler.py: the vector ISA Inductor chose", CHECKED),
    *(
        PrivateAPI(
            name,
            "builder/compiler.py: the compiler family Inductor takes CXX for, by its name",
            CHECKED,
        )
        for name in (_IS_GCC, _IS_CLANG)
    ),
    PrivateAPI(
        _ISA_LIST,
        "builder/compiler.py: narrowed to the target's ISA while a compile builds "
        "the list it picks from, so that no other ISA is probed",
        CHECKED,
    ),
    PrivateAPI(
        _VALID_ISAS,
        "builder/compiler.py: the ISAs a pick chooses from, kept for the process "
        "(functools.cache), cleared after the compile",
        CHECKED,
    ),
    PrivateAPI(
        _GPU_KERNELS,
        "builder/compiler.py: emptied, then kept in name order (the GPU kernels' link order)",
        CHECKED,
    ),
    PrivateAPI(
        _CUBIN_OBJECT,
        "builder/compiler.py: replaced, (cubin_file, kernel_name, ld, objcopy), so that the "
        "kernel's symbols are linked in an order no builder path decides",
        CHECKED,
    ),
    PrivateAPI(
        _RUN,
        "builder/normalize.py: wrapped, (cmd_line: str, cwd: str), to add -ffile-prefix-map",
        CHECKED,
    ),
    PrivateAPI(
        _CFLAGS,
        "builder/compiler.py: wrapped to replace -march=native (torch without cpp.march)",
        CHECKED,
    ),
    PrivateAPI(_HEADER_DIR, "builder/normalize.py: the precompiled headers' folder", CHECKED),
    PrivateAPI(_HEADER_LOCK_DIR, "builder/normalize.py: its lock folder", CHECKED),
    PrivateAPI(
        _BUILT_HEADERS,
        "builder/normalize.py, builder/pool.py: its per-process cache of header paths "
        "(functools.cache), cleared when the folder changes and after a jobs=0 warmup",
        CHECKED,
    ),
    PrivateAPI(
        _STRIDE,
        "builder/compiler.py: (index, var, vec_length), a functools.lru_cache of 128 entries "
        "that the CPU code generator calls by this name; wrapped in a larger cache kept across "
        "the compiles of a process",
        CHECKED,
    ),
    PrivateAPI(
        _SYMPY_FUNCTIONS,
        "builder/index_strides.py: the module whose sympy classes (FloorDiv, ModularIndexing, "
        "Min, Max, ...) a kept stride may be built of, by name",
        CHECKED,
    ),
    PrivateAPI(
        _AOTI_INTERFACE,
        "builder/wrapper_split.py: the file aoti_runtime/interface.cpp beside it, the text it "
        "pastes at the top of a CPU wrapper (none there: the wrapper is compiled whole)",
        CHECKED,
    ),
)

_BY_NAME = {api.name: api for api in BUILD_API}


def _module(name: str) -> ModuleType:
    """Import torch module ``name``.

    Raises:
        TorchAPIDriftError: there is no such module.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise drift(name, "is missing (no such module)", _BY_NAME) from None
        raise


def _get(dotted: str) -> Any:
    """The object ``dotted`` names (``module.attribute``, module imported).

    Raises:
        TorchAPIDriftError: the module or the attribute is missing.
    """
    return attribute(_module(dotted.rpartition(".")[0]), dotted, _BY_NAME)


def _torch_cache(dotted: str, why: str) -> Callable:
    """The function ``dotted`` names, which torch keeps per process behind a
    ``functools`` cache (``cache_info`` and ``cache_clear``).

    Raises:
        TorchAPIDriftError: the function is missing, or is no such cache
            (``why`` says which torch had).
    """
    f = _get(dotted)
    if not callable(f) or not all(
        callable(getattr(f, n, None)) for n in ("cache_info", "cache_clear")
    ):
        raise drift(dotted, why, _BY_NAME)
    return f


def _function(dotted: str, params: tuple[str, ...]) -> Callable:
    """The function ``dotted`` names, whose parameters start with ``params``.

    Raises:
        TorchAPIDriftError: missing, or other parameters.
    """
    fn = _get(dotted)
    try:
        have = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        raise drift(dotted, "is not a Python function", _BY_NAME) from None
    if have[: len(params)] != params:
        raise drift(dotted, f"takes ({', '.join(have)}), not ({', '.join(params)})", _BY_NAME)
    return fn


def inductor_config() -> ModuleType:
    """Inductor's configuration module (``patch``, ``get_config_copy``, options
    as attributes).

    Raises:
        TorchAPIDriftError: torch has no such module.
    """
    return _module(CONFIG_MODULES[0])


def config_modules() -> dict[str, ModuleType]:
    """``{name: module}`` of :data:`CONFIG_MODULES`, each with ``get_config_copy``
    and ``load_config``.

    Raises:
        TorchAPIDriftError: a module or one of those methods is missing.
    """
    out = {}
    for name in CONFIG_MODULES:
        module = _module(name)
        for method in ("get_config_copy", "load_config"):
            attribute(module, f"{name}.{method}", _BY_NAME)
        out[name] = module
    return out


def chosen_vec_isa(options: dict) -> str:
    """The vector ISA Inductor picks (``str`` of ``pick_vec_isa()``:
    ``avx512``, ``avx2``, ``INVALID_VEC_ISA``...) under ``options``'
    ``cpp.vec_isa_ok`` (the other options are ignored).

    Raises:
        TorchAPIDriftError: ``pick_vec_isa`` is missing.
    """
    pick = _function(_PICK, ())
    patch = {k: v for k, v in options.items() if k == "cpp.vec_isa_ok"}
    with inductor_config().patch(patch):
        return str(pick())


#: ISAs :func:`vec_isa_narrowed` may narrow a pick to: one whose own check is
#: ``cpp.vec_isa_ok`` alone and whose name is in no other ISA's name (Inductor
#: takes the first ISA whose name holds ``ATEN_CPU_CAPABILITY``). Not
#: ``avx512``: Inductor would pick its VNNI or AMX class where the CPU has them,
#: and its AVX-512 class probes BF16 even under ``cpp.vec_isa_ok``.
NARROWABLE_ISAS = ("avx2",)


@contextlib.contextmanager
def vec_isa_narrowed(only: str, options: dict) -> Iterator[None]:
    """For the block, Inductor's per-process list of vector ISAs
    (``valid_vec_isa_list``, which every pick of the process reads) holds the
    ISA named ``only`` alone, built under ``options``' ``cpp.vec_isa_ok``;
    cleared at the end, so later picks of the process build Inductor's own
    list. A list built already is used as it is.

    Building Inductor's own list probes every ISA this CPU lists whose check
    is more than ``cpp.vec_isa_ok`` (AVX-512 VNNI and BF16, AMX): a dry compile
    of a few lines, then a child Python that loads the result, which on torch
    before 2.13 imports torch (several seconds of CPU each, in every compile
    worker: docs/benchmarks/compile.md). For an ISA of
    :data:`NARROWABLE_ISAS` the pick is the same: Inductor takes the ISA
    ``ATEN_CPU_CAPABILITY`` names, and that ISA's own check is
    ``cpp.vec_isa_ok``. Process-wide: a pick of another thread during the
    block sees the narrowed list too.

    Raises:
        ValueError: ``only`` is not in :data:`NARROWABLE_ISAS`.
        TorchAPIDriftError: ``supported_vec_isa_list`` or a per-process
            ``valid_vec_isa_list`` is missing, or the list is not built from
            the former.
    """
    if only not in NARROWABLE_ISAS:
        raise ValueError(f"vector ISA {only!r} cannot be narrowed to: only {NARROWABLE_ISAS}")
    valid = _torch_cache(_VALID_ISAS, "is not cached per process (functools.cache)")
    if valid.cache_info().currsize:
        yield
        return
    module = _module(_VALID_ISAS.rpartition(".")[0])
    full = _get(_ISA_LIST)
    if not isinstance(full, list):
        raise drift(_ISA_LIST, f"is a {type(full).__name__}, not a list", _BY_NAME)
    narrowed = [isa for isa in full if str(isa) == only]
    patch = {k: v for k, v in options.items() if k == "cpp.vec_isa_ok"}
    module.supported_vec_isa_list = narrowed
    try:
        with inductor_config().patch(patch):
            built = valid()
    finally:
        module.supported_vec_isa_list = full
    try:
        if not all(any(isa is n for n in narrowed) for isa in built):
            raise drift(_VALID_ISAS, "is not built from supported_vec_isa_list", _BY_NAME)
        yield
    finally:
        valid.cache_clear()


def aoti_compile_and_package() -> Callable:
    """AOTInductor's ``aoti_compile_and_package(exported_program, *,
    package_path, inductor_configs)``, resolved (call it with those keywords).

    Raises:
        TorchAPIDriftError: it is missing or lacks one of those parameters.
    """
    fn = _function(_AOTI, ())
    have = inspect.signature(fn).parameters
    lacking = [p for p in ("package_path", "inductor_configs") if p not in have]
    if lacking:
        raise drift(_AOTI, f"has no parameter {', '.join(lacking)}", _BY_NAME)
    return fn


@contextlib.contextmanager
def gpu_kernels_in_name_order() -> Iterator[None]:
    """Inductor's process-wide table of compiled GPU kernels
    (``CudaKernelParamCache.cache``, ``{kernel name: its cubin and launch
    parameters}``) emptied, then kept sorted by kernel name for the block;
    ``set`` put back after.

    A CUDA package's ``.so`` links the embedded kernels in the table's order,
    which was the order kernels were first added in the worker process: a
    name (``triton_poi_fused_0``) an earlier compile added kept its place. The
    order of ``wrapper.so``'s dynamic symbols, and its build-id, could follow
    which variants the worker compiled before. Sorted, it follows the kernels'
    names alone, whatever order they are added in.

    Raises:
        TorchAPIDriftError: the table, its ``cache`` dict, ``cache_clear`` or
            ``set`` is missing.
    """
    table = _get(_GPU_KERNELS)
    cache, clear, original = (getattr(table, n, None) for n in ("cache", "cache_clear", "set"))
    own = vars(table).get("set") if isinstance(table, type) else None
    if not isinstance(cache, dict) or not callable(clear) or not callable(original) or not own:
        raise drift(_GPU_KERNELS, "has no cache dict, cache_clear() or set()", _BY_NAME)

    def in_name_order(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        ordered = sorted(cache.items())
        cache.clear()  # the same dict object: cache_clear is bound to it
        cache.update(ordered)
        return out

    clear()
    table.set = in_name_order
    try:
        yield
    finally:
        table.set = own  # the class's own descriptor (a classmethod), as it was


def _cubin_object(cubin_file: str, kernel_name: str, ld: str, objcopy: str) -> str:
    """Inductor's ``convert_cubin_to_obj``, with ``ld`` given the cubin's file
    name, run in its folder, instead of its absolute path.

    ``ld -r -b binary FILE`` names the symbols it makes after ``FILE``
    (``_binary_<FILE, each byte not an ASCII letter or digit as _>_start``, ``_end``,
    ``_size``)
    and writes them in its symbol hash table's order, which follows those
    names; Inductor then renames them to ``__<kernel>_start`` and so on. Given
    the absolute path, a builder's scratch folder decided the order, and so
    the order of the package's dynamic strings and its build-id (measured on
    an H100, torch 2.11: two builders of one key differed in exactly that).
    The file name is a hash of the cubin's bytes. The object is otherwise
    the one Inductor builds: the same three commands."""
    import re
    import shlex
    import subprocess

    folder, name = os.path.split(os.path.abspath(cubin_file))
    obj = name + ".o"
    if name.startswith("-"):  # a file, not an option of ld or objcopy
        name, obj = f"./{name}", f"./{obj}"

    def run(*args: str) -> None:
        subprocess.run(args, cwd=folder, capture_output=True, text=True, check=True)

    run(*shlex.split(ld), "-r", "-b", "binary", "-z", "noexecstack", "-o", obj, name)
    rodata = ".data=.rodata,alloc,load,readonly,data,contents"
    run(*shlex.split(objcopy), "--rename-section", rodata, obj)
    sym = re.sub(rb"[^0-9A-Za-z]", b"_", os.fsencode(name)).decode()  # ld's, byte by byte
    renames = [
        f"--redefine-sym=_binary_{sym}_{part}=__{kernel_name}_{part}"
        for part in ("start", "size", "end")
    ]
    run(*shlex.split(objcopy), *renames, obj)
    return os.path.normpath(os.path.join(folder, obj))


@contextlib.contextmanager
def cubin_objects_named_by_content() -> Iterator[None]:
    """Inductor's ``convert_cubin_to_obj`` (how a CUDA package embeds a
    kernel's cubin when it does not assemble them all at once) replaced by
    :func:`_cubin_object` for the block, and put back after.

    Raises:
        TorchAPIDriftError: it is missing or takes other parameters.
    """
    original = _function(_CUBIN_OBJECT, ("cubin_file", "kernel_name", "ld", "objcopy"))
    owner = _module(_CUBIN_OBJECT.rpartition(".")[0])
    owner.convert_cubin_to_obj = _cubin_object
    try:
        yield
    finally:
        owner.convert_cubin_to_obj = original


@contextlib.contextmanager
def compile_command_wrapped(wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Inductor's one function that runs a C++ compile command
    (``_run_compile_cmd(cmd_line: str, cwd: str)``) replaced by ``wrap(original)``
    for the block, and put back after.

    Raises:
        TorchAPIDriftError: the function is missing or takes other parameters.
    """
    original = _function(_RUN, ("cmd_line", "cwd"))
    builder = _module(_RUN.rpartition(".")[0])
    builder._run_compile_cmd = wrap(original)
    try:
        yield
    finally:
        builder._run_compile_cmd = original


def has_optimization_cflags() -> bool:
    """Whether Inductor's C++ builder has ``_get_optimization_cflags`` (the
    hook for ``-march`` on a torch without ``cpp.march``)."""
    try:
        _get(_CFLAGS)
    except TorchAPIDriftError:  # the builder or the function missing: no hook
        return False
    return True


@contextlib.contextmanager
def optimization_cflags_wrapped(wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """The C++ builder's ``_get_optimization_cflags(cpp_compiler, ...)``
    (returns the flags without ``-``: a list, or ``(cflags, ldflags)``)
    replaced by ``wrap(original)`` for the block, and put back after.

    Raises:
        TorchAPIDriftError: the function is missing or takes other parameters.
    """
    original = _function(_CFLAGS, ("cpp_compiler",))
    builder = _module(_CFLAGS.rpartition(".")[0])
    builder._get_optimization_cflags = wrap(original)
    try:
        yield
    finally:
        builder._get_optimization_cflags = original


@contextlib.contextmanager
def header_dir(path: str) -> Iterator[None]:
    """Inductor's precompiled headers' folder (read when a header is built) set
    to ``path`` (its locks in ``path/locks``) for the block, and put back after.

    Inductor keeps the path of each header it built for the rest of the process
    (``_precompile_header``, a ``functools.cache`` whose arguments do not name
    the folder). Entering with another folder than the last block's (a second
    ``jobs=0`` warmup into another cache) clears that cache first, so no
    compile includes a header of another folder, whose path would be in the
    package (:func:`headers_forgotten` clears it after the last block).

    Raises:
        TorchAPIDriftError: the folder's variables are missing (setting them
            would have no effect) or are not strings, or the header builder is
            missing or not a ``functools`` cache.
    """
    global _headers_of
    codecache = _module(_HEADER_DIR.rpartition(".")[0])
    saved = tuple(attribute(codecache, n, _BY_NAME) for n in (_HEADER_DIR, _HEADER_LOCK_DIR))
    for n, v in zip((_HEADER_DIR, _HEADER_LOCK_DIR), saved, strict=True):
        if not isinstance(v, str):
            raise drift(n, f"is a {type(v).__name__}, not a folder's path", _BY_NAME)
    if _headers_of != path:
        _built_headers().cache_clear()
        _headers_of = path
    codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = path, os.path.join(path, "locks")
    try:
        yield
    finally:
        codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = saved


#: The folder whose headers' paths Inductor's cache of built headers holds
#: (:func:`header_dir`); None: not one a block set.
_headers_of: str | None = None


def _built_headers() -> Callable:
    """Inductor's ``_precompile_header`` (:func:`_torch_cache`)."""
    return _torch_cache(_BUILT_HEADERS, "is not cached by torch (functools.cache)")


def headers_forgotten() -> None:
    """Clear Inductor's cache of built headers' paths if :func:`header_dir`
    filled it: a process that goes on compiling with torch's own folder (an
    engine after a ``jobs=0`` warmup) builds its own headers again.

    Raises:
        TorchAPIDriftError: as :func:`header_dir`.
    """
    global _headers_of
    if _headers_of is not None:
        _built_headers().cache_clear()
        _headers_of = None


#: Entries of the cache :func:`index_analysis_kept` keeps per process. A prefill
#: variant of the default plan asks for 150-260 distinct strides (torch 2.13,
#: ``benchmarks/index_analysis.py``), so this holds those of about sixty such
#: variants; each entry is one small sympy expression.
INDEX_ANALYSIS_KEPT = 1 << 14


class _Remembered:
    """The block's strides from earlier processes (:func:`index_analysis_kept`)."""

    strides: Any = None


@functools.cache
def _kept(original: Callable) -> Callable:
    """The process's cache of :data:`INDEX_ANALYSIS_KEPT` entries around torch's
    ``original`` function, made at its first use; below it, the strides
    :class:`_Remembered` holds for the block."""

    def stride_at_vec_range(index, var, vec_length=None):
        strides = _Remembered.strides
        if strides is None:
            return original(index, var, vec_length)
        key = strides.key(index, var, vec_length)
        stride = strides.get(key)
        if stride is None:
            stride = original(index, var, vec_length)
            strides.learn(key, stride)
        return stride

    return functools.lru_cache(maxsize=INDEX_ANALYSIS_KEPT)(stride_at_vec_range)


@contextlib.contextmanager
def index_analysis_kept(strides: Any = None) -> Iterator[None]:
    """The CPU code generator's stride analysis
    (``torch._inductor.codegen.cpp.stride_at_vec_range(index, var, vec_length)``)
    behind a cache of :data:`INDEX_ANALYSIS_KEPT` entries for the block, the
    cache kept for the process's later blocks; torch's function put back after.

    ``strides``: strides of earlier processes, asked before torch
    (:class:`warmup.builder.index_strides.Strides`: ``key(index, var,
    vec_length)``, ``get(key)``, None if not kept, and ``learn(key, stride)``
    for each stride torch computes in the block). None: only the process's cache.

    Choosing how to vectorize a loop, the code generator asks for the stride of
    every index expression along the loop variables, which ``sympy.simplify``
    works out. Torch caches the function in 128 entries, and one prefill
    variant of the default plan asks for 150-260, so a worker's next variant
    finds none of the expressions the two share (most of them: the sizes are
    symbols). ``benchmarks/index_analysis.py`` (docs/benchmarks/compile.md) has
    the CPU this saves.

    Torch caching the function is what makes a kept result safe to reuse: it
    is a function of its arguments alone (sympy expressions, compared by
    value), and a result equal to the one torch would compute prints the same
    C++. A function torch does not cache is not wrapped.

    Raises:
        TorchAPIDriftError: the function is missing, or is not a
            ``functools.lru_cache``.
    """
    cpp = _module(_STRIDE.rpartition(".")[0])
    original = _torch_cache(_STRIDE, "is not cached by torch (functools.lru_cache)")
    cpp.stride_at_vec_range = _kept(original)
    _Remembered.strides = strides
    try:
        yield
    finally:
        cpp.stride_at_vec_range = original
        _Remembered.strides = None


def is_torch_sympy_function(kind: type) -> bool:
    """Whether ``kind`` is one of torch's sympy function classes (its module is
    ``torch.utils._sympy.functions``)."""
    return kind.__module__ == _SYMPY_FUNCTIONS


def torch_sympy_function(module: str, name: str) -> type:
    """Torch's sympy function class ``module.name``, for a kept stride.

    Raises:
        ValueError: ``module`` is not torch's sympy functions module, or ``name``
            is not a sympy class defined there.
        TorchAPIDriftError: the module is missing.
    """
    import sympy

    if module != _SYMPY_FUNCTIONS:
        raise ValueError(f"{module} is not torch's sympy functions module")
    kind = getattr(_module(_SYMPY_FUNCTIONS), name, None)
    if not (
        isinstance(kind, type) and issubclass(kind, sympy.Basic) and is_torch_sympy_function(kind)
    ):
        raise ValueError(f"{module}.{name} is not a sympy class of torch's")
    return kind


@functools.cache
def aoti_interface_source() -> str | None:
    """The AOTInductor runtime's interface source that Inductor pastes at the top
    of every CPU wrapper (``codegen/aoti_runtime/interface.cpp``), or None where
    the installed torch has no such file (the wrapper is then compiled whole).

    Raises:
        TorchAPIDriftError: the module that pastes it is missing.
    """
    folder = os.path.dirname(_module(_AOTI_INTERFACE).__file__ or "")
    try:
        with open(os.path.join(folder, "aoti_runtime", "interface.cpp")) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def compiler_family_by_name(cxx: str) -> str:
    """The C++ compiler family Inductor takes ``cxx`` (``$CXX`` as given, or
    its default ``g++``) for, from the name alone: ``"gcc"``, ``"clang"`` or
    ``"neither"``. Inductor picks flags and pragmas by it, so a gcc named
    otherwise (a wrapper script) gets other code from the same key.

    Raises:
        TorchAPIDriftError: ``_is_gcc`` or ``_is_clang`` is missing or takes
            other arguments.
    """
    is_gcc, is_clang = _get(_IS_GCC), _get(_IS_CLANG)
    try:
        clang, gcc = bool(is_clang(cxx)), bool(is_gcc(cxx))
    except TypeError as e:
        raise drift(_IS_GCC, f"takes other arguments ({e})", _BY_NAME) from None
    return "clang" if clang else "gcc" if gcc else "neither"
