// One seed convention for the randomized CPU tests: fresh inputs on every run, the seed printed,
// SF_TEST_SEED=<seed> replays it (run the test alone with --gtest_filter: every call then returns
// that seed).
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>

namespace sf::testing {

inline uint64_t fresh_seed() {
  uint64_t s = 0;
  if (const char* e = std::getenv("SF_TEST_SEED")) {
    s = uint64_t(std::strtoull(e, nullptr, 10));
  } else {
    std::random_device rd;
    s = (uint64_t(rd()) << 32) ^ uint64_t(rd());
  }
  std::printf("seed %llu\n", static_cast<unsigned long long>(s));
  return s;
}

// One seed for the whole process (the GPU tests: every case of a run from one seed, which they
// print), SF_TEST_SEED=<seed> replaying all of them.
inline uint64_t process_seed() {
  static const uint64_t seed = [] {
    if (const char* e = std::getenv("SF_TEST_SEED")) return uint64_t(std::strtoull(e, nullptr, 10));
    std::random_device rd;
    return (uint64_t(rd()) << 32) | rd();
  }();
  return seed;
}

}  // namespace sf::testing
