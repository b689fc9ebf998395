// Device index estimators, host side (C++20): plan (workspace sizing, per-head parameters,
// capacity of the index built in place) split from run (the launch sequence of
// sparse_estimate.cu: no allocation, no host synchronization, capturable in a CUDA graph).
// The rules and the ranking are the CPU estimator's; kernels/sparse.h sparse_estimate on CUDA
// tensors runs plan + run + download and returns the host index.
#pragma once
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/sparse_estimate_launch.h"
#include "kernels/sparse.h"

namespace sf::kernels::cuda {

struct SparseEstimatePlan {
  EstimateLaunch launch;   // geometry, head tables and workspace pointers; q, k bound at run
  DeviceBuffer tables;     // per-head parameters and the need[] record: always the plan's own
  DeviceBuffer workspace;  // scores, selections (unless EstimateMemory lends them)
  DeviceBuffer index;      // the index built in place, SparseIndexDevice layout (likewise)
  char* workspace_base = nullptr;  // where the scratch and the index live (own or lent)
  char* index_base = nullptr;
  int64_t clamped_heads = 0;
  size_t workspace_bytes = 0, index_bytes = 0;
};

// Device memory a plan uses for its scratch and its index instead of allocating them: plans whose
// runs are ordered on one stream (a forward's layers and pieces) can share one arena, each run
// overwriting the last one's index after that index was consumed. size_only: the plan only
// records workspace_bytes and index_bytes (to size the arena) and allocates nothing. Both bases
// must be 256-byte aligned (as cudaMalloc's are); the plan refuses others.
struct EstimateMemory {
  char* workspace = nullptr;
  size_t workspace_bytes = 0;
  char* index = nullptr;
  size_t index_bytes = 0;
  bool size_only = false;
};

// Supported: F32 or BF16 contiguous q [n_q, heads, d], k [n_k, kv_heads, d] (the same dtype),
// d % 4 == 0, every pattern except vertical-slash / adaptive-vs with spread_rows > 0 (unless
// vs_cover) or segment_rows > 0, vs_cover heads with different spread_rows or a max_budget below
// the key or diagonal count, and adaptive-block with last_block_rows (kUnsupported). max_blocks /
// max_cols: index capacity per slot; <= 0 picks a default (every key block, and min(causal keys,
// 4096) columns). Allocates (with mem: only the head tables, and kOutOfRange when the lent memory
// is smaller than the plan needs); not for capture.
Status sparse_estimate_plan(const TensorView& q, const TensorView& k,
                            const std::vector<HeadPattern>& patterns, int64_t q_offset,
                            int max_blocks, int max_cols, SparseEstimatePlan* plan,
                            const EstimateMemory* mem = nullptr);
// Run step: estimates into plan->index and points *out at it. q, k as planned.
Status sparse_estimate_run(SparseEstimatePlan* plan, const TensorView& q, const TensorView& k,
                           SparseIndexDevice* out, void* stream);
// After a run (synchronizes the stream): the largest block and column counts any slot needed.
// Larger than the plan's capacity means that run truncated slots: re-plan with these.
Status sparse_estimate_needed(const SparseEstimatePlan& plan, void* stream, int* max_blocks,
                              int* max_cols);
// Enqueue-only form of sparse_estimate_needed: copies the run's {blocks, columns} need into
// host_need[2] (pinned memory) on `stream`, after the run, without waiting; the caller waits on
// the stream (an event) before reading it. A forward checks each layer's need while its
// attention runs, not after the whole prefill.
Status sparse_estimate_need_enqueue(const SparseEstimatePlan& plan, int32_t* host_need,
                                    void* stream);
// Copies a device index to a host SparseIndex, repacked to the capacities given (>= every
// count). Synchronizes the stream.
Status sparse_index_download(const SparseIndexDevice& idx, int max_blocks, int max_cols,
                             SparseIndex* out, void* stream);
// The selections of the last run (tests, tools): per query head its columns and diagonals
// (vertical-slash family; empty otherwise), per slot h * n_qblocks + qb its key blocks (block
// family; empty otherwise). Synchronizes the stream.
// vs_cover heads also hand back each item's round and which diagonals came free (VsCoverTrace's
// col_round / diag_round / diag_free; empty for other heads).
struct EstimateSelections {
  std::vector<std::vector<int32_t>> columns, diagonals, key_blocks;
  std::vector<std::vector<int32_t>> col_round, diag_round;
  std::vector<std::vector<uint8_t>> diag_free;
};
Status sparse_estimate_selections(const SparseEstimatePlan& plan, void* stream,
                                  EstimateSelections* out);
// Adds the index's computed (query, key) pairs (causal mask applied) to *pairs, a device
// counter: the numerator of SparseIndex::density. Enqueue only.
Status sparse_index_pairs(const SparseIndexDevice& idx, unsigned long long* pairs, void* stream);
// Fills the plan's index and selection arrays with `byte` (tests poison them before a run).
Status sparse_estimate_poison(SparseEstimatePlan* plan, int byte, void* stream);
// The backend-neutral entry (kernels/sparse.h) on CUDA tensors: plan, run, re-plan once if a
// slot overflowed, download. Synchronous.
Status sparse_estimate(const TensorView& q, const TensorView& k,
                       const std::vector<HeadPattern>& patterns, int64_t q_offset, SparseIndex* out,
                       EstimatorStats* stats, void* stream);

}  // namespace sf::kernels::cuda
