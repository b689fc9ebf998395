// One-row linear on the device (kernels::gemv): y = w x (+ bias), x and y F32, w F32 or BF16.
// The decode step's linears are this shape: cuBLASLt's GEMM for one row needs x in w's dtype (a
// cast kernel before each BF16 linear) and reads the weights at about half the copy rate.
//
// Work split: a CTA of kWarps warps takes kRows consecutive output rows; each lane reads 16
// bytes of each row (8 BF16 or 4 F32 weights) and the matching x elements once for all kRows
// rows, the warps taking alternate 32-lane strides of the rows; lanes reduce by shuffles, warps
// through shared memory in a fixed order. Rows that are not 16-byte aligned (in not a multiple
// of 8 BF16 / 4 F32 elements) take a scalar loop.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"

namespace sf::kernels::cuda {
namespace {

constexpr int kRows = 4;   // output rows per CTA
constexpr int kWarps = 4;  // warps per CTA, each summing every kWarps-th 32-lane stride of the rows
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
  __shared__ float part[kWarps][kRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  const int rows = int(min(int64_t(kRows), out - row0));
  float acc[kRows] = {};
  if constexpr (kVec) {
#pragma unroll 4
    for (int64_t c = (int64_t(warp) * 32 + lane) * P; c < in; c += int64_t(kWarps) * 32 * P) {
      const float4 xa = __ldg(reinterpret_cast<const float4*>(x + c));
      float xv[P];
      xv[0] = xa.x, xv[1] = xa.y, xv[2] = xa.z, xv[3] = xa.w;
      if constexpr (P == 8) {
        const float4 xb = __ldg(reinterpret_cast<const float4*>(x + c + 4));
        xv[4] = xb.x, xv[5] = xb.y, xv[6] = xb.z, xv[7] = xb.w;
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r >= rows) break;
        float wv[P];
        E::load(w, (row0 + r) * ldw + c, wv);
#pragma unroll
        for (int i = 0; i < P; ++i) acc[r] += wv[i] * xv[i];
      }
    }
  } else {
    for (int64_t c = int64_t(warp) * 32 + lane; c < in; c += int64_t(kWarps) * 32) {
      const float xc = __ldg(x + c);
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (r < rows) acc[r] += E::one(w, (row0 + r) * ldw + c) * xc;
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) acc[r] += __shfl_xor_sync(kAll, acc[r], o);
    if (lane == 0) part[warp][r] = acc[r];
  }
  __syncthreads();
  // The warps' sums in warp order: the same result on every run (no atomics).
  if (threadIdx.x < rows) {
    float v = 0.f;
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) v += part[wi][threadIdx.x];
    y[row0 + threadIdx.x] = v + (bias ? bias[row0 + threadIdx.x] : 0.f);
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
  const unsigned grid = unsigned((out + kRows - 1) / kRows);
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
  if (int64_t(w.shape[0]) > int64_t(kRows) * 2147483647LL)
    return SF_ERR(kOutOfRange, "gemv: too many output rows for one grid");
  const auto st = static_cast<cudaStream_t>(stream);
  return w.dtype == DType::kBF16 ? launch<true>(x, w, bias, y, st)
                                 : launch<false>(x, w, bias, y, st);
}

}  // namespace sf::kernels::cuda
