// Subsystem-tagged logging to stderr. Level from SF_LOG_LEVEL (debug|info|warn|error; default info).
#pragma once
#include <sstream>
#include <string>

namespace sf {

enum class LogLevel { kDebug = 0, kInfo, kWarn, kError };
LogLevel log_level();
void log_write(LogLevel lvl, const char* subsystem, const std::string& msg);

}  // namespace sf

#define SF_LOG(lvl, subsys, expr)                                              \
  do {                                                                         \
    if (::sf::LogLevel::lvl >= ::sf::log_level()) {                            \
      std::ostringstream sf_os_;                                               \
      sf_os_ << expr;                                                          \
      ::sf::log_write(::sf::LogLevel::lvl, subsys, sf_os_.str());              \
    }                                                                          \
  } while (0)
