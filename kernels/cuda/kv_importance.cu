// CUDA kv_importance (kernels/kv_importance.h): SnapKV column sums of the observation window's
// softmax, recomputed from the attention's LSE, max-pooled over keys. The CPU kernel's function
// (kernels/cpu/kv_importance.cpp); the sums are fp32 in another order, so results agree to
// rounding, not bit for bit.
//
// Work split: a CTA owns 64 output keys of one KV head, plus pool/2 halo keys on each side (their
// sums are recomputed, so the pooling needs no second pass or workspace). Its key rows sit in
// shared memory (rows padded by one float: a warp's 32 threads read 32 different rows of one
// column conflict-free); window rows of the group's query heads are staged 8 at a time, and
// thread j accumulates p = exp(min(s, lse) - lse) of key j for each (head, row) that may see it.
// The run allocates nothing and does not synchronize with the host. Keys may be BF16 (a CP
// rank's exchanged keys), widened as they are staged.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/smem_opt_in.h"

namespace sf::kernels::cuda {
namespace {

constexpr int kOutKeys = 64;                       // output keys per CTA
constexpr int kMaxHalf = 32;                       // pool / 2 supported (pool <= 65)
constexpr int kThreads = kOutKeys + 2 * kMaxHalf;  // one thread per key of the tile, halo included
constexpr int kRowsPerStage = 8;

struct ImpParams {
  const float* q;    // [nq, hq, d]
  const void* k;     // [nk, hkv, d], F32 or BF16 (k_bf16)
  const float* lse;  // [hq, nq]
  float* out;        // [hkv, nk]
  int64_t nq, nk, q_offset;
  int hq, hkv, d, window, half;
  float scale;
  bool k_bf16;
};

__global__ void __launch_bounds__(kThreads) kv_importance_kernel(const ImpParams p) {
  extern __shared__ float smem[];
  const int g = blockIdx.y;
  const int group = p.hq / p.hkv;
  const int64_t o0 = int64_t(blockIdx.x) * kOutKeys;     // first output key
  const int64_t t0 = o0 - p.half > 0 ? o0 - p.half : 0;  // first key summed
  const int64_t t1e = o0 + kOutKeys + p.half;            // one past the last
  const int64_t t1 = t1e < p.nk ? t1e : p.nk;
  const int T = int(t1 - t0);
  const int ld = p.d + 1;
  float* ks = smem;                                              // [T][d + 1]
  float* qs = ks + size_t(kThreads) * ld;                        // [kRowsPerStage][d]
  float* sums = qs + size_t(kRowsPerStage) * p.d;                // [kThreads]
  float* ls = sums + kThreads;                                   // [kRowsPerStage]
  int64_t* rs = reinterpret_cast<int64_t*>(ls + kRowsPerStage);  // row positions

  for (int x = threadIdx.x; x < T * p.d; x += blockDim.x) {
    const int j = x / p.d, c = x % p.d;
    const int64_t at = ((t0 + j) * p.hkv + g) * p.d + c;
    ks[j * ld + c] = p.k_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.k)[at])
                              : static_cast<const float*>(p.k)[at];
  }
  const int64_t W = p.window < p.nq ? p.window : p.nq;
  const int64_t r0 = p.nq - W;
  // Window rows that see none of the tile's keys are skipped (causal): key t0 needs
  // q_offset + r >= t0.
  int64_t first = t0 - p.q_offset - r0;
  first = first < 0 ? 0 : first;
  const int j = threadIdx.x;
  const int64_t key = t0 + j;
  float acc = 0.f;
  const int64_t n_pairs = first < W ? int64_t(group) * (W - first) : 0;
  for (int64_t b = 0; b < n_pairs; b += kRowsPerStage) {
    const int nr = int(n_pairs - b < kRowsPerStage ? n_pairs - b : kRowsPerStage);
    __syncthreads();  // previous stage consumed (and, the first time, ks written)
    for (int x = threadIdx.x; x < nr * p.d; x += blockDim.x) {
      const int64_t pr = b + x / p.d;
      const int h = g * group + int(pr / (W - first));
      const int64_t r = r0 + first + pr % (W - first);
      qs[x] = p.q[(r * p.hq + h) * p.d + x % p.d];
    }
    if (threadIdx.x < nr) {
      const int64_t pr = b + threadIdx.x;
      const int h = g * group + int(pr / (W - first));
      const int64_t r = r0 + first + pr % (W - first);
      ls[threadIdx.x] = p.lse[int64_t(h) * p.nq + r];
      rs[threadIdx.x] = r;
    }
    __syncthreads();
    if (j < T) {
      float dot[kRowsPerStage] = {};
      const float* kr = ks + j * ld;
      for (int c = 0; c < p.d; ++c) {
        const float kv = kr[c];
#pragma unroll
        for (int i = 0; i < kRowsPerStage; ++i) dot[i] = fmaf(qs[i * p.d + c], kv, dot[i]);
      }
#pragma unroll
      for (int i = 0; i < kRowsPerStage; ++i) {
        if (i >= nr) break;
        const float l = ls[i];
        // Rows that saw no key (lse -inf) contribute nothing; key must be causal for the row.
        if (!(l > -INFINITY) || key > p.q_offset + rs[i]) continue;
        // Recomputed scores can exceed lse by rounding: p <= 1.
        const float s = fminf(dot[i] * p.scale, l);
        acc += expf(s - l);
      }
    }
  }
  sums[j] = acc;
  __syncthreads();
  if (j < kOutKeys && o0 + j < p.nk) {
    const int64_t oj = o0 + j;
    const int64_t a = oj - p.half > 0 ? oj - p.half : 0;
    const int64_t e = oj + p.half < p.nk - 1 ? oj + p.half : p.nk - 1;
    float m = -INFINITY;
    for (int64_t u = a; u <= e; ++u) m = fmaxf(m, sums[u - t0]);
    p.out[int64_t(g) * p.nk + oj] = m;
  }
}

