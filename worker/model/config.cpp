#include "worker/model/config.h"

#include <cmath>

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

}  // namespace sf::model
