// KV importance scores for retention (DESIGN.md "KV store and tiering", seed 004): SnapKV column
// sums of the softmax of an observation window (the last queries of the prompt), computed from
// the LSE the attention already returned, so the softmax is never materialized: one extra pass
// recomputes s = scale * q.k for the window rows only and sums p = exp(s - lse) per key column.
#pragma once
#include <cstdint>

#include "kernels/api.h"

namespace sf::kernels {

struct ImportanceParams {
  int window = 64;       // observation window: the last `window` rows of q (all rows if fewer)
  int pool = 7;          // max-pool kernel over keys (odd; 1 = no pooling), SnapKV's kernel_size
  float scale = 0.f;     // 0: 1/sqrt(head_dim); must equal the attention's scale
  int64_t q_offset = 0;  // as AttentionParams::q_offset: global position of q row 0 minus k row 0
};

// q: [nq, n_heads, d], k: [nk, n_kv_heads, d], lse: [n_heads, nq] as attention_dense returns.
// All F32, except k, which may be BF16 on CUDA (widened as it is read). The CUDA kernel takes
// pool <= 65, head_dim a multiple of 8 up to 256, and q and k 16-byte aligned.
// out: [n_kv_heads, nk] F32. out[g, j] = maxpool_j( sum over the query heads h of KV group g and
// window rows i that may see key j (causal) of exp(scale * q[i,h].k[j,g] - lse[h,i]) ).
// Rows whose lse is -inf (they saw no key) contribute nothing.
Status kv_importance(const TensorView& q, const TensorView& k, const TensorView& lse,
                     const ImportanceParams& p, TensorView out, Stream s = {});

// out[j] = max of a over [j - pool/2, j + pool/2] clipped to [0, n): SnapKV's pooling of column
// scores over keys (pool odd). Host memory; out must not alias a.
void max_pool_keys(const float* a, int64_t n, int pool, float* out);

namespace cpu {
Status kv_importance(const TensorView& q, const TensorView& k, const TensorView& lse,
                     const ImportanceParams& p, TensorView out);
}  // namespace cpu

}  // namespace sf::kernels
