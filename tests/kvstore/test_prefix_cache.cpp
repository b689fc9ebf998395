// Prefix cache: the hash chain (model id and every token of a block matter from that block on),
// longest-prefix lookup, LRU eviction order, counters, and the end-to-end contract on a synthetic
// model: a prefix-hit prefill gives the same logits and KV as a full recompute.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <vector>

#include "kvstore/prefix_cache.h"
#include "kvstore/prefix_prefill.h"
#include "tests/common/logit_rows.h"
#include "tests/common/test_seed.h"
#include "tests/worker/model/model_test_util.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"
#include "tests/common/nan_max.h"

namespace sf::kvstore {
namespace {

using testing::fresh_seed;

std::vector<int32_t> random_tokens(int64_t n, int vocab, std::mt19937_64& rng) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % uint64_t(vocab));
  return t;
}

constexpr int kLayers = 2, kHeads = 2, kDim = 8;
constexpr int64_t kRow = kHeads * kDim;  // floats per token and layer

std::unique_ptr<BlockPool> host_pool(int64_t blocks) {
  BlockPoolConfig c;
  c.n_kv_heads = kHeads;
  c.head_dim = kDim;
  c.host_bytes = blocks * int64_t(2) * kPoolBlockTokens * kRow * 4;
  auto r = BlockPool::create(c);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return std::move(r).value();
}

// Synthetic KV rows of a prompt: a function of (layer, K/V, position, token) so a cached block
// read back can be checked against what any prompt with that prefix would hold.
struct FakeKv {
  std::vector<std::vector<float>> k, v;
  explicit FakeKv(const std::vector<int32_t>& toks) {
    for (int l = 0; l < kLayers; ++l) {
      k.emplace_back(toks.size() * kRow);
      v.emplace_back(toks.size() * kRow);
      for (size_t t = 0; t < toks.size(); ++t)
        for (int64_t j = 0; j < kRow; ++j) {
          k[size_t(l)][t * kRow + size_t(j)] = float(l * 1000 + toks[t]) + 0.001f * float(j + t);
          v[size_t(l)][t * kRow + size_t(j)] = -float(l * 1000 + toks[t]) - 0.001f * float(j);
        }
    }
  }
  KvRows rows() {
    return [this](int l, bool value) { return value ? v[size_t(l)].data() : k[size_t(l)].data(); };
  }
};

int64_t entry_bytes() { return kLayers * int64_t(2) * kPoolBlockTokens * kRow * 4; }

TEST(PrefixCache, HashChainCoversModelAndEveryToken) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const auto toks = random_tokens(64 * 3, 1000, rng);
  std::span<const int32_t> b0(toks.data(), 64), b1(toks.data() + 64, 64);
  const uint64_t k0 = prefix_block_key(0, "m", b0);
  EXPECT_NE(k0, prefix_block_key(0, "m2", b0));
  EXPECT_NE(prefix_block_key(k0, "m", b1), prefix_block_key(k0 + 1, "m", b1));
  EXPECT_EQ(k0, prefix_block_key(0, "m", b0));

  auto pool = host_pool(64);
  PrefixCache cache(pool.get(), kLayers, 16 * entry_bytes());
  FakeKv kv(toks);
  ASSERT_TRUE(cache.insert("m", toks, kv.rows()).is_ok());
  EXPECT_EQ(cache.lookup("m", toks), 192);
  EXPECT_EQ(cache.lookup("other-model", toks), 0);
  // One changed token in block 1: block 0 still hits, 1 and 2 miss (their keys chain on it).
  auto changed = toks;
  changed[64 + 17] = (changed[64 + 17] + 1) % 1000;
  EXPECT_EQ(cache.lookup("m", changed), 64);
  changed = toks;
  changed[0] = (changed[0] + 1) % 1000;  // the first token: nothing matches
  EXPECT_EQ(cache.lookup("m", changed), 0);
  // Whole blocks only, and capped by max_tokens.
  EXPECT_EQ(cache.lookup("m", std::span<const int32_t>(toks.data(), 150)), 128);
  EXPECT_EQ(cache.lookup("m", toks, 191), 128);
  EXPECT_EQ(cache.lookup("m", std::span<const int32_t>(toks.data(), 63)), 0);
}

