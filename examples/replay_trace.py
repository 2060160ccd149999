"""Replay real request lengths through a warmed plan, with zero compiles.

    python examples/replay_trace.py [ENGINE OPTIONS] [--cache-dir DIR] \
        [--trace CSV] [--limit 64] [--json]

``--trace`` defaults to ``../shared/data/azure-llm-trace-2023/conv.csv``
relative to the repository (:data:`DEFAULT_TRACE`); elsewhere pass the CSV.

Loads the plan (engine start), then serves each request of the trace: its
prefill chunks through ``paged_attention`` and its decode steps through
``batched_decode`` (batched in waves of up to max_num_seqs), with random
tensors of the real shapes. Prints requests served, kernel calls per variant,
the padded-read fraction (padded KV blocks read / all KV blocks read), the
compiles torch counted in this process since engine start (0) and the
compile-stack modules it imported (none); exits 1 if either is not.

Trace data: Microsoft Azure Public Dataset, AzureLLMInferenceTrace_conv (2023),
CC BY 4.0 ("Splitwise", ISCA 2024).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kernel_cache import load_plan
from kernel_cache.errors import KernelCacheError
from kernel_cache.plan.buckets import PAGED_ATTENTION
from warmup.cli.main import (
    CACHE_DIR_HELP,
    cache_dir_of,
    config_from_args,
    engine_options,
    quiet_on_closed_stdout,
)
from warmup.request_lengths import fit_request, kv_blocks_read, read_trace, schedule

#: The trace's place relative to the repository (the root is this file's parent's parent).
TRACE_IN_REPO = "../shared/data/azure-llm-trace-2023/conv.csv"
DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / TRACE_IN_REPO.removeprefix("../")
TRACE_SOURCE = (
    "AzureLLMInferenceTrace_conv.csv from https://github.com/Azure/AzurePublicDataset (CC BY 4.0)"
)


def check_trace(path) -> None:
    """Fail early, before the plan is loaded, when the trace is not there.

    Raises:
        KernelCacheError: names the path, the default and ``--trace``.
    """
    if not Path(path).is_file():
        default = Path(path) == DEFAULT_TRACE
        raise KernelCacheError(
            f"trace {path}: no such file"
            + (f" (the default: {TRACE_IN_REPO} relative to the repository)" if default else "")
            + "; pass --trace PATH, a CSV with ContextTokens and GeneratedTokens columns such "
            f"as {TRACE_SOURCE}"
        )


def replay(config, cache_dir, trace, limit, start=0, seed=0) -> dict:
    check_trace(trace)
    requests = read_trace(trace, limit=limit, start=start)
    rt = load_plan(config, cache_dir)
    c = config
    dev, dt = torch.device(c.device), c.torch_dtype()
    g = torch.Generator().manual_seed(seed)
    # One KV pool with a private block range per slot of a wave.
    pool = c.max_num_seqs * c.max_blocks
    kc = torch.randn(pool, c.block_size, c.num_kv_heads, c.head_dim, generator=g).to(dev, dt)
    vc = torch.randn(pool, c.block_size, c.num_kv_heads, c.head_dim, generator=g).to(dev, dt)
    tables = torch.arange(pool, dtype=torch.int32, device=dev).reshape(c.max_num_seqs, -1)
    read = real = 0
    t0 = time.perf_counter()
    for call in schedule(requests, rt.bucketer):
        r, n = kv_blocks_read(rt.bucketer, call)
        read += r
        real += n
        if call.kernel == PAGED_ATTENTION:
            q = torch.randn(call.query_len, c.num_heads, c.head_dim, generator=g).to(dev, dt)
            out = rt.prefill(q, kc, vc, tables[call.slots[0]], call.seq_lens[0])
        else:
            s = len(call.seq_lens)
            q = torch.randn(s, c.num_heads, c.head_dim, generator=g).to(dev, dt)
            out = rt.decode(q, kc, vc, tables[list(call.slots)], list(call.seq_lens))
        if not torch.isfinite(out).all():
            raise RuntimeError(f"non-finite output for {call}")
    truncated = sum(fit_request(r, c.max_model_len)[2] for r in requests)
    stats = rt.stats()
    return {
        "requests": len(requests),
        "truncated_requests": truncated,
        "kernel_calls": sum(stats["calls"].values()),
        "calls_per_variant": stats["calls"],
        "padded_read_fraction": round(1 - real / read, 4) if read else 0.0,
        "compiles": stats["compiles"],
        "compile_stack_imported": stats["compile_stack_imported"],
        "load_seconds": stats["load_seconds"],
        "serve_seconds": round(time.perf_counter() - t0, 3),
    }


@quiet_on_closed_stdout
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.add_argument("--cache-dir", default=None, metavar="DIR", help=CACHE_DIR_HELP)
    p.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE),
        metavar="CSV",
        help="requests: a CSV with ContextTokens and GeneratedTokens columns (default "
        f"{TRACE_IN_REPO} relative to the repository: {TRACE_SOURCE})",
    )
    p.add_argument("--limit", type=int, default=64, help="requests to replay (default 64)")
    p.add_argument("--start", type=int, default=0, help="first row of the trace")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        cfg, cache = config_from_args(args), cache_dir_of(args)
        report = replay(cfg, cache, args.trace, args.limit, args.start)
    except KernelCacheError as e:
        print(f"replay_trace: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"served {report['requests']} requests ({report['truncated_requests']} truncated "
            f"to max_model_len) in {report['kernel_calls']} kernel calls, "
            f"{report['serve_seconds']:.1f} s"
        )
        for v, n in report["calls_per_variant"].items():
            print(f"  {v:32s} {n:7d}")
        print(f"padded-read fraction: {report['padded_read_fraction']:.3f}")
        print(f"compiles: {report['compiles']}")
        if report["compile_stack_imported"]:
            print(f"compile stack imported: {', '.join(report['compile_stack_imported'])}")
    return 0 if report["compiles"] == 0 and not report["compile_stack_imported"] else 1


if __name__ == "__main__":
    sys.exit(main())
