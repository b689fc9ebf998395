// CPU backend of kernels/sparse.h: the online index estimators and the sparse attention kernels.
// Called through kernels/sparse.h, which validates shapes, dtypes and the index first.
#pragma once
#include <vector>

#include "kernels/sparse.h"

namespace sf::kernels::cpu {

// Builds the index for every head by its pattern (see kernels/sparse.h). When trace is non-null
// it receives, per slot (idx.slot order), the candidates fed to the builder — the selected
// columns, diagonals and key blocks — so tests and tools can check the selection itself; trace
// locals (the builder's `local`) are returned in *trace_local, one per head.
Status sparse_estimate(const TensorView& q, const TensorView& k,
                       const std::vector<HeadPattern>& patterns, int64_t q_offset, SparseIndex* out,
                       EstimatorStats* stats, std::vector<IndexCandidates>* trace = nullptr,
                       std::vector<int64_t>* trace_local = nullptr);

// The fast kernel: per (head, query block) task, flash-style online softmax over tiles of keys.
// Runs of consecutive block entries are one strided GEMM tile (up to 256 keys, no copies);
// columns are gathered per 256 into a per-thread buffer. Causal mask per row.
Status attention_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SparseIndex& idx, TensorView out, TensorView lse,
                        const AttentionParams& p);

// Exact reference for tests: per row, the selected causal keys, softmax in double.
Status attention_sparse_ref(const TensorView& q, const TensorView& k, const TensorView& v,
                            const SparseIndex& idx, TensorView out, TensorView lse,
                            const AttentionParams& p);


}  // namespace sf::kernels::cpu
