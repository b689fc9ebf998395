// KV encodings (kvstore/kv_quant.h): byte counts, the error each encoding allows per group,
// that groups are what KIVI's layout says (keys per channel per 64 rows, values per row), the
// int4 packing, and clear errors for what cannot be encoded or decoded.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>
#include <algorithm>
#include <cstring>
#include <limits>

#include "common/dtype.h"
#include "kvstore/kv_quant.h"

namespace sf {
namespace {

using kvstore::KvEncoding;

std::vector<float> random_rows(int64_t n, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> x(size_t(n * d));
  for (int64_t r = 0; r < n; ++r)
    for (int c = 0; c < d; ++c)  // channel 3 an outlier channel, as post-RoPE keys have;
      // channel 7 far from 0 with a narrow range (F16's step there is 0.25)
      x[size_t(r * d + c)] = g(rng) * (c == 3 ? 40.f : 1.f) + (c == 5 ? 7.f : c == 7 ? 300.f : 0.f);
  return x;
}

TEST(KvQuant, ParsesNamesAndRefusesOthers) {
  for (auto e : {KvEncoding::kF32, KvEncoding::kBF16, KvEncoding::kInt8, KvEncoding::kInt4})
    EXPECT_EQ(kvstore::kv_encoding_parse(kvstore::kv_encoding_name(e)).value(), e);
  auto bad = kvstore::kv_encoding_parse("fp8");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'fp8' is not f32, bf16, int8 or int4"), std::string::npos);
}

TEST(KvQuant, TwoTierNamesParseNarrowerLowOnly) {
  auto one = kvstore::kv_encodings_parse("int8");
  ASSERT_TRUE(one.is_ok());
  EXPECT_EQ(one->high, KvEncoding::kInt8);
  EXPECT_FALSE(one->low.has_value());
  auto two = kvstore::kv_encodings_parse("int8+int4");
  ASSERT_TRUE(two.is_ok()) << two.status().to_string();
  EXPECT_EQ(two->high, KvEncoding::kInt8);
  EXPECT_EQ(two->low, KvEncoding::kInt4);
  EXPECT_EQ(kvstore::kv_encodings_name(two.value()), "int8+int4");
  EXPECT_TRUE(kvstore::kv_encodings_parse("bf16+int8").is_ok());
  for (const char* s : {"int4+int8", "int8+int8", "int8+fp8", "int8+", "+int4"}) {
    auto r = kvstore::kv_encodings_parse(s);
    EXPECT_FALSE(r.is_ok()) << s;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << s;
  }
  EXPECT_NE(kvstore::kv_encodings_parse("int4+int8").status().message().find("narrower"),
            std::string::npos);
}

TEST(KvQuant, AutoIsTheForwardsDtypeAndOnlyAlone) {
  auto dev = kvstore::kv_encodings_parse("auto", DType::kBF16);
  ASSERT_TRUE(dev.is_ok());
  EXPECT_EQ(dev->high, KvEncoding::kBF16);
  EXPECT_FALSE(dev->low.has_value());
  auto cpu = kvstore::kv_encodings_parse("auto", DType::kF32);
  ASSERT_TRUE(cpu.is_ok());
  EXPECT_EQ(cpu->high, KvEncoding::kF32);
  // Any other name is the plain parser's, whatever the forward's dtype.
  EXPECT_EQ(kvstore::kv_encodings_parse("int8+int4", DType::kBF16)->low, KvEncoding::kInt4);
  EXPECT_EQ(kvstore::kv_encodings_parse("f32", DType::kBF16)->high, KvEncoding::kF32);
  for (const char* s : {"auto+int4", "int8+auto", "Auto"}) {
    auto r = kvstore::kv_encodings_parse(s, DType::kBF16);
    EXPECT_FALSE(r.is_ok()) << s;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << s;
  }
  // The batch line's parser (one argument) has no forward to take a dtype from.
  EXPECT_FALSE(kvstore::kv_encodings_parse("auto").is_ok());
}

TEST(KvQuant, EncodedBytesCountCodesScalesAndZeros) {
  // 100 rows of 64 channels: K and V each 6400 elements; keys have 2 blocks x 64 channel groups,
  // values 100 row groups; each group an F16 scale and zero (4 bytes).
  EXPECT_EQ(kvstore::kv_encoded_bytes(KvEncoding::kF32, 100, 64), 2 * 6400 * 4);
  EXPECT_EQ(kvstore::kv_encoded_bytes(KvEncoding::kBF16, 100, 64), 2 * 6400 * 2);
  EXPECT_EQ(kvstore::kv_encoded_bytes(KvEncoding::kInt8, 100, 64), 2 * 6400 + (128 + 100) * 4);
  EXPECT_EQ(kvstore::kv_encoded_bytes(KvEncoding::kInt4, 100, 64), 6400 + (128 + 100) * 4);
  // And they are the sizes kv_encode produces.
  const auto x = random_rows(100, 64, 7);
  for (auto e : {KvEncoding::kF32, KvEncoding::kBF16, KvEncoding::kInt8, KvEncoding::kInt4}) {
    auto k = kvstore::kv_encode(e, true, x.data(), 100, 64).value();
    auto v = kvstore::kv_encode(e, false, x.data(), 100, 64).value();
    EXPECT_EQ(int64_t(k.data.size() + v.data.size() +
                      2 * (k.scale.size() + k.zero.size() + v.scale.size() + v.zero.size())),
              kvstore::kv_encoded_bytes(e, 100, 64))
        << kvstore::kv_encoding_name(e);
  }
}

// Every element within half a step of its group (step = (max - min) / levels, widened by the
// F16 rounding of the zero and scale); bf16 within its relative rounding; f32 exact.
TEST(KvQuant, ErrorStaysWithinHalfAStepOfItsOwnGroup) {
  const int64_t n = 150;  // 2 full key blocks and a partial one
  const int d = 16;
  const auto x = random_rows(n, d, 11);
  for (auto e : {KvEncoding::kF32, KvEncoding::kBF16, KvEncoding::kInt8, KvEncoding::kInt4})
    for (bool keys : {true, false}) {
      std::vector<float> y = x;
      ASSERT_TRUE(kvstore::kv_round_trip(e, keys, y.data(), n, d).is_ok());
      double worst = 0;  // error / allowed, over every element
      for (int64_t r = 0; r < n; ++r)
        for (int c = 0; c < d; ++c) {
          const float xi = x[size_t(r * d + c)], err = std::fabs(y[size_t(r * d + c)] - xi);
          double allowed = 0;
          if (e == KvEncoding::kBF16) allowed = std::fabs(xi) * 0x1p-8;
          if (e == KvEncoding::kInt8 || e == KvEncoding::kInt4) {
            float mn = 1e30f, mx = -1e30f;  // the group, recomputed here
            if (keys) {
              const int64_t b0 = r / 64 * 64, b1 = std::min<int64_t>(n, b0 + 64);
              for (int64_t t = b0; t < b1; ++t) {
                mn = std::min(mn, x[size_t(t * d + c)]);
                mx = std::max(mx, x[size_t(t * d + c)]);
              }
            } else {
              for (int cc = 0; cc < d; ++cc) {
                mn = std::min(mn, x[size_t(r * d + cc)]);
                mx = std::max(mx, x[size_t(r * d + cc)]);
              }
            }
            const double L = e == KvEncoding::kInt8 ? 255 : 15;
            allowed = 0.5 * (mx - mn + std::fabs(mn) * 0x1p-10) / L * (1 + 0x1p-10) + 1e-6;
          }
          if (e == KvEncoding::kF32) {
            ASSERT_EQ(err, 0.f);
          } else {
            worst = std::max(worst, double(err) / allowed);
          }
        }
      EXPECT_LE(worst, 1.0) << kvstore::kv_encoding_name(e) << (keys ? " keys" : " values");
      if (e == KvEncoding::kInt4) EXPECT_GT(worst, 0.5);  // the bound is not vacuous
    }
}

// The groups are the layout's: keys grouped by channel, so an outlier channel costs the others
// nothing; values grouped by row, so an outlier row costs the other rows nothing.
TEST(KvQuant, AnOutlierOnlyCoarsensItsOwnGroup) {
  const int64_t n = 64;
  const int d = 16;
  // Every row and every channel holds all of 0, 0.01, ..., 0.15: int4's 16 levels exactly.
  std::vector<float> x(size_t(n * d));
  for (int64_t r = 0; r < n; ++r)
    for (int c = 0; c < d; ++c) x[size_t(r * d + c)] = 0.01f * float((r + c) % 16);
  std::vector<float> k = x, v = x;
  for (int64_t r = 0; r < n; ++r) k[size_t(r * d + 2)] = 500.f * float(r % 2);  // channel 2
  for (int c = 0; c < d; ++c) v[size_t(9 * d + c)] = -300.f * float(c % 2);     // row 9
  std::vector<float> k2 = k, v2 = v;
  ASSERT_TRUE(kvstore::kv_round_trip(KvEncoding::kInt4, true, k2.data(), n, d).is_ok());
  ASSERT_TRUE(kvstore::kv_round_trip(KvEncoding::kInt4, false, v2.data(), n, d).is_ok());
  for (int64_t r = 0; r < n; ++r)
    for (int c = 0; c < d; ++c) {
      // Held to F16 precision of the 0.01 scale.
      if (c != 2) {
        EXPECT_NEAR(k2[size_t(r * d + c)], k[size_t(r * d + c)], 1e-3) << r << "," << c;
      }
      if (r != 9) {
        EXPECT_NEAR(v2[size_t(r * d + c)], v[size_t(r * d + c)], 1e-3) << r << "," << c;
      }
    }
  // The outlier channel and row themselves are two-valued: exact up to F16.
  EXPECT_NEAR(k2[size_t(1 * d + 2)], 500.f, 0.5f);
  EXPECT_NEAR(v2[size_t(9 * d + 1)], -300.f, 0.5f);
}

// The export encodes a 64-row block at a time, at its offsets: the bytes must be one whole
// call's (keys: a block is its own groups; values: a row is), for a short last block too.
TEST(KvQuant, BlockAtATimeEncodesAsOneCall) {
  const int d = 64;
  const int64_t n = 150;  // blocks of 64, 64, 22
  const std::vector<float> x = random_rows(n, d, 7);
  for (KvEncoding e : {KvEncoding::kF32, KvEncoding::kBF16, KvEncoding::kInt8, KvEncoding::kInt4})
    for (bool keys : {true, false}) {
      auto whole = kvstore::kv_encode(e, keys, x.data(), n, d);
      ASSERT_TRUE(whole.is_ok());
      const int64_t row_bytes = int64_t(whole->data.size()) / n;
      std::vector<uint8_t> data(whole->data.size(), 0xA5);
      std::vector<uint16_t> scale(whole->scale.size(), 0xBEEF), zero(whole->zero.size(), 0xBEEF);
      for (int64_t t0 = 0; t0 < n; t0 += kvstore::kKvQuantKeyRows) {
        const int64_t nt = std::min<int64_t>(kvstore::kKvQuantKeyRows, n - t0);
        const int64_t g0 = keys ? kvstore::kv_param_groups(e, true, t0, d)
                                : kvstore::kv_param_groups(e, false, t0, d);
        ASSERT_TRUE(kvstore::kv_encode_into(e, keys, x.data() + t0 * d, nt, d,
                                            data.data() + t0 * row_bytes, scale.data() + g0,
                                            zero.data() + g0)
                        .is_ok());
      }
      EXPECT_EQ(data, whole->data) << kvstore::kv_encoding_name(e) << (keys ? " keys" : " values");
      EXPECT_EQ(scale, whole->scale) << kvstore::kv_encoding_name(e);
      EXPECT_EQ(zero, whole->zero) << kvstore::kv_encoding_name(e);
    }
}

// The encoder as it was written first, one group at a time with strided reads: the reference the
// vectorizable one (channel-innermost key blocks, row-at-a-time values) must equal byte for
// byte. It follows docs/kv-format.md's rules directly: zero = min rounded down to F16, scale =
// (max - zero) / levels rounded up to F16, code = round-half-even((x - zero) / scale) clamped.
uint16_t f16_down(uint16_t h) { return h == 0x0000 ? 0x8001 : (h & 0x8000) ? h + 1 : h - 1; }
uint16_t f16_up(uint16_t h) { return h == 0x8000 ? 0x0001 : (h & 0x8000) ? h - 1 : h + 1; }
bool reference_encode(KvEncoding e, bool keys, const float* rows, int64_t n, int d,
                      std::vector<uint8_t>* data, std::vector<uint16_t>* scale,
                      std::vector<uint16_t>* zero) {
  if (e == KvEncoding::kBF16) {
    data->assign(size_t(n * d * 2), 0);
    for (int64_t i = 0; i < n * d; ++i) {
      const uint16_t h = f32_to_bf16(rows[i]);
      std::memcpy(data->data() + 2 * i, &h, 2);
    }
    return true;
  }
  const int L = e == KvEncoding::kInt8 ? 255 : 15;
  const int64_t B = kvstore::kKvQuantKeyRows, blocks = (n + B - 1) / B;
  const int64_t ng = keys ? blocks * d : n;
  data->assign(size_t(e == KvEncoding::kInt8 ? n * d : n * d / 2), 0);
  scale->assign(size_t(ng), 0);
  zero->assign(size_t(ng), 0);
  for (int64_t g = 0; g < ng; ++g) {
    int64_t first, stride, count;
    if (keys) {
      const int64_t b = g / d, c = g % d;
      first = b * B * d + c, stride = d, count = std::min<int64_t>(B, n - b * B);
    } else {
      first = g * d, stride = 1, count = d;
    }
    float mn = rows[first], mx = mn;
    bool finite = true;
    for (int64_t i = 0; i < count; ++i) {
      const float x = rows[first + i * stride];
      finite = finite && std::isfinite(x);
      mn = std::min(mn, x);
      mx = std::max(mx, x);
    }
    uint16_t zh = f32_to_f16(mn);
    if (f16_to_f32(zh) > mn) zh = f16_down(zh);
    const float z = f16_to_f32(zh);
    const float need = std::max(0.f, mx - z) / float(L);
    uint16_t sh = f32_to_f16(need);
    if (f16_to_f32(sh) < need) sh = f16_up(sh);
    const float s = f16_to_f32(sh);
    if (!finite || !std::isfinite(z) || !std::isfinite(s)) return false;
    (*zero)[size_t(g)] = zh;
    (*scale)[size_t(g)] = sh;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t idx = first + i * stride;
      const int q = std::clamp(s > 0 ? int(std::lrint((rows[idx] - z) / s)) : 0, 0, L);
      if (e == KvEncoding::kInt8) {
        (*data)[size_t(idx)] = uint8_t(q);
      } else {
        uint8_t& b = (*data)[size_t(idx / 2)];
        b = (idx & 1) ? uint8_t((b & 0x0f) | (q << 4)) : uint8_t((b & 0xf0) | q);
      }
    }
  }
  return true;
}

// The decoder as it was written first, one group at a time: zero + code * scale.
std::vector<float> reference_decode(KvEncoding e, bool keys, const kvstore::EncodedRows& in,
                                    int64_t n, int d) {
  std::vector<float> out(size_t(n * d));
  if (e == KvEncoding::kBF16) {
    for (int64_t i = 0; i < n * d; ++i) {
      uint16_t h;
      std::memcpy(&h, in.data.data() + 2 * i, 2);
      out[size_t(i)] = bf16_to_f32(h);
    }
    return out;
  }
  const int64_t B = kvstore::kKvQuantKeyRows;
  const int64_t ng = keys ? (n + B - 1) / B * d : n;
  for (int64_t g = 0; g < ng; ++g) {
    const float z = f16_to_f32(in.zero[size_t(g)]), s = f16_to_f32(in.scale[size_t(g)]);
    int64_t first, stride, count;
    if (keys)
      first = g / d * B * d + g % d, stride = d, count = std::min<int64_t>(B, n - g / d * B);
    else
      first = g * d, stride = 1, count = d;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t idx = first + i * stride;
      const int q = e == KvEncoding::kInt8 ? in.data[size_t(idx)]
                    : (idx & 1)            ? in.data[size_t(idx / 2)] >> 4
                                           : in.data[size_t(idx / 2)] & 0x0f;
      out[size_t(idx)] = z + float(q) * s;
    }
  }
  return out;
}

