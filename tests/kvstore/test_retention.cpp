// Retention policies: each policy's defining property on random scores, and the range checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <random>
#include <set>
#include <string>

#include "kvstore/moa_profile.h"
#include "kvstore/retention.h"
#include "tests/common/test_seed.h"

namespace sf::kvstore {
namespace {

using testing::fresh_seed;

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

// NaN scores (a forward that overflowed) rank last: the scored picks are the top-k of the finite
// scores, for snapkv, adakv and a span, never a NaN position while finite ones are left. (Compared
// raw, a NaN ties with everything, and the sorts' picks were arbitrary.)
TEST(Retention, NanScoresRankLast) {
  const uint64_t seed = fresh_seed();
  const int L = 2, H = 2;
  const int64_t N = 777, W = 32;
  auto sc = random_scores(L, H, N, 7, seed);
  std::mt19937_64 rng(seed ^ 0x9e3779b9u);
  std::vector<std::vector<char>> nan_at(size_t(L), std::vector<char>(size_t(H * N)));
  for (int l = 0; l < L; ++l)
    for (int64_t i = 0; i < H * N; ++i)
      if (i % N == 0 || rng() % 5 == 0) {  // position 0 of each head, and a fifth of the rest
        sc.layers[size_t(l)][size_t(i)] = std::nanf("");
        nan_at[size_t(l)][size_t(i)] = 1;
      }
  for (const char* spec : {"snapkv:budget=200,window=32,pool=7", "adakv:budget=200,window=32,pool=7",
                           "snapkv:budget=200,window=32,pool=7,span=4"}) {
    auto p = retention_parse(spec);
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    auto r = retention_apply(p.value(), L, H, N, &sc);
    ASSERT_TRUE(r.is_ok()) << spec << ": " << r.status().to_string();
    expect_sorted_unique_in_range(r.value());
    const bool span = std::string(spec).find("span") != std::string::npos;
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        const auto& k = r->positions(l, h);
        EXPECT_TRUE(keeps_last(k, N, W)) << spec;
        if (span) continue;  // (spanned scores: a NaN's neighbours carry their own maxima)
        for (const int32_t t : k)
          if (t < N - W)
            EXPECT_FALSE(nan_at[size_t(l)][size_t(h * N + t)])
                << spec << ": layer " << l << " head " << h << " keeps NaN-scored position " << t;
        if (std::string(spec).rfind("snapkv", 0) == 0) {
          ASSERT_EQ(k.size(), 200u) << spec;
          expect_topk(k, sc.layers[size_t(l)].data() + h * N, N, W);
        }
      }
    if (span) {
      // With span 4 a position's score is the best finite one of the 4 ending there: a kept
      // position has at least one finite score among them.
      for (int l = 0; l < L; ++l)
        for (int h = 0; h < H; ++h)
          for (const int32_t t : r->positions(l, h)) {
            if (t >= N - W) continue;
            bool finite = false;
            for (int64_t j = std::max<int64_t>(0, t - 3); j <= t; ++j)
              finite |= !nan_at[size_t(l)][size_t(h * N + j)];
            EXPECT_TRUE(finite) << spec << ": keeps " << t << ", whose span holds only NaN";
          }
    }
  }
}

// span: snapkv over the forward-spanned scores. A single scored spike at t keeps [t, t + span)
// (the tokens a copy of it would read next) where plain SnapKV keeps t alone; the rest is the
// same top-k over s'[j] = max(s[j - span + 1 .. j]).
TEST(Retention, SpanKeepsTheTokensAfterAScoredOne) {
  const uint64_t seed = fresh_seed();
  const int L = 2, H = 2;
  const int64_t N = 500, W = 16, B = 120, span = 5;
  auto sc = random_scores(L, H, N, 7, seed);
  for (auto& l : sc.layers)
    for (auto& x : l) x = std::min(x, 50.f);
  const int64_t spike = 211;
  sc.layers[1][size_t(N + spike)] = 1e4f;  // layer 1, head 1; the next tokens score lowest
  for (int64_t t = spike + 1; t < spike + span; ++t) sc.layers[1][size_t(N + t)] = 0.f;
  auto plain = retention_parse("snapkv:budget=120,window=16,pool=7");
  auto spanned = retention_parse("snapkv:budget=120,window=16,pool=7,span=5");
  ASSERT_TRUE(plain.is_ok() && spanned.is_ok());
  EXPECT_EQ(retention_params(spanned.value()), "budget=120,window=16,pool=7,span=5");
  EXPECT_EQ(retention_params(plain.value()), "budget=120,window=16,pool=7");
  auto rp = retention_apply(plain.value(), L, H, N, &sc);
  auto rs = retention_apply(spanned.value(), L, H, N, &sc);
  ASSERT_TRUE(rp.is_ok() && rs.is_ok()) << rs.status().to_string();
  expect_sorted_unique_in_range(rs.value());
  auto kept = [](const std::vector<int32_t>& k, int64_t t) {
    return std::binary_search(k.begin(), k.end(), int32_t(t));
  };
  for (int64_t t = spike; t < spike + span; ++t) EXPECT_TRUE(kept(rs->positions(1, 1), t)) << t;
  for (int64_t t = spike + 1; t < spike + span; ++t)
    EXPECT_FALSE(kept(rp->positions(1, 1), t)) << t;
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      std::vector<float> s2(static_cast<size_t>(N));
      const float* s = sc.layers[size_t(l)].data() + h * N;
      for (int64_t j = 0; j < N; ++j)
        s2[size_t(j)] = *std::max_element(s + std::max<int64_t>(0, j - span + 1), s + j + 1);
      const auto& k = rs->positions(l, h);
      ASSERT_EQ(int64_t(k.size()), B);
      EXPECT_TRUE(keeps_last(k, N, W));
      expect_topk(k, s2.data(), N, W);
    }
  // adakv and pyramid take it too; other policies do not name it.
  EXPECT_TRUE(retention_parse("adakv:budget=120,span=8").is_ok());
  EXPECT_TRUE(retention_parse("pyramid:budget=120,span=8").is_ok());
  EXPECT_NE(retention_parse("streaming:span=4").status().message().find("'span=4'"),
            std::string::npos);
  for (const char* bad : {"snapkv:budget=120,span=0", "snapkv:budget=120,span=257"})
    EXPECT_EQ(retention_parse(bad).status().code(), Code::kOutOfRange) << bad;
  RetentionPolicy p = spanned.value();
  p.span = 0;
  EXPECT_EQ(retention_apply(p, L, H, N, &sc).status().code(), Code::kOutOfRange);
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
  // The evaluation's policies take its observation window as their kept window, as SnapKV keeps
  // its observation window (eval --obs-window 64: window 64, not 32).
  for (RetentionKind k : {RetentionKind::kSnapKV, RetentionKind::kAdaKV, RetentionKind::kPyramid}) {
    auto f = retention_for_fraction(k, 0.9, 2, 100, 64);
    ASSERT_TRUE(f.is_ok()) << retention_kind_name(k);
    EXPECT_EQ(f->window, 64) << retention_kind_name(k);
  }
  EXPECT_EQ(retention_for_fraction(RetentionKind::kSnapKV, 0.9, 2, 100)->window, 32);
}

