#include "worker/request_checks.h"

#include <string>

#include "kvstore/retention.h"

namespace sf::worker {
namespace {

// Why `r` cannot run in this job, or empty.
std::string why_bad(runtime::BatchRequest& r, const model::ModelConfig& cfg,
                    const model::Tokenizer* tok, const Options& o) {
  if (!r.has_tokens) {
    if (!tok) return "this model has no tokenizer support; give 'tokens'";
    r.tokens = tok->encode(r.prompt, /*add_special=*/true, /*parse_special=*/true);
    if (r.tokens.empty()) return "field 'prompt' encodes to no tokens";
  }
  for (size_t i = 0; i < r.tokens.size(); ++i)
    if (r.tokens[i] >= cfg.vocab)
      return "field 'tokens' item " + std::to_string(i) + " (" + std::to_string(r.tokens[i]) +
             ") is outside the vocabulary of " + std::to_string(cfg.vocab);
  if (int64_t(r.tokens.size()) > cfg.max_context && cfg.max_context > 0 && !o.allow_long)
    return "prompt has " + std::to_string(r.tokens.size()) +
           " tokens, more than the model context of " + std::to_string(cfg.max_context) +
           " (--allow-long to run anyway)";
  // Budgets against this prompt (and moa spans against the model), before its prefill runs.
  const kvstore::RetentionPolicy& policy = r.retention ? *r.retention : o.retention;
  if (Status st = kvstore::retention_check_prompt(policy, cfg.n_layers, cfg.n_kv_heads,
                                                  int64_t(r.tokens.size()));
      !st.is_ok())
    return std::string(r.retention ? "field 'retention'" : "--retention") + ": " + st.message();
  // A line's own f32 export would hold bf16 values with --kv-host-dtype bf16.
  if (o.kv_host_bf16 && r.kv_dtype && stores_f32(*r.kv_dtype))
    return "field 'kv_dtype': an f32 export needs --kv-host-dtype f32 (this job keeps bf16 K/V)";
  // Two tiers: a retention's high= and a HIGH+LOW encoding come together.
  const bool high = policy.high > 0;
  const bool two = (r.kv_dtype ? *r.kv_dtype : o.kv_dtype).low.has_value();
  if (high && !two) return "a retention with high= needs a two-tier kv_dtype (HIGH+LOW)";
  if (!high && two) return "a two-tier kv_dtype (HIGH+LOW) needs a retention with high=";
  return "";
}

}  // namespace

std::vector<runtime::BatchRequest> check_requests(runtime::BatchFile& bf,
                                                  const model::ModelConfig& cfg,
                                                  const model::Tokenizer* tok, const Options& o) {
  std::vector<runtime::BatchRequest> good;
  for (auto& r : bf.requests) {
    if (std::string why = why_bad(r, cfg, tok, o); !why.empty())
      bf.bad.push_back({r.line, std::move(why)});
    else
      good.push_back(std::move(r));
  }
  bf.requests.clear();  // moved from
  return good;
}

}  // namespace sf::worker
