"""Does garbage (NaN / inf) in KV slots past seq_len leak into the output?

vLLM's reference reads exactly seq_len tokens per sequence from the block table,
so what the pool holds past seq_len in the last block (a freed block's leftovers,
an uninitialized torch.empty pool) must not matter.

  .venv/bin/python attack/nan_tail.py /tmp/a4/cache-base
"""

import os
import sys

import torch

from kernel_cache import load_plan, make_config
from kernel_cache.kernels.reference import reference_attention, reference_decode

os.environ["KERNEL_CACHE_DIR"] = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
cfg = make_config(
    os.path.join(here, "tiny", "config.json"),
    max_model_len=32, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, kv_buckets=(32,),
)
attn = load_plan(cfg)
torch.manual_seed(0)
for garbage in (float("nan"), float("inf"), 1e30):
    k = torch.randn(4, 16, 2, 8)
    v = torch.randn(4, 16, 2, 8)
    # sequence of 20 tokens in blocks 1, 2: slots 4..15 of block 2 are past seq_len
    k[2, 4:] = garbage
    v[2, 4:] = garbage
    k[3] = garbage  # a block listed in the table past need (padding column)
    v[3] = garbage
    q = torch.randn(2, 4, 8)
    bt = torch.tensor([[1, 2], [2, 3]], dtype=torch.int32)
    lens = [20, 4]
    ref = reference_decode(q, k, v, bt, lens)
    out = attn.decode(q, k, v, bt, lens)
    print(f"decode  garbage={garbage}: ref finite {bool(ref.isfinite().all())}, "
          f"out finite {bool(out.isfinite().all())}, max err {(out - ref).abs().max().item():.3g}")
    qp = torch.randn(5, 4, 8)
    ref = reference_attention(qp, k, v, torch.tensor([1, 2], dtype=torch.int32), 20)
    out = attn.prefill(qp, k, v, torch.tensor([1, 2], dtype=torch.int32), 20)
    print(f"prefill garbage={garbage}: ref finite {bool(ref.isfinite().all())}, "
          f"out finite {bool(out.isfinite().all())}, max err {(out - ref).abs().max().item():.3g}")
