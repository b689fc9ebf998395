// Prefill-driven tiering on a small synthetic model: each layer's K/V go into the block pool as
// the forward produces them, the hot set (sink, recent window, top-scored block) stays on the
// host tier, cold blocks land on disk; reading any layer back gives the forward's own KV cache
// bit for bit; per-tier metrics expose the same counts. Also the --kv-pool spec parser.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "common/metrics.h"
#include "kvstore/tiered_kv.h"
#include "tests/common/test_seed.h"
#include "tests/worker/model/model_test_util.h"
#include "worker/model/model.h"

namespace sf::kvstore {
namespace {

model::ModelConfig tiny_config() { return testing::tiny_config(3); }

struct Fixture {
  uint64_t seed;
  model::ModelConfig cfg = tiny_config();
  std::vector<int32_t> tokens;
  std::string dir;
  Fixture() {
    seed = testing::fresh_seed();
    std::mt19937_64 rng(seed);
    tokens.resize(8 * kPoolBlockTokens + 17);  // 9 blocks per layer, the last one partial
    for (auto& t : tokens) t = int32_t(rng() % uint64_t(cfg.vocab));
    dir = (std::filesystem::temp_directory_path() /
           ("sf_tiered_kv_" + std::to_string(::getpid()) + "_" + std::to_string(seed)))
              .string();
  }
  ~Fixture() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  int64_t block_bytes() const { return int64_t(2) * kPoolBlockTokens * cfg.n_kv_heads * cfg.head_dim * 4; }
  // A host + disk pool of the model's block shape, budgets in blocks.
  BlockPoolConfig pool_config(int64_t host_blocks, int64_t disk_blocks) const {
    BlockPoolConfig pc;
    pc.n_kv_heads = cfg.n_kv_heads;
    pc.head_dim = cfg.head_dim;
    pc.host_bytes = host_blocks * block_bytes();
    pc.disk_bytes = disk_blocks * block_bytes();
    pc.disk_dir = dir;
    return pc;
  }
};

TEST(TieredKv, PrefillTiersLayersAndReadsBackBitExact) {
  Fixture f;
  auto m = model::Model::synthetic(f.cfg, f.seed);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  auto pool = BlockPool::create(f.pool_config(9, 64));  // 3 hot blocks per layer
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  TieredKvConfig tc;
  tc.n_layers = f.cfg.n_layers;
  tc.n_kv_heads = f.cfg.n_kv_heads;
  tc.head_dim = f.cfg.head_dim;
  auto tk = TieredKv::create(pool->get(), tc);
  ASSERT_TRUE(tk.is_ok()) << tk.status().to_string();

  model::PrefillOptions opt;
  opt.importance_window = 32;
  auto plain = model::prefill(m.value(), f.tokens, opt);
  ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
  int calls = 0;
  auto hook = (*tk)->hook();
  opt.on_layer_kv = [&](int l, const TensorView& k, const TensorView& v,
                        std::span<const float> imp) {
    EXPECT_EQ(l, calls++);  // one call per layer, in order, before the next layer runs
    return hook(l, k, v, imp);
  };
  auto r = model::prefill(m.value(), f.tokens, opt);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(calls, f.cfg.n_layers);
  // The hook only reads: logits are bit-identical to a run without it.
  ASSERT_EQ(r->logits.size(), plain->logits.size());
  EXPECT_EQ(std::memcmp(r->logits.data(), plain->logits.data(), r->logits.size() * 4), 0);

  const int64_t nb = 9;
  const BlockPool& p = **pool;
  for (int l = 0; l < f.cfg.n_layers; ++l) {
    const auto& ids = (*tk)->blocks(l);
    ASSERT_EQ(int64_t(ids.size()), nb);
    // Reassembled from host and disk, bit for bit the forward's cache.
    std::vector<float> k, v;
    k.assign(r->kv.k[size_t(l)].size() + 5, -7.f);  // poisoned, resized by read_layer
    ASSERT_TRUE((*tk)->read_layer(l, &k, &v).is_ok());
    ASSERT_EQ(k.size(), r->kv.k[size_t(l)].size());
    ASSERT_EQ(v.size(), r->kv.v[size_t(l)].size());
    EXPECT_EQ(std::memcmp(k.data(), r->kv.k[size_t(l)].data(), k.size() * 4), 0) << "layer " << l;
    EXPECT_EQ(std::memcmp(v.data(), r->kv.v[size_t(l)].data(), v.size() * 4), 0) << "layer " << l;
    // Hot set on host: sink block, last block, the best-scored middle block; the rest on disk.
    const auto& sc = (*tk)->scores(l);
    ASSERT_EQ(int64_t(sc.size()), nb);
    // Scores are max of the pooled importance over the block: recompute for one block.
    const auto& imp = r->importance[size_t(l)];
    EXPECT_EQ(sc[3], block_score(imp, f.cfg.n_kv_heads, int64_t(f.tokens.size()), 3 * 64, 4 * 64));
    float top_s = -1.f;
    int64_t top = -1;
    for (int64_t b = 1; b + 1 < nb; ++b)
      if (sc[size_t(b)] > top_s) top_s = sc[size_t(b)], top = b;
    ASSERT_GT(top_s, 0.f);  // importance is real, never all zeros
    for (int64_t b = 0; b < nb; ++b) {
      const bool hot = b == 0 || b == nb - 1 || b == top;
      auto t = p.tier_of(ids[size_t(b)]);
      ASSERT_TRUE(t.is_ok());
      EXPECT_EQ(t.value(), hot ? Tier::kHost : Tier::kDisk) << "layer " << l << " block " << b;
    }
    EXPECT_EQ((*tk)->placement(l).hot, 3);
  }
  const TierStats host = p.stats(Tier::kHost), disk = p.stats(Tier::kDisk);
  EXPECT_EQ(host.blocks, 9);
  EXPECT_EQ(disk.blocks, 18);
  EXPECT_EQ(host.blocks + disk.blocks, p.live_blocks());
  EXPECT_EQ(host.used_bytes, 9 * f.block_bytes());
  EXPECT_EQ(disk.used_bytes, 18 * f.block_bytes());
  // Layer 0 fits on host (then 6 demoted); layers 1 and 2 find 6 and 3 free host slots, so
  // 3 + 6 of their blocks spill straight to disk.
  EXPECT_EQ(disk.spilled_in, 9);

  MetricsRegistry reg;
  ASSERT_TRUE(pool_metrics_export(p, &reg).is_ok());
  const std::string text = reg.render();
  int64_t demoted = 0, promoted = 0;
  for (int l = 0; l < f.cfg.n_layers; ++l) {
    demoted += (*tk)->placement(l).demoted;
    promoted += (*tk)->placement(l).promoted;
  }
  auto has = [&](const std::string& line) {
    EXPECT_NE(text.find("\n" + line + "\n"), std::string::npos) << line << "\n" << text;
  };
  has("# TYPE sparsefill_kv_pool_bytes gauge");
  has("# TYPE sparsefill_kv_pool_blocks_moved_total counter");
  has("sparsefill_kv_pool_bytes{tier=\"host\"} " + std::to_string(9 * f.block_bytes()));
  has("sparsefill_kv_pool_bytes{tier=\"disk\"} " + std::to_string(18 * f.block_bytes()));
  has("sparsefill_kv_pool_bytes{tier=\"device\"} 0");
  has("sparsefill_kv_pool_blocks{tier=\"host\"} 9");
  has("sparsefill_kv_pool_blocks{tier=\"disk\"} 18");
  has("sparsefill_kv_pool_spilled_total{tier=\"disk\"} 9");
  has("sparsefill_kv_pool_blocks_moved_total{tier=\"host\",direction=\"down\"} " +
      std::to_string(demoted));
  has("sparsefill_kv_pool_blocks_moved_total{tier=\"disk\",direction=\"up\"} " +
      std::to_string(promoted));
  has("sparsefill_kv_pool_bytes_moved_total{tier=\"host\",direction=\"down\"} " +
      std::to_string(demoted * f.block_bytes()));
  EXPECT_GE(demoted, 6);  // layer 0 alone demotes 6

  // Freed with the TieredKv.
  tk->reset();
  EXPECT_EQ(p.live_blocks(), 0);
}

// Without keep_kv the forward drops each layer's K/V once its hook has run: the pool holds the
// only full copy, and the forward never holds more than one layer's K/V (kv_peak_bytes), against
// every layer's when kept. What the pool reads back is still bit for bit the kept run's cache, and
// the logits are unchanged.
TEST(TieredKv, NotKeptKvLivesOnlyInThePool) {
  Fixture f;
  auto m = model::Model::synthetic(f.cfg, f.seed);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  auto pool = BlockPool::create(f.pool_config(6, 64));
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  auto tk = TieredKv::create(pool->get(), {f.cfg.n_layers, f.cfg.n_kv_heads, f.cfg.head_dim});
  ASSERT_TRUE(tk.is_ok()) << tk.status().to_string();

  model::PrefillOptions kept;
  kept.importance_window = 16;
  auto ref = model::prefill(m.value(), f.tokens, kept);
  ASSERT_TRUE(ref.is_ok()) << ref.status().to_string();
  const int64_t layer_bytes =
      int64_t(2) * int64_t(f.tokens.size()) * f.cfg.n_kv_heads * f.cfg.head_dim * 4;
  EXPECT_EQ(ref->kv_peak_bytes, f.cfg.n_layers * layer_bytes);

  model::PrefillOptions opt = kept;
  opt.keep_kv = false;
  opt.on_layer_kv = (*tk)->hook();
  auto r = model::prefill(m.value(), f.tokens, opt);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_TRUE(r->kv.k.empty());
  EXPECT_EQ(r->kv_peak_bytes, layer_bytes);
  ASSERT_EQ(r->logits.size(), ref->logits.size());
  EXPECT_EQ(std::memcmp(r->logits.data(), ref->logits.data(), r->logits.size() * 4), 0);
  for (int l = 0; l < f.cfg.n_layers; ++l) {
    std::vector<float> k, v;
    ASSERT_TRUE((*tk)->read_layer(l, &k, &v).is_ok());
    ASSERT_EQ(k.size(), ref->kv.k[size_t(l)].size());
    EXPECT_EQ(std::memcmp(k.data(), ref->kv.k[size_t(l)].data(), k.size() * 4), 0) << "layer " << l;
    EXPECT_EQ(std::memcmp(v.data(), ref->kv.v[size_t(l)].data(), v.size() * 4), 0) << "layer " << l;
  }
  EXPECT_EQ((*pool)->stats(Tier::kHost).blocks, 6);
  EXPECT_EQ((*pool)->live_blocks(), 9 * f.cfg.n_layers);
}

// model::extend calls the hook again with the whole cache (prefix + new rows): the layer's blocks
// are replaced, not appended, and the pool holds exactly one copy.
TEST(TieredKv, ExtendReplacesLayerBlocks) {
  Fixture f;
  auto m = model::Model::synthetic(f.cfg, f.seed);
  ASSERT_TRUE(m.is_ok());
  auto pool = BlockPool::create(f.pool_config(6, 64));
  ASSERT_TRUE(pool.is_ok());
  auto tk = TieredKv::create(pool->get(), {f.cfg.n_layers, f.cfg.n_kv_heads, f.cfg.head_dim});
  ASSERT_TRUE(tk.is_ok());
  model::PrefillOptions opt;
  opt.importance_window = 16;
  opt.on_layer_kv = (*tk)->hook();
  model::PrefillResult r;
  const std::span<const int32_t> all(f.tokens);
  ASSERT_TRUE(model::extend(m.value(), all.first(130), opt, &r).is_ok());
  EXPECT_EQ((*pool)->live_blocks(), 3 * f.cfg.n_layers);
  ASSERT_TRUE(model::extend(m.value(), all.subspan(130), opt, &r).is_ok());
  EXPECT_EQ((*pool)->live_blocks(), 9 * f.cfg.n_layers);
  for (int l = 0; l < f.cfg.n_layers; ++l) {
    EXPECT_EQ((*tk)->n_tokens(l), int64_t(f.tokens.size()));
    std::vector<float> k, v;
    ASSERT_TRUE((*tk)->read_layer(l, &k, &v).is_ok());
    ASSERT_EQ(k.size(), r.kv.k[size_t(l)].size());
    EXPECT_EQ(std::memcmp(k.data(), r.kv.k[size_t(l)].data(), k.size() * 4), 0) << "layer " << l;
    EXPECT_EQ(std::memcmp(v.data(), r.kv.v[size_t(l)].data(), v.size() * 4), 0) << "layer " << l;
    EXPECT_EQ((*tk)->placement(l).hot, 2);  // 6 host blocks / 3 layers
  }
  EXPECT_EQ((*pool)->stats(Tier::kHost).blocks, 6);
  EXPECT_EQ((*pool)->stats(Tier::kDisk).blocks, 21);
}

TEST(TieredKv, NoTierHasRoomIsAClearError) {
  Fixture f;
  auto m = model::Model::synthetic(f.cfg, f.seed);
  ASSERT_TRUE(m.is_ok());
  auto pool = BlockPool::create(f.pool_config(4, 2));
  ASSERT_TRUE(pool.is_ok());
  auto tk = TieredKv::create(pool->get(), {f.cfg.n_layers, f.cfg.n_kv_heads, f.cfg.head_dim});
  ASSERT_TRUE(tk.is_ok());
  model::PrefillOptions opt;
  opt.on_layer_kv = (*tk)->hook();
  auto r = model::prefill(m.value(), f.tokens, opt);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kResourceExhausted);
  EXPECT_NE(r.status().message().find("tiered kv: layer 0 block 6 of 9 fits no tier"),
            std::string::npos)
      << r.status().message();
  EXPECT_EQ((*pool)->live_blocks(), 0);  // nothing half-placed is left behind
  // check_room says so before the prefill (host and disk together against every layer's
  // blocks), and passes where the tiers hold them exactly.
  const Status room = (*tk)->check_room(int64_t(f.tokens.size()));
  EXPECT_EQ(room.code(), Code::kResourceExhausted) << room.to_string();
  EXPECT_NE(room.message().find("the host and disk tiers hold 6 blocks"), std::string::npos)
      << room.message();
  const int64_t need = int64_t(f.cfg.n_layers) *
                       ((int64_t(f.tokens.size()) + kPoolBlockTokens - 1) / kPoolBlockTokens);
  tk->reset();  // (one pool a disk directory)
  pool->reset();
  auto enough = BlockPool::create(f.pool_config(4, need - 4));
  ASSERT_TRUE(enough.is_ok());
  auto tk2 = TieredKv::create(enough->get(), {f.cfg.n_layers, f.cfg.n_kv_heads, f.cfg.head_dim});
  ASSERT_TRUE(tk2.is_ok());
  EXPECT_TRUE((*tk2)->check_room(int64_t(f.tokens.size())).is_ok());
  EXPECT_EQ((*tk2)->check_room(int64_t(f.tokens.size()) + kPoolBlockTokens).code(),
            Code::kResourceExhausted);
}

TEST(TieredKv, CreateValidates) {
  Fixture f;
  BlockPoolConfig pc;
  pc.n_kv_heads = 2;
  pc.head_dim = 16;
  pc.host_bytes = f.block_bytes();
  auto pool = BlockPool::create(pc);
  ASSERT_TRUE(pool.is_ok());
  auto no_disk = TieredKv::create(pool->get(), {3, 2, 16});  // host only: nowhere for cold blocks
  ASSERT_FALSE(no_disk.is_ok());
  EXPECT_NE(no_disk.status().message().find("whose budget is 0"), std::string::npos);
  EXPECT_FALSE(TieredKv::create(pool->get(), {3, 2, 32}).is_ok());  // block size mismatch
  EXPECT_FALSE(TieredKv::create(nullptr, {3, 2, 16}).is_ok());
  {
    BlockPoolConfig two = pc;  // host and disk: a valid TieredKv, no layer placed yet
    two.disk_bytes = 4 * f.block_bytes();
    two.disk_dir = f.dir;
    auto p2 = BlockPool::create(two);
    ASSERT_TRUE(p2.is_ok()) << p2.status().to_string();
    auto tk = TieredKv::create(p2->get(), {3, 2, 16});
    ASSERT_TRUE(tk.is_ok()) << tk.status().to_string();
    std::vector<float> k, v;
    const Status st = (*tk)->read_layer(1, &k, &v);  // was ok with 0 rows
    EXPECT_EQ(st.code(), Code::kNotFound) << st.to_string();
  }
  TieredKvConfig c{3, 2, 16};
  c.fast = Tier::kDisk;  // nothing below it
  EXPECT_FALSE(TieredKv::create(pool->get(), c).is_ok());
  pc.host_bytes = 0;
  pc.disk_bytes = f.block_bytes();
  pc.disk_dir = f.dir;
  auto disk_only = BlockPool::create(pc);
  ASSERT_TRUE(disk_only.is_ok());
  auto e = TieredKv::create(disk_only->get(), {3, 2, 16});
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.status().message().find("no room for one block"), std::string::npos);
}

