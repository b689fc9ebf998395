// CUDA paged decode attention and append (kernels/decode_attention.h). The rules are those of the
// host reference, decode/decode_attention.cpp: the same bound summed in the same order, the same
// visit order (bound descending, ties by page index), the same stop test on masses in double.
// Scores and partial sums are added in another order than the host's, so results agree to float
// rounding, and a stop that sits within rounding of eps may fall one block apart.
//
// Work split. A warp takes one 64-key block for one query head (warp_block): each lane loads 16
// bytes of a row at a time (E = 4 F32, 8 BF16 or 16 INT8 channels), D / E lanes a row, so every
// load is whole coalesced rows; the dot partials a lane holds are reduce-scattered across the
// row's lanes, leaving one score per lane; the values are read the same way and weighted by the
// exps shuffled from the lanes that hold them, then handed to the callers four channels a lane.
// No shared memory, many loads in flight per warp. INT8 folds the key scales into the query
// (q_c s_c against the codes, plus sum_c q_c z_c per block) and each row's value scale and zero
// into its weight, so a code is converted once and no F32 row is formed.
//   full: flash-decoding. Each query head's pages are split over CTAs of 4 warps (about 6 CTAs
//         per SM); each CTA writes its partial (max, mass, output) and a second
//         kernel merges the splits. The query heads of one KV head are adjacent in the grid so
//         their K/V reads meet in L2 (sharing the loads inside a warp instead was slower for F32:
//         bench/NOTES.md). INT8 pools with 2+ query heads per KV head share them
//         (full_shared_kernel): a CTA per (split, KV head), a warp converting each row once
//         for up to 4 query heads, splits for one wave at that kernel's occupancy (2x faster
//         than a warp per head on H100; BF16 lost at 128K, where the kernel's registers leave
//         too few loads in flight, so BF16 keeps a warp per head: bench/NOTES.md).
//         At head_dim 64 and 128 every pool takes full_staged_kernel instead (INT8 with 2+
//         query heads per KV head): a producer thread streams a KV head's blocks into shared
//         memory by bulk copies, and the warps of its query heads read them there (on H100 at
//         d 128, 1.7x / 1.4x / 1.27x faster over F32 / BF16 / INT8; NOTES thirty-third and
//         thirty-fourth sessions).
//   psa:  in rounds over the whole device (psa_round_size, above psa_bounds_kernel): every
//         head's bounds (a thread each), a CTA per head sorting them, then per round a warp per
//         (head, ranked block) over every SM and a warp per head applying the host's sequential
//         stop rule to the round as prefix computations, 64 blocks at a time. Blocks past the
//         stop are discarded, so the visit set is the host's; a head that stops early wastes
//         at most its last round's reads, and one that visits most of its blocks is read by the
//         whole device rather than by one SM group (bench/NOTES.md, twenty-ninth session).
//   psa +gqa: one visit per KV head, in the same rounds (gqa_cand_kernel's comment): the blocks
//         each query head may name, a warp per (block, query head) scoring them so the group's
//         warps read a block together, and a CTA per KV head replaying the sequential turns 32 at
//         a time. The replay is the cost: 8 KV heads keep 8 SMs busy (bench/NOTES.md, thirtieth
//         session).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <string>

#include <cub/block/block_radix_sort.cuh>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dependent_launch.cuh"
#include "kernels/cuda/mbarrier.cuh"
#include "kernels/cuda/smem_opt_in.h"

namespace sf::kernels::cuda {
namespace {

constexpr int kBT = kDecodeBlockTokens;
constexpr int kFullWarps = 4;   // per CTA, full mode
constexpr unsigned kAll = 0xffffffffu;

struct DecodeArgs {
  const float* q;
  float* out;
  int32_t* visited;
  float* ws;  // full mode, splits > 1: [n_tokens * n_heads][splits][D + 4] output, max, (pad),
              // mass (double); psa takes its workspace through PsaWs instead
  PagedKv kv;
  int n_heads, splits;
  int n_tokens;  // full mode: tokens at once (PagedDecodeParams::n_tokens; > 1: pass_kernel)
  float scale;
  double eps;
  bool pin, recent_mean;
  bool shared;  // full mode: full_shared_kernel (grid over KV heads), splits counted for it
  bool gqa;     // psa: one visit per KV head (gqa_walk_kernel)
  int staged_splits, staged_w, staged_sets, staged_nhf;  // full mode: full_staged_kernel's plan
                                                         // (splits 0: another kernel)
};

// Halves v[0, 2 O) across lanes l and l ^ O (each keeps the half its bit O names, summed with
// the partner's copy), then recurses: after O = 1 lane l holds the sum of item l % (2 O_first).
// Recursion on a template argument, so every index is a constant and v stays in registers.
template <int O>
__device__ __forceinline__ void reduce_scatter(float* v, int lane) {
  if constexpr (O >= 1) {
    const bool upper = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < O; ++i) {
      const float send = upper ? v[i] : v[i + O];
      const float keep = upper ? v[i + O] : v[i];
      v[i] = keep + __shfl_xor_sync(kAll, send, O);
    }
    reduce_scatter<O / 2>(v, lane);
  }
}

__device__ __forceinline__ float4 ld4(const float* p) {
  return __ldg(reinterpret_cast<const float4*>(p));
}

// F16 bits to float.
__device__ __forceinline__ float f16f(uint16_t h) { return __half2float(__ushort_as_half(h)); }

// A lane loads 16 bytes of a row at a time: E elements of the pool's type.
template <PoolDType T>
inline constexpr int kElemsPerLoad = T == PoolDType::kF32    ? 4
                                     : T == PoolDType::kBF16 ? 8
                                                             : 16;

// Elements idx .. idx + E - 1 of a pool array (16-byte aligned) as floats; INT8: the codes (a
// byte under the exponent of 2^23, minus 2^23: exact, and cheaper than a conversion). kSmem:
// base is a block staged in shared memory (full_staged_kernel).
// The E elements of 16 loaded bytes u, as floats (ld_elems).
template <PoolDType T>
__device__ __forceinline__ void cvt_elems(uint4 u, float* x) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (T == PoolDType::kF32) {
      x[i] = __uint_as_float(w[i]);
    } else if constexpr (T == PoolDType::kBF16) {
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      // Code c becomes the float 2^23 + c (byte c under exponent byte 0x4b, one PRMT), then c.
#pragma unroll
      for (int b = 0; b < 4; ++b)
        x[4 * i + b] = __uint_as_float(__byte_perm(w[i], 0x4b000000u, 0x7440u | b)) - 8388608.f;
    }
  }
}
template <PoolDType T, bool kSmem = false>
__device__ __forceinline__ void ld_elems(const void* base, int64_t idx, float* x) {
  constexpr int E = kElemsPerLoad<T>;
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const char*>(base) + idx * (16 / E));
  cvt_elems<T>(kSmem ? *p : __ldg(p), x);
}

// 8 F16 values loaded as 16 bytes u, as floats.
__device__ __forceinline__ void cvt_f16x8(uint4 u, float* x) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    x[2 * j] = f16f(uint16_t(w[j]));
    x[2 * j + 1] = f16f(uint16_t(w[j] >> 16));
  }
}
// n F16 values (n a multiple of 8, 16-byte aligned) as floats; kSmem: p is in shared memory.
template <int N, bool kSmem = false>
__device__ __forceinline__ void ld_f16(const uint16_t* p, float* x) {
#pragma unroll
  for (int i = 0; i < N; i += 8) {
    const uint4* u = reinterpret_cast<const uint4*>(p + i);
    cvt_f16x8(kSmem ? *u : __ldg(u), x + i);
  }
}

// This lane's E channels of a query head's row q (global or shared memory): lane l reads
// channels E * (l % (D / E)) onward, the ones it meets in every key and value row.
template <int D, PoolDType T>
__device__ __forceinline__ void load_q(const float* q, float* qf) {
  constexpr int E = kElemsPerLoad<T>;
  const int grp = (threadIdx.x & 31) % (D / E);
#pragma unroll
  for (int i = 0; i < E; ++i) qf[i] = q[E * grp + i];
}

// One warp, block blk (n <= 64 keys) for one query: qf is this lane's channels of the query
// (load_q). Lanes read a row in D / E groups of E channels, 32 / (D / E) rows a load. Returns
// the block max bm of the scaled scores, mass = sum_t exp(s_t - bm) (double) and, in lanes
// l < D / 4, o4 = sum_t exp(s_t - bm) v_t on channels 4 l .. 4 l + 3. With kSmem the block's
// keys and values are read from a copy in shared memory, sk and sv ([64][D] each; F32 and BF16).
template <int D, PoolDType T, bool kSmem = false>
__device__ __forceinline__ void warp_block(const float* qf, const PagedKv& kv, int64_t blk, int n,
                                           float scale, float* bm, double* mass, float4* o4,
                                           const void* sk = nullptr, const void* sv = nullptr) {
  static_assert(!kSmem || T != PoolDType::kInt8, "INT8 blocks are read from global memory");
  constexpr int E = kElemsPerLoad<T>;
  constexpr int LPR = D / E;     // lanes per row
  constexpr int RPL = 32 / LPR;  // rows per warp load
  const int lane = threadIdx.x & 31, grp = lane % LPR, sub = lane / LPR;
  const int64_t row0 = blk * kBT;
  // INT8 keys: q . (z + code * s) = (q * s) . code + q . z, per channel of this block.
  float qk[E];
  float bias = 0.f;
  if constexpr (T == PoolDType::kInt8) {
    float ks[E], kz[E];
    ld_f16<E>(kv.kscale + blk * D + E * grp, ks);
    ld_f16<E>(kv.kzero + blk * D + E * grp, kz);
#pragma unroll
    for (int i = 0; i < E; ++i) qk[i] = qf[i] * ks[i], bias += qf[i] * kz[i];
  } else {
#pragma unroll
    for (int i = 0; i < E; ++i) qk[i] = qf[i];
  }
  float s[2];
#pragma unroll
  for (int round = 0; round < 2; ++round) {
    float v[LPR];
#pragma unroll
    for (int j = 0; j < LPR; ++j) {
      const int row = round * 32 + j * RPL + sub;
      float x[E];
      if (row < n) {
        if constexpr (kSmem)
          ld_elems<T, true>(sk, int64_t(row) * D + E * grp, x);
        else
          ld_elems<T>(kv.k, (row0 + row) * D + E * grp, x);
      } else {
#pragma unroll
        for (int i = 0; i < E; ++i) x[i] = 0.f;
      }
      float acc = bias;
#pragma unroll
      for (int i = 0; i < E; ++i) acc += qk[i] * x[i];
      v[j] = acc;
    }
    // Reduce-scatter over the LPR lanes of a row: afterwards lane grp holds row j = grp's sum.
    reduce_scatter<LPR / 2>(v, lane);
    const int row = round * 32 + grp * RPL + sub;
    s[round] = row < n ? v[0] * scale : -INFINITY;
  }
  float m = fmaxf(s[0], s[1]);
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kAll, m, o));
  float e[2] = {s[0] == -INFINITY ? 0.f : expf(s[0] - m), s[1] == -INFINITY ? 0.f : expf(s[1] - m)};
  double t = double(e[0]) + double(e[1]);
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) t += __shfl_xor_sync(kAll, t, o);
  // INT8 values: w (z + code s) = (w s) . code + w z; the lane holding a row's weight folds in
  // that row's scale and zero once.
  float ez[2] = {0.f, 0.f};
  if constexpr (T == PoolDType::kInt8) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r * 32 + grp * RPL + sub;
      if (row < n) {
        ez[r] = e[r] * f16f(__ldg(kv.vzero + row0 + row));
        e[r] *= f16f(__ldg(kv.vscale + row0 + row));
      }
    }
  }
  float acc[E];
#pragma unroll
  for (int i = 0; i < E; ++i) acc[i] = 0.f;
  float accz = 0.f;
#pragma unroll 8
  for (int j = 0; j < 64 / RPL; ++j) {
    const int row = j * RPL + sub;  // this lane's value row; rows j*RPL.. share one round
    const int r = row & 31;
    const int src = (r % RPL) * LPR + r / RPL;  // the lane that holds row's weight
    const float w = __shfl_sync(kAll, (j * RPL) < 32 ? e[0] : e[1], src);
    if constexpr (T == PoolDType::kInt8)
      accz += __shfl_sync(kAll, (j * RPL) < 32 ? ez[0] : ez[1], src);
    if (row < n) {
      float x[E];
      if constexpr (kSmem)
        ld_elems<T, true>(sv, int64_t(row) * D + E * grp, x);
      else
        ld_elems<T>(kv.v, (row0 + row) * D + E * grp, x);
#pragma unroll
      for (int i = 0; i < E; ++i) acc[i] += w * x[i];
    }
  }
#pragma unroll
  for (int o = LPR; o < 32; o <<= 1) {
#pragma unroll
    for (int i = 0; i < E; ++i) acc[i] += __shfl_xor_sync(kAll, acc[i], o);
    if constexpr (T == PoolDType::kInt8) accz += __shfl_xor_sync(kAll, accz, o);
  }
  if constexpr (T == PoolDType::kInt8) {
#pragma unroll
    for (int i = 0; i < E; ++i) acc[i] += accz;
  }
  // To the callers' layout, four channels a lane: lane l takes acc[4 (l % (E/4)) ..] of the
  // lane holding channel group l / (E / 4).
  if constexpr (E == 4) {
    *o4 = make_float4(acc[0], acc[1], acc[2], acc[3]);
  } else {
    constexpr int P = E / 4;
    const int src = (lane / P) % LPR;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < P; ++r) {
      const float x0 = __shfl_sync(kAll, acc[4 * r], src),
                  x1 = __shfl_sync(kAll, acc[4 * r + 1], src),
                  x2 = __shfl_sync(kAll, acc[4 * r + 2], src),
                  x3 = __shfl_sync(kAll, acc[4 * r + 3], src);
      if (lane % P == r) o = make_float4(x0, x1, x2, x3);
    }
    *o4 = o;
  }
  *bm = m;
  *mass = t;
}

// Folds a block result (bm, mass, o4) into a running (m, l, o): the frame moves to the larger max.
__device__ __forceinline__ void fold(float bm, double mass, float4 ob, float* m, double* l,
                                     float4* o) {
  if (mass == 0) return;
  if (bm > *m) {
    const float r = expf(*m - bm);  // 0 while nothing is folded (m = -inf)
    o->x *= r, o->y *= r, o->z *= r, o->w *= r;
    *l *= double(r);
    *m = bm;
  }
  const float w = expf(bm - *m);
  o->x += w * ob.x, o->y += w * ob.y, o->z += w * ob.z, o->w += w * ob.w;
  *l += double(w) * mass;
}

// Query head h's part `part` of `parts` (running max m, mass l, output o on channel quad c4):
// the normalized output itself when there is one part, else its row of the merge's workspace.
template <int D>
__device__ __forceinline__ void store_part(const DecodeArgs& a, int h, int part, int parts,
                                           float m, double l, float4 o, int c4) {
  if (parts == 1) {
    const float inv = l > 0 ? float(1.0 / l) : 0.f;
    reinterpret_cast<float4*>(a.out + int64_t(h) * D)[c4] =
        make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
    return;
  }
  float* dst = a.ws + (int64_t(h) * parts + part) * (D + 4);
  reinterpret_cast<float4*>(dst)[c4] = o;
  if (c4 == 0) {
    dst[D] = m;
    reinterpret_cast<double*>(dst + D + 2)[0] = l;
  }
}

// Full mode: CTA (split, query head); grid index = split * n_heads + h, so the query heads of a
// KV head sit side by side. Warp w takes the split's pages w, w + 4, ...
template <int D, PoolDType T>
__global__ void __launch_bounds__(kFullWarps * 32) full_kernel(const DecodeArgs a) {
  constexpr int LPR = D / 4;
  __shared__ float sm_m[kFullWarps];
  __shared__ double sm_l[kFullWarps];
  __shared__ float4 sm_o[kFullWarps][LPR];
  grid_dep_enter();
  const int h = blockIdx.x % a.n_heads, split = blockIdx.x / a.n_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = h / (a.n_heads / a.kv.n_kv_heads);
  const int nb = a.kv.n_pages[g];
  const int per = (nb + a.splits - 1) / a.splits;
  const int b0 = split * per, b1 = min(nb, b0 + per);
  const int32_t* pages = a.kv.pages + int64_t(g) * a.kv.max_pages;
  float qf[kElemsPerLoad<T>];
  load_q<D, T>(a.q + int64_t(h) * D, qf);
  float m = -INFINITY;
  double l = 0;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int b = b0 + warp; b < b1; b += kFullWarps) {
    const int64_t blk = pages[b];
    const int n = a.kv.fill[blk];
    if (n <= 0) continue;
    float bm;
    double mass;
    float4 ob;
    warp_block<D, T>(qf, a.kv, blk, n, a.scale, &bm, &mass, &ob);
    fold(bm, mass, ob, &m, &l, &o);
  }
  if (lane < LPR) sm_o[warp][lane] = o;
  if (lane == 0) sm_m[warp] = m, sm_l[warp] = l;
  __syncthreads();
  if (threadIdx.x >= LPR) return;
  float M = -INFINITY;
  double L = 0;
  float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int w = 0; w < kFullWarps; ++w) fold(sm_m[w], sm_l[w], sm_o[w][threadIdx.x], &M, &L, &O);
  store_part<D>(a, h, split, a.splits, M, L, O, threadIdx.x);
  if (threadIdx.x == 0 && split == 0 && a.visited) a.visited[h] = nb;
}

