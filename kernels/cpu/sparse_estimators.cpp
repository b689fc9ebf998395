// Online sparse-index estimators (MInference Alg. 2 and 3, PSA-style thresholds, MoA spans).
//
// Per head, by its HeadPattern; every pattern ends in sparse_slot_build, which always adds the
// sink [0, sink) and the local window [base - local, kend) of each query block:
//   dense           local = base: every causal key.
//   a-shape         nothing else: sink + local window.
//   vertical-slash  softmax(q_last K^T / sqrt(d)) over causal keys for the last L = min(64, n_q)
//                   rows (plus spread_rows evenly spaced earlier rows when set); column sums ->
//                   top n_vertical columns, sums along diagonals (offset = qpos - kpos) -> top
//                   n_slash diagonals. The sink columns and the local diagonals 0..local rank
//                   first and count toward the budgets. With segment_rows, each segment of that
//                   many query rows ranks from its own scoring rows, over the keys it can reach,
//                   and the last query block from its own rows (sparse_select.h, vs_segments):
//                   a mid-sequence row then keeps the columns rows near it attend, not those the
//                   prompt's end attends.
//   block-sparse    mean-pool q and k over 64-token blocks; score = pooled_q . pooled_k; per
//                   query block, top n_blocks causal key blocks; block 0 and the key blocks under
//                   the query block's diagonal rank first. The last query block is scored
//                   exactly instead: the softmax mass of its rows in each key block.
//   moa             local window of span = alpha + beta * n_k keys before each query block
//                   (a 64-row block shares the window of its first row), plus the sink.
//   adaptive-vs     vertical-slash scores; the smallest ranked set of columns whose normalized
//                   mass reaches gamma, likewise diagonals; each count in [min_budget, max_budget].
//   adaptive-block  per query block, softmax over the pooled block scores (the last block: its
//                   exact mass, as block-sparse); the smallest ranked set reaching gamma;
//                   count in [ceil(min_budget/64), ceil(max_budget/64)] blocks.
// Ranking is deterministic: forced items first, then score descending, index ascending.
// A head counts in stats.clamped_heads when its budget exceeds what the sequence holds:
// a-shape sink + local > n_k; vertical-slash n_vertical > causal keys of the last row or
// n_slash > diagonals; block-sparse n_blocks > key blocks; moa span > n_k; adaptive min_budget
// beyond those same limits.
//
// Cost: the last-query scores are two SGEMMs (row stats, then probabilities) of (G*L) x chunk x d
// per KV-head group and 2048-key chunk, parallel over (group, chunk): memory stays O(chunk), and
// the K tile is shared by the group's query heads. Index building runs parallel over heads, each
// slot linear in its candidates (they are sorted once per head).
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "common/thread_pool.h"
#include "common/timing.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_sparse.h"
#include "kernels/sparse_select.h"

