// Device index estimators: the CUDA run step of kernels/sparse.h sparse_estimate. The rules are the
// CPU estimator's (kernels/cpu/sparse_estimators.cpp), step for step:
//   1. last-query scoring (vertical-slash, and the block family's exact last query block): per
//      64-key chunk one CTA computes the (<= 64 rows) x 64 logits in shared memory; pass 1 keeps
//      each row's max and sum-exp, a CTA per row merges them into the row LSE, pass 2 recomputes
//      the logits, turns them into probabilities and writes column sums and per-chunk diagonal
//      partials (127 offsets), which a third kernel adds (each offset lies in <= 2 chunks).
//      Every sum has a fixed order: the result does not depend on scheduling.
//   2. selection (group_select): one CTA per (head, columns | diagonals), one warp per (head,
//      query block); forced items first, the rest ranked by score descending then index
//      ascending via an 8-bit radix select on order-preserving keys (4 passes), for top-k
//      directly, for the adaptive mass threshold by a first radix walk on the accumulated mass;
//      the selected ids come out sorted ascending by a scan.
//   3. block scores: q and k mean-pooled over 64 rows and rounded to bf16 (as on the CPU); k by a
//      pooling pass, q by the selector CTA that uses it, which then scores its group of query
//      blocks against every pooled key block on tensor cores into shared memory and selects per
//      query block.
//   4. slot building: one warp per (head, query block), the host builder's merge of sink,
//      local window, diagonal ranges and key blocks into 64-key entries plus columns, 32
//      intervals at a time (scans over the lanes), the entries written by the warp together.
// No allocation and no host synchronization: the launch sequence is safe under graph capture.
// Index capacity is the plan's; a slot that needs more is truncated and need[] records the
// largest counts, so the caller can re-plan (kernels/cuda/sparse_estimate.cpp).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "kernels/cuda/attention_sparse_bf16.cuh"  // mma.sync / ldmatrix helpers
#include "kernels/cuda/sparse_estimate_launch.h"
#include "kernels/sparse_tail.h"

namespace sf::kernels::cuda {
namespace {

constexpr int kB = 64;
constexpr int kScoreThreads = 256;
constexpr unsigned kAll = 0xffffffffu;
static_assert(kScoreThreads % kB == 0, "score_probs_kernel: a thread keeps one key column");

__host__ __device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p) { return __bfloat162float(*p); }

__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t u = __float_as_uint(x);
  // Negative: every bit flipped; else the sign bit set. Branch-free: a shift and one LOP3.
  return u ^ (uint32_t(int32_t(u) >> 31) | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// One scoring pass: rows r0 .. r0 + L - 1 of the heads listed, against keys [0, kend_last).
struct ScorePass {
  const int32_t* heads = nullptr;
  int n_heads = 0;
  int64_t r0 = 0, L = 0;
  float* col = nullptr;     // [n_heads * kend_last] column sums, or null
  float* mass = nullptr;    // [n_heads * n_kb] mass per key block / L, or null
  float* part_d = nullptr;  // [n_heads * n_chunks * 127] diagonal partials, or null
  int group_chunks = 0;     // 64-key chunks per CTA of score_stats_group_kernel (score_pass)
  // Rows not contiguous in the prompt (vs_cover's): q rows r0 .. of p.q (a gathered copy), each at
  // absolute position pos[i] (ascending); null: row i at q_offset + r0 + i.
  const int64_t* pos = nullptr;
  // Each row's probabilities in cov_p's layout ([n_heads][n_chunks][probs_rows][64], row
  // probs_row0 + i), or null.
  float* probs = nullptr;
  int64_t probs_row0 = 0, probs_rows = 0;
};

// Where a pass's probability of (head slot hs, row i, key c0 + j) goes: cov_p's layout, a
// [probs_rows][64] tile per 64-key chunk (sparse_estimate_launch.h).
__device__ __forceinline__ float* probs_at(const EstimateLaunch& p, const ScorePass& sp, int64_t hs,
                                           int64_t i, int64_t chunk) {
  return sp.probs +
         ((size_t(hs) * size_t(p.n_chunks) + size_t(chunk)) * size_t(sp.probs_rows) +
          size_t(sp.probs_row0 + i)) *
             kB;
}

// cov_p's entry of cover head c, scoring row r, key j.
__device__ __forceinline__ size_t cov_at(const EstimateLaunch& p, int64_t c, int64_t r,
                                         int64_t j) {
  return ((size_t(c) * size_t(p.n_chunks) + size_t(j / kB)) * size_t(p.cov_rows) + size_t(r)) *
             kB +
         size_t(j % kB);
}

// Absolute position of the pass's row i.
__device__ __forceinline__ int64_t row_pos(const EstimateLaunch& p, const ScorePass& sp,
                                           int64_t i) {
  return sp.pos ? sp.pos[i] : p.q_offset + sp.r0 + i;
}

// q rows and k rows stored row-major with a 4-float pad (qs[i * (d + 4) + c]): rows are read from
// global memory as coalesced 4-element vectors and stored as float4 without bank conflicts, and
// in the product 8 threads reading 8 consecutive padded rows hit 32 distinct banks. Then the
// 64 x 65 logits.
__host__ __device__ __forceinline__ int64_t tile_stride(int64_t d) { return d + 4; }
// BF16 q and k with d 64 or 128 and 16-byte aligned rows: the logits come from tensor cores
// (mma.sync m16n8k16, fp32 accumulation) on bf16 tiles [64][d + 8] (16-byte row pad: ldmatrix
// phases are conflict-free). bf16 products are exact in fp32, only the summation order differs
// from the fp32 path (and the CPU), so selections can differ at exact ties alone.
__host__ __device__ __forceinline__ int64_t tile_stride_b(int64_t d) { return d + 8; }
__host__ __device__ __forceinline__ bool mma_scores(const EstimateLaunch& p) {
  return p.bf16 && (p.d == 64 || p.d == 128) && (reinterpret_cast<uintptr_t>(p.q) % 16) == 0 &&
         (reinterpret_cast<uintptr_t>(p.k) % 16) == 0;
}
// The mma layout: q tile, k tile, then the logits; the stats pass (logits in registers) uses that
// last region for a second k tile (the next chunk's, in flight) and its row reduction.
constexpr size_t kLogitsBytes = size_t(kB * (kB + 1)) * sizeof(float);
constexpr size_t kStatsRedBytes = size_t(2 * kB * 2) * sizeof(float);
size_t score_smem_b(int64_t d) {
  const size_t tile = size_t(kB * tile_stride_b(d)) * 2;
  return 2 * tile + std::max(kLogitsBytes, tile + kStatsRedBytes);
}
size_t score_smem(const EstimateLaunch& p) {
  if (mma_scores(p)) return score_smem_b(p.d);
  return size_t(2 * kB * tile_stride(p.d)) * sizeof(float) + kLogitsBytes;
}
// Plan time (q, k not bound yet): the larger of the two layouts.
size_t score_smem_max(int64_t d) {
  return std::max(size_t(2 * kB * tile_stride(d)) * sizeof(float) + kLogitsBytes, score_smem_b(d));
}

constexpr int kChunksPerCta = 8;  // 64-key chunks per scoring CTA: the q tile is loaded once

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);  // 4 bf16, 8-byte aligned (d % 4 == 0)
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&u.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&u.y);
  const float2 a = __bfloat1622float2(lo), b = __bfloat1622float2(hi);
  return make_float4(a.x, a.y, b.x, b.y);
}

// dst[i * (d + 4) + c] = src[i * row_stride + c] for rows i < valid, else 0. Consecutive threads
// take consecutive 4-element vectors of a row (coalesced); 8 loads are issued before any store,
// so the reads overlap instead of waiting one by one.
// Tile indices are 32-bit (x < 64 * d / 4): 64-bit division by nv is a long integer routine.
template <typename T>
__device__ void load_tile(const T* src, int64_t row_stride, int64_t valid, int64_t d,
                          float* dst) {
  const int nv = int(d / 4), n = kB * nv, ts = int(tile_stride(d));
  for (int x0 = 0; x0 < n; x0 += int(blockDim.x) * 8) {
    float4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int x = x0 + u * int(blockDim.x) + int(threadIdx.x);
      const int i = x / nv, c = (x % nv) * 4;
      v[u] = (x < n && i < valid) ? load4(src + i * row_stride + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int x = x0 + u * int(blockDim.x) + int(threadIdx.x);
      if (x < n) *reinterpret_cast<float4*>(dst + (x / nv) * ts + (x % nv) * 4) = v[u];
    }
  }
}

// dst[i * (d + 8) + c] = src[i * row_stride + c] (bf16, 16-byte vectors), zero rows past valid.
__device__ void load_tile_b(const __nv_bfloat16* src, int64_t row_stride, int64_t valid,
                            int64_t d, __nv_bfloat16* dst) {
  const int nv = int(d / 8), n = kB * nv, ts = int(tile_stride_b(d));
  for (int x0 = 0; x0 < n; x0 += int(blockDim.x) * 4) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int x = x0 + u * int(blockDim.x) + int(threadIdx.x);
      const int i = x / nv, c = (x % nv) * 8;
      v[u] = (x < n && i < valid) ? *reinterpret_cast<const uint4*>(src + i * row_stride + c)
                                  : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int x = x0 + u * int(blockDim.x) + int(threadIdx.x);
      if (x < n) *reinterpret_cast<uint4*>(dst + (x / nv) * ts + (x % nv) * 8) = v[u];
    }
  }
}

// The scoring CTA's shared memory: q tile, k tile (fp32 padded rows, or bf16 for the mma path)
// and the 64 x 65 fp32 logits.
struct ScoreSmem {
  float *qs, *ks, *ss;
  __nv_bfloat16 *qb, *kb, *kb2;  // kb2: the stats pass's second k tile (aliases ss)
  float* red;                    // the stats pass's [2][64][2] row (max, sum) per key half
  bool mma;
  __device__ ScoreSmem(const EstimateLaunch& p, unsigned char* raw) : mma(mma_scores(p)) {
    if (mma) {
      qb = reinterpret_cast<__nv_bfloat16*>(raw);
      kb = qb + kB * tile_stride_b(p.d);
      kb2 = kb + kB * tile_stride_b(p.d);
      ss = reinterpret_cast<float*>(kb2);
      red = reinterpret_cast<float*>(kb2 + kB * tile_stride_b(p.d));
      qs = ks = nullptr;
    } else {
      qs = reinterpret_cast<float*>(raw);
      ks = qs + kB * tile_stride(p.d);
      ss = ks + kB * tile_stride(p.d);
      qb = kb = kb2 = nullptr;
      red = nullptr;
    }
  }
};

template <typename T>
__device__ void load_q_tile(const EstimateLaunch& p, const ScorePass& sp, int h, ScoreSmem& sm) {
  const T* src = static_cast<const T*>(p.q) + (sp.r0 * p.hq + h) * p.d;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (sm.mma) {
      load_tile_b(src, p.hq * p.d, sp.L, p.d, sm.qb);
      return;
    }
  }
  load_tile(src, p.hq * p.d, sp.L, p.d, sm.qs);
}

// Tensor-core logits (unscaled) into registers: warp w computes query rows 16 (w % 4) .. + 15
// against keys 32 (w / 4) .. + 31 (4 n-tiles of 8), two 16-wide k-steps per ldmatrix x4 of K
// rows. c[n][0..1]: row 16 (w % 4) + lane / 4, keys (4 (w / 4) + n) 8 + 2 (lane % 4) + 0..1;
// c[n][2..3]: the row 8 below. D > 0: the head dim known at compile time (the k-step loop
// unrolls and its addresses fold); D = 0: d at run time. Same k-step order either way, so the
// logits are the same bits.
template <int D>
__device__ __forceinline__ void logits_mma(int64_t d_rt, const __nv_bfloat16* qb,
                                           const __nv_bfloat16* kb, float (&c)[4][4]) {
  using namespace attention_sparse_bf16_detail;
  const int d = D > 0 ? D : int(d_rt);
  const int ts = d + 8;  // tile_stride_b
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int mt = warp % 4, nq = warp / 4;
  const __nv_bfloat16* qrow = qb + (mt * 16 + lane % 16) * ts + (lane / 16) * 8;
  const __nv_bfloat16* krow = kb + (nq * 32 + lane % 8) * ts + (lane / 8) * 8;
#pragma unroll(D > 0 ? D / 32 : 1)
  for (int ks = 0; ks < d / 16; ks += 2) {
    uint32_t a0[4], a1[4];
    ldmatrix_x4(a0, qrow + ks * 16);
    ldmatrix_x4(a1, qrow + (ks + 1) * 16);
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      uint32_t b[4];
      ldmatrix_x4(b, krow + n * 8 * ts + ks * 16);
      mma_bf16(c[n], a0[0], a0[1], a0[2], a0[3], b[0], b[1]);
      mma_bf16(c[n], a1[0], a1[1], a1[2], a1[3], b[2], b[3]);
    }
  }
}

__device__ void chunk_logits_mma(const EstimateLaunch& p, ScoreSmem& sm) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int mt = warp % 4, nq = warp / 4;
  float c[4][4] = {};
  logits_mma<0>(p.d, sm.qb, sm.kb, c);
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int j = (nq * 4 + n) * 8 + 2 * t;
    sm.ss[(mt * 16 + g) * (kB + 1) + j] = c[n][0] * p.scale;
    sm.ss[(mt * 16 + g) * (kB + 1) + j + 1] = c[n][1] * p.scale;
    sm.ss[(mt * 16 + g + 8) * (kB + 1) + j] = c[n][2] * p.scale;
    sm.ss[(mt * 16 + g + 8) * (kB + 1) + j + 1] = c[n][3] * p.scale;
  }
}

// Logits of the pass's rows (scaled, q tile already in qs) against the chunk's keys into
// ss[i * 65 + j]. Thread t computes rows i0 .. i0 + 3 (i0 = 4 (t / 16)) against keys
// t % 16 + 16 y; every logit is one fmaf chain over c = 0 .. d - 1 in order.
template <typename T>
__device__ void chunk_logits(const EstimateLaunch& p, const ScorePass& sp, int h, int64_t c0,
                             int64_t kc, ScoreSmem& sm) {
  const int64_t d = p.d, ts = tile_stride(d);
  const int64_t kvh = h / (p.hq / p.hkv);
  const T* ksrc = static_cast<const T*>(p.k) + (c0 * p.hkv + kvh) * d;
  __syncthreads();  // the previous chunk's readers of ks / ss are done
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (sm.mma) {
      load_tile_b(ksrc, p.hkv * d, kc, d, sm.kb);
      __syncthreads();
      chunk_logits_mma(p, sm);
      __syncthreads();
      return;
    }
  }
  float* const qs = sm.qs;
  float* const ks = sm.ks;
  float* const ss = sm.ss;
  load_tile(ksrc, p.hkv * d, kc, d, ks);
  __syncthreads();
  const int i0 = (threadIdx.x / 16) * 4, jb = threadIdx.x % 16;
  float acc[4][4] = {};
  for (int64_t c = 0; c < d; c += 4) {
    float4 av[4], bv[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) av[x] = *reinterpret_cast<const float4*>(qs + (i0 + x) * ts + c);
#pragma unroll
    for (int y = 0; y < 4; ++y) bv[y] = *reinterpret_cast<const float4*>(ks + (jb + 16 * y) * ts + c);
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        acc[x][y] = fmaf(av[x].x, bv[y].x, acc[x][y]);
        acc[x][y] = fmaf(av[x].y, bv[y].y, acc[x][y]);
        acc[x][y] = fmaf(av[x].z, bv[y].z, acc[x][y]);
        acc[x][y] = fmaf(av[x].w, bv[y].w, acc[x][y]);
      }
  }
#pragma unroll
  for (int x = 0; x < 4; ++x)
#pragma unroll
    for (int y = 0; y < 4; ++y) ss[(i0 + x) * (kB + 1) + jb + 16 * y] = acc[x][y] * p.scale;
  __syncthreads();
}

// Keys of the chunk that row i sees: [0, lim).
__device__ __forceinline__ int64_t row_visible(const EstimateLaunch& p, const ScorePass& sp,
                                               int64_t i, int64_t c0, int64_t kc) {
  const int64_t v = row_pos(p, sp, i) + 1 - c0;
  return v < 0 ? 0 : (v > kc ? kc : v);
}

