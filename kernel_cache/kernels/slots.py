"""Kernel slots: what an implementation of ``paged_attention`` or ``batched_decode``
must be, and how one is named, checked and built.

A slot is a kernel the runtime dispatches to. An engine may bring its own
implementation of a slot by import path (``package.module:Factory``, or the
name of an entry point of the :data:`ENTRY_POINT_GROUP` group): the
``kernels`` field of :class:`~kernel_cache.config.engine.EngineConfig`
(``--kernel SLOT=PATH`` on the command line). The built-in kernels are the
slots' default factories, one per device (:meth:`Slot.default_for`: the
plain-PyTorch kernels on the CPU, the Triton kernels on CUDA), named the same
way; nothing else special-cases them.

The contract (every slot):

* ``Factory(num_heads=H, num_kv_heads=KVH, head_dim=D, **launch)`` returns a
  ``torch.nn.Module``. ``launch`` holds the variant's launch parameters
  (:mod:`kernel_cache.plan.launch`): a factory must accept the slot's
  :attr:`Slot.launch` keywords (it may ignore their values).
* ``module(*inputs)`` takes the inputs of :attr:`Slot.inputs` (shapes in the
  names below, all on the plan's device) and returns one tensor of
  :attr:`Slot.output` shape in the query's dtype. Scale ``1 / sqrt(D)``; GQA:
  query head ``h`` reads KV head ``h // (H / KVH)``.
* For a plan whose ``kv_cache_dtype`` is ``fp8_e4m3`` the pools are
  ``float8_e4m3fn`` and two inputs follow the slot's: ``k_scale`` and
  ``v_scale``, ``[1]`` float32, read as ``float(stored) * scale`` (vLLM's
  per-tensor scales; passed at every call, never part of the artifact).
* The module is exported with ``torch.export`` (non-strict) with every bucket
  dimension static and ``num_pool_blocks`` (dim 0 of the KV caches) dynamic,
  then compiled with AOTInductor. Export runs the forward once on example
  inputs (:func:`kernel_cache.runtime.inputs.make_inputs`), so Python control
  flow on tensor values must be expressible to ``torch.export``.

Dimensions: ``H`` query heads, ``KVH`` KV heads, ``D`` head_dim, ``P``
num_pool_blocks (dynamic), ``B`` block_size (tokens per block), ``NB`` the
variant's KV bucket in blocks, ``Q`` its query bucket in tokens, ``S`` its
decode-batch bucket in sequences. Lengths are in tokens.

Identity: the key of a variant names its slot's import path (the ``kernel``
component) and hashes the source files of the implementation's module and
every module of its top-level package it imports, found by reading the code,
without importing it (:func:`kernel_cache.plan.sources.kernel_source_files`).

Resolving a path imports the engine's code: only warmup (compile, verify)
does it. Engine start needs only the key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kernel_cache.config.kernel_paths import (  # noqa: F401 - re-exported: the slots' names and parsing
    BATCHED_DECODE,
    BUILTIN,
    ENTRY_POINT_GROUP,
    FORM,
    PAGED_ATTENTION,
    check_path,
    check_slot_name,
    normalize,
    parse_kernel_option,
)
from kernel_cache.errors import CompileError, ConfigError
from kernel_cache.kernels import tiles


@dataclass(frozen=True)
class Slot:
    """One kernel slot's contract (see the module docstring).

    Attributes:
        name: the slot (the variant's ``kernel``).
        inputs: ``(name, shape, dtype, meaning)`` per positional input.
        output: ``(shape, dtype, meaning)`` of the one output.
        padding: what padded rows hold and which output rows are compared.
        launch: launch keywords passed to the factory (on the CPU; on CUDA
            ``paged_attention`` also gets the Triton prefill tiles, ``block_m``,
            ``block_n``, ``num_warps``, ``num_stages``).
        default: import path of the built-in factory on the CPU (and the eager
            oracle that verify compares every implementation with).
        cuda_default: import path of the built-in factory on CUDA.
        cuda_launch: launch keywords on CUDA (the built-in Triton kernel's).
        cuda_defaults: the Triton kernel's default launch parameters for a
            variant's shape (keywords of :meth:`default_launch`; :mod:`.tiles`).
        launch_ranges: ``{keyword: (lo, hi)}`` accepted, where the kernel bounds
            a keyword by itself (the Triton prefill tiles; :mod:`.tiles`).
    """

    name: str
    inputs: tuple[tuple[str, str, str, str], ...]
    output: tuple[str, str, str]
    padding: str
    launch: tuple[str, ...]
    default: str
    cuda_default: str
    cuda_launch: tuple[str, ...] = ()
    cuda_defaults: Callable[..., dict[str, int]] | None = None
    launch_ranges: Mapping[str, tuple[int, int]] = field(default_factory=dict, hash=False)

    def default_for(self, device: str) -> str:
        """The built-in factory's import path on ``device`` ("cpu" or "cuda")."""
        return self.cuda_default if device == "cuda" else self.default

    def launch_fields(self) -> tuple[str, ...]:
        """Every launch keyword the slot takes on some device, sorted."""
        return tuple(sorted({*self.launch, *self.cuda_launch}))

    def default_launch(self, device: str, **shape: int) -> dict[str, int]:
        """The launch parameters the slot's kernels take by default for a variant
        whose shape ``shape`` gives (``num_seqs``, ``num_kv_heads``, ``num_blocks``,
        ``block_size``, ``query_len``, ``num_queries_per_kv``, ``head_dim``,
        ``itemsize``): none on the CPU (the plan fills in its own), on CUDA the
        Triton kernel's heuristic (:mod:`kernel_cache.kernels.tiles`)."""
        if device != "cuda" or self.cuda_defaults is None:
            return {}
        return self.cuda_defaults(**shape)

    def signature(self, fp8: bool = False) -> str:
        """``forward(query [S, H, D] dtype, ...) -> [S, H, D] dtype``; with ``fp8``
        (a plan whose pools are ``float8_e4m3fn``), the scales that follow the
        slot's inputs (:data:`FP8_SCALES`)."""
        args = ", ".join(f"{n} {s} {t}" for n, s, t, _ in self.inputs)
        scales = f", {FP8_SCALES}" if fp8 else ""
        return f"forward({args}{scales}) -> {self.output[0]} {self.output[1]}"


#: The inputs an fp8 plan passes after every slot's own (vLLM's per-tensor scales).
FP8_SCALES = "k_scale [1] float32, v_scale [1] float32"

_KV = (
    ("key_cache", "[P, B, KVH, D]", "dtype", "paged keys"),
    ("value_cache", "[P, B, KVH, D]", "dtype", "paged values"),
)

SLOTS: dict[str, Slot] = {
    PAGED_ATTENTION: Slot(
        name=PAGED_ATTENTION,
        inputs=(
            ("query", "[Q, H, D]", "dtype", "one sequence's prefill chunk, bucket-padded"),
            *_KV,
            ("block_table", "[NB]", "int32", "the sequence's pool blocks, in order"),
            ("seq_len", "[1]", "int32", "KV tokens of the sequence, this chunk included"),
            ("real_query_len", "[1]", "int32", "real (unpadded) tokens of the chunk"),
        ),
        output=("[Q, H, D]", "dtype", "attention of each chunk token"),
        padding="causal: chunk token i sits at position seq_len - real_query_len + i and "
        "sees KV positions <= its own and < seq_len; rows >= real_query_len are padding "
        "(must be finite, never compared); block_table entries past ceil(seq_len / B) are "
        "padding and must not change the output",
        launch=(),
        default=BUILTIN[PAGED_ATTENTION][0],
        cuda_default=BUILTIN[PAGED_ATTENTION][1],
        cuda_launch=tuple(tiles.PREFILL_RANGES),
        cuda_defaults=tiles.prefill_defaults,
        launch_ranges=tiles.PREFILL_RANGES,
    ),
    BATCHED_DECODE: Slot(
        name=BATCHED_DECODE,
        inputs=(
            ("query", "[S, H, D]", "dtype", "one query token per sequence"),
            *_KV,
            ("block_tables", "[S, NB]", "int32", "each sequence's pool blocks, in order"),
            ("seq_lens", "[S]", "int32", "KV tokens per sequence; 0 marks a padded row"),
        ),
        output=("[S, H, D]", "dtype", "attention of each sequence's token"),
        padding="sequence s's token sits at position seq_lens[s] - 1 and sees KV positions "
        "< seq_lens[s]; a padded row (seq_lens[s] == 0) returns zeros; block_tables "
        "entries past ceil(seq_len / B) are padding and must not change the output",
        launch=("blocks_per_chunk", "num_kv_splits"),
        default=BUILTIN[BATCHED_DECODE][0],
        cuda_default=BUILTIN[BATCHED_DECODE][1],
        cuda_launch=("blocks_per_chunk", "num_kv_splits"),
        cuda_defaults=tiles.decode_defaults,
    ),
}


def check_slot(slot: str) -> Slot:
    """The :class:`Slot` named ``slot``.

    Raises:
        ConfigError: an unknown slot (names it and the known slots).
    """
    return SLOTS[check_slot_name(slot)]


#: Entry-point names resolved in this process (engine start resolves one per
#: variant; reading every installed package's metadata each time costs ms).
_RESOLVED: dict[str, str] = {}


def entry_point_path(slot: str, name: str) -> str:
    """The ``module:attr`` an installed entry point ``name`` of
    :data:`ENTRY_POINT_GROUP` names (read from package metadata, nothing imported).

    Raises:
        ConfigError: no such entry point (names the installed ones and the form).
    """
    from importlib.metadata import entry_points

    if name in _RESOLVED:
        return _RESOLVED[name]
    eps = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none installed"
        raise ConfigError(
            f"kernels: {slot}={name!r} is neither an import path nor an entry point of group "
            f"{ENTRY_POINT_GROUP!r} ({known}); expected {FORM}"
        )
    _RESOLVED[name] = eps[name]
    return eps[name]


def resolved_path(slot: str, path: str | None, device: str = "cpu") -> str:
    """The ``module:attr`` of ``path`` (an entry-point name resolved; None: the
    slot's built-in factory on ``device``). Imports nothing."""
    if path is None:
        return check_slot(slot).default_for(device)
    return path if ":" in path else entry_point_path(slot, path)


def builtin_paths() -> frozenset[str]:
    """The import paths of every built-in factory (each slot, each device)."""
    return frozenset(p for s in SLOTS.values() for p in (s.default, s.cuda_default))


def kernel_path(config, slot: str) -> str:
    """The import path ``config`` uses for ``slot``: its ``kernels`` entry
    (entry-point names resolved) or the slot's built-in factory on ``config.device``;
    for a slot ``config`` declares (``config.slots``), the spec's factory."""
    spec = config.slot(slot) if hasattr(config, "slot") else None
    if spec is not None:
        return resolved_path(slot, spec.factory)
    configured = dict(getattr(config, "kernels", ()) or ()).get(slot)
    return resolved_path(slot, configured, getattr(config, "device", "cpu"))


def load_factory(slot: str, path: str, kind: str = "kernel"):
    """Import the factory ``path`` names (``module:attr.attr``); errors name it
    as ``{kind} {slot}={path}`` (``kind``: ``kernel``, or ``slot`` for a
    declared slot).

    Raises:
        CompileError: the module does not import, the attribute is missing, or
            it is not callable (names the slot, the path and what went wrong).
    """
    import importlib

    target = resolved_path(slot, path)
    module, _, attr = target.partition(":")
    where = f"{kind} {slot}={path}"
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # the engine's code: any error is reported, not raised through
        raise CompileError(f"{where}: cannot import {module!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CompileError(f"{where}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CompileError(f"{where}: {target} is a {type(obj).__name__}, not callable; {FORM}")
    return obj


def build(slot: str, path: str | None, num_heads: int, num_kv_heads: int, head_dim: int, **launch):
    """The module of ``slot`` from factory ``path`` (None: the built-in), in eval mode.

    Raises:
        CompileError: the factory cannot be loaded, raised, or returned something
            that is not a ``torch.nn.Module`` (names the slot and the path).
        ConfigError: a built-in factory refused the launch parameters.
    """
    from torch import nn

    path = path or check_slot(slot).default
    factory = load_factory(slot, path)
    where = f"kernel {slot}={path}"
    try:
        mod = factory(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, **launch)
    except ConfigError as e:
        if path in builtin_paths():  # a built-in refusing launch parameters: as it says
            raise
        raise CompileError(f"{where}: the factory refused its arguments: {e}") from None
    except Exception as e:
        raise CompileError(
            f"{where}: the factory raised {type(e).__name__}: {e} (called with num_heads="
            f"{num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}, launch={launch})"
        ) from None
    if not isinstance(mod, nn.Module):
        raise CompileError(
            f"{where}: the factory returned a {type(mod).__name__}, not a torch.nn.Module; "
            f"it must return a module whose {SLOTS[slot].signature()}"
        )
    return mod.eval()


def check_output(slot: str, path: str, module, args) -> None:
    """Run ``module`` once on example ``args`` and check its output against the
    slot's contract: one tensor of the query's shape and dtype.

    Raises:
        CompileError: forward takes inputs into ``*args`` (which
            ``torch.export`` cannot give their shapes), it raised, or returned
            another type, shape or dtype (names the slot, the path, what came and
            what was expected).
    """
    import inspect

    import torch

    where = f"kernel {slot}={path}"
    fp8 = args[1].dtype == torch.float8_e4m3fn
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind(*args).arguments
    except (TypeError, ValueError):  # no signature, or the inputs do not fit: the call tells
        sig, bound = None, {}
    star = [
        p.name
        for p in (sig.parameters.values() if sig is not None else ())
        if p.kind is inspect.Parameter.VAR_POSITIONAL and p.name in bound
    ]
    if star:  # torch.export cannot give the inputs caught by *args their shapes
        raise CompileError(
            f"{where}: forward takes the slot's inputs into *{star[0]}; torch.export gives "
            f"each of the {len(args)} inputs a static or dynamic shape by forward's "
            f"parameter, so name each one: {SLOTS[slot].signature(fp8)}"
        )
    try:
        with torch.no_grad():
            out = module(*args)
    except Exception as e:
        first = str(e).strip().splitlines()[:3]
        hint = ""
        if isinstance(e, TypeError) and fp8:
            # a kernel written for the slot's inputs alone, in an fp8 plan
            hint = (
                "; this plan's kv_cache_dtype is fp8_e4m3, so the slot's inputs are "
                f"followed by {FP8_SCALES} (a key reads as "
                "float(stored) * k_scale; docs/custom_kernels.md): take them in forward, "
                "or warm up with --kv-cache-dtype auto"
            )
        raise CompileError(
            f"{where}: forward failed on example inputs: {type(e).__name__}: "
            f"{' '.join(first)}{hint}"
        ) from None
    want, dtype = tuple(args[0].shape), args[0].dtype
    if not isinstance(out, torch.Tensor):
        raise CompileError(
            f"{where}: forward returned a {type(out).__name__}, expected one tensor "
            f"{list(want)} {dtype}"
        )
    if tuple(out.shape) != want or out.dtype != dtype:
        raise CompileError(
            f"{where}: forward returned {list(out.shape)} {out.dtype}, expected {list(want)} "
            f"{dtype} ({SLOTS[slot].signature()})"
        )
