#!/usr/bin/env bash
# The run behind kernel_cache/plan/launch_tables/x86_64-x86-64-v3.json and docs/launch_tuning.md:
# kernel-cache tune for granite-3.3-8b batched decode (float32, CPU), block_size 128,
# max_model_len 8192, num_seqs buckets 4 and 8 at num_blocks buckets 8, 32 and 64.
# Candidates: num_kv_splits 1, 2, 4 x chunks per split 1, 4 (plus the defaults);
# 31 interleaved timing rounds (an earlier run with 21: docs/results/cpu/launch_tuning_cpu_run1.json); the rule is in warmup/tune/candidates.py (RULE).
# Results are cached under CACHE; run it again to resume an interrupted tune.
set -euo pipefail
CACHE="${CACHE:-${KERNEL_CACHE_DIR:-$HOME/.cache/kernel_cache}}"
OUT="${1:-launch-cpu.json}"
kernel-cache tune --model granite-3.3-8b --max-model-len 8192 --block-size 128 --max-num-seqs 8 \
  --variants batched_decode:1:8:4 batched_decode:1:32:4 batched_decode:1:64:4 \
             batched_decode:1:8:8 batched_decode:1:32:8 batched_decode:1:64:8 \
  --num-kv-splits 1,2,4 --chunks-per-split 1,4 --rounds 31 \
  --cache-dir "$CACHE" --out "$OUT" --jobs 2