// A row's max and sum of exp relative to it, the row's values spread over the 4 lanes of a quad
// (N each, -inf where hidden): every lane of the quad gets both. The sums run on the SFU as
// 2^(x log2 e - m log2 e).
template <int N>
__device__ __forceinline__ void quad_row_stats(const float (&v)[N], float& m, float& l) {
  using namespace attention_sparse_bf16_detail;
  m = -INFINITY;
#pragma unroll
  for (int x = 0; x < N; ++x) m = fmaxf(m, v[x]);
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  l = 0.f;
  if (m != -INFINITY) {
    const float ml = m * kLog2e;
#pragma unroll
    for (int x = 0; x < N; ++x) l += fast_exp2(fmaf(v[x], kLog2e, -ml));  // -inf -> 0
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
}

// The key rows of 64-key chunk `chunk` (bf16 rows krow elements apart from kbase, d wide) into a
// [64][d + 8] tile by cp.async, one commit group; rows past the keys are zero-filled.
// 64 bf16 rows (d wide, `stride` elements apart from src) into a [64][d + 8] tile by cp.async,
// rows from `valid` on zero-filled; no commit.
__device__ __forceinline__ void issue_rows(const __nv_bfloat16* src, int64_t stride, int64_t valid,
                                           int d, __nv_bfloat16* dst) {
  using namespace attention_sparse_bf16_detail;
  const int nv = d / 8, n = kB * nv, ts = d + 8;  // tile_stride_b
  for (int x = threadIdx.x; x < n; x += kScoreThreads) {
    const int i = x / nv, c = (x % nv) * 8;
    const bool ok = i < valid;
    cp_async_16(dst + i * ts + c, src + int64_t(ok ? i : 0) * stride + c, ok);
  }
}

__device__ __forceinline__ void issue_k_chunk(const EstimateLaunch& p, const __nv_bfloat16* kbase,
                                              int64_t krow, int d, int64_t chunk,
                                              __nv_bfloat16* dst) {
  using namespace attention_sparse_bf16_detail;
  const int64_t c0 = chunk * kB;
  issue_rows(kbase + c0 * krow, krow, imin(kB, p.kend_last - c0), d, dst);
  cp_async_commit();
}

// The stats pass on tensor cores (bf16): the logits stay in registers (each warp reduces its
// 16 rows x 32 keys across the 4 lanes of a row, two warps' halves meet in shared memory), and
// the next chunk's k tile is copied by cp.async while this one is scored. Sums of exp run on the
// SFU as 2^(x log2 e - m log2 e): m log2 e rounds once, so the relative error grows with the
// row's max (about 1e-6 at logits near 30), far inside the selections' tie tolerance. Chunks every
// row sees whole (all but the last one or two: the rows are the prompt's last) skip the mask.
template <int D>
__device__ void score_stats_mma(const EstimateLaunch& p, const ScorePass& sp, int hs,
                                ScoreSmem& sm) {
  using namespace attention_sparse_bf16_detail;
  const int d = D > 0 ? D : int(p.d);
  const int64_t kvh = sp.heads[hs] / (p.hq / p.hkv);
  const auto* kbase = static_cast<const __nv_bfloat16*>(p.k) + kvh * d;
  const int64_t krow = p.hkv * d;
  const int64_t ch0 = int64_t(blockIdx.y) * kChunksPerCta;
  const int64_t ch_end = imin(p.n_chunks, ch0 + kChunksPerCta);
  // The two k tiles are adjacent (kb2 = kb + one tile): the buffer by arithmetic, since a
  // pointer array indexed at run time lives in local memory.
  const int64_t tile = kB * tile_stride_b(d);
  auto kbuf = [&](int b) { return sm.kb + b * tile; };
  if (ch0 < ch_end) issue_k_chunk(p, kbase, krow, d, ch0, kbuf(0));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int mt = warp % 4, nq = warp / 4, g = lane / 4, t = lane % 4;
  // Row 0 sees keys [0, v0): a chunk ending at or before v0 is visible to every row.
  const int64_t v0 = row_pos(p, sp, 0) + 1;
  for (int64_t chunk = ch0; chunk < ch_end; ++chunk) {
    const int buf = int(chunk - ch0) & 1;
    if (chunk + 1 < ch_end) {
      issue_k_chunk(p, kbase, krow, d, chunk + 1, kbuf(buf ^ 1));
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this chunk's tile (and the q tile) is visible to every warp
    const int64_t c0 = chunk * kB, kc = imin(kB, p.kend_last - c0);
    const bool whole = kc == kB && c0 + kB <= v0;
    float c[4][4] = {};
    logits_mma<D>(d, sm.qb, kbuf(buf), c);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = mt * 16 + g + 8 * half;
      float v[8];
      if (whole && i < sp.L) {
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) v[n * 2 + e] = c[n][2 * half + e] * p.scale;
      } else {
        const int lim = i < sp.L ? int(row_visible(p, sp, i, c0, kc)) : 0;
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = (nq * 4 + n) * 8 + 2 * t + e;
            v[n * 2 + e] = j < lim ? c[n][2 * half + e] * p.scale : -INFINITY;
          }
      }
      float m, l;
      quad_row_stats(v, m, l);
      if (t == 0) {
        sm.red[(nq * kB + i) * 2] = m;
        sm.red[(nq * kB + i) * 2 + 1] = l;
      }
    }
    __syncthreads();  // both halves of every row are in red; the tile's readers are done
    if (threadIdx.x < sp.L) {
      const int i = threadIdx.x;
      const float m0 = sm.red[i * 2], l0 = sm.red[i * 2 + 1];
      const float m1 = sm.red[(kB + i) * 2], l1 = sm.red[(kB + i) * 2 + 1];
      const float m = fmaxf(m0, m1);
      float l = 0.f;
      if (l0 > 0.f) l += l0 * fast_exp2((m0 - m) * kLog2e);
      if (l1 > 0.f) l += l1 * fast_exp2((m1 - m) * kLog2e);
      const size_t at = (size_t(hs) * kB + size_t(i)) * size_t(p.n_chunks) + size_t(chunk);
      p.part_m[at] = m;
      p.part_l[at] = l;
    }
  }
}

// grid (n_heads, n_chunks): per row, the chunk's max and sum of exp, on tensor cores (bf16,
// mma_scores). A kernel per head dim, four CTAs an SM (64 registers, 53 KB of shared memory
// each at d = 128, no spills): the pass is bound by issue and latency, not by a pipe, so more
// warps hide more of it.
template <int D>
__global__ void __launch_bounds__(kScoreThreads, 4)
    score_stats_mma_kernel(const EstimateLaunch p, const ScorePass sp) {
  extern __shared__ __align__(16) unsigned char score_raw[];
  ScoreSmem sm(p, score_raw);
  load_q_tile<__nv_bfloat16>(p, sp, sp.heads[blockIdx.x], sm);
  score_stats_mma<D>(p, sp, int(blockIdx.x), sm);
}

// The stats pass for query heads that share a KV head (GQA): a CTA takes up to kGroupHeads of
// the pass's heads of one KV head, so each 64-key tile is copied once for all of them and every
// warp owns whole rows (32 rows x 64 keys: 2 m-tiles x 8 n-tiles), reducing them within itself.
// One barrier a chunk instead of two, and four times the tensor work per barrier and per copy,
// against score_stats_mma's 16 x 32 warp tiles and cross-warp merge. Logits are the same mma
// products; the sums of exp add in another order (within the selections' tie tolerance).
constexpr int kGroupHeads = 4;
size_t stats_group_smem(int64_t d) {
  return size_t(kGroupHeads + 2) * size_t(kB * tile_stride_b(d)) * 2;
}

// kProbs: the second pass instead, for passes that want only each row's probabilities (vs_cover's
// rows: no column sums, diagonal partials or mass): exp(logit - lse) of every visible key, 0 past
// a row's causal limit, stored from the registers as float2 (whole 32-byte sectors of 8 rows an
// instruction) into cov_p's chunk tiles: 1.33 ms a launch at 1M under ncu, against 3.3 for the
// CUDA-core pass, 4.4 for single-float stores into 1M-key rows (fadbb63) and 2.2 for float2
// ones (bench/NOTES.md sixty-third and sixty-fourth sessions).
template <int D, bool kProbs>
__global__ void __launch_bounds__(kScoreThreads, 2)
    score_stats_group_kernel(const EstimateLaunch p, const ScorePass sp) {
  using namespace attention_sparse_bf16_detail;
  static_assert(kScoreThreads == 2 * 32 * kGroupHeads, "two warps of 32 rows per head");
  constexpr int ts = D + 8;  // tile_stride_b
  extern __shared__ __align__(16) unsigned char score_raw[];
  auto* const qt = reinterpret_cast<__nv_bfloat16*>(score_raw);  // [kGroupHeads][64][ts]
  // The two k tiles after the q tiles, chosen by arithmetic: a pointer array indexed at run time
  // lives in local memory (Nsight: 9% of this kernel's stalls waited on that load).
  auto kbuf = [&](int b) { return qt + (kGroupHeads + b) * kB * ts; };
  __shared__ int hs_of[kGroupHeads];  // pass slots of this CTA's heads, -1 past the last
  const int64_t G = p.hq / p.hkv;
  const int per_kv = int((G + kGroupHeads - 1) / kGroupHeads);
  const int64_t kvh = blockIdx.x / per_kv;
  const int part = int(blockIdx.x % per_kv);
  // The pass's heads of this KV head, ascending, kGroupHeads per part: warp 0 reads 32 head ids
  // at a time (one thread reading them one by one held every CTA for their load latencies).
  if (threadIdx.x < 32) {
    const int lane = int(threadIdx.x);
    if (lane < kGroupHeads) hs_of[lane] = -1;
    __syncwarp();
    int seen = 0;
    for (int h0 = 0; h0 < sp.n_heads; h0 += 32) {
      const int hs = h0 + lane;
      const bool mine = hs < sp.n_heads && sp.heads[hs] / G == kvh;
      const unsigned m = __ballot_sync(kAll, mine);
      const int rank = seen + __popc(m & ((1u << lane) - 1u));
      if (mine && rank / kGroupHeads == part) hs_of[rank % kGroupHeads] = hs;
      seen += __popc(m);
    }
  }
  __syncthreads();
  if (hs_of[0] < 0) return;  // no head of the pass reads this KV head (uniform over the CTA)
  const int64_t ch0 = int64_t(blockIdx.y) * sp.group_chunks;
  const int64_t ch_end = imin(p.n_chunks, ch0 + sp.group_chunks);
  // The q tiles go by cp.async in chunk ch0's group, so their copy overlaps the first k tile's.
  for (int j = 0; j < kGroupHeads && hs_of[j] >= 0; ++j)
    issue_rows(static_cast<const __nv_bfloat16*>(p.q) + (sp.r0 * p.hq + sp.heads[hs_of[j]]) * D,
               p.hq * D, sp.L, D, qt + j * kB * ts);
  const auto* kbase = static_cast<const __nv_bfloat16*>(p.k) + kvh * D;
  const int64_t krs = p.hkv * D;
  issue_k_chunk(p, kbase, krs, D, ch0, kbuf(0));  // ch0 < ch_end: the grid covers n_chunks
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = warp / 2, row0 = (warp % 2) * 32, g = lane / 4, t = lane % 4;
  const int hs = hs_of[slot];
  const __nv_bfloat16* qrow = qt + (slot * kB + row0 + lane % 16) * ts + (lane / 16) * 8;
  const int64_t v0 = row_pos(p, sp, 0) + 1;  // row 0 sees keys [0, v0)
  for (int64_t chunk = ch0; chunk < ch_end; ++chunk) {
    const int buf = int(chunk - ch0) & 1;
    cp_async_wait<0>();
    // Every thread's copies of this chunk are visible, and every warp is done with the other
    // buffer (the last chunk's), which the next copy overwrites.
    __syncthreads();
    if (chunk + 1 < ch_end) issue_k_chunk(p, kbase, krs, D, chunk + 1, kbuf(buf ^ 1));
    if (hs < 0) continue;
    float c[2][8][4] = {};
    const __nv_bfloat16* krow = kbuf(buf) + (lane % 8) * ts + (lane / 8) * 8;
#pragma unroll
    for (int ks = 0; ks < D / 16; ks += 2) {
      uint32_t a[2][2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        ldmatrix_x4(a[m][0], qrow + m * 16 * ts + ks * 16);
        ldmatrix_x4(a[m][1], qrow + m * 16 * ts + (ks + 1) * 16);
      }
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        uint32_t b[4];
        ldmatrix_x4(b, krow + n * 8 * ts + ks * 16);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          mma_bf16(c[m][n], a[m][0][0], a[m][0][1], a[m][0][2], a[m][0][3], b[0], b[1]);
          mma_bf16(c[m][n], a[m][1][0], a[m][1][1], a[m][1][2], a[m][1][3], b[2], b[3]);
        }
      }
    }
    const int64_t c0 = chunk * kB, kc = imin(kB, p.kend_last - c0);
    const bool whole = kc == kB && c0 + kB <= v0;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = row0 + m * 16 + g + 8 * half;
        const int lim = whole ? kB : (i < sp.L ? int(row_visible(p, sp, i, c0, kc)) : 0);
        if constexpr (kProbs) {
          if (i < sp.L) {
            const float lse = p.lse[hs * kB + i];
            float* dst = probs_at(p, sp, hs, i, chunk);
#pragma unroll
            for (int n = 0; n < 8; ++n) {
              const int j = n * 8 + 2 * t;  // j + 1 < 64: inside the row's 64 floats
              if (j >= kc) continue;
              float2 v;
              v.x = j < lim && lse != -INFINITY ? expf(c[m][n][2 * half] * p.scale - lse) : 0.f;
              v.y = j + 1 < lim && lse != -INFINITY ? expf(c[m][n][2 * half + 1] * p.scale - lse)
                                                    : 0.f;
              *reinterpret_cast<float2*>(dst + j) = v;
            }
          }
        } else {
          float v[16];
#pragma unroll
          for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              v[n * 2 + e] = n * 8 + 2 * t + e < lim ? c[m][n][2 * half + e] * p.scale : -INFINITY;
          float mx, l;
          quad_row_stats(v, mx, l);
          if (t == 0 && i < sp.L) {
            const size_t at = (size_t(hs) * kB + size_t(i)) * size_t(p.n_chunks) + size_t(chunk);
            p.part_m[at] = mx;
            p.part_l[at] = l;
          }
        }
      }
  }
}

// The same on CUDA cores (fp32, or bf16 that mma_scores turns down).
template <typename T>
__global__ void __launch_bounds__(kScoreThreads)
    score_stats_kernel(const EstimateLaunch p, const ScorePass sp) {
  extern __shared__ __align__(16) unsigned char score_raw[];
  ScoreSmem sm(p, score_raw);
  float* const ss = sm.ss;
  const int hs = blockIdx.x;
  load_q_tile<T>(p, sp, sp.heads[hs], sm);
  const int64_t ch_end = imin(p.n_chunks, (int64_t(blockIdx.y) + 1) * kChunksPerCta);
  for (int64_t chunk = int64_t(blockIdx.y) * kChunksPerCta; chunk < ch_end; ++chunk) {
    const int64_t c0 = chunk * kB;
    const int64_t kc = imin(kB, p.kend_last - c0);
    chunk_logits<T>(p, sp, sp.heads[hs], c0, kc, sm);
    // Rows and keys of a chunk are < 64: 32-bit indices keep the integer pipe out of the way.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int i = warp; i < int(sp.L); i += kScoreThreads / 32) {
      const int lim = int(row_visible(p, sp, i, c0, kc));
      const float* row = ss + i * (kB + 1);
      float m = -INFINITY;
      for (int j = lane; j < lim; j += 32) m = fmaxf(m, row[j]);
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      float l = 0.f;
      if (lim > 0)
        for (int j = lane; j < lim; j += 32) l += expf(row[j] - m);
      for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
      if (lane == 0) {
        const size_t at = (size_t(hs) * kB + size_t(i)) * size_t(p.n_chunks) + size_t(chunk);
        p.part_m[at] = m;
        p.part_l[at] = l;
      }
    }
  }
}

// One CTA per (head, row): the row's log-sum-exp over all chunks. A CTA, not a warp: at 1M a row
// has 16K chunk partials, and a warp a row left the pass bound by one warp's load latency (403 us
// for 4 heads x 64 rows on H200 under ncu, 59 us this way; bench/NOTES.md sixty-third session).
constexpr int kLseThreads = 256;
__global__ void __launch_bounds__(kLseThreads) row_lse_kernel(const EstimateLaunch p,
                                                              const ScorePass sp) {
  __shared__ float wm[kLseThreads / 32];
  __shared__ double wl[kLseThreads / 32];
  const int64_t hs = blockIdx.x / sp.L, i = blockIdx.x % sp.L;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const size_t base = (size_t(hs) * kB + size_t(i)) * size_t(p.n_chunks);
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < p.n_chunks; c += kLseThreads)
    m = fmaxf(m, p.part_m[base + size_t(c)]);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) wm[warp] = m;
  __syncthreads();
  m = wm[0];
  for (int w = 1; w < kLseThreads / 32; ++w) m = fmaxf(m, wm[w]);
  double l = 0;
  if (m != -INFINITY)
    for (int64_t c = threadIdx.x; c < p.n_chunks; c += kLseThreads) {
      const float pl = p.part_l[base + size_t(c)];
      if (pl > 0.f) l += double(pl) * exp(double(p.part_m[base + size_t(c)]) - double(m));
    }
  for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
  if (lane == 0) wl[warp] = l;
  __syncthreads();
  if (threadIdx.x == 0) {
    l = 0;
    for (int w = 0; w < kLseThreads / 32; ++w) l += wl[w];
    p.lse[hs * kB + i] = m == -INFINITY ? -INFINITY : m + float(log(l));
  }
}

