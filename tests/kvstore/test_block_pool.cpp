// The unified KV block pool: budgets and accounting, spill order, the all-full error, pinning,
// byte-exact round trips through every tier, disk tier faults (unusable directory, ENOSPC) and
// sparsity-aware placement.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "kvstore/block_pool.h"
#include "tests/common/test_seed.h"

namespace sf::kvstore {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    static int n = 0;
    path = fs::temp_directory_path() /
           ("sf-pool-test-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string sub(const std::string& s) const { return (path / s).string(); }
};

using testing::fresh_seed;

constexpr int kHeads = 2, kDim = 8;

BlockPoolConfig config(int64_t host_blocks, int64_t disk_blocks, const std::string& dir) {
  BlockPoolConfig c;
  c.n_kv_heads = kHeads;
  c.head_dim = kDim;
  const int64_t bb = int64_t(2) * kPoolBlockTokens * kHeads * kDim * 4;
  // A partial block of budget must be ignored: budgets round down to whole blocks.
  c.host_bytes = host_blocks * bb + (host_blocks ? bb / 2 : 0);
  c.disk_bytes = disk_blocks * bb;
  c.disk_dir = dir;
  return c;
}

std::unique_ptr<BlockPool> make_pool(const BlockPoolConfig& c) {
  auto r = BlockPool::create(c);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? std::move(r).value() : nullptr;
}

// Random K and V of one block, never all zeros.
struct BlockData {
  std::vector<float> k, v;
  BlockData(int64_t n, std::mt19937_64& rng) : k(size_t(n)), v(size_t(n)) {
    std::normal_distribution<float> d(0.f, 1.f);
    for (auto& x : k) x = d(rng);
    for (auto& x : v) x = d(rng);
  }
};

void expect_block(const BlockPool& p, BlockId id, const BlockData& want) {
  // Poisoned so an unwritten element shows.
  std::vector<float> k(want.k.size(), std::nanf("")), v(want.v.size(), std::nanf(""));
  const Status st = p.read(id, k.data(), v.data());
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(0, std::memcmp(k.data(), want.k.data(), k.size() * 4)) << "K of block " << id;
  EXPECT_EQ(0, std::memcmp(v.data(), want.v.data(), v.size() * 4)) << "V of block " << id;
}

// c with a device tier of `blocks` blocks, created; null with the reason where no device tier
// can be had (a CPU build: kUnsupported; no usable device: kResourceExhausted), for the caller
// to skip on. Any other error fails the test.
std::unique_ptr<BlockPool> with_device_tier(BlockPoolConfig c, int64_t blocks, std::string* why) {
  c.device_bytes = blocks * (int64_t(2) * kPoolBlockTokens * kHeads * kDim * 4);
  auto r = BlockPool::create(c);
  if (r.is_ok()) return std::move(r).value();
  EXPECT_TRUE(r.status().code() == Code::kUnsupported ||
              r.status().code() == Code::kResourceExhausted)
      << r.status().to_string();
  // Where a device is usable (a CUDA build on a GPU host), the device tier must be had: a
  // regression there is a failure, not a skip.
  int n = 0;
  if (kernels::cuda::device_count(&n).is_ok() && n > 0)
    ADD_FAILURE() << "a device tier on a host with " << n << " CUDA device(s): "
                  << r.status().to_string();
  *why = r.status().to_string();
  return nullptr;
}

BlockId must_alloc(BlockPool& p, Tier t) {
  auto id = p.alloc(t);
  EXPECT_TRUE(id.is_ok()) << id.status().to_string();
  return id.is_ok() ? *id : -1;
}

Tier tier(const BlockPool& p, BlockId id) {
  auto t = p.tier_of(id);
  EXPECT_TRUE(t.is_ok()) << t.status().to_string();
  return t.is_ok() ? *t : Tier::kDevice;
}

// Placement keeps sink blocks first, then the recent window, then the rest by score, highest
// first; a NaN score ranks last instead of breaking the sort's order.
TEST(BlockPool, PlacementOrderRanksNanScoresLast) {
  const float nan = std::nanf("");
  const std::vector<float> scores = {5.f, 1.f, nan, 3.f, nan, 2.f, 9.f, 0.f};
  EXPECT_EQ(placement_order(scores, 1, 1), (std::vector<int64_t>{0, 7, 6, 3, 5, 1, 2, 4}));
  EXPECT_EQ(placement_order(scores, 0, 0), (std::vector<int64_t>{6, 0, 3, 5, 1, 7, 2, 4}));
}

TEST(BlockPool, BudgetsAndAccounting) {
  TempDir tmp;
  auto p = make_pool(config(3, 2, tmp.sub("disk")));
  ASSERT_TRUE(p);
  const int64_t bb = p->block_bytes();
  EXPECT_EQ(bb, int64_t(2) * 64 * kHeads * kDim * 4);
  EXPECT_EQ(p->stats(Tier::kHost).capacity_bytes, 3 * bb);
  EXPECT_EQ(p->stats(Tier::kDisk).capacity_bytes, 2 * bb);
  EXPECT_EQ(p->stats(Tier::kDevice).capacity_bytes, 0);
  std::vector<BlockId> ids;
  for (int i = 0; i < 3; ++i) {
    auto id = p->alloc(Tier::kHost);
    ASSERT_TRUE(id.is_ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  TierStats h = p->stats(Tier::kHost);
  EXPECT_EQ(h.used_bytes, 3 * bb);
  EXPECT_EQ(h.blocks, 3);
  EXPECT_EQ(h.allocs, 3);
  EXPECT_EQ(h.spilled_in, 0);
  ASSERT_TRUE(p->free(ids[1]).is_ok());
  h = p->stats(Tier::kHost);
  EXPECT_EQ(h.used_bytes, 2 * bb);
  EXPECT_EQ(h.frees, 1);
  EXPECT_EQ(p->live_blocks(), 2);
  // A freed id is dead: using it again is an error, not a crash.
  EXPECT_EQ(p->free(ids[1]).code(), Code::kInvalidArgument);
  EXPECT_EQ(p->tier_of(12345).status().code(), Code::kInvalidArgument);
  // The freed slot is reused before anything spills.
  auto again = p->alloc(Tier::kHost);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(tier(*p, *again), Tier::kHost);
  EXPECT_EQ(p->stats(Tier::kDisk).blocks, 0);
}

TEST(BlockPool, SpillsToNextTierThenErrorsWhenAllFull) {
  TempDir tmp;
  auto p = make_pool(config(2, 2, tmp.sub("disk")));
  ASSERT_TRUE(p);
  std::vector<Tier> got;
  // kDevice is disabled on this pool: allocation starts on host without counting a spill.
  for (int i = 0; i < 4; ++i) {
    auto id = p->alloc(Tier::kDevice);
    ASSERT_TRUE(id.is_ok()) << id.status().to_string();
    got.push_back(tier(*p, *id));
  }
  EXPECT_EQ(got, (std::vector<Tier>{Tier::kHost, Tier::kHost, Tier::kDisk, Tier::kDisk}));
  EXPECT_EQ(p->stats(Tier::kHost).spilled_in, 0);
  EXPECT_EQ(p->stats(Tier::kDisk).spilled_in, 2);
  EXPECT_EQ(p->stats(Tier::kHost).full_refusals, 2);
  auto full = p->alloc(Tier::kHost);
  ASSERT_FALSE(full.is_ok());
  EXPECT_EQ(full.status().code(), Code::kResourceExhausted);
  const std::string msg = full.status().to_string();
  std::printf("all-full error: %s\n", msg.c_str());
  EXPECT_NE(msg.find("all tiers full"), std::string::npos) << msg;
  EXPECT_NE(msg.find("disk"), std::string::npos) << msg;
  EXPECT_EQ(p->stats(Tier::kDisk).full_refusals, 1);
  EXPECT_EQ(p->live_blocks(), 4);
}

// place() with the slower tier full but for one block: demotions and promotions alternate, one
// block a round, and the swap completes with every block's data intact. With no free block on
// either tier it is a clear error and nothing moves.
TEST(BlockPool, PlaceSwapsThroughOneFreeBlock) {
  TempDir tmp;
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  auto p = make_pool(config(2, 3, tmp.sub("disk")));
  ASSERT_TRUE(p);
  std::vector<BlockId> ids;
  std::vector<BlockData> data;
  for (Tier t : {Tier::kHost, Tier::kHost, Tier::kDisk, Tier::kDisk}) {
    ids.push_back(must_alloc(*p, t));
    data.emplace_back(p->half_floats(), rng);
    ASSERT_TRUE(p->write(ids.back(), data.back().k.data(), data.back().v.data()).is_ok());
  }
  const std::vector<float> scores = {0.f, 0.f, 1.f, 2.f};  // the disk blocks are the hot ones
  auto r = p->place(ids, scores, 0, 0, Tier::kHost);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->demoted, 2);
  EXPECT_EQ(r->promoted, 2);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(tier(*p, ids[i]), i < 2 ? Tier::kDisk : Tier::kHost) << i;
    expect_block(*p, ids[i], data[i]);
  }
  // Fill the disk's last block: no room on either tier.
  const BlockId filler = must_alloc(*p, Tier::kDisk);
  const std::vector<float> back = {2.f, 1.f, 0.f, 0.f};
  auto stuck = p->place(ids, back, 0, 0, Tier::kHost);
  ASSERT_FALSE(stuck.is_ok());
  EXPECT_EQ(stuck.status().code(), Code::kResourceExhausted);
  EXPECT_NE(stuck.status().message().find("place cannot swap"), std::string::npos)
      << stuck.status().message();
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(tier(*p, ids[i]), i < 2 ? Tier::kDisk : Tier::kHost);
  ASSERT_TRUE(p->free(filler).is_ok());
}

// alloc's slowest bound: spill stops there (the device forward's blocks land on device or host,
// never on disk).
TEST(BlockPool, AllocStopsAtItsSlowestTier) {
  TempDir tmp;
  auto p = make_pool(config(1, 2, tmp.sub("disk")));
  ASSERT_TRUE(p);
  auto a = p->alloc(Tier::kHost, Tier::kHost);
  ASSERT_TRUE(a.is_ok());
  EXPECT_EQ(tier(*p, *a), Tier::kHost);
  auto b = p->alloc(Tier::kDevice, Tier::kHost);  // host full: no spill to disk
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), Code::kResourceExhausted);
  EXPECT_NE(b.status().message().find("from host to host"), std::string::npos)
      << b.status().message();
  EXPECT_EQ(p->stats(Tier::kDisk).blocks, 0);
  EXPECT_EQ(p->alloc(Tier::kDisk, Tier::kHost).status().code(), Code::kInvalidArgument);
  auto c = p->alloc(Tier::kHost);  // the default bound spills as before
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(tier(*p, *c), Tier::kDisk);
}

