// Loader and forward invariants on small synthetic models (no external files needed).
#include <gtest/gtest.h>

#include <functional>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <future>
#include <mutex>
#include <cstdio>
#include <fstream>
#include <random>

#include "tests/common/logit_rows.h"
#include "tests/common/test_seed.h"
#include "tests/worker/model/gguf_builder.h"
#include "worker/model/gguf.h"
#include "worker/model/kv_sizer.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"
#include "tests/common/nan_max.h"

namespace sf {
namespace {

model::ModelConfig tiny_config(model::Arch arch = model::Arch::kLlama) {
  model::ModelConfig c;
  c.arch = arch;
  c.name = "tiny";
  c.n_layers = 2;
  c.hidden = 64;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.intermediate = 96;
  c.vocab = 101;
  c.max_context = 4096;
  c.qkv_bias = arch == model::Arch::kQwen2;
  c.rope.neox = arch == model::Arch::kQwen2;
  c.rope.theta = 10000.f;
  return c;
}

std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % uint64_t(vocab));
  return t;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = testing::nan_max(m, double(std::fabs(a[i] - b[i])));
  return m;
}

// A sparse config of the tiny model with these per-layer head patterns, estimated at any length.
model::SparseConfig patterns_config(const model::ModelConfig& c,
                                    std::vector<std::vector<kernels::HeadPattern>> layers) {
  model::SparseConfig sc;
  sc.n_layers = c.n_layers;
  sc.n_heads = c.n_heads;
  sc.dense_below = 0;
  sc.layers = std::move(layers);
  return sc;
}

TEST(Forward, ChunkSizeDoesNotChangeResults) {
  const uint64_t seed = testing::fresh_seed();
  for (auto arch : {model::Arch::kLlama, model::Arch::kQwen2}) {
    auto m = model::Model::synthetic(tiny_config(arch), seed);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    const auto toks = random_tokens(300, 101, seed + 1);
    model::PrefillOptions a, b;
    a.chunk = 512;
    b.chunk = 37;  // odd size: chunk boundaries fall inside 64-row attention blocks
    a.all_logits = b.all_logits = true;
    auto ra = model::prefill(m.value(), toks, a);
    auto rb = model::prefill(m.value(), toks, b);
    ASSERT_TRUE(ra.is_ok() && rb.is_ok());
    EXPECT_LT(max_abs_diff(ra->logits, rb->logits), 1e-4);
    for (int l = 0; l < 2; ++l) EXPECT_LT(max_abs_diff(ra->kv.k[size_t(l)], rb->kv.k[size_t(l)]), 1e-5);
  }
}

