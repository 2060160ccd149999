"""The ``kernels`` field of the engine config: which implementation each kernel
slot uses, named by import path, parsed and normalized without importing anything.

A slot is a kernel the runtime dispatches to (``paged_attention``,
``batched_decode``); its contract is in :mod:`kernel_cache.kernels.slots`,
which builds on these names. An engine names its own implementation as
``package.module:Factory`` or as the name of an entry point of
:data:`ENTRY_POINT_GROUP` (``--kernel SLOT=PATH`` on the command line); the
built-in factories are :data:`BUILTIN`, one per device.
"""

from __future__ import annotations

import re

from kernel_cache.errors import ConfigError

#: Entry-point group of installed kernel plugins: ``--kernel SLOT=NAME`` (no ':')
#: resolves ``NAME`` here.
ENTRY_POINT_GROUP = "kernel_cache.kernels"

PAGED_ATTENTION = "paged_attention"
BATCHED_DECODE = "batched_decode"

#: ``{slot: (built-in factory on the CPU, built-in factory on CUDA)}``, in slot order.
BUILTIN: dict[str, tuple[str, str]] = {
    PAGED_ATTENTION: (
        "kernel_cache.kernels.builtin:RealKVPagedAttention",
        "kernel_cache.kernels.triton_prefill:TritonPagedAttention",
    ),
    BATCHED_DECODE: (
        "kernel_cache.kernels.builtin:RealKVBatchedDecode",
        "kernel_cache.kernels.triton_decode:TritonBatchedDecode",
    ),
}

_PATH_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_NAME_RE = re.compile(r"[A-Za-z0-9][\w.-]*")
FORM = "package.module:Factory (or the name of an installed 'kernel_cache.kernels' entry point)"


def builtin_path(slot: str, device: str) -> str:
    """The built-in factory's import path of ``slot`` on ``device`` ("cpu" or "cuda")."""
    cpu, cuda = BUILTIN[slot]
    return cuda if device == "cuda" else cpu


def check_slot_name(slot: str) -> str:
    """``slot`` if it names a slot.

    Raises:
        ConfigError: an unknown slot (names it and the known slots).
    """
    if slot not in BUILTIN:
        raise ConfigError(f"kernels: unknown slot {slot!r}; known slots: {', '.join(BUILTIN)}")
    return slot


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
        raise ConfigError(f"{flag} {text!r}: expected SLOT={FORM}; slots: {', '.join(BUILTIN)}")
    slot, path = slot.strip(), path.strip()
    check_slot_name(slot)
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
        check_slot_name(slot)
        check_path(slot, path)
        if out.get(slot, path) != path:
            raise ConfigError(f"kernels: slot {slot!r} given twice ({out[slot]!r}, {path!r})")
        out[slot] = path
    return tuple(sorted(out.items()))
