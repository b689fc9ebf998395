// One-row linears on the device (kernels::gemv, gemv_parts, gemv_swiglu): y = w x (+ bias), x
// and y F32, w F32 or BF16. The decode step's linears are this shape: cuBLASLt's GEMM for one row
// needs x in w's dtype (a cast kernel before each BF16 linear) and reads the weights at about
// half the copy rate.
//
// Work split (measured against the split it replaced, a CTA of 4 warps per 4 rows on alternate
// strides, at c65827c: bench/NOTES.md, twenty-seventh session): a warp sums one output row over
// all of in, each lane on every 32nd 16-byte chunk (8 BF16 or 4 F32 weights) with kUnroll
// chunks' loads in flight, kept as loaded and widened when used, then a shuffle tree in a fixed
// order (the same result on every run); a CTA of kRowWarps warps takes that many consecutive
// rows of one part. x is read through L1 by every warp, so L2 sees it once per kRowWarps rows.
// Rows that are not 16-byte aligned (in or the row stride not a multiple of the load width, or
// misaligned pointers) take a scalar loop.
//   parts:  up to kGemvMaxParts weights of one x in one launch (the step's Q, K and V); the grid
//           is the parts' CTAs end to end, and each part takes the load path gemv() of it alone
//           would (parts whose paths differ go one launch each), so each output is that
//           gemv()'s, bit for bit. gemv() is one part.
//   swiglu: a warp sums the same row of the gate and the up weights in one pass over x and
//           writes silu(g) u with swiglu()'s expression: gemv() twice and swiglu(), bit for bit,
//           without the two intermediate vectors or the third launch, when both weights take one
//           load path (both 16-byte aligned or neither; the 16-byte path needs both).
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"

namespace sf::kernels::cuda {
namespace {

constexpr unsigned kAll = 0xffffffffu;

template <bool kBf16>
struct Elems;
template <>
struct Elems<true> {
  static constexpr int kPerLoad = 8;
  using Raw = uint4;  // a load as it arrives: 4 registers, widened when used
  __device__ static Raw raw(const void* w, int64_t idx) {
    return __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w) + idx));
  }
  __device__ static void unpack(const Raw& u, float* out) {
    const unsigned v[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(v[i] << 16);
      out[2 * i + 1] = __uint_as_float(v[i] & 0xffff0000u);
    }
  }
  __device__ static void load(const void* w, int64_t idx, float* out) { unpack(raw(w, idx), out); }
  __device__ static float one(const void* w, int64_t idx) {
    return __uint_as_float(unsigned(__ldg(static_cast<const uint16_t*>(w) + idx)) << 16);
  }
};
template <>
struct Elems<false> {
  static constexpr int kPerLoad = 4;
  using Raw = float4;
  __device__ static Raw raw(const void* w, int64_t idx) {
    return __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(w) + idx));
  }
  __device__ static void unpack(const Raw& f, float* out) {
    out[0] = f.x, out[1] = f.y, out[2] = f.z, out[3] = f.w;
  }
  __device__ static void load(const void* w, int64_t idx, float* out) { unpack(raw(w, idx), out); }
  __device__ static float one(const void* w, int64_t idx) {
    return __ldg(static_cast<const float*>(w) + idx);
  }
};

struct Part {
  const void* w;
  int64_t ldw;
  const float* bias;  // null: none
  float* y;
  int64_t out;
  int64_t cta0;  // the part's first CTA in the grid
};
struct PartsArgs {
  Part p[kGemvMaxParts];
  int n;
};

constexpr int kRowWarps = 8;  // rows (warps) per CTA
constexpr int kUnroll = 8;    // 16-byte loads in flight per lane (per weight)