namespace sf::kernels::cpu {
namespace {

constexpr int64_t kB = kSparseBlock;
using Budget = SelectBudget;
constexpr int64_t kChunk = 2048;  // keys per scoring task: (G*64) x 2048 fp32 = 2 MiB at G = 4
static_assert(kChunk % kB == 0, "scoring chunks start on key-block boundaries");

void serial_blas_once() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool uses_vs(Pattern p) { return p == Pattern::kVerticalSlash || p == Pattern::kAdaptiveVS; }
bool uses_blocks(Pattern p) { return p == Pattern::kBlockSparse || p == Pattern::kAdaptiveBlock; }

struct Geometry {
  int64_t nq, nk, hq, hkv, group, d, n_qb, q_offset;
  float scale;
  const float* q;
  const float* k;
};

// Column sums and diagonal sums of softmax(q_row K^T * scale) over causal keys, for the scoring
// rows `rows` (sorted local row indices) of the heads in `heads`. col[h] has kend_last entries,
// diag[h] q_offset + n_q; diag may be null (columns only). row_blocks, when set, also gets each
// row's own mass per 64-key block: row_blocks[h] is [rows][ceil(kend_last / 64)]. row_probs,
// when set, gets each row's probabilities, [rows][kend_last], for the heads whose entry is
// non-empty on entry (HeadPattern::vs_cover; sized by the caller, zeros past causal limits).
void vs_scores(const Geometry& g, const std::vector<int>& heads, const std::vector<int64_t>& rows,
               std::vector<std::vector<float>>* col, std::vector<std::vector<float>>* diag,
               std::vector<std::vector<float>>* row_blocks = nullptr,
               std::vector<std::vector<float>>* row_probs = nullptr) {
  const int64_t L = int64_t(rows.size());
  const int64_t kend = std::clamp<int64_t>(g.q_offset + g.nq, 0, g.nk);
  const int64_t n_diag = g.q_offset + g.nq;
  const int64_t n_kb = ceil_div(kend, kB);
  for (int h : heads) {
    (*col)[size_t(h)].assign(size_t(kend), 0.f);
    if (diag) (*diag)[size_t(h)].assign(size_t(n_diag), 0.f);
    if (row_blocks) (*row_blocks)[size_t(h)].assign(size_t(L * n_kb), 0.f);
  }
  if (kend == 0 || L == 0) return;
  const int64_t pos_min = g.q_offset + rows.front(), pos_max = g.q_offset + rows.back();
  const int64_t kseen = std::min(kend, pos_max + 1);  // keys past the last row are never visible
  // Groups of query heads sharing a KV head.
  std::vector<std::vector<int>> groups(size_t(g.hkv));
  for (int h : heads) groups[size_t(h / g.group)].push_back(h);
  std::vector<int> gl;
  for (int64_t x = 0; x < g.hkv; ++x)
    if (!groups[size_t(x)].empty()) gl.push_back(int(x));
  const int64_t n_chunks = ceil_div(kseen, kChunk);
  const size_t n_tasks = gl.size() * size_t(n_chunks);
  // The scoring rows of q for each group, stacked head-major: row x * L + i.
  std::vector<std::vector<float>> qbuf(gl.size());
  for (size_t gi = 0; gi < gl.size(); ++gi) {
    const auto& hs = groups[size_t(gl[gi])];
    qbuf[gi].resize(hs.size() * size_t(L * g.d));
    for (size_t x = 0; x < hs.size(); ++x)
      for (int64_t i = 0; i < L; ++i)
        std::copy_n(g.q + (rows[size_t(i)] * g.hq + hs[x]) * g.d, g.d,
                    qbuf[gi].data() + (int64_t(x) * L + i) * g.d);
  }
  auto scores = [&](size_t task, std::vector<float>& s, int64_t* c0, int64_t* kc) {
    const size_t gi = task / size_t(n_chunks);
    *c0 = int64_t(task % size_t(n_chunks)) * kChunk;
    *kc = std::min(kChunk, kseen - *c0);
    const int64_t m = int64_t(groups[size_t(gl[gi])].size()) * L;
    s.resize(size_t(m * *kc));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(*kc), int(g.d), g.scale,
                qbuf[gi].data(), int(g.d), g.k + *c0 * g.hkv * g.d + int64_t(gl[gi]) * g.d,
                int(g.hkv * g.d), 0.f, s.data(), int(*kc));
  };
  auto pos = [&](int64_t i) { return g.q_offset + rows[size_t(i)]; };
  auto visible = [&](int64_t i, int64_t c0, int64_t kc) {
    return std::clamp<int64_t>(pos(i) + 1 - c0, 0, kc);
  };
  // Pass 1: per-row max and sum of each chunk.
  std::vector<std::vector<float>> part_m(n_tasks), part_l(n_tasks);
  parallel_for(n_tasks, [&](size_t tb, size_t te) {
    std::vector<float> s;
    for (size_t t = tb; t < te; ++t) {
      int64_t c0, kc;
      scores(t, s, &c0, &kc);
      const int64_t m = int64_t(s.size()) / kc;
      part_m[t].assign(size_t(m), -std::numeric_limits<float>::infinity());
      part_l[t].assign(size_t(m), 0.f);
      for (int64_t r = 0; r < m; ++r) {
        float* sr = s.data() + r * kc;
        const int64_t lim = visible(r % L, c0, kc);
        if (lim == 0) continue;
        const float mx = *std::max_element(sr, sr + lim);
        part_m[t][size_t(r)] = mx;
        part_l[t][size_t(r)] = exp_sub_sum(sr, lim, mx);
      }
    }
  });
  // Row log-sum-exp over all chunks.
  std::vector<std::vector<float>> row_lse(gl.size());
  for (size_t gi = 0; gi < gl.size(); ++gi) {
    const size_t m = groups[size_t(gl[gi])].size() * size_t(L);
    row_lse[gi].assign(m, -std::numeric_limits<float>::infinity());
    for (size_t r = 0; r < m; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < n_chunks; ++c)
        mx = std::max(mx, part_m[gi * size_t(n_chunks) + size_t(c)][r]);
      if (mx == -std::numeric_limits<float>::infinity()) continue;
      double l = 0;
      for (int64_t c = 0; c < n_chunks; ++c) {
        const size_t t = gi * size_t(n_chunks) + size_t(c);
        if (part_l[t][r] > 0.f)
          l += double(part_l[t][r]) * std::exp(double(part_m[t][r]) - double(mx));
      }
      row_lse[gi][r] = mx + float(std::log(l));
    }
  }
  // Pass 2: probabilities; columns are chunk-local (written in place), diagonal sums go to a
  // per-task partial array over the offsets this chunk reaches, reduced after.
  std::vector<std::vector<float>> part_d(n_tasks);
  std::vector<int64_t> part_omin(n_tasks);
  parallel_for(n_tasks, [&](size_t tb, size_t te) {
    std::vector<float> s;
    for (size_t t = tb; t < te; ++t) {
      int64_t c0, kc;
      scores(t, s, &c0, &kc);
      const size_t gi = t / size_t(n_chunks);
      const auto& hs = groups[size_t(gl[gi])];
      const int64_t omin = std::max<int64_t>(0, pos_min - (c0 + kc - 1));
      const int64_t omax = pos_max - c0;
      const int64_t span = omax - omin + 1;
      part_omin[t] = omin;
      if (diag) part_d[t].assign(hs.size() * size_t(span), 0.f);
      for (size_t x = 0; x < hs.size(); ++x) {
        float* cs = (*col)[size_t(hs[x])].data() + c0;
        float* ds = part_d[t].data() + x * size_t(span);
        for (int64_t i = 0; i < L; ++i) {
          const int64_t r = int64_t(x) * L + i;
          float* sr = s.data() + r * kc;
          const int64_t lim = visible(i, c0, kc);
          const float lse = row_lse[gi][size_t(r)];
          if (lim == 0 || lse == -std::numeric_limits<float>::infinity()) continue;
          exp_sub_sum(sr, lim, lse);
          for (int64_t j = 0; j < lim; ++j) cs[j] += sr[j];
          if (row_probs && !(*row_probs)[size_t(hs[x])].empty())
            std::copy_n(sr, lim, (*row_probs)[size_t(hs[x])].data() + i * kend + c0);
          if (row_blocks) {  // chunks start on block boundaries (kChunk % kB == 0)
            float* rb = (*row_blocks)[size_t(hs[x])].data() + i * n_kb + c0 / kB;
            for (int64_t j = 0; j < lim; ++j) rb[j / kB] += sr[j];
          }
          if (!diag) continue;
          // offset of (row i, key c0 + j) = pos(i) - c0 - j
          float* dr = ds + (pos(i) - c0 - omin);
          for (int64_t j = 0; j < lim; ++j) dr[-j] += sr[j];
        }
      }
    }
  });
  for (size_t gi = 0; diag && gi < gl.size(); ++gi) {
    const auto& hs = groups[size_t(gl[gi])];
    for (int64_t c = 0; c < n_chunks; ++c) {
      const size_t t = gi * size_t(n_chunks) + size_t(c);
      const size_t span = part_d[t].size() / hs.size();
      for (size_t x = 0; x < hs.size(); ++x) {
        float* dst = (*diag)[size_t(hs[x])].data() + part_omin[t];
        const float* src = part_d[t].data() + x * span;
        for (size_t o = 0; o < span; ++o) dst[o] += src[o];
      }
    }
  }
}

