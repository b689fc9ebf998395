// Command-line options, one parser for every binary (sparsefill, sparsefill-worker,
// sparsefill-decode): --key value, --key=value and --flag against a whitelist. Unknown options,
// an option given twice and a value that is another option ("--export-kv --force") are errors
// naming the option; --help or -h where an option can stand stops parsing with Args::help set.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace sf {

struct Args {
  std::map<std::string, std::string> opts;
  bool help = false;  // --help or -h was given (parsing stopped there)
  bool has(const std::string& k) const { return opts.count(k) > 0; }
  std::string get(const std::string& k, const std::string& def = "") const {
    auto it = opts.find(k);
    return it == opts.end() ? def : it->second;
  }
  // --k as a whole decimal integer (or def when absent) in [lo, hi]; "64k", "x" and "" are
  // errors naming the option, never read as 64 or 0.
  Result<int64_t> get_int(const std::string& k, int64_t def, int64_t lo, int64_t hi) const;
  // --k as a whole finite decimal number (whole_number) in [lo, hi].
  Result<double> get_double(const std::string& k, double def, double lo, double hi) const;
};

// argv[first..argc): valued options take the next argument (or =VALUE), flags none.
Result<Args> parse_args(int argc, char** argv, int first, const std::vector<std::string>& valued,
                        const std::vector<std::string>& flags);

// s as a whole decimal integer (no suffix, no blank or '+', no empty string, in int64 range).
bool whole_int(std::string_view s, int64_t* out);
// s as a whole finite decimal number: no hex ("0x1p-2"), no "inf" or "nan", no sign but '-', no
// blanks, and nothing that overflows or underflows a double (1e-400 is refused, not read as 0).
// Every number a user gives (options, retention and decode specs, environment) is read by this.
bool whole_number(std::string_view s, double* out);

}  // namespace sf
