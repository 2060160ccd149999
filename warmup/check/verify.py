"""``kernel-cache verify``: load every variant of a plan and check it against eager.

Run it in a fresh process (the CLI is one): it proves that engine start finds
and loads the whole plan with zero compiles. ``compiled`` counts the runtime's
compiles (it has no compile path, so 0) plus 1 if the process imported Dynamo
or Inductor's compiler while verifying.
"""

from __future__ import annotations

import sys
import time

import torch

from kernel_cache.config.engine import EngineConfig, config_to_cli
from kernel_cache.errors import CorruptEntryError, CpuTargetError
from kernel_cache.kernels.builtin import build_module
from kernel_cache.kernels.slots import SLOTS, kernel_path
from kernel_cache.plan.buckets import PAGED_ATTENTION, Bucketer
from kernel_cache.plan.keys import build_key, environment
from kernel_cache.plan.launch import describe_plan, launch_json, resolve_plan
from kernel_cache.runtime.inputs import make_inputs
from kernel_cache.runtime.load import check_cpu_features, default_tiers, load_package
from kernel_cache.store.lookup import Lookup, merge_accepted
from kernel_cache.store.tier import Tier

COMPILE_STACK = ("torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.codegen")

#: Max abs difference accepted between a compiled kernel and eager on the same
#: padded inputs (fp32 measured here within 2e-7; bf16/fp16 round differently).
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 3e-3}


def compile_stack_loaded() -> list[str]:
    """The compile-stack modules this process has imported (should be none)."""
    return [m for m in COMPILE_STACK if m in sys.modules]


def verify_plan(
    config: EngineConfig,
    cache_dir=None,
    *,
    tiers: list[Tier] | None = None,
    bundles=None,
    allow_shared_dir: bool | None = None,
) -> dict:
    """Load and check every variant, looked up as engine start does (bundles
    from ``bundles`` and ``$KERNEL_CACHE_BUNDLE`` first, then the local cache,
    read-only: a read-only directory works). Returns the JSON-ready report:

    ``ok`` (bool), ``variants``, ``loaded``, ``compiled``, ``missing`` and
    ``corrupt`` (lists of variant strings; corrupt entries carry the reason),
    ``unrunnable`` (artifacts needing an instruction this CPU lacks, with the reason),
    ``mismatched`` (variants whose output differs from eager, built with the
    same launch config), ``max_abs_err``, ``launch`` (the variants a launch
    table sets: ``{variant: {"config", "source"}}``),
    ``sources`` (``{tier location: variants loaded from it}``), ``source_kinds``
    (``{tier location: "bundle" | "disk" | "redis"}``),
    ``build_only_accepted`` (``{component: {"here", "stored": [...]}}``),
    ``kernels`` (``{slot: import path of the kernel the plan holds}``), ``seconds``.
    Every variant, the engine's own kernels' included, is compared with the
    built-in slot's eager kernel (the plain PyTorch formulation).

    Raises:
        UntrustedCacheError: see :mod:`kernel_cache.trust.permissions`
            (``allow_shared_dir`` opts out).
    """
    t0 = time.perf_counter()
    before = set(compile_stack_loaded())
    bucketer = Bucketer(config)
    tiers = (
        default_tiers(cache_dir, bundles, allow_shared_dir=allow_shared_dir)
        if tiers is None
        else tiers
    )
    env = environment(config)
    lookup = Lookup(tiers)
    launch = resolve_plan(config, bucketer.variants, env["device_arch"])
    modules = {}
    report = {
        "variants": len(bucketer.variants),
        "loaded": 0,
        "missing": [],
        "corrupt": [],
        "unrunnable": [],
        "mismatched": [],
        "max_abs_err": 0.0,
        "sources": {},
        "source_kinds": {},
        "build_only_accepted": {},
        "launch": describe_plan(launch),
        "kernels": {slot: kernel_path(config, slot) for slot in SLOTS},
    }
    tol = TOLERANCE[config.dtype]
    for v in bucketer.variants:
        cfg = launch[v].config
        key = build_key(config, v, env, launch=cfg)
        try:
            found = lookup.find(key)
            if found is None and lookup.rejected:  # Redis held a bad or unsigned entry
                raise lookup.rejected[-1]
            if found is None:
                report["missing"].append(str(v))
                continue
            entry = found.entry
            check_cpu_features(config, v, entry)
            runner = load_package(entry.data, config.device, entry.where, entry.key)
        except CorruptEntryError as e:
            report["corrupt"].append(
                {"variant": str(v), "key": e.key, "reason": e.reason, "where": e.where}
            )
            continue
        except CpuTargetError as e:
            report["unrunnable"].append({"variant": str(v), "reason": str(e)})
            continue
        report["loaded"] += 1
        src = found.tier.location
        report["sources"][src] = report["sources"].get(src, 0) + 1
        report["source_kinds"][src] = found.tier.name
        merge_accepted(report["build_only_accepted"], found.accepted)
        args = make_inputs(config, v, seed=1)
        out = runner.run(list(args))[0]
        mk = (v.kernel, launch_json(cfg))
        if mk not in modules:
            c = config
            # The CUDA prefill's tiles are the Triton kernel's; the oracle takes none.
            kw = {} if v.kernel == PAGED_ATTENTION else cfg
            modules[mk] = build_module(v.kernel, c.num_heads, c.num_kv_heads, c.head_dim, **kw)
        mod = modules[mk]
        with torch.no_grad():
            ref = mod(*args)
        if v.kernel == PAGED_ATTENTION:  # rows past the real chunk are padding: not compared
            real = int(args[5][0])
            out, ref = out[:real], ref[:real]
        err = float((out.float() - ref.float()).abs().max())
        report["max_abs_err"] = max(report["max_abs_err"], err)
        if not err <= tol:
            report["mismatched"].append(
                {"variant": str(v), "max_abs_err": err, "kernel": kernel_path(config, v.kernel)}
            )
    newly = sorted(set(compile_stack_loaded()) - before)
    report["compiled"] = len(newly)
    report["compile_stack_imported"] = newly
    report["ok"] = (
        report["loaded"] == report["variants"]
        and not report["mismatched"]
        and report["compiled"] == 0
    )
    report["seconds"] = round(time.perf_counter() - t0, 3)
    if not report["ok"]:
        report["repair"] = f"kernel-cache warmup {config_to_cli(config, cache_dir)}"
    return report
