// The prefill forward on a CUDA device: the model's weights uploaded once (DeviceModel), a plan
// that owns streams, events and every buffer (DevicePrefill::plan), and a run that only enqueues
// kernels/api.h ops (DevicePrefill::run). Same structure as forward.cpp: layer-major; per token
// chunk norm, QKV, RoPE; attention over all rows (per piece on a shard); O projection of every
// row, residual; per chunk MLP, residual.
//
// Plain C++ (no CUDA types), usable in every build: without SF_HAVE_CUDA each entry point returns
// kUnsupported. Dense attention: BF16 weights use cuDNN's fused kernel on BF16 Q/K/V when the
// build has cuDNN, F32 weights the F32 reference kernel. Sparse (PrefillOptions::sparse): the
// device estimators and our sparse kernel, per layer. Prefix extension (extend()) stays on the
// CPU for now.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "worker/model/model.h"

namespace sf::model {

// Ok when this build has the CUDA backend and `device` exists; otherwise says which is missing.
Status cuda_device_check(int device = 0);

// Tensor parallelism: the part of the model one rank holds (worker/runtime/grid.h's layout). KV
// heads are cut into `ways` contiguous slices, each with its GQA query heads; the MLP's
// intermediate columns likewise. Q/K/V/gate/up hold the slice's output rows, O and down the
// matching input columns, so their outputs are partial sums that the ranks add up (all-reduce).
struct TpSlice {
  int ways = 1, index = 0;
};

class DeviceModel {
 public:
  // Copies every weight to `device` (synchronous: a setup step). The linear weights (Q, K, V, O,
  // gate, up, down, LM head) go in weight_dtype, BF16 or F32; norms, biases and the embedding
  // table stay F32. Activations are F32 throughout; with BF16 weights each linear's input is
  // rounded to BF16 (kernels::cast) and the GEMM accumulates in F32. With a slice, only that
  // TP slice goes up, and config() is the sliced one (heads and intermediate divided by ways).
  static Result<DeviceModel> upload(const Model& m, DType weight_dtype = DType::kBF16,
                                    int device = 0, TpSlice slice = {});
  // Deterministic synthetic weights generated on the device, for models too large to build on
  // the host (e.g. Llama-3-8B-shaped benchmarks on a GPU host). Same scales as
  // Model::synthetic (std 1/sqrt(fan_in), norms 1 + 0.1 N), different values: each element is a
  // hash of (seed, tensor, position in the unsliced tensor), so every TP slice equals the
  // matching part of the unsliced synthetic model.
  static Result<DeviceModel> synthetic(const ModelConfig& cfg, uint64_t seed,
                                       DType weight_dtype = DType::kBF16, int device = 0,
                                       TpSlice slice = {});

  DeviceModel(DeviceModel&&) noexcept;
  DeviceModel& operator=(DeviceModel&&) noexcept;
  ~DeviceModel();

  const ModelConfig& config() const;       // of the slice this rank holds
  const ModelConfig& full_config() const;  // of the whole model
  TpSlice slice() const;
  DType weight_dtype() const;
  int device() const;
  const std::string& device_name() const;  // e.g. "NVIDIA H100 80GB HBM3"
  size_t weight_bytes() const;             // device memory held by the weights

  // Device views of the weights, for steps built from kernels/api.h ops outside the prefill (the
  // decode node's device session). Views of absent tensors (biases) are empty. rope_freqs is
  // host memory (kernels::rope reads the divisors while launching), null when the model has none.
  struct LayerViews {
    TensorView attn_norm, wq, wk, wv, bq, bk, bv, wo, ffn_norm, w_gate, w_up, w_down;
  };
  struct Views {
    TensorView tok_embd, out_norm, lm_head;
    std::vector<LayerViews> layers;
    const float* rope_freqs = nullptr;
  };
  Views views() const;

