// The pool's loops: parallel_for covers [0, n) once (nested calls run inline), parallel_copy_pair
// copies both arrays across the split between them, and size_vectors sizes, zeroes and reuses
// vectors and reports an allocation it cannot make instead of throwing from a pool thread, and
// run_items reports the first failure in index order (throws included) and starts nothing after.
#include <gtest/gtest.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/thread_pool.h"

namespace sf {
namespace {

// More threads than this machine's cores (unless the environment names a count): the pool's
// workers are then preempted inside regions, which the region tests below rely on. Set before
// main, so before the pool's size is first read.
const bool kManyThreads = [] { return setenv("SF_NUM_THREADS", "8", /*overwrite=*/0) == 0; }();

// The pool's default size follows the affinity mask (a core binding, taskset), not the machine.
TEST(ThreadPool, UsableCpusFollowTheAffinityMask) {
  cpu_set_t all;
  CPU_ZERO(&all);
  ASSERT_EQ(sched_getaffinity(0, sizeof all, &all), 0);
  EXPECT_EQ(sf::usable_cpus(), CPU_COUNT(&all));
  int first = -1;
  for (int c = 0; c < CPU_SETSIZE && first < 0; ++c)
    if (CPU_ISSET(c, &all)) first = c;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof one, &one), 0);
  const int bound = sf::usable_cpus();
  ASSERT_EQ(sched_setaffinity(0, sizeof all, &all), 0);  // restore before any assertion fails
  EXPECT_EQ(bound, 1);
}

TEST(ThreadPool, ParallelForCoversEveryIndexOnce) {
  for (size_t n : {size_t(1), size_t(7), size_t(1000), size_t(100003)}) {
    std::vector<std::atomic<int>> hits(n);
    parallel_for(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) hits[i]++;
      // A nested call runs inline on the calling task.
      parallel_for(2, [](size_t, size_t) {});
    });
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n " << n << " index " << i;
  }
}

// Regions of different sizes back to back: a worker that wakes late for one region must not
// claim an index of the next (each index of each region runs exactly once), and every region
// returns (a hang fails by the test's timeout).
TEST(ThreadPool, BackToBackRegionsRunEachIndexOnce) {
  ASSERT_TRUE(kManyThreads);
  constexpr int kRounds = 20000;
  std::vector<std::atomic<int>> small(2), large(64);
  for (int r = 0; r < kRounds; ++r) {
    parallel_for(2, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) small[i]++;
    });
    parallel_for(64, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) large[i]++;
    });
  }
  for (size_t i = 0; i < small.size(); ++i) EXPECT_EQ(small[i].load(), kRounds) << i;
  for (size_t i = 0; i < large.size(); ++i) EXPECT_EQ(large[i].load(), kRounds) << i;
}

// A task that throws, on a worker or on the caller: the region stops starting ranges, the first
// exception reaches parallel_for's caller once no worker is inside the region, and the pool
// (and the caller's own later regions) work as before.
TEST(ThreadPool, ATaskThatThrowsReachesTheCaller) {
  ASSERT_TRUE(kManyThreads);
  for (int r = 0; r < 200; ++r) {
    std::atomic<int> ran{0};
    EXPECT_THROW(parallel_for(1000,
                              [&](size_t b, size_t) {
                                ran++;
                                if (b % 3 == 1) throw std::runtime_error("task " + std::to_string(b));
                              }),
                 std::runtime_error);
    EXPECT_GE(ran.load(), 1);
    std::vector<std::atomic<int>> hits(100);
    parallel_for(100, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) hits[i]++;
    });
    for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i].load(), 1) << r << " " << i;
  }
  // A std::bad_alloc keeps its type.
  EXPECT_THROW(parallel_for(64, [](size_t, size_t) { throw std::bad_alloc(); }), std::bad_alloc);
}

TEST(ThreadPool, ParallelCopyPairCopiesBothArrays) {
  // Odd sizes and a small grain, so tasks straddle the boundary between the two arrays.
  for (size_t n : {size_t(1), size_t(333), size_t(70001)}) {
    std::vector<float> a(n), b(n), da(n, -1.f), db(n, -1.f);
    std::iota(a.begin(), a.end(), 1.f);
    std::iota(b.begin(), b.end(), -float(n));
    parallel_copy_pair(da.data(), a.data(), db.data(), b.data(), n, 64);
    EXPECT_EQ(da, a) << n;
    EXPECT_EQ(db, b) << n;
  }
}

