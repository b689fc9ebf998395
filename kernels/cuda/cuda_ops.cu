// Adapters from the backend-neutral API to the typed CUDA launchers: unpack views, apply the
// restrictions only this backend has, convert cudaError_t to Status. No host synchronization.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cuda/attention_dense.cuh"
#include "kernels/cuda/attention_sparse.cuh"
#include "kernels/cuda/attention_sparse_bf16_launch.cuh"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/elementwise.cuh"

namespace sf::kernels::cuda {
namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

Status embedding(const TensorView& table, const int32_t* ids, int64_t n, TensorView out,
                 void* stream) {
  const int64_t vocab = table.shape[0], hidden = table.shape[1];
  float* o = out.ptr<float>();
  switch (table.dtype) {
    case DType::kF32:
      SF_CUDA_TRY(embedding_launch(
          EmbeddingParams<float>{table.ptr<float>(), ids, o, vocab, hidden}, n, as_stream(stream)));
      return Status::ok();
    case DType::kF16:
      SF_CUDA_TRY(
          embedding_launch(EmbeddingParams<__half>{table.ptr<__half>(), ids, o, vocab, hidden}, n,
                           as_stream(stream)));
      return Status::ok();
    case DType::kBF16:
      SF_CUDA_TRY(embedding_launch(
          EmbeddingParams<__nv_bfloat16>{table.ptr<__nv_bfloat16>(), ids, o, vocab, hidden}, n,
          as_stream(stream)));
      return Status::ok();
    default:
      return SF_ERR(kUnsupported, std::string("embedding: table dtype ") + dtype_name(table.dtype) +
                                      " (CUDA supports F32, F16, BF16)");
  }
}

Status rms_norm(const TensorView& x, const TensorView& w, float eps, TensorView out, void* stream) {
  SF_CUDA_TRY(rms_norm_launch(
      RmsNormParams{x.ptr<float>(), w.ptr<float>(), out.ptr<float>(), x.shape[1], eps}, x.shape[0],
      as_stream(stream)));
  return Status::ok();
}

Status rope(TensorView x, const int32_t* positions, const RopeParams& p, void* stream) {
  RopeKernelParams kp{};
  kp.x = x.ptr<float>();
  kp.positions = positions;
  kp.heads = int(x.shape[1]);
  kp.head_dim = int(x.shape[2]);
  const int rot = p.rot_dim > 0 ? p.rot_dim : kp.head_dim;
  kp.half = rot / 2;
  kp.neox = p.neox;
  if (kp.half > kRopeMaxPairs)
    return SF_ERR(kUnsupported, "rope: rot_dim " + std::to_string(rot) +
                                    " exceeds the CUDA limit of " +
                                    std::to_string(2 * kRopeMaxPairs));
  cpu::rope_inv_freq(p, rot, kp.inv_freq);  // host-side plan; reads p.freq_factors (host memory)
  SF_CUDA_TRY(rope_launch(kp, x.shape[0], as_stream(stream)));
  return Status::ok();
}

Status swiglu(const TensorView& gate, const TensorView& up, TensorView out, void* stream) {
  SF_CUDA_TRY(swiglu_launch(
      SwigluParams{gate.ptr<float>(), up.ptr<float>(), out.ptr<float>(), gate.numel()},
      as_stream(stream)));
  return Status::ok();
}

Status add_inplace(TensorView out, const TensorView& x, void* stream) {
  SF_CUDA_TRY(
      add_launch(AddParams{out.ptr<float>(), x.ptr<float>(), out.numel()}, as_stream(stream)));
  return Status::ok();
}

Status add_rms_norm(TensorView x, const TensorView& delta, const TensorView& w, float eps,
                    TensorView out, void* stream) {
  SF_CUDA_TRY(add_rms_norm_launch(
      AddRmsNormParams{x.ptr<float>(), delta.data ? delta.ptr<float>() : nullptr, w.ptr<float>(),
                       out.ptr<float>(), x.shape[1], eps},
      x.shape[0], as_stream(stream)));
  return Status::ok();
}

Status fill_normal(TensorView out, const FillNormal& f, void* stream) {
  SF_ENSURE(out.device == Device::kCuda, kInvalidArgument,
            "fill_normal: out must be on the device");
  SF_ENSURE(out.dtype == DType::kF32 || out.dtype == DType::kBF16, kUnsupported,
            std::string("fill_normal: dtype ") + dtype_name(out.dtype) + " (supported: F32, BF16)");
  SF_ENSURE(out.contiguous() && (out.ndim == 1 || out.ndim == 2), kInvalidArgument,
            "fill_normal: out must be a contiguous 1-D or 2-D tensor");
  const int64_t rows = out.shape[0], cols = out.ndim == 2 ? out.shape[1] : 1;
  const int64_t ld = f.ld > 0 ? f.ld : cols;
  SF_ENSURE(f.row0 >= 0 && f.col0 >= 0 && f.col0 + cols <= ld, kInvalidArgument,
            "fill_normal: the window's columns fall outside ld");
  SF_CUDA_TRY(fill_normal_launch(FillNormalParams{out.data, out.dtype == DType::kBF16, rows, cols,
                                                  ld, f.row0, f.col0, f.seed, f.mean, f.stdv},
                                 as_stream(stream)));
  return Status::ok();
}

Status cast(const TensorView& x, TensorView out, void* stream) {
  const int64_t n = x.numel();
  if (x.dtype == out.dtype) {
    SF_CUDA_TRY(cudaMemcpyAsync(out.data, x.data, size_t(n) * dtype_size(x.dtype),
                                cudaMemcpyDeviceToDevice, as_stream(stream)));
    return Status::ok();
  }
  cudaError_t err = cudaErrorInvalidValue;
  if (x.dtype == DType::kF32 && out.dtype == DType::kBF16)
    err = cast_launch(CastParams<float, __nv_bfloat16>{x.ptr<float>(), out.ptr<__nv_bfloat16>(), n},
                      as_stream(stream));
  else if (x.dtype == DType::kF32 && out.dtype == DType::kF16)
    err = cast_launch(CastParams<float, __half>{x.ptr<float>(), out.ptr<__half>(), n},
                      as_stream(stream));
  else if (x.dtype == DType::kBF16 && out.dtype == DType::kF32)
    err = cast_launch(CastParams<__nv_bfloat16, float>{x.ptr<__nv_bfloat16>(), out.ptr<float>(), n},
                      as_stream(stream));
  else if (x.dtype == DType::kF16 && out.dtype == DType::kF32)
    err = cast_launch(CastParams<__half, float>{x.ptr<__half>(), out.ptr<float>(), n},
                      as_stream(stream));
  else
    return SF_ERR(kUnsupported, std::string("cast: ") + dtype_name(x.dtype) + " -> " +
                                    dtype_name(out.dtype) + " (CUDA supports F32 <-> F16/BF16)");
  SF_CUDA_TRY(err);
  return Status::ok();
}

bool attention_dense_supported(int head_dim) {
  return dispatch_head_dim(head_dim, [](auto) {});
}

Status attention_dense(const TensorView& q, const TensorView& k, const TensorView& v,
                       TensorView out, TensorView lse, const AttentionParams& p, void* stream) {
  if (q.dtype == DType::kBF16) return attention_dense_cudnn(q, k, v, out, lse, p, stream);
  const int d = int(q.shape[2]);
  AttentionDenseParams kp{};
  kp.q = q.ptr<float>();
  kp.k = k.ptr<float>();
  kp.v = v.ptr<float>();
  kp.out = out.ptr<float>();
  kp.lse = lse.ptr<float>();
  kp.n_q = q.shape[0];
  kp.n_k = k.shape[0];
  kp.n_heads = int(q.shape[1]);
  kp.n_kv_heads = int(k.shape[1]);
  kp.scale = p.scale > 0.f ? p.scale : 1.f / std::sqrt(float(d));
  kp.q_offset = p.q_offset;
  kp.causal = p.causal;
  cudaError_t err = cudaSuccess;
  const bool supported = dispatch_head_dim(d, [&](auto head_dim) {
    err = attention_dense_launch<decltype(head_dim)::value>(kp, as_stream(stream));
  });
  if (!supported)
    return SF_ERR(kUnsupported,
                  "attention_dense: head_dim " + std::to_string(d) + " (CUDA supports 64, 128)");
  SF_CUDA_TRY(err);
  return Status::ok();
}


bool attention_sparse_supported(int head_dim) {
  return dispatch_head_dim(head_dim, [](auto) {});
}

namespace {
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
std::atomic<int> g_sparse_bf16_mainloop{int(SparseBf16Mainloop::kWgmmaWs)};
}  // namespace

void set_sparse_bf16_mainloop(SparseBf16Mainloop m) {
  g_sparse_bf16_mainloop.store(int(m), std::memory_order_relaxed);
}
SparseBf16Mainloop sparse_bf16_mainloop() {
  return SparseBf16Mainloop(g_sparse_bf16_mainloop.load(std::memory_order_relaxed));
}
const char* sparse_bf16_mainloop_name(SparseBf16Mainloop m) {
  switch (m) {
    case SparseBf16Mainloop::kWgmma:
      return "wgmma";
    case SparseBf16Mainloop::kMmaSync:
      return "mma.sync";
    case SparseBf16Mainloop::kWgmmaWs:
      return "wgmma-ws";
    case SparseBf16Mainloop::kWgmmaWsPair:
      return "wgmma-ws-pair";
    case SparseBf16Mainloop::kWgmmaWsSingle:
      return "wgmma-ws-single";
  }
  return "?";
}
bool parse_sparse_bf16_mainloop(std::string_view name, SparseBf16Mainloop* m) {
  for (const auto c : {SparseBf16Mainloop::kWgmmaWs, SparseBf16Mainloop::kWgmmaWsPair,
                       SparseBf16Mainloop::kWgmmaWsSingle, SparseBf16Mainloop::kWgmma,
                       SparseBf16Mainloop::kMmaSync})
    if (name == sparse_bf16_mainloop_name(c)) {
      *m = c;
      return true;
    }
  return false;
}

Status attention_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SparseIndexDevice& idx, TensorView out, TensorView lse,
                        const AttentionParams& p, void* stream) {
  constexpr int64_t kQb = attention_sparse_detail::kQBlock;
  const int d = int(q.shape[2]);
  if (idx.n_heads != q.shape[1] || idx.n_q != q.shape[0] || idx.n_k != k.shape[0] ||
      idx.q_offset != p.q_offset || idx.n_qblocks != (idx.n_q + kQb - 1) / kQb)
    return SF_ERR(kInvalidArgument, "attention_sparse: device index geometry does not match q/k");
  if (!p.causal) return SF_ERR(kInvalidArgument, "attention_sparse: the sparse index is causal");
  for (const TensorView* t : std::initializer_list<const TensorView*>{&q, &k, &v, &out})
    if (!aligned16(t->data))
      return SF_ERR(kUnsupported, "attention_sparse: CUDA needs 16-byte aligned q, k, v, out");
  const bool bf16 = q.dtype == DType::kBF16;
  if (!(q.dtype == DType::kF32 || bf16) || k.dtype != q.dtype || v.dtype != q.dtype ||
      out.dtype != q.dtype || lse.dtype != DType::kF32)
    return SF_ERR(kUnsupported,
                  "attention_sparse: CUDA takes q, k, v, out all F32 or all BF16, lse F32");
  const float scale = p.scale > 0.f ? p.scale : 1.f / std::sqrt(float(d));
  cudaError_t err = cudaSuccess;
  bool supported = false;
  // The fields both precisions' kernel parameters share: pointers, shapes, scale, the index.
  auto fill = [&](auto& kp, auto* elem) {
    using T = std::remove_pointer_t<decltype(elem)>;
    kp.q = q.ptr<T>();
    kp.k = k.ptr<T>();
    kp.v = v.ptr<T>();
    kp.out = out.ptr<T>();
    kp.lse = lse.ptr<float>();
    kp.n_q = q.shape[0];
    kp.n_k = k.shape[0];
    kp.n_heads = int(q.shape[1]);
    kp.n_kv_heads = int(k.shape[1]);
    kp.scale = scale;
    kp.q_offset = p.q_offset;
    kp.block_count = idx.block_count;
    kp.block_offset = idx.block_offset;
    kp.column_count = idx.column_count;
    kp.column_index = idx.column_index;
    kp.n_qblocks = idx.n_qblocks;
    kp.max_blocks = idx.max_blocks;
    kp.max_cols = idx.max_cols;
  };
  if (bf16) {
    AttentionSparseBf16Params kp{};
    fill(kp, static_cast<__nv_bfloat16*>(nullptr));
    kp.pair_heads = idx.pair_heads;
    supported = dispatch_head_dim(d, [&](auto head_dim) {
      err = attention_sparse_bf16_launch<decltype(head_dim)::value>(kp, sparse_bf16_mainloop(),
                                                                    as_stream(stream));
    });
  } else {
    AttentionSparseParams kp{};
    fill(kp, static_cast<float*>(nullptr));
    supported = dispatch_head_dim(d, [&](auto head_dim) {
      err = attention_sparse_launch<decltype(head_dim)::value>(kp, as_stream(stream));
    });
  }
  if (!supported)
    return SF_ERR(kUnsupported,
                  "attention_sparse: head_dim " + std::to_string(d) + " (CUDA supports 64, 128)");
  SF_CUDA_TRY(err);
  return Status::ok();
}

}  // namespace sf::kernels::cuda
