#include "worker/request_exports.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <system_error>
#include <thread>

#include "common/file_io.h"
#include "common/text.h"
#include "common/timing.h"
#include "worker/job_comm.h"
#include "worker/request_summary.h"

namespace sf::worker {
namespace {

using clk = std::chrono::steady_clock;


// The files' writer on its own thread; where no thread can be had (std::system_error), the write
// runs here: the group's next collective (finish) must not wait on a rank that gave up. Its time
// counts from the launch, so a wait for it never exceeds it but by a wake-up. A streamed write
// cannot run here (it waits for layers the prefill, not yet begun, would publish): `no_thread`,
// when given, is its outcome instead.
template <typename Write>
std::future<WriteOutcome> launch(Write write,
                                 std::function<WriteOutcome(const std::system_error&)> no_thread = {}) {
  const auto w0 = clk::now();
  auto timed = [write, w0] {
    WriteOutcome w = write();
    w.seconds = seconds_since(w0);
    return w;
  };
  try {
    return std::async(std::launch::async, timed);
  } catch (const std::system_error& e) {
    std::promise<WriteOutcome> p;
    p.set_value(no_thread ? no_thread(e) : timed());
    return p.get_future();
  }
}

// Test faults: a write that sleeps `ms` after each layer it has written.
void sleep_after_each_layer(kvstore::ExportOptions& eo, int64_t ms) {
  eo.on_layer_written = [written = eo.on_layer_written, ms](int l) {
    if (written) written(l);
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  };
}

// What can be read of an export's files (a listing error counts nothing more).
int64_t dir_bytes(const std::string& dir) {
  int64_t bytes = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code fe;
    const uintmax_t n = it->is_regular_file(fe) ? it->file_size(fe) : 0;
    if (!fe) bytes += int64_t(n);
  }
  return bytes;
}

}  // namespace

void PendingExport::attach() {
  std::vector<int> early;
  {
    std::lock_guard<std::mutex> lk(attach_mu);
    attached = true;
    early.swap(written_early);
  }
  for (const int l : early) {
    freed_bytes.fetch_add(res.kv.free_layer(l));
    freed_layers.fetch_add(1);
  }
}

