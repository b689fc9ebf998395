// Decode session and decode attention on synthetic models: full retention + full decode equals
// the dense continuation; PSA's bound, its early stop and its eps = 1 limit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "tests/common/logit_rows.h"
#include "tests/decode/decode_test_util.h"
#include "kvstore/kv_quant.h"
#include "tests/common/nan_max.h"

namespace sf {
namespace {
using testing::TempDir;

void run_full_equals_dense(model::Arch arch) {
  const uint64_t seed = testing::fresh_seed();
  model::ModelConfig cfg = testing::tiny_config();
  cfg.arch = arch;
  cfg.qkv_bias = arch == model::Arch::kQwen2;
  cfg.rope.neox = arch == model::Arch::kQwen2;
  auto m = model::Model::synthetic(cfg, seed);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  const auto toks = testing::random_tokens(333, 101, seed + 1);
  auto pr = model::prefill(m.value(), toks);
  ASSERT_TRUE(pr.is_ok()) << pr.status().to_string();
  TempDir tmp;
  ASSERT_TRUE(testing::export_prefill(m.value(), toks, pr.value(), tmp.sub("kv"), nullptr, nullptr)
                  .is_ok());
  auto s = decode::open_decode_session(m.value(), tmp.sub("kv"), decode::DecodeAttnParams{});
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();

  // Reference: the model's own KV extend, step by step; logits compared at every step while
  // the two histories are the same. The same fp32 math in another summation order (per-token
  // loop against BLAS tiles) moves each logit by ~1e-6 (bound kLogit), so the two may part only
  // at a step where the reference's top two logits are within 2 x kLogit: a near-tie, which
  // then ends the comparison (their histories differ after it).
  constexpr double kLogit = 1e-4;
  const int n_new = 24;
  model::PrefillResult ref = pr.value();
  std::vector<int32_t> got{pr->first_token}, want{pr->first_token};
  std::vector<float> logits;
  double max_diff = 0;
  int parted = -1;
  for (int i = 1; i < n_new; ++i) {
    ASSERT_TRUE(s->step(got.back(), &logits).is_ok());
    got.push_back(int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()));
    const int32_t t = want.back();
    ASSERT_TRUE(model::extend(m.value(), std::span<const int32_t>(&t, 1), {}, &ref).is_ok());
    want.push_back(ref.first_token);
    if (parted >= 0) continue;
    ASSERT_EQ(logits.size(), ref.logits.size());
    for (size_t j = 0; j < logits.size(); ++j)
      max_diff = testing::nan_max(max_diff, double(std::fabs(logits[j] - ref.logits[j])));
    if (got.back() == want.back()) continue;
    parted = i;
    const double gap = testing::top2_gap(ref.logits.data(), int64_t(ref.logits.size()));
    EXPECT_LT(gap, 2 * kLogit) << "step " << i << ": the session took " << got.back()
                               << ", the dense continuation " << want.back()
                               << ", whose top two are " << gap << " apart";
    std::printf("step %d: a near-tie (top two %.3g apart) parted the two; compared up to it\n", i,
                gap);
  }
  if (parted < 0) EXPECT_EQ(got, want);
  auto dense = model::generate_greedy(m.value(), toks, n_new);
  ASSERT_TRUE(dense.is_ok());
  EXPECT_EQ(want, dense.value());  // the same extend calls
  EXPECT_LT(max_diff, kLogit) << "max |logit diff| " << max_diff;
  std::printf("max |logit diff| vs extend: %.3g\n", max_diff);
  EXPECT_EQ(s->stats().blocks_visited, s->stats().blocks_total);

  // The in-process path (no files) pages the same cache.
  auto full = kvstore::retention_apply(kvstore::RetentionPolicy{}, cfg.n_layers, cfg.n_kv_heads,
                                       333, nullptr);
  ASSERT_TRUE(full.is_ok());
  auto pc = decode::PagedKvCache::from_prefill(pr->kv, full.value());
  ASSERT_TRUE(pc.is_ok()) << pc.status().to_string();
  decode::DecodeSession s2(m.value(), std::move(pc).value(), 333, decode::DecodeAttnParams{});
  auto g2 = s2.generate_greedy(pr->first_token, n_new);
  ASSERT_TRUE(g2.is_ok());
  EXPECT_EQ(g2.value(), got);  // the same session arithmetic on the same K/V
}

TEST(Decode, FullRetentionFullDecodeEqualsDenseContinuationLlama) {
  run_full_equals_dense(model::Arch::kLlama);
}
TEST(Decode, FullRetentionFullDecodeEqualsDenseContinuationQwen2) {
  run_full_equals_dense(model::Arch::kQwen2);
}

// A one-layer, one-head export built by hand, with block metadata computed here.
decode::KvExport hand_export(int n, int d, const std::vector<float>& k,
                             const std::vector<float>& v) {
  decode::KvExport e;
  e.n_layers = 1;
  e.n_kv_heads = 1;
  e.head_dim = d;
  e.block_size = 64;
  e.n_tokens = n;
  decode::HeadKv h;
  for (int t = 0; t < n; ++t) h.positions.push_back(t);
  h.k = k;
  h.v = v;
  // The block statistics as an export writes them.
  const int nb = (n + 63) / 64;
  for (auto* x : {&h.block_kmin, &h.block_kmax, &h.block_kmean}) x->resize(size_t(nb * d));
  kvstore::block_key_stats(k.data(), n, d, h.block_kmin.data(), h.block_kmax.data(),
                           h.block_kmean.data());
  e.heads.push_back(std::move(h));
  return e;
}

// Loading pages the export's K/V and frees each head's copy as it goes: the pages equal
// from_export's, and the export keeps its manifest fields but no K/V.
TEST(PagedKv, TakeFromExportFreesTheExportsCopy) {
  const int n = 64 * 3 + 5, d = 8;
  std::vector<float> k(size_t(n * d)), v(size_t(n * d));
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = std::sin(0.37f * float(i));
    v[i] = std::cos(0.11f * float(i));
  }
  decode::KvExport e = hand_export(n, d, k, v);
  auto kept = decode::PagedKvCache::from_export(e, true);
  auto taken = decode::PagedKvCache::take_from_export(e, true);
  ASSERT_TRUE(kept.is_ok() && taken.is_ok());
  EXPECT_EQ(e.n_tokens, n);
  ASSERT_EQ(e.heads.size(), 1u);
  EXPECT_TRUE(e.heads[0].k.empty() && e.heads[0].v.empty() && e.heads[0].positions.empty() &&
              e.heads[0].block_kmin.empty());
  ASSERT_EQ(kept->pages(0, 0).size(), taken->pages(0, 0).size());
  for (size_t i = 0; i < kept->pages(0, 0).size(); ++i) {
    const auto& a = kept->block(kept->pages(0, 0)[i]);
    const auto& b = taken->block(taken->pages(0, 0)[i]);
    ASSERT_EQ(a.n, b.n);
    EXPECT_EQ(a.k, b.k);
    EXPECT_EQ(a.v, b.v);
    EXPECT_EQ(a.kmin, b.kmin);
    EXPECT_EQ(a.pos, b.pos);
  }
}