size_t smem_bytes(int d) {
  return (size_t(kThreads) * size_t(d + 1) + size_t(kRowsPerStage) * size_t(d) + kThreads +
          kRowsPerStage) *
             sizeof(float) +
         kRowsPerStage * sizeof(int64_t);
}

}  // namespace

Status kv_importance(const TensorView& q, const TensorView& k, const TensorView& lse,
                     const ImportanceParams& ip, TensorView out, void* stream) {
  ImpParams p;
  p.q = q.ptr<float>();
  p.k = k.data;
  p.k_bf16 = k.dtype == DType::kBF16;
  p.lse = lse.ptr<float>();
  p.out = out.ptr<float>();
  p.nq = q.shape[0];
  p.hq = int(q.shape[1]);
  p.d = int(q.shape[2]);
  p.nk = k.shape[0];
  p.hkv = int(k.shape[1]);
  p.q_offset = ip.q_offset;
  p.window = ip.window;
  p.half = ip.pool / 2;
  p.scale = ip.scale > 0.f ? ip.scale : 1.f / std::sqrt(float(p.d));
  if (p.half > kMaxHalf)
    return SF_ERR(kUnsupported,
                  "kv_importance: CUDA supports pool <= " + std::to_string(2 * kMaxHalf + 1) +
                      ", got " + std::to_string(ip.pool));
  if (p.d > 256)
    return SF_ERR(kUnsupported,
                  "kv_importance: CUDA supports head_dim <= 256, got " + std::to_string(p.d));
  if (p.nk == 0) return Status::ok();
  if ((p.nk + kOutKeys - 1) / kOutKeys > 0x7fffffff || p.hkv > 65535)
    return SF_ERR(kUnsupported, "kv_importance: grid too large");
  const size_t smem = smem_bytes(p.d);
  static std::atomic<uint64_t> opted{0};  // above 48 KB from head_dim 89 on
  SF_CUDA_TRY(opt_in_smem(kv_importance_kernel, smem, opted));
  const dim3 grid(unsigned((p.nk + kOutKeys - 1) / kOutKeys), unsigned(p.hkv));
  kv_importance_kernel<<<grid, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  SF_CUDA_TRY(cudaGetLastError());
  return Status::ok();
}

}  // namespace sf::kernels::cuda
