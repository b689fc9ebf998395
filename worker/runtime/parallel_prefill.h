// The prefill forward of worker/model on a TP x CP grid (CPU, host buffers; grid.h has the
// layout). Per layer, on each rank:
//   norm -> column-parallel Q/K/V of this TP slice's heads -> RoPE at global positions ->
//   [cp_estimate: the layer's sparse index scored where the keys live] ->
//   CP exchange of this slice's K/V (an all_gatherv of every key, or with selective_kv only the
//   rows the index reads) -> attention of each held piece (adjacent chunks merge) against keys
//   [0, piece end) (q_offset = piece start), dense or sparse -> row-parallel O projection + TP all-reduce -> norm -> column-parallel gate/up,
//   row-parallel down + TP all-reduce.
// Weights are views into the full model (row slices of Q/K/V/gate/up, column slices of O/down
// through the GEMM's leading dimension), so sharding copies nothing.
//
// Equality with model::prefill: the same kernels on the same rows; only the TP all-reduce sums
// partial projections in another order, so results differ by fp32 rounding (tests state bounds).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "kernels/sparse_index.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"
#include "worker/runtime/grid.h"

namespace sf::runtime {

// A layer's index over the whole prompt and every query head (n_q = n_k = n_tokens, q_offset
// 0), e.g. recorded from a single-rank run; each rank slices its heads and chunks out of it.
using GlobalIndexSource = std::function<const kernels::SparseIndex*(int layer)>;

struct ParallelOptions {
  int64_t chunk = 512;      // tokens per linear-layer chunk
  bool all_logits = false;  // logits of every position (gathered on the leader) instead of the last
  bool gather_kv = true;    // the full KV cache on the group leader (for export)
  // Instead (gather_kv false): every rank's result holds its own rows of its own KV heads
  // (ParallelResult::kv: n_tokens = the rank's rows, its CP chunks in prompt order; n_kv_heads =
  // the TP slice's), for a sharded export where the KV stays where it was computed.
  bool local_kv = false;
  // Sparse attention: per-chunk estimation where the chunk's queries live (the estimators'
  // last-query scores then come from the chunk's own last rows), or, when index_source is set,
  // the given global index. Null sparse: dense everywhere.
  const model::SparseConfig* sparse = nullptr;
  GlobalIndexSource index_source;
  // Sparsity-aware CP, transfer half: instead of the all-gather, each rank receives only the
  // (token, KV head) rows its index slices read; needs the index first (index_source or
  // cp_estimate). Counted in kv_moved_bytes against kv_allgather_bytes. A prompt the sparse
  // config leaves dense (shorter than dense_below) has no index and takes the all-gather.
  bool selective_kv = false;
  // Sparsity-aware CP, estimation half (cp_estimate.h): with `sparse`, each layer's index is the
  // single-rank one over the whole prompt, scored where the keys live, instead of per-chunk
  // estimation. Combines with selective_kv (then no key moves before its selection).
  bool cp_estimate = false;
  // > 0: SnapKV importance of the last importance_window queries against every key
  // (model::PrefillOptions' meaning, always from a dense pass over the window rows), computed
  // where the keys live: the window's queries go to every CP rank, each window row's LSE is
  // merged from every rank's keys, and each rank sums its own keys' columns; the sums meet on
  // every rank, pooled with importance_pool (ParallelResult::importance).
  int importance_window = 0;
  int importance_pool = 7;
  // Called on every rank before each layer (progress; the worker's fault injection).
  std::function<void(int layer)> on_layer;
  // With gather_kv: called on the ranks gathering the cache to the leader (CP rank 0's TP row)
  // after each layer's gather (progress; tests slow the gather with it).
  std::function<void(int layer)> on_kv_gathered;
  // With local_kv: this rank's K/V (and, with importance_window, each layer's importance) as
  // they become final, and its KvCache should the run fail after that (model::LayerKvHooks;
  // model::PrefillOptions::kv_hooks on devices).
  model::LayerKvHooks kv_hooks;
  // With index_source or cp_estimate: called on every rank with each non-empty attention piece's
  // index as the layer will use it (query heads [h0, h0 + index.n_heads) of this TP slice, the
  // piece's rows, keys [0, piece.end)). Tests compare an estimated index with single-rank's.
  std::function<void(int layer, const TokenRange& piece, int h0, const kernels::SparseIndex& index)>
      on_index;
};

struct ParallelStats {
  double seconds = 0, attention_s = 0, estimate_s = 0;
  // Device path: host seconds sizing the KV result (page faults) and copying layers into it out
  // of pinned memory (model::PrefillResult); both overlap later layers' compute.
  double kv_alloc_s = 0, kv_copy_s = 0;
  // Device path: the most times a rank of the group grew its sparse plan during the run because
  // a layer's index slot outgrew it (model::PrefillResult::sparse_grows).
  int sparse_grows = 0;
  // Before the run, not in `seconds`: the device path plans per prompt length (workspaces,
  // pinned host KV, cuDNN graphs and GEMM algorithms); 0 when the worker reused the last plan.
  double plan_s = 0;
  double comm_s = 0;               // time waiting in collectives (this rank; cp_estimate's
                                   // are in estimate_s)
  int64_t kv_allgather_bytes = 0;  // K/V bytes the per-layer CP all-gather brings this rank
  int64_t estimate_bytes = 0;      // what cp_estimate's collectives brought this rank
  // ... by part (CpEstimateBytes): scoring rows' q and row stats, columns, diagonals, blocks
  int64_t estimate_queries_bytes = 0, estimate_columns_bytes = 0, estimate_diagonals_bytes = 0,
          estimate_blocks_bytes = 0;
  int64_t kv_moved_bytes = 0;      // what it actually received for attention (==
                                   // kv_allgather_bytes unless selective_kv; then rows + masks)
  int64_t importance_bytes = 0;    // what this rank put into the importance collectives
  double importance_s = 0;
  int64_t tp_allreduce_bytes = 0;  // bytes this rank all-reduced over TP
  int64_t comm_bytes = 0;          // everything this rank put into collectives
  double density = 1.0;            // of this rank's attention (causal pairs computed)
  // The whole group (every TP x CP rank, gathered after the prefill; the fields above are this
  // rank's). The job's exchange against the job's all-gather is group_kv_moved_bytes /
  // group_kv_allgather_bytes; the leader (CP rank 0) holds the last chunk, whose queries reach
  // furthest, so its own fraction is usually the largest of the ranks.
  int64_t group_kv_allgather_bytes = 0, group_kv_moved_bytes = 0, group_estimate_bytes = 0;
  std::vector<int64_t> kv_moved_bytes_by_rank, estimate_bytes_by_rank;  // group rank order
  // Each rank's own seconds, attention_s, comm_s and density, in group rank order: a rank
  // slower than its peers (more attention work, a plan grown mid-run) shows as the others'
  // comm_s, the time they waited for it in the next exchange.
  std::vector<double> seconds_by_rank, attention_s_by_rank, comm_s_by_rank, density_by_rank;
  double group_density = 1.0;  // causal pairs computed over causal pairs, whole prompt, all heads
};

struct ParallelResult {
  int32_t first_token = -1;   // every rank of the group
  std::vector<float> logits;  // leader only: [n_logit_rows, vocab] in prompt order
  int64_t n_logit_rows = 0;
  model::KvCache kv;  // leader only, when gather_kv: the whole prompt, every KV head;
                      // every rank, when local_kv: its rows of its KV heads
  // Every rank of the group, when importance_window > 0: per layer [n_kv_heads, n_tokens], all
  // KV heads (every TP slice's), the same on every rank; retention policies select from it.
  std::vector<std::vector<float>> importance;
  ParallelStats stats;
};

// Collective over g.group_comm. Every rank passes the same tokens and options.
Result<ParallelResult> parallel_prefill(const model::Model& m, GridComms& g,
                                        std::span<const int32_t> tokens,
                                        const ParallelOptions& opt = {});

// Fills st's group_* and *_by_rank fields: an all-gather of this rank's byte counters, causal
// pairs (computed, total) and seconds, attention_s and comm_s over g.group_comm (set them
// first). Collective; parallel_prefill calls it last.
Status gather_group_stats(GridComms& g, double pairs_done, double pairs_causal, ParallelStats* st);

// Slices one layer's global index (see GlobalIndexSource) to query heads [h0, h0 + nh) and the
// query rows of chunk r (64-aligned begin), against keys [0, r.end). Exposed for tests.
Result<kernels::SparseIndex> slice_index(const kernels::SparseIndex& global, int h0, int nh,
                                         const TokenRange& r);

}  // namespace sf::runtime
