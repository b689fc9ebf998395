// NcclCommunicator under mpiexec -np 2, one GPU per rank (label gpu: skips with fewer than two
// GPUs). Collectives on device buffers against host-computed results, and the deadline: rank 0's
// all-reduce that rank 1 joins late fails within its deadline and aborts the communicator; an
// enqueued sum rank 1 never joins is aborted by the watchdog while rank 0 is blocked in a launch.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <thread>
#include <vector>

#include "comm/nccl_communicator.h"
#include "common/timing.h"
#include "tests/comm/mpi_gpu_env.h"
#include "tests/comm/mpi_test_env.h"

namespace sf {
namespace {

using testing::test_world;

bool have_gpus() { return testing::every_rank_has_a_gpu(); }

struct DeviceBuf {
  float* p = nullptr;
  explicit DeviceBuf(size_t n) { cudaMalloc(&p, n * sizeof(float)); }
  ~DeviceBuf() { cudaFree(p); }
};

TEST(CommNccl, CollectivesAndDeadline) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  auto& w = test_world();
  auto nc = comm::make_nccl_communicator(w, w.rank(), "nccl-test");
  ASSERT_TRUE(nc.is_ok()) << nc.status().to_string();
  comm::Communicator& c = *nc.value();
  EXPECT_EQ(c.size(), w.size());
  const int64_t n = 1 << 16;
  std::vector<float> h(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) h[size_t(i)] = float((i % 97) * (w.rank() + 1));
  DeviceBuf a(static_cast<size_t>(n)), b(static_cast<size_t>(n * w.size()));
  cudaMemcpy(a.p, h.data(), size_t(n) * sizeof(float), cudaMemcpyHostToDevice);
  ASSERT_TRUE(c.all_reduce(a.p, a.p, n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  std::vector<float> got(static_cast<size_t>(n));
  cudaMemcpy(got.data(), a.p, size_t(n) * sizeof(float), cudaMemcpyDeviceToHost);
  const int tri = w.size() * (w.size() + 1) / 2;
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[size_t(i)], float((i % 97) * tri)) << i;
  // all_gatherv with uneven counts.
  std::vector<int64_t> counts(size_t(w.size()));
  for (int r = 0; r < w.size(); ++r) counts[size_t(r)] = 100 + 50 * r;
  cudaMemcpy(a.p, h.data(), size_t(counts[size_t(w.rank())]) * sizeof(float),
             cudaMemcpyHostToDevice);
  ASSERT_TRUE(c.all_gatherv(a.p, counts[size_t(w.rank())], b.p, counts, DType::kF32).is_ok());
  std::vector<float> all(size_t(100 * w.size() + 25 * w.size() * (w.size() - 1)));
  cudaMemcpy(all.data(), b.p, all.size() * sizeof(float), cudaMemcpyDeviceToHost);
  size_t off = 0;
  for (int r = 0; r < w.size(); ++r)
    for (int64_t i = 0; i < counts[size_t(r)]; ++i)
      ASSERT_EQ(all[off++], float((i % 97) * (r + 1))) << "rank " << r << " item " << i;
  // all_gatherv with equal counts (as the CP exchange's zigzag chunks usually are): every rank's
  // block in rank order.
  const int64_t even = 300;
  std::fill(counts.begin(), counts.end(), even);
  cudaMemcpy(a.p, h.data(), size_t(even) * sizeof(float), cudaMemcpyHostToDevice);
  std::vector<float> fill(size_t(even * w.size()), -1.f);
  cudaMemcpy(b.p, fill.data(), fill.size() * sizeof(float), cudaMemcpyHostToDevice);
  ASSERT_TRUE(c.all_gatherv(a.p, even, b.p, counts, DType::kF32).is_ok());
  cudaMemcpy(fill.data(), b.p, fill.size() * sizeof(float), cudaMemcpyDeviceToHost);
  for (int r = 0; r < w.size(); ++r)
    for (int64_t i = 0; i < even; ++i)
      ASSERT_EQ(fill[size_t(r * even + i)], float((i % 97) * (r + 1))) << "rank " << r << " item " << i;
  // A negative count anywhere (another rank's, a receive's) is refused before NCCL sees it as a
  // huge size_t; the communicator stays usable.
  std::vector<int64_t> bad(size_t(w.size()), even);
  bad[size_t((w.rank() + 1) % w.size())] = w.size() > 1 ? -1 : even;
  if (w.size() > 1)
    EXPECT_EQ(c.all_gatherv(a.p, even, b.p, bad, DType::kF32).code(), Code::kInvalidArgument);
  EXPECT_EQ(c.sendrecv(a.p, 4, w.rank(), b.p, -4, w.rank(), DType::kF32, 0).code(),
            Code::kInvalidArgument);
  ASSERT_TRUE(c.barrier().is_ok());

  // Deadline: rank 0 waits 1 s; the others join 2 s late and time out themselves (the aborted
  // rank 0 never completes their call).
  using clock = std::chrono::steady_clock;
  c.set_timeout(std::chrono::milliseconds(w.rank() == 0 ? 1000 : 2000));
  if (w.rank() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  const auto t0 = clock::now();
  const Status st = c.all_reduce(a.p, a.p, n, DType::kF32, comm::ReduceOp::kSum);
  const double waited = sf::seconds_since(t0);
  if (w.rank() == 0) {
    std::printf("rank 0: %s after %.3f s\n", st.to_string().c_str(), waited);
    EXPECT_EQ(st.code(), Code::kDeadlineExceeded);
    // Fires at the deadline, not before; the rest is ncclCommAbort tearing the communicator
    // down (0.51 s on 2x H200, 2026-11-22), allowed up to 1 s.
    EXPECT_GE(waited, 1.0);
    EXPECT_LT(waited, 2.0);
    EXPECT_NE(st.message().find("all_reduce"), std::string::npos);
  }
  EXPECT_TRUE(!st.is_ok() || w.rank() != 0);
  EXPECT_FALSE(c.barrier().is_ok() && w.rank() == 0) << "an aborted communicator must fail fast";
}

// The stream-ordered all-reduce (overlapped TP): several enqueued behind events recorded on the
// caller's stream, then one wait; results equal the sums. Then the deadline: rank 0's enqueued
// sum whose peers come late fails in wait_enqueued at its 1 s deadline, naming the collective.
TEST(CommNccl, EnqueuedAllReduceAndDeadline) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  auto& w = test_world();
  auto nc = comm::make_nccl_communicator(w, w.rank(), "nccl-enqueue");
  ASSERT_TRUE(nc.is_ok()) << nc.status().to_string();
  comm::Communicator& c = *nc.value();
  const int64_t n = 1 << 14, parts = 4;
  std::vector<float> h(static_cast<size_t>(n * parts));
  for (size_t i = 0; i < h.size(); ++i) h[i] = float(int(i % 89) * (w.rank() + 1));
  DeviceBuf a(h.size());
  cudaStream_t s = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  for (int64_t p = 0; p < parts; ++p) {
    // The caller's stream produces each part, then the sum of that part is enqueued after it.
    ASSERT_EQ(cudaMemcpyAsync(a.p + p * n, h.data() + p * n, size_t(n) * sizeof(float),
                              cudaMemcpyHostToDevice, s),
              cudaSuccess);
    ASSERT_EQ(cudaEventRecord(ready, s), cudaSuccess);
    ASSERT_TRUE(c.all_reduce_enqueue(a.p + p * n, n, DType::kF32, comm::ReduceOp::kSum, ready, done)
                    .is_ok());
  }
  ASSERT_EQ(cudaStreamWaitEvent(s, done, 0), cudaSuccess);
  ASSERT_TRUE(c.wait_enqueued().is_ok());
  std::vector<float> got(h.size());
  ASSERT_EQ(cudaMemcpyAsync(got.data(), a.p, got.size() * sizeof(float), cudaMemcpyDeviceToHost, s),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const int tri = w.size() * (w.size() + 1) / 2;
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], float(int(i % 89) * tri)) << i;

