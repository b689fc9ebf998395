#!/usr/bin/env bash
# Builds sparsefill with the CUDA backend on a GPU host, runs the `gpu`-labelled tests, then
# `sparsefill bench attention` beside the torch SDPA peer (bench/gpu/sdpa_peer.py).
# Run from the repository root on the GPU host (no network needed):
#   OUT=/path/to/logs bench/gpu/run.sh [extra cmake args...]
#
# Writes up to 8 files to $OUT (default: <build>/out): summary.txt, env.txt, build.log (dependency,
# configure and build logs), ctest.log (verbose: every test's output), sanitizer.log (with
# SF_SANITIZE), bench-attention.log,
# gpu-clocks.csv (nvidia-smi's SM and memory clocks, power, temperature and clock-event reasons
# every 250 ms while the benchmark runs: read only, nothing is set), attention-<gpu>.json and,
# with SF_BENCH_INPUTS, attention-<gpu>-inputs.json.
# Exit status: 0 only if configure, the build of every gpu test and the gpu
# tests all succeeded, no gpu test skipped itself (a skip on a GPU host means the device was not
# usable), and the benchmark (when run) succeeded.
#
# Environment:
#   OUT            where the logs go
#   SF_BUILD_DIR   build folder (default build-gpu; /build*/ is git-ignored)
#   SF_JOBS        parallel build jobs (default: nproc)
#   SF_XXHASH_DIR  a folder holding xxhash.h, for hosts without libxxhash-dev
#   SF_BUILD_DEPS  1: build the GoogleTest/Boost.JSON/xxHash stand-ins below even where the
#                  packages exist (to test this script's fallbacks on a CPU machine)
#   SF_BENCH       0: skip the attention benchmark (default 1)
#   SF_TESTS       0: skip the gpu tests (a second benchmark call on a host whose build they
#                  already passed; the summary says they did not run)
#   SF_GPU_TEST_TIMEOUT  seconds per gpu test (default 1200)
#   SF_DECODE      token counts for sf_bench_decode (e.g. "32768 131072"): the decode kernel
#                  per pool encoding (SF_DECODE_POOLS, default f32,bf16,int8), mode and pull
#                  (SF_DECODE_PULLS, default 0.15: how far the planted blocks lean toward the
#                  query), one JSON line each into decode-<gpu>.jsonl; SF_DECODE_SHAPES,
#                  "heads:kv_heads:head_dim" items, default "32:8:128" (Llama-3-8B; SmolLM2 is
#                  "9:3:64")
#   SF_DECODE_SESSION  shape:tokens pairs for sf_bench_decode_session (e.g. "smollm2:4096
#                  llama3-8b:8192"): the decode node's step per token, kernels launched one by one
#                  and as a CUDA graph, unfused and fused, four JSON lines per weights and pool
#                  into decode-session-<gpu>.jsonl
#                  (SF_DECODE_STEPS timed steps, default 64; SF_DECODE_WEIGHTS, default
#                  bf16,f32; SF_DECODE_SESSION_POOLS, default f32,int8; SF_DECODE_VERIFY, modes
#                  with verified drafts, e.g. psa-avg:0.95:verify8, a line each)
#   SF_GEMV        1: sf_bench_gemv, the decode step's GEMVs at the Llama-3-8B and SmolLM2 shapes
#                  beside a copy of the same bytes, into gemv-<gpu>.jsonl
#   SF_TIERING_PREFILL  "tokens:layers:device_frac[:host_frac]" items (e.g. "32768:8:0.25"): the
#                  KV tiering device sink's cost to a Llama-3-8B-shaped prefill
#                  (sf_bench_kv_tiering_prefill), one JSON line each into
#                  tiering-prefill-<gpu>.jsonl; host_frac < 1 adds a disk tier (a temporary
#                  directory under TMPDIR, removed after) for what the host does not hold
#   SF_PREFIX_DEVICE  "tokens:prefix:layers" items (e.g. "32768:28672:8"): the prefix cache on the
#                  device (sf_bench_prefix_device) against full prefills of the same prompts, one
#                  JSON line each into prefix-device-<gpu>.jsonl (SF_PREFIX_REPS, default 3)
#   SF_KV_EXPORT   "tokens:layers:dtype:widths" items (e.g. "32768:8:f32:1,2,4,8"): KV export and
#                  load throughput on this host's CPUs and disk (sf_bench_kv_export, Llama-3-8B KV
#                  geometry, one JSON line per layers_in_flight width into kv-export-<gpu>.jsonl;
#                  written under TMPDIR and removed; SF_KV_EXPORT_REPS, default 2)
#   SF_WORKER_OVERLAP  "tokens:layers[:requests]" (e.g. "131072:8:4"): sparsefill-worker batches
#                  on 2 GPUs (CP 2, --model synthetic:llama3-8b:LAYERS, random token ids) with
#                  --export-overlap on and off (bench/mpi/export_overlap.sh; more worker flags in
#                  SF_WORKER_OVERLAP_ARGS; SF_OVERLAP_REPS=N for N alternating pairs) into
#                  export-overlap-<gpu>.json
#   SF_WORKER_PLANS  1: sparsefill-worker batches on 2 GPUs whose prompt lengths differ, each
#                  new length planning again, with the plans' buffers kept and freed
#                  (bench/mpi/plan_reuse.sh, its SF_PLAN_* settings; SF_PLAN_COMPARE=staging:
#                  the pinned K/V ring against a slot per layer) into plan-reuse-<gpu>.json
#   SF_WORKER_LONG  1: a sparsefill-worker batch of long requests (CP 2 on 2 GPUs, or SF_LONG_TP x SF_LONG_CP; lengths,
#                  layers and flags in SF_LONG_LENGTHS, SF_LONG_LAYERS, SF_LONG_ARGS; default two
#                  requests near 1M tokens, vertical-slash, int4 export) with each request's
#                  split of its time (bench/mpi/long_requests.sh) into long-requests-<gpu>.json
#   SF_SANITIZE    "tool@test_binary[@gtest_filter[@seconds]]" items (e.g. "memcheck@test_cuda_ops
#                  racecheck@test_cuda_ops@*AttentionSparseBf16/column_heavy:CudaOps.KvImportance@300"):
#                  each gpu test binary under compute-sanitizer's tool (memcheck, racecheck,
#                  synccheck, initcheck), after the gpu tests, into sanitizer.log; an error or
#                  hazard it reports, or a run that fails, fails the call (default timeout 300 s an
#                  item); the build then has -lineinfo, so a report names its source line;
#                  SF_SANITIZE_ARGS adds the tool's flags to every item (e.g. "--leak-check full")
#   SF_BUILD_TARGETS  build only these targets (space-separated), and SF_GPU_TEST_REGEX: run only
#                  the gpu tests whose names match (a short check when device time is scarce)
#   SF_DIST        1: also run the TP x CP prefill benchmark (bench/gpu/distributed.sh, its own
#                  SF_DIST_* settings; needs -DSF_MPI=ON among the cmake args and 2 GPUs for the
#                  2-rank grids); writes bench-distributed.log and distributed-<gpu>.json
#   SF_COMM        1: NCCL all-gather bandwidth of the device CP exchange's two paths on every GPU
#                  of the host (sf_bench_comm; needs -DSF_MPI=ON; SF_COMM_MIB, default
#                  64,512,1024) into comm-<gpu>.json
#   SF_BENCH_LENGTHS         dense lengths (default 8192,32768)
#   SF_BENCH_SPARSE_LENGTHS  sparse-mode lengths (default 32768)
#   SF_BENCH_REPS            timed repeats per kernel (default 3)
#   SF_BENCH_DTYPES          fp32,bf16 (default) or one of them
#   SF_BENCH_HOST_EST_MAX    lengths up to which the CPU estimator also runs, for the index
#                            comparison (default 32768)
#   SF_BENCH_TIMEOUT         seconds for the benchmark binary (default 420)
#   SF_PEER_REPS             timed repeats per SDPA backend (default 10)
#   SF_BENCH_MODES           a subset of the sparse modes (e.g. vertical-slash,block-sparse)
#   SF_BENCH_SPARSE_MEMORY_GB  the sparse modes' memory budget per layer (default 20: above it the
#                            heads run in groups)
#   SF_BENCH_CP_SIZES        CP sizes whose selective exchange is counted (default 2,4,8;
#                            none skips the count, which walks each index on the host)
#   SF_BENCH_SEED            the synthetic inputs' seed (default: from the clock; the JSON keeps it;
#                            the peer's copy of the inputs uses the same one)
#   SF_BENCH_ROPE_BASE, SF_BENCH_DIAG_LOGIT  the planted inputs' rotary base and diagonal logit
#                            (defaults 10000 and 12; 500000 and 16: Llama-3-like concentration)
#   SF_BENCH_HEAD_DIM        head_dim of the benchmark and its peer: 128 (default) or 64
#   SF_BENCH_MAINLOOPS       bf16 sparse mainloops to time, first = reported (default wgmma-ws;
#                            wgmma-ws,wgmma adds the A/B, their repeats interleaved)
#   SF_PEER_TIMEOUT          seconds for the SDPA peer (default 300; it saves after every record)
#   SF_PEER_BACKENDS         SDPA backends to time (default cudnn,flash,efficient)
#   SF_PEER_SAME_INPUTS      1 (default): the peer also times SDPA on the benchmark's own planted
#                            tensors (dumped with --dump-inputs, same seed), and the benchmark
#                            compares with those; 0: random normal inputs only
#   SF_BENCH_INPUTS          a q/k/v safetensors file (sparsefill prefill --dump-attention): the
#                            benchmark runs again on it, at its full length
#   SF_CUDNN_ROOT            cuDNN folder (default: the torch environment's nvidia/cudnn)
#
# Host gaps handled here (GPU-HOST.md): Boost 1.83 comes as headers only, so when CMake cannot
# find the compiled boost_json component, Boost.JSON is compiled from its header-only source
# (boost/json/src.hpp) into a local static library and handed to find_package(Boost COMPONENTS
# json) through boost_json_DIR (BoostConfig path) and Boost_JSON_LIBRARY_RELEASE (FindBoost path).
# When no GTestConfig.cmake is installed, GoogleTest is built from /usr/src/googletest into a
# local prefix. When libxxhash is missing but xxhash.h exists, a one-file static library is built.
set -uo pipefail

