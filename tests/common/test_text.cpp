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

// Bytes that are not well-formed UTF-8 become U+FFFD, one per byte; well-formed sequences of
// every length stay, and a sequence cut short at the end is not read past.
TEST(Text, ControlsEscapedKeepsEverythingElse) {
  EXPECT_EQ(controls_escaped(std::string("a\nb\x1b[2J\x7f\"\\\xc3\xa9", 12)),
            "a\\u000ab\\u001b[2J\\u007f\"\\\xc3\xa9");
  EXPECT_EQ(controls_escaped(std::string("x\0y", 3)), "x\\u0000y");
}

TEST(Text, InvalidUtf8BecomesTheReplacementCharacter) {
  const std::string r = "\xef\xbf\xbd";
  EXPECT_EQ(utf8_repaired("a\xff" "b"), "a" + r + "b");
  EXPECT_EQ(utf8_repaired("\xc0\xaf"), r + r);                // overlong '/'
  EXPECT_EQ(utf8_repaired("\xed\xa0\x80"), r + r + r);        // a surrogate
  EXPECT_EQ(utf8_repaired("\xf4\x90\x80\x80"), r + r + r + r);  // past U+10FFFF
  EXPECT_EQ(utf8_repaired("x\xe2\x82"), "x" + r + r);          // cut short
  const std::string ok = "\x7f\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\xf4\x8f\xbf\xbf";
  EXPECT_EQ(utf8_repaired(ok), ok);
  // json_quoted leaves such bytes for its caller to refuse (the safetensors writer does).
  EXPECT_EQ(json_quoted("n\xff"), "\"n\xff\"");
  EXPECT_EQ(json_quoted(utf8_repaired("n\xff")), "\"n" + r + "\"");
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
