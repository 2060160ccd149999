"""Hole: key_cache and value_cache with different pool sizes (num_pool_blocks).

Dispatch checks each cache's shape[1:] and that block ids are < key_cache.shape[0],
but not that value_cache.shape[0] == key_cache.shape[0]. The artifact was exported
with one dynamic dim for both (dim 0), and AOTInductor does not check inputs at
run time by default, so the kernel reads value_cache past its end (out of bounds)
or attends the wrong blocks, with no error.

Run (after warming the tiny plan into $CACHE):
  .venv/bin/python attack/kv_pool_mismatch.py $CACHE
"""

import os
import sys

import torch

from kernel_cache import load_plan, make_config
from kernel_cache.kernels.reference import reference_attention, reference_decode

cache = sys.argv[1]
os.environ["KERNEL_CACHE_DIR"] = cache
here = os.path.dirname(os.path.abspath(__file__))
cfg = make_config(
    os.path.join(here, "tiny", "config.json"),
    max_model_len=32, block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
    kv_buckets=(32,),
)
attn = load_plan(cfg)
torch.manual_seed(0)
P = 8
k = torch.randn(P, 16, 2, 8)
v_small = torch.randn(2, 16, 2, 8)  # only 2 blocks
q = torch.randn(4, 4, 8)
bt = torch.tensor([[6, 7], [5, 4], [3, 2], [1, 0]], dtype=torch.int32)
lens = [32, 20, 17, 3]
try:
    out = attn.decode(q, k, v_small, bt, lens)
    print("decode: NO ERROR; output finite:", bool(torch.isfinite(out).all()))
    # what should it be? the reference cannot even index v_small
    try:
        ref = reference_decode(q, k, v_small, bt, lens)
        print("max err vs reference", (out.float() - ref).abs().max().item())
    except Exception as e:
        print("reference itself fails (as it should):", type(e).__name__, str(e)[:80])
except Exception as e:
    print("decode raised", type(e).__name__, str(e)[:200])

try:
    qp = torch.randn(20, 4, 8)
    out = attn.prefill(qp, k, v_small, torch.tensor([7, 6], dtype=torch.int32), 20)
    print("prefill: NO ERROR; output finite:", bool(torch.isfinite(out).all()))
except Exception as e:
    print("prefill raised", type(e).__name__, str(e)[:200])
