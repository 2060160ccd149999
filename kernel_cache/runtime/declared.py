"""Dispatch of declared slots: ``runtime.call(slot, *inputs)`` and
``runtime.bind(slot, weights)``, on the hot-path rules of
:mod:`kernel_cache.runtime.dispatch`.

A call reads each bucket axis' size from the host-side shapes of its inputs
(never a tensor's values), picks the smallest bucket that holds it (a bisect
over the plan's ladder), checks every input against the declared spec
(rank, fixed dimensions, dtype, device, one size per axis and per
``dynamic:NAME``), copies an input
that is not exactly its bucket shape and contiguous into a buffer it keeps per
variant and shape, fills the padded elements with the input's ``pad``, runs the
loaded artifact on ``(*weights, *inputs)`` and returns the output's real rows
(``output_rows``). It never compiles, never synchronizes with the device, and
after a variant's first call allocates nothing but the output, so a call can be
captured in a CUDA graph (warm each variant up outside the capture first).

Weights: the artifact takes the module's parameters and buffers as inputs
(:mod:`kernel_cache.kernels.declared`). ``bind`` checks a module or a state
dict once against the names, shapes and dtypes the entries recorded
(``slot_params``) and keeps the tensors; ``prepare`` checks them once and
returns them for ``call(..., weights=...)`` (one set per layer of a model
whose layers share the slot); a module or state dict passed there is checked
at that call.
"""

from __future__ import annotations

import bisect

import torch

from kernel_cache.config.slot_spec import torch_dtype
from kernel_cache.errors import ShapeError
from kernel_cache.plan.buckets import Bucketer, KernelVariant

_AXIS_FIELD = {"query_tokens": "query_len", "kv_blocks": "num_blocks", "decode_seqs": "num_seqs"}


def _ladder(bucketer: Bucketer, axis: str) -> tuple[int, ...]:
    return {
        "query_tokens": bucketer.query_buckets,
        "kv_blocks": bucketer.num_blocks_buckets,
        "decode_seqs": bucketer.num_seqs_buckets,
    }[axis]


class Weights:
    """A declared slot's weights, checked once (:meth:`DeclaredSlots.prepare`):
    pass it as ``call(..., weights=...)`` to run one checkpoint of several (one
    decoder layer's MLP of many) with no check per call."""

    __slots__ = ("slot", "state", "owner")

    def __init__(self, slot: str, state: tuple, owner=None):
        self.slot = slot
        self.state = state
        self.owner = owner  # the _Slot that checked them (another runtime's: checked again)


