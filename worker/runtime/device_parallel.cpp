#include "worker/runtime/device_parallel.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/nccl_communicator.h"
#include "common/timing.h"
#include "kernels/cuda/cuda_ops.h"

#if SF_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace sf::runtime {

Result<int> local_device(int world_rank) {
  int n = 0;
  SF_TRY(kernels::cuda::device_count(&n));
  if (n <= 0) return SF_ERR(kUnsupported, "no CUDA device visible to this rank");
  int local = world_rank;
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* e = std::getenv(v); e && *e) {
      local = std::atoi(e);
      break;
    }
  return local % n;
}

Result<DeviceGrid> make_device_grid(GridComms& g, int device) {
  DeviceGrid dg;
  dg.device = device;
  // A size-1 row or column needs no transport (NCCL init would cost time for nothing).
  // Named after the host communicator it is built over ("tp (group g, cp rank c)"), so a
  // deadline on the device names which group and row stalled, as the host's errors do.
  auto one = [&](comm::Communicator& host) -> Result<std::unique_ptr<comm::Communicator>> {
    if (host.size() == 1) return comm::make_self_communicator(host.name() + " (self)");
    return comm::make_nccl_communicator(host, device, host.name() + " (nccl)");
  };
  SF_ASSIGN(dg.tp, one(*g.tp));
  SF_ASSIGN(dg.cp, one(*g.cp));
  return dg;
}

namespace {

// A rank's attention pieces (cp_rank_pieces) as the device shard's [begin, end) pairs.
std::vector<std::array<int64_t, 2>> rank_pieces(int64_t S, int cp, int r) {
  std::vector<std::array<int64_t, 2>> out;
  for (const TokenRange& p : cp_rank_pieces(S, cp, r)) out.push_back({p.begin, p.end});
  return out;
}

}  // namespace

struct DeviceParallelPrefill::Impl {
  GridComms* g = nullptr;
  DeviceGrid* dg = nullptr;
  int64_t S = 0, kvd = 0, head_dim = 0;
  size_t n_layers = 0;
  std::vector<std::array<int64_t, 2>> mine;
  std::vector<std::vector<std::array<int64_t, 2>>> rank_rows;  // per CP rank: its pieces
  std::vector<int64_t> counts;        // per CP rank: K (or V) elements it contributes
  kernels::cuda::DeviceBuffer stage;  // the all-gather's landing zone: [S, kvd], rank blocks
  std::optional<model::DevicePrefill> prefill;
  int64_t kv_recv_bytes = 0;  // per run: the K/V bytes the CP all-gather brings this rank
  // A prompt too short for a 64-token block on each CP rank: every CP rank computes it whole
  // (no exchange), and keeps only its own pieces' rows, so exports shard as at any length.
  bool whole = false;
  bool importance = false;    // PrefillOptions::importance_window > 0
  bool keep_kv = false;       // PrefillOptions::keep_kv
  model::LayerKvHooks kv_hooks;  // the current run's (run's argument)
  std::function<void(int64_t)> before_tp_sum;  // DeviceParallelOptions::before_tp_sum
  int64_t tp_sums = 0;                          // overlapped TP sums enqueued since the plan

  // CP exchange: all-gather each of K and V into `stage` (rank blocks in rank order), then copy
  // every rank's pieces to their places in the prompt.
  Status exchange(const void* kl, const void* vl, void* ka, void* va, DType dt) {
#if SF_HAVE_CUDA
    const size_t es = dtype_size(dt);
    const int me = g->cp_rank;
    for (int which = 0; which < 2; ++which) {
      SF_TRY(dg->cp->all_gatherv(which ? vl : kl, counts[size_t(me)], stage.data(), counts, dt));
      char* dst = static_cast<char*>(which ? va : ka);
      const char* src = static_cast<const char*>(stage.data());
      for (const auto& rows : rank_rows)
        for (const auto& p : rows) {
          const size_t bytes = size_t((p[1] - p[0]) * kvd) * es;
          if (cudaMemcpyAsync(dst + size_t(p[0] * kvd) * es, src, bytes, cudaMemcpyDeviceToDevice,
                              nullptr) != cudaSuccess)
            return SF_ERR(kInternal, "device CP exchange: unpacking the all-gathered rows failed");
          src += bytes;
        }
      // Device-to-device copies return before they finish, and neither NCCL's stream nor the
      // forward's compute stream orders after the legacy stream: wait before `stage` is reused
      // and before attention reads the rows.
      SF_TRY(kernels::cuda::stream_synchronize(nullptr));
    }
    return Status::ok();
#else
    (void)kl, (void)vl, (void)ka, (void)va, (void)dt;
    return SF_ERR(kUnsupported, "built without CUDA");
#endif
  }
};

