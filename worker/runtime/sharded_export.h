// The sharded KV export of one prefilled request (docs/kv-format.md "Shards"), for the TP x CP
// runtimes on CPUs and GPUs alike: the KV stays on the rank that computed it.
#pragma once
#include <string>

#include "common/status.h"
#include "kvstore/kv_export.h"
#include "worker/model/model.h"
#include "worker/runtime/grid.h"

namespace sf::runtime {

// The sharded export of one request (docs/kv-format.md "Shards"), collective over the group:
// the leader opens the export's temporary directory and broadcasts its path; every rank writes
// the shards of its own rows and KV heads there (kvstore::export_kv_shards) and sends their
// manifest entries, or its error, to the leader; the leader checks it can see every shard (a
// group spread over hosts needs --out on a shared filesystem), writes the manifest and moves the
// export into place. Returns the same status on every rank.
// `local` is this rank's rows (its CP chunks in prompt order) of its TP slice's KV heads, F32
// token-major, as parallel_prefill's local_kv or the device runtime's keep_kv return it; spec
// is the whole request's (every rank passes the same).
Status export_sharded(GridComms& g, const std::string& dir, const kvstore::KvExportSpec& spec,
                      const model::KvCache& local);

}  // namespace sf::runtime
