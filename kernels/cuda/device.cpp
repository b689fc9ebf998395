// Device queries, stream sync and DeviceBuffer: thin wrappers over the CUDA runtime that speak
// Status.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"

namespace sf::kernels::cuda {

Status device_count(int* n) {
  *n = 0;
  SF_CUDA_TRY(cudaGetDeviceCount(n));
  return Status::ok();
}

Status stream_synchronize(void* stream) {
  SF_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

namespace {
// -1: not read yet; 0 / 1 after.
std::atomic<int> g_dependent_launch{-1};
}  // namespace

bool dependent_launch() {
  int v = g_dependent_launch.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv("SF_PDL");
    v = e && std::strcmp(e, "0") == 0 ? 0 : 1;
    int expected = -1;  // a set_dependent_launch() that raced ahead wins
    if (!g_dependent_launch.compare_exchange_strong(expected, v, std::memory_order_relaxed))
      v = expected;
  }
  return v != 0;
}

void set_dependent_launch(bool on) {
  g_dependent_launch.store(on ? 1 : 0, std::memory_order_relaxed);
}

DeviceBuffer::~DeviceBuffer() { reset(); }

void DeviceBuffer::reset() {
  if (ptr_) (void)cudaFree(ptr_);  // a destructor cannot report; errors resurface on the next call
  ptr_ = nullptr;
  bytes_ = 0;
}

Status DeviceBuffer::alloc(size_t bytes) {
  reset();
  if (bytes == 0) return Status::ok();
  SF_CUDA_TRY(cudaMalloc(&ptr_, bytes));
  bytes_ = bytes;
  return Status::ok();
}

Status DeviceBuffer::upload(const void* src, size_t bytes, size_t offset) {
  SF_ENSURE(offset <= bytes_ && bytes <= bytes_ - offset, kOutOfRange,
            "DeviceBuffer::upload: " + std::to_string(bytes) + " bytes at offset " +
                std::to_string(offset) + " exceed the buffer's " + std::to_string(bytes_));
  SF_CUDA_TRY(cudaMemcpy(static_cast<char*>(ptr_) + offset, src, bytes, cudaMemcpyHostToDevice));
  // From pageable memory cudaMemcpy may return before the DMA lands; wait so that work on any
  // stream (non-blocking ones included) sees the data.
  SF_CUDA_TRY(cudaStreamSynchronize(nullptr));
  return Status::ok();
}

Status DeviceBuffer::download(void* dst, size_t bytes, size_t offset) const {
  SF_ENSURE(offset <= bytes_ && bytes <= bytes_ - offset, kOutOfRange,
            "DeviceBuffer::download: " + std::to_string(bytes) + " bytes at offset " +
                std::to_string(offset) + " exceed the buffer's " + std::to_string(bytes_));
  SF_CUDA_TRY(
      cudaMemcpy(dst, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost));
  return Status::ok();
}

}  // namespace sf::kernels::cuda
