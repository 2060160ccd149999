"""``kernel-cache verify``: load every variant of a plan and check it against eager.

Run it in a fresh process (the CLI is one): it proves that engine start finds
and loads the whole plan with zero compiles. ``compiled`` counts the Inductor
graph compiles torch's own counters saw while verifying, and
``compile_stack_imported`` the compile-stack modules imported meanwhile
(:mod:`kernel_cache.runtime.compiles`); both must be 0 / empty.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from kernel_cache.config.engine import EngineConfig, config_to_cli
from kernel_cache.errors import CorruptEntryError, CpuTargetError
from kernel_cache.kernels.builtin import build_module
from kernel_cache.kernels.slots import SLOTS, builtin_paths, kernel_path
from kernel_cache.plan.buckets import BATCHED_DECODE, PAGED_ATTENTION
from kernel_cache.plan.launch import LaunchChoice, launch_json
from kernel_cache.plan.plan import Plan, PlanItem
from kernel_cache.runtime.compiles import CompileCounter, compile_stack_loaded
from kernel_cache.runtime.inputs import make_inputs
from kernel_cache.runtime.load import check_cpu_features, default_lookup, signature_note
from kernel_cache.runtime.package import load_package
from kernel_cache.store.disk_tier import Tier
from kernel_cache.store.lookup import Lookup, merge_accepted
from kernel_cache.trust.signing import SignatureError

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


class RowKind(BaseModel):
    """One kind of output row of a mismatched variant, as verify's inputs hold it."""

    model_config = _FROZEN

    kind: Literal["real", "padded"] = Field(
        description="real: a sequence (decode) or chunk token (prefill); padded: bucket "
        "padding (decode seq_lens[s] == 0, prefill rows >= real_query_len)"
    )
    rows: int = Field(description="rows of this kind in verify's inputs")
    differing: list[int] = Field(description="indices of the rows that break the rule")
    max_abs_err: float | None = Field(
        description="max abs difference from what the rows must hold; null where the rule "
        "is only 'finite'"
    )
    must_hold: str = Field(description="what the slot contract says these rows hold")


