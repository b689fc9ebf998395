// CPU kv_importance: the window's scores are recomputed tile by tile (keys x window rows), so
// memory stays at one [window, tile] score buffer per task regardless of prompt length.
#include "kernels/kv_importance.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace sf::kernels::cpu {
namespace {
constexpr int64_t kKeyTile = 256;
}  // namespace

Status kv_importance(const TensorView& q, const TensorView& k, const TensorView& lse,
                     const ImportanceParams& p, TensorView out) {
  const int64_t nq = q.shape[0], hq = q.shape[1], d = q.shape[2], nk = k.shape[0], hkv = k.shape[1];
  const int64_t group = hq / hkv;
  const int64_t W = std::min<int64_t>(p.window, nq), r0 = nq - W;
  const float scale = p.scale > 0.f ? p.scale : 1.f / std::sqrt(float(d));
  const float* qp = q.ptr<float>();
  const float* kp = k.ptr<float>();
  const float* lp = lse.ptr<float>();
  // Our pool provides the parallelism; BLAS stays serial inside it (see blas_ops.cpp).
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
  std::vector<float> acc(size_t(hkv * nk), 0.f);
  const int64_t n_tiles = (nk + kKeyTile - 1) / kKeyTile;
  // Tasks own disjoint key tiles, so column sums need no reduction across tasks.
  parallel_for(size_t(n_tiles), [&](size_t tb, size_t te) {
    std::vector<float> s(size_t(W * kKeyTile));
    for (size_t t = tb; t < te; ++t) {
      const int64_t j0 = int64_t(t) * kKeyTile, tn = std::min(kKeyTile, nk - j0);
      // Window rows that see none of this tile's keys are skipped (causal).
      const int64_t first_row = std::max<int64_t>(0, j0 - p.q_offset - r0);
      if (first_row >= W) continue;
      const int64_t rows = W - first_row;
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t g = h / group;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(tn), int(d), scale,
                    qp + (r0 + first_row) * hq * d + h * d, int(hq * d), kp + j0 * hkv * d + g * d,
                    int(hkv * d), 0.f, s.data(), int(tn));
        float* a = acc.data() + g * nk + j0;
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t r = r0 + first_row + i;
          const float l = lp[h * nq + r];
          if (!(l > -std::numeric_limits<float>::infinity())) continue;
          const int64_t lim = std::clamp<int64_t>(p.q_offset + r + 1 - j0, 0, tn);
          float* sr = s.data() + i * tn;
          // Recomputed scores can exceed lse by rounding; exp_sub_sum needs s - lse <= 0.
          for (int64_t j = 0; j < lim; ++j) sr[j] = std::min(sr[j], l);
          exp_sub_sum(sr, lim, l);
          for (int64_t j = 0; j < lim; ++j) a[j] += sr[j];
        }
      }
    }
  });
  float* o = out.ptr<float>();
  for (int64_t g = 0; g < hkv; ++g) max_pool_keys(acc.data() + g * nk, nk, p.pool, o + g * nk);
  return Status::ok();
}

}  // namespace sf::kernels::cpu

namespace sf::kernels {

void max_pool_keys(const float* a, int64_t n, int pool, float* out) {
  const int64_t half = pool / 2;
  for (int64_t j = 0; j < n; ++j) {
    float m = a[j];
    for (int64_t u = std::max<int64_t>(0, j - half); u <= std::min(n - 1, j + half); ++u)
      m = std::max(m, a[u]);
    out[j] = m;
  }
}

}  // namespace sf::kernels