// The device path's preconditions, checked before anything is queued; what it does on a GPU is
// test_gpu_forward's TieredKvFromDeviceDuringGpuPrefill.
TEST(TieredKv, DevicePathValidates) {
  Fixture f;
  auto pool = BlockPool::create(f.pool_config(4, 40));
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  auto tk = TieredKv::create(pool->get(), {f.cfg.n_layers, f.cfg.n_kv_heads, f.cfg.head_dim});
  ASSERT_TRUE(tk.is_ok());
  const std::vector<float> rows(size_t(f.cfg.n_kv_heads * f.cfg.head_dim) * 70, 1.f);
  // The fast tier here is host: device rows need a device fast tier.
  const Status e = (*tk)->enqueue_device(0, rows.data(), rows.data(), 70, nullptr);
  EXPECT_EQ(e.code(), Code::kInvalidArgument);
  EXPECT_NE(e.message().find("device as the fast tier"), std::string::npos) << e.message();
  EXPECT_EQ((*tk)->place_device(0, {}).code(), Code::kInvalidArgument);  // nothing enqueued
  EXPECT_EQ((*tk)->place_device(7, {}).code(), Code::kInvalidArgument);
  EXPECT_EQ((*pool)->live_blocks(), 0);
  // A block on disk (or a CPU build) is refused by the pool before any copy is queued.
  auto id = (*pool)->alloc(Tier::kDisk);
  ASSERT_TRUE(id.is_ok());
  const std::vector<BlockId> one = {id.value()};
  const Status w = (*pool)->write_from_device_async(one, rows.data(), rows.data(), 64, nullptr);
  EXPECT_TRUE(w.code() == Code::kInvalidArgument || w.code() == Code::kUnsupported) << w.to_string();
  EXPECT_EQ((*pool)->write_from_device_async(one, rows.data(), rows.data(), 65, nullptr).code() ==
                Code::kOk,
            false);  // one block cannot hold 65 rows
  // The CPU forward refuses the sink.
  auto m = model::Model::synthetic(f.cfg, f.seed);
  ASSERT_TRUE(m.is_ok());
  model::PrefillOptions o;
  o.on_layer_kv_device = (*tk)->device_sink();
  EXPECT_EQ(model::prefill(m.value(), f.tokens, o).status().code(), Code::kUnsupported);
}