// Merges a query head's splits (one CTA per row: a query head, or with several tokens a
// (token, query head)) in two passes over the partials, each of independent loads: the largest
// max first (a thread per split, then the CTA), then every split's output weighted by
// exp(m - M), a thread per (channel quad, split group), the groups summed in order. Folding the
// splits one after another (a thread per quad) was a chain of dependent loads as long as the
// split count: 13 us for 9 heads of 88 splits on an H100 (NOTES, thirty-fourth session).
constexpr int kMergeThreads = 256;
template <int D>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const DecodeArgs a) {
  constexpr int Q = D / 4, P = kMergeThreads / Q;
  __shared__ float4 so[P][Q];
  __shared__ double sl[P];
  __shared__ float smax[kMergeThreads / 32];
  grid_dep_enter();
  const float* const base = a.ws + int64_t(blockIdx.x) * a.splits * (D + 4);
  const int t = threadIdx.x;
  float mx = -INFINITY;  // over the splits with mass (an empty split's max is -inf)
  for (int sp = t; sp < a.splits; sp += kMergeThreads) {
    const float* src = base + int64_t(sp) * (D + 4);
    if (reinterpret_cast<const double*>(src + D + 2)[0] > 0) mx = fmaxf(mx, src[D]);
  }
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, o));
  if ((t & 31) == 0) smax[t >> 5] = mx;
  __syncthreads();
  float M = smax[0];
#pragma unroll
  for (int w = 1; w < kMergeThreads / 32; ++w) M = fmaxf(M, smax[w]);
  const int c4 = t % Q, grp = t / Q;
  float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
  double L = 0;
  if (M > -INFINITY) {
#pragma unroll 4
    for (int sp = grp; sp < a.splits; sp += P) {
      const float* src = base + int64_t(sp) * (D + 4);
      const double l = reinterpret_cast<const double*>(src + D + 2)[0];
      if (!(l > 0)) continue;  // an empty split: its max is -inf, its output not read
      const float4 o = reinterpret_cast<const float4*>(src)[c4];
      const float w = expf(src[D] - M);
      O.x += w * o.x, O.y += w * o.y, O.z += w * o.z, O.w += w * o.w;
      L += double(w) * l;
    }
  }
  so[grp][c4] = O;
  if (c4 == 0) sl[grp] = L;
  __syncthreads();
  if (grp != 0) return;
  O = so[0][c4], L = sl[0];
  for (int j = 1; j < P; ++j) {
    const float4 x = so[j][c4];
    O.x += x.x, O.y += x.y, O.z += x.z, O.w += x.w;
    L += sl[j];
  }
  const float inv = L > 0 ? float(1.0 / L) : 0.f;
  reinterpret_cast<float4*>(a.out + int64_t(blockIdx.x) * D)[c4] =
      make_float4(O.x * inv, O.y * inv, O.z * inv, O.w * inv);
}

// Several tokens at once (PagedDecodeParams::n_tokens > 1): a verification pass's attention.
// A KV head's query rows (token-major: row r is token r / G of query head g G + r % G) go to
// CTAs of kPassRows; a CTA stages each block of its split in shared memory once, as floats, and
// its warps score it for kPassRowsPerWarp rows each (a lane per key, so no cross-lane sums),
// then fold the values (a lane per channel group). A block is thus read once per kPassRows rows
// instead of once per row. Row r does not see the newest n_tokens - 1 - token keys; a KV head's
// blocks before its last are full (the pool fills a block before opening the next), so block b
// holds keys 64 b onward.
constexpr int kPassWarps = 8, kPassRowsPerWarp = 4, kPassRows = kPassWarps * kPassRowsPerWarp;

template <int D>
constexpr size_t pass_smem_bytes() {
  // K (a row padded by four floats: lane t reads four channels of row t as one 16-byte load,
  // and each quarter-warp's loads fall in distinct banks), V, the CTA's queries, the warps'
  // weights.
  return sizeof(float) * (size_t(kBT) * (D + 4) + size_t(kBT) * D + size_t(kPassRows) * D +
                          size_t(kPassRows) * kBT);
}

// A thread of pass_kernel stages a block in NL loads of 16 bytes (E elements) of its keys and as
// many of its values; load li covers row (tid + 256 li) E / D at channel (tid E) % D, the same
// channels each time. PassRaw holds NR of them as loaded, from load l0 on, and for INT8 the F16
// scales and zeros of the thread's key channels and each row's value scale and zero.
template <int D, PoolDType T>
inline constexpr int kPassLoads = kDecodeBlockTokens * D / (kPassWarps * 32 * kElemsPerLoad<T>);
template <PoolDType T, int NR>
struct PassRaw {
  static constexpr int F = T == PoolDType::kInt8 ? kElemsPerLoad<T> / 8 : 1;  // F16 x 8 loads
  uint4 k[NR], v[NR];
  uint4 ks[F], kz[F];
  uint16_t vs[NR], vz[NR];
};
// Whether a whole block's loads fit in registers while the previous block is worked on (at
// most 8 of 16 bytes), so they are issued a block ahead. Otherwise (F32 at head_dim 128: 16,
// which took the kernel to 238 registers and one CTA an SM) a block is loaded as it is staged,
// 4 + 4 at a time.
template <int D, PoolDType T>
inline constexpr bool kPassAhead =
    2 * kPassLoads<D, T> + (T == PoolDType::kInt8 ? 2 * PassRaw<T, 1>::F : 0) <= 8;

// Issues loads l0 .. l0 + NR - 1 of block blk (fill n) into r (rows past the fill are not loaded);
// nothing waits on them until r is read.
template <int D, PoolDType T, int NR>
__device__ __forceinline__ void pass_fetch(const PagedKv& kv, int64_t blk, int n, int l0,
                                           PassRaw<T, NR>* r) {
  constexpr int E = kElemsPerLoad<T>;
  static_assert((kPassWarps * 32 * E) % D == 0, "a thread's loads share their channels");
  const int c = (threadIdx.x * E) % D;
  if constexpr (T == PoolDType::kInt8) {
    if (l0 == 0) {
#pragma unroll
      for (int e = 0; e < PassRaw<T, NR>::F; ++e) {
        r->ks[e] = __ldg(reinterpret_cast<const uint4*>(kv.kscale + blk * D + c + 8 * e));
        r->kz[e] = __ldg(reinterpret_cast<const uint4*>(kv.kzero + blk * D + c + 8 * e));
      }
    }
  }
#pragma unroll
  for (int li = 0; li < NR; ++li) {
    const int t = (threadIdx.x + (l0 + li) * kPassWarps * 32) * E / D;
    if (t >= n) continue;
    const int64_t at = (blk * kBT + t) * D + c;  // in elements
    const auto load = [&](const void* base) {
      return __ldg(reinterpret_cast<const uint4*>(static_cast<const char*>(base) + at * (16 / E)));
    };
    r->k[li] = load(kv.k);
    r->v[li] = load(kv.v);
    if constexpr (T == PoolDType::kInt8) {
      r->vs[li] = __ldg(kv.vscale + blk * kBT + t);
      r->vz[li] = __ldg(kv.vzero + blk * kBT + t);
    }
  }
}

// Writes the loads in r (from load l0 on) into the staged block as floats: K rows padded to
// D + 4, V rows of D (INT8: decoded with the block's channel scales and zeros for keys, the
// row's for values); rows past the fill n as zeros.
template <int D, PoolDType T, int NR>
__device__ __forceinline__ void pass_stage(const PassRaw<T, NR>& r, int n, int l0, float* ks,
                                           float* vs) {
  constexpr int E = kElemsPerLoad<T>;
  const int c = (threadIdx.x * E) % D;
#pragma unroll
  for (int li = 0; li < NR; ++li) {
    const int t = (threadIdx.x + (l0 + li) * kPassWarps * 32) * E / D;
    float k[E], v[E];
    if (t < n) {
      cvt_elems<T>(r.k[li], k);
      cvt_elems<T>(r.v[li], v);
      if constexpr (T == PoolDType::kInt8) {
        float s[E], z[E];
#pragma unroll
        for (int e = 0; e < E / 8; ++e)
          cvt_f16x8(r.ks[e], s + 8 * e), cvt_f16x8(r.kz[e], z + 8 * e);
        const float vsc = f16f(r.vs[li]), vz = f16f(r.vz[li]);
#pragma unroll
        for (int e = 0; e < E; ++e) k[e] = z[e] + k[e] * s[e], v[e] = vz + v[e] * vsc;
      }
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) k[e] = v[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < E; e += 4) {
      *reinterpret_cast<float4*>(ks + t * (D + 4) + c + e) =
          make_float4(k[e], k[e + 1], k[e + 2], k[e + 3]);
      *reinterpret_cast<float4*>(vs + t * D + c + e) =
          make_float4(v[e], v[e + 1], v[e + 2], v[e + 3]);
    }
  }
}

// CTA (KV head, split, row chunk); grid index = (g * splits + split) * chunks + chunk, so the
// chunks that read the same blocks run side by side.
template <int D, PoolDType T>
__global__ void __launch_bounds__(kPassWarps * 32) pass_kernel(const DecodeArgs a, int chunks) {
  extern __shared__ __align__(16) float smem[];  // read as float4
  float* ks = smem;                         // [kBT][D + 4]
  float* vs = ks + kBT * (D + 4);           // [kBT][D]
  float* qs = vs + kBT * D;                 // [kPassRows][D], scaled
  float* ps = qs + kPassRows * D;           // [kPassRows][kBT]
  constexpr int DPL = D / 32;               // channels a lane folds
  grid_dep_enter();
  const int chunk = blockIdx.x % chunks, gs = blockIdx.x / chunks;
  const int split = gs % a.splits, g = gs / a.splits;
  const int G = a.n_heads / a.kv.n_kv_heads, R = G * a.n_tokens;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int32_t* pages = a.kv.pages + int64_t(g) * a.kv.max_pages;
  const int nb = a.kv.n_pages[g];
  const int64_t total = nb > 0 ? int64_t(nb - 1) * kBT + a.kv.fill[pages[nb - 1]] : 0;
  // The CTA's rows: queries to shared memory, pre-scaled.
  for (int i = threadIdx.x; i < kPassRows * D; i += blockDim.x) {
    const int r = chunk * kPassRows + i / D;
    float x = 0.f;
    if (r < R) {
      const int tok = r / G, h = g * G + r % G;
      x = a.q[(int64_t(tok) * a.n_heads + h) * D + i % D] * a.scale;
    }
    qs[i] = x;
  }
  // This warp's rows: how many keys each sees, and its running max, mass and output.
  int64_t vis[kPassRowsPerWarp];
  float m[kPassRowsPerWarp], o[kPassRowsPerWarp][DPL];
  double l[kPassRowsPerWarp];
#pragma unroll
  for (int j = 0; j < kPassRowsPerWarp; ++j) {
    const int r = chunk * kPassRows + warp * kPassRowsPerWarp + j;
    vis[j] = r < R ? total - (a.n_tokens - 1 - r / G) : 0;
    m[j] = -INFINITY;
    l[j] = 0;
#pragma unroll
    for (int c = 0; c < DPL; ++c) o[j][c] = 0.f;
  }
  const int per = (nb + a.splits - 1) / a.splits;
  const int b0 = split * per, b1 = min(nb, b0 + per);
  // A block's loads are all issued before any is used, and where they fit (kPassAhead) a block
  // ahead: block b + 1's loads are in flight while the warps work on block b. (A loop of
  // load-then-store, then a barrier, then the arithmetic, had left the loads waiting one by one
  // and the SM idle between.)
  constexpr int NL = kPassLoads<D, T>;
  static_assert(NL * kPassWarps * 32 * kElemsPerLoad<T> == kBT * D, "whole loads a thread");
  constexpr bool kAhead = kPassAhead<D, T>;
  constexpr int NR = kAhead ? NL : (NL < 4 ? NL : 4);  // loads held in registers at once
  static_assert(NL % NR == 0, "whole rounds of loads");
  PassRaw<T, NR> raw;
  int n = 0;  // the fill of the block whose loads raw holds (kAhead)
  if (kAhead && b0 < b1) {
    n = a.kv.fill[pages[b0]];
    pass_fetch<D>(a.kv, pages[b0], n, 0, &raw);
  }
  for (int b = b0; b < b1; ++b) {
    __syncthreads();  // the last block's K and V are no longer read
    int n_cur;  // this block's fill
    if constexpr (kAhead) {
      n_cur = n;
      pass_stage<D>(raw, n_cur, 0, ks, vs);
      if (b + 1 < b1) {
        n = a.kv.fill[pages[b + 1]];
        pass_fetch<D>(a.kv, pages[b + 1], n, 0, &raw);
      }
    } else {
      const int64_t blk = pages[b];
      n_cur = a.kv.fill[blk];
#pragma unroll
      for (int l0 = 0; l0 < NL; l0 += NR) {
        pass_fetch<D>(a.kv, blk, n_cur, l0, &raw);
        pass_stage<D>(raw, n_cur, l0, ks, vs);
      }
    }
    __syncthreads();
    // Scores: lane t takes keys t and t + 32 for the warp's rows.
    float sc[kPassRowsPerWarp][2];
#pragma unroll
    for (int j = 0; j < kPassRowsPerWarp; ++j) sc[j][0] = sc[j][1] = 0.f;
    const float* qw = qs + warp * kPassRowsPerWarp * D;
#pragma unroll 4
    for (int c = 0; c < D; c += 4) {
      const float4 k0 = *reinterpret_cast<const float4*>(ks + lane * (D + 4) + c);
      const float4 k1 = *reinterpret_cast<const float4*>(ks + (lane + 32) * (D + 4) + c);
#pragma unroll
      for (int j = 0; j < kPassRowsPerWarp; ++j) {
        const float4 qv = *reinterpret_cast<const float4*>(qw + j * D + c);  // a broadcast
        sc[j][0] += qv.x * k0.x + qv.y * k0.y + qv.z * k0.z + qv.w * k0.w;
        sc[j][1] += qv.x * k1.x + qv.y * k1.y + qv.z * k1.z + qv.w * k1.w;
      }
    }
    float* pw = ps + warp * kPassRowsPerWarp * kBT;
#pragma unroll
    for (int j = 0; j < kPassRowsPerWarp; ++j) {
      const int64_t key0 = int64_t(b) * kBT;
      const bool ok0 = lane < n_cur && key0 + lane < vis[j];
      const bool ok1 = lane + 32 < n_cur && key0 + lane + 32 < vis[j];
      const float s0 = ok0 ? sc[j][0] : -INFINITY, s1 = ok1 ? sc[j][1] : -INFINITY;
      float bm = fmaxf(s0, s1);
#pragma unroll
      for (int off = 16; off >= 1; off >>= 1) bm = fmaxf(bm, __shfl_xor_sync(kAll, bm, off));
      if (bm == -INFINITY) {  // the row sees none of this block
        pw[j * kBT + lane] = 0.f;
        pw[j * kBT + lane + 32] = 0.f;
        continue;
      }
      const float mn = fmaxf(m[j], bm);
      const float alpha = expf(m[j] - mn);  // 0 while nothing is folded (m = -inf)
      const float e0 = ok0 ? expf(s0 - mn) : 0.f, e1 = ok1 ? expf(s1 - mn) : 0.f;
      double t = double(e0) + double(e1);
#pragma unroll
      for (int off = 16; off >= 1; off >>= 1) t += __shfl_xor_sync(kAll, t, off);
      l[j] = l[j] * double(alpha) + t;
      m[j] = mn;
#pragma unroll
      for (int c = 0; c < DPL; ++c) o[j][c] *= alpha;
      pw[j * kBT + lane] = e0;
      pw[j * kBT + lane + 32] = e1;
    }
    __syncwarp();
    // Values: lane folds channels lane, lane + 32, ... of each row, four keys a step (the
    // weights as one broadcast load; keys past the fill have weight 0 and value 0).
    for (int t = 0; t < n_cur; t += 4) {
      float v[4][DPL];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int c = 0; c < DPL; ++c) v[u][c] = vs[(t + u) * D + lane + 32 * c];
#pragma unroll
      for (int j = 0; j < kPassRowsPerWarp; ++j) {
        const float4 w = *reinterpret_cast<const float4*>(pw + j * kBT + t);
#pragma unroll
        for (int c = 0; c < DPL; ++c) o[j][c] += w.x * v[0][c] + w.y * v[1][c] + w.z * v[2][c] + w.w * v[3][c];
      }
    }
    __syncwarp();
  }
  // Partials (or, one split, the outputs) in full_kernel's layout: row tok * n_heads + h.
