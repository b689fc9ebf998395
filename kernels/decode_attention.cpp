// Validation + dispatch for paged decode attention (kernels/decode_attention.h).
#include "kernels/decode_attention.h"

#include <cstdint>
#include <string>

#if SF_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace sf::kernels {
namespace {

Status check_pool(const char* op, const PagedKv& kv, Stream s) {
  auto bad = [&](const std::string& what) {
    return SF_ERR(kInvalidArgument, std::string(op) + ": " + what);
  };
  if (!kv.k || !kv.v || !kv.kmin || !kv.kmax || !kv.fill || !kv.pages || !kv.n_pages)
    return bad("the block pool has a null array");
  if (kv.dtype == PoolDType::kInt8 &&
      (!kv.kscale || !kv.kzero || !kv.vscale || !kv.vzero || !kv.kopen))
    return bad("an INT8 pool needs its scales, zeros and last-block keys");
  if (kv.dtype != PoolDType::kF32 && kv.dtype != PoolDType::kBF16 && kv.dtype != PoolDType::kInt8)
    return bad("unknown pool element type");
  if (kv.n_kv_heads <= 0 || kv.head_dim <= 0)
    return bad("n_kv_heads and head_dim must be positive");
  if (kv.max_pages <= 0 || kv.max_pages > kDecodeMaxPages)
    return bad("max_pages " + std::to_string(kv.max_pages) + " out of range [1, " +
               std::to_string(kDecodeMaxPages) + "]");
  if (s.device != Device::kCuda)
    return SF_ERR(kUnsupported,
                  std::string(op) + ": device only (the host path is decode::decode_attention)");
  return Status::ok();
}

}  // namespace

size_t paged_decode_workspace_bytes(int n_heads, const PagedKv& kv, const PagedDecodeParams& p) {
#if SF_HAVE_CUDA
  return cuda::paged_decode_workspace_bytes(n_heads, kv, p);
#else
  (void)n_heads;
  (void)kv;
  (void)p;
  return 0;
#endif
}

bool paged_decode_staged(int n_heads, const PagedKv& kv, const PagedDecodeParams& p) {
#if SF_HAVE_CUDA
  return cuda::paged_decode_staged(n_heads, kv, p);
#else
  (void)n_heads;
  (void)kv;
  (void)p;
  return false;
#endif
}

Status paged_decode_attention(const float* q, int n_heads, const PagedKv& kv,
                              const PagedDecodeParams& p, float* out, int32_t* visited,
                              void* workspace, size_t workspace_bytes, Stream s) {
  SF_TRY(check_pool("paged_decode_attention", kv, s));
  if (!q || !out) return SF_ERR(kInvalidArgument, "paged_decode_attention: null q or out");
  // The kernels read q and write out and the workspace as float4.
  auto misaligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 != 0; };
  if (misaligned(q) || misaligned(out) || (workspace && misaligned(workspace)))
    return SF_ERR(kInvalidArgument,
                  "paged_decode_attention: q, out and workspace must be 16-byte aligned");
  if (n_heads <= 0 || n_heads % kv.n_kv_heads)
    return SF_ERR(kInvalidArgument, "paged_decode_attention: heads " + std::to_string(n_heads) +
                                        " not a multiple of kv heads " +
                                        std::to_string(kv.n_kv_heads));
  if (p.psa && p.psa_share_kv_head && n_heads / kv.n_kv_heads > kDecodePsaGqaMaxGroup)
    return SF_ERR(kUnsupported, "paged_decode_attention: psa '+gqa' takes at most " +
                                    std::to_string(kDecodePsaGqaMaxGroup) +
                                    " query heads per KV head, got " +
                                    std::to_string(n_heads / kv.n_kv_heads));
  if (p.n_tokens < 1 || p.n_tokens > kDecodeMaxTokens)
    return SF_ERR(kOutOfRange, "paged_decode_attention: n_tokens " + std::to_string(p.n_tokens) +
                                   " not in [1, " + std::to_string(kDecodeMaxTokens) + "]");
  if (p.n_tokens > 1 && (p.psa || visited))
    return SF_ERR(kInvalidArgument,
                  "paged_decode_attention: several tokens take full mode and no visited counts");
  if (p.psa && !(p.eps > 0 && p.eps <= 1))
    return SF_ERR(kOutOfRange,
                  "paged_decode_attention: eps " + std::to_string(p.eps) + " not in (0, 1]");
#if SF_HAVE_CUDA
  return cuda::paged_decode_attention(q, n_heads, kv, p, out, visited, workspace, workspace_bytes,
                                      s.handle);
#else
  (void)visited;
  (void)workspace;
  (void)workspace_bytes;
  return SF_ERR(kUnsupported, "paged_decode_attention: built without CUDA");
#endif
}

Status paged_append(const PagedKv& kv, const float* k_new, const float* v_new, Stream s,
                    int n_tokens) {
  SF_TRY(check_pool("paged_append", kv, s));
  if (!k_new || !v_new) return SF_ERR(kInvalidArgument, "paged_append: null k or v");
  if (n_tokens < 1 || n_tokens > kDecodeMaxTokens)
    return SF_ERR(kOutOfRange, "paged_append: n_tokens " + std::to_string(n_tokens) +
                                   " not in [1, " + std::to_string(kDecodeMaxTokens) + "]");
#if SF_HAVE_CUDA
  return cuda::paged_append(kv, k_new, v_new, n_tokens, s.handle);
#else
  return SF_ERR(kUnsupported, "paged_append: built without CUDA");
#endif
}

size_t paged_snapshot_bytes(const PagedKv& kv) {
#if SF_HAVE_CUDA
  return cuda::paged_snapshot_bytes(kv);
#else
  (void)kv;
  return 0;
#endif
}

namespace {
Status snapshot_or_restore(const char* op, const PagedKv& kv, const void* snap, size_t snap_bytes,
                           bool save, Stream s) {
  SF_TRY(check_pool(op, kv, s));
  if (!snap || reinterpret_cast<uintptr_t>(snap) % 16 != 0)
    return SF_ERR(kInvalidArgument, std::string(op) + ": null or misaligned snapshot");
  if (snap_bytes < paged_snapshot_bytes(kv))
    return SF_ERR(kInvalidArgument, std::string(op) + ": the snapshot holds " +
                                        std::to_string(snap_bytes) + " bytes, the pool needs " +
                                        std::to_string(paged_snapshot_bytes(kv)));
#if SF_HAVE_CUDA
  return cuda::paged_snapshot(kv, const_cast<void*>(snap), save, s.handle);
#else
  (void)save;
  return SF_ERR(kUnsupported, std::string(op) + ": built without CUDA");
#endif
}
}  // namespace

Status paged_snapshot(const PagedKv& kv, void* snap, size_t snap_bytes, Stream s) {
  return snapshot_or_restore("paged_snapshot", kv, snap, snap_bytes, true, s);
}

Status paged_restore(const PagedKv& kv, const void* snap, size_t snap_bytes, Stream s) {
  return snapshot_or_restore("paged_restore", kv, snap, snap_bytes, false, s);
}

}  // namespace sf::kernels
