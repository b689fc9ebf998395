// The one option parser every binary uses, and the number readers every spec goes through.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/args.h"

namespace sf {
namespace {

Result<Args> parse(std::vector<std::string> argv, const std::vector<std::string>& valued,
                   const std::vector<std::string>& flags = {}) {
  std::vector<char*> p;
  for (auto& s : argv) p.push_back(s.data());
  return parse_args(int(p.size()), p.data(), 0, valued, flags);
}

TEST(WholeNumber, ReadsPlainDecimals) {
  double x = -1;
  for (const auto& [s, want] : std::vector<std::pair<std::string, double>>{
           {"0.5", 0.5}, {"-2", -2}, {"1e-3", 1e-3}, {".25", 0.25}, {"7.", 7}, {"1E2", 100}}) {
    ASSERT_TRUE(whole_number(s, &x)) << s;
    EXPECT_EQ(x, want) << s;
  }
}

TEST(WholeNumber, RefusesWhatIsNotOne) {
  // Hex floats, values past a double's range (underflow included: 1e-400 is not 0), non-finite
  // words, signs and blanks strtod would skip, and trailing text.
  for (const std::string s : {"", "0x1p-2", "0x10", "1e-400", "1e400", "inf", "-inf", "nan",
                              "+1", " 1", "1 ", "1,5", "5%", "1e", "--1", "0.5s"}) {
    double x = 42;
    EXPECT_FALSE(whole_number(s, &x)) << "'" << s << "'";
    EXPECT_EQ(x, 42) << "'" << s << "' changed the output";
  }
}

TEST(WholeInt, RefusesBlanksSignsAndOverflow) {
  int64_t x = 7;
  EXPECT_TRUE(whole_int("-12", &x));
  EXPECT_EQ(x, -12);
  EXPECT_TRUE(whole_int("9223372036854775807", &x));
  EXPECT_EQ(x, INT64_MAX);
  for (const std::string s : {"", " 1", "+1", "1 ", "0x10", "1e3", "12k", "9223372036854775808"}) {
    x = 7;
    EXPECT_FALSE(whole_int(s, &x)) << "'" << s << "'";
    EXPECT_EQ(x, 7);
  }
}

TEST(Args, GetDoubleRangesAndErrorsNameTheOption) {
  auto a = parse({"--eps", "0x1p-1", "--gamma", "0.95", "--tiny", "1e-400"}, {"eps", "gamma", "tiny"});
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  auto eps = a.value().get_double("eps", 1, 0, 1);
  ASSERT_FALSE(eps.is_ok());
  EXPECT_NE(eps.status().message().find("--eps"), std::string::npos) << eps.status().message();
  auto tiny = a.value().get_double("tiny", 1, 0, 1);
  EXPECT_FALSE(tiny.is_ok()) << "1e-400 read as " << tiny.value();
  auto g = a.value().get_double("gamma", 1, 0, 1);
  ASSERT_TRUE(g.is_ok());
  EXPECT_EQ(g.value(), 0.95);
  EXPECT_FALSE(a.value().get_double("gamma", 1, 0, 0.9).is_ok());  // out of [lo, hi]
  EXPECT_EQ(a.value().get_double("absent", 0.25, 0, 1).value(), 0.25);
}

TEST(Args, GetIntIsWholeAndInRange) {
  auto a = parse({"--n=64k", "--m", "12", "--big", "99999999999999999999"}, {"n", "m", "big"});
  ASSERT_TRUE(a.is_ok());
  EXPECT_FALSE(a.value().get_int("n", 0, 0, 1 << 30).is_ok());
  EXPECT_FALSE(a.value().get_int("big", 0, 0, INT64_MAX).is_ok());
  EXPECT_EQ(a.value().get_int("m", 0, 0, 100).value(), 12);
  EXPECT_FALSE(a.value().get_int("m", 0, 13, 100).is_ok());
}

TEST(Args, ParserRefusesUnknownRepeatedAndMissingValues) {
  EXPECT_FALSE(parse({"--nope", "1"}, {"eps"}).is_ok());
  EXPECT_FALSE(parse({"--eps", "1", "--eps", "2"}, {"eps"}).is_ok());
  EXPECT_FALSE(parse({"--out", "--force"}, {"out"}, {"force"}).is_ok());
  EXPECT_FALSE(parse({"--eps"}, {"eps"}).is_ok());
  auto h = parse({"--eps", "1", "-h", "--nope"}, {"eps"});
  ASSERT_TRUE(h.is_ok());
  EXPECT_TRUE(h.value().help);
}

}  // namespace
}  // namespace sf
