"""Planning and compiling: the only code of kernel-cache that compiles.

It imports :mod:`kernel_cache`; :mod:`kernel_cache` never imports it.
``warmup.warmup`` (the planner's entry point) is imported on first use (PEP 562),
so ``import warmup.cli.main`` does not import the planner or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from warmup.builder.planner import warmup

__all__ = ["warmup"]


def __getattr__(name: str):
    if name != "warmup":
        raise AttributeError(f"module 'warmup' has no attribute {name!r}")
    from warmup.builder.planner import warmup

    globals()["warmup"] = warmup  # the next access is a plain attribute
    return warmup
