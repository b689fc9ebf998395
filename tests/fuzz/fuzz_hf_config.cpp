// libFuzzer target: config_from_hf_json on arbitrary text. An accepted config must pass
// ModelConfig::validate() (the loader relies on it) and be self-consistent.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "worker/model/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  sf::Result<sf::model::ModelConfig> r = sf::model::config_from_hf_json(text, "fuzz");
  if (!r.is_ok()) {
    if (r.status().message().empty()) __builtin_trap();
    return 0;
  }
  const sf::model::ModelConfig& c = *r;
  if (!c.validate().is_ok() || c.n_heads % c.n_kv_heads != 0 || !c.rope.neox) __builtin_trap();
  return 0;
}
