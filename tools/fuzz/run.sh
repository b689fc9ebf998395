#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang and runs each for EXECS executions.
#
#   tools/fuzz/run.sh [EXECS]        EXECS defaults to 1000000 per target
#
# Environment (defaults beside them):
#   SF_FUZZ_BUILD=build-fuzz         separate build dir (clang + sanitizers; never the main build)
#   SF_FUZZ_CORPUS=fuzz-corpus       corpora: <corpus>/<target>/ grows, <corpus>/seeds/ is regenerated
#   SF_FUZZ_JOBS=1                   build parallelism
#   SF_FUZZ_TARGETS="safetensors gguf hf_config kv_manifest moa_config"
#   SF_PYTHON=.venv-ref/bin/python   needs numpy, gguf, safetensors (deploy/setup-reference.sh)
# Prints "fuzz_<target>: N execs clean (R exec/s)" per target; exits non-zero on any crash, leak,
# timeout or sanitizer report, leaving the reproducer at <corpus>/crash-<target>-*.
set -euo pipefail

EXECS=${1:-1000000}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=${SF_FUZZ_BUILD:-$ROOT/build-fuzz}
CORPUS=${SF_FUZZ_CORPUS:-$ROOT/fuzz-corpus}
JOBS=${SF_FUZZ_JOBS:-1}
TARGETS=${SF_FUZZ_TARGETS:-"safetensors gguf hf_config kv_manifest moa_config"}
PY=${SF_PYTHON:-$ROOT/.venv-ref/bin/python}

command -v clang++-14 >/dev/null || { echo "run.sh: clang++-14 not found (apt-get install clang-14)" >&2; exit 2; }
[[ -x $PY ]] || { echo "run.sh: $PY not found; set SF_PYTHON or run deploy/setup-reference.sh" >&2; exit 2; }

mkdir -p "$BUILD"
CC=clang-14 CXX=clang++-14 cmake -S "$ROOT" -B "$BUILD" -DSF_FUZZ=ON -DSF_CUDA=OFF -DSF_MPI=OFF \
  -DSF_BUILD_TESTS=OFF -DSF_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$BUILD/sf-configure.log" 2>&1 \
  || { cat "$BUILD/sf-configure.log" >&2; exit 2; }
targets=()
for t in $TARGETS; do targets+=("fuzz_$t"); done
cmake --build "$BUILD" -j"$JOBS" --target "${targets[@]}"

rm -rf "$CORPUS/seeds"
"$PY" "$ROOT/tools/fuzz/make_seeds.py" "$CORPUS/seeds"
# The KV manifest seed is a committed file (a valid manifest for the target's expected hash).
mkdir -p "$CORPUS/seeds/kv_manifest"
cp "$ROOT/tests/fuzz/kv_manifest_seed.json" "$ROOT/tests/fuzz/kv_manifest_seed_v5.json" \
  "$ROOT/tests/fuzz/kv_manifest_seed_v6.json" "$CORPUS/seeds/kv_manifest/"
# The moa retention config's seed is the shipped config.
mkdir -p "$CORPUS/seeds/moa_config"
cp "$ROOT/configs/smollm2-135m-instruct-moa.json" "$CORPUS/seeds/moa_config/"

status=0
for t in $TARGETS; do
  mkdir -p "$CORPUS/$t"
  log="$CORPUS/fuzz_$t.log"
  # -max_len bounds mutated inputs (seeds are < 2 KB); -timeout flags any input taking > 10 s.
  start=$(date +%s.%N)
  set +e
  "$BUILD/fuzz/fuzz_$t" "$CORPUS/$t" "$CORPUS/seeds/$t" -runs="$EXECS" \
    -dict="$ROOT/tests/fuzz/$t.dict" -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$CORPUS/crash-$t-" >"$log" 2>&1
  rc=$?
  set -e
  secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  # libFuzzer's own average uses whole seconds; wall time includes loading the corpus.
  rate=$(awk -v n="${execs:-0}" -v s="$secs" 'BEGIN { printf "%d", (s > 0 ? n / s : 0) }')
  if [[ $rc -eq 0 ]]; then
    echo "fuzz_$t: ${execs:-?} execs clean (${secs} s, ${rate} exec/s, corpus $(ls "$CORPUS/$t" | wc -l) files)"
  else
    echo "fuzz_$t: FAILED (exit $rc) after ${execs:-?} execs; log $log; artifacts $CORPUS/crash-$t-*" >&2
    grep -E "ERROR|SUMMARY|==[0-9]+==|runtime error" "$log" | head -20 >&2 || true
    status=1
  fi
done
exit $status
