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
  auto r = sf::decode::parse_kv_manifest(text, "0123456789abcdef");
  if (!r.is_ok()) {
    if (r.status().message().empty()) __builtin_trap();
    return 0;
  }
  const sf::decode::KvManifest& m = *r;
  const auto& e = m.meta;
  if (int64_t(m.shards.size()) < e.n_layers || int64_t(e.token_ids.size()) != e.n_tokens ||
      m.pieces.size() != m.kept.size())
    __builtin_trap();
  // Every (layer, head) is covered by shard pieces whose kept tokens add up to its declared count.
  for (size_t i = 0; i < m.pieces.size(); ++i) {
    int64_t sum = 0;
    for (const auto& p : m.pieces[i]) {
      if (p.shard < 0 || size_t(p.shard) >= m.shards.size() || p.kept < 0 || p.row < 0)
        __builtin_trap();
      sum += p.kept;
    }
    if (sum != m.kept[i] || m.pieces[i].empty()) __builtin_trap();
  }
  auto enc = sf::kvstore::kv_encoding_parse(e.kv_dtype);
  if (!enc.is_ok()) __builtin_trap();
  int64_t bytes = 0;
  for (size_t i = 0; i < m.kept.size(); ++i) {
    int64_t sum = 0;
    for (const auto& [a, b] : m.ranges[i]) {
      if (a < 0 || b > e.n_tokens || a >= b) __builtin_trap();
      sum += b - a;
    }
    if (sum != m.kept[i]) __builtin_trap();
    bytes += sf::kvstore::kv_encoded_bytes(enc.value(), sum, e.head_dim);
  }
  if (bytes != e.kv_bytes) __builtin_trap();
  return 0;
}
