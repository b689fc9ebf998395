// The backend-neutral kernel API. Every op takes tensor views plus a Stream and returns Status;
// it dispatches on the views' device to kernels/cpu or kernels/cuda. No service code here.
//
// Layouts (row-major, contiguous unless stated):
//   activations x: [n_tokens, hidden]            weights W: [out, in] (GGUF/HF "y = x W^T")
//   q: [n_q, n_heads, head_dim]   k, v: [n_k, n_kv_heads, head_dim]   (token-major, GQA-native)
//   lse: [n_heads, n_q] fp32, natural log of the softmax denominator incl. the row max.
#pragma once
#include <cstdint>

#include "common/status.h"
#include "common/tensor.h"

namespace sf::kernels {

struct Stream {
  Device device = Device::kCpu;
  void* handle = nullptr;  // cudaStream_t on CUDA; unused on CPU
};

struct RopeParams {
  float theta = 10000.f;
  bool neox = false;  // false: rotate adjacent pairs (GGML "normal"); true: rotate halves (HF)
  // Llama-3 frequency scaling; factor == 0 disables it.
  float scaling_factor = 0.f;
  float low_freq_factor = 1.f;
  float high_freq_factor = 4.f;
  int original_max_pos = 8192;
  int rot_dim = 0;  // 0: the whole head_dim
  // Per-pair frequency divisors (GGUF rope_freqs.weight), rot_dim/2 values; overrides scaling.
  const float* freq_factors = nullptr;
};

struct AttentionParams {
  float scale = 0.f;       // 0: 1/sqrt(head_dim)
  bool causal = true;
  int64_t q_offset = 0;    // global position of q row 0 minus that of k row 0 (causal mask)
};

// out[i,:] = table[ids[i],:]; table may be F32/F16/BF16, out is F32.
Status embedding(const TensorView& table, const int32_t* ids, int64_t n, TensorView out, Stream s = {});
// out = x / rms(x) * w, rows of x. out may alias x.
Status rms_norm(const TensorView& x, const TensorView& w, float eps, TensorView out, Stream s = {});
// In place on x: [n, heads, head_dim]; positions[n] are absolute token positions.
Status rope(TensorView x, const int32_t* positions, const RopeParams& p, Stream s = {});
// out = silu(gate) * up, elementwise. out may alias gate.
Status swiglu(const TensorView& gate, const TensorView& up, TensorView out, Stream s = {});
// out += x, elementwise.
Status add_inplace(TensorView out, const TensorView& x, Stream s = {});
// x += delta, then out = rms_norm(x, w): a residual add and the next RMSNorm in one pass, with
// add_inplace()'s and rms_norm()'s results (x is updated). delta without data: rms_norm() alone.
// out may alias x; delta must not overlap x or out.
Status add_rms_norm(TensorView x, const TensorView& delta, const TensorView& w, float eps, TensorView out,
                    Stream s = {});
// y[n, out] = x[n, in] @ w[out, in]^T (+ bias[out] if bias.data). fp32 accumulation.
Status linear(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y, Stream s = {});
// y[n, out] = x[n, in] @ w[out, in]^T (+ bias[out]): linear() for the decode step's one row (or
// a verification pass's few). x, y, bias F32; w F32 or BF16, read as stored (x is not rounded);
// fp32 accumulation. Rows contiguous (x and y wholly so with n > 1). Row i of y is, bit for bit,
// what gemv() of x's row i alone gives: the CUDA kernel reads a weight row once for up to four
// x rows, with each row's sums in the one-row order.
Status gemv(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y, Stream s = {});
// Several gemv() of one x in one launch (the decode step's Q, K and V): part i is y_i = w_i x
// (+ bias_i), each as gemv() computes it alone. parts[0, n_parts): 1..kGemvMaxParts of them,
// their w of one dtype; each part's checks are gemv()'s.
inline constexpr int kGemvMaxParts = 3;
struct GemvPart {
  TensorView w, bias, y;
};
Status gemv_parts(const TensorView& x, const GemvPart* parts, int n_parts, Stream s = {});
// y[n, out] = silu(w_gate x) * (w_up x): the MLP's gate and up gemv() and swiglu() in one launch,
// with their result where both weights are 16-byte aligned or neither (CUDA loads the pair one
// way). w_gate and w_up [out, in] of one dtype (F32 or BF16) and row stride, no bias.
// For the gemv family, y must not overlap x (nor, in gemv_parts, another part's y).
Status gemv_swiglu(const TensorView& x, const TensorView& w_gate, const TensorView& w_up, TensorView y,
                   Stream s = {});
// out = x converted elementwise: F32 -> F16/BF16 (round to nearest even), F16/BF16 -> F32
// (exact), or a copy when the dtypes match. Contiguous, equal element counts. Feeds the
// half-precision inputs of linear() on backends whose GEMMs need x and w in one dtype.
Status cast(const TensorView& x, TensorView out, Stream s = {});
// Dense attention with LSE (the reference every sparse method is measured against).
Status attention_dense(const TensorView& q, const TensorView& k, const TensorView& v,
                       TensorView out, TensorView lse, const AttentionParams& p, Stream s = {});

}  // namespace sf::kernels
