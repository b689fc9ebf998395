// The unified sparse index (DESIGN.md "Contracts"): for each (query head, 64-query block), a list
// of 64-key block offsets plus a list of single key columns not covered by those blocks. Every
// pattern (dense, A-shape, vertical-slash, block-sparse, elastic window, adaptive) compiles to
// this; one attention kernel per backend consumes it. This is MInference's
// block_count / block_offset / column_count / column_index.
//
// Invariants (checked by sparse_index_validate, guaranteed by the builder):
//   - block offsets are sorted ascending, each block covers keys [off, off + 64) clipped to the
//     causal limit of the query block's last row, blocks never overlap;
//   - columns are sorted ascending, unique, not inside any listed block, and causal for the
//     query block's last row (the kernel still masks per row inside a query block);
//   - the sink (first `sink` keys) and the local window (the query block's own diagonal) are
//     always present; GQA-native: patterns are per query head, K/V are indexed by KV head.
//
// Geometry of slot (h, qb): rows r0 = 64*qb .. r0 + rows - 1 (rows = min(64, n_q - r0)); the
// first row's global key position is base = q_offset + r0; the causal limit of the block is
// kend = min(n_k, base + rows) (keys [0, kend) are visible to its last row; row i sees keys
// < min(n_k, base + i + 1), which the kernel masks).
//
// How candidates become entries (sparse_index_build):
//   1. Every candidate becomes a key range clipped to [0, kend):
//        sink            [0, sink)
//        local window    [base - local, kend)   (`local` keys before the block plus its diagonal)
//        diagonal o      [base - o, base - o + rows)   (MInference: the keys that the rows of this
//                        block reach along slash offset o; o <= local is already in the window)
//        key block b     [64 b, 64 b + 64)
//   2. Overlapping or adjacent ranges merge into maximal disjoint intervals [a, e).
//   3. Each interval is cut into 64-key block entries at a, a + 64, ...  An interval that ends
//      at kend keeps a final short entry (its [off, off + 64) is clipped by the causal limit, so
//      it covers exactly the rest). An interval that ends before kend keeps only its full 64-key
//      entries; its tail of (e - a) % 64 < 64 keys moves into the column list. So (without the
//      option below) no block entry ever covers a key that was not selected, and no key is listed
//      twice.
//   4. Candidate columns inside an interval are dropped; the rest (below kend) join the tails.
//   Optional (tail_block_min T in 1..63, 0 = off; HeadPattern::tail_block_min): a tail of at
//   least T keys becomes one more 64-key entry instead, reaching up to 64 - T keys past its
//   interval, when that entry ends at or before the next interval's start (or kend); candidate
//   columns it covers are dropped. That entry then covers keys the estimator did not select (the
//   index selects them: they are attended and counted in pairs and density), so this one rule
//   trades a few more computed keys for fewer gathered columns: a column tile's rows are copied
//   one by one from wherever they lie, a block arrives by one TMA copy. Its costs are in
//   bench/NOTES.md (twenty-second session).
// Validation also requires q_offset >= 0 and n_k <= INT32_MAX (offsets and columns are int32).
// Block offsets are therefore not 64-aligned in general; the kernel treats consecutive entries
// with off[i + 1] == off[i] + 64 as one contiguous key range (one strided GEMM tile).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "kernels/sparse_tail.h"

namespace sf::kernels {

struct SparseIndex {
  int n_heads = 0;        // query heads
  int64_t n_q = 0;        // queries covered (rows of q)
  int64_t n_k = 0;        // keys available
  int64_t q_offset = 0;   // global position of q row 0 minus that of k row 0
  int64_t n_qblocks = 0;  // ceil(n_q / 64)
  int max_blocks = 0;     // capacity per (head, qblock)
  int max_cols = 0;
  std::vector<int32_t> block_count;   // [n_heads * n_qblocks]
  std::vector<int32_t> block_offset;  // [n_heads * n_qblocks * max_blocks]
  std::vector<int32_t> column_count;  // [n_heads * n_qblocks]
  std::vector<int32_t> column_index;  // [n_heads * n_qblocks * max_cols]