// Mean of k over 64-key blocks, per KV head: [hkv][n_kb * d], by pooled_mean (bf16 values).
std::vector<std::vector<float>> pool_keys(const Geometry& g) {
  const int64_t n_kb = ceil_div(g.nk, kB);
  std::vector<std::vector<float>> pk(size_t(g.hkv), std::vector<float>(size_t(n_kb * g.d), 0.f));
  parallel_for(size_t(g.hkv * n_kb), [&](size_t tb, size_t te) {
    for (size_t t = tb; t < te; ++t) {
      const int64_t kvh = int64_t(t) / n_kb, b = int64_t(t) % n_kb;
      float* dst = pk[size_t(kvh)].data() + b * g.d;
      const int64_t j1 = std::min(g.nk, (b + 1) * kB);
      for (int64_t j = b * kB; j < j1; ++j) {
        const float* src = g.k + (j * g.hkv + kvh) * g.d;
        for (int64_t c = 0; c < g.d; ++c) dst[c] += src[c];
      }
      for (int64_t c = 0; c < g.d; ++c) dst[c] = pooled_mean(dst[c], j1 - b * kB);
    }
  });
  return pk;
}

// Per-head output: the slots' blocks and columns, CSR over query blocks.
struct HeadLists {
  std::vector<int32_t> blocks, cols;
  std::vector<int64_t> bstart, cstart;  // n_qb + 1
  bool clamped = false;
};

}  // namespace