TEST(KvQuant, DecodeEqualsTheGroupAtATimeReferenceBitForBit) {
  std::mt19937 rng(5);
  for (const int d : {2, 12, 128})
    for (const int64_t n : {int64_t(1), int64_t(65), int64_t(130)})
      for (KvEncoding e : {KvEncoding::kBF16, KvEncoding::kInt8, KvEncoding::kInt4})
        for (bool keys : {true, false}) {
          const std::vector<float> x = random_rows(n, d, uint32_t(d + n));
          auto enc = kvstore::kv_encode(e, keys, x.data(), n, d);
          ASSERT_TRUE(enc.is_ok());
          // Arbitrary codes too (every byte value), not only those an encoder writes.
          for (size_t i = 0; i < enc->data.size(); i += 3) enc->data[i] = uint8_t(rng());
          std::vector<float> got(size_t(n * d), -7.f);
          ASSERT_TRUE(kvstore::kv_decode(e, keys, *enc, n, d, got.data()).is_ok());
          const std::vector<float> want = reference_decode(e, keys, *enc, n, d);
          for (size_t i = 0; i < got.size(); ++i) {
            uint32_t a, b;
            std::memcpy(&a, &got[i], 4);
            std::memcpy(&b, &want[i], 4);
            ASSERT_EQ(a, b) << kvstore::kv_encoding_name(e) << (keys ? " keys" : " values")
                            << " n " << n << " d " << d << " at " << i;
          }
        }
}

