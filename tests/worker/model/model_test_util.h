// Locating the default model for tests. Tests that need it FAIL (never pass silently) when it
// is missing, naming the script that fetches it.
#pragma once
#include <cstdlib>
#include <filesystem>
#include <string>

namespace sf::testing {

inline std::string default_model_path() {
  if (const char* e = std::getenv("SF_MODEL")) return e;
  return std::string(SF_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}
inline bool default_model_present() { return std::filesystem::exists(default_model_path()); }
inline std::string missing_model_msg() {
  return "default model not found at " + default_model_path() + " (run deploy/fetch-model.sh)";
}

}  // namespace sf::testing
