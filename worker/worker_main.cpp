// sparsefill-worker: the MPI job of TP x CP ranks (DESIGN.md "One request, end to end", step 6).
//
//   mpirun -np N sparsefill-worker --model M [--tp T] [--cp C] --batch prompts.jsonl --out DIR
//
// N = groups x T x C: world rank w belongs to group w / (T*C); requests (good lines, in file
// order) go round-robin to groups. Process edge: errors become one `error: ...` line. Exit codes:
// 0 every request written or already complete; 1 a fatal error (model load, comm deadline);
// 2 bad invocation (options, world size, model does not divide by --tp); 3 the batch finished
// but some lines were bad or some requests failed.
//
// Start-up errors that every rank detects alike print once (rank 0). A rank that cannot load the
// model sends its message to every rank, and every rank exits with that same line. A collective
// that passes its deadline (--comm-timeout) ends the whole job (MPI_Abort) with the error naming
// the collective and ranks. Test-only fault injection: SF_WORKER_FAULT=load:R (world rank R fails
// to load the model), kill:R:L / stop:R:L (rank R SIGKILLs / SIGSTOPs itself at layer L of its
// first request), slow:R:MS (rank R sleeps MS milliseconds at every layer: slow but alive).
#include <algorithm>
#include <array>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <thread>

#include "comm/mpi_communicator.h"
#include "common/file_io.h"
#include "common/log.h"
#include "common/text.h"
#include "common/thread_pool.h"
#include "kvstore/kv_export.h"
#include "worker/device_plans.h"
#include "worker/dry_run.h"
#include "worker/host_kv.h"
#include "worker/job_comm.h"
#include "worker/job_identity.h"
#include "worker/job_start.h"
#include "worker/model/device_model.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"
#include "worker/options.h"
#include "worker/prefix_requests.h"
#include "worker/request_checks.h"
#include "worker/request_exports.h"
#include "worker/request_resume.h"
#include "worker/runtime/batch.h"
#include "worker/runtime/batch_metrics.h"
#include "worker/runtime/device_parallel.h"
#include "worker/runtime/grid.h"
#include "worker/runtime/parallel_prefill.h"

namespace sf {
namespace {

namespace fs = std::filesystem;

using worker::agree;
using worker::check_requests;
using worker::DevicePlans;
using worker::GroupProgress;
using worker::HostKvSizing;
using worker::Fault;
using worker::host_peers;
using worker::HostPeers;
using worker::kUsage;
using worker::Options;
using worker::parse_fault;
using worker::parse_options;
using worker::PendingExport;
using worker::PrefixRequests;
using worker::print_dry_run;
using worker::publish_layer;
using worker::RequestExports;
using worker::plain_bf16;
using worker::request_fingerprint;

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

int run(int argc, char** argv) {
  const auto job_t0 = std::chrono::steady_clock::now();
  const auto job_s = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - job_t0).count();
  };
  const Status mpi = comm::mpi_init(&argc, &argv);
  // An MPI that started but cannot host the job's threads ends it: running on as N one-rank jobs
  // would have every rank write the same outputs.
  if (!mpi.is_ok() && comm::mpi_initialized()) {
    std::fprintf(stderr, "error: %s\n", mpi.message().c_str());
    comm::mpi_abort_job(1);
  }
  const bool have_mpi = mpi.is_ok();
  std::unique_ptr<comm::Communicator> world;
  if (have_mpi) {
    auto w = comm::make_mpi_world();
    if (!w.is_ok()) {
      std::fprintf(stderr, "error: %s\n", w.status().message().c_str());
      comm::mpi_abort_job(1);
    }
    world = std::move(w).value();
  } else {
    world = comm::make_self_communicator("world");
  }
  const bool rank0 = world->rank() == 0;
  // Every rank gathers, whatever its environment says, so the collective is always matched.
  auto peers_r = host_peers(*world);
  if (!peers_r.is_ok()) {
    std::fprintf(stderr, "error: %s\n", peers_r.status().message().c_str());
    comm::mpi_abort_job(1);
  }
  const HostPeers peers = peers_r.value();
  // Ranks whose CPU sets overlap would each run a thread per CPU of the set: without
  // SF_NUM_THREADS each takes its share, before the pool's first use. A rank bound to CPUs of
  // its own keeps them all.
  if (const char* set = std::getenv("SF_NUM_THREADS"); (!set || !*set) && peers.cpu_sharers > 1)
    setenv("SF_NUM_THREADS", std::to_string(std::max(1, usable_cpus() / peers.cpu_sharers)).c_str(), 1);
  std::unique_ptr<GroupProgress> progress;  // several groups: the leaders' progress notes
  // Exits every rank the same way; the message prints once (rank 0) or on every rank.
  auto finish = [&](const worker::JobExit& e) {
    if (!e.message.empty() && (e.every_rank || rank0))
      std::fprintf(stderr, "error: %s\n", e.message.c_str());
    std::fflush(stdout);
    if (progress) progress->close();
    world.reset();
    comm::mpi_finalize();
    return e.code;
  };
  auto fatal = [](const Status& st) { worker::end_job(st); };