// The prompt-only checks (a worker's pre-flight): every policy's out-of-range case fails with the
// message retention_apply gives, without scores; the in-range ones pass without scores too.
TEST(Retention, CheckPromptMatchesApplyWithoutScores) {
  const int L = 2, H = 2;
  const int64_t N = 100;
  const auto sc = random_scores(L, H, N, 7, 1);
  const char* bad[] = {"snapkv:budget=101",         "adakv:budget=20",
                       "pyramid:budget=200",        "pyramid:budget=50,beta=0.5",
                       "streaming:sink=90,window=20", "layerwise:n_full=3,window=8,topk=0",
                       "layerwise:n_full=1,window=60,topk=50"};
  for (const char* spec : bad) {
    auto p = retention_parse(spec);
    ASSERT_TRUE(p.is_ok()) << spec << ": " << p.status().to_string();
    const Status pre = retention_check_prompt(p.value(), L, H, N);
    ASSERT_FALSE(pre.is_ok()) << spec;
    EXPECT_EQ(pre.code(), Code::kOutOfRange) << spec << ": " << pre.message();
    EXPECT_EQ(retention_apply(p.value(), L, H, N, &sc).status().message(), pre.message()) << spec;
  }
  for (const char* spec : {"full", "snapkv:budget=100", "adakv:budget=32,span=4",
                           "pyramid:budget=50", "streaming", "layerwise:n_full=2,window=8,topk=4"}) {
    auto p = retention_parse(spec);
    ASSERT_TRUE(p.is_ok()) << spec;
    EXPECT_TRUE(retention_check_prompt(p.value(), L, H, N).is_ok()) << spec;
  }
  // snapkv's pool: odd, in [1, kRetentionMaxPool], at parse and in the pre-flight.
  for (const char* bad_pool :
       {"snapkv:budget=64,pool=4", "snapkv:budget=64,pool=0", "adakv:budget=64,pool=-1",
        "snapkv:budget=64,pool=67", "snapkv:budget=1e300"})
    EXPECT_EQ(retention_parse(bad_pool).status().code(), Code::kOutOfRange) << bad_pool;
  RetentionPolicy even;
  even.kind = RetentionKind::kSnapKV;
  even.budget = 64;
  even.pool = 6;
  EXPECT_NE(retention_check_prompt(even, L, H, N).message().find("pool 6 must be odd"),
            std::string::npos);
  EXPECT_TRUE(retention_needs_scores(retention_parse("pyramid:budget=50").value()));
  EXPECT_FALSE(retention_needs_scores(retention_parse("streaming").value()));
  EXPECT_FALSE(
      retention_needs_scores(retention_parse("layerwise:n_full=1,window=8,topk=0").value()));
  EXPECT_TRUE(
      retention_needs_scores(retention_parse("layerwise:n_full=1,window=8,topk=4").value()));
  RetentionPolicy moa;
  moa.kind = RetentionKind::kMoA;
  moa.moa.assign(1, std::vector<MoaSpan>(H));  // one layer's spans for a 2-layer cache
  EXPECT_EQ(retention_check_prompt(moa, L, H, N).message(),
            retention_apply(moa, L, H, N, nullptr).status().message());
  EXPECT_FALSE(retention_check_prompt(moa, L, H, N).is_ok());
}

