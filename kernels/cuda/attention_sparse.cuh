// Sparse causal attention with LSE over the unified index (kernels/sparse_index.h), fp32,
// GQA-native: query head h reads K/V of head h / (n_heads / n_kv_heads) in place, no repeat_kv.
// One online softmax per row runs across the slot's block entries and then its gathered columns,
// so the result is exact attention over the selected keys (the CPU kernel's contract). This is
// the fp32 reference; attention_sparse_bf16.cuh is the tensor-core kernel.
//
// Work split. A CTA owns kRows = 16 consecutive query rows of one (head, 64-query block) slot:
// 4 CTAs per slot, 4 warps, 4 rows per warp. The slot's key list is walked in tiles of
// kKeys = 32 key positions (lane j owns key j for the scores, head dims lane + 32 i for the
// output), each tile either a stretch of one block entry or 32 gathered columns; K/V rows are
// staged in shared memory by position, so both kinds of tile run the same mainloop. Keys at or
// past the CTA's own causal limit are skipped (the upper part of the diagonal block costs
// nothing); the per-row mask inside the tile is exactly the CPU kernel's (key < base + i + 1).
// Slots of later query blocks (more keys under a causal index) are launched first.
//
// Index on the device: the four arrays of SparseIndex laid out as on the host. Offsets into
// q/k/v/out and the index are 64-bit: at 1M tokens n_q * n_heads * D passes 2^31.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention_f32_tile.cuh"
#include "kernels/cuda/reduce.cuh"

namespace sf::kernels::cuda {

struct AttentionSparseParams {
  const float* q;  // [n_q, n_heads, D]
  const float* k;  // [n_k, n_kv_heads, D]
  const float* v;  // [n_k, n_kv_heads, D]
  float* out;      // [n_q, n_heads, D]
  float* lse;      // [n_heads, n_q], natural log, -inf for rows that see no selected key
  int64_t n_q, n_k;
  int n_heads, n_kv_heads;
  float scale;
  int64_t q_offset;  // row i of q sees keys j < q_offset + i + 1
  // The index (device pointers), slot = h * n_qblocks + qb.
  const int32_t* block_count;   // [n_heads * n_qblocks]
  const int32_t* block_offset;  // [n_heads * n_qblocks * max_blocks]
  const int32_t* column_count;  // [n_heads * n_qblocks]
  const int32_t* column_index;  // [n_heads * n_qblocks * max_cols]
  int64_t n_qblocks;
  int max_blocks, max_cols;
};

namespace attention_sparse_detail {

constexpr int kQBlock = 64;  // kSparseBlock: query rows and key entry width of the index
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = attention_f32::kRowsPerWarp;
constexpr int kRows = kWarps * kRowsPerWarp;  // 16: a quarter of a slot
constexpr int kSubBlocks = kQBlock / kRows;
constexpr int kKeys = attention_f32::kKeys;

// D=128: 8 KB + 16.5 KB + 16 KB + 256 B, under the 48 KB static limit. Rows of q and k are read
// as float4; k rows are padded by 4 floats so the 8 lanes of a 128-bit load phase (rows 132
// words apart) fall on distinct banks.
template <int D>
struct Smem {
  float q[kRows][D];
  float k[kKeys][D + 4];
  float v[kKeys][D];
  int64_t pos[kKeys];  // key position of tile slot j, -1 when empty
};

using attention_f32::RowState;

// Stages K/V rows of the tile: positions first (one per lane of warp 0), then the rows as float4.
// Empty slots are zero-filled: their probability is 0, and 0 * garbage could be NaN.
template <int D>
__device__ __forceinline__ void load_tile(const AttentionSparseParams& p, Smem<D>& sm, int kv_head,
                                          int64_t my_pos) {
  if (threadIdx.x < kKeys) sm.pos[threadIdx.x] = my_pos;
  __syncthreads();
  constexpr int kVec = D / 4;
  for (int e = threadIdx.x; e < kKeys * kVec; e += kThreads) {
    const int j = e / kVec, c = e % kVec;
    const int64_t pos = sm.pos[j];
    float4 kv4 = make_float4(0.f, 0.f, 0.f, 0.f), vv4 = kv4;
    if (pos >= 0) {
      const int64_t off = (pos * p.n_kv_heads + kv_head) * D;
      kv4 = reinterpret_cast<const float4*>(p.k + off)[c];
      vv4 = reinterpret_cast<const float4*>(p.v + off)[c];
    }
    reinterpret_cast<float4*>(&sm.k[j][0])[c] = kv4;
    reinterpret_cast<float4*>(&sm.v[j][0])[c] = vv4;
  }
  __syncthreads();
}

template <int D>
__device__ __forceinline__ void mainloop_tile(float scale, const Smem<D>& sm, int warp, int lane,
                                              RowState<D>& st) {
  float s[kRowsPerWarp] = {};
  const float4* krow = reinterpret_cast<const float4*>(&sm.k[lane][0]);
#pragma unroll 4
  for (int c = 0; c < D / 4; ++c) {
    const float4 kd = krow[c];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float4 qd = reinterpret_cast<const float4*>(&sm.q[warp * kRowsPerWarp + r][0])[c];
      s[r] += qd.x * kd.x + qd.y * kd.y + qd.z * kd.z + qd.w * kd.w;
    }
  }
  const int64_t key = sm.pos[lane];
  float sc[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
    sc[r] = (key >= 0 && key < st.limit[r]) ? s[r] * scale : -INFINITY;
  attention_f32::softmax_tile<D>(st, sc, sm.v, lane);
}

template <int D>
__device__ __forceinline__ void attention_sparse_block(const AttentionSparseParams& p) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of the warp size");
  __shared__ __align__(16) Smem<D> sm;
  const int h = blockIdx.y;
  const int kv_head = h / (p.n_heads / p.n_kv_heads);
  const int64_t qb = p.n_qblocks - 1 - int64_t(blockIdx.x) / kSubBlocks;
  const int sub = int(blockIdx.x % kSubBlocks);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = qb * kQBlock + int64_t(sub) * kRows;  // first q row of this CTA
  if (r0 >= p.n_q) return;                                 // short last query block
  const int64_t rows = p.n_q - r0 < kRows ? p.n_q - r0 : kRows;
  const int64_t base = p.q_offset + r0;  // key limit of row i is min(n_k, base + i + 1)
  // The CTA's causal limit: keys at or past it are masked for all of its rows.
  const int64_t cta_end = base + rows < p.n_k ? base + rows : p.n_k;

