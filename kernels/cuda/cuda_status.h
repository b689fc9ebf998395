// cudaError_t -> Status at the boundary between the typed launchers (which return cudaError_t)
// and library code (which returns Status). Internal to kernels/cuda.
#pragma once
#include <cuda_runtime_api.h>

#include <string>

#include "common/status.h"

namespace sf::kernels::cuda {

inline Status cuda_status(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return Status::ok();
  const Code code = e == cudaErrorMemoryAllocation ? Code::kResourceExhausted : Code::kInternal;
  return Status(code,
                std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")",
                file, line);
}

}  // namespace sf::kernels::cuda

// SF_CUDA_TRY(launch_or_api_call): propagate a cudaError_t as Status with the call site.
#define SF_CUDA_TRY(expr) \
  SF_TRY(::sf::kernels::cuda::cuda_status((expr), #expr, __FILE__, __LINE__))
