// MetricsRegistry: Prometheus text exposition (0.0.4) of counters, gauges and histograms, name
// validation, and the textfile written for node_exporter's collector.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/metrics.h"

namespace sf {
namespace {

TEST(Metrics, ExpositionAndValidation) {
  MetricsRegistry reg;
  EXPECT_FALSE(reg.add_family("bad name", MetricKind::kGauge, "x").is_ok());
  EXPECT_FALSE(reg.add_family("sf_moves", MetricKind::kCounter, "x").is_ok());  // no _total
  ASSERT_TRUE(reg.add_family("sf_moves_total", MetricKind::kCounter, "Moves.").is_ok());
  EXPECT_FALSE(reg.add_family("sf_moves_total", MetricKind::kGauge, "x").is_ok());
  EXPECT_FALSE(reg.set("sf_missing", {}, 1).is_ok());
  ASSERT_TRUE(reg.set("sf_moves_total", {{"tier", "a\"b"}}, 12345678901.0).is_ok());
  EXPECT_EQ(reg.render(),
            "# HELP sf_moves_total Moves.\n# TYPE sf_moves_total counter\n"
            "sf_moves_total{tier=\"a\\\"b\"} 12345678901\n");
  EXPECT_EQ(reg.get("sf_moves_total", {{"tier", "a\"b"}}).value(), 12345678901.0);
  // Label names: no ':' and no reserved '__' prefix; HELP text escaped.
  EXPECT_FALSE(reg.set("sf_moves_total", {{"a:b", "x"}}, 1).is_ok());
  EXPECT_FALSE(reg.set("sf_moves_total", {{"__name__", "x"}}, 1).is_ok());
  MetricsRegistry h;
  ASSERT_TRUE(h.add_family("sf_g", MetricKind::kGauge, "two\nlines \\ here").is_ok());
  EXPECT_EQ(h.render(), "# HELP sf_g two\\nlines \\\\ here\n# TYPE sf_g gauge\n");
  // A label value that is not UTF-8 (a model file's name) is rendered with U+FFFD: a scraper
  // would refuse the whole file over one bad byte.
  ASSERT_TRUE(h.set("sf_g", {{"model", "m\xff"}}, 1).is_ok());
  EXPECT_NE(h.render().find("sf_g{model=\"m\xef\xbf\xbd\"} 1\n"), std::string::npos) << h.render();
}

TEST(Metrics, HistogramBucketsAreCumulativeWithSumAndCount) {
  MetricsRegistry reg;
  EXPECT_FALSE(reg.add_histogram("sf_h", "x", {}).is_ok());
  EXPECT_FALSE(reg.add_histogram("sf_h", "x", {1, 1}).is_ok());
  EXPECT_FALSE(reg.add_histogram("sf_h", "x", {2, 1}).is_ok());
  EXPECT_FALSE(reg.add_family("sf_h", MetricKind::kHistogram, "x").is_ok());
  ASSERT_TRUE(reg.add_histogram("sf_seconds", "Times.", {0.1, 1, 5}).is_ok());
  EXPECT_TRUE(reg.add_histogram("sf_seconds", "Times.", {0.1, 1, 5}).is_ok());  // same again
  EXPECT_FALSE(reg.add_histogram("sf_seconds", "Times.", {1, 5}).is_ok());    // other buckets
  EXPECT_FALSE(reg.set("sf_seconds", {}, 1).is_ok());
  EXPECT_FALSE(reg.get("sf_seconds", {}).is_ok());
  EXPECT_FALSE(reg.observe("sf_seconds", {{"le", "1"}}, 1).is_ok());  // reserved label
  EXPECT_FALSE(reg.observe("sf_seconds", {}, std::nan("")).is_ok());
  ASSERT_TRUE(reg.touch("sf_seconds", {{"group", "1"}}).is_ok());  // zeros before any sample
  // 1 lands in le="1" (upper bounds are inclusive); 7 only in +Inf.
  for (double v : {0.05, 1.0, 3.0, 7.2}) ASSERT_TRUE(reg.observe("sf_seconds", {}, v).is_ok());
  ASSERT_TRUE(reg.add_family("sf_moves_total", MetricKind::kCounter, "Moves.").is_ok());
  EXPECT_FALSE(reg.observe("sf_moves_total", {}, 1).is_ok());
  EXPECT_EQ(reg.render(),
            "# HELP sf_moves_total Moves.\n# TYPE sf_moves_total counter\n"
            "# HELP sf_seconds Times.\n# TYPE sf_seconds histogram\n"
            "sf_seconds_bucket{le=\"0.1\"} 1\n"
            "sf_seconds_bucket{le=\"1\"} 2\n"
            "sf_seconds_bucket{le=\"5\"} 3\n"
            "sf_seconds_bucket{le=\"+Inf\"} 4\n"
            "sf_seconds_sum 11.25\n"  // 0.05 + 1 + 3 + 7.2 in doubles
            "sf_seconds_count 4\n"
            "sf_seconds_bucket{group=\"1\",le=\"0.1\"} 0\n"
            "sf_seconds_bucket{group=\"1\",le=\"1\"} 0\n"
            "sf_seconds_bucket{group=\"1\",le=\"5\"} 0\n"
            "sf_seconds_bucket{group=\"1\",le=\"+Inf\"} 0\n"
            "sf_seconds_sum{group=\"1\"} 0\n"
            "sf_seconds_count{group=\"1\"} 0\n");
}

TEST(Metrics, TextfileIsReplacedWholeAndErrorsAreIo) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("sf-metrics-" + std::to_string(getpid())))
          .string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  MetricsRegistry reg;
  ASSERT_TRUE(reg.add_family("sf_up", MetricKind::kGauge, "Up.").is_ok());
  ASSERT_TRUE(reg.set("sf_up", {}, 1).is_ok());
  const std::string path = dir + "/sf.prom";
  {
    std::ofstream old(path);
    old << "an older, longer file that must not survive in part\n";
  }
  ASSERT_TRUE(reg.write_textfile(path).is_ok());
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_EQ(ss.str(), reg.render());
  // Nothing beside it: the temporary was renamed.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++entries;
  EXPECT_EQ(entries, 1);
  const Status st = reg.write_textfile(dir + "/missing/sf.prom");
  EXPECT_EQ(st.code(), Code::kIo) << st.message();
  EXPECT_NE(st.message().find("missing/sf.prom'"), std::string::npos) << st.message();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace sf