// grid (n_heads, n_chunks): probabilities; column sums, block mass, diagonal partials.
template <typename T>
__global__ void __launch_bounds__(kScoreThreads)
    score_probs_kernel(const EstimateLaunch p, const ScorePass sp) {
  extern __shared__ __align__(16) unsigned char score_raw[];
  ScoreSmem sm(p, score_raw);
  float* const ss = sm.ss;
  const int hs = blockIdx.x;
  __shared__ float red[kB];
  load_q_tile<T>(p, sp, sp.heads[hs], sm);
  const int64_t ch_end = imin(p.n_chunks, (int64_t(blockIdx.y) + 1) * kChunksPerCta);
  for (int64_t chunk = int64_t(blockIdx.y) * kChunksPerCta; chunk < ch_end; ++chunk) {
    const int64_t c0 = chunk * kB;
    const int64_t kc = imin(kB, p.kend_last - c0);
    chunk_logits<T>(p, sp, sp.heads[hs], c0, kc, sm);
    // Thread t owns column j = t % 64 of rows t / 64, + 4, ...: 32-bit indices, and the row's
    // LSE and causal limit (key c0 + j visible to row i when j < v0 + i) loaded once per row.
    {
      const int j = int(threadIdx.x) % kB;
      for (int i = int(threadIdx.x) / kB; i < kB; i += kScoreThreads / kB) {
        float v = 0.f;
        if (i < sp.L) {
          const float lse = p.lse[hs * kB + i];
          const int64_t lim = row_pos(p, sp, i) + 1 - c0;  // row i sees keys j < lim
          if (j < lim && j < kc && lse != -INFINITY) v = expf(ss[i * (kB + 1) + j] - lse);
          if (sp.probs && j < kc) probs_at(p, sp, hs, i, chunk)[j] = v;
        }
        ss[i * (kB + 1) + j] = v;
      }
    }
    __syncthreads();
    if (threadIdx.x < kB) {
      const int j = threadIdx.x;
      float s = 0.f;
      for (int64_t i = 0; i < sp.L; ++i) s += ss[i * (kB + 1) + j];
      if (sp.col && j < kc) sp.col[size_t(hs) * size_t(p.kend_last) + size_t(c0 + j)] = s;
      red[j] = s;
    }
    if (sp.part_d && threadIdx.x < 2 * kB - 1) {  // u = i - j + 63
      const int u = threadIdx.x;
      float s = 0.f;
      for (int64_t i = 0; i < sp.L; ++i) {
        const int64_t j = i - u + (kB - 1);
        if (j >= 0 && j < kB) s += ss[i * (kB + 1) + j];
      }
      sp.part_d[(size_t(hs) * size_t(p.n_chunks) + size_t(chunk)) * (2 * kB - 1) + size_t(u)] = s;
    }
    __syncthreads();
    if (sp.mass && threadIdx.x == 0) {
      float s = 0.f;
      for (int j = 0; j < kB; ++j) s += red[j];
      sp.mass[size_t(hs) * size_t(p.n_kb) + size_t(chunk)] = s / float(sp.L);
    }
  }
}

// Block family (mass only): the last query block's mass per key block straight from the stats
// pass, whose chunks are the key blocks: mass[c] = sum_i l_ic exp(m_ic - lse_i) / L, the same
// sum of probabilities as score_probs_kernel without recomputing the logits. Rows in fixed order.
__global__ void block_mass_kernel(const EstimateLaunch p, const ScorePass sp) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= int64_t(sp.n_heads) * p.n_chunks) return;
  const int64_t hs = t / p.n_chunks, c = t % p.n_chunks;
  float s = 0.f;
  for (int64_t i = 0; i < sp.L; ++i) {
    const size_t at = (size_t(hs) * kB + size_t(i)) * size_t(p.n_chunks) + size_t(c);
    const float l = p.part_l[at], lse = p.lse[hs * kB + i];
    if (l > 0.f && lse != -INFINITY) s += l * expf(p.part_m[at] - lse);
  }
  sp.mass[size_t(hs) * size_t(p.n_kb) + size_t(c)] = s / float(sp.L);
}

__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// Diagonal o of vs slot hs: the sum of the (<= 2) chunk partials that reach it.
__global__ void diag_reduce_kernel(const EstimateLaunch p, const ScorePass sp) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= int64_t(sp.n_heads) * p.n_diag) return;
  const int64_t hs = t / p.n_diag, o = t % p.n_diag;
  const int64_t P0 = p.q_offset + sp.r0;
  // chunk c holds o at u = o - P0 + 64 c + 63, valid in [0, L + 62]
  int64_t c_lo = -floor_div(o - P0 + kB - 1, kB);  // ceil((P0 - 63 - o) / 64)
  int64_t c_hi = floor_div(P0 + sp.L - 1 - o, kB);
  if (c_lo < 0) c_lo = 0;
  if (c_hi > p.n_chunks - 1) c_hi = p.n_chunks - 1;
  float s = 0.f;
  for (int64_t c = c_lo; c <= c_hi; ++c) {
    const int64_t u = o - P0 + kB * c + kB - 1;
    if (u >= 0 && u <= sp.L + kB - 2)
      s += sp.part_d[(size_t(hs) * size_t(p.n_chunks) + size_t(c)) * (2 * kB - 1) + size_t(u)];
  }
  p.diag[size_t(hs) * size_t(p.n_diag) + size_t(o)] = s;
}

// Pooled k in mma B-fragment order, per KV head: n-tile nt (key blocks 8 nt ..) x channel-pair
// block sp (32 channels) x lane 4 g + t x 8 bf16. Lane (g, t) holds key block 8 nt + g, channels
// 32 sp + 16 u + 8 hf + 2 t + e at element 2 (2 u + hf) + e: the b0 (hf 0) and b1 (hf 1)
// registers of m16n8k16 k-step 2 sp + u, so a lane loads two k-steps with one 16-byte load and a
// warp's loads are 512 contiguous bytes.
__host__ __device__ __forceinline__ int64_t kfrag_index(int64_t b, int64_t c, int64_t dp) {
  const int64_t nt = b / 8, g = b % 8, sp = c / 32, u = (c % 32) / 16, w = c % 16;
  const int64_t hf = w / 8, t = (w % 8) / 2, e = w % 2;
  return ((nt * (dp / 32) + sp) * 32 + g * 4 + t) * 8 + (u * 2 + hf) * 2 + e;
}

// Channels c .. c + V - 1 summed over `rows` rows of src (x at row 0's channel c, rows `stride`
// elements apart) in row order, f32: the CPU's pooled_mean sum. The device poolings all sum here,
// so their means are the same to the bit. V > 1: one 16-byte vector a row, kBatch rows loaded
// before they are added (a caller with few threads wants them all in flight at once).
template <typename T, int V, int kBatch = 8>
__device__ __forceinline__ void pooled_sum(const T* x, int64_t stride, int rows, float (&s)[V]) {
  int j = 0;
  if constexpr (V > 1) {
    static_assert(V * sizeof(T) == 16, "pooled_sum: 16-byte vectors");
    for (; j + kBatch <= rows; j += kBatch) {
      uint4 u[kBatch];
#pragma unroll
      for (int r = 0; r < kBatch; ++r) u[r] = *reinterpret_cast<const uint4*>(x + (j + r) * stride);
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        const T* e = reinterpret_cast<const T*>(&u[r]);
#pragma unroll
        for (int k = 0; k < V; ++k) s[k] += load_f(e + k);
      }
    }
  }
  for (; j < rows; ++j) {
    const T* r = x + j * stride;
    if constexpr (V == 1) {
      s[0] += load_f(r);
    } else {
      const uint4 u = *reinterpret_cast<const uint4*>(r);
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int k = 0; k < V; ++k) s[k] += load_f(e + k);
    }
  }
}

// Pooled k: the mean over each 64-row block of k [n, kv_heads, d], per KV head, rounded to bf16
// (kernels/sparse_select.h pooled_mean's float steps: pooled_sum, times the f32 reciprocal of the
// count, so the CPU's values to the bit), written in the B-fragment order above into
// [kv_heads][n_b_out blocks][dp]. Thread t: V channels of one (KV head, block), one 16-byte
// vector a row when V > 1 (the pass is bound by reading k); channels >= d and blocks >= n_b are
// zeros.
template <typename T, int V>
__global__ void pool_k_kernel(const T* src, int64_t n, int64_t hkv, int64_t d, int64_t dp,
                              int64_t n_b, int64_t n_b_out, uint16_t* dst) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t dv = dp / V;
  if (t >= hkv * n_b_out * dv) return;
  const int64_t c = (t % dv) * V, b = (t / dv) % n_b_out, h = t / (dv * n_b_out);
  float s[V] = {};
  float inv = 0.f;
  if (b < n_b && c < d) {
    const int64_t j0 = b * kB, j1 = imin(n, j0 + kB);
    pooled_sum<T, V>(src + (j0 * hkv + h) * d + c, hkv * d, int(j1 - j0), s);
    inv = 1.f / float(j1 - j0);
  }
#pragma unroll
  for (int k = 0; k < V; ++k)
    dst[h * n_b_out * dp + kfrag_index(b, c + k, dp)] =
        __bfloat16_as_ushort(__float2bfloat16_rn(s[k] * inv));
}
template <typename T>
void pool_k(const EstimateLaunch& p, cudaStream_t s) {
  constexpr int V = int(16 / sizeof(T));
  const T* src = static_cast<const T*>(p.k);
  const int64_t dp = sparse_estimate_pool_d(p.d), n_b_out = sparse_estimate_pool_kb(p.n_kb);
  const int64_t vec_n = p.hkv * n_b_out * (dp / V), n1 = p.hkv * n_b_out * dp;
  if (p.d % V == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0)
    pool_k_kernel<T, V><<<unsigned((vec_n + 255) / 256), 256, 0, s>>>(src, p.nk, p.hkv, p.d, dp,
                                                                      p.n_kb, n_b_out, p.pooled_k);
  else
    pool_k_kernel<T, 1><<<unsigned((n1 + 255) / 256), 256, 0, s>>>(src, p.nk, p.hkv, p.d, dp,
                                                                   p.n_kb, n_b_out, p.pooled_k);
}

// ---- selection ----------------------------------------------------------------------------

struct SelBudget {
  int mass = 0;
  int64_t k = 0;
  double gamma = 1.0;
  int64_t min_count = 0, max_count = 0;
  double goal = -1;  // mass mode: the mass to reach when >= 0 (else gamma x the list's total)
};

constexpr int kWarpCand = 384;  // candidates warp_topk keeps: the histogram's 3 KB, 8 bytes each
struct SelShared {
  union {
    struct {
      unsigned cnt[256];
      double msum[256];
    };
    uint2 cand[kWarpCand];  // warp_topk: (key, id) of the items at or above its floor
  };
  double dred[32];
  long long ired[32];
  uint32_t ured[32];
  uint32_t prefix;
  uint32_t mask;  // digits of prefix fixed by the walk (all 32 bits unless it stopped early)
  uint32_t floor;  // count mode: keys below it cannot be among the wanted (0: no floor)
  long long cnt_gt;
  double mass_gt;
  int found;
  long long value;
  long long run;
};

// The threads that run one selection: a whole CTA (one list per CTA: columns, diagonals) or one
// warp (the block selector: a warp per query block, so a CTA's query blocks select at once and
// wait on warp barriers instead of CTA barriers). The selection code below is written once over
// this: rank, size, barrier, reductions and the 0/1 exclusive scan of the compaction.
template <int BS>
struct CtaGroup {
  static constexpr int kSize = BS;
  __device__ static int rank() { return int(threadIdx.x); }
  __device__ static void sync() { __syncthreads(); }
};
struct WarpGroup {
  static constexpr int kSize = 32;
  __device__ static int rank() { return int(threadIdx.x % 32); }
  __device__ static void sync() { __syncwarp(); }
};

template <typename G, typename V, typename Op>
__device__ V group_reduce(V v, Op op, V* red) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if constexpr (G::kSize == 32) {
    return v;
  } else {
    __syncthreads();
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
      V r = red[0];
      for (int w = 1; w < G::kSize / 32; ++w) r = op(r, red[w]);
      red[0] = r;
    }
    __syncthreads();
    const V r = red[0];
    __syncthreads();
    return r;
  }
}
template <typename G>
__device__ double group_sum(double v, SelShared& sh) {
  return group_reduce<G>(
      v, [](double a, double b) { return a + b; }, sh.dred);
}
template <typename G>
__device__ double group_min(double v, SelShared& sh) {
  return group_reduce<G>(
      v, [](double a, double b) { return fmin(a, b); }, sh.dred);
}
template <typename G>
__device__ long long group_sum_i(long long v, SelShared& sh) {
  return group_reduce<G>(
      v, [](long long a, long long b) { return a + b; }, sh.ired);
}

// Exclusive sum of 0/1 flags over the group's ranks (one flag a thread), and their total.
template <typename G>
struct FlagScan {
  using Scan = cub::BlockScan<int, G::kSize>;
  typename Scan::TempStorage* tmp;
  __device__ void operator()(int f, int& pos, int& total) {
    if constexpr (G::kSize == 32) {
      const unsigned b = __ballot_sync(0xffffffffu, f);
      pos = __popc(b & ((1u << (threadIdx.x % 32)) - 1u));
      total = __popc(b);
    } else {
      Scan(*tmp).ExclusiveSum(f, pos, total);
      __syncthreads();
    }
  }
};

// Radix walk over the non-forced items' keys, 8 bits a pass from their highest differing bit (the
// bits above it are common to every item and need no pass: similar scores share their top digit,
// so an 8-bit pass from bit 31 mostly lands in one or two buckets). Count mode: the key T
// of the want-th largest (want >= 1). Mass mode: the key at which the accumulated score, starting
// from `start_mass`, first reaches `goal`; sh.found = 0 when it never does. Leaves sh.prefix = T,
// sh.cnt_gt / sh.mass_gt over keys above T, and returns the count of keys equal to T.
// Count mode with want <= 2 * BS first finds a floor: every thread keeps its two largest keys; the
// smallest of the threads' largest (want <= BS) or second largest (want <= 2 BS) is a key that at
// least BS or 2 BS items reach, so nothing below it can be among the want largest. The walk then
// counts only keys at or above the floor (sh.floor; the compaction applies it too), so most
// items drop out before the first histogram. A thread with too few items makes the floor 0 (no
// floor).
template <typename G, typename Forced>
__device__ long long radix_walk(const float* s, int n, Forced forced, bool mass_mode,
                                long long want, double goal, double start_mass, SelShared& sh) {
  constexpr int BS = G::kSize;
  const int rk = G::rank();
  const bool use_floor = !mass_mode && want <= 2 * BS;
  // 32-bit keys (no items: kmax = 0 < kmin = ~0).
  uint32_t kmax = 0, kmin = 0xffffffffu, second = 0;
  for (int i = rk; i < n; i += BS)
    if (!forced(i)) {
      const uint32_t key = order_key(s[i]);
      second = max(second, min(kmax, key));  // the second largest of this thread's keys
      kmax = max(kmax, key);
      kmin = min(kmin, key);
    }
  const uint32_t mine = want <= BS ? kmax : second;  // this thread's floor candidate
  kmax = group_reduce<G>(
      kmax, [](uint32_t a, uint32_t b) { return max(a, b); }, sh.ured);
  kmin = group_reduce<G>(
      kmin, [](uint32_t a, uint32_t b) { return min(a, b); }, sh.ured);
  uint32_t floor = 0;
  if (use_floor) {
    floor = group_reduce<G>(
        mine, [](uint32_t a, uint32_t b) { return min(a, b); }, sh.ured);
    // Every key the walk counts lies in [floor, kmax]: the bits they share start above the
    // highest bit where floor and kmax differ.
    if (kmax >= kmin && floor > kmin) kmin = floor;
  }
  // No items (kmax < kmin) or all equal: one pass over the whole key finds them.
  const uint32_t diff = kmax >= kmin ? kmax ^ kmin : 0u;
  const int hb = diff ? 31 - __clz(diff) : 0;
  // Bits above hb are fixed (hb = 31: 2u << 31 wraps to 0, so none are).
  uint32_t mask = diff ? ~((2u << hb) - 1u) : 0xffffffffu;
  int shift = hb > 7 ? hb - 7 : 0;
  if (rk == 0) {
    sh.prefix = kmax & mask;
    sh.floor = floor;
    sh.cnt_gt = 0;
    sh.mass_gt = start_mass;
    sh.found = 1;
  }
  long long eq = 0;
  for (;;) {
    for (int x = rk; x < 256; x += BS) {
      sh.cnt[x] = 0;
      if (mass_mode) sh.msum[x] = 0;
    }
    G::sync();
    const uint32_t prefix = sh.prefix;
    // Count mode: one shared atomic per item (the digits below the common bits spread over the
    // buckets). Mass mode sums each bucket's scores in lane order, for a result that does not
    // depend on timing: each warp merges the lanes that share a digit (__match_any_sync) and one
    // lane adds the group's count and mass.
    const int wl = threadIdx.x % 32;
    for (int i0 = 0; i0 < n; i0 += BS) {
      const int i = i0 + rk;
      float v = 0.f;
      unsigned dgt = 0;
      bool act = false;
      if (i < n && !forced(i)) {
        v = s[i];
        const uint32_t key = order_key(v);
        act = (key & mask) == prefix && key >= floor;
        dgt = (key >> shift) & 255u;
      }
      if (!mass_mode) {
        if (act) atomicAdd(&sh.cnt[dgt], 1u);
        continue;
      }
      const unsigned am = __ballot_sync(0xffffffffu, act);
      if (!act) continue;
      const unsigned peers = __match_any_sync(am, dgt);
      double m = 0;
      for (int l = 0; l < 32; ++l) {
        if (!((am >> l) & 1u)) continue;  // every active lane takes the same branches
        const float vl = __shfl_sync(am, v, l);
        if ((peers >> l) & 1u) m += double(vl);
      }
      if (wl == __ffs(peers) - 1) {
        atomicAdd(&sh.cnt[dgt], unsigned(__popc(peers)));
        atomicAdd(&sh.msum[dgt], m);
      }
    }
    G::sync();
    // Walk the buckets from the top for the first non-empty one where the running count (mass)
    // reaches the target: one warp, 8 buckets a lane, a warp scan for the lanes' offsets.
    if (rk < 32) {
      const int lane = rk;
      // Counts are 32-bit (n < 2^31 items); count mode leaves the mass bins alone.
      unsigned c[8];
      double m[8];
      unsigned csum = 0;
      double msum = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int bkt = 255 - 8 * lane - e;
        c[e] = sh.cnt[bkt];
        m[e] = mass_mode ? sh.msum[bkt] : 0.0;
        csum += c[e];
        msum += m[e];
      }
      unsigned cinc = csum;
      double minc = msum;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned cv = __shfl_up_sync(0xffffffffu, cinc, o);
        if (lane >= o) cinc += cv;
        if (mass_mode) {  // uniform across the warp
          const double mv = __shfl_up_sync(0xffffffffu, minc, o);
          if (lane >= o) minc += mv;
        }
      }
      const long long base_c = sh.cnt_gt;
      const double base_m = sh.mass_gt;
      long long c_acc = base_c + (long long)(cinc - csum);
      double m_acc = base_m + (minc - msum);
      int hit = -1;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (hit < 0 && c[e] > 0 &&
            (mass_mode ? m_acc + m[e] >= goal : c_acc + (long long)c[e] >= want))
          hit = e;
        if (hit < 0) {
          c_acc += c[e];
          m_acc += m[e];
        }
      }
      const unsigned ballot = __ballot_sync(0xffffffffu, hit >= 0);
      // Every lane has read cnt_gt / mass_gt before one of them writes them: a ballot orders no
      // memory (compute-sanitizer racecheck flagged the CTA walk, which had no barrier here).
      __syncwarp();
      if (ballot == 0) {
        if (lane == 0) {
          sh.found = 0;
          sh.prefix = prefix;
          sh.value = 0;
        }
      } else if (lane == __ffs(ballot) - 1) {
        const int chosen = 255 - 8 * lane - hit;
        sh.cnt_gt = c_acc;
        sh.mass_gt = m_acc;
        sh.prefix = prefix | (uint32_t(chosen) << shift);
        sh.value = c[hit];
      }
    }
    G::sync();
    const int found = sh.found;
    eq = sh.value;
    const long long cnt_gt = sh.cnt_gt;
    if (!found) break;
    mask |= 255u << shift;
    // Count mode: when the chosen bucket holds exactly the items still wanted, every key with
    // this prefix is taken and the lower digits cannot change the selection.
    if (!mass_mode && cnt_gt + eq == want) break;
    if (shift == 0) break;
    shift = shift > 8 ? shift - 8 : 0;  // a last pass under 8 bits re-reads fixed bits: harmless
  }
  if (rk == 0) sh.mask = mask;
  G::sync();
  return eq;
}

