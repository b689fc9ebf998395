// GEMM-backed CPU ops: linear layers and the dense attention reference.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace sf::kernels::cpu {
namespace {

// Our pool parallelizes attention over (head, query block); BLAS inside must then be serial
// or the two thread pools oversubscribe the cores.
class SerialBlas {
 public:
  SerialBlas() : prev_(openblas_get_num_threads()) { openblas_set_num_threads(1); }
  ~SerialBlas() { openblas_set_num_threads(prev_); }

 private:
  int prev_;
};

constexpr int64_t kQBlock = 64;

}  // namespace

Status linear(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y) {
  const int64_t n = x.shape[0], in = x.shape[1], out = w.shape[0];
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(out), int(in), 1.f, x.ptr<float>(),
              int(x.stride[0]), w.ptr<float>(), int(w.stride[0]), 0.f, y.ptr<float>(), int(y.stride[0]));
  if (bias.data) {
    const float* b = bias.ptr<float>();
    float* yp = y.ptr<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < out; ++j) yp[i * y.stride[0] + j] += b[j];
  }
  return Status::ok();
}

Status attention_dense(const TensorView& q, const TensorView& k, const TensorView& v, TensorView out,
                       TensorView lse, const AttentionParams& p) {
  const int64_t nq = q.shape[0], hq = q.shape[1], d = q.shape[2];
  const int64_t nk = k.shape[0], hkv = k.shape[1];
  const int64_t group = hq / hkv;
  const float scale = p.scale > 0.f ? p.scale : 1.f / std::sqrt(float(d));
  const int64_t n_qb = (nq + kQBlock - 1) / kQBlock;
  const float* qp = q.ptr<float>();
  const float* kp = k.ptr<float>();
  const float* vp = v.ptr<float>();
  float* op = out.ptr<float>();
  float* lp = lse.ptr<float>();
  SerialBlas serial;
  // Tasks = (head, query block); later query blocks see more keys, so interleave for balance.
  parallel_for(size_t(hq * n_qb), [&](size_t tb, size_t te) {
    std::vector<float> s;
    for (size_t t = tb; t < te; ++t) {
      const int64_t h = int64_t(t) % hq;
      const int64_t qb = int64_t(t) / hq;
      const int64_t kvh = h / group;
      const int64_t r0 = qb * kQBlock;
      const int64_t rows = std::min(kQBlock, nq - r0);
      // Keys visible to the last row of this block.
      int64_t kend = p.causal ? std::min(nk, p.q_offset + r0 + rows) : nk;
      float* orow0 = op + r0 * hq * d + h * d;
      if (kend <= 0) {  // fully masked rows: output 0, lse -inf
        for (int64_t i = 0; i < rows; ++i) {
          std::fill(orow0 + i * hq * d, orow0 + i * hq * d + d, 0.f);
          lp[h * nq + r0 + i] = -std::numeric_limits<float>::infinity();
        }
        continue;
      }
      s.resize(size_t(rows * kend));
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(kend), int(d), scale,
                  qp + r0 * hq * d + h * d, int(hq * d), kp + kvh * d, int(hkv * d), 0.f, s.data(), int(kend));
      for (int64_t i = 0; i < rows; ++i) {
        float* sr = s.data() + i * kend;
        const int64_t lim = p.causal ? std::clamp<int64_t>(p.q_offset + r0 + i + 1, 0, kend) : kend;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < lim; ++j) m = std::max(m, sr[j]);
        double l = 0;
        for (int64_t j = 0; j < lim; ++j) {
          sr[j] = std::exp(sr[j] - m);
          l += sr[j];
        }
        const float inv = lim > 0 ? float(1.0 / l) : 0.f;
        for (int64_t j = 0; j < lim; ++j) sr[j] *= inv;
        for (int64_t j = lim; j < kend; ++j) sr[j] = 0.f;
        lp[h * nq + r0 + i] = lim > 0 ? m + float(std::log(l)) : -std::numeric_limits<float>::infinity();
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(kend), 1.f, s.data(), int(kend),
                  vp + kvh * d, int(hkv * d), 0.f, orow0, int(hq * d));
    }
  });
  return Status::ok();
}

}  // namespace sf::kernels::cpu
