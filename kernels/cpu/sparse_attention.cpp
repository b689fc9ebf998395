// CPU sparse attention over the unified index: the fast kernel and an exact reference.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_sparse.h"

namespace sf::kernels::cpu {
namespace {

// BLAS runs single-threaded inside our pool (see blas_ops.cpp: its own threads oversubscribe).
void serial_blas_once() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

constexpr int64_t kQBlock = kSparseBlock;
// Key tile: as in the dense kernel, 64 x 256 fp32 scores (64 KiB) stay in L2; runs of adjacent
// block entries and batches of gathered columns are both cut to this width, so a computed
// 64-key block costs what it costs in the dense kernel.
constexpr int64_t kKTile = 256;

// Per-thread scratch, reused across tasks of one parallel_for range.
struct Scratch {
  std::vector<float> s, m, l, kbuf, vbuf;
  std::vector<int64_t> lim;
  explicit Scratch(int64_t d)
      : s(size_t(kQBlock * kKTile)),
        m(size_t(kQBlock)),
        l(size_t(kQBlock)),
        kbuf(size_t(kKTile * d)),
        vbuf(size_t(kKTile * d)),
        lim(size_t(kQBlock)) {}
};

// One key tile of the online softmax: scores = scale * Q K^T over tn keys (K rows at kp with
// leading dimension ldk), row i sees the first lim[i] of them; then O = O * alpha + P V.
void tile_step(const float* qp, int64_t ldq, int64_t rows, int64_t d, float scale, const float* kp,
               int64_t ldk, const float* vp, int64_t ldv, int64_t tn, Scratch& w, float* o,
               int64_t ldo) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(tn), int(d), scale, qp,
              int(ldq), kp, int(ldk), 0.f, w.s.data(), int(tn));
  bool any = false;
  for (int64_t i = 0; i < rows; ++i) {
    float* sr = w.s.data() + i * tn;
    const int64_t lim = w.lim[size_t(i)];
    float mx = w.m[size_t(i)];
    for (int64_t j = 0; j < lim; ++j) mx = std::max(mx, sr[j]);
    if (lim == 0 || mx == -std::numeric_limits<float>::infinity()) {
      if (any_nan(sr, lim)) w.l[size_t(i)] = std::numeric_limits<float>::quiet_NaN();
      std::fill(sr, sr + tn, 0.f);
      continue;
    }
    any = true;
    const float alpha = std::exp(w.m[size_t(i)] - mx);  // 0 on the first visible tile
    const float sum = exp_sub_sum(sr, lim, mx);
    std::fill(sr + lim, sr + tn, 0.f);
    w.l[size_t(i)] = w.l[size_t(i)] * alpha + sum;
    w.m[size_t(i)] = mx;
    if (alpha != 1.f)
      for (int64_t c = 0; c < d; ++c) o[i * ldo + c] *= alpha;
  }
  if (any)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d), int(tn), 1.f,
                w.s.data(), int(tn), vp, int(ldv), 1.f, o, int(ldo));
}

}  // namespace

Status attention_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SparseIndex& idx, TensorView out, TensorView lse,
                        const AttentionParams& p) {
  const int64_t nq = q.shape[0], hq = q.shape[1], d = q.shape[2];
  const int64_t nk = k.shape[0], hkv = k.shape[1];
  const int64_t group = hq / hkv;
  const float scale = p.scale > 0.f ? p.scale : 1.f / std::sqrt(float(d));
  const int64_t n_qb = idx.n_qblocks;
  const float* qp = q.ptr<float>();
  const float* kp = k.ptr<float>();
  const float* vp = v.ptr<float>();
  float* op = out.ptr<float>();
  float* lp = lse.ptr<float>();
  const int64_t ldq = hq * d, ldk = hkv * d;
  serial_blas_once();
  // Tasks = (head, query block), later query blocks first: under a causal index they tend to
  // hold more keys, and the pool hands out ranges dynamically, so the light ones fill the tail.
  parallel_for(size_t(hq * n_qb), [&](size_t tb, size_t te) {
    Scratch w(d);
    for (size_t t = tb; t < te; ++t) {
      const int64_t h = int64_t(t) % hq;
      const int64_t qb = n_qb - 1 - int64_t(t) / hq;
      const int64_t kvh = h / group;
      const SparseSlotGeometry g = sparse_slot_geometry(nq, nk, p.q_offset, qb);
      const int64_t r0 = qb * kQBlock, rows = g.rows;
      const size_t slot = idx.slot(int(h), qb);
      const int32_t* bo = idx.block_offset.data() + slot * size_t(idx.max_blocks);
      const int32_t* ci = idx.column_index.data() + slot * size_t(idx.max_cols);
      const int32_t bc = idx.block_count[slot], cc = idx.column_count[slot];
      const float* qh = qp + r0 * ldq + h * d;
      const float* kh = kp + kvh * d;
      const float* vh = vp + kvh * d;
      float* o = op + r0 * ldq + h * d;
      for (int64_t i = 0; i < rows; ++i) std::fill(o + i * ldq, o + i * ldq + d, 0.f);
      std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
      std::fill(w.l.begin(), w.l.end(), 0.f);
      // Runs of adjacent block entries: one contiguous key range, read in place.
      for (int32_t b = 0; b < bc;) {
        const int64_t k0 = bo[b];
        int64_t k1 = std::min<int64_t>(k0 + kSparseBlock, g.kend);
        for (++b; b < bc && bo[b] == k1 && k1 - k0 + kSparseBlock <= kKTile; ++b)
          k1 = std::min<int64_t>(int64_t(bo[b]) + kSparseBlock, g.kend);
        for (int64_t i = 0; i < rows; ++i)
          w.lim[size_t(i)] = std::clamp<int64_t>(std::min(nk, g.base + i + 1) - k0, 0, k1 - k0);
        tile_step(qh, ldq, rows, d, scale, kh + k0 * ldk, ldk, vh + k0 * ldk, ldk, k1 - k0, w, o,
                  ldq);
      }
      // Columns: gather up to kKTile K/V rows into the per-thread buffers. Sorted ascending, so
      // each row's visible columns are a prefix of the batch.
      for (int32_t c0 = 0; c0 < cc; c0 += int32_t(kKTile)) {
        const int64_t tn = std::min<int64_t>(kKTile, cc - c0);
        for (int64_t j = 0; j < tn; ++j) {
          std::memcpy(w.kbuf.data() + j * d, kh + int64_t(ci[c0 + j]) * ldk,
                      size_t(d) * sizeof(float));
          std::memcpy(w.vbuf.data() + j * d, vh + int64_t(ci[c0 + j]) * ldk,
                      size_t(d) * sizeof(float));
        }
        int64_t vis = 0;
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t limit = std::min(nk, g.base + i + 1);
          while (vis < tn && ci[c0 + vis] < limit) ++vis;
          w.lim[size_t(i)] = vis;
        }
        tile_step(qh, ldq, rows, d, scale, w.kbuf.data(), d, w.vbuf.data(), d, tn, w, o, ldq);
      }
      for (int64_t i = 0; i < rows; ++i)  // (no selected key: 0 and -inf, as the dense kernel)
        finish_row(w.m[size_t(i)], w.l[size_t(i)], o + i * ldq, d, &lp[h * nq + r0 + i]);
    }
  });
  return Status::ok();
}