class _Slot:
    """One declared slot's dispatch state: its spec read once into tuples, its
    runners by bucket, the bound weights and the per-variant buffers."""

    def __init__(self, spec, bucketer: Bucketer, runners: dict, params: dict, device):
        self.spec = spec
        self.name = spec.name
        self.device = device
        self.axes = spec.axes()
        self.ladders = tuple(_ladder(bucketer, a) for a in self.axes)
        self.n_inputs = len(spec.inputs)
        # per input: (name, rank, dtype, ((dim, fixed size), ...), ((dim, axis index), ...), pad)
        checks = []
        self.where: list[tuple[int, int]] = []  # (input, dim) read for each axis' size
        for a in self.axes:
            self.where.append(
                next(
                    (i, d)
                    for i, inp in enumerate(spec.inputs)
                    for d, x in enumerate(inp.shape)
                    if x == a
                )
            )
        for inp in spec.inputs:
            fixed = tuple((d, x) for d, x in enumerate(inp.shape) if isinstance(x, int))
            on_axis = tuple(
                (d, self.axes.index(x)) for d, x in enumerate(inp.shape) if x in self.axes
            )
            dtype = torch_dtype(inp.dtype)
            checks.append((inp.name, len(inp.shape), dtype, fixed, on_axis, inp.pad))
        self.checks = tuple(checks)
        dims: dict[str, list[tuple[int, int]]] = {}  # dynamic name -> its (input, dim)s
        for i, inp in enumerate(spec.inputs):
            names = iter(inp.dynamic_names())
            for d, x in enumerate(inp.shape):
                if isinstance(x, str) and x.startswith("dynamic"):
                    dims.setdefault(next(names), []).append((i, d))
        #: ``((name, ((input, dim), ...)), ...)``: the dynamic names several
        #: dimensions share (the artifact does not check they agree).
        self.shared = tuple((n, tuple(w)) for n, w in dims.items() if len(w) > 1)
        self.rows = self.axes.index(spec.output_rows) if spec.output_rows else None
        #: ``{bucket tuple: runner}`` (bucket per axis, in :attr:`axes` order).
        self.runners = {
            tuple(getattr(v, _AXIS_FIELD[a]) for a in self.axes): r for v, r in runners.items()
        }
        self.variants = {tuple(getattr(v, _AXIS_FIELD[a]) for a in self.axes): v for v in runners}
        #: ``{variant: [name, shape, dtype] list}`` the entries recorded.
        self.params = params
        self.state: tuple | None = None
        #: ``{(bucket tuple, input index): padded buffer}``: one per variant and
        #: input, replaced when a dynamic dimension's size changes (so memory
        #: stays bounded by the plan, not by the sizes seen).
        self.buffers: dict = {}
        self.calls: dict[KernelVariant, int] = {}

    # -- weights ----------------------------------------------------------------
    def expected(self) -> list:
        """The recorded ``[[name, shape, dtype], ...]`` (every loaded variant's must agree).

        Raises:
            ShapeError: no variant loaded, an entry that records none, or
                variants that disagree (names them and the fix).
        """
        specs = {repr(p) for p in self.params.values()}
        if not self.params:
            raise ShapeError(f"slot {self.name!r}: no variant of it is loaded")
        if None in self.params.values():
            raise ShapeError(
                f"slot {self.name!r}: an entry records no slot_params (built by an older "
                "kernel-cache); warm the slot up again"
            )
        if len(specs) > 1:
            raise ShapeError(
                f"slot {self.name!r}: its variants were built from modules with different "
                "parameters; warm the slot up again"
            )
        return next(iter(self.params.values()))

    def check_state(self, weights) -> tuple:
        """``weights`` (an ``nn.Module``, or a mapping of name to tensor) as the
        artifact's state inputs, in recorded order, detached, contiguous, on
        the plan's device.

        Raises:
            ShapeError: a parameter missing, unexpected, or of another shape,
                dtype or device (names the parameter, what came, what was
                recorded and the fix).
        """
        if isinstance(weights, torch.nn.Module):
            given = {**dict(weights.named_parameters()), **dict(weights.named_buffers())}
        elif hasattr(weights, "items"):
            given = dict(weights.items())
        else:
            raise ShapeError(
                f"slot {self.name!r}: weights are a {type(weights).__name__}; pass the "
                "torch.nn.Module or its state dict (name -> tensor)"
            )
        want = self.expected()
        names = [n for n, _, _ in want]
        missing = [n for n in names if n not in given]
        extra = sorted(set(given) - set(names))
        if missing or extra:
            raise ShapeError(
                f"slot {self.name!r}: the weights do not match the module the slot was built "
                f"from: missing {missing}, unexpected {extra}; expected {names}"
            )
        out = []
        for name, shape, dtype in want:
            t = given[name]
            if not isinstance(t, torch.Tensor):
                raise ShapeError(
                    f"slot {self.name!r}: parameter {name!r} is a {type(t).__name__}, not a tensor"
                )
            got = str(t.dtype).removeprefix("torch.")
            if list(t.shape) != list(shape) or got != dtype:
                raise ShapeError(
                    f"slot {self.name!r}: parameter {name!r} is {list(t.shape)} {got}, but the "
                    f"slot was built for {list(shape)} {dtype} (the factory's args "
                    f"{self.spec.factory_args()}); load a checkpoint of that shape, or "
                    "declare the slot with the args of this one and warm up"
                )
            if t.device.type != self.device.type:
                raise ShapeError(
                    f"slot {self.name!r}: parameter {name!r} is on {t.device}, the plan "
                    f"runs on {self.device}; move the weights there first"
                )
            t = t.detach()
            out.append(t if t.is_contiguous() else t.contiguous())
        return tuple(out)

    # -- the call -----------------------------------------------------------------
    def _refuse(self, i: int, t) -> ShapeError:
        """The error of input ``i`` (``t``), whose rank, dtype or device is not
        the declared one."""
        inp = self.spec.inputs[i]
        got = (
            f"{list(t.shape)} {t.dtype} on {t.device}"
            if isinstance(t, torch.Tensor)
            else f"a {type(t).__name__}"
        )
        return ShapeError(
            f"slot {self.name!r}: input {inp.name!r} is {got}; declared "
            f"{list(inp.shape)} {inp.dtype} on {self.device}"
        )

    def call(self, inputs: tuple, state: tuple):
        """See :meth:`DeclaredSlots.call`."""
        if len(inputs) != self.n_inputs:
            raise ShapeError(
                f"slot {self.name!r} takes {self.n_inputs} inputs "
                f"({', '.join(c[0] for c in self.checks)}), got {len(inputs)}"
            )
        device = self.device.type
        for i, (t, (name, rank, dtype, fixed, _, _)) in enumerate(
            zip(inputs, self.checks, strict=True)
        ):
            if not isinstance(t, torch.Tensor) or t.dim() != rank or t.dtype != dtype:
                raise self._refuse(i, t)
            if t.device.type != device:
                raise self._refuse(i, t)
            for d, size in fixed:
                if t.shape[d] != size:
                    raise ShapeError(
                        f"slot {self.name!r}: input {name!r} dim {d} is {t.shape[d]}, "
                        f"declared {size}"
                    )
        for dyn, ((i0, d0), *rest) in self.shared:
            for i, d in rest:
                if inputs[i].shape[d] != inputs[i0].shape[d0]:
                    raise ShapeError(
                        f"slot {self.name!r}: input {self.checks[i][0]!r} dim {d} is "
                        f"{inputs[i].shape[d]}, but input {self.checks[i0][0]!r} dim {d0} is "
                        f"{inputs[i0].shape[d0]}; both are declared dynamic:{dyn}, one size"
                    )
        sizes = [inputs[i].shape[d] for i, d in self.where]
        buckets = []
        for a, n, ladder in zip(self.axes, sizes, self.ladders, strict=True):
            j = bisect.bisect_left(ladder, n)
            if j == len(ladder) or n < 1:
                raise ShapeError(
                    f"slot {self.name!r}: {n} along {a} is outside the plan's buckets "
                    f"(1 to {ladder[-1] if ladder else 0}); raise the limit and warm up again"
                )
            buckets.append(ladder[j])
        key = tuple(buckets)
        runner = self.runners.get(key)
        if runner is None:
            at = dict(zip(self.axes, key, strict=True))
            raise ShapeError(
                f"slot {self.name!r}: its variant for buckets {at} "
                "is not loaded; warm it up (kernel-cache warmup with this --slot)"
            )
        args = []
        for i, (t, (name, _, dtype, _, on_axis, pad)) in enumerate(
            zip(inputs, self.checks, strict=True)
        ):
            shape = t.shape
            exact = True
            for d, a in on_axis:
                if shape[d] != sizes[a]:
                    raise ShapeError(
                        f"slot {self.name!r}: input {name!r} dim {d} is {shape[d]}, but "
                        f"{self.axes[a]} is {sizes[a]} (from another input)"
                    )
                exact = exact and shape[d] == buckets[a]
            if exact and t.is_contiguous():
                args.append(t)
                continue
            full = list(shape)
            for d, a in on_axis:
                full[d] = buckets[a]
            buf = self.buffers.get((key, i))
            if buf is None or buf.shape != tuple(
                full
            ):  # a dynamic dimension's new size replaces it
                buf = self.buffers[(key, i)] = torch.full(
                    full, pad, dtype=dtype, device=self.device
                )
            view = buf
            for d, a in on_axis:
                view = view.narrow(d, 0, sizes[a])
            view.copy_(t)
            for d, a in on_axis:  # padded elements: written by an earlier, larger call
                if sizes[a] < buckets[a]:
                    buf.narrow(d, sizes[a], buckets[a] - sizes[a]).fill_(pad)
            args.append(buf)
        out = runner.run([*state, *args])[0]
        v = self.variants[key]
        self.calls[v] = self.calls.get(v, 0) + 1
        if self.rows is not None and sizes[self.rows] != buckets[self.rows]:
            return out[: sizes[self.rows]]
        return out