// Ada-KV: a layer's scored budget is shared by its heads. Checked against its definition: each
// head's own best floor_k, then a top-k over every other candidate of the layer.
TEST(Retention, AdaKVSharesTheLayerBudgetAcrossHeads) {
  const uint64_t seed = fresh_seed();
  const int L = 2, H = 3;
  const int64_t N = 600, W = 32, B = 150, k = B - W, floor_k = int64_t(0.2 * double(k));
  auto sc = random_scores(L, H, N, 7, seed);
  // Layer 1, head 0 carries most of the mass: it must get more than the uniform share.
  for (int64_t t = 0; t < N; ++t) sc.layers[1][size_t(t)] *= 100.f;
  auto p = retention_parse("adakv:budget=150,window=32,pool=7,floor=0.2");
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  auto r = retention_apply(p.value(), L, H, N, &sc);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->policy, "adakv");
  EXPECT_EQ(r->params, "budget=150,window=32,pool=7,floor=0.2");
  // The canonical params name every value exactly (they are part of a job's fingerprint): two
  // floors or betas that differ past the sixth digit must not print alike, and each parses back.
  for (const char* spec : {"adakv:budget=150,window=32,floor=0.1234567",
                           "pyramid:budget=150,window=32,beta=20.0000004"}) {
    auto q = retention_parse(spec);
    ASSERT_TRUE(q.is_ok()) << q.status().to_string();
    const std::string params = retention_params(q.value());
    EXPECT_NE(params.find(std::string(spec).substr(std::string(spec).rfind(','))),
              std::string::npos)
        << params;
    auto back = retention_parse(std::string(spec).substr(0, std::string(spec).find(':') + 1) +
                                params);
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(back->floor, q->floor);
    EXPECT_EQ(back->beta, q->beta);
  }
  expect_sorted_unique_in_range(r.value());
  EXPECT_EQ(r->kept_total(), int64_t(L) * H * B);
  for (int l = 0; l < L; ++l) {
    const float* s = sc.layers[size_t(l)].data();
    float min_shared = 1e30f, max_dropped = -1e30f;
    for (int h = 0; h < H; ++h) {
      const auto& kept = r->positions(l, h);
      EXPECT_TRUE(keeps_last(kept, N, W));
      ASSERT_GE(int64_t(kept.size()), W + floor_k) << "layer " << l << " head " << h;
      // The head's floor: its floor_k best candidates. Floats can tie at the cut (rarely: an ulp
      // of ~4e-6 against gaps of ~1): a tied candidate left out of the floor competes for the
      // shared picks like any other.
      std::vector<float> own(s + h * N, s + h * N + (N - W));
      std::sort(own.begin(), own.end(), std::greater<>());
      const float floor_cut = own[size_t(floor_k - 1)];
      int64_t floor_kept = 0;
      for (int64_t t = 0; t < N - W; ++t) {
        const float x = s[h * N + t];
        const bool in = std::binary_search(kept.begin(), kept.end(), int32_t(t));
        if (x > floor_cut || (x == floor_cut && in)) {
          EXPECT_TRUE(in) << "layer " << l << " head " << h << " dropped a floor position " << t;
          ++floor_kept;
          continue;
        }
        if (in)
          min_shared = std::min(min_shared, x);
        else
          max_dropped = std::max(max_dropped, x);
      }
      EXPECT_GE(floor_kept, floor_k) << "layer " << l << " head " << h;
    }
    EXPECT_LE(max_dropped, min_shared) << "layer " << l;
  }
  EXPECT_GT(int64_t(r->positions(1, 0).size()), B);
  EXPECT_GE(int64_t(r->positions(1, 1).size()), W + floor_k);
  // floor = 1 is SnapKV's uniform split.
  auto uni = retention_parse("adakv:budget=150,window=32,floor=1");
  auto snap = retention_parse("snapkv:budget=150,window=32");
  ASSERT_TRUE(uni.is_ok() && snap.is_ok());
  EXPECT_EQ(retention_apply(uni.value(), L, H, N, &sc)->kept,
            retention_apply(snap.value(), L, H, N, &sc)->kept);
  // Bad input names the field.
  for (const char* bad : {"adakv:budget=150,floor=1.5", "adakv:budget=150,floor=-0.1"}) {
    auto e = retention_parse(bad);
    ASSERT_FALSE(e.is_ok()) << bad;
    EXPECT_NE(e.status().message().find("floor"), std::string::npos) << e.status().message();
  }
  EXPECT_NE(retention_parse("adakv:window=32").status().message().find("budget"),
            std::string::npos);
  EXPECT_EQ(
      retention_apply(retention_parse("adakv:budget=601").value(), L, H, N, &sc).status().code(),
      Code::kOutOfRange);
}

