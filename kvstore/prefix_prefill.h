// Prefill through the prefix cache: the longest cached prefix (whole 64-token blocks) is copied
// into the KV cache, model::extend computes only the suffix from that offset (positions and the
// causal mask continue from the prefix), and the prompt's whole blocks are then cached.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/status.h"
#include "kvstore/prefix_cache.h"
#include "worker/model/device_model.h"
#include "worker/model/model.h"

namespace sf::kvstore {

struct PrefixPrefillOptions {
  model::PrefillOptions prefill;
  bool insert = true;  // cache this prompt's whole blocks afterwards
  // Tokens always computed at the end (at least 1, for the first token's logits). A caller whose
  // result depends on the last rows' queries (SnapKV importance over an observation window)
  // sets it to that window, so a hit scores from the same queries a full prefill would.
  int64_t min_suffix = 1;
};

// The tokens a run always computes at the end: max(1, min_suffix, the importance window), so a
// hit scores importance from the same queries a full prefill would. Both paths look up with it.
inline int64_t computed_suffix(const PrefixPrefillOptions& o) {
  return std::max<int64_t>({1, o.min_suffix, o.prefill.importance_window});
}

struct PrefixPrefillStats {
  int64_t reused_tokens = 0, computed_tokens = 0;
  // Caching is best effort: a prompt that does not fit the cache budget or the pool still gets
  // its prefill result; why its blocks were not (all) cached is kept here.
  Status insert_status;
  // Where the call's time went (seconds): the plan when one was made, the forward, the cached
  // prefix's rows put into the result's KV on the host (on the device path, inside forward_s:
  // the drain overlaps later layers), and the insert.
  double plan_s = 0, forward_s = 0, assemble_s = 0, insert_s = 0;
};

// model_id must name the weights, not only the architecture: two checkpoints of one config must
// not share KV. At least the last token is always computed so the result carries its logits, and
// at least opt.prefill.importance_window tokens (so a hit's importance scores the same queries);
// with all_logits the rows cover the computed suffix only. opt.prefill.sparse is refused.
Result<model::PrefillResult> prefill_with_prefix_cache(const model::Model& m, PrefixCache* cache,
                                                       const std::string& model_id,
                                                       std::span<const int32_t> tokens,
                                                       const PrefixPrefillOptions& opt,
                                                       PrefixPrefillStats* stats = nullptr);

// Checks the cache's geometry against the model and returns the cached prefix's length: whole
// blocks, leaving at least max(1, min_suffix) tokens to compute. Shared by both paths.
Result<int64_t> prefix_lookup(PrefixCache* cache, const model::ModelConfig& c,
                              const std::string& model_id, std::span<const int32_t> tokens,
                              int64_t min_suffix);

// The same on the device forward (CUDA builds; one GPU, the whole model, dense attention). On a
// hit the plan is a one-rank DeviceShard whose only piece is the suffix [P, S): each layer's
// exchange, queued on the compute stream, fills the attention's K/V with the prefix rows, copied
// from the cache's pool blocks (device to device on a device tier:
// BlockPool::read_to_device_async) and cast to the attention's dtype, then the suffix's own rows.
// The prefix's blocks stay pinned for the run. The result's KV is the whole prompt's (the prefix
// rows as lead rows of the forward's own KV drain), as the CPU path's; its logits and importance
// are the suffix run's. A miss is a plain device prefill.
// opt.prefill.sparse is refused.
//
// Plans are length-specific (a hit's for exactly its S and P), and planning a long prompt costs
// about a second (allocation, GEMM algorithm choice, the attention graph): the object keeps its
// last hit plan and its last miss plan (for up to the longest prompt it has seen), so requests of
// one shape behind one cached prefix plan once. Both hold device memory until the next shape or
// the object's end. One run at a time; the DeviceModel and the cache outlive the object.
class DevicePrefixPrefill {
 public:
  DevicePrefixPrefill(const model::DeviceModel& dm, PrefixCache* cache, std::string model_id,
                      PrefixPrefillOptions opt);
  ~DevicePrefixPrefill();
  DevicePrefixPrefill(const DevicePrefixPrefill&) = delete;
  DevicePrefixPrefill& operator=(const DevicePrefixPrefill&) = delete;
  Result<model::PrefillResult> run(std::span<const int32_t> tokens,
                                   PrefixPrefillStats* stats = nullptr);
  // Device memory its kept plans and the hit plan's prefix staging hold (weights excluded).
  int64_t workspace_bytes() const;

 private:
  struct Impl;  // prefix_prefill_cuda.cpp
  std::unique_ptr<Impl> impl_;
};

// One call through a fresh DevicePrefixPrefill (plans every time).
Result<model::PrefillResult> prefill_with_prefix_cache_device(
    const model::DeviceModel& dm, PrefixCache* cache, const std::string& model_id,
    std::span<const int32_t> tokens, const PrefixPrefillOptions& opt,
    PrefixPrefillStats* stats = nullptr);

}  // namespace sf::kvstore
