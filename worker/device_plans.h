// --device cuda: a group rank's device prefill plans. A plan is made per prompt length (its
// shapes, zigzag pieces and sparse plans depend on it) and kept: a request of the same length
// and importance settings runs on it without planning again. Between plans the device workspace
// and pinned host staging go to a model::DeviceBufferCache, for the next plan to take where they
// are large enough; a sparse index capacity some run had to grow is carried to the next length's
// plan, scaled to it.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>

#include "worker/host_kv.h"
#include "worker/model/device_model.h"
#include "worker/options.h"
#include "worker/runtime/batch.h"
#include "worker/runtime/device_parallel.h"
#include "worker/runtime/grid.h"
#include "worker/runtime/parallel_prefill.h"

namespace sf::worker {

class DevicePlans {
 public:
  struct Setup {
    const Options* o = nullptr;
    const model::DeviceModel* dm = nullptr;
    runtime::GridComms* g = nullptr;
    runtime::DeviceGrid* dgrid = nullptr;
    const HostKvSizing* sizing = nullptr;
    std::function<void()> beat;  // a stall note at each layer, as the CPU paths' on_layer
    std::function<void(int64_t)> before_tp_sum;  // the stop_sum test fault (DeviceParallelOptions)
  };
  // SF_DEVICE_BUFFER_CACHE=0 frees a plan's buffers instead of keeping them for the next plan
  // (bench/mpi/plan_reuse.sh's comparison).
  explicit DevicePlans(Setup s);
  // Its plans call back into it (the request's per-layer callback): it stays where it was made.
  DevicePlans(const DevicePlans&) = delete;
  DevicePlans& operator=(const DevicePlans&) = delete;

  // Collective over the group: plans when the last plan was for another length or importance
  // setting (one rank's plan failure is the group's, agreed), then runs. po: the request's
  // sparse config, importance settings and per-layer callback (po.on_layer: progress notes and
  // the test faults; Setup::beat where it has none), which a kept plan calls for this request.
  // The result's stats.plan_s is this call's planning.
  Result<runtime::ParallelResult> run(std::span<const int32_t> tokens,
                                      const runtime::ParallelOptions& po,
                                      const model::LayerKvHooks& hooks);
  // After the group agreed that a request failed: a plan whose run failed may hold a half-done
  // state, so the next request plans afresh (every rank of the group alike).
  void drop_after_failure();
  // Pinned K/V staging the kept plan (or the buffer cache) holds, for the host memory check.
  int64_t staging_held() const { return staging_held_; }
  // Where the last planning's time went, while its plan is kept.
  std::optional<model::PlanTimes> plan_times() const;
  // The kept plan's device workspace (weights excluded; after any grow of its sparse arena).
  int64_t workspace_bytes() const;

 private:
  Setup s_;
  std::shared_ptr<model::DeviceBufferCache> buffers_;  // null: SF_DEVICE_BUFFER_CACHE=0
  std::optional<runtime::DeviceParallelPrefill> plan_;
  std::array<int64_t, 3> key_{-1, -1, -1};  // its tokens, importance window, pool
  std::function<void(int layer)> on_layer_;  // the running request's (po.on_layer)
  // A cache keeps the largest plan's pinned staging; without one each plan pins its own.
  int64_t staging_held_ = 0;
  // The last grown sparse index capacity and its prompt length: a new length's plan starts there
  // (scaled to its length) instead of at the estimators' default, which the data may outgrow,
  // and running the whole prefill again costs as much as the prefill. Only a capacity some run
  // grew is carried: the defaults are not a need (their column default is a constant, which
  // scaled to a longer prompt would only waste memory).
  std::array<int, 2> sparse_cap_{0, 0};
  int64_t sparse_cap_tokens_ = 0;
  bool carried_ = false;  // the kept plan started at a carried capacity
};

}  // namespace sf::worker
