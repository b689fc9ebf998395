// Small helpers the GPU-host benchmarks share: a failure line, a wall clock, and what a result
// line records about its own run (the date, the command and the commit; bench/gpu/run.sh exports
// SF_SOURCE_COMMIT from the .source-commit file the caller carries).
#pragma once
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/status.h"
#include "common/text.h"

namespace sf::bench {

inline int fail(const char* what, const Status& st) {
  std::fprintf(stderr, "%s: %s\n", what, st.to_string().c_str());
  return 1;
}

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// argv joined by spaces (the arguments here are plain words and numbers), for a JSON string.
inline std::string command_line(int argc, char** argv) {
  std::string c;
  for (int i = 0; i < argc; ++i) {
    if (i) c += ' ';
    for (const char* p = argv[i]; *p; ++p)
      if (*p != '"' && *p != '\\') c += *p;  // kept JSON-safe
  }
  return c;
}

inline std::string source_commit() {
  const char* e = std::getenv("SF_SOURCE_COMMIT");
  return e && *e ? e : "unknown";
}

}  // namespace sf::bench
