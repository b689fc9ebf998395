#include "worker/dry_run.h"

#include <algorithm>
#include <cstdio>

#include "common/text.h"
#include "kvstore/kv_export.h"
#include "worker/job_identity.h"

namespace sf::worker {

void print_dry_run(const Options& o, const model::ModelConfig& cfg,
                   const std::vector<runtime::BatchRequest>& good, int n_groups,
                   const std::string& job, const HostKvSizing& sizing, int local_ranks,
                   int64_t avail) {
  int64_t n_compute = 0, tokens = 0, export_bytes = 0, peak = 0, peak_host = 0, staging = 0,
          n_short = 0;
  // Each group's last computed request's KV (this rank's, and this host's).
  std::vector<int64_t> last(size_t(n_groups), 0), last_host(size_t(n_groups), 0);
  for (size_t i = 0; i < good.size(); ++i) {
    const runtime::BatchRequest& r = good[i];
    const int group = int(i % size_t(n_groups));
    const kvstore::RetentionPolicy& policy = r.retention ? *r.retention : o.retention;
    const kvstore::KvEncodings encs = r.kv_dtype ? *r.kv_dtype : o.kv_dtype;
    const std::string fp = request_fingerprint(r.tokens, policy, encs, job, sizing.host_bf16());
    const int64_t T = int64_t(r.tokens.size());
    const int64_t kv = int64_t(cfg.n_layers) * cfg.n_kv_heads *
                       kvstore::kv_encoded_bytes(encs.high, T, cfg.head_dim);  // K and V
    const int64_t host = sizing.rank_bytes(T);
    std::string status = "to compute";
    if (runtime::request_complete(o.out, r.id, fp)) {
      status = "complete, a run skips it";
    } else if (const std::string why = runtime::request_stale_reason(o.out, r.id, fp);
               !why.empty()) {
      status = "to compute again (" + why + ")";
    }
    const bool compute = status.rfind("complete", 0) != 0;
    const bool full = policy.kind == kvstore::RetentionKind::kFull;
    // What a run's host memory check would say of it (no plan held yet: its whole staging).
    const int64_t on_host = sizing.host_bytes(T);
    const bool too_big = compute && o.host_memory_check &&
                         !runtime::host_memory_fits(on_host, sizing.staging_bytes(T), 0, local_ranks, avail);
    n_short += too_big ? 1 : 0;
    std::printf("plan: %s (line %lld): %lld tokens, group %d, %s; K/V %s%s in %s, host KV %s a "
                "rank in %s%s\n",
                r.id.c_str(), static_cast<long long>(r.line), static_cast<long long>(T), group,
                status.c_str(), full ? "" : "at most ", human_bytes(kv).c_str(),
                kvstore::kv_encodings_name(encs).c_str(), human_bytes(host).c_str(),
                sizing.host_bf16() ? "bf16" : "f32", too_big ? "; more than this host's memory allows now: a run would fail it "
                          "(--host-memory-check)"
                        : "");
    if (!compute) continue;
    ++n_compute;
    tokens += T;
    export_bytes += kv;
    // With --export-overlap a rank holds the pending export's KV beside the next request's.
    peak = std::max(peak, host + (o.export_overlap ? last[size_t(group)] : 0));
    last[size_t(group)] = host;
    peak_host = std::max(peak_host, on_host + (o.export_overlap ? last_host[size_t(group)] : 0));
    last_host[size_t(group)] = on_host;
    // The GPU plan's pinned staging stays at the largest request's (plans pass buffers on).
    staging = std::max(staging, sizing.staging_bytes(T));
  }
  const std::string pinned =
      o.device == "cuda"
          ? sformat(", and %s of pinned K/V staging (--kv-staging-layers %d, --kv-staging-max-gib %g)",
                    human_bytes(staging).c_str(), o.kv_staging_layers, o.kv_staging_max_gib)
                         : "";
  std::printf("plan: %lld of %zu requests to compute (%lld tokens), K/V to write at most %s; peak "
              "host KV a rank %s (--export-overlap %s)%s, %d rank(s) on this host: %s of its %s "
              "available\n",
              static_cast<long long>(n_compute), good.size(), static_cast<long long>(tokens),
              human_bytes(export_bytes).c_str(), human_bytes(peak).c_str(),
              o.export_overlap ? "on" : "off", pinned.c_str(), local_ranks,
              human_bytes(peak_host + staging * local_ranks).c_str(), human_bytes(avail).c_str());
  if (n_short > 0)
    std::printf("plan: %lld request(s) need more host memory than this host can give now "
                "(0.8 of its available memory, for its %d rank(s)); a run fails them before their "
                "prefills (--host-memory-check off skips the check)\n",
                static_cast<long long>(n_short), local_ranks);
  std::fflush(stdout);
}

}  // namespace sf::worker
