// Reference pooling of the block estimators for the tests: the stated rule, written out per
// channel. A pooled value is the f32 sum of the block's rows in row order, times the f32
// reciprocal of the row count, rounded to bf16 (kernels/cpu/sparse_estimators.cpp pool_keys).
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace sf::test {

// row(r) gives the channel's value at row r, for r in [r0, r1).
template <typename Row>
double pooled_channel(int64_t r0, int64_t r1, Row row) {
  float sum = 0.f;
  for (int64_t r = r0; r < r1; ++r) sum += row(r);
  return double(round_to_bf16(sum * (1.f / float(r1 - r0))));
}

}  // namespace sf::test
