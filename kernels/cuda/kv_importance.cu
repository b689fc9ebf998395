// CUDA kv_importance (kernels/kv_importance.h): SnapKV column sums of the observation window's
// softmax, recomputed from the attention's LSE, max-pooled over keys. The CPU kernel's function
// (kernels/cpu/kv_importance.cpp); the sums are fp32 in another order, so results agree to
// rounding, not bit for bit.
//
// Work split: a CTA owns a tile of 128 keys of one KV head: 128 - 2 * (pool / 2) output keys
// plus pool/2 halo keys on each side (their sums are recomputed, so the pooling needs no second
// pass or workspace). The tile's key rows sit in shared memory, rows padded by four floats, so a
// thread's 16-byte loads stay aligned and a warp's eight per phase fall in distinct banks; window
// rows of the group's query heads are staged 16 at a time. Two threads share a key, each taking
// 8 of a stage's rows (two threads a key keep 16 warps an SM at two CTAs, which the tile's shared
// memory allows), and accumulate p = exp(min(s, lse) - lse) for each (head, row) that may see
// the key; their two sums are added before pooling. Each 16-byte key load feeds four
// multiply-adds into each of its 8 rows (the q loads are broadcasts).
// The run allocates nothing and does not synchronize with the host. Keys may be BF16 (a CP
// rank's exchanged keys, or the attention's copies), widened as they are staged.
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

