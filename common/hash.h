// SplitMix64's finalizer: a counter-based 64-bit hash, the same on the host and on the device
// (synthetic weights drawn on the GPU must equal any slice of them, whichever side computes).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define SF_HOST_DEVICE __host__ __device__
#else
#define SF_HOST_DEVICE
#endif

namespace sf {

SF_HOST_DEVICE inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace sf
