#include "worker/prefix_requests.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "common/timing.h"

namespace sf::worker {

namespace {
kvstore::BlockPoolConfig pool_config(const Options& o, const model::ModelConfig& cfg, bool device) {
  kvstore::BlockPoolConfig pc;
  pc.n_kv_heads = cfg.n_kv_heads;
  pc.head_dim = cfg.head_dim;
  (device ? pc.device_bytes : pc.host_bytes) = o.prefix_cache_bytes;
  return pc;
}
}  // namespace

Status PrefixRequests::check_budget(const Options& o, const model::ModelConfig& cfg) {
  // An entry is a block for each layer: a smaller budget would accept the option and cache
  // nothing, warning at every request. (A block's bytes do not depend on its tier.)
  const int64_t entry =
      int64_t(cfg.n_layers) * kvstore::BlockPool::block_bytes_for(pool_config(o, cfg, false));
  if (o.prefix_cache_bytes < entry)
    return SF_ERR(kInvalidArgument, "--prefix-cache " + std::to_string(o.prefix_cache_bytes) +
                                        " bytes holds no cache entry: one (" +
                                        std::to_string(kvstore::kPoolBlockTokens) +
                                        " tokens of every layer's K and V) takes " +
                                        std::to_string(entry) + " bytes for this model");
  return Status::ok();
}

Result<std::unique_ptr<PrefixRequests>> PrefixRequests::create(const Options& o,
                                                               const model::Model& m,
                                                               const model::DeviceModel* dm,
                                                               std::string model_compat) {
  const model::ModelConfig& cfg = m.config();
  if (Status st = check_budget(o, cfg); !st.is_ok()) return st;
  auto pool = kvstore::BlockPool::create(pool_config(o, cfg, dm != nullptr));
  if (!pool.is_ok()) return pool.status();
  std::unique_ptr<PrefixRequests> p(new PrefixRequests);
  p->o_ = &o;
  p->m_ = &m;
  p->dm_ = dm;
  p->model_compat_ = std::move(model_compat);
  p->pool_ = std::move(pool).value();
  p->cache_ = std::make_unique<kvstore::PrefixCache>(p->pool_.get(), cfg.n_layers,
                                                     o.prefix_cache_bytes);
  return p;
}

Result<runtime::ParallelResult> PrefixRequests::run(const runtime::BatchRequest& r,
                                                    const runtime::ParallelOptions& po,
                                                    int64_t* reused_tokens) {
  const Options& o = *o_;
  kvstore::PrefixPrefillOptions ppo;
  ppo.prefill.chunk = o.chunk;
  ppo.prefill.keep_kv = true;
  ppo.prefill.importance_window = po.importance_window;
  ppo.prefill.importance_pool = po.importance_pool;
  ppo.prefill.kv_staging_layers = o.kv_staging_layers;
  ppo.prefill.kv_staging_max_bytes = o.kv_staging_max_bytes();
  ppo.min_suffix = std::max(1, po.importance_window);
  if (dm_)
    layer_done_ = po.on_layer;  // progress and fault injection
  else if (po.on_layer)         // fault injection (tests): at the layer's end here, not its start
    ppo.prefill.on_layer_kv = [&po](int l, const TensorView&, const TensorView&,
                                    std::span<const float>) {
      po.on_layer(l);
      return Status::ok();
    };
  kvstore::PrefixPrefillStats pst;
  const auto t0 = std::chrono::steady_clock::now();
  Result<model::PrefillResult> hr = SF_ERR(kInternal, "not run");
  if (dm_) {
    auto& runner = runners_[{ppo.prefill.importance_window, ppo.prefill.importance_pool}];
    if (!runner) {
      ppo.prefill.on_layer_done = [this](int l) {
        if (layer_done_) layer_done_(l);
      };
      runner = std::make_unique<kvstore::DevicePrefixPrefill>(*dm_, cache_.get(), model_compat_,
                                                              ppo);
    }
    hr = runner->run(r.tokens, &pst);
  } else {
    hr = kvstore::prefill_with_prefix_cache(*m_, cache_.get(), model_compat_, r.tokens, ppo, &pst);
  }
  if (!hr.is_ok()) return hr.status();
  runtime::ParallelResult out;
  out.first_token = hr->first_token;
  out.kv = std::move(hr->kv);
  out.importance = std::move(hr->importance);
  // A plan the runner made (a new prompt shape) is plan_s, not prefill_s, as on the group path.
  runtime::ParallelStats& s = out.stats;
  s.plan_s = pst.plan_s;
  s.seconds = sf::seconds_since(t0) - pst.plan_s;
  s.attention_s = hr->attention_s;
  s.estimate_s = hr->estimate_s;
  s.importance_s = hr->importance_s;
  s.kv_alloc_s = hr->kv_alloc_s;
  s.kv_copy_s = hr->kv_copy_s;
  s.sparse_grows = hr->sparse_grows;
  s.kv_moved_bytes_by_rank = {0};  // one rank, nothing moved (as parallel_prefill)
  s.estimate_bytes_by_rank = {0};
  s.seconds_by_rank = {s.seconds};
  s.attention_s_by_rank = {s.attention_s};
  s.comm_s_by_rank = {0.0};
  s.density_by_rank = {s.density};
  *reused_tokens = pst.reused_tokens;
  reused_total_ += pst.reused_tokens;
  if (!pst.insert_status.is_ok())
    std::fprintf(stderr, "%s: prefix cache: not all of its blocks were cached: %s\n",
                 r.id.c_str(), pst.insert_status.message().c_str());
  return out;
}

int64_t PrefixRequests::device_workspace_bytes() const {
  int64_t n = 0;
  for (const auto& [key, runner] : runners_) n += runner->workspace_bytes();
  return n;
}

}  // namespace sf::worker
