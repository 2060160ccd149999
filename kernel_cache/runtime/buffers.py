"""The buffers dispatch reuses per loaded variant: padded inputs, host lengths
and, on CUDA, a ring of pinned staging rows (mapped to the device where kernels
can read pinned host memory directly). Made once per variant, on its first call
(:class:`kernel_cache.runtime.dispatch.AttentionRuntime`).
"""

from __future__ import annotations

from array import array

import torch

from kernel_cache.config.engine import EngineConfig
from kernel_cache.plan.buckets import PAGED_ATTENTION, KernelVariant

#: Pinned staging rows per slot for the lengths of a CUDA call; a row is
#: rewritten only after the GPU has run the kernel that read it, so the host may
#: run up to RING / 2 calls of one variant ahead of the GPU before a call waits.
RING = 64

#: Block tables up to this many entries are range-checked with Python's max over
#: a memoryview (cheaper in the dispatch loop than a numpy or torch reduction,
#: measured with benchmarks/dispatch.py); larger ones with numpy's.
SMALL_TABLE = 256


class _HostArray:
    """A ``__cuda_array_interface__`` over page-locked host memory: torch wraps
    it as a CUDA tensor whose kernels read that memory directly (under unified
    addressing, every ``cudaHostAlloc`` block is mapped at the same address on
    the device). Holds ``host`` alive as long as the tensor."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "<i4",
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def _mapped(host: torch.Tensor, device):
    """``host`` (pinned) as a CUDA tensor on ``device`` over the same memory, or
    None where torch refuses the pointer or would copy it instead (another
    device than the one the memory was registered with)."""
    try:
        dev = torch.as_tensor(_HostArray(host), device=device)
    except (RuntimeError, TypeError, ValueError):  # torch or CUDA refused the pointer
        return None
    return dev if dev.is_cuda and dev.data_ptr() == host.data_ptr() else None


_mapped_ok: dict = {}


def mapped_pinned_reads(device) -> bool:
    """Whether kernels on ``device`` read page-locked host memory through its
    host address (checked once per process and device: a kernel reads values
    written on the host after the tensor was made; it synchronizes). False
    where that fails, and on any device but CUDA (not probed there: pinned
    memory would start a CUDA context): dispatch then copies the lengths to the
    device per call."""
    key = str(device)
    if torch.device(device).type != "cuda":
        return False
    if key not in _mapped_ok:
        try:
            host = torch.zeros(8, dtype=torch.int32, pin_memory=True)
            dev = _mapped(host, device)
            host.numpy()[:] = range(3, 11)
            _mapped_ok[key] = dev is not None and (dev * 1).tolist() == list(range(3, 11))
        except Exception:  # any CUDA or torch refusal: fall back to the copy
            _mapped_ok[key] = False
    return _mapped_ok[key]


class VariantSlot:
    """One loaded variant with everything its calls reuse: the runner, the padded
    input buffers and views of them, made once (dispatch is a hot path: every
    torch op saved is microseconds per call).

    On CUDA, host lengths go through a ring of pinned rows (``ring``; the host
    writes row ``ring_i`` through ``ring_mv``/``ring_np``). Where kernels read
    pinned memory directly (:func:`mapped_pinned_reads`), ``ring_args[i]`` are the
    kernel's length arguments over row i itself, with no copy; else the row is
    copied to ``lens`` (``ring_rows[i]`` is the copy's source) and the kernel
    reads ``lens_views``. Each row starts 16 bytes apart (AOTInductor copies an
    input that is not 16-byte aligned on every call)."""

    __slots__ = (
        "variant",
        "runner",
        "calls",
        "num_seqs",
        "num_blocks",
        "qbuf",
        "btbuf",
        "lens",
        "lens_host",
        "lens_arr",
        "zeros",
        "lens_views",
        "ring",
        "ring_np",
        "ring_mv",
        "ring_rows",
        "ring_args",
        "ring_i",
        "ring_events",
        "bt_rows",
        "rows",
        "bt_max",
    )

    def __init__(self, v: KernelVariant, runner, config: EngineConfig, dtype, device, mapped=False):
        self.variant = v
        self.runner = runner
        self.calls = 0
        # The bucket as plain ints: a tensor's .shape builds a torch.Size per call.
        self.num_seqs, self.num_blocks = v.num_seqs, v.num_blocks
        dev = device
        self.qbuf = torch.zeros(
            (v.query_len * v.num_seqs, config.num_heads, config.head_dim), dtype=dtype, device=dev
        )
        prefill = v.kernel == PAGED_ATTENTION
        n = 2 if prefill else v.num_seqs
        shape = (v.num_blocks,) if v.kernel == PAGED_ATTENTION else (v.num_seqs, v.num_blocks)
        self.btbuf = torch.zeros(shape, dtype=torch.int32, device=dev)
        # Lengths are written on the host into an int32 array that a CPU tensor
        # shares (torch.frombuffer): no torch op per call.
        self.lens_arr = array("i", bytes(4 * n))
        self.zeros = array("i", bytes(4 * n))
        self.lens_host = torch.frombuffer(self.lens_arr, dtype=torch.int32)
        self.ring = self.ring_np = self.ring_mv = self.ring_rows = None
        self.ring_args = self.ring_events = None
        self.ring_i = 0

        def views(t):  # prefill's two [1] lengths 16 bytes apart, decode's [n]
            return (t[0:1], t[4:5]) if prefill else (t[:n],)

        if dev.type == "cpu":
            self.lens = self.lens_host
            self.lens_views = (self.lens[0:1], self.lens[1:2]) if prefill else (self.lens,)
        else:
            width = 8 if prefill else -(-n // 4) * 4
            self.lens = torch.zeros(width, dtype=torch.int32, device=dev)
            self.lens_views = views(self.lens)
            self.ring = torch.zeros((RING, width), dtype=torch.int32, pin_memory=True)
            self.ring_np = self.ring.numpy()
            self.ring_mv = [memoryview(r).cast("B").cast("i") for r in self.ring_np]
            on_device = _mapped(self.ring, dev) if mapped else None
            if on_device is not None:
                self.ring_args = [views(on_device[i]) for i in range(RING)]
            else:
                self.ring_rows = list(self.ring)
            self.ring_events = [torch.cuda.Event(), torch.cuda.Event()]
        self.bt_rows = v.num_seqs  # rows of btbuf that may hold stale block ids
        # On the CPU, the largest block id of btbuf read as unsigned (shared memory,
        # no copy): one max() finds an id >= the pool and a negative one (which
        # wraps above 2**31). Python's max over a memoryview for small tables
        # (about 2 us in a dispatch loop here), numpy's for large ones; None on CUDA.
        self.bt_max = None
        if dev.type == "cpu" and self.btbuf.numel():
            import functools

            import numpy

            u32 = self.btbuf.numpy().view(numpy.uint32)
            if u32.size <= SMALL_TABLE:
                self.bt_max = functools.partial(max, memoryview(u32).cast("B").cast("I"))
            else:
                self.bt_max = u32.max
        self.rows: dict = {}  # num_seqs -> (qbuf[:num_seqs], btbuf[:num_seqs])

    def row_views(self, n: int):
        views = self.rows[n] = (self.qbuf[:n], self.btbuf[:n])
        return views
