// libFuzzer target: moa_config_parse (kvstore/retention.h) on arbitrary text. A rejected config
// must say why. An accepted one must pass retention_check_geometry for its own shape, and
// retention_apply must keep, for every layer and KV head, ascending distinct positions inside
// the prompt that include the sink and the most recent token.
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvstore/retention.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  sf::Result<sf::kvstore::RetentionPolicy> r = sf::kvstore::moa_config_parse(text, "fuzz");
  if (!r.is_ok()) {
    if (r.status().message().empty()) __builtin_trap();
    return 0;
  }
  const sf::kvstore::RetentionPolicy& p = *r;
  if (p.kind != sf::kvstore::RetentionKind::kMoA || p.moa.empty() || p.moa[0].empty())
    __builtin_trap();
  const int layers = int(p.moa.size()), heads = int(p.moa[0].size());
  if (!sf::kvstore::retention_check_geometry(p, layers, heads).is_ok()) __builtin_trap();
  if (int64_t(layers) * heads > 4096) return 0;  // keep each input cheap
  const int64_t n_tokens = 1 + int64_t(size % 257);
  auto kept = sf::kvstore::retention_apply(p, layers, heads, n_tokens, nullptr);
  if (!kept.is_ok()) {
    if (kept.status().message().empty()) __builtin_trap();
    return 0;
  }
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < heads; ++h) {
      const auto& pos = kept->positions(l, h);
      if (pos.empty() || pos.back() != n_tokens - 1) __builtin_trap();
      for (size_t i = 0; i < pos.size(); ++i) {
        if (pos[i] < 0 || pos[i] >= n_tokens) __builtin_trap();
        if (i > 0 && pos[i] <= pos[i - 1]) __builtin_trap();
      }
      const int64_t sink = p.moa_sink < n_tokens ? p.moa_sink : n_tokens;
      if (int64_t(pos.size()) < sink) __builtin_trap();
      for (int64_t t = 0; t < sink; ++t)
        if (pos[size_t(t)] != t) __builtin_trap();
    }
  return 0;
}