#pragma unroll
  for (int j = 0; j < kPassRowsPerWarp; ++j) {
    const int r = chunk * kPassRows + warp * kPassRowsPerWarp + j;
    if (r >= R) continue;
    const int64_t row = int64_t(r / G) * a.n_heads + g * G + r % G;
    if (a.splits == 1) {
      const float inv = l[j] > 0 ? float(1.0 / l[j]) : 0.f;
#pragma unroll
      for (int c = 0; c < DPL; ++c) a.out[row * D + lane + 32 * c] = o[j][c] * inv;
    } else {
      float* dst = a.ws + (row * a.splits + split) * (D + 4);
#pragma unroll
      for (int c = 0; c < DPL; ++c) dst[lane + 32 * c] = o[j][c];
      if (lane == 0) {
        dst[D] = m[j];
        reinterpret_cast<double*>(dst + D + 2)[0] = l[j];
      }
    }
  }
}

// Full mode with the query heads of a KV head sharing each block's rows (INT8 pools):
// warp_block's work for up to kGqaMax query heads at once (NH of them in its loops, the first
// G <= NH real; entries from NH on are not written). The rows are loaded and, INT8, converted
// once; each head keeps its own folded query, scores, weights and sums, summed in the
// same order as warp_block's, so every head's result for a block is the one warp_block gives it
// (the splits differ from full_kernel's, so blocks merge in another order: the last bits move).
constexpr int kGqaMax = 4;

// Where warp_block_heads reads a block: the pool's arrays (global memory, rows from row0) or a
// copy staged in shared memory (full_staged_kernel, rows from 0).
struct BlockSrc {
  const void *k, *v;         // keys and values (codes for INT8); row r at (row0 + r) * D
  int64_t row0;
  const uint16_t *ks, *kz;   // INT8: the block's key channel scales and zeros (F16 bits), [D]
  const uint16_t *vs, *vz;   // INT8: its rows' value scales and zeros, [kBT]
};
template <int D>
__device__ __forceinline__ BlockSrc pool_block(const PagedKv& kv, int64_t blk) {
  return {kv.k, kv.v, blk * kBT, kv.kscale + blk * D, kv.kzero + blk * D, kv.vscale + blk * kBT,
          kv.vzero + blk * kBT};
}

template <int D, PoolDType T, bool kSmem = false, int NH = kGqaMax>
__device__ __forceinline__ void warp_block_heads(const float (&qf)[kGqaMax][kElemsPerLoad<T>],
                                                 int G, const BlockSrc& bs, int n,
                                                 float scale, float (&bm)[kGqaMax],
                                                 double (&mass)[kGqaMax],
                                                 float4 (&o4)[kGqaMax]) {
  constexpr int E = kElemsPerLoad<T>;
  constexpr int LPR = D / E;
  constexpr int RPL = 32 / LPR;
  const int lane = threadIdx.x & 31, grp = lane % LPR, sub = lane / LPR;
  const int64_t row0 = bs.row0;
  float qk[kGqaMax][E];
  float bias[kGqaMax];
  if constexpr (T == PoolDType::kInt8) {
    float ks[E], kz[E];
    ld_f16<E, kSmem>(bs.ks + E * grp, ks);
    ld_f16<E, kSmem>(bs.kz + E * grp, kz);
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      bias[hh] = 0.f;
#pragma unroll
      for (int i = 0; i < E; ++i) qk[hh][i] = qf[hh][i] * ks[i], bias[hh] += qf[hh][i] * kz[i];
    }
  } else {
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      bias[hh] = 0.f;
#pragma unroll
      for (int i = 0; i < E; ++i) qk[hh][i] = qf[hh][i];
    }
  }
  float s[kGqaMax][2];
#pragma unroll
  for (int round = 0; round < 2; ++round) {
    float v[kGqaMax][LPR];
#pragma unroll
    for (int j = 0; j < LPR; ++j) {
      const int row = round * 32 + j * RPL + sub;
      float x[E];
      if (row < n) {
        ld_elems<T, kSmem>(bs.k, (row0 + row) * D + E * grp, x);
      } else {
#pragma unroll
        for (int i = 0; i < E; ++i) x[i] = 0.f;
      }
#pragma unroll
      for (int hh = 0; hh < NH; ++hh) {
        float acc = bias[hh];
#pragma unroll
        for (int i = 0; i < E; ++i) acc += qk[hh][i] * x[i];
        v[hh][j] = acc;
      }
    }
    const int row = round * 32 + grp * RPL + sub;
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      if (hh < G) reduce_scatter<LPR / 2>(v[hh], lane);  // G is uniform over the warp
      s[hh][round] = row < n ? v[hh][0] * scale : -INFINITY;
    }
  }
  float e[kGqaMax][2];
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) {
    float m = fmaxf(s[hh][0], s[hh][1]);
    double t = 0;
    if (hh < G) {
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kAll, m, o));
      e[hh][0] = s[hh][0] == -INFINITY ? 0.f : expf(s[hh][0] - m);
      e[hh][1] = s[hh][1] == -INFINITY ? 0.f : expf(s[hh][1] - m);
      t = double(e[hh][0]) + double(e[hh][1]);
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) t += __shfl_xor_sync(kAll, t, o);
    } else {
      e[hh][0] = e[hh][1] = 0.f;
    }
    bm[hh] = m;
    mass[hh] = t;
  }
  float ez[kGqaMax][2];
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) ez[hh][0] = ez[hh][1] = 0.f;
  if constexpr (T == PoolDType::kInt8) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r * 32 + grp * RPL + sub;
      if (row < n) {
        const float z = f16f(kSmem ? bs.vz[row] : __ldg(bs.vz + row)),
                    sc = f16f(kSmem ? bs.vs[row] : __ldg(bs.vs + row));
#pragma unroll
        for (int hh = 0; hh < NH; ++hh) ez[hh][r] = e[hh][r] * z, e[hh][r] *= sc;
      }
    }
  }
  float acc[kGqaMax][E];
  float accz[kGqaMax];
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) {
    accz[hh] = 0.f;
#pragma unroll
    for (int i = 0; i < E; ++i) acc[hh][i] = 0.f;
  }
#pragma unroll 4
  for (int j = 0; j < 64 / RPL; ++j) {
    const int row = j * RPL + sub;
    const int r = row & 31;
    const int src = (r % RPL) * LPR + r / RPL;
    float w[kGqaMax];
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      w[hh] = __shfl_sync(kAll, (j * RPL) < 32 ? e[hh][0] : e[hh][1], src);
      if constexpr (T == PoolDType::kInt8)
        accz[hh] += __shfl_sync(kAll, (j * RPL) < 32 ? ez[hh][0] : ez[hh][1], src);
    }
    if (row < n) {
      float x[E];
      ld_elems<T, kSmem>(bs.v, (row0 + row) * D + E * grp, x);
#pragma unroll
      for (int hh = 0; hh < NH; ++hh)
#pragma unroll
        for (int i = 0; i < E; ++i) acc[hh][i] += w[hh] * x[i];
    }
  }
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) {
    if (hh >= G) {
      o4[hh] = make_float4(0.f, 0.f, 0.f, 0.f);
      continue;
    }
#pragma unroll
    for (int o = LPR; o < 32; o <<= 1) {
#pragma unroll
      for (int i = 0; i < E; ++i) acc[hh][i] += __shfl_xor_sync(kAll, acc[hh][i], o);
      if constexpr (T == PoolDType::kInt8) accz[hh] += __shfl_xor_sync(kAll, accz[hh], o);
    }
    if constexpr (T == PoolDType::kInt8) {
#pragma unroll
      for (int i = 0; i < E; ++i) acc[hh][i] += accz[hh];
    }
    constexpr int P = E / 4;
    const int srcl = (lane / P) % LPR;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < P; ++r) {
      const float x0 = __shfl_sync(kAll, acc[hh][4 * r], srcl),
                  x1 = __shfl_sync(kAll, acc[hh][4 * r + 1], srcl),
                  x2 = __shfl_sync(kAll, acc[hh][4 * r + 2], srcl),
                  x3 = __shfl_sync(kAll, acc[hh][4 * r + 3], srcl);
      if (lane % P == r) o = make_float4(x0, x1, x2, x3);
    }
    o4[hh] = o;
  }
}

// The rows of n consecutive query heads from q (load_q) in qf[0, n), zeros in qf[n, N).
template <int D, PoolDType T, int N>
__device__ __forceinline__ void load_q_heads(const float* q, int n,
                                             float (&qf)[kGqaMax][kElemsPerLoad<T>]) {
#pragma unroll
  for (int hh = 0; hh < N; ++hh) {
    if (hh < n) {
      load_q<D, T>(q + int64_t(hh) * D, qf[hh]);
    } else {
#pragma unroll
      for (int i = 0; i < kElemsPerLoad<T>; ++i) qf[hh][i] = 0.f;
    }
  }
}

// Full mode, one token: CTA (KV head, split). One producer thread streams the split's blocks
// through a ring of staged_stages() shared-memory stages, a block's keys and its values one bulk
// copy each (INT8: also its key channels' scales and zeros and its rows' value scales and
// zeros); the consumer warps read them there. A consumer warp serves a set of the KV head's
// query heads: one head over F32 and BF16 pools (warp_block), up to kGqaMax over INT8, whose
// codes it converts once for all of them (warp_block_heads). With `sets` sets, W =
// kStagedConsumers / sets warps a set take every W-th block. A block then comes from memory
// once for its KV head's query heads, and the copies run ahead of the arithmetic instead of
// waiting on it (full_kernel: a warp per query head loads its own rows). A set's W warps merge
// their partials in the CTA, so the merge kernel takes `splits` rows a query head, not splits x
// W (at head_dim 64, 88 CTAs a KV head would otherwise leave it 176).
// Consumer warps a CTA can hold (sets x W of them work). INT8 takes 3: warp_block_heads keeps
// four heads' queries and sums in about 255 registers (with 8 consumer warps the kernel was held
// to 168 and spilled), so 4 warps a CTA let two CTAs share an SM.
template <PoolDType T>
inline constexpr int kStagedConsumers = T == PoolDType::kInt8 ? 3 : 8;
template <PoolDType T>
inline constexpr int kStagedHeadsPerWarp = T == PoolDType::kInt8 ? kGqaMax : 1;
// The keys (or the values) of one block.
template <int D, PoolDType T>
__host__ __device__ constexpr size_t staged_block_bytes() {
  return size_t(kBT) * D * (T == PoolDType::kF32 ? 4 : T == PoolDType::kBF16 ? 2 : 1);
}
// INT8: a block's key scales and zeros ([D] F16 each), then its value scales and zeros ([kBT]).
template <int D, PoolDType T>
__host__ __device__ constexpr size_t staged_meta_bytes() {
  return T == PoolDType::kInt8 ? 2 * sizeof(uint16_t) * size_t(D + kBT) : 0;
}
template <int D, PoolDType T>
__host__ __device__ constexpr size_t staged_stage_bytes() {
  return 2 * staged_block_bytes<D, T>() + staged_meta_bytes<D, T>();
}
template <int D, PoolDType T>
__host__ __device__ constexpr int staged_stages() {  // as many as fit about 96 KB, 2 to 4
  const int fit = int((96 * 1024) / staged_stage_bytes<D, T>());
  return fit < 2 ? 2 : fit > 4 ? 4 : fit;
}
// The ring's stages, then their full and empty barriers, then the consumer warps' partials for
// the in-CTA merge: outputs [kStagedConsumers][heads a warp][D / 4] float4, masses (double),
// maxima.
template <int D, PoolDType T>
__host__ __device__ constexpr size_t staged_merge_offset() {
  return size_t(staged_stages<D, T>()) * (staged_stage_bytes<D, T>() + 2 * sizeof(uint64_t));
}
template <int D, PoolDType T>
__host__ __device__ constexpr size_t staged_smem_bytes() {
  return staged_merge_offset<D, T>() + size_t(kStagedConsumers<T>) * kStagedHeadsPerWarp<T> *
                                           (D * sizeof(float) + sizeof(double) + sizeof(float));
}

// Synchronizes `threads` threads (a multiple of 32) on hardware barrier `id` (0 is
// __syncthreads'): the consumer warps of a warp-specialized CTA, without the producer.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// NHF: INT8, the query heads a set's warp does the arithmetic for (warp_block_heads' NH): 4, or
// 2 and 3 for groups of that size (all of whose heads are one set). A group of 3 doing 4 heads'
// work was 17% slower at d 64, and a run-time choice among them in one kernel made the 4-head
// path 5% slower at d 128 (NOTES, thirty-fourth session), hence a kernel each.
template <int D, PoolDType T, int NHF = kStagedHeadsPerWarp<T>>
__global__ void __launch_bounds__((kStagedConsumers<T> + 1) * 32)
    full_staged_kernel(const DecodeArgs a, int splits, int W) {
  constexpr int S = staged_stages<D, T>(), LPR = D / 4, E = kElemsPerLoad<T>;
  constexpr int HPW = kStagedHeadsPerWarp<T>;
  constexpr size_t HB = staged_block_bytes<D, T>(), SB = staged_stage_bytes<D, T>();
  extern __shared__ __align__(128) unsigned char staged_smem[];
  unsigned char* const smem = staged_smem;
  grid_dep_enter();
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S * SB);  // stage's copies landed
  // Every lane of every consumer warp arrives on a stage's empty barrier for each block (an
  // arrive releases the arriving thread's own reads only; warps that skip the block arrive at
  // once), so no warp falls a whole ring behind the producer.
  uint64_t* empty = full + S;
  const int n_kv = a.kv.n_kv_heads, G = a.n_heads / n_kv, sets = (G + HPW - 1) / HPW;
  const int g = blockIdx.x % n_kv, split = blockIdx.x / n_kv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nb = a.kv.n_pages[g], per = (nb + splits - 1) / splits;
  const int b0 = min(nb, split * per), b1 = min(nb, b0 + per);
  const int32_t* pages = a.kv.pages + int64_t(g) * a.kv.max_pages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar::init(&full[s], 1), mbar::init(&empty[s], sets * W * 32);
    mbar::init_fence();
  }
  __syncthreads();
  if (warp == 0) {
    // Block i of the split goes to stage i % S once that stage's block i - S has been read.
    if (lane == 0)
      for (int b = b0, i = 0; b < b1; ++b, ++i) {
        const int s = i % S;
        if (i >= S) mbar::wait(&empty[s], ((i / S) - 1) & 1);
        const int64_t blk = pages[b];
        unsigned char* st = smem + s * SB;
        mbar::arrive_expect_tx(&full[s], uint32_t(SB));
        mbar::bulk_copy(st, static_cast<const char*>(a.kv.k) + blk * HB, uint32_t(HB), &full[s]);
        mbar::bulk_copy(st + HB, static_cast<const char*>(a.kv.v) + blk * HB, uint32_t(HB),
                        &full[s]);
        if constexpr (T == PoolDType::kInt8) {
          constexpr uint32_t KM = D * sizeof(uint16_t), VM = kBT * sizeof(uint16_t);
          mbar::bulk_copy(st + 2 * HB, a.kv.kscale + blk * D, KM, &full[s]);
          mbar::bulk_copy(st + 2 * HB + KM, a.kv.kzero + blk * D, KM, &full[s]);
          mbar::bulk_copy(st + 2 * HB + 2 * KM, a.kv.vscale + blk * kBT, VM, &full[s]);
          mbar::bulk_copy(st + 2 * HB + 2 * KM + VM, a.kv.vzero + blk * kBT, VM, &full[s]);
        }
      }
    return;
  }
  const int c = warp - 1;
  if (c >= sets * W) return;
  const int set = c % sets, w = c / sets;
  const int h0 = g * G + set * HPW, GS = min(HPW, G - set * HPW);  // this set's query heads
  float qf[kGqaMax][E];
  load_q_heads<D, T, HPW>(a.q + int64_t(h0) * D, GS, qf);
  float m[HPW];
  double l[HPW];
  float4 o[HPW];
#pragma unroll
  for (int hh = 0; hh < HPW; ++hh) m[hh] = -INFINITY, l[hh] = 0, o[hh] = make_float4(0, 0, 0, 0);
  // Every block's landing is awaited in order, the other warps' blocks too. A parity names a
  // stage's fill unambiguously only to a waiter at most one fill behind: the waits in order keep
  // it from being ahead, and the producer's wait for every warp's arrival from being behind.
  for (int b = b0, i = 0; b < b1; ++b, ++i) {
    const int s = i % S;
    mbar::wait(&full[s], (i / S) & 1);
    if (i % W != w) {
      mbar::arrive(&empty[s]);
      continue;
    }
    const int n = a.kv.fill[pages[b]];
    if (n > 0) {
      const unsigned char* st = smem + s * SB;
      if constexpr (T == PoolDType::kInt8) {
        const auto* meta = reinterpret_cast<const uint16_t*>(st + 2 * HB);
        const BlockSrc src{st, st + HB, 0, meta, meta + D, meta + 2 * D, meta + 2 * D + kBT};
        float bm[kGqaMax];
        double mass[kGqaMax];
        float4 ob[kGqaMax];
        warp_block_heads<D, T, true, NHF>(qf, GS, src, n, a.scale, bm, mass, ob);  // GS <= NHF
#pragma unroll
        for (int hh = 0; hh < HPW; ++hh)
          if (hh < GS) fold(bm[hh], mass[hh], ob[hh], &m[hh], &l[hh], &o[hh]);
      } else {
        float bm;
        double mass;
        float4 ob;
        warp_block<D, T, true>(qf[0], a.kv, pages[b], n, a.scale, &bm, &mass, &ob, st, st + HB);
        fold(bm, mass, ob, &m[0], &l[0], &o[0]);
      }
    }
    mbar::arrive(&empty[s]);
  }
  if (lane < GS && split == 0 && w == 0 && a.visited) a.visited[h0 + lane] = nb;
  // A set's W partials per head (warps set + j sets), folded in j order by its warp w = 0.
  float4* const po = reinterpret_cast<float4*>(smem + staged_merge_offset<D, T>());
  double* const pl = reinterpret_cast<double*>(po + kStagedConsumers<T> * HPW * LPR);
  float* const pm = reinterpret_cast<float*>(pl + kStagedConsumers<T> * HPW);