TEST(Forward, ExtendEqualsFullPrefill) {
  const uint64_t seed = testing::fresh_seed();
  auto m = model::Model::synthetic(tiny_config(), seed);
  ASSERT_TRUE(m.is_ok());
  const auto toks = random_tokens(150, 101, seed + 2);
  auto full = model::prefill(m.value(), toks);
  ASSERT_TRUE(full.is_ok());
  model::PrefillResult r;
  ASSERT_TRUE(model::extend(m.value(), std::span(toks).first(100), {}, &r).is_ok());
  ASSERT_TRUE(model::extend(m.value(), std::span(toks).subspan(100), {}, &r).is_ok());
  EXPECT_EQ(r.kv.n_tokens, 150);
  const double dl = max_abs_diff(r.logits, full->logits);
  EXPECT_LT(dl, 1e-4);
  if (r.first_token != full->first_token)  // only at a near-tie of the reference's top two
    EXPECT_LT(testing::top2_gap(full->logits.data() + full->logits.size() - tiny_config().vocab,
                                tiny_config().vocab),
              2 * dl)
        << "first tokens " << r.first_token << " vs " << full->first_token;
  EXPECT_LT(max_abs_diff(r.kv.v[1], full->kv.v[1]), 1e-5);
  // A call that fails (here: a sparse config for another model) leaves the cache as it was, so a
  // later call does not attend to rows it never finished.
  model::SparseConfig wrong;
  wrong.n_layers = 1;
  wrong.n_heads = 1;
  model::PrefillOptions bad;
  bad.sparse = &wrong;
  const auto more = random_tokens(10, 101, seed + 3);
  EXPECT_FALSE(model::extend(m.value(), more, bad, &r).is_ok());
  EXPECT_EQ(r.kv.n_tokens, 150);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(r.kv.k[size_t(l)].size(), full->kv.k[size_t(l)].size());
    EXPECT_EQ(r.kv.v[size_t(l)].size(), full->kv.v[size_t(l)].size());
  }
  // A cache whose layers do not hold n_tokens rows is refused.
  model::PrefillResult cut = r;
  cut.kv.v[1].resize(10);
  EXPECT_FALSE(model::extend(m.value(), more, {}, &cut).is_ok());
  // Not keeping K/V while extending a cached prefix would free the prefix's rows (and a failure
  // could not give them back): refused, the cache untouched.
  model::PrefillOptions drop;
  drop.keep_kv = false;
  const Status st = model::extend(m.value(), more, drop, &r);
  EXPECT_NE(st.message().find("keep_kv false with 150 cached tokens"), std::string::npos)
      << st.to_string();
  EXPECT_EQ(r.kv.k[0].size(), full->kv.k[0].size());
}

// Importance from the estimator's own scores: with 640 tokens (whole 64-row blocks) the
// vertical-slash heads' scoring rows and the block heads' last query block are both the last 64
// rows. Those scores are the full softmax, so layer 0 (whose q and k do not depend on how
// attention ran) must equal the LSE pass of a dense prefill with window 64. So must the LSE pass of
// a sparse prefill, whose window rows take their LSE from a dense pass (the sparse attention's
// covers the selected keys only). Layer 1's group 1 mixes a dense head in, so it keeps the LSE
// pass; PrefillResult::importance_reused_groups shows which path each run took.
TEST(Forward, ImportanceFromEstimatorIsTheSoftmaxOfTheLastRows) {
  const uint64_t seed = testing::fresh_seed();
  const model::ModelConfig c = tiny_config();
  auto m = model::Model::synthetic(c, seed);
  ASSERT_TRUE(m.is_ok());
  kernels::HeadPattern vs, bs, dn;
  vs.pattern = kernels::Pattern::kVerticalSlash;
  vs.n_vertical = 100;
  vs.n_slash = 64;
  bs.pattern = kernels::Pattern::kBlockSparse;
  bs.n_blocks = 3;
  dn.pattern = kernels::Pattern::kDense;
  const model::SparseConfig sc = patterns_config(c, {{bs, bs, vs, vs}, {vs, vs, dn, vs}});
  const auto toks = random_tokens(640, c.vocab, seed + 1);
  const int64_t nk = 640;
  model::PrefillOptions o;
  o.importance_window = 64;
  o.importance_pool = 7;
  auto dense = model::prefill(m.value(), toks, o);
  o.sparse = &sc;
  std::vector<std::pair<int, double>> seen;  // on_sparse_index: layer, the index's density
  o.on_sparse_index = [&](int l, const kernels::SparseIndex& idx) {
    seen.emplace_back(l, idx.density());
  };
  auto lse = model::prefill(m.value(), toks, o);
  o.on_sparse_index = nullptr;
  o.importance_from_estimator = true;
  auto est = model::prefill(m.value(), toks, o);
  ASSERT_TRUE(dense.is_ok() && lse.is_ok() && est.is_ok());
  {
    // An even pool is refused when the estimator scores every group (kv_importance, which held
    // the only check, then never runs): every head vertical-slash.
    const model::SparseConfig all_vs = patterns_config(c, {{vs, vs, vs, vs}, {vs, vs, vs, vs}});
    model::PrefillOptions even = o;
    even.sparse = &all_vs;
    even.importance_pool = 8;
    auto r = model::prefill(m.value(), toks, even);
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("prefill: importance_pool"), std::string::npos)
        << r.status().to_string();
  }
  EXPECT_EQ(lse->logits, est->logits);  // attention is the same either way
  // Each layer's index once, in order; both layers have the same causal pairs, so the run's
  // density is their mean.
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].first, 0);
  EXPECT_EQ(seen[1].first, 1);
  EXPECT_NEAR(lse->density, (seen[0].second + seen[1].second) / 2, 1e-12);
  EXPECT_LT(lse->density, 0.95);
  EXPECT_EQ(lse->importance_reused_groups, 0);
  // Layer 0: both groups (block-sparse pair, vertical-slash pair); layer 1: group 0 only.
  EXPECT_EQ(est->importance_reused_groups, 3);
  const auto& a = dense->importance[0];
  const auto& b = est->importance[0];
  ASSERT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t j = 0; j < a.size(); ++j)
    worst = std::max(worst, std::fabs(double(a[j]) - b[j]) / (1e-3 + std::fabs(double(a[j]))));
  EXPECT_LT(worst, 1e-4);
  std::printf("layer 0: estimator scores vs the dense LSE pass, max rel diff %.2g\n", worst);
  // The LSE pass on a sparse layer takes its window rows' LSE over every key, not the sparse
  // attention's over the selected ones: layer 0 (same K as the dense run) scores as dense does.
  worst = 0;
  for (size_t j = 0; j < a.size(); ++j)
    worst = std::max(
        worst, std::fabs(double(a[j]) - lse->importance[0][j]) / (1e-3 + std::fabs(double(a[j]))));
  EXPECT_LT(worst, 1e-4);
  std::printf("layer 0: sparse prefill's LSE pass vs the dense one, max rel diff %.2g\n", worst);
  // Layer 1: group 0 (two vertical-slash heads) reuses the estimator's sums, the same softmax
  // as the LSE pass up to summation order; group 1 (a dense head) takes the LSE pass both ways.
  const auto& l1 = est->importance[1];
  const auto& l1_lse = lse->importance[1];
  worst = 0;
  for (int64_t j = 0; j < nk; ++j)
    worst = std::max(worst, std::fabs(double(l1[size_t(j)]) - l1_lse[size_t(j)]) /
                                (1e-3 + std::fabs(double(l1_lse[size_t(j)]))));
  EXPECT_LT(worst, 1e-4);
  EXPECT_TRUE(std::equal(l1.begin() + nk, l1.end(), l1_lse.begin() + nk));  // group 1: LSE pass
}

