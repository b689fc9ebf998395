#!/usr/bin/env bash
# The gpu-labelled tests with their host code under AddressSanitizer + UBSan, on a GPU host:
# bench/gpu/run.sh builds them (RelWithDebInfo, SF_ASAN: the C++ is instrumented, the .cu files'
# host code and the kernels are not) in build-asan-gpu and runs `ctest -L gpu`. Every report goes
# to a file; the script copies them into $OUT/asan-reports.txt and ends 1 if there is any.
# CUDA needs protect_shadow_gap=0 (the driver maps memory where ASan keeps its shadow gap).
# Leaks: the CUDA libraries' and OpenMPI's own are suppressed (lsan-cuda.supp, lsan-openmpi.supp).
#   OUT=/path bash tests/sanitizers/asan_gpu.sh [extra cmake args, e.g. -DSF_MPI=ON]
# SF_BUILD_TARGETS / SF_GPU_TEST_REGEX narrow it as for run.sh (default: the tools and the one-GPU
# tests' binaries).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out="${OUT:?set OUT}"
build="$root/${SF_BUILD_DIR:-build-asan-gpu}"
reports="$build/asan-reports"
rm -rf "$reports" && mkdir -p "$reports" "$out"
supp="$reports/lsan.supp"
cat "$root/tests/sanitizers/lsan-openmpi.supp" "$root/tests/sanitizers/lsan-cuda.supp" >"$supp"
export ASAN_OPTIONS="protect_shadow_gap=0:detect_leaks=1:halt_on_error=1:fast_unwind_on_malloc=0:log_path=$reports/asan"
export LSAN_OPTIONS="suppressions=$supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"
export SF_BUILD_DIR="${SF_BUILD_DIR:-build-asan-gpu}" SF_BENCH=0
export SF_BUILD_TARGETS="${SF_BUILD_TARGETS:-sparsefill sparsefill-decode sparsefill-worker test_device_decode test_block_pool test_cli_gpu test_gpu_forward test_worker_gpu test_cuda_ops test_cuda_estimators test_comm_nccl test_device_parallel_mpi}"
bash "$root/bench/gpu/run.sh" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSF_ASAN=ON "$@"
rc=$?
found=$(grep -l -r -E 'ERROR: [A-Za-z]+Sanitizer|runtime error' "$reports" 2>/dev/null | sort)
{
  echo "asan_gpu: run.sh exit $rc; $(date -u); ASAN_OPTIONS=$ASAN_OPTIONS"
  if [[ -n "$found" ]]; then
    echo "asan_gpu: $(wc -l <<<"$found") report(s)"
    for f in $found; do echo "===== $f"; head -c 20000 "$f"; done
  else
    echo "asan_gpu: no AddressSanitizer, LeakSanitizer or UBSan report"
  fi
} >"$out/asan-reports.txt"
tail -3 "$out/asan-reports.txt"
[[ -n "$found" ]] && exit 1
exit "$rc"
