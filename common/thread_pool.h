// A fixed pool for data-parallel loops in CPU kernels. One process-wide pool, sized by
// SF_NUM_THREADS or the hardware; BLAS keeps its own threads.
#pragma once
#include <cstddef>
#include <functional>

namespace sf {

int num_threads();
// Splits [0, n) into contiguous ranges and runs fn(begin, end) on the pool; returns when all
// ranges are done. grain is the smallest range worth a task. Reentrant calls run inline.
void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t grain = 1);

}  // namespace sf