// high=H splits what a scored policy keeps into two tiers: the high tier is exactly the policy
// at budget H, the low tier the rest of what it keeps at its budget.
TEST(Retention, HighSplitsTheKeptTokensIntoTwoTiers) {
  const uint64_t seed = fresh_seed();
  const int L = 2, H = 3;
  const int64_t N = 600;
  auto sc = random_scores(L, H, N, 7, seed);
  for (const char* spec : {"adakv:budget=150,window=32,pool=7,span=4,high=60",
                           "snapkv:budget=150,window=32,pool=7,high=40",
                           "pyramid:budget=150,window=32,high=80"}) {
    auto p = retention_parse(spec);
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    auto r = retention_apply(p.value(), L, H, N, &sc);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_NE(r->params.find(",high=" + std::to_string(p->high)), std::string::npos) << r->params;
    RetentionPolicy one = p.value(), hi = p.value();
    one.high = hi.high = 0;
    hi.budget = p->high;
    auto r1 = retention_apply(one, L, H, N, &sc);
    auto rh = retention_apply(hi, L, H, N, &sc);
    ASSERT_TRUE(r1.is_ok() && rh.is_ok());
    ASSERT_TRUE(r->has_low());
    expect_sorted_unique_in_range(r.value());
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        const auto& kept = r->positions(l, h);
        const auto& low = r->low[size_t(l * H + h)];
        EXPECT_EQ(r->high_positions(l, h), rh->positions(l, h)) << spec;
        EXPECT_TRUE(std::includes(kept.begin(), kept.end(), low.begin(), low.end()));
        EXPECT_TRUE(std::includes(kept.begin(), kept.end(), r1->positions(l, h).begin(),
                                  r1->positions(l, h).end()));
        EXPECT_EQ(kept.size(), low.size() + rh->positions(l, h).size());
        EXPECT_TRUE(keeps_last(r->high_positions(l, h), N, 32));
      }
  }
  // Only scored policies split, and high lies in [window, budget).
  auto bad = [&](const char* spec, const char* needle) {
    auto p = retention_parse(spec);
    Status st = p.is_ok() ? retention_apply(p.value(), L, H, N, &sc).status() : p.status();
    ASSERT_FALSE(st.is_ok()) << spec;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.to_string();
  };
  bad("streaming:sink=4,window=100,high=50", "unknown or malformed parameter 'high=50' (sink, window)");
  bad("adakv:budget=150,window=32,high=150", "high 150 out of range [window 32, budget 150)");
  bad("adakv:budget=150,window=32,high=20", "high 20 out of range");
  // A key given twice (the last would have won) and a trailing comma are malformed too.
  bad("snapkv:budget=100,budget=50", "budget given twice");
  bad("snapkv:budget=100,", "trailing comma");
  bad("snapkv:budget=100,,window=32", "unknown or malformed parameter ''");
  bad("full:window=8", "unknown or malformed parameter 'window=8' (it takes none)");
  RetentionPolicy st;
  st.kind = RetentionKind::kStreaming;
  st.window = 100;
  st.high = 50;
  EXPECT_FALSE(retention_apply(st, L, H, N, nullptr).is_ok());
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
  EXPECT_EQ(total, 1024 * L);
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
  EXPECT_EQ(t2, 600 * L);
  EXPECT_EQ(c.value().front(), 1000);
  // Shares ending in exactly .5 (a step of 1.0 from 0.5 to 19.5 over 20 layers; 0.5 and 19.5 at
  // 2): rounded one by one, every mirrored pair gained a token (850 for 840). The total is exact
  // at any geometry, windowless too, and the schedule still falls.
  for (const auto& [budget, window, layers, n] :
       std::vector<std::array<int64_t, 4>>{{42, 32, 20, 1000}, {42, 32, 2, 1000}, {7, 0, 9, 50},
                                           {100, 16, 7, 333}, {300, 32, 30, 310}}) {
    auto d = pyramid_layer_budgets(budget, window, 20, int(layers), n);
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    int64_t t3 = 0;
    for (size_t l = 0; l < d->size(); ++l) {
      t3 += (*d)[l];
      EXPECT_GE((*d)[l], std::max<int64_t>(window, 1));
      EXPECT_LE((*d)[l], n);
      if (l > 0) EXPECT_LE((*d)[l], (*d)[l - 1]) << budget << "/" << layers << " layer " << l;
    }
    EXPECT_EQ(t3, budget * layers) << "budget " << budget << ", window " << window << ", "
                                   << layers << " layers";
  }

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

