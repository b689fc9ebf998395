#!/usr/bin/env bash
# Nsight Compute profile of the CUDA SnapKV scoring kernel (kernels/cuda/kv_importance.cu) at a
# realistic size, after bench/gpu/run.sh -DSF_MPI=ON has built build-gpu (e.g. with SF_TESTS=0
# SF_BENCH=0): one launch inside sf_bench_distributed's one-GPU prefill of one Llama-3-8B-shaped
# layer (32 query / 8 KV heads of 128) with --importance 32. Writes $OUT/ncu-kv-importance.txt.
#   OUT=... SF_PROFILE_LENGTH=131072 bench/gpu/profile_importance.sh
set -uo pipefail
root="$(pwd)"
out="${OUT:-$root/build-gpu/out}"
mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/find_ncu.sh"
[[ -n "$ncu_bin" ]] || { echo "profile_importance.sh: no ncu on this host" | tee "$out/ncu-kv-importance.txt"; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
L="${SF_PROFILE_LENGTH:-131072}"
{
  echo "ncu: $ncu_bin ($("$ncu_bin" --version | tail -1)); commit $(cat "$root/.source-commit" 2>/dev/null || git -C "$root" rev-parse HEAD)"
  echo "command: sf_bench_distributed --lengths $L --grids 1x1 --attention dense --reps 1 --layers 1 --importance 32"
  timeout 400 "$ncu_bin" --kernel-name regex:kv_importance --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats --section InstructionStats \
    "$root/build-gpu/bench/sf_bench_distributed" --lengths "$L" --grids 1x1 --attention dense \
    --reps 1 --layers 1 --importance 32 2>&1
} >"$out/ncu-kv-importance.txt" 2>&1
echo "profile_importance.sh: wrote $out/ncu-kv-importance.txt ($(wc -l <"$out/ncu-kv-importance.txt") lines)"
