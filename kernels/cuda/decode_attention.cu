// CUDA paged decode attention and append (kernels/decode_attention.h). The rules are those of the
// host reference, decode/decode_attention.cpp, step for step: the same bound, the same visit
// order (bound descending, ties by page index), the same online softmax in float with the masses
// in double, the same stop test. Results agree with it to float rounding (exp differs by an ulp),
// so a stop that sits exactly on eps may fall one block apart.
//
// Work split: one CTA of 128 threads per query head. PSA ranks the head's blocks in shared memory
// (bitonic sort of bound/index pairs, up to kDecodeMaxPages). Each visited block: the CTA loads
// its keys into a shared tile (float4, every load in flight), threads 0-63 score one key each,
// the CTA takes the block max, loads the values into the same tile, and thread c < head_dim
// accumulates channel c of the output. One CTA walks a head's blocks in order (PSA's visit is
// sequential), so a long context is latency bound: sf_bench_decode measures it.
#include <cuda_runtime.h>

#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/smem_opt_in.h"

namespace sf::kernels::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kBT = kDecodeBlockTokens;
constexpr int kMaxDim = kThreads;  // one output channel per thread

struct DecodeArgs {
  const float* q;
  float* out;
  int32_t* visited;
  PagedKv kv;
  int n_heads;
  float scale;
  double eps;
  bool psa, pin, recent_mean;
};

__device__ float block_bound(const float* q, const float* kmin, const float* kmax, int d) {
  float u = 0.f;
  for (int c = 0; c < d; ++c) u += fmaxf(q[c] * kmin[c], q[c] * kmax[c]);
  return u;
}

// n rows of d floats (d % 4 == 0, 16-byte aligned) from global into a [rows][ld] tile: float4
// loads, several per thread issued before their stores.
__device__ void load_tile(float* tile, const float* src, int n, int d, int ld) {
  const int q4 = d / 4, total = n * q4;
  const float4* s4 = reinterpret_cast<const float4*>(src);
  for (int i0 = threadIdx.x; i0 < total; i0 += 4 * kThreads) {
    float4 r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + u * kThreads;
      if (i < total) r[u] = s4[i];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + u * kThreads;
      if (i >= total) break;
      float* dst = tile + (i / q4) * ld + (i % q4) * 4;
      dst[0] = r[u].x;
      dst[1] = r[u].y;
      dst[2] = r[u].z;
      dst[3] = r[u].w;
    }
  }
}

// Descending by bound, ascending by index on ties: the order of the host's stable_sort.
__device__ bool before(float ua, int ia, float ub, int ib) {
  return ua > ub || (ua == ub && ia < ib);
}