// The bitwise walk of the warp top-k's (warp_topk, stream_keep): from bit hb down, narrows the
// bucket (keys equal to *prefix under *mask) that holds the take-th largest of the warp's keys,
// kPer a lane in rows below ne (an empty place holds 0, which no tested prefix equals).
// Invariant: *cnt_gt keys lie above the bucket, *eq in it, *cnt_gt < take <= *cnt_gt + *eq; it
// stops early when the bucket holds exactly the keys still wanted.
template <int kPer>
__device__ __forceinline__ void warp_key_walk(const uint32_t (&key)[kPer], int ne, int hb, int take,
                                              uint32_t* mask, uint32_t* prefix, int* cnt_gt,
                                              int* eq) {
  for (int bit = hb; bit >= 0 && *cnt_gt + *eq != take; --bit) {
    const uint32_t m2 = *mask | (1u << bit), p1 = *prefix | (1u << bit);
    int c = 0;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if (e >= ne) break;
      c += (key[e] & m2) == p1;
    }
    c = int(__reduce_add_sync(0xffffffffu, unsigned(c)));
    if (*cnt_gt + c >= take) {
      *prefix = p1;
      *eq = c;
    } else {
      *cnt_gt += c;
      *eq -= c;
    }
    *mask = m2;
  }
}

// Count mode on one warp, for the block selector's top-k (take <= 64): the take largest keys of
// the non-forced items, ties to the lower id, with every forced item, ids ascending into out (at
// most cap) and their number into *n_out; the same list as group_select's radix walk. Two sweeps
// over the scores instead of four: the first finds a floor (the smallest of the lanes' second
// largest keys: 64 >= take items reach it), the second copies the items at or above it, in id
// order, to sh.cand; a bitwise walk with warp reductions then finds the threshold among those
// few (<= 12 a lane, in registers). Forced items must be a head [0, fa) and a tail [fb, fc] with
// nothing after the tail. Returns false, writing nothing, when more than kWarpCand items pass.
__device__ bool warp_topk(const float* s, int n, int fa, int fb, int fc, int take, int32_t* out,
                          int64_t cap, int32_t* n_out, SelShared& sh) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kPer = kWarpCand / 32;
  const int lane = int(threadIdx.x % 32);
  const unsigned lt = (1u << lane) - 1u;
  // With the forced items a head and a tail, the rest is one range [r_lo, r_hi): the sweeps walk
  // it without a per-item test.
  const int r_lo = fa, r_hi = fb <= fc ? max(fa, fb) : n;
  uint32_t kmax = 0, second = 0;
  for (int i = r_lo + lane; i < r_hi; i += 32) {
    const uint32_t key = order_key(s[i]);
    second = max(second, min(kmax, key));
    kmax = max(kmax, key);
  }
  const uint32_t floor = __reduce_min_sync(kAll, second);  // 0 when a lane has < 2 items
  kmax = __reduce_max_sync(kAll, kmax);
  int m = 0;
  for (int i0 = r_lo; i0 < r_hi; i0 += 32) {
    const int i = i0 + lane;
    uint32_t key = 0;
    bool c = false;
    if (i < r_hi) {
      key = order_key(s[i]);
      c = key >= floor;
    }
    const unsigned bc = __ballot_sync(kAll, c);
    const int pos = m + __popc(bc & lt);
    if (c && pos < kWarpCand) sh.cand[pos] = make_uint2(key, uint32_t(i));
    m += __popc(bc);
  }
  __syncwarp();
  if (m > kWarpCand) return false;
  // Rows of candidates in use (warp-uniform): the loops below stop there instead of running all
  // kPer rows (a floor usually leaves about a tenth of the items, a few rows of the twelve).
  const int ne = (m + 31) / 32;
  uint32_t ck[kPer];
  unsigned valid = 0;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int x = e * 32 + lane;
    ck[e] = 0u;  // an empty place: no prefix the walk tests is 0 (each has its bit set)
    if (e < ne && x < m) {
      ck[e] = sh.cand[x].x;
      valid |= 1u << e;
    }
  }
  // Every candidate lies in [floor, kmax]: their bits above the highest one where the two differ
  // are common. Invariant: cnt_gt candidates are above the prefix, eq share it, cnt_gt < take <=
  // cnt_gt + eq (m >= take: at least 64 items reach the floor).
  const uint32_t diff = kmax ^ floor;
  const int hb = diff ? 31 - __clz(diff) : -1;  // -1: every candidate has the key kmax
  uint32_t mask = hb < 0 ? 0xffffffffu : (hb == 31 ? 0u : ~((2u << hb) - 1u));
  uint32_t prefix = kmax & mask;
  int cnt_gt = 0, eq = m;
  warp_key_walk(ck, ne, hb, take, &mask, &prefix, &cnt_gt, &eq);
  const int need_eq = take - cnt_gt;  // the lowest ids among the eq at the threshold
  for (int i = lane; i < fa; i += 32)
    if (i < cap) out[i] = i;
  int o = fa, tie_base = 0;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    if (e >= ne) break;
    const bool v = (valid >> e) & 1u;
    const bool gt = v && (ck[e] & mask) > prefix;
    const bool at = v && (ck[e] & mask) == prefix;
    const unsigned be = __ballot_sync(kAll, at);
    const bool sel = gt || (at && tie_base + __popc(be & lt) < need_eq);
    const unsigned bs = __ballot_sync(kAll, sel);
    const int pos = o + __popc(bs & lt);
    if (sel && pos < cap) out[pos] = int32_t(sh.cand[e * 32 + lane].y);
    o += __popc(bs);
    tie_base += __popc(be);
  }
  const int lo = fb > fa ? fb : fa;
  for (int i = lo + lane; i <= fc; i += 32)
    if (o + (i - lo) < cap) out[o + (i - lo)] = i;
  o += fc >= lo ? fc - lo + 1 : 0;
  if (lane == 0) *n_out = int32_t(o < cap ? o : cap);
  __syncwarp();
  return true;
}

// The CPU's select_ranked on the device. Forced items: [0, fa) and [fb, fc] (fb > fc: none).
// Writes the selected ids ascending to out (at most cap) and their number to *n_out.
// Item ids are 32-bit (lists of keys, diagonals or key blocks of one head: n < 2^31).
template <typename G>
__device__ void group_select(const float* s, int64_t n64, int64_t fa64, int64_t fb64, int64_t fc64,
                             const SelBudget& b, int32_t* out, int64_t cap, int32_t* n_out,
                             SelShared& sh, FlagScan<G> scan) {
  constexpr int BS = G::kSize;
  const int rk = G::rank();
  const int n = int(n64);
  const int fa = int(imin(fa64 < 0 ? 0 : fa64, n64));  // forced: [0, fa) and [fb, fc]
  const int fb = int(imin(fb64, n64)), fc = int(imin(fc64, n64 - 1));
  auto forced = [&](int i) { return i < fa || (i >= fb && i <= fc); };
  // Count mode needs only the number of forced items: no pass over the scores.
  long long nf = 0;
  double tot = 0, fm = 0;
  if (!b.mass) {
    const int lo = fb > fa ? fb : fa;
    nf = (long long)fa + (fc >= lo ? (long long)(fc - lo + 1) : 0);
  } else {
    long long nf_l = 0;
    double tot_l = 0, fm_l = 0;
    for (int i = rk; i < n; i += BS) {
      const double v = s[i];
      tot_l += v;
      if (forced(i)) {
        ++nf_l;
        fm_l += v;
      }
    }
    nf = group_sum_i<G>(nf_l, sh);
    tot = group_sum<G>(tot_l, sh);
    fm = group_sum<G>(fm_l, sh);
  }
  const long long nr = n - nf;
  long long take = 0;
  if (!b.mass) {
    take = b.k - nf;
  } else {
    const double goal = b.goal >= 0 ? b.goal : b.gamma * tot;
    long long c = nf;
    if (fm < goal && nr > 0) {
      const long long eq = radix_walk<G>(s, n, forced, true, 0, goal, fm, sh);
      if (!sh.found) {
        c = n;
      } else {
        const float sT = key_value(sh.prefix);
        if (!(sT > 0.f)) {
          c = n;
        } else {
          long long m = (long long)ceil((goal - sh.mass_gt) / double(sT));
          m = m < 1 ? 1 : (m > eq ? eq : m);
          c = nf + sh.cnt_gt + m;
        }
      }
    }
    const long long hi = b.max_count > b.min_count ? b.max_count : b.min_count;
    c = c < b.min_count ? b.min_count : (c > hi ? hi : c);
    take = c - nf;
  }
  take = take < 0 ? 0 : (take > nr ? nr : take);
  if constexpr (G::kSize == 32) {
    if (!b.mass && take > 0 && take <= 64 && (fb > fc || fc >= n - 1) &&
        warp_topk(s, n, fa, fb, fc, int(take), out, cap, n_out, sh))
      return;
  }
  G::sync();  // every thread has read the mass walk's results
  uint32_t T = 0xffffffffu, M = 0xffffffffu, F = 0;
  long long need_eq = 0, n_eq = 0;
  if (take > 0) {
    n_eq = radix_walk<G>(s, n, forced, false, take, 0.0, 0.0, sh);
    T = sh.prefix;
    M = sh.mask;
    F = sh.floor;
    need_eq = take - sh.cnt_gt;
  }
  // Every key at the threshold is taken (the usual case: unique scores, or an early stop):
  // no tie ranking, one scan per group of items instead of two.
  const bool all_eq = need_eq >= n_eq;
  // Compaction in index order: ties at T go to the lowest ids.
  long long tie_base = 0, out_base = 0;
  for (int t0 = 0; t0 < n; t0 += BS) {
    const int i = t0 + rk;
    int f = 0, gt = 0, eq = 0;
    if (i < n) {
      f = forced(i);
      if (!f && take > 0) {
        const uint32_t key = order_key(s[i]);
        gt = (key & M) > T;  // above every key at the threshold, so above the floor too
        eq = (key & M) == T && key >= F;
      }
    }
    int tie_rank = 0, tie_total = 0;
    if (!all_eq) scan(eq, tie_rank, tie_total);
    const int sel = f || gt || (eq && (all_eq || tie_base + tie_rank < need_eq));
    int pos, sel_total;
    scan(sel, pos, sel_total);
    if (sel && out_base + pos < cap) out[out_base + pos] = int32_t(i);
    tie_base += tie_total;
    out_base += sel_total;
  }
  if (rk == 0) *n_out = int32_t(out_base < cap ? out_base : cap);
  G::sync();
}

// One selection per CTA (its own scan storage).
template <int BS>
__device__ void cta_select(const float* s, int64_t n, int64_t fa, int64_t fb, int64_t fc,
                           const SelBudget& b, int32_t* out, int64_t cap, int32_t* n_out,
                           SelShared& sh) {
  __shared__ typename FlagScan<CtaGroup<BS>>::Scan::TempStorage scan_tmp;
  group_select<CtaGroup<BS>>(s, n, fa, fb, fc, b, out, cap, n_out, sh,
                             FlagScan<CtaGroup<BS>>{&scan_tmp});
}

constexpr int kVsSelectThreads = 1024;
constexpr int kBlockSelectThreads = 256;

// Runs of vs slot hs's selected diagonals: consecutive ones at most 64 apart cover one
// contiguous key range in every 64-row query block, so the slot builder walks runs instead of
// diagonals. The whole CTA.
__device__ void vs_runs(const EstimateLaunch& p, int hs) {
  using Scan = cub::BlockScan<int, kVsSelectThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int64_t n = p.n_diag;
  const int32_t* sel = p.sel_diags + size_t(hs) * size_t(n);
  const int64_t ns = p.n_sel_diags[hs];
  int32_t* lo = p.run_lo + size_t(hs) * size_t(n);
  int32_t* hi = p.run_hi + size_t(hs) * size_t(n);
  long long base_s = 0, base_e = 0;
  for (int64_t t0 = 0; t0 < ns; t0 += kVsSelectThreads) {
    const int64_t i = t0 + threadIdx.x;
    int st = 0, en = 0;
    if (i < ns) {
      st = i == 0 || sel[i] - sel[i - 1] > kB;
      en = i == ns - 1 || sel[i + 1] - sel[i] > kB;
    }
    int ps, ts, pe, te;
    Scan(tmp).ExclusiveSum(st, ps, ts);
    __syncthreads();
    Scan(tmp).ExclusiveSum(en, pe, te);
    __syncthreads();
    if (st) lo[base_s + ps] = sel[i];
    if (en) hi[base_e + pe] = sel[i];
    base_s += ts;
    base_e += te;
  }
  if (threadIdx.x == 0) p.n_runs[hs] = int32_t(base_s);
}

// grid (n_vs - n_cov, 2): y = 0 columns, y = 1 diagonals (cover slots select in cover_*).
__global__ void __launch_bounds__(kVsSelectThreads) vs_select_kernel(const EstimateLaunch p) {
  __shared__ SelShared sh;
  const int hs = blockIdx.x;
  const EstHead& eh = p.heads[p.vs_heads[hs]];
  SelBudget b;
  b.mass = eh.mass;
  b.gamma = eh.gamma;
  b.min_count = eh.min_count;
  b.max_count = eh.max_count;
  if (blockIdx.y == 0) {
    b.k = eh.k_cols;
    const int64_t n = p.kend_last;
    cta_select<kVsSelectThreads>(p.col + size_t(hs) * size_t(n), n, eh.sink, 1, 0, b,
                                 p.sel_cols + size_t(hs) * size_t(n), n, p.n_sel_cols + hs, sh);
  } else {
    b.k = eh.k_diags;
    const int64_t n = p.n_diag;
    cta_select<kVsSelectThreads>(p.diag + size_t(hs) * size_t(n), n, eh.local + 1, 1, 0, b,
                                 p.sel_diags + size_t(hs) * size_t(n), n, p.n_sel_diags + hs, sh);
    vs_runs(p, hs);
  }
}

// ---- vs_cover: one cover of columns and diagonals, in rounds (sparse_select.h vs_cover_select)

// q rows of the cover's scoring rows, every head: [cov_rows, hq, d] (elements of es bytes; a
// row is a whole number of 4-byte words since d % 4 == 0).
__global__ void cover_gather_kernel(const EstimateLaunch p, int es) {
  const int64_t words = p.hq * p.d * es / 4, n = p.cov_rows * words;
  const auto* src = static_cast<const int32_t*>(p.q);
  auto* dst = static_cast<int32_t*>(p.cov_q);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[p.cov_local[i / words] * words + i % words];
}

// Adds the block's sum of v (every thread of a block of at most 256 calls it) to *dst, one atomic.
__device__ void block_add(double v, double* dst) {
  __shared__ double red[8];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double b = 0;
    for (int w = 0; w < int(blockDim.x) / 32; ++w) b += red[w];
    if (b != 0) atomicAdd(dst, b);
  }
}

