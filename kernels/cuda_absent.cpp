// kernels::cuda's host helpers (kernels/cuda/device.cpp) in a build without the CUDA backend:
// code that names them (the device runtime's buffers, the worker's device lookup) links on a
// CPU-only host, and any use reports kUnsupported at run time instead.
#if !SF_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"

namespace sf::kernels::cuda {

namespace {
Status absent() { return SF_ERR(kUnsupported, "built without CUDA (SF_CUDA=OFF or no nvcc)"); }
}  // namespace

Status device_count(int* n) {
  *n = 0;
  return absent();
}
Status stream_synchronize(void*) { return absent(); }
bool dependent_launch() { return false; }
void set_dependent_launch(bool) {}

DeviceBuffer::~DeviceBuffer() = default;
void DeviceBuffer::reset() {
  ptr_ = nullptr;
  bytes_ = 0;
}
Status DeviceBuffer::alloc(size_t bytes) { return bytes == 0 ? Status::ok() : absent(); }
Status DeviceBuffer::upload(const void*, size_t, size_t) { return absent(); }
Status DeviceBuffer::download(void*, size_t, size_t) const { return absent(); }

}  // namespace sf::kernels::cuda
#endif
