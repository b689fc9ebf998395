#!/usr/bin/env bash
# GPU TP x CP prefill benchmark (issue 5, "Run on the 2-GPU host"): sf_bench_distributed under
# mpirun, one rank per GPU, on a Llama-3-8B-shaped model with synthetic weights drawn on each
# device, then distributed-<gpu>.json with the device, driver, date, commit, command and, per
# record, the speedup over the one-GPU run of the same length and the scaling efficiency.
#
#   bench/gpu/distributed.sh BUILD_DIR OUT_DIR        (bench/gpu/run.sh calls it with SF_DIST=1)
#
# Environment: SF_DIST_LENGTHS (default 32768,131072), SF_DIST_GRIDS (1x1,1x2,2x1,2x1b; must start
# with 1x1; a "b" suffix runs TP's all-reduces blocking, the twin that measures the overlap),
# SF_DIST_ATTENTION (dense and/or sparse modes of --attention, default
# dense,vertical-slash,block-sparse: MInference's 1000 columns / 6096 diagonals and top-64 key
# blocks on every head), SF_DIST_REPS (timed runs after one warm-up, default 2), SF_DIST_LAYERS
# (0: all 32),
# SF_DIST_CHUNK (tokens per linear chunk, default 8192; a comma list runs the whole benchmark once
# per chunk, in that order, into one results file), SF_DIST_TIMEOUT (seconds, default 1500, each run),
# SF_DIST_IMPORTANCE (SnapKV importance window, as a scored retention asks; default 0: none).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, GPU-HOST.md).
set -uo pipefail
build="$1"
out="$2"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="$build/bench/sf_bench_distributed"
log="$out/bench-distributed.log"
[[ -x "$bin" ]] || { echo "distributed.sh: $bin was not built (configure with -DSF_MPI=ON)" >&2; exit 1; }
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
(( ngpu >= 1 )) || { echo "distributed.sh: no GPU" >&2; exit 1; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
chunks="${SF_DIST_CHUNK:-8192}"
[[ "$chunks" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
  { echo "distributed.sh: SF_DIST_CHUNK must be positive integers, comma-separated (got '$chunks')" >&2; exit 2; }
args=(--lengths "${SF_DIST_LENGTHS:-32768,131072}" --grids "${SF_DIST_GRIDS:-1x1,1x2,2x1,2x1b}"
      --attention "${SF_DIST_ATTENTION:-dense,vertical-slash,block-sparse}" --reps "${SF_DIST_REPS:-2}" --layers "${SF_DIST_LAYERS:-0}"
      --importance "${SF_DIST_IMPORTANCE:-0}")
records="$build/distributed-records.jsonl"
cmd="mpirun --bind-to none -np $ngpu sf_bench_distributed ${args[*]} --chunk $chunks"
: >"$log"
rm -f "$records"  # a failed run must not publish an earlier run's records under this commit
rc=0
IFS=, read -ra chunk_list <<<"$chunks"
for c in "${chunk_list[@]}"; do
  echo "--- chunk $c: mpirun --bind-to none -np $ngpu sf_bench_distributed ${args[*]} --chunk $c ($(date -u))" >>"$log"
  timeout "${SF_DIST_TIMEOUT:-1500}" mpirun --bind-to none -np "$ngpu" "$bin" "${args[@]}" --chunk "$c" \
    --out "$records.part" >>"$log" 2>&1
  rc=$?
  echo "--- exit $rc ($(date -u))" >>"$log"
  [[ -s "$records.part" ]] && cat "$records.part" >>"$records"
  rm -f "$records.part"
  ((rc)) && break
done
# The records this run completed (all of them, or those before a timeout) are composed; none, no
# results file.
if [[ -s "$records" ]]; then
  python3 "$root/bench/gpu/distributed_compose.py" "$records" "$out/distributed-$gpu.json" "$cmd" \
    "${SF_SOURCE_COMMIT:-$(git -C "$root" rev-parse HEAD 2>/dev/null)}" "$ngpu" || { ((rc)) || rc=1; }
fi
exit $rc
