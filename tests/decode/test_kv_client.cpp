// KV export (format 4) and the decode-side client: round trips for full and partial retention,
// sharded exports (parts of each layer written separately), per-block metadata against a
// recomputation, K/V encodings (bf16, int8, int4) loading as exactly the encoding's round trip,
// and a clear error for every bad input.
#include <gtest/gtest.h>

#include <stdexcept>

#include <algorithm>
#include <boost/json.hpp>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "common/checksum.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "decode/kv_client.h"
#include "decode/paged_kv.h"
#include "kvstore/position_runs.h"
#include "tests/decode/decode_test_util.h"

namespace sf {
namespace {
namespace fs = std::filesystem;
using testing::TempDir;

constexpr int kN = 300;  // 4 full blocks + a partial one

class KvClient : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::fresh_seed();
    auto m = model::Model::synthetic(testing::tiny_config(), seed_);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    model_.emplace(std::move(m).value());
    toks_ = testing::random_tokens(kN, 101, seed_ + 1);
    model::PrefillOptions opt;
    opt.importance_window = 32;
    opt.importance_pool = 7;
    auto r = model::prefill(*model_, toks_, opt);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    pr_ = std::move(r).value();
    imp_ = testing::scores_of(pr_, 32, 7);
    hash_ = decode::model_compat_hash(*model_);
  }
  std::string export_to(const std::string& name, const kvstore::Retention* ret,
                        kvstore::KvEncoding enc = kvstore::KvEncoding::kF32,
                        std::optional<kvstore::KvEncoding> low = std::nullopt) {
    const std::string d = tmp_.sub(name);
    Status st = testing::export_prefill(*model_, toks_, pr_, d, ret, &imp_, enc, low);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return d;
  }
  // The prefill's export spec (its tokens and importance), stored as `enc`; with a retention, its
  // low tier as `low`.
  kvstore::KvExportSpec spec_of(kvstore::KvEncoding enc, const kvstore::Retention* ret = nullptr,
                                std::optional<kvstore::KvEncoding> low = std::nullopt) const {
    kvstore::KvExportSpec spec = kvstore::model_export_spec(*model_);
    spec.n_tokens = kN;
    spec.token_ids = toks_;
    spec.first_token = pr_.first_token;
    spec.importance = &imp_;
    spec.encoding = enc;
    spec.retention = ret;
    spec.encoding_low = low;
    return spec;
  }
  // A copy of a good export to break.
  std::string copy_of(const std::string& src, const std::string& name) {
    const std::string d = tmp_.sub(name);
    fs::copy(src, d, fs::copy_options::recursive);
    return d;
  }
  // load_kv_export(dir, expected_hash) fails with `code` and a message containing `needle`.
  static void expect_load_err(const std::string& dir, const std::string& expected_hash, Code code,
                              const std::string& needle) {
    auto r = decode::load_kv_export(dir, expected_hash);
    ASSERT_FALSE(r.is_ok()) << "loaded " << dir;
    EXPECT_EQ(r.status().code(), code) << r.status().to_string();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
  }
  // Two paged caches with the same pages, block for block: positions, rows and key min/max
  // equal; f(x, y) then checks more of each pair of blocks.
  template <typename F>
  static void expect_same_blocks(const decode::PagedKvCache& a, const decode::PagedKvCache& b,
                                 F&& f) {
    for (int l = 0; l < a.n_layers(); ++l)
      for (int h = 0; h < a.n_kv_heads(); ++h) {
        ASSERT_EQ(a.pages(l, h).size(), b.pages(l, h).size());
        for (size_t i = 0; i < a.pages(l, h).size(); ++i) {
          const decode::KvBlock& x = a.block(a.pages(l, h)[i]);
          const decode::KvBlock& y = b.block(b.pages(l, h)[i]);
          EXPECT_EQ(x.n, y.n);
          EXPECT_EQ(x.pos, y.pos);
          EXPECT_EQ(x.k, y.k) << "l" << l << " h" << h << " block " << i;
          EXPECT_EQ(x.v, y.v);
          EXPECT_EQ(x.kmin, y.kmin);
          EXPECT_EQ(x.kmax, y.kmax);
          f(x, y);
        }
      }
  }
  // The manifest's retention entry of (layer, head).
  static boost::json::object& retention_head(boost::json::value& v, size_t l, size_t h) {
    return v.as_object()["retention"].as_object()["layers"].as_array()[l].as_object()["heads"]
        .as_array()[h]
        .as_object();
  }
  static boost::json::value read_manifest(const std::string& dir) {
    std::ifstream f(dir + "/manifest.json");
    std::stringstream ss;
    ss << f.rdbuf();
    return boost::json::parse(ss.str());
  }
  static void write_manifest(const std::string& dir, const boost::json::value& v) {
    std::ofstream(dir + "/manifest.json") << boost::json::serialize(v);
  }
  // A shard of `dir` rewritten: `edit` may change its tensors' bytes (same sizes) and metadata
  // (an empty value drops the key), and tensors named in `drop` are left out. The new file's size
  // and xxh64 go into its manifest entry (and `drop` out of the entry's tensors), as a writer that
  // meant it would: only the reader's own checks can catch what changed.
  struct ShardEdit {
    std::function<void(const std::string& name, std::vector<uint8_t>& bytes)> bytes;
    std::map<std::string, std::string> metadata;
    std::set<std::string> drop;
  };
  static void rewrite_shard(const std::string& dir, const std::string& file, const ShardEdit& e) {
    const std::string path = dir + "/" + file;
    std::vector<std::pair<SafetensorsTensor, std::vector<uint8_t>>> ts;
    std::map<std::string, std::string> md;
    {
      auto f = SafetensorsFile::open(path);
      ASSERT_TRUE(f.is_ok()) << f.status().to_string();
      md = f->metadata();
      for (const SafetensorsTensor& t : f->tensors())
        if (!e.drop.count(t.name)) ts.push_back({t, {t.data, t.data + t.n_bytes()}});
    }
    SafetensorsWriter w;
    for (auto& [t, b] : ts) {
      if (e.bytes) e.bytes(t.name, b);
      auto dt = safetensors_to_dtype(t.dtype);
      ASSERT_TRUE(dt.is_ok()) << t.dtype;
      w.add(t.name, dt.value(), t.shape, b.data(), b.size());
    }
    for (const auto& [k, v] : e.metadata) md[k] = v;
    for (const auto& [k, v] : md)
      if (!v.empty()) w.set_metadata(k, v);
    auto h = w.write(path);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    auto m = read_manifest(dir);
    bool found = false;
    for (auto& sv : m.as_object()["shards"].as_array()) {
      auto& sh = sv.as_object();
      if (sh.at("file").as_string() != file) continue;
      found = true;
      sh["bytes"] = int64_t(fs::file_size(path));
      sh["xxh64"] = hex64(h.value());
      if (sh.contains("tensors")) {
        boost::json::array kept;
        for (const auto& n : sh.at("tensors").as_array())
          if (!e.drop.count(std::string(n.as_string()))) kept.push_back(n);
        sh["tensors"] = std::move(kept);
      }
    }
    ASSERT_TRUE(found) << file;
    write_manifest(dir, m);
  }
  // A head's (or its low tier's) positions as format 6 writes them, and back.
  static std::vector<kvstore::PositionRun> runs_of(const boost::json::object& o) {
    auto r = kvstore::decode_position_runs(std::string(o.at("runs").as_string()), kN);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    return r.is_ok() ? std::move(r).value() : std::vector<kvstore::PositionRun>{};
  }
  static void set_runs(boost::json::object& o, std::vector<kvstore::PositionRun> runs) {
    o["runs"] = kvstore::encode_position_runs(runs);
  }
  // A format 6 manifest rewritten as formats 3-5 kept positions (JSON [begin, end) arrays).
  static void to_json_ranges(boost::json::value& v, int version) {
    v.as_object()["format_version"] = version;
    for (auto& lv : v.as_object()["retention"].as_object()["layers"].as_array())
      for (auto& hv : lv.as_object()["heads"].as_array()) {
        auto convert = [](boost::json::object& o) {
          boost::json::array ranges;
          for (const auto& [b, e] : runs_of(o)) ranges.push_back(boost::json::array{b, e});
          o.erase("runs");
          o["ranges"] = std::move(ranges);
        };
        convert(hv.as_object());
        if (hv.as_object().contains("low")) convert(hv.as_object()["low"].as_object());
      }
  }
  // Channel c of exported (rotate-half) key row vs the forward's adjacent-pair layout.
  float cache_key(int l, int t, int h, int c) const {
    const int d = 16, hkv = 2;
    const float* r = pr_.kv.k[size_t(l)].data() + (int64_t(t) * hkv + h) * d;
    return c < d / 2 ? r[2 * c] : r[2 * (c - d / 2) + 1];
  }
  void expect_head_matches_cache(const decode::KvExport& e, int l, int h,
                                 const std::vector<int32_t>& pos) {
    const decode::HeadKv& H = e.head(l, h);
    ASSERT_EQ(H.positions, pos);
    const int d = 16;
    for (size_t i = 0; i < pos.size(); ++i)
      for (int c = 0; c < d; ++c) {
        ASSERT_EQ(H.k[i * d + size_t(c)], cache_key(l, pos[i], h, c))
            << "key l" << l << " h" << h << " i" << i;
        ASSERT_EQ(H.v[i * d + size_t(c)],
                  pr_.kv.v[size_t(l)][(size_t(pos[i]) * 2 + size_t(h)) * d + size_t(c)]);
      }
    // Block metadata recomputed from the loaded keys and the prefill's importance.
    const size_t nb = (pos.size() + 63) / 64;
    ASSERT_EQ(H.block_kmin.size(), nb * d);
    ASSERT_EQ(H.block_importance.size(), nb);
    for (size_t b = 0; b < nb; ++b) {
      double imp = 0;
      for (size_t i = b * 64; i < std::min(pos.size(), b * 64 + 64); ++i)
        imp += pr_.importance[size_t(l)][size_t(h) * kN + size_t(pos[i])];
      EXPECT_NEAR(H.block_importance[b], imp, 1e-4 * (1 + imp));
      for (int c = 0; c < d; ++c) {
        float lo = 1e30f, hi = -1e30f;
        double s = 0;
        const size_t t1 = std::min(pos.size(), b * 64 + 64);
        for (size_t i = b * 64; i < t1; ++i) {
          lo = std::min(lo, H.k[i * d + size_t(c)]);
          hi = std::max(hi, H.k[i * d + size_t(c)]);
          s += H.k[i * d + size_t(c)];
        }
        EXPECT_EQ(H.block_kmin[b * d + size_t(c)], lo);
        EXPECT_EQ(H.block_kmax[b * d + size_t(c)], hi);
        EXPECT_NEAR(H.block_kmean[b * d + size_t(c)], s / double(t1 - b * 64), 1e-5);
      }
    }
  }

