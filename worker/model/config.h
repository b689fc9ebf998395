// Model hyper-parameters, filled from GGUF metadata or a Hugging Face config.json.
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/api.h"

namespace sf::model {

enum class Arch { kLlama, kMistral, kQwen2 };  // SmolLM2 and Llama-2/3 are kLlama
const char* arch_name(Arch a);
Result<Arch> arch_from_string(const std::string& s);  // "llama", "mistral", "qwen2" (and HF names)

struct ModelConfig {
  Arch arch = Arch::kLlama;
  std::string name;          // general.name or model directory
  int n_layers = 0;
  int hidden = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int intermediate = 0;
  int vocab = 0;
  int max_context = 0;
  float rms_eps = 1e-5f;
  bool qkv_bias = false;      // Qwen2
  bool tied_embeddings = false;
  kernels::RopeParams rope;   // theta, style, Llama-3 scaling

  // Checks internal consistency (divisibility, positivity); names the offending field.
  Status validate() const;
};

}  // namespace sf::model
