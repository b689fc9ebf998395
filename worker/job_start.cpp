#include "worker/job_start.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "common/checksum.h"
#include "common/file_io.h"
#include "kvstore/kv_export.h"
#include "worker/job_comm.h"
#include "worker/job_identity.h"
#include "worker/model/gguf.h"
#include "worker/runtime/batch.h"
#include "worker/runtime/batch_metrics.h"

namespace sf::worker {

namespace fs = std::filesystem;

namespace {
// A collective's own failure: the world may be aborted, and ranks stuck in it.
void end_if_aborted(comm::Communicator& world) {
  if (world.aborted()) end_job(world.abort_status());
}
}  // namespace

std::optional<JobExit> agree_options(comm::Communicator& world, const Result<Options>& opts) {
  Status all = agree(world, opts.status());
  end_if_aborted(world);
  if (all.is_ok()) {
    const Options& p = opts.value();
    auto same = same_on_every_rank(
        world, {policy_fingerprint(p.retention), int64_t(p.dry_run), int64_t(p.export_overlap),
                int64_t(p.host_memory_check), int64_t(p.help),
                int64_t(p.kv_host_auto) * 2 + int64_t(p.kv_host_bf16), int64_t(p.export_stream),
                p.chunk});
    if (!same.is_ok()) end_job(same.status());
    if (!same.value()[0])
      all = SF_ERR(kInvalidArgument,
                   "--retention: the ranks read different policies (a moa config file must "
                   "hold the same spans on every host)");
    else if (!same.value()[1] || !same.value()[2] || !same.value()[3] || !same.value()[4] ||
             !same.value()[5] || !same.value()[6] || !same.value()[7])
      all = SF_ERR(kInvalidArgument,
                   "the ranks were given different --dry-run, --export-overlap, "
                   "--host-memory-check, --kv-host-dtype, --export-stream or --chunk flags (or "
                   "--help on some only; an MPMD launch must pass the same ones to every rank)");
  }
  if (all.is_ok()) return std::nullopt;
  if (world.rank() == 0) std::fputs(kUsage, stderr);
  return JobExit{2, all.message()};
}

std::optional<JobExit> claim_output(comm::Communicator& world, const Options& o,
                                    const runtime::GridShape& shape, int n_groups) {
  if (o.dry_run) return std::nullopt;  // a dry run reads --out (resume status) and writes nothing
  // Rank 0 creates --out and holds its lock until the job ends (a filesystem without flock: no
  // lock, said once). Under the lock, what a killed earlier job left half written goes: a
  // 1M-token export left by a preempted job is hundreds of gigabytes. Then, once every rank
  // knows the lock is this job's (a second job stopped at it must not touch the running one's
  // files), each leader checks its metrics file and removes an earlier job's on its host
  // (perhaps for another group count); the second agreement comes before any leader writes its
  // own.
  Status mine = Status::ok();
  if (world.rank() == 0) {
    std::error_code ec;
    fs::create_directories(o.out, ec);
    auto l = ec ? Result<int>(SF_ERR(kIo, "cannot create output dir '" + o.out + "': " + ec.message()))
                : runtime::lock_output_dir(o.out);
    if (!l.is_ok()) {
      mine = l.status();
    } else if (l.value() < 0) {
      std::fprintf(stderr,
                   "warning: --out '%s': this filesystem has no flock, so nothing stops a second "
                   "job writing it, and no stale partial output is removed\n",
                   o.out.c_str());
    } else {
      // The lock's descriptor stays open (and the lock held) until the process exits.
      std::vector<std::string> left;
      auto removed = runtime::remove_stale_partials(o.out, &left);
      if (removed.is_ok() && removed.value() > 0)
        std::printf("%s: removed %lld stale partial output(s) of an earlier job\n", o.out.c_str(),
                    static_cast<long long>(removed.value()));
      else if (!removed.is_ok())
        mine = removed.status();
      for (const std::string& l : left)
        std::fprintf(stderr, "warning: --out: cannot remove a stale partial output, left: %s\n",
                     l.c_str());
    }
  }
  Status all = agree(world, mine);
  end_if_aborted(world);
  if (!all.is_ok()) return JobExit{2, all.message()};
  if (o.metrics_file.empty()) return std::nullopt;
  // The metrics files: each leader locks its own (FILE.lock, held until the process exits, naming
  // this job by rank 0's pid and host), so a second job on the same --metrics-file stops here;
  // then, once every leader holds its lock, each removes an earlier job's files on its host
  // (perhaps for another group count), but none another running job holds.
  std::string holder = "sparsefill-worker pid " + std::to_string(::getpid()) + " on " + host_name();
  int64_t len = int64_t(holder.size());
  if (Status st = world.bcast(&len, 1, DType::kI64, 0); !st.is_ok()) end_job(st);
  holder.resize(size_t(len));
  if (Status st = world.bcast(holder.data(), len, DType::kU8, 0); !st.is_ok()) end_job(st);
  const bool leader = world.rank() % shape.group_size() == 0;
  if (leader) {
    const std::string mine_path = runtime::BatchMetrics::group_path(
        o.metrics_file, world.rank() / shape.group_size(), n_groups);
    mine = check_output_file(mine_path, "--metrics-file");
    if (mine.is_ok()) {
      // The descriptor stays open (the lock held) until the process exits, as --out's.
      auto l = runtime::lock_file(mine_path + ".lock", holder);
      if (!l.is_ok() && l.status().code() == Code::kAlreadyExists)
        mine = runtime::BatchMetrics::in_use(mine_path, l.status().message());
      else if (!l.is_ok())
        mine = l.status();
    }
  }
  all = agree(world, mine);
  end_if_aborted(world);
  if (!all.is_ok()) return JobExit{2, all.message()};
  if (leader) mine = runtime::BatchMetrics::remove_group_files(o.metrics_file, holder);
  all = agree(world, mine);
  end_if_aborted(world);
  if (!all.is_ok()) return JobExit{2, all.message()};
  return std::nullopt;
}

std::optional<JobExit> read_batch(comm::Communicator& world, const Options& o, std::string* text) {
  int64_t len = -1;
  std::string err;
  if (world.rank() == 0) {
    Result<std::string> r = read_file(o.batch, "batch file");
    if (r.is_ok()) {
      *text = std::move(r).value();
      len = int64_t(text->size());
    } else {
      err = r.status().message();
    }
  }
  if (Status st = world.bcast(&len, 1, DType::kI64, 0); !st.is_ok()) end_job(st);
  if (len < 0) return JobExit{2, err};
  text->resize(size_t(len));
  if (Status st = world.bcast(text->data(), len, DType::kU8, 0); !st.is_ok()) end_job(st);
  return std::nullopt;
}

std::optional<JobExit> load_model(comm::Communicator& world, const Options& o, bool fault_load,
                                  Result<model::Model>* out) {
  Result<model::Model>& mr = *out;
  if (fault_load) {
    mr = SF_ERR(kIo, "fault injection: rank " + std::to_string(world.rank()) + " cannot load '" +
                         o.model + "'");
  } else {
    mr = o.synthetic ? model::Model::shape_only(o.synthetic->config, o.model)
                     : model::Model::load(o.model);
  }
  Status mine = mr.is_ok() ? Status::ok()
                           : Status(mr.status().code(),
                                    "rank " + std::to_string(world.rank()) +
                                        " could not load the model: " + mr.status().message());
  Status all;
  {
    DeadlineAtLeast d(world, 10 * std::chrono::duration<double>(world.timeout()).count());
    all = agree(world, mine);
  }
  end_if_aborted(world);
  if (!all.is_ok()) return JobExit{1, all.message(), /*every_rank=*/true};
  return std::nullopt;
}

std::optional<JobExit> check_model(comm::Communicator& world, const Options& o,
                                   const model::Model& m, const std::string& job,
                                   std::optional<model::SparseConfig>* sparse) {
  const model::ModelConfig& cfg = m.config();
  Status mine = runtime::check_model_divides(cfg, o.tp);
  if (mine.is_ok()) {
    if (Status st = kvstore::retention_check_geometry(o.retention, cfg.n_layers, cfg.n_kv_heads);
        !st.is_ok())
      mine = Status(st.code(), "--retention: " + st.message());
  }
  if (mine.is_ok() && o.attention != "dense") {
    auto sc = model::sparse_config_for_mode(o.attention, cfg.n_layers, cfg.n_heads);
    if (sc.is_ok())
      sparse->emplace(std::move(sc).value());
    else
      mine = Status(sc.status().code(),
                    "rank " + std::to_string(world.rank()) + ": " + sc.status().message());
  }
  Status all = agree(world, mine);
  end_if_aborted(world);
  if (!all.is_ok()) return JobExit{2, all.message()};
  // The job identity holds the model's and the attention's parts of every request's
  // fingerprint. They are read on each rank's host: ranks holding other weights or another
  // config file would compute a mix of two models.
  auto same = same_on_every_rank(
      world, {int64_t(xxh64_bytes(job.data(), job.size()) & 0x7fffffffffffffffULL)});
  if (!same.is_ok()) end_job(same.status());
  if (!same.value()[0])
    return JobExit{2,
                   "the ranks read different model weights or --attention config files (each "
                   "host must hold the same files: compare their sizes and checksums)"};
  return std::nullopt;
}

std::optional<model::Tokenizer> load_tokenizer(const Options& o, const model::Model& m,
                                               std::string* why) {
  if (!m.has_weights() || m.format() != model::ModelFormat::kGguf) return std::nullopt;
  auto g = model::GgufFile::open(o.model);
  if (!g.is_ok()) {
    *why = g.status().message();
    return std::nullopt;
  }
  auto spec = model::tokenizer_spec_from_gguf(g.value(), model::TokenizerCompat::kGguf);
  if (!spec.is_ok()) {
    *why = spec.status().message();
    return std::nullopt;
  }
  auto t = model::Tokenizer::create(std::move(spec).value());
  if (!t.is_ok()) {
    *why = t.status().message();
    return std::nullopt;
  }
  return std::move(t).value();
}

void agree_requests(comm::Communicator& world, runtime::BatchFile* bf,
                    std::vector<runtime::BatchRequest>* good) {
  int64_t n_lines = 0;
  for (const auto& r : *good) n_lines = std::max(n_lines, r.line);
  for (const auto& b : bf->bad) n_lines = std::max(n_lines, b.line);
  int64_t all_lines = 0;
  if (Status st = world.all_reduce(&n_lines, &all_lines, 1, DType::kI64, comm::ReduceOp::kMax);
      !st.is_ok())
    end_job(st);
  std::vector<int64_t> fp(size_t(all_lines + 1), -1);
  for (const auto& r : *good)
    fp[size_t(r.line)] = r.retention ? policy_fingerprint(*r.retention) : 0;
  auto same = same_on_every_rank(world, fp);
  if (!same.is_ok()) end_job(same.status());
  std::vector<runtime::BatchRequest> agreed;
  for (auto& r : *good) {
    if (same.value()[size_t(r.line)]) {
      agreed.push_back(std::move(r));
    } else {
      bf->bad.push_back({r.line,
                         "rejected on another rank (that rank could not tokenize it, or its "
                         "field 'retention' names a moa config that rank cannot read or reads "
                         "with other spans)"});
    }
  }
  *good = std::move(agreed);
}

}  // namespace sf::worker
