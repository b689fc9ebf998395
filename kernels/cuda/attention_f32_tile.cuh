// What the F32 attention kernels (attention_dense.cuh, attention_sparse.cuh) share: a warp's
// running softmax state for kRowsPerWarp query rows, and the online-softmax update of that state
// by one tile of kKeys keys (FlashAttention's rescale, then P @ V). Lane j owns key j of the tile
// for the scores, and head dims lane + 32 i for the output accumulator; m and l are replicated
// across lanes.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/reduce.cuh"

namespace sf::kernels::cuda::attention_f32 {

constexpr int kRowsPerWarp = 4;  // each K element read from smem feeds 4 FMAs
constexpr int kKeys = 32;        // one key per lane

template <int D>
struct RowState {
  float m[kRowsPerWarp], l[kRowsPerWarp];
  float o[kRowsPerWarp][D / 32];
  int64_t limit[kRowsPerWarp];  // keys [0, limit) are visible to the row (0: no row)
};

// sc[r]: row r's scaled score for this lane's key, -inf where the key is not visible to it.
// v: the tile's V rows in shared memory.
template <int D>
__device__ __forceinline__ void softmax_tile(RowState<D>& st, const float (&sc)[kRowsPerWarp],
                                             const float (&v)[kKeys][D], int lane) {
  float prob[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const float m_new = fmaxf(st.m[r], warp_max(sc[r]));
    if (m_new == -INFINITY) {  // warp-uniform: the row has seen no visible key yet
      prob[r] = 0.f;
      continue;
    }
    const float alpha = expf(st.m[r] - m_new);  // 0 on the first visible tile (m = -inf)
    prob[r] = expf(sc[r] - m_new);
    st.l[r] = st.l[r] * alpha + warp_sum(prob[r]);
    st.m[r] = m_new;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) st.o[r][i] *= alpha;
  }
#pragma unroll 4
  for (int j = 0; j < kKeys; ++j) {
    float vj[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) vj[i] = v[j][lane + 32 * i];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float pj = __shfl_sync(kFullMask, prob[r], j);
#pragma unroll
      for (int i = 0; i < D / 32; ++i) st.o[r][i] += pj * vj[i];
    }
  }
}

}  // namespace sf::kernels::cuda::attention_f32
