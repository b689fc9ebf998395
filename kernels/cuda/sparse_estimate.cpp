// Host side of the device estimators: per-head parameters (the CPU estimator's budget and clamp
// rules, kernels/cpu/sparse_estimators.cpp), workspace carving, the run step and the
// backend-neutral wrapper that returns a host index.
#include "kernels/cuda/sparse_estimate.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "common/timing.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/sparse_select.h"

namespace sf::kernels::cuda {
namespace {

constexpr int64_t kB = kSparseBlock;
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Sequential carving of one allocation, 256-byte aligned pieces.
struct Carver {
  size_t off = 0;
  char* base = nullptr;
  template <typename T>
  T* take(size_t n) {
    off = (off + 255) / 256 * 256;
    T* p = base ? reinterpret_cast<T*>(base + off) : nullptr;
    off += n * sizeof(T);
    return p;
  }
};

}  // namespace

Status sparse_estimate_plan(const TensorView& q, const TensorView& k,
                            const std::vector<HeadPattern>& patterns, int64_t q_offset,
                            int max_blocks, int max_cols, SparseEstimatePlan* plan,
                            const EstimateMemory* mem) {
  if (!(q.dtype == k.dtype && (q.dtype == DType::kF32 || q.dtype == DType::kBF16) &&
        q.contiguous() && k.contiguous() && q.ndim == 3 && k.ndim == 3))
    return SF_ERR(kInvalidArgument,
                  "sparse_estimate (CUDA): q and k must be contiguous 3-D, both F32 or both BF16");
  EstimateLaunch& L = plan->launch;
  L = EstimateLaunch{};
  L.nq = q.shape[0];
  L.hq = q.shape[1];
  L.d = q.shape[2];
  L.nk = k.shape[0];
  L.hkv = k.shape[1];
  if (L.d % 4 != 0 || L.d > 256)
    return SF_ERR(kUnsupported, "sparse_estimate (CUDA): head_dim must be a multiple of 4, <= 256");
  L.q_offset = q_offset;
  L.n_qb = ceil_div(L.nq, kB);
  L.n_kb = ceil_div(L.nk, kB);
  L.kend_last = std::clamp<int64_t>(q_offset + L.nq, 0, L.nk);
  L.n_diag = q_offset + L.nq;
  L.n_chunks = ceil_div(L.kend_last, kB);
  L.scale = 1.f / std::sqrt(float(L.d));
  L.bf16 = q.dtype == DType::kBF16;

  // Block-sparse top-k on every head with one budget: paired heads hold equally many blocks.
  L.pair_heads = std::all_of(patterns.begin(), patterns.end(), [&](const HeadPattern& hp) {
    const HeadPattern& h0 = patterns.front();
    return hp.pattern == Pattern::kBlockSparse && hp.n_blocks == h0.n_blocks &&
           hp.sink == h0.sink && hp.local == h0.local;
  });
  std::vector<EstHead> heads(size_t(L.hq));
  std::vector<int32_t> vs_heads, blk_heads, cov_heads;
  int64_t clamped = 0, kb_cap = 3;
  bool any_adaptive_block = false;
  for (int64_t h = 0; h < L.hq; ++h) {
    const HeadPattern& hp = patterns[size_t(h)];
    EstHead& e = heads[size_t(h)];
    if (hp.share_group != 0)
      return SF_ERR(kUnsupported, "sparse_estimate (CUDA): patterns[" + std::to_string(h) +
                                      "].share_group is not implemented on the device");
    e.sink = hp.sink;
    e.local = hp.local;
    e.tail_block_min = hp.tail_block_min;
    bool cl = false;
    switch (hp.pattern) {
      case Pattern::kDense:
        e.local = q_offset + L.nq;
        break;
      case Pattern::kAShape:
        cl = hp.sink + hp.local > L.nk;
        break;
      case Pattern::kMoA: {
        const double span = hp.alpha + hp.beta * double(L.nk);
        cl = span > double(L.nk);
        e.local = std::clamp<int64_t>(std::llround(span), 0, L.nk);
        break;
      }
      case Pattern::kVerticalSlash:
      case Pattern::kAdaptiveVS:
        if (hp.spread_rows != 0 && hp.vs_cover == 0)
          return SF_ERR(kUnsupported, "sparse_estimate (CUDA): patterns[" + std::to_string(h) +
                                          "].spread_rows > 0 is not implemented on the device "
                                          "(except with vs_cover)");
        if (hp.segment_rows != 0)
          return SF_ERR(kUnsupported, "sparse_estimate (CUDA): patterns[" + std::to_string(h) +
                                          "].segment_rows > 0 is not implemented on the device");
        e.kind = kEstVS;
        if (hp.vs_cover != 0) {
          // One row set for every cover head; the rounds take no family cap.
          if (!cov_heads.empty() && patterns[size_t(cov_heads[0])].spread_rows != hp.spread_rows)
            return SF_ERR(kUnsupported,
                          "sparse_estimate (CUDA): vs_cover heads with different "
                          "spread_rows are not implemented on the device");
          if (hp.max_budget < std::max(L.kend_last, L.n_diag))
            return SF_ERR(kUnsupported,
                          "sparse_estimate (CUDA): patterns[" + std::to_string(h) +
                              "].vs_cover with max_budget below the key or diagonal count is not "
                              "implemented on the device");
          e.cover = 1;
          cov_heads.push_back(int32_t(h));
        } else {
          e.vs_slot = int32_t(vs_heads.size());
          vs_heads.push_back(int32_t(h));
        }
        if (hp.pattern == Pattern::kVerticalSlash) {
          e.k_cols = std::min(hp.n_vertical, L.kend_last);
          e.k_diags = std::min(hp.n_slash, L.n_diag);
          cl = hp.n_vertical > L.kend_last || hp.n_slash > L.n_diag;
        } else {
          e.mass = 1;
          e.gamma = hp.gamma;
          e.min_count = hp.min_budget;
          e.max_count = hp.max_budget;
          cl = hp.min_budget > L.kend_last || hp.min_budget > L.n_diag;
        }
        break;
      case Pattern::kBlockSparse:
      case Pattern::kAdaptiveBlock:
        if (hp.last_block_rows != 0)
          return SF_ERR(kUnsupported, "sparse_estimate (CUDA): patterns[" + std::to_string(h) +
                                          "].last_block_rows is not implemented on the device");
        e.kind = kEstBlock;
        e.blk_slot = int32_t(blk_heads.size());
        blk_heads.push_back(int32_t(h));
        if (hp.pattern == Pattern::kBlockSparse) {
          e.k_blocks = hp.n_blocks;
          kb_cap = std::max(kb_cap, hp.n_blocks);
          cl = hp.n_blocks > L.n_kb;
        } else {
          e.mass = 1;
          e.gamma = hp.gamma;
          e.min_count = ceil_div(hp.min_budget, kB);
          e.max_count = ceil_div(hp.max_budget, kB);
          any_adaptive_block = true;
          cl = ceil_div(hp.min_budget, kB) > L.n_kb;
        }
        break;
    }
    clamped += cl ? 1 : 0;
  }
  plan->clamped_heads = clamped;
  // Cover heads take the last vs slots, so the plain scoring pass runs over a prefix.
  for (int32_t h : cov_heads) {
    heads[size_t(h)].vs_slot = int32_t(vs_heads.size());
    vs_heads.push_back(h);
  }
  L.n_cov = int(cov_heads.size());
  std::vector<int64_t> cov_local, cov_pos;
  if (L.n_cov > 0) cov_local = scoring_rows(L.nq, patterns[size_t(cov_heads[0])].spread_rows);
  for (int64_t r : cov_local) cov_pos.push_back(q_offset + r);
  L.cov_rows = int64_t(cov_local.size());
  L.cov_max_rounds = kVsCoverRounds;
  L.cov_finish = kVsCoverFinish;
  L.n_vs = int(vs_heads.size());
  L.n_blk = int(blk_heads.size());
  L.vs_L = std::min<int64_t>(kB, L.nq);
  L.vs_r0 = L.nq - L.vs_L;
  L.blk_r0 = L.n_qb > 0 ? (L.n_qb - 1) * kB : 0;
  L.blk_L = L.nq - L.blk_r0;
  L.cap_kb = any_adaptive_block ? L.n_kb : std::min(L.n_kb, kb_cap);
  L.block_select_group = sparse_estimate_block_group(L.n_kb, L.d);
  // Top-k block heads stream where fewer than kBlockStreamRows query blocks' whole score rows
  // fit (long prompts: 3 at 1M), so each CTA streams the pooled keys for 8 rows instead of 3.
  int64_t max_take = 0;
  L.block_mass_heads = 0;
  for (int32_t h : blk_heads) {
    if (patterns[size_t(h)].pattern == Pattern::kAdaptiveBlock)
      ++L.block_mass_heads;
    else
      max_take = std::max(max_take, patterns[size_t(h)].n_blocks);
  }
  L.block_stream = L.n_blk > L.block_mass_heads && L.block_select_group < kBlockStreamRows &&
                   max_take <= kBlockStreamMaxTake;
  const bool whole_rows = L.block_mass_heads > 0 || (L.n_blk > 0 && !L.block_stream);
  if (whole_rows && L.block_select_group == 0)
    return SF_ERR(kUnsupported, "sparse_estimate (CUDA): " + std::to_string(L.n_kb) +
                                    " key blocks do not fit the block selector's shared memory");
  if (L.block_select_group == 0) L.block_select_group = 1;
  L.block_select_cta = sparse_estimate_block_cta(L.block_select_group) ? 1 : 0;
  SF_CUDA_TRY(sparse_estimate_configure(L));

  const size_t nv = size_t(L.n_vs), nb = size_t(L.n_blk), nch = size_t(L.n_chunks);
  const size_t nsc = std::max(nv, nb);
  auto carve_tables = [&](Carver& c) {
    L.heads = c.take<EstHead>(size_t(L.hq));
    L.vs_heads = c.take<int32_t>(nv);
    L.blk_heads = c.take<int32_t>(nb);
    L.need = c.take<int32_t>(2);
    L.cov_heads = c.take<int32_t>(size_t(L.n_cov));
    L.cov_local = c.take<int64_t>(size_t(L.cov_rows));
    L.cov_pos = c.take<int64_t>(size_t(L.cov_rows));
  };
  auto carve = [&](Carver& c) {
    L.part_m = c.take<float>(nsc * kB * nch);
    L.part_l = c.take<float>(nsc * kB * nch);
    L.lse = c.take<float>(nsc * kB);
    L.part_d = c.take<float>(nv * nch * (2 * kB - 1));
    L.col = c.take<float>(nv * size_t(L.kend_last));
    L.diag = c.take<float>(nv * size_t(L.n_diag));
    L.mass = c.take<float>(nb * size_t(L.n_kb));
    const size_t dp = size_t(sparse_estimate_pool_d(L.d));
    L.pooled_k = c.take<uint16_t>(nb ? size_t(L.hkv * sparse_estimate_pool_kb(L.n_kb)) * dp : 0);
    L.sel_cols = c.take<int32_t>(nv * size_t(L.kend_last));
    L.n_sel_cols = c.take<int32_t>(nv);
    L.sel_diags = c.take<int32_t>(nv * size_t(L.n_diag));
    L.n_sel_diags = c.take<int32_t>(nv);
    L.run_lo = c.take<int32_t>(nv * size_t(L.n_diag));
    L.run_hi = c.take<int32_t>(nv * size_t(L.n_diag));
    L.n_runs = c.take<int32_t>(nv);
    const size_t ncov = size_t(L.n_cov), ncx = size_t(L.kend_last + L.n_diag);
    L.cov_q = c.take<char>(ncov ? size_t(L.cov_rows * L.hq * L.d) * (L.bf16 ? 2 : 4) : 0);
    L.cov_p = c.take<float>(ncov * size_t(L.n_chunks) * size_t(L.cov_rows) * kB);
    L.cov_resd = c.take<double>(ncov * ncx);
    L.cov_res = c.take<float>(ncov * ncx);
    L.cov_sum = c.take<double>(ncov * 2);
    L.cov_hcnt = c.take<uint32_t>(ncov * 3 * kCoverBins);
    L.cov_hmass = c.take<double>(ncov * 3 * kCoverBins);
    L.cov_walkd = c.take<double>(ncov * 2);
    L.cov_walki = c.take<int64_t>(ncov * 8);
    L.cov_round = c.take<int32_t>(ncov * ncx);
    L.cov_free = c.take<uint8_t>(ncov * size_t(L.n_diag));
    L.cov_list = c.take<int32_t>(ncov * ncx);
    L.cov_n_list = c.take<int32_t>(ncov);
    L.cov_state = c.take<int32_t>(ncov * 2);
    L.sel_kb = c.take<int32_t>(nb * size_t(L.n_qb) * size_t(L.cap_kb));
    L.n_sel_kb = c.take<int32_t>(nb * size_t(L.n_qb));
  };
  // The index: every key block of the last query block bounds any slot's block entries.
  const int64_t block_bound = std::max<int64_t>(1, ceil_div(L.kend_last, kB));
  L.max_blocks = int(max_blocks > 0 ? max_blocks : block_bound);
  L.max_cols = int(max_cols > 0 ? max_cols : std::clamp<int64_t>(L.kend_last, 1, 4096));
  const size_t slots = size_t(L.hq) * size_t(L.n_qb);
  auto carve_index = [&](Carver& c) {
    L.block_count = c.take<int32_t>(slots);
    L.column_count = c.take<int32_t>(slots);
    L.block_offset = c.take<int32_t>(slots * size_t(L.max_blocks));
    L.column_index = c.take<int32_t>(slots * size_t(L.max_cols));
  };
  Carver sizing, ic, tc;
  carve(sizing);
  carve_index(ic);
  carve_tables(tc);
  plan->workspace_bytes = sizing.off;
  plan->index_bytes = ic.off;
  if (mem && mem->size_only) return Status::ok();
  if (mem) {
    SF_ENSURE(mem->workspace_bytes >= sizing.off && mem->index_bytes >= ic.off, kOutOfRange,
              "sparse_estimate_plan: lent memory (" + std::to_string(mem->workspace_bytes) + " + " +
                  std::to_string(mem->index_bytes) + " bytes) is smaller than the plan's " +
                  std::to_string(sizing.off) + " + " + std::to_string(ic.off));
    // The carvers align every array to 256 bytes from the base (the kernels' vector loads and
    // stores rely on it), so a lent base must be as aligned.
    SF_ENSURE(reinterpret_cast<uintptr_t>(mem->workspace) % 256 == 0 &&
                  reinterpret_cast<uintptr_t>(mem->index) % 256 == 0,
              kInvalidArgument, "sparse_estimate_plan: lent memory is not 256-byte aligned");
    plan->workspace.reset();
    plan->index.reset();
    plan->workspace_base = mem->workspace;
    plan->index_base = mem->index;
  } else {
    SF_TRY(plan->workspace.alloc(sizing.off));
    SF_TRY(plan->index.alloc(ic.off));
    plan->workspace_base = plan->workspace.as<char>();
    plan->index_base = plan->index.as<char>();
  }
  Carver real{0, plan->workspace_base};
  carve(real);
  Carver ir{0, plan->index_base};
  carve_index(ir);
  SF_TRY(plan->tables.alloc(tc.off));
  Carver tr{0, plan->tables.as<char>()};
  carve_tables(tr);
  auto put = [&](const void* src, size_t bytes, const void* dst) {
    return plan->tables.upload(src, bytes,
                               size_t(static_cast<const char*>(dst) - plan->tables.as<char>()));
  };
  SF_TRY(put(heads.data(), heads.size() * sizeof(EstHead), L.heads));
  if (nv) SF_TRY(put(vs_heads.data(), nv * 4, L.vs_heads));
  if (nb) SF_TRY(put(blk_heads.data(), nb * 4, L.blk_heads));
  if (L.n_cov) {
    SF_TRY(put(cov_heads.data(), cov_heads.size() * 4, L.cov_heads));
    SF_TRY(put(cov_local.data(), cov_local.size() * 8, L.cov_local));
    SF_TRY(put(cov_pos.data(), cov_pos.size() * 8, L.cov_pos));
  }
  return Status::ok();
}

Status sparse_estimate_run(SparseEstimatePlan* plan, const TensorView& q, const TensorView& k,
                           SparseIndexDevice* out, void* stream) {
  EstimateLaunch& L = plan->launch;
  if (q.shape[0] != L.nq || q.shape[1] != L.hq || q.shape[2] != L.d || k.shape[0] != L.nk ||
      k.shape[1] != L.hkv || (q.dtype == DType::kBF16) != L.bf16 || k.dtype != q.dtype)
    return SF_ERR(kInvalidArgument, "sparse_estimate_run: q/k do not match the plan");
  L.q = q.data;
  L.k = k.data;
  SF_CUDA_TRY(sparse_estimate_launch(L, static_cast<cudaStream_t>(stream)));
  SparseIndexDevice& d = *out;
  d.block_count = L.block_count;
  d.block_offset = L.block_offset;
  d.column_count = L.column_count;
  d.column_index = L.column_index;
  d.n_heads = int(L.hq);
  d.n_q = L.nq;
  d.n_k = L.nk;
  d.q_offset = L.q_offset;
  d.n_qblocks = L.n_qb;
  d.max_blocks = L.max_blocks;
  d.max_cols = L.max_cols;
  d.pair_heads = L.pair_heads;
  return Status::ok();
}

Status sparse_estimate_needed(const SparseEstimatePlan& plan, void* stream, int* max_blocks,
                              int* max_cols) {
  SF_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  int32_t need[2] = {0, 0};
  SF_CUDA_TRY(cudaMemcpy(need, plan.launch.need, sizeof(need), cudaMemcpyDeviceToHost));
  *max_blocks = need[0];
  *max_cols = need[1];
  return Status::ok();
}

Status sparse_estimate_need_enqueue(const SparseEstimatePlan& plan, int32_t* host_need,
                                    void* stream) {
  SF_ENSURE(plan.launch.need != nullptr && host_need != nullptr, kInvalidArgument,
            "sparse_estimate_need_enqueue: needs a planned estimator and a host destination");
  SF_CUDA_TRY(cudaMemcpyAsync(host_need, plan.launch.need, 2 * sizeof(int32_t),
                              cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

Status sparse_index_download(const SparseIndexDevice& idx, int max_blocks, int max_cols,
                             SparseIndex* out, void* stream) {
  SF_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  *out = sparse_index_make(idx.n_heads, idx.n_q, idx.n_k, idx.q_offset, max_blocks, max_cols);
  const size_t slots = size_t(idx.n_heads) * size_t(idx.n_qblocks);
  if (slots == 0) return Status::ok();
  SF_CUDA_TRY(
      cudaMemcpy(out->block_count.data(), idx.block_count, slots * 4, cudaMemcpyDeviceToHost));
  SF_CUDA_TRY(
      cudaMemcpy(out->column_count.data(), idx.column_count, slots * 4, cudaMemcpyDeviceToHost));
  for (size_t s = 0; s < slots; ++s)
    if (out->block_count[s] < 0 || out->column_count[s] < 0 || out->block_count[s] > max_blocks ||
        out->column_count[s] > max_cols)
      return SF_ERR(kInternal, "sparse_index_download: slot " + std::to_string(s) +
                                   " holds more entries than the capacity given");
  if (max_blocks > 0)
    SF_CUDA_TRY(cudaMemcpy2D(out->block_offset.data(), size_t(max_blocks) * 4, idx.block_offset,
                             size_t(idx.max_blocks) * 4, size_t(max_blocks) * 4, slots,
                             cudaMemcpyDeviceToHost));
  if (max_cols > 0)
    SF_CUDA_TRY(cudaMemcpy2D(out->column_index.data(), size_t(max_cols) * 4, idx.column_index,
                             size_t(idx.max_cols) * 4, size_t(max_cols) * 4, slots,
                             cudaMemcpyDeviceToHost));
  // Entries past each slot's count were never written: zero them as the CPU builder leaves them.
  for (size_t s = 0; s < slots; ++s) {
    std::fill(
        out->block_offset.begin() + ptrdiff_t(s * size_t(max_blocks) + size_t(out->block_count[s])),
        out->block_offset.begin() + ptrdiff_t((s + 1) * size_t(max_blocks)), 0);
    std::fill(
        out->column_index.begin() + ptrdiff_t(s * size_t(max_cols) + size_t(out->column_count[s])),
        out->column_index.begin() + ptrdiff_t((s + 1) * size_t(max_cols)), 0);
  }
  return Status::ok();
}

Status sparse_estimate_selections(const SparseEstimatePlan& plan, void* stream,
                                  EstimateSelections* out) {
  SF_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  const EstimateLaunch& L = plan.launch;
  auto get = []<typename T>(const T* src, size_t n, std::vector<T>* dst) -> Status {
    dst->resize(n);
    if (n) SF_CUDA_TRY(cudaMemcpy(dst->data(), src, n * sizeof(T), cudaMemcpyDeviceToHost));
    return Status::ok();
  };
  std::vector<EstHead> heads(size_t(L.hq));
  SF_CUDA_TRY(
      cudaMemcpy(heads.data(), L.heads, heads.size() * sizeof(EstHead), cudaMemcpyDeviceToHost));
  out->columns.assign(size_t(L.hq), {});
  out->diagonals.assign(size_t(L.hq), {});
  out->key_blocks.assign(size_t(L.hq * L.n_qb), {});
  out->col_round.assign(size_t(L.hq), {});
  out->diag_round.assign(size_t(L.hq), {});
  out->diag_free.assign(size_t(L.hq), {});
  std::vector<int32_t> n_sel;
  for (int64_t h = 0; h < L.hq; ++h) {
    const EstHead& e = heads[size_t(h)];
    if (e.kind == kEstVS) {
      int32_t nc = 0, nd = 0;
      SF_CUDA_TRY(cudaMemcpy(&nc, L.n_sel_cols + e.vs_slot, 4, cudaMemcpyDeviceToHost));
      SF_CUDA_TRY(cudaMemcpy(&nd, L.n_sel_diags + e.vs_slot, 4, cudaMemcpyDeviceToHost));
      if (nc < 0 || nc > L.kend_last || nd < 0 || nd > L.n_diag)
        return SF_ERR(kInternal, "sparse_estimate_selections: head " + std::to_string(h) +
                                     " selection count out of range (unwritten?)");
      SF_TRY(get(L.sel_cols + size_t(e.vs_slot) * size_t(L.kend_last), size_t(nc),
                 &out->columns[size_t(h)]));
      SF_TRY(get(L.sel_diags + size_t(e.vs_slot) * size_t(L.n_diag), size_t(nd),
                 &out->diagonals[size_t(h)]));
      if (e.cover) {
        const size_t c = size_t(e.vs_slot - (L.n_vs - L.n_cov)),
                     ncx = size_t(L.kend_last + L.n_diag);
        std::vector<int32_t> r;
        SF_TRY(get(L.cov_round + c * ncx, ncx, &r));
        out->col_round[size_t(h)].assign(r.begin(), r.begin() + L.kend_last);
        out->diag_round[size_t(h)].assign(r.begin() + L.kend_last, r.end());
        SF_TRY(get(L.cov_free + c * size_t(L.n_diag), size_t(L.n_diag), &out->diag_free[size_t(h)]));
      }
    } else if (e.kind == kEstBlock) {
      SF_TRY(get(L.n_sel_kb + size_t(e.blk_slot) * size_t(L.n_qb), size_t(L.n_qb), &n_sel));
      for (int64_t qb = 0; qb < L.n_qb; ++qb) {
        const int32_t n = n_sel[size_t(qb)];
        if (n < 0 || n > L.cap_kb)
          return SF_ERR(kInternal, "sparse_estimate_selections: head " + std::to_string(h) +
                                       " block " + std::to_string(qb) +
                                       " selection count out of range (unwritten?)");
        SF_TRY(get(L.sel_kb + (size_t(e.blk_slot) * size_t(L.n_qb) + size_t(qb)) * size_t(L.cap_kb),
                   size_t(n), &out->key_blocks[size_t(h * L.n_qb + qb)]));
      }
    }
  }
  return Status::ok();
}

Status sparse_index_pairs(const SparseIndexDevice& idx, unsigned long long* pairs, void* stream) {
  SF_CUDA_TRY(sparse_index_pairs_launch(
      IndexPairsArgs{idx.block_count, idx.block_offset, idx.column_count, idx.column_index,
                     idx.n_heads, idx.n_q, idx.n_k, idx.q_offset, idx.n_qblocks, idx.max_blocks,
                     idx.max_cols, pairs},
      static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

Status sparse_estimate_poison(SparseEstimatePlan* plan, int byte, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  SF_CUDA_TRY(cudaMemsetAsync(plan->index_base, byte, plan->index_bytes, s));
  // Scores, partials, selections and their counts (the head tables live apart).
  SF_CUDA_TRY(cudaMemsetAsync(plan->workspace_base, byte, plan->workspace_bytes, s));
  return Status::ok();
}

Status sparse_estimate(const TensorView& q, const TensorView& k,
                       const std::vector<HeadPattern>& patterns, int64_t q_offset, SparseIndex* out,
                       EstimatorStats* stats, void* stream) {
  const auto t0 = std::chrono::steady_clock::now();
  SparseEstimatePlan plan;
  SF_TRY(sparse_estimate_plan(q, k, patterns, q_offset, 0, 0, &plan));
  SparseIndexDevice d;
  SF_TRY(sparse_estimate_run(&plan, q, k, &d, stream));
  int nb = 0, nc = 0;
  SF_TRY(sparse_estimate_needed(plan, stream, &nb, &nc));
  if (nb > plan.launch.max_blocks || nc > plan.launch.max_cols) {
    SF_TRY(sparse_estimate_plan(q, k, patterns, q_offset, std::max(nb, 1), std::max(nc, 1), &plan));
    SF_TRY(sparse_estimate_run(&plan, q, k, &d, stream));
  }
  SF_TRY(sparse_index_download(d, nb, nc, out, stream));
  if (stats) {
    stats->clamped_heads = plan.clamped_heads;
    stats->density = out->density();
    stats->estimate_s = sf::seconds_since(t0);
  }
  return Status::ok();
}

}  // namespace sf::kernels::cuda
