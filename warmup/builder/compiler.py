"""Compile one variant: ``torch.export`` then AOTInductor into a ``.pt2`` package.

This is the only module of the project that imports torch's compile stack, and
it does so lazily, inside :func:`compile_variant` (with
:mod:`warmup.builder.normalize`, which it calls there). It is the root of the
``sources`` key component (:func:`kernel_cache.plan.sources.source_files`): it and
every project module it imports are hashed into every key, so an edit to the
recipe below misses every cached artifact. The options and the environment a
compile runs under are declared in :mod:`kernel_cache.config.recipe`; the worker
process that calls :func:`compile_variant` has already applied
:func:`kernel_cache.config.recipe.compile_environment` (:func:`pin_environment`).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
import warnings
from pathlib import Path

from kernel_cache.config.engine import EngineConfig
from kernel_cache.config.recipe import (
    BASE_OPTIONS,
    PINNED,
    classify,
    compile_environment,
    compile_options,
    device_arch,
    resolve_cpu_target,
)
from kernel_cache.errors import CompileError, TorchAPIDriftError, shown
from kernel_cache.kernels.builtin import build_module
from kernel_cache.kernels.slots import check_output, kernel_path
from kernel_cache.plan import traced_build as traced_files
from kernel_cache.plan.buckets import KernelVariant
from kernel_cache.plan.launch import launch_for, variant_defaults
from kernel_cache.plan.traced import Manifest
from kernel_cache.runtime.inputs import make_inputs
from warmup import torch_compat
from warmup.builder import index_strides
from warmup.builder.normalize import build_paths_mapped, normalize_package
from warmup.builder.recorder import RunRecorder

#: Modules that read the pinned environment variables when first imported.
_READS_ENV_AT_IMPORT = torch_compat.READS_ENV_AT_IMPORT
#: Pinned variables Inductor reads when it uses them, not at import: setting
#: them later takes effect.
_READ_AT_CALL = ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")
#: Pinned variables Python reads once, at interpreter start: no import of the
#: compile stack reads them, and setting them later only reaches child processes.
_READ_AT_START = ("PYTHONHASHSEED",)


#: ``TORCHINDUCTOR_COMPILE_THREADS`` this worker was started with (None: Inductor's default).
_compile_threads: int | None = None
#: The environment :func:`pin_environment` last installed in this process.
_pinned: dict[str, str] | None = None


def pin_environment(
    device: str, cpu_target: str, scratch: str | None = None, compile_threads: int | None = None
) -> None:
    """Replace this process's environment with the recipe's
    (:func:`kernel_cache.config.recipe.compile_environment`). Called first thing in a
    compile worker, before torch's compile stack is imported, and again before
    each compile. ``compile_threads`` (None: the last call's) is
    ``TORCHINDUCTOR_COMPILE_THREADS``, which Inductor reads at import.

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

    global _pinned, _compile_threads, _handed_back
    if compile_threads is not None:
        _compile_threads = compile_threads
    env = compile_environment(os.environ, device, cpu_target, scratch, _compile_threads)
    stale = [m for m in _READS_ENV_AT_IMPORT if m in sys.modules]
    before = os.environ if _pinned is None else _pinned
    if _handed_back is not None:  # the caller's environment is back: not the stack's
        own = {k: v for k, v in _handed_back.items() if k not in env}
    else:
        own = {} if _pinned is None else _set_since(_pinned, env)
    dirty = sorted(
        k
        for k in set(before) | set(env)
        if classify(k).action == PINNED
        and k not in _READ_AT_CALL + _READ_AT_START
        and env.get(k) != before.get(k)
    )
    if stale and dirty:

        def value(v):
            return "unset" if v is None else shown(v, 80)

        changes = ", ".join(
            f"{k} ({value(before.get(k))} then, {value(env.get(k))} now)" for k in dirty
        )
        raise ConfigError(
            f"cannot pin the compile environment: {', '.join(stale)} "
            f"{'was' if len(stale) == 1 else 'were'} imported in this process under other "
            f"values than this compile's recipe needs: {changes}; they "
            "are read at import, so compile in a fresh worker process (--jobs 1 or more), "
            "or unset the variables of yours among them before the first compile"
        )
    os.environ.clear()
    os.environ.update({**own, **env})
    _pinned, _handed_back = dict(env), None
    tempfile.tempdir = None  # gettempdir() caches its answer: read TMPDIR again


#: What the compile stack set since the last pin of an :func:`environment_pinned`
#: block, kept when the block gave the caller's environment back; None outside.
_handed_back: dict[str, str] | None = None


@contextlib.contextmanager
def environment_pinned(device: str, cpu_target: str, scratch: str):
    """:func:`pin_environment` for compiles in the caller's own process (``jobs=0``)
    for the block; after it the caller's environment and temp folder are put
    back. The variables the compile stack set meanwhile (once per process, such
    as ``TRITON_PTXAS_PATH``) leave the caller's environment too, but are kept
    for the next block's pin, as a worker keeps them between its compiles; a
    variable of the caller's that the recipe removes stays removed from every
    block's compiles.

    Raises:
        ConfigError: as :func:`pin_environment`.
    """
    global _handed_back
    saved, saved_tempdir = dict(os.environ), tempfile.tempdir
    pin_environment(device, cpu_target, scratch)  # raises before it changes anything
    try:
        yield
    finally:
        _handed_back = _set_since(_pinned, {})
        os.environ.clear()
        os.environ.update(saved)
        tempfile.tempdir = saved_tempdir  # the pin pointed it at the scratch folder


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


def _vec_isa_of_target(config: EngineConfig, options: dict):
    """A context for one compile: where the target's ISA can be narrowed to
    (:data:`warmup.torch_compat.NARROWABLE_ISAS`: ``x86-64-v3``'s AVX2),
    Inductor's picks in the block choose from that ISA alone, so Inductor
    probes no other (:func:`warmup.torch_compat.vec_isa_narrowed`: their
    outcome cannot change the pick, and on torch before 2.13 each probe is a
    child process that imports torch); otherwise (``native``) nothing changes."""
    target = resolve_cpu_target(config.cpu_target)
    if target.capability in torch_compat.NARROWABLE_ISAS:
        return torch_compat.vec_isa_narrowed(target.capability, options)
    return contextlib.nullcontext()


def _check_vec_isa(config: EngineConfig, options: dict) -> None:
    """Inductor's chosen vector ISA must be the target's (it follows
    ``ATEN_CPU_CAPABILITY``, set by :func:`pin_environment`; on CUDA it is the C++
    wrapper's), chosen under the recipe's ``options`` (``cpp.vec_isa_ok``).
    ``native`` is not checked.

    Raises:
        CompileError: Inductor chose another ISA.
    """
    target = resolve_cpu_target(config.cpu_target)
    if target.capability is None:
        return
    want = "INVALID_VEC_ISA" if target.capability == "default" else target.capability
    chosen = torch_compat.chosen_vec_isa(options)
    if chosen != want:
        raise CompileError(
            f"cpu_target={target.name}: Inductor chose the {chosen} vector ISA, not {want}; "
            "was the compile environment pinned (warmup.builder.compiler.pin_environment)?"
        )


def export_variant(
    config: EngineConfig, variant: KernelVariant, launch: dict | None = None, info=None
):
    """``torch.export`` the variant's kernel with its bucket dimensions static and
    ``num_pool_blocks`` (dim 0 of the KV caches) dynamic. ``launch``: the
    variant's launch config (None: the kernel's defaults). A declared slot's
    variant: :func:`export_declared` (``info`` receives its ``slot_params``)."""
    import torch

    spec = config.slot(variant.kernel)
    if spec is not None:
        return export_declared(spec, variant, info, device=config.device)
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


def export_declared(spec, variant: KernelVariant, info: dict | None = None, device: str = "cpu"):
    """``torch.export`` declared slot ``spec`` at ``variant``: the factory's module
    wrapped so that its parameters and buffers are the leading inputs
    (:func:`kernel_cache.kernels.declared.weights_as_inputs`), every bucket and
    fixed dimension static, each ``dynamic:NAME`` one dynamic dimension.
    ``info`` (a dict, if given) receives ``slot_params``: the state's
    ``[name, shape, dtype]`` list, recorded in the entry. The module and its
    example inputs are on ``device`` (the plan's).

    Raises:
        CompileError: the factory fails, or the module's eager output is not one
            tensor whose dim 0 is the ``output_rows`` bucket (names the slot).
    """
    import torch

    from kernel_cache.kernels.declared import (
        build_declared,
        example_state,
        state_spec,
        weights_as_inputs,
    )
    from kernel_cache.runtime.inputs import make_slot_inputs, slot_dims

    mod = build_declared(spec).to(device)
    args, dyn_sizes = make_slot_inputs(spec, variant, device=device)
    where = f"slot {spec.name}={spec.factory}"
    try:
        with torch.no_grad():
            out = mod(*args)
    except Exception as e:
        first = " ".join(str(e).strip().splitlines()[:3])
        shown = [
            f"{i.name} {list(a.shape)} {a.dtype}" for i, a in zip(spec.inputs, args, strict=True)
        ]
        raise CompileError(
            f"{where}: forward failed on example inputs {shown}: {type(e).__name__}: {first}"
        ) from None
    if not isinstance(out, torch.Tensor):
        raise CompileError(f"{where}: forward returned a {type(out).__name__}, not one tensor")
    rows = slot_dims(spec, variant).get(spec.output_rows) if spec.output_rows else None
    if rows is not None and (out.dim() == 0 or out.shape[0] != rows):
        raise CompileError(
            f"{where}: output_rows={spec.output_rows}: the output's dim 0 must be the "
            f"bucket, {rows}; forward returned {list(out.shape)}"
        )
    dims = {n: torch.export.Dim(n, min=1, max=2**31 - 1) for n in dyn_sizes}
    state = example_state(mod)
    dyn: list = [None] * len(state)
    for inp in spec.inputs:
        names = iter(inp.dynamic_names())
        spec_dims = {
            i: dims[next(names)]
            for i, d in enumerate(inp.shape)
            if isinstance(d, str) and d.startswith("dynamic")
        }
        dyn.append(spec_dims or None)
    if info is not None:
        info["slot_params"] = state_spec(mod)
    wrapper = weights_as_inputs(mod)
    shapes = (tuple(dyn),) if dims else None  # forward(*args): one entry, the varargs
    return torch.export.export(wrapper, (*state, *args), dynamic_shapes=shapes, strict=False)


def _impl(config: EngineConfig, variant: KernelVariant) -> str:
    """`` (kernel batched_decode=pkg.mod:Factory)`` for an engine's kernel, else ``""``."""
    spec = config.slot(variant.kernel)
    if spec is not None:
        return f" (slot {spec.name}={spec.factory})"
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
    """Whether Inductor's configuration ``cfg``
    (:func:`warmup.torch_compat.inductor_config`) has the option ``dotted`` (``a.b``)."""
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


def check_cxx() -> None:
    """Refuse, before anything is exported, a C++ compiler AOTInductor cannot
    use or would take for another family than it is: Inductor picks flags and
    pragmas by ``$CXX``'s name (:func:`warmup.torch_compat.compiler_family_by_name`),
    while the key's ``cxx`` component is what the compiler answers
    (:func:`kernel_cache.plan.keys.cxx_toolchain`), so a gcc behind a wrapper
    named otherwise would build other code under the same key.

    Raises:
        ConfigError: names ``CXX``, what it is and the fix.
    """
    from kernel_cache.errors import ConfigError
    from kernel_cache.plan.keys import cxx_executable, cxx_toolchain, cxx_version_line

    given = os.environ.get("CXX")
    name = given or "g++"
    shown_as = f"CXX={given!r}" if given else "the default C++ compiler g++ (CXX unset)"
    exe = cxx_executable()
    if exe is None:
        raise ConfigError(
            f"{shown_as} is not found (as a path or on PATH); warmup builds every "
            "variant's host code with it. fix: install g++ (Debian: apt-get install g++) "
            "or set CXX to a C++ compiler"
        )
    first = cxx_version_line(exe)
    compiler = cxx_toolchain(exe)["compiler"]
    if compiler == "unknown" or not re.search(r"g\+\+|gcc|clang", first, re.IGNORECASE):
        raise ConfigError(
            f"{shown_as} ({exe}) does not answer --version as a C++ compiler does (its "
            f"first line: {shown(first)}). fix: set CXX to g++ or clang++ (or a wrapper "
            "named so), or unset it"
        )
    family, seen = compiler.split()[0], torch_compat.compiler_family_by_name(name)
    if seen != family:
        taken = "neither gcc nor clang" if seen == "neither" else seen
        named = "g++ (or a name with gcc in it)" if family == "gcc" else "clang++"
        raise ConfigError(
            f"{shown_as} is {compiler} by its --version, but Inductor takes a "
            f"compiler for gcc or clang by its name alone, and this one for {taken}: it "
            "would generate other code (pragmas, flags) under the key of a compiler "
            f"named as it is. fix: give it a name that says {family}: a wrapper script "
            f"or link named {named}, or set CXX to the compiler itself"
        )


def compile_variant(
    config: EngineConfig,
    variant: KernelVariant,
    launch: dict | None = None,
    pch_dir: str | None = None,
    info: dict | None = None,
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
    (:func:`warmup.builder.normalize.build_paths_mapped`; None: this compile's own).
    ``info``: a dict that receives what the entry records besides the timings
    (a declared slot's ``slot_params``: :func:`export_declared`).

    Returns:
        (bytes of the ``.pt2`` package, {"export_s", "compile_s", "total_s"} in
        seconds, the manifest of the files whose code ran while the kernel was
        built and exported: :class:`RunRecorder`)

    Raises:
        CompileError: export or AOTInductor failed (the message names the variant
            and carries the compiler's error text); or code of the project or
            the engine ran from a ``.pyc`` of an earlier version of its file
            (:func:`kernel_cache.plan.traced_build.stale_bytecode`).
        ConfigError: the environment cannot be pinned (see :func:`pin_environment`).
    """
    traced_files.record_imports()  # a worker did at its start; --jobs 0 from here on
    pin_environment(config.device, config.cpu_target, os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    check_cxx()
    opts = compile_options(config.device, config.cpu_target)
    window = RunRecorder(kernel_path(config, variant.kernel))
    with _vec_isa_of_target(config, opts):
        _check_vec_isa(config, opts)
        data, timings = compile_with_options(
            config, variant, opts, launch, window=window, pch_dir=pch_dir, info=info
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
        TorchAPIDriftError: this torch's builder has no such hook to set it
            through (:func:`warmup.torch_compat.optimization_cflags_wrapped`).
    """
    if march is None:
        yield
        return

    def swap(fl):
        return [f"march={march}" if str(f).startswith("march=") else f for f in fl]

    def wrap(original):
        def flags(*args, **kwargs):  # a list of flags, or (cflags, ldflags) in newer torch
            out = original(*args, **kwargs)
            return (swap(out[0]), *out[1:]) if isinstance(out, tuple) else swap(out)

        return flags

    with torch_compat.optimization_cflags_wrapped(wrap):
        yield


def compile_with_options(
    config: EngineConfig,
    variant: KernelVariant,
    options: dict,
    launch: dict | None = None,
    *,
    window: RunRecorder | None = None,
    pch_dir: str | None = None,
    info: dict | None = None,
) -> tuple[bytes, dict]:
    """:func:`compile_variant` with other Inductor ``options`` and the caller's
    environment: for benchmarks comparing options, never for the cache (the key
    would not describe the artifact). ``window``: a :class:`RunRecorder` the
    kernel is built and exported in; ``pch_dir``, ``info``: as :func:`compile_variant`'s.

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
    inductor_config = torch_compat.inductor_config()
    opts = {
        k: v for k, v in opts.items() if k not in BASE_OPTIONS or _has_option(inductor_config, k)
    }
    march = None
    if "cpp.march" in opts and not _has_option(inductor_config, "cpp.march"):
        march = opts.pop("cpp.march")  # torch < 2.13: set through the builder's flags
    if launch is None:
        launch = launch_for(config, variant, device_arch(config.device, config.cpu_target))
    return _export_and_compile(config, variant, opts, launch, march, window, pch_dir, info)


#: torch's process-global settings a compile reads (Inductor's configuration
#: holds graph passes too): a kernel's code that changes one builds code its key
#: does not describe, and would build it for every later variant of the worker.
#: Compared around the factory and the export only: AOTInductor itself adds to
#: ``aot_inductor.metadata`` in place.
_CONFIG_MODULES = torch_compat.CONFIG_MODULES


def _global_configs() -> dict:
    return {n: m.get_config_copy() for n, m in torch_compat.config_modules().items()}


def _config_changes(before: dict) -> list[str]:
    """The settings that differ from ``before`` (:func:`_global_configs`), each
    put back to its value there."""
    modules = torch_compat.config_modules()
    changed = []
    for name, old in before.items():
        module = modules[name]
        now = module.get_config_copy()
        keys = sorted(k for k in old.keys() | now.keys() if old.get(k) != now.get(k))
        if keys:
            module.load_config({k: old[k] for k in keys if k in old})
            changed += [f"{name}.{k}" for k in keys]
    return changed


def _export_and_compile(config, variant, opts, launch, march, window, pch_dir, info=None):
    """The export (in ``window``) and the AOTInductor compile of
    :func:`compile_with_options`."""
    import torch

    compile_and_package = torch_compat.aoti_compile_and_package()
    t0 = time.perf_counter()
    before = _global_configs()
    try:
        with window or contextlib.nullcontext():
            ep = export_variant(config, variant, launch, info)
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
    # The stride analysis's results of earlier processes (beside the headers).
    known = index_strides.load(pch_dir) if pch_dir else None
    strides = None if known is None else index_strides.Strides(known)
    with tempfile.TemporaryDirectory(prefix="kernel_cache-build-") as tmp:
        path = os.path.join(tmp, "model.pt2")
        try:
            with (
                torch.no_grad(),
                _host_march(march),
                torch_compat.gpu_kernels_in_name_order(),
                torch_compat.cubin_objects_named_by_content(),
                torch_compat.index_analysis_kept(strides),
                build_paths_mapped(tmp, pch_dir) as paths,
            ):
                compile_and_package(ep, package_path=path, inductor_configs=opts)
        except TorchAPIDriftError:
            raise  # torch's API, not this variant
        except Exception as e:
            raise CompileError(
                f"AOTInductor failed for {variant}{_impl(config, variant)}: {type(e).__name__}: {e}"
            ) from None
        data = normalize_package(Path(path).read_bytes(), paths)
    if strides is not None:  # pch_dir is set
        index_strides.save(pch_dir, strides.learned)
    t2 = time.perf_counter()
    return data, {"export_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}