  uint64_t seed_ = 0;
  std::optional<model::Model> model_;
  std::vector<int32_t> toks_;
  model::PrefillResult pr_;
  kvstore::ImportanceScores imp_;
  std::string hash_;
  TempDir tmp_;
};

TEST(KvCompatHash, PlainRopeKeepsItsHashAndEveryRopeVariantChangesIt) {
  kvstore::KvExportSpec s;
  s.model_name = "t";
  s.arch = "llama";
  s.n_layers = 1;
  s.n_kv_heads = 1;
  s.head_dim = 2;
  s.rope_theta = 10000.f;
  // XXH64 of "sparsefill-kv/3;model=t;arch=llama;dtype=F32;layers=1;kv_heads=1;head_dim=2;
  // rope_theta=10000;rope=rotate_half;block=64", computed outside the project: exports of
  // plain-RoPE models written before rope_variant existed keep loading.
  EXPECT_EQ(kvstore::compat_hash(s), "5688de8268c8db7a");
  kernels::RopeParams plain;
  EXPECT_EQ(kvstore::rope_variant(plain, 2, nullptr, 0), "");
  kernels::RopeParams whole = plain;
  whole.rot_dim = 2;  // rotating every channel is plain RoPE
  EXPECT_EQ(kvstore::rope_variant(whole, 2, nullptr, 0), "");
  kernels::RopeParams llama3 = plain;
  llama3.scaling_factor = 8.f;
  const float freqs_a[2] = {1.f, 8.f}, freqs_b[2] = {1.f, 4.f};
  kernels::RopeParams partial = plain;
  partial.rot_dim = 32;
  std::vector<std::string> hashes{kvstore::compat_hash(s)};
  for (const std::string& v :
       {kvstore::rope_variant(llama3, 64, nullptr, 0), kvstore::rope_variant(partial, 64, nullptr, 0),
        kvstore::rope_variant(plain, 64, freqs_a, 2), kvstore::rope_variant(plain, 64, freqs_b, 2),
        kvstore::rope_variant(llama3, 64, freqs_a, 2)}) {
    EXPECT_FALSE(v.empty());
    kvstore::KvExportSpec t = s;
    t.rope_variant = v;
    hashes.push_back(kvstore::compat_hash(t));
  }
  EXPECT_EQ(kvstore::rope_variant(llama3, 64, nullptr, 0),
            "llama3(factor=8,low=1,high=4,original=8192)");
  // Divisors override the formula, so with them the scaling factor is not what is hashed.
  EXPECT_EQ(hashes[3], hashes[5]);
  hashes.erase(hashes.begin() + 5);
  std::sort(hashes.begin(), hashes.end());
  EXPECT_EQ(std::unique(hashes.begin(), hashes.end()), hashes.end()) << "two variants collide";
}

TEST_F(KvClient, FullRetentionRoundTripsAndKeepsTheHfLayout) {
  const std::string d = export_to("full", nullptr);
  auto e = decode::load_kv_export(d, hash_);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  EXPECT_EQ(e->retention_policy, "full");
  EXPECT_EQ(e->kv_bytes, e->kv_bytes_full);
  EXPECT_EQ(e->token_ids, toks_);
  EXPECT_EQ(e->first_token, pr_.first_token);
  std::vector<int32_t> all(kN);
  for (int t = 0; t < kN; ++t) all[size_t(t)] = t;
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) expect_head_matches_cache(e.value(), l, h, all);
  // Full retention keeps the version-1 tensors a DynamicCache reads.
  auto f = SafetensorsFile::open(d + "/layer_001.safetensors");
  ASSERT_TRUE(f.is_ok());
  ASSERT_NE(f->find("key"), nullptr);
  EXPECT_EQ(f->find("key")->shape, (std::vector<int64_t>{1, 2, kN, 16}));
  EXPECT_EQ(f->find("value")->shape, (std::vector<int64_t>{1, 2, kN, 16}));
}

TEST_F(KvClient, ExportDirectoryRules) {
  // A trailing "/" names the same directory: the export lands there, complete, and a second
  // export over it (force) replaces it.
  const std::string d = tmp_.sub("slashed");
  ASSERT_TRUE(testing::export_prefill(*model_, toks_, pr_, d + "/", nullptr, &imp_).is_ok());
  ASSERT_TRUE(decode::load_kv_export(d, hash_).is_ok());
  auto again = kvstore::begin_export(d + "/", /*force=*/false);
  ASSERT_FALSE(again.is_ok());
  EXPECT_NE(again.status().message().find("use --force"), std::string::npos);
  const kvstore::KvExportSpec spec = spec_of(kvstore::KvEncoding::kF32);
  const auto src = [&](int l, bool v) { return (v ? pr_.kv.v : pr_.kv.k)[size_t(l)].data(); };
  ASSERT_TRUE(kvstore::export_kv(d + "/", spec, src, /*force=*/true).is_ok());
  ASSERT_TRUE(decode::load_kv_export(d, hash_).is_ok());
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp_.path), fs::directory_iterator{}), 1)
      << "a temporary directory was left behind";
  // A layer source that throws (an allocation, a caller's bug) fails the export and leaves no
  // temporary directory.
  const std::string thrown = tmp_.sub("thrown");
  const auto bad_src = [&](int l, bool v) -> kvstore::LayerRows {
    if (l == 1) throw std::runtime_error("layer source failed");
    return src(l, v);
  };
  try {
    const Status t = kvstore::export_kv(thrown, spec, bad_src, /*force=*/false);
    EXPECT_FALSE(t.is_ok());
    std::printf("a throwing layer source: %s\n", t.to_string().c_str());
  } catch (const std::runtime_error& e) {
    std::printf("a throwing layer source: thrown through (%s)\n", e.what());
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp_.path), fs::directory_iterator{}), 1)
      << "a throwing export left its temporary directory";
  // --force replaces an earlier export, never a directory that is not one.
  const std::string other = tmp_.sub("other");
  fs::create_directories(other);
  { std::ofstream(other + "/notes.txt") << "keep me"; }
  auto st = kvstore::export_kv(other, spec, src, /*force=*/true);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("holds no manifest.json"), std::string::npos) << st.message();
  EXPECT_TRUE(fs::exists(other + "/notes.txt"));
  // What appears at the directory while the shards are written is checked again at the move:
  // a directory that is not an export is never replaced, and an export only with force.
  const std::string racing = tmp_.sub("racing");
  for (const bool force : {false, true}) {
    auto t = kvstore::begin_export(racing, force);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    fs::create_directories(racing);
    { std::ofstream(racing + "/notes.txt") << "keep me"; }
    const Status m = kvstore::finish_export(t.value(), racing, force);
    EXPECT_EQ(m.code(), Code::kAlreadyExists) << m.to_string();
    EXPECT_TRUE(fs::exists(racing + "/notes.txt")) << "force " << force;
    fs::remove_all(t.value());
    fs::remove_all(racing);
  }
  // Paths with no name of their own are refused before anything is touched.
  for (const std::string bad : {".", "..", "/", "", "sub/..", "sub/../"}) {
    const Status c = kvstore::export_dir_check(bad, /*force=*/true);
    ASSERT_FALSE(c.is_ok()) << "'" << bad << "'";
    EXPECT_NE(c.message().find("names no directory of its own"), std::string::npos) << c.message();
  }
  EXPECT_TRUE(kvstore::export_dir_check(tmp_.sub("fresh/kv/"), false).is_ok());
  // A linked export directory is replaced where it lives: the link still names the new export,
  // and nothing is left beside the link.
  const std::string real = tmp_.sub("real-kv"), link = tmp_.sub("link-kv");
  ASSERT_TRUE(kvstore::export_kv(real, spec, src, false).is_ok());
  fs::create_directory_symlink(real, link);
  std::ofstream(real + "/stale.txt") << "from before";
  ASSERT_TRUE(kvstore::export_kv(link + "/", spec, src, /*force=*/true).is_ok());
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_FALSE(fs::exists(real + "/stale.txt")) << "the linked directory was not replaced";
  ASSERT_TRUE(decode::load_kv_export(link, hash_).is_ok());
}