TEST(KvQuant, EqualsTheGroupAtATimeReferenceByteForByte) {
  int cases = 0;
  for (const int d : {2, 6, 12, 64, 128})
    for (const int64_t n : {int64_t(1), int64_t(7), int64_t(64), int64_t(65), int64_t(200)})
      for (KvEncoding e : {KvEncoding::kBF16, KvEncoding::kInt8, KvEncoding::kInt4})
        for (bool keys : {true, false}) {
          std::vector<float> x = random_rows(n, d, uint32_t(1000 + d * 7 + n));
          // A constant group (scale 0), exact ties between codes (x - zero a half step), a
          // negative zero and a subnormal: where a rounding or a select could differ.
          for (int64_t r = 0; r < n; ++r) x[size_t(r * d)] = 2.5f;
          if (n > 3) {
            x[size_t(1 * d + d - 1)] = -0.f;
            x[size_t(2 * d + d - 1)] = 1e-40f;
            for (int c = 0; c < d; ++c) x[size_t(3 * d + c)] = float(c % 16) * 0.5f;
          }
          if (n > 5 && d >= 12) {
            // Rows whose minimum is zero with both signs, each first in one row: the stored zero
            // is the first one's (-0 then +0, and +0 then -0, in different lanes).
            for (int c = 0; c < d; ++c) x[size_t(4 * d + c)] = x[size_t(5 * d + c)] = 1.f + float(c);
            x[size_t(4 * d + 1)] = -0.f, x[size_t(4 * d + 8)] = 0.f;
            x[size_t(5 * d + 1)] = 0.f, x[size_t(5 * d + 8)] = -0.f;
          }
          auto got = kvstore::kv_encode(e, keys, x.data(), n, d);
          std::vector<uint8_t> data;
          std::vector<uint16_t> scale, zero;
          ASSERT_TRUE(reference_encode(e, keys, x.data(), n, d, &data, &scale, &zero));
          ASSERT_TRUE(got.is_ok()) << got.status().message();
          const std::string what = std::string(kvstore::kv_encoding_name(e)) +
                                   (keys ? " keys" : " values") + " n " + std::to_string(n) +
                                   " d " + std::to_string(d);
          EXPECT_EQ(got->data, data) << what;
          if (e != KvEncoding::kBF16) {
            EXPECT_EQ(got->scale, scale) << what;
            EXPECT_EQ(got->zero, zero) << what;
          }
          ++cases;
        }
  EXPECT_EQ(cases, 150);
  // bf16 of the values a conversion treats specially, against f32_to_bf16 one at a time.
  const std::vector<float> special = {0.f, -0.f, 1e-40f, -1e-40f, 3.4e38f, -3.4e38f,
                                      std::numeric_limits<float>::infinity(),
                                      -std::numeric_limits<float>::infinity(), std::nanf(""),
                                      1.00390625f, 1.01171875f, 65504.f};
  auto b = kvstore::kv_encode(KvEncoding::kBF16, false, special.data(), 1, int(special.size()));
  ASSERT_TRUE(b.is_ok());
  for (size_t i = 0; i < special.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, b->data.data() + 2 * i, 2);
    EXPECT_EQ(h, f32_to_bf16(special[i])) << i;
  }
}

