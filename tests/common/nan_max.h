// The running maximum of an error that a NaN cannot hide: std::max(m, NaN) returns m (every
// comparison with NaN is false), so a NaN element passed "max error < bound". Once a NaN is seen
// the result stays NaN, and any bound check on it fails.
#pragma once
#include <cmath>

namespace sf::testing {

inline double nan_max(double m, double x) {
  if (std::isnan(m)) return m;
  return std::isnan(x) || x > m ? x : m;
}

}  // namespace sf::testing
