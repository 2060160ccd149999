#!/usr/bin/env bash
# The GPU benchmarks and the GPU suite, as run on the lent H200 and H100 machines (docs/benchmarks/, GPU pages).
# Run from the checkout root with python3 = the image's torch, diskcache and pydantic
# importable, and OUT set to a folder for logs and JSON. The image has no diskcache,
# pydantic(-settings), cryptography, redis or obstore: download their Python 3.12 wheels
# here (pip download --python-version 3.12 --only-binary=:all: --platform
# manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .gpu-wheels diskcache pydantic
# pydantic-settings cryptography redis obstore), carry .gpu-wheels, and there run
# python3 -m pip install --no-index --no-deps .gpu-wheels/*.whl first.
#   bash benchmarks/gpu_run.sh probe    # environment + compilers, kernel sweep, the GPU test suite
#   bash benchmarks/gpu_run.sh bench    # restart + kernel speed, per-bucket and trace-weighted
#   bash benchmarks/gpu_run.sh suite    # the GPU test suite alone
#   bash benchmarks/gpu_run.sh repro    # two CUDA builders, byte for byte; warm, verify, engine start
#   bash benchmarks/gpu_run.sh jobs     # warmup throughput against --jobs on the host's cores
#   bash benchmarks/gpu_run.sh fp8      # fp8 KV-cache tests and decode against a bf16 pool
#   bash benchmarks/gpu_run.sh tune     # kernel-cache tune, granite-3.3-8b bf16 decode -> sm_90.json
#   bash benchmarks/gpu_run.sh engine   # prefill kernel vs SDPA (+ tile sweep), dispatch, graphs
#   bash benchmarks/gpu_run.sh prefill  # prefill kernel variants vs flash and cuDNN, block_size 16 and 128
#   bash benchmarks/gpu_run.sh pipeline # software-pipelined and longest-first prefill variants, block_size 128
#   bash benchmarks/gpu_run.sh fp8      # the FP8 KV cache: its GPU tests, then decode bf16 vs fp8 pool
#   bash benchmarks/gpu_run.sh fp8prof  # the fp8 decode kernel: its variants and launch sweep, ncu, decode tests
# CXX is set to /usr/bin/g++: the image's CXX=/opt/gcc/bin/g++ builds packages that crash
# on load (docs/gpu.md, "When a compiled package crashes on load"); the suite checks that warmup catches that with
# KERNEL_CACHE_TEST_OTHER_CXX (the image's CXX, /opt/gcc/bin/g++ if that is g++ already, or
# OTHER_CXX when set).
set -uo pipefail
OUT=${OUT:-/tmp/kc-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The checkout itself, so that every child process (tests' subprocesses, the replay
# example) imports this kernel_cache without an install.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
# A granite-3.3-8b plan warmed once and shared by gpu_engine.py and the suite's tests.
export CACHE=${CACHE:-/tmp/kc-gpu-engine}
export KERNEL_CACHE_TEST_GPU_CACHE=$CACHE
IMAGE_CXX=${CXX:-}
export CXX=/usr/bin/g++
OTHER_CXX=${OTHER_CXX:-${IMAGE_CXX:-/opt/gcc/bin/g++}}
# A caller that already exported CXX=/usr/bin/g++ would make the other-compiler test
# compare a compiler with itself: take the image's own compiler then.
if [ "$(readlink -f "$OTHER_CXX")" = "$(readlink -f "$CXX")" ] && [ -x /opt/gcc/bin/g++ ]; then
  OTHER_CXX=/opt/gcc/bin/g++
fi
[ "$(readlink -f "$OTHER_CXX")" = "$(readlink -f "$CXX")" ] \
  && echo "warning: the other compiler ($OTHER_CXX) is CXX itself; set OTHER_CXX" >&2

env_report() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)"
  echo "image CXX=$IMAGE_CXX; using CXX=$CXX; other compiler: $OTHER_CXX"
  python3 -c "
from kernel_cache.plan.keys import cxx_toolchain, device_arch
print('cxx', cxx_toolchain())
print('other', cxx_toolchain('$OTHER_CXX'))
print('device_arch', device_arch('cuda'))"
  nproc
}

