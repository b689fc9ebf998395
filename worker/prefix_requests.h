// --prefix-cache: a rank's requests computed behind its prefix cache (a group of one rank, dense
// attention). The cache's pool holds the budget's bytes in host memory, or in device memory with
// --device cuda, where a hit's prefix rows reach the attention device to device. A request
// sharing whole 64-token blocks with an earlier one computes only the rest (model::extend on the
// CPU; a one-piece shard on the device); the importance window's rows are always computed, so a
// hit scores as a full prefill.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "kvstore/block_pool.h"
#include "kvstore/prefix_cache.h"
#include "kvstore/prefix_prefill.h"
#include "worker/model/device_model.h"
#include "worker/model/model.h"
#include "worker/options.h"
#include "worker/runtime/batch.h"
#include "worker/runtime/parallel_prefill.h"

namespace sf::worker {

class PrefixRequests {
 public:
  // kInvalidArgument when o.prefix_cache_bytes holds no entry (a block of every layer) of a
  // model of `cfg`: a start-up error, the same on every rank, and one --dry-run reports too.
  static Status check_budget(const Options& o, const model::ModelConfig& cfg);
  // The pool and cache of o.prefix_cache_bytes (check_budget first); dm: the rank's device model
  // (--device cuda) or null. model_compat: the export spec's compatibility hash, which names the
  // cache's entries.
  static Result<std::unique_ptr<PrefixRequests>> create(const Options& o, const model::Model& m,
                                                        const model::DeviceModel* dm,
                                                        std::string model_compat);

  // The request's prefill behind the cache, as the group path's result (this rank's stats
  // filled for a group of one); reused_tokens: its prompt tokens taken from the cache. po: its
  // importance settings and on_layer (progress and fault injection).
  Result<runtime::ParallelResult> run(const runtime::BatchRequest& r,
                                      const runtime::ParallelOptions& po, int64_t* reused_tokens);
  int64_t reused_total() const { return reused_total_; }
  // --device cuda: the device memory its runners' kept plans hold (0 on the CPU).
  int64_t device_workspace_bytes() const;

 private:
  PrefixRequests() = default;
  const Options* o_ = nullptr;
  const model::Model* m_ = nullptr;
  const model::DeviceModel* dm_ = nullptr;
  std::string model_compat_;
  std::unique_ptr<kvstore::BlockPool> pool_;
  std::unique_ptr<kvstore::PrefixCache> cache_;
  // On the device, a runner per importance setting (window, pool): each keeps its last plans, so
  // requests of one shape behind one cached prefix plan once. Their progress callback is each
  // request's.
  std::function<void(int)> layer_done_;
  std::map<std::pair<int, int>, std::unique_ptr<kvstore::DevicePrefixPrefill>> runners_;
  int64_t reused_total_ = 0;
};

}  // namespace sf::worker
