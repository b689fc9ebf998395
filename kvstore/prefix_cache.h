// Prefix cache (DESIGN.md "KV store and tiering"): KV of whole 64-token prompt blocks, found by a
// content hash chain so a request that shares a prompt prefix with an earlier one reuses that KV
// and computes only the suffix.
//
// Block i's key is XXH64 over (key of block i-1, model id, the 64 token ids of block i), so a key
// names the whole prefix up to and including its block: a different model id, or one changed
// token, misses from that block on. Each entry also keeps its parent key, model id and tokens and
// lookup compares them, so a hash collision is a miss, never wrong KV.
//
// Entries hold one BlockPool block per layer (the pool decides the tier). The cache has its own
// byte budget (pool block bytes x layers per entry) and evicts least recently used entries to stay
// under it. A lookup refreshes its chain leaf first, so a prefix block is always more recent than
// the blocks that extend it and eviction takes chain tails before their prefixes.
#pragma once
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "kvstore/block_pool.h"

namespace sf::kvstore {

uint64_t prefix_block_key(uint64_t parent, const std::string& model_id,
                          std::span<const int32_t> block_tokens);

struct PrefixCacheStats {
  int64_t lookups = 0, hits = 0, misses = 0;  // a hit matched at least one block
  int64_t hit_blocks = 0;                     // blocks served by lookups
  int64_t inserted_blocks = 0, evicted_blocks = 0;
  int64_t used_bytes = 0, budget_bytes = 0, entries = 0;
};

// A layer's K or V rows, token-major [n_tokens, n_kv_heads, head_dim] fp32 (as model::KvCache).
using KvRows = std::function<float*(int layer, bool value)>;

class PrefixCache {
 public:
  // pool: not owned, outlives the cache; its geometry must be the model's.
  PrefixCache(BlockPool* pool, int n_layers, int64_t budget_bytes);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // Tokens (a multiple of 64) of the longest cached prefix of `tokens`, at most max_tokens.
  // Counts a hit or a miss and refreshes the matched entries.
  int64_t lookup(const std::string& model_id, std::span<const int32_t> tokens,
                 int64_t max_tokens = INT64_MAX);
  // Copies the KV of the first n_tokens (a cached prefix, as lookup returned) into dst rows
  // 0..n_tokens-1 of every layer. Blocks are pinned while they are read.
  Status read(const std::string& model_id, std::span<const int32_t> tokens, int64_t n_tokens,
              const KvRows& dst);
  // The pool blocks of the first n_tokens (a cached prefix, as lookup returned), each pinned:
  // result[layer] in position order, for a reader that copies them itself (the device prefill,
  // BlockPool::read_to_device_async). kNotFound when part of the prefix is gone. Give them back
  // with unpin_blocks() before the next insert: eviction skips an entry with a pinned block, so
  // pins held across inserts shrink what the budget can make room for.
  Result<std::vector<std::vector<BlockId>>> pin_blocks(const std::string& model_id,
                                                       std::span<const int32_t> tokens,
                                                       int64_t n_tokens);
  Status unpin_blocks(const std::vector<std::vector<BlockId>>& blocks);
  // Caches every whole block of `tokens` not cached yet; src holds at least those rows. Evicts
  // LRU entries to fit the budget. A block that fits neither the budget nor the pool ends the
  // insert with kResourceExhausted (what was inserted before it stays). The new blocks' rows are
  // written in one batch at the end (BlockPool::write_batch), so src's rows must stay valid until
  // insert returns; if that write fails (or an allocation throws), none of this call's entries
  // stay.
  Status insert(const std::string& model_id, std::span<const int32_t> tokens, const KvRows& src);

  PrefixCacheStats stats() const;
  int64_t entry_bytes() const;
  int n_layers() const { return n_layers_; }
  BlockPool* pool() const { return pool_; }
  int64_t floats_per_token() const { return pool_->half_floats() / kPoolBlockTokens; }

 private:
  struct Entry {
    uint64_t parent = 0;
    std::string model_id;
    std::vector<int32_t> tokens;  // the block's 64 ids
    std::vector<BlockId> blocks;  // one per layer
    std::list<uint64_t>::iterator lru;
  };
  // Keys of the cached chain of `tokens`, from the first block on (locked).
  std::vector<uint64_t> match(const std::string& model_id, std::span<const int32_t> tokens,
                              int64_t max_blocks) const;
  // Keys of exactly the first n_tokens (whole blocks), or the error naming what is missing
  // (locked; `what` names the caller in the error).
  Result<std::vector<uint64_t>> match_all(const std::string& model_id,
                                          std::span<const int32_t> tokens, int64_t n_tokens,
                                          const char* what) const;
  // The least recent entry none of whose blocks is pinned, among all but the `keep` most recent
  // (an insert's own chain); false when there is none (locked).
  bool evict_one(size_t keep);

  mutable std::mutex mu_;
  BlockPool* pool_;
  int n_layers_;
  PrefixCacheStats st_;
  std::unordered_map<uint64_t, Entry> map_;
  std::list<uint64_t> lru_;  // front: most recent
};

}  // namespace sf::kvstore
