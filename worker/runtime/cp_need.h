// Sparsity-aware CP's transfer, counted from a global index without running the prefill: the
// (token, KV head) rows each CP rank's selective exchange would receive (parallel_prefill.h,
// selective_kv: the rows its query blocks read and another rank holds) against what the per-layer
// all-gather brings it. Used by `sparsefill bench attention` on indices of long prompts, and by
// the MPI tests to check the runtime's own counts.
#pragma once
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/sparse_index.h"

namespace sf::runtime {

class CpNeedCount {
 public:
  // One layer of an n_tokens prompt with n_kv_heads KV heads, split over cp ranks (zigzag).
  CpNeedCount(int64_t n_tokens, int n_kv_heads, int cp);
  // Adds what a global index's slots read (every query row of the prompt, q_offset 0; its heads
  // are query heads [q_head0, q_head0 + idx.n_heads), q_per_kv of them per KV head) to the rank
  // holding each query block. May be called once per head group. add_rank does one rank's part
  // (ranks own disjoint state: callers may run them in parallel); add runs every rank on the
  // thread pool.
  // The index must cover the whole prompt (n_q == n_k == n_tokens, q_offset 0) and its heads
  // whole KV groups inside the counter's KV heads; anything else is kInvalidArgument.
  Status add(const kernels::SparseIndex& idx, int q_per_kv, int q_head0);
  Status add_rank(const kernels::SparseIndex& idx, int q_per_kv, int q_head0, int rank);
  // Per CP rank: rows it needs and does not hold; rows the all-gather brings it.
  std::vector<int64_t> moved_rows() const;
  std::vector<int64_t> allgather_rows() const;
  int cp() const { return cp_; }

 private:
  int64_t n_tokens_;
  int n_kv_, cp_;
  std::vector<std::vector<uint8_t>> need_;  // per rank [n_tokens * n_kv]
};

}  // namespace sf::runtime