TEST_F(KvClient, PartialRetentionExportsExactlyTheKeptPositions) {
  auto snap = kvstore::retention_apply(
      kvstore::retention_parse("snapkv:budget=100,window=32,pool=7").value(), 2, 2, kN, &imp_);
  ASSERT_TRUE(snap.is_ok()) << snap.status().to_string();
  const std::string d = export_to("snap", &snap.value());
  auto e = decode::load_kv_export(d, hash_);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  EXPECT_EQ(e->retention_policy, "snapkv");
  EXPECT_EQ(e->retention_params, "budget=100,window=32,pool=7");
  EXPECT_EQ(e->kv_bytes, 2 * 2 * 100 * 16 * 2 * 4);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) expect_head_matches_cache(e.value(), l, h, snap->positions(l, h));
  EXPECT_NE(SafetensorsFile::open(d + "/layer_000.safetensors")->find("key"),
            nullptr);  // uniform layout

  kvstore::RetentionPolicy moa;
  moa.kind = kvstore::RetentionKind::kMoA;
  moa.moa_sink = 8;
  moa.moa = {{{50, 0.0}, {0, 0.5}}, {{20, 0.1}, {300, 0}}};
  auto mr = kvstore::retention_apply(moa, 2, 2, kN, nullptr);
  ASSERT_TRUE(mr.is_ok());
  const std::string d2 = export_to("moa", &mr.value());
  auto e2 = decode::load_kv_export(d2, hash_);
  ASSERT_TRUE(e2.is_ok()) << e2.status().to_string();
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) expect_head_matches_cache(e2.value(), l, h, mr->positions(l, h));
  auto f = SafetensorsFile::open(d2 + "/layer_000.safetensors");
  EXPECT_EQ(f->find("key"), nullptr);  // per-head layout: counts differ
  ASSERT_NE(f->find("key.h1"), nullptr);
  EXPECT_EQ(f->find("key.h1")->shape, (std::vector<int64_t>{1, 1, 8 + 150, 16}));
}

// An export in each encoding loads as the F32 cache's kv_round_trip (keys grouped per 64 kept
// tokens of the head, as the export writes them); the block metadata stays the F32 keys', and
// kv_bytes counts the encoded tensors.
TEST_F(KvClient, EncodedExportsLoadAsTheEncodingsRoundTrip) {
  using kvstore::KvEncoding;
  const int d = 16;
  auto snap = kvstore::retention_apply(
      kvstore::retention_parse("snapkv:budget=100,window=32,pool=7").value(), 2, 2, kN, &imp_);
  ASSERT_TRUE(snap.is_ok());
  kvstore::RetentionPolicy moa;  // per-head layout: counts differ
  moa.kind = kvstore::RetentionKind::kMoA;
  moa.moa_sink = 8;
  moa.moa = {{{50, 0.0}, {0, 0.5}}, {{20, 0.1}, {300, 0}}};
  auto mr = kvstore::retention_apply(moa, 2, 2, kN, nullptr);
  ASSERT_TRUE(mr.is_ok());
  std::vector<int32_t> all(kN);
  for (int t = 0; t < kN; ++t) all[size_t(t)] = t;
  for (KvEncoding enc : {KvEncoding::kBF16, KvEncoding::kInt8, KvEncoding::kInt4})
    for (const kvstore::Retention* ret :
         std::vector<const kvstore::Retention*>{nullptr, &snap.value(), &mr.value()}) {
      const std::string name = std::string(kvstore::kv_encoding_name(enc)) + "-" +
                               (ret ? ret->policy : std::string("full"));
      SCOPED_TRACE(name);
      auto e = decode::load_kv_export(export_to(name, ret, enc), hash_);
      ASSERT_TRUE(e.is_ok()) << e.status().to_string();
      EXPECT_EQ(e->kv_dtype, kvstore::kv_encoding_name(enc));
      int64_t bytes = 0;
      for (int l = 0; l < 2; ++l)
        for (int h = 0; h < 2; ++h) {
          const auto& pos = ret ? ret->positions(l, h) : all;
          const int64_t n = int64_t(pos.size());
          bytes += kvstore::kv_encoded_bytes(enc, n, d);
          std::vector<float> k(size_t(n * d)), v(size_t(n * d));
          for (int64_t i = 0; i < n; ++i)
            for (int c = 0; c < d; ++c) {
              k[size_t(i * d + c)] = cache_key(l, pos[size_t(i)], h, c);
              v[size_t(i * d + c)] =
                  pr_.kv.v[size_t(l)][(size_t(pos[size_t(i)]) * 2 + size_t(h)) * d + size_t(c)];
            }
          const decode::HeadKv& H = e->head(l, h);
          std::vector<float> k0 = k;
          ASSERT_TRUE(kvstore::kv_round_trip(enc, true, k.data(), n, d).is_ok());
          ASSERT_TRUE(kvstore::kv_round_trip(enc, false, v.data(), n, d).is_ok());
          // Metadata from the keys as stored (decoded), which can lie outside the F32 keys'
          // range by a code's half step: the min and max bound what the node reads.
          for (int64_t b = 0; b * 64 < n; ++b)
            for (int c = 0; c < d; ++c) {
              float lo = 1e30f, hi = -1e30f;
              for (int64_t i = b * 64; i < std::min(n, b * 64 + 64); ++i) {
                lo = std::min(lo, k[size_t(i * d + c)]);
                hi = std::max(hi, k[size_t(i * d + c)]);
              }
              ASSERT_EQ(H.block_kmin[size_t(b * d + c)], lo);
              ASSERT_EQ(H.block_kmax[size_t(b * d + c)], hi);
            }
          EXPECT_EQ(H.positions, pos);
          EXPECT_EQ(H.k, k) << "l" << l << " h" << h;
          EXPECT_EQ(H.v, v) << "l" << l << " h" << h;
          EXPECT_NE(H.k, k0);  // the encoding did change the keys
        }
      EXPECT_EQ(e->kv_bytes, bytes);
      // ... and is what the shards hold in K/V tensors and their scales and zeros.
      int64_t held = 0;
      for (int l = 0; l < 2; ++l) {
        auto sf = SafetensorsFile::open(tmp_.sub(name) + "/layer_00" + std::to_string(l) +
                                        ".safetensors");
        ASSERT_TRUE(sf.is_ok());
        for (const char* base :
             {"key", "value", "key_scale", "key_zero", "value_scale", "value_zero"})
          for (const std::string sfx : {"", ".h0", ".h1"})
            if (const SafetensorsTensor* t = sf->find(base + sfx)) held += int64_t(t->n_bytes());
      }
      EXPECT_EQ(held, e->kv_bytes);
      auto f = SafetensorsFile::open(tmp_.sub(name) + "/layer_000.safetensors");
      ASSERT_TRUE(f.is_ok());
      const SafetensorsTensor* key = f->find(ret == &mr.value() ? "key.h1" : "key");
      ASSERT_NE(key, nullptr);
      EXPECT_EQ(key->dtype, enc == KvEncoding::kBF16 ? "BF16" : "U8");
      EXPECT_EQ(key->shape.back(), enc == KvEncoding::kInt4 ? d / 2 : d);
      EXPECT_EQ(f->find("value_scale") != nullptr || f->find("value_scale.h1") != nullptr,
                enc != KvEncoding::kBF16);
    }
}

// The retention evaluation pages an encoding in process (PagedKvCache::from_prefill with enc);
// that must be exactly what a decode node pages from the export it loads.
TEST_F(KvClient, InProcessEncodingIsWhatTheNodeLoads) {
  auto snap = kvstore::retention_apply(
      kvstore::retention_parse("snapkv:budget=100,window=32,pool=7").value(), 2, 2, kN, &imp_);
  ASSERT_TRUE(snap.is_ok());
  for (auto enc : {kvstore::KvEncoding::kInt8, kvstore::KvEncoding::kInt4}) {
    auto e = decode::load_kv_export(
        export_to(std::string("paged-") + kvstore::kv_encoding_name(enc), &snap.value(), enc),
        hash_);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    auto a = decode::PagedKvCache::from_prefill(pr_.kv, snap.value(), enc);
    auto b = decode::PagedKvCache::from_export(e.value(), !model_->config().rope.neox);
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    SCOPED_TRACE(kvstore::kv_encoding_name(enc));
    expect_same_blocks(a.value(), b.value(), [&](const decode::KvBlock& x, const decode::KvBlock& y) {
      // int8 blocks keep their codes (a device pool uploads them as they are): the export's,
      // permuted to the model's channel order, equal the in-process encoding's and decode
      // to the block's values.
      if (enc != kvstore::KvEncoding::kInt8) {
        EXPECT_TRUE(y.kq.data.empty() && x.kq.data.empty());
        return;
      }
      const int d = a->head_dim();
      ASSERT_EQ(y.kq.data.size(), size_t(y.n) * size_t(d));
      EXPECT_EQ(x.kq.data, y.kq.data);
      EXPECT_EQ(x.kq.scale, y.kq.scale);
      EXPECT_EQ(x.kq.zero, y.kq.zero);
      EXPECT_EQ(x.vq.data, y.vq.data);
      EXPECT_EQ(x.vq.scale, y.vq.scale);
      EXPECT_EQ(x.vq.zero, y.vq.zero);
      std::vector<float> dk(size_t(y.n) * size_t(d)), dv(dk.size());
      ASSERT_TRUE(kvstore::kv_decode(enc, true, y.kq, y.n, d, dk.data()).is_ok());
      ASSERT_TRUE(kvstore::kv_decode(enc, false, y.vq, y.n, d, dv.data()).is_ok());
      EXPECT_TRUE(std::equal(dk.begin(), dk.end(), y.k.begin()));
      EXPECT_TRUE(std::equal(dv.begin(), dv.end(), y.v.begin()));
    });
    if (enc != kvstore::KvEncoding::kInt8) continue;
    // An append changes the block, so its codes no longer describe it and are dropped.
    decode::PagedKvCache c = std::move(b).value();
    const int32_t last = c.pages(0, 0).back();
    ASSERT_LT(c.block(last).n, 64);
    ASSERT_FALSE(c.block(last).kq.data.empty());
    std::vector<float> row(size_t(c.head_dim()), 0.5f);
    c.append(0, 0, kN, row.data(), row.data());
    EXPECT_TRUE(c.block(last).kq.data.empty() && c.block(last).vq.data.empty());
  }
}

