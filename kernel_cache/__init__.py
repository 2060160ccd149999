"""kernel-cache: a persistent compiled-kernel cache for LLM attention kernels.

The runtime an engine imports. It never compiles, and importing it does not
import torch's compile stack (Dynamo, Inductor). Engine start::

    from kernel_cache import make_config, load_plan
    attn = load_plan(make_config("llama-3.2-1b"))  # what `kernel-cache warmup` warms
    out = attn.decode(query, key_cache, value_cache, block_tables, seq_lens)

The names below are imported on first use (PEP 562): ``import kernel_cache``
and ``make_config`` import no torch; ``load_plan`` and ``AttentionRuntime`` do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernel_cache.config.engine import PRESETS, EngineConfig, make_config
    from kernel_cache.errors import (
        BundleError,
        CompileError,
        ConfigError,
        CorruptEntryError,
        KernelCacheError,
        MissingVariantsError,
        ShapeError,
    )
    from kernel_cache.plan.buckets import Bucketer, KernelVariant
    from kernel_cache.runtime.dispatch import AttentionRuntime
    from kernel_cache.runtime.load import load_plan

#: ``{public name: module that defines it}``.
_LAZY = {
    "PRESETS": "kernel_cache.config.engine",
    "EngineConfig": "kernel_cache.config.engine",
    "make_config": "kernel_cache.config.engine",
    "BundleError": "kernel_cache.errors",
    "CompileError": "kernel_cache.errors",
    "ConfigError": "kernel_cache.errors",
    "CorruptEntryError": "kernel_cache.errors",
    "KernelCacheError": "kernel_cache.errors",
    "MissingVariantsError": "kernel_cache.errors",
    "ShapeError": "kernel_cache.errors",
    "Bucketer": "kernel_cache.plan.buckets",
    "KernelVariant": "kernel_cache.plan.buckets",
    "AttentionRuntime": "kernel_cache.runtime.dispatch",
    "load_plan": "kernel_cache.runtime.load",
}

__all__ = [
    "AttentionRuntime",
    "Bucketer",
    "BundleError",
    "CompileError",
    "ConfigError",
    "CorruptEntryError",
    "EngineConfig",
    "KernelCacheError",
    "KernelVariant",
    "MissingVariantsError",
    "PRESETS",
    "ShapeError",
    "load_plan",
    "make_config",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernel_cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