TEST(DecodeAttention, PsaBoundHoldsAndStopsEarlyOnAPeakedHead) {
  const uint64_t seed = testing::fresh_seed();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int n = 64 * 20, d = 32;
  std::vector<float> q(static_cast<size_t>(d)), k(static_cast<size_t>(n * d)),
      v(static_cast<size_t>(n * d));
  for (auto& x : q) x = nd(rng);
  {
    // |q| = sqrt(d): the hot block's logits sit near 2 sqrt(d) on every seed. With |q| drawn
    // free, a short q (one seed in ~125) left the planted block under eps of the mass.
    double n2 = 0;
    for (float x : q) n2 += double(x) * x;
    for (auto& x : q) x = float(x * std::sqrt(double(d) / n2));
  }
  for (auto& x : k) x = 0.1f * nd(rng);
  for (auto& x : v) x = nd(rng);
  // Block 13 holds keys aligned with q: it carries nearly all of the attention mass.
  for (int t = 13 * 64; t < 14 * 64; ++t)
    for (int c = 0; c < d; ++c) k[size_t(t * d + c)] += 2.f * q[size_t(c)];
  auto cache = decode::PagedKvCache::from_export(hand_export(n, d, k, v), false);
  ASSERT_TRUE(cache.is_ok()) << cache.status().to_string();
  for (int32_t id : cache->pages(0, 0)) {
    const auto& b = cache->block(id);
    const float ub = decode::block_score_bound(q.data(), b, d);
    for (int t = 0; t < b.n; ++t) {
      float dot = 0;
      for (int c = 0; c < d; ++c) dot += q[size_t(c)] * b.k[size_t(t * d + c)];
      ASSERT_LE(dot, ub + 1e-4f) << "block " << id << " token " << t;
    }
  }
  std::vector<float> full(static_cast<size_t>(d)), psa(static_cast<size_t>(d)),
      one(static_cast<size_t>(d));
  decode::DecodeAttnStats sf, sp, s1;
  decode::DecodeAttnParams pf, pp, p1;
  pp.mode = p1.mode = decode::DecodeAttnMode::kPsa;
  pp.eps = 0.9;
  pp.pin_sink_recent = false;
  p1.eps = 1.0;
  ASSERT_TRUE(
      decode::decode_attention(cache.value(), 0, q.data(), 1, pf, full.data(), &sf).is_ok());
  ASSERT_TRUE(decode::decode_attention(cache.value(), 0, q.data(), 1, pp, psa.data(), &sp).is_ok());
  ASSERT_TRUE(decode::decode_attention(cache.value(), 0, q.data(), 1, p1, one.data(), &s1).is_ok());
  EXPECT_EQ(sf.blocks_visited, 20);
  EXPECT_EQ(sf.kv_blocks_loaded, 20);  // full mode loads every block of the KV head
  EXPECT_EQ(s1.blocks_visited, 20);  // eps = 1 can only stop when no block is left
  // The hot block ranks first; the next one sets AS_min small enough to stop.
  EXPECT_EQ(sp.blocks_visited, 2);
  // Pinned: sink and newest block first (they do not set AS_min), the hot one, then one cold
  // block sets AS_min.
  decode::DecodeAttnParams pin = pp;
  pin.pin_sink_recent = true;
  decode::DecodeAttnStats spin;
  std::vector<float> opin(static_cast<size_t>(d));
  ASSERT_TRUE(
      decode::decode_attention(cache.value(), 0, q.data(), 1, pin, opin.data(), &spin).is_ok());
  EXPECT_EQ(spin.blocks_visited, 4);
  // Brute-force softmax in double for the reference output.
  std::vector<double> ref(size_t(d), 0.0), sc(static_cast<size_t>(n));
  double mx = -1e300, z = 0;
  for (int t = 0; t < n; ++t) {
    double dot = 0;
    for (int c = 0; c < d; ++c) dot += double(q[size_t(c)]) * k[size_t(t * d + c)];
    sc[size_t(t)] = dot / std::sqrt(double(d));
    mx = std::max(mx, sc[size_t(t)]);
  }
  for (int t = 0; t < n; ++t) z += std::exp(sc[size_t(t)] - mx);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c)
      ref[size_t(c)] += std::exp(sc[size_t(t)] - mx) / z * v[size_t(t * d + c)];
  double e_full = 0, e_one = 0, e_psa = 0, norm = 0;
  for (int c = 0; c < d; ++c) {
    e_full = testing::nan_max(e_full, std::fabs(full[size_t(c)] - ref[size_t(c)]));
    e_one = testing::nan_max(e_one, std::fabs(one[size_t(c)] - ref[size_t(c)]));
    e_psa = testing::nan_max(e_psa, std::fabs(psa[size_t(c)] - ref[size_t(c)]));
    norm = std::max(norm, std::fabs(ref[size_t(c)]));
  }
  EXPECT_LT(e_full, 1e-5 * (1 + norm));
  EXPECT_LT(e_one, 1e-5 * (1 + norm));
  EXPECT_LT(e_psa, 0.05 * (1 + norm));
  std::printf("psa eps 0.9: %lld of 20 blocks, max err %.3g (full %.3g)\n",
              static_cast<long long>(sp.blocks_visited), e_psa, e_full);
}

// Uniform attention (all keys zero) over 20 full blocks and a newest block holding one token.
// The one-token block's raw mass must not become AS_min (it is pinned, and masses count as
// full-block equivalents): it would stand for every unseen block and end the visit early.
// One query of ones over layer 0, head 0 of `cache` under psa:eps: the output row, its stats.
std::vector<float> psa_visit(const decode::PagedKvCache& cache, int d, double eps,
                             decode::DecodeAttnStats* st) {
  const std::vector<float> q(static_cast<size_t>(d), 1.f);
  decode::DecodeAttnParams p;
  p.mode = decode::DecodeAttnMode::kPsa;
  p.eps = eps;
  std::vector<float> out(static_cast<size_t>(d));
  EXPECT_TRUE(decode::decode_attention(cache, 0, q.data(), 1, p, out.data(), st).is_ok());
  return out;
}