  auto opts_r = parse_options(argc, argv);
  if (auto e = worker::agree_options(*world, opts_r)) return finish(*e);
  const Options& o = opts_r.value();
  if (o.help) {
    if (rank0) std::fputs(kUsage, stdout);
    return finish({0, ""});
  }
  if (o.comm_timeout_s > 0)
    world->set_timeout(std::chrono::milliseconds(int64_t(o.comm_timeout_s * 1000)));
  const runtime::GridShape shape{o.tp, o.cp};
  if (Status st = runtime::check_world(shape, world->size()); !st.is_ok())
    return finish({2, st.message()});
  const int n_groups = world->size() / shape.group_size();
  if (auto e = worker::claim_output(*world, o, shape, n_groups)) return finish(*e);
  const Fault fault = parse_fault();

  // The batch file is read on rank 0 and broadcast, so other hosts need no copy of it.
  std::string text;
  if (auto e = worker::read_batch(*world, o, &text)) return finish(*e);

  // Every rank loads the model; one rank's failure is every rank's error.
  Result<model::Model> mr = SF_ERR(kInternal, "not loaded");
  if (auto e = worker::load_model(*world, o, fault.kind == "load" && fault.rank == world->rank(),
                                  &mr))
    return finish(*e);
  const model::Model& m = mr.value();
  const model::ModelConfig& cfg = m.config();
  // The request fingerprint's model and attention parts, the same for every request.
  const std::string model_compat = kvstore::compat_hash(kvstore::model_export_spec(m));
  const std::string job = worker::job_identity(o, model_compat);
  std::optional<model::SparseConfig> sparse;
  if (auto e = worker::check_model(*world, o, m, job, &sparse)) return finish(*e);
  const std::optional<model::Tokenizer> tok = worker::load_tokenizer(o, m);

  auto grid_r = runtime::make_grid(*world, shape);
  if (!grid_r.is_ok()) fatal(grid_r.status());
  runtime::GridComms& g = grid_r.value();
  // The leaders' progress notes (GroupProgress), for a job of several groups.
  {
    std::unique_ptr<comm::Heartbeat> hb;
    if (have_mpi && n_groups > 1) {
      auto h = comm::Heartbeat::create(world->timeout());
      if (!h.is_ok()) fatal(h.status());
      hb = std::move(h).value();
    }
    progress = std::make_unique<GroupProgress>(std::move(hb), g.leader(), g.group, n_groups,
                                               shape.group_size());
  }
  auto beat = [&](int64_t value) {
    if (Status st = progress->beat(value); !st.is_ok()) fatal(st);
  };

  // GPUs: each rank's TP slice on its device, then NCCL over the grid. Every rank learns of any
  // rank's failure before the next collective step (NCCL init would wait for a missing peer).
  std::optional<model::DeviceModel> dmodel;
  std::optional<runtime::DeviceGrid> dgrid;
  if (o.device == "cuda" && !o.dry_run) {
    Status mine = Status::ok();
    auto dev = runtime::local_device(world->rank());
    if (!dev.is_ok()) {
      mine = dev.status();
    } else {
      const model::TpSlice slice{o.tp, g.tp_rank};
      auto d = o.synthetic ? model::DeviceModel::synthetic(o.synthetic->config, o.synthetic->seed,
                                                           DType::kBF16, dev.value(), slice)
                           : model::DeviceModel::upload(m, DType::kBF16, dev.value(), slice);
      if (d.is_ok())
        dmodel.emplace(std::move(d).value());
      else
        mine = d.status();
    }
    Status all =
        agree(*world, mine.is_ok() ? mine
                                   : Status(mine.code(), "rank " + std::to_string(world->rank()) +
                                                             ": " + mine.message()));
    if (world->aborted()) fatal(world->abort_status());
    if (!all.is_ok()) return finish({1, all.message(), /*every_rank=*/true});
    auto grid = runtime::make_device_grid(g, dmodel->device());
    if (!grid.is_ok()) fatal(grid.status());
    dgrid.emplace(std::move(grid).value());
  }

