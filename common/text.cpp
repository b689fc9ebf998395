#include "common/text.h"

#include <cstdarg>
#include <cstdio>
#include <ctime>

#include "common/utf8.h"

namespace sf {

namespace {
constexpr char kReplacement[] = "\xef\xbf\xbd";  // U+FFFD
}  // namespace

std::string utf8_repaired(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const utf8::DecodedCodepoint d = utf8::utf8_decode(s, i);
    if (d.cp == utf8::kInvalidCodepoint)
      out += kReplacement;
    else
      out.append(s.substr(i, d.len));
    i += d.len;
  }
  return out;
}

namespace {
// c as JSON's \u00XX escape.
void append_u00(unsigned char c, std::string* out) {
  static const char kHex[] = "0123456789abcdef";
  *out += "\\u00";
  out->push_back(kHex[c >> 4]);
  out->push_back(kHex[c & 15]);
}
}  // namespace

void json_escape(std::string_view s, std::string* out) {
  out->push_back('"');
  for (char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(char(c));
    } else if (c < 0x20) {
      append_u00(c, out);
    } else {
      out->push_back(char(c));
    }
  }
  out->push_back('"');
}

std::string controls_escaped(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f)
      append_u00(c, &out);
    else
      out.push_back(ch);
  }
  return out;
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