TEST(PrefixCache, ReadReturnsTheInsertedKv) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const auto toks = random_tokens(64 * 2 + 10, 1000, rng);
  auto pool = host_pool(16);
  PrefixCache cache(pool.get(), kLayers, 16 * entry_bytes());
  FakeKv kv(toks);
  ASSERT_TRUE(cache.insert("m", toks, kv.rows()).is_ok());
  EXPECT_EQ(cache.stats().inserted_blocks, 2);  // the partial tail block is not cached
  std::vector<std::vector<float>> k(kLayers, std::vector<float>(128 * kRow, std::nanf(""))), v = k;
  ASSERT_TRUE(cache
                  .read("m", toks, 128,
                        [&](int l, bool value) {
                          return value ? v[size_t(l)].data() : k[size_t(l)].data();
                        })
                  .is_ok());
  for (int l = 0; l < kLayers; ++l)
    for (size_t i = 0; i < k[0].size(); ++i) {
      ASSERT_EQ(k[size_t(l)][i], kv.k[size_t(l)][i]) << "layer " << l << " K float " << i;
      ASSERT_EQ(v[size_t(l)][i], kv.v[size_t(l)][i]) << "layer " << l << " V float " << i;
    }
  // More than is cached, or not whole blocks: errors.
  EXPECT_EQ(cache.read("m", toks, 192, {}).code(), Code::kNotFound);
  EXPECT_EQ(cache.read("m", toks, 100, {}).code(), Code::kInvalidArgument);
}

// pin_blocks hands out the prefix's pool blocks per layer, in position order, each pinned once
// (the device prefill copies them itself), with read's errors; unpin_blocks gives them back.
TEST(PrefixCache, PinBlocksHandsOutThePrefixBlocksPinned) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const auto toks = random_tokens(64 * 3, 1000, rng);
  auto pool = host_pool(16);
  PrefixCache cache(pool.get(), kLayers, 16 * entry_bytes());
  FakeKv kv(toks);
  ASSERT_TRUE(cache.insert("m", toks, kv.rows()).is_ok());
  auto pinned = cache.pin_blocks("m", toks, 128);
  ASSERT_TRUE(pinned.is_ok()) << pinned.status().to_string();
  ASSERT_EQ(pinned->size(), size_t(kLayers));
  std::vector<float> kb(size_t(kPoolBlockTokens * kRow)), vb(kb.size());
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_EQ((*pinned)[size_t(l)].size(), 2u);
    for (size_t b = 0; b < 2; ++b) {
      const BlockId id = (*pinned)[size_t(l)][b];
      EXPECT_EQ(pool->pins(id).value(), 1);
      ASSERT_TRUE(pool->read(id, kb.data(), vb.data()).is_ok());
      EXPECT_EQ(kb[0], kv.k[size_t(l)][b * kPoolBlockTokens * kRow]) << "layer " << l << " block " << b;
      EXPECT_EQ(vb.back(), kv.v[size_t(l)][(b + 1) * kPoolBlockTokens * kRow - 1]);
    }
  }
  ASSERT_TRUE(cache.unpin_blocks(*pinned).is_ok());
  for (const auto& layer : *pinned)
    for (BlockId id : layer) EXPECT_EQ(pool->pins(id).value(), 0);
  EXPECT_EQ(cache.pin_blocks("m", toks, 256).status().code(), Code::kNotFound);
  EXPECT_EQ(cache.pin_blocks("m", toks, 100).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(cache.unpin_blocks(*pinned).code(), Code::kInvalidArgument);  // not pinned now
}

