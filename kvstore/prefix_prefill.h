// Prefill through the prefix cache: the longest cached prefix (whole 64-token blocks) is copied
// into the KV cache, model::extend computes only the suffix from that offset (positions and the
// causal mask continue from the prefix), and the prompt's whole blocks are then cached.
#pragma once
#include <cstdint>
#include <span>
#include <string>

#include "common/status.h"
#include "kvstore/prefix_cache.h"
#include "worker/model/model.h"

namespace sf::kvstore {

struct PrefixPrefillOptions {
  model::PrefillOptions prefill;
  bool insert = true;  // cache this prompt's whole blocks afterwards
  // Tokens always computed at the end (at least 1, for the first token's logits). A caller whose
  // result depends on the last rows' queries (SnapKV importance over an observation window)
  // sets it to that window, so a hit scores from the same queries a full prefill would.
  int64_t min_suffix = 1;
};

struct PrefixPrefillStats {
  int64_t reused_tokens = 0, computed_tokens = 0;
  // Caching is best effort: a prompt that does not fit the cache budget or the pool still gets
  // its prefill result; why its blocks were not (all) cached is kept here.
  Status insert_status;
};

// model_id must name the weights, not only the architecture: two checkpoints of one config must
// not share KV. At least the last token is always computed so the result carries its logits;
// with all_logits the rows cover the computed suffix only.
Result<model::PrefillResult> prefill_with_prefix_cache(const model::Model& m, PrefixCache* cache,
                                                       const std::string& model_id,
                                                       std::span<const int32_t> tokens,
                                                       const PrefixPrefillOptions& opt,
                                                       PrefixPrefillStats* stats = nullptr);

}  // namespace sf::kvstore
