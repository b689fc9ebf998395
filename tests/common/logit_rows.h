// One logit row of a device run against the CPU's, for the GPU forward and decode tests: BF16
// weights move every logit by up to logit_rel of its row's RMS, so two logits closer than twice
// that may swap; where the CPU's top two are further apart, the top-1 must be identical.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace sf::testing {

struct RowCompare {
  int64_t cpu_top = 0, gpu_top = 0;
  double rms = 0;               // of the CPU row
  double max_err = 0;           // max |gpu - cpu|
  double sq_err = 0, sq_ref = 0;  // sums of (gpu - cpu)^2 and cpu^2
  double top2_gap = 0;          // the CPU's top-1 logit minus its second
  bool same_top() const { return cpu_top == gpu_top; }
  double allowed_gap(double logit_rel) const { return 2 * logit_rel * rms; }
  bool within_rounding(double logit_rel) const { return top2_gap < allowed_gap(logit_rel); }
};

// The top-1 logit of a row minus its second. Two runs whose logits differ by at most d may pick
// different top-1 tokens only where the reference's gap is under 2 d (a near-tie, not a bug).
inline double top2_gap(const float* row, int64_t n) {
  const int64_t top = std::max_element(row, row + n) - row;
  double second = -INFINITY;
  for (int64_t j = 0; j < n; ++j)
    if (j != top) second = std::max(second, double(row[j]));
  return double(row[top]) - second;
}

inline RowCompare compare_logit_row(const float* gpu, const float* cpu, int64_t n) {
  RowCompare r;
  for (int64_t j = 0; j < n; ++j) {
    const double d = double(gpu[j]) - double(cpu[j]);
    r.sq_err += d * d;
    r.sq_ref += double(cpu[j]) * cpu[j];
    r.max_err = std::max(r.max_err, std::abs(d));
  }
  r.rms = std::sqrt(r.sq_ref / double(n));
  r.cpu_top = std::max_element(cpu, cpu + n) - cpu;
  r.gpu_top = std::max_element(gpu, gpu + n) - gpu;
  r.top2_gap = top2_gap(cpu, n);
  return r;
}

}  // namespace sf::testing
