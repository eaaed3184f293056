#!/usr/bin/env bash
# The GPU checks, one step per command, each sized to finish within 10 minutes:
#
#   bash benchmarks/gpu_session.sh            # build, report, CUDA tests, quick benchmark
#   bash benchmarks/gpu_session.sh bench      # build if needed, the full benchmark (JSON + plot)
#   bash benchmarks/gpu_session.sh bwd        # build if needed, the backward benchmark (JSON)
#   bash benchmarks/gpu_session.sh sage       # build if needed, sage vs our flash (the 1.5x target)
#   bash benchmarks/gpu_session.sh decode     # build if needed, the CUDA decode kernel vs torch SDPA (JSON)
#   bash benchmarks/gpu_session.sh hf         # build if needed, HF generate_batch on our functions vs paged sdpa
#                                             # (needs transformers on the machine; skipped without it)
#   bash benchmarks/gpu_session.sh sanitize   # build if needed, compute-sanitizer over the CUDA tests
#   bash benchmarks/gpu_session.sh kv         # the KV-cache tests on CUDA, then the decode benchmark call by
#                                             # call and in CUDA graphs (with auto's route for an int
#                                             # cache_seqlens beside torch): about 5 minutes
#   bash benchmarks/gpu_session.sh mma        # the tensor-core decode attention (attend_mma_kernel) against
#                                             # attend_kernel (ATTN_BACKENDS_CUDA_DECODE_KERNEL=mma / lanes)
#                                             # and the default rule: KV-cache tests (both kernels), the
#                                             # decode benchmark in CUDA graphs with each (the 16-bit
#                                             # caches), memcheck and racecheck on the tensor-core tests:
#                                             # about 4 minutes
#   bash benchmarks/gpu_session.sh lease      # all of it, shortened, in one call of under 10 minutes:
#                                             # CUDA tests (pytest-xdist), the decode benchmark (call
#                                             # by call, in CUDA graphs, against cache length), HF
#                                             # batching, memcheck and racecheck on the decode tests
#
# ATTN_BACKENDS_PREBUILT=DIR takes _C.abi3.so and libattn_backends_cuda.so from DIR instead of
# building (a device lease is short; the CUDA library takes most of the build):
#   ATTN_BACKENDS_CUDA=1 ATTN_BACKENDS_CUDA_ARCHS=90a ATTN_BACKENDS_CUDA_EMULATOR=0 \
#     python setup.py -q build_ext --inplace   # in a clean clone, on a machine with nvcc
#   mkdir -p .gpubuild && cp attn_backends/_C.abi3.so attn_backends/libattn_backends_cuda.so .gpubuild/
# and carry .gpubuild to the GPU machine.  Both are built for any Python 3.10+ (abi3) and torch
# 2.10+ (the stable ABI); if the prebuilt module does not load there, the script builds the module
# (CPU code only, ATTN_BACKENDS_CUDA=0) and keeps the prebuilt CUDA library.
#
# The machine starts bare with its own torch and python3 (docs/benchmarks.md, "GPU"), so each call
# builds in place for the device's own architecture (sm_90a on Hopper) and leaves everything it
# measured under ${OUT:-benchmarks/results/gpu}: build.log, report.txt, tests.log and the
# benchmark's JSON, plot and log, or the sanitizer's logs.  The last lines printed are the summary.
# Our CUDA flash and sage kernels are opt-in until verified; this script opts in
# (ATTN_BACKENDS_CUDA_FLASH=1, ATTN_BACKENDS_CUDA_SAGE=1; ATTN_BACKENDS_CUDA_DECODE=1 too, though the
# decode kernel is on by default since its H200 run).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-check}
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
# the benchmarks run as scripts: the package is imported from the checkout
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 ATTN_BACKENDS_CUDA_FLASH=1 ATTN_BACKENDS_CUDA_SAGE=1 ATTN_BACKENDS_CUDA_DECODE=1
py=$(command -v python3 || command -v python)
export PYTHON="$py" # the interpreter gpu_sanitize.sh runs pytest with
step() { echo "== $1 ($(date +%T))"; }

step "machine"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2> /dev/null; then
  echo "gpu_session: no CUDA device visible to $py's torch" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
"$py" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
nvcc --version | tail -1

