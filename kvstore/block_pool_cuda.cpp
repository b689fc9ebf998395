// CUDA stores of the block pool: the device tier (one cudaMalloc arena) and the pinned host tier
// (one cudaHostAlloc arena, so device<->host moves run at DMA speed). Built only with SF_KV_CUDA.
// The device tier owns a non-blocking copy stream: BlockPool::move_batch queues a batch of
// copies on it and waits once.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "kvstore/block_pool.h"

namespace sf::kvstore {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  return SF_ERR(kIo, std::string("block pool: ") + what + ": " + cudaGetErrorString(e));
}

class DeviceStore final : public TierStore {
 public:
  DeviceStore(void* p, int64_t bb, cudaStream_t s, int device)
      : p_(static_cast<char*>(p)), bb_(bb), s_(s), device_(device) {}
  ~DeviceStore() override {
    (void)cudaStreamSynchronize(s_);
    (void)cudaStreamDestroy(s_);
    (void)cudaFree(p_);
    if (stage_) (void)cudaFreeHost(stage_);
    for (cudaEvent_t e : done_)
      if (e) (void)cudaEventDestroy(e);
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
  char* device_ptr(int64_t slot) const override { return p_ + slot * bb_; }

  // From pageable host rows, a copy a block would wait for the driver's staging each time (a
  // prefix cache insert of 512 blocks took 61 ms). Here the blocks are packed on the thread pool
  // into one of two pinned chunks while the other's copies run, consecutive slots as one copy.
  // A few blocks (a single write()), or no pinned memory to be had, take the plain path: staged
  // one block at a time through `scratch`.
  Status write_blocks(std::span<const int64_t> slots, std::span<const float* const> k,
                      std::span<const float* const> v, int64_t half_bytes,
                      std::vector<float>* scratch) override {
    const int64_t per = std::max<int64_t>(1, kStageBytes / bb_);  // blocks a chunk
    if (slots.size() < kBatchMin || !batch_ready(per))
      return TierStore::write_blocks(slots, k, v, half_bytes, scratch);
    const Status st = [&]() -> Status {
      const size_t half = size_t(half_bytes);
      for (size_t c0 = 0, n = 0; c0 < slots.size(); c0 += size_t(per), ++n) {
        const size_t c1 = std::min(slots.size(), c0 + size_t(per));
        char* const buf = static_cast<char*>(stage_) + (n % 2) * size_t(per * bb_);
        // The chunk's buffer is free once the copies queued from it two chunks ago landed.
        SF_TRY(cuda_status(cudaEventSynchronize(done_[n % 2]), "device tier copy from host"));
        parallel_for(
            c1 - c0,
            [&](size_t b, size_t e) {
              for (size_t j = b; j < e; ++j) {
                std::memcpy(buf + j * size_t(bb_), k[c0 + j], half);
                std::memcpy(buf + j * size_t(bb_) + half, v[c0 + j], half);
              }
            },
            4);
        for (size_t j = c0; j < c1;) {
          size_t r = 1;
          while (j + r < c1 && slots[j + r] == slots[j] + int64_t(r)) ++r;
          SF_TRY(cuda_status(cudaMemcpyAsync(p_ + slots[j] * bb_, buf + (j - c0) * size_t(bb_),
                                             r * size_t(bb_), cudaMemcpyHostToDevice, s_),
                             "device tier copy from host"));
          j += r;
        }
        SF_TRY(cuda_status(cudaEventRecord(done_[n % 2], s_), "event"));
      }
      return Status::ok();
    }();
    const Status done = sync();  // also when queueing failed: nothing stays in flight
    return st.is_ok() ? done : st;
  }

 private:
  static constexpr int64_t kStageBytes = int64_t(32) << 20;
  static constexpr size_t kBatchMin = 8;
  // The pinned chunks and their events, made at the first large batch on this store's device;
  // false (the error cleared) when either cannot be had.
  bool batch_ready(int64_t per) {
    if (stage_) return true;
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(device_) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    bool ok = true;
    for (cudaEvent_t& e : done_)
      if (ok && !e) ok = cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess;
    if (ok) ok = cudaHostAlloc(&stage_, size_t(2 * per * bb_), cudaHostAllocDefault) == cudaSuccess;
    if (!ok) {
      (void)cudaGetLastError();
      stage_ = nullptr;
    }
    (void)cudaSetDevice(prev);
    return ok;
  }
  char* p_;
  int64_t bb_;
  cudaStream_t s_;
  int device_ = 0;
  void* stage_ = nullptr;  // 2 chunks of pinned memory, allocated at the first write_blocks
  cudaEvent_t done_[2] = {nullptr, nullptr};
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

Result<std::vector<char*>> BlockPool::device_copy_targets(std::span<const BlockId> ids,
                                                           int64_t n_rows, bool writing,
                                                           const char* what) const {
  SF_ENSURE(n_rows > 0 && int64_t(ids.size()) == (n_rows + kPoolBlockTokens - 1) / kPoolBlockTokens,
            kInvalidArgument,
            "block pool: " + std::to_string(ids.size()) + " blocks for " +
                std::to_string(n_rows) + " rows");
  std::vector<char*> at(ids.size());
  for (size_t b = 0; b < ids.size(); ++b) {
    SF_TRY(check_id(ids[b]));
    const Entry& e = entries_[size_t(ids[b])];
    if (writing && e.pins > 0)
      return SF_ERR(kInvalidArgument, "block pool: block " + std::to_string(ids[b]) + " is pinned");
    const TierStore& ts = *store_[size_t(e.tier)];
    at[b] = e.tier == int(Tier::kDevice) ? ts.device_ptr(e.slot) : ts.host_ptr(e.slot);
    if (!at[b] || e.tier == int(Tier::kDisk))
      return SF_ERR(kInvalidArgument, "block pool: block " + std::to_string(ids[b]) + " is on the " +
                                          tier_name(Tier(e.tier)) + " tier; " + what +
                                          " need the device or host tier");
  }
  return at;
}

Status BlockPool::wait_stream(void* stream) {
  return cuda_status(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "wait for a stream");
}

Status BlockPool::write_from_device_async(std::span<const BlockId> ids, const float* k,
                                         const float* v, int64_t n_rows, void* stream) {
  std::lock_guard<std::mutex> g(mu_);
  SF_ENSURE(k && v, kInvalidArgument, "block pool: write_from_device_async with null k or v");
  // Everything is checked before the first copy is queued.
  SF_ASSIGN(const std::vector<char*> dst,
            device_copy_targets(ids, n_rows, /*writing=*/true, "writes from device memory"));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const size_t half = size_t(block_bytes_ / 2);
  const int64_t full = n_rows / kPoolBlockTokens;  // blocks with all 64 rows
  const auto queue = [&]() -> Status {
    // Runs of full blocks whose slots follow each other in one tier: the source rows of a run
    // are contiguous, its destinations one block apart, so K (and V) go as one 2-D copy a run.
    for (int64_t b = 0; b < full;) {
      int64_t r = 1;
      while (b + r < full && dst[size_t(b + r)] == dst[size_t(b)] + r * block_bytes_) ++r;
      const size_t off = size_t(b) * half / sizeof(float);
      SF_TRY(cuda_status(cudaMemcpy2DAsync(dst[size_t(b)], size_t(block_bytes_), k + off, half,
                                           half, size_t(r), cudaMemcpyDefault, s),
                         "write from device (K)"));
      SF_TRY(cuda_status(cudaMemcpy2DAsync(dst[size_t(b)] + half, size_t(block_bytes_), v + off,
                                           half, half, size_t(r), cudaMemcpyDefault, s),
                         "write from device (V)"));
      b += r;
    }
    if (full == int64_t(ids.size())) return Status::ok();
    const int64_t b = full;
    const size_t have = size_t(n_rows - b * kPoolBlockTokens) * half / kPoolBlockTokens;
    const size_t off = size_t(b) * half / sizeof(float);
    const bool on_device = entries_[size_t(ids[size_t(b)])].tier == int(Tier::kDevice);
    for (int kv = 0; kv < 2; ++kv) {
      char* h = dst[size_t(b)] + size_t(kv) * half;
      // A fresh block is touched by no queued copy yet, so a host slot can be zeroed at once.
      if (on_device)
        SF_TRY(cuda_status(cudaMemsetAsync(h + have, 0, half - have, s), "zero a partial block"));
      else
        std::memset(h + have, 0, half - have);
      SF_TRY(cuda_status(cudaMemcpyAsync(h, (kv == 0 ? k : v) + off, have, cudaMemcpyDefault, s),
                         "write from device (last block)"));
    }
    return Status::ok();
  };
  const Status st = queue();
  // A copy that failed to queue may follow others that did: they land before the caller frees
  // the blocks, so an error leaves nothing in flight.
  if (!st.is_ok()) (void)cudaStreamSynchronize(s);
  return st;
}

Status BlockPool::read_to_device_async(std::span<const BlockId> ids, float* k, float* v,
                                       int64_t n_rows, void* stream) const {
  std::lock_guard<std::mutex> g(mu_);
  SF_ENSURE(k && v, kInvalidArgument, "block pool: read_to_device_async with null k or v");
  SF_ASSIGN(const std::vector<char*> src,
            device_copy_targets(ids, n_rows, /*writing=*/false, "reads into device memory"));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const size_t half = size_t(block_bytes_ / 2);
  const auto queue = [&]() -> Status {
    // Runs of blocks whose slots follow each other in one tier: one 2-D copy for K, one for V.
    for (int64_t b = 0; b < int64_t(ids.size());) {
      const int64_t r0 = b * kPoolBlockTokens;
      const bool partial = n_rows - r0 < kPoolBlockTokens;
      int64_t r = 1;
      while (!partial && b + r < int64_t(ids.size()) &&
             n_rows - (b + r) * kPoolBlockTokens >= kPoolBlockTokens &&
             src[size_t(b + r)] == src[size_t(b)] + r * block_bytes_)
        ++r;
      const size_t off = size_t(b) * half / sizeof(float);
      const size_t width = partial ? size_t(n_rows - r0) * half / kPoolBlockTokens : half;
      SF_TRY(cuda_status(cudaMemcpy2DAsync(k + off, half, src[size_t(b)], size_t(block_bytes_),
                                           width, size_t(r), cudaMemcpyDefault, s),
                         "read into device (K)"));
      SF_TRY(cuda_status(cudaMemcpy2DAsync(v + off, half, src[size_t(b)] + half,
                                           size_t(block_bytes_), width, size_t(r),
                                           cudaMemcpyDefault, s),
                         "read into device (V)"));
      b += r;
    }
    return Status::ok();
  };
  const Status st = queue();
  if (!st.is_ok()) (void)cudaStreamSynchronize(s);
  return st;
}

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
  int device = 0;
  (void)cudaGetDevice(&device);  // the arena's (current at creation)
  return std::unique_ptr<TierStore>(new DeviceStore(p, block_bytes, s, device));
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