TEST(DecodeAttention, PsaNewestPartialBlockDoesNotEndTheVisit) {
  const int n = 64 * 20 + 1, d = 16;
  std::vector<float> k(static_cast<size_t>(n * d), 0.f), v(static_cast<size_t>(n * d), 1.f);
  auto cache = decode::PagedKvCache::from_export(hand_export(n, d, k, v), false);
  ASSERT_TRUE(cache.is_ok()) << cache.status().to_string();
  ASSERT_EQ(cache->pages(0, 0).size(), 21u);
  decode::DecodeAttnStats st;
  const std::vector<float> out = psa_visit(cache.value(), d, 0.9, &st);
  // Exact uniform mass: stop once (65 + 64 k) / (65 + 64 * 19) >= 0.9, i.e. k = 17 ranked blocks.
  EXPECT_EQ(st.blocks_visited, 2 + 17);
  EXPECT_NEAR(out[0], 1.f, 1e-6f);
}

// A NaN key (a model that produced one) gives its block a NaN bound, which counts as unbounded:
// the block is visited first and the NaN reaches the output, as with full attention. Ranked as
// is, the NaN broke the sort's order and the visit could stop short of it with a finite output.
TEST(DecodeAttention, PsaVisitsABlockWithANanBound) {
  const int n = 64 * 20, d = 16;
  std::vector<float> k(static_cast<size_t>(n * d), 0.f), v(static_cast<size_t>(n * d), 1.f);
  for (int t = 3 * 64; t < 4 * 64; ++t)
    for (int c = 0; c < d; ++c) k[size_t(t * d + c)] = 2.f;  // block 3 holds nearly all the mass
  k[size_t((10 * 64 + 5) * d)] = std::nanf("");
  // The NaN is in row 5 of block 10: the block statistics keep it (std::min / max dropped a NaN
  // past a block's first row, and the visit skipped the block).
  decode::KvExport e = hand_export(n, d, k, v);
  ASSERT_TRUE(std::isnan(e.heads[0].block_kmin[size_t(10 * d)]));
  ASSERT_TRUE(std::isnan(e.heads[0].block_kmax[size_t(10 * d)]));
  auto cache = decode::PagedKvCache::from_export(e, false);
  ASSERT_TRUE(cache.is_ok()) << cache.status().to_string();
  decode::DecodeAttnStats st;
  const std::vector<float> out = psa_visit(cache.value(), d, 0.9, &st);
  EXPECT_TRUE(std::isnan(out[0])) << "visited " << st.blocks_visited << " blocks, out " << out[0];
  // Without the NaN the visit stops after a few blocks (the pinned ones, block 3): block 10 is
  // one a visit by bound skips.
  k[size_t((10 * 64 + 5) * d)] = 0.f;
  auto clean = decode::PagedKvCache::from_export(hand_export(n, d, k, v), false);
  ASSERT_TRUE(clean.is_ok());
  decode::DecodeAttnStats st2;
  (void)psa_visit(clean.value(), d, 0.9, &st2);
  EXPECT_LT(st2.blocks_visited, 10);
}

// A block whose min/max box is wide but whose keys are orthogonal to q ranks first with almost no
// mass. AS_min then stands for every unseen block, and the seed rule stops after 4 of 20 blocks
// with a sixth of the mass; psa-avg's recent mean forgets that block and reaches eps. The
// measured mass (measure_mass) is what tells them apart.
TEST(DecodeAttention, PsaAvgReachesEpsWhereAMisrankedBlockFoolsAsMin) {
  const int n = 64 * 20, d = 16;
  std::vector<float> q(static_cast<size_t>(d), 1.f), k(static_cast<size_t>(n * d), 1.f),
      v(static_cast<size_t>(n * d));
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) v[size_t(t * d + c)] = float((t * 7 + c * 3) % 11) - 5.f;
  // Block 5: token t has +5 on channel t % d and -5 on the next one, so q.k = 0 while the box
  // bound is 5 * sum|q| = 80 (the other blocks: q.k = bound = 16).
  for (int t = 5 * 64; t < 6 * 64; ++t)
    for (int c = 0; c < d; ++c)
      k[size_t(t * d + c)] = c == t % d ? 5.f : (c == (t + 1) % d ? -5.f : 0.f);
  auto cache = decode::PagedKvCache::from_export(hand_export(n, d, k, v), false);
  ASSERT_TRUE(cache.is_ok()) << cache.status().to_string();
  auto run = [&](const char* spec, decode::DecodeAttnStats* st) {
    auto p = decode::decode_attn_parse(spec);
    ASSERT_TRUE(p.is_ok());
    p->pin_sink_recent = false;
    p->measure_mass = true;
    std::vector<float> out(static_cast<size_t>(d));
    ASSERT_TRUE(
        decode::decode_attention(cache.value(), 0, q.data(), 1, p.value(), out.data(), st).is_ok());
  };
  decode::DecodeAttnStats seed_rule, avg, all;
  run("psa:0.9", &seed_rule);
  run("psa-avg:0.9", &avg);
  run("psa:1", &all);
  ASSERT_EQ(seed_rule.mass_n, 1);
  // Per-token mass e^0 : e^4 (scale 1/4); the seed rule stops at (e^0 + 3 e^4) / (e^0 + 19 e^4).
  const double e4 = std::exp(4.0);
  EXPECT_EQ(seed_rule.blocks_visited, 4);
  EXPECT_NEAR(seed_rule.mass_sum, (1 + 3 * e4) / (1 + 19 * e4), 1e-6);
  EXPECT_EQ(seed_rule.mass_below_eps, 1);
  // psa-avg: the hot blocks' mean stands for the rest; it stops at 19 of 20 with 18/19 hot.
  EXPECT_EQ(avg.blocks_visited, 19);
  EXPECT_GE(avg.mass_sum, 0.9);
  EXPECT_EQ(avg.mass_below_eps, 0);
  EXPECT_NEAR(all.mass_sum, 1.0, 1e-6);  // float exps in the visit, double in the check
  EXPECT_EQ(all.blocks_visited, 20);
}

