"""Dispatch overhead: ``AttentionRuntime`` dispatch against calling the same loaded
kernel directly on pre-padded inputs, per call, for decode and prefill shapes.

    python benchmarks/dispatch.py [ENGINE OPTIONS] [--calls K] [--repeats R]
        [--cache-dir DIR] [--out FILE]

For each case the plan's variant is loaded once (``load_plan``) and called
three ways, K calls per timed block (at most ``--calls``, fewer for a long
kernel: about ``--block-seconds`` per block), R rounds, the three interleaved in each
round (garbage collector off while timing). On the CPU the clock is, by default,
the calling thread's CPU time (``time.thread_time``) with one intra-op thread
(``--threads 1``): the kernel then runs on that thread and is counted, while
time the thread spends descheduled by other processes on a shared machine is
not. ``--clock wall`` uses ``time.perf_counter`` (always on CUDA, with a device
synchronization around each block):

* ``dispatch``: ``rt.decode(...)`` / ``rt.prefill(...)`` with real, unpadded
  inputs and host-side lengths (bucket lookup, shape checks, padding into the
  reused buffers, the kernel, the output slice);
* ``direct``: the same loaded runner (``runner.run``) on inputs padded
  beforehand, i.e. the kernel alone;
* ``host only``: the same dispatch with the kernel replaced by a runner that
  returns a preallocated output, i.e. everything dispatch adds, without the
  kernel's noise;
* with ``--host-only``, only the host-only ways (no warmup, no compiled kernel:
  the runtime is built around stub runners), e.g. to profile dispatch's Python
  path on a machine without the plan's artifacts;
* with ``--baseline DIR`` (another checkout, e.g. main before a change), also
  that checkout's dispatch, host only, interleaved: a before/after in one run.

Overhead = dispatch - direct, per round (median, min-max), in microseconds and
as a percent of the direct call. Case names: ``decode S/B seqs, kv A-Z`` is S
sequences in the batch bucket B with KV lengths between A and Z tokens;
``prefill Q/B tokens, kv L`` is Q new tokens in the query bucket B at L KV
tokens. Target: under 20 us per call on this CPU.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
from _common import (
    DEFAULT_CACHE,
    OUT_DIR,
    ROOT,
    fmt,
    header,
    machine,
    print_table,
    summary,
    sync,
    write_json,
)

from kernel_cache import AttentionRuntime, load_plan
from kernel_cache.plan.buckets import BATCHED_DECODE, PAGED_ATTENTION, Bucketer, KernelVariant
from warmup.builder.planner import warmup
from warmup.cli.main import config_from_args, engine_options

TARGET_US = 20.0


class HostOnlyRunner:
    """Stands in for a loaded kernel: returns a preallocated output (measures
    what dispatch costs around the kernel)."""

    def __init__(self, out):
        self.out = [out]

    def run(self, args):
        return self.out


def load_baseline(root: str):
    """Another checkout's ``kernel_cache`` package (e.g. main before a change),
    imported whole from ``root`` beside this one.

    Its modules import each other as ``kernel_cache.*``, so they are imported
    with ``root`` first on ``sys.path`` and this checkout's modules moved out of
    ``sys.modules``; afterwards this checkout's modules are put back and the
    baseline's live on through the returned package (its functions keep their
    own module globals). A function-level import the baseline runs later
    would find this checkout's module: dispatch's hot path has none.

    Raises:
        SystemExit: ``root`` has no ``kernel_cache`` package, or the import did
            not come from ``root``.
    """
    import importlib

    pkg = Path(root).resolve() / "kernel_cache"
    if not (pkg / "__init__.py").is_file():
        raise SystemExit(f"--baseline {root}: no kernel_cache package there")

    def ours(name: str) -> bool:
        return name == "kernel_cache" or name.startswith("kernel_cache.")

    saved = {k: m for k, m in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(pkg.parent))
    try:
        mod = importlib.import_module("kernel_cache")
    finally:
        sys.path.remove(str(pkg.parent))
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
    if not Path(mod.__file__).resolve().is_relative_to(pkg):
        raise SystemExit(f"--baseline {root}: imported {mod.__file__} instead")
    return mod


def baseline_host_runtime(base, cfg, v, out):
    """The baseline's AttentionRuntime with a host-only runner for ``v``."""
    known = set(base.EngineConfig.model_fields) - {"model"}  # fields the baseline has
    bcfg = base.make_config(None, **cfg.model_dump(include=known))
    bv = base.KernelVariant(**v.model_dump())
    return base.AttentionRuntime(bcfg, base.Bucketer(bcfg), {bv: HostOnlyRunner(out)})


