#include "worker/runtime/batch_metrics.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "worker/runtime/batch.h"

namespace sf::runtime {
namespace {

// Request times span a 100-token line on a CPU to a million-token prompt on a slow grid.
const std::vector<double> kPrefillBuckets = {0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600};

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::string BatchMetrics::group_path(const std::string& path, int group, int n_groups) {
  if (n_groups <= 1) return path;
  const std::filesystem::path p(path);
  const std::string tag = ".g" + std::to_string(group);
  return (p.parent_path() / (p.stem().string() + tag + p.extension().string())).string();
}

Status BatchMetrics::remove_group_files(const std::string& path, const std::string& holder,
                                       int* removed) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const std::string stem = p.stem().string() + ".g", ext = p.extension().string();
  std::error_code ec;
  std::vector<fs::path> old;
  if (fs::exists(p, ec)) old.push_back(p);
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= stem.size() + ext.size() || name.rfind(stem, 0) != 0 ||
        name.compare(name.size() - ext.size(), ext.size(), ext) != 0)
      continue;
    const std::string num = name.substr(stem.size(), name.size() - stem.size() - ext.size());
    if (!num.empty() && std::all_of(num.begin(), num.end(), [](char c) { return c >= '0' && c <= '9'; }))
      old.push_back(it->path());
  }
  // First every lock: a file another running job holds stops the job before anything goes.
  for (const auto& f : old) {
    const std::string lock = f.string() + ".lock";
    if (!fs::exists(lock, ec)) continue;
    auto l = runtime::lock_file(lock, holder);  // a probe: released at once when taken
    if (l.is_ok()) {
      if (l.value() >= 0) ::close(l.value());
    } else if (l.status().code() == Code::kAlreadyExists && l.status().message() != holder) {
      return in_use(f.string(), l.status().message());
    }
  }
  int n = 0;
  for (const auto& f : old)
    if (fs::remove(f, ec)) ++n;
  if (removed) *removed = n;
  return Status::ok();
}

Status BatchMetrics::in_use(const std::string& file, const std::string& held) {
  return SF_ERR(kAlreadyExists, "--metrics-file '" + file +
                                    "' is in use by another sparsefill-worker job (" + held +
                                    "); give each job its own --metrics-file");
}

MetricLabels BatchMetrics::with(const char* k, const char* v) const {
  MetricLabels l = group_;
  l.emplace_back(k, v);
  return l;
}