Status attention_sparse_ref(const TensorView& q, const TensorView& k, const TensorView& v,
                            const SparseIndex& idx, TensorView out, TensorView lse,
                            const AttentionParams& p) {
  const int64_t nq = q.shape[0], hq = q.shape[1], d = q.shape[2];
  const int64_t nk = k.shape[0], hkv = k.shape[1];
  const int64_t group = hq / hkv;
  const double scale = p.scale > 0.f ? double(p.scale) : 1.0 / std::sqrt(double(d));
  const float* qp = q.ptr<float>();
  const float* kp = k.ptr<float>();
  const float* vp = v.ptr<float>();
  std::vector<int64_t> keys;
  std::vector<double> s, acc(static_cast<size_t>(d));
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t kvh = h / group;
    for (int64_t qb = 0; qb < idx.n_qblocks; ++qb) {
      const SparseSlotGeometry g = sparse_slot_geometry(nq, nk, p.q_offset, qb);
      const size_t slot = idx.slot(int(h), qb);
      keys.clear();
      for (int32_t b = 0; b < idx.block_count[slot]; ++b) {
        const int64_t off = idx.block_offset[slot * size_t(idx.max_blocks) + size_t(b)];
        for (int64_t j = off; j < std::min<int64_t>(off + kSparseBlock, g.kend); ++j)
          keys.push_back(j);
      }
      for (int32_t c = 0; c < idx.column_count[slot]; ++c)
        keys.push_back(idx.column_index[slot * size_t(idx.max_cols) + size_t(c)]);
      for (int64_t i = 0; i < g.rows; ++i) {
        const int64_t row = qb * kQBlock + i;
        const int64_t limit = std::min(nk, g.base + i + 1);
        const float* qr = qp + (row * hq + h) * d;
        s.clear();
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j : keys) {
          if (j >= limit) {
            s.push_back(-std::numeric_limits<double>::infinity());
            continue;
          }
          const float* kr = kp + (j * hkv + kvh) * d;
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += double(qr[c]) * double(kr[c]);
          s.push_back(dot * scale);
          // NaN propagates (std::max would skip it): a NaN score makes the row NaN.
          mx = std::isnan(dot) || std::isnan(mx) ? std::numeric_limits<double>::quiet_NaN()
                                                 : std::max(mx, dot * scale);
        }
        float* orow = out.ptr<float>() + (row * hq + h) * d;
        if (std::isnan(mx)) {
          std::fill(orow, orow + d, std::numeric_limits<float>::quiet_NaN());
          lse.ptr<float>()[h * nq + row] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        if (mx == -std::numeric_limits<double>::infinity()) {
          std::fill(orow, orow + d, 0.f);
          lse.ptr<float>()[h * nq + row] = -std::numeric_limits<float>::infinity();
          continue;
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double l = 0;
        for (size_t x = 0; x < keys.size(); ++x) {
          if (s[x] == -std::numeric_limits<double>::infinity()) continue;
          const double e = std::exp(s[x] - mx);
          l += e;
          const float* vr = vp + (keys[x] * hkv + kvh) * d;
          for (int64_t c = 0; c < d; ++c) acc[size_t(c)] += e * double(vr[c]);
        }
        for (int64_t c = 0; c < d; ++c) orow[c] = float(acc[size_t(c)] / l);
        lse.ptr<float>()[h * nq + row] = float(mx + std::log(l));
      }
    }
  }
  return Status::ok();
}

}  // namespace sf::kernels::cpu
