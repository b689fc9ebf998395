// cast(): the CPU reference of the dtype conversions (F32 <-> F16/BF16), the same scalar
// conversions the loaders use, so the CUDA kernel is checked against them bit for bit.
#include <cstring>

#include "common/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace sf::kernels::cpu {

Status cast(const TensorView& x, TensorView out) {
  const size_t n = size_t(x.numel());
  if (x.dtype == out.dtype) {
    std::memmove(out.data, x.data, n * dtype_size(x.dtype));
    return Status::ok();
  }
  const DType from = x.dtype, to = out.dtype;
  parallel_for(
      n,
      [&](size_t b, size_t e) {
        if (from == DType::kF32) {
          const float* s = x.ptr<float>();
          uint16_t* d = out.ptr<uint16_t>();
          if (to == DType::kBF16) {
            for (size_t i = b; i < e; ++i) d[i] = f32_to_bf16(s[i]);
          } else {
            for (size_t i = b; i < e; ++i) d[i] = f32_to_f16(s[i]);
          }
        } else {
          const uint16_t* s = x.ptr<uint16_t>();
          float* d = out.ptr<float>();
          if (from == DType::kBF16) {
            for (size_t i = b; i < e; ++i) d[i] = bf16_to_f32(s[i]);
          } else {
            for (size_t i = b; i < e; ++i) d[i] = f16_to_f32(s[i]);
          }
        }
      },
      1 << 16);
  return Status::ok();
}

}  // namespace sf::kernels::cpu
