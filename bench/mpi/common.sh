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