step "build"
prebuilt=${ATTN_BACKENDS_PREBUILT:-}
if [ -n "$prebuilt" ] && [ -f "$prebuilt/libattn_backends_cuda.so" ]; then
  cp "$prebuilt/libattn_backends_cuda.so" attn_backends/
  [ -f "$prebuilt/_C.abi3.so" ] && cp "$prebuilt/_C.abi3.so" attn_backends/
  if ! "$py" -c "import attn_backends" > "$out/prebuilt.log" 2>&1; then
    tail -5 "$out/prebuilt.log"
    echo "prebuilt module does not load here: building the CPU module"
    rm -f attn_backends/_C.abi3.so
    start=$(date +%s)
    if ! ATTN_BACKENDS_CUDA=0 "$py" setup.py -q build_ext --inplace > "$out/build.log" 2>&1; then
      tail -40 "$out/build.log"
      echo "gpu_session: build failed (CPU module)"
      exit 1
    fi
    cp "$prebuilt/libattn_backends_cuda.so" attn_backends/  # the CPU-only build removes it
    echo "built the CPU module in $(($(date +%s) - start)) s"
  fi
  echo "prebuilt CUDA library: $(sha256sum attn_backends/libattn_backends_cuda.so | cut -c1-16)"
elif [ "$what" = check ] || ! "$py" -c "import attn_backends._C" 2> /dev/null; then
  arch=$("$py" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}a' if m == 9 else f'{m}{n}')")
  start=$(date +%s)
  if ! ATTN_BACKENDS_CUDA_ARCHS="$arch" "$py" setup.py -q build_ext --inplace > "$out/build.log" 2>&1; then
    tail -40 "$out/build.log"
    echo "gpu_session: build failed (sm_$arch)"
    exit 1
  fi
  echo "built for sm_$arch in $(($(date +%s) - start)) s"
fi
"$py" -m attn_backends > "$out/report.txt" 2>&1
grep -i -E "cuda|device|flash|sage" "$out/report.txt" | head -20