// Importance reused from the estimator is on the LSE pass's scale whatever the estimator scored:
// at 1,089 tokens a block head's last query block is 1 row, the LSE window 32 rows. Unpooled,
// every group's scores then sum to (query heads a group) x 32, from either source, so adakv's
// shared budget and tiering's max over KV heads compare like with like.
TEST(Forward, ImportanceFromEstimatorIsOnTheWindowScale) {
  const uint64_t seed = testing::fresh_seed();
  const model::ModelConfig c = tiny_config();
  auto m = model::Model::synthetic(c, seed);
  ASSERT_TRUE(m.is_ok());
  kernels::HeadPattern bs, dn;
  bs.pattern = kernels::Pattern::kBlockSparse;
  bs.n_blocks = 3;
  dn.pattern = kernels::Pattern::kDense;
  // Group 0 from the estimator, group 1 from the LSE pass.
  const model::SparseConfig sc = patterns_config(c, {{bs, bs, dn, dn}, {bs, bs, dn, dn}});
  const int64_t nk = 1089;
  const auto toks = random_tokens(nk, c.vocab, seed + 1);
  model::PrefillOptions o;
  o.importance_window = 32;
  o.importance_pool = 1;
  o.sparse = &sc;
  o.importance_from_estimator = true;
  auto est = model::prefill(m.value(), toks, o);
  ASSERT_TRUE(est.is_ok()) << est.status().to_string();
  EXPECT_EQ(est->importance_reused_groups, 2);
  const double want = double(c.n_heads / c.n_kv_heads) * 32;
  for (int l = 0; l < c.n_layers; ++l)
    for (int g = 0; g < c.n_kv_heads; ++g) {
      double total = 0;
      for (int64_t j = 0; j < nk; ++j) total += est->importance[size_t(l)][size_t(g * nk + j)];
      EXPECT_NEAR(total, want, 1e-3 * want) << "layer " << l << " group " << g;
    }
}