// Two tiers (format 5): the policy's top tokens in int8, the rest it keeps in int4, each tier in
// its own shards. The node's merged cache equals the in-process one bit for bit, the tiers'
// positions are what the retention split says, and the bytes are each tier's in its encoding.
TEST_F(KvClient, TwoTierExportLoadsAsTheInProcessCache) {
  using E = kvstore::KvEncoding;
  // adakv splits every head; pyramid at these budgets caps layer 0 at the prompt under both
  // budgets, so its heads there have an empty low tier (written and read as n = 0).
  for (const char* spec : {"adakv:budget=200,window=32,pool=7,high=70",
                           "pyramid:budget=200,window=32,high=180"}) {
    SCOPED_TRACE(spec);
    auto pol = kvstore::retention_parse(spec);
    ASSERT_TRUE(pol.is_ok()) << pol.status().to_string();
    auto ret = kvstore::retention_apply(pol.value(), 2, 2, kN, &imp_);
    ASSERT_TRUE(ret.is_ok()) << ret.status().to_string();
    ASSERT_TRUE(ret->has_low());
    size_t empty_low = 0;
    for (const auto& lo : ret->low) empty_low += lo.empty();
    if (spec[0] == 'p') EXPECT_GT(empty_low, 0u);
    const std::string dir = export_to(std::string("tiers-") + spec[0], &ret.value(), E::kInt8, E::kInt4);
    auto e = decode::load_kv_export(dir, hash_);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    EXPECT_EQ(e->kv_dtype, "int8");
    EXPECT_EQ(e->kv_dtype_low, "int4");
    EXPECT_EQ(e->kv_bytes, kvstore::kv_bytes(ret.value(), 16, E::kInt8, E::kInt4));
    EXPECT_LT(e->kv_bytes, kvstore::kv_bytes(ret.value(), 16, E::kInt8));
    EXPECT_GT(e->kv_bytes, kvstore::kv_bytes(ret.value(), 16, E::kInt4));
    EXPECT_EQ(read_manifest(dir).as_object().at("format_version").as_int64(), 6);
    for (int l = 0; l < 2; ++l) {
      EXPECT_TRUE(fs::exists(dir + "/layer_00" + std::to_string(l) + ".low.safetensors"));
      for (int h = 0; h < 2; ++h) EXPECT_EQ(e->head(l, h).positions, ret->positions(l, h));
    }
    auto a = decode::PagedKvCache::from_prefill(pr_.kv, ret.value(), E::kInt8, E::kInt4);
    auto b = decode::PagedKvCache::from_export(e.value(), !model_->config().rope.neox);
    ASSERT_TRUE(a.is_ok()) << a.status().to_string();
    ASSERT_TRUE(b.is_ok()) << b.status().to_string();
    expect_same_blocks(a.value(), b.value(), [](const decode::KvBlock&, const decode::KvBlock& y) {
      EXPECT_TRUE(y.kq.data.empty());  // mixed encodings: no codes for a device pool to reuse
    });
    // Each tier carries its own encoding's error: the low tier's values (int4's round trip of
    // that tier) are off by several times the high tier's (int8's), on average.
    double err[2] = {0, 0};
    int64_t cnt[2] = {0, 0};
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h) {
        const auto& lo = ret->low[size_t(l * 2 + h)];
        const decode::HeadKv& H = e->head(l, h);
        for (size_t i = 0; i < H.positions.size(); ++i) {
          const int t = std::binary_search(lo.begin(), lo.end(), H.positions[i]) ? 1 : 0;
          for (int c = 0; c < 16; ++c)
            err[t] += std::fabs(H.v[i * 16 + size_t(c)] -
                                pr_.kv.v[size_t(l)][(size_t(H.positions[i]) * 2 + size_t(h)) * 16 + size_t(c)]);
          cnt[t] += 16;
        }
      }
    ASSERT_GT(cnt[0], 0);
    ASSERT_GT(cnt[1], 0);
    EXPECT_GT(err[1] / double(cnt[1]), 4 * err[0] / double(cnt[0]));
  }
}

// Every file of an export directory, by name: its bytes.
std::map<std::string, std::string> dir_files(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream f(e.path(), std::ios::binary);
    out[e.path().filename().string()] =
        std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  return out;
}

// Shard files written several at once (ExportOptions::layers_in_flight) are the files written
// one at a time, byte for byte, manifest included; failing layers are reported as the first
// one's error whatever runs beside them, and leave no export behind.
TEST_F(KvClient, LayersInFlightWriteTheSameExport) {
  using E = kvstore::KvEncoding;
  auto pol = kvstore::retention_parse("adakv:budget=200,window=32,pool=7,high=70");
  ASSERT_TRUE(pol.is_ok()) << pol.status().to_string();
  auto ret = kvstore::retention_apply(pol.value(), 2, 2, kN, &imp_);
  ASSERT_TRUE(ret.is_ok()) << ret.status().to_string();
  // Full retention (one shard a layer) and two tiers (two a layer: 4 shard files in flight).
  for (const bool tiers : {false, true}) {
    SCOPED_TRACE(tiers ? "two tiers" : "full");
    const kvstore::KvExportSpec spec =
        tiers ? spec_of(E::kInt8, &ret.value(), E::kInt4) : spec_of(E::kF32);
    const kvstore::LayerSource src = [&](int l, bool v) {
      return (v ? pr_.kv.v : pr_.kv.k)[size_t(l)].data();
    };
    std::map<std::string, std::string> want;
    for (const int n : {1, 2, 4, 16}) {
      kvstore::ExportOptions eo;
      eo.layers_in_flight = n;
      const std::string dir = tmp_.sub(std::string("inflight-") + (tiers ? "t" : "f") +
                                       std::to_string(n));
      const Status st = kvstore::export_kv(dir, spec, src, false, eo);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      const auto got = dir_files(dir);
      EXPECT_EQ(got.size(), tiers ? 5u : 3u);
      if (n == 1)
        want = got;
      else
        EXPECT_TRUE(got == want) << n << " in flight wrote other bytes";
      // Loaded one layer at a time and several at once: the same cache.
      auto one = decode::load_kv_export(dir, hash_, 1);
      auto many = decode::load_kv_export(dir, hash_, 4);
      ASSERT_TRUE(one.is_ok()) << one.status().to_string();
      ASSERT_TRUE(many.is_ok()) << many.status().to_string();
      for (size_t i = 0; i < one->heads.size(); ++i) {
        EXPECT_EQ(one->heads[i].positions, many->heads[i].positions);
        EXPECT_EQ(one->heads[i].k, many->heads[i].k);
        EXPECT_EQ(one->heads[i].v, many->heads[i].v);
        EXPECT_EQ(one->heads[i].block_kmin, many->heads[i].block_kmin);
      }
    }
    // Neither layer has KV: the first layer's error at every width (whichever thread fails
    // first), and nothing left behind.
    const kvstore::LayerSource bad = [&](int, bool) -> const float* { return nullptr; };
    for (const int n : {1, 4}) {
      kvstore::ExportOptions eo;
      eo.layers_in_flight = n;
      const std::string dir = tmp_.sub(std::string("inflight-bad") + std::to_string(n));
      const Status st = kvstore::export_kv(dir, spec, bad, false, eo);
      EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
      EXPECT_NE(st.message().find("layer 0 has no KV"), std::string::npos) << st.to_string();
      EXPECT_FALSE(fs::exists(dir));
      for (const auto& e : fs::directory_iterator(tmp_.path))
        EXPECT_EQ(e.path().filename().string().find("inflight-bad" + std::to_string(n) + ".partial"),
                  std::string::npos);
    }
  }
}