constexpr int kKeys = 128;           // keys of a tile, halo included
constexpr int kThreads = 2 * kKeys;  // two threads a key, each on half of a stage's rows
constexpr int kMaxHalf = 32;         // pool / 2 supported (pool <= 65): 64 output keys at least
constexpr int kRowsPerStage = 16;
constexpr int kRowsPerThread = kRowsPerStage / 2;
constexpr int kPad = 4;  // floats after each staged key row

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
  extern __shared__ __align__(16) float smem[];
  const int g = blockIdx.y;
  const int group = p.hq / p.hkv;
  const int out_keys = kKeys - 2 * p.half;
  const int64_t o0 = int64_t(blockIdx.x) * out_keys;     // first output key
  const int64_t t0 = o0 - p.half > 0 ? o0 - p.half : 0;  // first key summed
  const int64_t t1e = o0 + out_keys + p.half;            // one past the last
  const int64_t t1 = t1e < p.nk ? t1e : p.nk;
  const int T = int(t1 - t0);
  const int ld = p.d + kPad;
  float* ks = smem;                                              // [T][d + kPad]
  float* qs = ks + size_t(kKeys) * ld;                           // [kRowsPerStage][d]
  float* sums = qs + size_t(kRowsPerStage) * p.d;                // [2][kKeys]
  float* ls = sums + 2 * kKeys;                                  // [kRowsPerStage]
  int64_t* rs = reinterpret_cast<int64_t*>(ls + kRowsPerStage);  // row positions

  // The tile's keys, 16 bytes a load: a row is `lanes` threads wide (no division per element;
  // Nsight counted twice the arithmetic's instructions when staging divided per element).
  if (p.k_bf16) {
    const int lanes = p.d / 8, per = kThreads / lanes, c8 = threadIdx.x % lanes;
    if (threadIdx.x < per * lanes)
      for (int jj = threadIdx.x / lanes; jj < T; jj += per) {
        const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.k) +
                                                          ((t0 + jj) * p.hkv + g) * p.d + c8 * 8);
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
        const float2 f0 = __bfloat1622float2(h2[0]), f1 = __bfloat1622float2(h2[1]);
        const float2 f2 = __bfloat1622float2(h2[2]), f3 = __bfloat1622float2(h2[3]);
        float4* dst = reinterpret_cast<float4*>(ks + jj * ld + c8 * 8);
        dst[0] = make_float4(f0.x, f0.y, f1.x, f1.y);
        dst[1] = make_float4(f2.x, f2.y, f3.x, f3.y);
      }
  } else {
    const int lanes = p.d / 4, per = kThreads / lanes, c4 = threadIdx.x % lanes;
    if (threadIdx.x < per * lanes)
      for (int jj = threadIdx.x / lanes; jj < T; jj += per)
        reinterpret_cast<float4*>(ks + jj * ld)[c4] = reinterpret_cast<const float4*>(
            static_cast<const float*>(p.k) + ((t0 + jj) * p.hkv + g) * p.d)[c4];
  }
  const int64_t W = p.window < p.nq ? p.window : p.nq;
  const int64_t r0 = p.nq - W;
  // Window rows that see none of the tile's keys are skipped (causal): key t0 needs
  // q_offset + r >= t0.
  int64_t first = t0 - p.q_offset - r0;
  first = first < 0 ? 0 : first;
  const int j = threadIdx.x % kKeys;
  const int i0 = int(threadIdx.x / kKeys) * kRowsPerThread;  // this thread's rows of a stage
  const int64_t key = t0 + j;
  float acc = 0.f;
  // Pairs (query head of the group, window row that sees the tile): fewer than group x window,
  // so 32-bit arithmetic.
  const int wf = first < W ? int(W - first) : 0;
  const int n_pairs = group * wf;
  const int q_lanes = p.d / 4, q_per = kThreads / q_lanes, c4 = threadIdx.x % q_lanes;
  for (int b = 0; b < n_pairs; b += kRowsPerStage) {
    const int nr = n_pairs - b < kRowsPerStage ? n_pairs - b : kRowsPerStage;
    __syncthreads();  // previous stage consumed (and, the first time, ks written)
    if (threadIdx.x < q_per * q_lanes)
      for (int i = threadIdx.x / q_lanes; i < nr; i += q_per) {
        const int h = g * group + (b + i) / wf;
        const int64_t r = r0 + first + (b + i) % wf;
        reinterpret_cast<float4*>(qs + i * p.d)[c4] =
            reinterpret_cast<const float4*>(p.q + (r * p.hq + h) * p.d)[c4];
      }
    if (threadIdx.x < nr) {
      const int h = g * group + (b + int(threadIdx.x)) / wf;
      const int64_t r = r0 + first + (b + int(threadIdx.x)) % wf;
      ls[threadIdx.x] = p.lse[int64_t(h) * p.nq + r];
      rs[threadIdx.x] = r;
    }
    __syncthreads();
    if (j < T) {
      // Channels in order, as one accumulator per row would: the sums are unchanged.
      float dot[kRowsPerThread] = {};
      const float4* kr = reinterpret_cast<const float4*>(ks + j * ld);
      const float4* q4 = reinterpret_cast<const float4*>(qs + i0 * p.d);
      const int d4 = p.d / 4;
      for (int c = 0; c < d4; ++c) {
        const float4 kv = kr[c];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          const float4 qv = q4[i * d4 + c];
          dot[i] = fmaf(qv.x, kv.x, dot[i]);
          dot[i] = fmaf(qv.y, kv.y, dot[i]);
          dot[i] = fmaf(qv.z, kv.z, dot[i]);
          dot[i] = fmaf(qv.w, kv.w, dot[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        if (i0 + i >= nr) break;
        const float l = ls[i0 + i];
        // Rows that saw no key (lse -inf) contribute nothing; key must be causal for the row.
        if (!(l > -INFINITY) || key > p.q_offset + rs[i0 + i]) continue;
        // Recomputed scores can exceed lse by rounding: p <= 1. (As the CPU's std::min(x, l): a
        // NaN score stays NaN, where fminf would make it l.)
        const float x = dot[i] * p.scale;
        const float s = l < x ? l : x;
        acc += expf(s - l);
      }
    }
  }
  sums[threadIdx.x] = acc;  // [half][key]
  __syncthreads();
  if (threadIdx.x < kKeys) sums[j] += sums[kKeys + j];
  __syncthreads();
  if (threadIdx.x < out_keys && o0 + j < p.nk) {
    const int64_t oj = o0 + j;
    const int64_t a = oj - p.half > 0 ? oj - p.half : 0;
    const int64_t e = oj + p.half < p.nk - 1 ? oj + p.half : p.nk - 1;
    // As the CPU's max_pool_keys (std::max from the key's own sum): NaN propagates alike.
    float m = sums[oj - t0];
    for (int64_t u = a; u <= e; ++u) m = m < sums[u - t0] ? sums[u - t0] : m;
    p.out[int64_t(g) * p.nk + oj] = m;
  }
}

size_t smem_bytes(int d) {
  return (size_t(kKeys) * size_t(d + kPad) + size_t(kRowsPerStage) * size_t(d) + 2 * kKeys +
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
  if (p.d > 256 || p.d % 8 != 0)
    return SF_ERR(kUnsupported,
                  "kv_importance: CUDA supports head_dim a multiple of 8 up to 256, got " +
                      std::to_string(p.d));
  // Rows are read 16 bytes at a time.
  if (reinterpret_cast<uintptr_t>(p.q) % 16 != 0 || reinterpret_cast<uintptr_t>(p.k) % 16 != 0)
    return SF_ERR(kUnsupported, "kv_importance: CUDA needs q and k 16-byte aligned");
  if (p.nk == 0) return Status::ok();
  const int64_t out_keys = kKeys - 2 * p.half;
  if ((p.nk + out_keys - 1) / out_keys > 0x7fffffff || p.hkv > 65535)
    return SF_ERR(kUnsupported, "kv_importance: grid too large");
  const size_t smem = smem_bytes(p.d);
  static SmemOptIn opted;  // above 48 KB from head_dim 80 on
  SF_CUDA_TRY(opt_in_smem(kv_importance_kernel, smem, opted));
  const dim3 grid(unsigned((p.nk + out_keys - 1) / out_keys), unsigned(p.hkv));
  kv_importance_kernel<<<grid, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  SF_CUDA_TRY(cudaGetLastError());
  return Status::ok();
}

}  // namespace sf::kernels::cuda
