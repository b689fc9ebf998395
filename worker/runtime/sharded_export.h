// The sharded KV export of one prefilled request (docs/kv-format.md "Shards"), for the TP x CP
// runtimes on CPUs and GPUs alike: the KV stays on the rank that computed it.
#pragma once
#include <array>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "kvstore/kv_export.h"
#include "worker/model/model.h"
#include "worker/runtime/grid.h"

namespace sf::runtime {

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
};

// begin, write and finish in one call.
Status export_sharded(GridComms& g, const std::string& dir, const kvstore::KvExportSpec& spec,
                      const model::KvCache& local);

}  // namespace sf::runtime
