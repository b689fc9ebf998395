// Validation + dispatch for kv_importance (kernels/kv_importance.h).
#include "kernels/kv_importance.h"

#include <initializer_list>
#include <string>

#if SF_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace sf::kernels {

Status kv_importance(const TensorView& q, const TensorView& k, const TensorView& lse,
                     const ImportanceParams& p, TensorView out, Stream s) {
  auto bad = [](const std::string& what) {
    return SF_ERR(kInvalidArgument, "kv_importance: " + what);
  };
  for (const TensorView* t : std::initializer_list<const TensorView*>{&q, &k, &lse, &out}) {
    const bool bf16_k = t == &k && t->dtype == DType::kBF16 && s.device == Device::kCuda;
    if ((t->dtype != DType::kF32 && !bf16_k) || !t->contiguous())
      return bad("q, k, lse, out must be contiguous F32 (k may be BF16 on CUDA)");
    if (t->device != s.device) return bad("tensor on a different device than the stream");
  }
  if (q.ndim != 3 || k.ndim != 3 || lse.ndim != 2 || out.ndim != 2)
    return bad(
        "expected q [nq, heads, d], k [nk, kv_heads, d], lse [heads, nq], out [kv_heads, nk]");
  const int64_t nq = q.shape[0], hq = q.shape[1], d = q.shape[2], nk = k.shape[0], hkv = k.shape[1];
  if (k.shape[2] != d)
    return bad("q and k head_dim differ: q" + q.shape_str() + " k" + k.shape_str());
  if (d <= 0) return bad("head_dim must be positive, got " + std::to_string(d));
  if (hkv <= 0 || hq % hkv != 0)
    return bad("heads " + std::to_string(hq) + " not a multiple of kv_heads " +
               std::to_string(hkv));
  if (lse.shape[0] != hq || lse.shape[1] != nq)
    return bad("lse must be [heads, nq], got " + lse.shape_str());
  if (out.shape[0] != hkv || out.shape[1] != nk)
    return bad("out must be [kv_heads, nk], got " + out.shape_str());
  if (p.window <= 0) return bad("window must be positive, got " + std::to_string(p.window));
  if (p.pool <= 0 || p.pool % 2 == 0)
    return bad("pool must be a positive odd kernel size, got " + std::to_string(p.pool));
  if (s.device == Device::kCuda) {
#if SF_HAVE_CUDA
    return cuda::kv_importance(q, k, lse, p, out, s.handle);
#else
    return SF_ERR(kUnsupported, "kv_importance: built without CUDA");
#endif
  }
  return cpu::kv_importance(q, k, lse, p, out);
}

}  // namespace sf::kernels