// A batch takes each block as alloc() would, in order, and on failure hands every block back.
TEST(BlockPool, AllocBatchIsAllOrNothing) {
  TempDir tmp;
  auto p = make_pool(config(2, 2, tmp.sub("disk")));
  ASSERT_TRUE(p);
  const std::vector<Tier> three = {Tier::kHost, Tier::kHost, Tier::kHost};
  auto a = p->alloc_batch(three, Tier::kDisk);  // the third spills to disk
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  ASSERT_EQ(a->size(), 3u);
  EXPECT_EQ(tier(*p, (*a)[0]), Tier::kHost);
  EXPECT_EQ(tier(*p, (*a)[1]), Tier::kHost);
  EXPECT_EQ(tier(*p, (*a)[2]), Tier::kDisk);
  EXPECT_EQ(p->stats(Tier::kDisk).spilled_in, 1);
  // One disk slot is left: a batch of two fails at its second block and leaves none behind.
  const std::vector<Tier> two = {Tier::kDisk, Tier::kDisk};
  auto b = p->alloc_batch(two, Tier::kDisk);
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), Code::kResourceExhausted);
  EXPECT_EQ(b.status().message().rfind("block 1 of 2: ", 0), 0u) << b.status().message();
  EXPECT_EQ(p->live_blocks(), 3);
  EXPECT_EQ(p->stats(Tier::kDisk).blocks, 1);
  // A batch handed back leaves the counters as the one alloc that failed would: its first block
  // spilled from host to disk and was freed again, and none of that counts; its second block's
  // refusals do (host full, then disk full).
  const TierStats host0 = p->stats(Tier::kHost), disk0 = p->stats(Tier::kDisk);
  const std::vector<Tier> two_host = {Tier::kHost, Tier::kHost};
  ASSERT_FALSE(p->alloc_batch(two_host, Tier::kDisk).is_ok());
  const TierStats host1 = p->stats(Tier::kHost), disk1 = p->stats(Tier::kDisk);
  EXPECT_EQ(disk1.allocs, disk0.allocs);
  EXPECT_EQ(disk1.frees, disk0.frees);
  EXPECT_EQ(disk1.spilled_in, disk0.spilled_in);
  EXPECT_EQ(disk1.used_bytes, disk0.used_bytes);
  EXPECT_EQ(host1.full_refusals, host0.full_refusals + 1);
  EXPECT_EQ(disk1.full_refusals, disk0.full_refusals + 1);
  // The disk slot it took and gave back can be allocated again.
  auto c = p->alloc_batch(std::span<const Tier>(two).first(1), Tier::kDisk);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(p->stats(Tier::kDisk).blocks, 2);
  EXPECT_EQ(p->alloc_batch({}, Tier::kDisk).value().size(), 0u);
  const std::vector<Tier> bad = {Tier::kDisk};
  EXPECT_EQ(p->alloc_batch(bad, Tier::kHost).status().code(), Code::kInvalidArgument);
}

