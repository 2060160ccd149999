"""Compile one variant: ``torch.export`` then AOTInductor into a ``.pt2`` package.

This is the only module of the project that imports torch's compile stack, and
it does so lazily, inside :func:`compile_variant` (with
:mod:`warmup.build.normalize`, which it calls there). It is the root of the
``sources`` key component (:func:`kernel_cache.plan.sources.source_files`): it and
every project module it imports are hashed into every key, so an edit to the
recipe below misses every cached artifact. The options and the environment a
compile runs under are declared in :mod:`kernel_cache.config.recipe`; the worker
process that calls :func:`compile_variant` has already applied
:func:`kernel_cache.config.recipe.compile_environment` (:func:`pin_environment`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
import warnings
from pathlib import Path

from kernel_cache.config.engine import EngineConfig
from kernel_cache.config.recipe import (
    BASE_OPTIONS,
    NATIVE,
    PINNED,
    classify,
    compile_environment,
    compile_options,
    cpu_features,
    device_arch,
    resolve_cpu_target,
)
from kernel_cache.errors import CompileError
from kernel_cache.kernels.builtin import build_module
from kernel_cache.kernels.slots import check_output, kernel_path
from kernel_cache.plan import traced as traced_files
from kernel_cache.plan.buckets import KernelVariant
from kernel_cache.plan.launch import launch_for, variant_defaults
from kernel_cache.plan.traced import Manifest, manifest_of
from kernel_cache.runtime.inputs import make_inputs
from warmup.build.normalize import build_paths_mapped, normalize_package

#: Modules that read the pinned environment variables when first imported.
_READS_ENV_AT_IMPORT = ("torch._inductor.config", "torch._dynamo.config")
#: Pinned variables Inductor reads when it uses them, not at import: setting
#: them later takes effect.
_READ_AT_CALL = ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")
#: Pinned variables Python reads once, at interpreter start: no import of the
#: compile stack reads them, and setting them later only reaches child processes.
_READ_AT_START = ("PYTHONHASHSEED",)


#: The environment :func:`pin_environment` last installed in this process.
_pinned: dict[str, str] | None = None


def pin_environment(device: str, cpu_target: str, scratch: str | None = None) -> None:
    """Replace this process's environment with the recipe's
    (:func:`kernel_cache.config.recipe.compile_environment`). Called first thing in a
    compile worker, before torch's compile stack is imported, and again before
    each compile.

    Between two calls the compile stack sets variables of its own, once per
    process (Inductor points ``TRITON_PTXAS_PATH`` at the ``ptxas`` bundled
    with torch, behind a ``functools.cache``): those are kept, so every
    variant a worker compiles runs the same tools.

    Raises:
        ConfigError: the compile stack was imported already under an
            environment whose pinned variables differ from the recipe's (their
            values are baked into Inductor's config), or an unusable ``cpu_target``.
    """
    import sys

    from kernel_cache.errors import ConfigError

    global _pinned
    env = compile_environment(os.environ, device, cpu_target, scratch)
    stale = [m for m in _READS_ENV_AT_IMPORT if m in sys.modules]
    before = os.environ if _pinned is None else _pinned
    own = {} if _pinned is None else _set_since(_pinned, env)
    dirty = sorted(
        k
        for k in set(before) | set(env)
        if classify(k).action == PINNED
        and k not in _READ_AT_CALL + _READ_AT_START
        and env.get(k) != before.get(k)
    )
    if stale and dirty:
        raise ConfigError(
            f"cannot pin the compile environment: {', '.join(stale)} was imported with "
            f"{', '.join(dirty)} set; compile in a worker process (--jobs 1 or more) or unset them"
        )
    os.environ.clear()
    os.environ.update({**own, **env})
    _pinned = dict(env)
    tempfile.tempdir = None  # gettempdir() caches its answer: read TMPDIR again


def _set_since(pinned: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """Variables this process set or changed since ``pinned`` was installed
    that the new ``env`` does not set itself."""
    return {k: v for k, v in os.environ.items() if pinned.get(k) != v and k not in env}


def module_for(config: EngineConfig, variant: KernelVariant, launch: dict | None = None):
    """The module compiled for ``variant``: its slot's implementation for
    ``config`` (:func:`kernel_cache.kernels.slots.kernel_path`: the engine's own
    when ``config.kernels`` names one, else the built-in factory of the device,
    on CUDA the Triton kernels), built through :mod:`kernel_cache.kernels.slots`
    with ``launch``, the variant's launch config (None: its defaults,
    :func:`kernel_cache.plan.launch.variant_defaults`)."""
    launch = variant_defaults(config, variant) if launch is None else launch
    c, impl = config, kernel_path(config, variant.kernel)
    return build_module(
        variant.kernel, c.num_heads, c.num_kv_heads, c.head_dim, impl=impl, **launch
    )


def required_cpu_features(config: EngineConfig) -> list[str]:
    """The ``/proc/cpuinfo`` flags an artifact of ``config`` may use in its host
    code (the CPU kernels, or a CUDA package's C++ wrapper; recorded in its
    metadata; engine start refuses it on a CPU that lacks one)."""
    target = resolve_cpu_target(config.cpu_target)
    return sorted(cpu_features()) if target.name == NATIVE else list(target.features)


def _check_vec_isa(config: EngineConfig, options: dict) -> None:
    """Inductor's chosen vector ISA must be the target's (it follows
    ``ATEN_CPU_CAPABILITY``, set by :func:`pin_environment`; on CUDA it is the C++
    wrapper's), chosen under the recipe's ``options`` (``cpp.vec_isa_ok``)."""
    target = resolve_cpu_target(config.cpu_target)
    if target.capability is None:
        return
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    with inductor_config.patch({k: v for k, v in options.items() if k == "cpp.vec_isa_ok"}):
        chosen = str(pick_vec_isa())
    want = "INVALID_VEC_ISA" if target.capability == "default" else target.capability
    if chosen != want:
        raise CompileError(
            f"cpu_target={target.name}: Inductor chose the {chosen} vector ISA, not {want}; "
            "was the compile environment pinned (warmup.build.compiler.pin_environment)?"
        )


def export_variant(config: EngineConfig, variant: KernelVariant, launch: dict | None = None):
    """``torch.export`` the variant's kernel with its bucket dimensions static and
    ``num_pool_blocks`` (dim 0 of the KV caches) dynamic. ``launch``: the
    variant's launch config (None: the kernel's defaults)."""
    import torch

    mod = module_for(config, variant, launch)
    args = make_inputs(config, variant, seed=0)
    impl = dict(config.kernels).get(variant.kernel)
    if impl is not None:  # the engine's code: check the contract before export
        check_output(variant.kernel, impl, mod, args)
    pool = torch.export.Dim("num_pool_blocks", min=1, max=2**31 - 1)
    dyn = [None] * len(args)
    dyn[1] = {0: pool}
    dyn[2] = {0: pool}
    return torch.export.export(mod, args, dynamic_shapes=tuple(dyn), strict=False)


def _impl(config: EngineConfig, variant: KernelVariant) -> str:
    """`` (kernel batched_decode=pkg.mod:Factory)`` for an engine's kernel, else ``""``."""
    impl = dict(config.kernels).get(variant.kernel)
    return f" (kernel {variant.kernel}={impl})" if impl else ""


