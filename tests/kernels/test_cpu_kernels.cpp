// CPU kernels against straightforward double-precision references on fresh random inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/api.h"
#include "kernels/cpu/cpu_ops.h"
#include "tests/common/test_seed.h"
#include "tests/common/nan_max.h"

namespace sf {
namespace {

using testing::fresh_seed;
std::vector<float> randn(size_t n, std::mt19937_64& rng, float sd = 1.f) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Reference: exact softmax in double, causal with q_offset, GQA by index.
void attention_ref(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v, int nq,
                   int nk, int hq, int hkv, int d, int64_t q_off, std::vector<double>& out, std::vector<double>& lse) {
  out.assign(size_t(nq) * hq * d, 0);
  lse.assign(size_t(hq) * nq, 0);
  const double scale = 1.0 / std::sqrt(double(d));
  for (int h = 0; h < hq; ++h) {
    const int kh = h / (hq / hkv);
    for (int i = 0; i < nq; ++i) {
      const int64_t lim = std::min<int64_t>(nk, q_off + i + 1);
      std::vector<double> s(static_cast<size_t>(lim));
      double m = -1e300;
      for (int64_t j = 0; j < lim; ++j) {
        double acc = 0;
        for (int c = 0; c < d; ++c) acc += double(q[(size_t(i) * hq + h) * d + c]) * k[(size_t(j) * hkv + kh) * d + c];
        s[size_t(j)] = acc * scale;
        m = std::max(m, s[size_t(j)]);
      }
      double l = 0;
      for (auto& x : s) l += (x = std::exp(x - m));
      for (int64_t j = 0; j < lim; ++j)
        for (int c = 0; c < d; ++c) out[(size_t(i) * hq + h) * d + c] += s[size_t(j)] / l * v[(size_t(j) * hkv + kh) * d + c];
      lse[size_t(h) * nq + i] = m + std::log(l);
    }
  }
}

TEST(CpuKernels, DenseAttentionMatchesReference) {
  std::mt19937_64 rng(fresh_seed());
  struct Case { int nq, nk, hq, hkv, d; };
  for (Case c : {Case{100, 100, 4, 2, 64}, Case{37, 170, 8, 2, 128}, Case{1, 65, 3, 1, 64}, Case{129, 129, 9, 3, 64}}) {
    const int64_t q_off = c.nk - c.nq;
    auto q = randn(size_t(c.nq) * c.hq * c.d, rng), k = randn(size_t(c.nk) * c.hkv * c.d, rng),
         v = randn(size_t(c.nk) * c.hkv * c.d, rng);
    std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN()),
        lse(size_t(c.hq) * c.nq, std::numeric_limits<float>::quiet_NaN());
    kernels::AttentionParams p;
    p.q_offset = q_off;
    auto st = kernels::attention_dense(TensorView::make(q.data(), DType::kF32, {c.nq, c.hq, c.d}),
                                       TensorView::make(k.data(), DType::kF32, {c.nk, c.hkv, c.d}),
                                       TensorView::make(v.data(), DType::kF32, {c.nk, c.hkv, c.d}),
                                       TensorView::make(out.data(), DType::kF32, {c.nq, c.hq, c.d}),
                                       TensorView::make(lse.data(), DType::kF32, {c.hq, c.nq}), p);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    std::vector<double> ro, rl;
    attention_ref(q, k, v, c.nq, c.nk, c.hq, c.hkv, c.d, q_off, ro, rl);
    double max_o = 0, max_l = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_FALSE(std::isnan(out[i])) << "unwritten output at " << i;
      max_o = testing::nan_max(max_o, std::fabs(out[i] - ro[i]));
    }
    for (size_t i = 0; i < lse.size(); ++i) max_l = testing::nan_max(max_l, std::fabs(lse[i] - rl[i]));
    // fp32 dot products of length <= 128 and sums of <= 170 terms: ~1e-5 absolute.
    EXPECT_LT(max_o, 2e-5) << c.nq << "x" << c.nk;
    EXPECT_LT(max_l, 2e-5) << c.nq << "x" << c.nk;
  }
}

