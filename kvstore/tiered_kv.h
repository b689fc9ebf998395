// Prefill-driven KV tiering (DESIGN.md "KV store and tiering", sparsity-aware tiering): as soon
// as a layer's attention (and its SnapKV importance) is done, the forward's per-layer hook hands
// its K/V here; they are written as 64-token pool blocks and BlockPool::place() keeps the sink,
// the recent window and the top-scored blocks of that layer on the fast tier, up to the layer's
// share of it, demoting the rest to the next tier.
//
// Block score: the max over the block's tokens and the layer's KV heads of the SnapKV importance
// (kernels/kv_importance.h, already max-pooled over keys): a block is hot when any head of the
// observation window attends to any of its tokens. Without importance every score is 0 and only
// sink and window are ranked (then position order).
//
// Plan/run split: TieredKv::create validates shapes against the pool and fixes each layer's
// fast-tier quota once; on_layer() runs per layer, from the CPU forward or the GPU forward (host
// K/V copies, device-computed importance). Both forwards still keep their own full KvCache; the
// pool holds the tiered copy.
//
// With the device as the fast tier, the GPU forward hands its K/V over without a host copy
// (device_sink): enqueue_device() queues the layer's blocks on the forward's copy stream as soon
// as its K/V are final, the layer's fast-tier share (sink, recent window, then the blocks nearest
// the end) device to device and the rest straight to pinned host; place_device() then ranks them
// by importance when it lands and swaps cold device blocks for hot host ones on the pool's copy
// stream. Neither waits inside a layer, and both run while the GPU computes later layers.
//
// A disk tier under the device form (device, host, disk) makes pinned host the middle tier: each
// placed layer keeps its host_keep() best cold blocks on host, and a background thread demotes
// the rest of them to disk while later layers compute. The sink then bounds the layers in flight
// to two (DeviceLayerKvSink::max_inflight), so the host needs room for two layers' landings plus
// every layer's host share, not for the whole KV; enqueue_device() waits for that room when the
// disk is slower than the forward. A prompt that starts again at layer 0 replaces every layer.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "common/tensor.h"
#include "kvstore/block_pool.h"
#include "worker/model/model.h"

namespace sf::kvstore {

struct TieredKvConfig {
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  int64_t sink_blocks = 1;    // attention sink: the first block(s)
  int64_t recent_blocks = 1;  // the last block(s): the observation window lives there
  Tier fast = Tier::kHost;    // kDevice in CUDA builds; cold blocks go one tier down
};

class TieredKv {
 public:
  // pool must outlive this object and match n_kv_heads / head_dim. Each layer's fast-tier quota
  // is an equal share of the fast tier's capacity (the remainder to the first layers): tiering
  // layer by layer must not let early layers take the whole fast tier.
  static Result<std::unique_ptr<TieredKv>> create(BlockPool* pool, const TieredKvConfig& cfg);
  ~TieredKv();  // frees this object's blocks
  TieredKv(const TieredKv&) = delete;
  TieredKv& operator=(const TieredKv&) = delete;

  // k, v: [n_tokens, n_kv_heads, head_dim] F32 host; importance: [n_kv_heads, n_tokens] or
  // empty. A layer seen again (model::extend) has its blocks replaced. Errors (e.g. every tier
  // full: kResourceExhausted naming layer and block) leave no block of this call allocated.
  Status on_layer(int layer, const TensorView& k, const TensorView& v,
                  std::span<const float> importance);
  // The hook for model::PrefillOptions::on_layer_kv.
  model::LayerKvHook hook();

  // The device forward's path (CUDA builds, fast tier kDevice): k, v are the layer's device rows
  // ([n_rows, n_kv_heads, head_dim] F32), read on `stream` (a cudaStream_t) after this returns;
  // no block lands on disk here (a disk tier gets placed layers' cold host blocks later; with
  // one, this waits for host room the drain frees). place_device() must follow once the stream
  // has passed those reads; until then the layer reads as empty and read_layer() refuses it.
  Status enqueue_device(int layer, const float* k, const float* v, int64_t n_rows, void* stream);
  Status place_device(int layer, std::span<const float> importance);
  // The sink for model::PrefillOptions::on_layer_kv_device.
  model::DeviceLayerKvSink device_sink();
  // A device prefill failed between enqueue_device and place_device: waits for the copies still
  // in flight into the unplaced layers' blocks (on their streams, which must still exist) and
  // frees those layers. The sink's `abandon`.
  void abandon_pending();
  // Before a device-path prefill of n_tokens: the host tier must hold every block outside the
  // layers' device shares, plus one that placement swaps through; with a disk tier, two layers'
  // landings plus one, and the disk the rest (kResourceExhausted naming the budget it needs
  // otherwise). For a host fast tier: host and disk together must hold every layer's blocks (the
  // pool holds the forward's only copy), so a disk budget too small fails before the prefill,
  // not in its last layer.
  Status check_room(int64_t n_tokens) const;

