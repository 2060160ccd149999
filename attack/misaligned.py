"""Misaligned (storage offset 1 element) and overlapping KV/query tensors against
the reference. usage: .venv/bin/python attack/misaligned.py /tmp/a4/cache-base"""
import os
import sys

import torch

from kernel_cache import load_plan, make_config
from kernel_cache.kernels.reference import reference_attention, reference_decode

os.environ["KERNEL_CACHE_DIR"] = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
cfg = make_config(os.path.join(here, "tiny", "config.json"), max_model_len=32, block_size=16,
                  max_num_seqs=4, max_num_batched_tokens=32, kv_buckets=(32,))
attn = load_plan(cfg)
torch.manual_seed(0)
n = 5 * 16 * 2 * 8
flat = torch.randn(2 * n + 3)
k = flat[1 : 1 + n].view(5, 16, 2, 8)  # 4-byte aligned only
v = flat[2 : 2 + n].view(5, 16, 2, 8)  # overlaps k, shifted one element
qf = torch.randn(4 * 4 * 8 + 1)
q = qf[1:].view(4, 4, 8)
bt = torch.tensor([[1, 2], [3, 3], [0, 4], [2, 0]], dtype=torch.int32)
lens = [32, 30, 17, 9]
out = attn.decode(q, k, v, bt, lens)
print("decode misaligned/overlapping: max err",
      (out - reference_decode(q, k, v, bt, lens)).abs().max().item())
qp = torch.randn(32 * 4 * 8 + 1)[1:].view(32, 4, 8)
out = attn.prefill(qp, k, v, torch.tensor([3, 1], dtype=torch.int32), 32)
print("prefill misaligned: max err",
      (out - reference_attention(qp, k, v, torch.tensor([3, 1], dtype=torch.int32), 32))
      .abs().max().item())
