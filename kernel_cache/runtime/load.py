"""Engine start: find, check and load every artifact of a plan, with zero compiles.

:func:`load_plan` loads every variant of a plan through AOTInductor's package
loader (:func:`kernel_cache.torch_compat.load_aoti_package`), which imports
neither Dynamo nor Inductor's compiler, and returns the dispatcher,
:class:`~kernel_cache.runtime.dispatch.AttentionRuntime`.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kernel_cache.config.engine import EngineConfig, config_to_cli
from kernel_cache.errors import (
    ConfigError,
    CorruptEntryError,
    CpuTargetError,
    MissingVariantsError,
    TorchAPIDriftError,
)
from kernel_cache.plan.keys import environment
from kernel_cache.plan.plan import Plan
from kernel_cache.runtime.compiles import CompileCounter
from kernel_cache.store.disk_tier import (
    ENV_CACHE_DIR,
    DiskTier,
    Tier,
    check_cache_dir_path,
    default_cache_dir,
)
from kernel_cache.trust.signing import load_trusted_keys

if TYPE_CHECKING:
    from kernel_cache.runtime.dispatch import AttentionRuntime

log = logging.getLogger("kernel_cache")


_LOAD_PREFIX = "kernel_cache-load-"
_load_dir: str | None = None
_load_dir_lock = threading.Lock()


def _remove_own_load_dir(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that inherited the handler
        shutil.rmtree(path, ignore_errors=True)


def load_dir() -> str:
    """This process's directory for unpacked packages, made on first use.

    AOTInductor's loader, given a ``.pt2`` file, unpacks it (its ``.so`` and
    data) into a new ``aotinductor_*`` directory under ``$TMPDIR`` and never
    removes it: a start of a 26-variant plan left 26 such directories behind.
    Loads therefore unpack into ``$TMPDIR/kernel_cache-load-<pid>-*`` themselves
    (:func:`load_package`), removed when the process exits;
    directories of processes that died without exiting (SIGKILL) are removed by
    the next process that loads. A process holds an ``flock`` in its directory
    while it lives (:func:`kernel_cache.store.locks.private_temp_dir`), so
    processes in other PID namespaces (containers sharing ``$TMPDIR``) never
    remove each other's.

    Raises:
        ConfigError: the directory is on a ``noexec`` mount, from which no
            compiled kernel can be mapped (every load would fail as if the
            entries were corrupt).
    """
    global _load_dir
    with _load_dir_lock:  # engines that start in two threads share one directory
        if _load_dir is None:
            from kernel_cache.store.locks import private_temp_dir, remove_private_temp_dir

            made = private_temp_dir(_LOAD_PREFIX)
            if os.statvfs(made).f_flag & getattr(os, "ST_NOEXEC", 0):
                remove_private_temp_dir(made)
                raise ConfigError(
                    f"the load directory {made} is on a noexec mount (TMPDIR="
                    f"{os.environ.get('TMPDIR', '')!r}): compiled kernels cannot be mapped "
                    "from it; set TMPDIR to a folder on a mount that allows executables"
                )
            _load_dir = made
            atexit.register(_remove_own_load_dir, _load_dir, os.getpid())
        return _load_dir


def load_package(data: bytes, device: str, where: str = "", key: str = ""):
    """Load verified ``.pt2`` bytes with the AOTInductor runtime loader.

    The package is unpacked into a new folder of :func:`load_dir` (never the
    cache directory, which may be read-only), and the loader is given that
    folder: AOTInductor's ``AOTIModelPackageLoader`` loads an unpacked package
    in place (torch 2.13), so it creates nothing under ``$TMPDIR`` and no
    environment variable is changed for it. The folder stays while the
    process runs (on CUDA the runner reads its kernels' cubin files from it)
    and goes with :func:`load_dir` at exit.

    On the CPU, a package that holds only its ``.so``, metadata and source
    (:func:`_cpu_library`) skips the loader: only the ``.so``, read from
    ``data``, is written and loaded (:func:`_load_cpu_library`; 1.7 ms per
    variant against 2.3 ms through the loader; docs/benchmarks/engine-start.md,
    "`load_plan` alone").

    On CUDA the runner is created in AOTInductor's single-threaded mode
    (``AOTIModelPackageLoader(path, model_name, run_single_threaded=True,
    num_runners=1, device_index)``): a call only enqueues its kernels on the
    current stream and returns, and it can be captured in a CUDA graph. The
    thread-safe mode waits, in every call, for the previous call's kernels to
    finish on the GPU (host time per call = GPU time; measured on an H200: 374
    us of host time per decode call against 34 us) and cannot be captured.
    Single-threaded runners must not be called from two threads at once, which
    :class:`AttentionRuntime` already requires.

    Raises:
        CorruptEntryError: the loader rejected the package.
        TorchAPIDriftError: the installed torch's loader is missing or takes
            other arguments (:mod:`kernel_cache.torch_compat`); the entry is not
            at fault and is left as it is.
        ConfigError: the package cannot be unpacked into the load directory
            (a full or unwritable ``$TMPDIR``; names it).
    """
    import torch  # here, not at module top: listings and ``explain`` need no torch

    from kernel_cache import torch_compat

    if device == "cpu":
        library = _cpu_library(data, where, key)
        if library is not None:
            return _load_cpu_library(library, where, key)
    path = _unpack(data, where, key)
    device_index = torch.cuda.current_device() if device == "cuda" else -1
    try:
        return torch_compat.load_aoti_package(
            path,
            model_name="model",
            run_single_threaded=device == "cuda",
            num_runners=1,
            device_index=device_index,
        )
    except TorchAPIDriftError:
        shutil.rmtree(path, ignore_errors=True)
        raise  # torch's API, not this entry
    except Exception as e:  # the loader raises RuntimeError for a bad package
        shutil.rmtree(path, ignore_errors=True)
        raise CorruptEntryError(key, f"the AOTInductor loader rejected it: {e}", where) from None


def _unpack(data: bytes, where: str, key: str) -> str:
    """The package ``data`` unpacked into a new folder of :func:`load_dir`
    (its path). :mod:`zipfile` writes no file outside that folder (absolute
    names and ``..`` are dropped) and makes no link.

    Raises:
        CorruptEntryError: ``data`` is not a zip archive.
        ConfigError: writing into the load directory failed (full, unwritable).
    """
    import io
    import zipfile

    base = load_dir()
    try:
        out = tempfile.mkdtemp(prefix="kernel_cache-", dir=base)
    except OSError as e:
        raise _load_dir_error(key, data, base, e) from None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            z.extractall(out)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as e:
        shutil.rmtree(out, ignore_errors=True)
        raise CorruptEntryError(
            key, f"the AOTInductor loader rejected it: not a package ({e})", where
        ) from None
    except OSError as e:  # the load directory, not the entry: a full or unwritable TMPDIR
        shutil.rmtree(out, ignore_errors=True)
        raise _load_dir_error(key, data, out, e) from None
    return out


def _load_dir_error(key: str, data: bytes, path: str, e: OSError) -> ConfigError:
    """The error of a write into the load directory that failed (``e``: ENOSPC,
    EACCES...): the directory's fault, not the entry's."""
    return ConfigError(
        f"cannot unpack entry {key[:16]} ({len(data)} bytes) into the load directory "
        f"{path}: {e}; free space there or set TMPDIR to a folder with room"
    )


#: A CPU package's model files, under its archive's top folder (``model/``).
_MODEL_DIR = "data/aotinductor/model/"


def _cpu_library(data: bytes, where: str, key: str) -> bytes | None:
    """The ``.so`` of a CPU package, if loading it alone is all AOTInductor's
    loader would do with the package; else None (the loader then loads it).

    That is: the package's model folder holds one ``.so``, its
    ``<name>_metadata.json`` saying ``AOTI_DEVICE_KEY`` ``cpu``, and otherwise
    only ``.cpp`` and ``_metadata.json`` files (generated source, flags: the
    loader reads the source only to compile a package that has no ``.so``,
    which an engine never does). Weights stored beside the ``.so``, the
    ``<name>.json`` of a graph that calls custom ops (the loader hands it to
    the proxy executor that runs them), anything else unknown, more than one
    top folder or a member name used twice (where this reading and the
    loader's could pick different ``.so`` files; the loader refuses two) send
    the package to the loader. ``data`` are the verified bytes:
    the ``.so`` returned is read from them, not from a file.

    Raises:
        CorruptEntryError: ``data`` is not a zip archive (the loader rejects it too).
    """
    import io
    import json
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = z.namelist()
            if len(set(names)) != len(names) or len({n.partition("/")[0] for n in names}) != 1:
                return None
            files = {}
            for info in z.infolist():
                _, _, rest = info.filename.partition("/")
                if rest.startswith(_MODEL_DIR) and not info.is_dir():
                    files[rest[len(_MODEL_DIR) :]] = info
            libs = [n for n in files if n.endswith(".so")]
            if len(libs) != 1 or any(
                "/" in n or not n.endswith((".so", ".cpp", "_metadata.json")) for n in files
            ):
                return None
            meta = files.get(libs[0][: -len(".so")] + "_metadata.json")
            if meta is None or json.loads(z.read(meta)).get("AOTI_DEVICE_KEY") != "cpu":
                return None
            return z.read(files[libs[0]])
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        ValueError,
        EOFError,
        NotImplementedError,
    ) as e:
        raise CorruptEntryError(
            key, f"the AOTInductor loader rejected it: not a package ({e})", where
        ) from None


def _load_cpu_library(library: bytes, where: str, key: str):
    """AOTInductor's CPU runner (``AOTIModelContainerRunnerCpu(so_path, 1)``, the
    runner the package loader makes for a CPU package, with one model) of the
    ``.so`` bytes ``library``, written to a private file in :func:`load_dir`,
    loaded (``dlopen``) and removed (the loaded library stays mapped).

    Raises:
        CorruptEntryError: the library does not load.
        TorchAPIDriftError: as :func:`load_package`'s.
        ConfigError: the library cannot be written into the load directory (a
            full ``$TMPDIR``; names it).
    """
    from kernel_cache import torch_compat

    base = load_dir()
    try:
        fd, path = tempfile.mkstemp(suffix=".so", prefix="kernel_cache-", dir=base)
    except OSError as e:
        raise _load_dir_error(key, library, base, e) from None
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(library)
        except OSError as e:  # a full TMPDIR: the load directory's fault, not the entry's
            raise _load_dir_error(key, library, base, e) from None
        try:
            return torch_compat.load_cpu_runner(path, num_models=1)
        except TorchAPIDriftError:
            raise  # torch's API, not this file
        except Exception as e:  # dlopen or a missing symbol: RuntimeError
            raise CorruptEntryError(
                key, f"the AOTInductor loader rejected it: {e}", where
            ) from None
    finally:
        Path(path).unlink(missing_ok=True)


def default_lookup(cache_dir=None, bundles=None, *, allow_shared_dir: bool | None = None):
    """The :class:`~kernel_cache.store.lookup.Lookup` of engine start: bundles
    (``bundles``, i.e. ``--bundle``, then ``$KERNEL_CACHE_BUNDLE``), then the
    local disk cache, then Redis when ``KERNEL_CACHE_REDIS_URL`` is set
    (:mod:`kernel_cache.store.redis`), then S3 when ``KERNEL_CACHE_S3_URL`` is set
    (:mod:`kernel_cache.store.s3`).

    The local cache is opened only if its directory exists: engine start never
    creates a cache directory. It is opened read-only (no lock, database, journal
    or temporary file is created in it) and its trust is checked
    (:mod:`kernel_cache.trust.permissions`; ``allow_shared_dir`` opts out). The one
    exception is a verified Redis hit, which the lookup copies into the local
    cache (created if needed) through a separate writable handle, opened only then.

    Raises:
        BundleError: a bundle path is not a bundle (names it).
        ConfigError: a malformed ``KERNEL_CACHE_REDIS_*`` setting, or a cache
            directory (or a folder above it) that is a file.
        SigningKeyError: a shared tier (a bundle, Redis, S3) and no key to check
            signatures, without ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED``.
    """
    from kernel_cache.config import settings
    from kernel_cache.store.lookup import Lookup, Source
    from kernel_cache.store.remote import tiers_from_env

    sources: list = []
    if bundles or settings.is_set("bundle"):  # bundle.py (its models) only for a bundle
        from kernel_cache.store.bundle import BundleTier, bundle_paths

        sources += [BundleTier(p) for p in bundle_paths(bundles)]
    directory = Path(cache_dir) if cache_dir else default_cache_dir()
    source = "cache_dir" if cache_dir else f"${ENV_CACHE_DIR}"
    check_cache_dir_path(directory, source, source)
    if directory.is_dir():
        sources.append(DiskTier(directory, read_only=True, allow_shared=allow_shared_dir))
    remote = tiers_from_env()
    if remote:  # a writable handle on the local cache, opened on the first copy
        local = DiskTier(directory, allow_shared=allow_shared_dir)
        sources += [Source(r, promote_into=local) for r in remote]
    return Lookup(sources)


def _take_import_memo(cache_dir, allow_shared: bool | None) -> str | None:
    """Read the local cache's memo of import scans, if any, before the keys are
    computed (:mod:`kernel_cache.store.imports_memo`; engine start only reads it).
    Returns the ``cxx`` key component it records (warmup's compiler), or None."""
    from kernel_cache.store import imports_memo
    from kernel_cache.trust.permissions import resolve_allow_shared

    directory = Path(cache_dir) if cache_dir else default_cache_dir()
    memo, _ = imports_memo.take(directory, allow_shared=resolve_allow_shared(allow_shared))
    return memo.cxx if memo is not None and memo.cxx else None


def default_tiers(
    cache_dir=None, bundles=None, *, allow_shared_dir: bool | None = None
) -> list[Tier]:
    """The tiers of :func:`default_lookup`, in lookup order (for listings)."""
    return default_lookup(cache_dir, bundles, allow_shared_dir=allow_shared_dir).tiers


def record_lookups(tiers: list[Tier], hits: dict[int, list[str]], misses: int) -> None:
    """Best-effort usage records for the tiers that keep them (the local disk
    cache: :meth:`~kernel_cache.store.disk_tier.Tier.note_usage`): ``hits`` maps
    ``id(tier)`` to the keys it served; misses go to the first such tier.
    Never raises, never writes to a read-only directory."""
    first = True
    for tier in tiers:
        if tier.note_usage(hits.get(id(tier), ()), misses if first else 0):
            first = False


def check_cpu_features(config: EngineConfig, variant, entry) -> None:
    """Refuse an artifact whose recorded ``cpu_features`` (the instruction set
    its host code was built for: :mod:`kernel_cache.config.recipe`; on CUDA the
    package's C++ wrapper) include one this CPU lacks: its first call would die
    of an illegal instruction.

    Raises:
        CpuTargetError: names the variant, the entry, its target, the missing
            features and the warmup command for a target this CPU runs.
        CorruptEntryError: an entry without a list of ``cpu_features``.
    """
    from kernel_cache.config.recipe import cpu_model, missing_cpu_features

    needed = entry.meta.get("cpu_features")
    if not isinstance(needed, list) or not all(isinstance(f, str) for f in needed):
        raise CorruptEntryError(
            entry.key,
            f"variant {variant}: an entry must record its cpu_features (a list of CPU "
            f"flags), it records {needed!r}; repair with: kernel-cache warmup "
            f"{config_to_cli(config)}",
            entry.where,
        )
    missing = missing_cpu_features(needed)
    if missing:
        target = entry.meta.get("cpu_target", "?")
        raise CpuTargetError(
            f"variant {variant} (entry {entry.key[:16]} in {entry.where}) was built for "
            f"cpu_target={target} and uses {', '.join(missing)}, which this CPU "
            f"({cpu_model()}) lacks; its first call would die of an illegal instruction. "
            f"Build for this CPU: kernel-cache warmup {config_to_cli(config)} "
            "(--cpu-target x86-64-v3 needs AVX2; native builds for this CPU)"
        )


def load_plan(
    config: EngineConfig,
    cache_dir=None,
    *,
    tiers: list[Tier] | None = None,
    bundles=None,
    strict: bool = True,
    allow_shared_dir: bool | None = None,
    plan: Plan | None = None,
) -> AttentionRuntime:
    """Engine start: load every variant of ``config``'s plan and return the runtime.

    Lookup (:class:`kernel_cache.store.lookup.Lookup`): each tier in order, the exact
    key first, then an entry equal in every runtime component that was built
    with another C++ compiler (``cxx`` is build-only; the accepted values are
    logged at INFO and reported in ``stats()["build_only_accepted"]``). Over a
    local cache that warmup wrote, no program is run: the keys take the ``cxx``
    that warmup recorded there (:mod:`kernel_cache.store.imports_memo`). Without
    that record (a bundle-only or remote-only engine), the C++ compiler is asked
    once for it (:func:`kernel_cache.plan.keys.cxx_compiler_id`, four short runs),
    so the keys are the builders' exact keys.

    Args:
        config: the engine configuration (its bucketer defines the plan).
        cache_dir: the local cache (default
            :func:`~kernel_cache.store.base.default_cache_dir`); ignored when ``tiers`` is given.
        bundles: bundle directories searched before the local cache, in
            addition to ``$KERNEL_CACHE_BUNDLE``; ignored when ``tiers`` is given.
        strict: raise on missing variants (default); with False, load what is there.
        allow_shared_dir: skip the trust checks of the cache directory (default
            ``KERNEL_CACHE_INSECURE_ALLOW_SHARED_DIR``; see :mod:`kernel_cache.trust.permissions`).
        plan: ``config``'s :class:`~kernel_cache.plan.plan.Plan` if the caller
            has built it (default: built here, once).

    Raises:
        MissingVariantsError: variants not in any tier, with the warmup command.
        CorruptEntryError: an entry failed verification (names it and the repair).
        CpuTargetError: an artifact needs an instruction this CPU lacks.
        BundleError: a bundle path is not a bundle.
        UntrustedCacheError: the directory or an entry file is writable by other
            users or owned by another user (names the path and the fix).
        SigningKeyError: a shared tier (Redis, S3, a bundle) is set and no key to
            check its signatures (and not ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED``;
            names ``kernel-cache keygen``, both key variables and the opt-out);
            signed entries are required and no trusted key is set; or a key
            setting is wrong (names the variable and the fix).
        SettingError: a ``KERNEL_CACHE_*`` variable does not validate (e.g.
            ``KERNEL_CACHE_NUM_THREADS``, which a CPU plan applies here:
            :mod:`kernel_cache.runtime.threads`).
    """
    from kernel_cache.runtime.dispatch import AttentionRuntime  # imports torch
    from kernel_cache.store.lookup import Lookup

    t0 = time.perf_counter()
    compiles = CompileCounter()  # stats() reports torch's compiles from here on
    load_trusted_keys()  # --require-signed without a key, or a bad key, fails here
    # a shared tier without a key to check signatures (and no opt-out) fails here
    lookup = (
        default_lookup(cache_dir, bundles, allow_shared_dir=allow_shared_dir)
        if tiers is None
        else Lookup(tiers)
    )
    if plan is None:
        cxx = None
        if tiers is None:  # the import scans and compiler warmup kept in the local cache
            cxx = _take_import_memo(cache_dir, allow_shared_dir)
        # warmup's record of 'cxx' spares the compiler runs (kernel_cache.plan.keys)
        plan = Plan.build(config, environment(config, cxx=cxx))
    if config.device == "cpu":  # KERNEL_CACHE_NUM_THREADS: see runtime/threads.py
        from kernel_cache.runtime import threads

        threads.apply()
    for tier in lookup.tiers:  # a remote may fetch the plan in one go (S3: its manifest)
        tier.expect([item.hexdigest for item in plan])
    found = _find_plan(plan, lookup, cache_dir)
    record_lookups(lookup.tiers, found.hits, len(found.missing))
    if found.missing and strict:
        raise MissingVariantsError(
            found.missing,
            f"kernel-cache warmup {config_to_cli(config, cache_dir)}",
            found.why,
            found.refused,
        )
    rt = AttentionRuntime(
        config,
        plan.bucketer,
        found.runners,
        time.perf_counter() - t0,
        compile_counter=compiles,
        sources=found.sources,
        build_only_accepted=found.accepted,
        launch={i.variant: i.launch for i in plan},
    )
    _log_accepted(found.accepted)
    log.info(
        "loaded %d variants in %.3f s from %s; %s", len(found.runners), rt.load_seconds,
        dict(found.sources), signature_note(lookup.keyring),
    )  # fmt: skip
    return rt


@dataclass
class _Found:
    """What :func:`_find_plan` found: ``runners`` by variant, ``missing``
    variants (``why``: the changed files that explain a miss, by variant:
    :meth:`~kernel_cache.store.lookup.Lookup.why_missing`; ``refused``: for a
    miss whose entry was refused, ``(why, repair)`` naming its tier), ``sources`` (tier
    location -> variants), ``accepted`` build-only components, ``hits``
    (``id(tier)`` -> keys it served)."""

    runners: dict = field(default_factory=dict)
    missing: list = field(default_factory=list)
    why: dict = field(default_factory=dict)
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)
    sources: Counter = field(default_factory=Counter)
    accepted: dict = field(default_factory=dict)
    hits: dict[int, list[str]] = field(default_factory=dict)


def _find_plan(plan: Plan, lookup, cache_dir) -> _Found:
    """Look every item of ``plan`` up through ``lookup`` (a
    :class:`~kernel_cache.store.lookup.Lookup`) and load what is found.

    Raises:
        CorruptEntryError: naming the variant and the repair command.
        CpuTargetError: from :func:`check_cpu_features`.
    """
    from kernel_cache.store.lookup import merge_accepted

    config, out = plan.config, _Found()
    for item in plan:
        v = item.variant
        result = lookup.search(item.key)
        if result.failed is not None:
            e, fix = result.failed.error, repair_hint(result.failed.tier, config, cache_dir)
            raise CorruptEntryError(e.key, f"{e.reason} (variant {v}); {fix}", e.where)
        hit = result.found
        if hit is None:
            out.missing.append(v)
            out.why[v] = lookup.why_missing(item.key, result.changes)
            if result.rejected:
                out.refused[str(v)] = refused_reason(result, config, cache_dir)
            continue
        entry = hit.entry
        check_cpu_features(config, v, entry)
        out.runners[v] = load_package(entry.data, config.device, entry.where, entry.key)
        out.sources[hit.tier.location] += 1
        out.hits.setdefault(id(hit.tier), []).append(entry.key)
        merge_accepted(out.accepted, hit.accepted)
    return out


def repair_hint(tier, config, cache_dir=None) -> str:
    """The command that replaces a bad entry of ``tier`` (by its
    :attr:`~kernel_cache.store.base.Tier.repair`), for error messages
    (``config``: the EngineConfig; ``cache_dir``: the local cache given, if any)."""
    from kernel_cache.config.engine import config_to_cli
    from kernel_cache.trust.signing import ENV_SIGNING_KEY_FILE

    if tier.repair == "export":
        return f"export the bundle again: kernel-cache export {config_to_cli(config)} --out DIR"
    if tier.repair == "publish":
        return (
            f"repair with a builder holding {ENV_SIGNING_KEY_FILE}: kernel-cache warmup "
            f"{config_to_cli(config, cache_dir)} {tier.location_flag} {tier.location}"
        )
    return f"repair with: kernel-cache warmup {config_to_cli(config, cache_dir)}"


def refused_reason(result, config, cache_dir) -> tuple[str, str]:
    """``(why, repair)`` for a miss whose entry was refused (``result``, a
    :class:`~kernel_cache.store.lookup.Search`): the last refusal (the
    furthest tier: a remote after a refused local copy; untrusted: a
    signature; else corrupt) and its tier's repair, which names the tier (a
    remote by its URL)."""
    from kernel_cache.trust.signing import SignatureError

    e, tier = result.rejected[-1].error, result.rejected[-1].tier
    kind = "untrusted" if isinstance(e, SignatureError) else "corrupt"
    return (
        f"their entries in {tier.location} are {kind} ({e.reason})",
        repair_hint(tier, config, cache_dir),
    )


def signature_note(keyring) -> str:
    """What engine start and verify say about signatures: the key ids they were
    checked with, or that they were not (the insecure opt-out)."""
    from kernel_cache.trust.signing import ENV_ALLOW_UNSIGNED

    if keyring is None:
        return f"signatures not checked ({ENV_ALLOW_UNSIGNED}=1 or no shared tier)"
    return f"signatures checked with key {', '.join(keyring.keys)}"


def _log_accepted(accepted: dict) -> None:
    for name, a in accepted.items():
        log.info(
            "build-only component %s: accepted %s recorded at build time (looked up first: %s)",
            name,
            ", ".join(map(repr, a["stored"])),
            repr(a["here"]),
        )