TEST(BlockPool, DiskBudgetFullIsAClearError) {
  TempDir tmp;
  auto p = make_pool(config(0, 1, tmp.sub("disk")));
  ASSERT_TRUE(p);
  ASSERT_TRUE(p->alloc(Tier::kDisk).is_ok());
  auto r = p->alloc(Tier::kDisk);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kResourceExhausted);
  const std::string bb = std::to_string(p->block_bytes());
  EXPECT_NE(r.status().message().find("disk " + bb + "/" + bb + " bytes"), std::string::npos)
      << r.status().to_string();
}

TEST(BlockPool, RoundTripThroughEveryTierIsByteExact) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir tmp;
  auto p = make_pool(config(2, 2, tmp.sub("disk")));
  ASSERT_TRUE(p);
  const int64_t bb = p->block_bytes();
  auto a = p->alloc(Tier::kHost), b = p->alloc(Tier::kDisk);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  const BlockData da(p->half_floats(), rng), db(p->half_floats(), rng);
  ASSERT_TRUE(p->write(*a, da.k.data(), da.v.data()).is_ok());
  ASSERT_TRUE(p->write(*b, db.k.data(), db.v.data()).is_ok());
  expect_block(*p, *a, da);
  expect_block(*p, *b, db);
  // host -> disk -> host, and disk -> host -> disk.
  ASSERT_TRUE(p->move(*a, Tier::kDisk).is_ok());
  EXPECT_EQ(tier(*p, *a), Tier::kDisk);
  expect_block(*p, *a, da);
  ASSERT_TRUE(p->move(*b, Tier::kHost).is_ok());
  EXPECT_EQ(tier(*p, *b), Tier::kHost);
  expect_block(*p, *b, db);
  ASSERT_TRUE(p->move(*a, Tier::kHost).is_ok());
  expect_block(*p, *a, da);
  ASSERT_TRUE(p->move(*b, Tier::kDisk).is_ok());
  expect_block(*p, *b, db);
  const TierStats h = p->stats(Tier::kHost), d = p->stats(Tier::kDisk);
  EXPECT_EQ(h.demoted_out, 2);
  EXPECT_EQ(h.bytes_down_out, 2 * bb);
  EXPECT_EQ(h.promoted_in, 2);
  EXPECT_EQ(h.bytes_up_in, 2 * bb);
  EXPECT_EQ(d.demoted_in, 2);
  EXPECT_EQ(d.bytes_down_in, 2 * bb);
  EXPECT_EQ(d.promoted_out, 2);
  EXPECT_EQ(d.bytes_up_out, 2 * bb);
  EXPECT_EQ(h.blocks + d.blocks, 2);
  EXPECT_EQ(h.used_bytes, bb);
  EXPECT_EQ(d.used_bytes, bb);
  // A move to a disabled tier is an error and leaves the block where it was.
  EXPECT_EQ(p->move(*a, Tier::kDevice).code(), Code::kInvalidArgument);
  expect_block(*p, *a, da);
}