TEST(ThreadPool, SizeVectorsSizesZeroesAndReuses) {
  // 6 MiB a vector: past the huge-page hint's threshold (4 MiB), so that path runs too.
  const size_t n = size_t(3) << 19;
  std::vector<std::vector<float>> store(5);
  store[1].assign(10, 7.f);         // grows: allocated afresh
  store[2].assign(2 * n, 7.f);      // large enough already: keeps its memory
  const float* kept = store[2].data();
  std::vector<std::vector<float>*> vs;
  for (auto& v : store) vs.push_back(&v);
  ASSERT_TRUE(size_vectors(vs, n));
  for (size_t i = 0; i < store.size(); ++i) {
    ASSERT_EQ(store[i].size(), n) << i;
    if (i != 2)
      for (size_t j = 0; j < n; j += 4099) ASSERT_EQ(store[i][j], 0.f) << i << " " << j;
  }
  EXPECT_EQ(store[2].data(), kept);
  EXPECT_EQ(store[2][0], 7.f);  // a shrink keeps the values (resize semantics)
  // More than a vector can hold: reported, not thrown from a pool thread.
  std::vector<float> big;
  std::vector<std::vector<float>*> one = {&big};
  EXPECT_FALSE(size_vectors(one, big.max_size() + 1));
  // One vector on the calling thread: the same sizing.
  std::vector<float> lone(3, 5.f);
  ASSERT_TRUE(size_vector(lone, n));
  ASSERT_EQ(lone.size(), n);
  for (size_t j = 0; j < n; j += 4099) ASSERT_EQ(lone[j], 0.f) << j;  // grown: afresh, zeroed
  EXPECT_FALSE(size_vector(big, big.max_size() + 1));
}

TEST(ThreadPool, RunItemsReportsTheFirstFailureInOrderAndStartsNothingAfterIt) {
  for (const int width : {1, 3, 16}) {
    std::vector<std::atomic<int>> ran(50);
    const Status st = run_items(50, width, [&](size_t i) -> Status {
      ran[i]++;
      if (i == 7) throw std::bad_alloc();
      if (i == 31) throw std::runtime_error("boom");
      if (i % 10 == 3) return SF_ERR(kInvalidArgument, "item " + std::to_string(i) + " is bad");
      return Status::ok();
    });
    // Every item up to the first failure ran once; later ones at most once (those started
    // before item 3 failed), and at width 1 none.
    for (size_t i = 0; i <= 3; ++i) ASSERT_EQ(ran[i].load(), 1) << width << " " << i;
    for (size_t i = 4; i < ran.size(); ++i) {
      ASSERT_LE(ran[i].load(), 1) << width << " " << i;
      if (width == 1) ASSERT_EQ(ran[i].load(), 0) << i;
    }
    // Item 3 fails first in index order, whatever finished first.
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("item 3 is bad"), std::string::npos) << st.to_string();
  }
  const Status oom = run_items(10, 4, [](size_t i) -> Status {
    if (i == 7) throw std::bad_alloc();
    return Status::ok();
  });
  EXPECT_EQ(oom.code(), Code::kResourceExhausted) << oom.to_string();
  const Status threw = run_items(10, 4, [](size_t i) -> Status {
    if (i == 5) throw std::runtime_error("boom");
    return Status::ok();
  });
  EXPECT_EQ(threw.code(), Code::kInternal);
  EXPECT_NE(threw.message().find("boom"), std::string::npos) << threw.to_string();
  EXPECT_TRUE(run_items(0, 4, [](size_t) { return SF_ERR(kInternal, "never"); }).is_ok());
  // Without failures every item runs once, at any width.
  for (const int width : {1, 5, 64}) {
    std::vector<std::atomic<int>> ran(37);
    ASSERT_TRUE(run_items(37, width, [&](size_t i) {
                  ran[i]++;
                  return Status::ok();
                }).is_ok());
    for (size_t i = 0; i < ran.size(); ++i) ASSERT_EQ(ran[i].load(), 1) << width << " " << i;
  }
}

}  // namespace
}  // namespace sf
