"""The launch space of the built-in CUDA kernels: their default launch
parameters per variant shape and the ranges their tiles accept.

Pure Python (no torch, no Triton): :mod:`kernel_cache.plan.launch` reads these
through the slot (:meth:`kernel_cache.kernels.slots.Slot.default_launch`) when it
resolves a plan, and the Triton kernels (:mod:`kernel_cache.kernels.triton_decode`,
:mod:`kernel_cache.kernels.triton_prefill`) use them when built without a launch
config. Each default is a pure function of the variant's shape, so an artifact
does not depend on which GPU warmed it.
"""

from __future__ import annotations

#: CUDA split-KV heuristic of the Triton decode kernel: aim for about this many
#: programs per launch (8 per streaming multiprocessor on a 132-SM H100/H200), but
#: never split below ``MIN_SPLIT_TOKENS`` tokens per program. A pure function of
#: the variant's shape, so the artifact does not depend on which GPU warmed it.
#: (Picked on an H200: docs/benchmarks/gpu-decode.md, kernel sweep.)
TARGET_PROGRAMS = 1024
MIN_SPLIT_TOKENS = 256


def cuda_default_splits(num_seqs: int, num_kv_heads: int, num_blocks: int, block_size: int) -> int:
    """The Triton decode kernel's default ``num_kv_splits`` for a variant.

    Splits of whole KV blocks, at least ``MIN_SPLIT_TOKENS`` tokens each, enough
    of them that ``num_seqs * num_kv_heads * splits`` is about
    ``TARGET_PROGRAMS``. Returns an integer in ``[1, num_blocks]``.
    """
    want = max(1, -(-TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads)))
    tokens = max(MIN_SPLIT_TOKENS, -(-(num_blocks * block_size) // want))
    per_split = min(num_blocks, max(1, -(-tokens // block_size)))
    return -(-num_blocks // per_split)


#: Default tiles of the Triton prefill kernel (picked on an H200 with the tile
#: sweep of benchmarks/gpu_engine.py, granite-3.3-8b bf16: 128 x 128 tiles, 8
#: warps, 3 stages took 0.112 ms at 512 query tokens over 4096 KV tokens and
#: 0.653 ms at 2048 over 8192, the fastest of 12 configurations at 2048 @ 8192
#: and 2-4% behind the fastest at 512 @ 4096; docs/benchmarks/gpu-prefill.md).
PREFILL_BLOCK_M = 128
PREFILL_BLOCK_N = 128
PREFILL_NUM_WARPS = 8
PREFILL_NUM_STAGES = 3
#: Shared memory per program on sm_90 (227 KiB of opt-in dynamic shared memory).
PREFILL_SMEM_BYTES = 227 * 1024

#: The Triton prefill kernel's launch parameters and their accepted ranges
#: (``block_m``, ``block_n`` and ``num_warps`` powers of two); the CPU
#: ``paged_attention`` kernel takes none.
PREFILL_RANGES = {
    "block_m": (16, 256),
    "block_n": (16, 256),
    "num_warps": (1, 16),
    "num_stages": (1, 8),
}


def cuda_prefill_defaults(
    query_len: int, num_queries_per_kv: int, head_dim: int, itemsize: int = 2
) -> dict[str, int]:
    """The Triton prefill kernel's default launch config for a variant.

    ``block_m`` score rows per program (query tokens x the GQA group padded to a
    power of two): :data:`PREFILL_BLOCK_M`, but no more rows than the query
    bucket fills (a 1-token bucket of a 4-head group gets 16), with 8 warps from
    128 rows on, else 4. ``block_n`` (KV tokens per step) and the pipeline stages
    start at :data:`PREFILL_BLOCK_N` and :data:`PREFILL_NUM_STAGES` and shrink
    (stages to 2 first, then ``block_n`` by halves, not below 16) until the
    estimated shared memory, ``(stages * 2 * block_n + block_m) * head_dim_pad *
    itemsize`` bytes (``itemsize``: bytes per element), fits
    :data:`PREFILL_SMEM_BYTES`. Returns ``{"block_m", "block_n", "num_stages",
    "num_warps"}``.
    """
    block_m = max(
        prefill_min_block_m(num_queries_per_kv),
        min(PREFILL_BLOCK_M, prefill_max_block_m(query_len, num_queries_per_kv)),
    )
    block_n, stages = PREFILL_BLOCK_N, PREFILL_NUM_STAGES
    while prefill_smem_bytes(block_m, block_n, stages, head_dim, itemsize) > PREFILL_SMEM_BYTES:
        if stages > 2:
            stages = 2
        elif block_n > 16:
            block_n //= 2
        else:
            break
    warps = PREFILL_NUM_WARPS if block_m >= 128 else 4
    return {"block_m": block_m, "block_n": block_n, "num_stages": stages, "num_warps": warps}


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def prefill_min_block_m(num_queries_per_kv: int) -> int:
    """The fewest score rows a prefill program can hold: one query token's GQA
    group, padded to a power of two."""
    return _pow2(num_queries_per_kv)


def prefill_max_block_m(query_len: int, num_queries_per_kv: int) -> int:
    """The most score rows a prefill program of this query bucket can fill: the
    query bucket times the GQA group, each padded to a power of two (at least 16
    rows, the smallest ``tl.dot`` tile)."""
    return max(16, prefill_min_block_m(num_queries_per_kv) * _pow2(query_len))


def prefill_smem_bytes(
    block_m: int, block_n: int, num_stages: int, head_dim: int, itemsize: int = 2
) -> int:
    """Estimated shared memory of one prefill program, in bytes: ``(num_stages *
    2 * block_n + block_m) * head_dim_pad * itemsize`` (the pipelined K and V
    tiles and the query tile; ``head_dim_pad``: a power of two, at least 16)."""
    d_pad = max(16, _pow2(head_dim))
    return (num_stages * 2 * block_n + block_m) * d_pad * itemsize


def decode_defaults(
    *, num_seqs: int, num_kv_heads: int, num_blocks: int, block_size: int, **_shape
) -> dict[str, int]:
    """``batched_decode``'s CUDA defaults for a variant's shape:
    ``{"num_kv_splits": cuda_default_splits(...)}`` (``block_size`` in tokens)."""
    return {"num_kv_splits": cuda_default_splits(num_seqs, num_kv_heads, num_blocks, block_size)}


def prefill_defaults(
    *, query_len: int, num_queries_per_kv: int, head_dim: int, itemsize: int, **_shape
) -> dict[str, int]:
    """``paged_attention``'s CUDA defaults for a variant's shape:
    :func:`cuda_prefill_defaults` (``query_len`` in tokens, ``itemsize`` in bytes)."""
    return cuda_prefill_defaults(query_len, num_queries_per_kv, head_dim, itemsize)
