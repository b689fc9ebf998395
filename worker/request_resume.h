// Resume: whether a request of the batch is computed, skipped as complete, or failed before its
// prefill because its old summary cannot be removed. The group leader reads --out; the group
// agrees on its answer.
#pragma once
#include <string>

#include "worker/options.h"
#include "worker/runtime/batch.h"
#include "worker/runtime/grid.h"

namespace sf::worker {

enum class ResumeState { kCompute, kComplete, kFailed };

// Collective over g.group_comm. The leader finds the request complete when DIR/<id>.json holds
// `fingerprint` beside a complete export; otherwise it says why an earlier output is stale and
// removes the old summary before the export is replaced (a job stopped in between must not leave
// a new export beside the old fingerprint). A summary that cannot be removed fails the request
// (its reason on stderr, with the batch line), leaving its export untouched. A failed broadcast
// ends the job.
ResumeState resume_state(const Options& o, runtime::GridComms& g, const runtime::BatchRequest& r,
                         const std::string& fingerprint);

}  // namespace sf::worker
