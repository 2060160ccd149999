"""Hole: the ``sources`` key component is computed once per process
(``functools.cache`` on ``kernel_cache.plan.sources.source_files``), so a second
``load_plan`` in the same process, after a kernel source file changed on disk,
computes the old key and serves the old artifact; a fresh process misses
(MissingVariantsError). Traced files, by contrast, are re-hashed per load
(cached by inode, size and mtime), so the two halves of identity disagree.

Runs on a copy of the project (so the worktree is never edited):
  .venv/bin/python attack/inprocess_sources_cache.py /tmp/a4/cache-base
"""

import os
import shutil
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
cache = sys.argv[1]
copy = tempfile.mkdtemp(prefix="a4-copy-")
for d in ("kernel_cache", "warmup"):
    shutil.copytree(os.path.join(root, d), os.path.join(copy, d))
model = os.path.join(here, "tiny", "config.json")

code = f"""
import os, sys
sys.path.insert(0, {copy!r})
os.environ["KERNEL_CACHE_DIR"] = {cache!r}
import kernel_cache
assert kernel_cache.__file__.startswith({copy!r}), kernel_cache.__file__
from kernel_cache import load_plan, make_config
cfg = make_config({model!r}, max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))
attn = load_plan(cfg)
print("first load_plan: ok,", attn.stats()["loads"], "variants")
if len(sys.argv) > 1:
    f = os.path.join({copy!r}, "kernel_cache", "kernels", "builtin.py")
    with open(f, "a") as fh:
        fh.write("\\n_SCALE_FUDGE = 2.0  # an edit: every key must change\\n")
    try:
        attn2 = load_plan(cfg)
        print("second load_plan after editing builtin.py: NO ERROR (stale),",
              attn2.stats()["loads"], "variants")
    except Exception as e:
        print("second load_plan raised", type(e).__name__, str(e)[:150])
"""
subprocess.run([sys.executable, "-c", code, "edit"], check=False)
r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
print("fresh process after the edit:", (r.stdout + r.stderr).strip().splitlines()[-1][:200])
shutil.rmtree(copy)