Result<DeviceParallelPrefill> DeviceParallelPrefill::plan(const model::DeviceModel& dm,
                                                          GridComms& g, DeviceGrid& dg,
                                                          int64_t n_tokens,
                                                          const model::PrefillOptions& opt,
                                                          const DeviceParallelOptions& popt) {
  const int TP = g.shape.tp, CP = g.shape.cp;
  if (!g.tp || !g.cp || !dg.tp || !dg.cp || dg.tp->size() != TP || dg.cp->size() != CP)
    return SF_ERR(kInvalidArgument,
                  "device parallel prefill: communicators do not match the grid shape");
  SF_TRY(check_model_divides(dm.full_config(), TP));
  if (dm.slice().ways != TP || dm.slice().index != g.tp_rank)
    return SF_ERR(kInvalidArgument, "device parallel prefill: the model holds TP slice " +
                                        std::to_string(dm.slice().index) + " of " +
                                        std::to_string(dm.slice().ways) + ", this rank is " +
                                        std::to_string(g.tp_rank) + " of " + std::to_string(TP));
  if (dm.device() != dg.device)
    return SF_ERR(kInvalidArgument,
                  "device parallel prefill: model on cuda:" + std::to_string(dm.device()) +
                      ", communicators on cuda:" + std::to_string(dg.device));

  DeviceParallelPrefill p;
  p.impl_ = std::make_unique<Impl>();
  Impl& w = *p.impl_;
  w.g = &g;
  w.dg = &dg;
  w.S = n_tokens;
  const model::ModelConfig& c = dm.config();  // the slice's
  w.kvd = int64_t(c.n_kv_heads) * c.head_dim;
  w.head_dim = c.head_dim;
  w.n_layers = size_t(c.n_layers);
  w.mine = rank_pieces(n_tokens, CP, g.cp_rank);
  w.importance = opt.importance_window > 0;
  w.keep_kv = opt.keep_kv;
  // The device shard needs rows on every rank: below a 64-token block a CP rank, each CP rank
  // runs the prompt whole (at most 2 x CP x 64 tokens, a few milliseconds) instead of failing.
  w.whole = CP > 1 && n_tokens < 2 * CP * 64;
  for (int r = 0; r < CP; ++r) {
    w.rank_rows.push_back(rank_pieces(n_tokens, CP, r));
    int64_t rows = 0;
    for (const auto& pc : w.rank_rows.back()) rows += pc[1] - pc[0];
    w.counts.push_back(rows * w.kvd);
  }

  model::DeviceShard shard;
  shard.n_tokens = n_tokens;
  shard.pieces = w.whole ? std::vector<std::array<int64_t, 2>>{{0, n_tokens}} : w.mine;
  shard.logits = g.leader();
  Impl* wp = &w;
  if (CP > 1 && !w.whole)
    shard.exchange_kv = [wp](int, const void* kl, const void* vl, void* ka, void* va, DType dt) {
      return wp->exchange(kl, vl, ka, va, dt);
    };
  if (TP > 1 && popt.overlap_tp) {
    w.before_tp_sum = popt.before_tp_sum;
    shard.reduce_tp_enqueue = [wp](float* x, int64_t count, void* ready, void* done) {
      if (wp->before_tp_sum) wp->before_tp_sum(wp->tp_sums);
      ++wp->tp_sums;
      return wp->dg->tp->all_reduce_enqueue(x, count, DType::kF32, comm::ReduceOp::kSum, ready,
                                            done);
    };
    shard.reduce_tp_wait = [wp] { return wp->dg->tp->wait_enqueued(); };
    // A K/V copy can wait on these sums: the host's waits for copies get the communicator's
    // deadline, so a dead TP peer is an error there too, not a hang.
    shard.copy_wait_timeout_s = std::chrono::duration<double>(wp->dg->tp->timeout()).count();
  } else if (TP > 1) {
    shard.reduce_tp = [wp](float* x, int64_t count) {
      return wp->dg->tp->all_reduce(x, x, count, DType::kF32, comm::ReduceOp::kSum);
    };
  }
  if (opt.kv_hooks.final || opt.kv_hooks.failed)
    return SF_ERR(kInvalidArgument, "device parallel prefill: kv_hooks are run's argument");
  // Each run's own hooks, through the plan's (a prompt run whole is cut after the run).
  model::PrefillOptions shard_opt = opt;
  if (opt.keep_kv) {  // (without it no K/V reaches the host to hand over)
    shard_opt.kv_hooks.final = [wp](int l, const model::KvCache& kv, std::span<const float> imp) {
      if (wp->kv_hooks.final && !wp->whole) wp->kv_hooks.final(l, kv, imp);
    };
    shard_opt.kv_hooks.failed = [wp](model::KvCache&& kv) {
      if (wp->kv_hooks.failed) wp->kv_hooks.failed(std::move(kv));
    };
  }
  SF_ASSIGN(model::DevicePrefill dp,
            model::DevicePrefill::plan_shard(dm, std::move(shard), shard_opt));
  if (CP > 1 && !w.whole) {
    // The exchange dtype is the attention's: BF16 on the cuDNN path.
    const size_t es = dtype_size(dp.attention_dtype());
    SF_TRY(w.stage.alloc(size_t(n_tokens * w.kvd) * es));
    w.kv_recv_bytes = int64_t(c.n_layers) * 2 * (n_tokens - w.counts[size_t(g.cp_rank)] / w.kvd) *
                      w.kvd * int64_t(es);
  }
  w.prefill.emplace(std::move(dp));
  return p;
}