TEST(PrefixCache, LruEvictsLeastRecentChainTailsFirst) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const auto a = random_tokens(128, 1000, rng), b = random_tokens(128, 1000, rng),
             c = random_tokens(64, 1000, rng);
  auto pool = host_pool(64);
  PrefixCache cache(pool.get(), kLayers, 4 * entry_bytes());  // four blocks
  FakeKv ka(a), kb(b), kc(c);
  ASSERT_TRUE(cache.insert("m", a, ka.rows()).is_ok());
  ASSERT_TRUE(cache.insert("m", b, kb.rows()).is_ok());
  EXPECT_EQ(cache.stats().used_bytes, 4 * entry_bytes());
  EXPECT_EQ(cache.lookup("m", a), 128);  // a is now the most recent
  ASSERT_TRUE(cache.insert("m", c, kc.rows()).is_ok());
  // b's tail (block 1) was the least recent entry; b's first block and all of a survive.
  EXPECT_EQ(cache.stats().evicted_blocks, 1);
  EXPECT_EQ(cache.lookup("m", b), 64);
  EXPECT_EQ(cache.lookup("m", a), 128);
  EXPECT_EQ(cache.lookup("m", c), 64);
  // Recency now (most recent first): c0, a0, a1, b0. Two new blocks evict b0, then a1 (a tail
  // goes before its head).
  const auto d = random_tokens(128, 1000, rng);
  FakeKv kd(d);
  ASSERT_TRUE(cache.insert("m", d, kd.rows()).is_ok());
  EXPECT_EQ(cache.stats().evicted_blocks, 3);
  EXPECT_EQ(cache.lookup("m", b), 0);
  EXPECT_EQ(cache.lookup("m", a), 64);
  EXPECT_EQ(cache.lookup("m", c), 64);
  EXPECT_EQ(cache.lookup("m", d), 128);
  EXPECT_EQ(cache.stats().used_bytes, 4 * entry_bytes());
  EXPECT_EQ(pool->live_blocks(), 4 * kLayers);  // evicted entries gave their pool blocks back
}

TEST(PrefixCache, HitMissCountersAndBudgetErrors) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const auto a = random_tokens(192, 1000, rng);
  auto pool = host_pool(64);
  PrefixCache cache(pool.get(), kLayers, 2 * entry_bytes());
  FakeKv ka(a);
  EXPECT_EQ(cache.lookup("m", a), 0);
  // Three blocks into a budget of two: the first two are cached, the third is refused.
  const Status st = cache.insert("m", a, ka.rows());
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.to_string();
  EXPECT_EQ(cache.lookup("m", a), 128);
  EXPECT_EQ(cache.lookup("x", a), 0);
  const PrefixCacheStats s = cache.stats();
  EXPECT_EQ(s.lookups, 3);
  EXPECT_EQ(s.hits, 1);
  EXPECT_EQ(s.misses, 2);
  EXPECT_EQ(s.hit_blocks, 2);
  EXPECT_EQ(s.inserted_blocks, 2);
  EXPECT_EQ(s.entries, 2);
  // A pool that runs out is an error too, never a crash (the cache budget is larger here).
  auto small = host_pool(kLayers);  // one entry's worth
  PrefixCache c2(small.get(), kLayers, 8 * entry_bytes());
  EXPECT_EQ(c2.insert("m", a, ka.rows()).code(), Code::kResourceExhausted);
  EXPECT_EQ(c2.lookup("m", a), 64);
}

// An insert that runs out of budget part way keeps what it cached with the prefix most recent,
// so later evictions take its tail first and the prefix stays reachable.
TEST(PrefixCache, PartialInsertKeepsItsPrefixMostRecent) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const auto a = random_tokens(6 * 64, 1000, rng), b = random_tokens(64, 1000, rng);
  auto pool = host_pool(64);
  PrefixCache cache(pool.get(), kLayers, 4 * entry_bytes());  // four blocks
  FakeKv ka(a), kb(b);
  EXPECT_EQ(cache.insert("m", a, ka.rows()).code(), Code::kResourceExhausted);
  EXPECT_EQ(cache.stats().entries, 4);  // (no lookup here: a lookup refreshes the chain itself)
  // One more block evicts one of a's: its last cached block, not its first (which would leave
  // the other three unreachable, still holding budget).
  ASSERT_TRUE(cache.insert("m", b, kb.rows()).is_ok());
  EXPECT_EQ(cache.stats().evicted_blocks, 1);
  EXPECT_EQ(cache.lookup("m", a), 3 * 64);
  EXPECT_EQ(cache.lookup("m", b), 64);
}

