// Non-owning tensor views. Row-major; strides in elements. Kernels take views plus a Stream and
// never own memory; owners live in the callers (model weights, workspaces, kvstore blocks).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace sf {

enum class Device : uint8_t { kCpu = 0, kCuda };

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device = Device::kCpu;
  int ndim = 0;
  std::array<int64_t, 4> shape{};
  std::array<int64_t, 4> stride{};  // elements

  static TensorView make(void* p, DType t, std::initializer_list<int64_t> dims, Device dev = Device::kCpu) {
    TensorView v;
    v.data = p; v.dtype = t; v.device = dev; v.ndim = int(dims.size());
    int i = 0;
    for (int64_t d : dims) v.shape[i++] = d;
    int64_t s = 1;
    for (int k = v.ndim - 1; k >= 0; --k) { v.stride[k] = s; s *= v.shape[k]; }
    return v;
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  bool contiguous() const {
    int64_t s = 1;
    for (int k = ndim - 1; k >= 0; --k) {
      if (stride[k] != s) return false;
      s *= shape[k];
    }
    return true;
  }
  template <typename T> T* ptr() const { return static_cast<T*>(data); }
  std::string shape_str() const;
};

}  // namespace sf
