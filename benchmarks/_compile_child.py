"""Compile variants in one fresh process and split each compile into phases,
for ``benchmarks/warmup_throughput.py``.

    python benchmarks/_compile_child.py SPEC_JSON

SPEC: ``config`` (EngineConfig JSON), ``variants`` (variant strings),
``compile_options`` (Inductor options, as in ``kernel_cache.config.recipe.compile_options``),
``kernel_calls`` (timed calls of each compiled kernel, 0 to skip).

Phases of one compile (seconds), measured by wrapping Inductor's own functions:

* ``export``: ``torch.export`` (``warmup.builder.compiler.compile_variant``'s export_s);
* ``cxx``: time inside ``torch._inductor.cpp_builder.CppBuilder.build``: every
  C++ compiler and linker run, precompiled headers included;
* ``packaging``: time inside ``torch._inductor.package.package_aoti`` (the .pt2 zip);
* ``codegen``: the rest of AOTInductor (AOT autograd, lowering, scheduling,
  generating the C++ source), i.e. compile_s - cxx - packaging.

CPU seconds (``cpu_s``: this process and the compiler processes it ran;
``cxx_cpu_s``: the compiler processes) are also recorded: on a shared machine
they move much less with other people's load than wall seconds do.

The kernel of each compiled package is loaded (AOTInductor runtime loader) and
timed on its bucket inputs: median microseconds per call (CPU: one intra-op
thread, the thread's CPU time). Prints one JSON line.
"""

import time

_T0 = time.perf_counter()
import torch  # noqa: E402

IMPORT_TORCH_S = time.perf_counter() - _T0

import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

from _common import cpu_all, cpu_children  # noqa: E402


def main() -> None:
    spec = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    import torch._inductor.cpp_builder as cpp_builder
    import torch._inductor.package as package

    from kernel_cache.config.engine import EngineConfig
    from kernel_cache.plan.buckets import KernelVariant
    from kernel_cache.runtime.inputs import make_inputs
    from kernel_cache.runtime.package import load_package
    from warmup.builder.compiler import compile_with_options, pin_environment

    import_s = time.perf_counter() - t0
    spent = {"cxx": 0.0, "packaging": 0.0, "cxx_runs": 0, "cxx_cpu": 0.0}

    def timed(fn, name):
        def wrapper(*a, **k):
            t, c = time.perf_counter(), cpu_children()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
                if name == "cxx":
                    spent["cxx_runs"] += 1
                    spent["cxx_cpu"] += cpu_children() - c

        return wrapper

    cpp_builder.CppBuilder.build = timed(cpp_builder.CppBuilder.build, "cxx")
    # aoti_compile_and_package imports package_aoti from torch._inductor.package
    # at call time, so the wrapper placed there is the one it calls.
    package.package_aoti = timed(package.package_aoti, "packaging")

    cfg = EngineConfig.model_validate_json(spec["config"])
    # The recipe's environment (as a warmup worker has it), keeping this phase's
    # Inductor directory; the options under comparison come from the spec.
    pin_environment(cfg.device, cfg.cpu_target, os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    opts = spec["compile_options"]
    # The precompiled headers kept for the process's later compiles, as a warmup
    # worker keeps them (each compile's own folder is removed after it).
    pch = os.path.join(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "/tmp", "kernel-cache-pch")
    rows = []
    for s in spec["variants"]:
        v = KernelVariant.parse(s)
        before = dict(spent)
        t, c = time.perf_counter(), cpu_all()
        data, tm = compile_with_options(cfg, v, opts, pch_dir=pch)
        total = time.perf_counter() - t
        cpu = cpu_all() - c
        cxx = spent["cxx"] - before["cxx"]
        pkg = spent["packaging"] - before["packaging"]
        row = {
            "variant": s,
            "total_s": total,
            "export_s": tm["export_s"],
            "codegen_s": tm["compile_s"] - cxx - pkg,
            "cxx_s": cxx,
            "packaging_s": pkg,
            "cxx_runs": spent["cxx_runs"] - before["cxx_runs"],
            "cpu_s": cpu,
            "cxx_cpu_s": spent["cxx_cpu"] - before["cxx_cpu"],
            "package_bytes": len(data),
        }
        if spec.get("kernel_calls"):
            runner = load_package(data, cfg.device)
            args = list(make_inputs(cfg, v, seed=0))
            threads = torch.get_num_threads()
            if cfg.device == "cpu":  # one thread, its CPU time: steady on a shared machine
                torch.set_num_threads(1)
            clock = time.thread_time if cfg.device == "cpu" else time.perf_counter
            for _ in range(3):
                runner.run(args)
            times = []
            for _ in range(spec["kernel_calls"]):
                if cfg.device == "cuda":
                    torch.cuda.synchronize()
                t = clock()
                runner.run(args)
                if cfg.device == "cuda":
                    torch.cuda.synchronize()
                times.append(clock() - t)
            torch.set_num_threads(threads)
            row["kernel_us"] = statistics.median(times) * 1e6
        rows.append(row)
    print(
        json.dumps(
            {"import_torch_s": IMPORT_TORCH_S, "import_compile_stack_s": import_s, "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
