// A worker group's batch loop (sparsefill-worker, worker_main.cpp): this group's share of the
// requests, one at a time. For each, the resume check; host memory for its KV beside the export
// still being written (waiting while that export frees its layers); the prefill (host, device
// plans or prefix cache, a streamed export alongside); its retention; and its export, completed
// once the next request's prefill is done (or at once with --export-overlap off). Every rank of
// a group makes the same collective calls in the same order: each decision that picks the next
// one is agreed over the group first.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "worker/device_plans.h"
#include "worker/host_kv.h"
#include "worker/model/device_model.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"
#include "worker/options.h"
#include "worker/prefix_requests.h"
#include "worker/request_exports.h"
#include "worker/runtime/batch.h"
#include "worker/runtime/batch_metrics.h"
#include "worker/runtime/device_parallel.h"
#include "worker/runtime/grid.h"
#include "worker/runtime/parallel_prefill.h"

namespace sf::worker {

class BatchLoop {
 public:
  struct Setup {
    const Options* o = nullptr;
    const model::Model* m = nullptr;
    runtime::GridComms* g = nullptr;
    comm::Communicator* world = nullptr;
    Fault fault;
    const model::DeviceModel* dm = nullptr;  // --device cuda
    runtime::DeviceGrid* dgrid = nullptr;    // --device cuda
    PrefixRequests* prefix = nullptr;        // --prefix-cache
    const model::SparseConfig* sparse = nullptr;
    const HostKvSizing* sizing = nullptr;
    runtime::BatchMetrics* metrics = nullptr;
    std::string job;  // the request fingerprint's job part (job_identity)
    bool host_bf16 = false;
    int local_ranks = 1;   // ranks on this host (its memory is theirs together)
    int64_t my_total = 0;  // this group's share of the batch
    // This rank's available host memory (the memory faults stand in for it in tests);
    // beside_pending: for the export overlap's check.
    std::function<int64_t(bool beside_pending)> host_avail;
    std::function<void(int64_t)> beat;  // the group's progress note: requests done with
    // Ends the job (never returns): a collective failed or a communicator was aborted.
    std::function<void(const Status&)> fatal;
  };
  // Makes the request exports and, with --device cuda, the device plans; agrees on
  // SF_WAIT_WHOLE_EXPORT over the world (a collective: every rank constructs one, in order).
  explicit BatchLoop(Setup s);
  // The exports and plans call back into it (progress notes): it stays where it was made.
  BatchLoop(const BatchLoop&) = delete;
  BatchLoop& operator=(const BatchLoop&) = delete;

  // The next request of this group's share.
  void request(const runtime::BatchRequest& r);
  // Completes the last pending export.
  void drain();
  // --metrics-file: the group's counts so far (warned once when the file cannot be written).
  void publish(bool in_flight, bool finished);

  int64_t done() const { return n_done_; }
  int64_t skipped() const { return n_skipped_; }
  int64_t failed() const { return n_failed_; }

 private:
  // Whether the group has host memory for r's KV (T tokens), waiting first while a pending
  // export frees its layers or completes; false when it does not fit on its own (reported,
  // counted). *wait_s: the seconds waited.
  bool admit(const runtime::BatchRequest& r, double* wait_s);
  // Whether any rank of the group is short of host memory for `need` bytes of KV plus `staging`
  // of pinned staging, of which the device plan holds `staging_held` already (beside the pending
  // export when beside_pending); *room: the least a host of the group may give. A collective of
  // the group.
  bool group_short(int64_t need, int64_t staging, int64_t staging_held, bool beside_pending,
                   int64_t* room);
  // The prefill's options for a request under `policy`, with the test faults' layer hooks.
  runtime::ParallelOptions options(const kvstore::RetentionPolicy& policy);
  // --export-stream: a full-retention sharded export begun before the prefill, which writes
  // each layer as the prefill publishes it (through hooks set in po); null when not streamed.
  std::unique_ptr<PendingExport> stream_export(const runtime::BatchRequest& r,
                                               const kvstore::RetentionPolicy& policy,
                                               const kvstore::KvEncodings& encs,
                                               const std::string& fingerprint,
                                               runtime::ParallelOptions* po,
                                               model::LayerKvHooks* hooks);
  // After a successful prefill: the export's retention and spec, a streamed export's rows
  // checked in place and attached. Null when the request failed (reported, counted).
  std::unique_ptr<PendingExport> prepare_export(const runtime::BatchRequest& r,
                                                const kvstore::RetentionPolicy& policy,
                                                const runtime::ParallelOptions& po,
                                                std::unique_ptr<PendingExport> x,
                                                runtime::ParallelResult* res);
  void fail(const runtime::BatchRequest& r, const std::string& why);
  void complete(std::unique_ptr<PendingExport> x);
  void beat() { s_.beat(k_); }

  Setup s_;
  std::optional<RequestExports> exports_;
  std::optional<DevicePlans> dplans_;
  bool wait_whole_export_ = false;
  bool stream_exports_ = false;
  int freeing_ms_ = 0;
  int64_t k_ = 0;  // requests of the share begun
  bool first_request_ = true;
  bool metrics_warned_ = false;
  std::chrono::steady_clock::time_point last_publish_{};  // the metrics file's last rewrite
  int64_t n_done_ = 0, n_skipped_ = 0, n_failed_ = 0;
  std::unique_ptr<PendingExport> pending_;  // the export being written beside the next prefill
};

}  // namespace sf::worker