TEST(BlockPool, PinnedBlocksAreNeverMovedOrFreed) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir tmp;
  auto p = make_pool(config(2, 4, tmp.sub("disk")));
  ASSERT_TRUE(p);
  std::vector<BlockId> ids;
  for (int i = 0; i < 2; ++i) ids.push_back(must_alloc(*p, Tier::kHost));
  const BlockData d0(p->half_floats(), rng);
  ASSERT_TRUE(p->write(ids[0], d0.k.data(), d0.v.data()).is_ok());
  ASSERT_TRUE(p->pin(ids[0]).is_ok());
  ASSERT_TRUE(p->pin(ids[0]).is_ok());
  EXPECT_EQ(p->pins(ids[0]).value(), 2);
  const Status mv = p->move(ids[0], Tier::kDisk);
  EXPECT_EQ(mv.code(), Code::kInvalidArgument);
  EXPECT_NE(mv.message().find("pinned"), std::string::npos) << mv.to_string();
  EXPECT_EQ(p->free(ids[0]).code(), Code::kInvalidArgument);
  // place() with the pinned block scored coldest: it must stay on host anyway.
  const std::vector<float> scores = {-1.f, 5.f};
  auto r = p->place(ids, scores, 0, 0, Tier::kHost);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->pinned_skipped, 1);
  EXPECT_EQ(tier(*p, ids[0]), Tier::kHost);
  expect_block(*p, ids[0], d0);
  ASSERT_TRUE(p->unpin(ids[0]).is_ok());
  EXPECT_FALSE(p->move(ids[0], Tier::kDisk).is_ok());  // one pin left
  ASSERT_TRUE(p->unpin(ids[0]).is_ok());
  EXPECT_EQ(p->unpin(ids[0]).code(), Code::kInvalidArgument);  // not pinned any more
  ASSERT_TRUE(p->move(ids[0], Tier::kDisk).is_ok());
  expect_block(*p, ids[0], d0);
}