// The rows of an insert are written in one batch at its end. When that write fails (here a
// disk tier that is /dev/full), every entry the insert made goes again, its written ones too: no
// entry without its rows, no block or budget leaked, and what was cached before stays.
TEST(PrefixCache, FailedWriteTakesTheInsertBack) {
  namespace fs = std::filesystem;
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const fs::path dir = fs::temp_directory_path() /
                       ("sf-prefix-full-" + std::to_string(::getpid()) + "-" +
                        std::to_string(seed % 100000));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink("/dev/full", dir / "blocks.bin");
  BlockPoolConfig c;
  c.n_kv_heads = kHeads;
  c.head_dim = kDim;
  const int64_t bb = int64_t(2) * kPoolBlockTokens * kRow * 4;
  // Two entries (kLayers blocks each) on the host: a's, then b's first new one; b's second
  // spills to disk, so the failed batch also held a block that was written.
  c.host_bytes = 4 * bb;
  c.disk_bytes = 8 * bb;
  c.disk_dir = dir.string();
  auto r = BlockPool::create(c);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  auto pool = std::move(r).value();
  {
    PrefixCache cache(pool.get(), kLayers, 16 * entry_bytes());
    const auto a = random_tokens(64, 1000, rng);
    FakeKv ka(a);
    ASSERT_TRUE(cache.insert("m", a, ka.rows()).is_ok());  // fits the host tier
    auto b = a;
    const auto tail = random_tokens(128, 1000, rng);
    b.insert(b.end(), tail.begin(), tail.end());
    FakeKv kb(b);
    const Status st = cache.insert("m", b, kb.rows());
    EXPECT_FALSE(st.is_ok());
    std::printf("error: %s\n", st.to_string().c_str());
    const PrefixCacheStats s = cache.stats();
    EXPECT_EQ(s.entries, 1);
    EXPECT_EQ(s.inserted_blocks, 1);
    EXPECT_EQ(s.used_bytes, entry_bytes());
    EXPECT_EQ(pool->stats(Tier::kHost).blocks, kLayers);  // b's host entry freed too
    EXPECT_EQ(pool->stats(Tier::kDisk).blocks, 0);
    EXPECT_EQ(cache.lookup("m", b), 64);
    // a's rows are still there.
    FakeKv got(a);
    for (auto* side : {&got.k, &got.v})
      for (auto& layer : *side) std::fill(layer.begin(), layer.end(), 0.f);
    ASSERT_TRUE(cache.read("m", a, 64, got.rows()).is_ok());
    EXPECT_EQ(got.k, ka.k);
    EXPECT_EQ(got.v, ka.v);
  }
  pool.reset();
  fs::remove_all(dir);
}

// A source that throws part way through an insert (as an allocation failure would): the insert
// takes back every entry it made, frees the blocks of the one it was building, and rethrows.
TEST(PrefixCache, ThrowingInsertLeavesNothingBehind) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  auto pool = host_pool(64);
  PrefixCache cache(pool.get(), kLayers, 16 * entry_bytes());
  const auto a = random_tokens(64, 1000, rng);
  FakeKv ka(a);
  ASSERT_TRUE(cache.insert("m", a, ka.rows()).is_ok());
  auto b = a;
  const auto tail = random_tokens(128, 1000, rng);
  b.insert(b.end(), tail.begin(), tail.end());
  FakeKv kb(b);
  int calls = 0;
  // Calls go (layer 0 K, V, layer 1 K, V) a new block: the 7th is the second new block's
  // layer 1 K, after its layer 0 block was allocated.
  const KvRows throwing = [&](int l, bool value) -> float* {
    if (++calls == 7) throw std::runtime_error("source failed");
    return value ? kb.v[size_t(l)].data() : kb.k[size_t(l)].data();
  };
  EXPECT_THROW((void)cache.insert("m", b, throwing), std::runtime_error);
  EXPECT_EQ(calls, 7);
  const PrefixCacheStats s = cache.stats();
  EXPECT_EQ(s.entries, 1);
  EXPECT_EQ(s.inserted_blocks, 1);
  EXPECT_EQ(s.used_bytes, entry_bytes());
  EXPECT_EQ(pool->stats(Tier::kHost).blocks, kLayers);
  EXPECT_EQ(cache.lookup("m", b), 64);
  // The cache still works: the same insert with a good source caches the rest.
  ASSERT_TRUE(cache.insert("m", b, kb.rows()).is_ok());
  EXPECT_EQ(cache.lookup("m", b), 192);
}