// This lane's share of row `row` of w . x (kPair: also of w2), summed over the warp: every lane
// returns the row's sums.
template <bool kBf16, bool kVec, bool kPair>
__device__ __forceinline__ void row_dot(const float* __restrict__ x, const void* __restrict__ w,
                                        const void* __restrict__ w2, int64_t ldw, int64_t row,
                                        int64_t in, float* out, float* out2) {
  using E = Elems<kBf16>;
  constexpr int P = E::kPerLoad;
  const int lane = threadIdx.x & 31;
  float acc = 0.f, acc2 = 0.f;
  if constexpr (kVec) {
    const int64_t step = int64_t(32) * P;
    int64_t c = int64_t(lane) * P;
    // Whole groups of kUnroll chunks: every load issued before the first multiply-add.
    for (; c + (kUnroll - 1) * step < in; c += kUnroll * step) {
      typename E::Raw wr[kUnroll], wr2[kPair ? kUnroll : 1];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        wr[u] = E::raw(w, row * ldw + c + u * step);
        if constexpr (kPair) wr2[u] = E::raw(w2, row * ldw + c + u * step);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float xv[P], wv[P], wv2[P];
        E::unpack(wr[u], wv);
        if constexpr (kPair) E::unpack(wr2[u], wv2);
        const float4 xa = __ldg(reinterpret_cast<const float4*>(x + c + u * step));
        xv[0] = xa.x, xv[1] = xa.y, xv[2] = xa.z, xv[3] = xa.w;
        if constexpr (P == 8) {
          const float4 xb = __ldg(reinterpret_cast<const float4*>(x + c + u * step + 4));
          xv[4] = xb.x, xv[5] = xb.y, xv[6] = xb.z, xv[7] = xb.w;
        }
#pragma unroll
        for (int i = 0; i < P; ++i) {
          acc += wv[i] * xv[i];
          if constexpr (kPair) acc2 += wv2[i] * xv[i];
        }
      }
    }
    for (; c < in; c += step) {
      float wv[P], xv[P];
      E::load(w, row * ldw + c, wv);
      const float4 xa = __ldg(reinterpret_cast<const float4*>(x + c));
      xv[0] = xa.x, xv[1] = xa.y, xv[2] = xa.z, xv[3] = xa.w;
      if constexpr (P == 8) {
        const float4 xb = __ldg(reinterpret_cast<const float4*>(x + c + 4));
        xv[4] = xb.x, xv[5] = xb.y, xv[6] = xb.z, xv[7] = xb.w;
      }
#pragma unroll
      for (int i = 0; i < P; ++i) acc += wv[i] * xv[i];
      if constexpr (kPair) {
        E::load(w2, row * ldw + c, wv);
#pragma unroll
        for (int i = 0; i < P; ++i) acc2 += wv[i] * xv[i];
      }
    }
  } else {
    for (int64_t c = lane; c < in; c += 32) {
      const float xc = __ldg(x + c);
      acc += E::one(w, row * ldw + c) * xc;
      if constexpr (kPair) acc2 += E::one(w2, row * ldw + c) * xc;
    }
  }
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) {
    acc += __shfl_xor_sync(kAll, acc, o);
    if constexpr (kPair) acc2 += __shfl_xor_sync(kAll, acc2, o);
  }
  *out = acc;
  if constexpr (kPair) *out2 = acc2;
}

template <bool kBf16, bool kVec>
__global__ void __launch_bounds__(kRowWarps * 32)
    gemv_parts_kernel(const float* __restrict__ x, const PartsArgs a, int64_t in) {
  int pi = 0;
  while (pi + 1 < a.n && int64_t(blockIdx.x) >= a.p[pi + 1].cta0) ++pi;
  const Part& p = a.p[pi];
  const int64_t row = (int64_t(blockIdx.x) - p.cta0) * kRowWarps + (threadIdx.x >> 5);
  if (row >= p.out) return;
  float v = 0.f;
  row_dot<kBf16, kVec, false>(x, p.w, nullptr, p.ldw, row, in, &v, nullptr);
  if ((threadIdx.x & 31) == 0) p.y[row] = v + (p.bias ? p.bias[row] : 0.f);
}

template <bool kBf16, bool kVec>
__global__ void __launch_bounds__(kRowWarps * 32)
    gemv_swiglu_kernel(const float* __restrict__ x, const void* __restrict__ wg,
                       const void* __restrict__ wu, int64_t ldw, float* __restrict__ y, int64_t in,
                       int64_t out) {
  const int64_t row = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= out) return;
  float g = 0.f, u = 0.f;
  row_dot<kBf16, kVec, true>(x, wg, wu, ldw, row, in, &g, &u);
  if ((threadIdx.x & 31) == 0) y[row] = g / (1.f + expf(-g)) * u;  // swiglu()'s expression
}