class DeclaredSlots:
    """Every declared slot of a loaded plan (:meth:`call`, :meth:`bind`)."""

    def __init__(self, config, bucketer: Bucketer, runners: dict, slot_params: dict):
        device = torch.device(config.device)
        self._slots: dict[str, _Slot] = {}
        for spec in config.slots:
            mine = {v: r for v, r in runners.items() if v.kernel == spec.name}
            params = {v: slot_params.get(v) for v in mine}
            self._slots[spec.name] = _Slot(spec, bucketer, mine, params, device)

    def _get(self, slot: str) -> _Slot:
        s = self._slots.get(slot)
        if s is None:
            known = ", ".join(self._slots) or "none declared"
            raise ShapeError(f"no declared slot {slot!r} in this plan (declared: {known})")
        return s

    def bind(self, slot: str, weights) -> None:
        """Check ``weights`` (the module or its state dict) against what slot
        ``slot`` was built from, once, and use them for every later call.

        Raises:
            ShapeError: an unknown slot, or weights that do not match (names
                the parameter; :meth:`_Slot.check_state`).
        """
        s = self._get(slot)
        s.state = s.check_state(weights)

    def prepare(self, slot: str, weights) -> Weights:
        """``weights`` checked as :meth:`bind` checks them, returned for
        ``call(..., weights=...)`` instead of kept (one per layer of a model
        whose layers share the slot)."""
        s = self._get(slot)
        return Weights(slot, s.check_state(weights), s)

    def call(self, slot: str, *inputs, weights=None):
        """Run declared slot ``slot`` on ``inputs`` (the declared inputs, in order;
        sizes along bucket axes at most the plan's limits). ``weights``: for
        this call only, a :class:`Weights` from :meth:`prepare` (checked
        already), or a module or state dict checked as :meth:`bind` checks
        them; None: the bound ones. Returns the output, its rows past the real size sliced off
        (``output_rows``).

        Raises:
            ShapeError: an unknown slot, no weights bound, an input that does not
                match the spec or is beyond the buckets, a variant not loaded.
        """
        s = self._get(slot)
        if weights is None:
            state = s.state
        elif type(weights) is Weights and weights.owner is s:
            state = weights.state
        elif type(weights) is Weights and weights.slot != slot:
            raise ShapeError(
                f"slot {slot!r}: weights=... were prepared for slot {weights.slot!r}; pass "
                f"runtime.prepare({slot!r}, module_or_state_dict)"
            )
        elif type(weights) is Weights:  # another runtime's slot of this name
            names = [n for n, _, _ in weights.owner.expected()]
            state = s.check_state(dict(zip(names, weights.state, strict=True)))
        else:
            state = s.check_state(weights)
        if state is None:
            raise ShapeError(
                f"slot {slot!r}: no weights; runtime.bind({slot!r}, module_or_state_dict) "
                "first, or pass weights=..."
            )
        return s.call(inputs, state)

    def calls(self) -> dict:
        """``{variant: calls}`` of every declared slot."""
        out: dict = {}
        for s in self._slots.values():
            out.update(s.calls)
        return out