 private:
  friend class DevicePrefill;
  struct Impl;  // device_model.cpp
  DeviceModel();
  std::unique_ptr<Impl> impl_;
};

// One rank's share of a tensor x context parallel prefill (worker/runtime/device_parallel.h fills
// it from NCCL communicators; the model layer knows no transport). The rank holds the prompt
// rows of `pieces` (global [begin, end), prompt order, 64-aligned starts), stored back to back;
// each piece attends to keys [0, end) with the causal diagonal at its begin. The hooks run on the
// host thread after the compute stream has drained, and return once their result is in place.
struct DeviceShard {
  int64_t n_tokens = 0;  // the whole prompt
  std::vector<std::array<int64_t, 2>> pieces;
  // Per layer, after this rank's K and V rows are final: k_loc, v_loc [local rows, kv_dim] in
  // `dtype` (the attention's: BF16 with cuDNN, else F32) -> k_all, v_all [n_tokens, kv_dim] in
  // prompt order, all device pointers.
  std::function<Status(int layer, const void* k_loc, const void* v_loc, void* k_all, void* v_all,
                       DType dtype)>
      exchange_kv;
  // Enqueue-only form of exchange_kv, used instead of it when set: queue the fill of k_all and
  // v_all on `stream` (the compute stream, a cudaStream_t) and return without waiting, so the
  // layers stay pipelined. For fills that need no host round trip (a local prefix cache's rows).
  std::function<Status(int layer, const void* k_loc, const void* v_loc, void* k_all, void* v_all,
                       DType dtype, void* stream)>
      exchange_kv_enqueue;
  bool exchanges() const { return bool(exchange_kv) || bool(exchange_kv_enqueue); }
  // With keep_kv, each layer of the result's KV holds kv_lead_rows rows this rank did not
  // compute (a cached prefix) before its own: run() sizes the vectors for both and calls
  // fill_kv_lead(layer, k, v) with the layer's host rows on the host thread, in layer order,
  // while later layers compute. The result's n_tokens counts them.
  int64_t kv_lead_rows = 0;
  std::function<Status(int layer, float* k, float* v)> fill_kv_lead;
  // Sums a device F32 buffer of `count` values over the TP slices, in place (the O and down
  // projections' partial sums, every row of the rank at once). Null: one slice.
  std::function<Status(float* x, int64_t count)> reduce_tp;
  // Overlapped TP, used instead of reduce_tp when set: enqueue the sum of one chunk's partial
  // sums after `ready` (a cudaEvent_t recorded on the compute stream) and record `done`
  // (cudaEvent_t) after it, without waiting. The next chunk's GEMMs run meanwhile; the compute
  // stream waits on `done` before the residual add; nothing waits on the host inside a layer.
  // reduce_tp_wait, after the last layer, waits for every enqueued sum against the deadline.
  std::function<Status(float* x, int64_t count, void* ready, void* done)> reduce_tp_enqueue;
  std::function<Status()> reduce_tp_wait;
  bool logits = true;  // whether this rank computes the last row's logits (the group leader)
  // > 0: the host's waits for this shard's K/V copies (the pinned ring's landings, inside the
  // layer loop) give up after this many seconds with kDeadlineExceeded. Set it with
  // reduce_tp_enqueue, whose sums a copy may wait on (the communicator's timeout): without it,
  // such a plan keeps a pinned slot per layer and waits for copies only after reduce_tp_wait.
  double copy_wait_timeout_s = 0;
};

// What a plan's setup spent its time on (DevicePrefill::plan_times), for the worker's summary.
struct PlanTimes {
  double total_s = 0;
  double device_buffers_s = 0;  // device workspace: cudaMalloc (or a cache hit) and NaN poisoning
  double host_buffers_s = 0;    // pinned host staging (cudaMallocHost: allocating and pinning)
  double sparse_s = 0;          // the estimators' plans and their arena
  double shapes_s = 0;          // the dry walk: cuBLASLt algorithms and cuDNN graphs per shape
  int64_t reused_bytes = 0;     // buffers taken from PrefillOptions::buffers
  int64_t allocated_bytes = 0;  // buffers allocated afresh
};

// Buffers between plans. A worker plans its device prefill per prompt length (shapes, zigzag
// pieces and sparse plans depend on it); without a cache each new length frees and allocates
// the device workspace and re-pins gigabytes of host staging for the KV (cudaMallocHost of 4 GB
// takes about a second). With PrefillOptions::buffers set, a plan takes each buffer from the
// cache when the one left there under the same role is large enough (a shorter prompt reuses
// all of them), allocates the rest, frees what it did not take once its setup is done, and
// gives every buffer back when it is destroyed. Buffers keep their larger size, as a caching
// allocator's do: the *_bytes_held() say how much. One plan at a time draws on a cache (a second
// live plan on it is refused with kInvalidArgument, so a prefix prefill's hit and miss plans
// need a cache each), on one thread. A plan whose last run failed frees its buffers instead of
// giving them back (work may still be in flight on them), and a plan on another device than the
// cache's last clears it first.
class DeviceBufferCache {
 public:
  DeviceBufferCache();
  ~DeviceBufferCache();
  DeviceBufferCache(const DeviceBufferCache&) = delete;
  DeviceBufferCache& operator=(const DeviceBufferCache&) = delete;
  size_t device_bytes_held() const;  // between plans: what the last plan gave back
  size_t host_bytes_held() const;
  void clear();  // frees everything held