Status sparse_estimate(const TensorView& q, const TensorView& k,
                       const std::vector<HeadPattern>& patterns, int64_t q_offset, SparseIndex* out,
                       EstimatorStats* stats, std::vector<IndexCandidates>* trace,
                       std::vector<int64_t>* trace_local) {
  const auto t_start = std::chrono::steady_clock::now();
  serial_blas_once();
  Geometry g;
  g.nq = q.shape[0];
  g.hq = q.shape[1];
  g.d = q.shape[2];
  g.nk = k.shape[0];
  g.hkv = k.shape[1];
  g.group = g.hq / g.hkv;
  g.n_qb = ceil_div(g.nq, kB);
  g.q_offset = q_offset;
  g.scale = 1.f / std::sqrt(float(g.d));
  g.q = q.ptr<float>();
  g.k = k.ptr<float>();
  const int64_t kend_last = std::clamp<int64_t>(q_offset + g.nq, 0, g.nk);
  const int64_t n_diag = q_offset + g.nq;
  const int64_t n_kb = ceil_div(g.nk, kB);

  std::vector<int> vs_heads;
  bool any_block = false;
  for (int h = 0; h < int(g.hq); ++h) {
    if (uses_vs(patterns[size_t(h)].pattern)) vs_heads.push_back(h);
    any_block |= uses_blocks(patterns[size_t(h)].pattern);
  }
  // Vertical-slash scores per head and selection segment: col[h] holds n_seg x kend_last sums,
  // diag[h] n_seg x n_diag (segment s at s * kend_last / s * n_diag; segments that borrow a later
  // one's selection stay zero). One scoring pass per distinct (spread_rows, segment_rows).
  std::vector<std::vector<float>> col(size_t(g.hq)), diag(size_t(g.hq));
  std::vector<VsSegments> segs(size_t(g.hq));
  // vs_cover heads: the scoring rows' softmax, [rows][kend_last] (their one segment's rows).
  std::vector<std::vector<float>> probs(size_t(g.hq));
  {
    std::vector<std::pair<int64_t, int64_t>> settings;
    for (int h : vs_heads)
      settings.emplace_back(patterns[size_t(h)].spread_rows, patterns[size_t(h)].segment_rows);
    std::sort(settings.begin(), settings.end());
    settings.erase(std::unique(settings.begin(), settings.end()), settings.end());
    for (const auto& [sp, sr] : settings) {
      std::vector<int> hs;
      for (int h : vs_heads)
        if (patterns[size_t(h)].spread_rows == sp && patterns[size_t(h)].segment_rows == sr)
          hs.push_back(h);
      const VsSegments sg = vs_segments(g.nq, sp, sr);
      for (int h : hs) {
        segs[size_t(h)] = sg;
        col[size_t(h)].assign(size_t(sg.count() * kend_last), 0.f);
        diag[size_t(h)].assign(size_t(sg.count() * n_diag), 0.f);
      }
      std::vector<std::vector<float>> sc(size_t(g.hq)), sd(size_t(g.hq));
      for (int64_t si = 0; si < sg.count(); ++si) {
        if (sg.rows[size_t(si)].empty()) continue;
        // vs_cover heads (one segment: check_pattern) also keep each scoring row's softmax.
        bool want_probs = false;
        for (int h : hs)
          if (patterns[size_t(h)].vs_cover) {
            probs[size_t(h)].assign(sg.rows[size_t(si)].size() * size_t(kend_last), 0.f);
            want_probs = true;
          }
        vs_scores(g, hs, sg.rows[size_t(si)], &sc, &sd, nullptr, want_probs ? &probs : nullptr);
        for (int h : hs) {
          std::copy(sc[size_t(h)].begin(), sc[size_t(h)].end(),
                    col[size_t(h)].begin() + si * kend_last);
          std::copy(sd[size_t(h)].begin(), sd[size_t(h)].end(),
                    diag[size_t(h)].begin() + si * n_diag);
        }
      }
    }
  }
  std::vector<std::vector<float>> pooled_k;
  // Block family, last query block: its rows are scored exactly (softmax mass per key block)
  // instead of by pooled q. Those rows give the logits a decode node starts from, and a pooled
  // query misses a key block that only a few of its rows attend (a retrieval head reading a
  // pass key 1.5K tokens back at 2K was the measured case).
  std::vector<std::vector<float>> last_mass(size_t(g.hq)), last_cols(size_t(g.hq));
  // last_block_rows heads: each last-block row's mass per key block, [rows][n_kb] (empty else).
  std::vector<std::vector<float>> last_rows(size_t(g.hq));
  if (any_block && g.n_qb > 0) {
    pooled_k = pool_keys(g);
    std::vector<int> bh;
    for (int h = 0; h < int(g.hq); ++h)
      if (uses_blocks(patterns[size_t(h)].pattern)) bh.push_back(h);
    std::vector<int64_t> rows;
    for (int64_t r = (g.n_qb - 1) * kB; r < g.nq; ++r) rows.push_back(r);
    bool per_row = false;
    for (int h : bh) per_row |= patterns[size_t(h)].last_block_rows != 0;
    vs_scores(g, bh, rows, &last_cols, nullptr, per_row ? &last_rows : nullptr);
    for (int h : bh) {
      if (!patterns[size_t(h)].last_block_rows) last_rows[size_t(h)].clear();
      auto& m = last_mass[size_t(h)];
      m.assign(size_t(n_kb), 0.f);
      const auto& lc = last_cols[size_t(h)];
      for (size_t j = 0; j < lc.size(); ++j) m[j / size_t(kB)] += lc[j];
      for (float& x : m) x /= float(rows.size());  // each row's mass sums to 1
    }
  }

  // KV-group-shared ranking (HeadPattern::share_group): a sharing set's vertical-slash heads rank
  // by their summed column and diagonal sums; its block heads by their summed block
  // probabilities (computed per query block below).
  const std::vector<int> leader = share_leaders(patterns, int(g.group));
  std::vector<std::vector<float>> shared_col, shared_diag;
  share_sums(leader, col, &shared_col);
  share_sums(leader, diag, &shared_diag);
  std::vector<std::vector<int>> members(size_t(g.hq));
  for (int h = 0; h < int(g.hq); ++h) members[size_t(leader[size_t(h)])].push_back(h);

  if (stats->keep_columns) {
    stats->columns.assign(size_t(g.hq), {});
    for (int h : vs_heads) {
      const VsSegments& sg = segs[size_t(h)];
      const int64_t sl = sg.count() - 1;  // the last segment: its rows end the prompt
      auto& c = stats->columns[size_t(h)];
      c.assign(size_t(g.nk), 0.f);
      std::copy_n(col[size_t(h)].begin() + sl * kend_last, kend_last, c.begin());
    }
    for (int h = 0; h < int(g.hq); ++h)
      if (uses_blocks(patterns[size_t(h)].pattern) && !last_cols[size_t(h)].empty()) {
        auto& c = stats->columns[size_t(h)];
        c.assign(size_t(g.nk), 0.f);
        std::copy(last_cols[size_t(h)].begin(), last_cols[size_t(h)].end(), c.begin());
      }
  }
  if (trace) trace->assign(size_t(g.hq * g.n_qb), IndexCandidates{});
  if (trace_local) trace_local->assign(size_t(g.hq), 0);
  std::vector<HeadLists> lists(size_t(g.hq));
  parallel_for(size_t(g.hq), [&](size_t hb, size_t he) {
    for (size_t h = hb; h < he; ++h) {
      const HeadPattern& hp = patterns[h];
      HeadLists& hl = lists[h];
      hl.bstart.assign(size_t(g.n_qb + 1), 0);
      hl.cstart.assign(size_t(g.n_qb + 1), 0);
      int64_t local = hp.local;
      // Vertical-slash family: the selection of each segment (one when segment_rows is 0).
      std::vector<std::vector<int32_t>> seg_cols(1), seg_diags(1);
      const VsSegments& vsg = segs[h];
      // Block family: pooled q and one chunk of block scores per head of the sharing set (h
      // alone unless it shares), and a shared set's summed probability row.
      const std::vector<int>& set = members[size_t(leader[h])];
      const bool shared = uses_blocks(hp.pattern) && set.size() > 1;
      std::vector<std::vector<float>> pqs, bscores;
      std::vector<float> srow;
      switch (hp.pattern) {
        case Pattern::kDense:
          local = g.q_offset + g.nq;
          break;  // >= base of every block
        case Pattern::kAShape:
          hl.clamped = hp.sink + hp.local > g.nk;
          break;
        case Pattern::kMoA: {
          const double span = hp.alpha + hp.beta * double(g.nk);
          hl.clamped = span > double(g.nk);
          local = std::clamp<int64_t>(std::llround(span), 0, g.nk);
          break;
        }
        case Pattern::kVerticalSlash:
        case Pattern::kAdaptiveVS: {
          if (hp.pattern == Pattern::kVerticalSlash)
            hl.clamped = hp.n_vertical > kend_last || hp.n_slash > n_diag;
          else
            hl.clamped = hp.min_budget > kend_last || hp.min_budget > n_diag;
          seg_cols.assign(size_t(vsg.count()), {});
          seg_diags.assign(size_t(vsg.count()), {});
          for (int64_t si = 0; si < vsg.count(); ++si) {
            // Ranked over the keys and diagonals this segment's rows can reach.
            const int64_t src = vsg.source[size_t(si)];
            const int64_t nd = g.q_offset + vsg.end_row(si);
            const int64_t nc = std::clamp<int64_t>(nd, 0, kend_last);
            if (hp.vs_cover) {  // one segment, no sharing (check_pattern)
              const auto& rs = vsg.rows[size_t(src)];
              std::vector<int64_t> pos(rs.size());
              for (size_t r = 0; r < rs.size(); ++r) pos[r] = g.q_offset + rs[r];
              vs_cover_select(hp, probs[h].data(), pos.data(), int64_t(rs.size()), kend_last,
                              col[h].data() + src * kend_last, nd, diag[h].data() + src * n_diag,
                              &seg_cols[size_t(si)], &seg_diags[size_t(si)]);
              continue;
            }
            vs_select(hp, share_scores(leader, shared_col, col, int(h)) + src * kend_last, nc,
                      share_scores(leader, shared_diag, diag, int(h)) + src * n_diag, nd,
                      &seg_cols[size_t(si)], &seg_diags[size_t(si)]);
          }
          break;
        }
        case Pattern::kBlockSparse:
        case Pattern::kAdaptiveBlock: {
          hl.clamped = hp.pattern == Pattern::kBlockSparse ? hp.n_blocks > n_kb
                                                           : ceil_div(hp.min_budget, kB) > n_kb;
          for (int m : shared ? set : std::vector<int>{int(h)}) {
            std::vector<float>& pq = pqs.emplace_back(size_t(g.n_qb * g.d), 0.f);
            for (int64_t r = 0; r < g.nq; ++r) {
              const float* src = g.q + (r * g.hq + int64_t(m)) * g.d;
              float* dst = pq.data() + (r / kB) * g.d;
              for (int64_t c = 0; c < g.d; ++c) dst[c] += src[c];
            }
            for (int64_t qb = 0; qb < g.n_qb; ++qb)
              for (int64_t c = 0; c < g.d; ++c)
                pq[size_t(qb * g.d + c)] =
                    pooled_mean(pq[size_t(qb * g.d + c)], std::min(kB, g.nq - qb * kB));
          }
          bscores.resize(pqs.size());
          break;
        }
      }
      if (trace_local) (*trace_local)[h] = local;
      const float* pk = uses_blocks(hp.pattern) ? pooled_k[h / size_t(g.group)].data() : nullptr;
      std::vector<int32_t> kbs;
      for (int64_t qb = 0; qb < g.n_qb; ++qb) {
        const SparseSlotGeometry sg = sparse_slot_geometry(g.nq, g.nk, g.q_offset, qb);
        kbs.clear();
        if (pk && n_kb > 0) {
          // Block scores for 64 query blocks at a time: one small SGEMM, O(64 * n_kb) memory.
          const int64_t c0 = qb / kB * kB;
          if (qb == c0) {
            const int64_t m = std::min(kB, g.n_qb - c0);
            for (size_t i = 0; i < pqs.size(); ++i) {
              bscores[i].resize(size_t(m * n_kb));
              cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(n_kb), int(g.d),
                          g.scale, pqs[i].data() + c0 * g.d, int(g.d), pk, int(g.d), 0.f,
                          bscores[i].data(), int(n_kb));
            }
          }
          const bool exact = qb == g.n_qb - 1;  // scored by last_mass (probabilities)
          const int64_t n_allowed = ceil_div(sg.kend, kB);
          // A set's last query block ranks per head: its rows give the logits a decode node
          // continues from, and one head's retrieval there is not outvoted by its group.
          const bool sum_set = shared && !exact;
          float* s = exact ? last_mass[h].data() : bscores[0].data() + (qb - c0) * n_kb;
          if (sum_set) {  // the set's summed probabilities, in head order
            srow.assign(size_t(n_allowed), 0.f);
            for (size_t i = 0; i < set.size(); ++i) {
              float* r = bscores[i].data() + (qb - c0) * n_kb;
              softmax_in_place(r, n_allowed);
              for (int64_t b = 0; b < n_allowed; ++b) srow[size_t(b)] += r[b];
            }
            s = srow.data();
          }
          std::vector<int32_t> forced = block_forced(sg.base, sg.kend, kB);
          Budget bb;
          if (hp.pattern == Pattern::kBlockSparse) {
            bb.k = hp.n_blocks;
          } else {  // softmax over the causal blocks, then the mass threshold
            if (!exact && !sum_set) softmax_in_place(s, n_allowed);
            bb.mass = true;
            bb.gamma = hp.gamma;
            bb.min_count = ceil_div(hp.min_budget, kB);
            bb.max_count = ceil_div(hp.max_budget, kB);
          }
          if (exact && !last_rows[h].empty()) {
            // vs_scores' rows are ceil(kend_last / 64) blocks wide; this slot reaches n_allowed.
            const size_t w = size_t(ceil_div(kend_last, kB));
            std::vector<std::vector<float>> rm;
            for (size_t r = 0; r * w < last_rows[h].size(); ++r) {
              rm.emplace_back(size_t(n_allowed), 0.f);
              std::copy_n(last_rows[h].begin() + std::ptrdiff_t(r * w),
                          std::min<size_t>(w, size_t(n_allowed)), rm.back().begin());
            }
            kbs = select_union_rows(rm, s, n_allowed, forced, bb);
          } else {
            kbs = select_ranked(s, n_allowed, std::move(forced), bb);
          }
        }
        hl.bstart[size_t(qb)] = int64_t(hl.blocks.size());
        hl.cstart[size_t(qb)] = int64_t(hl.cols.size());
        const size_t si = uses_vs(hp.pattern) ? size_t(vsg.of_row(qb * kB)) : 0;
        const auto& cols = seg_cols[si];
        const auto& diags = seg_diags[si];
        sparse_slot_build(sg, cols, diags, kbs, hp.sink, local, hp.tail_block_min, &hl.blocks,
                          &hl.cols);
        if (trace) {
          IndexCandidates& tc = (*trace)[h * size_t(g.n_qb) + size_t(qb)];
          tc.columns = cols;
          tc.diagonals = diags;
          tc.key_blocks = kbs;
        }
      }
      hl.bstart[size_t(g.n_qb)] = int64_t(hl.blocks.size());
      hl.cstart[size_t(g.n_qb)] = int64_t(hl.cols.size());
    }
  });

  // Size the index exactly, then copy the lists in.
  int64_t max_b = 0, max_c = 0;
  for (const HeadLists& hl : lists)
    for (int64_t qb = 0; qb < g.n_qb; ++qb) {
      max_b = std::max(max_b, hl.bstart[size_t(qb + 1)] - hl.bstart[size_t(qb)]);
      max_c = std::max(max_c, hl.cstart[size_t(qb + 1)] - hl.cstart[size_t(qb)]);
    }
  *out = sparse_index_make(int(g.hq), g.nq, g.nk, q_offset, int(max_b), int(max_c));
  stats->clamped_heads = 0;
  for (int64_t h = 0; h < g.hq; ++h) {
    const HeadLists& hl = lists[size_t(h)];
    stats->clamped_heads += hl.clamped ? 1 : 0;
    for (int64_t qb = 0; qb < g.n_qb; ++qb) {
      const size_t s = out->slot(int(h), qb);
      const int64_t b0 = hl.bstart[size_t(qb)], b1 = hl.bstart[size_t(qb + 1)];
      const int64_t c0 = hl.cstart[size_t(qb)], c1 = hl.cstart[size_t(qb + 1)];
      out->block_count[s] = int32_t(b1 - b0);
      out->column_count[s] = int32_t(c1 - c0);
      std::copy(hl.blocks.begin() + b0, hl.blocks.begin() + b1,
                out->block_offset.begin() + ptrdiff_t(s * size_t(max_b)));
      std::copy(hl.cols.begin() + c0, hl.cols.begin() + c1,
                out->column_index.begin() + ptrdiff_t(s * size_t(max_c)));
    }
  }
  stats->density = out->density();
  stats->estimate_s = sf::seconds_since(t_start);
  return Status::ok();
}

}  // namespace sf::kernels::cpu
