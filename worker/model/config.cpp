#include "worker/model/config.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <vector>

namespace sf::model {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::kLlama:
      return "llama";
    case Arch::kMistral:
      return "mistral";
    case Arch::kQwen2:
      return "qwen2";
  }
  return "unknown";
}

Result<Arch> arch_from_string(const std::string& s) {
  if (s == "llama" || s == "LlamaForCausalLM") return Arch::kLlama;
  if (s == "mistral" || s == "MistralForCausalLM") return Arch::kMistral;
  if (s == "qwen2" || s == "Qwen2ForCausalLM") return Arch::kQwen2;
  return SF_ERR(kUnsupported,
                "unsupported architecture '" + s +
                    "' (supported: llama, mistral, qwen2 and their *ForCausalLM classes)");
}

Status ModelConfig::validate() const {
  const std::string where = "model config '" + name + "': ";
  auto positive = [&](int v, const char* field) -> Status {
    if (v <= 0)
      return SF_ERR(kInvalidArgument,
                    where + field + " must be positive, got " + std::to_string(v));
    return Status::ok();
  };
  SF_TRY(positive(n_layers, "n_layers"));
  SF_TRY(positive(hidden, "hidden"));
  SF_TRY(positive(n_heads, "n_heads"));
  SF_TRY(positive(n_kv_heads, "n_kv_heads"));
  SF_TRY(positive(head_dim, "head_dim"));
  SF_TRY(positive(intermediate, "intermediate"));
  SF_TRY(positive(vocab, "vocab"));
  // 0 means the source did not state a context length.
  SF_ENSURE(max_context >= 0, kInvalidArgument,
            where + "max_context must not be negative, got " + std::to_string(max_context));
  SF_ENSURE(n_heads % n_kv_heads == 0, kInvalidArgument,
            where + "n_kv_heads (" + std::to_string(n_kv_heads) + ") must divide n_heads (" +
                std::to_string(n_heads) + ")");
  SF_ENSURE(head_dim % 2 == 0, kInvalidArgument,
            where + "head_dim must be even for RoPE, got " + std::to_string(head_dim));
  // hidden == n_heads * head_dim is not required here: some checkpoints (e.g. Mistral-Nemo) state
  // a head_dim that differs; loaders check divisibility where they derive head_dim themselves.
  SF_ENSURE(int64_t(n_heads) * head_dim <= (int64_t(1) << 30), kInvalidArgument,
            where + "n_heads * head_dim is implausibly large");
  SF_ENSURE(std::isfinite(rms_eps) && rms_eps > 0.f, kInvalidArgument,
            where + "rms_eps must be a positive finite number");
  SF_ENSURE(std::isfinite(rope.theta) && rope.theta > 0.f, kInvalidArgument,
            where + "rope.theta must be a positive finite number");
  SF_ENSURE(rope.rot_dim >= 0 && rope.rot_dim <= head_dim && rope.rot_dim % 2 == 0,
            kInvalidArgument,
            where + "rope.rot_dim (" + std::to_string(rope.rot_dim) +
                ") must be even and within [0, head_dim]");
  if (rope.scaling_factor != 0.f) {
    SF_ENSURE(std::isfinite(rope.scaling_factor) && rope.scaling_factor > 0.f, kInvalidArgument,
              where + "rope.scaling_factor must be positive");
    SF_ENSURE(std::isfinite(rope.low_freq_factor) && rope.low_freq_factor > 0.f, kInvalidArgument,
              where + "rope.low_freq_factor must be positive");
    // The Llama-3 interpolation divides by (high_freq_factor - low_freq_factor).
    SF_ENSURE(std::isfinite(rope.high_freq_factor) && rope.high_freq_factor > rope.low_freq_factor,
              kInvalidArgument, where + "rope.high_freq_factor must exceed rope.low_freq_factor");
    SF_ENSURE(rope.original_max_pos > 0, kInvalidArgument,
              where + "rope.original_max_pos must be positive");
  }
  return Status::ok();
}

ModelConfig llama3_8b_config(int layers) {
  ModelConfig c;
  c.name = "llama3-8b-shaped (synthetic weights)";
  c.n_layers = layers > 0 ? layers : 32;
  c.hidden = 4096;
  c.n_heads = 32;
  c.n_kv_heads = 8;
  c.head_dim = 128;
  c.intermediate = 14336;
  c.vocab = 128256;
  c.max_context = 1 << 20;
  c.rms_eps = 1e-5f;
  c.rope.theta = 500000.f;
  c.rope.scaling_factor = 8.f;
  c.rope.low_freq_factor = 1.f;
  c.rope.high_freq_factor = 4.f;
  c.rope.original_max_pos = 8192;
  return c;
}

Result<std::optional<SyntheticModelSpec>> parse_synthetic_model(const std::string& model) {
  const std::string prefix = kSyntheticModelPrefix;
  if (model.rfind(prefix, 0) != 0) return std::optional<SyntheticModelSpec>();
  std::vector<std::string> parts;
  for (size_t b = prefix.size();;) {
    const size_t e = model.find(':', b);
    parts.push_back(model.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  const std::string usage =
      "--model " + model + ": want synthetic:SHAPE[:LAYERS[:SEED]] with SHAPE llama3-8b";
  if (parts.size() > 3 || parts[0] != "llama3-8b") return SF_ERR(kInvalidArgument, usage);
  auto number = [&](const std::string& s, uint64_t lo, uint64_t hi) -> Result<uint64_t> {
    uint64_t x = 0;  // digits only: no sign, space or base prefix
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size() || x < lo || x > hi)
      return SF_ERR(kInvalidArgument, usage + " ('" + s + "' is not a number in [" +
                                          std::to_string(lo) + ", " + std::to_string(hi) + "])");
    return uint64_t(x);
  };
  SyntheticModelSpec spec;
  int layers = 0;
  if (parts.size() > 1) {
    SF_ASSIGN(const uint64_t l, number(parts[1], 1, 32));
    layers = int(l);
  }
  spec.config = llama3_8b_config(layers);
  if (parts.size() > 2) {
    SF_ASSIGN(spec.seed, number(parts[2], 0, UINT64_MAX));
  }
  return std::optional<SyntheticModelSpec>(std::move(spec));
}

}  // namespace sf::model
