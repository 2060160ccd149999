"""Compile the CPU decode kernel of another revision, for ``benchmarks/pool_size.py
--baseline-rev``.

    python benchmarks/_baseline_child.py SPEC_JSON

SPEC: ``config`` (EngineConfig JSON), ``variant`` (a ``batched_decode`` variant
string), ``source`` (a file holding that revision's
``kernel_cache/kernels/builtin.py``), ``out`` (the ``.pt2`` to write).

The recipe is the shipped one: this fresh process pins the compile environment
first (``warmup.builder.compiler.pin_environment``), then
``compile_with_options`` exports (``export_variant``: bucket static,
``num_pool_blocks`` dynamic) and compiles with the recipe's options
(``kernel_cache.config.recipe.compile_options``); only the module is swapped,
for that revision's ``RealKVBatchedDecode``. What that file imports (the plain
kernels of ``kernel_cache/kernels/plain.py`` it extends) is this checkout's.
Prints one JSON line.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path


def main() -> None:
    spec = json.loads(sys.argv[1])
    from kernel_cache.config.engine import EngineConfig
    from kernel_cache.config.recipe import compile_options
    from kernel_cache.plan.buckets import KernelVariant
    from warmup.builder import compiler

    cfg = EngineConfig.model_validate(spec["config"])
    variant = KernelVariant.parse(spec["variant"])
    compiler.pin_environment(cfg.device, cfg.cpu_target, os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    mspec = importlib.util.spec_from_file_location("kc_baseline_builtin", spec["source"])
    old = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(old)

    def module_for(config, v, launch=None):
        return old.RealKVBatchedDecode(config.num_heads, config.num_kv_heads, config.head_dim)

    compiler.module_for = module_for  # export_variant builds the module through it
    data, times = compiler.compile_with_options(
        cfg, variant, compile_options(cfg.device, cfg.cpu_target), launch={}
    )
    Path(spec["out"]).write_bytes(data)
    print(json.dumps({"bytes": len(data), **times}))


if __name__ == "__main__":
    main()