// A BF16 source (a device prefill's host K/V kept in bf16) exports exactly as the F32 source of
// its widened values: the same files, byte for byte, in every encoding, with full retention and
// two tiers (keys de-interleaved on the way, as this GGUF model's are). K and V of different
// dtypes are refused.
TEST_F(KvClient, Bf16SourceExportsAsItsWidenedValues) {
  using E = kvstore::KvEncoding;
  auto ret = kvstore::retention_apply(
      kvstore::retention_parse("snapkv:budget=200,window=32,pool=7,high=64").value(), 2, 2, kN,
      &imp_);
  ASSERT_TRUE(ret.is_ok()) << ret.status().to_string();
  const size_t nl = pr_.kv.k.size();
  std::vector<std::vector<uint16_t>> k16(nl), v16(nl);
  std::vector<std::vector<float>> kw(nl), vw(nl);
  size_t changed = 0;  // values bf16 rounding moved: the comparison is not of equal inputs
  for (size_t l = 0; l < nl; ++l)
    for (auto [f, h, w] : {std::tuple{&pr_.kv.k[l], &k16[l], &kw[l]},
                           std::tuple{&pr_.kv.v[l], &v16[l], &vw[l]}}) {
      for (float x : *f) {
        h->push_back(f32_to_bf16(x));
        w->push_back(bf16_to_f32(h->back()));
        changed += w->back() != x;
      }
    }
  EXPECT_GT(changed, size_t(0));
  int i = 0;
  for (const auto& [enc, low] : std::vector<std::pair<E, std::optional<E>>>{
           {E::kF32, std::nullopt}, {E::kBF16, std::nullopt}, {E::kInt8, std::nullopt},
           {E::kInt4, std::nullopt}, {E::kInt8, E::kInt4}}) {
    SCOPED_TRACE(std::to_string(i));
    const kvstore::KvExportSpec spec = spec_of(enc, low ? &ret.value() : nullptr, low);
    const std::string a = tmp_.sub("bf16src-" + std::to_string(i));
    const std::string b = tmp_.sub("widened-" + std::to_string(i++));
    const Status sa = kvstore::export_kv(a, spec, [&](int l, bool v) {
      return kvstore::LayerRows::bf16((v ? v16 : k16)[size_t(l)].data());
    }, false);
    ASSERT_TRUE(sa.is_ok()) << sa.to_string();
    const Status sb = kvstore::export_kv(b, spec, [&](int l, bool v) {
      return kvstore::LayerRows((v ? vw : kw)[size_t(l)].data());
    }, false);
    ASSERT_TRUE(sb.is_ok()) << sb.to_string();
    const auto fa = dir_files(a), fb = dir_files(b);
    EXPECT_EQ(fa.size(), fb.size());
    EXPECT_TRUE(fa == fb) << "a bf16 source wrote other bytes than its widened values";
  }
  const kvstore::KvExportSpec spec = spec_of(E::kF32);
  const Status mixed = kvstore::export_kv(tmp_.sub("bf16-mixed"), spec, [&](int l, bool v) {
    return v ? kvstore::LayerRows::bf16(v16[size_t(l)].data())
             : kvstore::LayerRows(kw[size_t(l)].data());
  }, false);
  EXPECT_EQ(mixed.code(), Code::kInvalidArgument) << mixed.to_string();
  EXPECT_NE(mixed.message().find("must both be F32 or both BF16"), std::string::npos)
      << mixed.to_string();
}

// What sparsefill-worker's --kv-host-dtype auto relies on: a bf16 export of bf16 host K/V (the
// F32 rounded to nearest even, as the device's cast does) is the bf16 export of the F32, file for
// file, since the writer rounds the same way and takes its block statistics from the stored keys
// (which they then bound, though rounding moved keys past the F32 ones' range). An int8 export of
// the rounded values does move codes, which is why auto keeps F32 for quantized exports.
TEST_F(KvClient, ExportFromBf16HostKvIsTheF32ExportsKv) {
  using E = kvstore::KvEncoding;
  const size_t nl = pr_.kv.k.size();
  std::vector<std::vector<uint16_t>> k16(nl), v16(nl);
  for (size_t l = 0; l < nl; ++l) {
    for (float x : pr_.kv.k[l]) k16[l].push_back(f32_to_bf16(x));
    for (float x : pr_.kv.v[l]) v16[l].push_back(f32_to_bf16(x));
  }
  // The bf16 and the F32 sourced exports' directories.
  auto export_both = [&](E enc) {
    const kvstore::KvExportSpec spec = spec_of(enc);
    const std::string name = kvstore::kv_encodings_name({enc, std::nullopt});
    const std::string a = tmp_.sub("host16-" + name), b = tmp_.sub("host32-" + name);
    const Status sa = kvstore::export_kv(a, spec, [&](int l, bool v) {
      return kvstore::LayerRows::bf16((v ? v16 : k16)[size_t(l)].data());
    }, false);
    const Status sb = kvstore::export_kv(b, spec, [&](int l, bool v) {
      return kvstore::LayerRows((v ? pr_.kv.v : pr_.kv.k)[size_t(l)].data());
    }, false);
    EXPECT_TRUE(sa.is_ok()) << sa.to_string();
    EXPECT_TRUE(sb.is_ok()) << sb.to_string();
    return std::pair{a, b};
  };
  {
    const auto [from16, from32] = export_both(E::kBF16);
    EXPECT_TRUE(dir_files(from16) == dir_files(from32)) << "bf16 host K/V changed a bf16 export";
    // The F32 export's block statistics are the F32 keys': count the stored bf16 keys outside
    // them (what statistics taken before rounding would have missed).
    auto e = decode::load_kv_export(from32, hash_);
    auto f = decode::load_kv_export(export_both(E::kF32).second, hash_);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    const size_t d = size_t(e->head_dim);
    size_t past_f32_range = 0;
    for (size_t i = 0; i < e->heads.size(); ++i) {
      const decode::HeadKv& H = e->heads[i];
      const decode::HeadKv& F = f->heads[i];
      for (size_t t = 0; t < H.positions.size(); ++t)
        for (size_t c = 0; c < d; ++c) {
          const size_t at = (t / 64) * d + c;
          const float x = H.k[t * d + c];
          ASSERT_TRUE(x >= H.block_kmin[at] && x <= H.block_kmax[at]) << t << " " << c;
          past_f32_range += x < F.block_kmin[at] || x > F.block_kmax[at];
        }
    }
    std::printf("  bf16 export: %zu stored keys lie outside their block's F32 key range\n",
                past_f32_range);
    EXPECT_GT(past_f32_range, size_t(0));
  }
  {
    const auto [from16, from32] = export_both(E::kInt8);
    auto a = decode::load_kv_export(from16, hash_), b = decode::load_kv_export(from32, hash_);
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    bool same = true;
    for (size_t i = 0; i < a->heads.size(); ++i)
      same = same && a->heads[i].k == b->heads[i].k && a->heads[i].v == b->heads[i].v;
    EXPECT_FALSE(same) << "int8 of bf16-rounded K/V decoded as int8 of the F32: auto could keep "
                          "bf16 host K/V for int8 exports too";
  }
}

// ExportOptions::on_layer_written (what sparsefill-worker frees a pending export's K/V by): once a
// layer, at any width, with one tier and two; the source is never read for a layer after it, and
// one file at a time, a layer's call comes before the next layer is read (not all at the end).
TEST_F(KvClient, OnLayerWrittenComesOnceALayerAfterItsLastRead) {
  using E = kvstore::KvEncoding;
  auto ret = kvstore::retention_apply(
      kvstore::retention_parse("snapkv:budget=200,window=32,pool=7,high=64").value(), 2, 2, kN,
      &imp_);
  ASSERT_TRUE(ret.is_ok()) << ret.status().to_string();
  const int nl = int(pr_.kv.k.size());
  int i = 0;
  for (const bool tiers : {false, true})
    for (const int width : {1, 4}) {
      SCOPED_TRACE(std::to_string(tiers) + " " + std::to_string(width));
      const kvstore::KvExportSpec spec =
          tiers ? spec_of(E::kInt8, &ret.value(), E::kInt4) : spec_of(E::kBF16);
      std::mutex mu;
      std::vector<int> calls(size_t(nl), 0);
      int late_reads = 0, released_before_last = -1;
      kvstore::ExportOptions eo;
      eo.layers_in_flight = width;
      eo.on_layer_written = [&](int l) {
        std::lock_guard<std::mutex> lk(mu);
        ++calls[size_t(l)];
      };
      const Status st = kvstore::export_kv(tmp_.sub("released-" + std::to_string(i++)), spec,
                                           [&](int l, bool v) {
                                             std::lock_guard<std::mutex> lk(mu);
                                             late_reads += calls[size_t(l)] > 0;
                                             if (l == nl - 1 && released_before_last < 0)
                                               released_before_last = calls[0];
                                             return (v ? pr_.kv.v : pr_.kv.k)[size_t(l)].data();
                                           },
                                           false, eo);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      EXPECT_EQ(calls, std::vector<int>(size_t(nl), 1));
      EXPECT_EQ(late_reads, 0);
      ASSERT_GE(nl, 2);
      if (width == 1) EXPECT_EQ(released_before_last, 1);
    }
}