  RowState<D> st;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int i = warp * kRowsPerWarp + r;
    const int64_t lim = base + i + 1 < p.n_k ? base + i + 1 : p.n_k;
    st.limit[r] = i < rows ? lim : 0;
    st.m[r] = -INFINITY;
    st.l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) st.o[r][c] = 0.f;
  }
  for (int e = threadIdx.x; e < kRows * (D / 4); e += kThreads) {
    const int r = e / (D / 4), c = e % (D / 4);
    float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < rows) val = reinterpret_cast<const float4*>(p.q + ((r0 + r) * p.n_heads + h) * D)[c];
    reinterpret_cast<float4*>(&sm.q[r][0])[c] = val;
  }

  const int64_t slot = int64_t(h) * p.n_qblocks + qb;
  const int32_t* bo = p.block_offset + slot * p.max_blocks;
  const int32_t* ci = p.column_index + slot * p.max_cols;
  const int bc = p.block_count[slot], cc = p.column_count[slot];
  // Block entries: each covers [off, min(off + 64, slot kend)); clipping at cta_end (<= slot
  // kend) drops keys no row of this CTA sees. Two 32-key tiles per full entry.
  for (int b = 0; b < bc; ++b) {
    const int64_t k0 = bo[b];
    const int64_t k1 = k0 + kQBlock < cta_end ? k0 + kQBlock : cta_end;
    for (int64_t t0 = k0; t0 < k1; t0 += kKeys) {
      __syncthreads();  // previous tile consumed (and, first time, q stored)
      load_tile(p, sm, kv_head, t0 + lane < k1 ? t0 + lane : -1);
      mainloop_tile<D>(p.scale, sm, warp, lane, st);
    }
  }
  // Columns: sorted ascending, so the first one at or past cta_end ends the list for this CTA.
  for (int c0 = 0; c0 < cc; c0 += kKeys) {
    if (ci[c0] >= cta_end) break;
    int64_t pos = -1;
    if (c0 + lane < cc) {
      const int64_t col = ci[c0 + lane];
      pos = col < cta_end ? col : -1;
    }
    __syncthreads();
    load_tile(p, sm, kv_head, pos);
    mainloop_tile<D>(p.scale, sm, warp, lane, st);
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int i = warp * kRowsPerWarp + r;
    if (i >= rows) continue;
    const int64_t t = r0 + i;
    const bool any = st.l[r] > 0.f;
    const float inv = any ? 1.f / st.l[r] : 0.f;
    float* o = p.out + (t * p.n_heads + h) * D;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) o[lane + 32 * c] = st.o[r][c] * inv;
    if (lane == 0) p.lse[int64_t(h) * p.n_q + t] = any ? st.m[r] + logf(st.l[r]) : -INFINITY;
  }
}

}  // namespace attention_sparse_detail

template <int D>
__global__ void __launch_bounds__(attention_sparse_detail::kThreads)
    attention_sparse_kernel(const AttentionSparseParams p) {
  attention_sparse_detail::attention_sparse_block<D>(p);
}

// Instantiated once per head dim in attention_sparse_hd<D>.cu (see dispatch.h).
template <int D>
cudaError_t attention_sparse_launch(const AttentionSparseParams& p, cudaStream_t stream) {
  using namespace attention_sparse_detail;
  if (p.n_q == 0 || p.n_qblocks == 0) return cudaSuccess;
  const int64_t blocks = p.n_qblocks * kSubBlocks;
  if (blocks > 0x7fffffff || p.n_heads > 65535) return cudaErrorInvalidConfiguration;
  attention_sparse_kernel<D>
      <<<dim3(unsigned(blocks), unsigned(p.n_heads)), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

extern template cudaError_t attention_sparse_launch<64>(const AttentionSparseParams&, cudaStream_t);
extern template cudaError_t attention_sparse_launch<128>(const AttentionSparseParams&,
                                                         cudaStream_t);

}  // namespace sf::kernels::cuda
