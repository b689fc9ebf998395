// One KV block pool shared by all layers (seed 002: PSA's unified pool; DESIGN.md "KV store and
// tiering"). A block is 64 tokens x n_kv_heads x head_dim of K followed by the same of V, fp32,
// token-major: the same layout as model::KvCache rows, so a block is a plain copy of 64 rows.
//
// Tiers, fastest first: device (CUDA builds only), pinned host, disk (one file in a directory,
// pread/pwrite). Each tier has a byte budget fixed at creation. Allocation tries the preferred
// tier and spills to the next slower one; when every tier is full the caller gets
// kResourceExhausted, never an abort. Pinned blocks are never moved or freed. Blocks move one
// tier down (demote) or up (promote) with byte counters per direction; place() applies the
// sparsity-aware policy: sink, recent window and top-scored blocks on the fast tier.
//
// Thread-safe: one mutex guards the tables and counters (copies to and from disk run under it).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace sf::kvstore {

constexpr int kPoolBlockTokens = 64;

enum class Tier : int { kDevice = 0, kHost = 1, kDisk = 2 };
constexpr int kNumTiers = 3;
const char* tier_name(Tier t);

struct BlockPoolConfig {
  int n_kv_heads = 0, head_dim = 0;
  // Byte budgets, rounded down to whole blocks; 0 disables a tier. device_bytes > 0 needs a
  // CUDA build (create() says so otherwise).
  int64_t device_bytes = 0;
  int64_t host_bytes = 0;
  int64_t disk_bytes = 0;
  std::string disk_dir;  // required when disk_bytes > 0; created if missing; holds blocks.bin
};

// Counters of one tier. Blocks that land here because a faster tier was full count in
// spilled_in; attempts refused because this tier was full count in full_refusals.
struct TierStats {
  int64_t capacity_bytes = 0, used_bytes = 0, blocks = 0;
  int64_t allocs = 0, frees = 0, spilled_in = 0, full_refusals = 0, io_errors = 0;
  int64_t demoted_out = 0, promoted_in = 0;     // blocks moved to / from the next slower tier
  int64_t bytes_down_out = 0, bytes_up_in = 0;  // bytes of those moves
  int64_t promoted_out = 0, demoted_in = 0;     // blocks moved to / from the next faster tier
  int64_t bytes_up_out = 0, bytes_down_in = 0;
};

using BlockId = int64_t;

struct PlacementResult {
  int64_t hot = 0, promoted = 0, demoted = 0, pinned_skipped = 0;
};

class TierStore;  // storage backend of one tier (block_pool.cpp, block_pool_cuda.cpp)

class BlockPool {
 public:
  static Result<std::unique_ptr<BlockPool>> create(const BlockPoolConfig& cfg);
  // Bytes of one block (K and V of kPoolBlockTokens tokens, F32) for cfg's heads and head_dim.
  static int64_t block_bytes_for(const BlockPoolConfig& cfg) {
    return int64_t(2) * kPoolBlockTokens * cfg.n_kv_heads * cfg.head_dim * 4;
  }
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  int64_t block_bytes() const { return block_bytes_; }
  int64_t block_floats() const { return block_bytes_ / int64_t(sizeof(float)); }  // K and V
  int64_t half_floats() const { return block_floats() / 2; }                      // K or V

