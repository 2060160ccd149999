"""One engine start, in a fresh process, for ``benchmarks/restart.py``.

    python benchmarks/_restart_child.py SPEC_JSON

SPEC: ``path`` ("kernel_cache" or "torch_compile"), ``config`` (EngineConfig
JSON), ``variants`` (list of variant strings), ``cache_dir`` (kernel_cache),
``load_artifacts`` / ``save_artifacts`` (torch.compile: a file of
``torch.compiler.save_cache_artifacts()`` bytes to load before compiling, or to
write after), ``seed``.

Clock: ``import_torch_s`` is ``import torch`` alone (the first statement).
``ready_s`` is everything after it, except building the random inputs: importing
kernel_cache (both paths need its kernels), then until every variant has run
once (device synchronized). ``second_calls_s`` then times one more call of
every variant (warm), the part of ready that is the kernels' own work:
kernel_cache loads the plan (``load_plan``) and dispatches each variant once;
torch.compile imports its compile stack, loads the artifacts if given, and
compiles (``torch.compile(module, dynamic=False)``, one per bucket) and calls
each variant once. Prints one JSON line.
"""

import time

_T0 = time.perf_counter()
import torch  # noqa: E402

IMPORT_TORCH_S = time.perf_counter() - _T0

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

_T1 = time.perf_counter()
from kernel_cache.config.engine import EngineConfig  # noqa: E402
from kernel_cache.plan.buckets import PAGED_ATTENTION, KernelVariant  # noqa: E402

#: Importing the project (its runtime and kernels) counts towards ready: both
#: paths need it (torch.compile compiles its kernels).
IMPORT_KERNEL_CACHE_S = time.perf_counter() - _T1

COMPILE_STACK = ("torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.codegen")


def build_inputs(cfg: EngineConfig, variants, seed: int):
    """Per variant: the bucket-padded kernel inputs and the dispatch arguments
    whose real lengths map to exactly that variant (KV length = the bucket's
    blocks, query length = the largest real length of the query bucket that
    fits). One KV pool for all, as in an engine."""
    g = torch.Generator().manual_seed(seed)
    dev, dt = torch.device(cfg.device), cfg.torch_dtype()
    h, kvh, d, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    pool = max(v.num_blocks * v.num_seqs for v in variants) + 3
    kc = torch.randn(pool, bs, kvh, d, generator=g).to(dev, dt)
    vc = torch.randn(pool, bs, kvh, d, generator=g).to(dev, dt)
    out = []
    for v in variants:
        nb, seq_len = v.num_blocks, v.num_blocks * bs
        if v.kernel == PAGED_ATTENTION:
            q_real = min(v.query_len, seq_len)
            bt = torch.randint(0, pool, (nb,), generator=g, dtype=torch.int32).to(dev)
            q = torch.randn(v.query_len, h, d, generator=g).to(dev, dt)
            lens = torch.tensor([seq_len, q_real], dtype=torch.int32, device=dev)
            padded = (q, kc, vc, bt, lens[0:1], lens[1:2])
            dispatch = ("prefill", (q[:q_real], kc, vc, bt, seq_len))
        else:
            s = v.num_seqs
            bt = torch.randint(0, pool, (s, nb), generator=g, dtype=torch.int32).to(dev)
            q = torch.randn(s, h, d, generator=g).to(dev, dt)
            lens = [seq_len] + [
                int(x) for x in torch.randint(1, seq_len + 1, (s - 1,), generator=g)
            ]
            padded = (q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device=dev))
            dispatch = ("decode", (q, kc, vc, bt, lens))
        out.append((v, padded, dispatch))
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_kernel_cache(spec, cfg, inputs) -> dict:
    from kernel_cache import load_plan

    t0 = time.perf_counter()
    rt = load_plan(cfg, spec["cache_dir"], strict=False)
    t_load = time.perf_counter() - t0
    with torch.no_grad():
        for _v, _padded, (method, args) in inputs:
            getattr(rt, method)(*args)
    sync(cfg.device)
    ready = time.perf_counter() - t0
    t1 = time.perf_counter()
    with torch.no_grad():
        for _v, _padded, (method, args) in inputs:
            getattr(rt, method)(*args)
    sync(cfg.device)
    second = time.perf_counter() - t1
    stats = rt.stats()
    called = sorted(stats["calls"])
    expected = sorted(str(v) for v, _, _ in inputs)
    if called != expected or stats["loads"] != len(inputs) or set(stats["calls"].values()) != {2}:
        raise SystemExit(
            f"kernel_cache path loaded {stats['loads']} variants and called {called}; "
            f"expected exactly {expected} (is the subset cache complete?)"
        )
    return {
        "ready_s": ready,
        "second_calls_s": second,
        "load_s": t_load,
        "first_calls_s": ready - t_load,
        "loaded": stats["loads"],
        "compiles": stats["compiles"],
    }


