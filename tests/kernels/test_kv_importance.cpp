// kv_importance (SnapKV column sums from the attention's LSE) against a brute-force softmax in
// double, and its hook in the prefill forward.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/api.h"
#include "kernels/kv_importance.h"
#include "tests/common/test_seed.h"
#include "tests/worker/model/model_test_util.h"
#include "worker/model/model.h"

namespace sf {
namespace {

using testing::fresh_seed;

std::vector<float> randn(size_t n, std::mt19937_64& rng, float sd) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Materializes the full softmax of the window rows in double, sums columns per KV group, pools.
std::vector<double> brute_force(const std::vector<float>& q, const std::vector<float>& k,
                                int64_t nq, int64_t nk, int64_t hq, int64_t hkv, int64_t d,
                                int64_t q_offset, int window, int pool) {
  const int64_t W = std::min<int64_t>(window, nq), group = hq / hkv;
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> col(size_t(hkv * nk), 0.0);
  for (int64_t h = 0; h < hq; ++h)
    for (int64_t r = nq - W; r < nq; ++r) {
      const int64_t kend = std::min(nk, q_offset + r + 1);
      std::vector<double> s(static_cast<size_t>(kend));
      double mx = -1e300;
      for (int64_t j = 0; j < kend; ++j) {
        double acc = 0;
        for (int64_t c = 0; c < d; ++c)
          acc += double(q[size_t((r * hq + h) * d + c)]) *
                 double(k[size_t((j * hkv + h / group) * d + c)]);
        s[size_t(j)] = acc * scale;
        mx = std::max(mx, s[size_t(j)]);
      }
      double z = 0;
      for (double x : s) z += std::exp(x - mx);
      for (int64_t j = 0; j < kend; ++j)
        col[size_t((h / group) * nk + j)] += std::exp(s[size_t(j)] - mx) / z;
    }
  std::vector<double> out(col.size());
  for (int64_t g = 0; g < hkv; ++g)
    for (int64_t j = 0; j < nk; ++j) {
      double m = 0;
      for (int64_t u = std::max<int64_t>(0, j - pool / 2); u <= std::min(nk - 1, j + pool / 2); ++u)
        m = std::max(m, col[size_t(g * nk + u)]);
      out[size_t(g * nk + j)] = m;
    }
  return out;
}

struct Case {
  int64_t nq, prefix, hq, hkv, d;
  int window, pool;
};

TEST(KvImportance, MatchesBruteForceSoftmax) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Case cases[] = {{300, 0, 6, 2, 32, 48, 1},
                        {300, 0, 6, 2, 32, 48, 7},
                        {90, 333, 4, 4, 16, 64, 7},
                        {20, 5, 8, 2, 64, 64, 7},
                        {513, 17, 3, 1, 8, 32, 5}};
  for (const Case& cs : cases) {
    SCOPED_TRACE("nq=" + std::to_string(cs.nq) + " prefix=" + std::to_string(cs.prefix) +
                 " pool=" + std::to_string(cs.pool));
    const int64_t nk = cs.prefix + cs.nq;
    // sd 2 makes the softmax peaked, so columns differ by orders of magnitude.
    auto q = randn(size_t(cs.nq * cs.hq * cs.d), rng, 2.f);
    auto k = randn(size_t(nk * cs.hkv * cs.d), rng, 1.f);
    auto v = randn(size_t(nk * cs.hkv * cs.d), rng, 1.f);
    std::vector<float> o(q.size()), lse(size_t(cs.hq * cs.nq));
    auto qv = TensorView::make(q.data(), DType::kF32, {cs.nq, cs.hq, cs.d});
    auto kv = TensorView::make(k.data(), DType::kF32, {nk, cs.hkv, cs.d});
    kernels::AttentionParams ap;
    ap.q_offset = cs.prefix;
    ASSERT_TRUE(kernels::attention_dense(
                    qv, kv, TensorView::make(v.data(), DType::kF32, {nk, cs.hkv, cs.d}),
                    TensorView::make(o.data(), DType::kF32, {cs.nq, cs.hq, cs.d}),
                    TensorView::make(lse.data(), DType::kF32, {cs.hq, cs.nq}), ap)
                    .is_ok());
    std::vector<float> out(size_t(cs.hkv * nk), std::numeric_limits<float>::quiet_NaN());  // poison
    kernels::ImportanceParams ip;
    ip.window = cs.window;
    ip.pool = cs.pool;
    ip.q_offset = cs.prefix;
    Status st =
        kernels::kv_importance(qv, kv, TensorView::make(lse.data(), DType::kF32, {cs.hq, cs.nq}),
                               ip, TensorView::make(out.data(), DType::kF32, {cs.hkv, nk}));
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    const auto ref =
        brute_force(q, k, cs.nq, nk, cs.hq, cs.hkv, cs.d, cs.prefix, cs.window, cs.pool);
    double max_rel = 0, total = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_TRUE(std::isfinite(out[i])) << "element " << i << " unwritten or not finite";
      max_rel = std::max(max_rel, std::fabs(out[i] - ref[i]) / (ref[i] + 1e-6));
      total += ref[i];
    }
    EXPECT_LT(max_rel, 2e-4);
    // Every window row's softmax sums to 1, so unpooled columns add up to rows x heads.
    if (cs.pool == 1)
      EXPECT_NEAR(total, double(std::min<int64_t>(cs.window, cs.nq) * cs.hq), 1e-3 * total);
  }
}