TEST(BlockPool, DiskDirectoryThatIsNotWritableIsAClearError) {
  TempDir tmp;
  const std::string file = tmp.sub("a-file");
  std::ofstream(file) << "x";
  // A directory below a regular file can never be created.
  auto r = BlockPool::create(config(1, 2, file + "/tier"));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kIo);
  std::printf("error: %s\n", r.status().to_string().c_str());
  EXPECT_NE(r.status().message().find("disk tier directory"), std::string::npos);
  // The path itself is a regular file.
  auto r2 = BlockPool::create(config(1, 2, file));
  ASSERT_FALSE(r2.is_ok());
  EXPECT_EQ(r2.status().code(), Code::kIo);
  // Permission bits: only meaningful when not root (root bypasses them).
  if (::geteuid() != 0) {
    const std::string ro = tmp.sub("ro");
    fs::create_directories(ro);
    fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
    auto r3 = BlockPool::create(config(1, 2, ro));
    fs::permissions(ro, fs::perms::owner_all);
    ASSERT_FALSE(r3.is_ok());
    EXPECT_NE(r3.status().message().find("not writable"), std::string::npos)
        << r3.status().to_string();
  }
}

TEST(BlockPool, TwoPoolsCannotShareADiskDirectory) {
  TempDir tmp;
  const std::string dir = tmp.sub("disk");
  auto a = BlockPool::create(config(1, 2, dir));
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  // A second pool on the same directory would overwrite the first's slots and, on closing,
  // delete its file: refused while the first lives.
  auto b = BlockPool::create(config(1, 2, dir));
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), Code::kAlreadyExists);
  std::printf("error: %s\n", b.status().to_string().c_str());
  EXPECT_NE(b.status().message().find("in use by another block pool"), std::string::npos);
  EXPECT_TRUE(fs::exists(dir + "/blocks.bin"));  // the refused pool removed nothing
  a.value().reset();  // the first pool goes, and its file with it
  EXPECT_FALSE(fs::exists(dir + "/blocks.bin"));
  auto c = BlockPool::create(config(1, 2, dir));
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
}

TEST(BlockPool, DiskFullWriteIsAClearErrorAndTheBlockSurvives) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir tmp;
  // The tier's file is /dev/full: every write fails with ENOSPC, as on a full disk.
  const std::string dir = tmp.sub("disk");
  fs::create_directories(dir);
  fs::create_symlink("/dev/full", dir + "/blocks.bin");
  auto p = make_pool(config(1, 2, dir));
  ASSERT_TRUE(p);
  auto h = p->alloc(Tier::kHost);
  ASSERT_TRUE(h.is_ok());
  const BlockData d(p->half_floats(), rng);
  ASSERT_TRUE(p->write(*h, d.k.data(), d.v.data()).is_ok());
  const Status mv = p->move(*h, Tier::kDisk);
  ASSERT_FALSE(mv.is_ok());
  EXPECT_EQ(mv.code(), Code::kResourceExhausted);
  std::printf("error: %s\n", mv.to_string().c_str());
  EXPECT_NE(mv.message().find("ENOSPC"), std::string::npos) << mv.to_string();
  EXPECT_EQ(tier(*p, *h), Tier::kHost);
  expect_block(*p, *h, d);
  EXPECT_EQ(p->stats(Tier::kDisk).io_errors, 1);
  EXPECT_EQ(p->stats(Tier::kDisk).blocks, 0);
  auto dd = p->alloc(Tier::kDisk);
  ASSERT_TRUE(dd.is_ok());
  EXPECT_EQ(p->write(*dd, d.k.data(), d.v.data()).code(), Code::kResourceExhausted);
  // The pool's destructor unlinks the symlink, never /dev/full itself.
  p.reset();
  EXPECT_TRUE(fs::exists("/dev/full"));
}

