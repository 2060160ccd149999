"""Fuzz dispatch of the tiny plan against vLLM's reference (per token, from the
block table, KV heads repeated): odd block tables (repeats, block 0 real and
padding), every seq_len, odd seq_lens containers, strided/offset tensors.

  .venv/bin/python attack/fuzz_dispatch.py /tmp/a4/cache-base
"""

import os
import random
import sys

import numpy as np
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
random.seed(0)
P = 5
big = torch.randn(P + 1, 16, 2, 8) * 3
k = big[1:]  # contiguous, storage offset
v = torch.randn(P, 16, 2, 8) * 3
bad = []


def check(name, out, ref, tol=2e-4):
    err = (out.float() - ref).abs().max().item()
    if not err <= tol:
        bad.append((name, err))


for trial in range(300):
    s = random.randint(1, 4)
    lens = [random.randint(1, 32) for _ in range(s)]
    bt = torch.tensor([[random.choice([0, 0, 1, 2, 3, 4]) for _ in range(2)] for _ in range(s)],
                      dtype=torch.int32)
    if trial % 3 == 0:
        bt[:, 1] = bt[:, 0]  # the last block repeated
    q = torch.randn(s, 4, 8)
    kind = trial % 5
    sl = (lens if kind == 0 else torch.tensor(lens) if kind == 1
          else torch.tensor(lens, dtype=torch.int16) if kind == 2
          else np.array(lens) if kind == 3 else [np.int64(x) for x in lens])
    try:
        out = attn.decode(q, k, v, bt, sl)
        check(f"decode bt={bt.tolist()} lens={lens} kind={kind}", out,
              reference_decode(q, k, v, bt, lens))
    except Exception as e:
        bad.append((f"decode raised {type(e).__name__}: {e}"[:160], None))

for trial in range(200):
    seq = random.randint(1, 32)
    ql = random.randint(1, seq)
    bt = torch.tensor([random.choice([0, 1, 2, 3, 4]) for _ in range(random.randint(2, 4))],
                      dtype=torch.int32)
    if trial % 2:
        bt = bt.repeat_interleave(2)[::2]  # non-contiguous view
    q = torch.randn(ql, 4, 8)
    if trial % 3 == 0:
        q = torch.randn(4, ql, 8).transpose(0, 1)  # non-contiguous query
    try:
        out = attn.prefill(q, k, v, bt, seq)
        check(f"prefill bt={bt.tolist()} seq={seq} q={ql}", out,
              reference_attention(q, k, v, bt, seq))
    except Exception as e:
        bad.append((f"prefill raised {type(e).__name__}: {e}"[:160], None))

# numpy bools / odd containers for seq_lens
for sl in ([np.True_], np.array([True]), [1.0], torch.tensor([True]), [True]):
    try:
        attn.decode(torch.randn(1, 4, 8), k, v, torch.zeros(1, 2, dtype=torch.int32), sl)
        bad.append((f"decode accepted seq_lens={sl!r}", None))
    except Exception as e:
        print(f"seq_lens={sl!r}: {type(e).__name__}: {str(e)[:90]}")

print(len(bad), "problems")
for b in bad[:20]:
    print(b)
