// Versioned KV export: one safetensors shard per layer plus manifest.json (docs/kv-format.md).
// Shards hold `key` and `value` as [1, n_kv_heads, n_kept, head_dim] in Hugging Face's cache
// layout and rotary convention, so `safetensors` + transformers.DynamicCache can consume them;
// when a retention keeps different counts per head, each head gets its own `key.hH`/`value.hH`.
// Every head also carries its kept positions and per-block (64 kept tokens) metadata that
// decode-side selection uses: key min/max/mean per channel and summed importance.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "kvstore/retention.h"

namespace sf::kvstore {

// 2: retention detail, per-head positions and per-block metadata (1 had full retention only).
constexpr int kKvFormatVersion = 2;
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
  // Optional; null means full retention and no importance. Not owned; must match the geometry.
  const Retention* retention = nullptr;
  const ImportanceScores* importance = nullptr;
};

// Returns the layer's K or V, token-major [n_tokens, n_kv_heads, head_dim] fp32.
using LayerSource = std::function<const float*(int layer, bool value)>;

// Bytes of K and V (F32) a retention keeps, summed over layers and heads.
int64_t kv_bytes(const Retention& r, int head_dim);

// Compatibility hash over everything a consumer must agree on (model, dtype, geometry, rope,
// block size). Hex string of XXH64.
std::string compat_hash(const KvExportSpec& s);

// Writes dir/manifest.json and dir/layer_XXX.safetensors. The export is built in a sibling
// temporary directory and renamed into place, so a failure leaves nothing half-written.
// An existing non-empty dir is an error unless force.
Status export_kv(const std::string& dir, const KvExportSpec& spec, const LayerSource& src, bool force);

}  // namespace sf::kvstore
