// A Llama-family decoder (Llama-2/3, SmolLM2, Mistral, Qwen2) with fp32 weights for the CPU
// backend, and its prefill forward. The weights are dequantized once at load time.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include <array>
#include <functional>

#include "common/tensor.h"
#include "kernels/sparse_index.h"
#include "worker/model/config.h"

namespace sf::model {

struct OwnedTensor {
  std::vector<float> data;
  std::vector<int64_t> shape;  // row-major
  bool empty() const { return data.empty(); }
  TensorView view() const;
};

struct LayerWeights {
  OwnedTensor attn_norm, wq, wk, wv, bq, bk, bv, wo;
  OwnedTensor ffn_norm, w_gate, w_up, w_down;
};

struct ModelWeights {
  OwnedTensor tok_embd;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  OwnedTensor out_norm;
  OwnedTensor lm_head;     // empty when tied to tok_embd
  OwnedTensor rope_freqs;  // optional per-pair divisors (GGUF Llama-3)
};

enum class ModelFormat { kGguf, kSafetensors };

// "--model default": $SF_MODEL when set and not empty, else the bundled SmolLM2 GGUF under
// source_dir/models (every binary passes its SF_SOURCE_DIR). Any other value is the path itself.
std::string resolve_model_path(const std::string& m, const std::string& source_dir);

class Model {
 public:
  // path: a .gguf file, or a Hugging Face directory with config.json + *.safetensors.
  static Result<Model> load(const std::string& path);
  // For tests and GPU-host runs: deterministic synthetic weights (seeded) of a given shape.
  static Result<Model> synthetic(const ModelConfig& cfg, uint64_t seed);
  // The shape alone, no weights: for runs whose weights live elsewhere (a device model drawn on
  // the GPU, `--model synthetic:...`). No host forward may run on it (has_weights() is false).
  static Result<Model> shape_only(const ModelConfig& cfg, std::string path);
  bool has_weights() const { return !w_.layers.empty(); }

  const ModelConfig& config() const { return cfg_; }
  const ModelWeights& weights() const { return w_; }
  ModelFormat format() const { return format_; }
  const std::string& path() const { return path_; }
  // The output projection ([vocab, hidden]), tied or not.
  const OwnedTensor& output_weight() const { return w_.lm_head.empty() ? w_.tok_embd : w_.lm_head; }

