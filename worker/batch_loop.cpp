#include "worker/batch_loop.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string_view>
#include <thread>
#include <utility>

#include "common/text.h"
#include "common/timing.h"
#include "kvstore/retention.h"
#include "worker/job_comm.h"
#include "worker/job_identity.h"
#include "worker/request_resume.h"

namespace sf::worker {
namespace {

using clk = std::chrono::steady_clock;

// SF_WORKER_FAULT=stop_sum:R:N: world rank R stops (SIGSTOP) before enqueuing its Nth overlapped
// TP sum; no hook elsewhere.
std::function<void(int64_t)> stop_before_tp_sum(const Fault& fault, int rank) {
  if (fault.kind != "stop_sum" || fault.rank != rank) return nullptr;
  return [rank, at = fault.layer](int64_t sum) {
    if (sum != at) return;
    std::fprintf(stderr, "fault injection: rank %d stops before TP sum %lld\n", rank,
                 static_cast<long long>(sum));
    std::fflush(stderr);
    std::raise(SIGSTOP);
  };
}

}  // namespace

BatchLoop::BatchLoop(Setup s) : s_(std::move(s)) {
  const Options& o = *s_.o;
  exports_.emplace(RequestExports::Setup{.o = &o,
                                         .g = s_.g,
                                         .m = s_.m,
                                         .fault = s_.fault,
                                         .world_rank = s_.world->rank(),
                                         .device = s_.dm != nullptr,
                                         .host_bf16 = s_.host_bf16,
                                         .prefix_cache = s_.prefix != nullptr,
                                         .my_total = s_.my_total,
                                         .metrics = s_.metrics,
                                         .beat = [this] { beat(); }});
  freeing_ms_ = exports_->freeing_ms();
  stream_exports_ = o.export_stream == 1 || (o.export_stream < 0 && s_.dm);
  // SF_WAIT_WHOLE_EXPORT=1: a request short of memory beside a pending export waits for all of
  // it, as before exports freed their K/V layer by layer (bench/mpi/long_requests.sh's A/B).
  // Agreed over the world (an environment the launcher did not pass to every host could differ),
  // since it decides which collectives a rank calls next.
  {
    const char* e = std::getenv("SF_WAIT_WHOLE_EXPORT");
    const int32_t mine = e && std::string_view(e) == "1" ? 1 : 0;
    int32_t any = 0;
    if (Status st = s_.world->all_reduce(&mine, &any, 1, DType::kI32, comm::ReduceOp::kMax);
        !st.is_ok())
      s_.fatal(st);
    wait_whole_export_ = any != 0;
  }
  // --device cuda: the last plan kept, buffers passed between plans (worker/device_plans.h).
  if (s_.dm)
    dplans_.emplace(DevicePlans::Setup{.o = &o,
                                       .dm = s_.dm,
                                       .g = s_.g,
                                       .dgrid = s_.dgrid,
                                       .sizing = s_.sizing,
                                       .beat = [this] { beat(); },
                                       .before_tp_sum =
                                           stop_before_tp_sum(s_.fault, s_.world->rank())});
}

void BatchLoop::publish(bool in_flight, bool finished) {
  // A file that stops being writable mid-batch (full disk) costs the operator the view, not
  // the job its exports: warned once.
  last_publish_ = std::chrono::steady_clock::now();
  const Status st = s_.metrics->publish(n_done_, n_skipped_, n_failed_, in_flight, finished);
  if (!st.is_ok() && !metrics_warned_) {
    metrics_warned_ = true;
    std::fprintf(stderr, "warning: --metrics-file: %s (the batch goes on)\n", st.message().c_str());
  }
}

void BatchLoop::fail(const runtime::BatchRequest& r, const std::string& why) {
  ++n_failed_;
  if (s_.g->leader())
    std::fprintf(stderr, "%s:%lld: request '%s' failed: %s\n", s_.o->batch.c_str(),
                 static_cast<long long>(r.line), r.id.c_str(), why.c_str());
}

void BatchLoop::complete(std::unique_ptr<PendingExport> x) {
  if (exports_->complete(std::move(x)))
    ++n_done_;
  else
    ++n_failed_;
}

void BatchLoop::drain() {
  if (pending_) complete(std::move(pending_));
}

bool BatchLoop::group_short(int64_t need, int64_t staging, int64_t staging_held,
                            bool beside_pending, int64_t* room) {
  int64_t avail = s_.host_avail(beside_pending);
  if (freeing_ms_ > 0 && beside_pending && pending_)  // the freeing fault's room (RequestExports)
    avail = 2 * pending_->freed_bytes.load() >= pending_->held_bytes ? int64_t(1) << 60 : 0;
  const bool fits = runtime::host_memory_fits(need, staging, staging_held, s_.local_ranks, avail);
  std::array<int64_t, 2> mine{fits ? 1 : 0, avail < 0 ? INT64_MAX : int64_t(0.8 * double(avail))},
      all{};
  if (Status st = s_.g->group_comm->all_reduce(mine.data(), all.data(), 2, DType::kI64,
                                               comm::ReduceOp::kMin);
      !st.is_ok())
    s_.fatal(st);
  *room = all[1];
  return all[0] == 0;
}

bool BatchLoop::admit(const runtime::BatchRequest& r, double* wait_s) {
  // Whether any rank of the group is short of host memory for this request's KV (plus what its
  // device plan's pinned staging grows by), beside whatever is still held: all of the group's
  // ranks take part, so they run the same collectives.
  const runtime::GridComms& g = *s_.g;
  const int64_t T = int64_t(r.tokens.size());
  const int64_t need = s_.sizing->host_bytes(T);  // this host's ranks, summed
  const int64_t staging = s_.sizing->staging_bytes(T);
  // What this rank's device plan holds pinned already (no plan runs or drops before the prefill).
  const int64_t staging_held = dplans_ ? dplans_->staging_held() : 0;
  int64_t room = 0;
  *wait_s = 0;
  if (pending_ && group_short(need, staging, staging_held, true, &room)) {
    // Two requests' KV at once is the overlap's price. The export frees each layer's K/V as its
    // files (all of its parts and tiers) are written, so this request starts once what is left
    // of that leaves room, or after the export (its finish, a collective, then runs here; at
    // once with SF_WAIT_WHOLE_EXPORT=1). Every rank takes the same turns: each round's two
    // answers are the group's.
    if (g.leader())
      std::printf("[group %d] %s: %.2f GB of KV to compute on this host, and a host of the "
                  "group is short of memory for it beside %s's: %s\n",
                  g.group, r.id.c_str(), double(need) / 1e9, pending_->r->id.c_str(),
                  wait_whole_export_ ? "that export finishes first"
                                     : "it waits as that export frees its K/V");
    std::fflush(stdout);
    const auto w0 = clk::now();
    bool fits = false;
    while (!wait_whole_export_) {
      const int32_t mine = pending_->written() ? 1 : 0;
      int32_t all_written = 0;
      if (Status st = g.group_comm->all_reduce(&mine, &all_written, 1, DType::kI32,
                                               comm::ReduceOp::kMin);
          !st.is_ok())
        s_.fatal(st);
      if (!group_short(need, staging, staging_held, true, &room)) {
        fits = true;
        break;
      }
      if (all_written) break;  // nothing more to free: the export completes first
      beat();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!fits) complete(std::move(pending_));
    *wait_s = seconds_since(w0);
    if (fits && g.leader()) {
      const int n_layers = s_.m->config().n_layers;
      std::printf("[group %d] %s: starts with %d of %s's %d layers of K/V not yet freed here, "
                  "after %.2f s\n",
                  g.group, r.id.c_str(), n_layers - pending_->freed_layers.load(),
                  pending_->r->id.c_str(), n_layers, seconds_since(w0));
      std::fflush(stdout);
    }
  }
  // A request whose KV does not fit on its own fails here, before its prefill, instead of
  // taking the host's last memory (and the job with it when the kernel kills a rank); the job
  // goes on with the next request.
  if (group_short(need, staging, staging_held, false, &room) && s_.o->host_memory_check) {
    const int64_t grow = std::max<int64_t>(0, staging - staging_held);  // each rank's staging
    const int n = s_.local_ranks;
    fail(r, sformat("its KV needs %s of host memory for the %d rank(s) on the leader's host%s, "
                    "and a host of the group can give %s (0.8 of its available memory); "
                    "--dry-run prints each request's need, --host-memory-check off skips this "
                    "check",
                    human_bytes(need + n * grow).c_str(), n,
                    grow > 0 ? sformat(" (%s of it pinned staging)", human_bytes(n * grow).c_str())
                                   .c_str()
                             : "",
                    human_bytes(room).c_str()));
    return false;
  }
  return true;
}

runtime::ParallelOptions BatchLoop::options(const kvstore::RetentionPolicy& policy) {
  const Options& o = *s_.o;
  const Fault& fault = s_.fault;
  const int rank = s_.world->rank();
  runtime::ParallelOptions po;
  po.chunk = o.chunk;
  po.gather_kv = o.export_mode != "sharded";
  po.local_kv = o.export_mode == "sharded";
  po.sparse = s_.sparse;
  po.cp_estimate = o.cp_estimate;
  po.selective_kv = o.selective_kv;
  // CPU exports carry per-block importance (as `sparsefill prefill --export-kv` does); scored
  // retention policies select with it. On GPUs it is computed only when the policy selects with
  // it (a scoring pass a layer on the rank holding the prompt's end, and with sparse attention
  // a dense pass over the window's rows).
  if (!dplans_ || kvstore::retention_needs_scores(policy)) {
    po.importance_window = 32;
    po.importance_pool = policy.kind == kvstore::RetentionKind::kSnapKV ||
                                 policy.kind == kvstore::RetentionKind::kAdaKV
                             ? policy.pool
                             : 7;
  }
  po.on_layer = [this](int) { beat(); };
  if ((fault.kind == "slow" || fault.kind == "slow_all") && fault.rank == rank)
    po.on_layer = [this, ms = fault.layer](int) {
      beat();
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    };
  if (first_request_ && (fault.kind == "kill" || fault.kind == "stop") && fault.rank == rank) {
    po.on_layer = [this, rank, kill = fault.kind == "kill", at = fault.layer](int l) {
      beat();
      if (l != at) return;
      std::fprintf(stderr, "fault injection: rank %d %s at layer %d\n", rank,
                   kill ? "kills itself" : "stops", l);
      std::fflush(stderr);
      std::raise(kill ? SIGKILL : SIGSTOP);
    };
  }
  first_request_ = false;
  return po;
}

std::unique_ptr<PendingExport> BatchLoop::stream_export(const runtime::BatchRequest& r,
                                                        const kvstore::RetentionPolicy& policy,
                                                        const kvstore::KvEncodings& encs,
                                                        const std::string& fingerprint,
                                                        runtime::ParallelOptions* po,
                                                        model::LayerKvHooks* hooks) {
  // Its opening is a collective; every rank decides alike.
  if (!stream_exports_ || s_.o->export_mode != "sharded" || s_.prefix ||
      policy.kind != kvstore::RetentionKind::kFull)
    return nullptr;
  const model::ModelConfig& cfg = s_.m->config();
  std::unique_ptr<PendingExport> streamed = exports_->make(r, encs, fingerprint, k_);
  PendingExport& sx = *streamed;
  if (po->importance_window > 0) {
    // Filled layer by layer as the prefill's importance lands (the writer reads a layer's after
    // its rows are published).
    const int64_t T = int64_t(r.tokens.size());
    sx.imp = kvstore::ImportanceScores{
        cfg.n_layers, cfg.n_kv_heads, T, po->importance_window, po->importance_pool,
        std::vector<std::vector<float>>(size_t(cfg.n_layers),
                                        std::vector<float>(size_t(cfg.n_kv_heads * T)))};
    sx.spec.importance = &*sx.imp;
  }
  sx.gate = std::make_unique<runtime::LayerGate>(cfg.n_layers);
  sx.attached = false;
  exports_->start(sx);
  hooks->final = [&sx](int l, const model::KvCache& kv, std::span<const float> imp) {
    if (Status st = publish_layer(sx, l, kv, imp); !st.is_ok()) sx.gate->fail(st);
  };
  // A failed run's K/V stays with the export (never attached, so nothing frees it) until its
  // writer is done with the published rows.
  hooks->failed = [&sx](model::KvCache&& kv) { sx.res.kv = std::move(kv); };
  po->kv_hooks = *hooks;
  return streamed;
}

std::unique_ptr<PendingExport> BatchLoop::prepare_export(const runtime::BatchRequest& r,
                                                         const kvstore::RetentionPolicy& policy,
                                                         const runtime::ParallelOptions& po,
                                                         std::unique_ptr<PendingExport> x,
                                                         runtime::ParallelResult* res) {
  runtime::GridComms& g = *s_.g;
  const model::ModelConfig& cfg = s_.m->config();
  kvstore::KvExportSpec& spec = x->spec;
  spec.first_token = res->first_token;  // (a streamed writer reads no first_token: the manifest's)
  // Every rank holds the same importance, so every rank reaches the same retention (or error).
  // (A streamed export's is in place already.)
  if (!x->gate && !res->importance.empty())
    x->imp = kvstore::ImportanceScores{cfg.n_layers,       cfg.n_kv_heads,
                                       spec.n_tokens,      po.importance_window,
                                       po.importance_pool, std::move(res->importance)};
  // Full retention stays implicit (null): its position lists would cost 4 bytes a token per
  // layer and KV head, a gigabyte for a 1M-token Llama-3-8B prompt.
  const bool full = policy.kind == kvstore::RetentionKind::kFull;
  kvstore::Retention full_retention;
  full_retention.policy = "full";
  Result<kvstore::Retention> ret = full_retention;
  if (!full)
    ret = kvstore::retention_apply(policy, cfg.n_layers, cfg.n_kv_heads, spec.n_tokens,
                                   x->imp ? &*x->imp : nullptr);
  {
    // The same importance gives every rank the same retention, but a rank that failed alone
    // (memory) must not skip the collectives its peers go on to (a pending export's finish).
    const Status all = agree(*g.group_comm, ret.is_ok() ? Status::ok() : ret.status());
    if (g.group_comm->aborted()) s_.fatal(g.group_comm->abort_status());
    if (!all.is_ok()) ret = all;
  }
  if (!ret.is_ok()) {
    fail(r, "retention: " + ret.status().message());
    if (x->gate) exports_->abandon(std::move(x), ret.status());
    return nullptr;
  }
  x->ret = std::move(ret).value();
  if (!x->gate) {  // (a streamed writer reads these: set before it started, full and its own)
    spec.retention = full ? nullptr : &x->ret;
    spec.importance = x->imp ? &*x->imp : nullptr;
  }
  x->kept_frac = full ? 1.0
                      : double(x->ret.kept_total()) /
                            double(int64_t(cfg.n_layers) * cfg.n_kv_heads * spec.n_tokens);
  if (!x->gate) x->res = std::move(*res);
  for (int l = 0; l < x->res.kv.n_layers; ++l) x->held_bytes += x->res.kv.layer_bytes(l);
  if (x->gate) {
    // The rows the prefill published must be where the result holds them; a layer it did not
    // publish (a device prompt run whole, cut after its run) is published from the result.
    Status st = x->gate->check_in_place(x->res.kv);
    for (int l = 0; st.is_ok() && l < cfg.n_layers; ++l)
      if (!x->gate->published(l))
        st = publish_layer(*x, l, x->res.kv,
                           size_t(l) < x->res.importance.size()
                               ? std::span<const float>(x->res.importance[size_t(l)])
                               : std::span<const float>());
    const Status grp = agree(*g.group_comm, st);
    if (g.group_comm->aborted()) s_.fatal(g.group_comm->abort_status());
    if (!grp.is_ok()) {
      fail(r, grp.message());
      exports_->abandon(std::move(x), grp);
      return nullptr;
    }
    // Attached: the layers written so far go now, later ones as they are written.
    x->attach();
    // (Its importance was copied into x->imp layer by layer.)
    std::vector<std::vector<float>>().swap(x->res.importance);
  }
  return x;
}

void BatchLoop::request(const runtime::BatchRequest& r) {
  const Options& o = *s_.o;
  runtime::GridComms& g = *s_.g;
  const Fault& fault = s_.fault;
  const int rank = s_.world->rank();
  beat();  // progress: the last request is done with
  ++k_;
  const kvstore::KvEncodings encs = r.kv_dtype ? *r.kv_dtype : o.kv_dtype;
  const kvstore::RetentionPolicy& policy = r.retention ? *r.retention : o.retention;
  const std::string fingerprint =
      request_fingerprint(r.tokens, policy, encs, s_.job, s_.host_bf16);
  const ResumeState resume = resume_state(o, g, r, fingerprint);
  if (resume == ResumeState::kFailed) {
    ++n_failed_;
    return;
  }
  if (resume == ResumeState::kComplete) {
    ++n_skipped_;
    if (g.leader())
      std::printf("[group %d] %lld/%lld %s: complete, skipped\n", g.group,
                  static_cast<long long>(k_), static_cast<long long>(s_.my_total), r.id.c_str());
    // Each rewrite is two fsyncs and a rename: a resumed batch of many finished requests
    // rewrites the file at most once a second while it skips them.
    if (seconds_since(last_publish_) >= 1.0)
      publish(/*in_flight=*/pending_ != nullptr, /*finished=*/false);  // an export may be going
    return;
  }
  publish(/*in_flight=*/true, /*finished=*/false);
  double memory_wait_s = 0;  // this request's, in its summary (memory_wait_s)
  if (!admit(r, &memory_wait_s)) return;
  runtime::ParallelOptions po = options(policy);
  model::LayerKvHooks kv_hooks;
  std::unique_ptr<PendingExport> streamed =
      stream_export(r, policy, encs, fingerprint, &po, &kv_hooks);
  Result<runtime::ParallelResult> pr = SF_ERR(kInternal, "not run");
  int64_t reused_tokens = 0;  // from the prefix cache
  if (s_.prefix) {
    // This rank alone (a group of one). (The device runner holds a miss and a hit plan, each
    // with its own pinned staging, so the memory check counts a request's staging whole.)
    pr = s_.prefix->run(r, po, &reused_tokens);
  } else if (dplans_) {
    pr = dplans_->run(r.tokens, po, kv_hooks);
  } else {
    pr = runtime::parallel_prefill(*s_.m, g, r.tokens, po);
  }
  if (streamed) {
    streamed->written_at_prefill_end = streamed->written_layers.load();
    // Its writer reads the result's rows: the export holds them from here, before anything
    // below can replace `pr` (a fault, the group's failure), which would free them under it.
    if (pr.is_ok()) streamed->res = std::move(pr.value());
  }
  if (((fault.kind == "fail_after") || (fault.kind == "fail_nth" && k_ == fault.layer)) &&
      fault.rank == rank && pr.is_ok())
    pr = SF_ERR(kInternal, "fault injection: rank " + std::to_string(rank) +
                               " fails the request after its prefill");
  if (!pr.is_ok() && (g.group_comm->aborted() || g.tp->aborted() || g.cp->aborted() ||
                      (s_.dgrid && (s_.dgrid->tp->aborted() || s_.dgrid->cp->aborted()))))
    s_.fatal(pr.status());
  {
    // One rank's failure is the group's: a rank that failed alone (after the run's last
    // collective) must not go on to the next request's collectives while its peers export this
    // one; the failing rank's reason reaches the leader, which reports it.
    const Status grp = agree(*g.group_comm, pr.status());
    if (g.group_comm->aborted()) s_.fatal(g.group_comm->abort_status());
    if (!grp.is_ok()) pr = grp;
  }
  if (!pr.is_ok()) {
    fail(r, pr.status().message());
    // (Every rank of the group drops its plan: all of them agreed on the failure just above.)
    if (dplans_) dplans_->drop_after_failure();
    if (streamed) exports_->abandon(std::move(streamed), pr.status());
    return;
  }
  std::unique_ptr<PendingExport> x =
      streamed ? std::move(streamed) : exports_->make(r, encs, fingerprint, k_);
  runtime::ParallelResult& res = x->gate ? x->res : pr.value();  // (streamed: held already)
  x->memory_wait_s = memory_wait_s;
  x->reused_tokens = reused_tokens;
  if (dplans_ && res.stats.plan_s > 0) x->plan = dplans_->plan_times();
  if (s_.prefix)
    x->device_workspace_bytes = s_.prefix->device_workspace_bytes();
  else if (dplans_)
    x->device_workspace_bytes = dplans_->workspace_bytes();
  x = prepare_export(r, policy, po, std::move(x), &res);
  if (!x) return;
  // The previous request's export, written while this prefill ran, completes first: a rank
  // holds at most two requests' KV.
  if (pending_) complete(std::move(pending_));
  if (!x->gate) exports_->start(*x);
  pending_ = std::move(x);
  if (!o.export_overlap) complete(std::move(pending_));
}

}  // namespace sf::worker
