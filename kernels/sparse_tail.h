// Index building rules the host and device builders share (nvcc compiles this; sparse_index.h,
// which needs C++20, it does not).
#pragma once
#include <cstdint>

#include "common/hash.h"  // SF_HOST_DEVICE

namespace sf::kernels {

constexpr int kSparseBlock = 64;

// The tail rule (sparse_index.h, step 4's option): does an interval's tail of `tail` keys
// starting at `at` (its full entries' end) become an entry [at, at + 64), with the next interval
// starting at next_a (kend for the last)?
SF_HOST_DEVICE inline bool sparse_tail_to_block(int64_t tail, int64_t tail_block_min, int64_t at,
                                                int64_t next_a) {
  return tail_block_min > 0 && tail > 0 && tail >= tail_block_min && at + kSparseBlock <= next_a;
}

}  // namespace sf::kernels
