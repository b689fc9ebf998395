// Wall time on the steady clock, in seconds: the one helper behind the times the tools, the
// worker, the tests and the benches report.
#pragma once

#include <chrono>

namespace sf {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace sf
