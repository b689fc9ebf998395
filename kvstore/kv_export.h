// Versioned KV export: one safetensors shard per layer plus manifest.json (docs/kv-format.md).
// Shards hold `key` and `value` as [1, n_kv_heads, n_tokens, head_dim] in Hugging Face's cache
// layout and rotary convention, so `safetensors` + transformers.DynamicCache can consume them.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace sf::kvstore {

constexpr int kKvFormatVersion = 1;
constexpr int kKvBlockSize = 64;

struct KvExportSpec {
  std::string model_name, arch;
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  float rope_theta = 0.f;
  // true when keys come rotated by adjacent pairs (GGUF llama layout); the export rewrites
  // them to rotate-half order, which is what HF caches hold.
  bool keys_interleaved = false;
  int64_t n_tokens = 0;
  std::vector<int32_t> token_ids;
  int32_t first_token = -1;
};

// Returns the layer's K or V, token-major [n_tokens, n_kv_heads, head_dim] fp32.
using LayerSource = std::function<const float*(int layer, bool value)>;

// Compatibility hash over everything a consumer must agree on (model, dtype, geometry, rope,
// block size). Hex string of XXH64.
std::string compat_hash(const KvExportSpec& s);

// Writes dir/manifest.json and dir/layer_XXX.safetensors. The export is built in a sibling
// temporary directory and renamed into place, so a failure leaves nothing half-written.
// An existing non-empty dir is an error unless force.
Status export_kv(const std::string& dir, const KvExportSpec& spec, const LayerSource& src, bool force);

}  // namespace sf::kvstore