 private:
  friend class DevicePrefill;
  struct Impl;  // device_model.cpp
  std::unique_ptr<Impl> impl_;
};

// Plan/run split. plan() does everything that may allocate or block: it checks the shapes
// against the kernels, creates a compute and a copy stream and their events, allocates the
// device workspace (sized for max_tokens and opt.chunk) and the pinned host staging for logits
// and (opt.keep_kv) the KV cache, and picks the cuBLASLt algorithm of every GEMM shape a run of
// max_tokens tokens uses. run() then enqueues without any host synchronization until the end,
// where it waits once and fills the host PrefillResult (logits, KV cache, first token, timings).
//
// Streams: the compute stream runs the layers; after a layer's QKV/RoPE phase its K and V (now
// final) are copied to pinned host memory on the copy stream, overlapping that layer's attention
// and the next layers. K/V live in two device slots used by alternate layers; an event from the
// copy stream makes layer l+2 wait until slot (l % 2) has been copied out. Logit chunks use the
// same two-slot scheme. The host drains each layer's KV from pinned memory into the result as
// soon as its copy event fires (one memcpy split over the CPU thread pool, into vectors the pool
// sized first), while the device is still computing later layers. With
// opt.importance_window > 0 each layer's SnapKV importance is computed on the device from its
// LSE (kernels/kv_importance.h) and copied out the same way; opt.on_layer_kv (KV tiering) is
// called on the host thread with each layer's host K/V and importance as soon as they land,
// after every layer's work has been enqueued (after that layer's copy into the result).
// opt.on_layer_kv_device (KV tiering from device memory) queues each layer's blocks on the copy
// stream while the layer is enqueued and places them on the host thread as above;
// opt.on_layer_done is called there too, once a layer, in order (progress).
//
// Contracts: the DeviceModel outlives the plan; plan and run on one thread (cuBLASLt's handle and
// workspace are per thread); one run at a time per plan. opt.on_attention is not supported on
// the device (kUnsupported); a sparse plan runs at exactly its planned length.
class DevicePrefill {
 public:
  static Result<DevicePrefill> plan(const DeviceModel& dm, int64_t max_tokens,
                                    const PrefillOptions& opt = {});
  // A rank of a TP x CP group: plans for exactly shard.n_tokens tokens of which this rank holds
  // shard.pieces. Dense or sparse attention (each piece estimates its own index); logits of the
  // last row only (on the rank with shard.logits); keep_kv keeps this rank's rows
  // (KvCache::n_tokens = local rows, pieces in order); importance on the rank whose last piece
  // ends the prompt; no per-layer KV hook or device sink. The dm must be this rank's TP slice.
  static Result<DevicePrefill> plan_shard(const DeviceModel& dm, DeviceShard shard,
                                          const PrefillOptions& opt = {});
  // tokens.size() in [1, max_tokens] (a shard's plan: exactly n_tokens, the whole prompt); ids
  // are checked on the host against the vocabulary.
  Result<PrefillResult> run(std::span<const int32_t> tokens);
  // Per-layer wall time of the last run on the device (first layer's start to each layer's end,
  // differenced), seconds; and the time the shard's hooks spent (host, communication).
  std::vector<double> layer_seconds() const;
  double hook_seconds() const;
  // Sparse index capacity. The estimators' slot sizes depend on the data. A run checks each
  // layer's slots as the layer's attention runs; where one needed more than the plan holds (its
  // index was truncated), the run grows the plan in place and runs that layer's
  // estimators and attention again before anything reads them, so nothing truncated is passed
  // off and no layer runs twice otherwise (PrefillResult::sparse_grows). A shard grows alone:
  // capacities are local, and its peers wait in the next exchange meanwhile. Where a grow fails
  // (no device memory, or an overflow past PrefillOptions::sparse_max_grows), a shard enqueues its remaining layers'
  // exchanges and TP sums without attention, so its peers do not wait on it, and returns the
  // error after them (DeviceParallelPrefill makes it the group's).
  std::array<int, 2> sparse_need() const;  // {blocks, columns} per slot in the last run
  // What every piece's slots hold now (after any grow): PrefillOptions::sparse_capacity for a
  // later plan. {0, 0} without sparse attention.
  std::array<int, 2> sparse_capacity() const;

  DevicePrefill(DevicePrefill&&) noexcept;
  DevicePrefill& operator=(DevicePrefill&&) noexcept;
  ~DevicePrefill();  // waits for work still in flight (an error path) before freeing buffers

  int64_t max_tokens() const;
  // The attention path the plan chose: with BF16 weights in a cuDNN build, cuDNN's fused flash
  // attention on BF16 copies of Q, K, V; otherwise the F32 reference kernel. A run shorter than
  // max_tokens builds the cuDNN graph for its length on first use (host side, once per length).
  const char* attention_kernel() const;
  DType attention_dtype() const;   // of Q/K/V/out in attention (and so of a shard's K/V exchange)
  size_t workspace_bytes() const;  // device memory of the plan (weights excluded)
  double plan_seconds() const;
  PlanTimes plan_times() const;

 private:
  struct Impl;  // device_model.cpp
  DevicePrefill();
  std::unique_ptr<Impl> impl_;
};

// One-shot convenience: plan for tokens.size(), then run. PrefillResult::seconds covers the run
// only; reuse a DevicePrefill to keep allocation and GEMM planning out of repeated prefills.
Result<PrefillResult> prefill_device(const DeviceModel& dm, std::span<const int32_t> tokens,
                                     const PrefillOptions& opt = {});

}  // namespace sf::model
