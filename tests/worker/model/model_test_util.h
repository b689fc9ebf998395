// Locating the default model for tests. Tests that need it FAIL (never pass silently) when it
// is missing, naming the script that fetches it. Also the tiny synthetic Llama config the
// synthetic-weight tests share.
#pragma once
#include <cstdlib>
#include <filesystem>
#include <string>

#include "worker/model/config.h"

namespace sf::testing {

inline std::string default_model_path() {
  if (const char* e = std::getenv("SF_MODEL")) return e;
  return std::string(SF_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}
inline bool default_model_present() { return std::filesystem::exists(default_model_path()); }
inline std::string missing_model_msg() {
  return "default model not found at " + default_model_path() + " (run deploy/fetch-model.sh)";
}

// Tiny Llama (hidden 64, 4 query / 2 KV heads of 16) for Model::synthetic.
inline model::ModelConfig tiny_config(int n_layers = 2) {
  model::ModelConfig c;
  c.arch = model::Arch::kLlama;
  c.name = "tiny";
  c.n_layers = n_layers;
  c.hidden = 64;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.intermediate = 96;
  c.vocab = 101;
  c.max_context = 4096;
  c.rope.theta = 10000.f;
  return c;
}

}  // namespace sf::testing
