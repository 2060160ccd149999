"""kernel-cache: a persistent compiled-kernel cache for LLM attention kernels.

The runtime an engine imports. It never compiles, and importing it does not
import torch's compile stack (Dynamo, Inductor). Engine start::

    from kernel_cache import make_config, load_plan
    attn = load_plan(make_config("llama-3.2-1b"))  # what `kernel-cache warmup` warms
    out = attn.decode(query, key_cache, value_cache, block_tables, seq_lens)
"""

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
