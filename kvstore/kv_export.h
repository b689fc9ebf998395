// Versioned KV export: one safetensors shard per layer plus manifest.json (docs/kv-format.md).
// Shards hold `key` and `value` as [1, n_kv_heads, n_kept, head_dim] in Hugging Face's cache
// layout and rotary convention, so `safetensors` + transformers.DynamicCache can consume them;
// when a retention keeps different counts per head, each head gets its own `key.hH`/`value.hH`.
// Every head also carries its kept positions and per-block (64 kept tokens) metadata that
// decode-side selection uses: key min/max/mean per channel and summed importance.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "kernels/api.h"
#include "kvstore/kv_quant.h"
#include "kvstore/retention.h"
#include "worker/model/model.h"

namespace sf::kvstore {

// 6: the retention's kept positions as one string a head (`runs`, kvstore/position_runs.h)
// instead of a JSON array a run (`ranges`), which at a million scattered tokens a head could pass
// the reader's manifest cap; written with or without a low tier;
// 5: a second, narrower encoding for the retention's low tier (kv_dtype_low; exports without a
// low tier were written as 4);
// 4: keys and values may be stored in another encoding than F32 (kv_dtype, kvstore/kv_quant.h);
// 3: a layer may be split over several shard files, each holding some token runs of some KV
// heads (the TP x CP ranks that computed them); 2: retention detail, per-head positions and
// per-block metadata; 1: full retention only. Readers read 3 to 6; 3's K/V are F32.
constexpr int kKvFormatVersion = 6;
// The version named inside compat_hash's string. It changes only when what a consumer must agree
// on changes, not with the file format: version 4 added an encoding, which any reader of 4
// decodes, so format 3 and 4 exports of one model share a hash.
constexpr int kKvCompatVersion = 3;
constexpr int kKvBlockSize = 64;

struct KvExportSpec {
  std::string model_name, arch;
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  float rope_theta = 0.f;
  // Whatever else of the model's RoPE changes the keys (rope_variant); empty for plain RoPE.
  std::string rope_variant;
  // true when keys come rotated by adjacent pairs (GGUF llama layout); the export rewrites
  // them to rotate-half order, which is what HF caches hold.
  bool keys_interleaved = false;
  int64_t n_tokens = 0;
  std::vector<int32_t> token_ids;
  int32_t first_token = -1;
  // Optional; null means full retention and no importance. Not owned; must match the geometry.
  const Retention* retention = nullptr;
  const ImportanceScores* importance = nullptr;
  // How the shards store K and V; block metadata stays F32, taken from the keys as stored
  // (decoded), so a block's key min and max bound what a reader loads.
  KvEncoding encoding = KvEncoding::kF32;
  // The low tier's encoding: set exactly when the retention has a low tier (Retention::low),
  // narrower than `encoding`. Each tier is written to its own shard files (docs/kv-format.md).
  std::optional<KvEncoding> encoding_low;
};

// A layer's K or V rows as a source holds them: F32, or BF16 (a device prefill's host K/V kept
// in bf16, model::PrefillOptions::kv_host_bf16), widened exactly as they are gathered; what is
// written is then the export of those widened values.
struct LayerRows {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  LayerRows() = default;
  LayerRows(const float* f32) : data(f32) {}  // NOLINT: F32 is what most sources hold
  static LayerRows bf16(const uint16_t* p) {
    LayerRows r;
    r.data = p;
    r.dtype = DType::kBF16;
    return r;
  }
};
// Returns the layer's K or V, token-major [n_tokens, n_kv_heads, head_dim], F32 or BF16.
using LayerSource = std::function<LayerRows(int layer, bool value)>;

// Bytes of K and V a retention keeps, summed over layers and heads, stored in `enc`
// (kv_encoded_bytes per head); a low tier's tokens in `low` (in `enc` when not given).
int64_t kv_bytes(const Retention& r, int head_dim, KvEncoding enc = KvEncoding::kF32,
                 std::optional<KvEncoding> low = std::nullopt);

// Compatibility hash over everything a consumer must agree on (model, dtype, geometry, rope,
// block size). Hex string of XXH64. A non-empty rope_variant joins the hashed string, so plain
// RoPE models keep the hash they had before it existed.
std::string compat_hash(const KvExportSpec& s);

// The RoPE beyond theta that a consumer must match to continue the keys: Llama-3 frequency
// scaling, a partial rotary dimension, per-pair frequency divisors (hashed by value). "" when
// the model has none of them.
std::string rope_variant(const kernels::RopeParams& rope, int head_dim, const float* freq_factors,
                         size_t n_freq_factors);

// The spec's model part for m (names, geometry, RoPE, key layout); token fields left empty.
// Every exporter (prefill, the worker) and every consumer's hash start from this one.
KvExportSpec model_export_spec(const model::Model& m);

// How an export runs.
struct ExportOptions {
  // Shard files gathered, encoded and written (hashed, fsynced) at once, each on its own thread
  // (the caller's is one): their copies and their waits for the disk overlap. Each holds one
  // shard's kept K/V in a gathered copy meanwhile. Above 1, the LayerSource is called from
  // several threads at once and must allow that.
  int layers_in_flight = 1;
  // Called once for each layer when every shard file this call writes of it is written: the
  // source's rows of that layer are no longer read, so a caller may free them (a batch's next
  // request then needs less memory beside this export). From the writing threads, several at
  // once; not for a layer whose file failed.
  std::function<void(int layer)> on_layer_written;
  // Called from the writing threads before a layer's rows (the LayerSource) or its importance
  // are read: an export begun while its prefill still runs (sparsefill-worker --export-stream)
  // waits here until the prefill has made that layer final. A non-ok status fails the layer's
  // file, and so the export, with that error. Unset: every layer is final already.
  std::function<Status(int layer)> wait_layer;
};
// A layers_in_flight for callers whose source is thread-safe: half the CPU pool's threads,
// between 1 and 8 (measured: bench/NOTES.md, forty-second session).
int default_layers_in_flight();

// Writes dir/manifest.json and dir/layer_XXX.safetensors. The export is built in a sibling
// temporary directory and renamed into place, so a failure leaves nothing half-written.
// An existing non-empty dir is an error unless force.
Status export_kv(const std::string& dir, const KvExportSpec& spec, const LayerSource& src, bool force,
                 const ExportOptions& opt = {});

// ---- sharded exports: each writer (a TP x CP rank) writes the part of every layer it holds;
// one writer then writes the manifest over every part's entries (docs/kv-format.md, "Shards").

// What one writer holds of every layer: token runs (ascending, disjoint) of KV heads
// [kv_head0, kv_head0 + n_kv_heads). Its LayerSource returns the part's rows, token-major
// [tokens in run order, n_kv_heads, head_dim]. Blocks of 64 kept tokens are counted within each
// part, so that they add up to the whole layer's, every part but the one holding a head's last
// kept position must keep a multiple of 64 tokens of that head (true of 64-aligned CP chunks).
struct KvShardPart {
  std::vector<std::array<int64_t, 2>> tokens;
  int kv_head0 = 0, n_kv_heads = 0;
  int rank = 0;          // who wrote it (recorded)
  std::string file_tag;  // file names: layer_LLL<file_tag>.safetensors
  int layer = -1;        // every layer (-1), or only this one (parts that differ per layer)
  // Two-tier exports: every tier (-1), or only the high (0) or low (1) one (parts cut per tier).
  int tier = -1;
};
// The whole cache as one part (what export_kv writes).
KvShardPart whole_part(const KvExportSpec& spec);

// Whether dir can take an export: a path with a name of its own ("out/kv", "out/kv/"; not ".",
// ".." or "/"), and either missing, empty, or (with force) an earlier export, one holding
// manifest.json. Cheap: callers check before a prefill, begin_export checks again.
Status export_dir_check(const std::string& dir, bool force);
// The temporary directory an export is built in (beside dir; created, emptied first) and its
// final move into place, which replaces an earlier export there. Its name is dir's +
// kExportPartialTag + HOST-PID, so a later job can tell a dead process's leftover on its own host
// (sparsefill-worker removes those under its output lock: runtime::stale_partial).
inline constexpr std::string_view kExportPartialTag = ".partial-";
Result<std::string> begin_export(const std::string& dir, bool force);
// dir is checked again (export_dir_check with the same force): what appeared there while the
// shards were written (another export, a user's directory) is not replaced unless begin would
// have replaced it. The move is made durable (the parent directory synced).
Status finish_export(const std::string& tmp, const std::string& dir, bool force);

// Writes the part's shard files into tmp and returns their manifest entries (JSON objects, one
// per layer, as text: writers on other ranks send them to the manifest's writer). validate false
// skips the spec's own checks (O(kept tokens)): for the second and later parts of one spec.
Result<std::vector<std::string>> export_kv_shards(const std::string& tmp, const KvExportSpec& spec,
                                                  const KvShardPart& part, const LayerSource& src,
                                                  bool validate = true,
                                                  const ExportOptions& opt = {});
// Writes tmp/manifest.json over every part's entries, after checking that every entry's file is
// in tmp at its size (kNotFound otherwise), that per layer they cover every (token, KV head)
// exactly once and that their blocks align (see KvShardPart).
Status export_kv_manifest(const std::string& tmp, const KvExportSpec& spec,
                          const std::vector<std::string>& entries);

}  // namespace sf::kvstore