def make_cases(cfg, b: Bucketer, g: torch.Generator):
    """Decode (full and padded batch) and prefill (one token, a padded chunk)
    cases whose lengths land in the middle of the plan's ladders."""
    dev, dt = torch.device(cfg.device), cfg.torch_dtype()
    h, kvh, d, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    nbs = b.num_blocks_buckets
    i = len(nbs) // 2
    nb = nbs[i]
    lo = nbs[i - 1] * bs if i else 0
    hi = nb * bs
    pool = max(b.num_seqs_buckets or (1,)) * b.max_blocks + 3
    kc = torch.randn(pool, bs, kvh, d, generator=g).to(dev, dt)
    vc = torch.randn(pool, bs, kvh, d, generator=g).to(dev, dt)
    cases = []

    def lens(n):
        return [int(x) for x in torch.randint(lo + 1, hi + 1, (n,), generator=g)]

    if b.num_seqs_buckets:
        sb = b.num_seqs_buckets[-1]
        counts = [sb]
        if sb > 1 and (len(b.num_seqs_buckets) == 1 or sb - 1 > b.num_seqs_buckets[-2]):
            counts.append(sb - 1)
        for s in counts:
            ls = lens(s)
            bt = torch.randint(0, pool, (s, b.max_blocks), generator=g, dtype=torch.int32)
            q = torch.randn(s, h, d, generator=g).to(dev, dt)
            v = KernelVariant(kernel=BATCHED_DECODE, query_len=1, num_blocks=nb, num_seqs=sb)
            qp = torch.zeros(sb, h, d, dtype=dt, device=dev)
            qp[:s] = q
            btp = torch.zeros(sb, nb, dtype=torch.int32)
            btp[:s] = bt[:, :nb]
            lp = torch.zeros(sb, dtype=torch.int32)
            lp[:s] = torch.tensor(ls, dtype=torch.int32)
            cases.append(
                {
                    "name": f"decode {s}/{sb} seqs, kv {lo + 1}-{hi}",
                    "variant": v,
                    "method": "decode",
                    "args": (q, kc, vc, bt.to(dev), ls),
                    "padded": [qp, kc, vc, btp.to(dev), lp.to(dev)],
                }
            )
    for qlen in (1, None):
        if qlen is None:
            if len(b.query_buckets) < 2:
                continue
            qb = b.query_buckets[1]
            qlen = max(1, min(qb - qb // 4, hi))
        qb = b.query_bucket(qlen)
        seq_len = max(qlen, hi - bs // 2, lo + 1)
        nbq = b.blocks_bucket(-(-seq_len // bs))
        bt = torch.randint(0, pool, (b.max_blocks,), generator=g, dtype=torch.int32)
        q = torch.randn(qlen, h, d, generator=g).to(dev, dt)
        v = KernelVariant(kernel=PAGED_ATTENTION, query_len=qb, num_blocks=nbq, num_seqs=1)
        qp = torch.zeros(qb, h, d, dtype=dt, device=dev)
        qp[:qlen] = q
        lensp = torch.tensor([seq_len, qlen], dtype=torch.int32, device=dev)
        cases.append(
            {
                "name": f"prefill {qlen}/{qb} tokens, kv {seq_len}",
                "variant": v,
                "method": "prefill",
                "args": (q, kc, vc, bt.to(dev), seq_len),
                "padded": [qp, kc, vc, bt[:nbq].to(dev), lensp[0:1], lensp[1:2]],
            }
        )
    return cases


def load_compiled(cfg, cache_dir: str, cases) -> AttentionRuntime:
    """Warm up (compile if missing) the cases' variants and load them."""
    needed = list(dict.fromkeys(c["variant"] for c in cases))
    rep = warmup(cfg, cache_dir, jobs=min(2, len(needed)), variants=needed, progress=True)
    if rep["failed"]:
        raise SystemExit(f"warmup failed: {rep['failed']}")
    return load_plan(cfg, cache_dir, strict=False)


def time_block(fn, calls: int, device: str, clock=time.perf_counter) -> float:
    """Seconds per call over ``calls`` back-to-back calls."""
    sync(device)
    t0 = clock()
    for _ in range(calls):
        fn()
    sync(device)
    return (clock() - t0) / calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.add_argument("--calls", type=int, default=200, help="calls per timed block (at most)")
    p.add_argument(
        "--block-seconds",
        type=float,
        default=0.05,
        help="fewer calls per block for long kernels: about this long per block",
    )
    p.add_argument("--repeats", type=int, default=15, help="rounds")
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="kernel_cache directory")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument(
        "--clock",
        choices=("thread", "wall"),
        default=None,
        help="thread CPU time (CPU default) or wall time (CUDA default)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="another checkout (its kernel_cache/): also time its host-only dispatch, "
        "interleaved, for a before/after in one run",
    )
    p.add_argument(
        "--host-only",
        action="store_true",
        help="time only dispatch around stub runners: no warmup, no compiled kernel",
    )
    p.add_argument("--out", default=str(OUT_DIR / "dispatch.json"))
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    clock_name = args.clock or ("wall" if cfg.device == "cuda" else "thread")
    clock = time.perf_counter if clock_name == "wall" else time.thread_time
    if cfg.device == "cpu":
        torch.set_num_threads(args.threads)
    b = Bucketer(cfg)
    g = torch.Generator().manual_seed(0)
    cases = make_cases(cfg, b, g)
    rt = None if args.host_only else load_compiled(cfg, args.cache_dir, cases)
    baseline = load_baseline(args.baseline) if args.baseline else None

    results = []
    with torch.no_grad():
        for c in cases:
            v = c["variant"]
            fns = {}
            if rt is None:
                direct_out = torch.empty_like(c["padded"][0])
            else:
                runner = rt._runners[v]  # the very kernel dispatch calls
                dispatch = getattr(rt, c["method"])
                out = dispatch(*c["args"])
                direct_out = runner.run(c["padded"])[0]
                err = float((out - direct_out[: out.shape[0]]).abs().max())
                if err > 0:
                    raise SystemExit(f"{c['name']}: dispatch and direct outputs differ by {err}")
                fns["dispatch"] = lambda d=dispatch, a=c["args"]: d(*a)
                fns["direct"] = lambda r=runner, a=c["padded"]: r.run(a)
            host_rt = AttentionRuntime(cfg, b, {v: HostOnlyRunner(direct_out)})
            host = getattr(host_rt, c["method"])
            fns["host_only"] = lambda h=host, a=c["args"]: h(*a)
            if cfg.device == "cpu":  # the same, without the block-id check
                nocheck_rt = AttentionRuntime(cfg, b, {v: HostOnlyRunner(direct_out)})
                nocheck_rt.check_block_ids = False
                nc = getattr(nocheck_rt, c["method"])
                fns["host_only_no_id_check"] = lambda h=nc, a=c["args"]: h(*a)
            if baseline is not None:
                brt = baseline_host_runtime(baseline, cfg, v, direct_out)
                bhost = getattr(brt, c["method"])
                fns["host_only_baseline"] = lambda h=bhost, a=c["args"]: h(*a)
            for f in fns.values():  # warm up
                time_block(f, 3, cfg.device, clock)
            # Calls per block, per way: at most --calls, fewer for a long kernel
            # so that a block takes about --block-seconds.
            calls = {}
            for k, f in fns.items():
                one = time_block(f, 3, cfg.device, clock)
                calls[k] = max(3, min(args.calls, round(args.block_seconds / max(one, 1e-9))))
            t = {k: [] for k in fns}
            gc.disable()
            try:
                for _ in range(args.repeats):
                    for k, f in fns.items():
                        t[k].append(time_block(f, calls[k], cfg.device, clock))
            finally:
                gc.enable()
            results.append({"case": c["name"], "variant": str(v), "calls_per_block": calls})
            if "direct" in t:
                over = [a - d for a, d in zip(t["dispatch"], t["direct"], strict=True)]
                pct = [100 * o / d for o, d in zip(over, t["direct"], strict=True)]
                results[-1]["direct_us"] = summary([x * 1e6 for x in t["direct"]])
                results[-1]["dispatch_us"] = summary([x * 1e6 for x in t["dispatch"]])
                results[-1]["overhead_us"] = summary([x * 1e6 for x in over])
                results[-1]["overhead_pct"] = summary(pct)
            results[-1]["host_only_us"] = summary([x * 1e6 for x in t["host_only"]])
            if "host_only_no_id_check" in t:
                results[-1]["host_only_no_id_check_us"] = summary(
                    [x * 1e6 for x in t["host_only_no_id_check"]]
                )
            if baseline is not None:
                results[-1]["host_only_baseline_us"] = summary(
                    [x * 1e6 for x in t["host_only_baseline"]]
                )
                results[-1]["host_only_vs_baseline"] = summary(
                    [a / b for a, b in zip(t["host_only"], t["host_only_baseline"], strict=True)]
                )

    doc = header("dispatch")
    doc["machine"] = machine(cfg.device)
    doc["config"] = {
        "engine": cfg.model_dump(mode="json"),
        "baseline": str(Path(args.baseline).resolve()) if args.baseline else None,
        "calls_per_block": args.calls,
        "repeats": args.repeats,
        "clock": clock_name,
        "torch_threads": torch.get_num_threads(),
    }
    doc["results"] = results
    doc["target"] = {
        "target_us": TARGET_US,
        "overhead_under_target": None
        if args.host_only
        else all(r["overhead_us"]["median"] < TARGET_US for r in results),
        "host_only_under_target": all(r["host_only_us"]["median"] < TARGET_US for r in results),
    }
    out = write_json(args.out, doc)
    print_table(
        f"Dispatch overhead per call, {cfg.model} ({cfg.dtype}, {cfg.device}), "
        f"{args.repeats} rounds of up to {args.calls} calls, {clock_name} clock, "
        f"{torch.get_num_threads()} thread(s), median (min-max)",
        ["case"]
        + ([] if args.host_only else ["direct us", "dispatch us", "overhead us", "overhead %"])
        + ["host only us"]
        + (["host only, no id check us"] if cfg.device == "cpu" else [])
        + (["baseline host only us", "host only / baseline"] if baseline else []),
        [
            [r["case"]]
            + [
                fmt(r[k], digits=1)
                for k in ("direct_us", "dispatch_us", "overhead_us", "overhead_pct")
                if k in r
            ]
            + [fmt(r["host_only_us"], digits=1)]
            + ([fmt(r["host_only_no_id_check_us"], digits=1)] if cfg.device == "cpu" else [])
            + (
                [
                    fmt(r["host_only_baseline_us"], digits=1),
                    fmt(r["host_only_vs_baseline"], digits=2),
                ]
                if baseline
                else []
            )
            for r in results
        ],
    )
    print(f"JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
