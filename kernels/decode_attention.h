// Paged decode attention on the device (DESIGN.md "progressive decode attention"): one new token
// per query head over a KV block pool, in full or PSA order, and the append that grows the pool
// by one token per KV head. The host reference is decode/decode_attention.cpp (the same rules on
// decode::PagedKvCache); these are its CUDA counterparts for a decode node with a GPU.
//
// Pool layout (all device memory): block b holds up to kDecodeBlockTokens keys and values,
// k/v [n_blocks, kDecodeBlockTokens, head_dim] in the pool's element type, their per-channel
// min/max kmin/kmax [n_blocks, head_dim] (F32) and its fill count fill[n_blocks]. A KV head's
// blocks, in position order, are pages[head * max_pages + i] for i < n_pages[head]; pages past
// n_pages are reserved blocks the append opens in turn (no host involvement, so a decode step can
// be captured in a graph).
//
// Element types: F32; BF16; INT8, the KIVI layout of kvstore/kv_quant.h (one rule on host and
// device): keys as codes per channel over each block (F16 scale and zero per block and channel),
// values per token (F16 scale and zero per row), x ~= zero + code * scale. An INT8 pool also
// keeps the F32 keys of each head's last block (kopen): an append changes that block's channel
// ranges, so it re-encodes the block from them, and the codes are always those of kv_encode on
// the block's F32 keys.
#pragma once
#include <cstdint>

#include "common/status.h"
#include "kernels/api.h"

