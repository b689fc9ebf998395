// Dense causal/non-causal attention with LSE, fp32, GQA-native: the correctness reference on the
// GPU (the wgmma/TMA kernels come later and are tested against it). Online softmax as in
// FlashAttention, with no score matrix in memory.
//
// Work split. The group = n_heads / n_kv_heads query heads that share a KV head are packed into
// rows (row = token * group + head_in_group, FlashInfer's GQA layout), so one K/V tile in shared
// memory serves all of them. A block owns kRows packed rows of one KV head; each warp owns
// kRowsPerWarp rows; within a key tile lane j owns key j for the scores (kKeys == warp size) and
// head dims lane + 32*i for the output accumulator.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention_f32_tile.cuh"
#include "kernels/cuda/reduce.cuh"

namespace sf::kernels::cuda {

struct AttentionDenseParams {
  const float* q;  // [n_q, n_heads, D]
  const float* k;  // [n_k, n_kv_heads, D]
  const float* v;  // [n_k, n_kv_heads, D]
  float* out;      // [n_q, n_heads, D]
  float* lse;      // [n_heads, n_q], natural log, -inf for rows that see no key
  int64_t n_q, n_k;
  int n_heads, n_kv_heads;
  float scale;
  int64_t q_offset;  // causal: q row i sees keys j <= q_offset + i
  bool causal;
};

namespace attention_dense_detail {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = attention_f32::kRowsPerWarp;
constexpr int kRows = kWarps * kRowsPerWarp;
constexpr int kKeys = attention_f32::kKeys;

// D=128: 8 KB + 16.5 KB + 16 KB, under the 48 KB static limit. K rows are padded by one float so
// that lanes reading K[lane][d] hit 32 different banks.
template <int D>
struct Smem {
  float q[kRows][D];
  float k[kKeys][D + 1];
  float v[kKeys][D];
};

using attention_f32::RowState;

__device__ __forceinline__ void unpack_row(const AttentionDenseParams& p, int group, int kv_head,
                                           int64_t row, int64_t* token, int* head) {
  *token = row / group;
  *head = kv_head * group + int(row % group);
}

template <int D>
__device__ __forceinline__ void load_q(const AttentionDenseParams& p, Smem<D>& sm, int group,
                                       int kv_head, int64_t row0, int64_t n_rows) {
  for (int e = threadIdx.x; e < kRows * D; e += kThreads) {
    const int r = e / D, d = e % D;
    float val = 0.f;
    if (row0 + r < n_rows) {
      int64_t t;
      int h;
      unpack_row(p, group, kv_head, row0 + r, &t, &h);
      val = p.q[(t * p.n_heads + h) * D + d];
    }
    sm.q[r][d] = val;
  }
}

// Keys past kv_end are zero-filled: their probability is 0, and 0 * garbage could be NaN.
template <int D>
__device__ __forceinline__ void load_kv_tile(const AttentionDenseParams& p, Smem<D>& sm,
                                             int kv_head, int64_t kv0, int64_t kv_end) {
  for (int e = threadIdx.x; e < kKeys * D; e += kThreads) {
    const int j = e / D, d = e % D;
    float kval = 0.f, vval = 0.f;
    if (kv0 + j < kv_end) {
      const int64_t off = ((kv0 + j) * p.n_kv_heads + kv_head) * D + d;
      kval = p.k[off];
      vval = p.v[off];
    }
    sm.k[j][d] = kval;
    sm.v[j][d] = vval;
  }
}

// One key tile for this warp's rows: scores, online-softmax rescale, P @ V.
template <int D>
__device__ __forceinline__ void mainloop_tile(const AttentionDenseParams& p, const Smem<D>& sm,
                                              int warp, int lane, int64_t kv0, RowState<D>& st) {
  float s[kRowsPerWarp] = {};
#pragma unroll 4
  for (int d = 0; d < D; ++d) {
    const float kd = sm.k[lane][d];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] += sm.q[warp * kRowsPerWarp + r][d] * kd;
  }
  const int64_t key = kv0 + lane;
  float sc[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
    sc[r] = key < st.limit[r] ? s[r] * p.scale : -INFINITY;
  attention_f32::softmax_tile<D>(st, sc, sm.v, lane);
}

// Normalize and store; rows that saw no key get out = 0 and lse = -inf (as the CPU reference).
template <int D>
__device__ __forceinline__ void epilogue(const AttentionDenseParams& p, int group, int kv_head,
                                         int64_t row0, int64_t n_rows, int warp, int lane,
                                         const RowState<D>& st) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t row = row0 + warp * kRowsPerWarp + r;
    if (row >= n_rows) continue;
    int64_t t;
    int h;
    unpack_row(p, group, kv_head, row, &t, &h);
    const bool any = st.l[r] > 0.f;
    const float inv = any ? 1.f / st.l[r] : 0.f;
    float* o = p.out + (t * p.n_heads + h) * D;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) o[lane + 32 * i] = st.o[r][i] * inv;
    if (lane == 0) p.lse[int64_t(h) * p.n_q + t] = any ? st.m[r] + logf(st.l[r]) : -INFINITY;
  }
}

