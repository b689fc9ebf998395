// libFuzzer target: parse_kv_manifest (the decode side's reader of manifest.json) on arbitrary
// text. An accepted manifest must be self-consistent: shards that cover every (layer, KV head)
// with pieces adding up to its kept count, declared ranges that add up to the kept counts, and
// kv_bytes equal to the kept K+V bytes in the manifest's kv_dtype.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "decode/kv_client.h"
#include "kvstore/kv_quant.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  // The seeds' model (name t, llama, 1 layer, 1 KV head, head_dim 2, theta 10000) hashes to this.
  auto r = sf::decode::parse_kv_manifest(text, "5688de8268c8db7a");
  if (!r.is_ok()) {
    if (r.status().message().empty()) __builtin_trap();
    return 0;
  }
  const sf::decode::KvManifest& m = *r;
  const auto& e = m.meta;
  const size_t n_tiers = e.kv_dtype_low.empty() ? 1 : 2;
  if (int64_t(m.shards.size()) < e.n_layers || int64_t(e.token_ids.size()) != e.n_tokens ||
      m.pieces.size() != n_tiers || m.tier_ranges.size() != n_tiers)
    __builtin_trap();
  auto enc = sf::kvstore::kv_encodings_parse(e.kv_dtype + (n_tiers == 2 ? "+" + e.kv_dtype_low : ""));
  if (!enc.is_ok()) __builtin_trap();
  // Every (layer, head) of each tier is covered by shard pieces whose kept tokens add up to the
  // tier's declared count, and the tiers' counts add up to the kept count.
  int64_t bytes = 0;
  for (size_t i = 0; i < m.kept.size(); ++i) {
    int64_t sum = 0;
    for (const auto& [a, b] : m.ranges[i]) {
      if (a < 0 || b > e.n_tokens || a >= b) __builtin_trap();
      sum += b - a;
    }
    if (sum != m.kept[i]) __builtin_trap();
    int64_t tiers_sum = 0;
    for (size_t t = 0; t < n_tiers; ++t) {
      if (m.pieces[t].size() != m.kept.size() || m.pieces[t][i].empty()) __builtin_trap();
      int64_t in_ranges = 0, in_pieces = 0;
      for (const auto& [a, b] : m.tier_ranges[t][i]) in_ranges += b - a;
      for (const auto& p : m.pieces[t][i]) {
        if (p.shard < 0 || size_t(p.shard) >= m.shards.size() || p.kept < 0 || p.row < 0)
          __builtin_trap();
        in_pieces += p.kept;
      }
      if (in_pieces != in_ranges) __builtin_trap();
      tiers_sum += in_ranges;
      const auto te = t == 0 ? enc.value().high : *enc.value().low;
      bytes += sf::kvstore::kv_encoded_bytes(te, in_ranges, e.head_dim);
    }
    if (tiers_sum != m.kept[i]) __builtin_trap();
  }
  if (bytes != e.kv_bytes) __builtin_trap();
  return 0;
}