__global__ void __launch_bounds__(kThreads) paged_decode_kernel(const DecodeArgs a) {
  extern __shared__ unsigned char smem_raw[];
  const int h = blockIdx.x, tid = threadIdx.x;
  const int d = a.kv.head_dim, group = a.n_heads / a.kv.n_kv_heads, g = h / group;
  const int nb = a.kv.n_pages[g];
  const int32_t* pages = a.kv.pages + int64_t(g) * a.kv.max_pages;
  int np2 = 1;
  while (np2 < nb) np2 <<= 1;
  const int ld = d + 1;                                       // tile row stride: no bank conflicts
  float* tile = reinterpret_cast<float*>(smem_raw);           // [kBT][ld] a block's K, then V
  float* qs = tile + kBT * ld;                                // [d]
  float* sc = qs + kMaxDim;                                   // [kBT] scores, then exps
  float* red = sc + kBT;                                      // [kThreads / 32] warp partials
  float* ub = red + kThreads / 32;                            // [np2] bounds (psa)
  int* ord = reinterpret_cast<int*>(ub + (a.psa ? np2 : 0));  // [np2] page indices in visit order

  for (int c = tid; c < d; c += kThreads) qs[c] = a.q[int64_t(h) * d + c];
  __syncthreads();
  for (int b = tid; b < np2; b += kThreads) {
    ord[b] = b;
    if (!a.psa) continue;
    if (b >= nb) {
      ub[b] = -INFINITY;
      continue;
    }
    const int64_t blk = pages[b];
    ub[b] = (a.pin && (b == 0 || b == nb - 1))
                ? INFINITY
                : block_bound(qs, a.kv.kmin + blk * d, a.kv.kmax + blk * d, d);
  }
  __syncthreads();
  if (a.psa) {
    for (int k = 2; k <= np2; k <<= 1)
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = tid; i < np2; i += kThreads) {
          const int l = i ^ j;
          if (l <= i) continue;
          const bool up = (i & k) == 0;  // this pair's run sorts in visit order
          const bool swap =
              up ? before(ub[l], ord[l], ub[i], ord[i]) : before(ub[i], ord[i], ub[l], ord[l]);
          if (swap) {
            const float tu = ub[i];
            ub[i] = ub[l];
            ub[l] = tu;
            const int to = ord[i];
            ord[i] = ord[l];
            ord[l] = to;
          }
        }
        __syncthreads();
      }
  }

  // Every thread keeps the same scalars (computed from the same shared values in the same order).
  float m = -INFINITY, o = 0.f;
  double acc = 0, as_min = INFINITY, recent[kPsaRecentBlocks] = {};
  int visited = 0, ranked = 0;
  for (int oi = 0; oi < nb; ++oi) {
    const int pi = ord[oi];
    const int64_t blk = pages[pi];
    const int n = a.kv.fill[blk];
    const float* kb = a.kv.k + blk * kBT * d;
    const float* vb = a.kv.v + blk * kBT * d;
    // The block's keys into shared memory, all loads in flight at once (a row per thread would
    // wait on one load per channel).
    load_tile(tile, kb, n, d, ld);
    __syncthreads();
    float s = -INFINITY;
    if (tid < n) {
      const float* kr = tile + tid * ld;
      // Eight partial sums, summed as the host's dot() does.
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int c = 0;
      for (; c + 8 <= d; c += 8)
#pragma unroll
        for (int j = 0; j < 8; ++j) part[j] += qs[c + j] * kr[c + j];
      float t = 0;
      for (; c < d; ++c) t += qs[c] * kr[c];
#pragma unroll
      for (int j = 0; j < 8; ++j) t += part[j];
      s = t * a.scale;
    }
    float wm = s;
    for (int off = 16; off > 0; off >>= 1) wm = fmaxf(wm, __shfl_xor_sync(0xffffffffu, wm, off));
    if ((tid & 31) == 0) red[tid >> 5] = wm;
    if (tid < kBT) sc[tid] = s;
    __syncthreads();
    float bm = red[0];
    for (int w = 1; w < kThreads / 32; ++w) bm = fmaxf(bm, red[w]);
    ++visited;
    if (n == 0) {
      __syncthreads();
      continue;
    }
    if (bm > m) {
      const double r = exp(double(m) - double(bm));  // 0 on the first block
      o = float(o * r);
      acc *= r;
      if (isfinite(as_min)) as_min *= r;
      for (int j = 0; j < kPsaRecentBlocks; ++j) recent[j] *= r;
      m = bm;
    }
    __syncthreads();  // every thread has read the scores' max and is done with the keys
    if (tid < n) sc[tid] = expf(sc[tid] - m);
    load_tile(tile, vb, n, d, ld);
    __syncthreads();
    double as_b = 0;
    for (int t = 0; t < n; ++t) as_b += sc[t];
    if (tid < d) {
      float oc = o;
      for (int t = 0; t < n; ++t) oc += sc[t] * tile[t * ld + tid];
      o = oc;
    }
    acc += as_b;
    __syncthreads();  // sc is rewritten by the next block
    const bool pinned = a.pin && (pi == 0 || pi == nb - 1);
    if (!pinned) {
      const double full_b = as_b * double(kBT) / double(n);
      as_min = fmin(as_min, full_b);
      recent[ranked % kPsaRecentBlocks] = full_b;
      ++ranked;
    }
    if (!a.psa || ranked == 0) continue;
    double per_block = as_min;
    if (a.recent_mean) {
      if (ranked < kPsaRecentBlocks) continue;
      per_block = 0;
      for (int j = 0; j < kPsaRecentBlocks; ++j) per_block += recent[j];
      per_block /= kPsaRecentBlocks;
    }
    const double left = double(nb - visited);
    if (acc / (acc + per_block * left) >= a.eps) break;
  }
  if (tid < d) a.out[int64_t(h) * d + tid] = acc > 0 ? o * float(1.0 / acc) : 0.f;
  if (tid == 0 && a.visited) a.visited[h] = visited;
}