#pragma unroll
  for (int hh = 0; hh < HPW; ++hh) {
    if (lane < LPR) po[(c * HPW + hh) * LPR + lane] = o[hh];
    if (lane == 0) pl[c * HPW + hh] = l[hh], pm[c * HPW + hh] = m[hh];
  }
  named_barrier_sync(1, sets * W * 32);
  if (w != 0 || lane >= LPR) return;
  for (int hh = 0; hh < GS; ++hh) {
    float M = -INFINITY;
    double L = 0;
    float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j = 0; j < W; ++j) {
      const int at = (set + j * sets) * HPW + hh;
      fold(pm[at], pl[at], po[at * LPR + lane], &M, &L, &O);
    }
    store_part<D>(a, h0 + hh, split, splits, M, L, O, lane);
  }
}

// Full mode, shared: CTA (split, KV head g), grid index = split * n_kv_heads + g. Warp w takes
// the split's pages w, w + 4, ... for the KV head's query heads, kGqaMax a pass; each head's
// split result goes where full_kernel's would (the same merge follows).
template <int D, PoolDType T>
__global__ void __launch_bounds__(kFullWarps * 32) full_shared_kernel(const DecodeArgs a) {
  constexpr int E = kElemsPerLoad<T>;
  constexpr int LPR = D / 4;
  __shared__ float sm_m[kFullWarps][kGqaMax];
  __shared__ double sm_l[kFullWarps][kGqaMax];
  __shared__ float4 sm_o[kFullWarps][kGqaMax][LPR];
  grid_dep_enter();
  const int n_kv = a.kv.n_kv_heads, group = a.n_heads / n_kv;
  const int g = blockIdx.x % n_kv, split = blockIdx.x / n_kv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nb = a.kv.n_pages[g];
  const int per = (nb + a.splits - 1) / a.splits;
  const int b0 = split * per, b1 = min(nb, b0 + per);
  const int32_t* pages = a.kv.pages + int64_t(g) * a.kv.max_pages;
  for (int h0 = 0; h0 < group; h0 += kGqaMax) {
    const int G = min(kGqaMax, group - h0);
    float qf[kGqaMax][E];
    load_q_heads<D, T, kGqaMax>(a.q + int64_t(g * group + h0) * D, G, qf);
    float m[kGqaMax];
    double l[kGqaMax];
    float4 o[kGqaMax];
#pragma unroll
    for (int hh = 0; hh < kGqaMax; ++hh) m[hh] = -INFINITY, l[hh] = 0, o[hh] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int b = b0 + warp; b < b1; b += kFullWarps) {
      const int64_t blk = pages[b];
      const int n = a.kv.fill[blk];
      if (n <= 0) continue;
      float bm[kGqaMax];
      double mass[kGqaMax];
      float4 ob[kGqaMax];
      warp_block_heads<D, T>(qf, G, pool_block<D>(a.kv, blk), n, a.scale, bm, mass, ob);
#pragma unroll
      for (int hh = 0; hh < kGqaMax; ++hh)
        if (hh < G) fold(bm[hh], mass[hh], ob[hh], &m[hh], &l[hh], &o[hh]);
    }
#pragma unroll
    for (int hh = 0; hh < kGqaMax; ++hh) {
      if (lane < LPR) sm_o[warp][hh][lane] = o[hh];
      if (lane == 0) sm_m[warp][hh] = m[hh], sm_l[warp][hh] = l[hh];
    }
    __syncthreads();
    // A thread per (head, channel quad) merges the warps.
    for (int t = threadIdx.x; t < G * LPR; t += blockDim.x) {
      const int hh = t / LPR, c4 = t % LPR, h = g * group + h0 + hh;
      float M = -INFINITY;
      double L = 0;
      float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int w = 0; w < kFullWarps; ++w) fold(sm_m[w][hh], sm_l[w][hh], sm_o[w][hh][c4], &M, &L, &O);
      if (a.splits == 1) {
        const float inv = L > 0 ? float(1.0 / L) : 0.f;
        reinterpret_cast<float4*>(a.out + int64_t(h) * D)[c4] =
            make_float4(O.x * inv, O.y * inv, O.z * inv, O.w * inv);
      } else {
        float* dst = a.ws + (int64_t(h) * a.splits + split) * (D + 4);
        reinterpret_cast<float4*>(dst)[c4] = O;
        if (c4 == 0) {
          dst[D] = M;
          reinterpret_cast<double*>(dst + D + 2)[0] = L;
        }
      }
    }
    __syncthreads();  // the shared arrays are rewritten by the next pass
  }
  if (split == 0 && a.visited)
    for (int t = threadIdx.x; t < group; t += blockDim.x) a.visited[g * group + t] = nb;
}

// The host's bound, summed channel by channel in its order (the ranking must be the host's).
// A NaN bound (from a NaN query or key) counts as unbounded, +inf, as on the host: the block is
// visited first and the order stays a total one.
template <int D>
__device__ float block_bound(const float* q, const float* kmin, const float* kmax) {
  float u = 0.f;
#pragma unroll 8
  for (int c = 0; c < D; c += 4) {
    const float4 lo = ld4(kmin + c), hi = ld4(kmax + c);
    u += fmaxf(q[c] * lo.x, q[c] * hi.x);
    u += fmaxf(q[c + 1] * lo.y, q[c + 1] * hi.y);
    u += fmaxf(q[c + 2] * lo.z, q[c + 2] * hi.z);
    u += fmaxf(q[c + 3] * lo.w, q[c + 3] * hi.w);
  }
  // A NaN bound counts as unbounded, as on the host: the block is visited first, so the NaN
  // reaches the output as with full attention (and the visit order is the host's).
  return isnan(u) ? INFINITY : u;
}

// PSA in rounds over the whole device. A launch is a fixed sequence of kernels (no host wait, so
// a CUDA graph can hold it): psa_bounds_kernel (every head's block bounds, a thread each),
// psa_rank_kernel (a CTA per head sorts them), then for each round r psa_round_kernel (a warp per
// (head, ranked block) of the round, over every SM) and psa_walk_kernel (a warp per head applies
// the host's stop rule to the round's blocks in rank order, 64 at a time, and folds the kept
// ones). Round r covers psa_round_size(r) ranked blocks (64, 128, ... up to kPsaRoundCap), so a
// head that stops early wastes at most one round's reads, and a head that visits most of its
// blocks gets them read by the whole device in a few rounds instead of by one SM group in many
// batches. A head whose rule has stopped is skipped by the later rounds.
constexpr int kPsaChunk = 64;        // blocks the walk tests at once (two a lane)
constexpr int kPsaRoundCap = 1024;   // the largest round
constexpr int kPsaRankThreads = 512;
constexpr int kPsaRoundWarps = 4;  // per CTA, psa_round_kernel

__host__ __device__ inline int psa_round_size(int r) {
  return r >= 4 ? kPsaRoundCap : kPsaChunk << r;  // 64, 128, 256, 512, 1024, 1024, ...
}

// A head's walk state between rounds (the host's scalars, in the frame of the running max m).
struct PsaHeadState {
  double acc, as_min, last4[kPsaRecentBlocks];
  float m;
  int visited, ranked, done;
};

// "+gqa" (one visit per KV head, gqa_walk_kernel): a KV head's walk state between rounds. turn:
// the query head (0 .. G - 1) whose turn comes next; running: heads whose rule has not stopped;
// n_cand: this round's scored blocks.
struct GqaKvState {
  int n_loaded, turn, running, n_cand, done;
};

// Where each part of the PSA workspace lives (byte offsets, 256-aligned), for n_heads query heads
// over pools of up to max_pages blocks per KV head. Round results: per query head, one slot per
// ranked block of the round; with +gqa, per KV head, one slot per block any of its G query heads
// may name this round (at most G x the round's size), scored for all G heads.
struct PsaLayout {
  int rounds = 0, round_max = 0;  // the rounds that cover max_pages; the largest one's size
  bool gqa = false;
  int group = 1, slots = 0;  // +gqa: G; result slots per owner (query head, or KV head)
  size_t state = 0, o = 0, ub = 0, ord = 0, r_bm = 0, r_n = 0, r_mass = 0, r_o = 0;
  size_t kvs = 0, cursor = 0, loaded = 0, mark = 0, cand_slot = 0, slot_page = 0, list = 0,
         list_n = 0;  // +gqa only
  size_t bytes = 0;
};
PsaLayout psa_layout(int n_heads, int n_kv_heads, int max_pages, int d, bool gqa) {
  PsaLayout L;
  for (int covered = 0; covered < max_pages; ++L.rounds) {
    covered += psa_round_size(L.rounds);
    L.round_max = psa_round_size(L.rounds);
  }
  L.gqa = gqa;
  L.group = gqa ? n_heads / n_kv_heads : 1;
  L.slots = gqa ? std::min(L.group * L.round_max, max_pages) : L.round_max;
  const size_t h = size_t(n_heads), P = size_t(max_pages), G = size_t(L.group);
  const size_t owners = gqa ? size_t(n_kv_heads) : h, S = size_t(L.slots);
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t off = at;
    at += (bytes + 255) / 256 * 256;
    return off;
  };
  L.state = take(h * sizeof(PsaHeadState));
  L.o = take(h * size_t(d) * sizeof(float));
  L.ub = take(h * P * sizeof(float));
  L.ord = take(h * P * sizeof(int));
  L.r_bm = take(owners * S * G * sizeof(float));
  L.r_n = take(owners * S * sizeof(int));
  L.r_mass = take(owners * S * G * sizeof(double));
  L.r_o = take(owners * S * G * size_t(d) * sizeof(float));
  if (gqa) {
    const size_t kv = size_t(n_kv_heads);
    L.kvs = take(kv * sizeof(GqaKvState));
    L.cursor = take(h * sizeof(int));
    L.loaded = take(kv * P);
    L.mark = take(kv * P * sizeof(int));
    L.cand_slot = take(kv * P * sizeof(int));
    L.slot_page = take(kv * S * sizeof(int));
    L.list = take(h * size_t(L.round_max) * sizeof(int));
    L.list_n = take(h * sizeof(int));
  }
  L.bytes = at;
  return L;
}

struct PsaWs {
  PsaHeadState* state;
  float* o;   // [n_heads][D] the running output
  float* ub;  // [n_heads][max_pages] bounds (psa_bounds_kernel), read by psa_rank_kernel
  int* ord;   // [n_heads][max_pages] page indices in visit order
  float* r_bm;  // [owner][slots][G] this round's block results, by slot
  int* r_n;     // [owner][slots]
  double* r_mass;
  float* r_o;  // [owner][slots][G][D]
  // +gqa: per KV head its state, blocks loaded (a byte per page index), this round's candidate
  // mark (round + 1) and slot per page index, page index per slot; per query head the cursor in
  // its order (every earlier block is loaded) and this round's list of blocks it may name.
  GqaKvState* kvs;
  int* cursor;
  unsigned char* loaded;
  int *mark, *cand_slot, *slot_page, *list, *list_n;
  int round_max, slots, group;
};
PsaWs psa_ws(void* base, const PsaLayout& L) {
  char* b = static_cast<char*>(base);
  auto at = [&](size_t off) { return L.gqa ? b + off : nullptr; };
  return PsaWs{reinterpret_cast<PsaHeadState*>(b + L.state),
               reinterpret_cast<float*>(b + L.o),
               reinterpret_cast<float*>(b + L.ub),
               reinterpret_cast<int*>(b + L.ord),
               reinterpret_cast<float*>(b + L.r_bm),
               reinterpret_cast<int*>(b + L.r_n),
               reinterpret_cast<double*>(b + L.r_mass),
               reinterpret_cast<float*>(b + L.r_o),
               reinterpret_cast<GqaKvState*>(at(L.kvs)),
               reinterpret_cast<int*>(at(L.cursor)),
               reinterpret_cast<unsigned char*>(at(L.loaded)),
               reinterpret_cast<int*>(at(L.mark)),
               reinterpret_cast<int*>(at(L.cand_slot)),
               reinterpret_cast<int*>(at(L.slot_page)),
               reinterpret_cast<int*>(at(L.list)),
               reinterpret_cast<int*>(at(L.list_n)),
               L.round_max,
               L.slots,
               L.group};
}

__device__ __forceinline__ int head_kv(const DecodeArgs& a, int h) {
  return h / (a.n_heads / a.kv.n_kv_heads);
}

// A thread per (query head, block): the host's bound (pinned blocks rank first).
template <int D>
__global__ void psa_bounds_kernel(const DecodeArgs a, const PsaWs w) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int P = a.kv.max_pages;
  if (idx >= int64_t(a.n_heads) * P) return;
  const int h = int(idx / P), b = int(idx % P), g = head_kv(a, h);
  const int nb = a.kv.n_pages[g];
  if (b >= nb) return;
  const int64_t blk = a.kv.pages[int64_t(g) * P + b];
  w.ub[idx] = (a.pin && (b == 0 || b == nb - 1))
                  ? INFINITY
                  : block_bound<D>(a.q + int64_t(h) * D, a.kv.kmin + blk * D, a.kv.kmax + blk * D);
}

// A CTA per query head: sorts its bounds into the visit order and resets its walk state. A head
// with no blocks is finished here. The order is the host's stable_sort by descending bound: a
// block radix sort is stable, and the blocks go in by index (blocked, thread t holding
// t * ITEMS ..), so ties stay in index order; -0 becomes +0 first, which the host's comparison
// holds equal, and padding past the head's blocks is -inf, after any real block. ITEMS x
// kPsaRankThreads covers max_pages (4 for 2,048 pages, 8 for kDecodeMaxPages).
template <int ITEMS>
__global__ void __launch_bounds__(kPsaRankThreads) psa_rank_kernel(const DecodeArgs a,
                                                                    const PsaWs w) {
  using Sort = cub::BlockRadixSort<float, kPsaRankThreads, ITEMS, int>;
  __shared__ typename Sort::TempStorage sort_tmp;
  const int h = blockIdx.x, tid = threadIdx.x, g = head_kv(a, h), D = a.kv.head_dim;
  const int nb = a.kv.n_pages[g], P = a.kv.max_pages;
  float key[ITEMS];
  int ord[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int b = tid * ITEMS + i;
    key[i] = b < nb ? w.ub[int64_t(h) * P + b] + 0.f : -INFINITY;
    ord[i] = b;
  }
  Sort(sort_tmp).SortDescending(key, ord);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
    if (tid * ITEMS + i < nb) w.ord[int64_t(h) * P + tid * ITEMS + i] = ord[i];
  for (int c = tid; c < D; c += blockDim.x) w.o[int64_t(h) * D + c] = 0.f;
  if (a.gqa) {
    // The first query head of a KV head resets the KV head's visit.
    if (tid == 0) w.cursor[h] = 0;
    if (h % w.group == 0) {
      for (int b = tid; b < nb; b += blockDim.x) {
        w.loaded[int64_t(g) * P + b] = 0;
        w.mark[int64_t(g) * P + b] = 0;
      }
      if (tid == 0) w.kvs[g] = GqaKvState{0, 0, w.group, 0, nb == 0};
    }
  }
  if (tid == 0) {
    PsaHeadState st{};
    st.acc = 0;
    st.as_min = INFINITY;
    st.m = -INFINITY;
    st.done = nb == 0;
    w.state[h] = st;
    if (nb == 0 && a.visited) a.visited[h] = 0;
  }
  if (nb == 0)
    for (int c = tid; c < D; c += blockDim.x) a.out[int64_t(h) * D + c] = 0.f;
}

// Round kernel: warp (head, slot) scores ranked block start + slot of its head, unless the head
// is done or has fewer blocks. Grid: n_heads x ceil(size / kPsaRoundWarps) CTAs.
template <int D, PoolDType T>
__global__ void __launch_bounds__(kPsaRoundWarps * 32)
    psa_round_kernel(const DecodeArgs a, const PsaWs w, int start, int size) {
  constexpr int LPR = D / 4;
  const int per_head = (size + kPsaRoundWarps - 1) / kPsaRoundWarps;
  const int h = blockIdx.x / per_head, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slot = (blockIdx.x % per_head) * kPsaRoundWarps + warp, i = start + slot;
  const int g = head_kv(a, h), nb = a.kv.n_pages[g];
  if (slot >= size || i >= nb || w.state[h].done) return;
  const int P = a.kv.max_pages;
  const int64_t blk = a.kv.pages[int64_t(g) * P + w.ord[int64_t(h) * P + i]];
  const int n = a.kv.fill[blk];
  float bm = -INFINITY;
  double mass = 0;
  float4 ob = make_float4(0.f, 0.f, 0.f, 0.f);
  if (n > 0) {
    float qf[kElemsPerLoad<T>];
    load_q<D, T>(a.q + int64_t(h) * D, qf);
    warp_block<D, T>(qf, a.kv, blk, n, a.scale, &bm, &mass, &ob);
  }
  const int64_t r = int64_t(h) * w.round_max + slot;
  if (lane < LPR) reinterpret_cast<float4*>(w.r_o + r * D)[lane] = ob;
  if (lane == 0) w.r_bm[r] = bm, w.r_mass[r] = mass, w.r_n[r] = n;
}

