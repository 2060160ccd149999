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
without importing it (:func:`kernel_cache.plan.keys.kernel_source_files`).

Resolving a path imports the engine's code: only warmup (compile, verify)
does it. Engine start needs only the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kernel_cache.errors import CompileError, ConfigError

#: Entry-point group of installed kernel plugins: ``--kernel SLOT=NAME`` (no ':')
#: resolves ``NAME`` here.
ENTRY_POINT_GROUP = "kernel_cache.kernels"

PAGED_ATTENTION = "paged_attention"
BATCHED_DECODE = "batched_decode"


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
    """

    name: str
    inputs: tuple[tuple[str, str, str, str], ...]
    output: tuple[str, str, str]
    padding: str
    launch: tuple[str, ...]
    default: str
    cuda_default: str

    def default_for(self, device: str) -> str:
        """The built-in factory's import path on ``device`` ("cpu" or "cuda")."""
        return self.cuda_default if device == "cuda" else self.default

    def signature(self) -> str:
        """``forward(query [S, H, D] dtype, ...) -> [S, H, D] dtype``."""
        args = ", ".join(f"{n} {s} {t}" for n, s, t, _ in self.inputs)
        return f"forward({args}) -> {self.output[0]} {self.output[1]}"


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
        default="kernel_cache.kernels.builtin:RealKVPagedAttention",
        cuda_default="kernel_cache.kernels.triton_prefill:TritonPagedAttention",
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
        default="kernel_cache.kernels.builtin:RealKVBatchedDecode",
        cuda_default="kernel_cache.kernels.triton_decode:TritonBatchedDecode",
    ),
}

_PATH_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_NAME_RE = re.compile(r"[A-Za-z0-9][\w.-]*")
FORM = "package.module:Factory (or the name of an installed 'kernel_cache.kernels' entry point)"


def check_slot(slot: str) -> Slot:
    """The :class:`Slot` named ``slot``.

    Raises:
        ConfigError: an unknown slot (names it and the known slots).
    """
    if slot not in SLOTS:
        raise ConfigError(f"kernels: unknown slot {slot!r}; known slots: {', '.join(SLOTS)}")
    return SLOTS[slot]


def check_path(slot: str, path: str) -> str:
    """``path`` if it has the form of an import path or an entry-point name.

    Raises:
        ConfigError: a malformed path (names the slot, the value and the form).
    """
    if not isinstance(path, str) or not (_PATH_RE.fullmatch(path) or _NAME_RE.fullmatch(path)):
        raise ConfigError(f"kernels: {slot}={path!r} is not an import path; expected {FORM}")
    return path


def parse_kernel_option(text: str, flag: str = "--kernel") -> tuple[str, str]:
    """``"batched_decode=pkg.mod:Factory"`` -> ``("batched_decode", "pkg.mod:Factory")``.

    Raises:
        ConfigError: no ``=``, an unknown slot or a malformed path (names ``flag``).
    """
    slot, eq, path = text.partition("=")
    if not eq:
        raise ConfigError(f"{flag} {text!r}: expected SLOT={FORM}; slots: {', '.join(SLOTS)}")
    slot, path = slot.strip(), path.strip()
    check_slot(slot)
    return slot, check_path(slot, path)


def normalize(kernels) -> tuple[tuple[str, str], ...]:
    """A mapping, or pairs, or ``SLOT=PATH`` strings -> sorted ``((slot, path), ...)``.

    Raises:
        ConfigError: an unknown slot, a malformed path or a slot given twice
            with different paths.
    """
    if kernels is None:
        return ()
    if isinstance(kernels, str):  # one "SLOT=PATH", not its characters
        kernels = (kernels,)
    items = kernels.items() if hasattr(kernels, "items") else kernels
    if not hasattr(items, "__iter__"):
        raise ConfigError(
            f"kernels: {kernels!r} is not a mapping {{slot: path}}, (slot, path) pairs "
            "or SLOT=PATH strings"
        )
    out: dict[str, str] = {}
    for item in items:
        if isinstance(item, str):
            slot, path = parse_kernel_option(item)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            slot, path = item
        else:
            raise ConfigError(f"kernels: {item!r} is not a (slot, path) pair or SLOT=PATH")
        check_slot(slot)
        check_path(slot, path)
        if out.get(slot, path) != path:
            raise ConfigError(f"kernels: slot {slot!r} given twice ({out[slot]!r}, {path!r})")
        out[slot] = path
    return tuple(sorted(out.items()))


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
    (entry-point names resolved) or the slot's built-in factory on ``config.device``."""
    configured = dict(getattr(config, "kernels", ()) or ()).get(slot)
    return resolved_path(slot, configured, getattr(config, "device", "cpu"))


def load_factory(slot: str, path: str):
    """Import the factory ``path`` names (``module:attr.attr``).

    Raises:
        CompileError: the module does not import, the attribute is missing, or
            it is not callable (names the slot, the path and what went wrong).
    """
    import importlib

    target = resolved_path(slot, path)
    module, _, attr = target.partition(":")
    where = f"kernel {slot}={path}"
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
        CompileError: it raised, or returned another type, shape or dtype
            (names the slot, the path, what came and what was expected).
    """
    import torch

    where = f"kernel {slot}={path}"
    try:
        with torch.no_grad():
            out = module(*args)
    except Exception as e:
        first = str(e).strip().splitlines()[:3]
        raise CompileError(
            f"{where}: forward failed on example inputs: {type(e).__name__}: {' '.join(first)}"
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