TEST_F(KvClient, TwoTierExportRejectsBadTiers) {
  using E = kvstore::KvEncoding;
  auto ret = kvstore::retention_apply(
      kvstore::retention_parse("snapkv:budget=200,window=32,pool=7,high=64").value(), 2, 2, kN,
      &imp_);
  ASSERT_TRUE(ret.is_ok());
  auto export_err = [&](const kvstore::Retention* r, E enc, std::optional<E> low,
                        const std::string& needle) {
    const std::string d = tmp_.sub("bad-export");
    Status st = testing::export_prefill(*model_, toks_, pr_, d, r, &imp_, enc, low);
    ASSERT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.to_string();
    EXPECT_FALSE(fs::exists(d + "/manifest.json"));
  };
  export_err(&ret.value(), E::kInt8, std::nullopt, "has a low tier but the export names one");
  export_err(&ret.value(), E::kInt4, E::kInt8, "must be narrower");
  auto one = kvstore::retention_apply(
      kvstore::retention_parse("snapkv:budget=200,window=32,pool=7").value(), 2, 2, kN, &imp_);
  export_err(&one.value(), E::kInt8, E::kInt4, "the retention has no low tier");
  export_err(nullptr, E::kInt8, E::kInt4, "no retention with a low tier");

  const std::string good = export_to("tiers-good", &ret.value(), E::kInt8, E::kInt4);
  ASSERT_TRUE(decode::load_kv_export(good, hash_).is_ok());
  auto expect_err = [&](const std::string& dir, Code code, const std::string& needle) {
    expect_load_err(dir, hash_, code, needle);
  };
  // A low tier in a format 4 manifest.
  {
    const std::string d = copy_of(good, "tiers-v4");
    auto v = read_manifest(d);
    v.as_object()["format_version"] = 4;
    write_manifest(d, v);
    expect_err(d, Code::kCorrupt, "kv_dtype_low needs format_version 5");
  }
  // Low ranges outside the kept ones.
  {
    const std::string d = copy_of(good, "tiers-outside");
    auto v = read_manifest(d);
    auto& h0 = retention_head(v, 0, 0);
    const auto kept = runs_of(h0);
    ASSERT_FALSE(kept.empty());
    // One low token just past the first kept range, where the head keeps nothing.
    const int64_t end = kept[0].second;
    boost::json::object outside;
    outside["n"] = 1;
    set_runs(outside, {{end, end + 1}});
    h0["low"] = std::move(outside);
    write_manifest(d, v);
    expect_err(d, Code::kCorrupt, "not inside its kept ranges");
  }
  // Every kept token in the low tier.
  {
    const std::string d = copy_of(good, "tiers-all-low");
    auto v = read_manifest(d);
    auto& h0 = retention_head(v, 0, 0);
    const boost::json::value n = h0.at("n"), runs = h0.at("runs");
    boost::json::object all_low;
    all_low["n"] = n;
    all_low["runs"] = runs;
    h0["low"] = std::move(all_low);
    write_manifest(d, v);
    expect_err(d, Code::kCorrupt, "keeps no token");
  }
  // Formats 3-5 kept positions as JSON ranges: a format 5 rewrite of the same export loads with
  // the same positions in both tiers.
  {
    const std::string d = copy_of(good, "tiers-v5");
    auto v = read_manifest(d);
    to_json_ranges(v, 5);
    write_manifest(d, v);
    auto a = decode::load_kv_export(good, hash_);
    auto b = decode::load_kv_export(d, hash_);
    ASSERT_TRUE(a.is_ok() && b.is_ok()) << b.status().to_string();
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h) {
        EXPECT_EQ(b->head(l, h).positions, a->head(l, h).positions);
        EXPECT_EQ(b->head(l, h).positions, ret->positions(l, h));
      }
    EXPECT_EQ(b->kv_bytes, a->kv_bytes);
    // ... and a format 6 manifest with JSON ranges instead of runs is refused.
    v.as_object()["format_version"] = 6;
    write_manifest(d, v);
    expect_err(d, Code::kCorrupt, "runs");
  }
  // Runs that are not base64, cut off inside a varint, or past the prompt.
  int bad_i = 0;
  for (const auto& [bad, why] : std::vector<std::pair<std::string, std::string>>{
           {"AB*=", "is not base64"},
           {"gA==", "cut off"},
           {kvstore::encode_position_runs(std::vector<kvstore::PositionRun>{{kN - 1, kN + 1}}),
            "ends past the prompt"}}) {
    const std::string d = copy_of(good, "tiers-bad-runs-" + std::to_string(bad_i++));
    auto v = read_manifest(d);
    retention_head(v, 1, 0)["runs"] = bad;
    write_manifest(d, v);
    expect_err(d, Code::kCorrupt, "runs of layer 1 head 0: position runs: ");
    auto r = decode::load_kv_export(d, hash_);
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().to_string();
  }
  // A low tier's shard gone: never a partial load.
  {
    const std::string d = copy_of(good, "tiers-missing");
    fs::remove(d + "/layer_001.low.safetensors");
    expect_err(d, Code::kNotFound, "layer_001.low.safetensors");
  }
  // A low tier's shards declared high: the high tier's tokens are then covered twice.
  {
    const std::string d = copy_of(good, "tiers-swapped");
    auto v = read_manifest(d);
    for (auto& sh : v.as_object()["shards"].as_array())
      if (sh.as_object().at("tier").as_string() == "low") sh.as_object()["tier"] = "high";
    write_manifest(d, v);
    expect_err(d, Code::kCorrupt, "shards: overlap at token 0");
  }
  // A two-tier export's shard that names no tier, and a one-tier export's that names one.
  {
    const std::string d = copy_of(good, "tiers-untagged");
    auto v = read_manifest(d);
    v.as_object()["shards"].as_array()[0].as_object().erase("tier");
    write_manifest(d, v);
    expect_err(d, Code::kCorrupt, "names no tier in a two-tier export");
    const std::string one = export_to("one-tier", nullptr);
    const std::string d1 = copy_of(one, "one-tier-tagged");
    auto v1 = read_manifest(d1);
    v1.as_object()["shards"].as_array()[0].as_object()["tier"] = "high";
    write_manifest(d1, v1);
    expect_err(d1, Code::kCorrupt, "names a tier, but kv_dtype_low is missing");
  }
}

TEST_F(KvClient, RejectsEveryBadInputWithAClearError) {
  const std::string good = export_to("good", nullptr);
  ASSERT_TRUE(decode::load_kv_export(good, hash_).is_ok());
  const auto& expect_err = expect_load_err;
  // Wrong format version.
  {
    const std::string d = copy_of(good, "v1");
    auto v = read_manifest(d);
    v.as_object()["format_version"] = 1;
    write_manifest(d, v);
    expect_err(d, hash_, Code::kUnsupported, "format_version 1 is not supported");
  }
  // Format 3 (no kv_dtype) is still read, as F32; a kv_dtype this reader does not know is not.
  {
    const std::string d = copy_of(good, "v3");
    auto v = read_manifest(d);
    to_json_ranges(v, 3);
    v.as_object().erase("kv_dtype");
    write_manifest(d, v);
    auto r = decode::load_kv_export(d, hash_);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(r->kv_dtype, "f32");
    v.as_object()["format_version"] = 4;
    v.as_object()["kv_dtype"] = "fp8";
    write_manifest(d, v);
    expect_err(d, hash_, Code::kUnsupported, "kv_dtype 'fp8' is not supported");
  }
  // An int8 export whose manifest claims F32 K/V: the shard's tensors say otherwise.
  {
    const std::string d = export_to("int8-claims-f32", nullptr, kvstore::KvEncoding::kInt8);
    auto v = read_manifest(d);
    v.as_object()["kv_dtype"] = "f32";
    for (const char* total : {"kv_bytes", "kv_bytes_full"})
      v.as_object()["retention"].as_object()[total] =
          2 * 2 * kvstore::kv_encoded_bytes(kvstore::KvEncoding::kF32, kN, 16);
    write_manifest(d, v);
    expect_err(d, hash_, Code::kCorrupt, "the file's metadata says kv_dtype int8, its manifest entry f32");
    // A file without that metadata (before it was written): its tensors say otherwise.
    for (const char* f : {"layer_000.safetensors", "layer_001.safetensors"})
      rewrite_shard(d, f, {.metadata = {{"kv_dtype", ""}}});
    expect_err(d, hash_, Code::kCorrupt, "tensor 'key' has dtype U8, expected F32");
  }
  // Compatibility hash of another model (the consumer's) and a manifest whose hash was edited.
  expect_err(good, "0123456789abcdef", Code::kInvalidArgument,
             "does not match this model's 0123456789abcdef");
  {
    const std::string d = copy_of(good, "hash");
    auto v = read_manifest(d);
    v.as_object()["compat_hash"] = "ffffffffffffffff";
    write_manifest(d, v);
    expect_err(d, hash_, Code::kInvalidArgument, "compat_hash ffffffffffffffff");
  }
  // Model fields edited after export, the hash left as it was: a consumer of the original model
  // would pass the hash check and then index layers and heads the cache does not have.
  for (const char* field : {"n_layers", "n_kv_heads", "head_dim"}) {
    const std::string d = copy_of(good, std::string("geom-") + field);
    auto v = read_manifest(d);
    auto& model = v.as_object()["model"].as_object();
    model[field] = model[field].as_int64() * 2;
    write_manifest(d, v);
    expect_err(d, hash_, Code::kCorrupt, "do not hash to compat_hash");
  }
  {
    const std::string d = copy_of(good, "rope-variant");
    auto v = read_manifest(d);
    v.as_object()["model"].as_object()["rope_variant"] = "llama3(factor=8,low=1,high=4,original=8192)";
    write_manifest(d, v);
    expect_err(d, hash_, Code::kCorrupt, "do not hash to compat_hash");
  }
  // Missing shard.
  {
    const std::string d = copy_of(good, "missing");
    fs::remove(d + "/layer_001.safetensors");
    expect_err(d, hash_, Code::kNotFound, "layer_001.safetensors' is missing");
  }
  // Corrupted shard: one flipped byte in the data section, same size.
  {
    const std::string d = copy_of(good, "corrupt");
    const std::string p = d + "/layer_000.safetensors";
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-100, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    c = char(c ^ 0x5a);
    f.seekp(-100, std::ios::end);
    f.write(&c, 1);
    f.close();
    expect_err(d, hash_, Code::kCorrupt, "xxh64 checksum mismatch");
  }
  // Truncated shard.
  {
    const std::string d = copy_of(good, "short");
    const std::string p = d + "/layer_001.safetensors";
    fs::resize_file(p, fs::file_size(p) - 8);
    expect_err(d, hash_, Code::kCorrupt, "bytes, the manifest says");
  }
  // Manifest ranges that do not add up to the declared count.
  {
    const std::string d = copy_of(good, "ranges");
    auto v = read_manifest(d);
    auto& head = v.as_object()["retention"]
                     .as_object()["layers"]
                     .as_array()[1]
                     .as_object()["heads"]
                     .as_array()[0];
    set_runs(head.as_object(), {{0, kN - 2}, {kN - 1, kN}});
    write_manifest(d, v);
    expect_err(d, hash_, Code::kCorrupt, "cover 299 positions, n says 300");
  }
  // Manifest declares other positions (same count) than a partial-retention shard holds.
  {
    auto snap = kvstore::retention_apply(
        kvstore::retention_parse("snapkv:budget=100,window=32,pool=7").value(), 2, 2, kN, &imp_);
    ASSERT_TRUE(snap.is_ok());
    const std::string d = export_to("snap-ranges", &snap.value());
    auto v = read_manifest(d);
    auto& head = v.as_object()["retention"]
                     .as_object()["layers"]
                     .as_array()[0]
                     .as_object()["heads"]
                     .as_array()[1];
    set_runs(head.as_object(), {{0, 100}});
    write_manifest(d, v);
    expect_err(d, hash_, Code::kCorrupt,
               "positions.h1 differ from the manifest's retention ranges");
  }
  // No manifest; a manifest that is not JSON; a shard entry with a path in its name.
  {
    const std::string d = copy_of(good, "nomanifest");
    fs::remove(d + "/manifest.json");
    expect_err(d, hash_, Code::kNotFound, "no manifest.json");
    std::ofstream(d + "/manifest.json") << "{\"format\": ";
    expect_err(d, hash_, Code::kCorrupt, "not valid JSON");
  }
  {
    const std::string d = copy_of(good, "path");
    auto v = read_manifest(d);
    v.as_object()["shards"].as_array()[0].as_object()["file"] = "../good/layer_000.safetensors";
    write_manifest(d, v);
    expect_err(d, hash_, Code::kCorrupt, "not a plain file name");
  }
}

