// Raising a kernel's dynamic shared-memory limit (needed above 48 KB), once per device and
// kernel. It is a function attribute, not a stream operation: the first launch does it, before
// any CUDA graph capture that follows. `done` is the caller's per-kernel static bit set.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace sf::kernels::cuda {

template <typename Kernel>
cudaError_t opt_in_smem(Kernel kernel, size_t bytes, std::atomic<uint64_t>& done) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  if (bit && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_relaxed);
  return err;
}

}  // namespace sf::kernels::cuda
