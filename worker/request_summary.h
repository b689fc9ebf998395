// DIR/<id>.json: the one-line summary a group leader writes beside a request's export once it is
// complete (docs/distributed.md, "Output"). Resume reads its fingerprint; operators and the
// benches read the rest.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "worker/model/device_model.h"
#include "worker/runtime/batch.h"
#include "worker/runtime/parallel_prefill.h"

namespace sf::worker {

struct RequestSummary {
  const runtime::BatchRequest* request = nullptr;
  int32_t first_token = -1;
  int tp = 1, cp = 1, group = 0;
  const runtime::ParallelStats* stats = nullptr;  // the leader's, with the group's totals
  std::string attention, kv_host_dtype, export_mode, device;
  std::string retention;  // policy[:params] as applied
  double kv_kept_fraction = 1.0;
  std::string kv_dtype;  // kvstore::kv_encodings_name
  int64_t prefix_reused_tokens = 0;
  double export_s = 0, export_wait_s = 0, memory_wait_s = 0;
  int64_t export_bytes = 0;
  bool export_streamed = false;
  int export_layers_at_prefill_end = 0;
  std::string fingerprint;
  std::optional<model::PlanTimes> plan;  // --device cuda, when the request planned
  int64_t chunk = 0;                     // tokens per linear-layer chunk
  int64_t device_workspace_bytes = 0;    // --device cuda: its plan's (0 on the CPU)
};

// One JSON object, no newline. Seconds and densities with six decimals.
std::string request_summary_json(const RequestSummary& s);

}  // namespace sf::worker
