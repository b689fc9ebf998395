// CUDA stores of the block pool: the device tier (one cudaMalloc arena) and the pinned host tier
// (one cudaHostAlloc arena, so device<->host moves run at DMA speed). Built only with SF_KV_CUDA.
// Copies are synchronous on the legacy stream; the async copy stream of deliverable 4 is not
// here yet.
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
  DeviceStore(void* p, int64_t bb) : p_(static_cast<char*>(p)), bb_(bb) {}
  ~DeviceStore() override { (void)cudaFree(p_); }
  Status write(int64_t slot, const void* src, int64_t bytes) override {
    return cuda_status(cudaMemcpy(p_ + slot * bb_, src, size_t(bytes), cudaMemcpyHostToDevice),
                       "device tier write");
  }
  Status read(int64_t slot, void* dst, int64_t bytes) const override {
    return cuda_status(cudaMemcpy(dst, p_ + slot * bb_, size_t(bytes), cudaMemcpyDeviceToHost),
                       "device tier read");
  }

 private:
  char* p_;
  int64_t bb_;
};

class PinnedHostStore final : public TierStore {
 public:
  PinnedHostStore(void* p, int64_t bb) : p_(static_cast<char*>(p)), bb_(bb) {}
  ~PinnedHostStore() override { (void)cudaFreeHost(p_); }
  Status write(int64_t slot, const void* src, int64_t bytes) override {
    std::memcpy(p_ + slot * bb_, src, size_t(bytes));
    return Status::ok();
  }
  Status read(int64_t slot, void* dst, int64_t bytes) const override {
    std::memcpy(dst, p_ + slot * bb_, size_t(bytes));
    return Status::ok();
  }

 private:
  char* p_;
  int64_t bb_;
};

}  // namespace

Result<std::unique_ptr<TierStore>> make_device_store(int64_t slots, int64_t block_bytes) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, size_t(slots * block_bytes));
  if (e != cudaSuccess)
    return SF_ERR(kResourceExhausted, "block pool: device tier cudaMalloc of " +
                                          std::to_string(slots * block_bytes) +
                                          " bytes failed: " + cudaGetErrorString(e));
  return std::unique_ptr<TierStore>(new DeviceStore(p, block_bytes));
}

Result<std::unique_ptr<TierStore>> make_host_store(int64_t slots, int64_t block_bytes) {
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, size_t(slots * block_bytes), cudaHostAllocDefault);
  if (e != cudaSuccess)
    return SF_ERR(kResourceExhausted, "block pool: host tier cudaHostAlloc of " +
                                          std::to_string(slots * block_bytes) +
                                          " bytes failed: " + cudaGetErrorString(e));
  return std::unique_ptr<TierStore>(new PinnedHostStore(p, block_bytes));
}

}  // namespace sf::kvstore
