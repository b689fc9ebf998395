// The sharded KV export of one prefilled request (docs/kv-format.md "Shards"), for the TP x CP
// runtimes on CPUs and GPUs alike: the KV stays on the rank that computed it.
#pragma once
#include <array>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "kvstore/kv_export.h"
#include "worker/model/model.h"
#include "worker/runtime/grid.h"

namespace sf::runtime {

// The layers of a prefill that is still running, as a streamed export reads them
// (kvstore::ExportOptions::wait_layer): the prefill's thread publishes each layer once its K/V
// rows are final (model::LayerKvHooks::final: PrefillOptions::kv_hooks on the device,
// ParallelOptions::kv_hooks on the CPU grid), and the export's writing threads wait for the
// layer they write next. Rows stay where the prefill
// put them: its result must keep them in place (moving it does) until the export is done.
class LayerGate {
 public:
  explicit LayerGate(int n_layers);
  // Layer l of kv (F32 or bf16) is final. Publishing a layer twice is an error.
  Status publish(int l, const model::KvCache& kv);
  // The export is abandoned: every wait, now and later, gets st, published layers' too (so a
  // failed request's writer stops at its next layer instead of writing the rest).
  void fail(Status st);
  // Until layer l is published (ok) or the gate has failed (the failure).
  Status wait(int l);
  // Layer l's K (value false) or V rows; after wait(l) succeeded.
  kvstore::LayerRows rows(int l, bool value) const;
  bool published(int l) const;
  int n_published() const;
  // Every published layer's rows are still those kv holds (the result kept them in place).
  Status check_in_place(const model::KvCache& kv) const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::array<kvstore::LayerRows, 2>> rows_;
  std::vector<char> ready_;
  int n_ready_ = 0;
  Status failed_;
};

// The sharded export of one request in three steps, so that a batch can write one request's
// files while the next request's prefill runs (sparsefill-worker --export-overlap):
//  - begin (collective over the group): the leader opens the export's temporary directory and
//    broadcasts its path; with a retention other than full, the rows that change rank at a
//    block boundary move (docs/kv-format.md "Shards");
//  - write (this rank alone, no communication; may run on another thread): the shards of its
//    own rows and KV heads (kvstore::export_kv_shards);
//  - finish (collective): every rank's manifest entries, or its error, reach the leader, which
//    checks it can see every shard (a group spread over hosts needs --out on a shared
//    filesystem), writes the manifest and moves the export into place. Returns the same status
//    on every rank.
// `local` is this rank's rows (its CP chunks in prompt order) of its TP slice's KV heads, F32 (or
// bf16: KvCache::bf16(), widened where a retention's rows move or are gathered) token-major, as parallel_prefill's local_kv or the device runtime's keep_kv return it; spec
// is the whole request's (every rank passes the same). Both must outlive the ShardedExport.
class ShardedExport {
 public:
  [[nodiscard]] static Result<std::unique_ptr<ShardedExport>> begin(
      GridComms& g, const std::string& dir, const kvstore::KvExportSpec& spec,
      const model::KvCache& local);
  // This rank's shards; what finish sends the leader ("ok" and one manifest entry a line, or
  // "error" and the message). Call once. eo.layers_in_flight shard files are written at once:
  // full retention's layers, or a retention's (layer, KV head) parts. eo.on_layer_written comes
  // once a layer, when its files (every part, every tier) are written.
  std::string write(const kvstore::ExportOptions& eo = {});
  // A streamed export (full retention only): the same files, each layer read from `gate` once
  // the prefill has published it, instead of from `local` (which begin did not read). Call once,
  // instead of write.
  std::string write_streamed(LayerGate& gate, kvstore::ExportOptions eo);
  [[nodiscard]] Status finish(GridComms& g, const std::string& written);

  // A retention tier's cut on this rank (sharded_export.cpp).
  struct Tier;
  ~ShardedExport();

 private:
  ShardedExport() = default;
  std::string dir_, tmp_;
  const kvstore::KvExportSpec* spec_ = nullptr;
  const model::KvCache* local_ = nullptr;
  int cp_ = 1, cp_rank_ = 0, tp_rank_ = 0, rank_ = 0;
  std::vector<std::unique_ptr<Tier>> tiers_;  // empty with full retention
  int kv_heads_ = 0;  // this rank's TP slice's KV heads
  std::string write_full(const kvstore::LayerSource& src, const kvstore::ExportOptions& eo);
};

// begin, write and finish in one call.
Status export_sharded(GridComms& g, const std::string& dir, const kvstore::KvExportSpec& spec,
                      const model::KvCache& local);

}  // namespace sf::runtime
