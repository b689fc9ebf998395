// Prefix-cached prefill on the device forward (prefix_prefill.h). Built only with SF_KV_CUDA.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "common/timing.h"
#include "kernels/api.h"
#include "kvstore/prefix_prefill.h"

namespace sf::kvstore {
namespace {

Status cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  return SF_ERR(kIo, std::string("prefix prefill (device): ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace

struct DevicePrefixPrefill::Impl {
  const model::DeviceModel* dm = nullptr;
  PrefixCache* cache = nullptr;
  std::string model_id;
  PrefixPrefillOptions opt;
  bool keep_kv = true;  // the caller's opt.prefill.keep_kv (the runs keep it regardless)
  // The hit plan (exactly hit_s tokens, prefix hit_p) and the miss plan (up to miss_max).
  std::optional<model::DevicePrefill> hit_plan, miss_plan;
  int64_t hit_s = -1, hit_p = -1, miss_max = 0;
  // What the hit plan's exchange reads during a run: the prefix's pinned blocks, and two F32
  // staging slots of its rows (2 x hit_p x kv_dim each; layer l uses slot l % 2). Each layer's
  // prefix rows also go to pinned host memory (K then V a layer) on `stream` while later layers
  // compute, from which fill_lead puts them in the result's KV: one DMA a layer instead of a
  // read of every block afterwards. Nothing in a layer waits on the host.
  std::vector<std::vector<BlockId>> blocks;
  float* staging = nullptr;
  float* host_prefix = nullptr;  // n_layers x 2 x hit_p x kv_dim, cudaHostAlloc'd
  cudaStream_t stream = nullptr;
  // Per layer: its prefix rows staged (compute stream), and on the host (`stream`).
  std::vector<cudaEvent_t> staged, on_host;
  int last_staged = -1;  // the last layer whose staging was queued in this run
  double fill_s = 0;     // this run's time in fill_lead

  void free_staging() {
    if (stream) (void)cudaStreamSynchronize(stream);
    if (staging) (void)cudaFree(staging);
    if (host_prefix) (void)cudaFreeHost(host_prefix);
    for (cudaEvent_t e : staged) (void)cudaEventDestroy(e);
    for (cudaEvent_t e : on_host) (void)cudaEventDestroy(e);
    staging = nullptr;
    host_prefix = nullptr;
    staged.clear();
    on_host.clear();
  }

  ~Impl() {
    hit_plan.reset();  // waits for work in flight before the staging goes
    free_staging();
    if (stream) (void)cudaStreamDestroy(stream);
  }

  int64_t kv_dim() const { return int64_t(dm->config().n_kv_heads) * dm->config().head_dim; }

  // Per layer, queued on the compute stream `cs` after the layer's K/V: prefix rows from the
  // pool blocks into a staging slot, cast to the attention's dtype, then the suffix's own rows
  // after them; the staged rows then go to the host on `stream`. The slot's layer before (l - 2)
  // must be on the host first. `staged[l]` is recorded even when queueing fails part way, so a
  // failed run can wait for every copy that reads the blocks before they are unpinned.
  Status exchange(int l, const void* k_loc, const void* v_loc, void* k_all, void* v_all,
                  DType dt, void* cs_ptr) {
    const cudaStream_t cs = static_cast<cudaStream_t>(cs_ptr);
    const Status st = exchange_queue(l, k_loc, v_loc, k_all, v_all, dt, cs);
    SF_TRY(cuda_ok(cudaEventRecord(staged[size_t(l)], cs), "event"));
    last_staged = l;
    SF_TRY(st);
    const int64_t n = 2 * hit_p * kv_dim();
    SF_TRY(cuda_ok(cudaStreamWaitEvent(stream, staged[size_t(l)], 0), "stream wait"));
    SF_TRY(cuda_ok(cudaMemcpyAsync(host_prefix + size_t(l) * size_t(n),
                                   staging + size_t(l % 2) * size_t(n), size_t(n) * sizeof(float),
                                   cudaMemcpyDeviceToHost, stream),
                   "prefix rows to the host"));
    return cuda_ok(cudaEventRecord(on_host[size_t(l)], stream), "event");
  }
  Status exchange_queue(int l, const void* k_loc, const void* v_loc, void* k_all, void* v_all,
                        DType dt, cudaStream_t cs) {
    const int64_t P = hit_p, S = hit_s, kvd = kv_dim();
    float* const sk = staging + size_t(l % 2) * size_t(2 * P * kvd);
    float* const sv = sk + P * kvd;
    if (l >= 2)
      SF_TRY(cuda_ok(cudaStreamWaitEvent(cs, on_host[size_t(l - 2)], 0), "stream wait"));
    SF_TRY(cache->pool()->read_to_device_async(blocks[size_t(l)], sk, sv, P, cs));
    const kernels::Stream ks{Device::kCuda, cs};
    const size_t es = dtype_size(dt);
    for (int kv = 0; kv < 2; ++kv) {
      void* all = kv ? v_all : k_all;
      SF_TRY(kernels::cast(TensorView::make(kv ? sv : sk, DType::kF32, {P * kvd}, Device::kCuda),
                           TensorView::make(all, dt, {P * kvd}, Device::kCuda), ks));
      SF_TRY(cuda_ok(cudaMemcpyAsync(static_cast<char*>(all) + size_t(P * kvd) * es,
                                     kv ? v_loc : k_loc, size_t((S - P) * kvd) * es,
                                     cudaMemcpyDeviceToDevice, cs),
                     "suffix rows"));
    }
    return Status::ok();
  }

  // The result's first hit_p rows of layer l (host), on the forward's host thread, once the
  // layer's prefix rows are on the host; split over the thread pool as the forward's own drain.
  Status fill_lead(int l, float* k, float* v) {
    const auto t0 = std::chrono::steady_clock::now();
    SF_TRY(cuda_ok(cudaEventSynchronize(on_host[size_t(l)]), "prefix rows to the host"));
    const size_t n = size_t(hit_p * kv_dim());
    const float* src = host_prefix + size_t(l) * 2 * n;
    parallel_copy_pair(k, src, v, src + n, n);
    fill_s += sf::seconds_since(t0);
    return Status::ok();
  }

  // After a hit run, before its blocks are unpinned: every queued copy that reads them (or the
  // staging) has finished. A run that failed part way may have left them in flight.
  void drain() {
    if (last_staged >= 0) (void)cudaEventSynchronize(staged[size_t(last_staged)]);
    if (stream) (void)cudaStreamSynchronize(stream);
    last_staged = -1;
  }

  // The hit plan for (S, P), reusing the last one of that shape. A plan that fails part way
  // keeps nothing: its staging would stay allocated until the next hit, counted with hit_p -1.
  Status plan_hit(int64_t S, int64_t P, const model::PrefillOptions& po, bool* planned) {
    if (hit_plan && hit_s == S && hit_p == P) return Status::ok();
    *planned = true;
    Status st = build_hit_plan(S, P, po);
    if (!st.is_ok()) {
      hit_plan.reset();
      free_staging();
      hit_s = hit_p = -1;
    }
    return st;
  }

  Status build_hit_plan(int64_t S, int64_t P, const model::PrefillOptions& po) {
    hit_plan.reset();
    free_staging();
    hit_s = hit_p = -1;
    SF_TRY(cuda_ok(cudaSetDevice(dm->device()), "cudaSetDevice"));
    SF_TRY(cuda_ok(cudaMalloc(&staging, size_t(4 * P * kv_dim()) * sizeof(float)),
                   "cudaMalloc of the prefix rows"));
    const int L = dm->config().n_layers;
    for (auto* ev : {&staged, &on_host})
      for (int l = 0; l < L; ++l) {
        cudaEvent_t e = nullptr;
        SF_TRY(cuda_ok(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event"));
        ev->push_back(e);
      }
    SF_TRY(cuda_ok(cudaHostAlloc(&host_prefix,
                                 size_t(dm->config().n_layers) * size_t(2 * P * kv_dim()) *
                                     sizeof(float),
                                 cudaHostAllocDefault),
                   "cudaHostAlloc of the prefix rows"));
    if (!stream)
      SF_TRY(cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "copy stream"));
    hit_s = S;
    hit_p = P;
    model::DeviceShard sh;
    sh.n_tokens = S;
    sh.pieces = {{P, S}};
    sh.logits = true;
    sh.exchange_kv_enqueue = [this](int l, const void* kl, const void* vl, void* ka, void* va,
                                    DType dt, void* cs) {
      return exchange(l, kl, vl, ka, va, dt, cs);
    };
    sh.kv_lead_rows = P;
    sh.fill_kv_lead = [this](int l, float* k, float* v) { return fill_lead(l, k, v); };
    SF_ASSIGN(model::DevicePrefill p, model::DevicePrefill::plan_shard(*dm, std::move(sh), po));
    hit_plan.emplace(std::move(p));
    return Status::ok();
  }

  Status plan_miss(int64_t S, const model::PrefillOptions& po, bool* planned) {
    if (miss_plan && S <= miss_max) return Status::ok();
    *planned = true;
    miss_plan.reset();
    SF_ASSIGN(model::DevicePrefill p, model::DevicePrefill::plan(*dm, S, po));
    miss_plan.emplace(std::move(p));
    miss_max = S;
    return Status::ok();
  }
};

DevicePrefixPrefill::DevicePrefixPrefill(const model::DeviceModel& dm, PrefixCache* cache,
                                         std::string model_id, PrefixPrefillOptions opt)
    : impl_(std::make_unique<Impl>()) {
  impl_->dm = &dm;
  impl_->cache = cache;
  impl_->model_id = std::move(model_id);
  impl_->opt = std::move(opt);
  impl_->keep_kv = impl_->opt.prefill.keep_kv;
  impl_->opt.prefill.keep_kv = true;  // the suffix's rows: the result's KV and the blocks to insert
}

DevicePrefixPrefill::~DevicePrefixPrefill() = default;

int64_t DevicePrefixPrefill::workspace_bytes() const {
  const Impl& I = *impl_;
  int64_t n = 0;
  if (I.hit_plan) n += int64_t(I.hit_plan->workspace_bytes());
  if (I.miss_plan) n += int64_t(I.miss_plan->workspace_bytes());
  if (I.staging) n += 4 * I.hit_p * I.kv_dim() * int64_t(sizeof(float));
  return n;
}

Result<model::PrefillResult> DevicePrefixPrefill::run(std::span<const int32_t> tokens,
                                                      PrefixPrefillStats* stats) {
  Impl& I = *impl_;
  const model::ModelConfig& c = I.dm->config();
  SF_ENSURE(I.dm->slice().ways == 1, kInvalidArgument,
            "prefix prefill (device): needs the whole model on one device, not a TP slice");
  SF_ENSURE(!I.opt.prefill.kv_host_bf16, kUnsupported,
            "prefix prefill (device): the cache holds F32 K/V; kv_host_bf16 is refused");
  SF_ENSURE(I.opt.prefill.sparse == nullptr, kUnsupported,
            "prefix prefill (device): dense attention only (a sparse plan would estimate the "
            "suffix's index from keys it did not compute the same way)");
  // A hit's plan is a shard's: the last row's logits only, and the importance window's rows in
  // the computed suffix. Refused or kept here, so a request does not fail once it hits.
  SF_ENSURE(!I.opt.prefill.all_logits, kUnsupported,
            "prefix prefill (device): all_logits is not supported (a hit computes the suffix's "
            "last row's logits only)");
  SF_ASSIGN(int64_t P,
            prefix_lookup(I.cache, c, I.model_id, tokens, computed_suffix(I.opt)));
  const int64_t S = int64_t(tokens.size());
  I.blocks.clear();
  if (P > 0) {
    auto pinned = I.cache->pin_blocks(I.model_id, tokens, P);
    if (pinned.is_ok())
      I.blocks = std::move(pinned).value();
    else if (pinned.status().code() == Code::kNotFound)
      P = 0;  // evicted between lookup and pin: compute it all
    else
      return pinned.status();
  }
  const model::PrefillOptions& po = I.opt.prefill;
  Result<model::PrefillResult> run = SF_ERR(kInternal, "prefix prefill (device): not run");
  // On a hit the run's KV is already the whole prompt's: the forward drains the suffix's rows
  // after P lead rows that fill_lead writes from the pinned prefix copies, layer by layer.
  PrefixPrefillStats times;
  {
    auto t0 = std::chrono::steady_clock::now();
    bool planned = false;  // a reused plan's lookup is not a plan (plan_s stays 0)
    if (P == 0) {
      const Status st = I.plan_miss(S, po, &planned);
      times.plan_s = planned ? seconds_since(t0) : 0.0;
      t0 = std::chrono::steady_clock::now();
      run = st.is_ok() ? I.miss_plan->run(tokens) : Result<model::PrefillResult>(st);
      times.forward_s = seconds_since(t0);
    } else {
      const Status st = I.plan_hit(S, P, po, &planned);
      times.plan_s = planned ? seconds_since(t0) : 0.0;
      t0 = std::chrono::steady_clock::now();
      I.fill_s = 0;
      run = st.is_ok() ? I.hit_plan->run(tokens) : Result<model::PrefillResult>(st);
      I.drain();
      times.forward_s = seconds_since(t0);
      times.assemble_s = I.fill_s;  // inside forward_s: the prefix rows' share of the KV drain
    }
    const Status up = I.cache->unpin_blocks(I.blocks);
    I.blocks.clear();
    if (run.is_ok() && !up.is_ok()) run = up;
  }
  SF_TRY(run.status());
  model::PrefillResult res = std::move(run).value();
  model::KvCache& kv = res.kv;
  Status ins;
  const auto ti = std::chrono::steady_clock::now();
  if (I.opt.insert)
    ins = I.cache->insert(I.model_id, tokens, [&](int l, bool value) {
      return (value ? kv.v : kv.k)[size_t(l)].data();
    });
  times.insert_s = seconds_since(ti);
  if (!I.keep_kv) {
    kv.k.clear();
    kv.v.clear();
  }
  if (stats) {
    times.reused_tokens = P;
    times.computed_tokens = S - P;
    times.insert_status = ins;
    *stats = times;
  }
  return res;
}

}  // namespace sf::kvstore