// The first i in [0, n) with a[i] >= v (a non-decreasing); n if none.
template <typename T>
__device__ __forceinline__ int64_t first_at_least(const T* a, int64_t n, T v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// grid (ceil(n_cx / 256), n_cov): item x's mass over the scoring rows, rows in order, summed in
// double: the plain column and diagonal sums (into col / diag of the slot, the top-up's ranking)
// and the residual before round 1 (entries no forced item covers, into cov_resd); the round table
// reset (forced items 0, the rest -1) and the total (the plain column sums) accumulated.
// Coalesced where a warp's items share their row ranges (almost everywhere): a column's threads
// read row r's consecutive keys, a diagonal's the same row's keys in descending order; near a
// scoring row's own key or offset, lanes start at different rows. (Measured slower under ncu at
// 1M: 8 rows' loads issued ahead, fadbb63, 17.2 ms a 4-head group against 10.8; 4 items a
// thread, 13.5 ms, 14e2ba7.)
__global__ void cover_sums_kernel(const EstimateLaunch p) {
  const int c = blockIdx.y;
  const int64_t nc = p.kend_last, nd = p.n_diag, ncx = nc + nd;
  const int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int hs = p.n_vs - p.n_cov + c;
  const EstHead& eh = p.heads[p.cov_heads[c]];
  const bool col = x < nc;
  double s = 0, r0 = 0;
  if (x < ncx) {
    const bool forced = col ? x < eh.sink : x - nc <= eh.local;
    p.cov_round[size_t(c) * size_t(ncx) + size_t(x)] = forced ? 0 : -1;
    if (!col) p.cov_free[size_t(c) * size_t(nd) + size_t(x - nc)] = 0;
    // The rows are ascending in position, so the rows holding an entry of the item, and those
    // whose entry is residual (no forced item covers it), are two ranges found by bisection;
    // the loops then carry no per-row test (more loads in flight did not speed the kernel up,
    // so it was likely bound by issuing those tests; bench/NOTES.md sixty-fourth session).
    // Column x: key x, rows at pos >= x; residual when x >= sink, from pos > x + local.
    // Diagonal o: key pos - o, rows at o <= pos < nc + o; residual when o > local, from
    // pos >= o + sink.
    const int64_t o = col ? 0 : x - nc;
    const int64_t* pos = p.cov_pos;
    const int64_t n = p.cov_rows;
    const int64_t r_in = first_at_least<int64_t>(pos, n, col ? x : o);
    const int64_t r_end = col ? n : first_at_least<int64_t>(pos, n, nc + o);
    int64_t r_res = r_end;
    if (!forced) r_res = first_at_least<int64_t>(pos, n, col ? x + eh.local + 1 : o + eh.sink);
    r_res = r_res < r_in ? r_in : r_res > r_end ? r_end : r_res;
    const float* P = p.cov_p + size_t(c) * size_t(p.n_chunks) * size_t(n) * kB;
    if (col) {  // row r's entry: chunk x / 64's tile, row r, lane x % 64
      const float* e = P + size_t(x / kB) * size_t(n) * kB + size_t(x % kB);
      for (int64_t r = r_in; r < r_res; ++r) s += double(e[size_t(r) * kB]);
      for (int64_t r = r_res; r < r_end; ++r) {
        const double v = double(e[size_t(r) * kB]);
        s += v;
        r0 += v;
      }
    } else {
      auto at = [&](int64_t r) {
        const int64_t j = pos[r] - o;
        return double(P[(size_t(j / kB) * size_t(n) + size_t(r)) * kB + size_t(j % kB)]);
      };
      for (int64_t r = r_in; r < r_res; ++r) s += at(r);
      for (int64_t r = r_res; r < r_end; ++r) {
        const double v = at(r);
        s += v;
        r0 += v;
      }
    }
    p.cov_resd[size_t(c) * size_t(ncx) + size_t(x)] = r0;
    if (col)
      p.col[size_t(hs) * size_t(nc) + size_t(x)] = float(s);
    else
      p.diag[size_t(hs) * size_t(nd) + size_t(x - nc)] = float(s);
  }
  // The total: the block's column sums (of the floats ranked, as the CPU adds them).
  block_add(col && x < ncx ? double(float(s)) : 0.0, p.cov_sum + 2 * c);
}

// grid (ceil(n_cx / 256), n_cov), before round k's selection: the residuals as the floats the
// selection ranks (0 for taken items), and the columns' residual total (uncovered) accumulated.
__global__ void cover_prep_kernel(const EstimateLaunch p) {
  const int c = blockIdx.y;
  if (p.cov_state[2 * c] != 0) return;  // done: uniform over the grid row
  const int64_t nc = p.kend_last, ncx = nc + p.n_diag;
  const int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  double u = 0;
  if (x < ncx) {
    const size_t at = size_t(c) * size_t(ncx) + size_t(x);
    const double r = p.cov_round[at] >= 0 ? 0.0 : p.cov_resd[at];
    const float f = float(r > 0 ? r : 0.0);  // updates can leave -1e-17 where 0 is meant
    p.cov_res[at] = f;
    if (x < nc) u = double(f);
  }
  block_add(u, p.cov_sum + 2 * c + 1);
}

// A round's pick: the smallest prefix of the joint list (residual descending, then index)
// whose residuals sum to >= target, found as the key T where the mass above first reaches it: a
// radix search over the residuals' float keys in three levels (bits 21..31, 10..20, 0..9), each a
// histogram of counts and masses (wide) and a walk down its buckets (one CTA a head); then every
// residual above T is taken, and at T the first m by index (m = ceil of what is still missing
// over T's value), as group_select takes them. cov_walki: [0] prefix, [1] mask, [2] mass-above
// count, [3] T's count, [4] m, [5] 1: fewer than T's count are taken (tie pass), [6] 1: the
// candidates do not reach the target, every one is taken.
constexpr int kCoverPer = 16;  // residuals a thread bins: neighbours share buckets, so runs merge
__device__ __forceinline__ int cover_shift(int level) {
  return level == 0 ? 21 : level == 1 ? 10 : 0;
}
__device__ __forceinline__ uint32_t cover_width_mask(int level) {
  return level == 2 ? 0x3ffu : 0x7ffu;
}

// grid (ceil(n_cx / (256 kCoverPer)), n_cov): level `level`'s histogram of the residuals (> 0)
// whose key matches the walk's prefix so far.
__global__ void __launch_bounds__(256) cover_hist_kernel(const EstimateLaunch p, int level) {
  __shared__ unsigned cnt[kCoverBins];
  __shared__ double mass[kCoverBins];
  const int c = blockIdx.y;
  if (p.cov_state[2 * c] != 0) return;
  const int64_t* wi = p.cov_walki + size_t(c) * 8;
  if (wi[6]) return;  // every candidate taken: no threshold
  const uint32_t prefix = uint32_t(wi[0]), mask = uint32_t(wi[1]);
  const int shift = cover_shift(level);
  const uint32_t wm = cover_width_mask(level);
  for (int b = threadIdx.x; b < kCoverBins; b += blockDim.x) {
    cnt[b] = 0;
    mass[b] = 0;
  }
  __syncthreads();
  const int64_t ncx = p.kend_last + p.n_diag;
  const float* res = p.cov_res + size_t(c) * size_t(ncx);
  const int64_t x0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kCoverPer;
  uint32_t rb = 0xffffffffu;
  unsigned rc = 0;
  double rm = 0;
  for (int i = 0; i < kCoverPer && x0 + i < ncx; ++i) {
    const float v = res[x0 + i];
    if (!(v > 0.f)) continue;
    const uint32_t key = order_key(v);
    if ((key & mask) != prefix) continue;
    const uint32_t b = (key >> shift) & wm;
    if (b != rb) {
      if (rc) {
        atomicAdd(&cnt[rb], rc);
        atomicAdd(&mass[rb], rm);
      }
      rb = b;
      rc = 0;
      rm = 0;
    }
    ++rc;
    rm += double(v);
  }
  if (rc) {
    atomicAdd(&cnt[rb], rc);
    atomicAdd(&mass[rb], rm);
  }
  __syncthreads();
  uint32_t* gc = p.cov_hcnt + (size_t(c) * 3 + size_t(level)) * kCoverBins;
  double* gm = p.cov_hmass + (size_t(c) * 3 + size_t(level)) * kCoverBins;
  for (int b = threadIdx.x; b < kCoverBins; b += blockDim.x)
    if (cnt[b]) {
      atomicAdd(gc + b, cnt[b]);
      atomicAdd(gm + b, mass[b]);
    }
}

// grid (n_cov), 256 threads: level `level`'s walk; level -1 sets the round up: need from the
// totals (done when <= 0), the target, an empty pick list. Each level leaves its histogram zeroed
// for the next round.
constexpr int kCoverWalkThreads = 256;
static_assert(kCoverBins == 8 * kCoverWalkThreads, "a walk thread reads 8 buckets");
__global__ void __launch_bounds__(kCoverWalkThreads)
    cover_walk_kernel(const EstimateLaunch p, int level, int round) {
  using Scan = cub::BlockScan<double, kCoverWalkThreads>;
  using ScanI = cub::BlockScan<long long, kCoverWalkThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ typename ScanI::TempStorage tmpi;
  __shared__ int hit;
  const int c = blockIdx.x;
  if (p.cov_state[2 * c] != 0) return;
  int64_t* wi = p.cov_walki + size_t(c) * 8;
  double* wd = p.cov_walkd + size_t(c) * 2;
  if (level < 0) {
    const EstHead& eh = p.heads[p.cov_heads[c]];
    const double total = p.cov_sum[2 * c], uncovered = p.cov_sum[2 * c + 1];
    __syncthreads();  // every thread has read uncovered before it is reset for the next round
    const double need = eh.gamma * total - (total - uncovered);
    if (threadIdx.x == 0) {
      p.cov_sum[2 * c + 1] = 0;
      if (!(need > 0)) {
        p.cov_state[2 * c] = 1;
      } else {
        wd[0] = need > total * p.cov_finish ? 0.5 * need : need;
        wd[1] = 0;
        for (int i = 0; i < 8; ++i) wi[i] = 0;
        p.cov_n_list[c] = 0;
      }
    }
    return;
  }
  if (wi[6]) return;  // uniform: every candidate taken
  uint32_t* gc = p.cov_hcnt + (size_t(c) * 3 + size_t(level)) * kCoverBins;
  double* gm = p.cov_hmass + (size_t(c) * 3 + size_t(level)) * kCoverBins;
  const double target = wd[0], above = wd[1];
  // Thread t holds buckets 2047 - 8t - e, e = 0..7: the buckets in descending key order.
  unsigned bc[8];
  double bm[8];
  double ms = 0;
  long long cs = 0;
  for (int e = 0; e < 8; ++e) {
    const int b = kCoverBins - 1 - 8 * int(threadIdx.x) - e;
    bc[e] = gc[b];
    bm[e] = gm[b];
    ms += bm[e];
    cs += bc[e];
  }
  double mex;
  long long cex;
  Scan(tmp).ExclusiveSum(ms, mex);
  ScanI(tmpi).ExclusiveSum(cs, cex);
  if (threadIdx.x == 0) hit = kCoverBins;
  __syncthreads();
  int mine = kCoverBins;
  double run = above + mex;
  for (int e = 0; e < 8; ++e) {
    if (bc[e] > 0 && run + bm[e] >= target) {
      mine = 8 * int(threadIdx.x) + e;
      break;
    }
    run += bm[e];
  }
  if (mine < kCoverBins) atomicMin(&hit, mine);
  __syncthreads();
  if (hit == kCoverBins && level > 0) {
    // The bucket's mass reached the target one level up; summed in another order here it may
    // fall short by rounding: its last non-empty bucket is where the target is reached.
    __syncthreads();
    if (threadIdx.x == 0) hit = -1;
    __syncthreads();
    int last = -1;
    for (int e = 0; e < 8; ++e)
      if (bc[e] > 0) last = 8 * int(threadIdx.x) + e;
    if (last >= 0) atomicMax(&hit, last);
    __syncthreads();
    if (hit < 0 && threadIdx.x == 0) hit = kCoverBins;
    __syncthreads();
  }
  const int h = hit;
  if (int(threadIdx.x) == h / 8) {
    const int e = h % 8;
    double m_above = above + mex;
    long long c_above = wi[2] + cex;
    for (int f = 0; f < e; ++f) {
      m_above += bm[f];
      c_above += bc[f];
    }
    const uint32_t b = uint32_t(kCoverBins - 1 - h);
    const int shift = cover_shift(level);
    wi[0] = int64_t(uint32_t(wi[0]) | (b << shift));
    wi[1] = int64_t(uint32_t(wi[1]) | (cover_width_mask(level) << shift));
    wi[2] = c_above;
    wd[1] = m_above;
    if (level == 2) {
      const float tv = key_value(uint32_t(wi[0]));
      long long m = (long long)ceil((target - m_above) / double(tv));
      m = m < 1 ? 1 : (m > (long long)bc[e] ? (long long)bc[e] : m);
      wi[3] = bc[e];
      wi[4] = m;
      wi[5] = m < (long long)bc[e] ? 1 : 0;
    }
  }
  if (h == kCoverBins && threadIdx.x == 0) wi[6] = 1;  // the candidates fall short: take them all
  if (threadIdx.x == 0 && (level == 2 || h == kCoverBins)) p.cov_state[2 * c + 1] = round;
  __syncthreads();
  for (int b = threadIdx.x; b < kCoverBins; b += blockDim.x) {  // clean for the next round
    gc[b] = 0;
    gm[b] = 0;
  }
}

// Appends x to head c's pick list (warp-aggregated: one atomic a warp).
__device__ __forceinline__ void cover_append(const EstimateLaunch& p, int c, bool take, int32_t x) {
  const unsigned act = __activemask();
  const unsigned b = __ballot_sync(act, take);
  if (!b) return;
  const int lane = int(threadIdx.x % 32), leader = __ffs(b) - 1;
  int base = 0;
  if (lane == leader) base = atomicAdd(p.cov_n_list + c, __popc(b));
  base = __shfl_sync(act, base, leader);
  if (take)
    p.cov_list[size_t(c) * size_t(p.kend_last + p.n_diag) + size_t(base) +
               size_t(__popc(b & ((1u << lane) - 1u)))] = x;
}

// grid (ceil(n_cx / 256), n_cov): takes every residual above T (and at T unless the tie pass
// decides), or every candidate when they fall short.
__global__ void cover_mark_kernel(const EstimateLaunch p, int round) {
  const int c = blockIdx.y;
  if (p.cov_state[2 * c] != 0) return;
  const int64_t* wi = p.cov_walki + size_t(c) * 8;
  const int64_t ncx = p.kend_last + p.n_diag;
  const int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  bool take = false;
  if (x < ncx) {
    const float v = p.cov_res[size_t(c) * size_t(ncx) + size_t(x)];
    if (v > 0.f) {
      const uint32_t key = order_key(v), T = uint32_t(wi[0]);
      take = wi[6] || key > T || (key == T && !wi[5]);
    }
  }
  if (take) p.cov_round[size_t(c) * size_t(ncx) + size_t(x)] = round;
  cover_append(p, c, take, int32_t(x));
}

// grid (n_cov): where fewer than T's count are taken, the first m at T by index.
__global__ void __launch_bounds__(kVsSelectThreads)
    cover_tie_kernel(const EstimateLaunch p, int round) {
  using Scan = cub::BlockScan<int, kVsSelectThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int c = blockIdx.x;
  if (p.cov_state[2 * c] != 0) return;
  const int64_t* wi = p.cov_walki + size_t(c) * 8;
  if (wi[6] || !wi[5]) return;
  const uint32_t T = uint32_t(wi[0]);
  const long long m = wi[4];
  const int64_t ncx = p.kend_last + p.n_diag;
  const float* res = p.cov_res + size_t(c) * size_t(ncx);
  long long seen = 0;
  for (int64_t x0 = 0; x0 < ncx && seen < m; x0 += kVsSelectThreads) {
    const int64_t x = x0 + threadIdx.x;
    const int eq = x < ncx && res[x] > 0.f && order_key(res[x]) == T;
    int before, n_eq;
    Scan(tmp).ExclusiveSum(eq, before, n_eq);
    __syncthreads();
    const bool take = eq && seen + before < m;
    if (take) p.cov_round[size_t(c) * size_t(ncx) + size_t(x)] = round;
    cover_append(p, c, take, int32_t(x));
    seen += n_eq;
  }
}

// grid (ceil(n_diag / 256), n_cov), 256 threads, after round k's picks (sparse_select.h: free
// diagonals): takes, in round k, every diagonal not yet taken whose offsets d - 63 .. d the taken
// diagonals' ranges (e reaches e - 63 .. e) all reach, so the update counts its mass. The CTA's
// diagonals d0 .. d0 + 255 need the taken flags of d0 - 63 .. d0 + 318. Other CTAs may mark
// diagonals in that window meanwhile; a free diagonal's range lies inside the taken ones', so
// whichever value is read, the reached offsets, and so the result, are the same.
constexpr int kCoverFreeThreads = 256;
constexpr int kCoverSpan = 64;  // sparse_select.h kVsCoverSpan
__global__ void __launch_bounds__(kCoverFreeThreads) cover_free_kernel(const EstimateLaunch p,
                                                                       int round) {
  __shared__ uint8_t taken[kCoverFreeThreads + 2 * kCoverSpan - 2];
  __shared__ uint8_t reached[kCoverFreeThreads + kCoverSpan - 1];
  const int c = blockIdx.y;
  if (p.cov_state[2 * c] != 0 || p.cov_state[2 * c + 1] != round) return;  // took nothing
  const int64_t nc = p.kend_last, nd = p.n_diag, ncx = nc + nd;
  int32_t* rd = p.cov_round + size_t(c) * size_t(ncx) + size_t(nc);
  const int64_t d0 = int64_t(blockIdx.x) * kCoverFreeThreads, e0 = d0 - (kCoverSpan - 1);
  for (int i = threadIdx.x; i < kCoverFreeThreads + 2 * kCoverSpan - 2; i += blockDim.x) {
    const int64_t e = e0 + i;
    taken[i] = e >= 0 && e < nd && rd[e] >= 0;
  }
  __syncthreads();
  // reached[i]: offset e0 + i has a taken diagonal in [e0 + i, e0 + i + 63].
  for (int i = threadIdx.x; i < kCoverFreeThreads + kCoverSpan - 1; i += blockDim.x) {
    uint8_t any = 0;
    for (int t = 0; t < kCoverSpan; ++t) any |= taken[i + t];
    reached[i] = any;
  }
  __syncthreads();
  const int64_t d = d0 + threadIdx.x;
  bool take = false;
  if (d < nd && !taken[threadIdx.x + kCoverSpan - 1]) {
    take = true;  // offsets d - 63 .. d are reached[threadIdx.x .. + 63]; below 0 count as reached
    for (int t = 0; t < kCoverSpan && take; ++t)
      take = d - (kCoverSpan - 1) + t < 0 || reached[threadIdx.x + t];
  }
  if (take) {
    rd[d] = round;
    p.cov_free[size_t(c) * size_t(nd) + size_t(d)] = 1;
  }
  cover_append(p, c, take, int32_t(nc + d));
}

// grid (kCoverUpdateBlocks, n_cov), after round k's selection: each entry the round's new items
// cover, uncovered before it, leaves the residual of its other item (a new column's entry leaves
// its diagonal's, a new diagonal's its column's) unless that item is new too. Per (item, row), in
// double: the residuals stay the CPU's fresh sums up to the order of the additions.
constexpr int kCoverUpdateBlocks = 64;
__global__ void cover_update_kernel(const EstimateLaunch p, int round) {
  const int c = blockIdx.y;
  if (p.cov_state[2 * c] != 0 || p.cov_state[2 * c + 1] != round) return;  // took nothing
  const int64_t nc = p.kend_last, nd = p.n_diag, ncx = nc + nd;
  const int32_t* rd = p.cov_round + size_t(c) * size_t(ncx);
  const int32_t* list = p.cov_list + size_t(c) * size_t(ncx);
  double* resd = p.cov_resd + size_t(c) * size_t(ncx);
  const int64_t work = int64_t(p.cov_n_list[c]) * p.cov_rows;
  auto old = [&](int32_t r) { return r >= 0 && r < round; };
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < work;
       w += int64_t(gridDim.x) * blockDim.x) {
    const int32_t x = list[w / p.cov_rows];
    const int64_t r = w % p.cov_rows, pos = p.cov_pos[r];
    const int64_t j = x < nc ? x : pos - (x - nc);
    if (j < 0 || j >= nc || j > pos) continue;
    const int64_t o = pos - j;
    const int32_t rc = rd[j], rdg = rd[nc + o];
    if (old(rc) || old(rdg)) continue;  // covered before this round
    const int64_t other = x < nc ? nc + o : j;
    if (rd[other] == round) continue;  // taken in this round too
    atomicAdd(resd + other, -double(p.cov_p[cov_at(p, c, r, j)]));
  }
}