// Walk kernel: one warp per query head takes the round's results in rank order, kPsaChunk at a
// time, and applies the host's walk (decode_attention.cpp) up to its stop as prefix computations:
// at each block the running mass, AS_min, the ranked count and the last kPsaRecentBlocks ranked
// masses are prefix quantities, so the warp finds the first block where the stop test holds at
// once. Masses are taken in the frame of the chunk's largest max M (the test is a ratio, so the
// frame changes only rounding), then carried in the frame of the visited blocks' max. Warp 0
// walks the round's chunks with scalars only, noting each kept block's max; then the
// kPsaWalkWarps warps fold the kept blocks once, in the final frame (weight exp(bm - m), so no
// chunk waits for the outputs: lane l < D / 4 holds channels 4 l .. 4 l + 3, 16 loads in flight),
// and warp 0 adds the partials to the running output rescaled into that frame.
constexpr int kPsaWalkWarps = 4;
template <int D>
__global__ void __launch_bounds__(kPsaWalkWarps * 32)
    psa_walk_kernel(const DecodeArgs a, const PsaWs w, int start, int size) {
  constexpr int LPR = D / 4;
  constexpr int kPer = kPsaChunk / 32;  // consecutive blocks per lane
  __shared__ double fb_s[kPsaChunk];         // each block's full-block mass if ranked
  __shared__ unsigned char rk_s[kPsaChunk];  // ... and whether it is ranked (not pinned, empty)
  __shared__ float kept_bm[kPsaRoundCap];   // the round's blocks: max if kept, -inf if not
  __shared__ float4 part_s[kPsaWalkWarps][LPR];  // the warps' folded shares of the round
  __shared__ float m_s;
  __shared__ int taken_s, done_s;
  const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = head_kv(a, h);
  const int nb = a.kv.n_pages[g], P = a.kv.max_pages;
  PsaHeadState st = w.state[h];
  if (st.done || start >= nb) return;
  float4 o = warp == 0 && lane < LPR ? reinterpret_cast<const float4*>(w.o + int64_t(h) * D)[lane]
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
  const float m_in = st.m;  // the frame of o
  float m = st.m;
  double acc = st.acc, as_min = st.as_min, last4[kPsaRecentBlocks];
#pragma unroll
  for (int j = 0; j < kPsaRecentBlocks; ++j) last4[j] = st.last4[j];
  int visited = st.visited, ranked = st.ranked;
  bool finished = false;
  const int end = min(nb, start + size);
  int taken = 0;  // round positions walked (kept or dropped)
  if (warp == 0) {
    for (int base = start; base < end && !finished; base += kPsaChunk) {
      const int cnt = min(kPsaChunk, end - base);
      const int64_t r0 = int64_t(h) * w.round_max + (base - start);
      float bmk[kPer];
      double mk[kPer];
      bool valid[kPer];
      float bmax = -INFINITY;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int x = lane * kPer + k;
        valid[k] = x < cnt && w.r_n[r0 + x] > 0;
        bmk[k] = valid[k] ? w.r_bm[r0 + x] : -INFINITY;
        mk[k] = valid[k] ? w.r_mass[r0 + x] : 0.0;
        bmax = fmaxf(bmax, bmk[k]);
      }
      for (int s = 16; s >= 1; s >>= 1) bmax = fmaxf(bmax, __shfl_xor_sync(kAll, bmax, s));
      const float M = fmaxf(m, bmax);
      const double into = (m == -INFINITY) ? 0.0 : exp(double(m) - double(M));
      const double acc0 = acc * into, asmin0 = isfinite(as_min) ? as_min * into : INFINITY;
      double l4[kPsaRecentBlocks];  // the carried last ranked masses, oldest first
#pragma unroll
      for (int j = 0; j < kPsaRecentBlocks; ++j) l4[j] = last4[j] * into;
      double pre_sum[kPer], pre_min[kPer];
      int pre_cnt[kPer];
      double lane_sum = 0, lane_min = INFINITY;
      int lane_cnt = 0;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int x = lane * kPer + k;
        const double as = valid[k] ? mk[k] * exp(double(bmk[k]) - double(M)) : 0.0;
        const int pi = x < cnt ? w.ord[int64_t(h) * P + base + x] : -1;
        const bool rk = valid[k] && !(a.pin && (pi == 0 || pi == nb - 1));
        const double fb = rk ? as * double(kBT) / double(w.r_n[r0 + x]) : INFINITY;
        fb_s[x] = fb;
        rk_s[x] = rk;
        lane_sum += as;
        lane_cnt += rk;
        lane_min = fmin(lane_min, fb);
        pre_sum[k] = lane_sum;
        pre_cnt[k] = lane_cnt;
        pre_min[k] = lane_min;
      }
      // Inclusive scans of the lanes' totals, then each lane's exclusive prefix.
      double xs = lane_sum, xm = lane_min;
      int xc = lane_cnt;
      for (int s = 1; s < 32; s <<= 1) {
        const double s2 = __shfl_up_sync(kAll, xs, s), m2 = __shfl_up_sync(kAll, xm, s);
        const int c2 = __shfl_up_sync(kAll, xc, s);
        if (lane >= s) xs += s2, xm = fmin(xm, m2), xc += c2;
      }
      double ex_s = __shfl_up_sync(kAll, xs, 1), ex_m = __shfl_up_sync(kAll, xm, 1);
      int ex_c = __shfl_up_sync(kAll, xc, 1);
      if (lane == 0) ex_s = 0, ex_m = INFINITY, ex_c = 0;
      __syncwarp();  // fb_s and rk_s are read across lanes below
      // The last kPsaRecentBlocks ranked masses up to block x, newest first from the chunk, then
      // from the carry; their mean.
      auto recent_mean_at = [&](int x) {
        double sum = 0;
        int got = 0;
        for (int j = x; j >= 0 && got < kPsaRecentBlocks; --j)
          if (rk_s[j]) sum += fb_s[j], ++got;
        for (int j = kPsaRecentBlocks - 1; got < kPsaRecentBlocks; --j, ++got) sum += l4[j];
        return sum / kPsaRecentBlocks;
      };
      int first = kPsaChunk;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int x = lane * kPer + k;
        if (first < kPsaChunk || !valid[k]) continue;  // the host tests nonempty blocks only
        const double acc_x = acc0 + ex_s + pre_sum[k];
        const int rank_x = ranked + ex_c + pre_cnt[k];
        if (rank_x == 0) continue;
        double per = fmin(asmin0, fmin(ex_m, pre_min[k]));
        if (a.recent_mean) {
          if (rank_x < kPsaRecentBlocks) continue;
          per = recent_mean_at(x);
        }
        const double left = double(nb - (visited + x + 1));
        if (acc_x >= a.eps * (acc_x + per * left)) first = x;  // the host's test, no division
      }
      for (int s = 16; s >= 1; s >>= 1) first = min(first, __shfl_xor_sync(kAll, first, s));
      const bool stop = first < cnt;
      const int take = stop ? first + 1 : cnt;
      // The state after block take - 1, from the lane that holds it.
      const int last = take - 1, owner = last / kPer;
      double t_sum = 0, t_min = INFINITY;
      int t_cnt = 0;
      float mt = -INFINITY;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        if (lane * kPer + k == last) t_sum = pre_sum[k], t_min = pre_min[k], t_cnt = pre_cnt[k];
        if (valid[k] && lane * kPer + k < take) mt = fmaxf(mt, bmk[k]);
      }
      t_sum = __shfl_sync(kAll, t_sum + ex_s, owner);
      t_min = __shfl_sync(kAll, fmin(t_min, ex_m), owner);
      t_cnt = __shfl_sync(kAll, t_cnt + ex_c, owner);
      for (int s = 16; s >= 1; s >>= 1) mt = fmaxf(mt, __shfl_xor_sync(kAll, mt, s));
      const float m_take = fmaxf(m, mt);
      double n4[kPsaRecentBlocks];
      {
        int got = 0;
        for (int j = last; j >= 0 && got < kPsaRecentBlocks; --j)
          if (rk_s[j]) n4[kPsaRecentBlocks - 1 - got++] = fb_s[j];
        for (int j = kPsaRecentBlocks - 1; got < kPsaRecentBlocks; --j)
          n4[kPsaRecentBlocks - 1 - got++] = l4[j];
      }
      // From the chunk frame M to the visited blocks' frame m_take (<= M).
      const double out = m_take == -INFINITY ? 1.0 : exp(double(M) - double(m_take));
      acc = (acc0 + t_sum) * out;
      const double mn = fmin(asmin0, t_min);
      as_min = isfinite(mn) ? mn * out : INFINITY;
#pragma unroll
      for (int j = 0; j < kPsaRecentBlocks; ++j) last4[j] = n4[j] * out;
      ranked += t_cnt;
      visited += take;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int x = lane * kPer + k;
        if (x < cnt) kept_bm[base - start + x] = (valid[k] && x < take) ? bmk[k] : -INFINITY;
      }
      m = m_take;
      taken = base - start + take;
      finished = stop || base + cnt >= nb;
      __syncwarp();  // fb_s and rk_s are rewritten by the next chunk
    }
    if (lane == 0) m_s = m, taken_s = taken, done_s = finished;
  }  // warp 0
  __syncthreads();  // kept_bm, m_s, taken_s and done_s are read by every warp
  const float mf = m_s;
  const int n_taken = taken_s;
  finished = done_s;
  if (lane < LPR) {
    // This warp's share of the kept blocks, 16 loads issued before their adds.
    constexpr int kQ = 16;
    const int64_t r0 = int64_t(h) * w.round_max;
    float4 p = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int x0 = warp * kQ; x0 < n_taken; x0 += kPsaWalkWarps * kQ) {
      float4 ob[kQ];
      float wt[kQ];
#pragma unroll
      for (int j = 0; j < kQ; ++j) {
        const int x = x0 + j;
        const float bm = x < n_taken ? kept_bm[x] : -INFINITY;
        wt[j] = bm == -INFINITY ? 0.f : expf(bm - mf);
        ob[j] = wt[j] != 0.f ? reinterpret_cast<const float4*>(w.r_o + (r0 + x) * D)[lane]
                             : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < kQ; ++j)
        p.x += wt[j] * ob[j].x, p.y += wt[j] * ob[j].y, p.z += wt[j] * ob[j].z,
            p.w += wt[j] * ob[j].w;
    }
    part_s[warp][lane] = p;
  }
  __syncthreads();
  if (warp == 0 && lane < LPR) {
    // The carried output from its frame m_in into the final one (0 while nothing was folded).
    const float f = mf == -INFINITY ? 1.f : (m_in == -INFINITY ? 0.f : expf(m_in - mf));
    o.x *= f, o.y *= f, o.z *= f, o.w *= f;
#pragma unroll
    for (int q = 0; q < kPsaWalkWarps; ++q) {
      const float4 pq = part_s[q][lane];
      o.x += pq.x, o.y += pq.y, o.z += pq.z, o.w += pq.w;
    }
  }
  if (warp != 0) return;
  if (finished) {
    if (lane < LPR) {
      const float inv = acc > 0 ? float(1.0 / acc) : 0.f;
      reinterpret_cast<float4*>(a.out + int64_t(h) * D)[lane] =
          make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
    }
    if (lane == 0) {
      w.state[h].done = 1;
      if (a.visited) a.visited[h] = visited;
    }
    return;
  }
  if (lane < LPR) reinterpret_cast<float4*>(w.o + int64_t(h) * D)[lane] = o;
  if (lane == 0) {
    st.m = m;
    st.acc = acc;
    st.as_min = as_min;
#pragma unroll
    for (int j = 0; j < kPsaRecentBlocks; ++j) st.last4[j] = last4[j];
    st.visited = visited;
    st.ranked = ranked;
    w.state[h] = st;
  }
}

// PSA "+gqa": one visit per KV head (the host's rule in decode_attention.cpp: the G query heads
// of a KV head take turns naming the best block of their own order not yet loaded, every head
// folds every loaded block, and each head's stop rule is tested after every load). The turns are
// sequential, so a round first scores every block a head could name in it, then a CTA per KV
// head replays the turns over those results:
//   gqa_cand_kernel: a CTA per KV head; each head whose rule has not stopped lists the first c
//     blocks of its order not loaded at the round's start (c: the round's size). A head names
//     blocks of its own list only, in order, so its turns this round are among them; the union
//     gets one result slot per block.
//   gqa_score_kernel: a warp per (slot, query head) scores the block, the G heads' warps side by
//     side, so the block is read from memory about once for the group.
//   gqa_walk_kernel: a CTA per KV head replays the turns 32 at a time: warp 0 names the next 32
//     blocks as if no head stopped (gqa_name_turns), the CTA fetches their results, and a warp
//     per head folds its share of the turns and tests its rule as prefix scans. A stop cuts the
//     batch after that turn (the later turns are undone, since the stopped head no longer takes
//     turns), and a head whose list runs out ends the round: every block it could name next is
//     unscored. Then the warps fold the loaded blocks' outputs into each head, once, in its final
//     frame.
// A round loads at least c blocks unless the visit ends (the head whose list ran out saw c blocks
// loaded), so the rounds psa_round_size lists cover max_pages as they do per query head.
constexpr int kGqaWarps = 8;

// One warp: positions x in [from, end) in order, 32 at a time; the first `want` for which
// is_free(x) holds go to take(k, x), k = 0, 1, ... Returns how many were taken; first (optional)
// gets the first free position, or -1.
template <typename IsFree, typename Take>
__device__ __forceinline__ int warp_first_free(int from, int end, int want, IsFree is_free,
                                               Take take, int* first = nullptr) {
  const int lane = threadIdx.x & 31;
  int found = 0;
  if (first) *first = -1;
  for (int pos = from; pos < end && found < want; pos += 32) {
    const int x = pos + lane;
    const bool fr = x < end && is_free(x);
    const unsigned bal = __ballot_sync(kAll, fr);
    if (first && *first < 0 && bal) *first = pos + __ffs(int(bal)) - 1;
    const int k = found + __popc(bal & ((1u << lane) - 1u));
    if (fr && k < want) take(k, x);
    found = min(want, found + __popc(bal));
  }
  return found;
}
constexpr int kGqaMaxGroup = kDecodePsaGqaMaxGroup;  // query heads per KV head (a lane each in the walk)

__global__ void __launch_bounds__(kGqaWarps * 32)
    gqa_cand_kernel(const DecodeArgs a, const PsaWs w, int round, int c) {
  __shared__ int n_cand;
  const int g = blockIdx.x, G = w.group, P = a.kv.max_pages;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (w.kvs[g].done) return;
  if (threadIdx.x == 0) n_cand = 0;
  __syncthreads();
  const int nb = a.kv.n_pages[g], stamp = round + 1;
  for (int i = warp; i < G; i += kGqaWarps) {
    const int h = g * G + i;
    int found = 0, first = -1;
    if (!w.state[h].done) {
      const int* ord = w.ord + int64_t(h) * P;
      const unsigned char* loaded = w.loaded + int64_t(g) * P;
      found = warp_first_free(
          w.cursor[h], nb, c, [&](int x) { return !loaded[ord[x]]; },
          [&](int k, int x) {
            const int b = ord[x];
            w.list[int64_t(h) * w.round_max + k] = b;
            if (atomicMax(&w.mark[int64_t(g) * P + b], stamp) < stamp) {  // first lister
              const int s = atomicAdd(&n_cand, 1);
              w.cand_slot[int64_t(g) * P + b] = s;
              w.slot_page[int64_t(g) * w.slots + s] = b;
            }
          },
          &first);
      if (lane == 0) w.cursor[h] = first < 0 ? nb : first;
    }
    if (lane == 0) w.list_n[h] = found;
  }
  __syncthreads();
  if (threadIdx.x == 0) w.kvs[g].n_cand = n_cand;
}

// A warp per (slot, query head), the G heads of a slot side by side in a CTA so the block's
// rows meet in L1. size: the round's slots per KV head.
template <int D, PoolDType T>
__global__ void __launch_bounds__(kPsaRoundWarps * 32)
    gqa_score_kernel(const DecodeArgs a, const PsaWs w, int size) {
  constexpr int LPR = D / 4;
  const int G = w.group, P = a.kv.max_pages;
  const int per_kv = (size * G + kPsaRoundWarps - 1) / kPsaRoundWarps;
  const int g = blockIdx.x / per_kv, lane = threadIdx.x & 31;
  const int item = (blockIdx.x % per_kv) * kPsaRoundWarps + (threadIdx.x >> 5);
  const int slot = item / G, i = item % G;
  if (w.kvs[g].done || slot >= w.kvs[g].n_cand) return;
  const int64_t r = int64_t(g) * w.slots + slot;
  const int64_t blk = a.kv.pages[int64_t(g) * P + w.slot_page[r]];
  const int n = a.kv.fill[blk];
  if (lane == 0 && i == 0) w.r_n[r] = n;
  float bm = -INFINITY;
  double mass = 0;
  float4 ob = make_float4(0.f, 0.f, 0.f, 0.f);
  if (n > 0) {
    float qf[kElemsPerLoad<T>];
    load_q<D, T>(a.q + int64_t(g * G + i) * D, qf);
    warp_block<D, T>(qf, a.kv, blk, n, a.scale, &bm, &mass, &ob);
  }
  const int64_t ri = r * G + i;
  if (lane < LPR) reinterpret_cast<float4*>(w.r_o + ri * D)[lane] = ob;
  if (lane == 0) w.r_bm[ri] = bm, w.r_mass[ri] = mass;
}