root="$(pwd)"
if [[ ! -f "$root/CMakeLists.txt" || ! -d "$root/kernels" ]]; then
  echo "run.sh: run from the sparsefill repository root (got $root)" >&2
  exit 2
fi
build="$root/${SF_BUILD_DIR:-build-gpu}"
out="${OUT:-$build/out}"
jobs="${SF_JOBS:-$(nproc)}"
force_deps="${SF_BUILD_DEPS:-0}"
deps="$build/_deps"
mkdir -p "$out" "$deps"
logs="$build/logs"
mkdir -p "$logs"
status="ok"
notes=()

any_exists() {
  for p in "$@"; do [[ -e "$p" ]] && return 0; done
  return 1
}
note() { notes+=("$*"); echo "run.sh: $*"; }
# The GPU's name as results files name it: "NVIDIA H100 80GB HBM3" -> nvidia-h100-80gb-hbm3.
gpu_slug() {
  local g
  g=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
      tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
  echo "${g:-unknown-gpu}"
}
fail() { status="FAIL"; note "FAIL: $*"; }

finish() {
  # The peer's copy of the planted inputs (12 GB at 1M) never stays on the host.
  [[ -n "${dumpdir:-}" ]] && rm -rf "$dumpdir"
  {
    echo "status: $status"
    for n in "${notes[@]}"; do echo "$n"; done
  } >"$logs/summary.txt"
  for f in summary.txt env.txt ctest.log sanitizer.log bench-attention.log gpu-clocks.csv; do
    [[ -f "$logs/$f" ]] && cp "$logs/$f" "$out/$f"
  done
  # $OUT brings back at most 8 files: dependency, configure and build logs travel as one.
  for f in deps.log configure.log build.log; do
    [[ -s "$logs/$f" ]] && { echo "===== $f"; cat "$logs/$f"; }
  done >"$out/build.log"
  # (ctest.log is --verbose, so Testing/Temporary/LastTest.log would repeat it; $OUT keeps 8 files.)
  cat "$logs/summary.txt"
  [[ "$status" == ok* ]]
}
trap 'finish; exit $?' EXIT