// +gqa: two query heads share one KV head, each with one hot block the other does not see
// (head 0 on channel 0 in block 5, head 1 on channel 1 in block 12; every other key is zero).
// Alone, each head's seed rule stops after its hot block and one cold one (2 blocks, the other
// head's block missed). Sharing, the heads take turns: 5 (head 0), 12 (head 1), 0 (head 0, which
// then stops), 1 (head 1, which then stops); both fold all four blocks, so each reads 4 blocks
// and captures its mate's block too. The outputs equal a softmax over exactly those blocks.
TEST(DecodeAttention, PsaGqaFoldsTheGroupsBlocks) {
  const int n = 64 * 20, d = 16, hq = 2;
  std::vector<float> q(size_t(hq * d), 0.f), k(size_t(n * d), 0.f), v(size_t(n * d));
  q[0] = 1.f;      // head 0: channel 0
  q[d + 1] = 1.f;  // head 1: channel 1
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) v[size_t(t * d + c)] = float((t * 5 + c * 7) % 13) - 6.f;
  for (int t = 0; t < 64; ++t) {
    k[size_t((5 * 64 + t) * d + 0)] = 24.f;   // q.k * 1/4 = 6 for head 0
    k[size_t((12 * 64 + t) * d + 1)] = 24.f;  // and for head 1
  }
  auto cache = decode::PagedKvCache::from_export(hand_export(n, d, k, v), false);
  ASSERT_TRUE(cache.is_ok()) << cache.status().to_string();
  auto run = [&](const char* spec, std::vector<float>* out, decode::DecodeAttnStats* st) {
    auto p = decode::decode_attn_parse(spec);
    ASSERT_TRUE(p.is_ok()) << spec;
    p->measure_mass = true;
    out->assign(size_t(hq * d), 0.f);
    ASSERT_TRUE(
        decode::decode_attention(cache.value(), 0, q.data(), hq, p.value(), out->data(), st)
            .is_ok());
  };
  std::vector<float> solo, shared;
  decode::DecodeAttnStats ss, sg;
  run("psa-strict:0.9", &solo, &ss);
  run("psa-strict+gqa:0.9", &shared, &sg);
  EXPECT_EQ(ss.last_visited_by_head, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(sg.last_visited_by_head, (std::vector<int32_t>{4, 4}));
  EXPECT_EQ(sg.blocks_visited, 8);
  EXPECT_EQ(sg.blocks_total, 40);
  // Loads for the KV head: alone the union {5, 0} + {12, 0}; shared, each block once.
  EXPECT_EQ(ss.kv_blocks_loaded, 3);
  EXPECT_EQ(sg.kv_blocks_loaded, 4);
  EXPECT_EQ(sg.kv_blocks_total, 20);
  // Captured mass per head: hot block 64 e^6 plus cold blocks of 64 each, of 64 e^6 + 19 x 64.
  const double e6 = std::exp(6.0);
  EXPECT_NEAR(ss.mass_sum, 2 * (e6 + 1) / (e6 + 19), 1e-6);
  EXPECT_NEAR(sg.mass_sum, 2 * (e6 + 3) / (e6 + 19), 1e-6);
  // Reference: each head's softmax over blocks {5, 12, 0, 1} in double.
  for (int h = 0; h < hq; ++h) {
    std::vector<double> ref(size_t(d), 0.0);
    double z = 0;
    for (int b : {5, 12, 0, 1})
      for (int t = b * 64; t < b * 64 + 64; ++t) {
        double s = 0;
        for (int c = 0; c < d; ++c) s += double(q[size_t(h * d + c)]) * k[size_t(t * d + c)];
        const double w = std::exp(s / 4.0);
        z += w;
        for (int c = 0; c < d; ++c) ref[size_t(c)] += w * v[size_t(t * d + c)];
      }
    for (int c = 0; c < d; ++c)
      EXPECT_NEAR(shared[size_t(h * d + c)], ref[size_t(c)] / z, 1e-5) << "head " << h << " ch " << c;
  }
}