// A throwing insert that went over cached entries of its chain (moving them to the front prefix
// first) leaves the chain refreshed leaf first, as every other exit does: an insert that evicts
// next takes the other chain's tail, never this chain's first block (which would leave its
// second one unreachable, holding budget).
TEST(PrefixCache, ThrowingInsertKeepsThePrefixMoreRecentThanItsTail) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  auto pool = host_pool(64);
  PrefixCache cache(pool.get(), kLayers, 4 * entry_bytes());  // four blocks
  const auto a = random_tokens(128, 1000, rng), x = random_tokens(64, 1000, rng),
             y = random_tokens(192, 1000, rng);
  FakeKv ka(a), kx(x), ky(y);
  ASSERT_TRUE(cache.insert("m", a, ka.rows()).is_ok());
  ASSERT_TRUE(cache.insert("m", x, kx.rows()).is_ok());  // LRU: x, a0, a1 (most recent first)
  auto b = a;
  const auto tail = random_tokens(64, 1000, rng);
  b.insert(b.end(), tail.begin(), tail.end());
  FakeKv kb(b);
  const KvRows throwing = [](int, bool) -> float* { throw std::runtime_error("source failed"); };
  EXPECT_THROW((void)cache.insert("m", b, throwing), std::runtime_error);
  EXPECT_EQ(cache.stats().entries, 3);
  // y's three blocks need two evictions: x and then a's tail (a1), which leaves a0 cached.
  EXPECT_EQ(cache.insert("m", y, ky.rows()).code(), Code::kOk);
  EXPECT_EQ(cache.stats().evicted_blocks, 2);
  EXPECT_EQ(cache.lookup("m", a), 64);
  EXPECT_EQ(cache.lookup("m", x), 0);
}

// An entry whose blocks a reader holds pinned (pin_blocks) is not evicted: its blocks could not
// be freed, and would stay allocated with nothing referring to them. An insert that needs its
// room evicts other entries, or fails with the budget error naming the pinned entries; once
// unpinned, every block the pool holds is an entry's.
TEST(PrefixCache, PinnedEntriesAreNotEvicted) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  auto pool = host_pool(64);
  PrefixCache cache(pool.get(), kLayers, 2 * entry_bytes());  // two blocks
  const auto a = random_tokens(64, 1000, rng), x = random_tokens(64, 1000, rng),
             b = random_tokens(128, 1000, rng);
  FakeKv ka(a), kx(x), kb(b);
  ASSERT_TRUE(cache.insert("m", a, ka.rows()).is_ok());
  ASSERT_TRUE(cache.insert("m", x, kx.rows()).is_ok());  // LRU: x, a
  auto pinned = cache.pin_blocks("m", a, 64);
  ASSERT_TRUE(pinned.is_ok()) << pinned.status().to_string();
  // b's first block evicts x (a, the least recent, is pinned); its second finds no room.
  const Status st = cache.insert("m", b, kb.rows());
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.to_string();
  EXPECT_NE(st.message().find("1 pinned by readers"), std::string::npos) << st.to_string();
  EXPECT_EQ(cache.stats().entries, 2);
  EXPECT_EQ(cache.lookup("m", x), 0);
  EXPECT_EQ(cache.lookup("m", b), 64);
  EXPECT_EQ(pool->stats(Tier::kHost).blocks, 2 * kLayers);
  // a's rows are intact.
  FakeKv got(a);
  for (auto* side : {&got.k, &got.v})
    for (auto& layer : *side) std::fill(layer.begin(), layer.end(), 0.f);
  ASSERT_TRUE(cache.read("m", a, 64, got.rows()).is_ok());
  EXPECT_EQ(got.k, ka.k);
  ASSERT_TRUE(cache.unpin_blocks(*pinned).is_ok());
  // Unpinned, a is evictable again: b's whole prompt now fits, and no block is left over.
  ASSERT_TRUE(cache.insert("m", b, kb.rows()).is_ok());
  EXPECT_EQ(cache.lookup("m", b), 128);
  EXPECT_EQ(cache.lookup("m", a), 0);
  EXPECT_EQ(pool->stats(Tier::kHost).blocks, cache.stats().entries * kLayers);
}

