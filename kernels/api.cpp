// Validation + dispatch. Shapes and dtypes are checked once here so backends can assume them.
#include "kernels/api.h"

#include "kernels/cpu/cpu_ops.h"
#if SF_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace sf::kernels {
namespace {

Status need(bool cond, const char* op, const std::string& what) {
  if (cond) return Status::ok();
  return Status(Code::kInvalidArgument, std::string(op) + ": " + what);
}
bool f32c(const TensorView& t) { return t.dtype == DType::kF32 && t.contiguous(); }
// Whether two contiguous views' bytes overlap (a view without data overlaps nothing).
bool overlap(const TensorView& a, const TensorView& b) {
  if (!a.data || !b.data) return false;
  const auto* pa = static_cast<const char*>(a.data);
  const auto* pb = static_cast<const char*>(b.data);
  return pa < pb + b.numel() * int64_t(dtype_size(b.dtype)) && pb < pa + a.numel() * int64_t(dtype_size(a.dtype));
}

Status same_device(const char* op, Stream s, std::initializer_list<const TensorView*> ts) {
  for (const TensorView* t : ts)
    if (t->data && t->device != s.device) return Status(Code::kInvalidArgument, std::string(op) + ": tensor on a different device than the stream");
  return Status::ok();
}

#if SF_HAVE_CUDA
#define SF_DISPATCH(op, ...) \
  return s.device == Device::kCuda ? cuda::op(__VA_ARGS__, s.handle) : cpu::op(__VA_ARGS__)
#else
#define SF_DISPATCH(op, ...)                                                                        \
  if (s.device == Device::kCuda) return SF_ERR(kUnsupported, #op ": built without the CUDA backend"); \
  return cpu::op(__VA_ARGS__)
#endif

}  // namespace

Status embedding(const TensorView& table, const int32_t* ids, int64_t n, TensorView out, Stream s) {
  SF_TRY(same_device("embedding", s, {&table, &out}));
  SF_TRY(need(table.ndim == 2 && table.contiguous(), "embedding", "table must be contiguous [vocab, hidden]"));
  SF_TRY(need(f32c(out) && out.ndim == 2 && out.shape[0] == n && out.shape[1] == table.shape[1], "embedding",
              "out must be F32 [n, hidden], got " + out.shape_str()));
  SF_DISPATCH(embedding, table, ids, n, out);
}

Status rms_norm(const TensorView& x, const TensorView& w, float eps, TensorView out, Stream s) {
  SF_TRY(same_device("rms_norm", s, {&x, &w, &out}));
  SF_TRY(need(f32c(x) && f32c(w) && f32c(out) && x.ndim == 2, "rms_norm", "x, w, out must be contiguous F32"));
  SF_TRY(need(w.numel() == x.shape[1] && out.numel() == x.numel(), "rms_norm",
              "shape mismatch x" + x.shape_str() + " w" + w.shape_str() + " out" + out.shape_str()));
  SF_DISPATCH(rms_norm, x, w, eps, out);
}

Status rope(TensorView x, const int32_t* positions, const RopeParams& p, Stream s) {
  SF_TRY(same_device("rope", s, {&x}));
  SF_TRY(need(f32c(x) && x.ndim == 3, "rope", "x must be contiguous F32 [n, heads, head_dim]"));
  const int rot = p.rot_dim > 0 ? p.rot_dim : int(x.shape[2]);
  SF_TRY(need(rot % 2 == 0 && rot <= x.shape[2], "rope", "rot_dim must be even and <= head_dim"));
  SF_TRY(need(p.theta > 0.f, "rope", "theta must be positive"));
  SF_DISPATCH(rope, x, positions, p);
}

Status swiglu(const TensorView& gate, const TensorView& up, TensorView out, Stream s) {
  SF_TRY(same_device("swiglu", s, {&gate, &up, &out}));
  SF_TRY(need(f32c(gate) && f32c(up) && f32c(out) && gate.numel() == up.numel() && out.numel() == gate.numel(),
              "swiglu", "gate, up, out must be contiguous F32 of equal size"));
  SF_DISPATCH(swiglu, gate, up, out);
}

Status add_inplace(TensorView out, const TensorView& x, Stream s) {
  SF_TRY(same_device("add_inplace", s, {&out, &x}));
  SF_TRY(need(f32c(out) && f32c(x) && out.numel() == x.numel(), "add_inplace", "contiguous F32 of equal size"));
  SF_DISPATCH(add_inplace, out, x);
}

Status add_rms_norm(TensorView x, const TensorView& delta, const TensorView& w, float eps, TensorView out,
                    Stream s) {
  SF_TRY(same_device("add_rms_norm", s, {&x, &delta, &w, &out}));
  SF_TRY(need(f32c(x) && f32c(w) && f32c(out) && x.ndim == 2, "add_rms_norm", "x, w, out must be contiguous F32"));
  SF_TRY(need(!delta.data || (f32c(delta) && delta.numel() == x.numel()), "add_rms_norm",
              "delta must be contiguous F32 of x's size"));
  SF_TRY(need(!overlap(delta, x) && !overlap(delta, out), "add_rms_norm", "delta must not overlap x or out"));
  SF_TRY(need(w.numel() == x.shape[1] && out.numel() == x.numel(), "add_rms_norm",
              "shape mismatch x" + x.shape_str() + " w" + w.shape_str() + " out" + out.shape_str()));
  SF_DISPATCH(add_rms_norm, x, delta, w, eps, out);
}

Status linear(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y, Stream s) {
  SF_TRY(same_device("linear", s, {&x, &w, &bias, &y}));
  SF_TRY(need(x.ndim == 2 && w.ndim == 2 && y.ndim == 2, "linear", "x, w, y must be 2-D"));
  SF_TRY(need(x.shape[1] == w.shape[1] && y.shape[0] == x.shape[0] && y.shape[1] == w.shape[0], "linear",
              "shape mismatch x" + x.shape_str() + " w" + w.shape_str() + " y" + y.shape_str()));
  SF_TRY(need(x.stride[1] == 1 && w.stride[1] == 1 && y.stride[1] == 1, "linear", "rows must be contiguous"));
  SF_TRY(need(x.data && w.data && y.data, "linear", "x, w and y need data"));
  SF_TRY(need(!bias.data || (bias.numel() == w.shape[0] && bias.dtype == DType::kF32 && bias.contiguous()),
              "linear", "bias must have out F32 elements"));
  SF_TRY(need(!overlap(x, y), "linear", "y must not overlap x"));
  if (s.device == Device::kCpu)
    SF_TRY(need(x.dtype == DType::kF32 && w.dtype == DType::kF32 && y.dtype == DType::kF32, "linear", "CPU linear is F32"));
  SF_DISPATCH(linear, x, w, bias, y);
}

namespace {
Status check_gemv(const char* op, const TensorView& x, const TensorView& w, const TensorView& bias,
                  const TensorView& y) {
  SF_TRY(need(x.ndim == 2 && w.ndim == 2 && y.ndim == 2 && x.shape[0] >= 1 && y.shape[0] == x.shape[0],
              op, "x [n, in], w [out, in], y [n, out], n >= 1"));
  SF_TRY(need(x.shape[1] == w.shape[1] && y.shape[1] == w.shape[0], op,
              "shape mismatch x" + x.shape_str() + " w" + w.shape_str() + " y" + y.shape_str()));
  SF_TRY(need(x.stride[1] == 1 && w.stride[1] == 1 && y.stride[1] == 1, op, "rows must be contiguous"));
  SF_TRY(need(x.shape[0] == 1 || (x.stride[0] == x.shape[1] && y.stride[0] == y.shape[1]), op,
              "several rows need x and y contiguous"));
  SF_TRY(need(x.dtype == DType::kF32 && y.dtype == DType::kF32 && (w.dtype == DType::kF32 || w.dtype == DType::kBF16),
              op, std::string("x and y F32, w F32 or BF16; got w ") + dtype_name(w.dtype)));
  SF_TRY(need(!overlap(x, y), op, "y must not overlap x"));
  return need(!bias.data || (bias.numel() == w.shape[0] && bias.dtype == DType::kF32), op,
              "bias must have out F32 elements");
}
}  // namespace

Status gemv(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y, Stream s) {
  SF_TRY(same_device("gemv", s, {&x, &w, &bias, &y}));
  SF_TRY(check_gemv("gemv", x, w, bias, y));
  SF_DISPATCH(gemv, x, w, bias, y);
}

Status gemv_parts(const TensorView& x, const GemvPart* parts, int n_parts, Stream s) {
  SF_TRY(need(parts && n_parts >= 1 && n_parts <= kGemvMaxParts, "gemv_parts",
              "1 to " + std::to_string(kGemvMaxParts) + " parts, got " + std::to_string(n_parts)));
  for (int i = 0; i < n_parts; ++i) {
    const GemvPart& p = parts[i];
    SF_TRY(same_device("gemv_parts", s, {&x, &p.w, &p.bias, &p.y}));
    SF_TRY(check_gemv("gemv_parts", x, p.w, p.bias, p.y));
    SF_TRY(need(p.w.dtype == parts[0].w.dtype, "gemv_parts", "every part's w of one dtype"));
    for (int j = 0; j < i; ++j)
      SF_TRY(need(!overlap(p.y, parts[j].y), "gemv_parts", "the parts' y must not overlap"));
  }
  SF_DISPATCH(gemv_parts, x, parts, n_parts);
}

Status gemv_swiglu(const TensorView& x, const TensorView& w_gate, const TensorView& w_up, TensorView y, Stream s) {
  SF_TRY(same_device("gemv_swiglu", s, {&x, &w_gate, &w_up, &y}));
  const TensorView none{};
  SF_TRY(check_gemv("gemv_swiglu", x, w_gate, none, y));
  SF_TRY(check_gemv("gemv_swiglu", x, w_up, none, y));
  SF_TRY(need(w_gate.dtype == w_up.dtype && w_gate.stride[0] == w_up.stride[0], "gemv_swiglu",
              "w_gate and w_up of one dtype and row stride"));
  SF_DISPATCH(gemv_swiglu, x, w_gate, w_up, y);
}

Status cast(const TensorView& x, TensorView out, Stream s) {
  SF_TRY(same_device("cast", s, {&x, &out}));
  SF_TRY(need(x.contiguous() && out.contiguous() && x.numel() == out.numel(), "cast",
              "x, out must be contiguous of equal size, got x" + x.shape_str() + " out" + out.shape_str()));
  auto is_float = [](DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; };
  const bool ok = is_float(x.dtype) && is_float(out.dtype) &&
                  (x.dtype == out.dtype || x.dtype == DType::kF32 || out.dtype == DType::kF32);
  SF_TRY(need(ok, "cast", std::string("unsupported conversion ") + dtype_name(x.dtype) + " -> " + dtype_name(out.dtype) +
                              " (F32 <-> F16/BF16, or equal dtypes)"));
  SF_DISPATCH(cast, x, out);
}

Status attention_dense(const TensorView& q, const TensorView& k, const TensorView& v, TensorView out,
                       TensorView lse, const AttentionParams& p, Stream s) {
  SF_TRY(same_device("attention_dense", s, {&q, &k, &v, &out, &lse}));
  SF_TRY(need(q.ndim == 3 && k.ndim == 3 && v.ndim == 3 && out.ndim == 3, "attention_dense", "q, k, v, out are 3-D"));
  // F32 everywhere (the reference kernels); on CUDA also BF16 q/k/v/out (cuDNN's fused kernel).
  const bool bf16 = q.dtype == DType::kBF16;
  const auto io = [&](const TensorView& t) { return t.contiguous() && t.dtype == (bf16 ? DType::kBF16 : DType::kF32); };
  SF_TRY(need(io(q) && io(k) && io(v) && io(out) && f32c(lse), "attention_dense",
              "contiguous tensors: q, k, v, out all F32 (or all BF16 on CUDA), lse F32"));
  SF_TRY(need(!bf16 || s.device == Device::kCuda, "attention_dense", "BF16 inputs need the CUDA backend"));
  SF_TRY(need(k.shape == v.shape && q.shape[2] == k.shape[2], "attention_dense", "k/v shape mismatch"));
  SF_TRY(need(k.shape[1] > 0 && q.shape[1] % k.shape[1] == 0, "attention_dense", "n_heads must be a multiple of n_kv_heads"));
  SF_TRY(need(out.shape == q.shape, "attention_dense", "out must match q"));
  SF_TRY(need(lse.numel() == q.shape[0] * q.shape[1], "attention_dense", "lse must be [n_heads, n_q]"));
  SF_TRY(need(q.numel() == 0 || (q.data && k.data && v.data && out.data && lse.data), "attention_dense",
              "q, k, v, out and lse need data"));
  SF_DISPATCH(attention_dense, q, k, v, out, lse, p);
}

}  // namespace sf::kernels