// With one query head per KV head there is nobody to take turns with: +gqa must be the per-head
// visit exactly (same blocks, same output bits), for each remainder rule, pinned or not.
TEST(DecodeAttention, PsaGqaWithOneHeadPerKvHeadIsThePerHeadVisit) {
  const int n = 64 * 37 + 5, d = 32;
  std::mt19937_64 rng(testing::fresh_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(static_cast<size_t>(d)), k(static_cast<size_t>(n * d)),
      v(static_cast<size_t>(n * d));
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = 0.5f * nd(rng);
  for (auto& x : v) x = nd(rng);
  for (int t = 64 * 9; t < 64 * 10; t += 2)  // one block the query likes
    for (int c = 0; c < d; ++c) k[size_t(t * d + c)] += 0.6f * q[size_t(c)];
  auto cache = decode::PagedKvCache::from_export(hand_export(n, d, k, v), false);
  ASSERT_TRUE(cache.is_ok()) << cache.status().to_string();
  for (const char* mode : {"psa", "psa-avg", "psa-strict"}) {
    const std::string a = std::string(mode) + ":0.9", b = std::string(mode) + "+gqa:0.9";
    std::vector<float> oa(static_cast<size_t>(d)), ob(static_cast<size_t>(d));
    decode::DecodeAttnStats sa, sb;
    ASSERT_TRUE(decode::decode_attention(cache.value(), 0, q.data(), 1,
                                         decode::decode_attn_parse(a).value(), oa.data(), &sa)
                    .is_ok());
    ASSERT_TRUE(decode::decode_attention(cache.value(), 0, q.data(), 1,
                                         decode::decode_attn_parse(b).value(), ob.data(), &sb)
                    .is_ok());
    EXPECT_EQ(sa.blocks_visited, sb.blocks_visited) << mode;
    EXPECT_EQ(sa.kv_blocks_loaded, sb.kv_blocks_loaded) << mode;
    EXPECT_LT(sa.blocks_visited, sa.blocks_total) << mode;  // a visit that stopped early
    for (int c = 0; c < d; ++c) EXPECT_EQ(oa[size_t(c)], ob[size_t(c)]) << mode << " ch " << c;
  }
}

// A verification pass: n new tokens' full attention in one read of each block equals n
// single-token full calls, each over the cache as it stood after its token's append, bit for bit
// (blocks end mid-pass: 60 of 64 filled, then 9 appends), and counts the blocks both ways.
TEST(DecodeAttention, CausalPassEqualsSingleTokenCalls) {
  const int n = 64 * 5 + 60, d = 32, heads = 3, extra = 9;
  std::mt19937_64 rng(testing::fresh_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  const auto fill = [&](size_t len) {
    std::vector<float> x(len);
    for (auto& e : x) e = nd(rng);
    return x;
  };
  const std::vector<float> k = fill(size_t(n * d)), v = fill(size_t(n * d)),
                           q = fill(size_t(extra * heads * d)),
                           nk = fill(size_t(extra * d)), nv = fill(size_t(extra * d));
  auto cache = decode::PagedKvCache::from_export(hand_export(n, d, k, v), false);
  ASSERT_TRUE(cache.is_ok()) << cache.status().to_string();
  decode::DecodeAttnParams full;
  std::vector<float> one(size_t(extra * heads * d)), pass(one.size(), -7.f);
  decode::DecodeAttnStats s1, sp;
  std::vector<int32_t> pos(static_cast<size_t>(extra));
  for (int i = 0; i < extra; ++i) {
    pos[size_t(i)] = n + i;
    cache->append(0, 0, n + i, nk.data() + i * d, nv.data() + i * d);
    ASSERT_TRUE(decode::decode_attention(cache.value(), 0, q.data() + i * heads * d, heads, full,
                                         one.data() + i * heads * d, &s1)
                    .is_ok());
  }
  ASSERT_TRUE(decode::decode_attention_causal(cache.value(), 0, q.data(), extra, pos.data(), heads,
                                              0.f, pass.data(), &sp)
                  .is_ok());
  EXPECT_EQ(pass, one);
  EXPECT_EQ(sp.blocks_total, s1.blocks_total);
  EXPECT_EQ(sp.blocks_computed, s1.blocks_computed);
  EXPECT_EQ(sp.kv_blocks_total, s1.kv_blocks_total);
  // Read once: every query head reads the 7 blocks of the final cache once.
  EXPECT_EQ(sp.blocks_visited, int64_t(heads) * 7);
  EXPECT_EQ(sp.kv_blocks_loaded, 7);
  EXPECT_EQ(s1.blocks_total, int64_t(heads) * (6 * 4 + 7 * 5));
  int64_t by_token = 0;
  for (int64_t t : sp.last_total_by_token) by_token += t;
  EXPECT_EQ(by_token, s1.blocks_total);
  // Positions must increase.
  std::swap(pos[0], pos[1]);
  EXPECT_EQ(decode::decode_attention_causal(cache.value(), 0, q.data(), extra, pos.data(), heads,
                                            0.f, pass.data(), nullptr)
                .code(),
            Code::kInvalidArgument);
}

TEST(DecodeAttention, ParseRejectsBadModes) {
  EXPECT_TRUE(decode::decode_attn_parse("full").is_ok());
  EXPECT_FALSE(decode::decode_attn_parse("psa-strict:0.9")->pin_sink_recent);
  auto p = decode::decode_attn_parse("psa:0.95");
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p->mode, decode::DecodeAttnMode::kPsa);
  EXPECT_DOUBLE_EQ(p->eps, 0.95);
  EXPECT_EQ(p->remainder, decode::PsaRemainder::kAsMin);
  auto a = decode::decode_attn_parse("psa-avg:0.9");
  ASSERT_TRUE(a.is_ok());
  EXPECT_EQ(a->remainder, decode::PsaRemainder::kRecentMean);
  EXPECT_TRUE(a->pin_sink_recent);
  EXPECT_DOUBLE_EQ(a->eps, 0.9);
  auto g = decode::decode_attn_parse("psa-avg+gqa:0.9");
  ASSERT_TRUE(g.is_ok());
  EXPECT_TRUE(g->share_kv_head);
  EXPECT_EQ(g->remainder, decode::PsaRemainder::kRecentMean);
  EXPECT_FALSE(a->share_kv_head);
  EXPECT_FALSE(decode::decode_attn_parse("psa-strict+gqa:0.9")->pin_sink_recent);
  EXPECT_EQ(decode::decode_attn_parse("full+gqa").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(decode::decode_attn_parse("psa+gqa").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(decode::decode_attn_parse("psa+kv:0.9").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(decode::decode_attn_parse("psa+gqa:2").status().code(), Code::kOutOfRange);
  EXPECT_EQ(decode::decode_attn_parse("psa-avg:0").status().code(), Code::kOutOfRange);
  EXPECT_EQ(decode::decode_attn_parse("psa:1.5").status().code(), Code::kOutOfRange);
  EXPECT_EQ(decode::decode_attn_parse("psa:").status().code(), Code::kOutOfRange);
  EXPECT_NE(decode::decode_attn_parse("topk").status().message().find("'topk'"), std::string::npos);
  auto gd = decode::decode_attn_parse("psa-avg:0.95:0.2");
  ASSERT_TRUE(gd.is_ok());
  EXPECT_DOUBLE_EQ(gd->eps, 0.95);
  EXPECT_DOUBLE_EQ(gd->guard_margin, 0.2);
  EXPECT_DOUBLE_EQ(a->guard_margin, 0.0);
  EXPECT_EQ(decode::decode_attn_parse("psa:0.9:0").status().code(), Code::kOutOfRange);
  EXPECT_EQ(decode::decode_attn_parse("psa:0.9:x").status().code(), Code::kOutOfRange);
  EXPECT_EQ(decode::decode_attn_parse("psa:0.9:").status().code(), Code::kOutOfRange);
  EXPECT_EQ(decode::decode_attn_parse("psa:2:0.1").status().code(), Code::kOutOfRange);
  auto vd = decode::decode_attn_parse("psa-avg:0.95:verify16");
  ASSERT_TRUE(vd.is_ok());
  EXPECT_EQ(vd->verify_draft, 16);
  EXPECT_DOUBLE_EQ(vd->guard_margin, 0.0);
  EXPECT_DOUBLE_EQ(vd->eps, 0.95);
  EXPECT_EQ(a->verify_draft, 0);
  for (const char* both : {"psa-avg:0.95:verify8:0.25", "psa-avg:0.95:0.25:verify8"}) {
    auto b = decode::decode_attn_parse(both);
    ASSERT_TRUE(b.is_ok()) << both;
    EXPECT_EQ(b->verify_draft, 8) << both;
    EXPECT_DOUBLE_EQ(b->guard_margin, 0.25) << both;
  }
  for (const char* bad : {"psa:0.9:verify0", "psa:0.9:verify257", "psa:0.9:verifyx",
                          "psa:0.9:verify", "psa:0.9:verify4:verify8", "psa:0.9:0.1:0.2",
                          "psa:0.9:verify+8", "psa:0.9:verify 8",
                          "psa:0.9:verify4:"})
    EXPECT_EQ(decode::decode_attn_parse(bad).status().code(), Code::kOutOfRange) << bad;
}

// An append taken back leaves the cache as it was: pages, fills, positions, keys and the block
// min/max PSA ranks by, whether the append filled a block or opened one.
TEST(PagedKv, UndoneAppendsRestoreTheCache) {
  const uint64_t seed = testing::fresh_seed();
  model::ModelConfig cfg = testing::tiny_config();
  auto m = model::Model::synthetic(cfg, seed);
  ASSERT_TRUE(m.is_ok());
  const auto toks = testing::random_tokens(127, 101, seed + 1);  // the 2nd block has one free row
  auto pr = model::prefill(m.value(), toks);
  ASSERT_TRUE(pr.is_ok());
  auto full = kvstore::retention_apply(kvstore::RetentionPolicy{}, cfg.n_layers, cfg.n_kv_heads,
                                       127, nullptr);
  ASSERT_TRUE(full.is_ok());
  auto a = decode::PagedKvCache::from_prefill(pr->kv, full.value());
  auto b = decode::PagedKvCache::from_prefill(pr->kv, full.value());
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  const int d = a->head_dim();
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd(0.f, 3.f);  // wide keys: the min/max move
  std::vector<decode::PagedKvCache::AppendUndo> undo;
  for (int step = 0; step < 2; ++step)  // fills the second block, then opens a third
    for (int l = 0; l < cfg.n_layers; ++l)
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        std::vector<float> k(static_cast<size_t>(d)), v(static_cast<size_t>(d));
        for (auto& x : k) x = nd(rng);
        for (auto& x : v) x = nd(rng);
        undo.push_back(a->append_undoable(l, h, 127 + step, k.data(), v.data()));
      }
  EXPECT_EQ(a->pages(0, 0).size(), 3u);
  for (auto it = undo.rbegin(); it != undo.rend(); ++it) a->undo_append(std::move(*it));
  EXPECT_EQ(a->n_blocks(), b->n_blocks());
  for (int l = 0; l < cfg.n_layers; ++l)
    for (int h = 0; h < cfg.n_kv_heads; ++h) {
      ASSERT_EQ(a->pages(l, h), b->pages(l, h));
      for (int32_t id : a->pages(l, h)) {
        const decode::KvBlock &x = a->block(id), &y = b->block(id);
        EXPECT_EQ(x.n, y.n);
        EXPECT_EQ(x.pos, y.pos);
        EXPECT_EQ(x.k, y.k);
        EXPECT_EQ(x.v, y.v);
        EXPECT_EQ(x.kmin, y.kmin);
        EXPECT_EQ(x.kmax, y.kmax);
      }
    }
  // Out of pool order, as a verification pass undoes its rejected tokens and keeps others: a
  // block opened by (layer 0, head 0) and then one by (layer 1, head 0); only the first append is
  // undone. Its block is no longer in use, and the next block opened reuses it, cleared.
  ASSERT_GE(cfg.n_layers, 2);
  std::vector<float> k(static_cast<size_t>(d), 1.f), v(static_cast<size_t>(d), 2.f);
  for (int l = 0; l < 2; ++l) a->append(l, 0, 127, k.data(), v.data());  // fills block 2
  auto u0 = a->append_undoable(0, 0, 128, k.data(), v.data());
  const int32_t opened0 = a->pages(0, 0).back();
  a->append(1, 0, 128, k.data(), v.data());
  ASSERT_TRUE(u0.opened);
  EXPECT_EQ(a->n_blocks(), b->n_blocks() + 2);
  a->undo_append(std::move(u0));
  EXPECT_EQ(a->n_blocks(), b->n_blocks() + 1);
  EXPECT_EQ(a->pages(0, 0).size(), 2u);
  for (auto& x : k) x = -1.f;
  a->append(0, 0, 129, k.data(), v.data());
  EXPECT_EQ(a->pages(0, 0).back(), opened0);
  EXPECT_EQ(a->n_blocks(), b->n_blocks() + 2);
  const decode::KvBlock& r = a->block(opened0);
  EXPECT_EQ(r.n, 1);
  EXPECT_EQ(r.pos[0], 129);
  EXPECT_EQ(r.pos[1], -1);
  EXPECT_EQ(r.kmin[0], -1.f);
  EXPECT_EQ(r.kmax[0], -1.f);
}

// A tiny synthetic model prefilled on n random tokens (fresh seed), and host decode sessions
// over its full cache.
struct TinyPrefill {
  model::ModelConfig cfg = testing::tiny_config();
  uint64_t seed;
  Result<model::Model> m;
  int n;
  model::PrefillResult pr;
  Result<kvstore::Retention> full;
  bool ok = false;
  explicit TinyPrefill(int n_tokens, uint64_t s = testing::fresh_seed())
      : seed(s), m(model::Model::synthetic(cfg, seed)), n(n_tokens),
        full(kvstore::retention_apply(kvstore::RetentionPolicy{}, cfg.n_layers, cfg.n_kv_heads,
                                      n_tokens, nullptr)) {
    if (!m.is_ok() || !full.is_ok()) return;
    auto p = model::prefill(m.value(), testing::random_tokens(n, 101, seed + 1));
    if (!p.is_ok()) return;
    pr = std::move(p).value();
    ok = true;
  }
  decode::DecodeSession session(const std::string& spec) const {
    auto pc = decode::PagedKvCache::from_prefill(pr.kv, full.value());
    EXPECT_TRUE(pc.is_ok());
    return decode::DecodeSession(m.value(), std::move(pc).value(), n,
                                 decode::decode_attn_parse(spec).value());
  }
};

// A step that fails part-way takes its appends back. Here layer 1's output projection is given
// a wrong shape, so the step fails in layer 1's linear after layers 0 and 1 appended their K/V:
// every head keeps its token count, and once the weight is mended the next step's logits are a
// fresh session's first step's, bit for bit (the same position and cache). Then the same with
// verified drafts, whose first draft fails.
TEST(DecodeSession, AFailedStepLeavesTheCacheAsItWas) {
  TinyPrefill tp(200);
  ASSERT_TRUE(tp.ok);
  const model::ModelConfig& c = tp.cfg;
  ASSERT_GE(c.n_layers, 2);
  // The test owns the model: breaking and mending one weight's shape in place is fine here.
  auto& wo = const_cast<model::ModelWeights&>(tp.m.value().weights()).layers[1].wo;
  const std::vector<int64_t> shape = wo.shape;
  for (const char* spec : {"full", "psa-avg:0.95:verify4"}) {
    SCOPED_TRACE(spec);
    auto s = tp.session(spec);
    auto counts = [&] {
      std::vector<int64_t> n;
      for (int l = 0; l < c.n_layers; ++l)
        for (int h = 0; h < c.n_kv_heads; ++h) n.push_back(s.cache().n_tokens(l, h));
      return n;
    };
    const std::vector<int64_t> before = counts();
    ASSERT_EQ(before.front(), 200);
    wo.shape = {shape[0], shape[1] / 2};
    std::vector<float> z;
    const bool verified = std::string(spec).find("verify") != std::string::npos;
    if (verified) {
      EXPECT_FALSE(s.generate_greedy(tp.pr.first_token, 8).is_ok());
    } else {
      EXPECT_FALSE(s.step(tp.pr.first_token, &z).is_ok());
    }
    EXPECT_EQ(counts(), before) << "a failed step left K/V in the cache";
    wo.shape = shape;
    if (verified) {
      auto a = s.generate_greedy(tp.pr.first_token, 8);
      auto b = tp.session(spec).generate_greedy(tp.pr.first_token, 8);
      ASSERT_TRUE(a.is_ok() && b.is_ok());
      EXPECT_EQ(a.value(), b.value());
    } else {
      ASSERT_TRUE(s.step(tp.pr.first_token, &z).is_ok());
      std::vector<float> want;
      auto fresh = tp.session(spec);
      ASSERT_TRUE(fresh.step(tp.pr.first_token, &want).is_ok());
      EXPECT_EQ(z, want);
    }
  }
  wo.shape = shape;
}

// A cache whose geometry is not the model's is refused by a step, not indexed out of bounds.
TEST(DecodeSession, ACacheOfAnotherGeometryIsRefused) {
  TinyPrefill tp(100);
  ASSERT_TRUE(tp.ok);
  model::KvCache kv = tp.pr.kv;
  kv.n_layers = 1;  // the first layer only
  kv.k.resize(1);
  kv.v.resize(1);
  auto ret = kvstore::retention_apply(kvstore::RetentionPolicy{}, 1, tp.cfg.n_kv_heads, 100, nullptr);
  ASSERT_TRUE(ret.is_ok());
  auto pc = decode::PagedKvCache::from_prefill(kv, ret.value());
  ASSERT_TRUE(pc.is_ok()) << pc.status().to_string();
  decode::DecodeSession s(tp.m.value(), std::move(pc).value(), 100, decode::DecodeAttnParams{});
  std::vector<float> z;
  const Status st = s.step(tp.pr.first_token, &z);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("the cache is 1 layers"), std::string::npos) << st.message();
}

// The psa guard: a margin no step's top two logits can be under re-runs nothing (the plain PSA
// session's logits bit for bit); one every step is under re-runs every step in full (the full
// session's logits bit for bit), and the re-runs' blocks count as visited.
TEST(DecodeSession, PsaGuardRerunsNearTiesInFull) {
  TinyPrefill tp(700);
  ASSERT_TRUE(tp.ok);
  const auto& pr = tp.pr;
  const auto session = [&](const std::string& spec) { return tp.session(spec); };
  auto run = [&](decode::DecodeSession& s, std::vector<std::vector<float>>* out) {
    auto g = s.generate_greedy(pr.first_token, 16,
                               [&](int, const std::vector<float>& z) { out->push_back(z); });
    ASSERT_TRUE(g.is_ok());
  };
  std::vector<std::vector<float>> z_psa, z_never, z_full, z_always;
  auto psa = session("psa:0.5"), never = session("psa:0.5:1e-30"), plain = session("full"),
       always = session("psa:0.5:1e30");
  run(psa, &z_psa);
  run(never, &z_never);
  run(plain, &z_full);
  run(always, &z_always);
  // An exact tie (top two logits equal, about 1e-5 a run) is under every positive margin, so the
  // guard re-runs that step even at 1e-30: the sessions agree bit for bit up to the first one.
  size_t first_tie = z_psa.size();
  for (size_t i = 0; i < z_psa.size() && first_tie == z_psa.size(); ++i)
    if (testing::top2_gap(z_psa[i].data(), int64_t(z_psa[i].size())) <= 0) first_tie = i;
  ASSERT_EQ(z_never.size(), z_psa.size());
  for (size_t i = 0; i < first_tie; ++i) EXPECT_EQ(z_never[i], z_psa[i]) << "step " << i;
  if (first_tie == z_psa.size())
    EXPECT_EQ(never.stats().guard_steps, 0);
  else
    EXPECT_GE(never.stats().guard_steps, 1) << "exact tie at step " << first_tie;
  EXPECT_EQ(z_always, z_full);
  EXPECT_EQ(always.stats().guard_steps, always.stats().steps);
  EXPECT_EQ(always.stats().steps, 15);
  // The PSA pass then the full pass: more than all the blocks, over the same total.
  EXPECT_EQ(always.stats().blocks_total, plain.stats().blocks_total);
  EXPECT_GT(always.stats().blocks_visited, plain.stats().blocks_visited);
  EXPECT_LT(always.stats().blocks_visited, 2 * plain.stats().blocks_visited);
  EXPECT_LT(psa.stats().blocks_visited, psa.stats().blocks_total);  // eps 0.5 skips blocks
  EXPECT_NE(z_psa, z_full);
}

// Verified drafts (psa:EPS:verifyN): the tokens are full decode's, however poor the draft (eps
// 0.5 here), up to the batched pass's float rounding; the logits are the full pass's; the cache
// left behind is full decode's; the blocks the kept tokens would visit in full are the total.
TEST(DecodeSession, VerifiedDraftsGiveFullDecodesTokens) {
  const int n_new = 40;
  // Some tiny models' drafts are never rejected (a few fixtures in a hundred): fixtures are tried
  // until one rejects a draft, so the undo of rejected tokens is exercised; every check below
  // holds on every fixture tried.
  const uint64_t base = testing::fresh_seed();
  bool rejected = false;
  for (uint64_t attempt = 0; attempt < 8 && !rejected; ++attempt) {
    SCOPED_TRACE("fixture seed " + std::to_string(base + 2 * attempt));
    TinyPrefill tp(700, base + 2 * attempt);
    ASSERT_TRUE(tp.ok);
    const auto& pr = tp.pr;
    const model::ModelConfig& cfg = tp.cfg;
    const auto session = [&](const std::string& spec) { return tp.session(spec); };
    struct Run {
      std::vector<int32_t> tokens;
      std::vector<std::vector<float>> z;
    };
    auto run = [&](decode::DecodeSession& s) {
      Run r;
      auto g = s.generate_greedy(pr.first_token, n_new, [&](int i, const std::vector<float>& z) {
        EXPECT_EQ(i, int(r.z.size()) + 1);
        r.z.push_back(z);
      });
      EXPECT_TRUE(g.is_ok()) << g.status().to_string();
      r.tokens = g.value();
      return r;
    };
    auto ref_s = session("full");
    const Run ref = run(ref_s);
    auto psa_s = session("psa:0.5");
    const Run psa = run(psa_s);
    EXPECT_NE(psa.z, ref.z);
    int64_t drafted = 0, kept = 0, drafted_no_margin = 0, drafted_margin = 0;
    for (const char* spec : {"psa:0.5:verify1", "psa:0.5:verify6", "psa:0.5:verify64",
                             "psa:0.5:verify64:1e30"}) {
      auto s = session(spec);
      const Run got = run(s);
      ASSERT_EQ(got.tokens.size(), size_t(n_new)) << spec;
      ASSERT_EQ(got.z.size(), ref.z.size()) << spec;
      bool parted = false;
      for (size_t i = 0; i < ref.z.size(); ++i) {
        double diff = 0;
        for (size_t j = 0; j < ref.z[i].size(); ++j)
          diff = std::max(diff, double(std::fabs(got.z[i][j] - ref.z[i][j])));
        EXPECT_LT(diff, 1e-4) << spec << " step " << i;  // batched GEMM against GEMV rows
        if (got.tokens[i + 1] != ref.tokens[i + 1]) {
          // Only a near-tie of the full cache's own logits may flip under that rounding.
          EXPECT_LT(testing::top2_gap(ref.z[i].data(), int64_t(ref.z[i].size())), 1e-4)
              << spec << " token " << i + 1;
          parted = true;
          break;  // the continuations part here
        }
      }
      const decode::DecodeAttnStats& st = s.stats();
      EXPECT_EQ(st.steps, n_new - 1) << spec;
      EXPECT_EQ(st.blocks_total, ref_s.stats().blocks_total) << spec;
      EXPECT_EQ(st.kv_blocks_total, ref_s.stats().kv_blocks_total) << spec;
      EXPECT_GT(st.verify_passes, 0) << spec;
      EXPECT_GT(st.draft_steps, 0) << spec;
      EXPECT_LE(st.draft_accepted, st.draft_steps) << spec;
      // Every kept token is one accepted draft or one pass's own token.
      EXPECT_EQ(st.draft_accepted + st.verify_passes, n_new - 1) << spec;
      EXPECT_EQ(st.verify_tokens, st.verify_passes + st.draft_steps) << spec;
      drafted += st.draft_steps;
      kept += st.draft_accepted;
      // verify1 drafts one token a round; verify6 and verify64 more.
      if (std::string(spec) == "psa:0.5:verify1")
        EXPECT_LE(st.verify_tokens, 2 * st.verify_passes) << spec;
      else
        EXPECT_GT(st.verify_tokens, 2 * st.verify_passes) << spec;
      if (std::string(spec) == "psa:0.5:verify64") drafted_no_margin = st.draft_steps;
      if (std::string(spec) == "psa:0.5:verify64:1e30") drafted_margin = st.draft_steps;
      if (parted) continue;  // a rounding near-tie: the caches hold different tokens from there
      // The cache left behind is full decode's: every block holding a generated token (positions,
      // K/V and the min/max PSA ranks by, within rounding), and no block more in use.
      EXPECT_EQ(s.cache().n_blocks(), ref_s.cache().n_blocks()) << spec;
      for (int l = 0; l < cfg.n_layers; ++l)
        for (int h = 0; h < cfg.n_kv_heads; ++h) {
          ASSERT_EQ(s.cache().n_tokens(l, h), ref_s.cache().n_tokens(l, h)) << spec;
          const auto& pa = s.cache().pages(l, h);
          const auto& pb = ref_s.cache().pages(l, h);
          ASSERT_EQ(pa.size(), pb.size()) << spec;
          for (size_t bi = size_t(tp.n) / 64; bi < pa.size(); ++bi) {
            const decode::KvBlock& a = s.cache().block(pa[bi]);
            const decode::KvBlock& b = ref_s.cache().block(pb[bi]);
            ASSERT_EQ(a.n, b.n) << spec;
            EXPECT_EQ(a.pos, b.pos) << spec;
            for (size_t c = 0; c < size_t(a.n) * size_t(cfg.head_dim); ++c) {
              EXPECT_NEAR(a.k[c], b.k[c], 1e-4) << spec;
              EXPECT_NEAR(a.v[c], b.v[c], 1e-4) << spec;
            }
            for (int c = 0; c < cfg.head_dim; ++c) {
              EXPECT_NEAR(a.kmin[size_t(c)], b.kmin[size_t(c)], 1e-4) << spec;
              EXPECT_NEAR(a.kmax[size_t(c)], b.kmax[size_t(c)], 1e-4) << spec;
            }
          }
        }
    }
    // Near-ties stopped drafts: with a margin every step is under, verify64 drafts far fewer
    // tokens than without.
    EXPECT_LT(drafted_margin, drafted_no_margin);
    EXPECT_LE(kept, drafted);
    rejected = kept < drafted;
  }
  // Some draft was rejected, so the undo of rejected tokens ran under the checks above.
  EXPECT_TRUE(rejected) << "no fixture of 8 rejected a draft";
}

// The stop rule at a draft's near-tie: P(wrong) (prior 1 in 4, then the session's rejected
// near-ties) x drafts left x a draft's share of the blocks, against one pass.
TEST(DecodeSession, VerifyStopsAtATieWhenTheRiskedDraftsOutweighAPass) {
  EXPECT_TRUE(decode::verify_stops_at_tie(0, 0, 20, 0.3));    // 0.25 x 20 x 0.3 = 1.5
  EXPECT_FALSE(decode::verify_stops_at_tie(0, 0, 10, 0.3));   // 0.75
  EXPECT_FALSE(decode::verify_stops_at_tie(0, 16, 20, 0.3));  // 1/20 x 20 x 0.3 = 0.3
  EXPECT_TRUE(decode::verify_stops_at_tie(6, 0, 10, 0.3));    // 0.7 x 10 x 0.3 = 2.1
  EXPECT_FALSE(decode::verify_stops_at_tie(6, 0, 0, 1.0));    // nothing left to risk
}

}  // namespace
}  // namespace sf
