// Selection rules every index estimator shares (the CPU estimators in kernels/cpu and the
// context-parallel estimator in worker/runtime), so a distributed index equals a single-rank one
// by construction rather than by keeping two copies in step.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/dtype.h"

namespace sf::kernels {

struct HeadPattern;

// The block estimators' pooled value of one channel: its f32 sum over the block's n rows (added
// in row order) times the f32 reciprocal of n, rounded to bf16. MInference pools in the model's
// bf16, and the device estimator (kernels/cuda/sparse_estimate.cu pooled_sum, the same float
// steps) multiplies bf16 values exactly, so every backend ranks the same numbers.
inline float pooled_mean(float sum, int64_t n) { return round_to_bf16(sum * (1.f / float(n))); }

struct SelectBudget {
  bool mass = false;  // false: top-k; true: smallest prefix reaching gamma of the total mass
  int64_t k = 0;      // top-k count, forced items included
  double gamma = 1.0;
  int64_t min_count = 0, max_count = 0;  // mass mode clamp, forced items included
};

// Selection over items [0, n) by score: the forced items (those outside [0, n) dropped) first,
// then the rest by score descending, index ascending. Returns the sorted item ids.
std::vector<int32_t> select_ranked(const float* score, int64_t n, std::vector<int32_t> forced,
                                   const SelectBudget& b);

// The last query block of an adaptive-block head with last_block_rows: the union over its rows of
// each row's mass selection (select_ranked with b's gamma, no count clamp, forced items included)
// by row_mass ([rows][n], each row's softmax mass per item), then clamped to [b.min_count,
// b.max_count] by mean_mass (over the max: the union's members with the most mean mass; under the
// min: the union, then the rest by mean mass). Unless the max binds, every row keeps >= gamma of
// its own mass.
std::vector<int32_t> select_union_rows(const std::vector<std::vector<float>>& row_mass,
                                       const float* mean_mass, int64_t n,
                                       const std::vector<int32_t>& forced, const SelectBudget& b);

// A block head's forced key blocks for a query segment whose own keys are [base, kend) (kend >
// 0): block 0 (the sinks) and every block from the segment's first to its last key. Block size
// block (kSparseBlock).
inline std::vector<int32_t> block_forced(int64_t base, int64_t kend, int64_t block) {
  std::vector<int32_t> forced{0};
  for (int64_t b = std::min(base, kend - 1) / block; b <= (kend - 1) / block; ++b)
    if (b > 0) forced.push_back(int32_t(b));
  return forced;
}

// 0, 1, ..., n-1 (empty for n <= 0).
std::vector<int32_t> iota_list(int64_t n);

// Local rows of q that score vertical-slash over a sequence of n query rows: `spread` rows evenly
// spaced over the rows before the last min(64, n), then those last rows (MInference Alg. 2).
std::vector<int64_t> scoring_rows(int64_t n, int64_t spread);

// Vertical-slash selection segments over n query rows. segment_rows 0: one segment (MInference,
// with spread rows when set). Otherwise the boundaries are the multiples of segment_rows below
// the last query block, and the last query block itself: that block is its own segment, ranked
// by its own rows only, so the rows whose logits a decode node continues from are not outvoted
// by spread rows (a pass key read only by the last rows was the measured case). Segment s holds
// rows [begin[s], end_row(s)) and ranks from the scoring rows inside it, rows[s], except that
// the last min(64, n) rows all rank the last segment (when n is not a multiple of 64 a few of
// them lie before its start); one with none takes the selection of the nearest later segment
// that has some, source[s] (the last segment always has rows).
struct VsSegments {
  int64_t n = 0;
  std::vector<int64_t> begin;  // ascending, begin[0] = 0
  std::vector<std::vector<int64_t>> rows;
  std::vector<int64_t> source;
  int64_t count() const { return int64_t(begin.size()); }
  int64_t end_row(int64_t s) const { return s + 1 < count() ? begin[size_t(s + 1)] : n; }
  int64_t of_row(int64_t r) const {
    return int64_t(std::upper_bound(begin.begin(), begin.end(), r) - begin.begin()) - 1;
  }
};
VsSegments vs_segments(int64_t n, int64_t spread, int64_t segment_rows);

// One vertical-slash (or adaptive-vs) selection: columns ranked over keys [0, n_cols) by col,
// diagonals over offsets [0, n_diags) by diag, with hp's budgets (top-k or mass threshold) and
// the sink columns / local diagonals forced first.
void vs_select(const HeadPattern& hp, const float* col, int64_t n_cols, const float* diag,
               int64_t n_diags, std::vector<int32_t>* cols, std::vector<int32_t>* diags);

// adaptive-vs with HeadPattern::vs_cover: columns and diagonals chosen as one cover. probs holds
// the scoring rows' softmax, [n_rows][n_cols] (row r over keys [0, n_cols), zero past its causal
// limit), pos[r] the row's absolute position (key j of row r lies on diagonal pos[r] - j, in
// [0, n_diags)); col / diag are the rows' plain column and diagonal sums. FlexPrefill's rule sizes
// each set for gamma alone, and the columns' mass, entering the diagonal sums too, scatters the
// diagonals (bench/planted_cover_model.py); the cover counts each (row, key) once. The rule, in
// rounds a GPU runs as a few passes (kernels/cuda/sparse_estimate.cu runs the same one):
//   - forced first, as vs_select: columns [0, sink) and diagonals [0, local];
//   - goal = gamma * (the sum of col). Round k = 1 .. kVsCoverRounds: every item's residual, its
//     mass on entries no taken item covers (in double: summed once, then each newly covered
//     entry taken off the other item's; ranked as floats); need = goal - (the sum of col - the
//     columns' residual total), the mass still missing; stop when need <= 0. target = need / 2
//     while need > kVsCoverFinish of the total, else need. The items not
//     taken, with residual > 0, ranked by residual descending, then columns before diagonals,
//     then the lower index, are taken in order until their residuals sum to >= target; a family
//     holding max_budget items takes no more;
//   - after a round's picks, every diagonal not yet taken whose whole range the taken diagonals'
//     ranges already read (vs_cover_widths: width 0) is taken in the same round (free: its
//     entries are computed in every row of every full query block), ascending, while the family is
//     under max_budget; the next round's residuals and need count its mass;
//   - a family then under min_budget is topped up by its plain sums as vs_select ranks them.
// Halving the target keeps the overlap between one round's picks small, so the cover comes out
// near the one-item-a-step greedy (planted_cover_model.py: 0.034 against 0.029 at 1M, where
// taking all that is missing each round gives 0.047).
// Free diagonals: the index builder reads, in the query block from row s, keys s - d .. s - d +
// 63 for a taken diagonal d (offsets d - 63 .. d from s), runs of taken diagonals at most 64 apart
// as one range; a diagonal whose offsets d - 63 .. d all lie in those ranges lies inside one run,
// so taking it leaves every full query block's slot as it was (the last block, of fewer rows,
// reads shorter ranges and may gain a few keys; `SparseSelect.FreeDiagonalsLeaveTheIndexAsItWas`),
// while ranking by mass alone left such diagonals' mass uncounted and took other items for it
// (planted_cover_model.py --free: 128K Llama-3-like density 0.0313 against 0.0467).
// cols and diags come back ascending; trace (tests) gets each item's round.
constexpr int kVsCoverRounds = 16;
constexpr double kVsCoverFinish = 1.0 / 32;
constexpr int64_t kVsCoverSpan = 64;  // a diagonal's key range in one query block
struct VsCoverTrace {
  std::vector<int32_t> col_round, diag_round;  // -1 not taken, 0 forced, k: taken in round k
  std::vector<uint8_t> diag_free;              // 1: taken free (width 0) in its round
  int rounds = 0;                              // rounds that took items
};
// width[d], d < n_diags: how many offsets o in [max(0, d - 63), d] no taken diagonal e (round
// >= 0) reaches, where e reaches the offsets [e - 63, e] (offsets below 0 count as reached).
void vs_cover_widths(const int32_t* diag_round, int64_t n_diags, int32_t* width);
void vs_cover_select(const HeadPattern& hp, const float* probs, const int64_t* pos, int64_t n_rows,
                     int64_t n_cols, const float* col, int64_t n_diags, const float* diag,
                     std::vector<int32_t>* cols, std::vector<int32_t>* diags,
                     VsCoverTrace* trace = nullptr);

// KV-group-shared ranking (HeadPattern::share_group). Heads rank together when each has
// share_group set, they read one KV head (h / q_per_kv), and they are of one family with equal
// scoring settings: vertical-slash and adaptive-vs with the same spread_rows and segment_rows, or
// block-sparse and adaptive-block (without last_block_rows). Such a set ranks its candidates by
// the sum of its heads' probability scores and each head takes its own budget from that one
// order, so the set's picks nest: the group reads the keys of its largest budget, not the union
// of one pick per head. Block heads rank the prompt's last query block per head (the rows a
// decode node continues from). leader[h] is the lowest head of h's set, h itself when it ranks
// alone (a set of one head ranks alone).
std::vector<int> share_leaders(const std::vector<HeadPattern>& patterns, int q_per_kv);

// Each set's scores: the element-wise sum, in head order, of its heads' arrays (equal lengths
// within a set), at out[leader]; empty for heads that rank alone and for non-leaders.
void share_sums(const std::vector<int>& leader, const std::vector<std::vector<float>>& arrays,
                std::vector<std::vector<float>>* out);

// The scores head h ranks by: its set's sum when it has one, else its own array.
inline const float* share_scores(const std::vector<int>& leader,
                                 const std::vector<std::vector<float>>& sums,
                                 const std::vector<std::vector<float>>& own, int h) {
  const auto& s = sums[size_t(leader[size_t(h)])];
  return s.empty() ? own[size_t(h)].data() : s.data();
}

}  // namespace sf::kernels