TEST(BlockPool, PlacementKeepsSinkRecentAndTopScoredOnFastTier) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir tmp;
  auto p = make_pool(config(4, 8, tmp.sub("disk")));
  ASSERT_TRUE(p);
  // 8 blocks of one sequence: 0..3 land on host, 4..7 spill to disk.
  std::vector<BlockId> ids;
  std::vector<BlockData> data;
  for (int i = 0; i < 8; ++i) {
    ids.push_back(must_alloc(*p, Tier::kHost));
    data.emplace_back(p->half_floats(), rng);
    ASSERT_TRUE(p->write(ids.back(), data.back().k.data(), data.back().v.data()).is_ok());
  }
  // sink = block 0, recent = block 7; of 1..6 the two best are 5 (9.0) and 2 (7.0).
  const std::vector<float> scores = {0.f, 1.f, 7.f, 0.5f, 2.f, 9.f, 3.f, 0.f};
  auto r = p->place(ids, scores, 1, 1, Tier::kHost);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const std::vector<int> hot = {0, 2, 5, 7};
  for (int i = 0; i < 8; ++i) {
    const bool want_hot = std::find(hot.begin(), hot.end(), i) != hot.end();
    EXPECT_EQ(tier(*p, ids[size_t(i)]), want_hot ? Tier::kHost : Tier::kDisk) << "block " << i;
    expect_block(*p, ids[size_t(i)], data[size_t(i)]);
  }
  EXPECT_EQ(r->hot, 4);
  EXPECT_EQ(r->demoted, 2);   // 1 and 3 left host
  EXPECT_EQ(r->promoted, 2);  // 5 and 7 came up
  EXPECT_EQ(p->stats(Tier::kHost).demoted_out, 2);
  EXPECT_EQ(p->stats(Tier::kHost).promoted_in, 2);
  EXPECT_EQ(p->stats(Tier::kHost).bytes_up_in, 2 * p->block_bytes());
  // Placing again is a no-op.
  auto r2 = p->place(ids, scores, 1, 1, Tier::kHost);
  ASSERT_TRUE(r2.is_ok());
  EXPECT_EQ(r2->demoted + r2->promoted, 0);
  // Mismatched scores are rejected.
  EXPECT_EQ(p->place(ids, std::vector<float>(3), 1, 1, Tier::kHost).status().code(),
            Code::kInvalidArgument);
}

TEST(BlockPool, MoveBatchIsAllOrNothing) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir tmp;
  auto p = make_pool(config(4, 3, tmp.sub("disk")));
  ASSERT_TRUE(p);
  std::vector<BlockId> ids;
  std::vector<BlockData> data;
  for (int i = 0; i < 4; ++i) {
    ids.push_back(must_alloc(*p, Tier::kHost));
    data.emplace_back(p->half_floats(), rng);
    ASSERT_TRUE(p->write(ids.back(), data.back().k.data(), data.back().v.data()).is_ok());
  }
  auto all_on = [&](Tier t) {
    for (BlockId id : ids)
      if (tier(*p, id) != t) return false;
    return true;
  };
  // Four blocks, room for three: refused, nothing moved.
  EXPECT_EQ(p->move_batch(ids, Tier::kDisk).code(), Code::kResourceExhausted);
  EXPECT_TRUE(all_on(Tier::kHost));
  EXPECT_EQ(p->stats(Tier::kDisk).full_refusals, 1);
  const std::vector<BlockId> three(ids.begin(), ids.begin() + 3);
  // A pinned block or a repeated one: refused, nothing moved.
  ASSERT_TRUE(p->pin(ids[1]).is_ok());
  EXPECT_EQ(p->move_batch(three, Tier::kDisk).code(), Code::kInvalidArgument);
  ASSERT_TRUE(p->unpin(ids[1]).is_ok());
  const std::vector<BlockId> twice = {ids[0], ids[0]};
  EXPECT_EQ(p->move_batch(twice, Tier::kDisk).code(), Code::kInvalidArgument);
  EXPECT_TRUE(all_on(Tier::kHost));
  ASSERT_TRUE(p->move_batch(three, Tier::kDisk).is_ok());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(tier(*p, ids[size_t(i)]), i < 3 ? Tier::kDisk : Tier::kHost);
    expect_block(*p, ids[size_t(i)], data[size_t(i)]);
  }
  EXPECT_EQ(p->stats(Tier::kHost).demoted_out, 3);
  EXPECT_EQ(p->stats(Tier::kDisk).bytes_down_in, 3 * p->block_bytes());
  ASSERT_TRUE(p->move_batch(ids, Tier::kHost).is_ok());  // ids[3] is already there
  EXPECT_TRUE(all_on(Tier::kHost));
  EXPECT_EQ(p->stats(Tier::kHost).promoted_in, 3);
  for (int i = 0; i < 4; ++i) expect_block(*p, ids[size_t(i)], data[size_t(i)]);
}

TEST(BlockPool, MoveBatchToAFullDiskMovesNothing) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir tmp;
  const std::string dir = tmp.sub("disk");
  fs::create_directories(dir);
  fs::create_symlink("/dev/full", dir + "/blocks.bin");
  auto p = make_pool(config(2, 2, dir));
  ASSERT_TRUE(p);
  std::vector<BlockId> ids;
  std::vector<BlockData> data;
  for (int i = 0; i < 2; ++i) {
    ids.push_back(must_alloc(*p, Tier::kHost));
    data.emplace_back(p->half_floats(), rng);
    ASSERT_TRUE(p->write(ids.back(), data.back().k.data(), data.back().v.data()).is_ok());
  }
  const Status st = p->move_batch(ids, Tier::kDisk);
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.to_string();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(tier(*p, ids[size_t(i)]), Tier::kHost);
    expect_block(*p, ids[size_t(i)], data[size_t(i)]);
  }
  EXPECT_EQ(p->stats(Tier::kDisk).blocks, 0);
  EXPECT_EQ(p->stats(Tier::kHost).demoted_out, 0);
}