// grid (n_cov, 2): the cover's items (+inf) and, up to min_budget, the rest by their plain sums:
// a top-k over the family, ascending into the slot's selection; then the diagonals' runs.
__global__ void __launch_bounds__(kVsSelectThreads) cover_final_kernel(const EstimateLaunch p) {
  using G = CtaGroup<kVsSelectThreads>;
  __shared__ SelShared sh;
  __shared__ typename FlagScan<G>::Scan::TempStorage scan_tmp;
  const int c = blockIdx.x;
  const int hs = p.n_vs - p.n_cov + c;
  const EstHead& eh = p.heads[p.cov_heads[c]];
  const int64_t nc = p.kend_last, nd = p.n_diag, ncx = nc + nd;
  const bool col = blockIdx.y == 0;
  const int64_t n = col ? nc : nd, off = col ? 0 : nc;
  const int32_t* rd = p.cov_round + size_t(c) * size_t(ncx) + size_t(off);
  float* v = p.cov_res + size_t(c) * size_t(ncx) + size_t(off);
  const float* plain = col ? p.col + size_t(hs) * size_t(nc) : p.diag + size_t(hs) * size_t(nd);
  long long taken = 0;
  for (int64_t i = threadIdx.x; i < n; i += kVsSelectThreads) {
    const bool t = rd[i] >= 0;
    v[i] = t ? INFINITY : plain[i];
    taken += t ? 1 : 0;
  }
  taken = group_sum_i<G>(taken, sh);
  SelBudget b;
  b.k = eh.min_count < n ? eh.min_count : n;
  if (b.k < taken) b.k = taken;
  int32_t* out = col ? p.sel_cols + size_t(hs) * size_t(nc) : p.sel_diags + size_t(hs) * size_t(nd);
  int32_t* n_out = col ? p.n_sel_cols + hs : p.n_sel_diags + hs;
  group_select<G>(v, n, 0, 1, 0, b, out, n, n_out, sh, FlagScan<G>{&scan_tmp});
  if (!col) vs_runs(p, hs);
}

cudaError_t cover_launch(const EstimateLaunch& p, cudaStream_t s) {
  const int64_t ncx = p.kend_last + p.n_diag;
  const dim3 sgrid(unsigned((ncx + 255) / 256), unsigned(p.n_cov));
  const size_t nh = size_t(p.n_cov) * 3 * kCoverBins;
  cudaError_t e = cudaMemsetAsync(p.cov_sum, 0, size_t(p.n_cov) * 2 * sizeof(double), s);
  if (e == cudaSuccess)
    e = cudaMemsetAsync(p.cov_state, 0, size_t(p.n_cov) * 2 * sizeof(int32_t), s);
  if (e == cudaSuccess) e = cudaMemsetAsync(p.cov_hcnt, 0, nh * sizeof(uint32_t), s);
  if (e == cudaSuccess) e = cudaMemsetAsync(p.cov_hmass, 0, nh * sizeof(double), s);
  if (e != cudaSuccess) return e;
  cover_sums_kernel<<<sgrid, 256, 0, s>>>(p);
  const dim3 hgrid(unsigned((ncx + 256 * kCoverPer - 1) / (256 * kCoverPer)), unsigned(p.n_cov));
  for (int k = 1; k <= p.cov_max_rounds; ++k) {
    cover_prep_kernel<<<sgrid, 256, 0, s>>>(p);
    for (int level = 0; level < 3; ++level) {
      if (level == 0)  // the walk sets the round up before level 0's histogram is read
        cover_walk_kernel<<<unsigned(p.n_cov), kCoverWalkThreads, 0, s>>>(p, -1, k);
      cover_hist_kernel<<<hgrid, 256, 0, s>>>(p, level);
      cover_walk_kernel<<<unsigned(p.n_cov), kCoverWalkThreads, 0, s>>>(p, level, k);
    }
    cover_mark_kernel<<<sgrid, 256, 0, s>>>(p, k);
    cover_tie_kernel<<<unsigned(p.n_cov), kVsSelectThreads, 0, s>>>(p, k);
    cover_free_kernel<<<dim3(unsigned((p.n_diag + kCoverFreeThreads - 1) / kCoverFreeThreads),
                             unsigned(p.n_cov)),
                        kCoverFreeThreads, 0, s>>>(p, k);
    cover_update_kernel<<<dim3(kCoverUpdateBlocks, unsigned(p.n_cov)), 256, 0, s>>>(p, k);
  }
  cover_final_kernel<<<dim3(unsigned(p.n_cov), 2), kVsSelectThreads, 0, s>>>(p);
  return cudaGetLastError();
}

// One query block's selection over its scores s (softmax first in mass mode) by the group's
// threads. The last query block selects on its exact mass instead (p.mass).
// Query block qb's key blocks [0, n_allowed) under the causal mask, and its forced ones for
// group_select: block 0, and fb .. fc, from the block of its first row's own key (at least 1)
// through the last visible. The whole-row and the streaming selectors share it.
struct QueryBlockRow {
  int64_t n_allowed, fb, fc;
};
__device__ __forceinline__ QueryBlockRow query_block_row(const EstimateLaunch& p, int64_t qb) {
  const int64_t base = p.q_offset + qb * kB;
  int64_t kend = base + imin(kB, p.nq - qb * kB);
  kend = kend < 0 ? 0 : (kend > p.nk ? p.nk : kend);
  const int64_t fb = kend > 0 ? (base < kend - 1 ? base : kend - 1) / kB : 1;
  return {(kend + kB - 1) / kB, fb > 0 ? fb : 1, kend > 0 ? (kend - 1) / kB : 0};
}

template <typename Grp>
__device__ void select_query_block(const EstimateLaunch& p, const EstHead& eh, int hb, int64_t qb,
                                   float* scores, SelShared& sh, FlagScan<Grp> scan) {
  const QueryBlockRow row = query_block_row(p, qb);
  const int64_t n_allowed = row.n_allowed;
  const bool exact = qb == p.n_qb - 1;
  // The last query block's exact mass comes into the shared score row first: the selection then
  // reads shared memory alone, with shared loads instead of generic ones.
  float* const s = scores;
  if (exact) {
    const float* mass = p.mass + size_t(hb) * size_t(p.n_kb);
    for (int64_t x = Grp::rank(); x < n_allowed; x += Grp::kSize) s[x] = mass[x];
    Grp::sync();
  }
  SelBudget b;
  b.mass = eh.mass;
  b.k = eh.k_blocks;
  b.gamma = eh.gamma;
  b.min_count = eh.min_count;
  b.max_count = eh.max_count;
  if (eh.mass && !exact && n_allowed > 0) {  // softmax over the causal blocks
    float mx = -INFINITY;
    for (int64_t x = Grp::rank(); x < n_allowed; x += Grp::kSize) mx = fmaxf(mx, s[x]);
    mx = float(-group_min<Grp>(-double(mx), sh));
    double sum = 0;
    for (int64_t x = Grp::rank(); x < n_allowed; x += Grp::kSize) sum += expf(s[x] - mx);
    const float fsum = float(group_sum<Grp>(sum, sh));
    for (int64_t x = Grp::rank(); x < n_allowed; x += Grp::kSize) s[x] = expf(s[x] - mx) / fsum;
    Grp::sync();
  }
  const size_t slot = size_t(hb) * size_t(p.n_qb) + size_t(qb);
  group_select<Grp>(s, n_allowed, 1, row.fb, row.fc, b, p.sel_kb + slot * size_t(p.cap_kb),
                    p.cap_kb, p.n_sel_kb + slot, sh, scan);
}

// grid (n_blk, ceil(n_qb / group)): block scores of `group` query blocks, then selection.
// Shared memory: the scores [group][n_kb] (f32), then the group's pooled q in A-fragment order.
__host__ __device__ __forceinline__ size_t block_scores_bytes(int64_t n_kb, int group) {
  return (size_t(group) * size_t(n_kb) * sizeof(float) + 15) / 16 * 16;
}

// Pooled q of query blocks qb0 .. qb0 + ng - 1 of head h, rounded to bf16, into the selector's
// A-fragment layout qa (zeroed by the caller): channel 32 sp + 8 k + 2 t + e of row g is half e
// of word k of qa[sp * 32 + g * 4 + t]. The pool pass's arithmetic (pooled_sum, then times the
// f32 reciprocal of the row count).
template <typename T, int V>
__device__ __forceinline__ void pool_group_q_v(const EstimateLaunch& p, int64_t h, int64_t qb0,
                                               int ng, uint4* qa) {
  const T* q = static_cast<const T*>(p.q);
  auto* q16 = reinterpret_cast<uint16_t*>(qa);
  const int nv = int(p.d / V);
  for (int x = threadIdx.x; x < ng * nv; x += blockDim.x) {
    const int g = x / nv, c = (x % nv) * V;
    const int64_t j0 = (qb0 + g) * kB;
    const int rows = int(imin(kB, p.nq - j0));
    float s[V] = {};
    // Few threads pool (bf16 at d 128: 8 query blocks x 16 vectors, half the CTA): 16 rows in
    // flight each.
    pooled_sum<T, V, 16>(q + (j0 * p.hq + h) * p.d + c, p.hq * p.d, rows, s);
    const float inv = 1.f / float(rows);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int ch = c + k, o = ch % 32;
      q16[(((ch / 32) * 32 + g * 4 + (o % 8) / 2) * 4 + o / 8) * 2 + o % 2] =
          __bfloat16_as_ushort(__float2bfloat16_rn(s[k] * inv));
    }
  }
}
template <typename T>
__device__ __forceinline__ void pool_group_q(const EstimateLaunch& p, int64_t h, int64_t qb0,
                                             int ng, uint4* qa) {
  constexpr int V = int(16 / sizeof(T));
  if (p.d % V == 0 && reinterpret_cast<uintptr_t>(p.q) % 16 == 0)
    pool_group_q_v<T, V>(p, h, qb0, ng, qa);
  else
    pool_group_q_v<T, 1>(p, h, qb0, ng, qa);
}

// The group's pooled q in qa for the selectors, rows past ng and channels past d zero (nsp * 32
// words). The whole CTA; synchronizes before and after.
__device__ __forceinline__ void load_group_q(const EstimateLaunch& p, int64_t h, int64_t qb0,
                                             int ng, int nsp, uint4* qa) {
  for (int x = threadIdx.x; x < nsp * 32; x += blockDim.x) qa[x] = make_uint4(0u, 0u, 0u, 0u);
  __syncthreads();
  if (p.bf16)
    pool_group_q<__nv_bfloat16>(p, h, qb0, ng, qa);
  else
    pool_group_q<float>(p, h, qb0, ng, qa);
  __syncthreads();
}

// The block selector's scoring for the common head dims (NSP = padded d / 32: 4 for d 128, 2 for
// d 64): the warp keeps the group's pooled q fragments in registers and loads the next tile's
// pooled k while the tensor cores take this one, so each tile costs one L2 round trip in the
// shadow of the last instead of one in series. The same products in the same order as
// block_scores_generic: the same scores to the bit.
template <int NSP>
__device__ __forceinline__ void block_scores_mma(const uint4* qa, const uint4* kf, int n_tiles,
                                                 int64_t n_score, int ng, float scale, float* sc,
                                                 int64_t stride) {
  using namespace attention_sparse_bf16_detail;
  constexpr int kWarps = kBlockSelectThreads / 32;
  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32), g = lane / 4, t = lane % 4;
  const int ns = int(n_score);
  uint4 a[NSP], b[NSP];
#pragma unroll
  for (int u = 0; u < NSP; ++u) a[u] = qa[u * 32 + lane];
  int nt = warp;
  if (nt < n_tiles) {
#pragma unroll
    for (int u = 0; u < NSP; ++u) b[u] = kf[size_t(nt) * NSP * 32 + size_t(u * 32 + lane)];
  }
  for (; nt < n_tiles; nt += kWarps) {
    // The next tile's k; past the end the index clamps to the last tile (an L2 hit) instead of
    // branching around the loads.
    uint4 bn[NSP];
    const uint4* kt = kf + size_t(min(nt + kWarps, n_tiles - 1)) * NSP * 32 + lane;
#pragma unroll
    for (int u = 0; u < NSP; ++u) bn[u] = kt[u * 32];
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < NSP; ++u) {
      mma_bf16(c, a[u].x, 0u, a[u].y, 0u, b[u].x, b[u].y);
      mma_bf16(c, a[u].z, 0u, a[u].w, 0u, b[u].z, b[u].w);
    }
    const int col = nt * 8 + 2 * t;  // < n_kb + 8: n_kb fits 32 bits (the selector's ids do)
    if (g < ng) {
      if (col < ns) sc[g * stride + col] = c[0] * scale;
      if (col + 1 < ns) sc[g * stride + col + 1] = c[1] * scale;
    }
#pragma unroll
    for (int u = 0; u < NSP; ++u) b[u] = bn[u];
  }
}

// Head dims off the fast paths (block_scores_mma): q fragments reread from shared memory, guarded
// channel groups. The same products in the same order.
__device__ __forceinline__ void block_scores_generic(const uint4* qa, const uint4* kf, int nsp,
                                                     int n_tiles, int64_t n_score, int ng,
                                                     float scale, float* sc, int64_t stride) {
  using namespace attention_sparse_bf16_detail;
  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32), g = lane / 4, t = lane % 4;
  for (int nt = warp; nt < n_tiles; nt += kBlockSelectThreads / 32) {
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    const uint4* kt = kf + size_t(nt) * size_t(nsp) * 32 + lane;
    for (int sp0 = 0; sp0 < nsp; sp0 += 4) {
      uint4 bq[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (sp0 + u < nsp) bq[u] = kt[(sp0 + u) * 32];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (sp0 + u < nsp) {
          const uint4 a = qa[(sp0 + u) * 32 + lane];
          mma_bf16(c, a.x, 0u, a.y, 0u, bq[u].x, bq[u].y);
          mma_bf16(c, a.z, 0u, a.w, 0u, bq[u].z, bq[u].w);
        }
    }
    const int64_t col = int64_t(nt) * 8 + 2 * t;
    if (g < ng) {
      if (col < n_score) sc[g * stride + col] = c[0] * scale;
      if (col + 1 < n_score) sc[g * stride + col + 1] = c[1] * scale;
    }
  }
}

// Scores of the group's ng rows (pooled q in qa) against key blocks [0, n_score) of kf, the
// pooled keys from tile 0 on: sc[g * stride + key block], every warp of the CTA.
__device__ __forceinline__ void block_scores(const uint4* qa, const uint4* kf, int nsp,
                                             int64_t n_score, int ng, float scale, float* sc,
                                             int64_t stride) {
  const int n_tiles = int((n_score + 7) / 8);
  if (nsp == 4)
    block_scores_mma<4>(qa, kf, n_tiles, n_score, ng, scale, sc, stride);
  else if (nsp == 2)
    block_scores_mma<2>(qa, kf, n_tiles, n_score, ng, scale, sc, stride);
  else
    block_scores_generic(qa, kf, nsp, n_tiles, n_score, ng, scale, sc, stride);
}

// One KV head's pooled keys (EstimateLaunch::pooled_k), as 16-byte B-fragment words.
__device__ __forceinline__ const uint4* pooled_k_of(const EstimateLaunch& p, int64_t kvh, int nsp) {
  return reinterpret_cast<const uint4*>(p.pooled_k) +
         size_t(kvh) * size_t(sparse_estimate_pool_kb(p.n_kb) / 8) * size_t(nsp) * 32;
}