// Without a window, a head must still keep a token (an export refuses an empty head, after the
// whole prefill): adakv whose floor rounds to 0 while another head takes every shared pick, and
// pyramid whose top layers' share rounds to 0.
TEST(Retention, NoHeadKeepsNothingWithoutAWindow) {
  const int L = 4, H = 2;
  const int64_t N = 600;
  auto sc = random_scores(L, H, N, 7, fresh_seed());
  for (auto& layer : sc.layers)
    for (int64_t t = 0; t < N; ++t) layer[size_t(N + t)] = 0.f;  // head 1 scores nothing
  for (const char* spec : {"adakv:budget=4,window=0,floor=0", "adakv:budget=3,window=0,floor=0.2",
                           "pyramid:budget=1,window=0"}) {
    auto p = retention_parse(spec);
    ASSERT_TRUE(p.is_ok()) << spec << ": " << p.status().to_string();
    auto r = retention_apply(p.value(), L, H, N, &sc);
    ASSERT_TRUE(r.is_ok()) << spec << ": " << r.status().to_string();
    expect_sorted_unique_in_range(r.value());
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) EXPECT_FALSE(r->positions(l, h).empty()) << spec << " " << l << "/" << h;
  }
  // Pyramid's raised top layers are given back by the bottom ones: the total stays L x budget.
  for (int64_t budget : {1, 2, 3}) {
    auto pb = pyramid_layer_budgets(budget, 0, 20, L, N);
    ASSERT_TRUE(pb.is_ok());
    int64_t total = 0;
    for (int64_t x : pb.value()) {
      EXPECT_GE(x, 1);
      total += x;
    }
    EXPECT_EQ(total, L * budget) << "budget " << budget;
  }
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
  // A span past int64 clamps to the prompt, not to one token.
  RetentionPolicy huge = p;
  huge.moa[0][0] = {1e19, 0.0};
  auto hr = retention_apply(huge, 2, 2, N, nullptr);
  ASSERT_TRUE(hr.is_ok()) << hr.status().to_string();
  EXPECT_EQ(hr->positions(0, 0).size(), size_t(N));
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
  for (auto kind : {RetentionKind::kStreaming, RetentionKind::kSnapKV, RetentionKind::kAdaKV,
                    RetentionKind::kPyramid, RetentionKind::kLayerwise})
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

// A 2-layer, 2-KV-head config; replacing `from` by `to` makes it bad.
std::string moa_text(const std::string& from = "", const std::string& to = "") {
  std::string t =
      R"({"format": "sparsefill-moa-retention", "model": "t", "n_layers": 2, "n_kv_heads": 2,)"
      R"( "sink": 16, "layers": [[{"alpha": 100, "beta": 0}, {"alpha": 0, "beta": 0.5}],)"
      R"( [{"alpha": 2000, "beta": 0}, {"alpha": 10, "beta": 0.1}]]})";
  if (!from.empty()) {
    const auto at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) t.replace(at, from.size(), to);
  }
  return t;
}