  using clock = std::chrono::steady_clock;
  c.set_timeout(std::chrono::milliseconds(w.rank() == 0 ? 1000 : 2000));
  if (w.rank() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  const auto t0 = clock::now();
  Status st = c.all_reduce_enqueue(a.p, n, DType::kF32, comm::ReduceOp::kSum, nullptr, nullptr);
  if (st.is_ok()) st = c.wait_enqueued();
  const double waited = sf::seconds_since(t0);
  if (w.rank() == 0) {
    std::printf("rank 0 (enqueued): %s after %.3f s\n", st.to_string().c_str(), waited);
    EXPECT_EQ(st.code(), Code::kDeadlineExceeded);
    EXPECT_GE(waited, 1.0);
    EXPECT_LT(waited, 2.0);
    EXPECT_NE(st.message().find("all_reduce"), std::string::npos);
  }
  (void)cudaEventDestroy(ready);
  (void)cudaEventDestroy(done);
  (void)cudaStreamDestroy(s);
}

// The watchdog of enqueued sums. Rank 0 goes on as overlapped TP does: work on its stream, a sum
// enqueued behind it, its stream waiting for the sum, again and again; rank 1 never joins. The
// first sum never completes, rank 0's stream stalls behind it, and once the launch queue is full
// rank 0 blocks inside cudaMemsetAsync, which no deadline of the communicator's calls reaches
// (measured: at 128 sums with 8 memsets a sum, 2x H200).
// The watchdog aborts the communicator at the sum's 1 s deadline: the NCCL kernel returns, the
// stream drains, and rank 0's next enqueue fails with the watchdog's error. Without the watchdog
// rank 0 stays blocked; the test then fails and ends the process (the thread cannot be joined).
TEST(CommNccl, StuckEnqueuedSumAbortsACallerBlockedInALaunch) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  auto& w = test_world();
  auto nc = comm::make_nccl_communicator(w, w.rank(), "nccl-stuck");
  ASSERT_TRUE(nc.is_ok()) << nc.status().to_string();
  comm::Communicator& c = *nc.value();
  const int64_t n = 1 << 10;
  DeviceBuf a{size_t(n)}, x{size_t(1) << 12};
  cudaStream_t s = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  // One sum both ranks join first: NCCL connects peers at their first collective, and until
  // then an enqueue whose peer is absent is itself in progress (and fails at its own deadline).
  ASSERT_TRUE(c.all_reduce_enqueue(a.p, n, DType::kF32, comm::ReduceOp::kSum, nullptr, nullptr)
                  .is_ok());
  ASSERT_TRUE(c.wait_enqueued().is_ok());
  c.set_timeout(std::chrono::milliseconds(1000));
  using clock = std::chrono::steady_clock;
  if (w.rank() == 0) {
    std::atomic<int> sums{0};
    const auto t0 = clock::now();
    auto fut = std::async(std::launch::async, [&]() -> Status {
      if (cudaSetDevice(w.rank()) != cudaSuccess) return SF_ERR(kInternal, "test: device");
      while (sf::seconds_since(t0) < 20.0) {
        // More of the caller's own work than sums: its stream's queue (about a thousand
        // entries) fills at about 32 sums, before the communicator's cap on sums in flight
        // (96) would stop it in all_reduce_enqueue instead.
        for (int k = 0; k < 32; ++k)
          if (cudaMemsetAsync(x.p, sums & 0xff, 4096, s) != cudaSuccess)
            return SF_ERR(kInternal, "test: memset");
        if (cudaEventRecord(ready, s) != cudaSuccess) return SF_ERR(kInternal, "test: record");
        SF_TRY(c.all_reduce_enqueue(a.p, n, DType::kF32, comm::ReduceOp::kSum, ready, done));
        if (cudaStreamWaitEvent(s, done, 0) != cudaSuccess) return SF_ERR(kInternal, "test: wait");
        ++sums;
      }
      return SF_ERR(kInternal, "test: still enqueuing after 20 s behind a sum that never ran");
    });
    if (fut.wait_for(std::chrono::seconds(40)) != std::future_status::ready) {
      std::fprintf(stderr,
                   "FAILED: rank 0 still blocked after 40 s, %d sums enqueued behind a stuck one "
                   "(a hang)\n",
                   sums.load());
      std::fflush(nullptr);
      std::_Exit(1);
    }
    const Status st = fut.get();
    const double waited = sf::seconds_since(t0);
    std::printf("rank 0 (stuck sum): %s after %.3f s, %d sums enqueued\n", st.to_string().c_str(),
                waited, sums.load());
    EXPECT_EQ(st.code(), Code::kDeadlineExceeded) << st.to_string();
    EXPECT_NE(st.message().find("watchdog"), std::string::npos) << st.to_string();
    EXPECT_NE(st.message().find("all_reduce"), std::string::npos) << st.to_string();
    EXPECT_GE(waited, 1.0);
    EXPECT_LT(waited, 10.0);
    EXPECT_TRUE(c.aborted());
    EXPECT_FALSE(c.wait_enqueued().is_ok()) << "an aborted communicator must fail fast";
    (void)cudaStreamSynchronize(s);  // drained by the abort (its result is not the test's)
  }
  // Rank 1 joined nothing. It waits for rank 0 over MPI, then fails its own barrier (rank 0 is
  // aborted), so its communicator is aborted rather than destroyed against a gone peer.
  ASSERT_TRUE(w.barrier().is_ok());
  if (w.rank() != 0) EXPECT_FALSE(c.barrier().is_ok());
  (void)cudaEventDestroy(ready);
  (void)cudaEventDestroy(done);
  (void)cudaStreamDestroy(s);
}

}  // namespace
}  // namespace sf