def run_torch_compile(spec, cfg, inputs) -> dict:
    from kernel_cache.kernels.builtin import build_module

    t0 = time.perf_counter()
    import torch._dynamo

    # One compiled module per bucket: each bucket is a recompile of the same
    # forward code, so lift Dynamo's per-code limit (8) above the plan size.
    torch._dynamo.config.recompile_limit = max(64, 2 * len(inputs))
    torch._dynamo.config.accumulated_recompile_limit = max(256, 4 * len(inputs))
    # Record what the C++ compiler builds at start (names only; a pass-through).
    import torch._inductor.cpp_builder as cpp_builder

    builds = []
    build = cpp_builder.CppBuilder.build

    def recording_build(self, *a, **k):
        builds.append(Path(self.get_target_file_path()).name)
        return build(self, *a, **k)

    cpp_builder.CppBuilder.build = recording_build
    t_import = time.perf_counter() - t0
    if spec.get("load_artifacts"):
        torch.compiler.load_cache_artifacts(Path(spec["load_artifacts"]).read_bytes())
    t_loaded = time.perf_counter() - t0
    compiled = []
    with torch.no_grad():
        for v, padded, _ in inputs:
            mod = build_module(v.kernel, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            compiled.append(torch.compile(mod, dynamic=False))
            compiled[-1](*padded)
    sync(cfg.device)
    ready = time.perf_counter() - t0

    from torch._dynamo.utils import counters

    doc = {
        "ready_s": ready,
        "import_compile_stack_s": t_import,
        "load_artifacts_s": t_loaded - t_import,
        "first_calls_s": ready - t_loaded,
        "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
        "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "autograd_cache_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "autograd_cache_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
        "cxx_compiler_runs": len(builds),
        "cxx_builds": builds,
    }
    t1 = time.perf_counter()
    with torch.no_grad():
        for fn, (_v, padded, _) in zip(compiled, inputs, strict=True):
            fn(*padded)
    sync(cfg.device)
    doc["second_calls_s"] = time.perf_counter() - t1
    doc["dynamo_graphs_after_second_calls"] = int(counters["stats"]["unique_graphs"])
    if spec.get("save_artifacts"):
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise SystemExit("torch.compiler.save_cache_artifacts() returned None")
        Path(spec["save_artifacts"]).write_bytes(saved[0])
        doc["saved_artifacts_bytes"] = len(saved[0])
    return doc


def main() -> None:
    spec = json.loads(sys.argv[1])
    cfg = EngineConfig.model_validate_json(spec["config"])
    variants = [KernelVariant.parse(s) for s in spec["variants"]]
    inputs = build_inputs(cfg, variants, spec.get("seed", 0))
    if spec["path"] == "kernel_cache":
        doc = run_kernel_cache(spec, cfg, inputs)
    else:
        doc = run_torch_compile(spec, cfg, inputs)
    doc["ready_s"] += IMPORT_KERNEL_CACHE_S
    doc["import_kernel_cache_s"] = IMPORT_KERNEL_CACHE_S
    doc["import_torch_s"] = IMPORT_TORCH_S
    doc["ready_incl_import_s"] = IMPORT_TORCH_S + doc["ready_s"]
    doc["compile_stack_imported"] = [m for m in COMPILE_STACK if m in sys.modules]
    doc["variants"] = len(variants)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