status=0
# bench_cuda LOG SECONDS LINES ARGS...: one benchmark run, its log under $out, its last LINES shown
bench_cuda() {
  local log="$out/$1" limit=$2 lines=$3
  shift 3
  timeout "$limit" "$py" benchmarks/bench_cuda.py "$@" > "$log" 2>&1 || status=1
  tail -"$lines" "$log"
}
case "$what" in
  check)
    step "CUDA tests"
    timeout 360 "$py" -m pytest -q -p no:cacheprovider -m cuda tests > "$out/tests.log" 2>&1 || status=1
    grep -E "passed|failed|error" "$out/tests.log" | tail -3
    step "quick benchmark"
    bench_cuda bench_quick.log 150 12 --quick --rounds 5 --sage
    step "quick decode benchmark"
    timeout 120 "$py" benchmarks/bench_decode.py --device cuda --quick > "$out/decode_quick.log" 2>&1 || status=1
    tail -6 "$out/decode_quick.log"
    ;;
  bench)
    step "benchmark"
    bench_cuda bench.log 540 40 --sage --json "$out/cuda.json" --plot "$out/bench_cuda.png"
    ;;
  bwd)
    step "backward benchmark"
    bench_cuda bench_bwd.log 540 40 --mode bwd --json "$out/cuda_bwd.json"
    ;;
  sage)
    step "sage vs flash"
    bench_cuda bench_sage.log 540 30 --sage-vs-flash --json "$out/cuda_sage.json"
    ;;
  decode)
    step "decode benchmark"
    timeout 540 "$py" benchmarks/bench_decode.py --device cuda --sweep --json "$out/decode_cuda.json" \
      > "$out/decode.log" 2>&1 || status=1
    tail -30 "$out/decode.log"
    ;;
  kv)
    step "KV-cache tests on CUDA (8 workers)"
    OMP_NUM_THREADS=2 timeout -k 10 150 "$py" -m pytest -q -p no:cacheprovider -n 8 --timeout 100 -m cuda \
      tests/test_kvcache_cuda_emu.py > "$out/tests_kv.log" 2>&1 || status=1
    grep -E "^(FAILED|ERROR)|passed|failed|error" "$out/tests_kv.log" | tail -15
    step "decode benchmark, call by call"
    timeout -k 5 110 "$py" benchmarks/bench_decode.py --device cuda --rounds 5 --json "$out/decode_cuda.json" \
      > "$out/decode.log" 2>&1 || status=1
    tail -16 "$out/decode.log"
    step "decode benchmark, in CUDA graphs"
    timeout -k 5 90 "$py" benchmarks/bench_decode.py --device cuda --rounds 5 --graph \
      --json "$out/decode_cuda_graph.json" > "$out/decode_graph.log" 2>&1 || status=1
    tail -16 "$out/decode_graph.log"
    ;;
  mma)
    step "KV-cache tests on CUDA, both attention kernels (8 workers)"
    OMP_NUM_THREADS=2 timeout -k 10 170 "$py" -m pytest -q -p no:cacheprovider -n 8 --timeout 100 -m cuda \
      tests/test_kvcache_cuda_emu.py > "$out/tests_kv.log" 2>&1 || status=1
    grep -E "^(FAILED|ERROR)|passed|failed|error" "$out/tests_kv.log" | tail -15
    # by_rows: neither forced, decode.cu's rule (variant_of); stages2: the rule with 2 stages at head dim
    # 128 (ATTN_BACKENDS_CUDA_DECODE_STAGES=2: three blocks an SM without rotary tables, against two of 3)
    for kernel in lanes mma by_rows stages2; do
      step "decode benchmark in CUDA graphs, ATTN_BACKENDS_CUDA_DECODE_KERNEL=$kernel"
      stages=$([ "$kernel" = stages2 ] && echo 2 || echo "")
      ATTN_BACKENDS_CUDA_DECODE_KERNEL=$kernel ATTN_BACKENDS_CUDA_DECODE_STAGES=$stages timeout -k 5 90 \
        "$py" benchmarks/bench_decode.py --device cuda \
        --dtypes bfloat16,float16 --rounds 5 --graph --json "$out/decode_cuda_graph_$kernel.json" > "$out/decode_graph_$kernel.log" 2>&1 \
        || status=1
      tail -9 "$out/decode_graph_$kernel.log"
    done
    step "memcheck and racecheck on the tensor-core decode tests"
    OUT="$out" timeout -k 5 80 bash benchmarks/gpu_sanitize.sh memcheck -k "kvcache_cuda_emu and mma and not hf" \
      || status=1
    OUT="$out" timeout -k 5 80 bash benchmarks/gpu_sanitize.sh racecheck \
      -k "kvcache_cuda_emu and mma and (split_and_unsplit or sinks)" || status=1
    ;;
  hf)
    step "HF continuous batching"
    if "$py" -c "import transformers" 2> /dev/null; then
      for dt in bfloat16 float16; do
        timeout 270 "$py" benchmarks/bench_hf_batching.py --device cuda --dtype "$dt" --layers 8 --hidden 1024 \
          --requests 32 --new 64 --json "$out/hf_batching_$dt.json" > "$out/hf_batching_$dt.log" 2>&1 || status=1
        tail -7 "$out/hf_batching_$dt.log"
      done
    else
      echo "transformers is not installed here: skipped"
    fi
    ;;
  lease)
    # everything in one call of under 10 minutes: each step has its own limit, logs go under $out
    step "CUDA tests (8 workers)"
    OMP_NUM_THREADS=2 timeout -k 10 180 "$py" -m pytest -q -p no:cacheprovider -n 8 --timeout 120 -m cuda tests \
      > "$out/tests.log" 2>&1 || status=1
    grep -E "^(FAILED|ERROR)|passed|failed|error" "$out/tests.log" | tail -25
    step "decode benchmark, call by call, and against cache length"
    timeout -k 5 120 "$py" benchmarks/bench_decode.py --device cuda --rounds 5 --sweep --json "$out/decode_cuda.json" \
      > "$out/decode.log" 2>&1 || status=1
    grep -v "^  Sk" "$out/decode.log" | tail -12
    step "decode benchmark, in CUDA graphs"
    timeout -k 5 80 "$py" benchmarks/bench_decode.py --device cuda --rounds 5 --graph \
      --json "$out/decode_cuda_graph.json" > "$out/decode_graph.log" 2>&1 || status=1
    tail -9 "$out/decode_graph.log"
    step "decode benchmark with the index values checked on the host (ATTN_BACKENDS_KVCACHE_CHECK=1)"
    ATTN_BACKENDS_KVCACHE_CHECK=1 timeout -k 5 40 "$py" benchmarks/bench_decode.py --device cuda --quick \
      > "$out/decode_checked.log" 2>&1 || status=1
    tail -3 "$out/decode_checked.log"
    step "HF continuous batching"
    if "$py" -c "import transformers" 2> /dev/null; then
      timeout -k 5 90 "$py" benchmarks/bench_hf_batching.py --device cuda --dtype bfloat16 --layers 8 --hidden 1024 \
        --requests 16 --new 32 --rounds 2 --json "$out/hf_batching_bfloat16.json" > "$out/hf_batching.log" 2>&1 || status=1
      tail -7 "$out/hf_batching.log"
    fi
    step "memcheck and racecheck on the decode tests"
    OUT="$out" timeout -k 5 80 bash benchmarks/gpu_sanitize.sh memcheck -k "kvcache_cuda_emu and not hf" || status=1
    OUT="$out" timeout -k 5 80 bash benchmarks/gpu_sanitize.sh racecheck \
      -k "kvcache_cuda_emu and (split_and_unsplit or sinks)" || status=1
    ;;
  sanitize)
    step "compute-sanitizer"
    OUT="$out" timeout 540 bash benchmarks/gpu_sanitize.sh || status=1
    ;;
  *)
    echo "gpu_session: unknown step '$what' (check, bench, bwd, sage, decode, kv, mma, hf, sanitize, lease)" >&2
    exit 2
    ;;
esac
step "done: status $status"
exit $status