// One CTA per KV head: thread 0 opens the next reserved page when the last block is full (or the
// head has none yet); then thread c writes channel c of the row and folds it into kmin/kmax.
__global__ void paged_append_kernel(const PagedKv kv, const float* k_new, const float* v_new) {
  const int g = blockIdx.x, d = kv.head_dim;
  __shared__ int64_t blk_s;
  __shared__ int slot_s;
  if (threadIdx.x == 0) {
    int np = kv.n_pages[g];
    int32_t* pages = kv.pages + int64_t(g) * kv.max_pages;
    int64_t blk = np > 0 ? pages[np - 1] : -1;
    if (blk < 0 || kv.fill[blk] >= kBT) {
      if (np < kv.max_pages) {
        blk = pages[np];
        kv.n_pages[g] = np + 1;
        kv.fill[blk] = 0;
      } else {
        blk = -1;  // no reserved page: the host checks capacity before launching
      }
    }
    blk_s = blk;
    slot_s = blk >= 0 ? kv.fill[blk] : 0;
  }
  __syncthreads();
  const int64_t blk = blk_s;
  if (blk < 0) return;
  const int slot = slot_s;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    const float kc = k_new[int64_t(g) * d + c];
    kv.k[(blk * kBT + slot) * d + c] = kc;
    kv.v[(blk * kBT + slot) * d + c] = v_new[int64_t(g) * d + c];
    float& lo = kv.kmin[blk * d + c];
    float& hi = kv.kmax[blk * d + c];
    lo = slot == 0 ? kc : fminf(lo, kc);
    hi = slot == 0 ? kc : fmaxf(hi, kc);
  }
  __syncthreads();
  if (threadIdx.x == 0) kv.fill[blk] = slot + 1;
}

constexpr size_t decode_smem_bytes(int np2, bool psa, int d) {
  return sizeof(float) * (size_t(kBT) * size_t(d + 1) + kMaxDim + kBT + kThreads / 32) +
         (psa ? sizeof(float) * size_t(np2) : 0) + sizeof(int) * size_t(np2);
}
constexpr size_t kDecodeSmemMax = decode_smem_bytes(kDecodeMaxPages, true, kMaxDim);

}  // namespace

Status paged_decode_attention(const float* q, int n_heads, const PagedKv& kv,
                              const PagedDecodeParams& p, float* out, int32_t* visited,
                              void* stream) {
  if (kv.head_dim > kMaxDim)
    return SF_ERR(kUnsupported,
                  "paged_decode_attention: CUDA supports head_dim <= " + std::to_string(kMaxDim) +
                      ", got " + std::to_string(kv.head_dim));
  DecodeArgs a{};
  a.q = q;
  a.out = out;
  a.visited = visited;
  a.kv = kv;
  a.n_heads = n_heads;
  a.scale = p.scale > 0.f ? p.scale : 1.f / std::sqrt(float(kv.head_dim));
  a.eps = p.eps;
  a.psa = p.psa;
  a.pin = p.pin_sink_recent;
  a.recent_mean = p.recent_mean;
  // Sized for the most pages a head may hold (the count itself lives on the device).
  int np2 = 1;
  while (np2 < kv.max_pages) np2 <<= 1;
  const size_t smem = decode_smem_bytes(np2, p.psa, kv.head_dim);
  // Opted in once for the largest launch (about 66 KB), so any later one fits.
  static std::atomic<uint64_t> opted{0};
  SF_CUDA_TRY(opt_in_smem(paged_decode_kernel, kDecodeSmemMax, opted));
  paged_decode_kernel<<<unsigned(n_heads), kThreads, smem, static_cast<cudaStream_t>(stream)>>>(a);
  SF_CUDA_TRY(cudaGetLastError());
  return Status::ok();
}

Status paged_append(const PagedKv& kv, const float* k_new, const float* v_new, void* stream) {
  paged_append_kernel<<<unsigned(kv.n_kv_heads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      kv, k_new, v_new);
  SF_CUDA_TRY(cudaGetLastError());
  return Status::ok();
}

}  // namespace sf::kernels::cuda
