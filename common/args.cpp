#include "common/args.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string_view>

namespace sf {

bool whole_int(std::string_view s, int64_t* out) {
  int64_t x = 0;
  // As whole_number: no blanks or '+' (which strtoll skips), out of range refused.
  const auto r = std::from_chars(s.data(), s.data() + s.size(), x, 10);
  if (s.empty() || r.ec != std::errc() || r.ptr != s.data() + s.size()) return false;
  *out = x;
  return true;
}

bool whole_number(std::string_view s, double* out) {
  double x = 0;
  // from_chars reads neither hex (without chars_format::hex) nor a leading '+' or blank, and
  // reports overflow and underflow as out of range instead of rounding to inf or 0.
  const auto r = std::from_chars(s.data(), s.data() + s.size(), x, std::chars_format::general);
  if (s.empty() || r.ec != std::errc() || r.ptr != s.data() + s.size() || !std::isfinite(x))
    return false;
  *out = x;
  return true;
}

Result<int64_t> Args::get_int(const std::string& k, int64_t def, int64_t lo, int64_t hi) const {
  if (!has(k)) return def;
  int64_t x = 0;
  if (!whole_int(get(k), &x) || x < lo || x > hi)
    return SF_ERR(kInvalidArgument, "--" + k + ": '" + get(k) + "' is not an integer in [" +
                                        std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

Result<double> Args::get_double(const std::string& k, double def, double lo, double hi) const {
  if (!has(k)) return def;
  const std::string v = get(k);
  double x = 0;
  if (!whole_number(v, &x) || x < lo || x > hi) {
    std::ostringstream range;
    range << "[" << lo << ", " << hi << "]";
    return SF_ERR(kInvalidArgument,
                  "--" + k + ": '" + v + "' is not a number in " + range.str());
  }
  return x;
}

Result<Args> parse_args(int argc, char** argv, int first, const std::vector<std::string>& valued,
                        const std::vector<std::string>& flags) {
  Args a;
  for (int i = first; i < argc; ++i) {
    std::string k = argv[i];
    // A help request where an option can stand (a valued option's value was taken above).
    if (k == "--help" || k == "-h") {
      a.help = true;
      return a;
    }
    if (k.rfind("--", 0) != 0) return SF_ERR(kInvalidArgument, "unexpected argument '" + k + "'");
    k = k.substr(2);
    // --key=value gives a value that itself starts with "--".
    std::optional<std::string> inline_value;
    if (const size_t eq = k.find('='); eq != std::string::npos) {
      inline_value = k.substr(eq + 1);
      k = k.substr(0, eq);
    }
    // A second --k would silently replace the first (two prompts, two outputs): refused.
    if (a.has(k)) return SF_ERR(kInvalidArgument, "option --" + k + " is given twice");
    if (std::find(flags.begin(), flags.end(), k) != flags.end()) {
      if (inline_value) return SF_ERR(kInvalidArgument, "option --" + k + " takes no value");
      a.opts.insert_or_assign(k, std::string("1"));  // (= "1" trips GCC 12's -Wrestrict)
    } else if (std::find(valued.begin(), valued.end(), k) != valued.end()) {
      if (inline_value) {
        a.opts[k] = *inline_value;
        continue;
      }
      // "--export-kv --force" means a forgotten value, not a directory named --force.
      if (i + 1 >= argc || std::string_view(argv[i + 1]).rfind("--", 0) == 0)
        return SF_ERR(kInvalidArgument, "option --" + k + " needs a value" +
                                            (i + 1 < argc ? std::string(" (got option '") +
                                                                argv[i + 1] + "'; use --" + k +
                                                                "=VALUE for a value starting with --)"
                                                          : std::string()));
      a.opts[k] = argv[++i];
    } else {
      return SF_ERR(kInvalidArgument, "unknown option --" + k);
    }
  }
  return a;
}

}  // namespace sf
