#include "kvstore/prefix_prefill.h"

#include <algorithm>

namespace sf::kvstore {

#ifndef SF_KV_CUDA
struct DevicePrefixPrefill::Impl {};
DevicePrefixPrefill::DevicePrefixPrefill(const model::DeviceModel&, PrefixCache*, std::string,
                                         PrefixPrefillOptions) {}
DevicePrefixPrefill::~DevicePrefixPrefill() = default;
Result<model::PrefillResult> DevicePrefixPrefill::run(std::span<const int32_t>,
                                                      PrefixPrefillStats*) {
  return SF_ERR(kUnsupported, "prefix prefill on the device needs a CUDA build");
}
int64_t DevicePrefixPrefill::workspace_bytes() const { return 0; }
#endif

Result<model::PrefillResult> prefill_with_prefix_cache_device(
    const model::DeviceModel& dm, PrefixCache* cache, const std::string& model_id,
    std::span<const int32_t> tokens, const PrefixPrefillOptions& opt, PrefixPrefillStats* stats) {
  DevicePrefixPrefill p(dm, cache, model_id, opt);
  return p.run(tokens, stats);
}

Result<int64_t> prefix_lookup(PrefixCache* cache, const model::ModelConfig& c,
                              const std::string& model_id, std::span<const int32_t> tokens,
                              int64_t min_suffix) {
  SF_ENSURE(cache != nullptr, kInvalidArgument, "prefix prefill: null cache");
  SF_ENSURE(!tokens.empty(), kInvalidArgument, "prefix prefill: empty prompt");
  if (cache->n_layers() != c.n_layers ||
      cache->floats_per_token() != int64_t(c.n_kv_heads) * c.head_dim)
    return SF_ERR(kInvalidArgument,
                  "prefix prefill: cache geometry (" + std::to_string(cache->n_layers()) +
                      " layers, " + std::to_string(cache->floats_per_token()) +
                      " floats per token) does not match the model (" + std::to_string(c.n_layers) +
                      ", " + std::to_string(int64_t(c.n_kv_heads) * c.head_dim) + ")");
  // Leave at least one token to compute (the first generated token needs its logits), or the
  // caller's min_suffix.
  const int64_t S = int64_t(tokens.size());
  return cache->lookup(model_id, tokens, std::max<int64_t>(0, S - std::max<int64_t>(1, min_suffix)));
}

Result<model::PrefillResult> prefill_with_prefix_cache(const model::Model& m, PrefixCache* cache,
                                                       const std::string& model_id,
                                                       std::span<const int32_t> tokens,
                                                       const PrefixPrefillOptions& opt,
                                                       PrefixPrefillStats* stats) {
  const model::ModelConfig& c = m.config();
  // As the device path: a cache keyed by model and tokens serves one attention. A sparse run's
  // K/V past layer 0 depend on its index, and would be served to dense requests.
  SF_ENSURE(opt.prefill.sparse == nullptr, kUnsupported,
            "prefix prefill: dense attention only (cached K/V past the first layer depend on the "
            "attention that computed them)");
  SF_ASSIGN(int64_t P, prefix_lookup(cache, c, model_id, tokens, computed_suffix(opt)));
  const int64_t S = int64_t(tokens.size());
  model::PrefillResult res;
  model::KvCache& kv = res.kv;
  if (P > 0) {
    kv.n_layers = c.n_layers;
    kv.n_kv_heads = c.n_kv_heads;
    kv.head_dim = c.head_dim;
    kv.n_tokens = P;
    const size_t n = size_t(P * c.n_kv_heads * c.head_dim);
    kv.k.assign(size_t(c.n_layers), std::vector<float>(n));
    kv.v.assign(size_t(c.n_layers), std::vector<float>(n));
    const Status rd = cache->read(model_id, tokens, P, [&](int l, bool value) {
      return value ? kv.v[size_t(l)].data() : kv.k[size_t(l)].data();
    });
    if (rd.code() == Code::kNotFound) {
      // Another request evicted part of the prefix between lookup and read: compute it all.
      kv = model::KvCache{};
      P = 0;
    } else {
      SF_TRY(rd);
    }
  }
  model::PrefillOptions po = opt.prefill;
  po.keep_kv = true;  // the blocks to insert come from it
  SF_TRY(model::extend(m, tokens.subspan(size_t(P)), po, &res));
  Status ins;
  if (opt.insert)
    ins = cache->insert(model_id, tokens, [&](int l, bool value) {
      return value ? res.kv.v[size_t(l)].data() : res.kv.k[size_t(l)].data();
    });
  if (!opt.prefill.keep_kv) {
    kv.k.clear();
    kv.v.clear();
  }
  if (stats) {
    stats->reused_tokens = P;
    stats->computed_tokens = S - P;
    stats->insert_status = ins;
  }
  return res;
}

}  // namespace sf::kvstore