  // Requests: parse, tokenize, validate; identical on every rank, reported once.
  runtime::BatchFile bf =
      runtime::parse_batch(text, o.compute_dtype());
  std::vector<runtime::BatchRequest> good = check_requests(bf, cfg, tok ? &*tok : nullptr, o);
  worker::agree_requests(*world, &bf, &good);
  // --kv-host-dtype auto: bf16 on the device when every export of the batch is plain bf16 (what
  // --kv-dtype auto gives there, the device forward's own dtype). Those files' K and V are then the
  // same bytes as from F32 host K/V: rounded once to nearest even, by the device's cast instead of
  // the writer (ExportFromBf16HostKvIsTheF32ExportsKv), for half the host memory; the block key
  // statistics are then those of the stored keys. An f32, int8 or int4 export keeps F32: quantizing
  // bf16-rounded values could move codes. Every rank holds the same lines, so all decide alike.
  const bool host_bf16 = [&] {
    if (!o.kv_host_auto) return o.kv_host_bf16;
    bool all = o.device == "cuda" && o.prefix_cache_bytes == 0 && !good.empty();
    for (const auto& r : good) all = all && plain_bf16(r.kv_dtype ? *r.kv_dtype : o.kv_dtype);
    return all;
  }();
  std::sort(bf.bad.begin(), bf.bad.end(),
            [](const auto& a, const auto& b) { return a.line < b.line; });
  if (rank0) {
    for (const auto& b : bf.bad)
      std::fprintf(stderr, "%s:%lld: %s; skipped\n", o.batch.c_str(),
                   static_cast<long long>(b.line), b.reason.c_str());
    // "ready": launch, model load (and device upload, NCCL grid) and the lines' tokenization.
    std::printf(
        "batch: %zu requests, %zu bad lines; %d group(s) of tp %d x cp %d; model %s; %d host "
        "threads a rank; ready in %.1f s\n",
        good.size(), bf.bad.size(), n_groups, o.tp, o.cp, cfg.name.c_str(), num_threads(),
        job_s());
    std::fflush(stdout);
  }
  const bool sharded = o.export_mode == "sharded";
  // Host memory a rank holds for one request's KV while it is prefilled and exported, and what
  // this host's ranks hold together (the host memory check and the dry run's plan).
  const HostKvSizing sizing(o, cfg, host_bf16, peers.ranks);
  // The ranks on this host share its memory: a rank's check counts them all (every group's).
  const int local_ranks = peers.local_ranks;
  // The host memory this rank sees (the memory faults stand in for it in tests): beside_pending
  // for the export overlap's check, which low_memory alone fails.
  auto host_avail = [&](bool beside_pending) -> int64_t {
    if (fault.rank != world->rank()) return host_memory_available();
    if (fault.kind == "no_memory" || (fault.kind == "low_memory" && beside_pending)) return 0;
    if (fault.kind == "memory") return fault.layer;
    return host_memory_available();
  };
  if (o.dry_run) {
    if (rank0)
      print_dry_run(o, cfg, good, n_groups, job, sizing, local_ranks, host_avail(false));
    return finish({bf.bad.empty() ? 0 : 3, ""});
  }
  if (g.leader()) {
    std::error_code ec;
    fs::create_directories(o.out, ec);
    if (ec) fatal(SF_ERR(kIo, "cannot create output dir '" + o.out + "': " + ec.message()));
  }