TEST(Forward, RejectsBadTokens) {
  auto m = model::Model::synthetic(tiny_config(), 1);
  ASSERT_TRUE(m.is_ok());
  std::vector<int32_t> bad{1, 2, 101};
  auto r = model::prefill(m.value(), bad);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("position 2"), std::string::npos) << r.status().message();
  EXPECT_FALSE(model::prefill(m.value(), std::vector<int32_t>{}).is_ok());
}

// A GGUF model written by an independent builder, then loaded and compared with the same
// weights fed to Model::synthetic's forward via a second path: Q/K rows permuted to the GGUF
// adjacent-pair layout must give the same logits as the rotate-half model.
TEST(GgufLoader, LoadsTinyLlamaAndMatchesRotateHalfEquivalent) {
  const uint64_t seed = testing::fresh_seed();
  auto cfg = tiny_config();
  cfg.rope.neox = true;
  cfg.tied_embeddings = true;  // the GGUF below has no output.weight
  auto hf = model::Model::synthetic(cfg, seed);
  ASSERT_TRUE(hf.is_ok());
  const int d = cfg.head_dim;
  // HF row (head h, i) -> GGUF row (head h, 2i) and (h, i + d/2) -> (h, 2i+1): llama.cpp's permute.
  auto permute = [&](const model::OwnedTensor& t, int heads) {
    std::vector<float> out(t.data.size());
    const int64_t cols = t.shape[1];
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d / 2; ++i) {
        std::copy_n(&t.data[size_t((h * d + i) * cols)], cols, &out[size_t((h * d + 2 * i) * cols)]);
        std::copy_n(&t.data[size_t((h * d + i + d / 2) * cols)], cols, &out[size_t((h * d + 2 * i + 1) * cols)]);
      }
    return out;
  };
  testing::GgufBuilder b;
  testing::add_llama(b, hf.value(), "tiny-gguf", permute);
  const auto bytes = b.build();
  const std::string path = ::testing::TempDir() + "tiny.gguf";
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  auto gm = model::Model::load(path);
  ASSERT_TRUE(gm.is_ok()) << gm.status().to_string();
  EXPECT_FALSE(gm->config().rope.neox);
  EXPECT_TRUE(gm->config().tied_embeddings);
  const auto toks = random_tokens(90, cfg.vocab, seed + 3);
  auto ra = model::prefill(hf.value(), toks);
  auto rb = model::prefill(gm.value(), toks);
  ASSERT_TRUE(ra.is_ok() && rb.is_ok());
  EXPECT_LT(max_abs_diff(ra->logits, rb->logits), 1e-3);

  // Truncation at every 97th length: always an error, never a crash.
  for (size_t n = 0; n < bytes.size(); n += 97) {
    auto g = model::GgufFile::parse({bytes.data(), n});
    if (g.is_ok()) {  // header may parse when only tensor data is cut... but then offsets fail
      ADD_FAILURE() << "truncated GGUF of " << n << " bytes parsed";
    }
  }
}

TEST(GgufLoader, UnknownArchitectureIsRejectedByName) {
  testing::GgufBuilder b;
  b.kv_string("general.architecture", "gpt2");
  b.tensor_f32("token_embd.weight", {4, 3}, std::vector<float>(12, 0.5f));
  const auto bytes = b.build();
  const std::string path = ::testing::TempDir() + "gpt2.gguf";
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  auto m = model::Model::load(path);
  ASSERT_FALSE(m.is_ok());
  EXPECT_EQ(m.status().code(), Code::kUnsupported);
  EXPECT_NE(m.status().message().find("unknown architecture 'gpt2'"), std::string::npos) << m.status().message();
}

