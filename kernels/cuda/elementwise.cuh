// Row-wise and elementwise kernels: embedding gather, RMSNorm, RoPE, SwiGLU, add. Header-only
// device code on raw pointers and params structs; each launcher enqueues on `stream` and returns
// cudaError_t without synchronizing. Non-template kernels are static: this header may be included
// by several .cu files. All are memory-bound: one block per row where a row needs a
// reduction or shared per-token values, grid-stride loops otherwise.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/hash.h"
#include "kernels/cuda/dependent_launch.cuh"
#include "kernels/cuda/reduce.cuh"

namespace sf::kernels::cuda {

constexpr int kRowThreads = 256;
constexpr int kFlatThreads = 256;
constexpr int64_t kMaxFlatBlocks = int64_t(1) << 16;  // grid-stride beyond this
// RoPE cos/sin table per token lives in shared memory and the inverse frequencies in the kernel
// parameters (passed by value, so capture-safe and no upload): 256 pairs covers head_dim 512.
constexpr int kRopeMaxPairs = 256;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline unsigned flat_blocks(int64_t n) {
  const int64_t b = ceil_div(n, kFlatThreads);
  return unsigned(b < kMaxFlatBlocks ? b : kMaxFlatBlocks);
}

__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ float load_float(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// ---- embedding -------------------------------------------------------------------------------

template <typename T>
struct EmbeddingParams {
  const T* table;      // [vocab, hidden]
  const int32_t* ids;  // [n], device
  float* out;          // [n, hidden]
  int64_t vocab, hidden;
};

template <typename T>
__device__ __forceinline__ void embedding_row(const EmbeddingParams<T>& p, int64_t i) {
  const int32_t id = p.ids[i];
  float* o = p.out + i * p.hidden;
  if (id < 0 || id >= p.vocab) {  // contract violation: poison the row (see cuda_ops.h)
    for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x) o[j] = __int_as_float(0x7fc00000);
    return;
  }
  const T* r = p.table + int64_t(id) * p.hidden;
  for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x) o[j] = load_float(r + j);
}

template <typename T>
__global__ void embedding_kernel(const EmbeddingParams<T> p) {
  grid_dep_enter();
  embedding_row(p, blockIdx.x);
}

template <typename T>
cudaError_t embedding_launch(const EmbeddingParams<T>& p, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return launch_dependent(embedding_kernel<T>, unsigned(n), kRowThreads, 0, stream, p);
}

// ---- RMSNorm ---------------------------------------------------------------------------------

struct RmsNormParams {
  const float* x;  // [rows, hidden]
  const float* w;  // [hidden]
  float* out;      // [rows, hidden]; may alias x (each element is read before its own write)
  int64_t hidden;
  float eps;
};

__device__ __forceinline__ void rms_norm_row(const RmsNormParams& p, int64_t row) {
  const float* x = p.x + row * p.hidden;
  float* o = p.out + row * p.hidden;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x) ss += x[j] * x[j];
  ss = block_sum(ss);
  const float inv = 1.f / sqrtf(ss / float(p.hidden) + p.eps);
  for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x) o[j] = x[j] * inv * p.w[j];
}

static __global__ void rms_norm_kernel(const RmsNormParams p) {
  grid_dep_enter();
  rms_norm_row(p, blockIdx.x);
}

inline cudaError_t rms_norm_launch(const RmsNormParams& p, int64_t rows, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return launch_dependent(rms_norm_kernel, unsigned(rows), kRowThreads, 0, stream, p);
}

// add_inplace() then rms_norm() on one row per CTA: the add is elementwise (add_kernel's result
// whatever thread does it), and each thread then squares and normalizes the same elements in the
// same order as rms_norm_row's threads, so the results are theirs bit for bit (the decode step
// uses either and tests hold them equal).
struct AddRmsNormParams {
  float* x;            // [rows, hidden], updated to x + delta
  const float* delta;  // [rows, hidden] or null (no add)
  const float* w;      // [hidden]
  float* out;          // [rows, hidden]; may alias x
  int64_t hidden;
  float eps;
};

static __global__ void add_rms_norm_kernel(const AddRmsNormParams p) {
  grid_dep_enter();
  float* x = p.x + int64_t(blockIdx.x) * p.hidden;
  const float* d = p.delta ? p.delta + int64_t(blockIdx.x) * p.hidden : nullptr;
  float* o = p.out + int64_t(blockIdx.x) * p.hidden;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x) {
    if (d) x[j] += d[j];
    ss += x[j] * x[j];
  }
  ss = block_sum(ss);
  const float inv = 1.f / sqrtf(ss / float(p.hidden) + p.eps);
  for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x) o[j] = x[j] * inv * p.w[j];
}

inline cudaError_t add_rms_norm_launch(const AddRmsNormParams& p, int64_t rows,
                                       cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return launch_dependent(add_rms_norm_kernel, unsigned(rows), kRowThreads, 0, stream, p);
}