# The copy of the tree on a GPU host may carry a stale .git: the caller writes the commit it sent
# to .source-commit (git-ignored, carried) and the results name that commit.
if [[ -z "${SF_SOURCE_COMMIT:-}" && -f "$root/.source-commit" ]]; then
  export SF_SOURCE_COMMIT="$(cat "$root/.source-commit")"
fi

# ---- what this host is ---------------------------------------------------------------------
{
  date -u
  echo "--- git"; echo "SF_SOURCE_COMMIT=${SF_SOURCE_COMMIT:-}"; git -C "$root" rev-parse HEAD 2>&1; git -C "$root" status --short 2>&1 | head -50
  echo "--- nvidia-smi"; nvidia-smi 2>&1 | head -30
  echo "--- nvcc"; /usr/local/cuda/bin/nvcc --version 2>&1 | tail -2
  echo "--- cmake"; cmake --version 2>&1 | head -1
  echo "--- ninja"; ninja --version 2>&1
  echo "--- g++"; g++ --version 2>&1 | head -1
  echo "--- boost"; grep -m1 '#define BOOST_LIB_VERSION' /usr/include/boost/version.hpp 2>&1
  ls -d /usr/lib/x86_64-linux-gnu/cmake/Boost-* /usr/lib/x86_64-linux-gnu/cmake/boost_json-* 2>&1
  ls /usr/lib/x86_64-linux-gnu/libboost_json* 2>&1
  echo "--- gtest"; ls -d /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/lib/cmake/GTest /usr/src/googletest 2>&1
  echo "--- xxhash"; ls /usr/include/xxhash.h /usr/lib/x86_64-linux-gnu/libxxhash* 2>&1
} >"$logs/env.txt" 2>&1

extra=()
: >"$logs/deps.log"

# ---- GoogleTest ----------------------------------------------------------------------------
if [[ $force_deps == 1 ]] || ! any_exists /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake /usr/lib/cmake/GTest/GTestConfig.cmake \
                /usr/local/lib/cmake/GTest/GTestConfig.cmake; then
  if [[ ! -f /usr/src/googletest/CMakeLists.txt ]]; then
    fail "no GTestConfig.cmake and no /usr/src/googletest to build it from"
    exit 1
  fi
  note "GTest: building /usr/src/googletest into $deps/gtest"
  if ! { cmake -S /usr/src/googletest -B "$deps/gtest-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
           -DCMAKE_INSTALL_PREFIX="$deps/gtest" -DBUILD_GMOCK=OFF -DINSTALL_GTEST=ON &&
         cmake --build "$deps/gtest-build" -j "$jobs" && cmake --install "$deps/gtest-build"; } >>"$logs/deps.log" 2>&1; then
    fail "building GoogleTest from /usr/src/googletest (see deps.log)"
    exit 1
  fi
  extra+=(-DGTest_ROOT="$deps/gtest" -DCMAKE_PREFIX_PATH="$deps/gtest")
fi

# ---- Boost.JSON ----------------------------------------------------------------------------
# BoostConfig looks for boost_json-<exact header version>; FindBoost for libboost_json.{so,a}. A
# runtime-only libboost_json.so.1.83.0 serves neither, so decide on the CMake config.
bv=$(sed -n 's/^#define BOOST_VERSION \([0-9]*\).*/\1/p' /usr/include/boost/version.hpp 2>/dev/null)
if [[ -z "$bv" ]]; then
  fail "Boost headers not found (/usr/include/boost/version.hpp)"
  exit 1
fi
bver="$((bv / 100000)).$((bv / 100 % 1000)).$((bv % 100))"
if [[ $force_deps == 1 ]] || ! any_exists /usr/lib/x86_64-linux-gnu/cmake/boost_json-"$bver" /usr/lib/cmake/boost_json-"$bver" \
                /usr/local/lib/cmake/boost_json-"$bver"; then
  if [[ ! -f /usr/include/boost/json/src.hpp ]]; then
    fail "Boost.JSON: no boost_json-$bver CMake package and no /usr/include/boost/json/src.hpp to build one"
    exit 1
  fi
  bj="$deps/boost_json"
  note "Boost.JSON: no compiled library; building $bver from boost/json/src.hpp into $bj"
  mkdir -p "$bj"
  echo '#include <boost/json/src.hpp>' >"$bj/boost_json_src.cpp"
  if ! { g++ -std=c++20 -O2 -fPIC -c "$bj/boost_json_src.cpp" -o "$bj/boost_json_src.o" &&
         ar rcs "$bj/libboost_json.a" "$bj/boost_json_src.o"; } >>"$logs/deps.log" 2>&1; then
    fail "compiling Boost.JSON from headers (see deps.log)"
    exit 1
  fi
  cat >"$bj/boost_json-config.cmake" <<EOF
