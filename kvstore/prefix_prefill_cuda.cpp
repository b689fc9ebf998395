// Prefix-cached prefill on the device forward (prefix_prefill.h). Built only with SF_KV_CUDA.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels/api.h"
#include "kvstore/prefix_prefill.h"

namespace sf::kvstore {
namespace {

Status cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  return SF_ERR(kIo, std::string("prefix prefill (device): ") + what + ": " + cudaGetErrorString(e));
}

// The prefix rows' F32 staging and the stream their copies run on, for one call.
struct Staging {
  float* rows = nullptr;  // K then V: 2 x prefix rows x kv_dim
  cudaStream_t stream = nullptr;
  ~Staging() {
    if (stream) {
      (void)cudaStreamSynchronize(stream);
      (void)cudaStreamDestroy(stream);
    }
    if (rows) (void)cudaFree(rows);
  }
};

}  // namespace

Result<model::PrefillResult> prefill_with_prefix_cache_device(
    const model::DeviceModel& dm, PrefixCache* cache, const std::string& model_id,
    std::span<const int32_t> tokens, const PrefixPrefillOptions& opt, PrefixPrefillStats* stats) {
  const model::ModelConfig& c = dm.config();
  SF_ENSURE(dm.slice().ways == 1, kInvalidArgument,
            "prefix prefill (device): needs the whole model on one device, not a TP slice");
  SF_ENSURE(opt.prefill.sparse == nullptr, kUnsupported,
            "prefix prefill (device): dense attention only (a sparse plan would estimate the "
            "suffix's index from keys it did not compute the same way)");
  SF_ASSIGN(int64_t P, prefix_lookup(cache, c, model_id, tokens, opt.min_suffix));
  const int64_t S = int64_t(tokens.size());
  const int64_t kvd = int64_t(c.n_kv_heads) * c.head_dim;
  std::vector<std::vector<BlockId>> blocks;
  if (P > 0) {
    auto pinned = cache->pin_blocks(model_id, tokens, P);
    if (pinned.is_ok())
      blocks = std::move(pinned).value();
    else if (pinned.status().code() == Code::kNotFound)
      P = 0;  // evicted between lookup and pin: compute it all
    else
      return pinned.status();
  }
  model::PrefillOptions po = opt.prefill;
  po.keep_kv = true;  // the suffix's rows: the result's KV and the blocks to insert
  Result<model::PrefillResult> run = SF_ERR(kInternal, "prefix prefill (device): not run");
  model::KvCache prefix_kv;
  {
    // Everything that reads the pinned blocks, then the pins go back whatever happened.
    const auto body = [&]() -> Result<model::PrefillResult> {
      if (P == 0) return model::prefill_device(dm, tokens, po);
      Staging stg;
      SF_TRY(cuda_ok(cudaSetDevice(dm.device()), "cudaSetDevice"));
      SF_TRY(cuda_ok(cudaMalloc(&stg.rows, size_t(2 * P * kvd) * sizeof(float)),
                     "cudaMalloc of the prefix rows"));
      SF_TRY(cuda_ok(cudaStreamCreateWithFlags(&stg.stream, cudaStreamNonBlocking),
                     "copy stream"));
      model::DeviceShard sh;
      sh.n_tokens = S;
      sh.pieces = {{P, S}};
      sh.logits = true;
      const BlockPool* pool = cache->pool();
      sh.exchange_kv = [&](int l, const void* k_loc, const void* v_loc, void* k_all, void* v_all,
                           DType dt) -> Status {
        float* const sk = stg.rows;
        float* const sv = stg.rows + P * kvd;
        SF_TRY(pool->read_to_device_async(blocks[size_t(l)], sk, sv, P, stg.stream));
        const kernels::Stream ks{Device::kCuda, stg.stream};
        const size_t es = dtype_size(dt);
        for (int kv = 0; kv < 2; ++kv) {
          // The prefix rows in the attention's dtype, then the suffix's own after them.
          void* all = kv ? v_all : k_all;
          SF_TRY(kernels::cast(
              TensorView::make(kv ? sv : sk, DType::kF32, {P * kvd}, Device::kCuda),
              TensorView::make(all, dt, {P * kvd}, Device::kCuda), ks));
          SF_TRY(cuda_ok(cudaMemcpyAsync(static_cast<char*>(all) + size_t(P * kvd) * es,
                                         kv ? v_loc : k_loc, size_t((S - P) * kvd) * es,
                                         cudaMemcpyDeviceToDevice, stg.stream),
                         "suffix rows"));
        }
        return cuda_ok(cudaStreamSynchronize(stg.stream), "prefix rows");
      };
      SF_ASSIGN(model::DevicePrefill plan, model::DevicePrefill::plan_shard(dm, sh, po));
      return plan.run(tokens);
    };
    run = body();
    if (run.is_ok() && P > 0) {
      // The prefix rows for the whole prompt's KV, while the blocks are still pinned.
      prefix_kv.k.assign(size_t(c.n_layers), std::vector<float>(size_t(P * kvd)));
      prefix_kv.v.assign(size_t(c.n_layers), std::vector<float>(size_t(P * kvd)));
      const Status rd = cache->read(model_id, tokens, P, [&](int l, bool value) {
        return (value ? prefix_kv.v : prefix_kv.k)[size_t(l)].data();
      });
      if (!rd.is_ok()) run = rd;
    }
    const Status up = cache->unpin_blocks(blocks);
    if (run.is_ok() && !up.is_ok()) run = up;
  }
  SF_TRY(run.status());
  model::PrefillResult res = std::move(run).value();
  model::KvCache& kv = res.kv;
  if (P > 0) {
    // Prefix rows, then the suffix's (the shard kept its own rows only).
    for (int l = 0; l < c.n_layers; ++l)
      for (auto* side : {&kv.k, &kv.v}) {
        std::vector<float>& rows = (*side)[size_t(l)];
        std::vector<float>& pre = (side == &kv.k ? prefix_kv.k : prefix_kv.v)[size_t(l)];
        pre.insert(pre.end(), rows.begin(), rows.end());
        rows.swap(pre);
      }
    kv.n_tokens = S;
  }
  Status ins;
  if (opt.insert)
    ins = cache->insert(model_id, tokens, [&](int l, bool value) {
      return (value ? kv.v : kv.k)[size_t(l)].data();
    });
  if (!opt.prefill.keep_kv) {
    kv.k.clear();
    kv.v.clear();
  }
  if (stats) {
    stats->reused_tokens = P;
    stats->computed_tokens = S - P;
    stats->insert_status = ins;
  }
  return res;
}

}  // namespace sf::kvstore
