"""Content-hashed cache keys built from named components.

A key is an ordered list of named components; each is hashed on its own and
recorded in the entry's metadata, so a miss can be explained component by
component (``kernel-cache explain``). The idea follows JAX's
``jax/_src/cache_key.py``; the code is ours.

What counts (:data:`COMPONENTS`, in order): the artifact format version, the
sources (every project file the compile path imports, found by code:
:func:`kernel_cache.plan.sources.source_files`, plus the files of the engine's
own kernel for the variant's slot:
:func:`kernel_cache.plan.sources.kernel_source_files`), the variant, the import
path of its slot's implementation (``kernel``: :mod:`kernel_cache.kernels.slots`; the
built-in factory unless the config names another), its resolved launch config (defaults
written out; :mod:`kernel_cache.plan.launch`), the geometry, the dtype (and the
KV cache's where it differs: :func:`dtype_component`), the device
type and architecture (on the CPU, the instruction-set target:
:mod:`kernel_cache.config.recipe`), the torch, Python and C++ compiler versions, and
the compile options.

What is pinned and what is ignored: the environment variables torch.export,
Inductor, Triton and the C++ compiler read are listed, each with its reason, in
:data:`kernel_cache.config.recipe.ENV_RULES`; warmup compiles in a worker whose
environment that list has cleaned. :data:`EXCLUDED` lists what must not count:
anything that changes between the machine that warms and the pods that load,
without changing the code.

The ``cxx`` component names the C++ compiler AOTInductor runs (``$CXX``, else
``g++``), its build and the C++ runtime library it links against, e.g.
``"gcc 12.2.0 (build 5d1c33a0); libstdc++ 6.0.30"`` (format: ``FAMILY VERSION
(build DIGEST); libstdc++ LIBVERSION``, ``"none"`` where no compiler is
installed; see :func:`cxx_toolchain`). They count because a package's
``wrapper.so`` is native code that another toolchain can make crash on load
(seen on a CUDA image with ``CXX=/opt/gcc/bin/g++``: SIGSEGV in
``std::regex``; warmup also loads every new artifact once in a fresh
process before publishing it, see :mod:`warmup.builder.loadcheck`). The name ``cxx`` is
stable (a build-only component, below).

Build-only components (:data:`BUILD_ONLY`): ``cxx``, the C++ compiler that
AOTInductor ran. It shapes the artifact's bytes, so it is in the key and a
builder with another compiler compiles afresh; but loading an artifact needs
no compiler, and a runtime image usually has none (:func:`cxx_compiler_id`
returns ``"none"`` there), so a loader cannot always reproduce it. Engine
start runs no compiler (nor any other program): it computes its keys with the
``cxx`` value warmup recorded in the local cache
(:mod:`kernel_cache.store.imports_memo`; :func:`environment` with ``cxx``),
else the one the tiers' records name for the plan's first variant
(:func:`kernel_cache.runtime.load.load_plan`), else :data:`CXX_NOT_PROBED`.
It looks that key up exactly first and, on a
miss, accepts a stored entry whose every *other* component equals its own (the
runtime digest, :attr:`CacheKey.runtime_digest`), taking the build-only values
the entry records and logging them. Whether an artifact runs here is decided
by runtime components and by the entry's recorded ``cpu_features``, read from
``/proc/cpuinfo`` (:func:`kernel_cache.runtime.load.check_cpu_features`).
Every other component is computed at runtime and must match:
``compile_options`` included, since the options are fixed by the installed
code (:func:`kernel_cache.config.recipe.compile_options`), so a
runtime computes them exactly and a release that changes an option misses.

What accepting ``cxx`` does not cover: an artifact built against another C++
runtime library than the loading process has may fail to load, either as an
error of the AOTInductor loader (reported by
:func:`kernel_cache.runtime.package.load_package` as a corrupt entry) or, as reported
for a CUDA image whose ``CXX`` did not match its libstdc++, as a crash inside
the package. ``warmup`` loads each new artifact once in a fresh process before
publishing it (:mod:`warmup.builder.loadcheck`), which catches such a crash on the
builder's own runtime; build and runtime stages should share one base image, as
``examples/Dockerfile`` does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kernel_cache.config.engine import EngineConfig
from kernel_cache.config.recipe import DEFAULT_CPU_TARGET, compile_options, device_arch
from kernel_cache.errors import ConfigError
from kernel_cache.kernels.slots import kernel_path
from kernel_cache.plan.buckets import KernelVariant
from kernel_cache.plan.sources import sources_component

#: Bump when the stored layout (bytes + metadata schema) or the way a key is
#: computed changes; entries of another format simply miss.
ARTIFACT_FORMAT = "kc4"

COMPONENTS = (
    "format",
    "sources",
    "variant",
    "kernel",
    "launch_config",
    "geometry",
    "dtype",
    "device",
    "device_arch",
    "torch",
    "python",
    "cxx",
    "compile_options",
)

#: Components a loader cannot reproduce (see the module docstring): matched
#: exactly by warmup, taken from the stored entry by engine start.
BUILD_ONLY = ("cxx",)

#: The components engine start computes and requires to match.
RUNTIME_COMPONENTS = tuple(c for c in COMPONENTS if c not in BUILD_ONLY)

#: Deliberately left out of every key, with the reason.
EXCLUDED = {
    "absolute paths (cache dir, bundle dir, site-packages)": "a moved or mounted cache must hit",
    "HOME, user and host names": "a prewarmed image must hit for any user on any host",
    "device index / CUDA_VISIBLE_DEVICES": "every rank must share one artifact",
    "max_model_len, max_num_seqs, max_num_batched_tokens": "they choose which variants exist, "
    "not how one variant compiles",
    "timestamps, compile seconds": "metadata, not identity",
    "environment variables not in recipe.ENV_RULES as 'counts'": "pinned by warmup or unable "
    "to change the code (the reason of each rule)",
}


def cxx_executable() -> str | None:
    """The C++ compiler AOTInductor runs: ``$CXX``, else ``g++`` (``clang++`` on
    macOS), resolved on ``PATH``; None if not found."""
    cxx = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    return shutil.which(cxx)


#: Seconds a compiler probe (``g++ --version`` and friends) may take. A slow
#: answer on a loaded machine must not turn into another key, so a probe that
#: times out is an error, not an empty answer.
PROBE_TIMEOUT_S = 120.0


def _run(args: list[str]) -> tuple[str, str]:
    """``(stdout, stderr)`` of a compiler probe; ``("", "")`` if it cannot run.

    Raises:
        ConfigError: the probe did not finish within :data:`PROBE_TIMEOUT_S`.
    """
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        return proc.stdout, proc.stderr
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"the C++ compiler probe {' '.join(args)!r} did not answer within "
            f"{PROBE_TIMEOUT_S:g} s; its answer is part of every cache key (the 'cxx' "
            "component), so it is not guessed. Retry on a less loaded machine or check $CXX"
        ) from None
    except (OSError, subprocess.SubprocessError):
        return "", ""


@functools.cache
def cxx_version_line(exe: str) -> str:
    """The first line ``exe --version`` prints (``"g++ (Debian 12.2.0-14) 12.2.0"``),
    ``""`` if it cannot run; asked once per process, as :func:`cxx_toolchain` is.

    Raises:
        ConfigError: it did not answer within :data:`PROBE_TIMEOUT_S`.
    """
    return (_run([exe, "--version"])[0].splitlines() or [""])[0]


#: Lines of ``$CXX -v`` that identify a compiler build (not its install path).
_BUILD_LINES = ("Target:", "Configured with:", "Thread model:", "gcc version", "clang version")


@functools.cache
def cxx_toolchain(exe: str | None = None) -> dict[str, str]:
    """What the C++ compiler is and which C++ runtime library it links against.

    Returns ``{"path", "compiler", "build", "libstdcxx_path", "libstdcxx"}``, e.g.
    ``{"path": "/usr/bin/g++", "compiler": "gcc 12.2.0", "build": "5d1c33a0",
    "libstdcxx_path": "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30",
    "libstdcxx": "6.0.30"}``. ``build`` is the sha256 (8 hex) of the lines of
    ``$CXX -v`` that identify the compiler's build (target, configure options,
    thread model, full version): two builds of one gcc version differ here (on
    a CUDA image (the lent H200's) ``/usr/bin/g++`` and ``/opt/gcc/bin/g++`` are both gcc 13.3.0,
    Ubuntu packages 13.3.0-6ubuntu2~24.04.1 and ~24.04: builds abc044f8 and d25c59f3).
    The library is what the compiler's linker resolves ``libstdc++.so`` to
    (``$CXX -print-file-name=libstdc++.so``, symlinks followed); its version is
    the file name's suffix, ``"unknown"`` if that cannot be read, and
    ``"static"`` when the compiler links ``libstdc++.a`` into the package (no
    shared library found, or ``-static-libstdc++`` on its link line): such a
    package crashes in a process that already has the shared libstdc++, as every
    torch process has (measured on that CUDA image: a ``std::regex`` object built
    by ``/opt/gcc/bin/g++``, a wrapper script whose objects do not need
    ``libstdc++.so.6``, ran alone and crashed after ``import torch``).
    ``compiler`` is ``"none"`` where no compiler is installed (a slim runtime image).
    """
    exe = exe or cxx_executable()
    if not exe:
        return {
            "path": "",
            "compiler": "none",
            "build": "none",
            "libstdcxx_path": "",
            "libstdcxx": "none",
        }
    first = cxx_version_line(exe)
    if not first:
        compiler = "unknown"
    else:
        family = "clang" if "clang" in first.lower() else "gcc"
        versions = re.findall(r"\d+\.\d+(?:\.\d+)?", first)
        compiler = f"{family} {versions[-1] if versions else first.strip()}"
    verbose = _run([exe, "-v"])[1].splitlines()
    ident = [line.strip() for line in verbose if line.strip().startswith(_BUILD_LINES)]
    build = hashlib.sha256("\n".join(ident).encode()).hexdigest()[:8] if ident else "unknown"
    lib_path, lib = "", "unknown"
    found = _run([exe, "-print-file-name=libstdc++.so"])[0].strip()
    if found and os.sep in found and Path(found).exists():
        lib_path = os.path.realpath(found)
        m = re.search(r"libstdc\+\+\.so\.(\d+(?:\.\d+)*)$", lib_path)
        lib = m.group(1) if m else "unknown"
    # Linked into the package instead of loaded: no shared libstdc++ to link against,
    # or the driver links the archive (-static-libstdc++, possibly from a wrapper script).
    link = _run([exe, "-###", "-shared", "-x", "c++", os.devnull, "-o", os.devnull])[1]
    static = re.search(r"-Bstatic\S*\s+\S*-lstdc\+\+|libstdc\+\+\.a|-static-libstdc\+\+", link)
    if static or not lib_path:
        archive = _run([exe, "-print-file-name=libstdc++.a"])[0].strip()
        if static or (archive and os.sep in archive and Path(archive).exists()):
            lib = "static"
            if archive and os.sep in archive and Path(archive).exists():
                lib_path = os.path.realpath(archive)
    return {
        "path": exe,
        "compiler": compiler,
        "build": build,
        "libstdcxx_path": lib_path,
        "libstdcxx": lib,
    }


@functools.cache
def cxx_compiler_id() -> str:
    """The ``cxx`` key component: ``"gcc 12.2.0 (build 5d1c33a0); libstdc++ 6.0.30"``.

    Compiler family, version and build digest, then the version of the libstdc++
    it links against (:func:`cxx_toolchain`); ``"none"`` where no compiler is
    installed. No path: the same compiler installed elsewhere hits.
    """
    t = cxx_toolchain()
    if t["compiler"] == "none":
        return "none"
    return f"{t['compiler']} (build {t['build']}); libstdc++ {t['libstdcxx']}"


def _target_of(config_or_device) -> tuple[str, str]:
    if isinstance(config_or_device, str):
        return config_or_device, DEFAULT_CPU_TARGET
    return config_or_device.device, config_or_device.cpu_target


@functools.cache
def torch_version() -> str:
    """``torch.__version__`` (``"2.13.0+cpu"``, the ``torch`` key component), read
    without importing torch where this process has not imported it.

    torch defines ``__version__`` from ``torch/version.py``, a file of constants;
    that file is run on its own here (about 1 ms against seconds for ``import
    torch``), so commands that need keys but no tensors (``plan``, ``explain``,
    ``gc --keep-plan``) stay torch-free. The installed distribution's metadata
    (``importlib.metadata.version("torch")``) is not used: a source build or a
    stale ``dist-info`` can name another string, and the key would change.
    Falls back to ``import torch`` if the file is missing.
    """
    import importlib.util

    if "torch" not in sys.modules:
        spec = importlib.util.find_spec("torch")
        for d in (spec and spec.submodule_search_locations) or ():
            path = Path(d) / "version.py"
            if path.is_file():
                file_spec = importlib.util.spec_from_file_location("_kernel_cache_torch_v", path)
                module = importlib.util.module_from_spec(file_spec)
                file_spec.loader.exec_module(module)
                return str(module.__version__)
    import torch

    return str(torch.__version__)


#: The ``cxx`` value of an engine start that has no record of its builders'
#: compiler (:func:`kernel_cache.runtime.load.load_plan`): no compiler is run
#: for it, and no artifact is built under it, so every lookup takes the
#: compatible entry and logs the ``cxx`` it accepted.
CXX_NOT_PROBED = "not probed"


def environment(config_or_device, *, cxx: str | None = None) -> dict[str, str]:
    """The environment components of a key, as strings, for an
    :class:`EngineConfig` (its device and CPU target) or a device name (the
    default CPU target).

    ``cxx``: the build-only ``cxx`` value to use; None probes the C++ compiler
    (:func:`cxx_compiler_id`, four compiler runs on a process's first call).
    Engine start passes a value, so it runs no program (module docstring).
    """
    device, target = _target_of(config_or_device)
    return {
        "device": device,
        "device_arch": device_arch(device, target),
        "torch": torch_version(),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "cxx": cxx_compiler_id() if cxx is None else cxx,
    }


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _combine(components) -> str:
    h = hashlib.sha256()
    for name, value in components:
        h.update(f"{name}={_digest(value)}\n".encode())
    return h.hexdigest()


def runtime_digest(components: dict[str, str]) -> str:
    """sha256 (hex) over the :data:`RUNTIME_COMPONENTS` of a recorded
    ``components`` mapping (a missing component hashes as an empty string)."""
    return _combine((n, components.get(n, "")) for n in RUNTIME_COMPONENTS)


def key_from_components(components: dict[str, str]) -> CacheKey:
    """The :class:`CacheKey` of a recorded ``components`` mapping (metadata,
    a bundle manifest), in :data:`COMPONENTS` order.

    Raises:
        ValueError: a component is missing or unknown (names them).
    """
    missing = [n for n in COMPONENTS if n not in components]
    unknown = sorted(set(components) - set(COMPONENTS))
    if missing or unknown:
        raise ValueError(f"key components: missing {missing}, unknown {unknown}")
    return CacheKey(tuple((n, str(components[n])) for n in COMPONENTS))


@dataclass(frozen=True)
class CacheKey:
    """An ordered tuple of ``(name, value)`` components and their sha256."""

    components: tuple[tuple[str, str], ...]

    @functools.cached_property
    def hexdigest(self) -> str:
        return _combine(self.components)

    @functools.cached_property
    def runtime_digest(self) -> str:
        """sha256 over the components a loader can compute (all but :data:`BUILD_ONLY`)."""
        return runtime_digest(dict(self.components))

    def __str__(self) -> str:
        return self.hexdigest

    def as_dict(self) -> dict[str, str]:
        return dict(self.components)

    def component_digests(self) -> dict[str, str]:
        """Each component's own sha256 (hex, 16 chars), for logs and explain."""
        return {n: _digest(v)[:16] for n, v in self.components}


def recipe_options(config: EngineConfig) -> dict:
    """The Inductor options ``config``'s variants compile with
    (:func:`kernel_cache.config.recipe.compile_options`)."""
    return compile_options(config.device, config.cpu_target)


def dtype_component(config: EngineConfig) -> str:
    """The ``dtype`` component: the model dtype (``"bfloat16"``), followed by the
    KV pool's where it is not the model's (``"bfloat16 kv_cache_dtype=fp8_e4m3"``).
    ``kv_cache_dtype`` ``auto`` leaves the component, and so the key, as it was
    before the option existed."""
    if config.kv_cache_dtype == "auto":
        return config.dtype
    return f"{config.dtype} kv_cache_dtype={config.kv_cache_dtype}"


def slot_dtype_component(spec) -> str:
    """The ``dtype`` component of a declared slot's variant: its inputs' dtypes in
    order (``"x=float32"``); the plan's model dtype does not shape its code."""
    return " ".join(f"{i.name}={i.dtype}" for i in spec.inputs)


def build_key(
    config: EngineConfig,
    variant: KernelVariant,
    env: dict[str, str] | None = None,
    compile_options: dict | None = None,
    overrides: dict[str, str] | None = None,
    launch: dict | None = None,
) -> CacheKey:
    """The cache key of one variant under ``config`` in this environment.

    ``overrides`` replaces named components (tests simulate a torch upgrade
    with ``{"torch": "2.14.1"}``). ``launch`` is the variant's resolved launch
    config (:func:`kernel_cache.plan.launch.resolve_plan`); when None it is resolved
    here (``KERNEL_CACHE_TUNING`` > bundled table > defaults).
    """
    env = environment(config) if env is None else env
    if launch is None:
        from kernel_cache.plan.launch import launch_for

        launch = launch_for(config, variant, env["device_arch"])
    opts = recipe_options(config) if compile_options is None else compile_options
    kernel = kernel_path(config, variant.kernel)
    spec = config.slot(variant.kernel)
    if spec is not None:  # a declared slot: its input spec in place of attention's geometry
        geometry, dtype = spec.key_json(), slot_dtype_component(spec)
    else:
        geometry, dtype = json.dumps(config.geometry(), sort_keys=True), dtype_component(config)
    values = {
        "format": ARTIFACT_FORMAT,
        "sources": sources_component(kernel=kernel, slot=variant.kernel),
        "variant": str(variant),
        "kernel": kernel,
        "launch_config": json.dumps(launch, sort_keys=True, separators=(",", ":")),
        "geometry": geometry,
        "dtype": dtype,
        **env,
        "compile_options": json.dumps(opts, sort_keys=True),
    }
    if overrides:
        unknown = set(overrides) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown key components {sorted(unknown)}; known: {COMPONENTS}")
        values.update(overrides)
    return CacheKey(tuple((name, values[name]) for name in COMPONENTS))


def source_changes(here: str, stored: str) -> str | None:
    """For the ``sources`` component (JSON ``{path: digest}``), which files differ:
    ``"warmup/builder/compiler.py changed; kernel_cache/helper.py new"``; None if either
    side is not such a mapping or none differs. ``stored`` may come from an
    unchecked record of a shared tier: anything unreadable (nested too deep for
    the parser too) is None."""
    try:
        a, b = json.loads(here), json.loads(stored)
    except (TypeError, ValueError, RecursionError):
        return None
    if not isinstance(a, dict) or not isinstance(b, dict):
        return None
    parts = [f"{f} changed" for f in sorted(set(a) & set(b)) if a[f] != b[f]]
    parts += [f"{f} new" for f in sorted(set(a) - set(b))]
    parts += [f"{f} gone" for f in sorted(set(b) - set(a))]
    return "; ".join(parts) or None


def diff_components(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Human-readable differences, e.g. ``["torch: 2.13.0 != 2.14.1"]``."""
    out = []
    for name in COMPONENTS:
        va, vb = a.get(name), b.get(name)
        if va != vb:
            out.append(f"{name}: {va} != {vb}")
    return out