  // Device form with a disk tier: the blocks each layer keeps on host once placed, for a prompt
  // of n_tokens (the host minus two layers' landings and one swap block, shared equally); -1
  // when the host cannot hold even the landings. Without a disk tier: no limit (n blocks).
  int64_t host_keep(int64_t n_tokens) const;
  // Waits until the background demotions to disk are done and returns the first error they met
  // (every later enqueue_device/place_device returns it too). Ok at once without a disk tier.
  Status wait_drained() const;

  // Reassembles a layer's K and V ([n_tokens, n_kv_heads, head_dim]) from whatever tiers its
  // blocks are on (after wait_drained()). kNotFound for a layer that holds nothing (never placed,
  // or released), which an empty result would otherwise pass for.
  Status read_layer(int layer, std::vector<float>* k, std::vector<float>* v) const;

  int64_t n_tokens(int layer) const { return tokens_[size_t(layer)]; }
  const std::vector<BlockId>& blocks(int layer) const { return blocks_[size_t(layer)]; }
  const std::vector<float>& scores(int layer) const { return scores_[size_t(layer)]; }
  int64_t fast_quota(int layer) const { return quota_[size_t(layer)]; }
  const PlacementResult& placement(int layer) const { return placed_[size_t(layer)]; }
  // Blocks of the layer the background demoted from host to disk (read after wait_drained()).
  int64_t drained(int layer) const { return drained_[size_t(layer)]; }
  // Seconds enqueue_device() waited for the drain to free host room, over this object's life:
  // how long the disk held the forward back.
  double host_wait_seconds() const { return host_wait_s_; }

 private:
  TieredKv() = default;
  void release(int layer);
  void wait_idle() const;
  // Scores the layer's blocks (importance: [n_kv_heads, n] or empty) and places them.
  Status rank_and_place(int layer, int64_t n, std::span<const float> importance);
  // Background demotion of placed layers' surplus host blocks to disk (device form + disk).
  struct Drainer;
  bool draining() const { return drain_ != nullptr; }
  void drain_loop();
  Status drain_layer(int layer);
  Status drain_error() const;
  BlockPool* pool_ = nullptr;
  TieredKvConfig cfg_;
  std::unique_ptr<Drainer> drain_;
  std::vector<int64_t> quota_, tokens_;
  std::vector<int64_t> pending_;  // rows enqueue_device() queued, not yet placed (0: none)
  std::vector<void*> pending_stream_;  // the stream those copies are queued on
  std::vector<std::vector<BlockId>> blocks_;
  std::vector<std::vector<float>> scores_;
  std::vector<PlacementResult> placed_;
  std::vector<int64_t> drained_;
  double host_wait_s_ = 0;
  std::vector<float> kbuf_, vbuf_;  // one block, zero-padded past the last token
};

// Block score of tokens [t0, t1) of one layer: max over KV heads and tokens of importance
// ([n_kv_heads, n_tokens]).
float block_score(std::span<const float> importance, int n_kv_heads, int64_t n_tokens, int64_t t0,
                  int64_t t1);

// Per-tier pool metrics: registers the families and every series (zeros included) and sets
// them from pool.stats(). Names: sparsefill_kv_pool_{capacity_bytes,bytes,blocks}{tier},
// sparsefill_kv_pool_blocks_moved_total{tier,direction="down"|"up"} (blocks moved out of tier),
// sparsefill_kv_pool_bytes_moved_total{tier,direction}, sparsefill_kv_pool_spilled_total{tier},
// sparsefill_kv_pool_full_refusals_total{tier}, sparsefill_kv_pool_io_errors_total{tier}.
Status pool_metrics_export(const BlockPool& pool, MetricsRegistry* reg);
// The pool's metrics plus sparsefill_kv_tiering_host_wait_seconds_total (host_wait_seconds()).
Status tiering_metrics_export(const TieredKv& tiered, const BlockPool& pool, MetricsRegistry* reg);

// `--kv-pool host=BYTES,disk=DIR[:BYTES]` (fast tier host, cold blocks to disk) or
// `--kv-pool device=BYTES,host=BYTES[,disk=DIR[:BYTES]]` (the device forward's: fast tier
// device, cold blocks to pinned host, and with disk= the coldest of those on to disk). Sizes:
// 123, 64K, 64M, 2G, 1T; binary multiples.
struct KvPoolSpec {
  int64_t device_bytes = 0;  // > 0: the device form
  int64_t host_bytes = 0;
  std::string disk_dir;
  int64_t disk_bytes = -1;  // -1: not given (the caller sizes it, e.g. to the whole KV)
};
Result<int64_t> parse_byte_size(const std::string& s, const std::string& what);
Result<KvPoolSpec> kv_pool_spec_parse(const std::string& spec);
// Creates the disk directory when missing and checks a file can be written there.
Status kv_pool_dir_check(const std::string& dir);

}  // namespace sf::kvstore
