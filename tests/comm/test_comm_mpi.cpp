// MpiCommunicator under mpiexec (any np >= 2; CI runs 4): every collective against the result
// each rank computes itself from the shared seed, outputs poisoned first; split groups; and the
// deadline contract: a rank that arrives late makes the waiting rank fail within its deadline
// with an error naming the collective and the ranks, and the communicator then fails fast.
#include <gtest/gtest.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "comm/mpi_communicator.h"
#include "common/timing.h"
#include "tests/comm/mpi_test_env.h"

namespace sf {
namespace {

using testing::test_seed;
using testing::test_world;

// Rank r's input of n values, the same on every rank that asks.
std::vector<float> input_f32(int r, int64_t n, uint64_t salt) {
  std::mt19937_64 rng(test_seed() ^ (uint64_t(r + 1) * 0x9e3779b97f4a7c15ull) ^ salt);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v{};
  v.resize(size_t(n));
  for (auto& x : v) x = u(rng);
  return v;
}
std::vector<int64_t> input_i64(int r, int64_t n, uint64_t salt) {
  std::mt19937_64 rng(test_seed() ^ (uint64_t(r + 7) * 0x2545f4914f6cdd1dull) ^ salt);
  std::vector<int64_t> v{};
  v.resize(size_t(n));
  for (auto& x : v) x = int64_t(rng() % 2000001) - 1000000;
  return v;
}

// Heartbeat notes: every rank posts 0..9 then -1 to every other rank, never waiting; each rank
// polls until it has every rank's -1, and each sender's notes arrive in the order sent.
TEST(CommMpi, HeartbeatNotesArriveInOrder) {
  auto& w = test_world();
  auto h = comm::Heartbeat::create();
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  std::vector<int> all(size_t(w.size()));
  for (int r = 0; r < w.size(); ++r) all[size_t(r)] = r;
  for (int64_t v = 0; v < 10; ++v) ASSERT_TRUE((*h)->beat(all, v).is_ok());
  ASSERT_TRUE((*h)->beat(all, -1).is_ok());
  std::vector<std::vector<int64_t>> got(size_t(w.size()));
  int done = 1;  // this rank sends itself nothing
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::vector<std::pair<int, int64_t>> notes;
  while (done < w.size() && std::chrono::steady_clock::now() < deadline) {
    notes.clear();
    ASSERT_TRUE((*h)->poll(&notes).is_ok());
    for (const auto& [src, v] : notes) {
      ASSERT_NE(src, w.rank()) << "a note to itself";
      got[size_t(src)].push_back(v);
      done += v < 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(done, w.size()) << "notes missing after 30 s";
  for (int r = 0; r < w.size(); ++r) {
    if (r == w.rank()) continue;
    std::vector<int64_t> want = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1};
    EXPECT_EQ(got[size_t(r)], want) << "from rank " << r;
  }
  ASSERT_TRUE(w.barrier().is_ok());  // every rank has its notes before the object goes
}

TEST(CommMpi, WorldShape) {
  auto& w = test_world();
  ASSERT_GE(w.size(), 2) << "run under mpiexec -np >= 2";
  EXPECT_STREQ(w.backend(), "mpi");
  EXPECT_LT(w.rank(), w.size());
}

TEST(CommMpi, AllReduceSumMaxExact) {
  auto& w = test_world();
  const int64_t n = 1000 + int64_t(test_seed() % 97);
  auto mine = input_i64(w.rank(), n, 1);
  std::vector<int64_t> sum(size_t(n), -777), mx(size_t(n), -777), want_sum(size_t(n), 0),
      want_max(size_t(n), INT64_MIN);
  for (int r = 0; r < w.size(); ++r) {
    auto v = input_i64(r, n, 1);
    for (int64_t i = 0; i < n; ++i) {
      want_sum[size_t(i)] += v[size_t(i)];
      want_max[size_t(i)] = std::max(want_max[size_t(i)], v[size_t(i)]);
    }
  }
  ASSERT_TRUE(w.all_reduce(mine.data(), sum.data(), n, DType::kI64, comm::ReduceOp::kSum).is_ok());
  ASSERT_TRUE(w.all_reduce(mine.data(), mx.data(), n, DType::kI64, comm::ReduceOp::kMax).is_ok());
  EXPECT_EQ(sum, want_sum);
  EXPECT_EQ(mx, want_max);
}

TEST(CommMpi, AllReduceF32InPlace) {
  auto& w = test_world();
  const int64_t n = 4096;
  auto v = input_f32(w.rank(), n, 2);
  std::vector<double> want(size_t(n), 0);
  for (int r = 0; r < w.size(); ++r) {
    auto o = input_f32(r, n, 2);
    for (int64_t i = 0; i < n; ++i) want[size_t(i)] += o[size_t(i)];
  }
  ASSERT_TRUE(w.all_reduce(v.data(), v.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  // fp32 sums of <= 4 terms in [-1, 1]: any order is within a few ulp of 4.
  double worst = 0;
  for (int64_t i = 0; i < n; ++i)
    worst = std::max(worst, std::abs(double(v[size_t(i)]) - want[size_t(i)]));
  EXPECT_LT(worst, 4e-6);
}

TEST(CommMpi, AllGatherAndGatherV) {
  auto& w = test_world();
  const int64_t n = 333;
  auto mine = input_f32(w.rank(), n, 3);
  std::vector<float> all(size_t(n * w.size()), std::nanf(""));
  ASSERT_TRUE(w.all_gather(mine.data(), all.data(), n, DType::kF32).is_ok());
  for (int r = 0; r < w.size(); ++r) {
    auto v = input_f32(r, n, 3);
    EXPECT_TRUE(std::equal(v.begin(), v.end(), all.begin() + r * n)) << "block of rank " << r;
  }
  // Variable counts, one rank sending nothing (CP ranks with empty chunks do).
  std::vector<int64_t> counts(size_t(w.size()));
  int64_t total = 0;
  for (int r = 0; r < w.size(); ++r) total += counts[size_t(r)] = r == 1 ? 0 : 10 + 17 * r;
  auto mv = input_f32(w.rank(), counts[size_t(w.rank())], 4);
  std::vector<float> gv(size_t(total) + 8, std::nanf(""));
  ASSERT_TRUE(
      w.all_gatherv(mv.data(), counts[size_t(w.rank())], gv.data(), counts, DType::kF32).is_ok());
  int64_t off = 0;
  for (int r = 0; r < w.size(); ++r) {
    auto v = input_f32(r, counts[size_t(r)], 4);
    EXPECT_TRUE(std::equal(v.begin(), v.end(), gv.begin() + off)) << "block of rank " << r;
    off += counts[size_t(r)];
  }
  for (size_t i = size_t(total); i < gv.size(); ++i)
    EXPECT_TRUE(std::isnan(gv[i])) << "written past the end";
  // A count vector that disagrees with send_count is refused before anything is sent.
  const Status bad =
      w.all_gatherv(mv.data(), counts[size_t(w.rank())] + 1, gv.data(), counts, DType::kF32);
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_FALSE(w.aborted());
}

// Past INT_MAX elements at the real limit (MPI counts are ints): all_gatherv and bcast go in
// pieces. About 5 GiB a rank, so opt-in:
// SF_COMM_BIG_TESTS=1 mpiexec -np 2 tests/test_comm_mpi --gtest_filter='*PastIntMax*'.
TEST(CommMpi, PastIntMaxElementsGoInPieces) {
  if (!std::getenv("SF_COMM_BIG_TESTS")) GTEST_SKIP() << "SF_COMM_BIG_TESTS=1 runs it (~5 GiB a rank)";
  auto& w = test_world();
  const int64_t row = 64;
  auto byte = [](int r, int64_t i) { return uint8_t((r * 131 + i * 7 + (i >> 20)) & 0xff); };
  // Rows a rank: together just past INT_MAX bytes. Equal counts (the K/V all-gather's: their
  // common divisor is a whole contribution), then the last rank one row more (divisor: a row).
  const int64_t rows = (int64_t(INT_MAX) / row) / w.size() + 1;
  for (const bool equal : {true, false}) {
    std::vector<int64_t> counts(size_t(w.size()), rows * row);
    if (!equal) counts.back() += row;
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    ASSERT_GT(total, int64_t(INT_MAX));
    std::vector<uint8_t> mine(static_cast<size_t>(counts[size_t(w.rank())]));
    for (int64_t i = 0; i < int64_t(mine.size()); ++i) mine[size_t(i)] = byte(w.rank(), i);
    std::vector<uint8_t> all(static_cast<size_t>(total), 0);
    const Status st =
        w.all_gatherv(mine.data(), int64_t(mine.size()), all.data(), counts, DType::kU8);
    ASSERT_TRUE(st.is_ok()) << (equal ? "equal counts: " : "") << st.to_string();
    int64_t off = 0, bad = 0;
    for (int r = 0; r < w.size(); ++r) {
      for (int64_t i = 0; i < counts[size_t(r)]; i += 4099) bad += all[size_t(off + i)] != byte(r, i);
      bad += all[size_t(off + counts[size_t(r)] - 1)] != byte(r, counts[size_t(r)] - 1);
      off += counts[size_t(r)];
    }
    EXPECT_EQ(bad, 0) << (equal ? "equal counts" : "unequal counts");
  }
  const int64_t total = int64_t(INT_MAX) + 129;
  std::vector<uint8_t> b(static_cast<size_t>(total), 0);
  if (w.rank() == 0)
    for (int64_t i = 0; i < total; ++i) b[size_t(i)] = byte(5, i);
  const Status st = w.bcast(b.data(), total, DType::kU8, 0);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  int64_t bad = 0;
  for (int64_t i = 0; i < total; i += 4099) bad += b[size_t(i)] != byte(5, i);
  bad += b[size_t(total - 1)] != byte(5, total - 1);
  EXPECT_EQ(bad, 0);
}

// Calls past one MPI call's element limit go in pieces (at INT_MAX, a 1M-token prompt's
// O-projection sums at hidden 4096 and TP 2 x CP 2 are 2^31 floats). The limit lowered to 7
// elements runs every piece path on small buffers: counts over, under and at it, unequal
// all_gatherv counts with an empty rank, and a sendrecv ring whose send and receive sizes differ
// (so the two sides' piece counts differ).
TEST(CommMpi, CallsPastTheElementLimitGoInPieces) {
  auto& w = test_world();
  const int n = w.size(), r = w.rank();
  struct Restore {
    ~Restore() { comm::mpi_set_call_limit_for_tests(0); }
  } restore;
  comm::mpi_set_call_limit_for_tests(7);
  for (const int64_t cnt : {int64_t(0), int64_t(1), int64_t(7), int64_t(50)}) {
    SCOPED_TRACE("count " + std::to_string(cnt));
    auto mine = input_i64(r, cnt, 21);
    std::vector<int64_t> sum(size_t(cnt), -7), want(size_t(cnt), 0);
    for (int q = 0; q < n; ++q) {
      auto v = input_i64(q, cnt, 21);
      for (int64_t i = 0; i < cnt; ++i) want[size_t(i)] += v[size_t(i)];
    }
    ASSERT_TRUE(w.all_reduce(mine.data(), sum.data(), cnt, DType::kI64, comm::ReduceOp::kSum).is_ok());
    EXPECT_EQ(sum, want);
    std::vector<int64_t> all(size_t(cnt * n), -7), want_all;
    for (int q = 0; q < n; ++q) {
      auto v = input_i64(q, cnt, 21);
      want_all.insert(want_all.end(), v.begin(), v.end());
    }
    ASSERT_TRUE(w.all_gather(mine.data(), all.data(), cnt, DType::kI64).is_ok());
    EXPECT_EQ(all, want_all);
    // reduce_scatter: block q of every rank's input summed onto rank q.
    auto blocks = input_i64(r, cnt * n, 22);
    std::vector<int64_t> got(size_t(cnt), -7), want_rs(size_t(cnt), 0);
    for (int q = 0; q < n; ++q) {
      auto v = input_i64(q, cnt * n, 22);
      for (int64_t i = 0; i < cnt; ++i) want_rs[size_t(i)] += v[size_t(r * cnt + i)];
    }
    ASSERT_TRUE(w.reduce_scatter(blocks.data(), got.data(), cnt, DType::kI64,
                                 comm::ReduceOp::kSum).is_ok());
    EXPECT_EQ(got, want_rs);
    // bcast from the last rank.
    std::vector<int64_t> b = r == n - 1 ? input_i64(n - 1, cnt, 23) : std::vector<int64_t>(size_t(cnt), -7);
    ASSERT_TRUE(w.bcast(b.data(), cnt, DType::kI64, n - 1).is_ok());
    EXPECT_EQ(b, input_i64(n - 1, cnt, 23));
  }
  // all_gatherv with unequal counts (one empty, one exactly the limit, some past it).
  std::vector<int64_t> counts(static_cast<size_t>(n));
  int64_t total = 0;
  for (int q = 0; q < n; ++q) total += counts[size_t(q)] = q == 1 ? 0 : q == 2 ? 7 : 9 + 11 * q;
  auto mv = input_i64(r, counts[size_t(r)], 24);
  std::vector<int64_t> gv(size_t(total) + 3, -7), want_gv;
  for (int q = 0; q < n; ++q) {
    auto v = input_i64(q, counts[size_t(q)], 24);
    want_gv.insert(want_gv.end(), v.begin(), v.end());
  }
  want_gv.insert(want_gv.end(), 3, -7);  // nothing written past the end
  ASSERT_TRUE(w.all_gatherv(mv.data(), counts[size_t(r)], gv.data(), counts, DType::kI64).is_ok());
  EXPECT_EQ(gv, want_gv);
  // A sendrecv ring: rank q sends 5 + 9q elements to q+1, so each rank's send and receive sizes
  // (and piece counts) differ.
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  auto sv = input_i64(r, 5 + 9 * r, 25);
  std::vector<int64_t> rv(size_t(5 + 9 * prev), -7);
  ASSERT_TRUE(w.sendrecv(sv.data(), int64_t(sv.size()), next, rv.data(), int64_t(rv.size()), prev,
                         DType::kI64, 31).is_ok());
  EXPECT_EQ(rv, input_i64(prev, 5 + 9 * prev, 25));
  // send / recv in pieces, even ranks first.
  std::vector<int64_t> pr(size_t(20), -7);
  auto ps = input_i64(r, 20, 26);
  if (r % 2 == 0) {
    ASSERT_TRUE(w.send(ps.data(), 20, DType::kI64, next, 32).is_ok());
    ASSERT_TRUE(w.recv(pr.data(), 20, DType::kI64, prev, 32).is_ok());
  } else {
    ASSERT_TRUE(w.recv(pr.data(), 20, DType::kI64, prev, 32).is_ok());
    ASSERT_TRUE(w.send(ps.data(), 20, DType::kI64, next, 32).is_ok());
  }
  EXPECT_EQ(pr, input_i64(prev, 20, 26));
  EXPECT_FALSE(w.aborted());
}

TEST(CommMpi, ReduceScatter) {
  auto& w = test_world();
  const int64_t blk = 257;
  auto mine = input_i64(w.rank(), blk * w.size(), 5);
  std::vector<int64_t> out(size_t(blk), -1), want(size_t(blk), 0);
  for (int r = 0; r < w.size(); ++r) {
    auto v = input_i64(r, blk * w.size(), 5);
    for (int64_t i = 0; i < blk; ++i) want[size_t(i)] += v[size_t(w.rank() * blk + i)];
  }
  ASSERT_TRUE(
      w.reduce_scatter(mine.data(), out.data(), blk, DType::kI64, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(out, want);
}

TEST(CommMpi, SendRecvRingAndBcast) {
  auto& w = test_world();
  const int n = w.size(), r = w.rank();
  const int64_t cnt = 1000;
  auto mine = input_f32(r, cnt, 6);
  std::vector<float> got(size_t(cnt), std::nanf(""));
  // Even ranks send first so the blocking pair order cannot deadlock.
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  if (r % 2 == 0) {
    ASSERT_TRUE(w.send(mine.data(), cnt, DType::kF32, next, 11).is_ok());
    ASSERT_TRUE(w.recv(got.data(), cnt, DType::kF32, prev, 11).is_ok());
  } else {
    ASSERT_TRUE(w.recv(got.data(), cnt, DType::kF32, prev, 11).is_ok());
    ASSERT_TRUE(w.send(mine.data(), cnt, DType::kF32, next, 11).is_ok());
  }
  EXPECT_EQ(got, input_f32(prev, cnt, 6));
  // sendrecv: every rank sends first, 1 MB each (beyond eager limits), and none deadlocks.
  const int64_t big = 1 << 18;
  auto mb = input_f32(r, big, 8);
  std::vector<float> gb(size_t(big), std::nanf(""));
  ASSERT_TRUE(w.sendrecv(mb.data(), big, next, gb.data(), big, prev, DType::kF32, 12).is_ok());
  EXPECT_EQ(gb, input_f32(prev, big, 8));
  const int root = n - 1;
  std::vector<float> b =
      r == root ? input_f32(root, cnt, 7) : std::vector<float>(size_t(cnt), std::nanf(""));
  ASSERT_TRUE(w.bcast(b.data(), cnt, DType::kF32, root).is_ok());
  EXPECT_EQ(b, input_f32(root, cnt, 7));
  EXPECT_EQ(w.send(mine.data(), cnt, DType::kF32, n, 1).code(), Code::kInvalidArgument);
}

TEST(CommMpi, SplitGroups) {
  auto& w = test_world();
  auto s = w.split(w.rank() % 2, w.rank(), "parity");
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  auto& c = *s.value();
  EXPECT_EQ(c.name(), "parity");
  EXPECT_EQ(c.size(), (w.size() + 1 - w.rank() % 2) / 2);
  EXPECT_EQ(c.rank(), w.rank() / 2);
  int64_t me = w.rank(), sum = -1, want = 0;
  for (int r = w.rank() % 2; r < w.size(); r += 2) want += r;
  ASSERT_TRUE(c.all_reduce(&me, &sum, 1, DType::kI64, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(sum, want);
}

TEST(CommMpi, ReductionOnHalfIsRefused) {
  auto& w = test_world();
  uint16_t h[4] = {};
  EXPECT_EQ(w.all_reduce(h, h, 4, DType::kBF16, comm::ReduceOp::kSum).code(), Code::kUnsupported);
  EXPECT_FALSE(w.aborted());
}

// Rank 0 waits on a collective the others join 1.5 s after its 1 s deadline. Rank 0 must fail in
// [1 s, 2 s), name the collective and the ranks, abort, and then fail fast. The late
// ranks complete against rank 0's abandoned (staged) request, which never touches freed memory.
TEST(CommMpi, DeadlineAbortsAndNamesTheCollective) {
  auto& w = test_world();
  auto s = w.split(0, w.rank(), "deadline-test");
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  auto& c = *s.value();
  using clock = std::chrono::steady_clock;
  std::vector<float> buf(64, 1.f);
  if (c.rank() == 0) {
    c.set_timeout(std::chrono::milliseconds(1000));
    const auto t0 = clock::now();
    const Status st = c.all_reduce(buf.data(), buf.data(), 64, DType::kF32, comm::ReduceOp::kSum);
    const double waited = sf::seconds_since(t0);
    std::printf("rank 0 deadline error after %.3f s: %s\n", waited, st.to_string().c_str());
    EXPECT_EQ(st.code(), Code::kDeadlineExceeded);
    EXPECT_GE(waited, 1.0);
    // The others arrive at 2.5 s: failing that late means no deadline at all (the bound leaves a
    // loaded CI machine a second of scheduling slack past the deadline).
    EXPECT_LT(waited, 2.0);
    EXPECT_NE(st.message().find("all_reduce"), std::string::npos);
    EXPECT_NE(st.message().find("'deadline-test'"), std::string::npos);
    EXPECT_NE(st.message().find("world 0-" + std::to_string(w.size() - 1)), std::string::npos);
    EXPECT_NE(st.message().find("1.0 s"), std::string::npos);
    EXPECT_TRUE(c.aborted());
    const auto t1 = clock::now();
    const Status again = c.barrier();
    // Fails at once (a wait would take the 1 s deadline again).
    EXPECT_LT(sf::seconds_since(t1), 0.25);
    EXPECT_EQ(again.code(), Code::kDeadlineExceeded);
    EXPECT_NE(again.message().find("aborted"), std::string::npos);
    buf.assign(buf.size(), -5.f);
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    ASSERT_TRUE(
        c.all_reduce(buf.data(), buf.data(), 64, DType::kF32, comm::ReduceOp::kSum).is_ok());
    EXPECT_EQ(buf[0], float(w.size()));
  }
  // The world communicator is untouched by the sub-communicator's abort.
  ASSERT_TRUE(w.barrier().is_ok());
  EXPECT_FALSE(w.aborted());
  if (c.rank() == 0)
    EXPECT_EQ(buf[0], -5.f) << "the abandoned request wrote into the caller's buffer";
}

}  // namespace
}  // namespace sf