TEST(KvImportance, RejectsBadParams) {
  std::vector<float> q(4 * 2 * 8, 1.f), k(4 * 1 * 8, 1.f), lse(2 * 4, 0.f), out(4, 0.f);
  auto qv = TensorView::make(q.data(), DType::kF32, {4, 2, 8});
  auto kv = TensorView::make(k.data(), DType::kF32, {4, 1, 8});
  auto lv = TensorView::make(lse.data(), DType::kF32, {2, 4});
  auto ov = TensorView::make(out.data(), DType::kF32, {1, 4});
  kernels::ImportanceParams ip;
  ip.pool = 4;
  Status st = kernels::kv_importance(qv, kv, lv, ip, ov);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("pool"), std::string::npos) << st.message();
  ip.pool = 7;
  ip.window = 0;
  EXPECT_NE(kernels::kv_importance(qv, kv, lv, ip, ov).message().find("window"), std::string::npos);
  ip.window = 4;
  auto bad_lse = TensorView::make(lse.data(), DType::kF32, {4, 2});
  EXPECT_NE(kernels::kv_importance(qv, kv, bad_lse, ip, ov).message().find("lse"),
            std::string::npos);
  // head_dim 0: no scores to take (the CUDA kernel divided its lanes by it).
  const Status d0 = kernels::kv_importance(TensorView::make(q.data(), DType::kF32, {4, 2, 0}),
                                           TensorView::make(k.data(), DType::kF32, {4, 1, 0}),
                                           lv, ip, ov);
  EXPECT_EQ(d0.code(), Code::kInvalidArgument);
  EXPECT_NE(d0.message().find("head_dim"), std::string::npos) << d0.message();
  EXPECT_TRUE(kernels::kv_importance(qv, kv, lv, ip, ov).is_ok());
}

using testing::tiny_config;

// The forward hands each layer's own q, k and LSE to the kernel: unpooled columns of every KV
// head must add up to window x group (softmax rows sum to 1); a wrong layer's q or LSE breaks it.
TEST(KvImportance, PrefillForwardFillsPerLayerScores) {
  const uint64_t seed = fresh_seed();
  auto m = model::Model::synthetic(tiny_config(), seed);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  std::mt19937_64 rng(seed + 1);
  std::vector<int32_t> toks(200);
  for (auto& t : toks) t = int32_t(rng() % 101);
  model::PrefillOptions opt;
  opt.importance_window = 32;
  opt.importance_pool = 1;
  opt.chunk = 64;
  auto r = model::prefill(m.value(), toks, opt);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->importance.size(), 2u);
  for (int l = 0; l < 2; ++l) {
    const auto& imp = r->importance[size_t(l)];
    ASSERT_EQ(imp.size(), size_t(2 * 200));
    for (int g = 0; g < 2; ++g) {
      double sum = 0;
      for (int j = 0; j < 200; ++j) {
        ASSERT_GE(imp[size_t(g * 200 + j)], 0.f);
        sum += imp[size_t(g * 200 + j)];
      }
      EXPECT_NEAR(sum, 32.0 * 2, 1e-3) << "layer " << l << " kv head " << g;
    }
  }
  // A continuation (extend) scores its own window against the whole cache.
  model::PrefillOptions opt2 = opt;
  opt2.importance_window = 8;
  std::vector<int32_t> more(10, 7);
  ASSERT_TRUE(model::extend(m.value(), more, opt2, &r.value()).is_ok());
  ASSERT_EQ(r->importance[0].size(), size_t(2 * 210));
  double sum = 0;
  for (int j = 0; j < 210; ++j) sum += r->importance[0][size_t(j)];
  EXPECT_NEAR(sum, 8.0 * 2, 1e-3);
}

}  // namespace
}  // namespace sf
