#include "worker/request_summary.h"

#include <type_traits>

#include "common/text.h"

namespace sf::worker {
namespace {

// A JSON array of byte counts, or of seconds and densities.
template <typename T>
std::string json_list(const std::vector<T>& v) {
  std::string o = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) o += ", ";
    if constexpr (std::is_floating_point_v<T>)
      o += sformat("%.6f", v[i]);
    else
      o += std::to_string(v[i]);
  }
  return o + "]";
}

std::string plan_json(const std::optional<model::PlanTimes>& p) {
  if (!p) return "null";
  return sformat(
      "{\"total_s\": %.6f, \"device_buffers_s\": %.6f, \"host_buffers_s\": %.6f, "
      "\"sparse_s\": %.6f, \"shapes_s\": %.6f, \"reused_bytes\": %lld, \"allocated_bytes\": %lld}",
      p->total_s, p->device_buffers_s, p->host_buffers_s, p->sparse_s, p->shapes_s,
      static_cast<long long>(p->reused_bytes), static_cast<long long>(p->allocated_bytes));
}

}  // namespace

std::string request_summary_json(const RequestSummary& x) {
  const runtime::BatchRequest& r = *x.request;
  const runtime::ParallelStats& s = *x.stats;
  using ll = long long;
  std::string out = sformat(
      "{\"id\": %s, \"line\": %lld, \"n_tokens\": %zu, \"first_token\": %d, \"tp\": %d, "
      "\"cp\": %d, \"group\": %d, \"prefill_s\": %.6f, \"plan_s\": %.6f, \"comm_s\": %.6f, "
      "\"kv_allgather_bytes\": %lld, \"kv_moved_bytes\": %lld, \"estimate_bytes\": %lld, "
      "\"estimate_bytes_parts\": {\"queries\": %lld, \"columns\": %lld, \"diagonals\": %lld, "
      "\"blocks\": %lld}, \"tp_allreduce_bytes\": %lld, \"comm_bytes\": %lld, \"attention\": %s, "
      "\"density\": %.6f, \"attention_s\": %.6f, \"estimate_s\": %.6f, \"sparse_grows\": %d, "
      "\"kv_alloc_s\": %.6f, \"kv_copy_s\": %.6f, \"kv_host_dtype\": \"%s\", \"export\": \"%s\", "
      "\"device\": \"%s\", \"retention\": %s, \"kv_kept_fraction\": %.6f, \"kv_dtype\": \"%s\", "
      "\"importance_bytes\": %lld, \"importance_s\": %.6f, \"prefix_reused_tokens\": %lld, "
      "\"export_s\": %.6f, \"export_bytes\": %lld, \"export_wait_s\": %.6f, "
      "\"export_streamed\": %s, \"export_layers_at_prefill_end\": %d, \"memory_wait_s\": %.6f, "
      "\"fingerprint\": \"%s\"",
      json_quoted(r.id).c_str(), ll(r.line), r.tokens.size(), x.first_token, x.tp, x.cp, x.group,
      s.seconds, s.plan_s, s.comm_s, ll(s.kv_allgather_bytes), ll(s.kv_moved_bytes),
      ll(s.estimate_bytes), ll(s.estimate_queries_bytes), ll(s.estimate_columns_bytes),
      ll(s.estimate_diagonals_bytes), ll(s.estimate_blocks_bytes), ll(s.tp_allreduce_bytes),
      ll(s.comm_bytes), json_quoted(utf8_repaired(x.attention)).c_str(), s.density, s.attention_s, s.estimate_s,
      s.sparse_grows, s.kv_alloc_s, s.kv_copy_s, x.kv_host_dtype.c_str(), x.export_mode.c_str(),
      x.device.c_str(), json_quoted(utf8_repaired(x.retention)).c_str(), x.kv_kept_fraction, x.kv_dtype.c_str(),
      ll(s.importance_bytes), s.importance_s, ll(x.prefix_reused_tokens), x.export_s,
      ll(x.export_bytes), x.export_wait_s, x.export_streamed ? "true" : "false",
      x.export_layers_at_prefill_end, x.memory_wait_s, x.fingerprint.c_str());
  // Group totals beside the leader's own counters (docs/distributed.md, sparsity-aware CP), where
  // this rank's plan spent its time, and each rank's figures in group rank order.
  out += sformat(
      ", \"group_kv_allgather_bytes\": %lld, \"group_kv_moved_bytes\": %lld, "
      "\"group_estimate_bytes\": %lld, \"group_density\": %.6f, \"chunk\": %lld, "
      "\"device_workspace_bytes\": %lld",
      ll(s.group_kv_allgather_bytes), ll(s.group_kv_moved_bytes), ll(s.group_estimate_bytes),
      s.group_density, ll(x.chunk), ll(x.device_workspace_bytes));
  out += ", \"plan_parts\": " + plan_json(x.plan) +
         ", \"kv_moved_bytes_by_rank\": " + json_list(s.kv_moved_bytes_by_rank) +
         ", \"estimate_bytes_by_rank\": " + json_list(s.estimate_bytes_by_rank) +
         ", \"prefill_s_by_rank\": " + json_list(s.seconds_by_rank) +
         ", \"attention_s_by_rank\": " + json_list(s.attention_s_by_rank) +
         ", \"comm_s_by_rank\": " + json_list(s.comm_s_by_rank) +
         ", \"density_by_rank\": " + json_list(s.density_by_rank) + "}";
  return out;
}

}  // namespace sf::worker