  size_t slot(int h, int64_t qb) const { return size_t(h) * size_t(n_qblocks) + size_t(qb); }
  // Keys the index makes each row of (h, qb) attend to, after causal clipping, summed over rows
  // of the block: the work the kernel does, in query-key pairs.
  int64_t pairs(int h, int64_t qb) const;
  // Fraction of causal query-key pairs computed, over all heads and blocks.
  double density() const;
};

// Allocates an empty index for the given geometry.
SparseIndex sparse_index_make(int n_heads, int64_t n_q, int64_t n_k, int64_t q_offset,
                              int max_blocks, int max_cols);

// Slot-level copies and comparisons between indices of different capacities (slot numbers
// from SparseIndex::slot): a slot's counts and listed entries, not the unused capacity. The copy
// needs `to`'s capacities to hold the slot's entries.
void sparse_index_copy_slot(const SparseIndex& from, size_t s, SparseIndex* to, size_t d);
bool sparse_index_slot_equal(const SparseIndex& a, size_t s, const SparseIndex& b, size_t t);

// Checks every invariant above; names the head, query block and field that breaks it.
Status sparse_index_validate(const SparseIndex& idx, int64_t sink);

// Builder: per (head, qblock), from candidate key columns (vertical lines), candidate diagonal
// offsets (slash lines: key = query - offset, offset >= 0), and candidate 64-key blocks (by
// block number, as block-sparse selects them). It adds the sink [0, sink) and the local window,
// merges adjacent diagonals into contiguous key ranges, drops keys covered by blocks from the
// column list, enforces causality and never emits a key twice.
struct IndexCandidates {
  std::vector<int32_t> columns;     // absolute key positions, any order, may repeat
  std::vector<int32_t> diagonals;   // slash offsets (query_pos - key_pos), >= 0
  std::vector<int32_t> key_blocks;  // 64-aligned key block numbers (key_pos / 64)
};
void sparse_index_build(SparseIndex* idx, int h, int64_t qb, const IndexCandidates& c, int64_t sink,
                        int64_t local, int64_t tail_block_min = 0);

// The (key, KV head) rows the slots of query blocks [qb_begin, qb_end) read, every head: sets
// need[key * n_kv + kv_head0 + h / q_per_kv] = 1 for each key of each listed block (clipped to
// the slot's causal end) and each column. need holds idx.n_k * n_kv bytes. What sparsity-aware
// context parallelism must move to a rank holding those query blocks (worker/runtime).
void sparse_index_key_rows(const SparseIndex& idx, int64_t qb_begin, int64_t qb_end, int q_per_kv,
                           int kv_head0, int n_kv, uint8_t* need);

// A dense index (every causal key of every row): the sparse kernel on it equals dense attention.
SparseIndex sparse_index_dense(int n_heads, int64_t n_q, int64_t n_k, int64_t q_offset);

// ---- lower level, for estimators that build many slots in parallel before sizing the index ----

struct SparseSlotGeometry {
  int64_t base = 0;  // global key position of the block's first query row
  int64_t rows = 0;  // query rows in the block (64, or fewer in the last block)
  int64_t kend = 0;  // causal limit of the block's last row: keys [0, kend)
};
SparseSlotGeometry sparse_slot_geometry(int64_t n_q, int64_t n_k, int64_t q_offset, int64_t qb);

// One slot by the rules above. Inputs must be sorted ascending and unique (columns, diagonals,
// key_blocks); out-of-range values are ignored. Appends the slot's block offsets and columns to
// *blocks and *columns (both end up sorted); returns nothing else, allocates only on growth.
void sparse_slot_build(const SparseSlotGeometry& g, std::span<const int32_t> columns,
                       std::span<const int32_t> diagonals, std::span<const int32_t> key_blocks,
                       int64_t sink, int64_t local, int64_t tail_block_min,
                       std::vector<int32_t>* blocks, std::vector<int32_t>* columns_out);

// Capacity: sparse_index_build grows max_blocks / max_cols (re-laying out the arrays) when a slot
// needs more than the index holds, so it never drops a key; that makes it unsafe to call
// concurrently on one index. Parallel builders use sparse_slot_build and size the index after.

}  // namespace sf::kernels