// RoPE scaling the forward does not implement (linear, YaRN) is refused by name, never loaded to
// rotate with unscaled frequencies; "none", or a factor of 1, loads.
TEST(GgufLoader, UnsupportedRopeScalingIsRefused) {
  const model::ModelConfig cfg = tiny_config();
  auto m = model::Model::synthetic(cfg, testing::fresh_seed());
  ASSERT_TRUE(m.is_ok());
  struct Case {
    const char* type;
    float factor;
    bool ok;
  };
  for (const Case& k : {Case{"linear", 4.f, false}, Case{"yarn", 4.f, false},
                        Case{"none", 0.f, true}, Case{"linear", 1.f, true}}) {
    testing::GgufBuilder b;
    testing::add_llama(b, m.value(), "tiny-scaled");
    b.kv_string("llama.rope.scaling.type", k.type);
    if (k.factor > 0) b.kv_f32("llama.rope.scaling.factor", k.factor);
    const auto bytes = b.build();
    const std::string path = ::testing::TempDir() + "scaled.gguf";
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    auto r = model::Model::load(path);
    EXPECT_EQ(r.is_ok(), k.ok) << k.type << " " << k.factor << ": " << r.status().to_string();
    if (!k.ok) {
      EXPECT_EQ(r.status().code(), Code::kUnsupported);
      EXPECT_NE(r.status().message().find(std::string("RoPE scaling '") + k.type + "'"),
                std::string::npos)
          << r.status().message();
    }
  }
}

// A partial rotary dimension is range-checked before it is narrowed to int: 2^32 + 2 would
// otherwise load as a rotation of 2 dimensions. An in-range partial rotation loads.
TEST(GgufLoader, RopeDimensionCountOutOfRangeIsRefused) {
  const model::ModelConfig cfg = tiny_config();
  auto m = model::Model::synthetic(cfg, testing::fresh_seed());
  ASSERT_TRUE(m.is_ok());
  for (const uint64_t rot : {(uint64_t(1) << 32) + 2, uint64_t(2)}) {
    testing::GgufBuilder b;
    testing::add_llama(b, m.value(), "tiny-rot");
    b.kv_u64("llama.rope.dimension_count", rot);
    const auto bytes = b.build();
    const std::string path = ::testing::TempDir() + "rot.gguf";
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    auto r = model::Model::load(path);
    if (rot == 2) {
      ASSERT_TRUE(r.is_ok()) << r.status().to_string();
      EXPECT_EQ(r->config().rope.rot_dim, 2);
    } else {
      ASSERT_FALSE(r.is_ok());
      EXPECT_EQ(r.status().code(), Code::kCorrupt);
      EXPECT_NE(r.status().message().find("rope.dimension_count"), std::string::npos)
          << r.status().message();
    }
  }
}