model::ModelConfig tiny_config() {
  model::ModelConfig c = testing::tiny_config(kLayers);
  c.n_kv_heads = kHeads;
  c.head_dim = kDim * 2;
  return c;
}

struct Diff {
  double max_abs = 0, max_ref = 0;
  void add(const float* a, const float* b, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      max_abs = testing::nan_max(max_abs, double(std::fabs(a[i] - b[i])));
      max_ref = std::max(max_ref, double(std::fabs(b[i])));
    }
  }
  double rel() const { return max_ref > 0 ? max_abs / max_ref : max_abs; }
};

// The contract: a request whose prefix is cached computes only its suffix and gets the logits
// and KV of a full recompute. The same kernels run on the same rows against the same cached K/V;
// only the summation order can differ (BLAS and attention tiles see a different row count), a
// few fp32 ulp (measured ~3e-7 relative). Allowed: 1e-5 relative to the largest magnitude, far
// below what a wrong position or a wrong block (O(1) differences) would give.
TEST(PrefixPrefill, PrefixHitEqualsFullRecompute) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const model::ModelConfig cfg = tiny_config();
  auto m = model::Model::synthetic(cfg, seed);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  BlockPoolConfig pc;
  pc.n_kv_heads = cfg.n_kv_heads;
  pc.head_dim = cfg.head_dim;
  pc.host_bytes = int64_t(64) << 20;
  auto pool = BlockPool::create(pc);
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  PrefixCache cache(pool->get(), cfg.n_layers, int64_t(32) << 20);

  // A: 200 tokens (3 whole blocks cached). B shares A's first 150 tokens (2 whole blocks).
  const auto a = random_tokens(200, cfg.vocab, rng);
  auto b = a;
  b.resize(150);
  const auto tail = random_tokens(123, cfg.vocab, rng);
  b.insert(b.end(), tail.begin(), tail.end());
  PrefixPrefillOptions opt;
  opt.prefill.all_logits = true;
  opt.prefill.chunk = 96;  // several chunks, unaligned to blocks
  PrefixPrefillStats st;
  auto ra = prefill_with_prefix_cache(*m, &cache, "tiny-seed", a, opt, &st);
  ASSERT_TRUE(ra.is_ok()) << ra.status().to_string();
  EXPECT_EQ(st.reused_tokens, 0);
  EXPECT_TRUE(st.insert_status.is_ok()) << st.insert_status.to_string();
  EXPECT_EQ(cache.stats().inserted_blocks, 3);

  auto rb = prefill_with_prefix_cache(*m, &cache, "tiny-seed", b, opt, &st);
  ASSERT_TRUE(rb.is_ok()) << rb.status().to_string();
  EXPECT_EQ(st.reused_tokens, 128);
  EXPECT_EQ(st.computed_tokens, int64_t(b.size()) - 128);
  model::PrefillOptions full_opt = opt.prefill;
  auto full = model::prefill(*m, b, full_opt);
  ASSERT_TRUE(full.is_ok()) << full.status().to_string();

  ASSERT_EQ(rb->kv.n_tokens, full->kv.n_tokens);
  Diff dk, dl;
  for (int l = 0; l < cfg.n_layers; ++l) {
    ASSERT_EQ(rb->kv.k[size_t(l)].size(), full->kv.k[size_t(l)].size());
    dk.add(rb->kv.k[size_t(l)].data(), full->kv.k[size_t(l)].data(), rb->kv.k[size_t(l)].size());
    dk.add(rb->kv.v[size_t(l)].data(), full->kv.v[size_t(l)].data(), rb->kv.v[size_t(l)].size());
  }
  // The hit computed rows 128.. only: compare them with the same rows of the full run.
  ASSERT_EQ(rb->n_logit_rows, int64_t(b.size()) - 128);
  const float* full_rows = full->logits.data() + 128 * cfg.vocab;
  dl.add(rb->logits.data(), full_rows, rb->logits.size());
  std::printf(
      "prefix hit vs full recompute: KV max abs diff %.3g (rel %.3g), logits max abs diff "
      "%.3g (rel %.3g)\n",
      dk.max_abs, dk.rel(), dl.max_abs, dl.rel());
  EXPECT_LE(dk.rel(), 1e-5);
  EXPECT_LE(dl.rel(), 1e-5);
  if (rb->first_token != full->first_token)  // only at a near-tie of the full run's top two
    EXPECT_LT(testing::top2_gap(full->logits.data() + full->logits.size() - cfg.vocab, cfg.vocab),
              2 * dl.max_abs)
        << "first tokens " << rb->first_token << " vs " << full->first_token;

  // A different model id never reuses the other model's blocks.
  ASSERT_TRUE(prefill_with_prefix_cache(*m, &cache, "other", b, opt, &st).is_ok());
  EXPECT_EQ(st.reused_tokens, 0);
  // The whole prompt cached: the last token is still computed, so logits exist.
  const std::vector<int32_t> a192(a.begin(), a.begin() + 192);
  auto rc = prefill_with_prefix_cache(*m, &cache, "tiny-seed", a192, opt, &st);
  ASSERT_TRUE(rc.is_ok()) << rc.status().to_string();
  EXPECT_EQ(st.reused_tokens, 128);
  EXPECT_EQ(st.computed_tokens, 64);
  auto full_c = model::prefill(*m, a192, full_opt);
  ASSERT_TRUE(full_c.is_ok());
  Diff dc;
  dc.add(rc->logits.data() + (rc->n_logit_rows - 1) * cfg.vocab,
         full_c->logits.data() + (full_c->n_logit_rows - 1) * cfg.vocab, size_t(cfg.vocab));
  std::printf("whole-prompt hit: last-row logits max abs diff %.3g (rel %.3g)\n", dc.max_abs,
              dc.rel());
  EXPECT_LE(dc.rel(), 1e-5);
}

