#!/usr/bin/env bash
# Configures and builds sparsefill into build/ (CUDA sources compile when nvcc is present).
#   deploy/build.sh [extra cmake args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${SF_JOBS:-$(nproc)}"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$root" -B "$root/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSF_UCX=OFF "$@"
cmake --build "$root/build" -j "$jobs"