TEST(KvPoolSpec, Parses) {
  auto a = kv_pool_spec_parse("host=64M,disk=/tmp/kv:2G");
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  EXPECT_EQ(a->host_bytes, int64_t(64) << 20);
  EXPECT_EQ(a->disk_dir, "/tmp/kv");
  EXPECT_EQ(a->disk_bytes, int64_t(2) << 30);
  auto b = kv_pool_spec_parse("disk=/tmp/kv,host=4096");
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(b->host_bytes, 4096);
  EXPECT_EQ(b->disk_bytes, -1);
  // A ':' inside the directory is the directory's; a size only follows the last one.
  auto c = kv_pool_spec_parse("host=1M,disk=/data/run:1/kv");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->disk_dir, "/data/run:1/kv");
  EXPECT_EQ(c->disk_bytes, -1);
  auto d = kv_pool_spec_parse("host=1M,disk=/data/run:1/kv:8G");
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->disk_dir, "/data/run:1/kv");
  EXPECT_EQ(d->disk_bytes, int64_t(8) << 30);
  // The device forward's form: device fast, host cold, no disk.
  auto g = kv_pool_spec_parse("device=256M,host=4G");
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  EXPECT_EQ(g->device_bytes, int64_t(256) << 20);
  EXPECT_EQ(g->host_bytes, int64_t(4) << 30);
  EXPECT_TRUE(g->disk_dir.empty());
  // ... and with a disk tier under the host one.
  auto h = kv_pool_spec_parse("device=1G,host=2G,disk=/tmp/kv:64G");
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_EQ(h->device_bytes, int64_t(1) << 30);
  EXPECT_EQ(h->host_bytes, int64_t(2) << 30);
  EXPECT_EQ(h->disk_dir, "/tmp/kv");
  EXPECT_EQ(h->disk_bytes, int64_t(64) << 30);
  EXPECT_EQ(kv_pool_spec_parse("disk=/tmp/kv,device=1G,host=1G").value().disk_bytes, -1);
  EXPECT_EQ(kv_pool_spec_parse("host=1M,disk=d").value().device_bytes, 0);
  EXPECT_EQ(kv_pool_spec_parse("host=1k,disk=d").value().host_bytes, 1024);
  EXPECT_EQ(kv_pool_spec_parse("host=3GB,disk=d").value().host_bytes, int64_t(3) << 30);
  for (const char* bad : {"", "host", "host=", "host=1.5G", "host=64Q", "host=-1", "host=0,disk=d",
                          "gpu=1G", "host=1M,host=2M", "host=1M,disk=", "host=1M,disk=:1G",
                          "host=1M,disk=/tmp/kv:x", "host=99999999999T", "disk=/tmp/kv", "host=1M",
                          "device=1G", "device=0,host=1G", "device=1G,host=0", "device=1G,device=1G,host=1M",
                          "device=1G,disk=/tmp/kv", "device=1G,host=1G,disk=", "device=x,host=1G"}) {
    auto r = kv_pool_spec_parse(bad);
    EXPECT_FALSE(r.is_ok()) << bad;
    if (!r.is_ok()) EXPECT_EQ(r.status().message().rfind("--kv-pool", 0), 0u) << r.status().message();
  }
}

TEST(KvPoolSpec, DirCheck) {
  Fixture f;
  EXPECT_TRUE(kv_pool_dir_check(f.dir + "/sub").is_ok());
  EXPECT_TRUE(std::filesystem::is_directory(f.dir + "/sub"));
  auto st = kv_pool_dir_check("/dev/null/kv");
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("cannot be created"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace sf::kvstore