 private:
  ModelConfig cfg_;
  ModelWeights w_;
  ModelFormat format_ = ModelFormat::kGguf;
  std::string path_;
  friend Status load_gguf(const std::string&, Model*);
  friend Status load_safetensors(const std::string&, Model*);
};

// The host forwards' first check: a shape-only model (Model::shape_only) has no weights to run
// on the CPU (kUnsupported, naming `who` and the model).
inline Status check_host_weights(const Model& m, const char* who) {
  if (m.has_weights()) return Status::ok();
  return SF_ERR(kUnsupported, std::string(who) + ": '" + m.path() +
                                         "' has no host weights (a shape-only model runs on a "
                                         "device model only)");
}

// Keys are stored after RoPE, in the model's own rotary convention (config().rope.neox).
struct KvCache {
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  int64_t n_tokens = 0;
  std::vector<std::vector<float>> k, v;  // per layer: [n_tokens, n_kv_heads, head_dim]
  // Or, from a device prefill with PrefillOptions::kv_host_bf16, the same rows in bf16 (k and v
  // then empty): half the host memory. Readers that take F32 only check bf16() and refuse.
  std::vector<std::vector<uint16_t>> k16, v16;
  bool bf16() const { return !k16.empty(); }
  // Bytes of layer l's K and V as held (F32 or bf16; 0 once freed).
  int64_t layer_bytes(int l) const {
    const size_t i = size_t(l);
    int64_t b = 0;
    if (i < k.size()) b += int64_t((k[i].size() + v[i].size()) * sizeof(float));
    if (i < k16.size()) b += int64_t((k16[i].size() + v16[i].size()) * sizeof(uint16_t));
    return b;
  }
  // Frees layer l's K and V (an export that has written them: kvstore::ExportOptions::
  // on_layer_written); returns the bytes freed. Other layers stay as they are.
  int64_t free_layer(int l) {
    const int64_t b = layer_bytes(l);
    const size_t i = size_t(l);
    if (i < k.size()) std::vector<float>().swap(k[i]), std::vector<float>().swap(v[i]);
    if (i < k16.size()) std::vector<uint16_t>().swap(k16[i]), std::vector<uint16_t>().swap(v16[i]);
    return b;
  }
};

struct SparseConfig;
class DeviceBufferCache;  // device_model.h

// A run's K/V as it becomes final, for a caller that reads each layer while later layers still
// compute (the worker's streamed export): PrefillOptions::kv_hooks on the device,
// runtime::ParallelOptions::kv_hooks on the CPU grid.
struct LayerKvHooks {
  // On the run's thread, once layer l's rows (kv.k[l] / kv.v[l], or k16 / v16) and its
  // importance ([n_kv_heads, n_tokens], all KV heads; empty where the run has none or, as on the
  // device, gathers it after the run) are final. Those rows stay where they are until the result
  // is destroyed (moving it moves no row), so they may be read from other threads meanwhile;
  // nothing else of kv may be.
  std::function<void(int layer, const KvCache& kv, std::span<const float> importance)> final;
  // The run failed after `final` was called: its KvCache, with the rows `final` named still in
  // place, handed over before the run returns (which would otherwise free them under their
  // readers), for the caller to hold until its readers are done. Must not throw. The rows of a
  // failed run are not the prompt's K/V to keep: a device shard learns of a peer's failure only
  // at the run's end, and may have called final for layers computed from the failed peer's.
  // (A shard that fails itself lands no layer after its failure.)
  std::function<void(KvCache&& kv)> failed;
  explicit operator bool() const { return bool(final); }
};

// Observer of each layer's attention inputs (eval measures attention recall here): q holds the
// rows computed in this call, k all keys; idx is null when the layer ran dense.
using AttentionObserver = std::function<void(int layer, const TensorView& q, const TensorView& k,
                                             const kernels::SparseIndex* idx)>;

// Called once per layer when that layer's K/V rows are final (after attention and importance):
// k, v are [n_tokens in the cache, n_kv_heads, head_dim]; importance is that layer's
// [n_kv_heads, n_tokens] SnapKV scores, empty when importance_window is 0. A non-ok Status
// stops the prefill with that error (KV tiering: kvstore/tiered_kv.h). Reads only: numerics
// are unchanged.
using LayerKvHook = std::function<Status(int layer, const TensorView& k, const TensorView& v,
                                         std::span<const float> importance)>;

// KV tiering straight from the device forward (kvstore::TieredKv::device_sink). enqueue is
// called while a layer is being enqueued, as soon as its K/V rows are final in device memory
// (k, v: [n_rows, n_kv_heads, head_dim] F32): it may only queue reads of them on `stream` (the
// forward's copy stream, a cudaStream_t), never wait, as the rows are overwritten two layers
// later. place is called on the host thread once that stream has passed those reads and the
// layer's importance ([n_kv_heads, n_rows], empty without importance_window) has landed, while
// the device computes later layers. Single-device DevicePrefill only; the CPU forward refuses it.
struct DeviceLayerKvSink {
  std::function<Status(int layer, const float* k, const float* v, int64_t n_rows, void* stream)>
      enqueue;
  std::function<Status(int layer, std::span<const float> importance)> place;
  // > 0: at most this many layers enqueued and not yet placed; the forward places layer
  // l - max_inflight before it enqueues layer l (waiting for that layer's copies and importance),
  // so a sink whose cold blocks drain to a slower tier in the background gets host room back
  // while later layers compute. 0: every layer is enqueued first, then placed in order.
  int max_inflight = 0;
  // Optional: called when a run fails, before the forward's streams can go (its plan may be
  // destroyed right after): the sink waits for the copies of layers it enqueued and was never
  // asked to place, and drops them, so nothing later waits on a stream that no longer exists.
  std::function<void()> abandon;
  explicit operator bool() const { return bool(enqueue) && bool(place); }
};

// The default tokens per linear-layer chunk. On the CPU it bounds activation memory and keeps a
// chunk's GEMM operands near the caches. On a GPU each chunk is a GEMM launch per linear (and,
// under TP, an all-reduce of its partial sums), so larger chunks run faster: a 128K Llama-3-8B
// prefill on H200 takes 11.7 s at 8192 against 12.3 s at 512, and 6.3 s against 7.5 s at TP 2,
// for 1.2 GB more device workspace (bench/NOTES.md, fifty-sixth and fifty-seventh entries).
inline constexpr int64_t kDefaultChunkCpu = 512;
inline constexpr int64_t kDefaultChunkDevice = 8192;

struct PrefillOptions {
  int64_t chunk = kDefaultChunkCpu;  // tokens per linear-layer chunk: bounds activation memory
  bool all_logits = false;  // logits of every position instead of the last only
  bool keep_kv = true;
  const SparseConfig* sparse = nullptr;  // null: dense attention everywhere
  AttentionObserver on_attention;
  // Each sparse layer's final index (after any grow), one call per piece of the layer's queries
  // (SparseIndex::q_offset says which), on the calling thread. Both forwards; the device forward
  // copies the index to the host and so waits for the layer: tests and tools, not serving.
  std::function<void(int layer, const kernels::SparseIndex& idx)> on_sparse_index;
  // > 0: SnapKV importance of the last importance_window queries of this call against all keys,
  // from the attention's LSE (kernels/kv_importance.h), into PrefillResult::importance.
  int importance_window = 0;
  int importance_pool = 7;  // max-pool kernel over keys (1: raw column sums)
  // With a sparse config on the CPU: a KV group whose query heads all have estimator scores
  // (vertical-slash or block family, kernels::EstimatorStats::columns) takes its importance from
  // them, max-pooled the same way, instead of the LSE pass; its observation rows are then the
  // estimator's (vertical-slash: the last 64 plus spread rows; block family: the last query
  // block, 1 to 64 rows), each head's sums rescaled to importance_window rows so groups from
  // either source compare. A layer whose groups all have them skips the pass.
  bool importance_from_estimator = false;
  LayerKvHook on_layer_kv;
  DeviceLayerKvSink on_layer_kv_device;  // DevicePrefill only
  // DevicePrefill only, with keep_kv: pinned host slots for the layers' K/V on their way to the
  // result (a ring: layer l's copy reuses layer l - N's slot once the host has taken that layer
  // out). 0, or at least n_layers: a slot per layer (every layer's copy can be queued at once),
  // which is also what a plan with on_layer_kv or on_layer_kv_device gets, and a shard with
  // overlapped TP sums but no DeviceShard::copy_wait_timeout_s. Fewer slots pin less host
  // memory (at 128K on a CP 2 rank of Llama-3-8B, 537 MB a layer) and the device runs at most N
  // layers ahead of the host's copies.
  int kv_staging_layers = 8;
  // DevicePrefill with keep_kv: the result's K/V in bf16 (KvCache::k16 / v16), rounded on the
  // device before they leave it, so the pinned staging, the copies and the host's K/V take half
  // the bytes (at 1M tokens through 32 Llama-3-8B layers, 134 GB instead of 268 GB over the
  // ranks). Not with the per-layer hooks or kv_lead_rows (they take F32); the CPU forward
  // refuses it. The sharded export reads such a cache with any retention.
  bool kv_host_bf16 = false;
  // With a ring (kv_staging_layers > 0): at most this many bytes of slots, but the cap leaves at
  // least two (or the one kv_staging_layers = 1 asks for; 0: no cap). Pinning runs at about 1.5 GB/s, so at 1M tokens (4.3 GB a layer on a CP 2
  // rank) 8 slots took 21-28 s of each new plan; the device needs only enough slots to stay ahead
  // of the host's copies, a fraction of a layer's compute at such lengths. kv_staging_slots().
  int64_t kv_staging_max_bytes = int64_t(8) << 30;
  // DevicePrefill with sparse attention: floors for its index slots' capacity {64-key blocks,
  // gathered columns} (0: each piece's estimator default). The slots' needs depend on the data;
  // a layer that needs more grows the plan during the run and runs that layer's attention again
  // (PrefillResult::sparse_grows), so a caller that saw an earlier plan's
  // (DevicePrefill::sparse_capacity) can start a new plan there.
  std::array<int, 2> sparse_capacity{0, 0};
  // DevicePrefill with sparse attention: grows of the plan one layer may take before the run
  // fails with kResourceExhausted (float atomics in the scoring can move a near-tie selection,
  // and so a slot's size, between a layer's runs); 0 fails at the first slot that outgrows the
  // plan, for callers that size it themselves (sparse_capacity).
  int sparse_max_grows = 2;
  // DevicePrefill only: take workspace and pinned host buffers from this cache where they are
  // large enough, and give them back to it when the plan is destroyed (DeviceBufferCache).
  std::shared_ptr<DeviceBufferCache> buffers;
  // Progress: called on the calling thread once layer l is done (the CPU forward: after its
  // hook; DevicePrefill: as its work lands on the host, after the KV copy-out and hooks, while
  // later layers still compute). The worker's stall notes use it.
  std::function<void(int layer)> on_layer_done;
  // DevicePrefill with keep_kv: each layer's K/V as it becomes final (before on_layer_done), and
  // the result's KvCache should the run fail after that (LayerKvHooks). The CPU forward refuses
  // them (the CPU grid's are runtime::ParallelOptions::kv_hooks).
  LayerKvHooks kv_hooks;
};

struct PrefillResult {
  std::vector<float> logits;  // [n_rows, vocab]
  int64_t n_logit_rows = 0;
  int32_t first_token = -1;   // argmax of the last position
  KvCache kv;
  double seconds = 0;
  // Attention accounting of the last call: time in estimators and in attention kernels, and the
  // fraction of causal query-key pairs computed (1.0 for dense).
  double estimate_s = 0, attention_s = 0, density = 1.0;
  // Per layer [n_kv_heads, n_tokens in the cache] when PrefillOptions::importance_window > 0,
  // and the time spent computing it.
  std::vector<std::vector<float>> importance;
  double importance_s = 0;
  // KV groups, summed over layers, whose importance came from the estimator's scores
  // (PrefillOptions::importance_from_estimator) instead of the LSE pass.
  int64_t importance_reused_groups = 0;
  // Most bytes of K/V the forward held in host memory at once during the call: every layer's
  // when keep_kv, one layer's at a time when not (the per-layer hook, e.g. KV tiering, keeps its
  // own copy). The GPU forward reports its pinned host copies.
  int64_t kv_peak_bytes = 0;
  // Device forward with keep_kv: host seconds spent sizing the result's KV vectors (their page
  // faults, on a helper thread from the run's start) and copying each layer into them out of
  // pinned memory (a shard's lead rows included, with their wait for their own copy). Both
  // overlap the layers' compute.
  double kv_alloc_s = 0, kv_copy_s = 0;
  // DevicePrefill: times the run grew its sparse plan because a layer's index slot outgrew it
  // (each grow re-plans with a quarter more room than the layer needed and runs that layer's
  // estimators and attention again; attention_s counts the grow, estimate_s both estimates).
  int sparse_grows = 0;
};

Result<PrefillResult> prefill(const Model& m, std::span<const int32_t> tokens, const PrefillOptions& opt = {});
// The pinned K/V slots a DevicePrefill stages through for slots of slot_bytes (one layer's K and
// V of the rows it holds) under opt's kv_staging_layers and kv_staging_max_bytes: n_layers for a
// slot per layer. The worker's host memory check counts the same.
int kv_staging_slots(const PrefillOptions& opt, int n_layers, int64_t slot_bytes);

// Appends tokens to out->kv (which may already hold a prefix) and replaces out's logits with
// those of the new tokens. Positions continue from the cached prefix.
Status extend(const Model& m, std::span<const int32_t> tokens, const PrefillOptions& opt, PrefillResult* out);
// Greedy continuation: n_new tokens after the prompt, using the KV cache (one token per step).
Result<std::vector<int32_t>> generate_greedy(const Model& m, std::span<const int32_t> prompt, int n_new);

}  // namespace sf::model