namespace sf::kernels {

inline constexpr int kDecodeBlockTokens = 64;
// Blocks per KV head the PSA ranking sorts in shared memory (256K tokens).
inline constexpr int kDecodeMaxPages = 4096;
inline constexpr int kPsaRecentBlocks = 4;  // psa-avg: ranked blocks the unseen mass is averaged on
inline constexpr int kDecodePsaGqaMaxGroup = 32;  // psa "+gqa": query heads per KV head (a lane each)

enum class PoolDType : uint8_t { kF32 = 0, kBF16, kInt8 };

struct PagedKv {
  PoolDType dtype = PoolDType::kF32;
  void *k = nullptr, *v = nullptr;  // elements of dtype (INT8: codes)
  float *kmin = nullptr, *kmax = nullptr;
  uint16_t *kscale = nullptr, *kzero = nullptr;  // INT8: F16 bits [n_blocks, head_dim]
  uint16_t *vscale = nullptr, *vzero = nullptr;  // INT8: F16 bits [n_blocks, kDecodeBlockTokens]
  float* kopen = nullptr;  // INT8: [n_kv_heads, kDecodeBlockTokens, head_dim], last block's keys
  int32_t *fill = nullptr, *pages = nullptr, *n_pages = nullptr;
  int n_kv_heads = 0, head_dim = 0, max_pages = 0;
};

struct PagedDecodeParams {
  bool psa = false;
  double eps = 0.95;
  bool pin_sink_recent = true;  // psa: sink and newest block first, not ranked
  bool recent_mean = false;     // psa: unseen mass from the last kPsaRecentBlocks, not AS_min
  float scale = 0.f;            // 0: 1/sqrt(head_dim)
  // full mode, INT8 pools, 2+ query heads per KV head: a warp scores a block for all of its KV
  // head's query heads (up to 4 a pass), so the block's codes are loaded and converted once a
  // pass instead of once per query head. false: a warp per query head (as F32, BF16 and psa).
  bool share_kv_heads = true;
  // full mode, one token, head_dim 64 or 128, up to 8 query heads per KV head over F32 and BF16
  // pools, 2 to 12 over INT8: a CTA streams a KV head's blocks into shared memory by bulk copies
  // (TMA), ahead of the warps that read them there for its query heads (INT8: a warp converts a
  // block's codes once for up to 4 heads). false: a warp per query head loading its own rows, or
  // over INT8 the shared-codes kernel (share_kv_heads) (A/B timing).
  bool full_staged = true;
  // INT8 pools stage only from this many blocks (KV heads x max_pages) on, below which the
  // shared-codes kernel is faster; -1: kDecodeStagedInt8MinBlocks, 0: always (tests reach the
  // staged kernel on small caches with it).
  // Decided by the pool's capacity, at plan time, like every other choice of kernel here.
  int64_t staged_int8_min_blocks = -1;
  // psa: the host's "+gqa" visit, one per KV head: the query heads of a KV head take turns
  // naming blocks, every head folds every loaded block, so a block is read once for the group.
  // Up to kDecodePsaGqaMaxGroup query heads per KV head.
  bool psa_share_kv_head = false;
  // Full mode: tokens attended at once, a verification pass's (decode::decode_attention_causal).
  // q and out are [n_tokens, n_heads, head_dim]; every token's K/V is already in the pool, and
  // token i does not see the newest n_tokens - 1 - i keys of each KV head. A block is staged in
  // shared memory once for 32 rows (a KV head's tokens x query heads), not read per row, and
  // the CTAs that stage the same blocks run side by side. psa takes 1 only. It needs what every
  // producer of a pool here gives (decode::PagedKvCache, DevicePagedPool, paged_append): each
  // block of a KV head but its last is full (keys are numbered 64 b + slot), and each KV head
  // holds at least n_tokens keys (the device cannot check it; a row with none comes out 0).
  int n_tokens = 1;
};

inline constexpr int kDecodeMaxTokens = 256;  // n_tokens, at most

// INT8 pools take the staged kernel from this many blocks (KV heads x max_pages) on: below it
// the shared-codes kernel is faster. On H100, timed alone, the staged kernel has a floor of about
// 21 us at head_dim 64 and 33 us at 128 where the shared-codes kernel takes 13-21 us; in two runs
// the shared-codes kernel won up to 1,024 blocks (16K x 3 KV heads at d 64, 8K x 8 at d 128) and
// the staged one from 1,152 on (24K x 3, 12K x 8): bench/results/decode-int8-threshold-h100-
// 054028c.jsonl and decode-int8-sweep-h100-83eaa9b.jsonl (bench/NOTES.md).
inline constexpr int64_t kDecodeStagedInt8MinBlocks = 1152;

// Device memory the mode in p needs (full: its split partials, per token with p.n_tokens; psa:
// the bounds, visit order, walk state and one round's block results per query head, about
// 0.5 MB a head at 2,048 pages and head_dim 128; psa +gqa: results for every block a KV head's
// query heads may name in a round, scored for each of them, about 1.1 MB a query head there): a
// plan step, fixed by the mode, n_tokens, n_heads, the KV heads, head_dim, max_pages and the
// device's SM count. 0 without CUDA.
size_t paged_decode_workspace_bytes(int n_heads, const PagedKv& kv, const PagedDecodeParams& p);

// Whether full mode over kv runs the staged kernel on the current device
// (PagedDecodeParams::full_staged; one token, head_dim 64 or 128, the group sizes named there,
// and the kernel fits the device): a plan step, for tests and benchmarks. false without CUDA.
bool paged_decode_staged(int n_heads, const PagedKv& kv, const PagedDecodeParams& p);

// q: [n_heads, head_dim] F32 (rotated); out: [n_heads, head_dim] F32 (both [p.n_tokens, ...]
// with several tokens); visited: [n_heads] int32 blocks visited per query head (+gqa: blocks its
// KV head loaded; may be null; must be null with several tokens); workspace:
// paged_decode_workspace_bytes(n_heads, kv, p) of device
// memory. Query head h reads KV head h / (n_heads / n_kv_heads). Device only, head_dim 32, 64 or
// 128 (BF16 and INT8 pools: 64 or 128): anything else gets kUnsupported (the host path is
// decode::decode_attention).
Status paged_decode_attention(const float* q, int n_heads, const PagedKv& kv,
                              const PagedDecodeParams& p, float* out, int32_t* visited,
                              void* workspace, size_t workspace_bytes, Stream s);

// Appends n_tokens (1..kDecodeMaxTokens) tokens per KV head, in order: k_new, v_new [n_tokens,
// n_kv_heads, head_dim] F32; the pool is as n_tokens one-token calls leave it. Fills each
// head's last block, opening its next reserved page when the block is full; keeps kmin/kmax
// exact (and, INT8, re-encodes the block's keys with its new channel ranges and encodes the
// value row). A value F16 cannot hold gives an infinite or NaN group: the device cannot report
// it. The caller reserves the pages (decode::DevicePagedPool::upload) and never appends past
// them: the device cannot report it, and such a token would be dropped.
Status paged_append(const PagedKv& kv, const float* k_new, const float* v_new, Stream s,
                    int n_tokens = 1);

// Undoing appends (a verification pass takes back rejected drafts): paged_snapshot saves what
// appends change in each KV head of kv (its block count, and of its last block the fill, key
// min/max and, INT8, key codes, scales and zeros and the head's kopen); paged_restore puts it
// back, so the pool is as it was at the snapshot whatever was appended since. Device memory of
// paged_snapshot_bytes(kv), 16-byte aligned. kv may span several layers (one view of a whole
// pool: decode::DevicePagedPool::all()).
size_t paged_snapshot_bytes(const PagedKv& kv);
Status paged_snapshot(const PagedKv& kv, void* snap, size_t snap_bytes, Stream s);
Status paged_restore(const PagedKv& kv, const void* snap, size_t snap_bytes, Stream s);

}  // namespace sf::kernels
