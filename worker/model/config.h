// Model hyper-parameters, filled from GGUF metadata or a Hugging Face config.json.
#pragma once
#include <cstdint>
#include <optional>
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

// The Llama-3-8B shape (config.json of meta-llama/Meta-Llama-3-8B): 32 layers, hidden 4096, 32
// query / 8 KV heads of 128, intermediate 14336, vocab 128256, rope theta 500000 with Llama-3
// scaling (factor 8, low 1, high 4, original 8192). layers > 0 keeps that many.
ModelConfig llama3_8b_config(int layers = 0);

// "--model synthetic:SHAPE[:LAYERS[:SEED]]": a model of a known shape with deterministic
// synthetic weights, for benchmarks on hosts the real weights cannot reach (vLLM's dummy load
// format). SHAPE: llama3-8b. The weights are drawn where they are used (DeviceModel::synthetic).
struct SyntheticModelSpec {
  ModelConfig config;
  uint64_t seed = 1;
};
inline constexpr const char* kSyntheticModelPrefix = "synthetic:";
// nullopt when `model` does not start with "synthetic:"; an error names what is wrong with one
// that does.
Result<std::optional<SyntheticModelSpec>> parse_synthetic_model(const std::string& model);

}  // namespace sf::model
