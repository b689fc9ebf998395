// One-row linears on the device (kernels::gemv, gemv_parts, gemv_swiglu): y = w x (+ bias), x
// and y F32, w F32 or BF16. The decode step's linears are this shape: cuBLASLt's GEMM for one row
// needs x in w's dtype (a cast kernel before each BF16 linear) and reads the weights at about
// half the copy rate. A verification pass runs a few rows (up to 256): a warp then takes up to
// kRowsPerWarp of them per weight row, each summed as the one-row kernel sums it.
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
#include "kernels/cuda/dependent_launch.cuh"

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

// This lane's share of row `row` of w . x (kPair: also of w2), summed over the warp, for x's
// rows 0..nr (R at most; ldx apart): every lane returns the sums. A weight load serves every x
// row, and each row's sum is taken in the one-row order, so row r's result is that of R = 1 on
// it alone, bit for bit. Rows past nr read row 0 and are not returned.
template <bool kBf16, bool kVec, bool kPair, int R>
__device__ __forceinline__ void row_dot(const float* __restrict__ x, int64_t ldx, int nr,
                                        const void* __restrict__ w, const void* __restrict__ w2,
                                        int64_t ldw, int64_t row, int64_t in, float* out,
                                        float* out2) {
  using E = Elems<kBf16>;
  constexpr int P = E::kPerLoad;
  const int lane = threadIdx.x & 31;
  const float* xr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) xr[r] = x + (r < nr ? r : 0) * ldx;
  float acc[R], acc2[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f, acc2[r] = 0.f;
  // x's P values at column c of row r, as loaded.
  auto xload = [&](int r, int64_t c, float* xv) {
    const float4 xa = __ldg(reinterpret_cast<const float4*>(xr[r] + c));
    xv[0] = xa.x, xv[1] = xa.y, xv[2] = xa.z, xv[3] = xa.w;
    if constexpr (P == 8) {
      const float4 xb = __ldg(reinterpret_cast<const float4*>(xr[r] + c + 4));
      xv[4] = xb.x, xv[5] = xb.y, xv[6] = xb.z, xv[7] = xb.w;
    }
  };
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
        float wv[P], wv2[P];
        E::unpack(wr[u], wv);
        if constexpr (kPair) E::unpack(wr2[u], wv2);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float xv[P];
          xload(r, c + u * step, xv);
#pragma unroll
          for (int i = 0; i < P; ++i) {
            acc[r] += wv[i] * xv[i];
            if constexpr (kPair) acc2[r] += wv2[i] * xv[i];
          }
        }
      }
    }
    for (; c < in; c += step) {
      float wv[P], wv2[P];
      E::load(w, row * ldw + c, wv);
      if constexpr (kPair) E::load(w2, row * ldw + c, wv2);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float xv[P];
        xload(r, c, xv);
#pragma unroll
        for (int i = 0; i < P; ++i) acc[r] += wv[i] * xv[i];
        if constexpr (kPair) {
#pragma unroll
          for (int i = 0; i < P; ++i) acc2[r] += wv2[i] * xv[i];
        }
      }
    }
  } else {
    for (int64_t c = lane; c < in; c += 32) {
      const float wc = E::one(w, row * ldw + c);
      const float wc2 = kPair ? E::one(w2, row * ldw + c) : 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float xc = __ldg(xr[r] + c);
        acc[r] += wc * xc;
        if constexpr (kPair) acc2[r] += wc2 * xc;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) {
      acc[r] += __shfl_xor_sync(kAll, acc[r], o);
      if constexpr (kPair) acc2[r] += __shfl_xor_sync(kAll, acc2[r], o);
    }
    out[r] = acc[r];
    if constexpr (kPair) out2[r] = acc2[r];
  }
}

// x rows per warp with several: a weight row is read once for that many (a pass's 2-256 rows
// read the weights n / 4 times instead of n).
constexpr int kRowsPerWarp = 4;

// A warp asks L2 for the head of its weight row before it waits for the kernel before it
// (launched as a dependent, dependent_launch.cuh): the weights are no earlier kernel's output,
// and a prefetch changes no value, so the first loads' DRAM latency hides under that kernel's
// tail. Only the head: whole rows from every resident warp (Llama-3-8B's gate and up, 28 KB a
// row, 64 warps an SM) would be more than L2 holds before the loads came. (Whole rows, 1 KB and
// none measured within noise of each other on the Llama-3-8B step: NOTES, thirty-fifth session.)
constexpr int64_t kPrefetchBytes = 1024;
template <bool kBf16>
__device__ __forceinline__ void prefetch_row(const void* w, int64_t ldw, int64_t row, int64_t in) {
  constexpr int64_t kElem = kBf16 ? 2 : 4, kLine = 128;
  const int64_t b = int64_t(threadIdx.x & 31) * kLine;
  const char* r = static_cast<const char*>(w) + row * ldw * kElem;
  if (b < in * kElem && b < kPrefetchBytes) asm volatile("prefetch.global.L2 [%0];" ::"l"(r + b));
}

