#!/bin/sh
# Warm the tiny plan (3 variants) into cache dir $1, with the extra environment given
# as further arguments (VAR=VALUE ...), then print each entry's key and artifact sha256.
# usage: attack/warm_tiny.sh /tmp/a4/cache-base [VAR=VALUE ...]
set -e
ROOT=$(cd "$(dirname "$0")/.." && pwd)
dir=$1; shift
env "$@" "$ROOT/.venv/bin/kernel-cache" warmup --model "$ROOT/attack/tiny/config.json" \
  --max-model-len 32 --block-size 16 --max-num-seqs 4 --max-num-batched-tokens 32 \
  --kv-buckets 32 --cache-dir "$dir" --jobs 1 -q
rm -rf "$dir.bundle"
"$ROOT/.venv/bin/kernel-cache" export --model "$ROOT/attack/tiny/config.json" \
  --max-model-len 32 --block-size 16 --max-num-seqs 4 --max-num-batched-tokens 32 \
  --kv-buckets 32 --cache-dir "$dir" --out "$dir.bundle" >/dev/null
cd "$dir.bundle" && find . -type f ! -name '*.json' | sort | xargs sha256sum
