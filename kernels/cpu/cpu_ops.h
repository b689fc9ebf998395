// CPU backend: plain loops + OpenBLAS for GEMMs, parallelized with common/thread_pool.
// Called through kernels/api.h, which validates shapes and dtypes first.
#pragma once
#include <cmath>
#include <limits>

#include "kernels/api.h"

namespace sf::kernels::cpu {

Status embedding(const TensorView& table, const int32_t* ids, int64_t n, TensorView out);
Status rms_norm(const TensorView& x, const TensorView& w, float eps, TensorView out);
Status rope(TensorView x, const int32_t* positions, const RopeParams& p);
Status swiglu(const TensorView& gate, const TensorView& up, TensorView out);
Status add_inplace(TensorView out, const TensorView& x);
Status linear(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y);
Status gemv(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y);
// gemv() per part; gemv() twice then swiglu(); add_inplace() then rms_norm(): the references.
Status gemv_parts(const TensorView& x, const GemvPart* parts, int n_parts);
Status gemv_swiglu(const TensorView& x, const TensorView& w_gate, const TensorView& w_up, TensorView y);
Status add_rms_norm(TensorView x, const TensorView& delta, const TensorView& w, float eps, TensorView out);
Status cast(const TensorView& x, TensorView out);
Status attention_dense(const TensorView& q, const TensorView& k, const TensorView& v, TensorView out,
                       TensorView lse, const AttentionParams& p);

// x[j] = exp(x[j] - sub) for j < n, returns the sum; x[j] - sub must be <= 0 (scores minus a
// row max). Branch-free so it vectorizes under -march=x86-64-v3 (libm's scalar expf was ~25% of
// 8K-token prefill): exp(v) = 2^k * exp(r), |r| <= ln2/2, degree-6 Taylor polynomial, relative
// error < 2e-7. Shared by the dense and sparse attention kernels and the estimators.
float exp_sub_sum(float* x, int64_t n, float sub);
// The online softmax's row rules, shared by the dense and sparse kernels. A score that is NaN must
// not pass for a row that sees no key: max() skips NaN, so a row of NaN scores would look masked
// (-inf max) and one NaN among finite ones would leave l NaN, which `l > 0` reads as "no key".
// A tile whose visible scores have no finite maximum marks its row NaN (l = NaN) when any is NaN.
inline bool any_nan(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (x[j] != x[j]) return true;
  return false;
}
// A finished row: out / l and lse = m + log l; a row with a NaN score gets NaN out and lse; a row
// that sees no key gets 0 (as accumulated) and lse -inf.
inline void finish_row(float m, float l, float* o, int64_t d, float* lse) {
  if (l > 0.f) {
    const float inv = 1.f / l;
    for (int64_t c = 0; c < d; ++c) o[c] *= inv;
    *lse = m + std::log(l);
  } else if (l != l) {
    for (int64_t c = 0; c < d; ++c) o[c] = l;
    *lse = l;
  } else {
    *lse = -std::numeric_limits<float>::infinity();
  }
}
// x[0, n) <- softmax(x[0, n)) (max-subtracted; n <= 0: nothing).
void softmax_in_place(float* x, int64_t n);

// Inverse frequencies for RoPE (rot_dim/2 values), shared by CPU and CUDA planning.
void rope_inv_freq(const RopeParams& p, int rot_dim, float* out);

}  // namespace sf::kernels::cpu