// Dynamic shared memory of gqa_walk_kernel for a round of c blocks a head.
__host__ __device__ inline size_t gqa_walk_smem_bytes(int group, int c, int slots, int max_pages) {
  return size_t(group) * size_t(c) * 4 + size_t(slots) * 2 + size_t(max_pages);
}
// The most any pool can ask (kGqaMaxGroup heads, rounds of kPsaRoundCap, kDecodeMaxPages): the
// opt-in, once per device.
inline size_t gqa_walk_smem_limit() {
  return gqa_walk_smem_bytes(kGqaMaxGroup, kPsaRoundCap, kDecodeMaxPages, kDecodeMaxPages);
}

// gqa_walk_kernel's static shared memory: a batch of up to 32 turns (block, naming head, its
// results for every head), how the batch was named, and each head's walk state (the host's
// scalars in the frame of its running max m; l4: its last ranked blocks' masses, oldest first),
// with the state after the whole batch pending until the batch is known not to be cut.
struct GqaWalkShared {
  int t_head[32], t_slot[32], t_page[32], t_n[32], u_ptr[32];
  float t_bm[32][kGqaMaxGroup];
  double t_mass[32][kGqaMaxGroup];
  int act[32], tn[32];    // the heads taking turns, in turn order; picks listed for each
  int tp[32][32];         // active head q's k-th pick this batch: its list index
  double fb[kGqaWarps][32];  // per warp: its head's full-block mass of each turn it ranked
  unsigned char rk[kGqaWarps][32];
  float m[kGqaMaxGroup], m_in[kGqaMaxGroup], pm[kGqaMaxGroup];
  double acc[kGqaMaxGroup], as_min[kGqaMaxGroup], l4[kGqaMaxGroup][kPsaRecentBlocks];
  double pacc[kGqaMaxGroup], pas_min[kGqaMaxGroup], pl4[kGqaMaxGroup][kPsaRecentBlocks];
  int ranked[kGqaMaxGroup], pranked[kGqaMaxGroup], first[kGqaMaxGroup], l_n[kGqaMaxGroup],
      ptr[kGqaMaxGroup];
  unsigned char hdone[kGqaMaxGroup];
  int turn, n_loaded, running, n_kept, cnt, ran_out, go, round_end;
  float4 part[kGqaMaxGroup > kGqaWarps ? kGqaMaxGroup : kGqaWarps][32];  // the output fold's partials
};

// Head i over the batch's first n turns, a lane a turn: the host's folds and stop tests as prefix
// computations (as psa_walk_kernel does for a head's own blocks), in the frame M of the largest
// max among them (the test is a ratio, so the frame changes only rounding). Returns the first
// turn whose stop test holds for head i (n if none, or if !test), and writes head i's state after
// the n turns (M is then exactly its running max) into the pending arrays (commit false) or the
// state (commit true). One warp, all lanes.
__device__ int gqa_chunk_head(const DecodeArgs& a, GqaWalkShared& S, int i, int n, int n_loaded,
                              int nb, bool test, bool commit) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double* fbs = S.fb[warp];
  unsigned char* rks = S.rk[warp];
  __syncwarp();  // the previous head's fbs and rks are read
  const int nt = lane < n ? S.t_n[lane] : 0;
  const bool valid = nt > 0;  // the host folds and tests nonempty blocks only
  const float bm = valid ? S.t_bm[lane][i] : -INFINITY;
  const int b = lane < n ? S.t_page[lane] : 0;
  const bool rk = valid && S.t_head[lane] == i && !(a.pin && (b == 0 || b == nb - 1));
  float bmax = bm;
  for (int s = 16; s >= 1; s >>= 1) bmax = fmaxf(bmax, __shfl_xor_sync(kAll, bmax, s));
  const float m0 = S.m[i], M = fmaxf(m0, bmax);
  const double into = m0 == -INFINITY ? 0.0 : exp(double(m0) - double(M));
  const double acc0 = S.acc[i] * into;
  const double asmin0 = isfinite(S.as_min[i]) ? S.as_min[i] * into : INFINITY;
  const double as = valid ? S.t_mass[lane][i] * exp(double(bm) - double(M)) : 0.0;
  const double fb = rk ? as * double(kBT) / double(nt) : INFINITY;
  fbs[lane] = fb;
  rks[lane] = rk;
  double ps = as, pm = fb;  // inclusive scans over the turns
  int pc = rk;
  for (int s = 1; s < 32; s <<= 1) {
    const double s2 = __shfl_up_sync(kAll, ps, s), m2 = __shfl_up_sync(kAll, pm, s);
    const int c2 = __shfl_up_sync(kAll, pc, s);
    if (lane >= s) ps += s2, pm = fmin(pm, m2), pc += c2;
  }
  __syncwarp();  // fbs and rks are read across lanes
  // The last kPsaRecentBlocks ranked masses up to turn x (newest first from the batch, then the
  // carried ones), written oldest first into out.
  auto recent = [&](int x, double* out) {
    int got = 0;
    for (int j = x; j >= 0 && got < kPsaRecentBlocks; --j)
      if (rks[j]) out[kPsaRecentBlocks - 1 - got++] = fbs[j];
    for (int j = kPsaRecentBlocks - 1; got < kPsaRecentBlocks; --j)
      out[kPsaRecentBlocks - 1 - got++] = S.l4[i][j] * into;
  };
  int first = n;
  if (test) {
    bool hit = false;
    const int rank_x = S.ranked[i] + pc;
    if (valid && rank_x > 0) {
      const double acc_x = acc0 + ps;
      double per = fmin(asmin0, pm);
      bool ok = true;
      if (a.recent_mean) {
        ok = rank_x >= kPsaRecentBlocks;
        double r4[kPsaRecentBlocks];
        recent(lane, r4);
        per = (r4[0] + r4[1] + r4[2] + r4[3]) / kPsaRecentBlocks;
      }
      const double left = double(nb - (n_loaded + lane + 1));
      hit = ok && acc_x >= a.eps * (acc_x + per * left);  // the host's test, no division
    }
    const unsigned bal = __ballot_sync(kAll, hit);
    first = bal ? __ffs(int(bal)) - 1 : n;
  }
  if (n > 0) {
    const int last = n - 1;
    const double t_sum = __shfl_sync(kAll, ps, last), t_min = __shfl_sync(kAll, pm, last);
    const int t_cnt = __shfl_sync(kAll, pc, last);
    // Every lane's reads of the state (m, acc, as_min; ranked and l4 under `test`) come before
    // lane 0 overwrites it: shuffles and ballots order no memory.
    __syncwarp();
    if (lane == 0) {
      double r4[kPsaRecentBlocks];
      recent(last, r4);
      double* l4 = commit ? S.l4[i] : S.pl4[i];
#pragma unroll
      for (int j = 0; j < kPsaRecentBlocks; ++j) l4[j] = r4[j];
      (commit ? S.acc : S.pacc)[i] = acc0 + t_sum;
      (commit ? S.as_min : S.pas_min)[i] = fmin(asmin0, t_min);
      (commit ? S.ranked : S.pranked)[i] = S.ranked[i] + t_cnt;
      (commit ? S.m : S.pm)[i] = M;
    }
  }
  return first;
}

// Warp 0 names the batch's turns as if no head stopped (the sequential rule: each head in turn
// takes the first block of its list not yet loaded), in parallel passes: a lane a turn, each head
// taking its next entries unloaded at the pass's start, the pass cut before the first pick an
// earlier turn of it already took (that head would have skipped it) or whose head has no entry
// left (its list ran out: the round ends there). Short passes (picks shared between heads) hand
// the rest of the batch to lane 0, one turn at a time. Turns are logged (head, page, slot, the
// head's list position before the turn) so a cut can undo them.
__device__ void gqa_name_turns(GqaWalkShared& S, const int16_t* l_page, const int16_t* l_slot,
                               unsigned char* loaded, int c, int G, int nb) {
  const int lane = threadIdx.x & 31;
  const int room = min(32, nb - S.n_loaded), turn = S.turn;  // turns this batch may take
  const unsigned heads = G == 32 ? kAll : (1u << G) - 1u;
  const unsigned act = __ballot_sync(kAll, lane < G && !S.hdone[lane]);
  const int A = __popc(act);  // > 0: the caller checked running
  const unsigned rot = ((act >> turn) | (turn ? act << (G - turn) : 0u)) & heads;
  if (lane < A) {  // the lane-th set bit of rot, back in head numbers
    unsigned m = rot;
    for (int k = 0; k < lane; ++k) m &= m - 1;
    const int bit = __ffs(int(m)) - 1;
    S.act[lane] = bit + turn >= G ? bit + turn - G : bit + turn;
  }
  __syncwarp();
  // Parallel passes: turn cnt + l is head act[(q0 + l) % A]'s (l / A)-th pick among the entries
  // unloaded at the pass's start; a pass ends before the first pick an earlier turn of it took.
  // Passes go on while they name at least kLong turns.
  constexpr int kLong = 8;
  int cnt = 0, q0 = 0, ran_out = 0;
  while (cnt < room) {
    const int left = room - cnt;
    for (int r = 0; r < A && r < left; ++r) {
      const int j = S.act[(q0 + r) % A], need = (left - r + A - 1) / A;
      const int found = warp_first_free(
          S.ptr[j], S.l_n[j], need, [&](int x) { return !loaded[l_page[j * c + x]]; },
          [&](int k, int x) { S.tp[r][k] = x; });
      if (lane == 0) S.tn[r] = found;
    }
    __syncwarp();
    const int r = lane % A, k = lane / A, j = S.act[(q0 + r) % A];
    const bool has = lane < left && k < S.tn[r];
    const int idx = has ? S.tp[r][k] : 0;
    const int page = has ? l_page[j * c + idx] : -1 - lane;
    bool bad = !has;
    for (int s = 1; s < 32; ++s) {
      const int p2 = __shfl_up_sync(kAll, page, s);
      bad |= lane >= s && p2 == page;
    }
    const unsigned badm = __ballot_sync(kAll, bad);
    const int T = badm ? __ffs(int(badm)) - 1 : 32;  // turns named exactly
    ran_out = T < left && !__shfl_sync(kAll, has, T & 31);  // T's head has no entry left
    if (lane < T) {
      const int t = cnt + lane;
      S.t_head[t] = j;
      S.t_page[t] = page;
      S.t_slot[t] = l_slot[j * c + idx];
      // The undo point is the head's position before this turn: what it skipped may have been
      // loaded by an earlier pass of this batch, which a cut undoes too.
      S.u_ptr[t] = k == 0 ? S.ptr[j] : S.tp[r][k - 1] + 1;
      loaded[page] = 1;
    }
    __syncwarp();  // every S.ptr read above comes before the writes below
    if (lane < T && lane + A >= T) S.ptr[j] = idx + 1;  // this head's last turn of the pass
    __syncwarp();
    cnt += T;
    q0 = (q0 + T) % A;
    if (ran_out || T < kLong) break;
  }
  if (lane == 0) {
    // After a short pass (picks shared between heads), one turn at a time.
    int t = cnt, jq = q0;
    while (!ran_out && t < room) {
      const int jj = S.act[jq];
      int kk = S.ptr[jj];
      while (kk < S.l_n[jj] && loaded[l_page[jj * c + kk]]) ++kk;
      if (kk == S.l_n[jj]) {
        ran_out = 1;
        break;
      }
      S.u_ptr[t] = S.ptr[jj];  // before the skip, as above
      S.ptr[jj] = kk + 1;
      loaded[l_page[jj * c + kk]] = 1;
      S.t_head[t] = jj;
      S.t_slot[t] = l_slot[jj * c + kk];
      S.t_page[t] = l_page[jj * c + kk];
      ++t;
      jq = jq + 1 == A ? 0 : jq + 1;
    }
    S.cnt = t;
    S.ran_out = ran_out;
  }
}

// A CTA per KV head replays the round's turns (gqa_cand_kernel's comment): warp 0 names each
// batch's blocks, the CTA fetches their results, each warp folds and tests its heads (a head per
// warp, more when G > kGqaWarps), thread 0 cuts and undoes; then the warps fold the loaded
// blocks' outputs into the heads (a head's blocks over kGqaWarps / G warps when G < kGqaWarps).
template <int D>
__global__ void __launch_bounds__(kGqaWarps * 32)
    gqa_walk_kernel(const DecodeArgs a, const PsaWs w, int c) {
  constexpr int LPR = D / 4;
  extern __shared__ unsigned char smem_raw[];
  __shared__ GqaWalkShared S;
  const int g = blockIdx.x, G = w.group, P = a.kv.max_pages;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const GqaKvState ks = w.kvs[g];
  if (ks.done) return;
  const int nb = a.kv.n_pages[g];
  int16_t* l_page = reinterpret_cast<int16_t*>(smem_raw);  // [G][c] each head's list
  int16_t* l_slot = l_page + G * c;                        // [G][c] ... their result slots
  int16_t* kept = l_slot + G * c;                          // [slots] loaded this round
  unsigned char* loaded = reinterpret_cast<unsigned char*>(kept + w.slots);  // [nb]
  for (int b = threadIdx.x; b < nb; b += blockDim.x) loaded[b] = w.loaded[int64_t(g) * P + b];
  for (int i = threadIdx.x; i < G; i += blockDim.x) {
    const PsaHeadState st = w.state[g * G + i];
    S.l_n[i] = w.list_n[g * G + i];
    S.ptr[i] = 0;
    S.hdone[i] = st.done;
    S.m[i] = S.m_in[i] = st.m;
    S.acc[i] = st.acc;
    S.as_min[i] = st.as_min;
#pragma unroll
    for (int j = 0; j < kPsaRecentBlocks; ++j) S.l4[i][j] = st.last4[j];
    S.ranked[i] = st.ranked;
  }
  if (threadIdx.x == 0) {
    S.turn = ks.turn;
    S.n_loaded = ks.n_loaded;
    S.running = ks.running;
    S.n_kept = 0;
    S.round_end = 0;
  }
  __syncthreads();
  {  // the lists, 8 entries a thread at a time so their loads overlap
    constexpr int U = 8;
    for (int x0 = threadIdx.x; x0 < G * c; x0 += blockDim.x * U) {
      int b[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int x = x0 + u * blockDim.x, i = x / c, k = x % c;
        b[u] = x < G * c && k < S.l_n[i] ? w.list[int64_t(g * G + i) * w.round_max + k] : -1;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int x = x0 + u * blockDim.x;
        if (b[u] < 0) continue;
        l_page[x] = int16_t(b[u]);
        l_slot[x] = int16_t(w.cand_slot[int64_t(g) * P + b[u]]);
      }
    }
  }
  __syncthreads();
  for (;;) {
    if (warp == 0) {
      const bool go = S.n_loaded < nb && S.running > 0 && !S.round_end;
      if (go) gqa_name_turns(S, l_page, l_slot, loaded, c, G, nb);
      if (lane == 0) S.go = go;
    }
    __syncthreads();
    if (!S.go) break;
    const int cnt = S.cnt, n_loaded = S.n_loaded;
    for (int x = threadIdx.x; x < cnt * G; x += blockDim.x) {  // the turns' results
      const int t = x / G, i = x % G;
      const int64_t r = int64_t(g) * w.slots + S.t_slot[t];
      S.t_bm[t][i] = w.r_bm[r * G + i];
      S.t_mass[t][i] = w.r_mass[r * G + i];
      if (i == 0) S.t_n[t] = w.r_n[r];
    }
    __syncthreads();
    // Each warp tests its heads over the whole batch; the first stop of any head cuts the batch
    // after that turn.
    for (int i = warp; i < G; i += kGqaWarps) {
      const int f = gqa_chunk_head(a, S, i, cnt, n_loaded, nb, !S.hdone[i], false);
      if (lane == 0) S.first[i] = f;
    }
    __syncthreads();
    int accepted = cnt;
    for (int i = 0; i < G; ++i) accepted = min(accepted, S.first[i] + 1);
    for (int i = warp; i < G; i += kGqaWarps) {
      if (accepted < cnt) {
        gqa_chunk_head(a, S, i, accepted, n_loaded, nb, false, true);
      } else if (lane == 0 && cnt > 0) {  // not cut: the states after the batch stand
        S.m[i] = S.pm[i];
        S.acc[i] = S.pacc[i];
        S.as_min[i] = S.pas_min[i];
        S.ranked[i] = S.pranked[i];
#pragma unroll
        for (int j = 0; j < kPsaRecentBlocks; ++j) S.l4[i][j] = S.pl4[i][j];
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int i = 0; i < G; ++i)
        if (!S.hdone[i] && S.first[i] == accepted - 1) S.hdone[i] = 1, --S.running;
      for (int t = cnt - 1; t >= accepted; --t) {  // newest first, so each head's undo is exact
        loaded[S.t_page[t]] = 0;
        S.ptr[S.t_head[t]] = S.u_ptr[t];
      }
      for (int t = 0; t < accepted; ++t) kept[S.n_kept + t] = int16_t(S.t_slot[t]);
      S.n_kept += accepted;
      S.n_loaded += accepted;
      if (accepted > 0) S.turn = S.t_head[accepted - 1] + 1 == G ? 0 : S.t_head[accepted - 1] + 1;
      S.round_end = S.ran_out && accepted == cnt;
    }
    __syncthreads();
  }
  const bool fin = S.n_loaded == nb || S.running == 0;
  for (int i = threadIdx.x; i < G; i += blockDim.x) {
    PsaHeadState st{};
    st.m = S.m[i];
    st.acc = S.acc[i];
    st.as_min = S.as_min[i];
#pragma unroll
    for (int j = 0; j < kPsaRecentBlocks; ++j) st.last4[j] = S.l4[i][j];
    st.ranked = S.ranked[i];
    st.visited = S.n_loaded;
    st.done = S.hdone[i];
    w.state[g * G + i] = st;
  }
  if (threadIdx.x == 0) w.kvs[g] = GqaKvState{S.n_loaded, S.turn, S.running, 0, fin};
  for (int b = threadIdx.x; b < nb; b += blockDim.x) w.loaded[int64_t(g) * P + b] = loaded[b];
  const int n_kept = S.n_kept;
  // Each head folds the round's loaded blocks once, in its final frame, onto its carried output.
  // A head's blocks are split over the warps it gets (parts), whose partials meet in S.part; a
  // block's max and output are loaded together, 16 blocks at a time.
  const int parts = max(1, kGqaWarps / G);
  for (int u = warp; u < G * parts; u += kGqaWarps) {
    if (lane >= LPR) continue;
    const int i = u % G, part = u / G;
    const float mf = S.m[i];
    float4 p = make_float4(0.f, 0.f, 0.f, 0.f);
    constexpr int kQ = 16;
    for (int x0 = part * kQ; x0 < n_kept; x0 += parts * kQ) {
      float4 ob[kQ];
      float bm[kQ];
#pragma unroll
      for (int j = 0; j < kQ; ++j) {
        const int64_t ri = x0 + j < n_kept ? (int64_t(g) * w.slots + kept[x0 + j]) * G + i : -1;
        bm[j] = ri >= 0 ? w.r_bm[ri] : -INFINITY;
        ob[j] = ri >= 0 ? reinterpret_cast<const float4*>(w.r_o + ri * D)[lane]
                        : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < kQ; ++j) {
        const float wt = bm[j] == -INFINITY ? 0.f : expf(bm[j] - mf);  // empty blocks: 0
        p.x += wt * ob[j].x, p.y += wt * ob[j].y, p.z += wt * ob[j].z, p.w += wt * ob[j].w;
      }
    }
    S.part[u][lane] = p;
  }
  __syncthreads();
  for (int i = warp; i < G; i += kGqaWarps) {
    if (lane >= LPR) continue;
    const int h = g * G + i;
    const float mf = S.m[i], mi = S.m_in[i];
    float4 o = reinterpret_cast<const float4*>(w.o + int64_t(h) * D)[lane];
    const float f = mf == -INFINITY ? 1.f : (mi == -INFINITY ? 0.f : expf(mi - mf));
    o.x *= f, o.y *= f, o.z *= f, o.w *= f;
    for (int part = 0; part < parts; ++part) {
      const float4 q = S.part[part * G + i][lane];
      o.x += q.x, o.y += q.y, o.z += q.z, o.w += q.w;
    }
    if (!fin) {
      reinterpret_cast<float4*>(w.o + int64_t(h) * D)[lane] = o;
      continue;
    }
    const double acc = S.acc[i];
    const float inv = acc > 0 ? float(1.0 / acc) : 0.f;
    reinterpret_cast<float4*>(a.out + int64_t(h) * D)[lane] =
        make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
    if (lane == 0 && a.visited) a.visited[h] = S.n_loaded;
  }
}

