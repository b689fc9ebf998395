#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer + UBSan (RelWithDebInfo, MPI on) in build-asan/:
# every report goes to a file under $SF_ASAN_REPORTS (default build-asan/reports), those of child
# processes whose output a test keeps to itself too, and the script ends 1 if there is any.
# OpenMPI's own leaks are suppressed (lsan-openmpi.supp). Extra args go to ctest (e.g. -R
# worker_). About 18 minutes of tests for the whole suite on 2 cores, plus the build.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build="$root/build-asan"
reports="${SF_ASAN_REPORTS:-$build/reports}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSF_CUDA=OFF -DSF_UCX=OFF \
  -DSF_ASAN=ON -DSF_MPI=ON >/dev/null || exit 1
ninja -C "$build" || exit 1
rm -rf "$reports" && mkdir -p "$reports"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:fast_unwind_on_malloc=0:log_path=$reports/asan"
export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan-openmpi.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"
ctest --test-dir "$build" -j "${SF_TEST_JOBS:-2}" --timeout 1500 --output-on-failure "$@"
rc=$?
found=$(grep -l -r -E 'ERROR: [A-Za-z]+Sanitizer|runtime error' "$reports" | sort)
if [[ -n "$found" ]]; then
  echo "asan_suite: $(wc -l <<<"$found") report(s):"
  for f in $found; do echo "== $f"; grep -m1 -E 'ERROR:|runtime error' "$f"; done
  exit 1
fi
echo "asan_suite: no AddressSanitizer, LeakSanitizer or UBSan report (ctest exit $rc)"
exit "$rc"
