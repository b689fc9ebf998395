# Sourced by the MPI benches in this folder: `mpi_bench_setup DEFAULT_OUT_NAME "$@"` sets root
# (the repository), build ($1, default build/), out ($2, default bench/results/DEFAULT_OUT_NAME),
# worker, and tmp (a scratch folder removed on exit), and lets mpirun run as root.
mpi_bench_setup() {
  local name="$1"; shift
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  build="${1:-$root/build}"
  out="${2:-$root/bench/results/$name}"
  worker="$build/worker/sparsefill-worker"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
}

# The record's device ("CPU: model (N cores)", with the first two GPUs' names in front when $1 is
# "gpu") and commit (SF_SOURCE_COMMIT where bench/gpu/run.sh exported it from the carried
# .source-commit: a device copy of the tree has no history of its own).
mpi_bench_device() {
  local d
  d="CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //') ($(nproc) cores)"
  [[ "${1:-}" == gpu ]] && d="$(nvidia-smi --query-gpu=name --format=csv,noheader | paste -sd+) + $d"
  echo "$d"
}
mpi_bench_commit() {
  if [[ -n "${SF_SOURCE_COMMIT:-}" ]]; then echo "$SF_SOURCE_COMMIT"; return; fi
  echo "$(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet HEAD -- . || echo -dirty)"
}