  // A block on `preferred` or, when that tier is full, on the next slower tier that has room, down
  // to `slowest` (the device forward's blocks stop at host: a disk write would wait).
  Result<BlockId> alloc(Tier preferred = Tier::kDevice, Tier slowest = Tier::kDisk);
  // One block a preferred tier, each as alloc(preferred[i], slowest), under one lock (a caller
  // that allocates a layer's blocks then waits once behind a background mover, not once a
  // block). All or nothing: on failure nothing stays allocated and the error names the block.
  Result<std::vector<BlockId>> alloc_batch(std::span<const Tier> preferred, Tier slowest);
  Status free(BlockId id);
  // k and v: [64, n_kv_heads, head_dim] each, host memory, whatever tier the block is on.
  Status write(BlockId id, const float* k, const float* v);
  Status read(BlockId id, float* k, float* v) const;
  // write() of many blocks under one lock: block ids[i] gets k[i] and v[i] (host memory, as
  // write()). Host tiers copy on the thread pool; the device tier packs the rows into pinned
  // memory and copies a chunk at a time, waiting once a chunk instead of once a block. Every
  // block is checked before anything is written; on an I/O error some blocks may hold their new
  // rows and others not.
  Status write_batch(std::span<const BlockId> ids, std::span<const float* const> k,
                     std::span<const float* const> v);
  // Block b of ids gets rows [64 b, min(n_rows, 64 b + 64)) of k and v (device memory,
  // [n_rows, n_kv_heads, head_dim] F32 each; ids.size() blocks cover n_rows); a partial last
  // block's other rows are zeroed. Copies are queued on `stream` (a cudaStream_t), runs of
  // consecutive slots as one 2-D copy, and not waited for: the caller must let the stream pass
  // them before the blocks are read, moved or freed. Blocks must be live, unpinned, freshly
  // allocated and on the device or pinned host tier. Every block is checked before anything is
  // queued, and a copy that fails to queue waits for those queued before it, so an error leaves
  // nothing in flight. CUDA builds only (kUnsupported otherwise).
  Status write_from_device_async(std::span<const BlockId> ids, const float* k, const float* v,
                                 int64_t n_rows, void* stream);
  // The inverse: rows [0, n_rows) of k and v (device memory, [n_rows, n_kv_heads, head_dim] F32
  // each) from blocks ids (ids.size() blocks cover n_rows; a partial last block gives its first
  // rows), queued on `stream` and not waited for. Blocks must be live, on the device or host tier
  // (pinned host copies by DMA), and must not move or be freed before the stream has passed the
  // copies: pin them. Every block is checked before anything is queued. CUDA builds only.
  Status read_to_device_async(std::span<const BlockId> ids, float* k, float* v, int64_t n_rows,
                              void* stream) const;
  // Waits until `stream` (a cudaStream_t) has passed everything queued on it, such as the copies
  // above, before their blocks are freed. Ok at once without CUDA.
  static Status wait_stream(void* stream);
  Result<Tier> tier_of(BlockId id) const;

  // Refcounted: a block with pins > 0 is not moved by move()/place() and cannot be freed.
  Status pin(BlockId id);
  Status unpin(BlockId id);
  Result<int> pins(BlockId id) const;

  // Moves a block to tier `to` (any direction). Errors, leaving the block where it was: pinned,
  // destination full or disabled, I/O failure.
  Status move(BlockId id, Tier to);

  // Moves a batch to tier `to`: checks every block (live, unpinned, listed once) and the room
  // first, queues all copies (asynchronous on the device tier's copy stream) and waits once. On
  // any error no block has moved. Blocks already on `to` are left alone.
  Status move_batch(std::span<const BlockId> ids, Tier to);

  // Sparsity-aware placement of one sequence's blocks (position order) on the fast tier `fast`:
  // the first sink_blocks and last recent_blocks come first, then the rest by descending score;
  // as many as fit in the fast tier (its free room plus what these blocks already occupy) are
  // hot. Cold blocks on `fast` are demoted to the next tier, hot ones elsewhere are promoted.
  // Pinned blocks stay put. scores: one per block (e.g. the summed importance of its tokens).
  // Demotions run as one batch, then promotions as another, each sized to the room the other
  // tier has: when the slower tier is full, rounds alternate (a swap needs one free block on
  // either tier; none is kResourceExhausted). When a later batch fails (e.g. an I/O error) the
  // earlier moves stay done.
  // max_hot >= 0 caps the hot set further: a share of the fast tier when several sequences or
  // layers are placed one after another (tiered_kv.h splits it per layer).
  Result<PlacementResult> place(std::span<const BlockId> blocks, std::span<const float> scores,
                                int64_t sink_blocks, int64_t recent_blocks, Tier fast,
                                int64_t max_hot = -1);

  TierStats stats(Tier t) const;
  int64_t live_blocks() const;

