"""Shared helpers of the GPU benchmarks (``benchmarks/gpu_*.py``): timing with CUDA
events, the device description, the granite-3.3-8b decode inputs, JSON output.

Timing (METHOD.md of this workplace): warm up first, then time each repetition
with CUDA events around the launch, after writing a 256 MiB buffer so that no
input is left in the 50-60 MB L2 cache; report the median and min-max. Kernel
timings replay a CUDA graph of the call (``graph=True``), so that the Python
launch overhead of an eager Triton launch (tens of microseconds) stays out: an
AOTInductor artifact launches from C++.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: granite-3.3-8b attention (ibm-granite/granite-3.3-8b-instruct config.json).
GRANITE = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}

_flush_buf = None


def flush_l2() -> None:
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    _flush_buf.fill_(1)


def graphed(fn):
    """``fn`` captured in a CUDA graph (after one eager call that compiles it);
    returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def time_cuda(
    fn, reps: int = 20, warmup: int = 3, flush: bool = True, graph: bool = False,
    queued: bool = False,
) -> dict:  # fmt: skip
    """Milliseconds per call of ``fn``: ``{"median_ms", "min_ms", "max_ms", "reps"}``;
    with ``graph``, of the replay of ``fn`` captured in a CUDA graph. With
    ``queued``, the GPU spins for about 1 ms (``torch.cuda._sleep``) before the
    start event, so ``fn``'s host work is done before the GPU reaches it: the
    time is the GPU's alone, as in an engine whose host runs ahead."""
    if graph:
        fn = graphed(fn)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if flush:
            flush_l2()
        if queued:
            torch.cuda._sleep(2_000_000)
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "reps": reps,
    }


def host_us(fn, calls: int, repeats: int, warmup: int = 50, gc_off: bool = True) -> dict:
    """Host microseconds per call of ``fn``: ``time.perf_counter`` over ``calls``
    back-to-back calls / ``calls``, ``repeats`` rounds, the GPU synchronized
    between rounds (after ``warmup`` untimed calls), the garbage collector off
    with ``gc_off``: ``{"median", "min", "max"}``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    xs = []
    if gc_off:
        gc.disable()
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            xs.append((time.perf_counter() - t) / calls * 1e6)
            torch.cuda.synchronize()
    finally:
        if gc_off:
            gc.enable()
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def device_info() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    p = torch.cuda.get_device_properties(0)
    try:
        triton = version("triton")
    except PackageNotFoundError:
        triton = "none"
    return {
        "device": p.name,
        "sm": f"{p.major}.{p.minor}",
        "multiprocessors": p.multi_processor_count,
        "memory_gib": round(p.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton,
        "python": sys.version.split()[0],
    }


def copy_bandwidth(gib: float = 2.0) -> dict:
    """Device-to-device copy of ``gib`` GiB: bytes read + written per second (TB/s)."""
    n = int(gib * 2**30)
    x = torch.empty(n, dtype=torch.int8, device="cuda").fill_(3)
    y = torch.empty_like(x)
    t = time_cuda(lambda: y.copy_(x), reps=10, flush=False)

    return {"gib": gib, **t, "tb_per_s": 2 * n / (t["median_ms"] * 1e-3) / 1e12}


def decode_inputs(
    num_seqs: int,
    num_blocks: int,
    block_size: int,
    dtype=torch.bfloat16,
    seq_lens=None,
    geometry=GRANITE,
    seed: int = 0,
):
    """Random decode inputs on the GPU: a KV pool of exactly the blocks the batch
    uses, block tables a random permutation of it (fragmented, as in a long-running
    engine), ``seq_lens`` default every sequence at ``num_blocks * block_size``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h, kvh, d = geometry["num_heads"], geometry["num_kv_heads"], geometry["head_dim"]
    pool = num_seqs * num_blocks
    kc = torch.randn(pool, block_size, kvh, d, generator=g, device="cuda", dtype=dtype)
    vc = torch.randn(pool, block_size, kvh, d, generator=g, device="cuda", dtype=dtype)
    bt = torch.randperm(pool, generator=g, device="cuda").to(torch.int32).reshape(num_seqs, -1)
    q = torch.randn(num_seqs, h, d, generator=g, device="cuda", dtype=dtype)
    if seq_lens is None:
        seq_lens = [num_blocks * block_size] * num_seqs
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q, kc, vc, bt, lens


def prefill_inputs(q: int, kv: int, block_size: int, geometry=GRANITE, seed: int = 0):
    """Random bfloat16 inputs on the GPU for one prefill chunk of ``q`` tokens at
    ``kv`` tokens of KV: a pool of the sequence's blocks plus 64, a block table
    drawn at random from it, lengths ``([kv], [q])`` int32 on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h, kvh, d = geometry["num_heads"], geometry["num_kv_heads"], geometry["head_dim"]
    nb = kv // block_size
    pool = nb + 64
    kc = torch.randn(pool, block_size, kvh, d, generator=g, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(pool, block_size, kvh, d, generator=g, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(pool, generator=g, device="cuda")[:nb].to(torch.int32)
    query = torch.randn(q, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
    lens = (
        torch.tensor([kv], dtype=torch.int32, device="cuda"),
        torch.tensor([q], dtype=torch.int32, device="cuda"),
    )
    return query, kc, vc, bt, lens


def kv_bytes(seq_lens, geometry=GRANITE, itemsize: int = 2) -> int:
    """The fewest bytes a decode step must read: K and V of every real token."""
    return 2 * sum(seq_lens) * geometry["num_kv_heads"] * geometry["head_dim"] * itemsize


def write_json(doc: dict, out: str | None, name: str) -> None:
    """Write ``doc`` to ``OUT/name`` (tables go to stdout separately)."""
    if out:
        os.makedirs(out, exist_ok=True)
        Path(out, name).write_text(json.dumps(doc, indent=1))
