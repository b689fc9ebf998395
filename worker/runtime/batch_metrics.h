// Prometheus metrics of a worker group's batch, for operators who watch a job under mpirun.
//
// Each group leader writes its group's series to a file in the text exposition format, for
// node_exporter's textfile collector (or anything that reads the format): at start, before each
// request, and at the end. The file is replaced by a rename, so a scrape never reads half of it.
// With one group the file is PATH; with several, group G writes PATH with ".gG" before its
// extension (sf.prom -> sf.g0.prom, sf.g1.prom), and every series carries group="G" and
// out="<the job's --out>". The batch-wide bad-line count is in group 0's file only, so a sum over
// files counts it once.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"

namespace sf::runtime {

struct BatchMetricsInfo {
  std::string model, device, attention;
  // The job's output directory (absolute): a label on every series, so files of two jobs read by
  // one collector never export the same series (one job a directory: its lock).
  std::string out;
  int tp = 1, cp = 1;
  int group = 0, n_groups = 1;
};

// One written request's figures (its summary's group totals).
struct WrittenRequest {
  int64_t tokens = 0, prefix_reused_tokens = 0;
  double prefill_s = 0, comm_s = 0;
  int64_t kv_allgather_bytes = 0, kv_moved_bytes = 0, estimate_bytes = 0, tp_allreduce_bytes = 0;
  // The KV export: the leader's wall time from its start to the manifest in place (the group's
  // shards included when sharded), and the bytes of the export's files.
  double export_s = 0;
  int64_t export_bytes = 0;
  // What of the export the batch waited for (its start, the wait for its files after the next
  // request's prefill, its manifest step): export_s less what the next prefill hid.
  double export_wait_s = 0;
  // The device prefill's planning before the run (0 when the last plan was reused).
  double plan_s = 0;
  // Times the device prefill grew its sparse plan during the run (ParallelStats::sparse_grows).
  int64_t sparse_grows = 0;
  // Each rank's attention and collective-wait seconds, group rank order (ParallelStats'
  // *_by_rank; empty counts nothing).
  std::vector<double> attention_s_by_rank, comm_s_by_rank;
  // How long it waited before its prefill for host memory beside the pending export.
  double memory_wait_s = 0;
  // --device cuda: the device memory of the plan it ran on (weights excluded), the leader's.
  int64_t device_workspace_bytes = 0;
};

class BatchMetrics {
 public:
  // The file group `group` of `n_groups` writes for --metrics-file PATH.
  static std::string group_path(const std::string& path, int group, int n_groups);
  // Removes PATH and every PATH.gN (an earlier job's files, perhaps with another group count,
  // which would otherwise keep exporting their last values), except that a file whose lock
  // (FILE.lock, runtime::lock_file) another job holds (its text is not `holder`) is an error,
  // kAlreadyExists naming that job, and nothing is removed. *removed (when given): how many went.
  static Status remove_group_files(const std::string& path, const std::string& holder,
                                   int* removed = nullptr);
  // kAlreadyExists: `file`, a metrics file, is locked by the job `held` names.
  static Status in_use(const std::string& file, const std::string& held);

  // path empty: disabled (every call is a no-op). Registers every series with zeros.
  BatchMetrics(std::string path, const BatchMetricsInfo& info);

  // The group's share of the batch and (group 0) the batch's bad lines; writes the first file.
  [[nodiscard]] Status start(int64_t assigned, int64_t bad_lines);
  void add_written(const WrittenRequest& w);
  // Request counts so far (snapshots), whether a request is now running; writes the file.
  [[nodiscard]] Status publish(int64_t written, int64_t skipped, int64_t failed, bool in_flight,
                               bool finished);
  const MetricsRegistry& registry() const { return reg_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  MetricsRegistry reg_;
  MetricLabels group_;  // group (and out) labels of every series
  MetricLabels with(const char* k, const char* v) const;
  int group_idx_ = 0;
  int64_t tokens_ = 0, reused_ = 0, allgather_ = 0, moved_ = 0, estimate_ = 0, allreduce_ = 0;
  int64_t export_bytes_ = 0, sparse_grows_ = 0, workspace_ = 0;
  double comm_s_ = 0, export_wait_s_ = 0, plan_s_ = 0, memory_wait_s_ = 0;
  std::vector<double> rank_attention_s_, rank_comm_s_;  // per group rank, summed
};

}  // namespace sf::runtime
