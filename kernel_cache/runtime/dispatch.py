"""Dispatch: the hot path an engine calls every step, with zero compiles.

:class:`AttentionRuntime` (made by :func:`kernel_cache.runtime.load.load_plan`)
picks buckets from host-side lengths (Python ints, lists, CPU tensors) with a
bisect, checks the inputs against the variant's static shapes (a static
AOTInductor kernel would run a wrong-shaped input silently), pads into
per-variant buffers that are reused across calls, runs the loaded kernel and
slices the output. It never reads a GPU scalar and never compiles. On CUDA a
call only enqueues its work (single-threaded AOTInductor runners, lengths copied
from pinned staging rows) and can be captured in a CUDA graph when the lengths
are passed as device tensors (``device_seq_lens``; ``device_seq_len`` and
``device_query_len``): docs/gpu.md, "The hot path on CUDA" and "CUDA graphs".
"""

from __future__ import annotations

from collections import Counter

import torch

from kernel_cache.config.engine import EngineConfig, config_to_cli
from kernel_cache.errors import ShapeError
from kernel_cache.plan.buckets import BATCHED_DECODE, PAGED_ATTENTION, Bucketer, KernelVariant
from kernel_cache.runtime.buffers import RING, VariantSlot, mapped_pinned_reads
from kernel_cache.runtime.checks import InputChecks
from kernel_cache.runtime.compiles import CompileCounter
from kernel_cache.runtime.declared import DeclaredSlots
from kernel_cache.torch_compat import stream_capture_query

#: torch.cuda.is_current_stream_capturing without its Python frame (hot path);
#: False on a torch built without CUDA. A torch built with CUDA that lacks it
#: fails here (TorchAPIDriftError) rather than run without the capture guard.
_capturing = stream_capture_query()

#: Rows of a staging ring's half (:data:`~kernel_cache.runtime.buffers.RING`):
#: the host waits for the GPU at most once per half.
_HALF = RING // 2


def _dead_ref():
    return None