#: Lines of an exporter's message kept in a CompileError (torch's can run to
#: hundreds of lines of graph and stack).
EXPORT_LINES = 12


def _first_lines(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    more = f"\n... ({len(lines) - EXPORT_LINES} more lines)" if len(lines) > EXPORT_LINES else ""
    return "\n".join(lines[:EXPORT_LINES]) + more


def _has_option(cfg, dotted: str) -> bool:
    """Whether ``torch._inductor.config`` has the option ``dotted`` (``a.b``)."""
    *parents, name = dotted.split(".")
    for p in parents:
        cfg = getattr(cfg, p, None)
        if cfg is None:
            return False
    try:
        getattr(cfg, name)
    except AttributeError:
        return False
    return True


def compile_variant(
    config: EngineConfig,
    variant: KernelVariant,
    launch: dict | None = None,
    pch_dir: str | None = None,
) -> tuple[bytes, dict, Manifest]:
    """Export and AOT-compile ``variant`` exactly as its key says: under the
    recipe's pinned environment (:func:`pin_environment`, applied here, a no-op
    in a worker that applied it already) and with the recipe's Inductor
    options; return the package bytes, timings and the files its code came
    from. Nothing a caller passes can change the options or the environment, so
    the code that decides them is all in the key's ``sources`` (this module and
    what it imports).

    ``launch`` is the variant's resolved launch config (the one in its key;
    :func:`kernel_cache.plan.launch.resolve_plan`); None resolves it here.
    ``pch_dir``: the folder of the precompiled headers, kept for later compiles
    (:func:`warmup.build.normalize.build_paths_mapped`; None: this compile's own).

    Returns:
        (bytes of the ``.pt2`` package, {"export_s", "compile_s", "total_s"} in
        seconds, the manifest of the files whose code ran while the kernel was
        built and exported: :class:`TraceWindow`)

    Raises:
        CompileError: export or AOTInductor failed (the message names the variant
            and carries the compiler's error text); or code of the project or
            the engine ran from a ``.pyc`` of an earlier version of its file
            (:func:`kernel_cache.plan.traced.stale_bytecode`).
        ConfigError: the environment cannot be pinned (see :func:`pin_environment`).
    """
    traced_files.record_imports()  # a worker did at its start; --jobs 0 from here on
    pin_environment(config.device, config.cpu_target, os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    opts = compile_options(config.device, config.cpu_target)
    _check_vec_isa(config, opts)
    window = TraceWindow(kernel_path(config, variant.kernel))
    data, timings = compile_with_options(
        config, variant, opts, launch, window=window, pch_dir=pch_dir
    )
    manifest = window.manifest()  # refuses traced code from stale bytecode
    stale = traced_files.stale_loaded_modules()
    if stale:
        raise traced_files.stale_bytecode_error(*stale[0])
    return data, timings, manifest


@contextlib.contextmanager
def _host_march(march: str | None):
    """On a torch without ``cpp.march`` (before 2.13; the GPU image runs 2.11),
    the ``-march=`` its C++ builder passes for host code, ``native`` otherwise,
    replaced by ``march`` for the block (None: nothing changed). The option is
    in the key either way (:func:`kernel_cache.config.recipe.compile_options`).

    Raises:
        CompileError: this torch's builder has no ``_get_optimization_cflags``
            to set it through (a torch this recipe does not know).
    """
    if march is None:
        yield
        return
    from torch._inductor import cpp_builder

    original = getattr(cpp_builder, "_get_optimization_cflags", None)
    if original is None:
        raise CompileError(
            f"torch {_torch_version()} has neither cpp.march nor the C++ builder hook to "
            f"build host code for -march={march}; use torch 2.11 to 2.13"
        )

    def swap(fl):
        return [f"march={march}" if str(f).startswith("march=") else f for f in fl]

    def flags(*args, **kwargs):  # a list of flags, or (cflags, ldflags) in newer torch
        out = original(*args, **kwargs)
        return (swap(out[0]), *out[1:]) if isinstance(out, tuple) else swap(out)

    cpp_builder._get_optimization_cflags = flags
    try:
        yield
    finally:
        cpp_builder._get_optimization_cflags = original


def _torch_version() -> str:
    import torch

    return torch.__version__


def compile_with_options(
    config: EngineConfig,
    variant: KernelVariant,
    options: dict,
    launch: dict | None = None,
    *,
    window: TraceWindow | None = None,
    pch_dir: str | None = None,
) -> tuple[bytes, dict]:
    """:func:`compile_variant` with other Inductor ``options`` and the caller's
    environment: for benchmarks comparing options, never for the cache (the key
    would not describe the artifact). ``window``: a :class:`TraceWindow` the
    kernel is built and exported in; ``pch_dir``: as :func:`compile_variant`'s.

    Raises:
        CompileError: as :func:`compile_variant`, or the kernel's code changed
            one of torch's global compiler settings (:data:`_CONFIG_MODULES`;
            put back before raising).
    """
    # torch 2.13's pytree emits a FutureWarning per export; it is not ours to fix.
    warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
    opts = dict(options)
    # A built-in option this torch does not have (enable_line_tables is new in
    # 2.13) is left out. The torch version is in the key, so one key always
    # means one set of options.
    from torch._inductor import config as inductor_config

    opts = {
        k: v for k, v in opts.items() if k not in BASE_OPTIONS or _has_option(inductor_config, k)
    }
    march = None
    if "cpp.march" in opts and not _has_option(inductor_config, "cpp.march"):
        march = opts.pop("cpp.march")  # torch < 2.13: set through the builder's flags
    if launch is None:
        launch = launch_for(config, variant, device_arch(config.device, config.cpu_target))
    return _export_and_compile(config, variant, opts, launch, march, window, pch_dir)


#: torch's process-global settings a compile reads (``torch._inductor.config``
#: holds graph passes too): a kernel's code that changes one builds code its key
#: does not describe, and would build it for every later variant of the worker.
#: Compared around the factory and the export only: AOTInductor itself adds to
#: ``aot_inductor.metadata`` in place.
_CONFIG_MODULES = ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config")


def _global_configs() -> dict:
    import importlib

    return {n: importlib.import_module(n).get_config_copy() for n in _CONFIG_MODULES}


def _config_changes(before: dict) -> list[str]:
    """The settings that differ from ``before`` (:func:`_global_configs`), each
    put back to its value there."""
    import importlib

    changed = []
    for name, old in before.items():
        module = importlib.import_module(name)
        now = module.get_config_copy()
        keys = sorted(k for k in old.keys() | now.keys() if old.get(k) != now.get(k))
        if keys:
            module.load_config({k: old[k] for k in keys if k in old})
            changed += [f"{name}.{k}" for k in keys]
    return changed


def _export_and_compile(config, variant, opts, launch, march, window, pch_dir):
    """The export (in ``window``) and the AOTInductor compile of
    :func:`compile_with_options`."""
    import torch
    import torch._inductor

    t0 = time.perf_counter()
    before = _global_configs()
    try:
        with window or contextlib.nullcontext():
            ep = export_variant(config, variant, launch)
    except CompileError as e:  # the engine's kernel broke the slot's contract
        raise CompileError(f"{variant}: {e}") from None
    except Exception as e:
        raise CompileError(
            f"torch.export failed for {variant}{_impl(config, variant)}: "
            f"{type(e).__name__}: {_first_lines(e)}"
        ) from None
    finally:
        changed = _config_changes(before)  # the kernel's code ran; export itself sets none
    if changed:
        raise CompileError(
            f"{variant}{_impl(config, variant)}: torch's global compiler settings changed while "
            f"the kernel was built ({', '.join(changed[:5])}): the key does not cover them, and "
            "they would reach every later compile of this worker (put back now). Set no torch "
            "config in a kernel's code; the compile options are the recipe's "
            "(kernel_cache.config.recipe)"
        )
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kernel_cache-build-") as tmp:
        path = os.path.join(tmp, "model.pt2")
        try:
            with torch.no_grad(), _host_march(march), build_paths_mapped(tmp, pch_dir) as paths:
                torch._inductor.aoti_compile_and_package(
                    ep, package_path=path, inductor_configs=opts
                )
        except Exception as e:
            raise CompileError(
                f"AOTInductor failed for {variant}{_impl(config, variant)}: {type(e).__name__}: {e}"
            ) from None
        data = normalize_package(Path(path).read_bytes(), paths)
    t2 = time.perf_counter()
    return data, {"export_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


# -- the files a kernel's code came from ---------------------------------------------

#: Per kernel import path: the source files (outside the standard library,
#: torch and the installed distributions) whose import ran inside one of its
#: :class:`TraceWindow` in this process. A module's body runs once per process,
#: so a later window would not see it run (a module-level constant read at trace
#: time); it is added to later windows: of the same kernel, and of every engine
#: kernel (not a built-in one), since two engine kernels may share a module
#: loaded by a computed name (``importlib.import_module``) and the second one's
#: window sees no code of it run. The cost is over-invalidation: an edit to such
#: a file rebuilds the other engine kernel's variants too.
_IMPORTED: dict[str, set[str]] = {}
#: Files whose code ran outside imports in a window of this process, by kernel
#: import path, added to later windows as :data:`_IMPORTED` is: a trace may
#: reuse what an earlier one computed without running its code again (a
#: ``functools.cache`` of a library function, a module-level memo), and the
#: later entry depends on that code as much as the first.
_RAN: dict[str, set[str]] = {}
#: The code objects of the engine's and the project's source files
#: (:func:`_own_source`) that ran in a window of this process, by file: the
#: manifest checks them against the file it hashes
#: (:func:`kernel_cache.plan.traced.manifest_of`).
_CODES: dict[str, dict[int, object]] = {}


def _find_and_load_code():
    """The code object of the import system's ``_find_and_load`` (every import
    of a module not yet in ``sys.modules`` runs it)."""
    import importlib._bootstrap

    return importlib._bootstrap._find_and_load.__code__


#: ``co_flags`` a function's code has (CO_OPTIMIZED, CO_NEWLOCALS) and a module's,
#: a class body's or exec'd code has not.
_FUNCTION_FLAGS = 0x1 | 0x2
#: Frames looked through for the engine's own above code run under a file's name.
_CALLER_DEPTH = 64


def _own_source(filename: str) -> bool:
    """Whether code that ran inside an import from ``filename`` counts: a file
    classified :data:`~kernel_cache.plan.traced.OTHER`, or one in a site folder
    that no distribution lists with its sha256 (a module copied there, an
    ``.egg-info``'s), which no version stands for either."""
    kind = traced_files.classify(filename)
    if kind == traced_files.OTHER:
        return True
    return kind == traced_files.SITE and traced_files.dist_of(traced_files._norm(filename)) is None


#: The open :class:`TraceWindow` s, innermost last (one at a time in a compile).
_OPEN: list = []
#: The innermost open window, which :func:`_dispatch` records into; None outside one.
_WINDOW = None
#: That window's :attr:`TraceWindow.seen` (empty outside one).
_SEEN: set[int] = set()


def _set_window() -> None:
    """Point :data:`_WINDOW` and :data:`_SEEN` at the innermost open window."""
    global _WINDOW, _SEEN
    _WINDOW = _OPEN[-1] if _OPEN else None
    _SEEN = _WINDOW.seen if _WINDOW is not None else set()


def _dispatch(frame, event, arg, _id=id) -> None:
    """The profile function of every :class:`TraceWindow` (``sys.setprofile``):
    records into the window open now; outside one it does nothing.

    Python calls it for every call and return, C calls included (about 15
    million events in the export of one variant of the tiny plan), so the common
    cases cost one or two set lookups here and no further call: a function
    already seen outside an import, and, inside an import, one already seen
    inside an import (``_id``: ``id`` bound once, not looked up per call)."""
    if event == "call":
        cid = _id(frame.f_code)
        if cid not in _SEEN:
            window = _WINDOW
            if window is not None and not (window._depth and cid in window.seen_in_import):
                window._call(frame.f_code, frame)
    elif event == "return":
        window = _WINDOW
        if window is not None and frame.f_code is window._import:
            window._depth -= 1


class TraceWindow:
    """A context in which every Python function called (the factory's import,
    the factory, ``torch.export``), in this thread and in threads started
    inside it, has its file recorded.

    Code run by an import (finders, module and class bodies) is told apart by
    the import system's ``_find_and_load`` frame: of it only files classified
    :data:`~kernel_cache.plan.traced.OTHER` and site files no distribution
    lists are kept (the engine's modules, whose module-level values a trace
    may read: :func:`_own_source`), also for every later window
    of the same kernel import path ``kernel`` and, for an engine kernel, of
    every engine kernel (:data:`_IMPORTED`); a distribution counts only where its
    code ran outside an import (so the setuptools and editable-install import
    hooks, and the libraries torch's export stack imports on first use, do not).

    Uses ``sys.setprofile``/``threading.setprofile`` with one module-level
    function (:func:`_dispatch`) that records into the open window: a thread
    started in an earlier window keeps that function, so its code is recorded
    in the window open when it runs. A previous profile function is restored
    on exit. Measured on the tiny plan's three variants (Python 3.11, the
    project's 2-core CPU, idle, ``perf_counter`` around ``export_variant``):
    2.0-4.3 s untraced, 5.0-9.7 s traced, of which about 4 s is what any
    Python profile function costs for the 15 million events of such an export
    (one that does nothing: 6.8 s against 2.8 s untraced).

    Refused with :class:`~kernel_cache.errors.CompileError` on exit, since the
    record would be incomplete: the profile hook was replaced during the window
    (cProfile, ``torch.profiler`` with ``with_stack``, a tool that sets
    ``sys.setprofile``), or the engine's code ran code compiled from a string
    (``exec``/``eval`` of text with no file name), whose source no file holds,
    or module code under a file's name that is not that file's (checked for
    every file, the standard library's, torch's and distributions' included).
    Not seen: a thread started before the process's first window (Python
    before 3.12 cannot hook a running thread), and a replacement that put the
    hook back before the window closed.
    """

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.files: set[str] = set()  # code that ran outside imports
        self.imported: set[str] = set()  # code that ran inside imports
        self.codes: dict[int, object] = {}  # every code object that ran, by id
        self.seen: set[int] = set()  # ids of functions that ran outside imports
        self.seen_in_import: set[int] = set()  # ids of functions that ran inside imports
        self.from_text: list[str] = []  # "file:line" of the engine's exec/eval of text
        self.module_runs: list[tuple] = []  # (file name, code, "file:line") exec'd by it
        self._own: dict[str, bool] = {}  # _own_source by file name, for this window
        self._depth = 0
        self._import = _find_and_load_code()

    def _call(self, code, frame) -> None:
        """A call of ``code`` that :func:`_dispatch` has not ruled out: the first
        of a function outside imports and the first inside imports, every call
        of the import system's ``_find_and_load``, and every run of module or
        class-body code (checked by :meth:`_module_run` each time)."""
        self.codes[id(code)] = code
        if code is self._import:
            self._depth += 1
            return
        if self._depth:
            self.imported.add(code.co_filename)
        else:
            self.files.add(code.co_filename)
        if not code.co_flags & _FUNCTION_FLAGS:  # module or class body: exec'd code
            self._module_run(code, frame.f_back)
        elif self._depth:  # recorded in imported: later calls inside imports change nothing
            self.seen_in_import.add(id(code))
        else:  # recorded in files: later calls change nothing (an import's call of it
            # is not added to imported, which the manifest only adds to files)
            self.seen.add(id(code))

    def _module_run(self, code, caller) -> None:
        """Code that is not a function's (a module's or a class body: what
        ``exec``/``eval`` run, whatever its ``co_name``) started. Text with no file
        name is kept in :attr:`from_text` when the engine's own code started it
        directly (the standard library's and torch's generated code, dataclass
        methods say, is theirs). Code under a file's name is kept in
        :attr:`module_runs`, to be checked against that file, when an engine
        frame is found above it before the import system's (``runpy``,
        ``code.InteractiveInterpreter`` and the like run it for the engine; the
        import system runs modules' own code)."""
        name = code.co_filename
        if not name or name.startswith("<"):
            if caller is not None and _own_source(caller.f_code.co_filename):
                self.from_text.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
            return
        frame = caller
        for _ in range(_CALLER_DEPTH):
            if frame is None:
                return
            filename = frame.f_code.co_filename
            if filename.startswith("<frozen importlib"):
                return
            own = self._own.get(filename)
            if own is None:
                own = self._own[filename] = _own_source(filename)
            if own:
                self.module_runs.append((name, code, f"{filename}:{frame.f_lineno}"))
                return
            frame = frame.f_back

    def _check_module_runs(self) -> None:
        """Module code the engine ran under a file's name must be that file's (the
        bytes imported, else those on disk), whatever the file is: a standard
        library, torch or distribution file is recorded by its version, not
        hashed, so code compiled from other text under its name would go unseen."""
        for name, code, where in self.module_runs:
            path = traced_files._norm(name)
            data = traced_files._LOADED_BYTES.get(path)
            try:
                data = Path(path).read_bytes() if data is None else data
            except OSError:
                data = None
            digest = hashlib.sha256(data or b"").hexdigest()
            if data is None or code not in traced_files._compiled(path, digest, data):
                raise CompileError(
                    f"kernel {self.kernel}: its code ran module code under the name {name} "
                    f"(at {where}) that is not that file's contents: the entry would "
                    "record that file, not the code that ran; compile a file's text "
                    "under its own path"
                )

    def _refuse_incomplete(self, intact: bool, hook) -> None:
        """Raise :class:`CompileError` where the window's record cannot be trusted
        (class docstring): the hook replaced, module code that is not its file's,
        code compiled from text with no file name."""
        if not intact:
            raise CompileError(
                f"kernel {self.kernel}: the profile hook that records the files the "
                f"kernel's code runs was replaced while it was traced (now {hook!r}: a "
                "profiler such as cProfile or torch.profiler(with_stack=True), or a tool "
                "that calls sys.setprofile), so the record of the files it ran is "
                "incomplete and the build is refused; build the kernel without it"
            )
        self._check_module_runs()
        if self.from_text:
            raise CompileError(
                f"kernel {self.kernel}: its code ran code compiled from text with no file "
                f"name (exec or eval of a string, at {', '.join(sorted(set(self.from_text)))}),"
                " whose source no file holds, so the cache key cannot cover it; run it from "
                "its file (import it, or exec(compile(text, path, 'exec')) with the path it "
                "was read from, which is hashed)"
            )

    def __enter__(self) -> TraceWindow:
        import sys
        import threading

        self._saved = (sys.getprofile(), threading.getprofile())
        _OPEN.append(self)
        _set_window()
        threading.setprofile(_dispatch)
        sys.setprofile(_dispatch)
        return self

    def __exit__(self, *exc) -> None:
        import sys
        import threading

        hook = sys.getprofile()
        intact = hook is _dispatch and threading.getprofile() is _dispatch
        sys.setprofile(self._saved[0])
        threading.setprofile(self._saved[1])
        _OPEN.remove(self)
        _set_window()
        if exc[0] is None:
            self._refuse_incomplete(intact, hook)
        own = {f for f in self.imported if _own_source(f)}
        _IMPORTED.setdefault(self.kernel, set()).update(own)
        _RAN.setdefault(self.kernel, set()).update(self.files)
        mine = {f for f in {c.co_filename for c in self.codes.values()} if _own_source(f)}
        for code in self.codes.values():
            if code.co_filename in mine:
                _CODES.setdefault(code.co_filename, {})[id(code)] = code
        self.codes, self.seen, self.seen_in_import = {}, set(), set()

    def manifest(self) -> Manifest:
        """The recorded files, with the source files imported in this or an
        earlier window of this process (:data:`_IMPORTED`), as a
        :class:`~kernel_cache.plan.traced.Manifest`."""
        from kernel_cache.kernels.slots import builtin_paths

        builtins = builtin_paths()
        if self.kernel in builtins:
            imported = _IMPORTED.get(self.kernel, set()) | _RAN.get(self.kernel, set())
        else:
            earlier = [f for d in (_IMPORTED, _RAN) for k, f in d.items() if k not in builtins]
            imported = set().union(*earlier)
        files = self.files | imported
        return manifest_of(files, ran={f: list(_CODES[f].values()) for f in files if f in _CODES})
