#!/usr/bin/env bash
# The gpu-labelled tests with their host code under AddressSanitizer + UBSan, on a GPU host:
# bench/gpu/run.sh builds them (RelWithDebInfo, SF_ASAN and SF_MPI: the C++ is instrumented, the
# .cu files' host code and the kernels are not) in build-asan-gpu and runs `ctest -L gpu`. Every
# report goes to a file under a folder of its own for this run; on exit (a timeout's TERM too) the
# script copies them into $OUT/asan-reports.txt, and it ends 1 if there is any.
# CUDA needs protect_shadow_gap=0 (the driver maps memory where ASan keeps its shadow gap).
# Leaks: the CUDA libraries' and OpenMPI's own are suppressed (lsan-cuda.supp, lsan-openmpi.supp).
#   OUT=/path bash tests/sanitizers/asan_gpu.sh [more cmake args]
# SF_BUILD_TARGETS / SF_GPU_TEST_REGEX narrow it as for run.sh (default: the tools and the one-GPU
# tests' binaries). Negative control: tests/sanitizers/asan_cuda_probe.cpp.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out="${OUT:?set OUT}"
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$root" || exit 2  # run.sh runs from the repository root
build="$root/${SF_BUILD_DIR:-build-asan-gpu}"
reports="$build/asan-reports/run-$(date -u +%Y%m%dT%H%M%S)-$$"
mkdir -p "$reports"
supp="$reports/lsan.supp"
cat "$root/tests/sanitizers/lsan-openmpi.supp" "$root/tests/sanitizers/lsan-cuda.supp" >"$supp"
rc=""  # set when run.sh ends; empty if a signal stopped the run first
collect() {
  local found
  mapfile -t found < <(grep -l -r -E 'ERROR: [A-Za-z]+Sanitizer|runtime error' "$reports" 2>/dev/null | sort)
  {
    echo "asan_gpu: run.sh exit ${rc:-none (stopped by a signal first)}; $(date -u); ASAN_OPTIONS=$ASAN_OPTIONS"
    if ((${#found[@]})); then
      echo "asan_gpu: ${#found[@]} report(s)"
      for f in "${found[@]}"; do echo "===== $f"; head -c 20000 "$f"; done
    else
      echo "asan_gpu: no AddressSanitizer, LeakSanitizer or UBSan report in $reports"
    fi
  } >"$out/asan-reports.txt"
  tail -2 "$out/asan-reports.txt"
  [[ -z "$rc" ]] && rc=143
  ((${#found[@]})) && rc=1
  return 0
}
trap 'collect; exit $rc' EXIT
export ASAN_OPTIONS="protect_shadow_gap=0:detect_leaks=1:halt_on_error=1:fast_unwind_on_malloc=0:log_path=$reports/asan"
export LSAN_OPTIONS="suppressions=$supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"
export SF_BUILD_DIR="${SF_BUILD_DIR:-build-asan-gpu}" SF_BENCH=0
unset SF_SANITIZE  # compute-sanitizer over ASan binaries is not this script's run
export SF_BUILD_TARGETS="${SF_BUILD_TARGETS:-sparsefill sparsefill-decode sparsefill-worker test_device_decode test_block_pool test_cli_gpu test_gpu_forward test_worker_gpu test_cuda_ops test_cuda_estimators}"
# In the background, so a TERM (a caller's timeout) is handled at once, not after run.sh ends.
bash "$root/bench/gpu/run.sh" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSF_ASAN=ON -DSF_MPI=ON \
  -DSF_REQUIRE_MPI=ON "$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null; exit' TERM INT
wait "$child"
rc=$?