// 16-byte loads need every row start and x aligned: in and every ldw multiples of the load
// width, and the pointers aligned.
bool vec_ok(const void* x, int64_t in, std::initializer_list<std::pair<const void*, int64_t>> ws,
            int per_load) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  bool ok = in % per_load == 0 && aligned(x);
  for (const auto& [w, ldw] : ws) ok = ok && ldw % per_load == 0 && aligned(w);
  return ok;
}

template <bool kBf16>
Status launch_parts(const TensorView& x, const GemvPart* parts, int n_parts, cudaStream_t st) {
  const int64_t in = x.shape[1];
  constexpr int P = Elems<kBf16>::kPerLoad;
  bool vec[kGemvMaxParts];
  for (int i = 0; i < n_parts; ++i)
    vec[i] = vec_ok(x.data, in, {{parts[i].w.data, parts[i].w.stride[0]}}, P);
  // One launch takes one load path; parts that would take different ones alone go one launch
  // each, so every output stays the one gemv() of its part gives (the step's never split).
  for (int i = 1; i < n_parts; ++i)
    if (vec[i] != vec[0]) {
      for (int j = 0; j < n_parts; ++j) SF_TRY(launch_parts<kBf16>(x, parts + j, 1, st));
      return Status::ok();
    }
  PartsArgs a{};
  a.n = n_parts;
  int64_t ctas = 0;
  for (int i = 0; i < a.n; ++i) {
    const GemvPart& g = parts[i];
    a.p[i] = Part{g.w.data, g.w.stride[0], g.bias.data ? g.bias.ptr<float>() : nullptr,
                  g.y.ptr<float>(), g.w.shape[0], ctas};
    ctas += (g.w.shape[0] + kRowWarps - 1) / kRowWarps;
  }
  if (ctas == 0) return Status::ok();
  if (ctas > 2147483647LL) return SF_ERR(kOutOfRange, "gemv: too many output rows for one grid");
  const unsigned grid = unsigned(ctas);
  if (vec[0])
    gemv_parts_kernel<kBf16, true><<<grid, kRowWarps * 32, 0, st>>>(x.ptr<float>(), a, in);
  else
    gemv_parts_kernel<kBf16, false><<<grid, kRowWarps * 32, 0, st>>>(x.ptr<float>(), a, in);
  SF_CUDA_TRY(cudaGetLastError());
  return Status::ok();
}

template <bool kBf16>
Status launch_swiglu(const TensorView& x, const TensorView& wg, const TensorView& wu, TensorView y,
                     cudaStream_t st) {
  const int64_t in = x.shape[1], out = wg.shape[0], ldw = wg.stride[0];
  if (out == 0) return Status::ok();
  const int64_t ctas = (out + kRowWarps - 1) / kRowWarps;
  if (ctas > 2147483647LL) return SF_ERR(kOutOfRange, "gemv_swiglu: too many output rows for one grid");
  // The pair shares one row stride (api.cpp checks it; the kernels index both weights by it).
  const bool vec = vec_ok(x.data, in, {{wg.data, ldw}, {wu.data, ldw}}, Elems<kBf16>::kPerLoad);
  const float* xp = x.ptr<float>();
  float* yp = y.ptr<float>();
  const unsigned grid = unsigned(ctas);
  if (vec)
    gemv_swiglu_kernel<kBf16, true><<<grid, kRowWarps * 32, 0, st>>>(xp, wg.data, wu.data, ldw,
                                                                     yp, in, out);
  else
    gemv_swiglu_kernel<kBf16, false><<<grid, kRowWarps * 32, 0, st>>>(xp, wg.data, wu.data, ldw,
                                                                      yp, in, out);
  SF_CUDA_TRY(cudaGetLastError());
  return Status::ok();
}

}  // namespace

Status gemv(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y,
            void* stream) {
  const GemvPart one{w, bias, y};
  return gemv_parts(x, &one, 1, stream);
}

Status gemv_parts(const TensorView& x, const GemvPart* parts, int n_parts, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  return parts[0].w.dtype == DType::kBF16 ? launch_parts<true>(x, parts, n_parts, st)
                                          : launch_parts<false>(x, parts, n_parts, st);
}

Status gemv_swiglu(const TensorView& x, const TensorView& w_gate, const TensorView& w_up,
                   TensorView y, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  return w_gate.dtype == DType::kBF16 ? launch_swiglu<true>(x, w_gate, w_up, y, st)
                                      : launch_swiglu<false>(x, w_gate, w_up, y, st);
}

}  // namespace sf::kernels::cuda