// kvstore/kv_quant.cpp's group rule on the device, for 255 levels: the zero is the F16 of the
// minimum rounded down, the scale the F16 of (max - zero) / 255 rounded up, and a code is
// (x - zero) / scale rounded to nearest even, in [0, 255]. Bit-level neighbours as on the host.
__device__ __forceinline__ uint16_t f16_toward(float x, bool up) {
  uint16_t h = __half_as_ushort(__float2half_rn(x));
  const float r = f16f(h);
  if (!up && r > x) h = h == 0x0000 ? 0x8001 : (h & 0x8000) ? h + 1 : h - 1;
  if (up && r < x) h = h == 0x8000 ? 0x0001 : (h & 0x8000) ? h - 1 : h + 1;
  return h;
}
struct QuantGroup {
  uint16_t zh, sh;
  float z, s;
};
__device__ __forceinline__ QuantGroup quant_group(float mn, float mx) {
  QuantGroup g;
  g.zh = f16_toward(mn, false);
  g.z = f16f(g.zh);
  g.sh = f16_toward(fmaxf(0.f, mx - g.z) / 255.f, true);
  g.s = f16f(g.sh);
  return g;
}
__device__ __forceinline__ uint8_t quant_code(float x, const QuantGroup& g) {
  const int q = g.s > 0.f ? __float2int_rn((x - g.z) / g.s) : 0;
  return uint8_t(min(max(q, 0), 255));
}

// n_tokens new tokens per KV head (one CTA each), in order: for each, thread 0 opens the next
// reserved page when the last block is full (or the head has none yet); then thread c writes
// channel c of the row and folds it, as stored, into kmin/kmax. INT8: the key row goes to the
// head's kopen, the value row is encoded (its min and max reduced over the CTA), then each
// channel of the block's keys is re-encoded over the filled rows, and its kmin/kmax become those
// of the decoded codes (zero + code x scale, unfused, as the host's decoder rounds): PSA's bound
// on q.k holds for what attention reads, not just for the F32 keys. k_new, v_new: [n_tokens,
// n_kv_heads, d].
template <PoolDType T>
__global__ void paged_append_kernel(const PagedKv kv, const float* k_new, const float* v_new,
                                    int n_tokens) {
  grid_dep_enter();
  const int g = blockIdx.x, d = kv.head_dim;
  __shared__ int64_t blk_s;
  __shared__ int slot_s;
  __shared__ float red[2][32];
  for (int t = 0; t < n_tokens; ++t, k_new += int64_t(kv.n_kv_heads) * d,
           v_new += int64_t(kv.n_kv_heads) * d) {
    __syncthreads();  // the previous token's fill is written and its shared values read
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
    if (blk < 0) return;  // every thread: the same shared value
    const int slot = slot_s;
    const int64_t row = (blk * kBT + slot) * d;
    float vmn = INFINITY, vmx = -INFINITY;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
      float kc = k_new[int64_t(g) * d + c];
      const float vc = v_new[int64_t(g) * d + c];
      if constexpr (T == PoolDType::kF32) {
        static_cast<float*>(kv.k)[row + c] = kc;
        static_cast<float*>(kv.v)[row + c] = vc;
      } else if constexpr (T == PoolDType::kBF16) {
        const __nv_bfloat16 kb = __float2bfloat16_rn(kc);
        static_cast<__nv_bfloat16*>(kv.k)[row + c] = kb;
        static_cast<__nv_bfloat16*>(kv.v)[row + c] = __float2bfloat16_rn(vc);
        kc = __bfloat162float(kb);  // the bound is of the key as stored
      } else {
        kv.kopen[(int64_t(g) * kBT + slot) * d + c] = kc;
        vmn = fminf(vmn, vc);
        vmx = fmaxf(vmx, vc);
      }
      if constexpr (T != PoolDType::kInt8) {  // (INT8: from the re-encoded codes below)
        float& lo = kv.kmin[blk * d + c];
        float& hi = kv.kmax[blk * d + c];
        // NaN-keeping, as the host's block statistics (fminf / fmaxf drop a NaN).
        lo = slot == 0 || kc < lo || kc != kc ? kc : lo;
        hi = slot == 0 || kc > hi || kc != kc ? kc : hi;
      }
    }
    if constexpr (T == PoolDType::kInt8) {
      for (int o = 16; o >= 1; o >>= 1) {
        vmn = fminf(vmn, __shfl_xor_sync(kAll, vmn, o));
        vmx = fmaxf(vmx, __shfl_xor_sync(kAll, vmx, o));
      }
      const int warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
      if ((threadIdx.x & 31) == 0) red[0][warp] = vmn, red[1][warp] = vmx;
      __syncthreads();  // also orders the kopen row before the key pass below
      vmn = red[0][0];
      vmx = red[1][0];
      for (int w = 1; w < nw; ++w) vmn = fminf(vmn, red[0][w]), vmx = fmaxf(vmx, red[1][w]);
      const QuantGroup vg = quant_group(vmn, vmx);
      if (threadIdx.x == 0) {
        kv.vzero[blk * kBT + slot] = vg.zh;
        kv.vscale[blk * kBT + slot] = vg.sh;
      }
      uint8_t* k8 = static_cast<uint8_t*>(kv.k);
      uint8_t* v8 = static_cast<uint8_t*>(kv.v);
      const float* open = kv.kopen + int64_t(g) * kBT * d;
      for (int c = threadIdx.x; c < d; c += blockDim.x) {
        v8[row + c] = quant_code(v_new[int64_t(g) * d + c], vg);
        float mn = open[c], mx = mn;
        for (int r = 1; r <= slot; ++r)
          mn = fminf(mn, open[r * d + c]), mx = fmaxf(mx, open[r * d + c]);
        const QuantGroup kg = quant_group(mn, mx);
        kv.kzero[blk * d + c] = kg.zh;
        kv.kscale[blk * d + c] = kg.sh;
        float lo = INFINITY, hi = -INFINITY;
        for (int r = 0; r <= slot; ++r) {
          const uint8_t q = quant_code(open[r * d + c], kg);
          k8[(blk * kBT + r) * d + c] = q;
          const float x = __fadd_rn(kg.z, __fmul_rn(float(q), kg.s));
          lo = fminf(lo, x);
          hi = fmaxf(hi, x);
        }
        kv.kmin[blk * d + c] = lo;
        kv.kmax[blk * d + c] = hi;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) kv.fill[blk] = slot + 1;
  }
}

// What an append changes in a KV head, saved per head (PagedSnapshot below): n_pages, and of
// the last block its fill, kmin and kmax, and (INT8) its key codes, scales and zeros and the
// head's kopen. Rows past the fill and blocks past n_pages need nothing: an append writes a row
// before reading it, and opening a page resets its fill and (slot 0) its kmin and kmax. Value
// rows are encoded alone, so rows below the fill never change.
struct SnapLayout {
  int d;
  bool q8;
  __host__ __device__ size_t f32s() const { return 2 * size_t(d) + (q8 ? size_t(kBT) * d : 0); }
  __host__ __device__ size_t u16s() const { return q8 ? 2 * size_t(d) : 0; }
  __host__ __device__ size_t u8s() const { return q8 ? size_t(kBT) * d : 0; }
  // Per head: 2 int32 (n_pages, fill), then the F32, U16 and U8 parts, each 16-byte aligned.
  __host__ __device__ static size_t up16(size_t b) { return (b + 15) / 16 * 16; }
  __host__ __device__ size_t head_bytes() const {
    return up16(8) + up16(4 * f32s()) + up16(2 * u16s()) + up16(u8s());
  }
};

template <bool kSave>
__global__ void paged_snapshot_kernel(const PagedKv kv, uint8_t* snap) {
  const int g = blockIdx.x, d = kv.head_dim;
  const bool q8 = kv.dtype == PoolDType::kInt8;
  const SnapLayout lay{d, q8};
  uint8_t* base = snap + size_t(g) * lay.head_bytes();
  int32_t* hdr = reinterpret_cast<int32_t*>(base);
  float* f = reinterpret_cast<float*>(base + SnapLayout::up16(8));
  uint16_t* h = reinterpret_cast<uint16_t*>(base + SnapLayout::up16(8) + SnapLayout::up16(4 * lay.f32s()));
  uint8_t* b = base + SnapLayout::up16(8) + SnapLayout::up16(4 * lay.f32s()) +
               SnapLayout::up16(2 * lay.u16s());
  __shared__ int np_s;
  if (threadIdx.x == 0) np_s = kSave ? kv.n_pages[g] : hdr[0];
  __syncthreads();
  const int np = np_s;
  const int64_t blk = np > 0 ? kv.pages[int64_t(g) * kv.max_pages + np - 1] : -1;
  if (threadIdx.x == 0) {
    if (kSave) {
      hdr[0] = np;
      hdr[1] = blk >= 0 ? kv.fill[blk] : 0;
    } else {
      kv.n_pages[g] = np;
      if (blk >= 0) kv.fill[blk] = hdr[1];
    }
  }
  if (blk < 0) return;
  auto move = [&](auto* pool, auto* saved, int64_t n) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      if (kSave) saved[i] = pool[i];
      else pool[i] = saved[i];
    }
  };
  move(kv.kmin + blk * d, f, d);
  move(kv.kmax + blk * d, f + d, d);
  if (q8) {
    move(kv.kopen + int64_t(g) * kBT * d, f + 2 * d, int64_t(kBT) * d);
    move(kv.kscale + blk * d, h, d);
    move(kv.kzero + blk * d, h + d, d);
    move(static_cast<uint8_t*>(kv.k) + blk * kBT * d, b, int64_t(kBT) * d);
  }
}

bool supported_dim(int d) { return d == 32 || d == 64 || d == 128; }

// Full-mode splits per query head: about 6 CTAs per SM over all heads (one wave; Nsight put 4 at
// 0.59 waves and 25% occupancy, 8 spilled into a second wave), at least 4 pages per split (one
// per warp). Fixed by the pool's capacity, not its fill (the fill lives on the device).
// The current device's SM count, queried once per device: the splits below are planned at
// every launch (each layer of each step).
int device_sms() {
  static std::atomic<int> sm_count[64] = {};
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    const int cached = dev >= 0 && dev < 64 ? sm_count[dev].load(std::memory_order_relaxed) : 0;
    if (cached > 0) {
      sms = cached;
    } else if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess) {
      if (dev >= 0 && dev < 64) sm_count[dev].store(sms, std::memory_order_relaxed);
    } else {
      sms = 132;
    }
  }
  return sms;
}

int full_splits(int n_heads, int max_pages, int ctas_per_sm = 6) {
  const int want = (ctas_per_sm * device_sms() + n_heads - 1) / n_heads;
  const int most = (max_pages + kFullWarps - 1) / kFullWarps;
  return std::max(1, std::min(want, most));
}

// full_staged_kernel's CTAs an SM on the current device, its shared memory opted in there
// first (a function attribute is per device); 0 if it cannot run.
template <int D, PoolDType T, int NHF = kStagedHeadsPerWarp<T>>
int staged_per_sm() {
  static std::atomic<int> occ[64];  // CTAs an SM + 1 per device; 0: not asked yet
  static SmemOptIn opted;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    return 0;
  }
  if (opt_in_smem(full_staged_kernel<D, T, NHF>, staged_smem_bytes<D, T>(), opted) !=
      cudaSuccess) {
    (void)cudaGetLastError();  // the per-head kernel runs instead; leave no error pending
    return 0;
  }
  const int known = occ[dev].load(std::memory_order_relaxed);
  if (known > 0) return known - 1;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, full_staged_kernel<D, T, NHF>,
                                                    (kStagedConsumers<T> + 1) * 32,
                                                    staged_smem_bytes<D, T>()) != cudaSuccess) {
    (void)cudaGetLastError();
    per_sm = 0;
  }
  occ[dev].store(per_sm + 1, std::memory_order_relaxed);
  return per_sm;
}
// head_dim 64 and 128 (32 keeps full_kernel: no BF16 or INT8 instantiation there, and no model
// served).
template <int D>
int staged_per_sm_dim(PoolDType t, int nhf) {
  switch (t) {
    case PoolDType::kF32: return staged_per_sm<D, PoolDType::kF32>();
    case PoolDType::kBF16: return staged_per_sm<D, PoolDType::kBF16>();
    case PoolDType::kInt8:
      return nhf == 2   ? staged_per_sm<D, PoolDType::kInt8, 2>()
             : nhf == 3 ? staged_per_sm<D, PoolDType::kInt8, 3>()
                        : staged_per_sm<D, PoolDType::kInt8, 4>();
  }
  return 0;
}
int staged_per_sm(int d, PoolDType t, int nhf) {
  return d == 128 ? staged_per_sm_dim<128>(t, nhf) : d == 64 ? staged_per_sm_dim<64>(t, nhf) : 0;
}