// A shard whose checksum is right (rewritten as a writer would) but whose contents are not what
// its manifest entry or its own keys say: each is refused, naming the shard and the field.
TEST_F(KvClient, RejectsShardsThatDisagreeWithTheirEntryOrTheirKeys) {
  const std::string good = export_to("agree-good", nullptr);
  ASSERT_TRUE(decode::load_kv_export(good, hash_).is_ok());
  const auto& expect_err = expect_load_err;
  // Block statistics that are not the keys': PSA's bound would rank by them (halved here; a NaN
  // would break its sort).
  for (const char* name : {"block_key_max.h0", "block_key_min.h1", "block_key_mean.h0"}) {
    const std::string d = copy_of(good, std::string("stats-") + name);
    rewrite_shard(d, "layer_001.safetensors",
                  {.bytes = [&](const std::string& n, std::vector<uint8_t>& b) {
                     if (n != name) return;
                     float x;
                     std::memcpy(&x, b.data() + 16 * 4 + 4, 4);  // block 1, channel 1
                     x = x * 0.5f + 0.25f;
                     std::memcpy(b.data() + 16 * 4 + 4, &x, 4);
                   }});
    expect_err(d, hash_, Code::kCorrupt,
               "shard 'layer_001.safetensors': " + std::string(name) +
                   " is not its keys' (block 1, channel 1)");
  }
  // The stored keys of an int8 export are checked against the statistics as stored too.
  {
    const std::string q = export_to("agree-int8", nullptr, kvstore::KvEncoding::kInt8);
    ASSERT_TRUE(decode::load_kv_export(q, hash_).is_ok());
    const std::string d = copy_of(q, "stats-int8-code");
    rewrite_shard(d, "layer_000.safetensors", {.bytes = [](const std::string& n, std::vector<uint8_t>& b) {
                                                 if (n == "key") b[5] ^= 0x40;  // one key code
                                               }});
    expect_err(d, hash_, Code::kCorrupt, "is not its keys' (block 0, channel 5)");
  }
  // Two entries' files swapped (names, sizes and checksums): the tensors carry no layer, but the
  // files' metadata does.
  {
    const std::string d = copy_of(good, "swapped-layers");
    auto v = read_manifest(d);
    auto& sh = v.as_object()["shards"].as_array();
    ASSERT_EQ(sh.size(), 2u);
    for (const char* k : {"file", "bytes", "xxh64"})
      std::swap(sh[0].as_object()[k], sh[1].as_object()[k]);
    write_manifest(d, v);
    expect_err(d, hash_, Code::kCorrupt,
               "shard 'layer_001.safetensors': the file's metadata says layer 1, its manifest "
               "entry 0");
  }
  {
    const std::string d = copy_of(good, "heads-meta");
    rewrite_shard(d, "layer_000.safetensors", {.metadata = {{"kv_heads", "0-1"}}});
    expect_err(d, hash_, Code::kCorrupt, "metadata says kv_heads 0-1, its manifest entry 0-2");
  }
  // A tensor the entry lists but the file lacks, and one the file has but the entry does not.
  {
    const std::string d = copy_of(good, "tensor-list");
    auto v = read_manifest(d);
    v.as_object()["shards"].as_array()[0].as_object()["tensors"].as_array().push_back(
        "block_key_p99.h0");
    write_manifest(d, v);
    expect_err(d, hash_, Code::kCorrupt, "its tensors are not the");
  }
  // Importance: the manifest names one, a shard head has none; and the reverse.
  {
    const std::string d = copy_of(good, "imp-dropped");
    rewrite_shard(d, "layer_000.safetensors", {.drop = {"block_importance.h1"}});
    expect_err(d, hash_, Code::kCorrupt,
               "has no block_importance.h1, but the manifest names an importance");
    const std::string d2 = copy_of(good, "imp-null");
    auto v = read_manifest(d2);
    v.as_object()["importance"] = nullptr;
    write_manifest(d2, v);
    expect_err(d2, hash_, Code::kCorrupt,
               "carries block_importance.h0, but the manifest's importance is null");
    v.as_object()["importance"] = "snapkv";
    write_manifest(d2, v);
    expect_err(d2, hash_, Code::kCorrupt, "importance is neither null nor an object");
  }
  // Totals that are not the retention's.
  for (const char* total : {"kept_tokens", "kv_bytes_full"}) {
    const std::string d = copy_of(good, std::string("total-") + total);
    auto v = read_manifest(d);
    auto& r = v.as_object()["retention"].as_object();
    r[total] = r[total].as_int64() + 1;
    write_manifest(d, v);
    expect_err(d, hash_, Code::kCorrupt, std::string(total) + " ");
  }
  // A two-tier export whose low tier declares other tokens of the head (as many, inside its kept
  // ones) than the low tier's file holds: the merged positions would still be the kept ones.
  {
    using E = kvstore::KvEncoding;
    auto ret = kvstore::retention_apply(
        kvstore::retention_parse("snapkv:budget=200,window=32,pool=7,high=64").value(), 2, 2,
        kN, &imp_);
    ASSERT_TRUE(ret.is_ok());
    const std::string two = export_to("agree-tiers", &ret.value(), E::kInt8, E::kInt4);
    ASSERT_TRUE(decode::load_kv_export(two, hash_).is_ok());
    const std::string d = copy_of(two, "tiers-moved");
    auto v = read_manifest(d);
    auto& h0 = retention_head(v, 0, 0);
    std::vector<int64_t> kept, low;
    for (const auto& [a, b] : runs_of(h0))
      for (int64_t t = a; t < b; ++t) kept.push_back(t);
    for (const auto& [a, b] : runs_of(h0.at("low").as_object()))
      for (int64_t t = a; t < b; ++t) low.push_back(t);
    ASSERT_FALSE(low.empty());
    ASSERT_LT(low.size(), kept.size());
    // The first kept tokens as the low tier, or the last ones where those are the low tier.
    std::vector<int64_t> moved(kept.begin(), kept.begin() + int64_t(low.size()));
    if (moved == low) moved.assign(kept.end() - int64_t(low.size()), kept.end());
    ASSERT_NE(moved, low);
    std::vector<kvstore::PositionRun> runs;
    for (const int64_t t : moved)
      if (!runs.empty() && runs.back().second == t)
        ++runs.back().second;
      else
        runs.push_back({t, t + 1});
    set_runs(h0["low"].as_object(), runs);
    write_manifest(d, v);
    expect_err(d, hash_, Code::kCorrupt, "positions.h0 differ from the ");
  }
}

TEST_F(KvClient, ExportRejectsARetentionOfAnotherGeometry) {
  auto r = kvstore::retention_apply(kvstore::RetentionPolicy{}, 2, 2, kN - 1, nullptr);
  ASSERT_TRUE(r.is_ok());
  Status st = testing::export_prefill(*model_, toks_, pr_, tmp_.sub("bad"), &r.value(), &imp_);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("retention geometry"), std::string::npos) << st.to_string();
  EXPECT_FALSE(fs::exists(tmp_.sub("bad")));  // nothing half-written
}

