"""Engine start and dispatch: load a plan's artifacts, then serve with zero compiles.

:func:`load_plan` loads every variant of a plan through AOTInductor's package
loader (``torch._C._aoti.AOTIModelPackageLoader``), which imports neither
Dynamo nor Inductor's compiler, and returns an :class:`AttentionRuntime`.

Dispatch (:meth:`AttentionRuntime.prefill`, :meth:`AttentionRuntime.decode`)
picks buckets from host-side lengths (Python ints, lists, CPU tensors) with a
bisect, checks the inputs against the variant's static shapes (a static
AOTInductor kernel would run a wrong-shaped input silently), pads into
per-variant buffers that are reused across calls, runs the loaded kernel and
slices the output. It never reads a GPU scalar and never compiles.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from .buckets import BATCHED_DECODE, PAGED_ATTENTION, Bucketer, KernelVariant
from .config import EngineConfig, config_to_cli
from .errors import CorruptEntryError, MissingVariantsError, ShapeError
from .keys import build_key, environment
from .launch import resolve_plan
from .store import DiskTier, Tier, default_cache_dir, verify_entry

log = logging.getLogger("kernel_cache")


def load_package(data: bytes, device: str, where: str = "", key: str = ""):
    """Load verified ``.pt2`` bytes with the AOTInductor runtime loader.

    The bytes go to a private temporary file (``tempfile``, never the cache
    directory, which may be read-only), are loaded, and the file is removed.

    Raises:
        CorruptEntryError: the loader rejected the package.
    """
    fd, path = tempfile.mkstemp(suffix=".pt2", prefix="kernel_cache-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        device_index = torch.cuda.current_device() if device == "cuda" else -1
        try:
            return torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, device_index)
        except Exception as e:  # the loader raises RuntimeError for bad zips
            raise CorruptEntryError(
                key, f"the AOTInductor loader rejected it: {e}", where
            ) from None
    finally:
        Path(path).unlink(missing_ok=True)


def fetch_entry(tiers: list[Tier], key: str):
    """The first verified entry for ``key`` across ``tiers`` (in order), or None.

    Raises:
        CorruptEntryError: an entry exists but fails verification.
    """
    for tier in tiers:
        entry = tier.get(key)
        if entry is not None:
            verify_entry(entry)
            return entry
    return None


class AttentionRuntime:
    """The attention object an engine calls, holding one loaded kernel per variant.

    ``counters``: ``loads`` (artifacts loaded at start), ``calls`` (per variant,
    a :class:`collections.Counter`), ``compiles`` (always 0: this class has no
    compile path).
    """

    def __init__(self, config: EngineConfig, bucketer: Bucketer, runners: dict, load_seconds=0.0):
        self.config = config
        self.bucketer = bucketer
        self._runners = runners
        self._buffers: dict = {}
        self.counters = {"loads": len(runners), "calls": Counter(), "compiles": 0}
        self.load_seconds = load_seconds
        #: Where the variants came from: ``{tier location: count}``.
        self.sources: dict[str, int] = {}
        #: Build-only components taken from stored records (see keys.BUILD_ONLY):
        #: ``{name: {"here": value, "stored": [values]}}``.
        self.build_only_accepted: dict[str, dict] = {}
        #: ``{variant: resolved launch config}`` the loaded artifacts were compiled with.
        self.launch: dict = {}
        self._device = torch.device(config.device)
        self._dtype = config.torch_dtype()
        c = config
        self._qshape = (c.num_heads, c.head_dim)
        self._kvshape = (c.block_size, c.num_kv_heads, c.head_dim)

    @property
    def variants(self) -> tuple[KernelVariant, ...]:
        return tuple(self._runners)

    # -- checks ------------------------------------------------------------
    def _check(self, query, key_cache, value_cache):
        if query.dim() != 3 or tuple(query.shape[1:]) != self._qshape:
            raise ShapeError(
                f"query shape {tuple(query.shape)}: expected [n, num_heads, "
                f"head_dim] = [n, {self._qshape[0]}, {self._qshape[1]}]"
            )
        if query.dtype != self._dtype or query.device.type != self._device.type:
            raise ShapeError(
                f"query is {query.dtype} on {query.device}; the plan is "
                f"{self._dtype} on {self._device.type}"
            )
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if t.dim() != 4 or tuple(t.shape[1:]) != self._kvshape:
                raise ShapeError(
                    f"{name} shape {tuple(t.shape)}: expected [num_pool_blocks, block_size, "
                    f"num_kv_heads, head_dim] = [P, {', '.join(map(str, self._kvshape))}]"
                )
            if t.dtype != self._dtype or t.device.type != self._device.type:
                raise ShapeError(
                    f"{name} is {t.dtype} on {t.device}; the plan is "
                    f"{self._dtype} on {self._device.type}"
                )

    def _buffers_for(self, v: KernelVariant):
        buf = self._buffers.get(v)
        if buf is None:
            dev, c = self._device, self.config
            q = torch.zeros(
                (v.query_len * v.num_seqs, c.num_heads, c.head_dim), dtype=self._dtype, device=dev
            )
            if v.kernel == PAGED_ATTENTION:
                bt = torch.zeros((v.num_blocks,), dtype=torch.int32, device=dev)
                lens = torch.zeros((2,), dtype=torch.int32, device=dev)
            else:
                bt = torch.zeros((v.num_seqs, v.num_blocks), dtype=torch.int32, device=dev)
                lens = torch.zeros((v.num_seqs,), dtype=torch.int32, device=dev)
            buf = self._buffers[v] = (q, bt, lens)
        return buf

    def _runner(self, v: KernelVariant):
        r = self._runners.get(v)
        if r is None:  # the plan was loaded partially (load_plan(strict=False))
            raise ShapeError(
                f"variant {v} is not loaded; warm it up: kernel-cache warmup "
                f"{config_to_cli(self.config)}"
            )
        self.counters["calls"][v] += 1
        return r

    # -- dispatch ----------------------------------------------------------
    def prefill(self, query, key_cache, value_cache, block_table, seq_len: int):
        """Attention for one sequence's chunk of ``query_len`` new tokens.

        Args:
            query: ``[query_len, num_heads, head_dim]``, the chunk's queries.
            key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``.
            block_table: 1-D int32 tensor, at least ``ceil(seq_len / block_size)`` blocks.
            seq_len: host int, KV tokens of the sequence including this chunk (tokens).

        Returns: ``[query_len, num_heads, head_dim]``.

        Raises:
            ShapeError: a shape, dtype or device mismatch, ``query_len > seq_len``,
                or a length beyond the plan's limits (names the limit).
        """
        self._check(query, key_cache, value_cache)
        q = query.shape[0]
        seq_len = int(seq_len)
        if not 1 <= q <= seq_len:
            raise ShapeError(f"query_len {q} must be between 1 and seq_len {seq_len}")
        if seq_len > self.config.max_model_len:
            raise ShapeError(
                f"seq_len {seq_len} is above max_model_len {self.config.max_model_len}"
            )
        bs = self.config.block_size
        need = -(-seq_len // bs)
        nb = self.bucketer.blocks_bucket(need)
        qb = self.bucketer.query_bucket(q)
        if (
            block_table.dim() != 1
            or block_table.shape[0] < need
            or block_table.dtype != torch.int32
        ):
            raise ShapeError(
                f"block_table shape {tuple(block_table.shape)} {block_table.dtype}:"
                f" expected 1-D int32 with at least {need} blocks"
            )
        v = KernelVariant(kernel=PAGED_ATTENTION, query_len=qb, num_blocks=nb, num_seqs=1)
        runner = self._runner(v)
        qbuf, btbuf, lens = self._buffers_for(v)
        if q == qb:
            qin = query
        else:
            qbuf[:q].copy_(query)
            qin = qbuf
        w = min(nb, block_table.shape[0])
        btbuf[:w].copy_(block_table[:w])
        if w < nb:
            btbuf[w:].zero_()
        lens[0] = seq_len
        lens[1] = q
        out = runner.run([qin, key_cache, value_cache, btbuf, lens[0:1], lens[1:2]])[0]
        return out[:q] if q != qb else out

    def decode(self, query, key_cache, value_cache, block_tables, seq_lens):
        """One decode step for a batch of sequences.

        Args:
            query: ``[num_seqs, num_heads, head_dim]``.
            key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``.
            block_tables: ``[num_seqs, >= max blocks]`` int32.
            seq_lens: host-side KV lengths in tokens (list of ints or a CPU tensor),
                the query token included. Never a GPU tensor (reading it would sync).

        Returns: ``[num_seqs, num_heads, head_dim]``.

        Raises:
            ShapeError: shapes, dtypes, a GPU ``seq_lens``, ``num_seqs > max_num_seqs``
                or ``seq_len > max_model_len``.
        """
        self._check(query, key_cache, value_cache)
        s = query.shape[0]
        if isinstance(seq_lens, torch.Tensor):
            if seq_lens.device.type != "cpu":
                raise ShapeError(
                    "seq_lens must be host-side (a list or a CPU tensor); "
                    "reading a GPU tensor would synchronize the device"
                )
            if seq_lens.numel() != s:
                raise ShapeError(f"seq_lens has {seq_lens.numel()} entries for {s} queries")
            longest = int(seq_lens.max()) if s else 0
            lens_t = seq_lens.to(torch.int32)
        else:
            if len(seq_lens) != s:
                raise ShapeError(f"seq_lens has {len(seq_lens)} entries for {s} queries")
            longest = max(seq_lens) if s else 0
            lens_t = None
        if longest > self.config.max_model_len:
            raise ShapeError(
                f"seq_len {longest} is above max_model_len "
                f"{self.config.max_model_len}; raise --max-model-len and warm up"
            )
        if s > self.config.max_num_seqs:
            raise ShapeError(f"num_seqs {s} is above max_num_seqs {self.config.max_num_seqs}")
        bs = self.config.block_size
        need = max(1, -(-longest // bs))
        if (
            block_tables.dim() != 2
            or block_tables.shape[0] != s
            or block_tables.shape[1] < need
            or block_tables.dtype != torch.int32
        ):
            raise ShapeError(
                f"block_tables shape {tuple(block_tables.shape)} "
                f"{block_tables.dtype}: expected [{s}, >= {need}] int32"
            )
        if not self.bucketer.num_seqs_buckets:
            return self._decode_per_sequence(query, key_cache, value_cache, block_tables, seq_lens)
        nb = self.bucketer.blocks_bucket(need)
        sb = self.bucketer.num_seqs_bucket(s)
        v = KernelVariant(kernel=BATCHED_DECODE, query_len=1, num_blocks=nb, num_seqs=sb)
        runner = self._runner(v)
        qbuf, btbuf, lbuf = self._buffers_for(v)
        w = min(nb, block_tables.shape[1])
        qbuf[:s].copy_(query)
        btbuf[:s, :w].copy_(block_tables[:, :w])
        if w < nb:
            btbuf[:s, w:].zero_()
        if lens_t is None:
            lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        lbuf[:s].copy_(lens_t, non_blocking=True)
        if s < sb:
            lbuf[s:].zero_()
            btbuf[s:].zero_()
        out = runner.run([qbuf, key_cache, value_cache, btbuf, lbuf])[0]
        return out[:s]

    def _decode_per_sequence(self, query, key_cache, value_cache, block_tables, seq_lens):
        lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
        outs = [
            self.prefill(query[i : i + 1], key_cache, value_cache, block_tables[i], n)
            for i, n in enumerate(lens)
        ]
        return torch.cat(outs, dim=0)

    def stats(self) -> dict:
        """Counters as JSON-ready data."""
        return {
            "loads": self.counters["loads"],
            "compiles": self.counters["compiles"],
            "calls": {str(v): n for v, n in sorted(self.counters["calls"].items(), key=str)},
            "load_seconds": round(self.load_seconds, 4),
            "sources": dict(self.sources),
            "build_only_accepted": self.build_only_accepted,
        }


def default_tiers(
    cache_dir=None, bundles=None, *, allow_shared_dir: bool | None = None
) -> list[Tier]:
    """The lookup order at engine start: bundles (``bundles``, i.e. ``--bundle``,
    then ``$KERNEL_CACHE_BUNDLE``), then the local disk cache.

    The local cache is opened only if its directory exists: engine start never
    creates a cache directory. It is opened read-only (no lock, database, journal
    or temporary file is created in it) and its trust is checked
    (:mod:`kernel_cache.trust`; ``allow_shared_dir`` opts out).

    Raises:
        BundleError: a bundle path is not a bundle (names it).
    """
    from .bundle import BundleTier, bundle_paths

    tiers: list[Tier] = [BundleTier(p) for p in bundle_paths(bundles)]
    directory = Path(cache_dir) if cache_dir else default_cache_dir()
    if directory.is_dir():
        tiers.append(DiskTier(directory, read_only=True, allow_shared=allow_shared_dir))
    return tiers


def record_lookups(tiers: list[Tier], hits: dict[int, list[str]], misses: int) -> None:
    """Best-effort usage records (kernel_cache.usage) for the local disk tiers:
    ``hits`` maps ``id(tier)`` to the keys it served; misses go to the first
    disk tier. Never raises, never writes to a read-only directory."""
    from . import usage

    first = True
    for tier in tiers:
        if isinstance(tier, DiskTier):
            usage.record(tier.directory, hits=hits.get(id(tier), ()), misses=misses if first else 0)
            first = False


def load_plan(
    config: EngineConfig,
    cache_dir=None,
    *,
    tiers: list[Tier] | None = None,
    bundles=None,
    strict: bool = True,
    allow_shared_dir: bool | None = None,
) -> AttentionRuntime:
    """Engine start: load every variant of ``config``'s plan and return the runtime.

    Lookup (:class:`kernel_cache.lookup.Lookup`): each tier in order, the exact
    key first, then an entry equal in every runtime component that was built
    with another C++ compiler (``cxx`` is build-only; the accepted values are
    logged at INFO and reported in ``stats()["build_only_accepted"]``).

    Args:
        config: the engine configuration (its bucketer defines the plan).
        cache_dir: the local cache (default ``$KERNEL_CACHE_DIR`` or
            ``~/.cache/kernel_cache``); ignored when ``tiers`` is given.
        bundles: bundle directories searched before the local cache, in
            addition to ``$KERNEL_CACHE_BUNDLE``; ignored when ``tiers`` is given.
        strict: raise on missing variants (default); with False, load what is there.
        allow_shared_dir: skip the trust checks of the cache directory (default
            ``KERNEL_CACHE_INSECURE_ALLOW_SHARED_DIR``; see :mod:`kernel_cache.trust`).

    Raises:
        MissingVariantsError: variants not in any tier, with the warmup command.
        CorruptEntryError: an entry failed verification (names it and the repair).
        BundleError: a bundle path is not a bundle.
        UntrustedCacheError: the directory or an entry file is writable by other
            users or owned by another user (names the path and the fix).
    """
    from .lookup import Lookup, merge_accepted

    t0 = time.perf_counter()
    bucketer = Bucketer(config)
    tiers = (
        default_tiers(cache_dir, bundles, allow_shared_dir=allow_shared_dir)
        if tiers is None
        else tiers
    )
    env = environment(config.device)
    lookup = Lookup(tiers)
    launch = resolve_plan(config, bucketer.variants, env["device_arch"])
    runners, missing = {}, []
    sources: Counter = Counter()
    accepted: dict = {}
    hits: dict[int, list[str]] = {}
    for v in bucketer.variants:
        key = build_key(config, v, env, launch=launch[v].config)
        try:
            found = lookup.find(key)
        except CorruptEntryError as e:
            bundle = any(t.name == "bundle" and t.location == e.where for t in tiers)
            fix = (
                f"export the bundle again: kernel-cache export {config_to_cli(config)} --out DIR"
                if bundle
                else f"repair with: kernel-cache warmup {config_to_cli(config, cache_dir)}"
            )
            raise CorruptEntryError(e.key, f"{e.reason} (variant {v}); {fix}", e.where) from None
        if found is None:
            missing.append(v)
            continue
        entry = found.entry
        runners[v] = load_package(entry.data, config.device, entry.where, entry.key)
        sources[found.tier.location] += 1
        hits.setdefault(id(found.tier), []).append(entry.key)
        merge_accepted(accepted, found.accepted)
    record_lookups(tiers, hits, len(missing))
    if missing and strict:
        raise MissingVariantsError(
            missing, f"kernel-cache warmup {config_to_cli(config, cache_dir)}"
        )
    rt = AttentionRuntime(config, bucketer, runners, time.perf_counter() - t0)
    rt.launch = {v: r.config for v, r in launch.items()}
    rt.sources = dict(sources)
    rt.build_only_accepted = accepted
    for name, a in accepted.items():
        log.info(
            "build-only component %s: accepted %s recorded at build time (this process: %s)",
            name,
            ", ".join(map(repr, a["stored"])),
            repr(a["here"]),
        )
    log.info("loaded %d variants in %.3f s from %s", len(runners), rt.load_seconds, dict(sources))
    return rt
