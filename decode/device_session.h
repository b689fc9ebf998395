// The reference decode node on a CUDA device: DecodeSession's step (decode_session.h) with the
// weights on the device (model::DeviceModel) and the cache in a device block pool
// (kernels/decode_attention.h), full or PSA attention by the same rules as the host's.
//
// Plan/run split: open() uploads the paged cache and reserves pool pages for max_new_tokens more
// tokens per head, allocates every activation buffer and creates the stream; step() only
// enqueues ops (the token id and position go up with one small copy) and waits once, for the
// logits. Activations are F32 and no linear rounds them: the fused step (the default) runs every
// linear as a one-row GEMV (kernels::gemv, gemv_parts, gemv_swiglu: F32 x against the weights as
// stored); the unfused step does so for BF16 weights and uses cuBLASLt for F32 weights; F32
// accumulation either way (the device prefill instead rounds x to BF16 for its GEMMs). In a
// build without CUDA, open() returns kUnsupported.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/status.h"
#include "decode/decode_attention.h"
#include "decode/paged_kv.h"
#include "kernels/decode_attention.h"
#include "worker/model/device_model.h"

namespace sf::decode {

// A PagedKvCache in device memory (kernels/decode_attention.h's pool): each layer and KV head
// gets its own pages plus reserved ones for `reserve_tokens` more tokens, which the device
// append opens in turn. Upload is a setup step (synchronous copies). Every head's range is as
// long as the longest head's, so a retention with uneven heads (adakv, moa) costs the device
// memory of its longest head times the heads.
//
// enc: how the pool stores keys and values: f32 (as the cache holds them), bf16, or int8 (a
// quarter of F32's bytes plus F16 scales and zeros: 1/8 for keys, 1/32 for values at d = 128);
// int4 is kUnsupported (the kernel does not read it). Each block is encoded by kvstore's
// kv_encode, so the pool attends over exactly PagedKvCache::round_trip(enc) of the cache; blocks
// that carry int8 codes (from an int8 export, or round_trip(kInt8)) go up as they are, so such a
// cache is attended over as loaded, not rounded twice.
class DevicePagedPool {
 public:
  static Result<DevicePagedPool> upload(const PagedKvCache& cache, int reserve_tokens,
                                        kvstore::KvEncoding enc = kvstore::KvEncoding::kF32);
  DevicePagedPool();  // empty until assigned from upload()
  DevicePagedPool(DevicePagedPool&&) noexcept;
  DevicePagedPool& operator=(DevicePagedPool&&) noexcept;
  ~DevicePagedPool();
  kernels::PagedKv layer(int l) const;  // the layer's view (pages and counts of its heads)
  // Every layer as one view of n_layers x n_kv_heads heads (a layer's heads one after another):
  // for what acts on each head alike, such as kernels::paged_snapshot.
  kernels::PagedKv all() const;
  size_t bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The device kernel's parameters for a host decode attention mode (the same rules).
kernels::PagedDecodeParams device_attn_params(const DecodeAttnParams& p);

class DeviceDecodeSession {
 public:
  // dm must outlive the session. p: full, psa or psa-avg (measure_mass is host-only: rejected),
  // psa with verified drafts (p.verify_draft up to kernels::kDecodeMaxTokens - 1, with or
  // without a margin: generate_greedy below); the guard alone is host-only (rejected).
  // pool_enc: the device pool's encoding (DevicePagedPool::upload). cuda_graph: from the second
  // step on, replay the step's kernels as one CUDA graph instead of launching each (the same
  // kernels on the same buffers, so the same logits; a capture the runtime refuses leaves the
  // session eager, which graph_steps() shows). fused_step: a layer in 9 launches plus the
  // attention's (Q/K/V in one GEMV, the MLP's gate, up and SwiGLU in one, each residual add
  // joined to the norm after it) instead of 16; with BF16 weights the logits are the unfused
  // step's bit for bit, with F32 weights its linears leave cuBLASLt for the GEMV. Unfused with
  // F32 weights, a graph is bound to the thread that captured it (cuBLASLt's per-thread
  // workspace): a step from another thread runs eagerly and captures again at the next one.
  // Steps of one session must not run concurrently.
  static Result<DeviceDecodeSession> open(const model::DeviceModel& dm, const PagedKvCache& cache,
                                          int64_t next_pos, DecodeAttnParams p, int max_new_tokens,
                                          kvstore::KvEncoding pool_enc = kvstore::KvEncoding::kF32,
                                          bool cuda_graph = true, bool fused_step = true);
  DeviceDecodeSession(DeviceDecodeSession&&) noexcept;
  DeviceDecodeSession& operator=(DeviceDecodeSession&&) noexcept;
  ~DeviceDecodeSession();

  // As DecodeSession::step; kOutOfRange once max_new_tokens steps have run. A step that fails
  // part way leaves the session unusable (kInternal after): reopen it. With verify_draft, a step
  // is the draft's PSA alone, as on the host.
  Status step(int32_t token, std::vector<float>* logits);
  // As DecodeSession::generate_greedy. With verify_draft, a round's PSA drafts run as steps
  // (the pool saved before them by kernels::paged_snapshot and restored after), then one
  // verification pass runs the round's tokens at once: every linear a gemv over its rows (each
  // row as the fused step's gemv gives it), the attention kernels::paged_decode_attention with
  // n_tokens, full. The pass's K/V stay for the tokens kept; the rest are taken back (restore,
  // then the kept tokens' K/V appended again). The stop rules and stats are the host's.
  Result<std::vector<int32_t>> generate_greedy(
      int32_t first_token, int n_new,
      const std::function<void(int, const std::vector<float>&)>& on_logits = {});
  const DecodeAttnStats& stats() const;
  size_t pool_bytes() const;  // device memory of the block pool
  int64_t graph_steps() const;  // steps run as a CUDA graph replay

 private:
  struct Impl;
  DeviceDecodeSession();
  Status run_step(int32_t token, std::vector<float>* logits);
  Status enqueue_step();
  // The verification pass: tokens[0..n) at the next n positions, appended; logits [n, vocab].
  Status run_pass(const int32_t* tokens, int n, std::vector<float>* logits);
  Result<std::vector<int32_t>> generate_verified(
      int32_t first_token, int n_new,
      const std::function<void(int, const std::vector<float>&)>& on_logits);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sf::decode