TEST(CpuKernels, RmsNormAndSwiglu) {
  std::mt19937_64 rng(fresh_seed());
  const int n = 7, h = 300;
  auto x = randn(size_t(n) * h, rng, 3.f), w = randn(size_t(h), rng);
  std::vector<float> out(x.size());
  ASSERT_TRUE(kernels::rms_norm(TensorView::make(x.data(), DType::kF32, {n, h}), TensorView::make(w.data(), DType::kF32, {h}),
                                1e-5f, TensorView::make(out.data(), DType::kF32, {n, h})).is_ok());
  for (int i = 0; i < n; ++i) {
    double ss = 0;
    for (int j = 0; j < h; ++j) ss += double(x[size_t(i * h + j)]) * x[size_t(i * h + j)];
    const double inv = 1 / std::sqrt(ss / h + 1e-5);
    for (int j = 0; j < h; ++j) EXPECT_NEAR(out[size_t(i * h + j)], x[size_t(i * h + j)] * inv * w[size_t(j)], 1e-5);
  }
  auto g = randn(50, rng, 4.f), u = randn(50, rng);
  std::vector<float> o(50);
  ASSERT_TRUE(kernels::swiglu(TensorView::make(g.data(), DType::kF32, {50}), TensorView::make(u.data(), DType::kF32, {50}),
                              TensorView::make(o.data(), DType::kF32, {50})).is_ok());
  for (int i = 0; i < 50; ++i) EXPECT_NEAR(o[size_t(i)], g[size_t(i)] / (1 + std::exp(-double(g[size_t(i)]))) * u[size_t(i)], 1e-5);
}

// Adjacent-pair rotation on permuted channels equals rotate-half on the originals.
TEST(CpuKernels, RopeStylesAgreeUnderPermutation) {
  std::mt19937_64 rng(fresh_seed());
  const int n = 20, heads = 3, d = 64;
  auto x = randn(size_t(n) * heads * d, rng);
  std::vector<float> perm(x.size());
  for (int t = 0; t < n * heads; ++t)
    for (int i = 0; i < d / 2; ++i) {
      perm[size_t(t * d + 2 * i)] = x[size_t(t * d + i)];
      perm[size_t(t * d + 2 * i + 1)] = x[size_t(t * d + i + d / 2)];
    }
  std::vector<int32_t> pos(n);
  for (int i = 0; i < n; ++i) pos[size_t(i)] = 1000 * i + 3;
  kernels::RopeParams half, pairs;
  half.neox = true;
  half.theta = pairs.theta = 500000.f;
  half.scaling_factor = pairs.scaling_factor = 8.f;  // Llama-3 scaling path
  ASSERT_TRUE(kernels::rope(TensorView::make(x.data(), DType::kF32, {n, heads, d}), pos.data(), half).is_ok());
  ASSERT_TRUE(kernels::rope(TensorView::make(perm.data(), DType::kF32, {n, heads, d}), pos.data(), pairs).is_ok());
  for (int t = 0; t < n * heads; ++t)
    for (int i = 0; i < d / 2; ++i) {
      EXPECT_NEAR(perm[size_t(t * d + 2 * i)], x[size_t(t * d + i)], 1e-5);
      EXPECT_NEAR(perm[size_t(t * d + 2 * i + 1)], x[size_t(t * d + i + d / 2)], 1e-5);
    }
}

TEST(CpuKernels, Llama3InvFreqBands) {
  kernels::RopeParams p;
  p.theta = 500000.f;
  p.scaling_factor = 8.f;
  p.low_freq_factor = 1.f;
  p.high_freq_factor = 4.f;
  p.original_max_pos = 8192;
  std::vector<float> f(64);
  kernels::cpu::rope_inv_freq(p, 128, f.data());
  const double kPi = 3.14159265358979323846;
  for (int i = 0; i < 64; ++i) {
    const double base = std::pow(500000.0, -2.0 * i / 128);
    const double wl = 2 * kPi / base;
    if (wl < 8192 / 4.0) EXPECT_NEAR(f[size_t(i)], base, base * 1e-6);            // high freq: kept
    else if (wl > 8192 / 1.0) EXPECT_NEAR(f[size_t(i)], base / 8, base * 1e-6);   // low freq: / factor
    else EXPECT_TRUE(f[size_t(i)] < base && f[size_t(i)] > base / 8);              // blended
  }
}

