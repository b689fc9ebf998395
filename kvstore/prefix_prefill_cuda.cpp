// Prefix-cached prefill on the device forward (prefix_prefill.h). Built only with SF_KV_CUDA.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common/thread_pool.h"
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
  // What the hit plan's exchange reads during a run: the prefix's pinned blocks, and the F32
  // staging of its rows (2 x hit_p x kv_dim) with the stream their copies run on. Each layer's
  // prefix rows also go to pinned host memory (K then V a layer) while the run goes on, for the
  // whole prompt's KV on the host: one DMA a layer instead of a read of every block afterwards.
  std::vector<std::vector<BlockId>> blocks;
  float* staging = nullptr;
  float* host_prefix = nullptr;  // n_layers x 2 x hit_p x kv_dim, cudaHostAlloc'd
  cudaStream_t stream = nullptr;

  void free_staging() {
    if (stream) (void)cudaStreamSynchronize(stream);
    if (staging) (void)cudaFree(staging);
    if (host_prefix) (void)cudaFreeHost(host_prefix);
    staging = nullptr;
    host_prefix = nullptr;
  }

  ~Impl() {
    hit_plan.reset();  // waits for work in flight before the staging goes
    free_staging();
    if (stream) (void)cudaStreamDestroy(stream);
  }

  int64_t kv_dim() const { return int64_t(dm->config().n_kv_heads) * dm->config().head_dim; }

  // Per layer, on the host thread after the compute stream drained: prefix rows from the pool
  // blocks, cast to the attention's dtype, then the suffix's own rows after them. On an error
  // the copies already queued are waited for: the blocks are unpinned right after.
  Status exchange(int l, const void* k_loc, const void* v_loc, void* k_all, void* v_all,
                  DType dt) {
    const Status st = exchange_queue(l, k_loc, v_loc, k_all, v_all, dt);
    if (!st.is_ok()) (void)cudaStreamSynchronize(stream);
    return st;
  }
  Status exchange_queue(int l, const void* k_loc, const void* v_loc, void* k_all, void* v_all,
                        DType dt) {
    const int64_t P = hit_p, S = hit_s, kvd = kv_dim();
    float* const sk = staging;
    float* const sv = staging + P * kvd;
    SF_TRY(cache->pool()->read_to_device_async(blocks[size_t(l)], sk, sv, P, stream));
    const kernels::Stream ks{Device::kCuda, stream};
    const size_t es = dtype_size(dt);
    for (int kv = 0; kv < 2; ++kv) {
      void* all = kv ? v_all : k_all;
      SF_TRY(kernels::cast(TensorView::make(kv ? sv : sk, DType::kF32, {P * kvd}, Device::kCuda),
                           TensorView::make(all, dt, {P * kvd}, Device::kCuda), ks));
      SF_TRY(cuda_ok(cudaMemcpyAsync(static_cast<char*>(all) + size_t(P * kvd) * es,
                                     kv ? v_loc : k_loc, size_t((S - P) * kvd) * es,
                                     cudaMemcpyDeviceToDevice, stream),
                     "suffix rows"));
    }
    SF_TRY(cuda_ok(cudaMemcpyAsync(host_prefix + size_t(l) * size_t(2 * P * kvd), staging,
                                   size_t(2 * P * kvd) * sizeof(float), cudaMemcpyDeviceToHost,
                                   stream),
                   "prefix rows to the host"));
    return cuda_ok(cudaStreamSynchronize(stream), "prefix rows");
  }

  // The hit plan for (S, P), reusing the last one of that shape.
  Status plan_hit(int64_t S, int64_t P, const model::PrefillOptions& po) {
    if (hit_plan && hit_s == S && hit_p == P) return Status::ok();
    hit_plan.reset();
    free_staging();
    hit_s = hit_p = -1;
    SF_TRY(cuda_ok(cudaSetDevice(dm->device()), "cudaSetDevice"));
    SF_TRY(cuda_ok(cudaMalloc(&staging, size_t(2 * P * kv_dim()) * sizeof(float)),
                   "cudaMalloc of the prefix rows"));
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
    sh.exchange_kv = [this](int l, const void* kl, const void* vl, void* ka, void* va, DType dt) {
      return exchange(l, kl, vl, ka, va, dt);
    };
    SF_ASSIGN(model::DevicePrefill p, model::DevicePrefill::plan_shard(*dm, std::move(sh), po));
    hit_plan.emplace(std::move(p));
    return Status::ok();
  }

  Status plan_miss(int64_t S, const model::PrefillOptions& po) {
    if (miss_plan && S <= miss_max) return Status::ok();
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

Result<model::PrefillResult> DevicePrefixPrefill::run(std::span<const int32_t> tokens,
                                                      PrefixPrefillStats* stats) {
  Impl& I = *impl_;
  const model::ModelConfig& c = I.dm->config();
  SF_ENSURE(I.dm->slice().ways == 1, kInvalidArgument,
            "prefix prefill (device): needs the whole model on one device, not a TP slice");
  SF_ENSURE(I.opt.prefill.sparse == nullptr, kUnsupported,
            "prefix prefill (device): dense attention only (a sparse plan would estimate the "
            "suffix's index from keys it did not compute the same way)");
  // A hit's plan is a shard's: the last row's logits only, and the importance window's rows in
  // the computed suffix. Refused or kept here, so a request does not fail once it hits.
  SF_ENSURE(!I.opt.prefill.all_logits, kUnsupported,
            "prefix prefill (device): all_logits is not supported (a hit computes the suffix's "
            "last row's logits only)");
  SF_ASSIGN(int64_t P,
            prefix_lookup(I.cache, c, I.model_id, tokens,
                          std::max<int64_t>(I.opt.min_suffix, I.opt.prefill.importance_window)));
  const int64_t S = int64_t(tokens.size());
  const int64_t kvd = I.kv_dim();
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
  // The whole prompt's KV: each layer's rows allocated (and faulted in) on the thread pool, the
  // prefix read from the cache while its blocks are pinned, the suffix copied in after the run.
  model::KvCache full;
  PrefixPrefillStats times;
  const auto since = [](std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  {
    auto t0 = std::chrono::steady_clock::now();
    if (P == 0) {
      const Status st = I.plan_miss(S, po);
      times.plan_s = since(t0);
      t0 = std::chrono::steady_clock::now();
      run = st.is_ok() ? I.miss_plan->run(tokens) : Result<model::PrefillResult>(st);
      times.forward_s = since(t0);
    } else {
      const Status st = I.plan_hit(S, P, po);
      times.plan_s = since(t0);
      t0 = std::chrono::steady_clock::now();
      run = st.is_ok() ? I.hit_plan->run(tokens) : Result<model::PrefillResult>(st);
      times.forward_s = since(t0);
      t0 = std::chrono::steady_clock::now();
      if (run.is_ok()) {
        full.k.resize(size_t(c.n_layers));
        full.v.resize(size_t(c.n_layers));
        std::atomic<bool> no_memory{false};
        parallel_for(size_t(2 * c.n_layers), [&](size_t b, size_t e) {
          try {
            for (size_t i = b; i < e; ++i) (i % 2 ? full.v : full.k)[i / 2].resize(size_t(S * kvd));
          } catch (const std::bad_alloc&) {
            no_memory = true;
          }
        });
        if (no_memory)
          run = SF_ERR(kResourceExhausted, "prefix prefill (device): no host memory for the KV");
      }
      times.assemble_s = since(t0);
    }
    const Status up = I.cache->unpin_blocks(I.blocks);
    I.blocks.clear();
    if (run.is_ok() && !up.is_ok()) run = up;
  }
  SF_TRY(run.status());
  model::PrefillResult res = std::move(run).value();
  model::KvCache& kv = res.kv;
  if (P > 0) {
    // Each layer's prefix rows (from the pinned copies the run made), then the suffix's (the
    // shard kept its own rows only).
    const auto t0 = std::chrono::steady_clock::now();
    const size_t pre = size_t(P * kvd), n = size_t((S - P) * kvd);
    parallel_for(size_t(2 * c.n_layers), [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        auto& dst = (i % 2 ? full.v : full.k)[i / 2];
        const auto& src = (i % 2 ? kv.v : kv.k)[i / 2];
        std::memcpy(dst.data(), I.host_prefix + (i / 2) * 2 * pre + (i % 2) * pre,
                    pre * sizeof(float));
        std::memcpy(dst.data() + pre, src.data(), n * sizeof(float));
      }
    });
    kv.k = std::move(full.k);
    kv.v = std::move(full.v);
    kv.n_tokens = S;
    times.assemble_s += since(t0);
  }
  Status ins;
  const auto ti = std::chrono::steady_clock::now();
  if (I.opt.insert)
    ins = I.cache->insert(I.model_id, tokens, [&](int l, bool value) {
      return (value ? kv.v : kv.k)[size_t(l)].data();
    });
  times.insert_s = since(ti);
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
