// A fixed pool for data-parallel loops in CPU kernels. One process-wide pool, sized by
// SF_NUM_THREADS or the CPUs the process may use; BLAS keeps its own threads.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/status.h"

namespace sf {

// SF_NUM_THREADS, or usable_cpus().
int num_threads();
// The CPUs this process may run on (its affinity mask: a core binding, taskset, a cpuset), or the
// hardware's count where the mask cannot be read.
int usable_cpus();
// Splits [0, n) into contiguous ranges and runs fn(begin, end) on the pool; returns when all
// ranges are done. grain is the smallest range worth a task. Reentrant calls run inline. A range
// that throws: no further ranges start, and the first exception is rethrown here once every
// range already running has returned.
void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t grain = 1);

// Copies n floats from a to da and n from b to db on the pool, as one range of 2n floats split
// into tasks of at least `grain` (1 MiB): a large copy into fresh pages is bound by page faults
// on one thread. The KV drains of the device prefill use it (K and V of a layer).
void parallel_copy_pair(float* da, const float* a, float* db, const float* b, size_t n,
                        size_t grain = size_t(1) << 18);
// The same for n bf16 (or any 2-byte) elements each.
void parallel_copy_pair(uint16_t* da, const uint16_t* a, uint16_t* db, const uint16_t* b, size_t n,
                        size_t grain = size_t(1) << 19);

// Sizes every vector to n floats, one vector a task on the pool: a large vector's first touch is
// bound by page faults, so one thread would take seconds for a long prompt's KV. A vector that
// must grow is allocated afresh and, on Linux, marked for transparent huge pages before it is
// touched (4 MiB or more; one 2 MiB fault instead of 512 small ones; SF_HOST_HUGEPAGES=0 turns
// this off). False when an allocation failed; the vectors' sizes are then unspecified.
bool size_vectors(std::span<std::vector<float>* const> vs, size_t n);
// One vector, as size_vectors does each, on the calling thread (not the pool): for callers that
// fault memory in beside a pool another thread is using.
bool size_vector(std::vector<float>& v, size_t n);
bool size_vector(std::vector<uint16_t>& v, size_t n);

// Runs fn(i) for i in [0, n) on `width` threads (the caller's and up to width - 1 more), each
// taking the next index when it is done: for items that wait (writes, fsync) or hold memory each
// (a layer's shard), where parallel_for's pool (sized for compute; nested calls run inline) is
// not the tool. The result is the first failure in index order, so which error is reported does
// not depend on timing; items after a failed one are not started (those already running finish).
// An item that throws fails with kResourceExhausted (std::bad_alloc) or kInternal. Items must not
// touch each other's state.
Status run_items(size_t n, int width, const std::function<Status(size_t)>& fn);

}  // namespace sf
