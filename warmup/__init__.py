"""Planning and compiling: the only code of kernel-cache that compiles.

It imports :mod:`kernel_cache`; :mod:`kernel_cache` never imports it.
"""

from warmup.build.planner import warmup

__all__ = ["warmup"]
