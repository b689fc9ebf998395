// Running a command line from a test: its exit status, with stdout and stderr in a log file the
// test prints when it fails.
#pragma once
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

namespace sf::testing {

// The command's exit status (-1 when it did not exit normally); its output goes to `log`.
inline int run_logged(const std::string& cmd, const std::string& log) {
  const int rc = std::system((cmd + " >" + log + " 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// A whole text file ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

}  // namespace sf::testing