class MismatchedRow(BaseModel):
    model_config = _FROZEN

    variant: str
    max_abs_err: float = Field(description="max abs difference from eager")
    kernel: str = Field(description="import path of the variant's kernel")
    rows: list[RowKind] = Field(description="per kind of row: which differ and by how much")
    contract: str = Field(description="the slot contract on rows (kernel_cache.kernels.slots)")
    cause: Literal["kernel", "artifact", "unknown"] = Field(
        description="kernel: the kernel run eagerly (uncompiled) breaks the rule too; "
        "artifact: only the compiled code does; unknown: the eager run failed"
    )
    fix: str = Field(description="what repairs it (warmup only where a rebuild can)")


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
    compiled: int = Field(description="Inductor graph compiles while verifying (torch's counter)")
    compile_stack_imported: list[str] = Field(
        description="Dynamo / Inductor compiler modules first imported while verifying"
    )
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
    signatures: str = Field(
        "", description="whether signatures were checked, and with which key ids"
    )
    seconds: float
    repair: str | None = Field(
        None,
        description="the warmup command that repairs missing, corrupt or unrunnable entries "
        "(a mismatch names its own fix)",
    )


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
    same launch config, or whose padded rows break the slot contract: per kind
    of row the differing indices and error, the contract, the cause and the
    fix, :class:`MismatchedRow`), ``max_abs_err``, ``launch`` (the variants a launch
    table sets: ``{variant: {"config", "source"}}``),
    ``sources`` (``{tier location: variants loaded from it}``), ``source_kinds``
    (``{tier location: "bundle" | "disk" | "redis"}``),
    ``build_only_accepted`` (``{component: {"here", "stored": [...]}}``),
    ``kernels`` (``{slot: import path of the kernel the plan holds}``), ``signatures``
    (whether signatures were checked, and with which key ids), ``seconds``,
    ``repair`` (the warmup command, only where warmup can repair: something
    missing, corrupt or unrunnable). Every variant, the engine's own kernels'
    included, is compared with the built-in slot's eager kernel (the plain
    PyTorch formulation).

    Raises:
        UntrustedCacheError: see :mod:`kernel_cache.trust.permissions`
            (``allow_shared_dir`` opts out).
    """
    t0 = time.perf_counter()
    before, compiles = set(compile_stack_loaded()), CompileCounter()
    lookup = (
        default_lookup(cache_dir, bundles, allow_shared_dir=allow_shared_dir)
        if tiers is None
        else Lookup(tiers)
    )
    plan = Plan.build(config)
    report = _empty_report(plan)
    report["signatures"] = signature_note(lookup.keyring)
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
        err, rows = oracle.check(item, runner)
        report["max_abs_err"] = max(report["max_abs_err"], err)
        if any(r["differing"] for r in rows):
            report["mismatched"].append(oracle.diagnose(item, err, rows, found, cache_dir))
    newly = sorted(set(compile_stack_loaded()) - before)
    report["compiled"] = compiles.compiles()
    report["compile_stack_imported"] = newly
    report["ok"] = (
        report["loaded"] == report["variants"]
        and not report["mismatched"]
        and report["compiled"] == 0
        and not newly
    )
    report["seconds"] = round(time.perf_counter() - t0, 3)
    if report["missing"] or report["corrupt"] or report["unrunnable"]:  # what warmup rebuilds
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
        "kernels": {
            slot: kernel_path(plan.config, slot)
            for slot in (*SLOTS, *(s.name for s in plan.config.slots))
        },
    }


def _load_item(config: EngineConfig, item: PlanItem, lookup: Lookup, report: dict):
    """Find and load one item as engine start does: ``(runner, found)``, or
    ``(None, None)`` with the variant noted in ``report`` as missing, corrupt
    or unrunnable."""
    v = item.variant
    try:
        result = lookup.search(item.key)
        if result.failed is not None:
            raise result.failed.error
        found = result.found
        if found is None and result.rejected:  # Redis held a bad or unsigned entry
            raise result.rejected[-1].error
        if found is None:
            report["missing"].append(str(v))
            return None, None
        entry = found.entry
        check_cpu_features(config, v, entry)
        return load_package(entry.data, config.device, entry.where, entry.key), found
    except CorruptEntryError as e:
        # a signature refusal is said as such: the entry may be whole, its signer is not trusted
        reason = f"untrusted: {e.reason}" if isinstance(e, SignatureError) else e.reason
        report["corrupt"].append(
            {"variant": str(v), "key": e.key, "reason": reason, "where": e.where}
        )
    except CpuTargetError as e:
        report["unrunnable"].append({"variant": str(v), "reason": str(e)})
    return None, None


#: What each kind of output row must hold, per slot: the rules of
#: ``SLOTS[slot].padding`` (:mod:`kernel_cache.kernels.slots`) that verify checks.
ROW_RULES = {
    BATCHED_DECODE: {
        "real": "the eager reference: attention over KV positions < seq_lens[s]",
        "padded": "zeros (seq_lens[s] == 0: 'a padded row returns zeros')",
    },
    PAGED_ATTENTION: {
        "real": "the eager reference: causal attention of the chunk token",
        "padded": "finite values, never compared (rows >= real_query_len)",
    },
}


def row_kinds(variant, args) -> dict[str, list[int]]:
    """``{"real": [row], "padded": [row]}``: the output rows of ``variant``'s
    kernel on ``args`` (from :func:`~kernel_cache.runtime.inputs.make_inputs`) by
    kind (decode: sequences, padded where ``seq_lens == 0``; prefill: chunk
    tokens, padded from ``real_query_len`` on)."""
    if variant.kernel == PAGED_ATTENTION:
        real = int(args[5][0])
        return {"real": list(range(real)), "padded": list(range(real, variant.query_len))}
    lens = args[4].tolist()
    return {
        "real": [i for i, n in enumerate(lens) if n > 0],
        "padded": [i for i, n in enumerate(lens) if n == 0],
    }


def check_rows(slot: str, out, ref, kinds: dict[str, list[int]], tol: float) -> list[dict]:
    """Each kind of row of ``out`` against its rule (:data:`ROW_RULES`): real rows
    against ``ref`` (the eager oracle), decode's padded rows against zeros,
    prefill's padded rows for being finite. A row differs where its max abs
    difference is above ``tol`` or not a number. Returns one :class:`RowKind`
    dict per kind present."""
    out, ref = out.detach().float().cpu(), ref.detach().float().cpu()
    checked = []
    for kind, idx in kinds.items():
        if not idx:
            continue
        got = out[idx].flatten(1)
        if slot == PAGED_ATTENTION and kind == "padded":
            finite = torch.isfinite(got).all(dim=1).tolist()
            bad, err = [i for i, ok in zip(idx, finite, strict=True) if not ok], None
        else:
            want = torch.zeros_like(got) if kind == "padded" else ref[idx].flatten(1)
            per_row = (got - want).abs().amax(dim=1).tolist()
            bad = [i for i, e in zip(idx, per_row, strict=True) if not e <= tol]
            err = max(per_row)
        checked.append(
            {
                "kind": kind,
                "rows": len(idx),
                "differing": bad,
                "max_abs_err": err,
                "must_hold": ROW_RULES[slot][kind],
            }
        )
    return checked


class _Oracle:
    """Eager modules of the same kernels and launch configs, built once per
    ``(kernel, launch config)``; :meth:`check` compares a runner with one and
    :meth:`diagnose` says why a variant differs."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.modules: dict = {}
        self.tol = TOLERANCE[config.dtype]

    def _reference(self, item: PlanItem, args):
        c, v, cfg = self.config, item.variant, item.launch
        mk = (v.kernel, launch_json(cfg))
        if mk not in self.modules:
            # The CUDA prefill's tiles are the Triton kernel's; the oracle takes none.
            kw = {} if v.kernel == PAGED_ATTENTION else cfg
            self.modules[mk] = build_module(v.kernel, c.num_heads, c.num_kv_heads, c.head_dim, **kw)
        with torch.no_grad():
            return self.modules[mk](*args)

    def _declared(self, spec):
        """The eager module of declared slot ``spec`` (built once) and its state."""
        from kernel_cache.kernels.declared import build_declared, example_state

        if spec.name not in self.modules:
            mod = build_declared(spec).to(self.config.device)
            self.modules[spec.name] = (mod, example_state(mod))
        return self.modules[spec.name]

    def check_declared(self, spec, item: PlanItem, runner) -> tuple[float, list[dict]]:
        """A declared slot's variant against its module run eagerly on the same
        seeded inputs and the module's own weights (passed to the artifact as
        inputs): one ``real`` row kind, every output row compared, the tolerance
        of the first floating input's dtype."""
        from kernel_cache.runtime.inputs import make_slot_inputs

        mod, state = self._declared(spec)
        args, _ = make_slot_inputs(spec, item.variant, seed=1, device=self.config.device)
        out = runner.run([*state, *args])[0]
        with torch.no_grad():
            ref = mod(*args)
        floats = [i.dtype for i in spec.inputs if i.dtype in TOLERANCE]
        tol = TOLERANCE[floats[0]] if floats else self.tol
        got, want = out.detach().float().cpu(), ref.detach().float().cpu()
        got, want = got.reshape(got.shape[0] if got.dim() else 1, -1), want.reshape(got.shape)
        per_row = (got - want).abs().amax(dim=1).tolist() if got.numel() else []
        bad = [i for i, e in enumerate(per_row) if not e <= tol]
        err = max(per_row) if per_row else 0.0
        rule = "the module run eagerly on the same inputs and weights"
        row = {"kind": "real", "rows": len(per_row), "differing": bad, "max_abs_err": err}
        return err, [{**row, "must_hold": rule}]

    def check(self, item: PlanItem, runner) -> tuple[float, list[dict]]:
        """``(max abs err, rows)``: ``runner`` against eager on seeded inputs; the
        error over the compared rows (prefill's padded rows are not compared),
        and :func:`check_rows`'s verdict per kind of row."""
        v = item.variant
        spec = self.config.slot(v.kernel)
        if spec is not None:
            return self.check_declared(spec, item, runner)
        args = make_inputs(self.config, v, seed=1)
        out = runner.run(list(args))[0]
        rows = check_rows(v.kernel, out, self._reference(item, args), row_kinds(v, args), self.tol)
        errs = [r["max_abs_err"] for r in rows if r["max_abs_err"] is not None]
        return (max(errs) if errs else 0.0), rows

    def diagnose(self, item: PlanItem, err: float, rows: list[dict], found, cache_dir) -> dict:
        """The :class:`MismatchedRow` of a variant whose rows differ: runs the
        variant's kernel eagerly (uncompiled) on the same inputs to tell a kernel
        that breaks the contract (fixed in the kernel: a warmup would find the
        entry cached and change nothing) from an artifact that differs from its
        own kernel (rebuilt by a warmup once the entry is gone)."""
        c, v = self.config, item.variant
        path = kernel_path(c, v.kernel)
        where = f"{found.entry.key[:16]} in {found.entry.where}"
        cli = config_to_cli(c, cache_dir)
        if c.slot(v.kernel) is not None:  # the oracle is the module itself: the artifact differs
            return {
                "variant": str(v),
                "max_abs_err": err,
                "kernel": path,
                "rows": rows,
                "contract": "a declared slot's output equals its module's, run eagerly",
                "cause": "artifact",
                "fix": f"the compiled artifact (entry {where}) differs from {path} run eagerly: "
                "remove it (kernel-cache clear, or a rebuilt bundle), then kernel-cache "
                f"warmup {cli}",
            }
        args = make_inputs(c, v, seed=1)
        try:
            mod = build_module(
                v.kernel, c.num_heads, c.num_kv_heads, c.head_dim, impl=path, **item.launch
            )
            with torch.no_grad():
                eager = mod(*args)
            ref = self._reference(item, args)
            eager_rows = check_rows(v.kernel, eager, ref, row_kinds(v, args), self.tol)
        except Exception as e:  # the engine's code run eagerly: any failure is reported
            cause, fix = (
                "unknown",
                (
                    f"the kernel {path} failed when run eagerly ({type(e).__name__}: {e}); "
                    "it cannot tell a wrong kernel from a wrong artifact"
                ),
            )
        else:
            bad = [f"{r['kind']} rows {r['differing']}" for r in eager_rows if r["differing"]]
            if bad:
                cause = "kernel"
                who = (
                    f"the built-in kernel {path}: a bug in kernel-cache"
                    if path in builtin_paths()
                    else f"{path}: fix the kernel; its sources are in the key, so a warmup "
                    "after the fix compiles the new code"
                )
                fix = (
                    f"the kernel itself breaks the {v.kernel} contract: run eagerly "
                    f"(uncompiled) on the same inputs it differs in {', '.join(bad)}; "
                    f"a rebuild compiles the same code again. It is {who}"
                )
            else:
                cause = "artifact"
                fix = (
                    f"the compiled artifact (entry {where}) differs from {path} run "
                    "eagerly, which meets the contract: a miscompile or a replaced entry. "
                    "A warmup finds the entry cached: remove it (kernel-cache clear, or a "
                    f"rebuilt bundle), then kernel-cache warmup {cli}"
                )
        return {
            "variant": str(v),
            "max_abs_err": err,
            "kernel": path,
            "rows": rows,
            "contract": SLOTS[v.kernel].padding,
            "cause": cause,
            "fix": fix,
        }