// Key blocks any of query blocks qb0 .. qb0 + ng - 1 can see (causal).
__device__ __forceinline__ int64_t group_key_blocks(const EstimateLaunch& p, int64_t qb0,
                                                    int64_t ng) {
  int64_t kend = p.q_offset + (qb0 + ng - 1) * kB + imin(kB, p.nq - (qb0 + ng - 1) * kB);
  kend = kend < 0 ? 0 : (kend > p.nk ? p.nk : kend);
  return (kend + kB - 1) / kB;
}

__global__ void __launch_bounds__(kBlockSelectThreads) block_select_kernel(const EstimateLaunch p) {
  using namespace attention_sparse_bf16_detail;
  extern __shared__ __align__(16) float smem[];
  __shared__ SelShared sh_warp[kBlockSelectThreads / 32];
  // Grid x walks the query-block groups of one head, y the heads: CTAs running together share
  // that head's pooled K in L2 (4 MB per KV head at 1M) instead of touching every head's.
  const int hb = blockIdx.y;
  const int G = p.block_select_group;
  const int64_t n_kb = p.n_kb;
  const int nsp = int(sparse_estimate_pool_d(p.d) / 32);
  float* sc = smem;  // [G][n_kb]
  // Pooled q as the A operand of m16n8k16 (rows: the group's query blocks, 8 at most, rows 8-15
  // zero): [sp][g][t] uint4 = the words of channels 32 sp + 2 t + {0, 8, 16, 24} (+ 1) of row g:
  // registers a0, a2 of k-step 2 sp, then of k-step 2 sp + 1. Consecutive lanes, consecutive
  // 16-byte words: conflict-free.
  auto* qa = reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(smem) +
                                      block_scores_bytes(n_kb, G));
  const int64_t qb0 = int64_t(blockIdx.x) * G;
  const int64_t ng = imin(G, p.n_qb - qb0);
  // Key blocks any query block of the group can see: the selector reads scores [0, n_allowed)
  // only (the last query block uses its exact mass instead), so later blocks are not scored.
  const int64_t n_score = group_key_blocks(p, qb0, ng);
  const int h = p.blk_heads[hb];
  if (p.block_stream && !p.heads[h].mass) return;  // the streaming selector takes top-k heads
  // The group's pooled q, computed here rather than by a pooling pass: that pass read all of q
  // at the HBM roofline, and here the reads partly overlap the other CTA's selection on the SM
  // (issue-bound, next to no DRAM traffic; Nsight at 128K: selector +173 us, pass -261 us).
  load_group_q(p, h, qb0, int(ng), nsp, qa);
  const int64_t kvh = h / (p.hq / p.hkv);
  // The group's rows against 8 key blocks per warp step, on tensor cores: bf16 products are
  // exact in f32 (the pooled values are bf16), so the scores differ from the CPU's by the
  // accumulation alone (order, and the tensor core's f32 adds): tie-level. One 16-byte load of
  // pooled k and one of q per two k-steps.
  block_scores(qa, pooled_k_of(p, kvh, nsp), nsp, n_score, int(ng), p.scale, sc, n_kb);
  __syncthreads();
  const EstHead& eh = p.heads[h];
  if (p.block_select_cta && eh.mass) {
    // Long prompts, mass threshold: few query blocks' scores fit, and a warp's radix walk over
    // 16K scores is slow, so the whole CTA runs each selection in turn. A top-k selection stays
    // on its warp (warp_topk: two sweeps and a walk over ~1% of the items), the group's
    // selections side by side.
    using Cta = CtaGroup<kBlockSelectThreads>;
    __shared__ typename FlagScan<Cta>::Scan::TempStorage scan_tmp;
    for (int g = 0; g < ng; ++g)
      select_query_block<Cta>(p, eh, hb, qb0 + g, sc + g * n_kb, sh_warp[0],
                              FlagScan<Cta>{&scan_tmp});
    return;
  }
  // A warp per query block: the group's selections run side by side.
  const int warp = int(threadIdx.x / 32);
  for (int g = warp; g < ng; g += kBlockSelectThreads / 32)
    select_query_block<WarpGroup>(p, eh, hb, qb0 + g, sc + g * n_kb, sh_warp[warp],
                                  FlagScan<WarpGroup>{nullptr});
}

// ---- streaming block selector (top-k heads at long prompts) --------------------------------
//
// The block selector holds whole score rows in shared memory, so at 1M (16K key blocks, 64 KB a
// row) a CTA takes 3 query blocks: each streams its KV head's pooled keys from L2 (2 MB on
// average) and fills 3 of the mma's rows, so scoring costs 8/3 of what it costs per row at 128K,
// where 8 fit. Here a CTA scores kBlockStreamRows query blocks chunk by chunk, and each row's
// warp keeps a running exact top-k of what it has seen: keys arrive in id order, so once take
// candidates are kept, an item at or below the smallest kept key cannot enter (equal keys go to
// the lower id, which came first). The selection is group_select's for count mode, bit for bit.

constexpr int kStreamCand = 2 * kBlockStreamMaxTake;  // a row's candidates between compactions

// Keeps the take largest keys of cand[0, m) (ties: the earlier entry; entries are in id order),
// in place and in order, and returns the smallest key kept. 0 < take <= m <= kStreamCand. One
// warp: a bitwise walk over the keys in registers, as warp_topk's.
__device__ uint32_t stream_keep(uint2* cand, int m, int take) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kPer = kStreamCand / 32;
  const int lane = int(threadIdx.x % 32);
  const unsigned lt = (1u << lane) - 1u;
  uint2 c[kPer];
  uint32_t key[kPer];
  unsigned valid = 0;
  __syncwarp();  // the lanes' appends are visible
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int x = e * 32 + lane;
    c[e] = make_uint2(0u, 0u);
    if (x < m) {
      c[e] = cand[x];
      valid |= 1u << e;
    }
    key[e] = c[e].x;
  }
  __syncwarp();  // every lane has read its entries before any is overwritten
  uint32_t mask = 0, prefix = 0;
  int cnt_gt = 0, eq = m;
  warp_key_walk(key, kPer, 31, take, &mask, &prefix, &cnt_gt, &eq);
  const int need_eq = take - cnt_gt;  // the earliest entries in the bucket
  int o = 0, tie_base = 0;
  uint32_t kmin = 0xffffffffu;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const bool v = (valid >> e) & 1u;
    const bool gt = v && (c[e].x & mask) > prefix;
    const bool at = v && (c[e].x & mask) == prefix;
    const unsigned be = __ballot_sync(kAll, at);
    const bool sel = gt || (at && tie_base + __popc(be & lt) < need_eq);
    const unsigned bs = __ballot_sync(kAll, sel);
    if (sel) {
      cand[o + __popc(bs & lt)] = c[e];  // at or before its own place: already read
      kmin = min(kmin, c[e].x);
    }
    o += __popc(bs);
    tie_base += __popc(be);
  }
  kmin = __reduce_min_sync(kAll, kmin);
  __syncwarp();
  return kmin;
}

// grid (ceil(n_qb / kBlockStreamRows), n_blk), kBlockSelectThreads. Shared memory: the chunk's
// scores [rows][chunk] f32, the candidates [rows][kStreamCand] (key, id), pooled q (8 rows).
__global__ void __launch_bounds__(kBlockSelectThreads) block_stream_kernel(const EstimateLaunch p) {
  constexpr unsigned kAll = 0xffffffffu;
  static_assert(kBlockSelectThreads / 32 == kBlockStreamRows, "a warp per row");
  extern __shared__ __align__(16) float smem[];
  const int hb = blockIdx.y;
  const int h = p.blk_heads[hb];
  const EstHead& eh = p.heads[h];
  if (eh.mass) return;  // mass thresholds need whole rows: block_select_kernel
  const int C = p.block_stream_chunk;
  const int nsp = int(sparse_estimate_pool_d(p.d) / 32);
  float* const sc = smem;
  uint2* const cand = reinterpret_cast<uint2*>(smem + size_t(kBlockStreamRows) * size_t(C));
  auto* const qa = reinterpret_cast<uint4*>(cand + kBlockStreamRows * kStreamCand);
  const int64_t qb0 = int64_t(blockIdx.x) * kBlockStreamRows;
  const int ng = int(imin(kBlockStreamRows, p.n_qb - qb0));
  const int64_t n_score = group_key_blocks(p, qb0, ng);
  load_group_q(p, h, qb0, ng, nsp, qa);
  const uint4* kf = pooled_k_of(p, h / (p.hq / p.hkv), nsp);

  // This warp's query block: select_query_block's causal extent and forced blocks (block 0, the
  // blocks from the first row's own through the last visible), group_select's count mode.
  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32);
  const unsigned lt = (1u << lane) - 1u;
  const int64_t qb = qb0 + warp;
  const bool mine = warp < ng;
  int n = 0, fa = 0, fb = 0, fc = -1, take = 0;
  bool exact = false;
  if (mine) {
    const QueryBlockRow row = query_block_row(p, qb);
    n = int(row.n_allowed);
    fa = n < 1 ? n : 1;
    fb = int(imin(row.fb, n));
    fc = int(imin(row.fc, int64_t(n) - 1));
    const int lo = fb > fa ? fb : fa;
    const int nf = fa + (fc >= lo ? fc - lo + 1 : 0);
    const int64_t t = eh.k_blocks - nf;
    take = int(t < 0 ? 0 : (t > n - nf ? n - nf : t));
    exact = qb == p.n_qb - 1;
  }
  // The non-forced items: one range (the forced tail [fb, fc] ends the row).
  const int r_lo = fa, r_hi = fb <= fc ? (fa > fb ? fa : fb) : n;
  uint2* const mc = cand + warp * kStreamCand;
  const float* const mass = p.mass + size_t(hb) * size_t(p.n_kb);
  int m = 0;
  bool open = true;  // no threshold yet: every item is a candidate
  uint32_t thr = 0;
  for (int64_t c0 = 0; c0 < n_score; c0 += C) {
    const int64_t cn = imin(C, n_score - c0);
    block_scores(qa, kf + size_t(c0 / 8) * size_t(nsp) * 32, nsp, cn, ng, p.scale, sc, C);
    __syncthreads();
    if (mine && take > 0) {
      const int hi = int(imin(r_hi, c0 + cn));
      for (int i0 = int(c0 > r_lo ? c0 : r_lo); i0 < hi; i0 += 32) {
        if (m > kStreamCand - 32) {
          thr = stream_keep(mc, m, take);
          m = take;
          open = false;
        }
        const int i = i0 + lane;
        uint32_t key = 0;
        bool pass = false;
        if (i < hi) {
          // The last query block ranks by its exact mass (select_query_block).
          key = order_key(exact ? mass[i] : sc[size_t(warp) * size_t(C) + size_t(i - c0)]);
          pass = open || key > thr;
        }
        const unsigned b = __ballot_sync(kAll, pass);
        if (pass) mc[m + __popc(b & lt)] = make_uint2(key, uint32_t(i));
        m += __popc(b);
      }
      __syncwarp();
    }
    __syncthreads();  // the next chunk's scores overwrite these
  }
  if (!mine) return;
  if (take > 0 && m > take) stream_keep(mc, m, take);
  const size_t slot = size_t(hb) * size_t(p.n_qb) + size_t(qb);
  int32_t* const out = p.sel_kb + slot * size_t(p.cap_kb);
  const int64_t cap = p.cap_kb;
  for (int i = lane; i < fa; i += 32)
    if (i < cap) out[i] = i;
  for (int j = lane; j < take; j += 32)
    if (fa + j < cap) out[fa + j] = int32_t(mc[j].y);
  int o = fa + take;
  const int lo = fb > fa ? fb : fa;
  for (int i = lo + lane; i <= fc; i += 32)
    if (o + (i - lo) < cap) out[o + (i - lo)] = i;
  o += fc >= lo ? fc - lo + 1 : 0;
  if (lane == 0) p.n_sel_kb[slot] = int32_t(o < cap ? o : cap);
}

// ---- slot building (sparse_index.cpp sparse_slot_build, a warp per slot) -------------------
//
// The host builder walks one stream of key intervals sorted by start (the sink, the diagonal
// runs or key blocks, the local window), unites those that touch into ranges, and emits each
// range as 64-key entries plus its tail columns, preceded by the selected columns no range
// covers. A thread per slot ran that walk serially (5-6 ms for vertical-slash at 128K: thousands
// of runs a slot, 65K slots); here a warp takes 32 intervals at a time. An interval starts a
// range when it begins past every end before it (a prefix max over the lanes), a lane that
// starts one closes the range before it, the closed ranges' entry counts are scanned, and the
// warp writes the entries together, lane k element k. Same entries, same order as the host.

constexpr int kBuildWarps = 4;

__device__ __forceinline__ int warp_incl_max(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(kAll, v, o);
    if (lane >= o) v = max(v, u);
  }
  return v;
}

// Exclusive prefix sum over the lanes; *total gets the warp's sum.
__device__ __forceinline__ int warp_excl_sum(int v, int lane, int* total) {
  int s = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(kAll, s, o);
    if (lane >= o) s += u;
  }
  *total = __shfl_sync(kAll, s, 31);
  return s - v;
}

// The largest lane whose ex (nondecreasing over the lanes, 0 at lane 0) is <= j: the lane that
// owns element j of a scanned list.
__device__ __forceinline__ int warp_owner(int ex, int j) {
  int lo = 0;
#pragma unroll
  for (int step = 16; step > 0; step >>= 1)
    if (__shfl_sync(kAll, ex, lo + step) <= j) lo += step;
  return lo;
}

// A slot's output lists and the selected columns (ascending) its ranges leave free.
struct SlotWriter {
  const int32_t* cols;
  int ncol;
  int32_t* blocks;
  int32_t* out_cols;
  int cap_b, cap_c, kend;
  int64_t tail_min;    // HeadPattern::tail_block_min
  int nb = 0, nc = 0;  // entries so far (uniform over the warp; may pass the capacities)

  __device__ int first_at_least(int x) const {
    return int(::sf::kernels::cuda::first_at_least<int32_t>(cols, ncol, x));
  }

  // Where the range [A, E) with the next range at next_a ends once emitted: past E when its tail
  // becomes a block (sparse_tail_to_block); the next range's free columns start there.
  __device__ int emitted_end(int A, int E, int next_a) const {
    if (E == kend) return E;
    const int at = A + (E - A) / kB * kB;
    return sparse_tail_to_block(E - at, tail_min, at, next_a) ? at + kB : E;
  }

  // Each lane with `has` emits the free columns in [P, A), then the range [A, E): whole 64-key
  // entries, the last one past the range when E is the slot's end, else the tail as columns, or
  // as one more entry where the tail rule moved the range's end (end_e = emitted_end(A, E, ...)
  // > E). The lanes' outputs follow each other in lane order.
  __device__ void emit(bool has, int A, int E, int P, int end_e, int lane) {
    int g_lo = 0, gap = 0, n_b = 0, tail = 0;
    if (has) {
      if (cols) {
        g_lo = first_at_least(P);
        gap = first_at_least(A) - g_lo;
      }
      if (E == kend) {
        n_b = (E - A + kB - 1) / kB;
      } else {
        n_b = (E - A) / kB;
        tail = E - A - n_b * kB;
        if (end_e > E) {  // the tail rule held (emitted_end)
          ++n_b;
          tail = 0;
        }
      }
    }
    const int full_end = A + n_b * kB;
    int tb = 0, tc = 0;
    const int xb = warp_excl_sum(n_b, lane, &tb);
    const int xc = warp_excl_sum(gap + tail, lane, &tc);
    for (int j0 = 0; j0 < tb; j0 += 32) {
      const int j = j0 + lane;
      const int w = warp_owner(xb, j);
      const int a = __shfl_sync(kAll, A, w), x = __shfl_sync(kAll, xb, w);
      if (j < tb && nb + j < cap_b) blocks[nb + j] = a + (j - x) * kB;
    }
    for (int j0 = 0; j0 < tc; j0 += 32) {
      const int j = j0 + lane;
      const int w = warp_owner(xc, j);
      const int x = __shfl_sync(kAll, xc, w), g = __shfl_sync(kAll, gap, w);
      const int gl = __shfl_sync(kAll, g_lo, w), fe = __shfl_sync(kAll, full_end, w);
      if (j < tc && nc + j < cap_c) {
        const int off = j - x;
        out_cols[nc + j] = off < g ? cols[gl + off] : fe + (off - g);
      }
    }
    nb += tb;
    nc += tc;
  }
};