BatchMetrics::BatchMetrics(std::string path, const BatchMetricsInfo& info)
    : path_(std::move(path)), group_{{"group", std::to_string(info.group)}},
      group_idx_(info.group) {
  if (!info.out.empty()) group_.emplace_back("out", info.out);
  if (path_.empty()) return;
  // Names and kinds are fixed here, so a failure would be a programming error: checked by the
  // unit test that renders every family.
  auto add = [&](const char* name, MetricKind kind, const char* help) {
    (void)reg_.add_family(name, kind, help);
    (void)reg_.set(name, group_, 0);
  };
  (void)reg_.add_family("sparsefill_worker_info", MetricKind::kGauge,
                        "The job's settings as labels (value 1).");
  MetricLabels info_labels = group_;
  info_labels.insert(info_labels.end(), {{"model", info.model},
                                         {"device", info.device},
                                         {"attention", info.attention},
                                         {"tp", std::to_string(info.tp)},
                                         {"cp", std::to_string(info.cp)},
                                         {"groups", std::to_string(info.n_groups)}});
  (void)reg_.set("sparsefill_worker_info", info_labels, 1);
  add("sparsefill_worker_requests_assigned", MetricKind::kGauge,
      "Good batch lines this group runs (round-robin share).");
  (void)reg_.add_family("sparsefill_worker_requests_total", MetricKind::kCounter,
                        "Requests finished by this group, by outcome: written (export and "
                        "summary), skipped (already complete on resume), failed.");
  for (const char* oc : {"written", "skipped", "failed"})
    (void)reg_.set("sparsefill_worker_requests_total", with("outcome", oc), 0);
  if (info.group == 0) {
    (void)reg_.add_family("sparsefill_worker_batch_bad_lines", MetricKind::kGauge,
                          "Lines of the batch file that were reported and skipped (whole job).");
    (void)reg_.set("sparsefill_worker_batch_bad_lines", group_, 0);
  }
  add("sparsefill_worker_request_in_flight", MetricKind::kGauge,
      "1 while a request is being prefilled or exported.");
  add("sparsefill_worker_finished", MetricKind::kGauge, "1 once this group ran its whole share.");
  add("sparsefill_worker_last_update_timestamp_seconds", MetricKind::kGauge,
      "Unix time this file was last written (before each request computed, at most once a "
      "second while requests are skipped as complete, and at the end).");
  add("sparsefill_worker_prompt_tokens_total", MetricKind::kCounter,
      "Prompt tokens of written requests.");
  add("sparsefill_worker_prefix_reused_tokens_total", MetricKind::kCounter,
      "Prompt tokens taken from the prefix cache instead of computed.");
  add("sparsefill_worker_comm_seconds_total", MetricKind::kCounter,
      "Time the leader waited on the group's collectives during written requests.");
  add("sparsefill_worker_kv_allgather_bytes_total", MetricKind::kCounter,
      "Bytes a full K/V all-gather would move over the group for written requests.");
  add("sparsefill_worker_kv_moved_bytes_total", MetricKind::kCounter,
      "K/V bytes the group's ranks received (equal to the all-gather unless --selective-kv).");
  add("sparsefill_worker_estimate_bytes_total", MetricKind::kCounter,
      "Bytes the sparse estimator exchanged (--cp-estimate).");
  add("sparsefill_worker_tp_allreduce_bytes_total", MetricKind::kCounter,
      "Bytes the leader all-reduced over TP (each TP rank of the group as much).");
  (void)reg_.add_histogram("sparsefill_worker_prefill_seconds",
                           "Wall time of a written request's prefill (leader).", kPrefillBuckets);
  (void)reg_.touch("sparsefill_worker_prefill_seconds", group_);
  (void)reg_.add_histogram("sparsefill_worker_export_seconds",
                           "Wall time of a written request's KV export, to its manifest in place "
                           "(leader; the group's shards included when sharded).",
                           kPrefillBuckets);
  (void)reg_.touch("sparsefill_worker_export_seconds", group_);
  add("sparsefill_worker_export_bytes_total", MetricKind::kCounter,
      "Bytes of the written requests' KV exports (shards and manifests).");
  add("sparsefill_worker_export_wait_seconds_total", MetricKind::kCounter,
      "Time the batch waited on written requests' exports: what the next prefill did not hide "
      "(all of the export with --export-overlap off).");
  add("sparsefill_worker_memory_wait_seconds_total", MetricKind::kCounter,
      "Time written requests waited before their prefills for host memory the pending export "
      "held (it frees a full retention's K/V layer by layer).");
  add("sparsefill_worker_plan_seconds_total", MetricKind::kCounter,
      "Time the leader spent planning device prefills (--device cuda; a request of the last "
      "plan's length and importance settings reuses it).");
  add("sparsefill_worker_sparse_grows_total", MetricKind::kCounter,
      "Times a written request's device prefill grew its sparse plan during the run because a "
      "layer's index outgrew it (each redoes that layer's attention; --device cuda).");
  add("sparsefill_worker_device_workspace_bytes", MetricKind::kGauge,
      "Device memory of the plan the last written request ran on, weights excluded (leader; "
      "--device cuda, 0 on the CPU; the linear chunk adds to it: docs/operations.md).");
  // Per rank of the group: a rank whose attention runs longer than its peers' shows as their
  // larger collective waits (docs/operations.md, "Stragglers").
  (void)reg_.add_family("sparsefill_worker_rank_attention_seconds_total", MetricKind::kCounter,
                        "Attention kernel time of each rank of the group (group rank order) "
                        "during written requests.");
  (void)reg_.add_family("sparsefill_worker_rank_comm_seconds_total", MetricKind::kCounter,
                        "Time each rank of the group waited on the group's collectives during "
                        "written requests.");
  const int ranks = std::max(1, info.tp * info.cp);
  rank_attention_s_.assign(size_t(ranks), 0.0);
  rank_comm_s_.assign(size_t(ranks), 0.0);
  for (int r = 0; r < ranks; ++r) {
    const std::string rs = std::to_string(r);
    (void)reg_.set("sparsefill_worker_rank_attention_seconds_total", with("rank", rs.c_str()), 0);
    (void)reg_.set("sparsefill_worker_rank_comm_seconds_total", with("rank", rs.c_str()), 0);
  }
}

