// Retention policies: each policy's defining property on random scores, and the range checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "kvstore/retention.h"

namespace sf::kvstore {
namespace {

uint64_t fresh_seed() {
  const uint64_t s = std::random_device{}();
  std::printf("seed %llu\n", static_cast<unsigned long long>(s));
  return s;
}

ImportanceScores random_scores(int L, int H, int64_t N, int pool, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<float> d(0.f, 2.f);
  ImportanceScores s;
  s.n_layers = L;
  s.n_kv_heads = H;
  s.n_tokens = N;
  s.window = 32;
  s.pool = pool;
  s.layers.assign(size_t(L), std::vector<float>(size_t(H * N)));
  for (auto& l : s.layers)
    for (auto& x : l) x = d(rng);
  return s;
}

void expect_sorted_unique_in_range(const Retention& r) {
  for (const auto& k : r.kept) {
    ASSERT_TRUE(std::is_sorted(k.begin(), k.end()));
    ASSERT_EQ(std::adjacent_find(k.begin(), k.end()), k.end()) << "duplicate position";
    if (!k.empty()) {
      ASSERT_GE(k.front(), 0);
      ASSERT_LT(k.back(), r.n_tokens);
    }
  }
}

bool keeps_last(const std::vector<int32_t>& k, int64_t N, int64_t window) {
  for (int64_t t = N - window; t < N; ++t)
    if (!std::binary_search(k.begin(), k.end(), int32_t(t))) return false;
  return true;
}

// The scored part is a top-k: no dropped candidate outranks a kept one.
void expect_topk(const std::vector<int32_t>& k, const float* score, int64_t N, int64_t window) {
  float min_kept = 1e30f, max_dropped = -1e30f;
  for (int64_t t = 0; t < N - window; ++t) {
    if (std::binary_search(k.begin(), k.end(), int32_t(t)))
      min_kept = std::min(min_kept, score[t]);
    else
      max_dropped = std::max(max_dropped, score[t]);
  }
  EXPECT_LE(max_dropped, min_kept);
}

TEST(Retention, FullKeepsEverything) {
  auto r = retention_apply(RetentionPolicy{}, 3, 2, 100, nullptr);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_TRUE(r->is_full());
  EXPECT_EQ(r->kept_total(), 3 * 2 * 100);
  EXPECT_EQ(r->policy, "full");
}

TEST(Retention, StreamingKeepsSinkAndWindow) {
  auto p = retention_parse("streaming:sink=4,window=60");
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  auto r = retention_apply(p.value(), 2, 3, 1000, nullptr);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  expect_sorted_unique_in_range(r.value());
  for (const auto& k : r->kept) {
    ASSERT_EQ(k.size(), 64u);
    EXPECT_EQ(k[3], 3);
    EXPECT_EQ(k[4], 940);
    EXPECT_TRUE(keeps_last(k, 1000, 60));
  }
  auto bad = p.value();
  bad.window = 999;
  auto e = retention_apply(bad, 2, 3, 1000, nullptr);
  ASSERT_FALSE(e.is_ok());
  EXPECT_EQ(e.status().code(), Code::kOutOfRange);
  EXPECT_NE(e.status().message().find("sink + window"), std::string::npos) << e.status().message();
}

TEST(Retention, SnapKVKeepsWindowPlusTopScored) {
  const uint64_t seed = fresh_seed();
  const int L = 3, H = 2;
  const int64_t N = 777;
  const auto sc = random_scores(L, H, N, 7, seed);
  auto p = retention_parse("snapkv:budget=200,window=32,pool=7");
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  auto r = retention_apply(p.value(), L, H, N, &sc);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  expect_sorted_unique_in_range(r.value());
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      const auto& k = r->positions(l, h);
      ASSERT_EQ(k.size(), 200u);
      EXPECT_TRUE(keeps_last(k, N, 32));
      expect_topk(k, sc.layers[size_t(l)].data() + h * N, N, 32);
    }
  // Heads with different scores keep different positions.
  EXPECT_NE(r->positions(0, 0), r->positions(0, 1));
}

TEST(Retention, SnapKVRejectsBadBudgetsAndScores) {
  const auto sc = random_scores(2, 2, 100, 7, 1);
  RetentionPolicy p;
  p.kind = RetentionKind::kSnapKV;
  p.window = 32;
  for (int64_t b : {int64_t(-5), int64_t(0), int64_t(31), int64_t(101)}) {
    p.budget = b;
    auto r = retention_apply(p, 2, 2, 100, &sc);
    ASSERT_FALSE(r.is_ok()) << "budget " << b;
    EXPECT_EQ(r.status().code(), Code::kOutOfRange);
    EXPECT_NE(r.status().message().find("budget " + std::to_string(b)), std::string::npos)
        << r.status().message();
  }
  p.budget = 50;
  EXPECT_NE(
      retention_apply(p, 2, 2, 100, nullptr).status().message().find("needs importance scores"),
      std::string::npos);
  EXPECT_NE(retention_apply(p, 3, 2, 100, &sc).status().message().find("importance scores are for"),
            std::string::npos);
  p.pool = 5;
  EXPECT_NE(retention_apply(p, 2, 2, 100, &sc).status().message().find("pooled with kernel 7"),
            std::string::npos);
  p.pool = 7;
  EXPECT_TRUE(retention_apply(p, 2, 2, 100, &sc).is_ok());
}

TEST(Retention, PyramidBudgetsFallLinearlyAndKeepTheTotal) {
  const int L = 30;
  auto b = pyramid_layer_budgets(1024, 32, 20, L, 8192);
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  int64_t total = 0;
  for (int l = 0; l < L; ++l) {
    total += b.value()[size_t(l)];
    if (l > 0) EXPECT_LE(b.value()[size_t(l)], b.value()[size_t(l - 1)]);
  }
  EXPECT_NEAR(double(total), 1024.0 * L, L);  // rounding per layer
  // Top layer's scored part is avg / beta = (1024 - 32) / 20.
  EXPECT_NEAR(double(b.value().back() - 32), (1024.0 - 32) / 20, 1.0);
  EXPECT_GT(b.value().front(), 1.9 * (1024 - 32));
  // When the bottom would exceed the prompt it is capped and the total is still kept.
  auto c = pyramid_layer_budgets(600, 32, 20, L, 1000);
  ASSERT_TRUE(c.is_ok());
  int64_t t2 = 0;
  for (int64_t x : c.value()) {
    EXPECT_LE(x, 1000);
    t2 += x;
  }
  EXPECT_NEAR(double(t2), 600.0 * L, L);
  EXPECT_EQ(c.value().front(), 1000);

  const auto sc = random_scores(4, 2, 500, 7, fresh_seed());
  auto p = retention_parse("pyramid:budget=100,window=16");
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  auto r = retention_apply(p.value(), 4, 2, 500, &sc);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  auto lb = pyramid_layer_budgets(100, 16, 20, 4, 500).value();
  for (int l = 0; l < 4; ++l)
    for (int h = 0; h < 2; ++h) {
      ASSERT_EQ(int64_t(r->positions(l, h).size()), lb[size_t(l)]);
      EXPECT_TRUE(keeps_last(r->positions(l, h), 500, 16));
      expect_topk(r->positions(l, h), sc.layers[size_t(l)].data() + h * 500, 500, 16);
    }
  auto e = pyramid_layer_budgets(501, 16, 20, 4, 500);
  EXPECT_EQ(e.status().code(), Code::kOutOfRange);
}

TEST(Retention, MoAKeepsPerHeadElasticSpans) {
  RetentionPolicy p;
  p.kind = RetentionKind::kMoA;
  p.moa_sink = 64;
  p.moa = {{{100, 0.0}, {0, 0.5}}, {{2000, 0.0}, {10, 0.1}}};
  const int64_t N = 1000;
  auto r = retention_apply(p, 2, 2, N, nullptr);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  expect_sorted_unique_in_range(r.value());
  EXPECT_EQ(r->positions(0, 0).size(), 64u + 100u);
  EXPECT_EQ(r->positions(0, 1).size(), 64u + 500u);
  EXPECT_EQ(r->positions(1, 0).size(), size_t(N));  // span clamps to the prompt
  EXPECT_EQ(r->positions(1, 1).size(), 64u + 110u);
  EXPECT_TRUE(keeps_last(r->positions(0, 1), N, 500));
  p.moa[1][1].beta = 1.5;
  auto e = retention_apply(p, 2, 2, N, nullptr);
  EXPECT_EQ(e.status().code(), Code::kOutOfRange);
  EXPECT_NE(e.status().message().find("layer 1 head 1"), std::string::npos) << e.status().message();
  p.moa[1].pop_back();
  EXPECT_NE(retention_apply(p, 2, 2, N, nullptr).status().message().find("head spans"),
            std::string::npos);
}

TEST(Retention, LayerwiseFullBottomLayersThenWindowPlusTopK) {
  const auto sc = random_scores(5, 2, 400, 7, fresh_seed());
  auto p = retention_parse("layerwise:n_full=2,window=20,topk=30");
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  auto r = retention_apply(p.value(), 5, 2, 400, &sc);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  for (int l = 0; l < 5; ++l)
    for (int h = 0; h < 2; ++h) {
      const auto& k = r->positions(l, h);
      if (l < 2) {
        EXPECT_EQ(k.size(), 400u);
      } else {
        EXPECT_EQ(k.size(), 50u);
        EXPECT_TRUE(keeps_last(k, 400, 20));
        expect_topk(k, sc.layers[size_t(l)].data() + h * 400, 400, 20);
      }
    }
  auto bad = p.value();
  bad.n_full = 6;
  EXPECT_EQ(retention_apply(bad, 5, 2, 400, &sc).status().code(), Code::kOutOfRange);
  bad = p.value();
  bad.topk = 400;
  EXPECT_EQ(retention_apply(bad, 5, 2, 400, &sc).status().code(), Code::kOutOfRange);
}

TEST(Retention, ParseRejectsUnknownPoliciesAndKeys) {
  EXPECT_NE(retention_parse("h2o").status().message().find("unknown retention policy 'h2o'"),
            std::string::npos);
  EXPECT_NE(retention_parse("snapkv:budget=10,size=3").status().message().find("'size=3'"),
            std::string::npos);
  EXPECT_NE(retention_parse("snapkv:window=3").status().message().find("needs budget"),
            std::string::npos);
  EXPECT_NE(retention_parse("snapkv:budget=1.5").status().message().find("integer"),
            std::string::npos);
  EXPECT_NE(retention_parse("streaming:sink=x").status().message().find("not a number"),
            std::string::npos);
  auto p = retention_parse("pyramid:budget=512,window=8,beta=10");
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(retention_params(p.value()), "budget=512,window=8,beta=10");
}

TEST(Retention, FractionHitsTheRequestedShareOfKvBytes) {
  const int L = 30, H = 3;
  const int64_t N = 8192;
  const auto sc = random_scores(L, H, N, 7, fresh_seed());
  for (auto kind : {RetentionKind::kStreaming, RetentionKind::kSnapKV, RetentionKind::kPyramid,
                    RetentionKind::kLayerwise})
    for (double f : {0.1, 0.25, 0.5}) {
      auto p = retention_for_fraction(kind, f, L, N);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      auto r = retention_apply(p.value(), L, H, N, &sc);
      ASSERT_TRUE(r.is_ok()) << retention_kind_name(kind) << " " << f << ": "
                             << r.status().to_string();
      const double got = double(r->kept_total()) / double(int64_t(L) * H * N);
      EXPECT_NEAR(got, f, 0.01) << retention_kind_name(kind) << " at " << f;
    }
  EXPECT_EQ(retention_for_fraction(RetentionKind::kSnapKV, 0, L, N).status().code(),
            Code::kOutOfRange);
  EXPECT_EQ(retention_for_fraction(RetentionKind::kSnapKV, 1.5, L, N).status().code(),
            Code::kOutOfRange);
}

}  // namespace
}  // namespace sf::kvstore
