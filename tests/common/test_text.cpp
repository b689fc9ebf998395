// common/text: JSON string quoting, byte counts for people, UTC timestamps.
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "common/text.h"

namespace sf {
namespace {

TEST(Text, JsonQuotedEscapesQuotesBackslashesAndControls) {
  EXPECT_EQ(json_quoted("a\"b\\c\n\x01"), "\"a\\\"b\\\\c\\u000a\\u0001\"");
  EXPECT_EQ(json_quoted("caf\xc3\xa9"), "\"caf\xc3\xa9\"");  // UTF-8 as is
}

TEST(Text, HumanBytesKeepsThreeSignificantDigits) {
  EXPECT_EQ(human_bytes(0), "0 B");
  EXPECT_EQ(human_bytes(999), "999 B");
  EXPECT_EQ(human_bytes(1000), "1.00 kB");
  EXPECT_EQ(human_bytes(1'500'000), "1.50 MB");
  EXPECT_EQ(human_bytes(23'440'000'000), "23.4 GB");
  EXPECT_EQ(human_bytes(999'400'000), "999 MB");
  EXPECT_EQ(human_bytes(999'600'000), "1.00 GB");  // rounds up into the next unit
  EXPECT_EQ(human_bytes(1'200'000'000'000), "1.20 TB");
  EXPECT_EQ(human_bytes(-1), "unknown");
}

TEST(Text, NowIsUtcIso8601ToTheSecond) {
  EXPECT_TRUE(std::regex_match(now_iso8601(), std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")))
      << now_iso8601();
}

}  // namespace
}  // namespace sf