Result<ParallelResult> DeviceParallelPrefill::run(std::span<const int32_t> tokens,
                                                  const model::LayerKvHooks& kv) {
  Impl& w = *impl_;
  // (Before any collective: every rank of the group is given the same hooks.)
  if (!w.keep_kv && (kv.final || kv.failed))
    return SF_ERR(kInvalidArgument,
                  "device parallel prefill: K/V hooks need a plan with keep_kv (no K/V reaches "
                  "the host to hand over)");
  w.kv_hooks = kv;
  struct Clear {  // the hooks are this run's only
    Impl& w;
    ~Clear() { w.kv_hooks = {}; }
  } clear{w};
  GridComms& g = *w.g;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t tp0 = w.dg->tp->bytes_sent(), cp0 = w.dg->cp->bytes_sent(),
                grp0 = g.group_comm->bytes_sent();
  if (int64_t(tokens.size()) != w.S)
    return SF_ERR(kInvalidArgument, "device parallel prefill: " + std::to_string(tokens.size()) +
                                        " tokens, planned for " + std::to_string(w.S));
  Result<model::PrefillResult> rr = w.prefill->run(tokens);
  ParallelResult out;
  // A failure from here on (a peer's, or a collective's) hands this rank's K/V to kv.failed, as
  // the shard's own failed run does.
  struct HandOver {
    Result<model::PrefillResult>& rr;
    ParallelResult& out;
    const std::function<void(model::KvCache&&)>& failed;
    bool ok = false;
    ~HandOver() {
      if (ok || !failed) return;
      if (out.kv.n_layers > 0)
        failed(std::move(out.kv));
      else if (rr.is_ok())
        failed(std::move(rr.value().kv));
    }
  } hand{rr, out, kv.failed};
  // Any failure of any rank is every rank's, here, before the collectives below (a rank
  // returning alone would meet its peers' next collective with its caller's). A sparse index
  // that outgrew its plan is not one: each rank grew its own plan during the run. The group
  // reports its ranks' most grows.
  int32_t mine[2] = {rr.is_ok() ? 0 : 1, rr.is_ok() ? rr.value().sparse_grows : 0};
  int32_t all[2] = {0, 0};
  if (Status st = g.group_comm->all_reduce(mine, all, 2, DType::kI32, comm::ReduceOp::kMax);
      !st.is_ok()) {
    if (rr.is_ok()) return st;
    // This rank's own failure comes first: a stuck peer fails both, and its sums' deadline
    // (the TP communicator's watchdog) says more than the group's check does.
    return Status(rr.status().code(),
                  rr.status().message() + " (then the group's check of it: " + st.message() + ")",
                  __FILE__, __LINE__);
  }
  if (all[0]) {
    if (!rr.is_ok()) return rr.status();
    return SF_ERR(kInternal, "device parallel prefill: another rank of the group failed");
  }
  model::PrefillResult& r = rr.value();
  int32_t first = g.leader() ? r.first_token : -1;
  SF_TRY(g.group_comm->bcast(&first, 1, DType::kI32, 0));
  out.first_token = first;
  if (g.leader()) {
    out.logits = std::move(r.logits);
    out.n_logit_rows = r.n_logit_rows;
  }
  out.kv = std::move(r.kv);
  if (w.whole && (!out.kv.k.empty() || out.kv.bf16())) {
    // Computed whole: keep this rank's pieces' rows, as a sharded run holds them (F32 or bf16).
    const size_t row = size_t(w.kvd);
    int64_t n_mine = 0;
    for (const auto& p : w.mine) n_mine += p[1] - p[0];
    const auto keep_mine = [&](auto& layers) {
      for (auto& layer : layers) {
        std::remove_reference_t<decltype(layer)> kept(size_t(n_mine) * row);
        size_t o = 0;
        for (const auto& p : w.mine) {
          std::copy(layer.begin() + std::ptrdiff_t(size_t(p[0]) * row),
                    layer.begin() + std::ptrdiff_t(size_t(p[1]) * row), kept.begin() + std::ptrdiff_t(o));
          o += size_t(p[1] - p[0]) * row;
        }
        layer = std::move(kept);
      }
    };
    keep_mine(out.kv.k);
    keep_mine(out.kv.v);
    keep_mine(out.kv.k16);
    keep_mine(out.kv.v16);
    out.kv.n_tokens = n_mine;
  }
  ParallelStats& st = out.stats;
  if (w.importance) {
    // The slice's scores come from the CP rank that holds the prompt's end (CP rank 0, whose
    // last piece is the last chunk): to every CP rank, then every TP slice's heads to every rank
    // (host MPI; [KV heads, S] floats a layer).
    const int64_t n = int64_t(w.kvd / w.head_dim) * w.S;
    const int TP = g.shape.tp;
    const int64_t b0 = g.cp->bytes_sent() + g.tp->bytes_sent();
    // CP rank 0 says whether it has the scores first, so no rank retains on zeros.
    bool ok = r.importance.size() == w.n_layers;
    for (size_t l = 0; ok && l < w.n_layers; ++l) ok = int64_t(r.importance[l].size()) == n;
    int32_t have = g.cp_rank != 0 || ok ? 1 : 0, all_have = 0;
    SF_TRY(g.group_comm->all_reduce(&have, &all_have, 1, DType::kI32, comm::ReduceOp::kMin));
    if (!all_have)
      return SF_ERR(kInternal,
                    "device parallel prefill: the rank holding the prompt's end has no importance");
    std::vector<float> all(size_t(n * TP));
    out.importance.resize(w.n_layers);
    for (size_t l = 0; l < w.n_layers; ++l) {
      std::vector<float> mine =
          g.cp_rank == 0 ? std::move(r.importance[l]) : std::vector<float>(size_t(n));
      if (g.cp->size() > 1) SF_TRY(g.cp->bcast(mine.data(), n, DType::kF32, 0));
      if (TP == 1) {
        out.importance[l] = std::move(mine);
        continue;
      }
      SF_TRY(g.tp->all_gather(mine.data(), all.data(), n, DType::kF32));
      out.importance[l] = all;
    }
    st.importance_bytes = g.cp->bytes_sent() + g.tp->bytes_sent() - b0;
    st.importance_s = r.importance_s;
  }
  st.seconds = sf::seconds_since(t0);
  st.attention_s = r.attention_s;
  st.estimate_s = r.estimate_s;
  st.kv_alloc_s = r.kv_alloc_s;
  st.kv_copy_s = r.kv_copy_s;
  st.sparse_grows = all[1];
  st.density = r.density;
  st.comm_s = w.prefill->hook_seconds();
  st.kv_allgather_bytes = w.kv_recv_bytes;
  st.kv_moved_bytes = w.kv_recv_bytes;
  st.tp_allreduce_bytes = w.dg->tp->bytes_sent() - tp0;
  st.comm_bytes = st.tp_allreduce_bytes + (w.dg->cp->bytes_sent() - cp0) +
                  (g.group_comm->bytes_sent() - grp0) + st.importance_bytes;
  // Every TP rank holds as many heads, so causal pairs per head weigh the ranks alike.
  double causal = 0;
  const std::vector<std::array<int64_t, 2>> computed =
      w.whole ? std::vector<std::array<int64_t, 2>>{{0, w.S}} : w.mine;
  for (const auto& p : computed) {
    const double n = double(p[1] - p[0]);
    causal += n * double(p[0]) + n * (n + 1) / 2;
  }
  SF_TRY(gather_group_stats(g, causal * r.density, causal, &st));
  hand.ok = true;
  return out;
}

const std::vector<std::array<int64_t, 2>>& DeviceParallelPrefill::pieces() const {
  return impl_->mine;
}
std::vector<double> DeviceParallelPrefill::layer_seconds() const {
  return impl_->prefill->layer_seconds();
}
const model::DevicePrefill& DeviceParallelPrefill::prefill() const { return *impl_->prefill; }

DeviceParallelPrefill::DeviceParallelPrefill() = default;
DeviceParallelPrefill::DeviceParallelPrefill(DeviceParallelPrefill&&) noexcept = default;
DeviceParallelPrefill& DeviceParallelPrefill::operator=(DeviceParallelPrefill&&) noexcept = default;
DeviceParallelPrefill::~DeviceParallelPrefill() = default;

}  // namespace sf::runtime
