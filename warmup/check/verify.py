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
from pydantic import BaseModel, ConfigDict, Field

from kernel_cache.config.engine import EngineConfig, config_to_cli
from kernel_cache.errors import CorruptEntryError, CpuTargetError
from kernel_cache.kernels.builtin import build_module
from kernel_cache.kernels.slots import SLOTS, kernel_path
from kernel_cache.plan.buckets import PAGED_ATTENTION
from kernel_cache.plan.launch import LaunchChoice, launch_json
from kernel_cache.plan.plan import Plan, PlanItem
from kernel_cache.runtime.inputs import make_inputs
from kernel_cache.runtime.load import check_cpu_features, default_lookup, load_package
from kernel_cache.store.lookup import Lookup, merge_accepted
from kernel_cache.store.tier import Tier

COMPILE_STACK = ("torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.codegen")

#: Max abs difference accepted between a compiled kernel and eager on the same
#: padded inputs (fp32 measured here within 2e-7; bf16/fp16 round differently).
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 3e-3}


_FROZEN = ConfigDict(frozen=True, extra="forbid")


class CorruptRow(BaseModel):
    model_config = _FROZEN

    variant: str
    key: str | None = Field(description="the cache key (64 hex)")
    reason: str = Field(description="checksum, truncation, signature, trust, ...")
    where: str | None = Field(description="the tier or file it came from")


class UnrunnableRow(BaseModel):
    model_config = _FROZEN

    variant: str
    reason: str = Field(description="the CPU instructions it needs that this CPU lacks")


class MismatchedRow(BaseModel):
    model_config = _FROZEN

    variant: str
    max_abs_err: float = Field(description="max abs difference from eager")
    kernel: str = Field(description="import path of the variant's kernel")


class AcceptedComponent(BaseModel):
    model_config = _FROZEN

    here: str | None = Field(description="this machine's value of a build-only key component")
    stored: list[str | None] = Field(description="the values the loaded entries were built with")


class VerifyReport(BaseModel):
    """What ``kernel-cache verify --json`` prints (:func:`verify_plan` returns it as a dict)."""

    model_config = _FROZEN

    ok: bool = Field(description="all loaded, all match eager, nothing compiled")
    variants: int
    loaded: int
    compiled: int = Field(description="compile-stack modules imported while verifying")
    compile_stack_imported: list[str]
    missing: list[str] = Field(description="variants in no tier")
    corrupt: list[CorruptRow]
    unrunnable: list[UnrunnableRow]
    mismatched: list[MismatchedRow]
    max_abs_err: float
    sources: dict[str, int] = Field(description="{tier location: variants loaded from it}")
    source_kinds: dict[str, str] = Field(description="{tier location: bundle | disk | redis}")
    build_only_accepted: dict[str, AcceptedComponent]
    launch: dict[str, LaunchChoice] = Field(description="the variants a launch table sets")
    kernels: dict[str, str] = Field(description="{slot: import path of the kernel the plan holds}")
    seconds: float
    repair: str | None = Field(None, description="the warmup command that repairs it")


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
    lookup = (
        default_lookup(cache_dir, bundles, allow_shared_dir=allow_shared_dir)
        if tiers is None
        else Lookup(tiers)
    )
    plan = Plan.build(config)
    report = _empty_report(plan)
    oracle = _Oracle(config)
    for item in plan:
        runner, found = _load_item(config, item, lookup, report)
        if runner is None:
            continue
        report["loaded"] += 1
        src = found.tier.location
        report["sources"][src] = report["sources"].get(src, 0) + 1
        report["source_kinds"][src] = found.tier.name
        merge_accepted(report["build_only_accepted"], found.accepted)
        err = oracle.error(item, runner)
        report["max_abs_err"] = max(report["max_abs_err"], err)
        if not err <= TOLERANCE[config.dtype]:
            report["mismatched"].append(
                {
                    "variant": str(item.variant),
                    "max_abs_err": err,
                    "kernel": kernel_path(config, item.variant.kernel),
                }
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
    VerifyReport.model_validate(report)  # the report is what its model (and schema) says
    return report


def _empty_report(plan: Plan) -> dict:
    return {
        "variants": len(plan),
        "loaded": 0,
        "missing": [],
        "corrupt": [],
        "unrunnable": [],
        "mismatched": [],
        "max_abs_err": 0.0,
        "sources": {},
        "source_kinds": {},
        "build_only_accepted": {},
        "launch": plan.describe_launch(),
        "kernels": {slot: kernel_path(plan.config, slot) for slot in SLOTS},
    }


def _load_item(config: EngineConfig, item: PlanItem, lookup: Lookup, report: dict):
    """Find and load one item as engine start does: ``(runner, found)``, or
    ``(None, None)`` with the variant noted in ``report`` as missing, corrupt
    or unrunnable."""
    v = item.variant
    try:
        found = lookup.find(item.key)
        if found is None and lookup.rejected:  # Redis held a bad or unsigned entry
            raise lookup.rejected[-1]
        if found is None:
            report["missing"].append(str(v))
            return None, None
        entry = found.entry
        check_cpu_features(config, v, entry)
        return load_package(entry.data, config.device, entry.where, entry.key), found
    except CorruptEntryError as e:
        report["corrupt"].append(
            {"variant": str(v), "key": e.key, "reason": e.reason, "where": e.where}
        )
    except CpuTargetError as e:
        report["unrunnable"].append({"variant": str(v), "reason": str(e)})
    return None, None


class _Oracle:
    """Eager modules of the same kernels and launch configs, built once per
    ``(kernel, launch config)``; :meth:`error` compares a runner with one."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.modules: dict = {}

    def error(self, item: PlanItem, runner) -> float:
        """Max abs difference between ``runner`` and eager on seeded inputs."""
        c, v, cfg = self.config, item.variant, item.launch
        args = make_inputs(c, v, seed=1)
        out = runner.run(list(args))[0]
        mk = (v.kernel, launch_json(cfg))
        if mk not in self.modules:
            # The CUDA prefill's tiles are the Triton kernel's; the oracle takes none.
            kw = {} if v.kernel == PAGED_ATTENTION else cfg
            self.modules[mk] = build_module(v.kernel, c.num_heads, c.num_kv_heads, c.head_dim, **kw)
        with torch.no_grad():
            ref = self.modules[mk](*args)
        if v.kernel == PAGED_ATTENTION:  # rows past the real chunk are padding: not compared
            real = int(args[5][0])
            out, ref = out[:real], ref[:real]
        return float((out.float() - ref.float()).abs().max())
