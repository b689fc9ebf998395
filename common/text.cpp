#include "common/text.h"

#include <cstdarg>
#include <cstdio>
#include <ctime>

namespace sf {

namespace {
constexpr char kReplacement[] = "\xef\xbf\xbd";  // U+FFFD
}  // namespace

size_t utf8_sequence_length(std::string_view s, size_t i) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = at(i);
  if (c < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xbf;  // the second byte's range
  if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c >= 0xe0 && c <= 0xef) n = 3, lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
  else if (c >= 0xf0 && c <= 0xf4) n = 4, lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
  else return 0;
  if (i + n > s.size() || at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (at(i + k) < 0x80 || at(i + k) > 0xbf) return 0;
  return n;
}

std::string utf8_repaired(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_sequence_length(s, i);
    if (n == 0) {
      out += kReplacement;
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

void json_escape(std::string_view s, std::string* out) {
  static const char kHex[] = "0123456789abcdef";
  out->push_back('"');
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(char(c));
      ++i;
    } else if (c < 0x20) {
      *out += "\\u00";
      out->push_back(kHex[c >> 4]);
      out->push_back(kHex[c & 15]);
      ++i;
    } else {
      out->push_back(char(c));
      ++i;
    }
  }
  out->push_back('"');
}

std::string json_quoted(std::string_view s) {
  std::string out;
  json_escape(s, &out);
  return out;
}

std::string sformat(const char* fmt, ...) {
  va_list ap, ap2;
  va_start(ap, fmt);
  va_copy(ap2, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string out(n > 0 ? size_t(n) : 0, '\0');
  if (n > 0) std::vsnprintf(out.data(), size_t(n) + 1, fmt, ap2);
  va_end(ap2);
  return out;
}

std::string human_bytes(int64_t n) {
  if (n < 0) return "unknown";
  if (n < 1000) return std::to_string(n) + " B";
  static const char* units[] = {"kB", "MB", "GB", "TB", "PB"};
  double x = double(n) / 1000;
  int u = 0;
  while (x >= 999.5 && u < 4) {
    x /= 1000;
    ++u;
  }
  return sformat(x < 9.995 ? "%.2f %s" : x < 99.95 ? "%.1f %s" : "%.0f %s", x, units[u]);
}

std::string now_iso8601() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);  // (std::gmtime's buffer is shared between threads)
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

}  // namespace sf