// The cache serves dense attention only, on both paths: a sparse prefill is refused before it
// can insert K/V that later dense requests would be served.
TEST(PrefixPrefill, SparseAttentionIsRefused) {
  auto m = model::Model::synthetic(tiny_config(), 1);
  ASSERT_TRUE(m.is_ok());
  auto pool = host_pool(8);
  PrefixCache cache(pool.get(), kLayers, 4 * entry_bytes());
  auto sc = model::sparse_config_for_mode("a-shape", m->config().n_layers, m->config().n_heads);
  ASSERT_TRUE(sc.is_ok()) << sc.status().to_string();
  PrefixPrefillOptions opt;
  opt.prefill.sparse = &sc.value();
  const std::vector<int32_t> t(70, 3);
  auto r = prefill_with_prefix_cache(*m, &cache, "tiny", t, opt, nullptr);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kUnsupported) << r.status().to_string();
  EXPECT_EQ(cache.stats().entries, 0) << "nothing was cached";
}

TEST(PrefixPrefill, GeometryMismatchIsAnError) {
  auto m = model::Model::synthetic(tiny_config(), 1);
  ASSERT_TRUE(m.is_ok());
  auto pool = host_pool(8);  // head_dim kDim, the model has 2 * kDim
  PrefixCache cache(pool.get(), kLayers, 4 * entry_bytes());
  const std::vector<int32_t> t(70, 3);
  auto r = prefill_with_prefix_cache(*m, &cache, "tiny", t, {}, nullptr);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("geometry"), std::string::npos) << r.status().to_string();
}

}  // namespace
}  // namespace sf::kvstore
