"""``kernel-cache verify --rebuild VARIANT``: build a stored entry again and
compare the bytes.

Builds are reproducible (docs/reproducible.md): two builders of one key write
the same package bytes. So anyone with the same toolchain (the key's ``torch``,
``python``, ``cxx`` and ``device_arch`` components) can audit an artifact: find
the entry as engine start would, compile its variant again in a fresh worker
process under warmup's pinned environment and a private scratch directory, and
compare. Nothing is written to any cache.
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor

from pydantic import BaseModel, ConfigDict, Field

from kernel_cache.config.engine import EngineConfig
from kernel_cache.errors import ConfigError
from kernel_cache.plan.buckets import KernelVariant
from kernel_cache.plan.plan import Plan
from kernel_cache.runtime.load import default_lookup
from kernel_cache.store.disk_tier import Tier
from kernel_cache.store.lookup import Lookup


class MemberRow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    member: str = Field(description="the zip member's name in the package")
    stored_size: int = Field(description="its size in the stored entry, bytes")
    rebuilt_size: int = Field(description="its size in the rebuilt package, bytes")


class RebuildReport(BaseModel):
    """One variant rebuilt and compared (``verify --rebuild --json``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    variant: str = Field(description="the variant, KERNEL:QUERY:BLOCKS:SEQS")
    key: str = Field(description="its key (sha256 hex) in this checkout's plan")
    where: str | None = Field(description="the tier the stored entry came from; None: missing")
    identical: bool = Field(description="the rebuilt package has the stored bytes")
    stored_sha256: str | None = Field(description="sha256 of the stored package")
    rebuilt_sha256: str | None = Field(description="sha256 of the rebuilt package")
    differs: list[MemberRow] = Field(description="members present in both, other bytes")
    only_stored: list[str] = Field(description="members only the stored package has")
    only_rebuilt: list[str] = Field(description="members only the rebuilt package has")
    compile_s: float = Field(description="seconds the rebuild took (export + AOTInductor)")


def _rebuild_worker(config_json: str, variant_json: str, launch: dict) -> bytes:
    """Worker body: compile one variant as warmup does; the package bytes."""
    from warmup.builder.compiler import compile_variant

    config = EngineConfig.model_validate_json(config_json)
    variant = KernelVariant.model_validate_json(variant_json)
    return compile_variant(config, variant, launch=launch)[0]


def compare_packages(stored: bytes, rebuilt: bytes) -> dict:
    """``{"identical", "differs": [{"member", "stored_size", "rebuilt_size"}],
    "only_stored", "only_rebuilt"}`` for two ``.pt2`` packages (zip archives);
    a package that is not a zip is compared as one member named ``(package)``."""
    try:
        with zipfile.ZipFile(io.BytesIO(stored)) as a, zipfile.ZipFile(io.BytesIO(rebuilt)) as b:
            ma = {n: a.read(n) for n in a.namelist()}
            mb = {n: b.read(n) for n in b.namelist()}
    except zipfile.BadZipFile:
        ma, mb = {"(package)": stored}, {"(package)": rebuilt}
    differs = [
        {"member": n, "stored_size": len(ma[n]), "rebuilt_size": len(mb[n])}
        for n in ma
        if n in mb and ma[n] != mb[n]
    ]
    return {
        "identical": stored == rebuilt,
        "differs": differs,
        "only_stored": sorted(set(ma) - set(mb)),
        "only_rebuilt": sorted(set(mb) - set(ma)),
    }


def rebuild_variant(
    config: EngineConfig,
    variant: str,
    cache_dir=None,
    *,
    tiers: list[Tier] | None = None,
    bundles=None,
    allow_shared_dir: bool | None = None,
) -> dict:
    """Find ``variant``'s entry as ``verify`` does (bundles, then the local
    cache read-only, then Redis when set; or ``tiers``), compile it again in a
    fresh worker process (warmup's pinned environment, a private scratch
    directory removed afterwards) and compare the bytes. Writes to no cache.

    Returns: a :class:`RebuildReport` as a dict; ``where`` None when no tier
    holds the entry (nothing is compiled then).

    Raises:
        ConfigError: ``variant`` is not in the plan (names the plan's variants).
        CompileError: the rebuild failed.
    """
    from warmup.builder.pool import drop_scratch, hash_seed_pinned, new_scratch
    from warmup.builder.worker import init_worker

    plan = Plan.build(config)
    item = plan.find(variant)
    if item is None:
        raise ConfigError(
            f"--rebuild {variant}: not a variant of this plan; its variants are "
            f"{', '.join(str(v) for v in plan.variants)} (kernel-cache plan lists them)"
        )
    lookup = (
        default_lookup(cache_dir, bundles, allow_shared_dir=allow_shared_dir)
        if tiers is None
        else Lookup(tiers)
    )
    found = lookup.find(item.key)
    out = {"variant": str(item.variant), "key": item.hexdigest, "compile_s": 0.0}
    if found is None:
        empty = {"differs": [], "only_stored": [], "only_rebuilt": []}
        out.update(where=None, identical=False, stored_sha256=None, rebuilt_sha256=None, **empty)
        return RebuildReport.model_validate(out).model_dump()
    stored = found.entry  # checksum (and for Redis, signature) checked by the lookup
    scratch = new_scratch()
    t0 = time.perf_counter()
    try:
        with ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=init_worker,
            initargs=(os.getpid(), config.device, config.cpu_target, scratch),
        ) as pool:
            args = (config.model_dump_json(), item.variant.model_dump_json(), item.launch)
            with hash_seed_pinned():  # the submit spawns the worker
                fut = pool.submit(_rebuild_worker, *args)
            rebuilt = fut.result()
    finally:
        drop_scratch(scratch)
    out.update(
        where=found.tier.location,
        stored_sha256=hashlib.sha256(stored.data).hexdigest(),
        rebuilt_sha256=hashlib.sha256(rebuilt).hexdigest(),
        compile_s=round(time.perf_counter() - t0, 3),
        **compare_packages(stored.data, rebuilt),
    )
    return RebuildReport.model_validate(out).model_dump()
