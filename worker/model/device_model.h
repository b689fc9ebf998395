// The prefill forward on a CUDA device: the model's weights uploaded once (DeviceModel), a plan
// that owns streams, events and every buffer (DevicePrefill::plan), and a run that only enqueues
// kernels/api.h ops (DevicePrefill::run). Same structure as forward.cpp: layer-major; per token
// chunk norm, QKV, RoPE; attention over all rows; per chunk O-proj, residual, MLP.
//
// Plain C++ (no CUDA types), usable in every build: without SF_HAVE_CUDA each entry point returns
// kUnsupported. Dense attention only (BF16 weights: cuDNN's fused kernel on BF16 Q/K/V when the
// build has cuDNN; F32 weights: the F32 reference kernel); prefix extension (extend()) stays on
// the CPU for now.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "worker/model/model.h"

namespace sf::model {

// Ok when this build has the CUDA backend and `device` exists; otherwise says which is missing.
Status cuda_device_check(int device = 0);

class DeviceModel {
 public:
  // Copies every weight to `device` (synchronous: a setup step). The linear weights (Q, K, V, O,
  // gate, up, down, LM head) go in weight_dtype, BF16 or F32; norms, biases and the embedding
  // table stay F32. Activations are F32 throughout; with BF16 weights each linear's input is
  // rounded to BF16 (kernels::cast) and the GEMM accumulates in F32.
  static Result<DeviceModel> upload(const Model& m, DType weight_dtype = DType::kBF16,
                                    int device = 0);

  DeviceModel(DeviceModel&&) noexcept;
  DeviceModel& operator=(DeviceModel&&) noexcept;
  ~DeviceModel();

  const ModelConfig& config() const;
  DType weight_dtype() const;
  int device() const;
  const std::string& device_name() const;  // e.g. "NVIDIA H100 80GB HBM3"
  size_t weight_bytes() const;             // device memory held by the weights

 private:
  friend class DevicePrefill;
  struct Impl;  // device_model.cpp
  DeviceModel();
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
// soon as its copy event fires, while the device is still computing later layers. With
// opt.importance_window > 0 each layer's SnapKV importance is computed on the device from its
// LSE (kernels/kv_importance.h) and copied out the same way; opt.on_layer_kv (KV tiering) is
// called on the host thread with each layer's host K/V and importance as soon as they land,
// after every layer's work has been enqueued.
//
// Contracts: the DeviceModel outlives the plan; plan and run on one thread (cuBLASLt's handle and
// workspace are per thread); one run at a time per plan. opt.sparse and opt.on_attention are
// not supported on the device (kUnsupported).
class DevicePrefill {
 public:
  static Result<DevicePrefill> plan(const DeviceModel& dm, int64_t max_tokens,
                                    const PrefillOptions& opt = {});
  // tokens.size() in [1, max_tokens]; ids are checked on the host against the vocabulary.
  Result<PrefillResult> run(std::span<const int32_t> tokens);

  DevicePrefill(DevicePrefill&&) noexcept;
  DevicePrefill& operator=(DevicePrefill&&) noexcept;
  ~DevicePrefill();  // waits for work still in flight (an error path) before freeing buffers

  int64_t max_tokens() const;
  // The attention path the plan chose: with BF16 weights in a cuDNN build, cuDNN's fused flash
  // attention on BF16 copies of Q, K, V; otherwise the F32 reference kernel. A run shorter than
  // max_tokens builds the cuDNN graph for its length on first use (host side, once per length).
  const char* attention_kernel() const;
  size_t workspace_bytes() const;  // device memory of the plan (weights excluded)
  double plan_seconds() const;

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