template <int D>
__device__ __forceinline__ void attention_dense_block(const AttentionDenseParams& p) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of the warp size");
  __shared__ Smem<D> sm;
  const int group = p.n_heads / p.n_kv_heads;
  const int kv_head = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n_rows = p.n_q * group;
  const int64_t row0 = int64_t(blockIdx.x) * kRows;

  RowState<D> st;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t row = row0 + warp * kRowsPerWarp + r;
    const int64_t t = row / group;
    const int64_t lim = p.causal ? p.q_offset + t + 1 : p.n_k;
    st.limit[r] = row < n_rows ? (lim < p.n_k ? lim : p.n_k) : 0;
    st.m[r] = -INFINITY;
    st.l[r] = 0.f;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) st.o[r][i] = 0.f;
  }
  // Keys visible to the block's last (largest-position) row bound the loop.
  const int64_t last_row = (row0 + kRows < n_rows ? row0 + kRows : n_rows) - 1;
  int64_t kv_end = p.causal ? p.q_offset + last_row / group + 1 : p.n_k;
  kv_end = kv_end < p.n_k ? kv_end : p.n_k;

  load_q(p, sm, group, kv_head, row0, n_rows);
  for (int64_t kv0 = 0; kv0 < kv_end; kv0 += kKeys) {
    __syncthreads();  // Q stored / previous tile consumed
    load_kv_tile(p, sm, kv_head, kv0, kv_end);
    __syncthreads();
    mainloop_tile(p, sm, warp, lane, kv0, st);
  }
  epilogue(p, group, kv_head, row0, n_rows, warp, lane, st);
}

}  // namespace attention_dense_detail

template <int D>
__global__ void __launch_bounds__(attention_dense_detail::kThreads)
    attention_dense_kernel(const AttentionDenseParams p) {
  attention_dense_detail::attention_dense_block<D>(p);
}

// Instantiated once per head dim in attention_dense_hd<D>.cu (see dispatch.h).
template <int D>
cudaError_t attention_dense_launch(const AttentionDenseParams& p, cudaStream_t stream) {
  using namespace attention_dense_detail;
  const int64_t n_rows = p.n_q * (p.n_heads / p.n_kv_heads);
  if (n_rows == 0) return cudaSuccess;
  const int64_t blocks = (n_rows + kRows - 1) / kRows;
  if (blocks > 0x7fffffff || p.n_kv_heads > 65535) return cudaErrorInvalidConfiguration;
  attention_dense_kernel<D>
      <<<dim3(unsigned(blocks), unsigned(p.n_kv_heads)), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

extern template cudaError_t attention_dense_launch<64>(const AttentionDenseParams&, cudaStream_t);
extern template cudaError_t attention_dense_launch<128>(const AttentionDenseParams&, cudaStream_t);

}  // namespace sf::kernels::cuda
