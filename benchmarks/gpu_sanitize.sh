#!/usr/bin/env bash
# The CUDA tests under NVIDIA compute-sanitizer: memcheck, racecheck, initcheck, synccheck, one run
# each, with torch's caching allocator disabled so every cudaMalloc/cudaFree is seen (an overrun
# into a neighbouring cached block would otherwise go unnoticed).  Needs a GPU machine with the
# package built (pip install --no-build-isolation -e .) and pytest installed.
#   bash benchmarks/gpu_sanitize.sh                 # all four tools on `pytest -m cuda tests`
#   bash benchmarks/gpu_sanitize.sh memcheck -k flash
# Writes one log per tool to ${OUT:-benchmarks/results}/sanitize-<tool>.log; exit status is nonzero
# if any tool reports an error or pytest fails under it.
set -uo pipefail
cd "$(dirname "$0")/.."
san=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
[ -x "$san" ] || { echo "gpu_sanitize: compute-sanitizer not found (PATH or \$CUDA_HOME/bin)" >&2; exit 2; }
tools=(memcheck racecheck initcheck synccheck)
if [ $# -gt 0 ] && [[ " ${tools[*]} " == *" $1 "* ]]; then tools=("$1"); shift; fi
out=${OUT:-benchmarks/results}
# the interpreter: $PYTHON (gpu_session.sh passes its own), else python3 or python on the PATH
py=${PYTHON:-$(command -v python3 || command -v python)}
mkdir -p "$out"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
status=0
for tool in "${tools[@]}"; do
  extra=()
  # no --leak-check: the CUDA library allocates no device memory (torch allocates for it), and at exit
  # the tensors torch or pytest still hold are reported as leaks (seen on an H200, 2026-11-27)
  [ "$tool" = racecheck ] && extra=(--racecheck-report all)
  log="$out/sanitize-$tool.log"
  start=$(date +%s)
  "$san" --tool "$tool" "${extra[@]}" --error-exitcode 99 --target-processes all \
    "$py" -m pytest -q -x -p no:cacheprovider -m cuda tests "$@" > "$log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
  echo "gpu_sanitize: $tool rc=$rc in $(( $(date +%s) - start ))s: ${summary:-no summary} ($log)"
  [ $rc -ne 0 ] && status=1
done
exit $status
