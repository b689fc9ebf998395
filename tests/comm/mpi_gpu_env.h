// For the gpu-labelled tests that run under mpiexec (one GPU per rank): whether every rank of the
// test world sees enough GPUs. All ranks must agree before any of them skips, or one would wait
// in NCCL init for a peer that skipped.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "tests/comm/mpi_test_env.h"

namespace sf::testing {

inline bool every_rank_has_a_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  int32_t mine = n >= test_world().size() ? 1 : 0, all = 0;
  if (!test_world().all_reduce(&mine, &all, 1, DType::kI32, comm::ReduceOp::kMin).is_ok())
    return false;
  return all == 1;
}

}  // namespace sf::testing