# Why packages built by the image's /opt/gcc/bin/g++ crash on load: the two compilers, the
# libstdc++ a torch process maps, and a std::regex shared object built by each, dlopen'ed
# after import torch (the crash site was parse_device_str -> std::regex).
diag() {
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; echo "LD_PRELOAD=${LD_PRELOAD:-}"
  for c in /usr/bin/g++ "$OTHER_CXX"; do
    echo "--- $c -> $(readlink -f "$c")"; file "$(readlink -f "$c")" | cut -c1-200
    "$c" -v 2>&1 | grep -E "^(Target|Configured with|Thread model|gcc version)" | cut -c1-400
    echo "libstdc++.so -> $("$c" -print-file-name=libstdc++.so)"
    echo "libstdc++.so.6 -> $("$c" -print-file-name=libstdc++.so.6)"
    echo "cc1plus -> $("$c" -print-prog-name=cc1plus)"
  done
  ls -la /opt/gcc /opt/gcc/lib64 2>&1 | grep -iE "stdc|total|lib" | head -20
  python3 -c "import torch; from warmup.builder.loadcheck import loaded_libstdcxx; print('torch process maps:', loaded_libstdcxx())"
  d=$(mktemp -d)
  cat > "$d/re.cpp" <<'CPP'
#include <regex>
#include <string>
extern "C" int parse(const char* s) {
  std::regex re("(cuda|cpu)(:([0-9]+))?");
  std::cmatch m;
  if (!std::regex_match(s, m, re)) return -2;
  return m[3].matched ? std::stoi(m[3].str()) : -1;
}
CPP
  for c in /usr/bin/g++ "$OTHER_CXX"; do
    n=$(echo "$c" | tr '/' '_')
    "$c" -shared -fPIC -O1 -std=c++17 "$d/re.cpp" -o "$d/re$n.so" || continue
    echo "--- regex .so by $c: $(readelf -d "$d/re$n.so" | grep -E 'NEEDED|RPATH|RUNPATH' | tr -s ' ' | tr '\n' ';')"
    python3 -c "import ctypes; print('  without torch:', ctypes.CDLL('$d/re$n.so').parse(b'cuda:3'))"; echo "  rc=$?"
    python3 -c "import torch, ctypes; print('  after import torch:', ctypes.CDLL('$d/re$n.so').parse(b'cuda:3'))"; echo "  rc=$?"
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 python3 -c "import torch, ctypes; print('  LD_PRELOAD system libstdc++, after import torch:', ctypes.CDLL('$d/re$n.so').parse(b'cuda:3'))"; echo "  rc=$?"
  done
}

# SUITE_K: a pytest -k expression to split the suite over calls (the kernel tests
# are -k "triton_ or eager_paged", about 190 s). At the limit pytest gets SIGINT,
# so it still prints its failures and summary.
suite() {
  KERNEL_CACHE_TEST_OTHER_CXX=$OTHER_CXX timeout -s INT -k 30 "${SUITE_TIMEOUT:-570}" \
    python3 -m pytest -o addopts= -v -rs -m gpu tests/e2e/test_gpu.py --durations=15 -p no:cacheprovider \
    ${SUITE_K:+-k "$SUITE_K"}
}

# The fp8 KV cache's CPU tests (tests/kernels/test_fp8_kv.py without the compiles): with
# Triton installed they include the CUDA kernels' code under Triton's interpreter.
fp8_cpu_tests() {
  timeout 90 python3 -m pytest -o addopts= -q -p no:cacheprovider -m "not compile and not slow" \
    tests/kernels/test_fp8_kv.py
}

