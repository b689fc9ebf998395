#include "kvstore/prefix_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

namespace sf::kvstore {

uint64_t prefix_block_key(uint64_t parent, const std::string& model_id,
                          std::span<const int32_t> block_tokens) {
  XXH64_state_t* s = XXH64_createState();
  XXH64_reset(s, 0);
  XXH64_update(s, &parent, sizeof(parent));
  // The length goes in so that (id "ab", tokens ...) and (id "a", "b"...) cannot collide.
  const uint64_t n = model_id.size();
  XXH64_update(s, &n, sizeof(n));
  XXH64_update(s, model_id.data(), model_id.size());
  XXH64_update(s, block_tokens.data(), block_tokens.size_bytes());
  const uint64_t h = XXH64_digest(s);
  XXH64_freeState(s);
  return h;
}

PrefixCache::PrefixCache(BlockPool* pool, int n_layers, int64_t budget_bytes)
    : pool_(pool), n_layers_(n_layers) {
  st_.budget_bytes = budget_bytes;
}

PrefixCache::~PrefixCache() {
  for (auto& [k, e] : map_)
    for (BlockId b : e.blocks) (void)pool_->free(b);  // cannot fail: the cache never pins at rest
}

int64_t PrefixCache::entry_bytes() const { return pool_->block_bytes() * n_layers_; }

std::vector<uint64_t> PrefixCache::match(const std::string& model_id,
                                         std::span<const int32_t> tokens,
                                         int64_t max_blocks) const {
  std::vector<uint64_t> keys;
  uint64_t parent = 0;
  const int64_t nb = std::min<int64_t>(int64_t(tokens.size()) / kPoolBlockTokens, max_blocks);
  for (int64_t b = 0; b < nb; ++b) {
    auto blk = tokens.subspan(size_t(b * kPoolBlockTokens), kPoolBlockTokens);
    const uint64_t k = prefix_block_key(parent, model_id, blk);
    auto it = map_.find(k);
    if (it == map_.end() || it->second.parent != parent || it->second.model_id != model_id ||
        !std::equal(blk.begin(), blk.end(), it->second.tokens.begin()))
      break;
    keys.push_back(k);
    parent = k;
  }
  return keys;
}

int64_t PrefixCache::lookup(const std::string& model_id, std::span<const int32_t> tokens,
                            int64_t max_tokens) {
  std::lock_guard<std::mutex> g(mu_);
  const std::vector<uint64_t> keys =
      match(model_id, tokens, std::max<int64_t>(0, max_tokens) / kPoolBlockTokens);
  ++st_.lookups;
  if (keys.empty()) {
    ++st_.misses;
    return 0;
  }
  ++st_.hits;
  st_.hit_blocks += int64_t(keys.size());
  // Leaf first: the first block ends up most recent, so chains are evicted tail first.
  for (auto it = keys.rbegin(); it != keys.rend(); ++it) {
    Entry& e = map_[*it];
    lru_.splice(lru_.begin(), lru_, e.lru);
  }
  return int64_t(keys.size()) * kPoolBlockTokens;
}

Result<std::vector<uint64_t>> PrefixCache::match_all(const std::string& model_id,
                                                     std::span<const int32_t> tokens,
                                                     int64_t n_tokens, const char* what) const {
  if (n_tokens < 0 || n_tokens % kPoolBlockTokens != 0)
    return SF_ERR(kInvalidArgument, std::string("prefix cache: ") + what + " of " +
                                        std::to_string(n_tokens) +
                                        " tokens, not a whole number of blocks");
  const int64_t nb = n_tokens / kPoolBlockTokens;
  std::vector<uint64_t> keys = match(model_id, tokens, nb);
  if (int64_t(keys.size()) < nb)
    return SF_ERR(kNotFound, "prefix cache: only " +
                                 std::to_string(keys.size() * kPoolBlockTokens) + " of the " +
                                 std::to_string(n_tokens) + " requested prefix tokens are cached");
  return keys;
}

Status PrefixCache::read(const std::string& model_id, std::span<const int32_t> tokens,
                         int64_t n_tokens, const KvRows& dst) {
  std::lock_guard<std::mutex> g(mu_);
  SF_ASSIGN(const std::vector<uint64_t> keys, match_all(model_id, tokens, n_tokens, "read"));
  const int64_t nb = int64_t(keys.size());
  const int64_t row = pool_->half_floats() / kPoolBlockTokens;  // floats per token
  for (int64_t b = 0; b < nb; ++b) {
    const Entry& e = map_.at(keys[size_t(b)]);
    for (int l = 0; l < n_layers_; ++l) {
      float* k = dst(l, false);
      float* v = dst(l, true);
      if (!k || !v) return SF_ERR(kInvalidArgument, "prefix cache: null destination rows");
      const BlockId id = e.blocks[size_t(l)];
      SF_TRY(pool_->pin(id));
      const Status st =
          pool_->read(id, k + b * kPoolBlockTokens * row, v + b * kPoolBlockTokens * row);
      SF_TRY(pool_->unpin(id));
      SF_TRY(st);
    }
  }
  return Status::ok();
}

Result<std::vector<std::vector<BlockId>>> PrefixCache::pin_blocks(
    const std::string& model_id, std::span<const int32_t> tokens, int64_t n_tokens) {
  std::lock_guard<std::mutex> g(mu_);
  SF_ASSIGN(const std::vector<uint64_t> keys, match_all(model_id, tokens, n_tokens, "pin"));
  std::vector<std::vector<BlockId>> out(static_cast<size_t>(n_layers_));
  for (uint64_t key : keys) {
    const Entry& e = map_.at(key);
    for (int l = 0; l < n_layers_; ++l) {
      const Status st = pool_->pin(e.blocks[size_t(l)]);
      if (!st.is_ok()) {
        (void)unpin_blocks(out);
        return st;
      }
      out[size_t(l)].push_back(e.blocks[size_t(l)]);
    }
  }
  return out;
}

Status PrefixCache::unpin_blocks(const std::vector<std::vector<BlockId>>& blocks) {
  Status first;
  for (const auto& layer : blocks)
    for (BlockId id : layer) {
      const Status st = pool_->unpin(id);
      if (first.is_ok() && !st.is_ok()) first = st;
    }
  return first;
}

bool PrefixCache::evict_one(size_t keep) {
  // A pinned block cannot be freed: evicting its entry would leak it (out of the map and the
  // byte count, never freed). Pins cover a prefix from its first block, so an unpinned entry
  // is never a pinned one's prefix, and skipping pinned entries keeps every chain whole.
  size_t left = lru_.size() > keep ? lru_.size() - keep : 0;
  for (auto li = lru_.end(); left > 0; --left) {
    --li;
    auto it = map_.find(*li);
    bool pinned = false;
    for (BlockId b : it->second.blocks) {
      const Result<int> p = pool_->pins(b);
      pinned = pinned || !p.is_ok() || p.value() > 0;
    }
    if (pinned) continue;
    for (BlockId b : it->second.blocks) (void)pool_->free(b);  // unpinned: cannot fail
    lru_.erase(li);
    map_.erase(it);
    ++st_.evicted_blocks;
    st_.used_bytes -= entry_bytes();
    --st_.entries;
    return true;
  }
  return false;
}

Status PrefixCache::insert(const std::string& model_id, std::span<const int32_t> tokens,
                           const KvRows& src) {
  std::lock_guard<std::mutex> g(mu_);
  const int64_t nb = int64_t(tokens.size()) / kPoolBlockTokens;
  const int64_t eb = entry_bytes();
  const int64_t row = pool_->half_floats() / kPoolBlockTokens;
  std::vector<uint64_t> chain;
  // This call's new entries (the tail of chain) and their rows, written in one batch at the end
  // (a device tier then copies once a chunk, not once a block). The lock keeps the entries
  // unseen until their rows are in.
  std::vector<uint64_t> mine;  // this call's new entries (the chain may reuse entries after one)
  std::vector<BlockId> w_ids, cur;  // cur: the entry being built, freed if it does not go in
  std::vector<const float*> w_k, w_v;
  bool placing = false;  // an entry is in the map but not yet in the LRU list
  uint64_t placing_key = 0;
  // This call's entries out again (their rows were not written), and the chain cut before the
  // first of them (what follows it no longer extends a cached prefix).
  const auto take_back = [&] {
    if (mine.empty()) return;
    chain.resize(size_t(std::find(chain.begin(), chain.end(), mine.front()) - chain.begin()));
    for (auto k = mine.rbegin(); k != mine.rend(); ++k) {
      auto it = map_.find(*k);
      lru_.erase(it->second.lru);
      for (BlockId id : it->second.blocks) (void)pool_->free(id);
      map_.erase(it);
      --st_.inserted_blocks;
      --st_.entries;
      st_.used_bytes -= eb;
    }
    mine.clear();
  };
  // Every exit, a throw's included: the chain refreshed leaf first, as lookup does, so a prefix
  // is more recent than its extensions. The loop moves its entries to the front prefix first,
  // which would leave the prefix oldest: evicted first, stranding the rest of its chain.
  const auto refresh = [&] {
    for (auto it = chain.rbegin(); it != chain.rend(); ++it)
      lru_.splice(lru_.begin(), lru_, map_.find(*it)->second.lru);
  };
  // Every return: the batch written (or, when that fails, this call's entries taken out again),
  // then the refresh.
  const auto finish = [&](Status st) -> Status {
    const Status wr = w_ids.empty() ? Status::ok() : pool_->write_batch(w_ids, w_k, w_v);
    if (!wr.is_ok()) {
      take_back();
      st = wr;
    }
    refresh();
    return st;
  };
  try {
    // Sized up front, so that adding to them below cannot throw half way through an entry.
    chain.reserve(size_t(nb));
    mine.reserve(size_t(nb));
    cur.reserve(size_t(n_layers_));
    w_ids.reserve(size_t(nb * n_layers_));
    w_k.reserve(size_t(nb * n_layers_));
    w_v.reserve(size_t(nb * n_layers_));
    uint64_t parent = 0;
    for (int64_t b = 0; b < nb; ++b) {
      auto blk = tokens.subspan(size_t(b * kPoolBlockTokens), kPoolBlockTokens);
      const uint64_t key = prefix_block_key(parent, model_id, blk);
      auto it = map_.find(key);
      if (it != map_.end()) {
        if (it->second.parent != parent || it->second.model_id != model_id ||
            !std::equal(blk.begin(), blk.end(), it->second.tokens.begin()))
          break;  // a collision holds this key: leave the rest uncached
        lru_.splice(lru_.begin(), lru_, it->second.lru);
        chain.push_back(key);
        parent = key;
        continue;
      }
      if (eb > st_.budget_bytes)
        return finish(SF_ERR(kResourceExhausted, "prefix cache: one block (" +
                                                     std::to_string(eb) +
                                                     " bytes) exceeds the budget of " +
                                                     std::to_string(st_.budget_bytes)));
      // Evict, never this request's own chain: its entries were just made most recent, so the
      // LRU tail is something else unless the budget holds only this chain.
      while (st_.used_bytes + eb > st_.budget_bytes && evict_one(chain.size())) {
      }
      if (st_.used_bytes + eb > st_.budget_bytes)
        return finish(SF_ERR(kResourceExhausted,
                             "prefix cache: budget of " + std::to_string(st_.budget_bytes) +
                                 " bytes holds " + std::to_string(chain.size()) +
                                 " blocks of this prompt" +
                                 (int64_t(lru_.size()) > int64_t(chain.size())
                                      ? " and " + std::to_string(lru_.size() - chain.size()) +
                                            " pinned by readers"
                                      : "")));
      Entry e;
      e.parent = parent;
      e.model_id = model_id;
      e.tokens.assign(blk.begin(), blk.end());
      Status st;
      for (int l = 0; l < n_layers_ && st.is_ok(); ++l) {
        const float* k = src(l, false);
        const float* v = src(l, true);
        if (!k || !v) {
          st = SF_ERR(kInvalidArgument, "prefix cache: null source rows");
          break;
        }
        Result<BlockId> id = pool_->alloc(Tier::kDevice);
        // The pool is full: give back cached blocks that are not this chain's, then retry.
        while (!id.is_ok() && id.status().code() == Code::kResourceExhausted &&
               evict_one(chain.size()))
          id = pool_->alloc(Tier::kDevice);
        if (!id.is_ok()) {
          st = id.status();
          break;
        }
        cur.push_back(*id);
        w_ids.push_back(*id);
        w_k.push_back(k + b * kPoolBlockTokens * row);
        w_v.push_back(v + b * kPoolBlockTokens * row);
      }
      if (!st.is_ok()) {
        for (BlockId id : cur) (void)pool_->free(id);
        w_ids.resize(w_ids.size() - cur.size());
        w_k.resize(w_ids.size());
        w_v.resize(w_ids.size());
        cur.clear();
        return finish(st);
      }
      e.blocks = cur;
      auto pos = map_.emplace(key, std::move(e)).first;
      cur.clear();  // the map's entry holds them now
      placing = true;
      placing_key = key;
      lru_.push_front(key);
      pos->second.lru = lru_.begin();
      placing = false;
      ++st_.inserted_blocks;
      ++st_.entries;
      st_.used_bytes += eb;
      chain.push_back(key);
      mine.push_back(key);
      parent = key;
    }
    return finish(Status::ok());
  } catch (...) {
    // An allocation failed (the map, the LRU list) or src threw: no entry may stay without its
    // rows, and no block may leak.
    for (BlockId id : cur) (void)pool_->free(id);
    if (placing) {
      auto it = map_.find(placing_key);
      for (BlockId id : it->second.blocks) (void)pool_->free(id);
      map_.erase(it);
    }
    take_back();
    refresh();
    throw;
  }
}

PrefixCacheStats PrefixCache::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  return st_;
}

}  // namespace sf::kvstore
