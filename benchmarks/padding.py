"""Padding on a real trace: variants, padded-read fraction and KV blocks read per
real KV block, per KV ladder and per kernel.

    python benchmarks/padding.py [--trace CSV] [--limit N] [--block-size 128]
        [--max-model-len 8192] [--kv-buckets 128,256,... (repeatable)]
        [--plot PNG] [--out FILE]

Replays the request lengths of a trace (default: the Azure LLM inference trace,
conversation, 2023, ``../shared/data/azure-llm-trace-2023/conv.csv``; any CSV
with ``ContextTokens,GeneratedTokens`` columns) through the engine schedule of
:func:`warmup.request_lengths.schedule` (prefill chunks, then batched decode in waves
of max_num_seqs) and counts, with :func:`warmup.request_lengths.kv_blocks_read`,
the KV blocks each bucketed kernel call reads and the blocks it really needs.
No kernel runs: the count is exact.

    padded-read fraction = (blocks read - real blocks) / blocks read

over every decode step and prefill chunk, for a kernel that reads its whole
bucket (the plain kernels of ``kernel_cache.kernels.plain``: every block of the KV
bucket for every row of the num_seqs bucket). Beside it, per kernel, KV blocks
read per real KV block:

* ``whole bucket``: the plain kernels (blocks read / real blocks, as above);
* ``real KV``: the compiled CPU kernels (``RealKVPagedAttention``: the
  sequence's ``clamp(ceil(seq_len / block_size), 1, num_blocks)`` blocks;
  ``RealKVBatchedDecode``: ``ceil(seq_len / block_size)`` blocks per real row
  and none for a padded row), counted by :func:`real_kv_blocks_read` from
  what those kernels list for reading.

These are computed for the ``pow2`` ladder, the ``4/3``
ladder capped at ``--kv-dense-cap`` tokens (the default), the ``4/3`` ladder
uncapped, and every ``--kv-buckets`` ladder. Two parts of it are also shown:
``kv only`` leaves out the padded rows of a decode batch (the same for every KV
ladder) but keeps the shorter sequences of a batch padded to its longest one's
bucket; ``per sequence`` is the ladder's rounding alone (each sequence read up to
its own bucket, as a per-sequence kernel would). The plot (``--plot``,
needs matplotlib: ``pip install -e '.[plot]'``) shows the padded fraction
against KV length per ladder: the ladder's rounding for one sequence (top), and
on the trace per KV length of the call (bottom, kv only, lengths holding at
least 0.1% of the real blocks read), over the share of real blocks read.

Trace data: Microsoft Azure Public Dataset, AzureLLMInferenceTrace_conv (2023),
CC BY 4.0, from "Splitwise: Efficient generative LLM inference using phase
splitting" (ISCA 2024).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from _common import DEFAULT_TRACE, OUT_DIR, ROOT, header, machine, print_table, write_json

from kernel_cache.config.engine import make_config
from kernel_cache.errors import KernelCacheError
from kernel_cache.plan.buckets import BATCHED_DECODE, Bucketer, parse_bucket_list
from warmup.request_lengths import fit_request, kv_blocks_read, read_trace, schedule

#: Bins of the trace panel holding less than this share of the real blocks read
#: are left out of the plot (too few calls to say anything).
MIN_BIN_SHARE = 0.001

ATTRIBUTION = (
    "Trace: Microsoft Azure Public Dataset, AzureLLMInferenceTrace_conv (2023), "
    "CC BY 4.0 (Splitwise, ISCA 2024)"
)


def ladders(args) -> dict:
    """Ladder name -> EngineConfig (same limits, different KV buckets)."""
    base = {
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    out = {
        "pow2": make_config(args.model, kv_ladder="pow2", **base),
        f"4/3 capped at {args.kv_dense_cap}": make_config(
            args.model, kv_ladder="4/3", kv_dense_cap=args.kv_dense_cap, **base
        ),
        "4/3 uncapped": make_config(args.model, kv_ladder="4/3", kv_dense_cap=0, **base),
    }
    for text in args.kv_buckets or ():
        buckets = parse_bucket_list(text, "--kv-buckets")
        name = f"custom {text}"
        if len(buckets) > 4:
            name = f"custom {buckets[0]},{buckets[1]},..,{buckets[-1]}"
        out[name] = make_config(args.model, kv_buckets=buckets, **base)
    return out


def real_kv_blocks_read(bucketer: Bucketer, call) -> int:
    """KV blocks the real-KV CPU kernels read for ``call``: prefill gathers
    ``clamp(ceil(seq_len / block_size), 1, num_blocks)`` blocks; decode lists
    ``ceil(seq_len / block_size)`` blocks per sequence, none for a padded row
    (:class:`kernel_cache.kernels.builtin.RealKVPagedAttention`, ``RealKVBatchedDecode``)."""
    bs = bucketer.block_size
    need = [-(-n // bs) for n in call.seq_lens]
    if call.kernel == BATCHED_DECODE:
        return sum(need)
    return max(1, need[0])


def measure(requests, bucketers: dict) -> dict:
    """Blocks read and real blocks per ladder: in total, per phase and per KV
    length (bin = blocks the call's longest sequence needs)."""
    first = next(iter(bucketers.values()))
    nbins = first.max_blocks + 1
    acc = {
        name: {
            "read": 0,
            "real": 0,
            "read_kv_only": 0,
            "read_per_seq": 0,
            "prefill": [0, 0],
            "decode": [0, 0],
            "real_kv": {"prefill": 0, "decode": 0},
            "bins_read": [0] * nbins,
            "bins_real": [0] * nbins,
        }
        for name in bucketers
    }
    bs = first.block_size
    items = [
        (acc[n], b, bool(b.num_seqs_buckets), [0] + [b.blocks_bucket(k) for k in range(1, nbins)])
        for n, b in bucketers.items()
    ]
    calls = {"prefill": 0, "decode": 0}
    for call in schedule(requests, first):
        decode = call.kernel == BATCHED_DECODE
        calls["decode" if decode else "prefill"] += 1
        need = [-(-x // bs) for x in call.seq_lens]
        n = max(need)
        s = len(need)
        for a, b, batched, bucket_of in items:
            read, real = kv_blocks_read(b, call)
            a["read"] += read
            a["real"] += real
            kv_only = read * s // b.num_seqs_bucket(s) if decode and batched else read
            a["read_kv_only"] += kv_only
            a["read_per_seq"] += sum(bucket_of[k] for k in need)
            ph = a["decode" if decode else "prefill"]
            ph[0] += read
            ph[1] += real
            a["real_kv"]["decode" if decode else "prefill"] += real_kv_blocks_read(b, call)
            a["bins_read"][n] += kv_only
            a["bins_real"][n] += real
    return {"acc": acc, "calls": calls}


def _ratio(read: int, real: int) -> float | None:
    return read / real if real else None


def plot(path: Path, bucketers: dict, acc: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(bucketers.values()))
    bs, mb = first.block_size, first.max_blocks
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True)
    styles = [("-", 2.4), ("-", 1.4), ("--", 1.4), (":", 1.6), ("-.", 1.2)]
    for i, (name, b) in enumerate(bucketers.items()):
        xs, ys = [0], [0.0]
        for n in range(1, mb + 1):
            bucket = b.blocks_bucket(n)
            xs.append(n * bs)
            ys.append((bucket - n) / bucket)
        ls, lw = styles[i % len(styles)]
        ax1.step(
            xs,
            ys,
            where="pre",
            linestyle=ls,
            linewidth=lw,
            label=f"{name} ({len(b.num_blocks_buckets)} kv buckets, {len(b.variants)} variants)",
        )
    ax1.set_ylabel("padded fraction of one\nsequence's read (ladder)")
    ax1.set_title(title, fontsize=10)
    ax1.set_ylim(0, 1.2)
    ax1.legend(fontsize=8, loc="upper right", framealpha=0.95)
    ax1.grid(alpha=0.3)
    twin = ax2.twinx()
    real = acc[next(iter(acc))]["bins_real"]
    total = sum(real) or 1
    twin.bar(
        [n * bs for n in range(len(real))],
        [r / total for r in real],
        width=bs * 0.9,
        color="0.85",
        label="share of real KV blocks read",
    )
    twin.set_ylabel("share of real KV blocks read (bars)")
    ax2.set_zorder(twin.get_zorder() + 1)
    ax2.patch.set_visible(False)
    for i, (name, a) in enumerate(acc.items()):
        ls, lw = styles[i % len(styles)]
        xs, ys = [], []
        for n, (rd, rl) in enumerate(zip(a["bins_read"], a["bins_real"], strict=True)):
            if rd and real[n] >= MIN_BIN_SHARE * total:
                xs.append(n * bs)
                ys.append(1 - rl / rd)
        ax2.plot(xs, ys, marker=".", markersize=3, linestyle=ls, linewidth=lw * 0.6, label=name)
    ax2.set_xlabel(f"KV length of the call (tokens; blocks of {bs})")
    ax2.set_ylabel("padded fraction of decode and\nprefill reads on the trace (kv only)")
    ax2.set_ylim(0, 1.2)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8, loc="upper right", framealpha=0.95)
    fig.text(0.01, 0.005, ATTRIBUTION, fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _reads(d: dict) -> str:
    def f(x):
        return "-" if x is None else f"{x:.3f}"

    return f"{f(d['all'])} ({f(d['prefill'])}, {f(d['decode'])})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE),
        help="CSV with ContextTokens,"
        "GeneratedTokens (default: the Azure conv trace beside the checkout)",
    )
    p.add_argument("--limit", type=int, default=None, help="requests (default: all)")
    p.add_argument("--start", type=int, default=0, help="first row of the trace")
    p.add_argument(
        "--model",
        default="llama-3.2-1b",
        help="preset or config.json (the geometry does not change padding)",
    )
    p.add_argument("--block-size", type=int, default=128, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=8192, help="tokens")
    p.add_argument("--max-num-seqs", type=int, default=8, help="decode wave size")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="prefill chunk")
    p.add_argument("--kv-dense-cap", type=int, default=4096, help="tokens, the capped 4/3 ladder")
    p.add_argument(
        "--kv-buckets",
        action="append",
        help="an extra ladder: comma-separated KV buckets in tokens (repeatable)",
    )
    p.add_argument("--plot", default=str(OUT_DIR / "padding.png"), help="PNG path; 'none' to skip")
    p.add_argument("--out", default=str(OUT_DIR / "padding.json"))
    args = p.parse_args(argv)
    try:
        configs = ladders(args)
        bucketers = {n: Bucketer(c) for n, c in configs.items()}
        requests = read_trace(args.trace, limit=args.limit, start=args.start)
    except KernelCacheError as e:
        print(f"padding: error: {e}", file=sys.stderr)
        return 2
    if not requests:
        print(f"padding: error: no requests in {args.trace}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    m = measure(requests, bucketers)
    seconds = time.perf_counter() - t0
    acc = m["acc"]
    cap_name = f"4/3 capped at {args.kv_dense_cap}"
    results = []
    for name, b in bucketers.items():
        a = acc[name]
        results.append(
            {
                "ladder": name,
                "kv_buckets": list(b.kv_buckets),
                "variants": len(b.variants),
                "kv_blocks_read": a["read"],
                "kv_blocks_real": a["real"],
                "padded_read_fraction": 1 - a["real"] / a["read"],
                "padded_read_fraction_kv_only": 1 - a["real"] / a["read_kv_only"],
                "padded_read_fraction_per_sequence": 1 - a["real"] / a["read_per_seq"],
                "padded_read_fraction_prefill": 1 - a["prefill"][1] / a["prefill"][0]
                if a["prefill"][0]
                else 0.0,
                "padded_read_fraction_decode": 1 - a["decode"][1] / a["decode"][0]
                if a["decode"][0]
                else 0.0,
                "blocks_read_vs_pow2": a["read"] / acc["pow2"]["read"],
                "reads_per_real_block": {
                    "whole_bucket": {
                        "all": a["read"] / a["real"],
                        "prefill": _ratio(*a["prefill"]),
                        "decode": _ratio(*a["decode"]),
                    },
                    "real_kv": {
                        "all": sum(a["real_kv"].values()) / a["real"],
                        "prefill": _ratio(a["real_kv"]["prefill"], a["prefill"][1]),
                        "decode": _ratio(a["real_kv"]["decode"], a["decode"][1]),
                    },
                },
            }
        )
    by = {r["ladder"]: r for r in results}
    doc = header("padding")
    doc["machine"] = machine("cpu")
    cfg0 = configs["pow2"]
    doc["config"] = {
        "trace": str(Path(args.trace).resolve()),
        "trace_attribution": ATTRIBUTION,
        "requests": len(requests),
        "truncated_requests": sum(fit_request(r, cfg0.max_model_len)[2] for r in requests),
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kernel_calls": m["calls"],
        "seconds": round(seconds, 2),
    }
    doc["results"] = results
    doc["target"] = {
        "4/3 capped reads less than pow2 for whole-bucket kernels": by[cap_name][
            "padded_read_fraction"
        ]
        < by["pow2"]["padded_read_fraction"]
    }
    want_plot = args.plot.lower() != "none"
    if want_plot and importlib.util.find_spec("matplotlib") is None:
        print(
            "padding: matplotlib is not installed, so no plot "
            "(pip install -e '.[plot]', or --plot none to silence this)",
            file=sys.stderr,
        )
        want_plot = False
    if want_plot:
        title = (
            f"KV padding per ladder: block_size {args.block_size}, max_model_len "
            f"{args.max_model_len}, {len(requests)} requests of {Path(args.trace).name}"
        )
        plot(Path(args.plot), bucketers, acc, title)
        doc["plot"] = str(Path(args.plot).resolve())
    out = write_json(args.out, doc)
    print_table(
        f"Padding on {Path(args.trace).name}: {len(requests)} requests, "
        f"{m['calls']['prefill']} prefill chunks, {m['calls']['decode']} decode steps, "
        f"block_size {args.block_size}, max_model_len {args.max_model_len}",
        [
            "ladder",
            "kv buckets",
            "variants",
            "padded read",
            "kv only",
            "per sequence",
            "prefill",
            "decode",
            "reads / pow2",
            "reads per real block: whole bucket (prefill, decode)",
            "real KV (prefill, decode)",
        ],
        [
            [
                r["ladder"],
                len(r["kv_buckets"]),
                r["variants"],
                f"{r['padded_read_fraction']:.3f}",
                f"{r['padded_read_fraction_kv_only']:.3f}",
                f"{r['padded_read_fraction_per_sequence']:.3f}",
                f"{r['padded_read_fraction_prefill']:.3f}",
                f"{r['padded_read_fraction_decode']:.3f}",
                f"{r['blocks_read_vs_pow2']:.3f}",
                _reads(r["reads_per_real_block"]["whole_bucket"]),
                _reads(r["reads_per_real_block"]["real_kv"]),
            ]
            for r in results
        ],
    )
    if "plot" in doc:
        print(f"plot: {doc['plot']}")
    print(f"JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
