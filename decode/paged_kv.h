// A paged KV cache for decode: one block pool shared by all layers and heads (seed 002: PSA's
// unified pool), and per (layer, KV head) page tables of block ids in position order. Heads may
// hold different token counts and positions (retention is per head). Each block keeps the
// per-channel key min/max that PSA's upper bound needs, updated as tokens are appended.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "decode/kv_client.h"
#include "kvstore/kv_quant.h"
#include "kvstore/retention.h"
#include "worker/model/model.h"

namespace sf::decode {

constexpr int kBlockTokens = 64;
static_assert(kBlockTokens == kvstore::kKvQuantKeyRows, "a page is one key group of the export");

struct KvBlock {
  int32_t n = 0;                  // tokens filled, <= kBlockTokens
  std::vector<int32_t> pos;       // [kBlockTokens]
  std::vector<float> k, v;        // [kBlockTokens, head_dim]
  std::vector<float> kmin, kmax;  // [head_dim] over the filled tokens
  // The block's int8 codes (one key group, a value group per row) when k and v are their
  // decoding: a block of an int8 export, or of round_trip(kInt8). An append clears them.
  kvstore::EncodedRows kq, vq;
};

class PagedKvCache {
 public:
  // keys_interleaved: the consuming model rotates adjacent channel pairs (GGUF llama); exported
  // keys (rotate-half order) and their block min/max are permuted back to that order.
  static Result<PagedKvCache> from_export(const KvExport& e, bool keys_interleaved);
  // The same, freeing each head's K/V in e once it is paged (e keeps its manifest fields): a
  // load then peaks near one copy of the cache, not two.
  static Result<PagedKvCache> take_from_export(KvExport& e, bool keys_interleaved);

  // In-process path (evaluation): the prefill's own cache (model channel order already) with a
  // retention applied, same paging and metadata as an export would give. enc: the keys and
  // values become what a decode node loading an export in that encoding holds
  // (kvstore::kv_round_trip per block of 64 kept tokens); the block min/max are those of the
  // keys as stored (decoded), as the export's metadata is.
  // With a low tier (r.low; `low` then names its encoding) each tier of a head is round-tripped
  // on its own, in position order (its key groups are 64 of its own tokens, as the export's
  // tier shards hold them), and the merged blocks' min/max are the decoded keys', as the
  // reader's merge gives them.
  static Result<PagedKvCache> from_prefill(const model::KvCache& kv, const kvstore::Retention& r,
                                           kvstore::KvEncoding enc = kvstore::KvEncoding::kF32,
                                           std::optional<kvstore::KvEncoding> low = std::nullopt);

  // Every block's keys and values replaced by kv_round_trip in `enc` (keys per block, values
  // per row), the block min/max recomputed from the decoded keys (PSA's bound must hold for the
  // keys it attends over): what a pool storing that encoding attends over, which is also what a
  // device pool in INT8 or BF16 holds (DevicePagedPool encodes each block so).
  Status round_trip(kvstore::KvEncoding enc);

  int n_layers() const { return n_layers_; }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  const std::vector<int32_t>& pages(int layer, int head) const { return pages_[idx(layer, head)]; }
  const KvBlock& block(int32_t id) const { return pool_[size_t(id)]; }
  // Blocks in use (an undone append's block may wait in the pool for reuse).
  int64_t n_blocks() const { return int64_t(pool_.size() - free_.size()); }
  int64_t n_tokens(int layer, int head) const;
  // Appends one token (a decoded one) to a head: fills the last block or opens a new one.
  void append(int layer, int head, int32_t pos, const float* k, const float* v);
  // What undo_append needs to take one append back exactly (the block's min/max and encoding
  // before it, and whether it opened the block).
  struct AppendUndo {
    int layer = 0, head = 0;
    bool opened = false;
    std::vector<float> kmin, kmax;
    kvstore::EncodedRows kq, vq;
  };
  AppendUndo append_undoable(int layer, int head, int32_t pos, const float* k, const float* v);
  // Takes back the newest append of u's head; undo several of a head in the reverse order of
  // its appends. Heads are independent: undoing one head's appends and keeping another's later
  // ones is fine (a block freed out of pool order is reused by the next block opened).
  void undo_append(AppendUndo&& u);

 private:
  // from_export and take_from_export (Export: const KvExport or KvExport, whose heads it frees).
  template <typename Export>
  static Result<PagedKvCache> page_export(Export& e, bool keys_interleaved);
  size_t idx(int layer, int head) const {
    return size_t(layer) * size_t(n_kv_heads_) + size_t(head);
  }
  int32_t new_block();
  int n_layers_ = 0, n_kv_heads_ = 0, head_dim_ = 0;
  std::vector<KvBlock> pool_;
  std::vector<int32_t> free_;  // pool blocks no page table holds, reused first
  std::vector<std::vector<int32_t>> pages_;
};

// Whether a cache fits a model's attention (layers, KV heads, head_dim); `who` starts the error.
// A session indexes the cache by the model's layers and heads, so a mismatch is refused first.
Status check_cache_geometry(const PagedKvCache& cache, int n_layers, int n_kv_heads, int head_dim,
                            const std::string& who);

}  // namespace sf::decode
