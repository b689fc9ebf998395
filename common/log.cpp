#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace sf {

LogLevel log_level() {
  static const LogLevel lvl = [] {
    const char* e = std::getenv("SF_LOG_LEVEL");
    if (!e) return LogLevel::kInfo;
    if (!std::strcmp(e, "debug")) return LogLevel::kDebug;
    if (!std::strcmp(e, "warn")) return LogLevel::kWarn;
    if (!std::strcmp(e, "error")) return LogLevel::kError;
    return LogLevel::kInfo;
  }();
  return lvl;
}

void log_write(LogLevel lvl, const char* subsystem, const std::string& msg) {
  static std::mutex mu;
  static const char* names[] = {"D", "I", "W", "E"};
  std::lock_guard<std::mutex> lk(mu);
  std::fprintf(stderr, "[%s %s] %s\n", names[int(lvl)], subsystem, msg.c_str());
}

}  // namespace sf