// CUDA builds on a GPU host: the device tier round trip. Skips in CPU builds (kUnsupported) and
// where no device can be allocated.
TEST(BlockPool, DeviceTierRoundTrip) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  std::string why;
  auto p = with_device_tier(config(2, 0, ""), 2, &why);
  if (!p) GTEST_SKIP() << why;
  std::vector<BlockId> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(must_alloc(*p, Tier::kDevice));
  EXPECT_EQ(tier(*p, ids[0]), Tier::kDevice);
  EXPECT_EQ(tier(*p, ids[2]), Tier::kHost);  // spilled
  const BlockData d(p->half_floats(), rng);
  ASSERT_TRUE(p->write(ids[0], d.k.data(), d.v.data()).is_ok());
  expect_block(*p, ids[0], d);
  ASSERT_TRUE(p->free(ids[2]).is_ok());
  ASSERT_TRUE(p->move(ids[0], Tier::kHost).is_ok());
  expect_block(*p, ids[0], d);
  ASSERT_TRUE(p->move(ids[0], Tier::kDevice).is_ok());
  expect_block(*p, ids[0], d);
  EXPECT_EQ(p->stats(Tier::kDevice).bytes_down_out, p->block_bytes());
  EXPECT_EQ(p->stats(Tier::kDevice).bytes_up_in, p->block_bytes());
  // The copy-stream path: a batch down to pinned host and back up.
  const BlockData d1(p->half_floats(), rng);
  ASSERT_TRUE(p->write(ids[1], d1.k.data(), d1.v.data()).is_ok());
  const std::vector<BlockId> both = {ids[0], ids[1]};
  ASSERT_TRUE(p->move_batch(both, Tier::kHost).is_ok());
  EXPECT_EQ(tier(*p, ids[1]), Tier::kHost);
  expect_block(*p, ids[0], d);
  expect_block(*p, ids[1], d1);
  ASSERT_TRUE(p->move_batch(both, Tier::kDevice).is_ok());
  EXPECT_EQ(tier(*p, ids[1]), Tier::kDevice);
  expect_block(*p, ids[0], d);
  expect_block(*p, ids[1], d1);
  EXPECT_EQ(p->stats(Tier::kDevice).bytes_down_out, 3 * p->block_bytes());
}

// A disk<->device batch goes through the host staging block: a failed read of the disk (its
// file cut short under the pool) counts on the disk tier, where it failed, as move() counts it,
// and the block stays on disk. CUDA builds on a GPU host; skips elsewhere.
// A pool that died without its destructor (kill -9) leaves blocks.bin behind, unlocked: the next
// pool in that directory takes it over and empties it, so the dead pool's blocks stop holding
// the disk.
TEST(BlockPool, ALeftoverDiskFileIsEmptiedOnTakeOver) {
  TempDir tmp;
  const std::string dir = tmp.sub("disk");
  fs::create_directories(dir);
  {
    std::ofstream f(dir + "/blocks.bin", std::ios::binary);
    f << std::string(1 << 20, 'x');
  }
  ASSERT_EQ(fs::file_size(dir + "/blocks.bin"), uintmax_t(1) << 20);
  auto p = BlockPool::create(config(1, 2, dir));
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(fs::file_size(dir + "/blocks.bin"), 0u) << "the dead pool's blocks still hold the disk";
  const BlockId id = must_alloc(*p.value(), Tier::kDisk);
  std::mt19937_64 rng(fresh_seed());
  const BlockData d(p.value()->half_floats(), rng);
  ASSERT_TRUE(p.value()->write(id, d.k.data(), d.v.data()).is_ok());
  EXPECT_GT(fs::file_size(dir + "/blocks.bin"), 0u);
}