// A sharded export (format 3): the cache written as the parts a TP 2 x CP 2 group holds (KV head
// 0 or 1 x the zigzag chunk pairs {[0, 64), [256, 300)} and {[64, 256)}), each part by its own
// export_kv_shards call from its own rows, then one manifest. Loading it gives exactly the heads
// of the one-part export; coverage and block alignment are checked on both sides.
TEST_F(KvClient, ShardedExportLoadsAsTheWhole) {
  kvstore::KvExportSpec spec = spec_of(kvstore::KvEncoding::kF32);
  const int d = 16, hkv = 2;
  const std::vector<std::vector<std::array<int64_t, 2>>> chunks = {{{0, 64}, {256, kN}},
                                                                   {{64, 256}}};
  // A part's rows, token-major [its tokens, its heads, d], cut out of the whole cache.
  auto rows_of = [&](const kvstore::KvShardPart& part, int l, bool value) {
    std::vector<float> out;
    const auto& src = (value ? pr_.kv.v : pr_.kv.k)[size_t(l)];
    for (const auto& r : part.tokens)
      for (int64_t t = r[0]; t < r[1]; ++t)
        for (int h = part.kv_head0; h < part.kv_head0 + part.n_kv_heads; ++h)
          out.insert(out.end(), src.begin() + (t * hkv + h) * d,
                     src.begin() + (t * hkv + h + 1) * d);
    return out;
  };
  auto write = [&](const std::string& name, const std::vector<kvstore::KvShardPart>& parts) {
    auto tmp = kvstore::begin_export(tmp_.sub(name), false);
    EXPECT_TRUE(tmp.is_ok()) << tmp.status().to_string();
    std::vector<std::string> entries;
    for (const auto& part : parts) {
      std::vector<std::vector<float>> k(2), v(2);
      for (int l = 0; l < 2; ++l) {
        k[size_t(l)] = rows_of(part, l, false);
        v[size_t(l)] = rows_of(part, l, true);
      }
      auto e = kvstore::export_kv_shards(tmp.value(), spec, part, [&](int l, bool value) {
        return (value ? v : k)[size_t(l)].data();
      });
      EXPECT_TRUE(e.is_ok()) << e.status().to_string();
      entries.insert(entries.end(), e->begin(), e->end());
    }
    Status st = kvstore::export_kv_manifest(tmp.value(), spec, entries);
    if (st.is_ok()) st = kvstore::finish_export(tmp.value(), tmp_.sub(name), /*force=*/true);
    return st;
  };
  std::vector<kvstore::KvShardPart> parts;
  for (int c = 0; c < 2; ++c)
    for (int h = 0; h < 2; ++h) {
      kvstore::KvShardPart p;
      p.tokens = chunks[size_t(c)];
      p.kv_head0 = h;
      p.n_kv_heads = 1;
      p.rank = c * 2 + h;
      p.file_tag = ".r" + std::to_string(p.rank);
      parts.push_back(p);
    }
  ASSERT_TRUE(write("sharded", parts).is_ok());
  EXPECT_TRUE(fs::exists(tmp_.sub("sharded") + "/layer_001.r3.safetensors"));
  auto sharded = decode::load_kv_export(tmp_.sub("sharded"), hash_);
  ASSERT_TRUE(sharded.is_ok()) << sharded.status().to_string();
  auto whole = decode::load_kv_export(export_to("whole", nullptr), hash_);
  ASSERT_TRUE(whole.is_ok()) << whole.status().to_string();
  std::vector<int32_t> all(kN);
  for (int i = 0; i < kN; ++i) all[size_t(i)] = i;
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < hkv; ++h) {
      const decode::HeadKv& a = sharded->head(l, h);
      const decode::HeadKv& b = whole->head(l, h);
      EXPECT_EQ(a.positions, b.positions);
      EXPECT_EQ(a.k, b.k);
      EXPECT_EQ(a.v, b.v);
      EXPECT_EQ(a.block_kmin, b.block_kmin);
      EXPECT_EQ(a.block_kmax, b.block_kmax);
      EXPECT_EQ(a.block_kmean, b.block_kmean);
      EXPECT_EQ(a.block_importance, b.block_importance);
      expect_head_matches_cache(sharded.value(), l, h, all);
    }
  // int4 in parts: every part encodes its whole blocks, so the groups are the whole export's.
  spec.encoding = kvstore::KvEncoding::kInt4;
  ASSERT_TRUE(write("sharded-int4", parts).is_ok());
  auto s4 = decode::load_kv_export(tmp_.sub("sharded-int4"), hash_);
  ASSERT_TRUE(s4.is_ok()) << s4.status().to_string();
  auto w4 =
      decode::load_kv_export(export_to("whole-int4", nullptr, kvstore::KvEncoding::kInt4), hash_);
  ASSERT_TRUE(w4.is_ok()) << w4.status().to_string();
  EXPECT_EQ(s4->kv_bytes, w4->kv_bytes);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < hkv; ++h) {
      EXPECT_EQ(s4->head(l, h).k, w4->head(l, h).k);
      EXPECT_EQ(s4->head(l, h).v, w4->head(l, h).v);
      EXPECT_NE(s4->head(l, h).k, whole->head(l, h).k);
    }
  spec.encoding = kvstore::KvEncoding::kF32;
  // The writer refuses parts that overlap, leave a gap, or split a block of 64 mid-head.
  auto refused = [&](const std::string& name, std::vector<kvstore::KvShardPart> ps,
                     const std::string& needle) {
    const Status st = write(name, ps);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << name << ": " << st.to_string();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.to_string();
  };
  auto dup = parts;
  dup.push_back(parts[0]);
  dup.back().file_tag = ".dup";
  refused("overlap", dup, "overlap at token 0");
  auto gap = parts;
  gap.pop_back();  // chunk {64, 256} of head 1 missing
  refused("gap", gap, "leave a gap at token 64");
  auto odd = parts;
  odd[0].tokens = {{0, 100}, {256, kN}};
  odd[2].tokens = {{100, 256}};
  odd[1].tokens = odd[0].tokens;
  odd[3].tokens = odd[2].tokens;
  refused("split", odd, "not whole blocks of 64");
  // The reader refuses a manifest whose shards do not cover a head (one entry dropped).
  {
    const std::string d = copy_of(tmp_.sub("sharded"), "sharded-gap");
    auto v = read_manifest(d);
    auto& sh = v.as_object()["shards"].as_array();
    sh.erase(sh.begin() + 1);
    write_manifest(d, v);
    auto r = decode::load_kv_export(d, hash_);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), Code::kCorrupt);
    EXPECT_NE(r.status().message().find("leave a gap"), std::string::npos)
        << r.status().to_string();
  }
  // Every head keeps tokens 0-29 only: the parts' runs [64, 256) and [256, 300) keep nothing, and
  // the latter's first row falls inside the part's one partial block. The load has that one
  // block's metadata once, as the whole export's.
  {
    kvstore::Retention first30;
    first30.policy = "streaming";
    first30.params = "sink=30,window=0";
    first30.n_layers = 2;
    first30.n_kv_heads = hkv;
    first30.n_tokens = kN;
    std::vector<int32_t> p30(30);
    for (int i = 0; i < 30; ++i) p30[size_t(i)] = i;
    first30.kept.assign(size_t(2 * hkv), p30);
    spec.retention = &first30;
    ASSERT_TRUE(write("sharded-first30", parts).is_ok());
    spec.retention = nullptr;
    auto a = decode::load_kv_export(tmp_.sub("sharded-first30"), hash_);
    ASSERT_TRUE(a.is_ok()) << a.status().to_string();
    auto b = decode::load_kv_export(export_to("whole-first30", &first30), hash_);
    ASSERT_TRUE(b.is_ok()) << b.status().to_string();
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < hkv; ++h) {
        const decode::HeadKv& x = a->head(l, h);
        EXPECT_EQ(x.positions, p30);
        EXPECT_EQ(x.block_kmin.size(), size_t(d)) << "one block of metadata";
        EXPECT_EQ(x.block_importance.size(), 1u);
        EXPECT_EQ(x.block_kmin, b->head(l, h).block_kmin);
        EXPECT_EQ(x.block_kmax, b->head(l, h).block_kmax);
        EXPECT_EQ(x.block_kmean, b->head(l, h).block_kmean);
        EXPECT_EQ(x.block_importance, b->head(l, h).block_importance);
        EXPECT_EQ(x.k, b->head(l, h).k);
      }
  }
}

// The fuzz target's seed must stay a valid manifest, or the fuzzer never gets past the checks.
TEST(KvManifest, FuzzSeedIsAcceptedAndTamperedCopiesAreNot) {
  auto read_seed = [](const char* name) {
    std::ifstream f(std::string(SF_SOURCE_DIR) + "/tests/fuzz/" + name);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  const std::string seed = read_seed("kv_manifest_seed.json");
  // The seeds' model fields hash to this (kvstore::compat_hash, pinned in test_kv_export).
  const std::string h = "5688de8268c8db7a";
  auto m = decode::parse_kv_manifest(seed, h);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  EXPECT_EQ(m->meta.n_tokens, 2);
  EXPECT_EQ(m->kept, (std::vector<int64_t>{2}));
  std::string bad = seed;
  const std::string k32 = "\"kv_bytes\":32";
  bad.replace(bad.find(k32), k32.size(), "\"kv_bytes\":33");
  EXPECT_NE(
      decode::parse_kv_manifest(bad, h).status().message().find("kv_bytes 33"),
      std::string::npos);
  // The two-tier seed (format 5): int8 for positions 0 and 2, int4 for 1.
  const std::string seed5 = read_seed("kv_manifest_seed_v5.json");
  auto m5 = decode::parse_kv_manifest(seed5, h);
  ASSERT_TRUE(m5.is_ok()) << m5.status().to_string();
  EXPECT_EQ(m5->meta.kv_dtype_low, "int4");
  ASSERT_EQ(m5->tier_ranges.size(), 2u);
  EXPECT_EQ(m5->tier_ranges[0][0],
            (std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {2, 3}}));
  EXPECT_EQ(m5->tier_ranges[1][0], (std::vector<std::pair<int64_t, int64_t>>{{1, 2}}));
  std::string bad5 = seed5;
  const std::string k38 = "\"kv_bytes\":38";
  bad5.replace(bad5.find(k38), k38.size(), "\"kv_bytes\":37");
  EXPECT_NE(
      decode::parse_kv_manifest(bad5, h).status().message().find("kv_bytes 37"),
      std::string::npos);
}

}  // namespace
}  // namespace sf
