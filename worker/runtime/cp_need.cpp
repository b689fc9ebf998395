#include "worker/runtime/cp_need.h"

#include <algorithm>

#include "common/thread_pool.h"
#include "worker/runtime/grid.h"

namespace sf::runtime {

CpNeedCount::CpNeedCount(int64_t n_tokens, int n_kv_heads, int cp)
    : n_tokens_(n_tokens), n_kv_(n_kv_heads), cp_(cp) {
  need_.assign(size_t(cp), std::vector<uint8_t>(size_t(n_tokens * n_kv_heads), 0));
}

Status CpNeedCount::add_rank(const kernels::SparseIndex& idx, int q_per_kv, int q_head0, int rank) {
  constexpr int64_t B = kernels::kSparseBlock;
  if (idx.n_q != n_tokens_ || idx.n_k != n_tokens_ || idx.q_offset != 0)
    return SF_ERR(kInvalidArgument, "CpNeedCount: the index must cover the whole " +
                                        std::to_string(n_tokens_) + "-token prompt");
  if (q_per_kv < 1 || q_head0 % q_per_kv != 0 || idx.n_heads % q_per_kv != 0 ||
      q_head0 / q_per_kv + idx.n_heads / q_per_kv > n_kv_ || rank < 0 || rank >= cp_)
    return SF_ERR(kInvalidArgument, "CpNeedCount: query heads [" + std::to_string(q_head0) + ", " +
                                        std::to_string(q_head0 + idx.n_heads) +
                                        ") are not whole KV groups of " + std::to_string(q_per_kv) +
                                        " inside " + std::to_string(n_kv_) + " KV heads, or rank " +
                                        std::to_string(rank) + " is outside CP " +
                                        std::to_string(cp_));
  for (const TokenRange& p : cp_rank_pieces(n_tokens_, cp_, rank))
    kernels::sparse_index_key_rows(idx, p.begin / B, (p.end + B - 1) / B, q_per_kv,
                                   q_head0 / q_per_kv, n_kv_, need_[size_t(rank)].data());
  return Status::ok();
}

Status CpNeedCount::add(const kernels::SparseIndex& idx, int q_per_kv, int q_head0) {
  SF_TRY(add_rank(idx, q_per_kv, q_head0, 0));  // checks the arguments once
  parallel_for(size_t(cp_ - 1), [&](size_t b, size_t e) {
    for (size_t r = b; r < e; ++r) (void)add_rank(idx, q_per_kv, q_head0, int(r) + 1);
  });
  return Status::ok();
}

std::vector<int64_t> CpNeedCount::moved_rows() const {
  std::vector<int64_t> out(size_t(cp_), 0);
  parallel_for(size_t(cp_), [&](size_t b, size_t e) {
    for (size_t r = b; r < e; ++r) {
      const auto own = cp_rank_ranges(n_tokens_, cp_, int(r));
      const std::vector<uint8_t>& nd = need_[r];
      int64_t n = std::count(nd.begin(), nd.end(), 1);
      for (const TokenRange& o : own)
        n -= std::count(nd.begin() + o.begin * n_kv_, nd.begin() + o.end * n_kv_, 1);
      out[r] = n;
    }
  });
  return out;
}

std::vector<int64_t> CpNeedCount::allgather_rows() const {
  std::vector<int64_t> out(static_cast<size_t>(cp_));
  for (int r = 0; r < cp_; ++r) {
    const auto own = cp_rank_ranges(n_tokens_, cp_, r);
    out[size_t(r)] = (n_tokens_ - own[0].size() - own[1].size()) * n_kv_;
  }
  return out;
}

}  // namespace sf::runtime