TEST(BlockPool, MoveBatchCountsAReadErrorOnItsSourceTier) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir tmp;
  const std::string dir = tmp.sub("disk");
  std::string why;
  auto p = with_device_tier(config(0, 2, dir), 2, &why);
  if (!p) GTEST_SKIP() << why;
  const BlockId id = must_alloc(*p, Tier::kDisk);
  ASSERT_EQ(tier(*p, id), Tier::kDisk);
  const BlockData d(p->half_floats(), rng);
  ASSERT_TRUE(p->write(id, d.k.data(), d.v.data()).is_ok());
  fs::resize_file(dir + "/blocks.bin", 0);
  const std::vector<BlockId> one = {id};
  const Status st = p->move_batch(one, Tier::kDevice);
  EXPECT_EQ(st.code(), Code::kIo) << st.to_string();
  EXPECT_EQ(tier(*p, id), Tier::kDisk);
  EXPECT_EQ(p->stats(Tier::kDisk).io_errors, 1);
  EXPECT_EQ(p->stats(Tier::kDevice).io_errors, 0);
}

// write_batch: every block of a batch that spans the tiers (the device tier too, where one is
// usable: ten blocks, enough for the packed pinned chunks) reads back byte-exact, then a batch of
// one (the plain path); a bad id or a span of the wrong length is refused before anything is
// written.
TEST(BlockPool, WriteBatchLandsEveryBlockOnEveryTier) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  TempDir tmp;
  BlockPoolConfig c = config(3, 3, tmp.sub("disk"));
  c.device_bytes = 10 * (int64_t(2) * kPoolBlockTokens * kHeads * kDim * 4);
  auto r = BlockPool::create(c);
  if (!r.is_ok()) {  // a build or machine without a device: host and disk only
    c.device_bytes = 0;
    r = BlockPool::create(c);
  }
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  auto p = std::move(r).value();
  const int n = c.device_bytes > 0 ? 16 : 6;
  std::vector<BlockId> ids;
  for (int i = 0; i < n; ++i) ids.push_back(must_alloc(*p, Tier::kDevice));  // spill in order
  EXPECT_EQ(tier(*p, ids.back()), Tier::kDisk);
  std::vector<BlockData> d;
  std::vector<const float*> k, v;
  for (int i = 0; i < n; ++i) d.emplace_back(p->half_floats(), rng);
  // Out of slot order, so a device batch has runs of consecutive slots and breaks between them.
  const std::vector<int> order =
      n == 16 ? std::vector<int>{0, 1, 2, 5, 4, 3, 9, 10, 11, 12, 15, 6, 7, 8, 13, 14}
              : std::vector<int>{5, 0, 1, 3, 2, 4};
  std::vector<BlockId> batch;
  for (int i : order) {
    batch.push_back(ids[size_t(i)]);
    k.push_back(d[size_t(i)].k.data());
    v.push_back(d[size_t(i)].v.data());
  }
  ASSERT_TRUE(p->write_batch(batch, k, v).is_ok());
  for (int i = 0; i < n; ++i) expect_block(*p, ids[size_t(i)], d[size_t(i)]);
  // Refused before anything is written: other rows offered, every block keeps its own.
  const BlockData other(p->half_floats(), rng);
  const std::vector<const float*> ok(size_t(n), other.k.data()), ov(size_t(n), other.v.data());
  std::vector<BlockId> bad = batch;
  bad.back() = 1000;
  EXPECT_EQ(p->write_batch(bad, ok, ov).code(), Code::kInvalidArgument);
  EXPECT_EQ(p->write_batch(batch, std::span<const float* const>(ok).first(2), ov).code(),
            Code::kInvalidArgument);
  std::vector<const float*> with_null = ok;
  with_null.back() = nullptr;
  EXPECT_EQ(p->write_batch(batch, with_null, ov).code(), Code::kInvalidArgument);
  for (int i = 0; i < n; ++i) expect_block(*p, ids[size_t(i)], d[size_t(i)]);
  // A batch of one on each tier (write()'s path) replaces just that block.
  for (const int i : {0, n / 2, n - 1}) {
    ASSERT_TRUE(p->write(ids[size_t(i)], other.k.data(), other.v.data()).is_ok());
    expect_block(*p, ids[size_t(i)], other);
    d[size_t(i)] = other;
  }
  for (int i = 0; i < n; ++i) expect_block(*p, ids[size_t(i)], d[size_t(i)]);
}

TEST(BlockPool, InvalidConfigIsRejected) {
  BlockPoolConfig c = config(1, 0, "");
  c.n_kv_heads = 0;
  EXPECT_EQ(BlockPool::create(c).status().code(), Code::kInvalidArgument);
  c = config(1, 1, "");  // disk budget without a directory
  EXPECT_EQ(BlockPool::create(c).status().code(), Code::kInvalidArgument);
  c = config(0, 0, "");
  c.host_bytes = 100;  // below one block
  EXPECT_EQ(BlockPool::create(c).status().code(), Code::kInvalidArgument);
  c = config(1, 0, "");
  c.host_bytes = -1;
  EXPECT_EQ(BlockPool::create(c).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace sf::kvstore
