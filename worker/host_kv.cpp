#include "worker/host_kv.h"

#include <utility>

#include "worker/model/model.h"

namespace sf::worker {

HostKvSizing::HostKvSizing(const Options& o, const model::ModelConfig& cfg, bool host_bf16,
                           std::vector<int> host_ranks)
    : cfg_(cfg),
      cuda_(o.device == "cuda"),
      sharded_(o.export_mode == "sharded"),
      selective_kv_(o.selective_kv),
      host_bf16_(host_bf16),
      tp_(o.tp),
      cp_(o.cp),
      staging_layers_(o.kv_staging_layers),
      staging_max_bytes_(o.kv_staging_max_bytes()),
      row_(int64_t(cfg.head_dim) * 2 * (host_bf16 ? 2 : int64_t(sizeof(float)))),
      host_ranks_(std::move(host_ranks)) {}

int64_t HostKvSizing::rank_rows(int64_t T) const {
  if (!sharded_) return T;
  if (cuda_ && cp_ > 1 && T < 2 * int64_t(cp_) * 64) return T;
  return (T + cp_ - 1) / cp_;
}

int64_t HostKvSizing::rank_layer_bytes(int64_t T) const {
  return rank_rows(T) * (sharded_ ? cfg_.n_kv_heads / tp_ : cfg_.n_kv_heads) * row_;
}

int64_t HostKvSizing::rank_bytes(int64_t T) const {
  const int64_t layer = cuda_ ? 0 : 2 * T * (cfg_.n_kv_heads / tp_) * row_;
  return rank_layer_bytes(T) * cfg_.n_layers + layer;
}

int64_t HostKvSizing::host_bytes(int64_t T) const {
  int64_t sum = 0;
  for (const int r : host_ranks_) {
    const int gr = r % (tp_ * cp_), cp_rank = gr / tp_;
    if (sharded_ || gr == 0) {
      sum += rank_bytes(T);
      continue;
    }
    const int64_t slice = int64_t(cfg_.n_kv_heads / tp_) * row_;  // a token of a TP slice's heads
    const int64_t keep = cp_rank == 0    ? T * slice
                         : selective_kv_ ? (T + cp_ - 1) / cp_ * slice
                                         : 0;
    sum += keep * cfg_.n_layers + (cuda_ ? 0 : 2 * T * slice);
  }
  return sum;
}

int64_t HostKvSizing::staging_bytes(int64_t T) const {
  if (!cuda_) return 0;
  model::PrefillOptions po;
  po.kv_staging_layers = staging_layers_;
  po.kv_staging_max_bytes = staging_max_bytes_;
  const int64_t slot = rank_layer_bytes(T);
  return slot * model::kv_staging_slots(po, cfg_.n_layers, slot);
}

}  // namespace sf::worker