// Biases the forward does not apply (o_proj, MLP) are refused, not dropped into wrong logits; a
// partial rotation's rope_freqs holds rot_dim / 2 divisors, as llama.cpp writes it.
TEST(GgufLoader, UnappliedBiasesAreRefusedAndRopeFreqsFollowTheRotation) {
  const model::ModelConfig cfg = tiny_config();
  auto m = model::Model::synthetic(cfg, testing::fresh_seed());
  ASSERT_TRUE(m.is_ok());
  const auto load = [&](const std::function<void(testing::GgufBuilder&)>& extra) {
    testing::GgufBuilder b;
    testing::add_llama(b, m.value(), "tiny-extra");
    extra(b);
    const auto bytes = b.build();
    const std::string path = ::testing::TempDir() + "extra.gguf";
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    return model::Model::load(path);
  };
  const uint64_t H = uint64_t(cfg.hidden);
  for (const char* bias : {"attn_output.bias", "ffn_down.bias"}) {
    auto r = load([&](testing::GgufBuilder& b) {
      b.tensor_f32(std::string("blk.1.") + bias, {H}, std::vector<float>(size_t(H), 0.5f));
    });
    ASSERT_FALSE(r.is_ok()) << bias;
    EXPECT_EQ(r.status().code(), Code::kUnsupported);
    EXPECT_NE(r.status().message().find(std::string("blk.1.") + bias), std::string::npos)
        << r.status().message();
  }
  const int rot = cfg.head_dim / 2;
  auto partial = load([&](testing::GgufBuilder& b) {
    b.kv_u64("llama.rope.dimension_count", uint64_t(rot));
    b.tensor_f32("rope_freqs.weight", {uint64_t(rot / 2)}, std::vector<float>(size_t(rot / 2), 1.f));
  });
  ASSERT_TRUE(partial.is_ok()) << partial.status().to_string();
  EXPECT_EQ(partial->config().rope.rot_dim, rot);
}

TEST(GgufLoader, BadMagicAndMissingFile) {
  const uint8_t junk[16] = {'G', 'G', 'U', 'X'};
  auto g = model::GgufFile::parse({junk, sizeof junk});
  ASSERT_FALSE(g.is_ok());
  EXPECT_NE(g.status().message().find("magic"), std::string::npos);
  auto m = model::Model::load("/nonexistent/model.gguf");
  ASSERT_FALSE(m.is_ok());
  EXPECT_NE(m.status().message().find("does not exist"), std::string::npos);
}

TEST(Dequant, Q4_1AndQ8_0AndQ4_0KnownBlocks) {
  // Q4_1 block: d=0.5 (f16 0x3800), m=-1 (0xbc00), nibbles j -> element j (low) and j+16 (high)
  uint8_t q41[20] = {0x00, 0x38, 0x00, 0xbc};
  for (int j = 0; j < 16; ++j) q41[4 + j] = uint8_t((15 - j) << 4 | j);
  float out[32];
  ASSERT_TRUE(model::dequantize_row(3, q41, 32, out).is_ok());
  for (int j = 0; j < 16; ++j) {
    EXPECT_FLOAT_EQ(out[j], 0.5f * j - 1.f);
    EXPECT_FLOAT_EQ(out[j + 16], 0.5f * (15 - j) - 1.f);
  }
  uint8_t q80[34] = {0x00, 0x40};  // d = 2
  for (int j = 0; j < 32; ++j) q80[2 + j] = uint8_t(int8_t(j - 16));
  ASSERT_TRUE(model::dequantize_row(8, q80, 32, out).is_ok());
  for (int j = 0; j < 32; ++j) EXPECT_FLOAT_EQ(out[j], 2.f * (j - 16));
  uint8_t q40[18] = {0x00, 0x3c};  // d = 1
  for (int j = 0; j < 16; ++j) q40[2 + j] = uint8_t(j << 4 | (15 - j));
  ASSERT_TRUE(model::dequantize_row(2, q40, 32, out).is_ok());
  for (int j = 0; j < 16; ++j) {
    EXPECT_FLOAT_EQ(out[j], float(15 - j - 8));
    EXPECT_FLOAT_EQ(out[j + 16], float(j - 8));
  }
  EXPECT_FALSE(model::dequantize_row(12, q40, 32, out).is_ok());  // Q4_K: unsupported, clear error
}