 private:
  BlockPool() = default;
  struct Entry {
    int tier = -1;  // -1: free entry
    int64_t slot = -1;
    int pins = 0;
  };
  Status check_id(BlockId id) const;  // caller holds mu_
  // The device-copy entry points' common checks (caller holds mu_; CUDA builds): n_rows fills
  // ids, and each block is live and on the device or host tier (not pinned, for writes). Its
  // address, device or host, a block; `what` names the call in errors.
  Result<std::vector<char*>> device_copy_targets(std::span<const BlockId> ids, int64_t n_rows,
                                                 bool writing, const char* what) const;
  Result<BlockId> alloc_locked(int preferred, int slowest);
  Status free_locked(BlockId id);
  Status move_locked(BlockId id, int to);
  Status move_batch_locked(std::span<const BlockId> ids, int to);
  void count_move(int from, int to);
  int64_t free_slots(int t) const;

  mutable std::mutex mu_;
  BlockPoolConfig cfg_;
  int64_t block_bytes_ = 0;
  std::array<std::unique_ptr<TierStore>, kNumTiers> store_;
  mutable std::array<TierStats, kNumTiers> st_{};  // mutable: read() counts io_errors
  std::array<std::vector<int64_t>, kNumTiers> free_slots_;
  std::vector<Entry> entries_;
  std::vector<BlockId> free_ids_;
  mutable std::vector<float> staging_;  // one block: disk reads/writes and disk<->device moves
};

// The order place() ranks one sequence's blocks in: the first sink_blocks and the last
// recent_blocks, then the rest by descending score (ties: earlier position first).
std::vector<int64_t> placement_order(std::span<const float> scores, int64_t sink_blocks,
                                     int64_t recent_blocks);

// Storage of one tier: a fixed number of block slots. Implementations: host (aligned, or
// cudaHostAlloc'd in CUDA builds), disk (file), device (CUDA builds only).
class TierStore {
 public:
  virtual ~TierStore() = default;
  virtual Status write(int64_t slot, const void* src, int64_t bytes) = 0;
  virtual Status read(int64_t slot, void* dst, int64_t bytes) const = 0;
  // Host-addressable memory of a slot (host tiers), else null. Moves to or from such a slot copy
  // straight into or out of it: a device<->pinned-host move is one DMA, with no staging copy.
  virtual char* host_ptr(int64_t /*slot*/) const { return nullptr; }
  // Device memory of a slot (the device tier), else null.
  virtual char* device_ptr(int64_t /*slot*/) const { return nullptr; }
  // Copies that may complete later (the device tier queues them on its copy stream); sync()
  // waits for all of them and reports the first failure. Other tiers copy at once.
  virtual Status read_async(int64_t slot, void* dst, int64_t bytes) {
    return read(slot, dst, bytes);
  }
  virtual Status write_async(int64_t slot, const void* src, int64_t bytes) {
    return write(slot, src, bytes);
  }
  virtual Status sync() { return Status::ok(); }
  // Slot slots[i] gets k[i] then v[i] (half_bytes each, host memory). The default packs each
  // block into `scratch` (block-sized) and write()s it; the device tier batches its copies.
  virtual Status write_blocks(std::span<const int64_t> slots, std::span<const float* const> k,
                              std::span<const float* const> v, int64_t half_bytes,
                              std::vector<float>* scratch);
};

// Device and pinned-host stores. CUDA builds take them from block_pool_cuda.cpp (cudaMalloc,
// cudaHostAlloc); other builds from block_pool.cpp: no device tier (kUnsupported) and plain
// page-aligned host memory.
Result<std::unique_ptr<TierStore>> make_device_store(int64_t slots, int64_t block_bytes);
Result<std::unique_ptr<TierStore>> make_host_store(int64_t slots, int64_t block_bytes);
// The host store over an arena of slots either build allocated; release frees it (std::free or
// cudaFreeHost).
std::unique_ptr<TierStore> make_host_arena_store(void* arena, int64_t block_bytes,
                                                 void (*release)(void*));
// Page-aligned pageable host memory: the host tier of CPU builds, and of CUDA builds on a machine
// without a usable device (pinning needs a driver; the tier works the same without it).
Result<std::unique_ptr<TierStore>> make_pageable_host_store(int64_t slots, int64_t block_bytes);

}  // namespace sf::kvstore
