// Decode-side KV client: loads an export (docs/kv-format.md, format versions 3-6) from a directory,
// verifies it completely and returns it only when every check passed, so a consumer never sees
// partial data. Checks: format and version, the compatibility hash against the consumer's model,
// every shard's size and XXH64, its metadata and tensor names against its manifest entry, dtypes
// and shapes, that the shards of each layer cover every (token, KV head) exactly once (a layer
// may be split over the TP x CP ranks that computed it), that the positions stored in the shards
// equal the retention the manifest declares (each tier's its own), and that the block key
// statistics are the stored keys'. The network transport comes later; this is the file-backed
// path.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "kvstore/kv_quant.h"

namespace sf::decode {

// One layer's KV head: the kept tokens in position order, as exported (keys post-RoPE in
// rotate-half channel order; decoded to F32 from the export's kv_dtype), plus per-block metadata
// over runs of 64 kept tokens.
struct HeadKv {
  std::vector<int32_t> positions;
  std::vector<float> k, v;                                 // [n, head_dim]
  std::vector<float> block_kmin, block_kmax, block_kmean;  // [n_blocks, head_dim]
  std::vector<float> block_importance;  // [n_blocks]; empty when the export had none
  // int8 exports: the codes and F16 scales / zeros as stored (k and v are their decoding), for a
  // consumer that keeps the encoding (decode::DevicePagedPool); empty for other encodings.
  kvstore::EncodedRows kq, vq;
};

struct KvExport {
  std::string model_name, arch, compat_hash;
  int n_layers = 0, n_kv_heads = 0, head_dim = 0, block_size = 0;
  int64_t n_tokens = 0;
  std::vector<int32_t> token_ids;
  int32_t first_token = -1;
  std::string retention_policy, retention_params;
  std::string kv_dtype = "f32";  // how the shards stored K/V (kvstore/kv_quant.h); heads hold F32
  // Format 5 with a low tier: its tokens' encoding ("" otherwise). A head's tiers are merged in
  // position order on load; its block metadata is then taken from the decoded keys of the merged
  // blocks, and block_importance is left empty (the files' blocks are per tier).
  std::string kv_dtype_low;
  int64_t kv_bytes = 0, kv_bytes_full = 0;
  std::vector<HeadKv> heads;  // [layer * n_kv_heads + head]

  const HeadKv& head(int layer, int h) const {
    return heads[size_t(layer) * size_t(n_kv_heads) + size_t(h)];
  }
};

// The manifest alone, validated (format, version, compat hash, geometry, declared retention,
// shard entries) without touching any shard: the part of the reader that parses untrusted text
// (fuzzed: tests/fuzz/fuzz_kv_manifest.cpp).
struct KvManifest {
  KvExport meta;  // every field but the heads' data
  struct Shard {
    std::string file, xxh64;
    std::vector<std::string> tensors;  // its entry's `tensors` (empty where the entry has none)
    int64_t bytes = 0;
    bool uniform = true;                        // key/value for all its heads, else key.hH/value.hH
    int layer = 0, kv_head0 = 0, kv_head1 = 0;  // KV heads [kv_head0, kv_head1)
    std::vector<std::pair<int64_t, int64_t>> tokens;  // prompt runs it holds, ascending
    std::vector<int64_t> kept;                        // per head of the shard: kept tokens
    bool low = false;                                 // holds the low tier (format 5)
  };
  // Where (layer, head)'s kept tokens come from, in position order: a run of one shard, its
  // kept tokens there, and their first row among the shard's rows of that head.
  struct Piece {
    int shard = 0;
    int64_t kept = 0, row = 0;
  };
  std::vector<Shard> shards;                                     // in manifest order
  // [tier][layer * n_kv_heads + head]: tier 0 the high tier (every kept token without a low
  // tier), tier 1 the low tier (present only with kv_dtype_low).
  std::vector<std::vector<std::vector<Piece>>> pieces;
  std::vector<int64_t> kept;                                     // [layer * n_kv_heads + head]
  std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges;  // declared [begin, end) runs
  // [tier][layer * n_kv_heads + head]: each tier's runs (tier 0 is `ranges` minus the low tier's).
  std::vector<std::vector<std::vector<std::pair<int64_t, int64_t>>>> tier_ranges;
  // The manifest's `importance`: an object (every shard head carries block_importance), null
  // (none does), or absent (a manifest before the field: either, as the files have it).
  enum class Importance { kAbsent, kNull, kPresent } importance = Importance::kAbsent;
};
Result<KvManifest> parse_kv_manifest(std::string_view text,
                                     const std::string& expected_compat_hash);

// expected_compat_hash: the hash of the consumer's own model (decode::model_compat_hash); an
// export for any other model, dtype, geometry, rope or block size is refused. Layers are
// verified and read layers_in_flight at a time, each on its own thread (0:
// kvstore::default_layers_in_flight()); the result and any error are the same at every width.
Result<KvExport> load_kv_export(const std::string& dir, const std::string& expected_compat_hash,
                                int layers_in_flight = 0);

}  // namespace sf::decode
