#!/usr/bin/env bash
# Runs every test: installs dependencies (and the pinned Python reference stack used by the
# interop test, unless --no-reference), fetches the default model, builds, runs ctest.
# GPU tests skip themselves on machines without a GPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ref=(--with-reference)
for a in "$@"; do
  case "$a" in
    --no-reference) ref=() ;;
    *) echo "test.sh: unknown option '$a'" >&2; exit 2 ;;
  esac
done
"$root/deploy/setup.sh" "${ref[@]}"
# With the reference stack installed here, the interop test must run: a missing or broken stack
# fails it instead of skipping it.
if ((${#ref[@]})); then export SF_REQUIRE_REFERENCE=1; fi
"$root/deploy/fetch-model.sh"
# The mpi-label tests must be built: a missing MPI fails the configure instead of dropping them.
"$root/deploy/build.sh" -DSF_REQUIRE_MPI=ON
cd "$root/build"
ctest --output-on-failure -j "${SF_TEST_JOBS:-1}" --timeout 1800