TEST(Retention, MoaConfigParsesAndTheSpecLoadsTheShippedConfig) {
  auto p = moa_config_parse(moa_text(), "t.json");
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->kind, RetentionKind::kMoA);
  EXPECT_EQ(p->moa_sink, 16);
  ASSERT_EQ(p->moa.size(), 2u);
  ASSERT_EQ(p->moa[1].size(), 2u);
  EXPECT_EQ(p->moa[1][0].alpha, 2000);
  EXPECT_EQ(p->moa[0][1].beta, 0.5);
  EXPECT_EQ(p->moa[1][1].alpha, 10);
  EXPECT_EQ(p->moa[1][1].beta, 0.1);
  auto r = retention_apply(p.value(), 2, 2, 1000, nullptr);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->positions(0, 1).size(), 16u + 500u);
  EXPECT_EQ(r->params, "config=t.json,sink=16,heads=2x2");

  const std::string shipped =
      std::string(SF_SOURCE_DIR) + "/configs/smollm2-135m-instruct-moa.json";
  auto q = retention_parse("moa:config=" + shipped + ",sink=8");
  ASSERT_TRUE(q.is_ok()) << q.status().to_string();
  EXPECT_EQ(q->moa_sink, 8);  // the spec's sink overrides the file's
  EXPECT_TRUE(retention_check_geometry(q.value(), 30, 3).is_ok());
  auto g = retention_check_geometry(q.value(), 30, 2);
  EXPECT_EQ(g.code(), Code::kInvalidArgument);
  EXPECT_NE(g.message().find("layer 0 has 3 head spans, the cache has 2"), std::string::npos)
      << g.message();
  EXPECT_NE(retention_check_geometry(q.value(), 24, 3).message().find("has 30 layers"),
            std::string::npos);
}

TEST(Retention, MoaConfigRejectsBadInputNamingTheField) {
  struct Case {
    std::string text;
    Code code;
    const char* what;
  };
  const Case cases[] = {
      {"{not json", Code::kInvalidArgument, "invalid JSON"},
      {"[1, 2]", Code::kInvalidArgument, "top level must be an object"},
      {moa_text("\"model\"", "\"spans\""), Code::kInvalidArgument, "unknown field 'spans'"},
      {moa_text("\"n_layers\": 2,", ""), Code::kInvalidArgument, "field 'n_layers' is missing"},
      {moa_text("\"n_kv_heads\": 2", "\"n_kv_heads\": 0"), Code::kInvalidArgument,
       "field 'n_kv_heads' must be an integer"},
      {moa_text("\"sink\": 16", "\"sink\": -1"), Code::kInvalidArgument,
       "field 'sink' must be an integer >= 0"},
      {moa_text("\"sink\": 16", "\"sink\": 1.5"), Code::kInvalidArgument,
       "field 'sink' must be an integer >= 0"},
      {moa_text("sparsefill-moa-retention", "sparsefill-pattern-config"), Code::kInvalidArgument,
       "field 'format'"},
      {moa_text("\"n_layers\": 2", "\"n_layers\": 3"), Code::kInvalidArgument,
       "field 'layers' must be an array of n_layers = 3"},
      {moa_text(", {\"alpha\": 10, \"beta\": 0.1}", ""), Code::kInvalidArgument,
       "layer 1 must be an array of n_kv_heads = 2"},
      {moa_text("{\"alpha\": 0, \"beta\": 0.5}", "7"), Code::kInvalidArgument,
       "layer 0 head 1: must be an object"},
      {moa_text("{\"alpha\": 2000,", "{\"gamma\": 1, \"alpha\": 2000,"), Code::kInvalidArgument,
       "layer 1 head 0: unknown field 'gamma'"},
      {moa_text("\"alpha\": 100, \"beta\": 0", "\"alpha\": 100"), Code::kInvalidArgument,
       "layer 0 head 0: field 'beta' is missing"},
      {moa_text("\"alpha\": 10,", "\"alpha\": \"10\","), Code::kInvalidArgument,
       "layer 1 head 1: field 'alpha' must be a number"},
      {moa_text("\"alpha\": 10,", "\"alpha\": -5,"), Code::kOutOfRange,
       "layer 1 head 1: field 'alpha' must be >= 0"},
      {moa_text("\"beta\": 0.5", "\"beta\": 1.5"), Code::kOutOfRange,
       "layer 0 head 1: field 'beta' must be in [0, 1]"},
  };
  for (const Case& c : cases) {
    auto r = moa_config_parse(c.text, "bad.json");
    ASSERT_FALSE(r.is_ok()) << c.what;
    EXPECT_EQ(r.status().code(), c.code) << c.what;
    EXPECT_NE(r.status().message().find("moa config 'bad.json'"), std::string::npos);
    EXPECT_NE(r.status().message().find(c.what), std::string::npos)
        << r.status().message() << " does not say " << c.what;
  }
  EXPECT_NE(retention_parse("moa").status().message().find("needs config=FILE"), std::string::npos);
  auto io = retention_parse("moa:config=/nonexistent/moa.json");
  EXPECT_EQ(io.status().code(), Code::kIo);
  EXPECT_NE(io.status().message().find("cannot read moa config '/nonexistent/moa.json'"),
            std::string::npos);
  EXPECT_NE(retention_parse("moa:config=x.json,window=3").status().message().find("'window=3'"),
            std::string::npos);
  EXPECT_NE(retention_parse("moa:config=x.json,sink=-4").status().message().find("sink"),
            std::string::npos);
  // Refused before any file is read, as retention_parse refuses them for the other policies (a
  // second config= was taken silently and the first path never read).
  const std::string shipped =
      std::string(SF_SOURCE_DIR) + "/configs/smollm2-135m-instruct-moa.json";
  ASSERT_TRUE(retention_parse("moa:config=" + shipped + ",sink=4").is_ok());
  for (const std::string& bad :
       {"moa:config=" + shipped + ",", "moa:config=/nonexistent/moa.json,config=" + shipped,
        "moa:config=" + shipped + ",sink=1,sink=2"}) {
    auto r = retention_parse(bad);
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << bad;
    const std::string& m = r.status().message();
    EXPECT_TRUE(m.find("trailing comma") != std::string::npos ||
                m.find("given twice") != std::string::npos)
        << bad << ": " << m;
  }
}

