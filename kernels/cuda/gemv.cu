// One-row linear on the device (kernels::gemv): y = w x (+ bias), x and y F32, w F32 or BF16.
// The decode step's linears are this shape: cuBLASLt's GEMM for one row needs x in w's dtype (a
// cast kernel before each BF16 linear) and reads the weights at about half the copy rate.
//
// Work split: a warp takes kRows consecutive output rows; each lane reads 16 bytes of each row
// (8 BF16 or 4 F32 weights) and the matching x elements once for all kRows rows, for every
// 32-lane stride of the row; the lanes' partial sums are then reduced by shuffles. Rows that are
// not 16-byte aligned (in not a multiple of 8 BF16 / 4 F32 elements) take a scalar loop.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"

namespace sf::kernels::cuda {
namespace {

constexpr int kRows = 4;           // output rows per warp
constexpr int kWarps = 8;          // warps per CTA
constexpr unsigned kAll = 0xffffffffu;

template <bool kBf16>
struct Elems;
template <>
struct Elems<true> {
  static constexpr int kPerLoad = 8;
  __device__ static void load(const void* w, int64_t idx, float* out) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w) + idx));
    const unsigned v[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(v[i] << 16);
      out[2 * i + 1] = __uint_as_float(v[i] & 0xffff0000u);
    }
  }
  __device__ static float one(const void* w, int64_t idx) {
    return __uint_as_float(unsigned(__ldg(static_cast<const uint16_t*>(w) + idx)) << 16);
  }
};
template <>
struct Elems<false> {
  static constexpr int kPerLoad = 4;
  __device__ static void load(const void* w, int64_t idx, float* out) {
    const float4 f = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(w) + idx));
    out[0] = f.x, out[1] = f.y, out[2] = f.z, out[3] = f.w;
  }
  __device__ static float one(const void* w, int64_t idx) {
    return __ldg(static_cast<const float*>(w) + idx);
  }
};

template <bool kBf16, bool kVec>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_kernel(const float* __restrict__ x, const void* __restrict__ w, int64_t ldw,
                const float* __restrict__ bias, float* __restrict__ y, int64_t in, int64_t out) {
  using E = Elems<kBf16>;
  constexpr int P = E::kPerLoad;
  const int lane = threadIdx.x & 31;
  const int64_t row0 = (int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kRows;
  if (row0 >= out) return;
  float acc[kRows] = {};
  if constexpr (kVec) {
#pragma unroll 2
    for (int64_t c = int64_t(lane) * P; c < in; c += 32 * P) {
      const float4 xa = __ldg(reinterpret_cast<const float4*>(x + c));
      float xv[P];
      xv[0] = xa.x, xv[1] = xa.y, xv[2] = xa.z, xv[3] = xa.w;
      if constexpr (P == 8) {
        const float4 xb = __ldg(reinterpret_cast<const float4*>(x + c + 4));
        xv[4] = xb.x, xv[5] = xb.y, xv[6] = xb.z, xv[7] = xb.w;
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (row0 + r >= out) break;
        float wv[P];
        E::load(w, (row0 + r) * ldw + c, wv);
#pragma unroll
        for (int i = 0; i < P; ++i) acc[r] += wv[i] * xv[i];
      }
    }
  } else {
    for (int64_t c = lane; c < in; c += 32) {
      const float xc = __ldg(x + c);
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (row0 + r < out) acc[r] += E::one(w, (row0 + r) * ldw + c) * xc;
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) acc[r] += __shfl_xor_sync(kAll, acc[r], o);
  if (lane < kRows && row0 + lane < out) {
    float v = acc[0];
#pragma unroll
    for (int r = 1; r < kRows; ++r)
      if (lane == r) v = acc[r];
    y[row0 + lane] = v + (bias ? bias[row0 + lane] : 0.f);
  }
}

template <bool kBf16>
Status launch(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y,
              cudaStream_t st) {
  const int64_t in = x.shape[1], out = w.shape[0], ldw = w.stride[0];
  constexpr int P = Elems<kBf16>::kPerLoad;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  // 16-byte loads need every row start and x aligned: in and ldw multiples of the load width.
  const bool vec = in % P == 0 && ldw % P == 0 && aligned(w.data) && aligned(x.data);
  const int64_t per_cta = int64_t(kWarps) * kRows;
  const unsigned grid = unsigned((out + per_cta - 1) / per_cta);
  const float* b = bias.data ? bias.ptr<float>() : nullptr;
  if (vec)
    gemv_kernel<kBf16, true><<<grid, kWarps * 32, 0, st>>>(x.ptr<float>(), w.data, ldw, b,
                                                           y.ptr<float>(), in, out);
  else
    gemv_kernel<kBf16, false><<<grid, kWarps * 32, 0, st>>>(x.ptr<float>(), w.data, ldw, b,
                                                            y.ptr<float>(), in, out);
  SF_CUDA_TRY(cudaGetLastError());
  return Status::ok();
}

}  // namespace

Status gemv(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y,
            void* stream) {
  if (w.shape[0] == 0) return Status::ok();
  if (int64_t(w.shape[0]) > int64_t(kWarps) * kRows * 2147483647LL)
    return SF_ERR(kOutOfRange, "gemv: too many output rows for one grid");
  const auto st = static_cast<cudaStream_t>(stream);
  return w.dtype == DType::kBF16 ? launch<true>(x, w, bias, y, st)
                                 : launch<false>(x, w, bias, y, st);
}

}  // namespace sf::kernels::cuda
