// GEMM-backed CPU ops: linear layers and the dense attention reference.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "common/dtype.h"
#include "common/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace sf::kernels::cpu {
namespace {

// All CPU parallelism goes through common/thread_pool; BLAS runs single-threaded inside it.
// Mixing OpenBLAS's own threads with ours oversubscribes the cores: its idle workers spin in
// sched_yield while our pool runs attention (measured: ~20% of prefill time on 2 cores).
void serial_blas_once() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

constexpr int64_t kQBlock = 64;
constexpr int64_t kKTile = 256;

}  // namespace

Status linear(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y) {
  serial_blas_once();
  const int64_t n = x.shape[0], in = x.shape[1], out = w.shape[0];
  // Split output features across the pool; blocks of 64 keep each SGEMM's B panel whole.
  const int64_t kCols = 64;
  const int64_t n_blocks = (out + kCols - 1) / kCols;
  const size_t grain = size_t(std::max<int64_t>(1, (1 << 22) / std::max<int64_t>(1, n * in * kCols)));
  parallel_for(size_t(n_blocks), [&](size_t b, size_t e) {
    const int64_t c0 = int64_t(b) * kCols;
    const int64_t c1 = std::min(out, int64_t(e) * kCols);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(c1 - c0), int(in), 1.f, x.ptr<float>(),
                int(x.stride[0]), w.ptr<float>() + c0 * w.stride[0], int(w.stride[0]), 0.f, y.ptr<float>() + c0,
                int(y.stride[0]));
  }, grain);
  if (bias.data) {
    const float* bp = bias.ptr<float>();
    float* yp = y.ptr<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < out; ++j) yp[i * y.stride[0] + j] += bp[j];
  }
  return Status::ok();
}

Status gemv(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y) {
  const int64_t in = x.shape[1], out = w.shape[0], n = x.shape[0];
  const bool bf16 = w.dtype == DType::kBF16;
  parallel_for(size_t(out), [&](size_t b, size_t e) {
    std::vector<float> row(bf16 ? size_t(in) : 0);
    for (size_t j = b; j < e; ++j) {
      const float* wr = nullptr;
      if (bf16) {
        const uint16_t* h = static_cast<const uint16_t*>(w.data) + int64_t(j) * w.stride[0];
        for (int64_t c = 0; c < in; ++c) row[size_t(c)] = bf16_to_f32(h[c]);
        wr = row.data();
      } else {
        wr = w.ptr<float>() + int64_t(j) * w.stride[0];
      }
      // Each row of x against the weight row (widened once), each sum as the one-row case's.
      for (int64_t r = 0; r < n; ++r) {
        const float* xp = x.ptr<float>() + r * x.stride[0];
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight partial sums: vectorizes, fixed order
        int64_t c = 0;
        for (; c + 8 <= in; c += 8)
          for (int u = 0; u < 8; ++u) acc[u] += wr[c + u] * xp[c + u];
        float sum = 0.f;
        for (; c < in; ++c) sum += wr[c] * xp[c];
        for (float a : acc) sum += a;
        y.ptr<float>()[r * y.stride[0] + int64_t(j)] = sum + (bias.data ? bias.ptr<float>()[j] : 0.f);
      }
    }
  }, 64);
  return Status::ok();
}

Status gemv_parts(const TensorView& x, const GemvPart* parts, int n_parts) {
  for (int i = 0; i < n_parts; ++i) SF_TRY(gemv(x, parts[i].w, parts[i].bias, parts[i].y));
  return Status::ok();
}

Status gemv_swiglu(const TensorView& x, const TensorView& w_gate, const TensorView& w_up, TensorView y) {
  std::vector<float> up(size_t(x.shape[0] * w_up.shape[0]));
  const TensorView none{};
  TensorView uv = TensorView::make(up.data(), DType::kF32, {x.shape[0], w_up.shape[0]});
  SF_TRY(gemv(x, w_gate, none, y));
  SF_TRY(gemv(x, w_up, none, uv));
  return swiglu(y, uv, y);
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
  serial_blas_once();
  // Tasks = (head, query block), latest blocks first so the long ones don't finish last. Within a task, keys stream in tiles of kKTile with an online
  // softmax (flash-style), so the score tile stays in L2 (64 x 256 fp32 = 64 KiB) at any length.
  parallel_for(size_t(hq * n_qb), [&](size_t tb, size_t te) {
    std::vector<float> s(static_cast<size_t>(kQBlock * kKTile)), m(static_cast<size_t>(kQBlock)), l(static_cast<size_t>(kQBlock));
    for (size_t t = tb; t < te; ++t) {
      const int64_t h = int64_t(t) % hq;
      const int64_t qb = n_qb - 1 - int64_t(t) / hq;  // heaviest (latest) query blocks first
      const int64_t kvh = h / group;
      const int64_t r0 = qb * kQBlock;
      const int64_t rows = std::min(kQBlock, nq - r0);
      const int64_t ld = hq * d;
      // Keys visible to the last row of this block.
      const int64_t kend = p.causal ? std::clamp<int64_t>(p.q_offset + r0 + rows, 0, nk) : nk;
      float* o = op + r0 * ld + h * d;
      for (int64_t i = 0; i < rows; ++i) std::fill(o + i * ld, o + i * ld + d, 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t k0 = 0; k0 < kend; k0 += kKTile) {
        const int64_t tn = std::min(kKTile, kend - k0);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(tn), int(d), scale, qp + r0 * ld + h * d,
                    int(ld), kp + k0 * hkv * d + kvh * d, int(hkv * d), 0.f, s.data(), int(tn));
        for (int64_t i = 0; i < rows; ++i) {
          float* sr = s.data() + i * tn;
          const int64_t lim = p.causal ? std::clamp<int64_t>(p.q_offset + r0 + i + 1 - k0, 0, tn) : tn;
          float mx = m[size_t(i)];
          for (int64_t j = 0; j < lim; ++j) mx = std::max(mx, sr[j]);
          if (lim == 0 || mx == -std::numeric_limits<float>::infinity()) {
            if (any_nan(sr, lim)) l[size_t(i)] = std::numeric_limits<float>::quiet_NaN();
            std::fill(sr, sr + tn, 0.f);
            continue;
          }
          const float alpha = std::exp(m[size_t(i)] - mx);  // 0 on the first visible tile
          const float sum = exp_sub_sum(sr, lim, mx);
          std::fill(sr + lim, sr + tn, 0.f);
          l[size_t(i)] = l[size_t(i)] * alpha + sum;
          m[size_t(i)] = mx;
          if (alpha != 1.f)
            for (int64_t c = 0; c < d; ++c) o[i * ld + c] *= alpha;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(tn), 1.f, s.data(), int(tn),
                    vp + k0 * hkv * d + kvh * d, int(hkv * d), 1.f, o, int(ld));
      }
      for (int64_t i = 0; i < rows; ++i)
        finish_row(m[size_t(i)], l[size_t(i)], o + i * ld, d, &lp[h * nq + r0 + i]);
    }
  });
  return Status::ok();
}

}  // namespace sf::kernels::cpu
