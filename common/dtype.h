// Element types and scalar conversions shared by every backend.
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>

namespace sf {

enum class DType : uint8_t { kF32 = 0, kF16, kBF16, kI32, kI64, kU8 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF16: case DType::kBF16: return 2;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
  }
  return 0;
}
const char* dtype_name(DType t);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round-to-nearest-even; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
// f rounded to the nearest bf16 value (kept as f32).
inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// A score as every ranking compares it (top-k picks, retention, tier placement): NaN, which a
// forward that overflowed can leave, ranks last, as -inf. Compared raw, a NaN ties with every
// score, which breaks the strict weak order std::sort and std::partial_sort need (undefined
// behaviour: arbitrary picks).
inline float nan_last(float s) { return s != s ? -std::numeric_limits<float>::infinity() : s; }
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace sf
