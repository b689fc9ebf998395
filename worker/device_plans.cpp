#include "worker/device_plans.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string_view>

#include "common/timing.h"
#include "worker/job_comm.h"

namespace sf::worker {

DevicePlans::DevicePlans(Setup s) : s_(std::move(s)) {
  const char* cache_env = std::getenv("SF_DEVICE_BUFFER_CACHE");
  if (!(cache_env && std::string_view(cache_env) == "0"))
    buffers_ = std::make_shared<model::DeviceBufferCache>();
}

Result<runtime::ParallelResult> DevicePlans::run(std::span<const int32_t> tokens,
                                                 const runtime::ParallelOptions& po,
                                                 const model::LayerKvHooks& hooks) {
  runtime::GridComms& g = *s_.g;
  const Options& o = *s_.o;
  const int64_t T = int64_t(tokens.size());
  const std::array<int64_t, 3> key{T, po.importance_window, po.importance_pool};
  double plan_s = 0;
  if (!plan_ || key_ != key) {
    const auto p0 = std::chrono::steady_clock::now();
    // Its device workspace and pinned host KV go back to the cache first.
    plan_.reset();
    model::PrefillOptions dopt;
    dopt.buffers = buffers_;
    dopt.kv_staging_layers = o.kv_staging_layers;
    dopt.kv_staging_max_bytes = o.kv_staging_max_bytes();
    dopt.chunk = o.chunk;
    dopt.keep_kv = true;  // this rank's rows of its KV heads, for the sharded export
    dopt.kv_host_bf16 = s_.sizing->host_bf16();
    dopt.sparse = po.sparse;
    dopt.importance_window = po.importance_window;
    dopt.importance_pool = po.importance_pool;
    // The plan is kept for later requests: it calls whichever request runs it.
    dopt.on_layer_done = [this](int l) {
      if (on_layer_) on_layer_(l);
    };
    if (po.sparse && sparse_cap_tokens_ > 0)
      dopt.sparse_capacity = runtime::scaled_sparse_capacity(sparse_cap_, sparse_cap_tokens_, T);
    const bool carry = dopt.sparse_capacity != std::array<int, 2>{0, 0};
    runtime::DeviceParallelOptions popt;
    popt.before_tp_sum = s_.before_tp_sum;
    auto plan = runtime::DeviceParallelPrefill::plan(*s_.dm, g, *s_.dgrid, T, dopt, popt);
    Status ok = agree(*g.group_comm, plan.status());
    if (g.group_comm->aborted()) end_job(g.group_comm->abort_status());
    carried_ = ok.is_ok() && carry;
    if (!ok.is_ok() && carry) {
      // The carried capacity may not fit this length's device memory: the defaults then.
      { auto dropped = std::move(plan); }  // a rank whose own plan succeeded frees it first
      dopt.sparse_capacity = {0, 0};
      plan = runtime::DeviceParallelPrefill::plan(*s_.dm, g, *s_.dgrid, T, dopt, popt);
      ok = agree(*g.group_comm, plan.status());
      if (g.group_comm->aborted()) end_job(g.group_comm->abort_status());
    }
    plan_s = sf::seconds_since(p0);
    if (!ok.is_ok()) {
      if (!buffers_) staging_held_ = 0;
      return ok;
    }
    plan_.emplace(std::move(plan).value());
    key_ = key;
    const int64_t staged = s_.sizing->staging_bytes(T);
    staging_held_ = buffers_ ? std::max(staging_held_, staged) : staged;
  }
  on_layer_ = po.on_layer;
  if (!on_layer_) on_layer_ = [beat = s_.beat](int) { if (beat) beat(); };
  auto pr = plan_->run(tokens, hooks);
  on_layer_ = nullptr;
  if (pr.is_ok()) {
    pr.value().stats.plan_s = plan_s;
    if (pr.value().stats.sparse_grows > 0 || carried_) {
      sparse_cap_ = plan_->prefill().sparse_capacity();
      sparse_cap_tokens_ = T;
      carried_ = true;  // this plan's capacity is now a grown one
    }
  }
  return pr;
}

void DevicePlans::drop_after_failure() {
  plan_.reset();
  // Its buffers went back to the cache only where this rank's own run succeeded; where they were
  // freed the pinned staging is gone from the host check's ledger too.
  staging_held_ = buffers_ ? std::min<int64_t>(staging_held_, int64_t(buffers_->host_bytes_held()))
                           : 0;
}

std::optional<model::PlanTimes> DevicePlans::plan_times() const {
  if (!plan_) return std::nullopt;
  return plan_->prefill().plan_times();
}

int64_t DevicePlans::workspace_bytes() const {
  return plan_ ? int64_t(plan_->prefill().workspace_bytes()) : 0;
}

}  // namespace sf::worker