// --model synthetic:SHAPE[:LAYERS[:SEED]]: the Llama-3-8B shape, its layer count and seed;
// anything else after the prefix is an error naming the spec; other model strings are not
// synthetic at all.
TEST(SyntheticModel, SpecsParseToTheShapeLayersAndSeed) {
  auto a = model::parse_synthetic_model("synthetic:llama3-8b");
  ASSERT_TRUE(a.is_ok() && a.value().has_value());
  EXPECT_EQ(a.value()->config.n_layers, 32);
  EXPECT_EQ(a.value()->config.hidden, 4096);
  EXPECT_EQ(a.value()->config.n_kv_heads, 8);
  EXPECT_EQ(a.value()->seed, 1u);
  auto b = model::parse_synthetic_model("synthetic:llama3-8b:8:18446744073709551615");
  ASSERT_TRUE(b.is_ok() && b.value().has_value());
  EXPECT_EQ(b.value()->config.n_layers, 8);
  EXPECT_EQ(b.value()->seed, 18446744073709551615ull);
  auto none = model::parse_synthetic_model("models/x.gguf");
  ASSERT_TRUE(none.is_ok());
  EXPECT_FALSE(none.value().has_value());
  for (const char* bad : {"synthetic:", "synthetic:llama3-70b", "synthetic:llama3-8b:0",
                          "synthetic:llama3-8b:33", "synthetic:llama3-8b:8:", "synthetic:llama3-8b: 8",
                          "synthetic:llama3-8b:+8", "synthetic:llama3-8b:8:-1",
                          "synthetic:llama3-8b:8:18446744073709551616", "synthetic:llama3-8b:8:1:2"}) {
    auto r = model::parse_synthetic_model(bad);
    EXPECT_FALSE(r.is_ok()) << bad;
    if (!r.is_ok()) EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status().message();
  }
  auto shape = model::Model::shape_only(b.value()->config, "synthetic:llama3-8b:8");
  ASSERT_TRUE(shape.is_ok());
  EXPECT_FALSE(shape.value().has_weights());
  // No host forward runs on it: one clear error, not an index into empty weights.
  const std::vector<int32_t> toks{1, 2, 3};
  auto p = model::prefill(shape.value(), toks, {});
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), Code::kUnsupported);
  EXPECT_NE(p.status().message().find("has no host weights"), std::string::npos)
      << p.status().message();
}

// The pinned K/V ring's slots (model::kv_staging_slots, which the device plan allocates and the
// worker's host check counts): kv_staging_layers bounded by n_layers and by the byte cap, never
// below two slots for the cap, and a slot per layer (uncapped) for 0.
TEST(KvStaging, SlotsFollowLayersAndTheByteCap) {
  model::PrefillOptions o;  // 8 slots, 8 GiB
  const int64_t gib = int64_t(1) << 30;
  EXPECT_EQ(model::kv_staging_slots(o, 32, 537 * (int64_t(1) << 20)), 8);  // 128K CP 2: 4.2 GiB
  EXPECT_EQ(model::kv_staging_slots(o, 32, int64_t(4.3 * double(gib))), 2);  // 1M CP 2: the floor
  EXPECT_EQ(model::kv_staging_slots(o, 32, 3 * gib), 2);
  EXPECT_EQ(model::kv_staging_slots(o, 32, gib), 8);
  EXPECT_EQ(model::kv_staging_slots(o, 32, gib + 1), 7);
  EXPECT_EQ(model::kv_staging_slots(o, 4, 1024), 4);  // never more than the layers
  o.kv_staging_layers = 1;
  EXPECT_EQ(model::kv_staging_slots(o, 32, 3 * gib), 1);  // the floor does not raise a ring
  o.kv_staging_layers = 0;
  EXPECT_EQ(model::kv_staging_slots(o, 32, 3 * gib), 32);  // a slot per layer, as asked
  o.kv_staging_layers = 8;
  o.kv_staging_max_bytes = 0;
  EXPECT_EQ(model::kv_staging_slots(o, 32, 3 * gib), 8);  // no cap
}

