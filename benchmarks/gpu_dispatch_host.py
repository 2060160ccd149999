"""Where dispatch's host time goes on CUDA: granite-3.3-8b decode 32 x 8192 and
prefill 2048 @ 8192 through ``AttentionRuntime`` around stub runners (no kernel,
no artifact), and the pieces of the CUDA-only path timed alone.

    python benchmarks/gpu_dispatch_host.py [--calls N] [--repeats R] [--out DIR]

Each row: ``time.perf_counter`` over N back-to-back calls / N, R rounds, median
(min-max) in microseconds, garbage collector off. The stub returns a
preallocated output, so a row is dispatch's own Python and torch work (checks,
bucket lookup, padding, the lengths' staging row and its host-to-device copy).
Writes ``gpu_dispatch_host.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from array import array

import torch

if not torch.cuda.is_available():
    sys.exit(f"{sys.argv[0]}: needs a CUDA GPU; run it on the GPU machine")

from gpu_common import host_us, write_json

from kernel_cache import AttentionRuntime, make_config
from kernel_cache.plan.buckets import BATCHED_DECODE, PAGED_ATTENTION, Bucketer, KernelVariant

try:  # absent before the kernels read pinned lengths in place (a baseline run)
    from kernel_cache.runtime.buffers import mapped_pinned_reads
except ImportError:

    def mapped_pinned_reads(device) -> bool:
        return False


LIMITS = dict(
    max_model_len=8192,
    block_size=16,
    max_num_seqs=32,
    max_num_batched_tokens=2048,
    kv_buckets=(4096, 8192),
    query_buckets=(512, 2048),
    num_seqs_buckets=(8, 32),
)


class StubRunner:
    """Returns a preallocated output: what dispatch costs around the kernel."""

    def __init__(self, out):
        self.out = [out]

    def run(self, args):
        return self.out


def cases() -> dict:
    """``{name: zero-argument callable}``."""
    cfg = make_config("granite-3.3-8b", device="cuda", **LIMITS)
    b = Bucketer(cfg)
    dec = KernelVariant(kernel=BATCHED_DECODE, query_len=1, num_blocks=512, num_seqs=32)
    pre = KernelVariant(kernel=PAGED_ATTENTION, query_len=2048, num_blocks=512, num_seqs=1)
    dev, dt = "cuda", torch.bfloat16
    runners = {
        dec: StubRunner(torch.empty(32, 32, 128, device=dev, dtype=dt)),
        pre: StubRunner(torch.empty(2048, 32, 128, device=dev, dtype=dt)),
    }
    rt = AttentionRuntime(cfg, b, runners)  # lengths read in place where that works
    rt.map_pinned_lengths = True
    copied = AttentionRuntime(cfg, b, runners)  # lengths copied to the device per call
    copied.map_pinned_lengths = False
    kc = torch.zeros(64, 16, 8, 128, device=dev, dtype=dt)  # block ids are not read
    vc = torch.zeros_like(kc)
    bt = torch.zeros(32, 512, device=dev, dtype=torch.int32)
    q32 = torch.zeros(32, 32, 128, device=dev, dtype=dt)
    q2k = torch.zeros(2048, 32, 128, device=dev, dtype=dt)
    lens = [8192 - i for i in range(32)]
    dlens = torch.full((32,), 8192, device=dev, dtype=torch.int32)
    rt.decode(q32, kc, vc, bt, lens)
    slot = next(iter(rt._slots.values()))
    row = slot.ring_np[0]
    mv = memoryview(row).cast("B").cast("i")
    arr = array("i", lens)
    pinned = slot.ring[0]
    ev = torch.cuda.Event()
    out = {
        "decode 32 x 8192, host lengths": lambda: rt.decode(q32, kc, vc, bt, lens),
        "decode 32 x 8192, host lengths, copied": lambda: copied.decode(q32, kc, vc, bt, lens),
        "decode 32 x 8192, device_seq_lens": lambda: rt.decode(
            q32, kc, vc, bt, lens, device_seq_lens=dlens
        ),
        "prefill 2048 @ 8192": lambda: rt.prefill(q2k, kc, vc, bt[0], 8192),
        "prefill 2048 @ 8192, copied": lambda: copied.prefill(q2k, kc, vc, bt[0], 8192),
        "piece: array('i', lens)": lambda: array("i", lens),
        "piece: numpy row[:32] = array": lambda: row.__setitem__(slice(0, 32), arr),
        "piece: memoryview row[:32] = array": lambda: mv.__setitem__(slice(0, 32), arr),
        "piece: is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "piece: lens.copy_(pinned, non_blocking)": lambda: slot.lens.copy_(
            pinned, non_blocking=True
        ),
        "piece: event.record()": ev.record,
    }
    try:
        from cuda.bindings import runtime as cudart

        dst, src, n = slot.lens.data_ptr(), pinned.data_ptr(), pinned.nbytes
        raw = torch._C._cuda_getCurrentRawStream
        kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        out["piece: cudaMemcpyAsync (cuda.bindings)"] = lambda: cudart.cudaMemcpyAsync(
            dst, src, n, kind, raw(0)
        )
        out["piece: _cuda_getCurrentRawStream"] = lambda: raw(0)
    except Exception as e:  # the bindings are optional here
        print(f"cuda.bindings not timed: {e}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = {name: host_us(fn, args.calls, args.repeats) for name, fn in cases().items()}
    write_json({"calls": args.calls, "repeats": args.repeats, "rows": rows}, args.out,
               "gpu_dispatch_host.json")  # fmt: skip
    print(f"lengths read from pinned rows by the kernels: {mapped_pinned_reads('cuda')}")
    print(f"host us per call, median (min-max) of {args.repeats} x {args.calls} calls:")
    for name, r in rows.items():
        print(f"  {name:45s} {r['median']:7.2f} ({r['min']:.2f}-{r['max']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