# Generated by bench/gpu/run.sh: Boost.JSON compiled from its header-only source.
if(NOT TARGET Boost::json)
  add_library(Boost::json STATIC IMPORTED)
  set_target_properties(Boost::json PROPERTIES IMPORTED_LOCATION "$bj/libboost_json.a")
  if(TARGET Boost::headers)
    set_property(TARGET Boost::json PROPERTY INTERFACE_LINK_LIBRARIES Boost::headers)
  endif()
endif()
EOF
  cat >"$bj/boost_json-config-version.cmake" <<EOF
set(PACKAGE_VERSION "$bver")
if(PACKAGE_FIND_VERSION VERSION_EQUAL PACKAGE_VERSION)
  set(PACKAGE_VERSION_EXACT TRUE)
endif()
if(NOT PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
endif()
EOF
  # FindBoost (used when BoostConfig.cmake is absent) also wants json's dependency, container;
  # header-only Boost.JSON needs nothing from it, so the same archive stands in.
  extra+=(-Dboost_json_DIR="$bj" -DBoost_JSON_LIBRARY_RELEASE="$bj/libboost_json.a"
          -DBoost_CONTAINER_LIBRARY_RELEASE="$bj/libboost_json.a")
fi

# ---- xxHash --------------------------------------------------------------------------------
xxh_inc=""
for d in "${SF_XXHASH_DIR:-}" /usr/include /usr/local/include "$root/.deps/xxhash"; do
  [[ -n "$d" && -f "$d/xxhash.h" ]] && { xxh_inc="$d"; break; }
done
if [[ -z "$xxh_inc" ]]; then
  fail "xxhash.h not found (libxxhash-dev absent); set SF_XXHASH_DIR to a folder holding xxhash.h"
  exit 1
fi
[[ "$xxh_inc" != /usr/include ]] && extra+=(-DSF_XXHASH_INCLUDE="$xxh_inc")
if [[ $force_deps == 1 ]] || ! any_exists /usr/lib/x86_64-linux-gnu/libxxhash.{so,a} /usr/lib/libxxhash.{so,a} /usr/local/lib/libxxhash.{so,a}; then
  note "xxHash: no library; building one from $xxh_inc/xxhash.h"
  mkdir -p "$deps/xxhash"
  printf '#define XXH_STATIC_LINKING_ONLY\n#define XXH_IMPLEMENTATION\n#include "xxhash.h"\n' >"$deps/xxhash/xxhash.c"
  if ! { gcc -O2 -fPIC -I"$xxh_inc" -c "$deps/xxhash/xxhash.c" -o "$deps/xxhash/xxhash.o" &&
         ar rcs "$deps/xxhash/libxxhash.a" "$deps/xxhash/xxhash.o"; } >>"$logs/deps.log" 2>&1; then
    fail "building libxxhash from xxhash.h (see deps.log)"
    exit 1
  fi
  extra+=(-DSF_XXHASH_LIB="$deps/xxhash/libxxhash.a")
fi

# ---- cuDNN (the bf16 dense path) -----------------------------------------------------------
# GPU-HOST.md: cuDNN lives in the torch environment (nvidia/cudnn), not under /usr/local/cuda. The
# frontend headers come from deploy/fetch-cudnn-frontend.sh, run on the CPU machine and carried
# (.deps/cudnn-frontend; the host has no network). With both, the build must use cuDNN
# (SF_CUDNN=ON); without either, it builds without and the bf16 dense path reports kUnsupported.
cudnn_root="${SF_CUDNN_ROOT:-}"
if [[ -z "$cudnn_root" ]]; then
  cudnn_root=$(python3 -c 'import nvidia.cudnn as c; print(list(c.__path__)[0])' 2>/dev/null || true)
fi
fe_inc="$root/.deps/cudnn-frontend/include"
if [[ -n "$cudnn_root" && -f "$cudnn_root/include/cudnn.h" && -f "$fe_inc/cudnn_frontend.h" ]]; then
  extra+=(-DSF_CUDNN=ON -DSF_CUDNN_ROOT="$cudnn_root" -DSF_CUDNN_FRONTEND_INCLUDE="$fe_inc")
  # cuDNN loads its engine libraries (and NVRTC for runtime-compiled ones) by name at run time.
  nv_libs=$(python3 -c 'import glob, os, nvidia; print(":".join(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "*", "lib")))))' 2>/dev/null || true)
  export LD_LIBRARY_PATH="$cudnn_root/lib${nv_libs:+:$nv_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  note "cuDNN: $cudnn_root (frontend $(cat "$root/.deps/cudnn-frontend/VERSION" 2>/dev/null))"
else
  note "cuDNN: not used (root '${cudnn_root}', frontend headers $( [[ -f "$fe_inc/cudnn_frontend.h" ]] && echo present || echo missing: carry .deps/cudnn-frontend))"
fi
{ echo "--- cudnn"; echo "root=$cudnn_root"; ls "$cudnn_root/lib" 2>&1 | head; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; } >>"$logs/env.txt"

# ---- configure, build, test ----------------------------------------------------------------
# Sanitizer runs name the source line of a report (-lineinfo: line tables only). Set either way,
# so a build folder does not keep it from an earlier call.
if [[ -n "${SF_SANITIZE:-}" ]]; then extra+=(-DSF_CUDA_LINEINFO=ON); else extra+=(-DSF_CUDA_LINEINFO=OFF); fi
if ! cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSF_CUDA=ON -DSF_UCX=OFF -DSF_MPI=OFF \
       "${extra[@]}" "$@" >"$logs/configure.log" 2>&1; then
  fail "configure (see configure.log; last lines below)"
  notes+=("$(tail -25 "$logs/configure.log")")
  exit 1
fi

# Keep going past unrelated failures: every test that can be built still runs.
# SF_BUILD_TARGETS (space-separated) builds only those targets, for a short check of a few tests.
build_targets=()
[[ -n "${SF_BUILD_TARGETS:-}" ]] && build_targets=(--target ${SF_BUILD_TARGETS})
if ! cmake --build "$build" -j "$jobs" "${build_targets[@]}" -- -k 0 >"$logs/build.log" 2>&1; then
  note "build had failures (see build.log); running the gpu tests that did build"
  notes+=("$(grep -m 10 '^FAILED:' "$logs/build.log")")
  build_failed=1
else
  build_failed=0
fi

# --verbose keeps each op's error figures in the log even when the tests pass.
if [[ "${SF_TESTS:-1}" == 0 ]]; then
  echo "gpu tests not run (SF_TESTS=0)" >"$logs/ctest.log"
  notes+=("gpu tests not run (SF_TESTS=0)")
else
# SF_GPU_TEST_REGEX narrows the gpu label to the tests whose names match (with SF_BUILD_TARGETS).
test_filter=()
[[ -n "${SF_GPU_TEST_REGEX:-}" ]] && test_filter=(-R "$SF_GPU_TEST_REGEX")
ctest --test-dir "$build" -L gpu "${test_filter[@]}" --output-on-failure --verbose --timeout "${SF_GPU_TEST_TIMEOUT:-1200}" >"$logs/ctest.log" 2>&1
ctest_rc=$?
notes+=("$(grep -E '^ *[0-9]+/[0-9]+ Test +#|tests passed|tests failed|^[[:space:]]+[0-9]+ - ' "$logs/ctest.log" | tail -20)")
# test_gpu_forward's figures (GPU prefill vs the CPU forward) belong in the summary too.
notes+=("$(grep -E '(bf16|f32) (logits|top-1|KV cache):|device: ' "$logs/ctest.log" | head -12)")
# test_device_decode: the device decode kernel and session vs the host's.
notes+=("$(grep -E 'visited [0-9]+ of [0-9]+ blocks, max err|logits rel err' "$logs/ctest.log" | head -16)")
# test_cuda_estimators: device index vs the CPU estimator, per case.
notes+=("$(grep -E 'slots equal to the host builder|seed=' "$logs/ctest.log" | grep -B1 'slots equal' | head -12)")
if grep -q 'No tests were found' "$logs/ctest.log"; then
  fail "no gpu-labelled tests were registered (is SF_HAVE_CUDA on? see configure.log)"
elif [[ $ctest_rc -ne 0 ]]; then
  fail "gpu tests failed (see ctest.log)"
elif grep -q '(Skipped)' "$logs/ctest.log"; then
  # A skip is a failure on a GPU host unless its only reason is that this host has one GPU (the
  # multi-GPU tests); gtest prints each skip's reason on the line after "Skipped".
  reasons=$(grep -A1 -E ': Skipped$' "$logs/ctest.log" | grep -v -E ': Skipped$|^--$' | sed -E 's/^[0-9]+: //' | sort -u)
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  other=$(grep -v -x -E 'needs one GPU per rank|needs two GPUs' <<<"$reasons" || true)
  if [[ "${gpus:-0}" -lt 2 && -z "$other" ]]; then
    skipped=$(grep -E '^[[:space:]]+[0-9]+ - .*\(Skipped\)' "$logs/ctest.log" | awk '{print $3}' | paste -sd' ')
    status="ok (the multi-GPU tests skipped on this ${gpus}-GPU host: ${skipped}$([[ $build_failed == 1 ]] && echo '; other targets failed to build, see build.log'))"
  else
    fail "gpu tests skipped themselves on a GPU host: $(head -1 <<<"${other:-$reasons}")"
  fi
elif [[ $build_failed == 1 ]]; then
  status="ok (gpu tests passed; other targets failed to build, see build.log)"
fi
fi

# ---- compute-sanitizer over gpu test binaries (SF_SANITIZE) --------------------------------
if [[ -n "${SF_SANITIZE:-}" ]]; then
  san=""
  for c in compute-sanitizer /usr/local/cuda/bin/compute-sanitizer; do
    command -v "$c" >/dev/null 2>&1 && { san="$c"; break; }
  done
  sl="$logs/sanitizer.log"
  : >"$sl"
  if [[ -z "$san" ]]; then
    fail "SF_SANITIZE: no compute-sanitizer on this host"
  else
    for item in $SF_SANITIZE; do
      IFS=@ read -r tool bin filt secs <<<"$item"
      exe="$build/tests/$bin"
      if [[ ! -x "$exe" ]]; then
        fail "SF_SANITIZE: $bin was not built"
        continue
      fi
      args=()
      [[ -n "$filt" ]] && args=(--gtest_filter="$filt")
      # The environment ctest gives this binary's test (ENVIRONMENT: the MPI tests' run-as-root
      # switches, SF_SOURCE_DIR, NCCL_NVLS_ENABLE), so it runs as it does under ctest.
      mapfile -t tenv < <(ctest --test-dir "$build" --show-only=json-v1 2>/dev/null | python3 -c '
import json, sys
for t in json.load(sys.stdin).get("tests", []):
    if t.get("command") and t["command"][0].endswith("/" + sys.argv[1]):
        for p in t.get("properties", []):
            if p.get("name") == "ENVIRONMENT":
                print("\n".join(p["value"]))
        break' "$bin")
      echo "===== $tool $bin ${filt:-(all)}" >>"$sl"
      from=$(wc -l <"$sl")
      # --error-exitcode: a reported error fails the item even when the test itself passes.
      # SF_SANITIZE_ARGS: more of the tool's flags for every item (e.g. "--leak-check full").
      # shellcheck disable=SC2086
      env "${tenv[@]}" timeout "${secs:-300}" "$san" --tool "$tool" --error-exitcode 99 --print-limit 50 \
        ${SF_SANITIZE_ARGS:-} "$exe" "${args[@]}" >>"$sl" 2>&1
      rc=$?
      # This item's own summary line (a run cut by its timeout prints none).
      line=$(tail -n +"$((from + 1))" "$sl" | grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' | tail -1)
      notes+=("sanitizer $tool $bin ${filt:-(all)}: rc $rc; ${line:-no summary line}")
      [[ $rc -ne 0 ]] && fail "sanitizer $tool $bin ${filt:-(all)}: exit $rc (see sanitizer.log)"
    done
  fi
fi

# ---- attention benchmark: torch SDPA peer, then ours (dense and sparse modes) ---------------
if [[ "${SF_BENCH:-1}" != 0 ]]; then
  dense_l="${SF_BENCH_LENGTHS:-8192,32768}"
  sparse_l="${SF_BENCH_SPARSE_LENGTHS:-32768}"
  peer_l=$(echo "$dense_l,$sparse_l" | tr ',' '\n' | sort -nu | paste -sd, -)
  gpu=$(gpu_slug)
  bl="$logs/bench-attention.log"
  : >"$bl"
  # Clocks and power while the benchmark runs: a kernel's time moves with them (the same kernel
  # has differed by a third between calls on H100), so the record says what the GPU ran at.
  mon_pid=""
  if command -v nvidia-smi >/dev/null; then
    q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
    reasons=clocks_event_reasons.active
    nvidia-smi --query-gpu="$reasons" --format=csv,noheader >/dev/null 2>&1 ||
      reasons=clocks_throttle_reasons.active
    nvidia-smi --query-gpu="$q,$reasons" --format=csv -lms 250 >"$logs/gpu-clocks.csv" 2>&1 &
    mon_pid=$!
  fi
  hd="${SF_BENCH_HEAD_DIM:-128}"
  # One seed for the peer's copy of the planted inputs and the benchmark's own (the JSON keeps it).
  seed="${SF_BENCH_SEED:-$(( $(date +%s%N) / 1000 % 1000000000000 ))}"
  # The peer also times SDPA on the very tensors our kernels run on (a GPU at its power cap clocks
  # by the data it multiplies: random normal inputs ran cuDNN 5-11% slower than the planted ones
  # in earlier runs); the benchmark then compares with those records.
  in_pat=""
  dumpdir="$build/peer-inputs"
  if [[ "${SF_PEER_SAME_INPUTS:-1}" == 1 && -x "$build/tools/sparsefill" ]]; then
    echo "--- planted inputs for the peer ($(date -u))" >>"$bl"
    rm -rf "$dumpdir" && mkdir -p "$dumpdir"
    if timeout "${SF_DUMP_TIMEOUT:-300}" "$build/tools/sparsefill" bench attention --lengths "$dense_l" --sparse-lengths "$sparse_l" \
         --head-dim "$hd" --seed "$seed" \
         ${SF_BENCH_ROPE_BASE:+--planted-rope-base "$SF_BENCH_ROPE_BASE"} \
         ${SF_BENCH_DIAG_LOGIT:+--planted-diag-logit "$SF_BENCH_DIAG_LOGIT"} \
         --dump-inputs "$dumpdir/planted" >>"$bl" 2>&1; then
      in_pat="$dumpdir/planted-{L}.safetensors"
    else
      note "planted inputs for the peer failed (see bench-attention.log); the peer runs on random inputs only"
    fi
  fi
  echo "--- sdpa peer ($(date -u))" >>"$bl"
  if ! timeout "${SF_PEER_TIMEOUT:-300}" python3 "$root/bench/gpu/sdpa_peer.py" --lengths "$peer_l" --head-dim "$hd" --reps "${SF_PEER_REPS:-10}" --backends "${SF_PEER_BACKENDS:-cudnn,flash,efficient}" ${in_pat:+--inputs "$in_pat"} --out "$logs/sdpa.json" >>"$bl" 2>&1; then
    note "sdpa peer failed (see bench-attention.log); benchmark runs without it"
  fi
  rm -rf "$dumpdir"
  sdpa_arg=()
  [[ -f "$logs/sdpa.json" ]] && sdpa_arg=(--sdpa "$logs/sdpa.json")
  echo "--- sparsefill bench attention ($(date -u))" >>"$bl"
  if [[ ! -x "$build/tools/sparsefill" ]]; then
    fail "sparsefill did not build; no attention benchmark"
  elif ! timeout "${SF_BENCH_TIMEOUT:-420}" "$build/tools/sparsefill" bench attention --lengths "$dense_l" \
         --sparse-lengths "$sparse_l" --head-dim "$hd" --reps "${SF_BENCH_REPS:-3}" "${sdpa_arg[@]}" \
         --dtypes "${SF_BENCH_DTYPES:-fp32,bf16}" --host-estimate-max "${SF_BENCH_HOST_EST_MAX:-32768}" \
         ${SF_BENCH_MODES:+--modes "$SF_BENCH_MODES"} \
         ${SF_BENCH_CP_SIZES:+--cp-sizes "$SF_BENCH_CP_SIZES"} \
         ${SF_BENCH_MAINLOOPS:+--mainloops "$SF_BENCH_MAINLOOPS"} \
         ${SF_BENCH_SPARSE_MEMORY_GB:+--sparse-memory-gb "$SF_BENCH_SPARSE_MEMORY_GB"} \
         ${SF_BENCH_ROPE_BASE:+--planted-rope-base "$SF_BENCH_ROPE_BASE"} \
         --seed "$seed" \
         ${SF_BENCH_DIAG_LOGIT:+--planted-diag-logit "$SF_BENCH_DIAG_LOGIT"} \
         --out "$out/attention-$gpu.json" >>"$bl" 2>&1; then
    fail "bench attention failed (see bench-attention.log)"
  fi
  # Real-model tensors (sparsefill prefill --dump-attention LAYER:FILE, carried to the host): the
  # same benchmark on that file's q, k, v, with the peer run on the file's shape.
  if [[ -n "${SF_BENCH_INPUTS:-}" && -x "$build/tools/sparsefill" ]]; then
    echo "--- inputs $SF_BENCH_INPUTS ($(date -u))" >>"$bl"
    shp=$(python3 - "$SF_BENCH_INPUTS" <<'PY' 2>>"$bl"
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
q, k = h["q"]["shape"], h["k"]["shape"]
print(q[0], q[1], k[1], q[2])
PY
)
    read -r in_n in_h in_kv in_d <<<"$shp"
    in_arg=()
    if [[ -n "${in_d:-}" ]] && timeout 120 python3 "$root/bench/gpu/sdpa_peer.py" --lengths "$in_n" --heads "$in_h" \
         --kv-heads "$in_kv" --head-dim "$in_d" --out "$logs/sdpa-inputs.json" >>"$bl" 2>&1; then
      in_arg=(--sdpa "$logs/sdpa-inputs.json")
    else
      note "sdpa peer on the --inputs shape failed (see bench-attention.log)"
    fi
    if ! timeout "${SF_BENCH_TIMEOUT:-420}" "$build/tools/sparsefill" bench attention --inputs "$SF_BENCH_INPUTS" \
         --reps "${SF_BENCH_REPS:-3}" "${in_arg[@]}" --dtypes "${SF_BENCH_DTYPES:-fp32,bf16}" \
         --out "$out/attention-$gpu-inputs.json" >>"$bl" 2>&1; then
      fail "bench attention --inputs failed (see bench-attention.log)"
    fi
  fi
  echo "--- done ($(date -u))" >>"$bl"
  [[ -n "$mon_pid" ]] && kill "$mon_pid" 2>/dev/null
  notes+=("$(grep -E '^(device|  dense|  [a-z-]+\(|sdpa )' "$bl" | head -30)")
fi

# ---- decode attention (sf_bench_decode): the device kernel per pool encoding and mode ---------
if [[ -n "${SF_DECODE:-}" ]]; then
  dj="$out/decode-$(gpu_slug).jsonl"
  : >"$dj"
  for shape in ${SF_DECODE_SHAPES:-32:8:128}; do
    IFS=: read -r dhq dhkv dd <<<"$shape"
    for n in $SF_DECODE; do
      for pull in ${SF_DECODE_PULLS:-0.15}; do
        if ! timeout "${SF_DECODE_TIMEOUT:-300}" "$build/bench/sf_bench_decode" "$n" "$dhq" "$dhkv" \
             "$dd" "$pull" "${SF_DECODE_POOLS:-f32,bf16,int8}" >>"$dj" 2>>"$logs/build.log"; then
          fail "sf_bench_decode $n $shape (pull $pull) failed (its stderr is at the end of build.log)"
        fi
      done
    done
  done
  notes+=("$(cut -c1-300 "$dj" | head -24)")
fi

# ---- the decode node's step (sf_bench_decode_session): eager and graph, unfused and fused -----
if [[ -n "${SF_DECODE_SESSION:-}" ]]; then
  sj="$out/decode-session-$(gpu_slug).jsonl"
  : >"$sj"
  for spec in $SF_DECODE_SESSION; do
    if ! timeout "${SF_DECODE_TIMEOUT:-300}" "$build/bench/sf_bench_decode_session" "${spec%%:*}" \
         "${spec#*:}" "${SF_DECODE_STEPS:-64}" "${SF_DECODE_SESSION_POOLS:-f32,int8}" \
         "${SF_DECODE_WEIGHTS:-bf16,f32}" "${SF_DECODE_VERIFY:-}" >>"$sj" 2>>"$logs/build.log"; then
      fail "sf_bench_decode_session $spec failed (its stderr is at the end of build.log)"
    fi
  done
  notes+=("$(cut -c1-300 "$sj" | head -12)")
fi

# ---- the decode step's one-row linears (sf_bench_gemv) against a copy of the same bytes --------
if [[ "${SF_GEMV:-0}" == 1 ]]; then
  gj="$out/gemv-$(gpu_slug).jsonl"
  if ! timeout "${SF_DECODE_TIMEOUT:-300}" "$build/bench/sf_bench_gemv" "${SF_GEMV_REPS:-50}" \
       >"$gj" 2>>"$logs/build.log"; then
    fail "sf_bench_gemv failed (its stderr is at the end of build.log)"
  fi
  notes+=("$(cut -c1-300 "$gj" | head -36)")
fi

# ---- KV tiering during a prefill (sf_bench_kv_tiering_prefill) ---------------------------------
if [[ -n "${SF_TIERING_PREFILL:-}" ]]; then
  tj="$out/tiering-prefill-$(gpu_slug).jsonl"
  : >"$tj"
  for item in $SF_TIERING_PREFILL; do
    IFS=: read -r t_tok t_lay t_frac t_host <<<"$item"
    t_disk=()
    if [[ -n "$t_host" ]]; then
      # The disk tier's scratch directory (gigabytes at 128K), removed after the item.
      if ! t_dir="$(mktemp -d "${TMPDIR:-/tmp}/sf-tiering-disk.XXXXXX")"; then
        fail "sf_bench_kv_tiering_prefill $item: no scratch directory for its disk tier"
        continue
      fi
      t_disk=("$t_host" "$t_dir")
    fi
    if ! timeout "${SF_DECODE_TIMEOUT:-300}" "$build/bench/sf_bench_kv_tiering_prefill" \
         "$t_tok" "$t_lay" "$t_frac" "${SF_TIERING_REPS:-3}" "${t_disk[@]}" \
         >>"$tj" 2>>"$logs/build.log"; then
      fail "sf_bench_kv_tiering_prefill $item failed (its stderr is at the end of build.log)"
    fi
    [[ -n "$t_host" ]] && rm -rf "$t_dir"
  done
  notes+=("$(cut -c1-600 "$tj")")
fi

if [[ -n "${SF_PREFIX_DEVICE:-}" ]]; then
  pj="$out/prefix-device-$(gpu_slug).jsonl"
  : >"$pj"
  for item in $SF_PREFIX_DEVICE; do
    IFS=: read -r p_tok p_pre p_lay <<<"$item"
    if ! timeout "${SF_DECODE_TIMEOUT:-300}" "$build/bench/sf_bench_prefix_device" \
         "$p_tok" "$p_pre" "$p_lay" "${SF_PREFIX_REPS:-3}" >>"$pj" 2>>"$logs/build.log"; then
      fail "sf_bench_prefix_device $item failed (its stderr is at the end of build.log)"
    fi
  done
  notes+=("$(cut -c1-600 "$pj")")
fi

if [[ -n "${SF_KV_EXPORT:-}" ]]; then
  ej="$out/kv-export-$(gpu_slug).jsonl"
  : >"$ej"
  for item in $SF_KV_EXPORT; do
    IFS=: read -r e_tok e_lay e_dt e_widths <<<"$item"
    for w in ${e_widths//,/ }; do
      if ! timeout "${SF_DECODE_TIMEOUT:-300}" "$build/bench/sf_bench_kv_export" "$e_tok" "$e_lay" 8 \
           128 "$e_dt" "${SF_KV_EXPORT_REPS:-2}" "$w" >>"$ej" 2>>"$logs/build.log"; then
        fail "sf_bench_kv_export $item width $w failed (its stderr is at the end of build.log)"
      fi
    done
  done
  notes+=("$(cut -c1-400 "$ej")")
fi

# ---- the worker's export overlap on GPUs (needs -DSF_MPI=ON and 2 GPUs) ----------------------
if [[ -n "${SF_WORKER_OVERLAP:-}" ]]; then
  IFS=: read -r o_tok o_lay o_n <<<"$SF_WORKER_OVERLAP"
  oj="$out/export-overlap-$(gpu_slug).json"
  if ! SF_OVERLAP_MODEL="synthetic:llama3-8b:$o_lay" SF_OVERLAP_TOKENS="$o_tok" SF_OVERLAP_N="${o_n:-4}" \
       SF_OVERLAP_ARGS="--device cuda ${SF_WORKER_OVERLAP_ARGS:-}" \
       timeout "${SF_WORKER_OVERLAP_TIMEOUT:-500}" bash "$root/bench/mpi/export_overlap.sh" "$build" "$oj" \
       >>"$logs/build.log" 2>&1; then
    fail "export overlap benchmark failed (its output is at the end of build.log)"
  fi
  [[ -s "$oj" ]] && notes+=("$(cut -c1-800 "$oj")")
fi

# ---- long requests through the worker (needs -DSF_MPI=ON and 2 GPUs) ---------------------------
if [[ "${SF_WORKER_LONG:-0}" == 1 ]]; then
  lj="$out/long-requests-$(gpu_slug).json"
  if ! timeout "${SF_WORKER_LONG_TIMEOUT:-500}" bash "$root/bench/mpi/long_requests.sh" "$build" "$lj" \
       >>"$logs/build.log" 2>&1; then
    fail "long requests benchmark failed (its output is at the end of build.log)"
  fi
  [[ -s "$lj" ]] && notes+=("$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); [print(r["id"], r["n_tokens"], r["plan_s"], r["prefill_s"], r["attention_s"], r["sparse_grows"]) for r in d["requests"]]' "$lj")")
fi

# ---- the worker's plans across prompt lengths (needs -DSF_MPI=ON and 2 GPUs) ------------------
if [[ "${SF_WORKER_PLANS:-0}" == 1 ]]; then
  pj="$out/plan-reuse-$(gpu_slug).json"
  if ! timeout "${SF_WORKER_PLANS_TIMEOUT:-400}" bash "$root/bench/mpi/plan_reuse.sh" "$build" "$pj" \
       >>"$logs/build.log" 2>&1; then
    fail "plan reuse benchmark failed (its output is at the end of build.log)"
  fi
  [[ -s "$pj" ]] && notes+=("$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); [print(r["variant"], r["job_s"], r["plan_s"], [q["plan_s"] for q in r["requests"]], [q["prefill_s"] for q in r["requests"]]) for r in d["runs"]]' "$pj")")
fi

# ---- NCCL all-gather bandwidth (needs -DSF_MPI=ON and 2 or more GPUs) ------------------------
if [[ "${SF_COMM:-0}" == 1 ]]; then
  cj="$out/comm-$(gpu_slug).json"
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if ! NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
       timeout "${SF_COMM_TIMEOUT:-120}" mpirun --bind-to none -np "$ngpu" "$build/bench/sf_bench_comm" \
       --mib "${SF_COMM_MIB:-64,512,1024}" --reps 5 --out "$cj" >>"$logs/build.log" 2>&1; then
    fail "comm benchmark failed (its output is at the end of build.log)"
  fi
  [[ -s "$cj" ]] && notes+=("$(cut -c1-600 "$cj")")
fi

# ---- distributed prefill: TP x CP over NCCL (needs -DSF_MPI=ON among the cmake args) ---------
if [[ "${SF_DIST:-0}" == 1 ]]; then
  if ! bash "$root/bench/gpu/distributed.sh" "$build" "$out"; then
    fail "distributed benchmark failed (see bench-distributed.log)"
  fi
  notes+=("$(grep -E '^\{' "$out/bench-distributed.log" | cut -c1-400 | head -12)")
fi
exit 0
