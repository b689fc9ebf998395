// --dry-run's plan, printed by rank 0: what a run of this batch would do, with nothing computed
// or written.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "worker/host_kv.h"
#include "worker/model/config.h"
#include "worker/options.h"
#include "worker/runtime/batch.h"

namespace sf::worker {

// One line a request: its group (round-robin, as the run assigns), whether a run would compute
// or skip it (resume, against --out), its K/V bytes in the export's encoding (at most that under
// a retention) and its host KV; then the totals and the peak host memory a rank would hold for
// KV, against `avail` bytes this host has available. `job`: the request fingerprint's job part.
void print_dry_run(const Options& o, const model::ModelConfig& cfg,
                   const std::vector<runtime::BatchRequest>& good, int n_groups,
                   const std::string& job, const HostKvSizing& sizing, int local_ranks,
                   int64_t avail);

}  // namespace sf::worker