TEST(KvQuant, Int4PacksTheEvenChannelInTheLowNibble) {
  // One row of values 0..15 (scale 1, zero 0): codes equal the values.
  std::vector<float> x(16);
  for (int c = 0; c < 16; ++c) x[size_t(c)] = float(c);
  auto v = kvstore::kv_encode(KvEncoding::kInt4, false, x.data(), 1, 16).value();
  ASSERT_EQ(v.data.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(v.data[size_t(i)], uint8_t((2 * i) | ((2 * i + 1) << 4)));
  EXPECT_EQ(f16_to_f32(v.scale[0]), 1.f);
  EXPECT_EQ(f16_to_f32(v.zero[0]), 0.f);
  std::vector<float> y(16);
  ASSERT_TRUE(kvstore::kv_decode(KvEncoding::kInt4, false, v, 1, 16, y.data()).is_ok());
  EXPECT_EQ(y, x);
}

TEST(KvQuant, RefusesWhatItCannotRepresentOrRead) {
  std::vector<float> x = random_rows(4, 8, 3);
  x[5] = -1e6f;  // its group's zero (the minimum) is below F16's range
  auto r = kvstore::kv_encode(KvEncoding::kInt8, true, x.data(), 4, 8);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kOutOfRange);
  x[5] = std::nanf("");
  EXPECT_EQ(kvstore::kv_encode(KvEncoding::kInt4, false, x.data(), 4, 8).status().code(),
            Code::kOutOfRange);
  EXPECT_EQ(kvstore::kv_encode(KvEncoding::kInt4, true, x.data(), 3, 7).status().code(),
            Code::kInvalidArgument);  // odd head_dim cannot pack
  // A minimum above F16's largest (65504) is not refused (docs/kv-format.md): the zero saturates
  // at 65504 and the scale covers the group from there, so the error is half of that wider step.
  std::vector<float> big(32);
  for (size_t i = 0; i < big.size(); ++i) big[i] = 7e4f + 1e3f * float(i);
  std::vector<float> rt = big;
  ASSERT_TRUE(kvstore::kv_round_trip(KvEncoding::kInt8, false, rt.data(), 4, 8).is_ok());
  for (size_t i = 0; i < big.size(); ++i) {
    const double step = (double(big[i / 8 * 8 + 7]) - 65504.0) / 255.0;  // the value row's group
    EXPECT_LE(std::fabs(double(rt[i]) - double(big[i])), 0.5 * step * (1 + 0x1p-10) + 0.02) << i;
  }
  // A buffer that does not match its geometry (as a file could declare) is refused.
  const auto y = random_rows(4, 8, 4);
  auto enc = kvstore::kv_encode(KvEncoding::kInt8, true, y.data(), 4, 8).value();
  std::vector<float> out(32);
  enc.scale.pop_back();
  auto st = kvstore::kv_decode(KvEncoding::kInt8, true, enc, 4, 8, out.data());
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("int8 keys of 4 x 8"), std::string::npos) << st.message();
  auto enc2 = kvstore::kv_encode(KvEncoding::kInt8, true, y.data(), 4, 8).value();
  enc2.scale[0] = 0x7c00;  // F16 infinity
  EXPECT_EQ(kvstore::kv_decode(KvEncoding::kInt8, true, enc2, 4, 8, out.data()).code(),
            Code::kInvalidArgument);
}

}  // namespace
}  // namespace sf