TEST(Retention, MoaScaledKeepsJustUnderTheBudget) {
  const int L = 30, H = 3;
  const int64_t N = 8192, full = int64_t(L) * H * N;
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> ua(0, 2000), ub(0, 0.3);
  RetentionPolicy random;
  random.kind = RetentionKind::kMoA;
  random.moa.assign(size_t(L), std::vector<MoaSpan>(size_t(H)));
  for (auto& layer : random.moa)
    for (auto& s : layer) s = {ua(rng), ub(rng)};
  auto shipped =
      moa_config_load(std::string(SF_SOURCE_DIR) + "/configs/smollm2-135m-instruct-moa.json");
  ASSERT_TRUE(shipped.is_ok()) << shipped.status().to_string();
  for (const RetentionPolicy* base : {&random, &shipped.value()})
    for (double f : {0.05, 0.1, 0.25, 0.5, 0.9}) {
      auto p = retention_moa_scaled(*base, f, L, H, N);
      ASSERT_TRUE(p.is_ok()) << f << ": " << p.status().to_string();
      ASSERT_GT(p->moa_scale, 0);
      for (int l = 0; l < L; ++l)
        for (int h = 0; h < H; ++h) {
          const MoaSpan& b = base->moa[size_t(l)][size_t(h)];
          const MoaSpan& s = p->moa[size_t(l)][size_t(h)];
          EXPECT_NEAR(s.alpha, b.alpha * p->moa_scale, 1e-9 * (1 + s.alpha));
          EXPECT_NEAR(s.beta, std::min(1.0, b.beta * p->moa_scale), 1e-12);
        }
      auto r = retention_apply(p.value(), L, H, N, nullptr);
      ASSERT_TRUE(r.is_ok()) << r.status().to_string();
      expect_sorted_unique_in_range(r.value());
      const double got = double(r->kept_total()) / double(full);
      EXPECT_LE(got, f) << "f " << f << " scale " << p->moa_scale;
      EXPECT_GE(got, f - 0.001) << "f " << f << " scale " << p->moa_scale;
      EXPECT_NE(r->params.find(",scale="), std::string::npos) << r->params;
    }
  auto all = retention_moa_scaled(random, 1.0, L, H, N);
  ASSERT_TRUE(all.is_ok()) << all.status().to_string();
  EXPECT_TRUE(retention_apply(all.value(), L, H, N, nullptr)->is_full());
  // Sink 64 + one token per head is 65 of 1000: a 5% budget cannot hold it.
  auto low = retention_moa_scaled(shipped.value(), 0.05, L, H, 1000);
  EXPECT_EQ(low.status().code(), Code::kOutOfRange);
  EXPECT_NE(low.status().message().find("sink"), std::string::npos) << low.status().message();
  EXPECT_EQ(retention_moa_scaled(RetentionPolicy{}, 0.5, L, H, N).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(retention_moa_scaled(random, 0.5, L, 2, N).status().code(), Code::kInvalidArgument);
}

// One head whose span is tiny but not zero puts the search's upper scale far above the answer
// (beta 1e-70: 2/beta); the search must still land on the budget, not at scale 0 (it kept 130
// of 8,192 tokens here before the step-down). A span no finite scale covers is refused, not
// turned into a policy with an infinite alpha that retention_apply then refuses.
TEST(Retention, MoaScaledReachesTheBudgetPastATinySpan) {
  const int64_t N = 8192;
  RetentionPolicy p;
  p.kind = RetentionKind::kMoA;
  p.moa = {{MoaSpan{0, 1e-70}, MoaSpan{1024, 0.125}}};
  for (double beta : {1e-70, 1e-60, 1e-200}) {
    p.moa[0][0].beta = beta;
    auto s = retention_moa_scaled(p, 0.5, 1, 2, N);
    ASSERT_TRUE(s.is_ok()) << beta << ": " << s.status().to_string();
    auto r = retention_apply(s.value(), 1, 2, N, nullptr);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_LE(r->kept_total(), N) << beta;
    EXPECT_GE(r->kept_total(), N - 2) << beta << " scale " << s->moa_scale;
  }
  p.moa[0][0] = MoaSpan{1e-310, 0};
  EXPECT_EQ(retention_moa_scaled(p, 0.5, 1, 2, N).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace sf::kvstore

namespace sf {
namespace {

TEST(MoaProfile, MassCurveCountsTheSinkAndTheNewestTokens) {
  // 10 tokens: 0.5 on token 0 (sink), 0.3 on token 2, 0.2 on token 9 (the newest).
  std::vector<float> s(10, 0.f);
  s[0] = 0.5f, s[2] = 0.3f, s[9] = 0.2f;
  const auto c = kvstore::moa_mass_curve(s.data(), 10, 1, 4);
  // Spans 0, 4, 8, 9 (the last: every token after the sink).
  ASSERT_EQ(c.size(), 4u);
  EXPECT_NEAR(c[0], 0.5, 1e-6);
  EXPECT_NEAR(c[1], 0.7, 1e-6);  // tokens 6..9
  EXPECT_NEAR(c[2], 1.0, 1e-6);  // tokens 2..9: token 2 is in
  EXPECT_NEAR(c[3], 1.0, 1e-6);
  std::vector<float> none(10, 0.f);
  EXPECT_EQ(kvstore::moa_mass_curve(none.data(), 10, 1, 4), std::vector<double>(4, 0.0));
}

TEST(MoaProfile, AllocationGoesWhereTheMassIsAndKeepsTheBudget) {
  // Head 0: all its mass within the newest 64 tokens (a local head). Head 1: half of it 900
  // tokens back (a retrieval head), flat before that. Head 2: mass spread evenly.
  const int64_t n = 1024, step = 64;
  std::vector<float> local(n, 0.f), far(n, 0.f), even(n, 1.f);
  local[n - 1] = 1.f;
  far[n - 1] = 1.f, far[n - 900] = 1.f;
  std::vector<std::vector<double>> curves{kvstore::moa_mass_curve(local.data(), n, 0, step),
                                          kvstore::moa_mass_curve(far.data(), n, 0, step),
                                          kvstore::moa_mass_curve(even.data(), n, 0, step)};
  // The even head gains 1/1024 a token, the far one 0.5/896 by its one jump: the even head
  // fills first (to the whole prompt, 960 more), then the far head jumps back 896 tokens.
  auto a = kvstore::moa_allocate(curves, step, 3 * 64 + 960 + 896, 64);
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  const auto& sp = a.value();
  EXPECT_EQ(sp[0], 64);    // nothing more to gain
  EXPECT_EQ(sp[1], 960);   // past token n - 900, reached across its flat stretch
  EXPECT_EQ(sp[2], 1024);  // the whole prompt
  EXPECT_LE(sp[0] + sp[1] + sp[2], 3 * 64 + 960 + 896);
  EXPECT_EQ(sp[0] % step + sp[1] % step + sp[2] % step, 0);
  // A budget below every head's minimum is an error, not a silent overrun.
  EXPECT_FALSE(kvstore::moa_allocate(curves, step, 100, 64).is_ok());
  // A tighter budget gives each head no more than the looser one did.
  auto b = kvstore::moa_allocate(curves, step, 3 * 64 + 256, 64);
  ASSERT_TRUE(b.is_ok());
  for (size_t h = 0; h < 3; ++h) EXPECT_LE(b.value()[h], sp[h]) << h;
}

TEST(MoaProfile, FitIsExactOnALineAndClampsItsCoefficients) {
  const auto f = kvstore::moa_fit({2048, 4096, 8192}, {612, 1124, 2148});  // 100 + N / 4
  EXPECT_NEAR(f.alpha, 100, 1e-9);
  EXPECT_NEAR(f.beta, 0.25, 1e-12);
  const auto shrink = kvstore::moa_fit({2048, 4096}, {1000, 500});  // falling: beta 0
  EXPECT_EQ(shrink.beta, 0);
  EXPECT_NEAR(shrink.alpha, 750, 1e-9);
  const auto steep = kvstore::moa_fit({2048, 4096}, {0, 4000});  // alpha < 0: through 0
  EXPECT_EQ(steep.alpha, 0);
  EXPECT_GT(steep.beta, 0);
  EXPECT_LE(steep.beta, 1);
  const auto one = kvstore::moa_fit({4096}, {512});
  EXPECT_EQ(one.alpha, 512);
  EXPECT_EQ(one.beta, 0);
}

}  // namespace
}  // namespace sf