// grid ceil(hq * n_qb / kBuildWarps), kBuildWarps warps: warp w builds slot (h, qb).
__global__ void __launch_bounds__(32 * kBuildWarps) build_kernel(const EstimateLaunch p) {
  const int lane = int(threadIdx.x % 32);
  const int64_t t = int64_t(blockIdx.x) * kBuildWarps + int64_t(threadIdx.x / 32);
  if (t >= p.hq * p.n_qb) return;  // the whole warp
  const int64_t h = t / p.n_qb, qb = t % p.n_qb;
  const EstHead& eh = p.heads[h];
  const int64_t r0 = qb * kB;
  const int rows = int(imin(kB, p.nq - r0));
  const int64_t base64 = p.q_offset + r0;
  const int64_t kend64 = base64 + rows;
  const int kend = int(kend64 < 0 ? 0 : (kend64 > p.nk ? p.nk : kend64));
  auto clampk = [&](int64_t x) { return int(x < 0 ? 0 : (x > kend ? kend : x)); };
  const int32_t *cols = nullptr, *dlo = nullptr, *dhi = nullptr, *kbs = nullptr;
  int ncol = 0, n_mid = 0;
  if (eh.kind == kEstVS) {
    cols = p.sel_cols + size_t(eh.vs_slot) * size_t(p.kend_last);
    ncol = p.n_sel_cols[eh.vs_slot];
    int ndiag;
    if (rows == kB) {  // full query block: the precomputed runs
      dlo = p.run_lo + size_t(eh.vs_slot) * size_t(p.n_diag);
      dhi = p.run_hi + size_t(eh.vs_slot) * size_t(p.n_diag);
      ndiag = p.n_runs[eh.vs_slot];
    } else {  // short last block: single diagonals
      dlo = dhi = p.sel_diags + size_t(eh.vs_slot) * size_t(p.n_diag);
      ndiag = p.n_sel_diags[eh.vs_slot];
    }
    // Runs with lo >= base + rows reach no key of the slot: the stream starts at the last run
    // below that and walks down (starts ascend as the offsets fall).
    int lo = 0, hi = ndiag;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (int64_t(dlo[mid]) < base64 + rows)
        lo = mid + 1;
      else
        hi = mid;
    }
    n_mid = lo;
  } else if (eh.kind == kEstBlock) {
    const size_t slot = size_t(eh.blk_slot) * size_t(p.n_qb) + size_t(qb);
    kbs = p.sel_kb + slot * size_t(p.cap_kb);
    n_mid = p.n_sel_kb[slot];
  }
  const size_t s = size_t(t);
  SlotWriter w{cols,
               ncol,
               p.block_offset + s * size_t(p.max_blocks),
               p.column_index + s * size_t(p.max_cols),
               p.max_blocks,
               p.max_cols,
               kend,
               eh.tail_block_min};
  const int se = int(imin(eh.sink > 0 ? eh.sink : 0, kend));
  const int la = clampk(base64 - (eh.local > 0 ? eh.local : 0));
  // The stream: item 0 the sink, items 1 .. n_mid the diagonal runs (descending) or the key
  // blocks (ascending), item n_mid + 1 the local window [la, kend). A middle interval starting at
  // or past la lies inside the local window (every end is clamped to kend), so it is dropped and
  // the window can come last: the stream stays sorted by start.
  int run_e = -1;  // the largest end so far
  bool open = false;
  int open_a = 0, open_p = 0;  // the open range's start and the end of the range before it
  const int64_t n_items = int64_t(n_mid) + 2;
  for (int64_t x0 = 0; x0 < n_items; x0 += 32) {
    const int64_t x = x0 + lane;
    int a = 0, e = -1;
    bool valid = false, past = false;
    if (x == 0) {
      e = se;
      valid = se > 0;
    } else if (x <= n_mid) {
      if (dlo) {
        const int64_t di = int64_t(n_mid) - x;
        const int64_t dl = dlo[di];
        a = clampk(base64 - dhi[di]);
        e = clampk(base64 - dl + rows);
        valid = dl >= 0 && a < e;
      } else {
        const int64_t bb = kbs[x - 1];
        a = clampk(bb * kB);
        e = clampk(int64_t(a) + kB);
        valid = bb >= 0 && bb * kB < kend;
      }
      past = a >= la;
      valid = valid && !past;
    } else if (x == n_mid + 1) {
      a = la;
      e = kend;
      valid = la < kend;
    }
    const int incl = max(warp_incl_max(valid ? e : -1, lane), run_e);
    int before = __shfl_up_sync(kAll, incl, 1);  // the largest end before this item
    if (lane == 0) before = run_e;
    const bool start = valid && a > before;
    const unsigned starts = __ballot_sync(kAll, start);
    const unsigned lower = starts & ((1u << lane) - 1u);
    const int pl = lower ? 31 - __clz(lower) : 0;
    const int a_prev = __shfl_sync(kAll, a, pl);
    // A lane that starts a range closes the one before: from the lower starting lane, or the
    // range still open from earlier batches.
    const bool has = start && (lower != 0 || open);
    const int prev_a = lower ? a_prev : open_a;
    // Where the free columns before a range starting here begin: the end of the one before, as
    // emitted.
    const int p_here = has ? w.emitted_end(prev_a, before, a) : max(before, 0);
    const int p_prev = __shfl_sync(kAll, p_here, pl);
    if (__ballot_sync(kAll, has))  // else every interval of the batch joined the open range
      w.emit(has, prev_a, before, lower ? p_prev : open_p, p_here, lane);
    if (starts) {
      const int last = 31 - __clz(starts);
      open = true;
      open_a = __shfl_sync(kAll, a, last);
      open_p = __shfl_sync(kAll, p_here, last);
    }
    run_e = __shfl_sync(kAll, incl, 31);
    // Starts ascend: once a middle interval is past la, so are the rest: on to the window.
    if (__ballot_sync(kAll, past) && x0 + 32 <= int64_t(n_mid) + 1) x0 = int64_t(n_mid) + 1 - 32;
  }
  // The last range, then the free columns up to the slot's end.
  const bool last_has = lane == 0 ? open : lane == 1;
  const int last_a = lane == 0 ? open_a : kend;
  const int last_e = lane == 0 ? run_e : kend;
  const int last_end = open ? w.emitted_end(open_a, run_e, kend) : 0;
  const int last_p = lane == 0 ? open_p : last_end;
  w.emit(last_has, last_a, last_e, last_p, last_end, lane);
  if (lane == 0) {
    p.block_count[s] = imin(w.nb, w.cap_b);
    p.column_count[s] = imin(w.nc, w.cap_c);
    atomicMax(p.need + 0, w.nb);
    atomicMax(p.need + 1, w.nc);
  }
}

template <typename T>
cudaError_t score_pass(const EstimateLaunch& p, const ScorePass& sp, cudaStream_t s) {
  if (sp.n_heads == 0 || sp.L == 0 || p.n_chunks == 0) return cudaSuccess;
  const size_t smem = score_smem(p);
  const dim3 grid(unsigned(sp.n_heads), unsigned((p.n_chunks + kChunksPerCta - 1) / kChunksPerCta));
  const int64_t G = p.hq / p.hkv;
  // Grouped stats: more chunks a CTA (fewer q tile loads) while the grid keeps about four
  // waves of two CTAs on each of Hopper's 132 SMs.
  const int64_t gx = p.hkv * ((G + kGroupHeads - 1) / kGroupHeads);
  constexpr int64_t kMinCtas = 1024;  // about four waves of two CTAs on 132 SMs
  ScorePass gsp = sp;
  gsp.group_chunks = kChunksPerCta;
  while (gsp.group_chunks < 32 &&
         gx * ((p.n_chunks + 2 * gsp.group_chunks - 1) / (2 * gsp.group_chunks)) >= kMinCtas)
    gsp.group_chunks *= 2;
  const dim3 ggrid(unsigned(gx), unsigned((p.n_chunks + gsp.group_chunks - 1) / gsp.group_chunks));
  const bool grouped = mma_scores(p) && G > 1;
  if (!mma_scores(p))
    score_stats_kernel<T><<<grid, kScoreThreads, smem, s>>>(p, sp);
  else if (grouped && p.d == 128)
    score_stats_group_kernel<128, false>
        <<<ggrid, kScoreThreads, stats_group_smem(128), s>>>(p, gsp);
  else if (grouped)
    score_stats_group_kernel<64, false><<<ggrid, kScoreThreads, stats_group_smem(64), s>>>(p, gsp);
  else if (p.d == 128)
    score_stats_mma_kernel<128><<<grid, kScoreThreads, smem, s>>>(p, sp);
  else
    score_stats_mma_kernel<64><<<grid, kScoreThreads, smem, s>>>(p, sp);
  row_lse_kernel<<<unsigned(int64_t(sp.n_heads) * sp.L), kLseThreads, 0, s>>>(p, sp);
  if (!sp.col && !sp.part_d && !sp.probs) {  // mass alone: from the stats, no second pass
    const int64_t n = int64_t(sp.n_heads) * p.n_chunks;
    block_mass_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(p, sp);
    return cudaGetLastError();
  }
  if (grouped && sp.probs && !sp.col && !sp.part_d && !sp.mass) {  // probabilities alone
    if (p.d == 128)
      score_stats_group_kernel<128, true>
          <<<ggrid, kScoreThreads, stats_group_smem(128), s>>>(p, gsp);
    else
      score_stats_group_kernel<64, true><<<ggrid, kScoreThreads, stats_group_smem(64), s>>>(p, gsp);
    return cudaGetLastError();
  }
  score_probs_kernel<T><<<grid, kScoreThreads, smem, s>>>(p, sp);
  if (sp.part_d) {
    const int64_t n = int64_t(sp.n_heads) * p.n_diag;
    diag_reduce_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(p, sp);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_all(const EstimateLaunch& p, cudaStream_t s) {
  cudaError_t e = cudaSuccess;
  if ((p.stages & 1) && p.n_vs > p.n_cov) {
    ScorePass sp;
    sp.heads = p.vs_heads;
    sp.n_heads = p.n_vs - p.n_cov;
    sp.r0 = p.vs_r0;
    sp.L = p.vs_L;
    sp.col = p.col;
    sp.part_d = p.part_d;
    if ((e = score_pass<T>(p, sp, s)) != cudaSuccess) return e;
  }
  if ((p.stages & 1) && p.n_cov > 0 && p.cov_rows > 0) {
    // The cover's rows gathered, then scored 64 at a time on the copy, at their own positions.
    const int es = int(sizeof(T));
    const int64_t words = p.cov_rows * p.hq * p.d * es / 4;
    cover_gather_kernel<<<unsigned(std::min<int64_t>((words + 255) / 256, 4096)), 256, 0, s>>>(p,
                                                                                               es);
    EstimateLaunch pc = p;
    pc.q = p.cov_q;
    for (int64_t r0 = 0; r0 < p.cov_rows; r0 += kB) {
      ScorePass sp;
      sp.heads = p.cov_heads;
      sp.n_heads = p.n_cov;
      sp.r0 = r0;
      sp.L = imin(kB, p.cov_rows - r0);
      sp.pos = p.cov_pos + r0;
      sp.probs = p.cov_p;
      sp.probs_row0 = r0;
      sp.probs_rows = p.cov_rows;
      if ((e = score_pass<T>(pc, sp, s)) != cudaSuccess) return e;
    }
  }
  if ((p.stages & 1) && p.n_blk > 0 && p.n_qb > 0) {
    ScorePass sp;
    sp.heads = p.blk_heads;
    sp.n_heads = p.n_blk;
    sp.r0 = p.blk_r0;
    sp.L = p.blk_L;
    sp.mass = p.mass;
    if ((e = score_pass<T>(p, sp, s)) != cudaSuccess) return e;
    if (p.n_kb > 0) pool_k<T>(p, s);
  }
  if ((p.stages & 2) && p.n_vs > p.n_cov)
    vs_select_kernel<<<dim3(unsigned(p.n_vs - p.n_cov), 2), kVsSelectThreads, 0, s>>>(p);
  if ((p.stages & 2) && p.n_cov > 0 && (e = cover_launch(p, s)) != cudaSuccess) return e;
  if ((p.stages & 2) && p.n_blk > 0 && p.n_qb > 0) {
    if (!p.block_stream || p.block_mass_heads > 0) {
      const size_t smem = sparse_estimate_block_smem(p.n_kb, p.d, p.block_select_group);
      const unsigned gy = unsigned((p.n_qb + p.block_select_group - 1) / p.block_select_group);
      block_select_kernel<<<dim3(gy, unsigned(p.n_blk)), kBlockSelectThreads, smem, s>>>(p);
    }
    if (p.block_stream) {
      const unsigned gy = unsigned((p.n_qb + kBlockStreamRows - 1) / kBlockStreamRows);
      block_stream_kernel<<<dim3(gy, unsigned(p.n_blk)), kBlockSelectThreads,
                            sparse_estimate_stream_smem(p.d, p.block_stream_chunk), s>>>(p);
    }
  }
  if (!(p.stages & 4)) return cudaGetLastError();
  if ((e = cudaMemsetAsync(p.need, 0, 2 * sizeof(int32_t), s)) != cudaSuccess) return e;
  const int64_t slots = p.hq * p.n_qb;
  if (slots > 0)
    build_kernel<<<unsigned((slots + kBuildWarps - 1) / kBuildWarps), 32 * kBuildWarps, 0, s>>>(p);
  return cudaGetLastError();
}

// Both passes of the grouped scoring kernel at head dim D.
template <int D>
cudaError_t set_group_smem() {
  const int bytes = int(stats_group_smem(D));
  cudaError_t e = cudaFuncSetAttribute(score_stats_group_kernel<D, false>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(score_stats_group_kernel<D, true>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  return e;
}

template <typename T>
cudaError_t configure(const EstimateLaunch& p) {
  const int smem = int(score_smem_max(p.d));
  cudaError_t e = cudaFuncSetAttribute(score_stats_kernel<T>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(score_probs_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem);
  if (e == cudaSuccess && std::is_same_v<T, __nv_bfloat16>)
    e = cudaFuncSetAttribute(score_stats_mma_kernel<128>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess && std::is_same_v<T, __nv_bfloat16>)
    e = cudaFuncSetAttribute(score_stats_mma_kernel<64>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess && std::is_same_v<T, __nv_bfloat16>) e = set_group_smem<128>();
  if (e == cudaSuccess && std::is_same_v<T, __nv_bfloat16>) e = set_group_smem<64>();
  if (e == cudaSuccess && (!p.block_stream || p.block_mass_heads > 0))
    e = cudaFuncSetAttribute(block_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(sparse_estimate_block_smem(p.n_kb, p.d, p.block_select_group)));
  if (e == cudaSuccess && p.block_stream)
    e = cudaFuncSetAttribute(block_stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(sparse_estimate_stream_smem(p.d, p.block_stream_chunk)));
  return e;
}

}  // namespace

cudaError_t sparse_estimate_configure(const EstimateLaunch& p) {
  return p.bf16 ? configure<__nv_bfloat16>(p) : configure<float>(p);
}

size_t sparse_estimate_block_smem(int64_t n_kb, int64_t d, int group) {
  // The scores, then pooled q for 8 rows (the m16 tile's real half), bf16.
  return block_scores_bytes(n_kb, group) + size_t(8 * sparse_estimate_pool_d(d)) * 2;
}

size_t sparse_estimate_stream_smem(int64_t d, int chunk) {
  return size_t(kBlockStreamRows) * size_t(chunk) * sizeof(float) +
         size_t(kBlockStreamRows) * kStreamCand * sizeof(uint2) +
         size_t(8 * sparse_estimate_pool_d(d)) * 2;
}

bool sparse_estimate_block_cta(int group) { return group <= kBlockSelectThreads / 32 / 2; }

int sparse_estimate_block_group(int64_t n_kb, int64_t d) {
  const size_t limit = sparse_estimate_block_smem_limit();
  for (int g = 8; g >= 1; --g)
    if (sparse_estimate_block_smem(n_kb, d, g) <= limit) return g;
  return 0;
}

size_t sparse_estimate_block_smem_limit() {
  // The device's opt-in limit less the kernel's static shared memory, as the runtime reports them;
  // without a device, Hopper's 227 KB less the per-warp state and 1 KB of slack.
  int dev = 0, optin = 0;
  cudaFuncAttributes fa{};
  if (cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
      cudaFuncGetAttributes(&fa, block_select_kernel) == cudaSuccess && optin > 0 &&
      size_t(optin) > fa.sharedSizeBytes)
    return size_t(optin) - fa.sharedSizeBytes;
  (void)cudaGetLastError();  // a failed query would leave its error for the next check
  constexpr size_t kStatic =
      sizeof(SelShared) * (kBlockSelectThreads / 32) +
      sizeof(typename FlagScan<CtaGroup<kBlockSelectThreads>>::Scan::TempStorage);
  return size_t(227 * 1024) - kStatic - 1024;
}

cudaError_t sparse_estimate_launch(const EstimateLaunch& p, cudaStream_t s) {
  return p.bf16 ? launch_all<__nv_bfloat16>(p, s) : launch_all<float>(p, s);
}

namespace {

constexpr int kPairsThreads = 128;

// One block per slot: the (query, key) pairs its entries cover under the causal mask, as
// SparseIndex::pairs counts them on the host (sparse_index.cpp).
__global__ void __launch_bounds__(kPairsThreads) index_pairs_kernel(const IndexPairsArgs a) {
  const int64_t slot = blockIdx.x;
  const int64_t qb = slot % a.n_qblocks;
  const int64_t r0 = qb * kB;
  const int64_t rows = min(max(a.n_q - r0, int64_t(0)), int64_t(kB));
  const int64_t base = a.q_offset + r0;
  const int64_t kend = min(max(base + rows, int64_t(0)), a.n_k);
  auto limit = [&](int64_t i) { return min(max(base + i + 1, int64_t(0)), a.n_k); };
  auto range = [&](int64_t lo, int64_t hi) -> unsigned long long {
    if (hi <= lo) return 0;
    if (hi <= limit(0)) return (unsigned long long)((hi - lo) * rows);
    unsigned long long sum = 0;
    for (int64_t i = 0; i < rows; ++i)
      sum += (unsigned long long)min(max(limit(i) - lo, int64_t(0)), hi - lo);
    return sum;
  };
  unsigned long long sum = 0;
  const int nb = a.block_count[slot], nc = a.column_count[slot];
  for (int i = threadIdx.x; i < nb; i += blockDim.x) {
    const int64_t off = a.block_offset[slot * a.max_blocks + i];
    sum += range(off, min(off + int64_t(kB), kend));
  }
  for (int i = threadIdx.x; i < nc; i += blockDim.x) {
    const int64_t c = a.column_index[slot * a.max_cols + i];
    sum += range(c, c + 1);
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
  if ((threadIdx.x & 31) == 0 && sum) atomicAdd(a.pairs, sum);
}

}  // namespace

cudaError_t sparse_index_pairs_launch(const IndexPairsArgs& a, cudaStream_t s) {
  const int64_t slots = int64_t(a.n_heads) * a.n_qblocks;
  if (slots == 0) return cudaSuccess;
  index_pairs_kernel<<<unsigned(slots), kPairsThreads, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace sf::kernels::cuda
