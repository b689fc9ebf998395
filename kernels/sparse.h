// Sparse prefill attention: patterns, per-head configs, online estimators, the sparse kernel.
// Backend-neutral API; CPU implementation in kernels/cpu; the sparse kernel also in kernels/cuda.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/api.h"
#include "kernels/sparse_index.h"

namespace sf::kernels {

enum class Pattern {
  kDense,
  kAShape,
  kVerticalSlash,
  kBlockSparse,
  kMoA,
  kAdaptiveVS,
  kAdaptiveBlock
};
const char* pattern_name(Pattern p);
Result<Pattern> pattern_from_string(const std::string& s);

// One head's pattern and budget. Token counts; budgets are clamped to the sequence (and the
// clamp is reported by the estimator stats).
struct HeadPattern {
  Pattern pattern = Pattern::kDense;
  int64_t sink = 64;          // always-kept leading keys
  int64_t local = 64;         // always-kept recent keys (diagonal window) beyond the query's block
  int64_t n_vertical = 1000;  // vertical-slash: top-k columns
  int64_t n_slash = 6096;     // vertical-slash: top-k diagonals
  int64_t spread_rows = 0;    // vertical-slash scoring: rows spread over the sequence besides the
                              // last 64 (0 = MInference: the last 64 only)
  int64_t segment_rows = 0;   // vertical-slash: query rows per selection segment (a multiple of
                              // 64; 0 = one selection for every row, as MInference). Each segment
                              // ranks columns and diagonals from the scoring rows inside it.
  int64_t n_blocks = 64;      // block-sparse: top-k key blocks per query block
  double alpha = 1024;        // MoA span = alpha + beta * N
  double beta = 0.0;
  double gamma = 0.95;           // adaptive: cumulative estimated attention mass to reach
  int64_t min_budget = 256;      // adaptive: tokens kept at least (adaptive-vs: columns, and
                                 // diagonals, each; adaptive-block: ceil(budget / 64) blocks)...
  int64_t max_budget = 1 << 20;  // ...and at most
  int64_t last_block_rows = 0;   // adaptive-block, 1: the last query block keeps, for each of its
                                 // rows, the smallest ranked key-block set holding gamma of that
                                 // row's mass (their union), not the set for the rows' mean mass
  int64_t share_group = 0;       // 1: rank with the other sharing heads of this KV group and
                                 // family (sparse_select.h, share_leaders): one order, each head
                                 // its own budget, so the group's picks nest and its heads read
                                 // fewer distinct keys (what context parallelism moves)
  int64_t tail_block_min = 32;   // index building: a diagonal band's tail of at least this many
                                 // keys (1..63) becomes one more 64-key block instead of gathered
                                 // columns (sparse_index.h, step 4's option); 0 = off. A sparse
                                 // config file that omits it means 0 (files kept their meaning
                                 // when this default went from 0 to 32)
  int64_t vs_cover = 0;          // adaptive-vs, 1: columns and diagonals chosen as ONE cover,
                                 // in rounds by the scoring rows' mass not yet covered, until
                                 // their union holds gamma of it (sparse_select.h,
                                 // vs_cover_select); 0: each set holds gamma alone (FlexPrefill).
                                 // CPU and CUDA estimators (--cp-estimate refuses it)
  double score = 0;              // search: attention recall of this head's choice (informational)
};

// A head's pattern parameters in range (what sparse_estimate checks of patterns[h]; the error
// names "patterns[h]." and the field).
Status check_pattern(const HeadPattern& hp, size_t h);

struct EstimatorStats {
  double estimate_s = 0;
  int64_t clamped_heads = 0;  // heads whose budget exceeded the sequence and was clamped
  double density = 0;         // of the index built
  // Input (CPU backend): also hand back the scores the estimator computed anyway, for KV
  // importance (PrefillOptions::importance_from_estimator). columns[h] ([n_k], empty for heads
  // with no such scores) sums softmax(q_row K^T * scale) over the head's scoring rows: the last
  // segment's rows for vertical-slash and adaptive-vs heads (the last 64 rows, plus spread rows
  // when set and segment_rows is 0; with segment_rows only the last 64), the last query block's
  // rows for block-sparse and adaptive-block heads.
  bool keep_columns = false;
  std::vector<std::vector<float>> columns;
};

// Builds the index for one layer's attention over all rows of q: q [n_q, n_heads, d] (global
// offset q_offset relative to k row 0), k [n_k, n_kv_heads, d]. Vertical-slash and adaptive
// scoring use the last min(64, n_q) rows of q against all keys (MInference Alg. 2); block-sparse
// mean-pools q and k over 64-token blocks (Alg. 3). patterns.size() == n_heads. Estimation time
// is part of prefill time and is reported in stats (which may be null).
// Per pattern (details and the exact clamp rules in kernels/cpu/sparse_estimators.cpp):
//   dense: every causal key. a-shape: sink + local window. vertical-slash: top n_vertical
//   columns and top n_slash diagonals of the last-query softmax, sink columns and diagonals
//   0..local ranked first. block-sparse: top n_blocks pooled-score key blocks per query block,
//   block 0 and the diagonal blocks ranked first. moa: local window of alpha + beta * n_k keys.
//   adaptive-vs / adaptive-block: the smallest ranked set reaching gamma of the estimated mass.
// Every pattern also gets the sink and local window (sparse_index.h). Ties rank by lower index.
// CUDA tensors (F32, or BF16 q and k): the device estimators (kernels/cuda/sparse_estimate.h),
// same rules; spread_rows > 0 (except with vs_cover) or segment_rows > 0 is kUnsupported there.
Status sparse_estimate(const TensorView& q, const TensorView& k,
                       const std::vector<HeadPattern>& patterns, int64_t q_offset, SparseIndex* out,
                       EstimatorStats* stats);

// out/lse as attention_dense. Exact online softmax over the keys the index selects. Requires
// p.causal and p.q_offset == idx.q_offset; the index is validated structurally first (bounds,
// order, overlaps; linear in its size). A row that sees no selected key gets 0 and lse -inf.
// CUDA stream: kernels/cuda/attention_sparse.cuh (the index is copied to the device in stream
// order; cuda::attention_sparse with a SparseIndexDevice is the capturable run step).
Status attention_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SparseIndex& idx, TensorView out, TensorView lse,
                        const AttentionParams& p, Stream s = {});

}  // namespace sf::kernels
