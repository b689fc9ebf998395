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
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>

#include "comm/mpi_communicator.h"
#include "common/file_io.h"
#include "common/log.h"
#include "common/text.h"
#include "common/thread_pool.h"
#include "common/timing.h"
#include "kvstore/kv_export.h"
#include "worker/batch_loop.h"
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
using worker::GroupProgress;
using worker::HostKvSizing;
using worker::Fault;
using worker::host_peers;
using worker::HostPeers;
using worker::kUsage;
using worker::Options;
using worker::parse_fault;
using worker::parse_options;
using worker::PrefixRequests;
using worker::print_dry_run;
using worker::plain_bf16;

int run(int argc, char** argv) {
  const auto job_t0 = std::chrono::steady_clock::now();
  const auto job_s = [&] {
    return sf::seconds_since(job_t0);
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
  // A --prefix-cache budget under one entry: the same on every rank (one model, one option), a
  // start-up error like the option's other checks, before the lines, a plan or any output.
  if (o.prefix_cache_bytes > 0)
    if (Status st = PrefixRequests::check_budget(o, cfg); !st.is_ok())
      return finish({2, st.message()});
  std::string no_tok;
  const std::optional<model::Tokenizer> tok = worker::load_tokenizer(o, m, &no_tok);
  if (!no_tok.empty() && rank0)
    std::fprintf(stderr, "warning: no tokenizer (%s): lines with a 'prompt' are refused\n",
                 no_tok.c_str());
  // node_exporter's textfile collector reads *.prom files only: another name is written and
  // never scraped.
  if (rank0 && !o.metrics_file.empty() && fs::path(o.metrics_file).extension() != ".prom")
    std::fprintf(stderr,
                 "warning: --metrics-file '%s' does not end in .prom: node_exporter's textfile "
                 "collector will not read it\n",
                 o.metrics_file.c_str());

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
  if (fault.kind == "refuse_line" && fault.rank == world->rank())  // tests: this rank's checks
    for (auto it = good.begin(); it != good.end(); ++it)
      if (it->line == fault.layer) {
        bf.bad.push_back({it->line, "fault injection: refused on this rank"});
        good.erase(it);
        break;
      }
  worker::agree_requests(*world, &bf, &good);
  // Repeated ids on the agreed lines, the same on every rank: the first line that passes every
  // check on every rank owns its id.
  good = runtime::first_of_each_id(std::move(good), bf.bad);
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
  // --prefix-cache: this rank's cache and the requests computed behind it.
  std::unique_ptr<PrefixRequests> prefix;
  if (o.prefix_cache_bytes > 0) {
    auto p = PrefixRequests::create(o, m, dmodel ? &*dmodel : nullptr, model_compat);
    if (!p.is_ok()) fatal(p.status());
    prefix = std::move(p).value();
  }
  if (g.leader()) {
    std::error_code ec;
    fs::create_directories(o.out, ec);
    if (ec) fatal(SF_ERR(kIo, "cannot create output dir '" + o.out + "': " + ec.message()));
  }

  // This group's share, round-robin over the good requests.
  int64_t my_total = 0;
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
  // This group's share of the batch (worker/batch_loop.h).
  worker::BatchLoop loop({.o = &o,
                          .m = &m,
                          .g = &g,
                          .world = world.get(),
                          .fault = fault,
                          .dm = dmodel ? &*dmodel : nullptr,
                          .dgrid = dgrid ? &*dgrid : nullptr,
                          .prefix = prefix.get(),
                          .sparse = sparse ? &*sparse : nullptr,
                          .sizing = &sizing,
                          .metrics = &metrics,
                          .job = job,
                          .host_bf16 = host_bf16,
                          .local_ranks = local_ranks,
                          .my_total = my_total,
                          .host_avail = host_avail,
                          .beat = beat,
                          .fatal = fatal});
  for (size_t i = size_t(g.group); i < good.size(); i += size_t(n_groups)) loop.request(good[i]);
  loop.drain();
  loop.publish(/*in_flight=*/false, /*finished=*/true);
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
  int64_t mine[4] = {g.leader() ? loop.done() : 0, g.leader() ? loop.skipped() : 0,
                     g.leader() ? loop.failed() : 0, prefix ? prefix->reused_total() : 0},
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
