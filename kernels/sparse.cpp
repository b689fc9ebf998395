// Sparse attention API: pattern names, validation, dispatch. Shapes, dtypes, pattern parameters
// and the index's invariants are checked here once, so backends can assume them.
#include "kernels/sparse.h"

#include <cmath>

#include "kernels/cpu/cpu_sparse.h"
#ifdef SF_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/sparse_estimate.h"
#endif

namespace sf::kernels {
namespace {

constexpr struct {
  Pattern p;
  const char* name;
} kPatternNames[] = {
    {Pattern::kDense, "dense"},
    {Pattern::kAShape, "a-shape"},
    {Pattern::kVerticalSlash, "vertical-slash"},
    {Pattern::kBlockSparse, "block-sparse"},
    {Pattern::kMoA, "moa"},
    {Pattern::kAdaptiveVS, "adaptive-vs"},
    {Pattern::kAdaptiveBlock, "adaptive-block"},
};

Status need(bool cond, const char* op, const std::string& what) {
  if (cond) return Status::ok();
  return Status(Code::kInvalidArgument, std::string(op) + ": " + what);
}
bool f32c(const TensorView& t) { return t.dtype == DType::kF32 && t.contiguous(); }

}  // namespace

Status check_pattern(const HeadPattern& hp, size_t h) {
  const std::string f = "sparse_estimate: patterns[" + std::to_string(h) + "].";
  auto err = [&](const char* field, const std::string& what) {
    return SF_ERR(kInvalidArgument, f + field + " " + what);
  };
  // Counts of keys, columns, diagonals or blocks: at most a prompt's positions (int32), so the
  // estimators' rounding up to blocks and their sums cannot overflow (a larger value means
  // "all" and is written so).
  constexpr int64_t kMaxCount = INT32_MAX;
  const std::string in_range = "must be in [0, " + std::to_string(kMaxCount) + "]";
  for (const auto& [name, x] : {std::pair<const char*, int64_t>{"sink", hp.sink},
                                {"local", hp.local},
                                {"n_vertical", hp.n_vertical},
                                {"n_slash", hp.n_slash},
                                {"n_blocks", hp.n_blocks},
                                {"min_budget", hp.min_budget},
                                {"max_budget", hp.max_budget}})
    if (x < 0 || x > kMaxCount) return err(name, in_range);
  if (hp.spread_rows < 0 || hp.spread_rows > 4096) return err("spread_rows", "must be in [0, 4096]");
  if (hp.segment_rows < 0 || hp.segment_rows % kSparseBlock != 0)
    return err("segment_rows", "must be >= 0 and a multiple of 64");
  // MoA's span alpha + beta * n_k is rounded to an integer: bounded so that it converts.
  if (!(hp.alpha >= 0 && hp.alpha <= double(kMaxCount))) return err("alpha", in_range);
  if (!(hp.beta >= 0 && hp.beta <= double(kMaxCount))) return err("beta", in_range);
  if (!(hp.gamma > 0 && hp.gamma <= 1)) return err("gamma", "must be in (0, 1]");
  if (hp.max_budget < hp.min_budget) return err("max_budget", "must be >= min_budget");
  if (hp.last_block_rows != 0 && hp.last_block_rows != 1)
    return err("last_block_rows", "must be 0 or 1");
  if (hp.last_block_rows != 0 && hp.pattern != Pattern::kAdaptiveBlock)
    return err("last_block_rows", "applies to adaptive-block only");
  if (hp.share_group != 0 && hp.share_group != 1) return err("share_group", "must be 0 or 1");
  if (hp.tail_block_min < 0 || hp.tail_block_min >= kSparseBlock)
    return err("tail_block_min", "must be in [0, 63]");
  if (hp.vs_cover != 0 && hp.vs_cover != 1) return err("vs_cover", "must be 0 or 1");
  if (hp.vs_cover != 0 && hp.pattern != Pattern::kAdaptiveVS)
    return err("vs_cover", "applies to adaptive-vs only");
  if (hp.vs_cover != 0 && (hp.segment_rows != 0 || hp.share_group != 0))
    return err("vs_cover", "needs segment_rows 0 and share_group 0");
  bool known = false;
  for (const auto& e : kPatternNames) known |= e.p == hp.pattern;
  if (!known) return err("pattern", "is not a known pattern");
  return Status::ok();
}

const char* pattern_name(Pattern p) {
  for (const auto& e : kPatternNames)
    if (e.p == p) return e.name;
  return "unknown";
}

Result<Pattern> pattern_from_string(const std::string& s) {
  for (const auto& e : kPatternNames)
    if (s == e.name) return e.p;
  return SF_ERR(
      kInvalidArgument,
      "unknown sparse pattern '" + s +
          "' (dense, a-shape, vertical-slash, block-sparse, moa, adaptive-vs, adaptive-block)");
}

Status sparse_estimate(const TensorView& q, const TensorView& k,
                       const std::vector<HeadPattern>& patterns, int64_t q_offset, SparseIndex* out,
                       EstimatorStats* stats) {
  SF_TRY(need(out != nullptr, "sparse_estimate", "out index is null"));
  SF_TRY(
      need(q.ndim == 3 && k.ndim == 3, "sparse_estimate", "q and k are 3-D [n, heads, head_dim]"));
  SF_TRY(need(q.device == k.device, "sparse_estimate", "q and k on different devices"));
  const bool bf16_cuda = q.device == Device::kCuda && q.dtype == DType::kBF16 &&
                         k.dtype == DType::kBF16 && q.contiguous() && k.contiguous();
  SF_TRY(need(bf16_cuda || (f32c(q) && f32c(k)), "sparse_estimate",
              "q and k must be contiguous F32 (or, on CUDA, both BF16)"));
  SF_TRY(
      need(q.shape[2] == k.shape[2] && q.shape[2] > 0, "sparse_estimate", "q/k head_dim mismatch"));
  SF_TRY(need(k.shape[1] > 0 && q.shape[1] % k.shape[1] == 0, "sparse_estimate",
              "n_heads must be a multiple of n_kv_heads"));
  SF_TRY(need(int64_t(patterns.size()) == q.shape[1], "sparse_estimate",
              "patterns has " + std::to_string(patterns.size()) + " entries for " +
                  std::to_string(q.shape[1]) + " heads"));
  SF_TRY(need(q_offset >= 0, "sparse_estimate", "q_offset must be >= 0"));
  SF_TRY(need(k.shape[0] <= INT32_MAX, "sparse_estimate", "n_k exceeds int32 key positions"));
  for (size_t h = 0; h < patterns.size(); ++h) SF_TRY(check_pattern(patterns[h], h));
  EstimatorStats local_stats;
  if (q.device == Device::kCuda) {
#ifdef SF_HAVE_CUDA
    // Legacy default stream: the caller's work on it is ordered before, the download after.
    return cuda::sparse_estimate(q, k, patterns, q_offset, out, stats ? stats : &local_stats,
                                 nullptr);
#else
    return SF_ERR(kUnsupported, "sparse_estimate: built without the CUDA backend");
#endif
  }
  return cpu::sparse_estimate(q, k, patterns, q_offset, out, stats ? stats : &local_stats);
}

Status attention_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SparseIndex& idx, TensorView out, TensorView lse,
                        const AttentionParams& p, Stream s) {
  for (const TensorView* t : std::initializer_list<const TensorView*>{&q, &k, &v, &out, &lse})
    SF_TRY(need(!t->data || t->device == s.device, "attention_sparse",
                "tensor on a different device than the stream"));
  SF_TRY(need(q.ndim == 3 && k.ndim == 3 && v.ndim == 3 && out.ndim == 3, "attention_sparse",
              "q, k, v, out are 3-D"));
  // BF16 q, k, v, out (lse F32) only on CUDA: the tensor-core kernel; the CPU kernels are F32.
  const bool bf16_cuda = s.device == Device::kCuda && q.dtype == DType::kBF16 &&
                         k.dtype == DType::kBF16 && v.dtype == DType::kBF16 &&
                         out.dtype == DType::kBF16 && q.contiguous() && k.contiguous() &&
                         v.contiguous() && out.contiguous() && f32c(lse);
  SF_TRY(need(bf16_cuda || (f32c(q) && f32c(k) && f32c(v) && f32c(out) && f32c(lse)),
              "attention_sparse",
              "contiguous F32 tensors (or, on CUDA, BF16 q, k, v, out with F32 lse)"));
  SF_TRY(need(k.shape == v.shape && q.shape[2] == k.shape[2], "attention_sparse",
              "k/v shape mismatch"));
  SF_TRY(need(k.shape[1] > 0 && q.shape[1] % k.shape[1] == 0, "attention_sparse",
              "n_heads must be a multiple of n_kv_heads"));
  SF_TRY(need(out.shape == q.shape, "attention_sparse", "out must match q"));
  SF_TRY(need(lse.numel() == q.shape[0] * q.shape[1], "attention_sparse",
              "lse must be [n_heads, n_q]"));
  SF_TRY(need(q.numel() == 0 || (q.data && k.data && v.data && out.data && lse.data),
              "attention_sparse", "q, k, v, out and lse need data"));
  SF_TRY(
      need(p.causal, "attention_sparse", "the sparse index is causal; params.causal must be true"));
  SF_TRY(need(idx.n_heads == q.shape[1] && idx.n_q == q.shape[0] && idx.n_k == k.shape[0],
              "attention_sparse",
              "index geometry (heads " + std::to_string(idx.n_heads) + ", n_q " +
                  std::to_string(idx.n_q) + ", n_k " + std::to_string(idx.n_k) +
                  ") does not match q" + q.shape_str() + " k" + k.shape_str()));
  SF_TRY(need(idx.q_offset == p.q_offset, "attention_sparse",
              "index q_offset " + std::to_string(idx.q_offset) + " != params.q_offset " +
                  std::to_string(p.q_offset)));
  // Structural check (bounds, order, no overlap): the kernel reads K/V rows at these offsets.
  // Linear in the index size, negligible next to the attention itself.
  SF_TRY(sparse_index_validate(idx, 0));
  if (s.device == Device::kCuda) {
#ifdef SF_HAVE_CUDA
    return cuda::attention_sparse(q, k, v, idx, out, lse, p, s.handle);
#else
    return SF_ERR(kUnsupported, "attention_sparse: built without the CUDA backend");
#endif
  }
  return cpu::attention_sparse(q, k, v, idx, out, lse, p);
}

}  // namespace sf::kernels