// ---- RoPE ------------------------------------------------------------------------------------

struct RopeKernelParams {
  float* x;                   // [n, heads, head_dim], rotated in place
  const int32_t* positions;   // [n], device
  int heads, head_dim, half;  // half = rot_dim / 2 pairs rotated per head
  bool neox;                  // pairs (i, i + half) instead of (2i, 2i + 1)
  float inv_freq[kRopeMaxPairs];
};

// One block per token: the angles are shared by all heads. They are formed and reduced in double
// because position * inv_freq reaches 1e5+ radians, where an fp32 angle is off by ~1e-2.
__device__ __forceinline__ void rope_token(const RopeKernelParams& p, int64_t t) {
  __shared__ float cs[kRopeMaxPairs], sn[kRopeMaxPairs];
  const double pos = double(p.positions[t]);
  for (int i = threadIdx.x; i < p.half; i += blockDim.x) {
    double s, c;
    sincos(pos * double(p.inv_freq[i]), &s, &c);
    cs[i] = float(c);
    sn[i] = float(s);
  }
  __syncthreads();
  float* xt = p.x + t * p.heads * p.head_dim;
  for (int e = threadIdx.x; e < p.heads * p.half; e += blockDim.x) {
    const int h = e / p.half, i = e % p.half;
    float* r = xt + int64_t(h) * p.head_dim;
    const int i0 = p.neox ? i : 2 * i;
    const int i1 = p.neox ? i + p.half : 2 * i + 1;
    const float x0 = r[i0], x1 = r[i1];
    r[i0] = x0 * cs[i] - x1 * sn[i];
    r[i1] = x0 * sn[i] + x1 * cs[i];
  }
}

static __global__ void rope_kernel(const RopeKernelParams p) {
  grid_dep_enter();
  rope_token(p, blockIdx.x);
}

inline cudaError_t rope_launch(const RopeKernelParams& p, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return launch_dependent(rope_kernel, unsigned(n), kRowThreads, 0, stream, p);
}

// ---- SwiGLU and add --------------------------------------------------------------------------

struct SwigluParams {
  const float* gate;
  const float* up;
  float* out;  // may alias gate
  int64_t n;
};

static __global__ void swiglu_kernel(const SwigluParams p) {
  grid_dep_enter();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = p.gate[i];
    p.out[i] = g / (1.f + expf(-g)) * p.up[i];
  }
}

inline cudaError_t swiglu_launch(const SwigluParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  return launch_dependent(swiglu_kernel, flat_blocks(p.n), kFlatThreads, 0, stream, p);
}

struct AddParams {
  float* out;
  const float* x;
  int64_t n;
};

static __global__ void add_kernel(const AddParams p) {
  grid_dep_enter();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += int64_t(gridDim.x) * blockDim.x)
    p.out[i] += p.x[i];
}

inline cudaError_t add_launch(const AddParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  return launch_dependent(add_kernel, flat_blocks(p.n), kFlatThreads, 0, stream, p);
}

// ---- deterministic random fill (synthetic weights) -------------------------------------------

// Element (r, c) of a window [rows, cols] cut at (row0, col0) out of a notional [*, ld] tensor
// gets mean + std * N(0,1), the normal drawn (Box-Muller) from a counter hash of
// (seed, (row0 + r) * ld + col0 + c): any window of a tensor equals the same part of the whole,
// which is how tensor-parallel slices of a synthetic model match the unsliced one.
struct FillNormalParams {
  void* out;  // [rows, cols] contiguous, F32 or BF16
  bool bf16;
  int64_t rows, cols, ld, row0, col0;
  uint64_t seed;
  float mean, stdv;
};

static __global__ void fill_normal_kernel(const FillNormalParams p) {
  const int64_t n = p.rows * p.cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.cols, c = i - r * p.cols;
    const uint64_t h = splitmix64(p.seed ^ splitmix64(uint64_t((p.row0 + r) * p.ld + p.col0 + c)));
    // Two 24-bit uniforms in (0, 1): the log never sees 0.
    const float u1 = (float(uint32_t(h >> 40)) + 0.5f) * (1.f / 16777216.f);
    const float u2 = (float(uint32_t(h & 0xFFFFFFu)) + 0.5f) * (1.f / 16777216.f);
    const float z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    const float v = p.mean + p.stdv * z;
    if (p.bf16)
      static_cast<__nv_bfloat16*>(p.out)[i] = __float2bfloat16_rn(v);
    else
      static_cast<float*>(p.out)[i] = v;
  }
}

inline cudaError_t fill_normal_launch(const FillNormalParams& p, cudaStream_t stream) {
  if (p.rows * p.cols == 0) return cudaSuccess;
  fill_normal_kernel<<<flat_blocks(p.rows * p.cols), kFlatThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sf::kernels::cuda
