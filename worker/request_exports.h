// A worker rank's request exports: begun on the job's thread (a sharded export's collective
// opening; a streamed export before its own prefill, the others after it), their files written
// on a thread of their own, and completed (the manifest, the summary) by the job's thread once
// the next request's prefill is done, or at once with --export-overlap off. A rank holds at most
// two requests' K/V: the one being prefilled and the one being written, whose layers are freed
// as their files are written (kvstore::ExportOptions::on_layer_written).
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvstore/kv_export.h"
#include "kvstore/retention.h"
#include "worker/model/device_model.h"
#include "worker/model/model.h"
#include "worker/options.h"
#include "worker/runtime/batch.h"
#include "worker/runtime/batch_metrics.h"
#include "worker/runtime/grid.h"
#include "worker/runtime/parallel_prefill.h"
#include "worker/runtime/sharded_export.h"

namespace sf::worker {

struct WriteOutcome {
  std::string mine;  // sharded: this rank's entries for the leader (ShardedExport::write)
  Status st;         // gathered (leader): the export's outcome
  double seconds = 0;
};

// One request's export. It owns everything its export and summary read; the write thread reads
// it by reference, so `write` is the last member (destroyed first: its destructor waits for the
// thread).
struct PendingExport {
  const runtime::BatchRequest* r = nullptr;
  int64_t k = 0;  // its place in this group's share
  kvstore::KvEncodings encs;
  std::string fingerprint, dir;
  int64_t reused_tokens = 0;
  runtime::ParallelResult res;
  kvstore::KvExportSpec spec;
  std::optional<kvstore::ImportanceScores> imp;
  kvstore::Retention ret;
  double kept_frac = 1.0;
  std::optional<model::PlanTimes> plan;  // --device cuda, when this request planned
  int64_t device_workspace_bytes = 0;     // --device cuda: the plan this request ran on
  double memory_wait_s = 0;              // before its prefill, for memory the pending export held
  double begin_s = 0;
  Status begun;  // the sharded export's opening (the same on every rank)
  std::unique_ptr<runtime::ShardedExport> sharded;
  // Host K/V the export holds, and what it has freed so far (layers whose files are written).
  int64_t held_bytes = 0;
  std::atomic<int64_t> freed_bytes{0};
  std::atomic<int> freed_layers{0};
  std::atomic<int> written_layers{0};  // this rank's layers whose files are written
  // A streamed export (--export-stream): begun before the prefill, it reads each layer from
  // `gate` as the prefill publishes it. Until the prefill's result is attached (res), a written
  // layer cannot be freed yet: it is noted in written_early and freed at attach().
  std::unique_ptr<runtime::LayerGate> gate;
  int written_at_prefill_end = 0;  // written_layers when the prefill ended (streamed only)
  std::mutex attach_mu;
  bool attached = true;
  std::vector<int> written_early;
  // Last, so it is destroyed first: its destructor waits for the writer, which updates the
  // counters above.
  std::future<WriteOutcome> write;

  // A streamed export's result is in `res`: the layers written so far are freed now, later ones
  // as they are written.
  void attach();
  // Whether its writer has finished (or never started).
  bool written() const;
  // A streamed export dropped unfinished (an exception unwinding past it): its writer may wait
  // for a layer no prefill will publish; failing the gate first lets `write`'s destructor return
  // (this body runs before the members are destroyed).
  ~PendingExport();
};

// Layer l of a streamed export's prefill is final: its importance (when the export has any)
// copied into place, then its rows published to the writer.
Status publish_layer(PendingExport& x, int l, const model::KvCache& kv,
                     std::span<const float> imp);

class RequestExports {
 public:
  struct Setup {
    const Options* o = nullptr;
    runtime::GridComms* g = nullptr;
    const model::Model* m = nullptr;
    Fault fault;
    int world_rank = 0;
    bool device = false;     // --device cuda (the host's cores are free during a prefill)
    bool host_bf16 = false;  // the job's host K/V dtype, for the summary
    bool prefix_cache = false;
    int64_t my_total = 0;  // this group's share of the batch, for the progress lines
    runtime::BatchMetrics* metrics = nullptr;
    std::function<void()> beat;  // a progress note, from the job's thread only
  };
  explicit RequestExports(Setup s);

  // A request's export, its spec filled in but first_token (and retention, importance).
  std::unique_ptr<PendingExport> make(const runtime::BatchRequest& r,
                                      const kvstore::KvEncodings& encs,
                                      const std::string& fingerprint, int64_t k) const;
  // Opens it (sharded: a collective of the group) and starts its writer.
  void start(PendingExport& x);
  // A streamed export whose request failed (on every rank of the group alike, so they all come
  // here): the failed gate stops the writer at its next layer (published or not), and the
  // group's finish, told of the failure by every rank, removes the partial export.
  void abandon(std::unique_ptr<PendingExport> x, const Status& why);
  // Waits for its writer, finishes it (the manifest: a collective of the group) and, on the
  // leader, writes its summary and prints its line. False where the leader's export or summary
  // failed (said on stderr); other ranks return true.
  bool complete(std::unique_ptr<PendingExport> x);
  // SF_WORKER_FAULT=freeing: ms slept after each layer freed (0 otherwise).
  int freeing_ms() const { return freeing_ms_; }

 private:
  WriteOutcome wait_writer(PendingExport& x);
  std::function<void(int)> free_layer_when_written(PendingExport& x) const;
  bool write_summary(const PendingExport& x, const WriteOutcome& w, double wait_s, double finish_s);
  bool group_aborted() const;

  Setup s_;
  int width_;  // shard files a rank writes at once
  int freeing_ms_;
};

}  // namespace sf::worker