TEST(CpuKernels, ValidationNamesTheProblem) {
  std::vector<float> a(12), b(10), c(12);
  auto st = kernels::swiglu(TensorView::make(a.data(), DType::kF32, {12}), TensorView::make(b.data(), DType::kF32, {10}),
                            TensorView::make(c.data(), DType::kF32, {12}));
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("swiglu"), std::string::npos);
  kernels::Stream gpu{Device::kCuda, nullptr};
  EXPECT_FALSE(kernels::swiglu(TensorView::make(a.data(), DType::kF32, {12}), TensorView::make(a.data(), DType::kF32, {12}),
                               TensorView::make(c.data(), DType::kF32, {12}), gpu).is_ok());
  // linear: a bias the kernels read as F32 must be F32 (a BF16 one of `out` elements was read
  // past its end), and y must not alias x (the threads read x while others write y).
  std::vector<float> x(2 * 3, 1.f), w(4 * 3, 1.f), y(2 * 4), bias(4, 1.f);
  std::vector<uint16_t> bias16(4);
  const TensorView tx = TensorView::make(x.data(), DType::kF32, {2, 3}),
                   tw = TensorView::make(w.data(), DType::kF32, {4, 3});
  EXPECT_TRUE(kernels::linear(tx, tw, TensorView::make(bias.data(), DType::kF32, {4}),
                              TensorView::make(y.data(), DType::kF32, {2, 4})).is_ok());
  EXPECT_EQ(y[0], 4.f);
  st = kernels::linear(tx, tw, TensorView::make(bias16.data(), DType::kBF16, {4}),
                       TensorView::make(y.data(), DType::kF32, {2, 4}));
  EXPECT_NE(st.message().find("bias must have out F32 elements"), std::string::npos) << st.to_string();
  std::vector<float> xy(2 * 4, 1.f);  // x [2, 3] in its first 6, y [2, 4] over all 8
  st = kernels::linear(TensorView::make(xy.data(), DType::kF32, {2, 3}), tw, TensorView{},
                       TensorView::make(xy.data(), DType::kF32, {2, 4}));
  EXPECT_NE(st.message().find("must not overlap"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace sf

namespace sf {
namespace {

// F32 -> BF16/F16 -> F32 round trips against the scalar converters in common/dtype.h.
TEST(CpuKernels, CastRoundsToNearestEven) {
  std::mt19937_64 rng(fresh_seed());
  auto x = randn(1000, rng, 100.f);
  x[0] = 1.00390625f;  // exactly halfway between two bf16 values: ties to even (1.0)
  std::vector<uint16_t> b(x.size()), h(x.size());
  ASSERT_TRUE(kernels::cast(TensorView::make(x.data(), DType::kF32, {1000}),
                            TensorView::make(b.data(), DType::kBF16, {1000})).is_ok());
  ASSERT_TRUE(kernels::cast(TensorView::make(x.data(), DType::kF32, {1000}),
                            TensorView::make(h.data(), DType::kF16, {1000})).is_ok());
  EXPECT_EQ(bf16_to_f32(b[0]), 1.f);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(b[i], f32_to_bf16(x[i])) << i;
    EXPECT_EQ(h[i], f32_to_f16(x[i])) << i;
    EXPECT_LE(std::fabs(bf16_to_f32(b[i]) - x[i]), std::fabs(x[i]) * (1.f / 256)) << i;
  }
}

}  // namespace
}  // namespace sf

namespace sf {
namespace {

// gemv against a double-precision dot product, F32 and BF16 weights (the BF16 bits widened
// exactly on both sides, so only the summation order differs: 1e-5 of the row's sum of |w x|).
// in = 577 leaves a tail after the 8-wide partial sums; a padded row stride checks ldw.
TEST(CpuKernels, GemvMatchesDoubleReference) {
  std::mt19937_64 rng(fresh_seed());
  for (const int64_t in : {int64_t(576), int64_t(577)})
    for (const DType wdt : {DType::kF32, DType::kBF16}) {
      const int64_t out = 37, ldw = in + 8;
      const auto x = randn(size_t(in), rng), w32 = randn(size_t(out * ldw), rng),
                 b = randn(size_t(out), rng);
      std::vector<uint16_t> w16(w32.size());
      std::vector<float> wf(w32.size());  // the values the kernel reads
      for (size_t i = 0; i < w32.size(); ++i) {
        w16[i] = f32_to_bf16(w32[i]);
        wf[i] = wdt == DType::kBF16 ? bf16_to_f32(w16[i]) : w32[i];
      }
      TensorView wv = wdt == DType::kBF16 ? TensorView::make(w16.data(), DType::kBF16, {out, ldw})
                                          : TensorView::make(const_cast<float*>(w32.data()), DType::kF32, {out, ldw});
      wv.shape[1] = in;  // rows of ldw elements, in of them used
      std::vector<float> y(size_t(out), std::nanf(""));
      ASSERT_TRUE(kernels::gemv(TensorView::make(const_cast<float*>(x.data()), DType::kF32, {1, in}), wv,
                                TensorView::make(const_cast<float*>(b.data()), DType::kF32, {out}),
                                TensorView::make(y.data(), DType::kF32, {1, out}))
                      .is_ok());
      for (int64_t j = 0; j < out; ++j) {
        double ref = b[size_t(j)], mag = std::fabs(b[size_t(j)]);
        for (int64_t c = 0; c < in; ++c) {
          ref += double(wf[size_t(j * ldw + c)]) * x[size_t(c)];
          mag += std::fabs(double(wf[size_t(j * ldw + c)]) * x[size_t(c)]);
        }
        ASSERT_TRUE(std::isfinite(y[size_t(j)]));
        EXPECT_NEAR(y[size_t(j)], ref, 1e-5 * mag) << dtype_name(wdt) << " in " << in << " row " << j;
      }
    }
}

// Several rows: row r of y is gemv() of x's row r alone, bit for bit (the verification pass's
// linears are the decode step's), for gemv, gemv_parts and gemv_swiglu.
TEST(CpuKernels, GemvRowsAreOneRowGemvs) {
  std::mt19937_64 rng(fresh_seed());
  const int64_t n = 5, in = 577, out = 41;
  for (const DType wdt : {DType::kF32, DType::kBF16}) {
    const auto x = randn(size_t(n * in), rng), w32 = randn(size_t(out * in), rng),
               u32 = randn(size_t(out * in), rng), b = randn(size_t(out), rng);
    std::vector<uint16_t> w16(w32.size()), u16(u32.size());
    for (size_t i = 0; i < w32.size(); ++i) w16[i] = f32_to_bf16(w32[i]), u16[i] = f32_to_bf16(u32[i]);
    auto wv = [&](std::vector<float>& f, std::vector<uint16_t>& h) {
      return wdt == DType::kBF16 ? TensorView::make(h.data(), DType::kBF16, {out, in})
                                 : TensorView::make(f.data(), DType::kF32, {out, in});
    };
    auto w32m = w32, u32m = u32;
    const TensorView w = wv(w32m, w16), u = wv(u32m, u16);
    const TensorView bias = TensorView::make(const_cast<float*>(b.data()), DType::kF32, {out});
    std::vector<float> y(static_cast<size_t>(n * out)), ys(y.size()), one(static_cast<size_t>(out));
    ASSERT_TRUE(kernels::gemv(TensorView::make(const_cast<float*>(x.data()), DType::kF32, {n, in}), w,
                              bias, TensorView::make(y.data(), DType::kF32, {n, out}))
                    .is_ok());
    ASSERT_TRUE(kernels::gemv_swiglu(TensorView::make(const_cast<float*>(x.data()), DType::kF32, {n, in}),
                                     w, u, TensorView::make(ys.data(), DType::kF32, {n, out}))
                    .is_ok());
    for (int64_t r = 0; r < n; ++r) {
      const TensorView xr = TensorView::make(const_cast<float*>(x.data()) + r * in, DType::kF32, {1, in});
      ASSERT_TRUE(kernels::gemv(xr, w, bias, TensorView::make(one.data(), DType::kF32, {1, out})).is_ok());
      for (int64_t j = 0; j < out; ++j)
        ASSERT_EQ(y[size_t(r * out + j)], one[size_t(j)]) << dtype_name(wdt) << " row " << r << " out " << j;
      ASSERT_TRUE(kernels::gemv_swiglu(xr, w, u, TensorView::make(one.data(), DType::kF32, {1, out})).is_ok());
      for (int64_t j = 0; j < out; ++j)
        ASSERT_EQ(ys[size_t(r * out + j)], one[size_t(j)]) << dtype_name(wdt) << " swiglu row " << r;
    }
  }
}

TEST(CpuKernels, GemvRefusesWhatItDoesNotTake) {
  std::vector<float> x(16), w(64), y(8);
  std::vector<uint16_t> h(64);
  const TensorView none;
  // Two rows of x and one of y; two of each with x's rows padded (several rows must be dense).
  std::vector<float> y2(16);
  auto st = kernels::gemv(TensorView::make(x.data(), DType::kF32, {2, 8}), TensorView::make(w.data(), DType::kF32, {8, 8}),
                          none, TensorView::make(y.data(), DType::kF32, {1, 8}));
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("gemv"), std::string::npos);
  TensorView padded = TensorView::make(x.data(), DType::kF32, {2, 8});
  padded.shape[1] = 7;  // rows 8 apart, 7 used
  EXPECT_EQ(kernels::gemv(padded, TensorView::make(w.data(), DType::kF32, {8, 7}), none,
                          TensorView::make(y2.data(), DType::kF32, {2, 8}))
                .code(),
            Code::kInvalidArgument);
  // F16 weights, and an output that does not match w's rows.
  EXPECT_EQ(kernels::gemv(TensorView::make(x.data(), DType::kF32, {1, 8}), TensorView::make(h.data(), DType::kF16, {8, 8}),
                          none, TensorView::make(y.data(), DType::kF32, {1, 8}))
                .code(),
            Code::kInvalidArgument);
  EXPECT_EQ(kernels::gemv(TensorView::make(x.data(), DType::kF32, {1, 8}), TensorView::make(w.data(), DType::kF32, {8, 8}),
                          none, TensorView::make(y.data(), DType::kF32, {1, 7}))
                .code(),
            Code::kInvalidArgument);
}

// The decode step's joined ops on the CPU are their parts in sequence, to the bit (the CUDA
// tests hold the device's joined ops to these references with the joined ops' own bounds, so a
// CPU version that computed them another way would move those bounds): gemv_parts is gemv per
// part, gemv_swiglu is silu(gemv) * gemv, add_rms_norm is the add then rms_norm. And the API
// refuses, on every backend (the checks are api.cpp's): 0 or more than kGemvMaxParts parts,
// mixed weight dtypes, an up weight of another shape or row stride, y overlapping x or another
// part's y, a delta of another size or overlapping x.
TEST(CpuKernels, JoinedDecodeOpsAreTheirParts) {
  std::mt19937_64 rng(fresh_seed());
  const int64_t in = 40, out = 12;
  const auto x = randn(size_t(in), rng), wg = randn(size_t(out * in), rng),
             wu = randn(size_t(out * in), rng), b = randn(size_t(out), rng);
  auto row = [](const std::vector<float>& v, int64_t n) {
    return TensorView::make(const_cast<float*>(v.data()), DType::kF32, {1, n});
  };
  auto mat = [&](const std::vector<float>& v) {
    return TensorView::make(const_cast<float*>(v.data()), DType::kF32, {out, in});
  };
  const TensorView none, bias = TensorView::make(const_cast<float*>(b.data()), DType::kF32, {out});
  const size_t no = static_cast<size_t>(out);
  std::vector<float> y1(no), y2(no), g(no), u(no), s(no);
  const kernels::GemvPart parts[2] = {{mat(wg), bias, row(y1, out)}, {mat(wu), none, row(y2, out)}};
  ASSERT_TRUE(kernels::gemv_parts(row(x, in), parts, 2).is_ok());
  ASSERT_TRUE(kernels::gemv(row(x, in), mat(wg), bias, row(g, out)).is_ok());
  ASSERT_TRUE(kernels::gemv(row(x, in), mat(wu), none, row(u, out)).is_ok());
  EXPECT_EQ(y1, g);
  EXPECT_EQ(y2, u);
  ASSERT_TRUE(kernels::gemv(row(x, in), mat(wg), none, row(g, out)).is_ok());
  ASSERT_TRUE(kernels::gemv_swiglu(row(x, in), mat(wg), mat(wu), row(s, out)).is_ok());
  for (int64_t j = 0; j < out; ++j) {
    const float gj = g[size_t(j)];
    EXPECT_EQ(s[size_t(j)], gj / (1.f + std::exp(-gj)) * u[size_t(j)]) << j;
  }
  std::vector<float> xa = x, xb = x, oa(static_cast<size_t>(in)), ob(static_cast<size_t>(in));
  const auto d = randn(size_t(in), rng), nw = randn(size_t(in), rng);
  const TensorView nwv = TensorView::make(const_cast<float*>(nw.data()), DType::kF32, {in});
  ASSERT_TRUE(kernels::add_inplace(row(xa, in), row(d, in)).is_ok());
  ASSERT_TRUE(kernels::rms_norm(row(xa, in), nwv, 1e-5f, row(oa, in)).is_ok());
  ASSERT_TRUE(kernels::add_rms_norm(row(xb, in), row(d, in), nwv, 1e-5f, row(ob, in)).is_ok());
  EXPECT_EQ(xa, xb);
  EXPECT_EQ(oa, ob);

  const kernels::GemvPart four[4] = {parts[0], parts[0], parts[0], parts[0]};
  EXPECT_EQ(kernels::gemv_parts(row(x, in), parts, 0).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(kernels::gemv_parts(row(x, in), four, 4).code(), Code::kInvalidArgument);
  std::vector<uint16_t> h(size_t(out * in));
  const kernels::GemvPart mixed[2] = {parts[0],
                                      {TensorView::make(h.data(), DType::kBF16, {out, in}), none, row(y2, out)}};
  EXPECT_EQ(kernels::gemv_parts(row(x, in), mixed, 2).code(), Code::kInvalidArgument);
  EXPECT_EQ(kernels::gemv_swiglu(row(x, in), mat(wg), TensorView::make(const_cast<float*>(wu.data()), DType::kF32,
                                                                       {out - 1, in}),
                                 row(s, out))
                .code(),
            Code::kInvalidArgument);
  std::vector<float> wpad(static_cast<size_t>(out * (in + 4)));
  TensorView wu_padded = TensorView::make(wpad.data(), DType::kF32, {out, in + 4});
  wu_padded.shape[1] = in;  // the same shape as w_gate, another row stride
  EXPECT_EQ(kernels::gemv_swiglu(row(x, in), mat(wg), wu_padded, row(s, out)).code(), Code::kInvalidArgument);
  EXPECT_EQ(kernels::add_rms_norm(row(xb, in), row(d, in - 1), nwv, 1e-5f, row(ob, in)).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(kernels::add_rms_norm(row(xb, in), row(xb, in), nwv, 1e-5f, row(ob, in)).code(),
            Code::kInvalidArgument);
  // y over x (in place), and two parts writing one y.
  std::vector<float> big(static_cast<size_t>(std::max(in, out)));
  const TensorView x_as_y = TensorView::make(big.data(), DType::kF32, {1, out});
  const TensorView x_big = TensorView::make(big.data(), DType::kF32, {1, in});
  EXPECT_EQ(kernels::gemv(x_big, mat(wg), none, x_as_y).code(), Code::kInvalidArgument);
  EXPECT_EQ(kernels::gemv_swiglu(x_big, mat(wg), mat(wu), x_as_y).code(), Code::kInvalidArgument);
  const kernels::GemvPart same_y[2] = {{mat(wg), none, row(y1, out)}, {mat(wu), none, row(y1, out)}};
  EXPECT_EQ(kernels::gemv_parts(row(x, in), same_y, 2).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace sf
