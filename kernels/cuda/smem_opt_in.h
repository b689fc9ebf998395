// Raising a kernel's dynamic shared-memory limit (needed above 48 KB), per device and kernel. It
// is a function attribute, not a stream operation: the first launch that needs it does it, before
// any CUDA graph capture that follows. `opted` is the caller's per-kernel static state: the limit
// set on each device so far, raised again when a launch needs more (a kernel whose size depends on
// its arguments, as kv_importance's on head_dim, would otherwise keep the first call's limit and
// fail a later, larger launch).
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace sf::kernels::cuda {

struct SmemOptIn {
  std::atomic<size_t> bytes[64] = {};  // per device ordinal: the limit set (0: not yet)
};

template <typename Kernel>
cudaError_t opt_in_smem(Kernel kernel, size_t bytes, SmemOptIn& opted) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::atomic<size_t>* have = dev >= 0 && dev < 64 ? &opted.bytes[dev] : nullptr;
  if (have && have->load(std::memory_order_relaxed) >= bytes) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (err == cudaSuccess && have) {
    // Two threads may raise it at once: keep the larger (the attribute is the last set, so a
    // smaller one set after a larger is noticed by the next launch that needs more).
    size_t cur = have->load(std::memory_order_relaxed);
    while (cur < bytes && !have->compare_exchange_weak(cur, bytes, std::memory_order_relaxed)) {
    }
  }
  return err;
}

}  // namespace sf::kernels::cuda