// Whether full mode runs full_staged_kernel (PagedDecodeParams::full_staged: one token, at most
// kStagedConsumers sets of query heads per KV head), with W consumer warps a set and `splits`
// CTAs a KV head: one wave at the kernel's occupancy, each warp two blocks at least.
struct StagedPlan {
  int splits = 0, w = 1, sets = 1;  // splits 0: not staged
  int nhf = 1;                      // INT8: the kernel's heads a warp (full_staged_kernel's NHF)
};
StagedPlan staged_plan(int n_heads, const PagedKv& kv, const PagedDecodeParams& p) {
  StagedPlan sp;
  if (p.psa || p.n_tokens > 1 || !p.full_staged || kv.n_kv_heads <= 0 || n_heads <= 0 ||
      n_heads % kv.n_kv_heads != 0)
    return sp;
  const int G = n_heads / kv.n_kv_heads;
  const bool i8 = kv.dtype == PoolDType::kInt8;
  // INT8 with one query head per KV head keeps full_kernel: warp_block_heads does four heads'
  // arithmetic whatever the group, and there is no conversion to share.
  if (i8 && G < 2) return sp;
  const int64_t min_blocks =
      p.staged_int8_min_blocks >= 0 ? p.staged_int8_min_blocks : kDecodeStagedInt8MinBlocks;
  if (i8 && int64_t(kv.n_kv_heads) * kv.max_pages < min_blocks) return sp;
  const int hpw = i8 ? kStagedHeadsPerWarp<PoolDType::kInt8> : 1;
  const int consumers = i8 ? kStagedConsumers<PoolDType::kInt8> : kStagedConsumers<PoolDType::kF32>;
  sp.sets = (G + hpw - 1) / hpw;
  sp.nhf = std::min(G, hpw);
  if (sp.sets > consumers) return sp;
  const int per_sm = staged_per_sm(kv.head_dim, kv.dtype, sp.nhf);
  if (per_sm <= 0) return sp;
  sp.w = consumers / sp.sets;
  const int most = std::max(1, kv.max_pages / (2 * sp.w));
  sp.splits = std::clamp(per_sm * device_sms() / kv.n_kv_heads, 1, most);
  return sp;
}

// Several tokens (pass_kernel): row chunks of a KV head, and splits of its pages so that the
// grid fills about two waves of 2 CTAs an SM (the kernel's shared memory allows 2), at least 8
// pages a split.
int pass_chunks(int n_heads, int n_kv_heads, int n_tokens) {
  return (n_heads / n_kv_heads * n_tokens + kPassRows - 1) / kPassRows;
}
int pass_splits(int n_heads, int n_kv_heads, int n_tokens, int max_pages) {
  const int ctas = n_kv_heads * pass_chunks(n_heads, n_kv_heads, n_tokens);
  const int want = (4 * device_sms() + ctas - 1) / ctas;
  return std::max(1, std::min(want, (max_pages + 7) / 8));
}

// The PSA sequence (psa_round_kernel's comment): bounds, ranking, then every round that
// max_pages can need (a fixed count, so the launch fits a CUDA graph).
template <int D, PoolDType T>
Status launch_psa(const DecodeArgs& a, void* workspace, cudaStream_t st) {
  const PsaLayout L = psa_layout(a.n_heads, a.kv.n_kv_heads, a.kv.max_pages, D, a.gqa);
  const PsaWs w = psa_ws(workspace, L);
  const int64_t items = int64_t(a.n_heads) * a.kv.max_pages;
  psa_bounds_kernel<D><<<unsigned((items + 255) / 256), 256, 0, st>>>(a, w);
  SF_CUDA_TRY(cudaGetLastError());
  static_assert(kPsaRankThreads * 8 >= kDecodeMaxPages, "the rank sort covers every page");
  if (a.kv.max_pages <= kPsaRankThreads * 4)
    psa_rank_kernel<4><<<unsigned(a.n_heads), kPsaRankThreads, 0, st>>>(a, w);
  else
    psa_rank_kernel<8><<<unsigned(a.n_heads), kPsaRankThreads, 0, st>>>(a, w);
  SF_CUDA_TRY(cudaGetLastError());
  if (a.gqa) {
    static SmemOptIn walk_opted;
    SF_CUDA_TRY(opt_in_smem(gqa_walk_kernel<D>, gqa_walk_smem_limit(), walk_opted));
  }
  const int n_kv = a.kv.n_kv_heads;
  for (int r = 0, start = 0; r < L.rounds; start += psa_round_size(r), ++r) {
    const int size = psa_round_size(r);
    if (a.gqa) {
      const int slots = std::min(L.group * size, a.kv.max_pages);
      gqa_cand_kernel<<<unsigned(n_kv), kGqaWarps * 32, 0, st>>>(a, w, r, size);
      SF_CUDA_TRY(cudaGetLastError());
      gqa_score_kernel<D, T>
          <<<unsigned(n_kv * ((slots * L.group + kPsaRoundWarps - 1) / kPsaRoundWarps)),
             kPsaRoundWarps * 32, 0, st>>>(a, w, slots);
      SF_CUDA_TRY(cudaGetLastError());
      gqa_walk_kernel<D><<<unsigned(n_kv), kGqaWarps * 32,
                           gqa_walk_smem_bytes(L.group, size, L.slots, a.kv.max_pages), st>>>(
          a, w, size);
      SF_CUDA_TRY(cudaGetLastError());
      continue;
    }
    const int per_head = (size + kPsaRoundWarps - 1) / kPsaRoundWarps;
    psa_round_kernel<D, T>
        <<<unsigned(a.n_heads * per_head), kPsaRoundWarps * 32, 0, st>>>(a, w, start, size);
    SF_CUDA_TRY(cudaGetLastError());
    psa_walk_kernel<D><<<unsigned(a.n_heads), kPsaWalkWarps * 32, 0, st>>>(a, w, start, size);
    SF_CUDA_TRY(cudaGetLastError());
  }
  return Status::ok();
}

template <int D, PoolDType T>
Status launch_pass(const DecodeArgs& a, cudaStream_t st) {
  static SmemOptIn opted;
  constexpr size_t smem = pass_smem_bytes<D>();
  SF_CUDA_TRY(opt_in_smem(pass_kernel<D, T>, smem, opted));
  const int chunks = pass_chunks(a.n_heads, a.kv.n_kv_heads, a.n_tokens);
  SF_CUDA_TRY(launch_dependent(pass_kernel<D, T>, unsigned(a.kv.n_kv_heads * a.splits * chunks),
                               kPassWarps * 32, smem, st, a, chunks));
  if (a.splits > 1)
    SF_CUDA_TRY(launch_dependent(merge_kernel<D>, unsigned(a.n_heads * a.n_tokens), kMergeThreads,
                                 0, st, a));
  return Status::ok();
}

template <int D, PoolDType T>
Status launch(const DecodeArgs& a, bool psa, void* workspace, cudaStream_t st) {
  if (psa) return launch_psa<D, T>(a, workspace, st);
  if (a.n_tokens > 1) return launch_pass<D, T>(a, st);
  DecodeArgs b = a;
  unsigned grid = unsigned(a.n_heads * a.splits);
  if constexpr (D != 32) {
    if (a.staged_splits > 0) {
      b.splits = a.staged_splits;  // partials a query head, for the merge
      const dim3 grid_s(unsigned(a.kv.n_kv_heads * a.staged_splits)),
          block_s(unsigned((1 + a.staged_sets * a.staged_w) * 32));
      const auto go = [&](auto kernel) {
        return launch_dependent(kernel, grid_s, block_s, staged_smem_bytes<D, T>(), st, a,
                                a.staged_splits, a.staged_w);
      };
      if constexpr (T == PoolDType::kInt8) {
        if (a.staged_nhf == 2)
          SF_CUDA_TRY(go(full_staged_kernel<D, T, 2>));
        else if (a.staged_nhf == 3)
          SF_CUDA_TRY(go(full_staged_kernel<D, T, 3>));
        else
          SF_CUDA_TRY(go(full_staged_kernel<D, T, 4>));
      } else {
        SF_CUDA_TRY(go(full_staged_kernel<D, T>));
      }
      if (b.splits > 1)
        SF_CUDA_TRY(
            launch_dependent(merge_kernel<D>, unsigned(b.n_heads), kMergeThreads, 0, st, b));
      return Status::ok();
    }
  }
  if (a.shared && T != PoolDType::kInt8)  // the dispatch below would run no kernel
    return SF_ERR(kInternal, "paged_decode_attention: the shared kernel is INT8's only");
  if constexpr (T == PoolDType::kInt8) {
    if (a.shared) {
      // One wave at the kernel's occupancy (its registers allow fewer CTAs an SM than
      // full_kernel's 6, for which the workspace was sized: an upper bound).
      static std::atomic<int> occ{0};
      int per_sm = occ.load(std::memory_order_relaxed);
      if (per_sm == 0) {
        SF_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, full_shared_kernel<D, T>, kFullWarps * 32, 0));
        per_sm = std::clamp(per_sm, 1, 6);
        occ.store(per_sm, std::memory_order_relaxed);
      }
      b.splits = full_splits(a.kv.n_kv_heads, a.kv.max_pages, per_sm);
      grid = unsigned(a.kv.n_kv_heads * b.splits);
      SF_CUDA_TRY(launch_dependent(full_shared_kernel<D, T>, grid, kFullWarps * 32, 0, st, b));
    }
  }
  if (!b.shared)
    SF_CUDA_TRY(launch_dependent(full_kernel<D, T>, grid, kFullWarps * 32, 0, st, b));
  if (b.splits > 1)
    SF_CUDA_TRY(launch_dependent(merge_kernel<D>, unsigned(b.n_heads), kMergeThreads, 0, st, b));
  return Status::ok();
}

// The element type's instantiations: F32 at every head_dim, BF16 and INT8 at 64 and 128 (the
// models served; fewer nvcc instantiations).
template <int D>
Status launch_dtype(const DecodeArgs& a, bool psa, void* ws, cudaStream_t st) {
  switch (a.kv.dtype) {
    case PoolDType::kF32:
      return launch<D, PoolDType::kF32>(a, psa, ws, st);
    case PoolDType::kBF16:
      if constexpr (D != 32) return launch<D, PoolDType::kBF16>(a, psa, ws, st);
      break;
    case PoolDType::kInt8:
      if constexpr (D != 32) return launch<D, PoolDType::kInt8>(a, psa, ws, st);
      break;
  }
  return SF_ERR(kUnsupported,
                "paged_decode_attention: BF16 and INT8 pools take head_dim 64 or "
                "128, got " +
                    std::to_string(D));
}

}  // namespace

namespace {
// Full mode's split partials (0 with one split), for n_tokens tokens at once.
size_t full_workspace_bytes(int n_heads, const PagedKv& kv, int n_tokens) {
  if (n_tokens > 1) {
    const int splits = pass_splits(n_heads, kv.n_kv_heads, n_tokens, kv.max_pages);
    return splits > 1 ? sizeof(float) * size_t(n_heads) * size_t(n_tokens) * size_t(splits) *
                            size_t(kv.head_dim + 4)
                      : 0;
  }
  // Enough for either full kernel (the shared one splits a KV head's pages more ways).
  const int splits = std::max(full_splits(n_heads, kv.max_pages),
                              kv.n_kv_heads > 0 ? full_splits(kv.n_kv_heads, kv.max_pages) : 1);
  return splits > 1 ? sizeof(float) * size_t(n_heads) * size_t(splits) * size_t(kv.head_dim + 4)
                    : 0;
}
}  // namespace

// Full mode's partials: either kernel's (the staged one's with plan sp).
static size_t full_mode_workspace_bytes(int n_heads, const PagedKv& kv,
                                        const PagedDecodeParams& p, const StagedPlan& sp) {
  const size_t staged = sp.splits > 1 ? sizeof(float) * size_t(n_heads) * size_t(sp.splits) *
                                           size_t(kv.head_dim + 4)
                                     : 0;
  return std::max(staged, full_workspace_bytes(n_heads, kv, std::max(p.n_tokens, 1)));
}

size_t paged_decode_workspace_bytes(int n_heads, const PagedKv& kv, const PagedDecodeParams& p) {
  if (!supported_dim(kv.head_dim) || n_heads <= 0 || kv.max_pages <= 0 || kv.n_kv_heads <= 0)
    return 0;
  // Full mode's partials, or PSA's bounds, order, walk state and round results.
  if (p.psa)
    return psa_layout(n_heads, kv.n_kv_heads, kv.max_pages, kv.head_dim, p.psa_share_kv_head)
        .bytes;
  return full_mode_workspace_bytes(n_heads, kv, p, staged_plan(n_heads, kv, p));
}

bool paged_decode_staged(int n_heads, const PagedKv& kv, const PagedDecodeParams& p) {
  return supported_dim(kv.head_dim) && n_heads > 0 && staged_plan(n_heads, kv, p).splits > 0;
}

Status paged_decode_attention(const float* q, int n_heads, const PagedKv& kv,
                              const PagedDecodeParams& p, float* out, int32_t* visited,
                              void* workspace, size_t workspace_bytes, void* stream) {
  if (!supported_dim(kv.head_dim))
    return SF_ERR(kUnsupported, "paged_decode_attention: CUDA supports head_dim 32, 64 or 128, got " +
                                    std::to_string(kv.head_dim));
  if (n_heads <= 0 || kv.n_kv_heads <= 0 || n_heads % kv.n_kv_heads != 0)
    return SF_ERR(kInvalidArgument, "paged_decode_attention: " + std::to_string(n_heads) +
                                        " query heads over " + std::to_string(kv.n_kv_heads) +
                                        " KV heads (want a positive multiple)");
  DecodeArgs a{};
  a.q = q;
  a.out = out;
  a.visited = visited;
  a.kv = kv;
  a.n_heads = n_heads;
  // The shared kernel where it pays: INT8 rows, whose conversion is most of the work, and 2+
  // query heads per KV head (F32 and BF16 ran faster with a warp per head: bench/NOTES.md).
  // Several tokens run pass_kernel.
  a.n_tokens = p.psa ? 1 : std::max(p.n_tokens, 1);
  a.shared = !p.psa && p.share_kv_heads && kv.dtype == PoolDType::kInt8 && kv.head_dim != 32 &&
             n_heads / kv.n_kv_heads >= 2 && a.n_tokens == 1;
  a.splits = p.psa             ? 1
             : a.n_tokens > 1 ? pass_splits(n_heads, kv.n_kv_heads, a.n_tokens, kv.max_pages)
                              : full_splits(a.shared ? kv.n_kv_heads : n_heads, kv.max_pages);
  a.scale = p.scale > 0.f ? p.scale : 1.f / std::sqrt(float(kv.head_dim));
  a.eps = p.eps;
  a.pin = p.pin_sink_recent;
  a.recent_mean = p.recent_mean;
  a.gqa = p.psa && p.psa_share_kv_head;
  const StagedPlan sp = staged_plan(n_heads, kv, p);
  a.staged_splits = sp.splits;
  a.staged_w = sp.w;
  a.staged_sets = sp.sets;
  a.staged_nhf = sp.nhf;
  // The plan above sizes the full-mode workspace too; PSA's is its layout's.
  size_t need = 0;
  if (p.psa)
    need = cuda::paged_decode_workspace_bytes(n_heads, kv, p);
  else if (a.splits > 1 || a.staged_splits > 1)
    need = full_mode_workspace_bytes(n_heads, kv, p, sp);
  if (need > 0) {
    if (!workspace || workspace_bytes < need)
      return SF_ERR(kInvalidArgument, std::string("paged_decode_attention: ") +
                                          (p.psa ? "psa" : "full") + " mode needs " +
                                          std::to_string(need) + " bytes of workspace, got " +
                                          std::to_string(workspace_bytes));
    a.ws = static_cast<float*>(workspace);
  }
  const auto st = static_cast<cudaStream_t>(stream);
  switch (kv.head_dim) {
    case 32:
      return launch_dtype<32>(a, p.psa, workspace, st);
    case 64:
      return launch_dtype<64>(a, p.psa, workspace, st);
    case 128:
      return launch_dtype<128>(a, p.psa, workspace, st);
    default: return SF_ERR(kInternal, "paged_decode_attention: head_dim not dispatched");
  }
}

Status paged_append(const PagedKv& kv, const float* k_new, const float* v_new, int n_tokens,
                    void* stream) {
  const auto go = [&](auto kernel) {
    return launch_dependent(kernel, unsigned(kv.n_kv_heads), 128, 0,
                            static_cast<cudaStream_t>(stream), kv, k_new, v_new, n_tokens);
  };
  switch (kv.dtype) {
    case PoolDType::kF32: SF_CUDA_TRY(go(paged_append_kernel<PoolDType::kF32>)); break;
    case PoolDType::kBF16: SF_CUDA_TRY(go(paged_append_kernel<PoolDType::kBF16>)); break;
    case PoolDType::kInt8: SF_CUDA_TRY(go(paged_append_kernel<PoolDType::kInt8>)); break;
  }
  return Status::ok();
}

size_t paged_snapshot_bytes(const PagedKv& kv) {
  return size_t(kv.n_kv_heads) * SnapLayout{kv.head_dim, kv.dtype == PoolDType::kInt8}.head_bytes();
}

Status paged_snapshot(const PagedKv& kv, void* snap, bool save, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  const unsigned grid = unsigned(kv.n_kv_heads);
  auto* p = static_cast<uint8_t*>(snap);
  if (save)
    paged_snapshot_kernel<true><<<grid, 128, 0, st>>>(kv, p);
  else
    paged_snapshot_kernel<false><<<grid, 128, 0, st>>>(kv, p);
  SF_CUDA_TRY(cudaGetLastError());
  return Status::ok();
}

}  // namespace sf::kernels::cuda
