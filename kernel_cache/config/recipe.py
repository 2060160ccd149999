"""The compile recipe's declared settings: Inductor options, the pinned
environment and the CPU target.

Warmup compiles every variant under exactly these settings, whatever the
caller's environment, so the generated code depends only on what the cache key
records (:mod:`kernel_cache.plan.keys`):

- :func:`compile_options`: the Inductor options passed to
  ``aoti_compile_and_package``. They are a key component.
- :data:`ENV_RULES`: one list saying, for each environment variable that
  torch.export, Inductor, Triton or the C++ compiler read, whether it
  **counts** (it is a key component), is **pinned** (warmup removes it from
  the compile worker's environment, or sets it to the recipe's value) or is
  **ignored** (it cannot change the generated code), each with its reason.
  :func:`compile_environment` applies it; :func:`classify` answers for one
  variable.
- :data:`CPU_TARGETS`: the instruction sets a CPU artifact can be built for
  (``--cpu-target``), and a CUDA artifact's host code (the package's C++
  wrapper) too. The target is part of the key (``device_arch``), and the
  CPU features it needs are recorded in the entry, so that engine start refuses
  an artifact this CPU cannot run (:func:`missing_cpu_features`).

This module is read by engine start too (to build keys); it imports nothing of
torch's compile stack.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import os
import platform
from dataclasses import dataclass

from kernel_cache.errors import ConfigError

#: Inductor options of every variant (``aoti_compile_and_package(inductor_configs=)``).
#:
#: - ``aot_inductor.enable_line_tables: False`` drops the ``-g1`` line tables
#:   from the package's ``.so``: measured with torch 2.13, gcc 12 on the CPU
#:   (docs/benchmarks/compile.md, warmup throughput), 1.63 MB -> 0.47 MB, identical
#:   disassembly, half the CPU time to verify and load a variant.
#: - ``aot_inductor.debug_compile``, ``max_autotune``: pinned off, so that
#:   ``AOT_INDUCTOR_DEBUG_COMPILE=1`` (``-O0 -g``) or
#:   ``TORCHINDUCTOR_MAX_AUTOTUNE=1`` in a builder's environment cannot reach
#:   the code (the worker's environment is cleaned as well: :data:`ENV_RULES`).
#: - ``aot_inductor.model_name_for_generated_files``: the generated files are
#:   named after it instead of a hash of their text, which holds the build's
#:   paths (the kernel file's first line names the wrapper's path; the hash of
#:   the wrapper mixes in a compile command with the torch install's include
#:   paths), so two builders of one key name them alike (docs/reproducible.md).
#:   On CUDA it also prefixes the Triton kernels' symbol names.
#: - ``aot_inductor.precompile_headers: True`` (on the CPU; :func:`compile_options`
#:   turns it off on CUDA): the wrapper's and the CPU kernels' torch headers
#:   are parsed once per compiler, torch and flags into precompiled headers
#:   kept beside the cache (``warmup.builder.normalize``:
#:   their folder and hashed file names are mapped to fixed names in the
#:   package, so the bytes stay the same; the object code is unchanged).
#:   Measured with torch 2.13, gcc 12 on the CPU (docs/reproducible.md, cost):
#:   ``g++`` CPU per variant 4.6-4.9 s -> 4.0-4.3 s for the wrapper and 1.7-3.4 s
#:   -> 0.7-2.5 s for the kernels, for about 9 s once per folder (two headers).
BASE_OPTIONS: dict = {
    "aot_inductor.enable_line_tables": False,
    "aot_inductor.debug_compile": False,
    "max_autotune": False,
    "aot_inductor.model_name_for_generated_files": "kernel_cache",
    "aot_inductor.precompile_headers": True,
}

#: The fixed names a build's own directories are given in the artifact: the
#: compiler maps each to its name (``-ffile-prefix-map``) and the package's
#: C++ comments are rewritten with them (``warmup.builder.compiler``), so no
#: builder path (scratch, temp, home, the venv or the Python install) is in
#: the bytes and two builders of one key write identical packages. ``cxx``
#: replaces the compiler (the first word of the compile and link commands in
#: those comments) alone: the key names the compiler by identity, not path.
BUILD_PATH_NAMES: dict[str, str] = {
    "build": "/kernel-cache/build",
    "torch": "/kernel-cache/torch",
    "python_include": "/kernel-cache/python/include",
    "python_lib": "/kernel-cache/python/lib",
    "pch": "/kernel-cache/pch",
    "cxx": "/kernel-cache/cxx",
}

#: The thread count Inductor's CPU code generation assumes when it decides how
#: many loop levels to parallelize. Inductor otherwise takes the compiling
#: process's thread count (``OMP_NUM_THREADS=1`` gives code with no OpenMP
#: region at all). With ``cpp.dynamic_threads`` the code asks OpenMP for the
#: thread count at run time, so an artifact uses the engine process's threads
#: (``torch.set_num_threads``), whatever the builder had.
CPU_CODEGEN_THREADS = 16


@dataclass(frozen=True)
class CpuTarget:
    """An instruction-set target for CPU artifacts.

    Attributes:
        name: ``--cpu-target`` value, e.g. ``"x86-64-v3"``.
        march: the ``-march=`` value Inductor compiles with (``cpp.march``).
        capability: the vector ISA Inductor generates code for (its
            ``ATEN_CPU_CAPABILITY`` value: ``avx2``, or ``default`` for scalar
            code); None: the best this CPU has.
        features: the ``/proc/cpuinfo`` flags the code may use (for
            ``native``: this CPU's, see :func:`cpu_features`).
    """

    name: str
    march: str
    capability: str | None
    features: tuple[str, ...]


# The x86-64 micro-architecture levels (the x86-64 psABI), as /proc/cpuinfo flags.
_V2 = ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3")
_V3 = (*_V2, "abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave")
_V4 = (*_V3, "avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl")

#: Instruction-set flags a compiler may use under ``-march=native`` (the
#: ``/proc/cpuinfo`` names). A ``native`` artifact records those its builder had.
ISA_FLAGS = (
    *_V4,
    "adx",
    "aes",
    "amx_bf16",
    "amx_fp16",
    "amx_int8",
    "amx_tile",
    "avx512_bf16",
    "avx512_bitalg",
    "avx512_fp16",
    "avx512_vbmi2",
    "avx512_vnni",
    "avx512_vp2intersect",
    "avx512_vpopcntdq",
    "avx512ifma",
    "avx512vbmi",
    "avx_vnni",
    "clflushopt",
    "clwb",
    "gfni",
    "pclmulqdq",
    "rdrand",
    "rdseed",
    "sha_ni",
    "sse4a",
    "vaes",
    "vpclmulqdq",
    "xsavec",
    "xsaveopt",
)

#: The portable targets; ``native`` is resolved per machine (:func:`resolve_cpu_target`).
CPU_TARGETS: dict[str, CpuTarget] = {
    "x86-64-v3": CpuTarget("x86-64-v3", "x86-64-v3", "avx2", tuple(sorted(_V3))),
}
# No x86-64-v2: Inductor's CPU flex_attention (the compiled decode kernel) needs a
# vector ISA, AVX2 at least ("torch.compile on current platform is not supported").
# No x86-64-v4: for ATEN_CPU_CAPABILITY=avx512 Inductor picks the AVX-512 VNNI or
# AMX variant when the builder's CPU has it, so one key could hold code for
# three instruction sets. AVX-512 code is had with ``native``.
NATIVE = "native"
CPU_TARGET_NAMES = (*CPU_TARGETS, NATIVE)

#: The default ``--cpu-target``. x86-64-v3 (AVX2) runs on every x86-64 server
#: CPU of the last decade; its kernel speed against ``native`` on an AVX-512
#: CPU is measured in docs/benchmarks/cpu-kernels.md ("CPU target").
DEFAULT_CPU_TARGET = "x86-64-v3"


@functools.cache
def cpu_features() -> frozenset[str]:
    """This CPU's instruction-set flags (``/proc/cpuinfo``), restricted to
    :data:`ISA_FLAGS`; empty where that file does not exist."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split()) & frozenset(ISA_FLAGS)
    except OSError:
        pass
    return frozenset()


def resolve_cpu_target(name: str) -> CpuTarget:
    """The :class:`CpuTarget` named ``name`` on this machine.

    Raises:
        ConfigError: an unknown name, an x86-64 level on another machine type,
            or a level this CPU cannot run (its artifacts could not be checked
            here): names the missing features and the targets that work.
    """
    if name == NATIVE:
        return CpuTarget(NATIVE, "native", None, tuple(sorted(cpu_features())))
    if name not in CPU_TARGETS:
        raise ConfigError(
            f"cpu_target={name!r} is not a known CPU target; accepted: "
            f"{', '.join(CPU_TARGET_NAMES)} (--cpu-target)"
        )
    if platform.machine() not in ("x86_64", "AMD64"):
        raise ConfigError(
            f"cpu_target={name!r} is an x86-64 level, but this machine is "
            f"{platform.machine()}; use --cpu-target native"
        )
    target = CPU_TARGETS[name]
    missing = sorted(set(target.features) - cpu_features()) if cpu_features() else []
    if missing:
        ok = [n for n, t in CPU_TARGETS.items() if set(t.features) <= cpu_features()]
        raise ConfigError(
            f"cpu_target={name!r} needs {', '.join(missing)}, which this CPU lacks, so its "
            f"artifacts could not run or be checked here; use one of {ok + [NATIVE]}"
        )
    return target


def required_cpu_features(cpu_target: str) -> list[str]:
    """The ``/proc/cpuinfo`` flags an artifact built for ``cpu_target`` may use in
    its host code (the CPU kernels, or a CUDA package's C++ wrapper; recorded in
    its metadata; engine start refuses it on a CPU that lacks one). Raises
    :class:`ConfigError` as :func:`resolve_cpu_target` does."""
    target = resolve_cpu_target(cpu_target)
    return sorted(cpu_features()) if target.name == NATIVE else list(target.features)


@functools.cache
def cpu_model() -> str:
    """This CPU's vendor, family, model and name from ``/proc/cpuinfo``
    (``"AuthenticAMD 25 1 AMD EPYC"``); ``platform.processor()`` elsewhere."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        return platform.processor()
    keys = ("vendor_id", "cpu family", "model", "model name")
    return " ".join(fields.get(k, "?") for k in keys)


def cpu_arch(target: CpuTarget) -> str:
    """The ``device_arch`` key component of a CPU target: ``"x86_64/x86-64-v3"``.
    ``native`` adds a digest of this CPU's model and features,
    ``"x86_64/native 1f2e3d4c"``: ``-march=native`` tunes for the model too, so
    artifacts of CPUs of other models or features never share a key."""
    arch = f"{platform.machine()}/{target.name}"
    if target.name == NATIVE:
        ident = cpu_model() + "|" + " ".join(target.features)
        arch += " " + hashlib.sha256(ident.encode()).hexdigest()[:8]
    return arch


@functools.cache
def gpu_arch() -> str:
    """The GPU part of a CUDA ``device_arch``: ``"sm_90 cuda 13.0 triton 3.6.0"``
    (compute capability of the current device, CUDA and Triton versions).

    Raises:
        ConfigError: no usable GPU (a CPU-only torch build or no visible device).
    """
    from importlib.metadata import PackageNotFoundError, version

    import torch

    if not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) is a CPU-only build"
            if torch.version.cuda is None
            else f"no CUDA device is visible (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})"
        )
        raise ConfigError(
            f"device='cuda': {why}; run on a machine with a GPU and a CUDA build of "
            "torch, or use --device cpu"
        )
    major, minor = torch.cuda.get_device_capability()
    try:
        triton = version("triton")
    except PackageNotFoundError:
        triton = "none"
    return f"sm_{major}{minor} cuda {torch.version.cuda} triton {triton}"


@functools.cache
def device_arch(device: str, cpu_target: str = DEFAULT_CPU_TARGET) -> str:
    """The ``device_arch`` key component; never the device index.

    CPU: the machine and the instruction-set target the code is built for,
    ``"x86_64/x86-64-v3"`` (:func:`kernel_cache.config.recipe.cpu_arch`; ``native``
    adds a digest of this CPU's features). CUDA: the GPU (:func:`gpu_arch`) and
    the host target of the package's C++ wrapper, which runs on the CPU and is
    compiled for ``cpu_target`` too: ``"sm_90 cuda 13.0 triton 3.6.0 host
    x86_64/x86-64-v3"`` (the first word stays the launch tables' architecture,
    :func:`kernel_cache.plan.launch.arch_family`).

    Raises:
        ConfigError: ``cuda`` without a usable GPU (a CPU-only torch build or no
            visible device), or an unknown or unusable ``cpu_target``.
        ValueError: an unknown device.
    """
    if device == "cpu":
        return cpu_arch(resolve_cpu_target(cpu_target))
    if device == "cuda":
        gpu = gpu_arch()
        return f"{gpu} host {cpu_arch(resolve_cpu_target(cpu_target))}"
    raise ValueError(f"device={device!r}; accepted values: cpu, cuda")


def missing_cpu_features(required) -> list[str]:
    """The flags of ``required`` (an entry's recorded ``cpu_features``) this CPU
    lacks; empty where ``/proc/cpuinfo`` cannot be read (nothing to compare)."""
    have = cpu_features()
    if not have:
        return []
    return sorted(set(required) - have)


def compile_options(device: str, cpu_target: str) -> dict:
    """The Inductor options a variant is compiled with (a key component).

    Where the target fixes the vector ISA (``x86-64-v3``: AVX2),
    ``cpp.vec_isa_ok``: Inductor takes the ISAs ``/proc/cpuinfo`` lists as
    buildable instead of dry-compiling a probe for each (``native`` keeps the
    probe: there it picks the best ISA the toolchain builds).

    On the CPU: :data:`BASE_OPTIONS` plus ``cpp.threads`` and
    ``cpp.dynamic_threads`` (:data:`CPU_CODEGEN_THREADS`) and ``cpp.march``
    from the target. On CUDA: :data:`BASE_OPTIONS` without precompiled
    headers, plus ``cpp.march``: the
    package's C++ wrapper runs on the host, and Inductor would otherwise compile
    it with ``-march=native`` (the builder's CPU, AVX-512 on one machine, AVX2 on
    another, under one key).

    Raises:
        ConfigError: an unknown or unusable ``cpu_target`` (see :func:`resolve_cpu_target`).
    """
    opts = dict(BASE_OPTIONS)
    target = resolve_cpu_target(cpu_target)
    if target.capability is not None:
        # The vector ISA is the target's (ATEN_CPU_CAPABILITY), not a probe's result:
        # Inductor's probe (a dry compile and a load per ISA this CPU lists, 11 g++
        # runs in each compile worker) cannot change the choice, only fail or pass.
        opts["cpp.vec_isa_ok"] = True
    if device == "cpu":
        opts.update(
            {
                "cpp.threads": CPU_CODEGEN_THREADS,
                "cpp.dynamic_threads": True,
                "cpp.march": target.march,
            }
        )
    else:
        opts["cpp.march"] = target.march
        # Unmeasured on a GPU builder: off there.
        opts["aot_inductor.precompile_headers"] = False
        # The kernels' cubins linked into the package's .so, loaded from memory:
        # otherwise the wrapper loads each by the path it had on the builder,
        # a string in wrapper.cpp's code and wrapper.so (docs/reproducible.md).
        opts["aot_inductor.embed_kernel_binary"] = True
    return opts


@dataclass(frozen=True)
class EnvRule:
    """What one environment variable (or ``*`` pattern) does to a compile."""

    pattern: str
    action: str  # "counts" | "pinned" | "ignored"
    reason: str


COUNTS, PINNED, IGNORED = "counts", "pinned", "ignored"

#: ``PYTHONHASHSEED`` of every compile worker. Python reads it at start, so warmup
#: spawns its workers with it (:func:`compile_environment` alone, applied inside a
#: running worker, is too late for that worker's own hashing).
HASH_SEED = "0"

#: What counts, what is pinned and what is ignored, first match wins. Warmup
#: applies it to each compile worker's environment (:func:`compile_environment`)
#: before torch is imported there; ``docs/keys.md`` prints it.
ENV_RULES: tuple[EnvRule, ...] = (
    EnvRule(
        "CXX",
        COUNTS,
        "the C++ compiler Inductor runs; its version, build and libstdc++ are the "
        "'cxx' key component, and warmup refuses one whose name Inductor would take "
        "for another family (it picks pragmas and flags by the name)",
    ),
    EnvRule(
        "ATEN_CPU_CAPABILITY",
        PINNED,
        "selects Inductor's vector ISA; set from --cpu-target (the 'device_arch' component)",
    ),
    EnvRule(
        "TORCHINDUCTOR_CACHE_DIR",
        PINNED,
        "Inductor's scratch and FX-graph cache; warmup points it at a private directory "
        "it removes, so no earlier build's cached code is reused",
    ),
    EnvRule(
        "TMPDIR",
        PINNED,
        "Inductor writes its temporary files there; warmup points it at its private "
        "scratch directory too",
    ),
    EnvRule(
        "TORCHINDUCTOR_*",
        PINNED,
        "Inductor reads its config from these at import; warmup sets "
        "TORCHINDUCTOR_COMPILE_THREADS (how many processes compile one variant's "
        "Triton kernels, not what they generate) to the usable CPUs over --jobs",
    ),
    EnvRule("AOT_INDUCTOR_*", PINNED, "AOTInductor options, e.g. DEBUG_COMPILE builds -O0 -g"),
    EnvRule("AOTINDUCTOR_*", PINNED, "AOTInductor options"),
    EnvRule("INDUCTOR_*", PINNED, "Inductor debug and test switches"),
    EnvRule("TORCH_COMPILE_*", PINNED, "torch.compile debug switches that reach Inductor"),
    EnvRule("TORCHDYNAMO_*", PINNED, "Dynamo settings read by export's tracer"),
    EnvRule("TORCH_INDUCTOR_*", PINNED, "Inductor install and build switches"),
    EnvRule("DUMP_AOTI_MINIFIER", PINNED, "read by Inductor's config at import (a debug dump)"),
    EnvRule("LOG_AUTOTUNE_RESULTS", PINNED, "read by Inductor's config at import"),
    EnvRule("MAST_HPC_JOB_NAME", PINNED, "read by Inductor's config at import (job identity)"),
    EnvRule("ROLE_RANK", PINNED, "read by Inductor's config at import (job identity)"),
    EnvRule(
        "TRITON_CACHE_DIR",
        IGNORED,
        "where Triton keeps compiled kernels, keyed by their own source and options",
    ),
    EnvRule("TRITON_HOME", IGNORED, "where Triton keeps its cache (a path)"),
    EnvRule(
        "TRITON_*",
        PINNED,
        "Triton code generation and ptxas switches; on CUDA warmup sets "
        "TRITON_DISABLE_LINE_INFO=1 (no builder path in a cubin)",
    ),
    EnvRule("CUTLASS_*", PINNED, "Inductor's CUTLASS template switches"),
    EnvRule("CUTEDSL_*", PINNED, "Inductor's CuTe DSL switches"),
    EnvRule("ENABLE_*TMA*", PINNED, "Inductor's TMA template switches"),
    EnvRule(
        "PYTHONHASHSEED",
        PINNED,
        "Python's string-hash seed orders sets of sympy symbols, and Inductor names one "
        "picked from such a set in a runtime assert's message; warmup starts its compile "
        f"workers with {HASH_SEED}",
    ),
    EnvRule("OMP_PREFIX", PINNED, "Inductor adds its include and library paths to the compile"),
    EnvRule(
        "OMP_NUM_THREADS",
        IGNORED,
        "Inductor would bake the builder's thread count into the code; cpp.threads and "
        "cpp.dynamic_threads are pinned compile options instead",
    ),
    EnvRule("MKL_NUM_THREADS", IGNORED, "as OMP_NUM_THREADS"),
    EnvRule("CPATH", PINNED, "gcc reads extra include directories from it"),
    EnvRule("C_INCLUDE_PATH", PINNED, "gcc include directories"),
    EnvRule("CPLUS_INCLUDE_PATH", PINNED, "g++ include directories"),
    EnvRule("LIBRARY_PATH", PINNED, "gcc link directories"),
    EnvRule(
        "LD_RUN_PATH",
        PINNED,
        "GNU ld writes it into the package's .so as its RUNPATH when the link names no "
        "-rpath, as Inductor's does not",
    ),
    EnvRule("GCC_EXEC_PREFIX", PINNED, "selects gcc's own programs"),
    EnvRule("COMPILER_PATH", PINNED, "selects gcc's own programs"),
    EnvRule("CFLAGS", PINNED, "compiler flags some builds read"),
    EnvRule("CXXFLAGS", PINNED, "compiler flags some builds read"),
    EnvRule("CPPFLAGS", PINNED, "preprocessor flags some builds read"),
    EnvRule("LDFLAGS", PINNED, "linker flags some builds read"),
    EnvRule(
        "CUDA_VISIBLE_DEVICES",
        IGNORED,
        "the device index; the architecture is the 'device_arch' component",
    ),
    EnvRule(
        "LD_LIBRARY_PATH",
        IGNORED,
        "the loader's search path; the libstdc++ linked against is in the 'cxx' component",
    ),
    EnvRule(
        "*",
        IGNORED,
        "not read by torch.export, Inductor, Triton or the C++ compiler when generating "
        "code (paths, locale, user, host); the rules above name those that are",
    ),
)


def classify(name: str) -> EnvRule:
    """The first rule of :data:`ENV_RULES` matching variable ``name``."""
    for rule in ENV_RULES:
        if fnmatch.fnmatchcase(name, rule.pattern):
            return rule
    raise AssertionError("ENV_RULES ends with '*'")  # pragma: no cover


def compile_environment(
    environ,
    device: str,
    cpu_target: str,
    scratch: str | None = None,
    compile_threads: int | None = None,
) -> dict[str, str]:
    """The environment a compile worker runs with: ``environ`` less every
    pinned variable, plus the recipe's own values (``ATEN_CPU_CAPABILITY`` from
    the CPU target; ``TORCHINDUCTOR_CACHE_DIR`` and ``TMPDIR`` set to
    ``scratch``, warmup's private directory for everything a compile writes;
    ``PYTHONHASHSEED`` :data:`HASH_SEED`, for the processes the worker starts;
    on CUDA ``TRITON_DISABLE_LINE_INFO=1``, so that no builder path is in a cubin).
    ``ATEN_CPU_CAPABILITY`` is set on CUDA too: it picks the vector ISA of the
    package's C++ wrapper (recorded as ``AOTI_CPU_ISA`` in the package).

    ``compile_threads``: ``TORCHINDUCTOR_COMPILE_THREADS``, the processes Inductor
    compiles one variant's Triton kernels on (None: Inductor's default, one per
    CPU up to 32). It does not shape the code; warmup gives each of its ``N``
    workers the usable CPUs over ``N``, so ``N`` workers do not each start a
    pool the size of the machine.

    Raises:
        ConfigError: an unknown or unusable ``cpu_target``.
    """
    env = {k: v for k, v in environ.items() if classify(k).action != PINNED}
    if compile_threads is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, int(compile_threads)))
    target = resolve_cpu_target(cpu_target)
    if target.capability is not None:
        env["ATEN_CPU_CAPABILITY"] = target.capability
    env["PYTHONHASHSEED"] = HASH_SEED
    if device == "cuda":
        # No line tables in the cubins: they name the kernels' source files, by
        # the paths they have on the builder (Inductor's generated kernels under
        # its scratch folder, the engine's Triton kernels wherever they live).
        env["TRITON_DISABLE_LINE_INFO"] = "1"
    if scratch is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = scratch
        env["TMPDIR"] = scratch
    return env


def pinned_variables(environ=None) -> list[str]:
    """The variables of ``environ`` (default ``os.environ``) warmup removes or replaces."""
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if classify(k).action == PINNED)


def rules_markdown() -> str:
    """:data:`ENV_RULES` as a Markdown table (``docs/keys.md`` holds it; a test
    checks the two agree)."""
    rows = ["| variable | action | reason |", "| --- | --- | --- |"]
    rows += [f"| `{r.pattern}` | {r.action} | {r.reason} |" for r in ENV_RULES]
    return "\n".join(rows) + "\n"
