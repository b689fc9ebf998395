#!/usr/bin/env bash
# Nsight Compute profile of the bf16 sparse attention kernels on a GPU host, after
# bench/gpu/run.sh has built build-gpu (run it first, e.g. with SF_BENCH=0). Profiles one launch
# of each mainloop on one sparse mode at one length and writes the report as text to
# $OUT/ncu-sparse.txt: speed of light (tensor pipe, L2/DRAM throughput), memory workload, warp
# stall reasons, occupancy.
#   OUT=... SF_PROFILE_LENGTH=32768 SF_PROFILE_MODE=block-sparse bench/gpu/profile.sh
# SF_PROFILE_MAINLOOPS (default wgmma-ws,wgmma) names the bf16 sparse mainloops that run, in order;
# SF_PROFILE_KERNELS (an ncu regex, default attention_sparse_bf16) and SF_PROFILE_COUNT (launches,
# default 4) pick other kernels, e.g. the device estimator's:
#   SF_PROFILE_KERNELS='score|row_lse|diag|select|build|pool' SF_PROFILE_COUNT=8
# SF_PROFILE_ARGS adds bench options not already in the command (a repeated option is refused; e.g. '--cp-sizes none', which a 1M profile wants: the CP
# count walks each index on the host).
set -uo pipefail
root="$(pwd)"
# As in run.sh: the bench JSON these profiles embed names the commit the caller sent.
if [[ -z "${SF_SOURCE_COMMIT:-}" && -f "$root/.source-commit" ]]; then
  export SF_SOURCE_COMMIT="$(cat "$root/.source-commit")"
fi
out="${OUT:-$root/build-gpu/out}"
mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/find_ncu.sh"
if [[ -z "$ncu_bin" ]]; then
  echo "profile.sh: no ncu on this host" | tee "$out/ncu-sparse.txt"
  exit 2
fi
L="${SF_PROFILE_LENGTH:-32768}"
mode="${SF_PROFILE_MODE:-block-sparse}"
ml="${SF_PROFILE_MAINLOOPS:-wgmma-ws,wgmma}"
# Dense lengths: the shortest, so a 1M profile does not also time dense attention at 1M.
dl=8192
{
  echo "ncu: $ncu_bin ($("$ncu_bin" --version | tail -1))"
  echo "command: sparsefill bench attention --lengths $dl --sparse-lengths $L --modes $mode --dtypes bf16 --reps 1 --mainloops $ml --dense-ours-max 0 --host-estimate-max 0 ${SF_PROFILE_ARGS:-}"
  timeout 500 "$ncu_bin" --kernel-name "regex:${SF_PROFILE_KERNELS:-attention_sparse_bf16}" \
    --launch-count "${SF_PROFILE_COUNT:-4}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    "$root/build-gpu/tools/sparsefill" bench attention --lengths "$dl" --sparse-lengths "$L" \
    --modes "$mode" --dtypes bf16 --reps 1 --mainloops "$ml" --dense-ours-max 0 \
    --host-estimate-max 0 ${SF_PROFILE_ARGS:-} 2>&1
} >"$out/ncu-sparse.txt" 2>&1
echo "profile.sh: wrote $out/ncu-sparse.txt ($(wc -l <"$out/ncu-sparse.txt") lines)"
