// Selection rules every index estimator shares (the CPU estimators in kernels/cpu and the
// context-parallel estimator in worker/runtime), so a distributed index equals a single-rank one
// by construction rather than by keeping two copies in step.
#pragma once
#include <cstdint>
#include <vector>

namespace sf::kernels {

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

// 0, 1, ..., n-1 (empty for n <= 0).
std::vector<int32_t> iota_list(int64_t n);

// Local rows of q that score vertical-slash over a sequence of n query rows: `spread` rows evenly
// spaced over the rows before the last min(64, n), then those last rows (MInference Alg. 2).
std::vector<int64_t> scoring_rows(int64_t n, int64_t spread);

}  // namespace sf::kernels
