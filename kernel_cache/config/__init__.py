"""Stage 1, config: what an engine runs (geometry, buckets, dtype, device, CPU
target), the compile recipe that turns it into code, and the ``KERNEL_CACHE_*``
settings."""