// The device forward's KV sizer: every layer's K and V sized and zeroed, a layer's wait
// returning once its own are (the rest may still be going), no memory reported at the first
// wait and at finish, and a sizer destroyed before its waits stops and joins.
TEST(KvSizer, SizesEveryLayerWaitsAndReportsFailure) {
  const size_t n = size_t(3) << 19;  // 6 MiB a vector (the huge-page path too)
  model::KvCache kv;
  kv.k.assign(6, std::vector<float>(7, 1.f));
  kv.v.assign(6, {});
  {
    model::KvSizer sz(&kv, n, 3);
    ASSERT_TRUE(sz.wait(0).is_ok());
    ASSERT_EQ(kv.k[0].size(), n);
    ASSERT_EQ(kv.v[0].size(), n);
    ASSERT_TRUE(sz.wait(5).is_ok());
    double s = -1;
    ASSERT_TRUE(sz.finish(&s).is_ok());
    EXPECT_GE(s, 0.0);
  }
  for (int l = 0; l < 6; ++l)
    for (const auto* v : {&kv.k[size_t(l)], &kv.v[size_t(l)]}) {
      ASSERT_EQ(v->size(), n) << l;
      for (size_t j = 0; j < n; j += 4099) ASSERT_EQ((*v)[j], 0.f) << l << " " << j;
    }
  model::KvCache huge;
  huge.k.assign(2, {});
  huge.v.assign(2, {});
  {
    model::KvSizer sz(&huge, huge.k[0].max_size() + 1, 2);
    const Status w = sz.wait(0);
    EXPECT_EQ(w.code(), Code::kResourceExhausted) << w.message();
    EXPECT_NE(w.message().find("no host memory for the kept KV"), std::string::npos) << w.message();
    EXPECT_EQ(sz.finish(nullptr).code(), Code::kResourceExhausted);
  }
  model::KvCache many;
  many.k.assign(64, {});
  many.v.assign(64, {});
  {
    // stop(): the rest is skipped, a wait for a layer it did not reach fails instead of
    // hanging, and one it reached succeeds.
    model::KvCache stopped;
    stopped.k.assign(64, {});
    stopped.v.assign(64, {});
    model::KvSizer sz(&stopped, n, 1);
    sz.stop();
    const Status last = sz.wait(63);
    EXPECT_EQ(last.is_ok(), stopped.k[63].size() == n && stopped.v[63].size() == n)
        << last.message();
    if (!last.is_ok())
      EXPECT_NE(last.message().find("stopped before layer 63"), std::string::npos)
          << last.message();
    EXPECT_TRUE(sz.finish(nullptr).is_ok());
  }
  { model::KvSizer sz(&many, n, 1); }  // destroyed at once: stops between vectors, joins
  // Whatever it reached before the stop is whole; the rest untouched (how far it got depends on
  // timing, so only that each vector is one or the other).
  for (size_t l = 0; l < many.k.size(); ++l)
    for (const auto* v : {&many.k[l], &many.v[l]})
      EXPECT_TRUE(v->empty() || v->size() == n) << l << " " << v->size();
}

// A layer's wait returns once its own vectors are sized, not after the rest: layer 1's are held
// back (on_vector blocks before them) while wait(0) must return; a wait that waited for every
// layer would time out here.
TEST(KvSizer, ALayersWaitDoesNotWaitForLaterLayers) {
  model::KvCache kv;
  kv.k.assign(4, {});
  kv.v.assign(4, {});
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  model::KvSizer sz(&kv, 1024, 1, [&](size_t i) {
    if (i < 2) return;
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return open; });
  });
  auto w0 = std::async(std::launch::async, [&] { return sz.wait(0); });
  EXPECT_EQ(w0.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "wait(0) waited for the layers after it";
  EXPECT_TRUE(kv.k[1].empty() && kv.v[1].empty());  // held back: not sized yet
  {
    std::lock_guard<std::mutex> lk(mu);
    open = true;
  }
  cv.notify_all();
  EXPECT_TRUE(w0.get().is_ok());
  EXPECT_EQ(kv.k[0].size(), 1024u);
  EXPECT_TRUE(sz.wait(3).is_ok());
  EXPECT_TRUE(sz.finish(nullptr).is_ok());
  for (size_t l = 0; l < 4; ++l) EXPECT_EQ(kv.v[l].size(), 1024u) << l;
}

}  // namespace
}  // namespace sf