  // This group's share, round-robin over the good requests.
  int64_t n_done = 0, n_skipped = 0, n_failed = 0, my_total = 0;
  for (size_t i = size_t(g.group); i < good.size(); i += size_t(n_groups)) ++my_total;
  // --metrics-file: the leader's first file is written now; one leader that cannot write its
  // file stops the job before any prefill, with every rank agreeing.
  runtime::BatchMetrics metrics(
      g.leader() && !o.metrics_file.empty()
          ? runtime::BatchMetrics::group_path(o.metrics_file, g.group, n_groups)
          : std::string(),
      runtime::BatchMetricsInfo{cfg.name, o.device, o.attention,
                                fs::absolute(o.out).lexically_normal().string(), o.tp, o.cp,
                                g.group, n_groups});
  {
    const Status st = metrics.start(my_total, int64_t(bf.bad.size()));
    const Status all = agree(*world, st.is_ok() ? st
                                                : Status(st.code(), "--metrics-file: " +
                                                                        st.message()));
    if (world->aborted()) fatal(world->abort_status());
    if (!all.is_ok()) return finish({2, all.message()});
  }
  bool metrics_warned = false;
  auto publish = [&](bool in_flight, bool finished) {
    // A file that stops being writable mid-batch (full disk) costs the operator the view, not
    // the job its exports: warned once.
    const Status st = metrics.publish(n_done, n_skipped, n_failed, in_flight, finished);
    if (!st.is_ok() && !metrics_warned) {
      metrics_warned = true;
      std::fprintf(stderr, "warning: --metrics-file: %s (the batch goes on)\n",
                   st.message().c_str());
    }
  };
  int64_t k = 0;
  bool first_request = true;
  // --prefix-cache: this rank's cache and the requests computed behind it.
  std::unique_ptr<PrefixRequests> prefix;
  if (o.prefix_cache_bytes > 0) {
    auto p = PrefixRequests::create(o, m, dmodel ? &*dmodel : nullptr, model_compat);
    if (!p.is_ok()) fatal(p.status());
    prefix = std::move(p).value();
  }
  // The requests' exports (worker/request_exports.h): a written one's files beside the next
  // request's prefill, its manifest and summary after it.
  RequestExports exports({.o = &o,
                          .g = &g,
                          .m = &m,
                          .fault = fault,
                          .world_rank = world->rank(),
                          .device = dmodel.has_value(),
                          .host_bf16 = host_bf16,
                          .prefix_cache = prefix != nullptr,
                          .my_total = my_total,
                          .metrics = &metrics,
                          .beat = [&] { beat(k); }});
  auto complete_export = [&](std::unique_ptr<PendingExport> x) {
    if (exports.complete(std::move(x)))
      ++n_done;
    else
      ++n_failed;
  };
  const int freeing_ms = exports.freeing_ms();
  const bool stream_exports = o.export_stream == 1 || (o.export_stream < 0 && dmodel);
  using clk = std::chrono::steady_clock;
  auto since = [](clk::time_point t0) {
    return std::chrono::duration<double>(clk::now() - t0).count();
  };
  std::unique_ptr<PendingExport> pending;
  // SF_WAIT_WHOLE_EXPORT=1: a request short of memory beside a pending export waits for all of
  // it, as before exports freed their K/V layer by layer (bench/mpi/long_requests.sh's A/B).
  // Agreed over the world (an environment the launcher did not pass to every host could differ),
  // since it decides which collectives a rank calls next.
  const bool wait_whole_export = [&] {
    const char* e = std::getenv("SF_WAIT_WHOLE_EXPORT");
    const int32_t mine = e && std::string_view(e) == "1" ? 1 : 0;
    int32_t any = 0;
    if (Status st = world->all_reduce(&mine, &any, 1, DType::kI32, comm::ReduceOp::kMax);
        !st.is_ok())
      fatal(st);
    return any != 0;
  }();
  // --device cuda: the last plan kept, buffers passed between plans (worker/device_plans.h).
  std::optional<DevicePlans> dplans;
  if (dmodel)
    dplans.emplace(DevicePlans::Setup{.o = &o,
                                      .dm = &*dmodel,
                                      .g = &g,
                                      .dgrid = &*dgrid,
                                      .sizing = &sizing,
                                      .beat = [&] { beat(k); },
                                      .before_tp_sum = stop_before_tp_sum(fault, world->rank())});
  for (size_t i = size_t(g.group); i < good.size(); i += size_t(n_groups)) {
    const runtime::BatchRequest& r = good[i];
    beat(k);  // progress: the last request is done with
    publish(/*in_flight=*/true, /*finished=*/false);
    ++k;
    const kvstore::KvEncodings encs = r.kv_dtype ? *r.kv_dtype : o.kv_dtype;
    const std::string fingerprint =
        request_fingerprint(r.tokens, r.retention ? *r.retention : o.retention, encs, job,
                            host_bf16);
    const worker::ResumeState resume = worker::resume_state(o, g, r, fingerprint);
    if (resume == worker::ResumeState::kFailed) {
      ++n_failed;
      continue;
    }
    if (resume == worker::ResumeState::kComplete) {
      ++n_skipped;
      if (g.leader())
        std::printf("[group %d] %lld/%lld %s: complete, skipped\n", g.group,
                    static_cast<long long>(k), static_cast<long long>(my_total), r.id.c_str());
      continue;
    }
    // Whether any rank of the group is short of host memory for this request's KV (plus what
    // its device plan's pinned staging grows by), beside whatever is still held: all of the
    // group's ranks take part, so they run the same collectives.
    const int64_t T = int64_t(r.tokens.size());
    const int64_t need = sizing.host_bytes(T);  // this host's ranks, summed
    const int64_t staging_held = dplans ? dplans->staging_held() : 0;
    // room: the least a host of the group may give (0.8 of its available memory), for the
    // message; grow: what each rank's pinned staging adds.
    const int64_t grow = std::max<int64_t>(0, sizing.staging_bytes(T) - staging_held);
    int64_t room = 0;
    auto group_short = [&](bool beside_pending) -> bool {
      int64_t avail = host_avail(beside_pending);
      if (freeing_ms > 0 && beside_pending && pending)  // the freeing fault's room (above)
        avail = 2 * pending->freed_bytes.load() >= pending->held_bytes ? int64_t(1) << 60 : 0;
      const bool fits =
          runtime::host_memory_fits(need, sizing.staging_bytes(T), staging_held, local_ranks, avail);
      std::array<int64_t, 2> mine{fits ? 1 : 0,
                                  avail < 0 ? INT64_MAX : int64_t(0.8 * double(avail))},
          all{};
      if (Status st = g.group_comm->all_reduce(mine.data(), all.data(), 2, DType::kI64,
                                               comm::ReduceOp::kMin);
          !st.is_ok())
        fatal(st);
      room = all[1];
      return all[0] == 0;
    };
    double memory_wait_s = 0;  // this request's, in its summary (memory_wait_s)
    if (pending && group_short(true)) {
      // Two requests' KV at once is the overlap's price. The export frees each layer's K/V as
      // its files (all of its parts and tiers) are written, so this request starts once what is
      // left of that leaves room, or after the export (its finish, a collective, then runs
      // here; at once with SF_WAIT_WHOLE_EXPORT=1). Every rank takes the same turns: each
      // round's two answers are the group's.
      if (g.leader())
        std::printf("[group %d] %s: %.2f GB of KV to compute on this host, and a host of the "
                    "group is short of memory for it beside %s's: %s\n",
                    g.group, r.id.c_str(), double(need) / 1e9, pending->r->id.c_str(),
                    wait_whole_export ? "that export finishes first"
                                      : "it waits as that export frees its K/V");
      std::fflush(stdout);
      const auto w0 = clk::now();
      bool fits = false;
      while (!wait_whole_export) {
        const int32_t mine = pending->written() ? 1 : 0;
        int32_t all_written = 0;
        if (Status st = g.group_comm->all_reduce(&mine, &all_written, 1, DType::kI32,
                                                 comm::ReduceOp::kMin);
            !st.is_ok())
          fatal(st);
        if (!group_short(true)) {
          fits = true;
          break;
        }
        if (all_written) break;  // nothing more to free: the export completes first
        beat(k);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      if (!fits) complete_export(std::move(pending));
      memory_wait_s = since(w0);
      if (fits && g.leader()) {
        std::printf("[group %d] %s: starts with %d of %s's %d layers of K/V not yet freed here, "
                    "after %.2f s\n",
                    g.group, r.id.c_str(), cfg.n_layers - pending->freed_layers.load(),
                    pending->r->id.c_str(), cfg.n_layers, since(w0));
        std::fflush(stdout);
      }
    }
    // A request whose KV does not fit on its own fails here, before its prefill, instead of
    // taking the host's last memory (and the job with it when the kernel kills a rank); the
    // job goes on with the next request.
    if (group_short(false) && o.host_memory_check) {
      ++n_failed;
      if (g.leader())
        std::fprintf(stderr,
                     "%s:%lld: request '%s' failed: its KV needs %s of host memory for the %d "
                     "rank(s) on the leader's host%s, and a host of the group can give %s (0.8 of "
                     "its available memory); --dry-run prints each request's need, "
                     "--host-memory-check off skips this check\n",
                     o.batch.c_str(), static_cast<long long>(r.line), r.id.c_str(),
                     human_bytes(need + local_ranks * grow).c_str(), local_ranks,
                     grow > 0 ? sformat(" (%s of it pinned staging)",
                                        human_bytes(local_ranks * grow).c_str())
                                    .c_str()
                              : "",
                     human_bytes(room).c_str());
      continue;
    }
    runtime::ParallelOptions po;
    po.chunk = o.chunk;
    po.gather_kv = !sharded;
    po.local_kv = sharded;
    po.sparse = sparse ? &*sparse : nullptr;
    po.cp_estimate = o.cp_estimate;
    po.selective_kv = o.selective_kv;
    const kvstore::RetentionPolicy& policy = r.retention ? *r.retention : o.retention;
    // CPU exports carry per-block importance (as `sparsefill prefill --export-kv` does); scored
    // retention policies select with it. On GPUs it is computed only when the policy selects
    // with it (a scoring pass a layer on the rank holding the prompt's end, and with sparse
    // attention a dense pass over the window's rows).
    if (!dmodel || kvstore::retention_needs_scores(policy)) {
      po.importance_window = 32;
      po.importance_pool = policy.kind == kvstore::RetentionKind::kSnapKV ||
                                   policy.kind == kvstore::RetentionKind::kAdaKV
                               ? policy.pool
                               : 7;
    }
    po.on_layer = [&](int) { beat(k); };
    if ((fault.kind == "slow" || fault.kind == "slow_all") && fault.rank == world->rank())
      po.on_layer = [&](int) {
        beat(k);
        std::this_thread::sleep_for(std::chrono::milliseconds(fault.layer));
      };
    if (first_request && (fault.kind == "kill" || fault.kind == "stop") &&
        fault.rank == world->rank()) {
      po.on_layer = [&](int l) {
        beat(k);
        if (l != fault.layer) return;
        std::fprintf(stderr, "fault injection: rank %d %s at layer %d\n", world->rank(),
                     fault.kind == "kill" ? "kills itself" : "stops", l);
        std::fflush(stderr);
        std::raise(fault.kind == "kill" ? SIGKILL : SIGSTOP);
      };
    }
    first_request = false;
    // --export-stream: a full-retention sharded export begins now (its opening is a collective;
    // every rank decides alike) and writes each layer as the prefill publishes it.
    std::unique_ptr<PendingExport> streamed;
    model::LayerKvHooks kv_hooks;
    if (stream_exports && sharded && !prefix && policy.kind == kvstore::RetentionKind::kFull) {
      streamed = exports.make(r, encs, fingerprint, k);
      PendingExport& sx = *streamed;
      if (po.importance_window > 0) {
        // Filled layer by layer as the prefill's importance lands (the writer reads a layer's
        // after its rows are published).
        const int64_t T = int64_t(r.tokens.size());
        sx.imp = kvstore::ImportanceScores{
            cfg.n_layers, cfg.n_kv_heads, T, po.importance_window, po.importance_pool,
            std::vector<std::vector<float>>(size_t(cfg.n_layers),
                                            std::vector<float>(size_t(cfg.n_kv_heads * T)))};
        sx.spec.importance = &*sx.imp;
      }
      sx.gate = std::make_unique<runtime::LayerGate>(cfg.n_layers);
      sx.attached = false;
      exports.start(sx);
      kv_hooks.final = [&sx](int l, const model::KvCache& kv, std::span<const float> imp) {
        if (Status st = publish_layer(sx, l, kv, imp); !st.is_ok()) sx.gate->fail(st);
      };
      // A failed run's K/V stays with the export (never attached, so nothing frees it) until
      // its writer is done with the published rows.
      kv_hooks.failed = [&sx](model::KvCache&& kv) { sx.res.kv = std::move(kv); };
      po.kv_hooks = kv_hooks;
    }
    Result<runtime::ParallelResult> pr = SF_ERR(kInternal, "not run");
    int64_t reused_tokens = 0;  // from the prefix cache
    if (prefix) {
      // This rank alone (a group of one). (The device runner holds a miss and a hit plan, each
      // with its own pinned staging, so the memory check counts a request's staging whole.)
      pr = prefix->run(r, po, &reused_tokens);
    } else if (dplans) {
      pr = dplans->run(r.tokens, po, kv_hooks);
    } else {
      pr = runtime::parallel_prefill(m, g, r.tokens, po);
    }
    if (streamed) {
      streamed->written_at_prefill_end = streamed->written_layers.load();
      // Its writer reads the result's rows: the export holds them from here, before anything
      // below can replace `pr` (a fault, the group's failure), which would free them under it.
      if (pr.is_ok()) streamed->res = std::move(pr.value());
    }
    if (((fault.kind == "fail_after") || (fault.kind == "fail_nth" && k == fault.layer)) &&
        fault.rank == world->rank() && pr.is_ok())
      pr = SF_ERR(kInternal, "fault injection: rank " + std::to_string(world->rank()) +
                                 " fails the request after its prefill");
    if (!pr.is_ok() && (g.group_comm->aborted() || g.tp->aborted() || g.cp->aborted() ||
                        (dgrid && (dgrid->tp->aborted() || dgrid->cp->aborted()))))
      fatal(pr.status());
    {
      // One rank's failure is the group's: a rank that failed alone (after the run's last
      // collective) must not go on to the next request's collectives while its peers export
      // this one; the failing rank's reason reaches the leader, which reports it.
      const Status grp = agree(*g.group_comm, pr.status());
      if (g.group_comm->aborted()) fatal(g.group_comm->abort_status());
      if (!grp.is_ok()) pr = grp;
    }
    if (!pr.is_ok()) {
      ++n_failed;
      if (g.leader())
        std::fprintf(stderr, "%s:%lld: request '%s' failed: %s\n", o.batch.c_str(),
                     static_cast<long long>(r.line), r.id.c_str(), pr.status().message().c_str());
      // (Every rank of the group drops its plan: all of them agreed on the failure just above.)
      if (dplans) dplans->drop_after_failure();
      if (streamed) exports.abandon(std::move(streamed), pr.status());
      continue;
    }
    std::unique_ptr<PendingExport> x =
        streamed ? std::move(streamed) : exports.make(r, encs, fingerprint, k);
    runtime::ParallelResult& res = x->gate ? x->res : pr.value();  // (streamed: held already)
    x->memory_wait_s = memory_wait_s;
    x->reused_tokens = reused_tokens;
    if (dplans && res.stats.plan_s > 0) x->plan = dplans->plan_times();
    if (prefix)
      x->device_workspace_bytes = prefix->device_workspace_bytes();
    else if (dplans)
      x->device_workspace_bytes = dplans->workspace_bytes();
    kvstore::KvExportSpec& spec = x->spec;
    spec.first_token = res.first_token;  // (a streamed writer reads no first_token: the manifest's)
    // Every rank holds the same importance, so every rank reaches the same retention (or error).
    // (A streamed export's is in place already.)
    if (!x->gate && !res.importance.empty())
      x->imp = kvstore::ImportanceScores{cfg.n_layers,       cfg.n_kv_heads,
                                         spec.n_tokens,      po.importance_window,
                                         po.importance_pool, std::move(res.importance)};
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
      if (g.group_comm->aborted()) fatal(g.group_comm->abort_status());
      if (!all.is_ok()) ret = all;
    }
    if (!ret.is_ok()) {
      ++n_failed;
      if (g.leader())
        std::fprintf(stderr, "%s:%lld: request '%s' failed: retention: %s\n", o.batch.c_str(),
                     static_cast<long long>(r.line), r.id.c_str(), ret.status().message().c_str());
      if (x->gate) exports.abandon(std::move(x), ret.status());
      continue;
    }
    x->ret = std::move(ret).value();
    if (!x->gate) {  // (a streamed writer reads these: set before it started, full and its own)
      spec.retention = full ? nullptr : &x->ret;
      spec.importance = x->imp ? &*x->imp : nullptr;
    }
    x->kept_frac = full ? 1.0
                        : double(x->ret.kept_total()) /
                              double(int64_t(cfg.n_layers) * cfg.n_kv_heads * spec.n_tokens);
    if (!x->gate) x->res = std::move(res);
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
      if (g.group_comm->aborted()) fatal(g.group_comm->abort_status());
      if (!grp.is_ok()) {
        ++n_failed;
        if (g.leader())
          std::fprintf(stderr, "%s:%lld: request '%s' failed: %s\n", o.batch.c_str(),
                       static_cast<long long>(r.line), r.id.c_str(), grp.message().c_str());
        exports.abandon(std::move(x), grp);
        continue;
      }
      // Attached: the layers written so far go now, later ones as they are written.
      x->attach();
      // (Its importance was copied into x->imp layer by layer.)
      std::vector<std::vector<float>>().swap(x->res.importance);
    }
    // The previous request's export, written while this prefill ran, completes first: a rank
    // holds at most two requests' KV.
    if (pending) complete_export(std::move(pending));
    if (!x->gate) exports.start(*x);
    pending = std::move(x);
    if (!o.export_overlap) complete_export(std::move(pending));
  }
  if (pending) complete_export(std::move(pending));
  publish(/*in_flight=*/false, /*finished=*/true);
  // Every other group's "done", or the job ends when one goes quiet for --stall-timeout.
  if (Status st = progress->finish(o.stall_timeout_s); !st.is_ok()) fatal(st);
  // Test fault: this rank stops after its group's last request, before the tally.
  if (fault.kind == "stop_end" && fault.rank == world->rank()) {
    std::fprintf(stderr, "fault injection: rank %d stops before the final tally\n", world->rank());
    std::fflush(stderr);
    std::raise(SIGSTOP);
  }
  // Totals over the leaders. A member enters as soon as its group is done and may wait for other
  // groups for hours: a day's deadline. A leader enters once every group said "done" (above; in
  // a job of one group, once its group's last collective ran), so every rank is past its work
  // and due within moments: a rank stopped after its group's last request ends the job after
  // --stall-timeout instead of holding it for the day.
  int64_t mine[4] = {g.leader() ? n_done : 0, g.leader() ? n_skipped : 0,
                     g.leader() ? n_failed : 0, prefix ? prefix->reused_total() : 0},
          tot[4] = {};
  // (In a job of one group every rank is past the group's last collective: all are due.)
  world->set_timeout(
      g.leader() || n_groups == 1
          ? std::chrono::milliseconds(int64_t(o.stall_timeout_s * 1000))
          : std::max(world->timeout(), std::chrono::milliseconds(int64_t(24) * 3600 * 1000)));
  if (Status st = world->all_reduce(mine, tot, 4, DType::kI64, comm::ReduceOp::kSum); !st.is_ok()) {
    if ((g.leader() || n_groups == 1) && st.code() == Code::kDeadlineExceeded)
      fatal(SF_ERR(kDeadlineExceeded,
                   sformat("the final tally: every group finished its requests, but a rank did "
                           "not arrive within --stall-timeout (%.0f s): it stopped or hung after "
                           "its group's last request; ending the job (%s)",
                           o.stall_timeout_s, st.message().c_str())));
    fatal(st);
  }
  if (rank0) {
    std::printf(
        "batch done: %lld written, %lld already complete, %lld failed, %zu bad lines -> %s "
        "(%.1f s)\n",
        static_cast<long long>(tot[0]), static_cast<long long>(tot[1]),
        static_cast<long long>(tot[2]), bf.bad.size(), o.out.c_str(), job_s());
    if (o.prefix_cache_bytes > 0)
      std::printf("prefix cache: %lld prompt tokens reused, not computed\n",
                  static_cast<long long>(tot[3]));
  }
  return finish({tot[2] > 0 || !bf.bad.empty() ? 3 : 0, ""});
}

}  // namespace
}  // namespace sf

int main(int argc, char** argv) {
  try {
    return sf::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    sf::comm::mpi_abort_job(1);
  }
}
