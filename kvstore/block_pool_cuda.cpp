// CUDA stores of the block pool: the device tier (one cudaMalloc arena) and the pinned host tier
// (one cudaHostAlloc arena, so device<->host moves run at DMA speed). Built only with SF_KV_CUDA.
// The device tier owns a non-blocking copy stream: BlockPool::move_batch queues a batch of
// copies on it and waits once.
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "kvstore/block_pool.h"

namespace sf::kvstore {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  return SF_ERR(kIo, std::string("block pool: ") + what + ": " + cudaGetErrorString(e));
}

class DeviceStore final : public TierStore {
 public:
  DeviceStore(void* p, int64_t bb, cudaStream_t s) : p_(static_cast<char*>(p)), bb_(bb), s_(s) {}
  ~DeviceStore() override {
    (void)cudaStreamSynchronize(s_);
    (void)cudaStreamDestroy(s_);
    (void)cudaFree(p_);
  }
  Status write(int64_t slot, const void* src, int64_t bytes) override {
    SF_TRY(write_async(slot, src, bytes));
    return sync();
  }
  Status read(int64_t slot, void* dst, int64_t bytes) const override {
    SF_TRY(cuda_status(
        cudaMemcpyAsync(dst, p_ + slot * bb_, size_t(bytes), cudaMemcpyDeviceToHost, s_),
        "device tier read"));
    return cuda_status(cudaStreamSynchronize(s_), "device tier read");
  }
  // The copy stream: moves of a batch queue here and overlap; pinned host ends make them DMA.
  Status read_async(int64_t slot, void* dst, int64_t bytes) override {
    return cuda_status(
        cudaMemcpyAsync(dst, p_ + slot * bb_, size_t(bytes), cudaMemcpyDeviceToHost, s_),
        "device tier copy to host");
  }
  Status write_async(int64_t slot, const void* src, int64_t bytes) override {
    return cuda_status(
        cudaMemcpyAsync(p_ + slot * bb_, src, size_t(bytes), cudaMemcpyHostToDevice, s_),
        "device tier copy from host");
  }
  Status sync() override { return cuda_status(cudaStreamSynchronize(s_), "device tier copy"); }

 private:
  char* p_;
  int64_t bb_;
  cudaStream_t s_;
};

// A CUDA build may run where there is no GPU or driver (CI, CPU hosts).
bool cuda_usable() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

}  // namespace

Result<std::unique_ptr<TierStore>> make_device_store(int64_t slots, int64_t block_bytes) {
  if (!cuda_usable())
    return SF_ERR(kUnsupported, "block pool: device tier: no usable CUDA device (device_bytes > 0)");
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, size_t(slots * block_bytes));
  if (e != cudaSuccess)
    return SF_ERR(kResourceExhausted, "block pool: device tier cudaMalloc of " +
                                          std::to_string(slots * block_bytes) +
                                          " bytes failed: " + cudaGetErrorString(e));
  cudaStream_t s = nullptr;
  const cudaError_t es = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (es != cudaSuccess) {
    (void)cudaFree(p);
    return SF_ERR(kIo,
                  std::string("block pool: device tier copy stream: ") + cudaGetErrorString(es));
  }
  return std::unique_ptr<TierStore>(new DeviceStore(p, block_bytes, s));
}

Result<std::unique_ptr<TierStore>> make_host_store(int64_t slots, int64_t block_bytes) {
  if (!cuda_usable()) return make_pageable_host_store(slots, block_bytes);
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, size_t(slots * block_bytes), cudaHostAllocDefault);
  if (e != cudaSuccess)
    return SF_ERR(kResourceExhausted, "block pool: host tier cudaHostAlloc of " +
                                          std::to_string(slots * block_bytes) +
                                          " bytes failed: " + cudaGetErrorString(e));
  return make_host_arena_store(p, block_bytes, [](void* q) { (void)cudaFreeHost(q); });
}

}  // namespace sf::kvstore