// Grid: x = the parts' CTAs end to end, y = groups of R rows of x.
template <bool kBf16, bool kVec, int R>
__global__ void __launch_bounds__(kRowWarps * 32)
    gemv_parts_kernel(const float* __restrict__ x, const PartsArgs a, int64_t in, int64_t n) {
  int pi = 0;
  while (pi + 1 < a.n && int64_t(blockIdx.x) >= a.p[pi + 1].cta0) ++pi;
  const Part& p = a.p[pi];
  const int64_t row = (int64_t(blockIdx.x) - p.cta0) * kRowWarps + (threadIdx.x >> 5);
  if (row >= p.out) return;
  prefetch_row<kBf16>(p.w, p.ldw, row, in);
  grid_dep_enter();
  const int64_t r0 = int64_t(blockIdx.y) * R;
  const int nr = int(min(int64_t(R), n - r0));
  float v[R];
  row_dot<kBf16, kVec, false, R>(x + r0 * in, in, nr, p.w, nullptr, p.ldw, row, in, v, nullptr);
  if ((threadIdx.x & 31) == 0)
    for (int r = 0; r < nr; ++r) p.y[(r0 + r) * p.out + row] = v[r] + (p.bias ? p.bias[row] : 0.f);
}

template <bool kBf16, bool kVec, int R>
__global__ void __launch_bounds__(kRowWarps * 32)
    gemv_swiglu_kernel(const float* __restrict__ x, const void* __restrict__ wg,
                       const void* __restrict__ wu, int64_t ldw, float* __restrict__ y, int64_t in,
                       int64_t out, int64_t n) {
  const int64_t row = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= out) return;
  prefetch_row<kBf16>(wg, ldw, row, in);
  prefetch_row<kBf16>(wu, ldw, row, in);
  grid_dep_enter();
  const int64_t r0 = int64_t(blockIdx.y) * R;
  const int nr = int(min(int64_t(R), n - r0));
  float g[R], u[R];
  row_dot<kBf16, kVec, true, R>(x + r0 * in, in, nr, wg, wu, ldw, row, in, g, u);
  if ((threadIdx.x & 31) == 0)
    for (int r = 0; r < nr; ++r)
      y[(r0 + r) * out + row] = g[r] / (1.f + expf(-g[r])) * u[r];  // swiglu()'s expression
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
  const int64_t n = x.shape[0], groups = (n + kRowsPerWarp - 1) / kRowsPerWarp;
  if (groups > 65535) return SF_ERR(kOutOfRange, "gemv: too many x rows for one grid");
  const float* xp = x.ptr<float>();
  const dim3 grid(unsigned(ctas), n == 1 ? 1u : unsigned(groups));
  const auto go = [&](auto kernel) {
    return launch_dependent(kernel, grid, kRowWarps * 32, 0, st, xp, a, in, n);
  };
  if (n == 1 && vec[0])
    SF_CUDA_TRY(go(gemv_parts_kernel<kBf16, true, 1>));
  else if (n == 1)
    SF_CUDA_TRY(go(gemv_parts_kernel<kBf16, false, 1>));
  else if (vec[0])
    SF_CUDA_TRY(go(gemv_parts_kernel<kBf16, true, kRowsPerWarp>));
  else
    SF_CUDA_TRY(go(gemv_parts_kernel<kBf16, false, kRowsPerWarp>));
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
  const int64_t n = x.shape[0], groups = (n + kRowsPerWarp - 1) / kRowsPerWarp;
  if (groups > 65535) return SF_ERR(kOutOfRange, "gemv_swiglu: too many x rows for one grid");
  const dim3 grid(unsigned(ctas), n == 1 ? 1u : unsigned(groups));
  const void *g = wg.data, *u = wu.data;
  constexpr int T = kRowWarps * 32, R = kRowsPerWarp;
  const auto go = [&](auto kernel) {
    return launch_dependent(kernel, grid, T, 0, st, xp, g, u, ldw, yp, in, out, n);
  };
  if (n == 1 && vec)
    SF_CUDA_TRY(go(gemv_swiglu_kernel<kBf16, true, 1>));
  else if (n == 1)
    SF_CUDA_TRY(go(gemv_swiglu_kernel<kBf16, false, 1>));
  else if (vec)
    SF_CUDA_TRY(go(gemv_swiglu_kernel<kBf16, true, R>));
  else
    SF_CUDA_TRY(go(gemv_swiglu_kernel<kBf16, false, R>));
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