case "${1:-probe}" in
  probe)
    { env_report; diag; } 2>&1 | tee "$OUT/env.txt"
    suite 2>&1 | tee "$OUT/pytest_gpu.log"
    timeout "${SWEEP_TIMEOUT:-170}" python3 benchmarks/gpu_kernel.py --sweep --out "$OUT" 2>&1 \
      | tee "$OUT/kernel.log"
    ;;
  bench)
    env_report 2>&1 | tee "$OUT/env.txt"
    # Bytecode compiled as an install compiles it (pip writes .pyc files): the image
    # sets PYTHONDONTWRITEBYTECODE=1 and ships filelock without bytecode, so without
    # this every child process of the restart benchmark compiles kernel_cache's and
    # filelock's sources again (about 0.1 s of its load_plan).
    echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-}" | tee -a "$OUT/env.txt"
    python3 -m compileall -q -j 0 "$ROOT/kernel_cache" "$ROOT/warmup" ${PYTHONPATH//:/ } \
      "$(python3 -c 'import filelock, os; print(os.path.dirname(filelock.__file__))')" \
      >/dev/null 2>&1
    timeout 290 python3 benchmarks/gpu_restart.py --out "$OUT" 2>&1 | tee "$OUT/restart.log"
    timeout 110 python3 benchmarks/gpu_kernel.py --inductor --out "$OUT" 2>&1 | tee "$OUT/kernel.log"
    timeout 160 python3 benchmarks/gpu_decode_buckets.py --out "$OUT" 2>&1 | tee "$OUT/buckets.log"
    ;;
  engine)
    env_report 2>&1 | tee "$OUT/env.txt"
    timeout "${ENGINE_TIMEOUT:-400}" python3 benchmarks/gpu_engine.py --sweep --out "$OUT" 2>&1 \
      | tee "$OUT/engine.log"
    ;;
  prefill)
    env_report 2>&1 | tee "$OUT/env.txt"
    timeout "${PREFILL_TIMEOUT:-330}" python3 benchmarks/gpu_prefill_variants.py --ir --out "$OUT" \
      2>&1 | tee "$OUT/variants.log"
    ;;
  pipeline)
    env_report 2>&1 | tee "$OUT/env.txt"
    timeout 300 python3 benchmarks/gpu_prefill_pipeline.py --out "$OUT" 2>&1 | tee "$OUT/pipeline.log"
    ;;
  repro)
    # Two CUDA builders of one key give the same bytes, verify --rebuild agrees; then the
    # tiny plan's warmup, verify in a fresh process and engine start (packages loaded).
    env_report 2>&1 | tee "$OUT/env.txt"
    SUITE_K="two_builders" SUITE_TIMEOUT=${REPRO_TIMEOUT:-300} suite 2>&1 | tee "$OUT/pytest_repro.log"
    SUITE_K="gpu_warmup_compiles or gpu_verify_in_fresh or engine_start_dispatch" \
      SUITE_TIMEOUT=${LOAD_TIMEOUT:-200} suite 2>&1 | tee "$OUT/pytest_load.log"
    ;;
  jobs)
    # Warmup throughput against --jobs on this host's cores: a 39-variant granite-3.3-8b
    # CUDA plan (enough variants that 16 workers get more than two rounds each) into an
    # empty cache (precompiled headers off on CUDA) per worker count; wall seconds and
    # the CPU seconds of the warmup's process tree (getrusage).
    env_report 2>&1 | tee "$OUT/env.txt"
    for j in ${JOBS_LIST:-1 16 4}; do
      rm -rf "/tmp/kc-jobs-$j"
      timeout "${JOBS_TIMEOUT:-300}" python3 -c '
import json, resource, subprocess, sys, time
t = time.perf_counter()
p = subprocess.run(sys.argv[2:], capture_output=True, text=True)
wall = time.perf_counter() - t
r = resource.getrusage(resource.RUSAGE_CHILDREN)
rep = json.loads(p.stdout) if p.returncode == 0 else {}
print(json.dumps({"jobs": int(sys.argv[1]), "rc": p.returncode, "wall_s": round(wall, 1),
  "cpu_s": round(r.ru_utime + r.ru_stime, 1), "compiled": rep.get("compiled"),
  "failed": rep.get("failed"), "stderr_tail": p.stderr[-400:] if p.returncode else ""}))
