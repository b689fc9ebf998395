// Typed launchers of the device index estimators (sparse_estimate.cu). Plain structs only: this
// header is read by nvcc (C++17 or 20) and by the host plan (sparse_estimate.cpp, C++20), which
// fills EstimateLaunch from the per-head patterns. Every pointer is device memory owned by the
// plan's workspace; nothing here allocates or synchronizes, so the sequence is capturable.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/hash.h"  // SF_HOST_DEVICE

namespace sf::kernels::cuda {

// Per query head, what the slot builder and the selectors need (pattern codes: EstKind).
enum EstKind : int32_t { kEstWindow = 0, kEstVS = 1, kEstBlock = 2 };
struct EstHead {
  int32_t kind = kEstWindow;
  int32_t vs_slot = -1;   // row in the vertical-slash score / selection arrays
  int32_t blk_slot = -1;  // row in the block-family arrays
  int32_t mass = 0;       // 1: adaptive (mass threshold), 0: top-k
  int64_t sink = 0, local = 0;
  int64_t k_cols = 0, k_diags = 0, k_blocks = 0;  // top-k budgets (forced included)
  double gamma = 1.0;
  int64_t min_count = 0, max_count = 0;  // adaptive clamp (items: columns / diagonals / blocks)
  int64_t tail_block_min = 0;            // HeadPattern::tail_block_min
  int32_t cover = 0;                     // HeadPattern::vs_cover (an adaptive-vs head)
};

struct EstimateLaunch {
  // Geometry.
  int64_t nq = 0, nk = 0, hq = 0, hkv = 0, d = 0, q_offset = 0, n_qb = 0, n_kb = 0;
  int64_t kend_last = 0, n_diag = 0;
  float scale = 1.f;
  bool bf16 = false;  // q, k element type: false F32, true BF16
  bool pair_heads = false;  // SparseIndexDevice::pair_heads
  const void* q = nullptr;
  const void* k = nullptr;
  // Heads.
  const EstHead* heads = nullptr;  // [hq]
  int n_vs = 0, n_blk = 0;
  const int32_t* vs_heads = nullptr;   // [n_vs] query head of each vs slot
  const int32_t* blk_heads = nullptr;  // [n_blk]
  // Scoring rows (contiguous local rows r0 .. r0 + L - 1): vertical-slash, block last q block.
  int64_t vs_r0 = 0, vs_L = 0, blk_r0 = 0, blk_L = 0;
  int64_t n_chunks = 0;  // 64-key chunks of [0, kend_last)
  // Workspace.
  float* part_m = nullptr;  // [max(n_vs, n_blk) * 64 * n_chunks]
  float* part_l = nullptr;
  float* lse = nullptr;           // [max(n_vs, n_blk) * 64]
  float* part_d = nullptr;        // [n_vs * n_chunks * 127]
  float* col = nullptr;           // [n_vs * kend_last]
  float* diag = nullptr;          // [n_vs * n_diag]
  float* mass = nullptr;          // [n_blk * n_kb] exact mass of the last query block
  // Pooled k, bf16 bits (the estimators round the f32 means to bf16), channels zero-padded to
  // d_pad = d rounded up to 32 (sparse_estimate_pool_d), per KV head in mma B-fragment order
  // (sparse_estimate.cu kfrag_index), key blocks zero-padded to a multiple of 8. The block
  // selector pools q itself.
  uint16_t* pooled_k = nullptr;
  int32_t* sel_cols = nullptr;    // [n_vs * kend_last]
  int32_t* n_sel_cols = nullptr;  // [n_vs]
  int32_t* sel_diags = nullptr;   // [n_vs * n_diag]
  int32_t* n_sel_diags = nullptr;
  int32_t* run_lo = nullptr;    // [n_vs * n_diag] runs of selected diagonals with gaps <= 64:
  int32_t* run_hi = nullptr;    // one contiguous key range per run for every full query block
  int32_t* n_runs = nullptr;    // [n_vs]
  // vs_cover heads: the last n_cov vs slots (n_vs - n_cov ..), scored on their own rows (the
  // scoring rows with spread rows, sparse_select.h scoring_rows), whose softmax they keep, then
  // selected in rounds (sparse_select.h vs_cover_select). n_cx = kend_last + n_diag: one joint
  // item list, columns then diagonals.
  int n_cov = 0;
  int64_t cov_rows = 0;
  const int32_t* cov_heads = nullptr;  // [n_cov] query head
  const int64_t* cov_local = nullptr;  // [cov_rows] local q rows, ascending
  const int64_t* cov_pos = nullptr;    // [cov_rows] their absolute positions
  void* cov_q = nullptr;               // [cov_rows, hq, d] those rows of q (q's type)
  // The scoring rows' softmax, 0 past causal: [n_cov][n_chunks][cov_rows][64], a tile of every
  // row for each 64-key chunk, so what a CTA writes at once (a chunk's 64 rows of a head, 16 KB)
  // and what a column's sums read (a key over all rows) lie within a few pages: row-major over 1M
  // keys, each row 4 MB from the next, the writes ran at about 0.75 TB/s (bench/NOTES.md
  // sixty-fourth session).
  float* cov_p = nullptr;
  double* cov_resd = nullptr;          // [n_cov * n_cx] residuals, kept up to date by updates
  float* cov_res = nullptr;            // [n_cov * n_cx] a round's residuals, ranked (scratch after)
  double* cov_sum = nullptr;           // [n_cov * 2] total (plain column sums), uncovered
  // A round's threshold search over the residuals' float keys (order_key), 11 + 11 + 10 bits:
  // per head three histograms of kCoverBins (count, mass) and the walk's state.
  uint32_t* cov_hcnt = nullptr;        // [n_cov * 3 * kCoverBins]
  double* cov_hmass = nullptr;         // [n_cov * 3 * kCoverBins]
  double* cov_walkd = nullptr;         // [n_cov * 2] target, mass above the bucket
  int64_t* cov_walki = nullptr;        // [n_cov * 8] see sparse_estimate.cu CoverWalk
  int32_t* cov_round = nullptr;        // [n_cov * n_cx] -1 not taken, 0 forced, k round k
  uint8_t* cov_free = nullptr;         // [n_cov * n_diag] 1: a diagonal taken free
  int32_t* cov_list = nullptr;         // [n_cov * n_cx] a round's picks and free diagonals
  int32_t* cov_n_list = nullptr;       // [n_cov]
  int32_t* cov_state = nullptr;        // [n_cov * 2] done, rounds that took items
  int cov_max_rounds = 0;              // sparse_select.h kVsCoverRounds
  double cov_finish = 0;               // sparse_select.h kVsCoverFinish
  int32_t* sel_kb = nullptr;    // [n_blk * n_qb * cap_kb]
  int32_t* n_sel_kb = nullptr;  // [n_blk * n_qb]
  int64_t cap_kb = 0;
  int block_select_group = 1;  // query blocks per CTA in the block selector
  int block_select_cta = 0;    // 1: the CTA runs each selection in turn (else a warp each)
  // 1: top-k block heads take the streaming selector (kBlockStreamRows query blocks a CTA, scores
  // in chunks of block_stream_chunk key blocks, an exact running top-k a row); the block selector
  // then runs the mass-threshold heads alone, and only when there are some.
  int block_stream = 0;
  int block_stream_chunk = 2048;  // a multiple of 8
  int block_mass_heads = 0;       // block-family heads with a mass threshold (adaptive-block)
  // Output (the unified index, SparseIndexDevice layout) and its sizing record.
  int32_t* block_count = nullptr;
  int32_t* block_offset = nullptr;
  int32_t* column_count = nullptr;
  int32_t* column_index = nullptr;
  int max_blocks = 0, max_cols = 0;
  int32_t* need = nullptr;  // [2]: the largest block and column counts any slot needed
  // Bit 0 scoring and the k pooling, 1 selection (the selector pools q), 2 slot building (timing
  // breakdowns).
  int stages = 7;
};

constexpr int kCoverBins = 2048;

// The pooled arrays' padded head dim (a multiple of 32) and key-block count (a multiple of 8).
SF_HOST_DEVICE inline int64_t sparse_estimate_pool_d(int64_t d) { return (d + 31) / 32 * 32; }
SF_HOST_DEVICE inline int64_t sparse_estimate_pool_kb(int64_t n_kb) { return (n_kb + 7) / 8 * 8; }

// Plan step: the kernels' shared-memory opt-ins for this geometry (not a stream operation; kept
// out of the run step so that nothing but launches and a memset happens under capture).
cudaError_t sparse_estimate_configure(const EstimateLaunch& p);
// The whole run step in stream order: scoring, selection, pooling, slot building.
cudaError_t sparse_estimate_launch(const EstimateLaunch& p, cudaStream_t s);
// Dynamic shared memory the block selector needs for a group of query blocks, and the most it
// may take (Hopper's 227 KB per block less the selector's static per-warp state).
size_t sparse_estimate_block_smem(int64_t n_kb, int64_t d, int group);
size_t sparse_estimate_block_smem_limit();
// Query blocks per block-selector CTA for this geometry: the most (<= 8) whose scores fit the
// limit; 0 when not even one does.
int sparse_estimate_block_group(int64_t n_kb, int64_t d);
// The streaming block selector (block_stream): query blocks a CTA scores (a warp each, the
// mma's first 8 rows), the largest top-k it takes (its candidate buffer holds twice that), and
// its dynamic shared memory.
constexpr int kBlockStreamRows = 8;
constexpr int kBlockStreamMaxTake = 128;
size_t sparse_estimate_stream_smem(int64_t d, int chunk);
// Whether a CTA of this group size selects with all its threads, one query block at a time (when
// at most half its warps would have a query block of their own).
bool sparse_estimate_block_cta(int group);

// A device index (SparseIndexDevice layout) whose computed (query, key) pairs under the causal
// mask are added to *pairs, as SparseIndex::pairs counts them: the numerator of its density.
struct IndexPairsArgs {
  const int32_t* block_count;
  const int32_t* block_offset;
  const int32_t* column_count;
  const int32_t* column_index;
  int n_heads;
  int64_t n_q, n_k, q_offset, n_qblocks;
  int max_blocks, max_cols;
  unsigned long long* pairs;
};
cudaError_t sparse_index_pairs_launch(const IndexPairsArgs& a, cudaStream_t s);

}  // namespace sf::kernels::cuda
