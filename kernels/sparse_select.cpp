#include "kernels/sparse_select.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "kernels/sparse.h"
#include "kernels/sparse_index.h"

namespace sf::kernels {

std::vector<int32_t> select_ranked(const float* score, int64_t n, std::vector<int32_t> forced,
                                   const SelectBudget& b) {
  forced.erase(
      std::remove_if(forced.begin(), forced.end(), [&](int32_t x) { return x < 0 || x >= n; }),
      forced.end());
  std::sort(forced.begin(), forced.end());
  forced.erase(std::unique(forced.begin(), forced.end()), forced.end());
  std::vector<char> is_forced(size_t(std::max<int64_t>(n, 0)), 0);
  for (int32_t x : forced) is_forced[size_t(x)] = 1;
  std::vector<int32_t> rest;
  rest.reserve(size_t(std::max<int64_t>(n - int64_t(forced.size()), 0)));
  for (int64_t j = 0; j < n; ++j)
    if (!is_forced[size_t(j)]) rest.push_back(int32_t(j));
  auto better = [&](int32_t x, int32_t y) {
    const float sx = nan_last(score[x]), sy = nan_last(score[y]);
    return sx > sy || (sx == sy && x < y);
  };
  const int64_t nf = int64_t(forced.size()), nr = int64_t(rest.size());
  int64_t take = 0;
  if (!b.mass) {
    take = std::clamp<int64_t>(b.k - nf, 0, nr);
    std::partial_sort(rest.begin(), rest.begin() + take, rest.end(), better);
  } else {
    std::sort(rest.begin(), rest.end(), better);
    double total = 0, cum = 0;
    for (int64_t j = 0; j < n; ++j) total += double(score[j]);
    for (int32_t x : forced) cum += double(score[x]);
    const double goal = b.gamma * total;
    while (take < nr && cum < goal) cum += double(score[rest[size_t(take++)]]);
    const int64_t count =
        std::clamp<int64_t>(nf + take, b.min_count, std::max(b.min_count, b.max_count));
    take = std::clamp<int64_t>(count - nf, 0, nr);
  }
  std::vector<int32_t> sel = std::move(forced);
  sel.insert(sel.end(), rest.begin(), rest.begin() + take);
  std::sort(sel.begin(), sel.end());
  return sel;
}

std::vector<int32_t> select_union_rows(const std::vector<std::vector<float>>& row_mass,
                                       const float* mean_mass, int64_t n,
                                       const std::vector<int32_t>& forced, const SelectBudget& b) {
  std::vector<char> in(size_t(std::max<int64_t>(n, 0)), 0);
  SelectBudget rb = b;
  rb.min_count = 0;  // the clamp applies to the union
  rb.max_count = n;
  for (const auto& m : row_mass)
    for (int32_t x : select_ranked(m.data(), n, forced, rb)) in[size_t(x)] = 1;
  int64_t u = 0;
  for (int64_t j = 0; j < n; ++j) u += in[size_t(j)];
  SelectBudget kb;
  kb.k = std::clamp<int64_t>(u, b.min_count, std::max(b.min_count, b.max_count));
  // Over the max: the union's members by mean mass. Under the min: the whole union, then the
  // rest by mean mass. (Infinities keep the mean masses' own order; no offset rounds them.)
  constexpr float kInf = std::numeric_limits<float>::infinity();
  std::vector<float> score(size_t(std::max<int64_t>(n, 0)));
  for (int64_t j = 0; j < n; ++j)
    score[size_t(j)] = in[size_t(j)] ? (kb.k <= u ? mean_mass[j] : kInf)
                                     : (kb.k <= u ? -kInf : mean_mass[j]);
  return select_ranked(score.data(), n, forced, kb);
}

std::vector<int32_t> iota_list(int64_t n) {
  std::vector<int32_t> v(size_t(std::max<int64_t>(n, 0)));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

std::vector<int64_t> scoring_rows(int64_t n, int64_t spread) {
  const int64_t last = std::min<int64_t>(kSparseBlock, n);
  const int64_t head = n - last;
  std::vector<int64_t> rows;
  const int64_t n_spread = std::clamp<int64_t>(spread, 0, head);
  for (int64_t i = 0; i < n_spread; ++i) rows.push_back((2 * i + 1) * head / (2 * n_spread));
  for (int64_t r = head; r < n; ++r) rows.push_back(r);
  return rows;
}

VsSegments vs_segments(int64_t n, int64_t spread, int64_t segment_rows) {
  VsSegments sg;
  sg.n = n;
  const int64_t last = n > 0 ? (n - 1) / kSparseBlock * kSparseBlock : 0;
  sg.begin.push_back(0);
  for (int64_t b = segment_rows; segment_rows > 0 && b < last; b += segment_rows)
    sg.begin.push_back(b);
  if (last > 0 && segment_rows > 0) sg.begin.push_back(last);
  const int64_t count = sg.count();
  sg.rows.assign(size_t(count), {});
  // The last min(64, n) rows all rank the last segment, also those before the last block's start
  // (n not a multiple of 64): else the segment before it ranked from the few rows spilling into
  // it, and every earlier segment without rows of its own borrowed that (one row at n = 4095).
  const int64_t tail0 = n - std::min<int64_t>(kSparseBlock, n);
  for (int64_t r : scoring_rows(n, spread))
    sg.rows[size_t(segment_rows > 0 && r >= tail0 ? count - 1 : sg.of_row(r))].push_back(r);
  sg.source.assign(size_t(count), count - 1);
  for (int64_t s = count - 1, src = count - 1; s >= 0; --s) {
    if (!sg.rows[size_t(s)].empty()) src = s;
    sg.source[size_t(s)] = src;
  }
  return sg;
}

void vs_select(const HeadPattern& hp, const float* col, int64_t n_cols, const float* diag,
               int64_t n_diags, std::vector<int32_t>* cols, std::vector<int32_t>* diags) {
  SelectBudget bc, bd;
  if (hp.pattern == Pattern::kVerticalSlash) {
    bc.k = std::min(hp.n_vertical, n_cols);
    bd.k = std::min(hp.n_slash, n_diags);
  } else {
    bc.mass = bd.mass = true;
    bc.gamma = bd.gamma = hp.gamma;
    bc.min_count = bd.min_count = hp.min_budget;
    bc.max_count = bd.max_count = hp.max_budget;
  }
  *cols = select_ranked(col, n_cols, iota_list(std::min(hp.sink, n_cols)), bc);
  *diags = select_ranked(diag, n_diags, iota_list(std::min(hp.local + 1, n_diags)), bd);
}

std::vector<int> share_leaders(const std::vector<HeadPattern>& patterns, int q_per_kv) {
  const int n = int(patterns.size());
  std::vector<int> leader(static_cast<size_t>(n));
  std::iota(leader.begin(), leader.end(), 0);
  if (q_per_kv <= 0) return leader;
  auto family = [](const HeadPattern& hp) {
    if (hp.share_group == 0) return 0;
    if (hp.pattern == Pattern::kVerticalSlash || hp.pattern == Pattern::kAdaptiveVS) return 1;
    if ((hp.pattern == Pattern::kBlockSparse || hp.pattern == Pattern::kAdaptiveBlock) &&
        hp.last_block_rows == 0)
      return 2;
    return 0;
  };
  for (int h = 0; h < n; ++h) {
    const HeadPattern& a = patterns[size_t(h)];
    const int fa = family(a);
    if (fa == 0) continue;
    for (int g = h / q_per_kv * q_per_kv; g < h; ++g) {
      const HeadPattern& b = patterns[size_t(g)];
      if (leader[size_t(g)] != g || family(b) != fa) continue;
      if (fa == 1 && (a.spread_rows != b.spread_rows || a.segment_rows != b.segment_rows)) continue;
      leader[size_t(h)] = g;
      break;
    }
  }
  return leader;
}

void share_sums(const std::vector<int>& leader, const std::vector<std::vector<float>>& arrays,
                std::vector<std::vector<float>>* out) {
  out->assign(arrays.size(), {});
  std::vector<int> count(arrays.size(), 0);
  for (size_t h = 0; h < leader.size(); ++h) ++count[size_t(leader[h])];
  for (size_t h = 0; h < leader.size(); ++h) {
    const size_t l = size_t(leader[h]);
    if (count[l] < 2) continue;
    auto& s = (*out)[l];
    if (s.empty()) {
      s = arrays[h];
      continue;
    }
    const auto& a = arrays[h];
    for (size_t i = 0; i < s.size() && i < a.size(); ++i) s[i] += a[i];
  }
}

void vs_cover_widths(const int32_t* diag_round, int64_t n_diags, int32_t* width) {
  const int64_t nd = std::max<int64_t>(n_diags, 0);
  // chosen[e] as prefix counts; offset o is reached when a chosen diagonal lies in [o, o + 63];
  // then prefix counts of the unreached offsets.
  std::vector<int32_t> chosen(size_t(nd + 1), 0), open(size_t(nd + 1), 0);
  for (int64_t e = 0; e < nd; ++e) chosen[size_t(e + 1)] = chosen[size_t(e)] + (diag_round[e] >= 0);
  for (int64_t o = 0; o < nd; ++o) {
    const bool reached = chosen[size_t(std::min(o + kVsCoverSpan, nd))] > chosen[size_t(o)];
    open[size_t(o + 1)] = open[size_t(o)] + (reached ? 0 : 1);
  }
  for (int64_t d = 0; d < nd; ++d)
    width[d] = open[size_t(d + 1)] - open[size_t(std::max<int64_t>(0, d - kVsCoverSpan + 1))];
}

void vs_cover_select(const HeadPattern& hp, const float* probs, const int64_t* pos, int64_t n_rows,
                     int64_t n_cols, const float* col, int64_t n_diags, const float* diag,
                     std::vector<int32_t>* cols, std::vector<int32_t>* diags, VsCoverTrace* trace) {
  const int64_t nc = std::max<int64_t>(n_cols, 0), nd = std::max<int64_t>(n_diags, 0);
  const int64_t nr = std::max<int64_t>(n_rows, 0);
  // round[kind][x]: -1 not taken, 0 forced, k taken in round k.
  std::vector<int32_t> round[2] = {std::vector<int32_t>(size_t(nc), -1),
                                   std::vector<int32_t>(size_t(nd), -1)};
  const int64_t sink = std::min(hp.sink, nc), local = std::min(hp.local + 1, nd);
  for (int64_t j = 0; j < sink; ++j) round[0][size_t(j)] = 0;
  for (int64_t o = 0; o < local; ++o) round[1][size_t(o)] = 0;
  int64_t count[2] = {sink, local};
  const int64_t cap[2] = {std::min(hp.max_budget, nc), std::min(hp.max_budget, nd)};
  const float* plain[2] = {col, diag};
  // The mass to cover: the plain column sums' total, as the device reduces it.
  double total = 0;
  for (int64_t j = 0; j < nc; ++j) total += double(col[j]);
  const double goal = hp.gamma * total;
  std::vector<float> res(size_t(nc + nd));
  std::vector<double> acc(size_t(nc + nd));
  std::vector<int32_t> order;
  int rounds = 0;
  // Residuals: each item's mass on entries no taken item covers, in double. Summed once over the
  // rows after the forced items; after each round every newly covered entry leaves the residual
  // of its other item (unless that one was taken in the same round), as the device keeps them.
  for (int64_t r = 0; r < nr; ++r) {
    const float* p = probs + r * nc;
    const int64_t lim = std::clamp<int64_t>(pos[r] + 1, 0, nc);
    for (int64_t j = 0; j < lim; ++j) {
      const int64_t o = pos[r] - j;
      if (round[0][size_t(j)] >= 0 || (o < nd && round[1][size_t(o)] >= 0)) continue;
      acc[size_t(j)] += double(p[j]);
      if (o < nd) acc[size_t(nc + o)] += double(p[j]);
    }
  }
  std::vector<int32_t> fresh;  // the last round's picks (and free diagonals), as joint ids
  std::vector<int32_t> width(static_cast<size_t>(nd));
  std::vector<uint8_t> freed(static_cast<size_t>(nd), 0);
  for (int k = 1; k <= kVsCoverRounds; ++k) {
    auto old = [&](int32_t rd) { return rd >= 0 && rd < k - 1; };
    for (int32_t x : fresh) {
      const bool is_col = x < nc;
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t j = is_col ? x : pos[r] - (x - nc);
        if (j < 0 || j >= nc || j > pos[r]) continue;
        const int64_t o = pos[r] - j;
        if (o >= nd || old(round[0][size_t(j)]) || old(round[1][size_t(o)])) continue;
        const int64_t other = is_col ? nc + o : j;
        if ((is_col ? round[1][size_t(o)] : round[0][size_t(j)]) == k - 1) continue;
        acc[size_t(other)] -= double(probs[r * nc + j]);
      }
      acc[size_t(x)] = 0;
    }
    fresh.clear();
    double uncovered = 0;
    for (int64_t x = 0; x < nc + nd; ++x) {
      const double a = acc[size_t(x)];
      res[size_t(x)] = float(a > 0 ? a : 0.0);  // updates can leave -1e-17 where 0 is meant
      if (x < nc) uncovered += double(res[size_t(x)]);
    }
    const double need = goal - (total - uncovered);
    if (!(need > 0)) break;
    const double target = need > total * kVsCoverFinish ? 0.5 * need : need;
    // Candidates ranked by residual descending, then columns before diagonals, then index: one
    // joint list with the diagonals after the columns.
    order.clear();
    for (int64_t x = 0; x < nc + nd; ++x) {
      const int kind = x < nc ? 0 : 1;
      if (res[size_t(x)] > 0.f && round[kind][size_t(kind ? x - nc : x)] < 0)
        order.push_back(int32_t(x));
    }
    if (order.empty()) break;
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return res[size_t(a)] > res[size_t(b)] || (res[size_t(a)] == res[size_t(b)] && a < b);
    });
    double taken = 0;
    bool any = false;
    for (int32_t x : order) {
      if (taken >= target) break;
      const int kind = x < nc ? 0 : 1;
      if (count[kind] >= cap[kind]) continue;  // a full family takes no more
      round[kind][size_t(kind ? x - nc : x)] = k;
      ++count[kind];
      taken += double(res[size_t(x)]);
      fresh.push_back(x);
      any = true;
    }
    rounds = k;
    if (!any) break;
    // Free diagonals: those whose whole range the chosen diagonals' ranges already read (width
    // 0) are computed for every row of every full query block; they are taken with the round and
    // their mass counted, at no cost (in ascending order, up to the family's cap).
    vs_cover_widths(round[1].data(), nd, width.data());
    for (int64_t d = 0; d < nd && count[1] < cap[1]; ++d)
      if (round[1][size_t(d)] < 0 && width[size_t(d)] == 0) {
        round[1][size_t(d)] = k;
        freed[size_t(d)] = 1;
        ++count[1];
        fresh.push_back(int32_t(nc + d));
      }
  }
  const int64_t n[2] = {nc, nd};
  std::vector<int32_t>* out[2] = {cols, diags};
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<int32_t> sel;
    for (int64_t x = 0; x < n[kind]; ++x)
      if (round[kind][size_t(x)] >= 0) sel.push_back(int32_t(x));
    if (int64_t(sel.size()) < std::min(hp.min_budget, n[kind])) {
      SelectBudget b;  // top-k: the cover's items forced, the rest by plain sums
      b.k = std::min(hp.min_budget, n[kind]);
      sel = select_ranked(plain[kind], n[kind], std::move(sel), b);
    }
    *out[kind] = std::move(sel);
  }
  if (trace) {
    trace->col_round = std::move(round[0]);
    trace->diag_round = std::move(round[1]);
    trace->diag_free = std::move(freed);
    trace->rounds = rounds;
  }
}

}  // namespace sf::kernels