class AttentionRuntime(InputChecks):
    """The attention object an engine calls, holding one loaded kernel per variant.

    The shape, dtype, device and layout checks of ``key_cache``/``value_cache``
    run once per pair of tensor objects (remembered by weak reference): changing
    a pool's metadata in place (``resize_``, ``set_``) after a call is not seen.

    ``counters``: ``loads`` (artifacts loaded at start), ``calls`` (per variant,
    a :class:`collections.Counter`), and what torch's own counters saw this
    process compile since ``compile_counter``'s baseline (the start of
    :func:`~kernel_cache.runtime.load.load_plan`, else construction): ``compiles``
    (Inductor graph compiles), ``dynamo_graphs``, and ``compile_stack_imported``
    (:mod:`kernel_cache.runtime.compiles`). This class has no compile path; the
    counts move when something else in the process compiles.
    """

    def __init__(
        self,
        config: EngineConfig,
        bucketer: Bucketer,
        runners: dict,
        load_seconds=0.0,
        compile_counter: CompileCounter | None = None,
        *,
        sources: dict[str, int] | None = None,
        build_only_accepted: dict[str, dict] | None = None,
        launch: dict | None = None,
        slot_params: dict | None = None,
    ):
        self.config = config
        self._compile_counter = compile_counter or CompileCounter()
        self.bucketer = bucketer
        self._runners = runners
        self._slots: dict = {}
        self.load_seconds = load_seconds
        #: Where the variants came from: ``{tier location: count}``.
        self.sources: dict[str, int] = dict(sources or {})
        #: Build-only components taken from stored records (see keys.BUILD_ONLY):
        #: ``{name: {"here": value, "stored": [values]}}``.
        self.build_only_accepted: dict[str, dict] = dict(build_only_accepted or {})
        #: ``{variant: resolved launch config}`` the loaded artifacts were compiled with.
        self.launch: dict = dict(launch or {})
        self._device = torch.device(config.device)
        self._dtype = config.torch_dtype()
        self._kv_dtype = config.kv_torch_dtype()
        self._kv_fp8 = config.kv_fp8
        c = config
        self._qshape = (c.num_heads, c.head_dim)
        self._kvshape = (c.block_size, c.num_kv_heads, c.head_dim)
        # The config is frozen: its limits read once (attribute lookups on the
        # pydantic model cost more than on the runtime).
        self._max_len, self._block, self._max_seqs = c.max_model_len, c.block_size, c.max_num_seqs
        # The KV pool passed last and found good, as weak references and their
        # layout: an engine passes the same two tensors on every call, so they are
        # checked once (again if their layout changes in place).
        self._kv_ok: tuple = (_dead_ref, _dead_ref, None, None)
        #: CPU only: check every block id against the pool before a kernel reads
        #: it (an id outside the pool aborts the process inside the kernel). One
        #: reduction over the padded table: about 2 us of a decode call's host
        #: time here (docs/benchmarks/dispatch.md, "Dispatch overhead"). An engine that
        #: builds its block tables itself may set it to False.
        self.check_block_ids = True
        #: CUDA only: False (the default) copies each call's host lengths from a
        #: pinned staging row to the device before the kernel; True lets the
        #: kernels read the pinned row in place where :func:`mapped_pinned_reads`
        #: passes, saving the copy's host time (9-16 us a decode call, H100 and
        #: H200) but costing GPU time, as every program reads the lengths over
        #: PCIe (decode 32 x 8192 on an H100: 27 us more for a bfloat16 pool,
        #: 37 us for fp8; docs/benchmarks/gpu-decode.md). Applies to variants
        #: not called yet.
        self.map_pinned_lengths = False
        #: The declared slots (:mod:`kernel_cache.runtime.declared`): :meth:`call`, :meth:`bind`.
        self.declared = DeclaredSlots(config, bucketer, runners, dict(slot_params or {}))

    @property
    def variants(self) -> tuple[KernelVariant, ...]:
        return tuple(self._runners)

    @property
    def counters(self) -> dict:
        """``{"loads", "calls": Counter(variant -> calls), "compiles", "dynamo_graphs",
        "compile_stack_imported"}`` (a snapshot; the class docstring says what each counts)."""
        calls = Counter({s.variant: s.calls for s in self._slots.values() if s.calls})
        calls.update(self.declared.calls())
        return {"loads": len(self._runners), "calls": calls, **self._compile_counter.read()}

    @staticmethod
    def _staging_row(slot: VariantSlot, name: str) -> int:
        """The index of ``slot``'s next pinned staging row, for the host to write
        this call's lengths into (``slot.ring_mv[i]`` / ``slot.ring_np[i]``);
        :meth:`_staged_lens` gives the kernel's length arguments for it and
        :meth:`_staged_done` hands the row to the GPU after the kernel is enqueued.

        The ring's two halves each have an event, recorded after the kernel of
        the half's last row; entering a half waits for that event of the
        previous lap, which has long completed unless the host is RING / 2 calls
        of this variant ahead of the GPU (then it waits, bounding the queue).
        Under CUDA-graph capture the graph would replay the lengths of the
        capture, so the lengths must come from the device instead.

        Raises: ShapeError under CUDA-graph capture (names ``name``).
        """
        if _capturing():
            raise ShapeError(
                f"capturing a CUDA graph: pass the lengths as device tensors ({name}=...) "
                "that the engine rewrites before each replay; host lengths would be baked "
                "into the graph (docs/gpu.md, 'CUDA graphs')"
            )
        i = slot.ring_i
        if i % _HALF == 0:
            slot.ring_events[i // _HALF].synchronize()
        return i

    @staticmethod
    def _staged_lens(slot: VariantSlot, i: int) -> tuple:
        """The kernel's length arguments holding staging row ``i``: views of the
        pinned row itself where kernels read it directly, else of the slot's
        device lengths after an enqueued copy of the row (pinned source)."""
        if slot.ring_args is not None:
            return slot.ring_args[i]
        slot.lens.copy_(slot.ring_rows[i], non_blocking=True)
        return slot.lens_views

    @staticmethod
    def _staged_done(slot: VariantSlot, i: int) -> None:
        """After the kernel that reads row ``i`` is enqueued: close the ring's half
        with an event at its last row, and move to the next row."""
        if i % _HALF == _HALF - 1:
            slot.ring_events[i // _HALF].record()
        slot.ring_i = (i + 1) % RING

    def _slot(self, kernel: str, query_len: int, num_blocks: int, num_seqs: int) -> VariantSlot:
        key = (kernel, query_len, num_blocks, num_seqs)
        slot = self._slots.get(key)
        if slot is None:
            v = KernelVariant(
                kernel=kernel, query_len=query_len, num_blocks=num_blocks, num_seqs=num_seqs
            )
            r = self._runners.get(v)
            if r is None:  # the plan was loaded partially (load_plan(strict=False))
                raise ShapeError(
                    f"variant {v} is not loaded; warm it up: kernel-cache warmup "
                    f"{config_to_cli(self.config)}"
                )
            mapped = self.map_pinned_lengths and mapped_pinned_reads(self._device)
            slot = self._slots[key] = VariantSlot(
                v, r, self.config, self._dtype, self._device, mapped
            )
        return slot

    # -- dispatch ----------------------------------------------------------
    def prefill(
        self,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_len: int,
        *,
        device_seq_len=None,
        device_query_len=None,
        k_scale=None,
        v_scale=None,
    ):
        """Attention for one sequence's chunk of ``query_len`` new tokens.

        Args:
            query: ``[query_len, num_heads, head_dim]``, the chunk's queries.
            key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``.
            block_table: 1-D int32 tensor, at least ``ceil(seq_len / block_size)`` blocks.
            seq_len: host int, KV tokens of the sequence including this chunk (tokens).
            device_seq_len, device_query_len: CUDA only, optional, both or
                neither: ``[1]`` int32 tensors on the device (each its own
                allocation: an input not 16-byte aligned is copied by the
                artifact) holding the KV length and the real query length, which
                the kernel then reads instead of a copy of the host values
                (``seq_len`` and ``query.shape[0]`` still pick the buckets and are
                checked; the device tensors are never read on the host). For CUDA
                graphs: see docs/gpu.md, "CUDA graphs".
            k_scale, v_scale: for an fp8 plan (``kv_cache_dtype="fp8_e4m3"``),
                required: 0-d or ``[1]`` float32 tensors on the plan's device,
                the per-tensor scales (a key reads as ``float(stored) *
                k_scale``); never read on the host, so a CUDA graph replays with
                their values at replay. For any other plan: None.

        Returns: ``[query_len, num_heads, head_dim]``.

        Raises:
            ShapeError: a shape, dtype or device mismatch, non-contiguous KV
                caches, a non-integer ``seq_len``, ``query_len > seq_len``, a length
                beyond the plan's limits (names the limit), bad device lengths, a
                CUDA-graph capture without device lengths, or (CPU only) a block
                id outside the pool; a missing, extra or malformed ``k_scale`` or
                ``v_scale``, or a pool whose dtype is not the plan's KV dtype.
        """
        self._check(query, key_cache, value_cache)
        scales = self._scales(k_scale, v_scale)
        q = query.shape[0]
        seq_len = self._prefill_seq_len(seq_len, q)
        need = -(-seq_len // self._block)
        nb = self.bucketer.blocks_bucket(need)
        qb = self.bucketer.query_bucket(q)
        width = block_table.shape[0] if block_table.dim() == 1 else -1
        if width < need or block_table.dtype != torch.int32:
            raise ShapeError(
                f"block_table shape {tuple(block_table.shape)} {block_table.dtype}:"
                f" expected 1-D int32 with at least {need} blocks"
            )
        slot = self._slot(PAGED_ATTENTION, qb, nb, 1)
        if q == qb and query.is_contiguous():
            qin = query
        else:
            qin = slot.qbuf
            qin[:q].copy_(query)
        btbuf = self._prefill_table(slot, block_table, width, nb)
        if self.check_block_ids and slot.bt_max is not None:
            self._check_block_ids("block_table", slot, key_cache)
        i = None
        if device_seq_len is not None or device_query_len is not None:
            self._check_device_lens("device_seq_len", device_seq_len, 1)
            self._check_device_lens("device_query_len", device_query_len, 1)
            lq, lq2 = device_seq_len, device_query_len
        elif slot.ring is None:  # CPU: the kernel reads the host buffer itself
            slot.lens_arr[0] = seq_len
            slot.lens_arr[1] = q
            lq, lq2 = slot.lens_views
        else:
            i = self._staging_row(slot, "device_seq_len, device_query_len")
            row = slot.ring_mv[i]
            row[0] = seq_len
            row[4] = q
            lq, lq2 = self._staged_lens(slot, i)
        slot.calls += 1  # counted when the kernel runs, not for a refused call
        out = slot.runner.run([qin, key_cache, value_cache, btbuf, lq, lq2, *scales])[0]
        if i is not None:
            self._staged_done(slot, i)
        return out[:q] if q != qb else out

    @staticmethod
    def _prefill_table(slot: VariantSlot, block_table, width: int, nb: int):
        """The ``[nb]`` block table the kernel reads: on CUDA the engine's own
        when it is exactly ``nb`` wide and contiguous (ids not checked), else the
        slot's buffer holding its first ``nb`` ids, zero-padded."""
        btbuf = slot.btbuf
        if width == nb and slot.ring is not None and block_table.is_cuda:
            if block_table.is_contiguous():
                return block_table
        if width >= nb:
            btbuf.copy_(block_table if width == nb else block_table[:nb])
        else:
            btbuf[:width].copy_(block_table)
            btbuf[width:].zero_()
        return btbuf

    def decode(
        self,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        *,
        device_seq_lens=None,
        k_scale=None,
        v_scale=None,
    ):
        """One decode step for a batch of sequences.

        Args:
            query: ``[num_seqs, num_heads, head_dim]``.
            key_cache, value_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``.
            block_tables: ``[num_seqs, >= max blocks]`` int32.
            seq_lens: host-side KV lengths in tokens (list of ints or a CPU tensor),
                the query token included. Never a GPU tensor (reading it would sync).
            device_seq_lens: CUDA only, optional: ``[num_seqs]`` int32 on the device
                holding the lengths the kernel reads instead of a copy of
                ``seq_lens`` (which still picks the bucket and is checked;
                ``device_seq_lens`` is never read on the host). A 0 in it makes
                that row's output zeros. For CUDA graphs: see docs/gpu.md,
                "CUDA graphs".
            k_scale, v_scale: as in :meth:`prefill` (required for an fp8 plan,
                None otherwise).

        Returns: ``[num_seqs, num_heads, head_dim]``.

        Raises:
            ShapeError: shapes, dtypes, non-contiguous KV caches, a GPU ``seq_lens``,
                a length below 1 or not an integer, ``num_seqs > max_num_seqs``,
                ``seq_len > max_model_len``, a bad ``device_seq_lens``, a CUDA-graph
                capture without ``device_seq_lens``, (CPU only) a block id
                outside the pool, or bad scales or pool dtype (as :meth:`prefill`).

        Not thread-safe: a runtime reuses its padding buffers across calls; give
        each thread its own runtime (``load_plan``) or serialize calls.
        """
        self._check(query, key_cache, value_cache)
        scales = self._scales(k_scale, v_scale)
        s = query.shape[0]
        lens_arr, longest = self._decode_seq_lens(seq_lens, s)
        if s > self._max_seqs:
            raise ShapeError(
                f"num_seqs {s} is above max_num_seqs {self._max_seqs}; "
                "raise --max-num-seqs and warm up"
            )
        need = max(1, -(-longest // self._block))
        shape = block_tables.shape
        if len(shape) != 2 or shape[0] != s or shape[1] < need or block_tables.dtype != torch.int32:
            raise ShapeError(
                f"block_tables shape {tuple(block_tables.shape)} "
                f"{block_tables.dtype}: expected [{s}, >= {need}] int32"
            )
        if not self.bucketer.num_seqs_buckets:
            if device_seq_lens is not None:
                raise ShapeError(
                    "device_seq_lens needs a plan with num_seqs buckets (batched_decode); "
                    "this plan decodes one sequence at a time through prefill"
                )
            return self._decode_per_sequence(
                query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale
            )
        sb = self.bucketer.num_seqs_bucket(s)
        slot = self._slot(BATCHED_DECODE, 1, self.bucketer.blocks_bucket(need), sb)
        if s == sb and query.is_contiguous():
            qin = query
        else:
            qin = slot.qbuf
            rows = slot.rows.get(s) or slot.row_views(s)
            rows[0].copy_(query)
        btbuf = self._decode_tables(slot, block_tables, s)
        if self.check_block_ids and slot.bt_max is not None:
            self._check_block_ids("block_tables", slot, key_cache)
        i = None
        if device_seq_lens is not None:
            lens = self._decode_device_lens(slot, device_seq_lens, s)
        else:
            lens, i = self._decode_host_lens(slot, seq_lens, lens_arr, s)
        slot.calls += 1
        out = slot.runner.run([qin, key_cache, value_cache, btbuf, lens, *scales])[0]
        if i is not None:
            self._staged_done(slot, i)
        return out[:s] if s != sb else out

    @staticmethod
    def _decode_tables(slot: VariantSlot, block_tables, s: int):
        """The ``[num_seqs bucket, nb]`` block tables the kernel reads: on CUDA the
        engine's own when they are exactly that shape and contiguous (ids not
        checked), else the slot's buffer holding the first ``nb`` ids of each of
        the ``s`` rows, zero-padded, with rows past ``s`` reset to block 0."""
        btbuf = slot.btbuf
        sb, nb = slot.num_seqs, slot.num_blocks
        width = block_tables.shape[1]
        if s == sb and width == nb and slot.ring is not None and block_tables.is_cuda:
            if block_tables.is_contiguous():
                return block_tables
        src = block_tables if width == nb else block_tables[:, :nb] if width > nb else None
        if s == sb and src is not None:
            btbuf.copy_(src)
        elif src is not None:
            rows = slot.rows.get(s) or slot.row_views(s)
            rows[1].copy_(src)
        else:
            btbuf[:s, :width].copy_(block_tables)
            btbuf[:s, width:].zero_()
        if s < slot.bt_rows:  # rows of earlier, larger batches: reset to block 0
            btbuf[s : slot.bt_rows].zero_()
        slot.bt_rows = s
        return btbuf

    def _decode_host_lens(self, slot: VariantSlot, seq_lens, lens_arr, s: int) -> tuple:
        """Write the ``s`` host lengths (``lens_arr``, or the CPU tensor
        ``seq_lens`` where it is None) and 0 past them up to the bucket:
        ``(kernel's lengths argument, staging row index or None)``. On the CPU
        into the slot's host buffer, which the kernel reads; on CUDA into the
        next pinned staging row (:meth:`_staging_row`: raises ShapeError under
        CUDA-graph capture); the caller calls :meth:`_staged_done` after the
        kernel is enqueued."""
        sb = slot.num_seqs
        if slot.ring is None:
            if lens_arr is None:
                slot.lens_host[:s].copy_(seq_lens)
            else:
                slot.lens_arr[:s] = lens_arr
            if s < sb:
                slot.lens_arr[s:] = slot.zeros[: sb - s]
            return slot.lens, None
        i = self._staging_row(slot, "device_seq_lens")
        if lens_arr is None:
            row = slot.ring_np[i]
            row[:s] = seq_lens.numpy()
            row[s:sb] = 0
        else:
            row = slot.ring_mv[i]
            row[:s] = lens_arr
            if s < sb:
                row[s:sb] = slot.zeros[: sb - s]
        return self._staged_lens(slot, i)[0], i

    def _decode_device_lens(self, slot: VariantSlot, device_seq_lens, s: int):
        """``device_seq_lens`` (checked: ``[s]`` int32 on the device) as the
        kernel's ``[num_seqs bucket]`` lengths: itself for a full bucket, else
        copied into the slot's device lengths with 0 (nothing read) past ``s``."""
        self._check_device_lens("device_seq_lens", device_seq_lens, s)
        if s == slot.num_seqs:
            return device_seq_lens
        lens = slot.lens_views[0]
        lens[:s].copy_(device_seq_lens)
        lens[s:].zero_()
        return lens

    def _decode_per_sequence(
        self, query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale
    ):
        lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
        kw = {"k_scale": k_scale, "v_scale": v_scale}
        outs = [
            self.prefill(query[i : i + 1], key_cache, value_cache, block_tables[i], n, **kw)
            for i, n in enumerate(lens)
        ]
        return torch.cat(outs, dim=0)

    # -- declared slots ------------------------------------------------------
    def bind(self, slot: str, weights) -> None:
        """Bind the weights of declared slot ``slot``: its ``torch.nn.Module`` or a
        state dict, checked once against the parameters and buffers (names,
        shapes, dtypes) its entries recorded, then used by every :meth:`call`.

        Raises:
            ShapeError: an unknown slot, or a parameter missing, unexpected or of
                another shape, dtype or device (names it and the fix).
        """
        self.declared.bind(slot, weights)

    def prepare(self, slot: str, weights):
        """Check ``weights`` of declared slot ``slot`` once, as :meth:`bind` does,
        and return them for ``call(slot, ..., weights=...)``: one set per layer
        of a model whose layers share one slot, with no check per call.

        Raises:
            ShapeError: as :meth:`bind`.
        """
        return self.declared.prepare(slot, weights)

    def call(self, slot: str, *inputs, weights=None):
        """Run declared slot ``slot`` (``config.slots``) on its declared ``inputs``:
        picks the bucket from their host-side shapes, pads into reused buffers,
        runs the loaded artifact with the bound weights (or ``weights``: from
        :meth:`prepare`, or a module or state dict checked at this call) and
        returns the output's real rows. Never compiles.

        Raises:
            ShapeError: an unknown slot, no weights, an input that does not match
                the declared spec or is beyond the plan's buckets, or a variant not
                loaded (:mod:`kernel_cache.runtime.declared`).
        """
        return self.declared.call(slot, *inputs, weights=weights)

    def stats(self) -> dict:
        """Counters as JSON-ready data."""
        c = self.counters
        return {
            "loads": c["loads"],
            "compiles": c["compiles"],
            "dynamo_graphs": c["dynamo_graphs"],
            "compile_stack_imported": c["compile_stack_imported"],
            "calls": {str(v): n for v, n in sorted(c["calls"].items(), key=str)},
            "load_seconds": round(self.load_seconds, 4),
            "sources": dict(self.sources),
            "build_only_accepted": self.build_only_accepted,
        }