bool PendingExport::written() const {
  return !write.valid() || write.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

PendingExport::~PendingExport() {
  if (gate) gate->fail(SF_ERR(kInternal, "the request's export was abandoned"));
}

Status publish_layer(PendingExport& x, int l, const model::KvCache& kv,
                     std::span<const float> imp) {
  if (x.imp) {
    std::vector<float>& dst = x.imp->layers[size_t(l)];
    if (imp.size() != dst.size())
      return SF_ERR(kInternal, "streamed export: layer " + std::to_string(l) +
                                   "'s importance has " + std::to_string(imp.size()) +
                                   " scores, not " + std::to_string(dst.size()));
    std::copy(imp.begin(), imp.end(), dst.begin());
  }
  return x.gate->publish(l, kv);
}

RequestExports::RequestExports(Setup s) : s_(std::move(s)) {
  const Options& o = *s_.o;
  // A CPU prefill keeps every core busy: an export written beside it takes one layer at a time,
  // not the several that compete with the prefill's threads (on GPUs the host cores are free).
  const bool overlap_cpu = o.export_overlap && !s_.device;
  width_ = o.export_threads > 0 ? o.export_threads
           : overlap_cpu        ? 1
                                : kvstore::default_layers_in_flight();
  freeing_ms_ = s_.fault.kind == "freeing" && s_.fault.rank == s_.world_rank ? int(s_.fault.layer)
                                                                             : 0;
}

bool RequestExports::group_aborted() const {
  return s_.g->group_comm->aborted() || s_.g->cp->aborted() || s_.g->tp->aborted();
}

// Frees layer l of a request's host K/V (F32 or bf16) once its files are written: a next request
// that would not fit beside the whole export can start when enough of it is gone.
std::function<void(int)> RequestExports::free_layer_when_written(PendingExport& x) const {
  return [&x, ms = freeing_ms_](int l) {
    x.written_layers.fetch_add(1);
    {
      std::lock_guard<std::mutex> lk(x.attach_mu);
      if (!x.attached) {  // a streamed export's prefill still runs: freed at attach()
        x.written_early.push_back(l);
        return;
      }
    }
    x.freed_bytes.fetch_add(x.res.kv.free_layer(l));
    x.freed_layers.fetch_add(1);
    if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  };
}

std::unique_ptr<PendingExport> RequestExports::make(const runtime::BatchRequest& r,
                                                    const kvstore::KvEncodings& encs,
                                                    const std::string& fingerprint,
                                                    int64_t k) const {
  auto x = std::make_unique<PendingExport>();
  x->r = &r;
  x->k = k;
  x->encs = encs;
  x->fingerprint = fingerprint;
  x->dir = runtime::request_dir(s_.o->out, r.id);
  kvstore::KvExportSpec& spec = x->spec;
  spec = kvstore::model_export_spec(*s_.m);
  spec.n_tokens = int64_t(r.tokens.size());
  spec.token_ids = r.tokens;
  spec.encoding = encs.high;
  spec.encoding_low = encs.low;
  return x;
}

void RequestExports::start(PendingExport& x) {
  runtime::GridComms& g = *s_.g;
  const Fault& fault = s_.fault;
  const auto t0 = clk::now();
  if (s_.o->export_mode == "sharded") {
    auto b = runtime::ShardedExport::begin(g, x.dir, x.spec, x.res.kv);
    if (group_aborted()) end_job(b.status());
    x.begin_s = seconds_since(t0);
    if (!b.is_ok()) {
      x.begun = b.status();
      return;
    }
    x.sharded = std::move(b).value();
    kvstore::ExportOptions eo;
    eo.layers_in_flight = width_;
    eo.on_layer_written = free_layer_when_written(x);
    if (x.gate && fault.kind == "fail_after" && fault.rank == s_.world_rank && fault.layer > 0)
      // (fail_after's N: this rank's streamed export sleeps N ms after each layer, so it is
      // still reading the prefill's rows when the request fails.)
      sleep_after_each_layer(eo, fault.layer);
    if ((fault.kind == "slow_export" || fault.kind == "slow_all") && fault.rank == s_.world_rank &&
        fault.layer > 0) {
      // (slow_export's N: this rank's shard files take N ms more a layer, one layer at a time:
      // a slow filesystem on one host.)
      eo.layers_in_flight = 1;
      sleep_after_each_layer(eo, fault.layer);
    }
    const int rank = g.group_comm->rank();  // as a write's own errors name it
    std::function<WriteOutcome(const std::system_error&)> no_thread;
    if (x.gate)
      no_thread = [rank](const std::system_error& e) {
        WriteOutcome w;
        w.mine = "error\nrank " + std::to_string(rank) +
                 ": no thread for the streamed export: " + e.what();
        return w;
      };
    x.write = launch(
        [&x, eo, rank] {
          WriteOutcome w;
          try {
            w.mine = x.gate ? x.sharded->write_streamed(*x.gate, eo) : x.sharded->write(eo);
          } catch (const std::exception& e) {  // reported as this rank's error, as a write's
            w.mine = "error\nrank " + std::to_string(rank) + ": export thread: " + e.what();
          }
          return w;
        },
        std::move(no_thread));
  } else if (g.leader()) {
    kvstore::ExportOptions eo;
    // (The slow-export fault stands for a slow filesystem: one layer at a time, so its export
    // outlasts --comm-timeout on any core count.)
    const bool slow = fault.kind == "slow_export" || fault.kind == "slow_all";
    eo.layers_in_flight = slow ? 1 : width_;
    eo.on_layer_written = free_layer_when_written(x);
    const int slow_ms = slow && fault.rank == s_.world_rank ? int(fault.layer) : 0;
    x.write = launch([&x, eo, slow_ms] {
      WriteOutcome w;
      try {
        w.st = kvstore::export_kv(
            x.dir, x.spec,
            [&](int l, bool v) {
              if (!v && slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
              return (v ? x.res.kv.v : x.res.kv.k)[size_t(l)].data();
            },
            /*force=*/true, eo);
      } catch (const std::exception& e) {
        w.st = SF_ERR(kInternal, std::string("export thread: ") + e.what());
      }
      return w;
    });
  }
}

// The heartbeat goes from this thread only: a long wait for a writer is progress too.
WriteOutcome RequestExports::wait_writer(PendingExport& x) {
  WriteOutcome w;
  if (x.write.valid()) {
    while (x.write.wait_for(std::chrono::milliseconds(200)) != std::future_status::ready)
      s_.beat();
    w = x.write.get();
  }
  return w;
}

void RequestExports::abandon(std::unique_ptr<PendingExport> x, const Status& why) {
  x->gate->fail(why);
  (void)wait_writer(*x);
  if (x->begun.is_ok() && x->sharded) {
    const Status st = x->sharded->finish(
        *s_.g, "error\nrank " + std::to_string(s_.g->group_comm->rank()) +
                   ": the request failed (" + why.message() + ")");
    if (group_aborted()) end_job(st);
  }
}

bool RequestExports::complete(std::unique_ptr<PendingExport> x) {
  runtime::GridComms& g = *s_.g;
  const Options& o = *s_.o;
  const auto w0 = clk::now();
  const WriteOutcome w = wait_writer(*x);
  const double wait_s = seconds_since(w0);
  const auto f0 = clk::now();
  Status st;
  if (o.export_mode == "sharded") {
    st = x->begun;
    if (st.is_ok()) {
      // Each rank waited for its own writer only: finish's first collective waits for the
      // slowest rank's files, under --stall-timeout as the gathered export's wait below.
      {
        DeadlineAtLeast d(*g.group_comm, o.stall_timeout_s);
        st = x->sharded->finish(g, w.mine);
      }
      if (group_aborted()) end_job(st);
    }
  } else {
    st = w.st;
    // The other ranks wait for the leader's export here (every layer written and hashed: minutes
    // for a long prompt on a slow filesystem), under --stall-timeout, not in the next request's
    // first collective under --comm-timeout.
    int32_t wrote = st.is_ok() ? 1 : 0;
    Status bs;
    {
      DeadlineAtLeast d(*g.group_comm, o.stall_timeout_s);
      bs = g.group_comm->bcast(&wrote, 1, DType::kI32, 0);
    }
    if (!bs.is_ok()) end_job(bs);
  }
  const double finish_s = seconds_since(f0);
  if (!g.leader()) return true;
  if (!st.is_ok()) {
    std::fprintf(stderr, "%s:%lld: request '%s' failed: %s\n", o.batch.c_str(),
                 static_cast<long long>(x->r->line), x->r->id.c_str(), st.message().c_str());
    return false;
  }
  return write_summary(*x, w, wait_s, finish_s);
}

bool RequestExports::write_summary(const PendingExport& x, const WriteOutcome& w, double wait_s,
                                   double finish_s) {
  const Options& o = *s_.o;
  const runtime::BatchRequest& r = *x.r;
  const runtime::ParallelStats& s = x.res.stats;
  // The export's own time (its opening, the files, the manifest), and what of it the batch
  // waited for: all of it with --export-overlap off, less what the next prefill hid.
  const double export_s = x.begin_s + w.seconds + finish_s;
  const double export_wait_s = x.begin_s + wait_s + finish_s;
  const int64_t export_bytes = dir_bytes(x.dir);
  RequestSummary sum;
  sum.request = &r;
  sum.first_token = x.res.first_token;
  sum.tp = o.tp;
  sum.cp = o.cp;
  sum.group = s_.g->group;
  sum.stats = &s;
  sum.attention = o.attention;
  sum.kv_host_dtype = s_.host_bf16 ? "bf16" : "f32";
  sum.export_mode = o.export_mode;
  sum.device = o.device;
  sum.retention = x.ret.policy + (x.ret.params.empty() ? "" : ":" + x.ret.params);
  sum.kv_kept_fraction = x.kept_frac;
  sum.kv_dtype = kvstore::kv_encodings_name(x.encs);
  sum.prefix_reused_tokens = x.reused_tokens;
  sum.export_s = export_s;
  sum.export_bytes = export_bytes;
  sum.export_wait_s = export_wait_s;
  sum.export_streamed = x.gate != nullptr;
  sum.export_layers_at_prefill_end = x.written_at_prefill_end;
  sum.memory_wait_s = x.memory_wait_s;
  sum.fingerprint = x.fingerprint;
  sum.plan = x.plan;
  sum.chunk = o.chunk;
  sum.device_workspace_bytes = x.device_workspace_bytes;
  if (Status ws = write_file_atomic(x.dir + ".json", request_summary_json(sum) + "\n");
      !ws.is_ok()) {
    std::fprintf(stderr, "%s:%lld: request '%s' failed: %s\n", o.batch.c_str(),
                 static_cast<long long>(r.line), r.id.c_str(), ws.message().c_str());
    return false;
  }
  s_.metrics->add_written({int64_t(r.tokens.size()), x.reused_tokens, s.seconds, s.comm_s,
                           s.group_kv_allgather_bytes, s.group_kv_moved_bytes,
                           s.group_estimate_bytes, s.tp_allreduce_bytes, export_s, export_bytes,
                           export_wait_s, s.plan_s, s.sparse_grows, s.attention_s_by_rank,
                           s.comm_s_by_rank, x.memory_wait_s, x.device_workspace_bytes});
  const std::string reused =
      s_.prefix_cache ? " (" + std::to_string(x.reused_tokens) + " from the prefix cache)" : "";
  const std::string plan =
      std::string(s.plan_s > 0 ? sformat(", after a %.3f s plan", s.plan_s) : "") +
      (s.sparse_grows > 0 ? sformat(", sparse plan grown %d time(s) during the run", s.sparse_grows)
                          : "");
  std::printf(
      "[group %d] %lld/%lld %s: %zu tokens%s, first token %d, %.3f s (%.0f tokens/s, comm %.3f "
      "s%s), export %.3f s (%.3f s waited) -> %s\n",
      s_.g->group, static_cast<long long>(x.k), static_cast<long long>(s_.my_total),
      r.id.c_str(), r.tokens.size(), reused.c_str(), x.res.first_token, s.seconds,
      double(r.tokens.size()) / s.seconds, s.comm_s, plan.c_str(), export_s, export_wait_s,
      x.dir.c_str());
  std::fflush(stdout);
  return true;
}

}  // namespace sf::worker
