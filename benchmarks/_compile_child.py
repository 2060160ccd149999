"""Compile variants in one fresh process and split each compile into phases,
for ``benchmarks/warmup_throughput.py``.

    python benchmarks/_compile_child.py SPEC_JSON

SPEC: ``config`` (EngineConfig JSON), ``variants`` (variant strings),
``compile_options`` (Inductor options, as in ``kernel_cache.keys.COMPILE_OPTIONS``),
``kernel_calls`` (timed calls of each compiled kernel, 0 to skip).

Phases of one compile (seconds), measured by wrapping Inductor's own functions:

* ``export``: ``torch.export`` (``warmup.compiler.compile_variant``'s export_s);
* ``cxx``: time inside ``torch._inductor.cpp_builder.CppBuilder.build``: every
  C++ compiler and linker run, precompiled headers included;
* ``packaging``: time inside ``torch._inductor.package.package_aoti`` (the .pt2 zip);
* ``codegen``: the rest of AOTInductor (AOT autograd, lowering, scheduling,
  generating the C++ source), i.e. compile_s - cxx - packaging.

The kernel of each compiled package is loaded (AOTInductor runtime loader) and
timed on its bucket inputs: median microseconds per call. Prints one JSON line.
"""

import time

_T0 = time.perf_counter()
import torch  # noqa: E402

IMPORT_TORCH_S = time.perf_counter() - _T0

import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402


def main() -> None:
    spec = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    import torch._inductor.cpp_builder as cpp_builder
    import torch._inductor.package as package

    from kernel_cache.buckets import KernelVariant
    from kernel_cache.config import EngineConfig
    from kernel_cache.inputs import make_inputs
    from kernel_cache.runtime import load_package
    from warmup.compiler import compile_variant

    import_s = time.perf_counter() - t0
    spent = {"cxx": 0.0, "packaging": 0.0, "cxx_runs": 0}

    def timed(fn, name):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
                if name == "cxx":
                    spent["cxx_runs"] += 1

        return wrapper

    cpp_builder.CppBuilder.build = timed(cpp_builder.CppBuilder.build, "cxx")
    # aoti_compile_and_package imports package_aoti from torch._inductor.package
    # at call time, so the wrapper placed there is the one it calls.
    package.package_aoti = timed(package.package_aoti, "packaging")

    cfg = EngineConfig.model_validate_json(spec["config"])
    opts = spec["compile_options"]
    rows = []
    for s in spec["variants"]:
        v = KernelVariant.parse(s)
        before = dict(spent)
        t = time.perf_counter()
        data, tm = compile_variant(cfg, v, opts)
        total = time.perf_counter() - t
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
            "package_bytes": len(data),
        }
        if spec.get("kernel_calls"):
            runner = load_package(data, cfg.device)
            args = list(make_inputs(cfg, v, seed=0))
            for _ in range(3):
                runner.run(args)
            times = []
            for _ in range(spec["kernel_calls"]):
                if cfg.device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                runner.run(args)
                if cfg.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            row["kernel_us"] = statistics.median(times) * 1e6
        rows.append(row)
    print(
        json.dumps(
            {"import_torch_s": IMPORT_TORCH_S, "import_compile_stack_s": import_s, "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
