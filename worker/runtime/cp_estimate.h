// Sparsity-aware CP, estimation half: the index estimators' scores computed where the keys live,
// so every rank builds (its slices of) the index a single rank would build over the whole prompt,
// before any key crosses the wire.
//
// Vertical-slash family (kernels/cpu/sparse_estimators.cpp, reproduced here on a CP grid):
//   1. the scoring rows' queries (the prompt's last 64 rows plus spread_rows earlier rows) go
//      from their owner to every rank holding a key they can see (L x heads x d floats at most;
//      pairwise sendrecv: a row before a rank's first key would only be masked there);
//   2. each rank scores them against its own keys; the row max and sum-exp are all-reduced;
//   3. each rank adds the probabilities of its keys into column sums and diagonal sums (offset =
//      query position - key position); a column is complete on its key's owner and is gathered
//      from there (S / CP floats per head), the diagonals are all-reduced (S per head). A head
//      ranked by a top-k budget over the whole prompt (vertical-slash without segments) moves
//      only candidates for the items beyond the forced ones that its budget can take (n_vertical
//      less the sink columns, n_slash less the local diagonals): each owner's top columns, and
//      for the diagonals (partial on every rank) threshold rounds (TPUT: top k partials, then
//      every partial above the k-th known sum / CP, then every rank's partials of the items
//      that can still reach the top k), or where those would move more, a reduce-scatter and
//      each rank's top k of its slice; either way the global top k is among the candidates;
//   4. every rank ranks columns and diagonals by the same rules (forced sink columns and local
//      diagonals first, then score descending, index ascending) and builds its own query blocks'
//      slots with kernels::sparse_slot_build.
//   With segment_rows, steps 1-4 run per selection segment (kernels::vs_segments). A KV group's
//   sharing set (HeadPattern::share_group, kernels::share_leaders) is summed into its leader's
//   arrays on each rank after step 3 and only those travel: one candidate list per set (for
//   the largest budget of its heads), or one array where a head takes a mass threshold.
// Block family: pooled keys (one 64-key block per owner, bf16 as the single-rank estimator rounds
// them) are all-gathered as bf16, each rank pools its own query blocks and ranks key blocks by
// the single-rank rules (a sharing set by its heads' summed probabilities); the prompt's last
// query block is scored exactly, its softmax mass summed per key block on the block's owner and
// gathered (S / 64 per head: chunk boundaries are 64-aligned).
// dense, a-shape and moa need no scores.
//
// The result equals kernels::sparse_estimate over the whole prompt up to fp32 summation order in
// the reductions (a near-tie at a top-k boundary can swap); tests measure the agreement.
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "kernels/sparse.h"
#include "kernels/sparse_index.h"
#include "worker/runtime/grid.h"

namespace sf::runtime {

struct CpEstimateArgs {
  int64_t n_tokens = 0;                            // S, the whole prompt
  std::array<TokenRange, 2> ranges;                // this rank's chunks (rows of q_loc / k_loc)
  std::vector<TokenRange> pieces;                  // attention pieces to build indices for
  const float* q_loc = nullptr;                    // [n_loc, n_heads, d] after RoPE
  const float* k_loc = nullptr;                    // [n_loc, n_kv_heads, d] after RoPE
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;   // this TP slice's
  const kernels::HeadPattern* patterns = nullptr;  // n_heads, this slice's
};

// What the estimator's collectives brought this rank, by what they carried.
struct CpEstimateBytes {
  int64_t queries = 0;    // scoring rows' q, their row max and sum-exp
  int64_t columns = 0;    // vertical-slash column sums or candidates
  int64_t diagonals = 0;  // diagonal sums (all-reduce counted as 2x the array) or candidates
  int64_t blocks = 0;     // pooled keys and the last query block's mass per key block
  int64_t total() const { return queries + columns + diagonals + blocks; }
  CpEstimateBytes& operator+=(const CpEstimateBytes& o) {
    queries += o.queries;
    columns += o.columns;
    diagonals += o.diagonals;
    blocks += o.blocks;
    return *this;
  }
};

struct CpEstimateStats {
  int64_t bytes = 0;  // parts.total()
  CpEstimateBytes parts;
  double seconds = 0;
};

// Collective over cp. out[i] is the index of pieces[i] (empty for an empty piece).
Status cp_estimate(comm::Communicator& cp, const CpEstimateArgs& a,
                   std::vector<kernels::SparseIndex>* out, CpEstimateStats* stats);

}  // namespace sf::runtime