Status BatchMetrics::start(int64_t assigned, int64_t bad_lines) {
  if (path_.empty()) return Status::ok();
  SF_TRY(reg_.set("sparsefill_worker_requests_assigned", group_, double(assigned)));
  if (group_idx_ == 0)
    SF_TRY(reg_.set("sparsefill_worker_batch_bad_lines", group_, double(bad_lines)));
  return publish(0, 0, 0, false, false);
}

void BatchMetrics::add_written(const WrittenRequest& w) {
  if (path_.empty()) return;
  tokens_ += w.tokens;
  reused_ += w.prefix_reused_tokens;
  comm_s_ += w.comm_s;
  allgather_ += w.kv_allgather_bytes;
  moved_ += w.kv_moved_bytes;
  estimate_ += w.estimate_bytes;
  allreduce_ += w.tp_allreduce_bytes;
  export_bytes_ += w.export_bytes;
  export_wait_s_ += w.export_wait_s;
  memory_wait_s_ += w.memory_wait_s;
  plan_s_ += w.plan_s;
  sparse_grows_ += w.sparse_grows;
  workspace_ = w.device_workspace_bytes;
  for (size_t r = 0; r < w.attention_s_by_rank.size() && r < rank_attention_s_.size(); ++r)
    rank_attention_s_[r] += w.attention_s_by_rank[r];
  for (size_t r = 0; r < w.comm_s_by_rank.size() && r < rank_comm_s_.size(); ++r)
    rank_comm_s_[r] += w.comm_s_by_rank[r];
  (void)reg_.observe("sparsefill_worker_prefill_seconds", group_, w.prefill_s);
  (void)reg_.observe("sparsefill_worker_export_seconds", group_, w.export_s);
}

Status BatchMetrics::publish(int64_t written, int64_t skipped, int64_t failed, bool in_flight,
                             bool finished) {
  if (path_.empty()) return Status::ok();
  SF_TRY(reg_.set("sparsefill_worker_requests_total", with("outcome", "written"), double(written)));
  SF_TRY(reg_.set("sparsefill_worker_requests_total", with("outcome", "skipped"), double(skipped)));
  SF_TRY(reg_.set("sparsefill_worker_requests_total", with("outcome", "failed"), double(failed)));
  SF_TRY(reg_.set("sparsefill_worker_request_in_flight", group_, in_flight ? 1 : 0));
  SF_TRY(reg_.set("sparsefill_worker_finished", group_, finished ? 1 : 0));
  SF_TRY(reg_.set("sparsefill_worker_last_update_timestamp_seconds", group_, unix_now()));
  SF_TRY(reg_.set("sparsefill_worker_prompt_tokens_total", group_, double(tokens_)));
  SF_TRY(reg_.set("sparsefill_worker_prefix_reused_tokens_total", group_, double(reused_)));
  SF_TRY(reg_.set("sparsefill_worker_comm_seconds_total", group_, comm_s_));
  SF_TRY(reg_.set("sparsefill_worker_kv_allgather_bytes_total", group_, double(allgather_)));
  SF_TRY(reg_.set("sparsefill_worker_kv_moved_bytes_total", group_, double(moved_)));
  SF_TRY(reg_.set("sparsefill_worker_estimate_bytes_total", group_, double(estimate_)));
  SF_TRY(reg_.set("sparsefill_worker_tp_allreduce_bytes_total", group_, double(allreduce_)));
  SF_TRY(reg_.set("sparsefill_worker_export_bytes_total", group_, double(export_bytes_)));
  SF_TRY(reg_.set("sparsefill_worker_export_wait_seconds_total", group_, export_wait_s_));
  SF_TRY(reg_.set("sparsefill_worker_memory_wait_seconds_total", group_, memory_wait_s_));
  SF_TRY(reg_.set("sparsefill_worker_plan_seconds_total", group_, plan_s_));
  SF_TRY(reg_.set("sparsefill_worker_sparse_grows_total", group_, double(sparse_grows_)));
  SF_TRY(reg_.set("sparsefill_worker_device_workspace_bytes", group_, double(workspace_)));
  for (size_t r = 0; r < rank_attention_s_.size(); ++r) {
    const std::string rs = std::to_string(r);
    SF_TRY(reg_.set("sparsefill_worker_rank_attention_seconds_total", with("rank", rs.c_str()),
                    rank_attention_s_[r]));
    SF_TRY(reg_.set("sparsefill_worker_rank_comm_seconds_total", with("rank", rs.c_str()),
                    rank_comm_s_[r]));
  }
  return reg_.write_textfile(path_);
}

}  // namespace sf::runtime
