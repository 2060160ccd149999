"""Input checks of the dispatch hot path: shapes, dtypes, devices and layout of
the query and the KV pool, host lengths against the plan's limits, block ids
against the pool (CPU), device lengths (CUDA). A mixin of
:class:`kernel_cache.runtime.dispatch.AttentionRuntime`, whose attributes it
reads (``_qshape``, ``_kvshape``, ``_dtype``, ``_kv_dtype``, ``_kv_fp8``,
``_device``, ``_kv_ok``, ``_max_len``); every check raises :class:`~kernel_cache.errors.ShapeError`.
"""

from __future__ import annotations

import numbers
import operator
import weakref
from array import array

import torch

from kernel_cache.errors import ShapeError
from kernel_cache.runtime.buffers import VariantSlot

_FP8 = torch.float8_e4m3fn


def _layout(t) -> tuple:
    """What the pool checks depend on and an in-place change can alter: storage
    address and size, sizes, strides, dtype (host-side metadata; no device
    access)."""
    return (t.data_ptr(), t.untyped_storage().nbytes(), t.shape, t.stride(), t.dtype)


class InputChecks:
    """The checks :class:`~kernel_cache.runtime.dispatch.AttentionRuntime` runs
    per call (see the module docstring)."""

    def _check(self, query, key_cache, value_cache):
        # shape[1:] of any tensor that is not [n, num_heads, head_dim] differs
        # from the tuple (length or entries): no dim() call needed.
        if query.shape[1:] != self._qshape:
            raise ShapeError(
                f"query shape {tuple(query.shape)}: expected [n, num_heads, "
                f"head_dim] = [n, {self._qshape[0]}, {self._qshape[1]}]"
            )
        # t.is_cuda / t.is_cpu: a device object per check (t.device.type) costs
        # about half a microsecond, three times per call.
        dt, cuda = self._dtype, self._device.type == "cuda"
        if query.dtype != dt or not (query.is_cuda if cuda else query.is_cpu):
            raise ShapeError(
                f"query is {query.dtype} on {query.device}; the plan is "
                f"{self._dtype} on {self._device.type}"
            )
        # The pool tensors are checked once; later calls with the same objects skip
        # the checks unless the tensors' layout changed in place since (a ``.data``
        # swap, as ``nn.Module.to`` does to a parameter, ``resize_``,
        # ``as_strided_``, a storage resized under the tensor): storage address
        # and size, sizes, strides and dtype are compared.
        ok = self._kv_ok
        if (
            ok[0]() is key_cache
            and ok[1]() is value_cache
            and ok[2] == _layout(key_cache)
            and ok[3] == _layout(value_cache)
        ):
            return
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if t.dim() != 4 or t.shape[1:] != self._kvshape:
                raise ShapeError(
                    f"{name} shape {tuple(t.shape)}: expected [num_pool_blocks, block_size, "
                    f"num_kv_heads, head_dim] = [P, {', '.join(map(str, self._kvshape))}]"
                )
            if t.dtype != self._kv_dtype:
                other = "auto" if t.dtype == dt else "fp8_e4m3" if t.dtype == _FP8 else None
                hint = (
                    f", or warm up and load a plan with --kv-cache-dtype {other}" if other else ""
                )
                raise ShapeError(
                    f"{name} is {t.dtype}; the plan's KV pool is {self._kv_dtype} "
                    f"(dtype={self.config.dtype}, kv_cache_dtype={self.config.kv_cache_dtype}): "
                    f"pass a pool of {self._kv_dtype}{hint}"
                )
            if not (t.is_cuda if cuda else t.is_cpu):
                raise ShapeError(
                    f"{name} is {t.dtype} on {t.device}; the plan is "
                    f"{self._kv_dtype} on {self._device.type}"
                )
            need = (t.storage_offset() + t.numel()) * t.element_size()
            have = t.untyped_storage().nbytes()
            if have < need:
                # A storage shrunk under the tensor (untyped_storage().resize_): the
                # kernels would read past its end.
                raise ShapeError(
                    f"{name}'s storage holds {have} bytes, fewer than its sizes "
                    f"{tuple(t.shape)} need ({need}): pass a pool tensor that owns its memory"
                )
            if t.is_neg() or t.is_conj():
                # A lazy negation or conjugation view: the kernels read the memory
                # as it is, without the pending operation.
                raise ShapeError(
                    f"{name} is a negated or conjugated view (is_neg() or is_conj() is True): "
                    "the kernels read its memory as stored; pass .resolve_neg() / "
                    ".resolve_conj() of it"
                )
            if not t.is_contiguous():
                # The artifacts were compiled for the contiguous paged layout; a
                # strided view (a slice of a larger pool, a permuted tensor) would be
                # read with the wrong strides.
                raise ShapeError(
                    f"{name} is not contiguous (strides {tuple(t.stride())}); the kernels "
                    "read the contiguous [num_pool_blocks, block_size, num_kv_heads, "
                    "head_dim] layout: pass the pool tensor itself or .contiguous()"
                )
        if key_cache.shape[0] != value_cache.shape[0]:
            # One dynamic num_pool_blocks for both in every artifact, and block ids
            # are checked against key_cache only: a smaller value_cache is read
            # past its end.
            raise ShapeError(
                f"key_cache has {key_cache.shape[0]} pool blocks and value_cache "
                f"{value_cache.shape[0]}; the two caches must be one pool "
                "(equal num_pool_blocks)"
            )
        self._kv_ok = (
            weakref.ref(key_cache),
            weakref.ref(value_cache),
            _layout(key_cache),
            _layout(value_cache),
        )

    def _scales(self, k_scale, v_scale) -> tuple:
        """The kernel's scale arguments: ``(k_scale, v_scale)`` as ``[1]`` float32
        tensors for an fp8 plan, ``()`` for a plan whose pool is in the model
        dtype. Metadata only (the values are never read: no GPU sync, and a CUDA
        graph replays whatever the tensors hold then).

        Raises:
            ShapeError: a scale missing for an fp8 plan, a scale given to another
                plan, or one that is not a 1-element float32 tensor on the plan's
                device (names the input, what it is and the fix).
        """
        if not self._kv_fp8:
            if k_scale is not None or v_scale is not None:
                name = "k_scale" if k_scale is not None else "v_scale"
                raise ShapeError(
                    f"{name} was given, but this plan's KV pool is {self._kv_dtype} "
                    f"(kv_cache_dtype={self.config.kv_cache_dtype}), which takes no scales: "
                    "drop k_scale and v_scale, or warm up and load a plan with "
                    "--kv-cache-dtype fp8_e4m3"
                )
            return ()
        out = []
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is None:
                raise ShapeError(
                    f"{name} is missing: this plan's KV pool is float8_e4m3fn "
                    "(kv_cache_dtype=fp8_e4m3) and reads float(stored) * scale; pass "
                    f"{name}=torch.tensor([s], dtype=torch.float32, "
                    f"device={self._device.type!r}) with both k_scale and v_scale"
                )
            if not isinstance(t, torch.Tensor):
                # a number goes into the fix as it is; anything else (a list, a
                # string) would make a fix the check refuses
                s = repr(t) if isinstance(t, numbers.Real) and not isinstance(t, bool) else "s"
                raise ShapeError(
                    f"{name}={t!r} is a {type(t).__name__}; expected a 1-element "
                    f"torch.float32 tensor on {self._device.type} (a tensor, so that a "
                    f"CUDA graph reads its value at replay): torch.tensor([{s}], "
                    f"dtype=torch.float32, device={self._device.type!r})"
                )
            cuda = self._device.type == "cuda"
            if (
                t.numel() != 1
                or t.dim() > 1
                or t.dtype != torch.float32
                or not (t.is_cuda if cuda else t.is_cpu)
            ):
                raise ShapeError(
                    f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; expected a "
                    f"0-d or [1] torch.float32 tensor on the plan's device "
                    f"({self._device.type})"
                )
            out.append(t if t.dim() == 1 else t.view(1))
        return tuple(out)

    @staticmethod
    def _check_block_ids(name: str, slot: VariantSlot, key_cache) -> None:
        """On the CPU, every block id a kernel will read (the slot's padded block
        table) must lie in the pool: an out-of-range id would abort the process
        inside the kernel. On CUDA the table lives on the device and reading it
        would synchronize: not checked (``slot.bt_max`` is None)."""
        top = slot.bt_max
        pool = key_cache.shape[0]
        if top is not None and int(top()) >= pool:
            lo, hi = (int(x) for x in torch.aminmax(slot.btbuf))
            bad = lo if lo < 0 else hi
            raise ShapeError(
                f"{name} holds block id {bad}, outside the KV pool [0, {pool}) "
                f"(key_cache.shape[0] = num_pool_blocks = {pool}); every id up to the "
                "bucket's num_blocks columns must be a block of the pool (pad with 0)"
            )

    def _check_device_lens(self, name: str, t, n: int) -> None:
        """``t`` must be ``[n]`` int32 on the plan's CUDA device (metadata only:
        its values are never read here)."""
        if self._device.type != "cuda":
            raise ShapeError(f"{name} is for CUDA plans; on the CPU pass host lengths only")
        if t is None:
            raise ShapeError(
                f"{name} is missing: give device_seq_len and device_query_len together"
            )
        if t.shape != (n,) or t.dtype != torch.int32 or not t.is_cuda:
            raise ShapeError(
                f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; expected [{n}] "
                "torch.int32 on the plan's CUDA device"
            )

    def _prefill_seq_len(self, seq_len, q: int) -> int:
        """``seq_len`` as an int, checked: an integer (not a bool), at least the
        chunk's ``q`` tokens, at most max_model_len. Raises ShapeError."""
        if seq_len is True or seq_len is False:  # bool is an int subclass: True == 1
            raise ShapeError(f"seq_len {seq_len!r} is a bool; expected an int (tokens)")
        try:
            seq_len = operator.index(seq_len)
        except TypeError:
            raise ShapeError(f"seq_len {seq_len!r} must be an integer (tokens)") from None
        if not 1 <= q <= seq_len:
            raise ShapeError(f"query_len {q} must be between 1 and seq_len {seq_len}")
        if seq_len > self._max_len:
            raise ShapeError(
                f"seq_len {seq_len} is above max_model_len {self._max_len}; "
                "raise --max-model-len and warm up"
            )
        return seq_len

    def _decode_seq_lens(self, seq_lens, s: int) -> tuple:
        """Check decode's host ``seq_lens`` for ``s`` queries: ``(lens, longest)``,
        ``lens`` an int32 ``array`` of them (None for a CPU tensor, used as it
        is). Raises ShapeError: a GPU tensor, a wrong count, a non-integer or
        bool, a length below 1 or above max_model_len."""
        lens_arr = None
        if isinstance(seq_lens, torch.Tensor):
            if seq_lens.device.type != "cpu":
                raise ShapeError(
                    "seq_lens must be host-side (a list or a CPU tensor); "
                    "reading a GPU tensor would synchronize the device"
                )
            if seq_lens.numel() != s:
                raise ShapeError(f"seq_lens has {seq_lens.numel()} entries for {s} queries")
            if seq_lens.is_floating_point() or seq_lens.dtype == torch.bool:
                raise ShapeError(f"seq_lens is {seq_lens.dtype}; expected integers (tokens)")
            shortest, longest = (int(x) for x in torch.aminmax(seq_lens)) if s else (1, 0)
        else:
            if len(seq_lens) != s:
                raise ShapeError(f"seq_lens has {len(seq_lens)} entries for {s} queries")
            try:  # one C loop: rejects floats and strings, and is what the slot takes
                lens_arr = array("i", seq_lens)
            except (TypeError, OverflowError):
                bad = next((n for n in seq_lens if not isinstance(n, int)), seq_lens)
                raise ShapeError(
                    f"seq_lens holds {bad!r}; expected ints (tokens) below 2**31"
                ) from None
            shortest, longest = (min(lens_arr), max(lens_arr)) if s else (1, 0)
            # bool is an int subclass (True == 1): looked for only where one could hide
            if shortest <= 1 and any(n is True or n is False for n in seq_lens):
                bad = next(n for n in seq_lens if n is True or n is False)
                raise ShapeError(f"seq_lens holds {bad!r}, a bool; expected ints (tokens)")
        if shortest < 1:
            raise ShapeError(
                f"seq_lens holds {shortest}; every decoding sequence has at least 1 KV "
                "token (its query token): drop finished or empty sequences from the batch"
            )
        if longest > self._max_len:
            raise ShapeError(
                f"seq_len {longest} is above max_model_len "
                f"{self._max_len}; raise --max-model-len and warm up"
            )
        return lens_arr, longest