' "$j" python3 -m warmup.cli.main warmup --model granite-3.3-8b --device cuda \
        --dtype bfloat16 --max-model-len 1024 --block-size 16 --max-num-seqs 8 --query-step 128 \
        --kv-buckets 16,32,64,128,256,512,1024 --jobs "$j" --cache-dir "/tmp/kc-jobs-$j" --json -q \
        2>&1 | tee -a "$OUT/jobs.jsonl"
    done
    ;;
  fp8)
    # The fp8 tests of the GPU suite (kernels against the reference on the dequantized
    # pool; a tiny fp8 plan warmed, dispatched and graph-replayed with new scales;
    # FP8_SUITE_K to choose others) and the fp8 CPU tests, then decode 32 x 8192
    # through dispatch with a bf16 and an fp8 pool (two plans warmed into
    # $CACHE/fp8). About 6 minutes on an H200.
    env_report 2>&1 | tee "$OUT/env.txt"
    SUITE_K=${FP8_SUITE_K:-fp8} SUITE_TIMEOUT=${FP8_SUITE_TIMEOUT:-290} suite 2>&1 \
      | tee "$OUT/pytest_fp8.log"
    fp8_cpu_tests 2>&1 | tee -a "$OUT/pytest_fp8.log"
    timeout "${FP8_BENCH_TIMEOUT:-170}" python3 benchmarks/gpu_fp8_decode.py --out "$OUT" \
      --cache-dir "$CACHE/fp8" 2>&1 | tee "$OUT/fp8_decode.log"
    ;;
  fp8prof)
    # The fp8 decode kernel at 32 x 8192 (benchmarks/gpu_fp8_variants.py): its variants,
    # probes and launch sweep against the bf16 pool; with APPLY_BEST=1 the fp8 launch
    # defaults in triton_decode.py set to the sweep's fastest; ncu of the bf16 and fp8
    # kernels, the fp8 kernel before the int16 pairs and the load-only probe (named
    # sections, then the pipes' utilization as raw metrics); then (PROF_TESTS=1, the
    # default) the decode kernels' GPU tests and the fp8 CPU tests (the Triton
    # interpreter among them). About 5 minutes on an H100.
    env_report 2>&1 | tee "$OUT/env.txt"
    timeout "${VARIANTS_TIMEOUT:-200}" python3 benchmarks/gpu_fp8_variants.py --out "$OUT" 2>&1 \
      | tee "$OUT/fp8_variants.log"
    if [ "${APPLY_BEST:-0}" = 1 ]; then
      python3 benchmarks/gpu_fp8_variants.py --apply-best "$OUT/gpu_fp8_variants.json" 2>&1 \
        | tee -a "$OUT/fp8_variants.log"
    fi
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute*/ncu \
      /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    KERNELS='regex:_decode_split|_decode_combine|_split_v|_load_probe'
    if [ -n "$NCU" ]; then
      timeout "${NCU_TIMEOUT:-140}" "$NCU" --clock-control none -k "$KERNELS" \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section Occupancy --section LaunchStats \
        --section SchedulerStats --section WarpStateStats --section InstructionStats \
        --section SourceCounters --print-details all \
        python3 benchmarks/gpu_fp8_variants.py --ncu-target >"$OUT/ncu_fp8_decode.txt" 2>&1
      timeout 60 "$NCU" --clock-control none -k "$KERNELS" --metrics \
        'regex:^sm__inst_executed_pipe_[a-z0-9_]+\.avg\.pct_of_peak_sustained_active$,regex:^sm__pipe_[a-z0-9_]+_cycles_active\.avg\.pct_of_peak_sustained_active$,smsp__inst_executed.sum,dram__bytes_read.sum,gpu__time_duration.sum' \
        python3 benchmarks/gpu_fp8_variants.py --ncu-target >"$OUT/ncu_fp8_metrics.txt" 2>&1
    else
      echo "no ncu found" | tee "$OUT/ncu_fp8_decode.txt"
    fi
    if [ "${PROF_TESTS:-1}" = 1 ]; then
      SUITE_K=triton_decode SUITE_TIMEOUT=${DECODE_SUITE_TIMEOUT:-150} suite 2>&1 \
        | tee "$OUT/pytest_decode.log"
      fp8_cpu_tests 2>&1 | tee -a "$OUT/pytest_decode.log"
    fi
    ;;
  suite)
    { env_report; file -L "$OTHER_CXX" | grep -q "shell script" && head -c 800 "$OTHER_CXX"; } \
      2>&1 | tee "$OUT/env.txt"
    suite 2>&1 | tee "$OUT/pytest_gpu.log"
    ;;
  tune)
    # The run behind kernel_cache/plan/launch_tables/sm_90.json (docs/launch_tuning.md):
    # num_seqs buckets 4, 32, 64 x num_blocks buckets 8, 32, 64 (1024-8192 tokens),
    # every split count 1..64 that fits, against the split heuristic (the defaults).
    env_report 2>&1 | tee "$OUT/env.txt"
    timeout "${TUNE_TIMEOUT:-540}" python3 -m warmup.cli.main tune --model granite-3.3-8b \
      --device cuda --dtype bfloat16 --max-model-len 8192 --block-size 128 --max-num-seqs 64 \
      --variants batched_decode:1:8:4 batched_decode:1:32:4 batched_decode:1:64:4 \
                 batched_decode:1:8:32 batched_decode:1:32:32 batched_decode:1:64:32 \
                 batched_decode:1:8:64 batched_decode:1:32:64 batched_decode:1:64:64 \
      --num-kv-splits 1,2,4,8,16,32,64 --rounds 21 --target-ms 20 --jobs "${JOBS:-6}" \
      --cache-dir "${CACHE:-/tmp/kc-tune-cache}" --out "$OUT/sm_90.json" --json \
      >"$OUT/tune.json" 2> >(tee "$OUT/tune.log" >&2)
    ;;
  *)
    echo "usage: $0 probe|bench|suite|repro|jobs|tune|engine|prefill|pipeline|fp8|fp8prof" >&2
    exit 2
    ;;
esac
