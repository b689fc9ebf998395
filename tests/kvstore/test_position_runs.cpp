// Format 6's kept-position runs (kvstore/position_runs.h): round trips, every malformed input
// refused, and the size and read time against the JSON ranges of formats 2-5 on a scattered
// million-token head.
#include <gtest/gtest.h>

#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>

#include "common/timing.h"
#include "kvstore/position_runs.h"
#include "tests/common/test_seed.h"

namespace sf::kvstore {
namespace {

std::vector<int32_t> random_positions(std::mt19937_64& rng, int64_t n, double keep, int cluster) {
  std::vector<int32_t> out;
  for (int64_t p = 0; p < n;) {
    const int64_t len = 1 + int64_t(rng() % uint64_t(cluster));
    const bool take = std::uniform_real_distribution<double>(0, 1)(rng) < keep;
    for (int64_t i = 0; i < len && p < n; ++i, ++p)
      if (take) out.push_back(int32_t(p));
  }
  return out;
}

TEST(PositionRuns, RoundTrip) {
  std::mt19937_64 rng(testing::fresh_seed());
  for (int iter = 0; iter < 300; ++iter) {
    const int64_t n = 1 + int64_t(rng() % (iter < 200 ? 5000 : 3000000));
    auto pos = random_positions(rng, n, std::uniform_real_distribution<double>(0, 1)(rng),
                                1 + int(rng() % 300));
    if (pos.empty()) pos.push_back(int32_t(n - 1));
    const auto runs = position_runs(pos);
    int64_t count = 0;
    for (const auto& [b, e] : runs) {
      ASSERT_LT(b, e);
      count += e - b;
    }
    ASSERT_EQ(count, int64_t(pos.size()));
    const std::string text = encode_position_runs(runs);
    ASSERT_EQ(text.size() % 4, 0u);
    auto back = decode_position_runs(text, n);
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    ASSERT_EQ(back.value(), runs) << "iter " << iter;
  }
  // Edges: the whole prompt, the first and the last position, an empty list.
  for (const auto& runs : std::vector<std::vector<PositionRun>>{
           {{0, 1}}, {{0, 1 << 20}}, {{(1 << 20) - 1, 1 << 20}}, {{0, 1}, {5, 6}, {200, 70000}}, {}}) {
    auto back = decode_position_runs(encode_position_runs(runs), 1 << 20);
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(back.value(), runs);
  }
}

TEST(PositionRuns, MalformedIsRefused) {
  const int64_t n = 1000;
  const std::string good = encode_position_runs(std::vector<PositionRun>{{3, 10}, {20, 21}});
  ASSERT_TRUE(decode_position_runs(good, n).is_ok());
  const std::string overlong(16, '/');  // twelve 0xff bytes: a varint that never ends in 63 bits
  for (const auto& [text, why] : std::vector<std::pair<std::string, std::string>>{
           {good.substr(0, good.size() - 1), "not a multiple of 4"},
           {"AB?A", "is not base64"},
           {"A=AA", "is not base64"},     // padding before the end of a quad
           {"AA=A", "is not base64"},     // data after padding
           {"AAAA" + good, "is empty"},   // 0x00 0x00 0x00: a run of length 0
           {"gA==", "cut off"},           // 0x80: a varint that does not end
           {overlong, "cut off or too large"},
           {encode_position_runs(std::vector<PositionRun>{{999, 1001}}), "ends past"},
           {encode_position_runs(std::vector<PositionRun>{{1000, 1001}}), "ends past"}}) {
    auto r = decode_position_runs(text, n);
    ASSERT_FALSE(r.is_ok()) << text;
    EXPECT_EQ(r.status().code(), Code::kCorrupt);
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().to_string();
  }
  // Touching runs (a gap of 0) read, as the JSON ranges of formats 3-5 allowed them; a run
  // before the previous one's end cannot be written at all (gaps are unsigned).
  auto r = decode_position_runs(encode_position_runs(std::vector<PositionRun>{{0, 5}, {5, 6}}), n);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->back(), PositionRun(5, 6));
}

// One KV head of a 1M-token prompt keeping a quarter of its tokens by SnapKV-like scores (random
// here, so the runs are as scattered as real importance gets), pooled with kernel 7 (the
// default) and 1: bytes and read time of formats 2-5's JSON ranges against format 6's runs.
TEST(PositionRuns, ScatteredMillionTokenHeadIsSmallerAndFasterToRead) {
  std::mt19937_64 rng(testing::fresh_seed());
  const int64_t n = int64_t(1) << 20, budget = n / 4;
  using clock = std::chrono::steady_clock;
  for (int pool : {7, 1}) {
    std::vector<float> s(static_cast<size_t>(n)), pooled(static_cast<size_t>(n));
    std::normal_distribution<float> nd;
    for (auto& x : s) x = nd(rng);
    for (int64_t i = 0; i < n; ++i) {
      float m = s[size_t(i)];
      for (int64_t j = std::max<int64_t>(0, i - pool / 2); j <= std::min(n - 1, i + pool / 2); ++j)
        m = std::max(m, s[size_t(j)]);
      pooled[size_t(i)] = m;
    }
    std::vector<int32_t> idx(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), 0);
    std::nth_element(idx.begin(), idx.begin() + budget, idx.end(),
                     [&](int32_t a, int32_t b) { return pooled[size_t(a)] > pooled[size_t(b)]; });
    idx.resize(size_t(budget));
    std::sort(idx.begin(), idx.end());
    const auto runs = position_runs(idx);
    boost::json::array ranges;
    for (const auto& [b, e] : runs) ranges.push_back(boost::json::array{b, e});
    const std::string json_text = boost::json::serialize(ranges);
    const std::string runs_text = encode_position_runs(runs);
    const std::string runs_json = boost::json::serialize(boost::json::value(runs_text));
    auto t0 = clock::now();
    const boost::json::value parsed = boost::json::parse(json_text);
    std::vector<PositionRun> from_json;
    for (const auto& rv : parsed.as_array())
      from_json.emplace_back(rv.as_array()[0].as_int64(), rv.as_array()[1].as_int64());
    const double json_s = sf::seconds_since(t0);
    t0 = clock::now();
    const boost::json::value parsed_runs = boost::json::parse(runs_json);
    auto from_runs = decode_position_runs(std::string(parsed_runs.as_string()), n);
    const double runs_s = sf::seconds_since(t0);
    ASSERT_TRUE(from_runs.is_ok());
    EXPECT_EQ(from_runs.value(), runs);
    EXPECT_EQ(from_json, runs);
    std::printf(
        "pool %d: %zu runs a head; JSON ranges %zu bytes, read in %.1f ms; runs %zu bytes (%.2fx "
        "smaller), read in %.1f ms; x 256 heads (Llama-3-8B): %.0f MiB against %.0f MiB\n",
        pool, runs.size(), json_text.size(), json_s * 1e3, runs_json.size(),
        double(json_text.size()) / double(runs_json.size()), runs_s * 1e3,
        double(json_text.size()) * 256 / (1 << 20), double(runs_json.size()) * 256 / (1 << 20));
    EXPECT_LT(runs_json.size() * 4, json_text.size());
  }
}

}  // namespace
}  // namespace sf::kvstore
