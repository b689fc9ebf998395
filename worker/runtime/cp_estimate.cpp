#include "worker/runtime/cp_estimate.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "common/dtype.h"
#include "common/timing.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/sparse_select.h"

namespace sf::runtime {
namespace {

using kernels::HeadPattern;
using kernels::Pattern;
constexpr int64_t kB = kernels::kSparseBlock;
using Budget = kernels::SelectBudget;
using kernels::iota_list;
using kernels::scoring_rows;
using kernels::select_ranked;
constexpr int64_t kTile = 2048;  // keys per scoring SGEMM: bounds the logits buffer
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

bool uses_vs(Pattern p) { return p == Pattern::kVerticalSlash || p == Pattern::kAdaptiveVS; }
bool uses_blocks(Pattern p) { return p == Pattern::kBlockSparse || p == Pattern::kAdaptiveBlock; }
int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }
// Bytes an all-reduce of `array_bytes` brings each rank: a reduce-scatter and an all-gather,
// (CP - 1) / CP of the array each, as the reduce-scatter and all-gathers here are counted.
int64_t all_reduce_bytes(int CP, int64_t array_bytes) {
  return 2 * int64_t(CP - 1) * array_bytes / CP;
}

// How score_rows hands one head's sums over, when only a top-k selection over all S items reads
// them: k >= 0 (the non-forced items the selection takes at most) sends only candidates for the
// top k non-forced items (ids >= forced); the rest of the array comes back as -1, below every
// probability sum. k < 0: the whole array.
struct TopK {
  int64_t k = -1, forced = 0;
  bool on() const { return k >= 0; }
};

// Every rank's per-head float lists (lists[x]), all-gathered: out[r][x] is rank r's list x.
// Adds the bytes received to *bytes.
Status all_lists(comm::Communicator& cp, const std::vector<std::vector<float>>& lists,
                 std::vector<std::vector<std::vector<float>>>* out, int64_t* bytes) {
  const int CP = cp.size();
  const int64_t nh = int64_t(lists.size());
  std::vector<int64_t> n_mine(static_cast<size_t>(nh)), all_n(static_cast<size_t>(nh * CP));
  std::vector<float> mine;
  for (int64_t x = 0; x < nh; ++x) {
    n_mine[size_t(x)] = int64_t(lists[size_t(x)].size());
    mine.insert(mine.end(), lists[size_t(x)].begin(), lists[size_t(x)].end());
  }
  SF_TRY(cp.all_gather(n_mine.data(), all_n.data(), nh, DType::kI64));
  std::vector<int64_t> counts(static_cast<size_t>(CP), 0);
  for (int r = 0; r < CP; ++r)
    for (int64_t x = 0; x < nh; ++x) counts[size_t(r)] += all_n[size_t(r * nh + x)];
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  std::vector<float> got(static_cast<size_t>(total));
  SF_TRY(cp.all_gatherv(mine.data(), int64_t(mine.size()), got.data(), counts, DType::kF32));
  *bytes += int64_t(sizeof(float)) * (total - int64_t(mine.size())) +
            int64_t(sizeof(int64_t)) * nh * (CP - 1);
  out->assign(size_t(CP), std::vector<std::vector<float>>(size_t(nh)));
  size_t o = 0;
  for (int r = 0; r < CP; ++r)
    for (int64_t x = 0; x < nh; ++x) {
      const int64_t n = all_n[size_t(r * nh + x)];
      (*out)[size_t(r)][size_t(x)].assign(got.begin() + std::ptrdiff_t(o),
                                          got.begin() + std::ptrdiff_t(o + size_t(n)));
      o += size_t(n);
    }
  return Status::ok();
}

float id_bits(int32_t id) {
  float f;
  std::memcpy(&f, &id, sizeof(f));
  return f;
}
int32_t bits_id(float f) {
  int32_t id;
  std::memcpy(&id, &f, sizeof(id));
  return id;
}

// The top k non-forced (ids >= forced) of this rank's items, the spans [lo, hi) of s (indexed
// by global id), ranked by value descending then id ascending, appended to out as (id bits,
// value) float pairs.
void top_candidates(const float* s, const std::vector<std::pair<int64_t, int64_t>>& spans,
                    const TopK& t, std::vector<float>* out) {
  std::vector<int32_t> ids;
  for (const auto& [lo, hi] : spans)
    for (int64_t j = std::max(lo, t.forced); j < hi; ++j) ids.push_back(int32_t(j));
  const int64_t k = std::min<int64_t>(t.k, int64_t(ids.size()));
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                    [&](int32_t x, int32_t y) { return s[x] > s[y] || (s[x] == s[y] && x < y); });
  for (int64_t i = 0; i < k; ++i) {
    out->push_back(id_bits(ids[size_t(i)]));
    out->push_back(s[ids[size_t(i)]]);
  }
}

// All ranks' candidates (per head, from top_candidates) into the heads' arrays dst[x * S ..),
// filled with -1 first. Adds the bytes received to *bytes.
Status gather_candidates(comm::Communicator& cp, const std::vector<std::vector<float>>& mine,
                         int64_t S, const std::vector<size_t>& heads, std::vector<float>* dst,
                         int64_t* bytes) {
  std::vector<std::vector<std::vector<float>>> got;
  SF_TRY(all_lists(cp, mine, &got, bytes));
  for (size_t h : heads)
    std::fill(dst->begin() + std::ptrdiff_t(h * size_t(S)),
              dst->begin() + std::ptrdiff_t((h + 1) * size_t(S)), -1.f);
  for (const auto& rank : got)
    for (size_t x = 0; x < heads.size(); ++x)
      for (size_t i = 0; i < rank[x].size(); i += 2)
        (*dst)[heads[x] * size_t(S) + size_t(bits_id(rank[x][i]))] = rank[x][i + 1];
  return Status::ok();
}

// The top k (ids >= forced) of sums over ranks of per-rank partial arrays part[x][0, S) (ranked by
// sum descending, id ascending), exactly, moving only what can matter: TPUT (Cao and Wang,
// "Efficient top-K query calculation in distributed networks", PODC 2004). 1) every rank sends
// its top k partials; tau1 = the k-th largest partial sum known, T = tau1 / CP; 2) every rank sends
// its other partials >= T, so any unsent partial is < T and an item's sum is at most what is
// known plus T per silent rank, and tau2 = the k-th largest known sum bounds the top k from below;
// 3) the items whose upper bound reaches tau2 get every rank's partial and their exact sums (in
// rank order, the same on every rank). Items that cannot reach the top k come back as -1.
// A head whose round 2 would move more than a reduce-scatter of its array is listed in
// *fallback and left alone. Adds the bytes received to *bytes.
Status tput_top_sums(comm::Communicator& cp, std::vector<float>* part, int64_t S,
                     const std::vector<size_t>& heads, const std::vector<TopK>& tk,
                     std::vector<size_t>* fallback, int64_t* bytes) {
  const int CP = cp.size();
  const int64_t nh = int64_t(heads.size());
  auto row = [&](int64_t x) { return part->data() + heads[size_t(x)] * size_t(S); };
  // A head that takes no non-forced item needs nothing (every rank knows k).
  for (int64_t x = 0; x < nh; ++x)
    if (tk[size_t(x)].k == 0) std::fill(row(x), row(x) + S, -1.f);
  // A NaN partial (NaN activations) becomes -inf, so its item's sum ranks last, as a NaN score
  // does in the single-rank selection (nan_last), and the orderings below stay valid.
  for (int64_t x = 0; x < nh; ++x)
    for (float* p = row(x); p < row(x) + S; ++p) *p = nan_last(*p);
  // 1) top k partials.
  std::vector<std::vector<float>> l1(static_cast<size_t>(nh));
  for (int64_t x = 0; x < nh; ++x) top_candidates(row(x), {{0, S}}, tk[size_t(x)], &l1[size_t(x)]);
  std::vector<std::vector<std::vector<float>>> r1;
  SF_TRY(all_lists(cp, l1, &r1, bytes));
  // Known partials per head: ids in first-seen order, their known sum and how many ranks sent
  // one (slot[x][id] indexes them).
  std::vector<double> T(static_cast<size_t>(nh), 0.0);
  auto kth = [](std::vector<double> v, int64_t k) {
    if (k <= 0 || int64_t(v.size()) < k) return 0.0;
    std::nth_element(v.begin(), v.begin() + (k - 1), v.end(), std::greater<double>());
    return v[size_t(k - 1)];
  };
  std::vector<std::vector<double>> ksum(static_cast<size_t>(nh));
  std::vector<std::vector<int>> kcnt(static_cast<size_t>(nh));
  std::vector<std::vector<int32_t>> kids(static_cast<size_t>(nh));
  auto add = [&](int64_t x, const std::vector<float>& l, std::vector<int32_t>* where) {
    for (size_t i = 0; i < l.size(); i += 2) {
      const int32_t id = bits_id(l[i]);
      int32_t& w = (*where)[size_t(id)];
      if (w < 0) {
        w = int32_t(kids[size_t(x)].size());
        kids[size_t(x)].push_back(id);
        ksum[size_t(x)].push_back(0.0);
        kcnt[size_t(x)].push_back(0);
      }
      ksum[size_t(x)][size_t(w)] += double(l[i + 1]);
      kcnt[size_t(x)][size_t(w)] += 1;
    }
  };
  std::vector<std::vector<int32_t>> slot(static_cast<size_t>(nh));
  for (int64_t x = 0; x < nh; ++x) {
    slot[size_t(x)].assign(size_t(S), -1);
    for (int r = 0; r < CP; ++r) add(x, r1[size_t(r)][size_t(x)], &slot[size_t(x)]);
    T[size_t(x)] = kth(ksum[size_t(x)], tk[size_t(x)].k) / double(CP);
    if (tk[size_t(x)].k == 0) T[size_t(x)] = std::numeric_limits<double>::infinity();
  }
  // 2) the other partials >= T; heads where that outgrows a reduce-scatter fall back.
  std::vector<std::vector<float>> l2(static_cast<size_t>(nh));
  std::vector<int64_t> n2(static_cast<size_t>(nh), 0);
  for (int64_t x = 0; x < nh; ++x) {
    std::vector<char> sent(static_cast<size_t>(S), 0);
    for (size_t i = 0; i < l1[size_t(x)].size(); i += 2)
      sent[size_t(bits_id(l1[size_t(x)][i]))] = 1;
    const float* p = row(x);
    for (int64_t o = tk[size_t(x)].forced; o < S; ++o)
      if (!sent[size_t(o)] && double(p[o]) >= T[size_t(x)]) {
        l2[size_t(x)].push_back(id_bits(int32_t(o)));
        l2[size_t(x)].push_back(p[o]);
      }
    n2[size_t(x)] = int64_t(l2[size_t(x)].size());
  }
  SF_TRY(cp.all_reduce(n2.data(), n2.data(), nh, DType::kI64, comm::ReduceOp::kSum));
  *bytes += all_reduce_bytes(cp.size(), int64_t(sizeof(int64_t)) * nh);
  std::vector<char> use(static_cast<size_t>(nh), 1);
  const int64_t rs_floats = (CP - 1) * ceil_div(S, CP);
  for (int64_t x = 0; x < nh; ++x)
    if (n2[size_t(x)] > rs_floats) {
      use[size_t(x)] = 0;
      fallback->push_back(heads[size_t(x)]);
      l2[size_t(x)].clear();
    }
  std::vector<std::vector<std::vector<float>>> r2;
  SF_TRY(all_lists(cp, l2, &r2, bytes));
  // 3) candidates: upper bound (known + T per silent rank) >= tau2; every rank's partials.
  std::vector<std::vector<int32_t>> cand(static_cast<size_t>(nh));
  std::vector<std::vector<float>> l3(static_cast<size_t>(nh));
  for (int64_t x = 0; x < nh; ++x) {
    if (!use[size_t(x)]) continue;
    for (int r = 0; r < CP; ++r) add(x, r2[size_t(r)][size_t(x)], &slot[size_t(x)]);
    const double tau2 = kth(ksum[size_t(x)], tk[size_t(x)].k);
    for (size_t i = 0; i < kids[size_t(x)].size(); ++i) {
      // A relative margin keeps near-ties in: the final ranking is on rounded float sums. (-inf
      // sums, from NaN partials: no margin arithmetic on infinities, and an item every rank
      // sent has no unknown part.)
      const int silent = CP - kcnt[size_t(x)][i];
      const double bound =
          ksum[size_t(x)][i] + (silent == 0 ? 0.0 : T[size_t(x)] * double(silent));
      const double bar = std::isfinite(tau2) ? tau2 - 1e-6 * std::fabs(tau2)
                                             : -std::numeric_limits<double>::infinity();
      if (bound >= bar) cand[size_t(x)].push_back(kids[size_t(x)][i]);
    }
    std::sort(cand[size_t(x)].begin(), cand[size_t(x)].end());
    const float* p = row(x);
    for (int32_t id : cand[size_t(x)]) l3[size_t(x)].push_back(p[id]);
  }
  std::vector<std::vector<std::vector<float>>> r3;
  SF_TRY(all_lists(cp, l3, &r3, bytes));
  for (int64_t x = 0; x < nh; ++x) {
    if (!use[size_t(x)]) continue;
    float* out = row(x);
    std::fill(out, out + S, -1.f);
    for (size_t i = 0; i < cand[size_t(x)].size(); ++i) {
      float s = 0.f;
      for (int r = 0; r < CP; ++r) s += r3[size_t(r)][size_t(x)][i];
      out[cand[size_t(x)][i]] = s;
    }
  }
  return Status::ok();
}

// Column sums (and, when diag is set, diagonal sums) of softmax(q_row K^T * scale) over causal
// keys for the scoring rows `rows` (global positions, ascending) of the slice heads `hs`, with
// the keys spread over the CP ranks: rows' q all-gathered, row max / sum-exp all-reduced, each
// rank's probabilities summed into [head][S] arrays. A column is complete on its key's owner:
// gathered from there (all of it, or per TopK `col_k` only candidates); the diagonals are
// all-reduced, or per `diag_k` reduce-scattered and their candidates gathered. Every rank gets the
// same arrays. With `pool_cols` the columns come back as sums per 64-key block ([head][n_kb]:
// blocks never straddle ranks). With `into` (per head x, the head its sums are added to; x itself
// for most), a KV-group sharing set's heads are summed into its leader's arrays on each rank and
// only the leader's travel. *bytes_out gets what the collectives brought this rank, by part.
Status score_rows(comm::Communicator& cp, const CpEstimateArgs& a, const std::vector<int>& hs,
                  const std::vector<int64_t>& rows, bool want_diag, std::vector<float>* col_out,
                  std::vector<float>* diag_out, CpEstimateBytes* bytes_out,
                  const std::vector<TopK>& col_k = {}, const std::vector<TopK>& diag_k = {},
                  bool pool_cols = false, const std::vector<int>& into = {}) {
  const int64_t S = a.n_tokens, d = a.head_dim, hq = a.n_heads, hkv = a.n_kv_heads;
  const int64_t group = hq / hkv;
  const float scale = 1.f / std::sqrt(float(d));
  const int CP = cp.size();
  auto local_row = [&](int64_t p) {
    return p < a.ranges[0].end ? p - a.ranges[0].begin : a.ranges[0].size() + p - a.ranges[1].begin;
  };
  CpEstimateBytes bytes;
  const int64_t nh = int64_t(hs.size());
  const int64_t L = int64_t(rows.size());
  // 1) The scoring rows' q, exchanged pairwise: each rank sends the rows it holds, in position
  // order, to every rank holding a key they can see (a row before a rank's first key would only
  // be masked there: rank r's first key starts chunk r). Rows a rank does not receive stay zero
  // and are never read (every key they would meet is past the causal limit).
  std::vector<std::vector<int64_t>> rank_rows(static_cast<size_t>(CP));
  std::vector<int64_t> first_key(static_cast<size_t>(CP));
  for (int r = 0; r < CP; ++r) {
    const auto rr = cp_rank_ranges(S, CP, r);
    first_key[size_t(r)] = std::min(rr[0].begin, rr[1].begin);
    for (int64_t p : rows)
      if ((p >= rr[0].begin && p < rr[0].end) || (p >= rr[1].begin && p < rr[1].end))
        rank_rows[size_t(r)].push_back(p);
  }
  std::vector<int64_t> row_of(static_cast<size_t>(S), -1);
  for (int64_t i = 0; i < L; ++i) row_of[size_t(rows[size_t(i)])] = i;
  // Head-major [x][i][d] in the order of `rows`.
  std::vector<float> qr(static_cast<size_t>(nh * L * d), 0.f);
  auto put = [&](const std::vector<int64_t>& rs, const float* src) {
    for (int64_t p : rs)
      for (int64_t x = 0; x < nh; ++x, src += d)
        std::copy_n(src, d, qr.data() + (x * L + row_of[size_t(p)]) * d);
  };
  {
    const std::vector<int64_t>& own = rank_rows[size_t(cp.rank())];
    auto seen_by = [&](const std::vector<int64_t>& rs, int r) {
      std::vector<int64_t> out;
      for (int64_t p : rs)
        if (p >= first_key[size_t(r)]) out.push_back(p);
      return out;
    };
    auto pack = [&](const std::vector<int64_t>& rs) {
      std::vector<float> buf(rs.size() * size_t(nh * d));
      size_t o = 0;
      for (int64_t p : rs)
        for (int h : hs) {
          std::copy_n(a.q_loc + (local_row(p) * hq + h) * d, d, buf.data() + o);
          o += size_t(d);
        }
      return buf;
    };
    put(own, pack(own).data());
    for (int step = 1; step < CP; ++step) {
      const int to = (cp.rank() + step) % CP, from = (cp.rank() - step + CP) % CP;
      const std::vector<float> send = pack(seen_by(own, to));
      const std::vector<int64_t> got_rows = seen_by(rank_rows[size_t(from)], cp.rank());
      std::vector<float> got(got_rows.size() * size_t(nh * d));
      SF_TRY(cp.sendrecv(send.data(), int64_t(send.size()), to, got.data(), int64_t(got.size()),
                         from, DType::kF32, /*tag=*/41));
      bytes.queries += int64_t(sizeof(float)) * int64_t(got.size());
      put(got_rows, got.data());
    }
  }
  // Logits of head x's scoring rows against local keys [t0, t0 + n) of one range.
  std::vector<float> s;
  auto logits = [&](int64_t x, int64_t n, int64_t lrow0) {
    s.resize(size_t(L * n));
    const int64_t kvh = hs[size_t(x)] / group;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(L), int(n), int(d), scale,
                qr.data() + x * L * d, int(d), a.k_loc + (lrow0 * hkv + kvh) * d, int(hkv * d), 0.f,
                s.data(), int(n));
  };
  // Tiles of this rank's keys: (global start, count, local row).
  struct Tile {
    int64_t t0, n, lrow0;
  };
  std::vector<Tile> tiles;
  for (const auto& r : a.ranges)
    for (int64_t t = r.begin; t < r.end; t += kTile)
      tiles.push_back({t, std::min(kTile, r.end - t), local_row(t)});
  // 2) Row max and sum-exp over local keys, then over ranks.
  std::vector<float> mx(static_cast<size_t>(nh * L), kNegInf),
      sum(static_cast<size_t>(nh * L), 0.f);
  for (int64_t x = 0; x < nh; ++x)
    for (const Tile& tl : tiles) {
      logits(x, tl.n, tl.lrow0);
      for (int64_t i = 0; i < L; ++i) {
        const int64_t lim = std::clamp<int64_t>(rows[size_t(i)] + 1 - tl.t0, 0, tl.n);
        if (lim == 0) continue;
        const float* sr = s.data() + i * tl.n;
        const float m = *std::max_element(sr, sr + lim);
        float& M = mx[size_t(x * L + i)];
        float& l = sum[size_t(x * L + i)];
        double acc = 0;
        for (int64_t j = 0; j < lim; ++j) acc += std::exp(double(sr[j]) - double(std::max(m, M)));
        l = float(double(l) * (M == kNegInf ? 0.0 : std::exp(double(M) - double(std::max(m, M)))) +
                  acc);
        M = std::max(m, M);
      }
    }
  std::vector<float> gmx(mx.size());
  SF_TRY(
      cp.all_reduce(mx.data(), gmx.data(), int64_t(mx.size()), DType::kF32, comm::ReduceOp::kMax));
  for (size_t r = 0; r < sum.size(); ++r)
    sum[r] =
        mx[r] == kNegInf ? 0.f : float(double(sum[r]) * std::exp(double(mx[r]) - double(gmx[r])));
  SF_TRY(cp.all_reduce(sum.data(), sum.data(), int64_t(sum.size()), DType::kF32,
                       comm::ReduceOp::kSum));
  bytes.queries +=
      all_reduce_bytes(CP, int64_t(sizeof(float)) * int64_t(mx.size() + sum.size()));
  // 3) Probabilities of local keys into column and diagonal sums, then over ranks.
  std::vector<float> cs(static_cast<size_t>(nh * S), 0.f), ds(static_cast<size_t>(nh * S), 0.f);
  for (int64_t x = 0; x < nh; ++x)
    for (const Tile& tl : tiles) {
      logits(x, tl.n, tl.lrow0);
      for (int64_t i = 0; i < L; ++i) {
        const int64_t lim = std::clamp<int64_t>(rows[size_t(i)] + 1 - tl.t0, 0, tl.n);
        if (lim == 0 || sum[size_t(x * L + i)] <= 0.f) continue;
        const float lse = gmx[size_t(x * L + i)] + std::log(sum[size_t(x * L + i)]);
        const float* sr = s.data() + i * tl.n;
        float* c = cs.data() + x * S + tl.t0;
        float* dg = ds.data() + x * S + (rows[size_t(i)] - tl.t0);
        for (int64_t j = 0; j < lim; ++j) {
          const float pr = std::exp(sr[j] - lse);
          c[j] += pr;
          if (want_diag) dg[-j] += pr;
        }
      }
    }
  auto topk = [](const std::vector<TopK>& v, int64_t x) {
    return x < int64_t(v.size()) ? v[size_t(x)] : TopK{};
  };
  // Sharing sets: members added into their leader's rows in head order (share_sums' order, per
  // rank), then only the leaders travel.
  auto sent = [&](int64_t x) { return into.empty() || into[size_t(x)] == x; };
  for (int64_t x = 0; x < nh; ++x) {
    if (sent(x)) continue;
    const size_t l = size_t(into[size_t(x)]) * size_t(S), m = size_t(x) * size_t(S);
    for (int64_t j = 0; j < S; ++j) cs[l + size_t(j)] += cs[m + size_t(j)];
    if (want_diag)
      for (int64_t j = 0; j < S; ++j) ds[l + size_t(j)] += ds[m + size_t(j)];
  }
  // Columns: complete on their key's owner (every scoring row was added there), so gathered
  // from the owners (S / CP per head, or per 64-key block) rather than all-reduced; heads ranked
  // top-k only send their owners' candidates.
  {
    std::vector<size_t> full, cand;
    for (int64_t x = 0; x < nh; ++x)
      if (sent(x)) (topk(col_k, x).on() && !pool_cols ? cand : full).push_back(size_t(x));
    const int64_t unit = pool_cols ? kB : 1, n_out = pool_cols ? ceil_div(S, kB) : S;
    std::vector<float> out(static_cast<size_t>(nh * n_out), 0.f);
    if (!full.empty()) {
      const int64_t nf = int64_t(full.size());
      std::vector<int64_t> counts(static_cast<size_t>(CP));
      for (int r = 0; r < CP; ++r) {
        const auto rr = cp_rank_ranges(S, CP, r);
        counts[size_t(r)] = (ceil_div(rr[0].size(), unit) + ceil_div(rr[1].size(), unit)) * nf;
      }
      std::vector<float> mine(static_cast<size_t>(counts[size_t(cp.rank())])),
          got(static_cast<size_t>(n_out * nf));
      size_t o = 0;
      for (const auto& r : a.ranges)
        for (size_t x : full)
          for (int64_t b0 = r.begin; b0 < r.end; b0 += unit, ++o) {
            // per-block sums add the columns in key order, as the single-rank block mass does
            float s = 0.f;
            for (int64_t j = b0; j < std::min(r.end, b0 + unit); ++j)
              s += cs[x * size_t(S) + size_t(j)];
            mine[o] = s;
          }
      SF_TRY(cp.all_gatherv(mine.data(), int64_t(mine.size()), got.data(), counts, DType::kF32));
      (pool_cols ? bytes.blocks : bytes.columns) +=
          int64_t(sizeof(float)) * (int64_t(got.size()) - int64_t(mine.size()));
      o = 0;
      for (int r = 0; r < CP; ++r)
        for (const auto& rr : cp_rank_ranges(S, CP, r))
          for (size_t x : full) {
            const int64_t n = ceil_div(rr.size(), unit);
            std::copy_n(got.data() + o, n,
                        out.data() + x * size_t(n_out) + size_t(rr.begin / unit));
            o += size_t(n);
          }
    }
    if (!cand.empty()) {
      std::vector<std::vector<float>> mine(cand.size());
      const std::vector<std::pair<int64_t, int64_t>> owned{{a.ranges[0].begin, a.ranges[0].end},
                                                           {a.ranges[1].begin, a.ranges[1].end}};
      for (size_t i = 0; i < cand.size(); ++i)
        top_candidates(cs.data() + cand[i] * size_t(S), owned, topk(col_k, int64_t(cand[i])),
                       &mine[i]);
      SF_TRY(gather_candidates(cp, mine, n_out, cand, &out, &bytes.columns));
    }
    cs = std::move(out);
  }
  if (want_diag) {
    std::vector<size_t> full, cand;
    for (int64_t x = 0; x < nh; ++x)
      if (sent(x)) (topk(diag_k, x).on() ? cand : full).push_back(size_t(x));
    if (!full.empty()) {
      std::vector<float> buf(full.size() * size_t(S));
      for (size_t i = 0; i < full.size(); ++i)
        std::copy_n(ds.data() + full[i] * size_t(S), S, buf.data() + i * size_t(S));
      SF_TRY(cp.all_reduce(buf.data(), buf.data(), int64_t(buf.size()), DType::kF32,
                           comm::ReduceOp::kSum));
      bytes.diagonals += all_reduce_bytes(CP, int64_t(sizeof(float)) * int64_t(buf.size()));
      for (size_t i = 0; i < full.size(); ++i)
        std::copy_n(buf.data() + i * size_t(S), S, ds.data() + full[i] * size_t(S));
    }
    if (!cand.empty()) {  // threshold rounds first; heads they do not suit fall back below
      std::vector<TopK> tks;
      for (size_t h : cand) tks.push_back(topk(diag_k, int64_t(h)));
      std::vector<size_t> rs;
      SF_TRY(tput_top_sums(cp, &ds, S, cand, tks, &rs, &bytes.diagonals));
      cand = std::move(rs);
    }
    if (!cand.empty()) {
      // Reduce-scatter: rank r sums the diagonals [r * slice, (r + 1) * slice) of every
      // candidate head, then sends its top k of them.
      const int64_t slice = ceil_div(S, CP), nc = int64_t(cand.size());
      std::vector<float> send(size_t(CP * nc * slice), 0.f), mine_sum(size_t(nc * slice));
      for (int r = 0; r < CP; ++r)
        for (int64_t i = 0; i < nc; ++i) {
          const int64_t o0 = r * slice, n = std::clamp<int64_t>(S - o0, 0, slice);
          std::copy_n(ds.data() + cand[size_t(i)] * size_t(S) + size_t(o0), n,
                      send.data() + size_t((r * nc + i) * slice));
        }
      SF_TRY(cp.reduce_scatter(send.data(), mine_sum.data(), nc * slice, DType::kF32,
                               comm::ReduceOp::kSum));
      bytes.diagonals += int64_t(sizeof(float)) * (CP - 1) * nc * slice;  // a ring's share per rank
      const int64_t o0 = cp.rank() * slice, o1 = std::min(S, o0 + slice);
      std::vector<float> full_row(static_cast<size_t>(S));
      std::vector<std::vector<float>> mine(cand.size());
      for (int64_t i = 0; i < nc; ++i) {
        if (o1 > o0) std::copy_n(mine_sum.data() + i * slice, o1 - o0, full_row.data() + o0);
        top_candidates(full_row.data(), {{o0, std::max(o0, o1)}},
                       topk(diag_k, int64_t(cand[size_t(i)])), &mine[size_t(i)]);
      }
      SF_TRY(gather_candidates(cp, mine, S, cand, &ds, &bytes.diagonals));
    }
  }
  *col_out = std::move(cs);
  if (want_diag) *diag_out = std::move(ds);
  *bytes_out += bytes;
  return Status::ok();
}

}  // namespace

Status cp_estimate(comm::Communicator& cp, const CpEstimateArgs& a,
                   std::vector<kernels::SparseIndex>* out, CpEstimateStats* stats) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t S = a.n_tokens, d = a.head_dim, hq = a.n_heads, hkv = a.n_kv_heads;
  if (S <= 0 || hq <= 0 || hkv <= 0 || hq % hkv != 0 || !a.patterns)
    return SF_ERR(kInvalidArgument, "cp_estimate: bad geometry");
  for (int64_t h = 0; h < hq; ++h)  // every rank holds the same patterns: all refuse alike
    if (a.patterns[h].vs_cover != 0)
      return SF_ERR(kUnsupported, "cp_estimate: patterns[" + std::to_string(h) +
                                      "].vs_cover is not implemented under --cp-estimate");
  const int CP = cp.size();
  // Scores per head and selection segment (col[h], diag[h]: n_seg x S), one scoring pass per
  // distinct (spread_rows, segment_rows) and segment with rows, as single-rank.
  std::vector<std::vector<float>> col(static_cast<size_t>(hq)), diag(static_cast<size_t>(hq));
  std::vector<kernels::VsSegments> segs(static_cast<size_t>(hq));
  std::vector<std::pair<int64_t, int64_t>> settings;
  for (int64_t h = 0; h < hq; ++h)
    if (uses_vs(a.patterns[h].pattern))
      settings.emplace_back(a.patterns[h].spread_rows, a.patterns[h].segment_rows);
  std::sort(settings.begin(), settings.end());
  settings.erase(std::unique(settings.begin(), settings.end()), settings.end());
  // KV-group-shared ranking (sparse_select.h): a sharing set ranks by its heads' summed scores,
  // which its leader's arrays hold after the exchange (members[leader] lists the set).
  const std::vector<HeadPattern> patterns(a.patterns, a.patterns + hq);
  const std::vector<int> leader = kernels::share_leaders(patterns, int(hq / hkv));
  std::vector<std::vector<int>> members(static_cast<size_t>(hq));
  for (int64_t h = 0; h < hq; ++h) members[size_t(leader[size_t(h)])].push_back(int(h));
  auto shares = [&](int64_t h) { return members[size_t(leader[size_t(h)])].size() > 1; };
  CpEstimateBytes bytes;
  for (const auto& [sp, sr] : settings) {
    std::vector<int> hs;
    for (int64_t h = 0; h < hq; ++h)
      if (uses_vs(a.patterns[h].pattern) && a.patterns[h].spread_rows == sp &&
          a.patterns[h].segment_rows == sr)
        hs.push_back(int(h));
    const int64_t nh = int64_t(hs.size());
    const kernels::VsSegments vsg = kernels::vs_segments(S, sp, sr);
    for (int h : hs) {
      segs[size_t(h)] = vsg;
      col[size_t(h)].assign(size_t(vsg.count() * S), 0.f);
      diag[size_t(h)].assign(size_t(vsg.count() * S), 0.f);
    }
    // One selection over all S items per head (no segments) with a top-k budget: only each
    // rank's candidates need to travel, where that is smaller than the sums themselves.
    // A sharing set's heads are summed on each rank before anything travels (score_rows'
    // `into`): the set sends one array, its leader's, which every member ranks by.
    std::vector<int> into(static_cast<size_t>(nh));
    for (int64_t x = 0; x < nh; ++x)
      into[size_t(x)] =
          int(std::find(hs.begin(), hs.end(), leader[size_t(hs[size_t(x)])]) - hs.begin());
    std::vector<TopK> col_k(static_cast<size_t>(nh)), diag_k(static_cast<size_t>(nh));
    if (CP > 1 && vsg.count() == 1 && vsg.end_row(0) == S && vsg.source[0] == 0)
      for (int64_t x = 0; x < nh; ++x) {
        if (into[size_t(x)] != x) continue;
        // vs_select takes min(budget, S) items, the forced ones first: the candidates must hold
        // every member's top others (ids at or past the set's fewest forced)
        bool mass = false;
        int64_t fc0 = S, fc1 = 0, fd0 = S, fd1 = 0, kc = 0, kd = 0;
        for (int m : members[size_t(hs[size_t(x)])]) {
          const HeadPattern& hp = a.patterns[m];
          mass |= hp.pattern != Pattern::kVerticalSlash;  // a mass threshold needs every sum
          const int64_t fc = std::min(std::max<int64_t>(hp.sink, 0), S),
                        fd = std::min(std::max<int64_t>(hp.local + 1, 0), S);
          fc0 = std::min(fc0, fc), fc1 = std::max(fc1, fc), fd0 = std::min(fd0, fd),
          fd1 = std::max(fd1, fd);
          kc = std::max(kc, std::max<int64_t>(hp.n_vertical - fc, 0));
          kd = std::max(kd, std::max<int64_t>(hp.n_slash - fd, 0));
        }
        if (mass) continue;
        kc += fc1 - fc0, kd += fd1 - fd0;
        if (2 * kc * CP < S) col_k[size_t(x)] = {kc, fc0};
        if ((CP - 1) * (S / CP + 2 * kd) < 2 * S) diag_k[size_t(x)] = {kd, fd0};
      }
    for (int64_t si = 0; si < vsg.count(); ++si) {
      if (vsg.rows[size_t(si)].empty()) continue;
      std::vector<float> cs, ds;
      SF_TRY(score_rows(cp, a, hs, vsg.rows[size_t(si)], true, &cs, &ds, &bytes, col_k, diag_k,
                        false, into));
      for (int64_t x = 0; x < nh; ++x) {
        std::copy(cs.begin() + x * S, cs.begin() + (x + 1) * S,
                  col[size_t(hs[size_t(x)])].begin() + si * S);
        std::copy(ds.begin() + x * S, ds.begin() + (x + 1) * S,
                  diag[size_t(hs[size_t(x)])].begin() + si * S);
      }
    }
  }

  // Block family: pooled k of every 64-key block (each block lives on one rank: its owner pools
  // it, then all-gather), pooled q of this rank's own query blocks (local), and the exact
  // softmax mass of the prompt's last query block per key block (scored like the columns).
  const int64_t n_kb = ceil_div(S, kB), n_qb_all = ceil_div(S, kB);
  std::vector<int> bh;
  for (int64_t h = 0; h < hq; ++h)
    if (uses_blocks(a.patterns[h].pattern)) bh.push_back(int(h));
  std::vector<float> pooled_k;  // [n_kb][hkv][d]
  std::vector<std::vector<float>> last_mass(static_cast<size_t>(hq));
  // last_block_rows heads: each last-block row's own mass per key block ([rows][n_kb]).
  std::vector<std::vector<std::vector<float>>> last_rows(static_cast<size_t>(hq));
  if (!bh.empty()) {
    std::vector<int64_t> counts(static_cast<size_t>(CP));
    for (int r = 0; r < CP; ++r) {
      const auto rr = cp_rank_ranges(S, CP, r);
      counts[size_t(r)] = (ceil_div(rr[0].size(), kB) + ceil_div(rr[1].size(), kB)) * hkv * d;
    }
    // The pooled keys travel as bf16: they are bf16 values already (the single-rank rule), so
    // half the bytes of f32 carry the same numbers.
    std::vector<uint16_t> mine(static_cast<size_t>(counts[size_t(cp.rank())]), 0),
        all(static_cast<size_t>(n_kb * hkv * d));
    {
      size_t o = 0;
      int64_t lrow = 0;
      std::vector<float> sum(static_cast<size_t>(d));
      for (const auto& r : a.ranges) {
        for (int64_t b0 = r.begin; b0 < r.end; b0 += kB) {
          const int64_t b1 = std::min(r.end, b0 + kB);
          for (int64_t kvh = 0; kvh < hkv; ++kvh) {
            std::fill(sum.begin(), sum.end(), 0.f);
            for (int64_t j = b0; j < b1; ++j) {
              const float* src = a.k_loc + ((lrow + j - r.begin) * hkv + kvh) * d;
              for (int64_t c = 0; c < d; ++c) sum[size_t(c)] += src[c];
            }
            for (int64_t c = 0; c < d; ++c)  // exact: pooled_mean's values are bf16
              mine[o + size_t(kvh * d + c)] =
                  f32_to_bf16(kernels::pooled_mean(sum[size_t(c)], b1 - b0));
          }
          o += size_t(hkv * d);
        }
        lrow += r.size();
      }
    }
    SF_TRY(cp.all_gatherv(mine.data(), int64_t(mine.size()), all.data(), counts, DType::kBF16));
    bytes.blocks += int64_t(sizeof(uint16_t)) * (int64_t(all.size()) - int64_t(mine.size()));
    pooled_k.resize(all.size());
    {
      size_t o = 0;
      for (int r = 0; r < CP; ++r)
        for (const auto& rr : cp_rank_ranges(S, CP, r))
          for (int64_t b0 = rr.begin; b0 < rr.end; b0 += kB) {
            float* dst = pooled_k.data() + (b0 / kB) * hkv * d;
            for (int64_t x = 0; x < hkv * d; ++x) dst[x] = bf16_to_f32(all[o + size_t(x)]);
            o += size_t(hkv * d);
          }
    }
    std::vector<int64_t> rows;
    for (int64_t r = (n_qb_all - 1) * kB; r < S; ++r) rows.push_back(r);
    std::vector<float> lc, unused;  // lc: [head][n_kb] column sums per key block
    SF_TRY(score_rows(cp, a, bh, rows, false, &lc, &unused, &bytes, {}, {}, /*pool_cols=*/true));
    for (size_t x = 0; x < bh.size(); ++x) {
      auto& m = last_mass[size_t(bh[x])];
      m.assign(lc.begin() + std::ptrdiff_t(x * size_t(n_kb)),
               lc.begin() + std::ptrdiff_t((x + 1) * size_t(n_kb)));
      for (float& v : m) v /= float(rows.size());  // each row's mass sums to 1
    }
    std::vector<int> rh;
    for (int h : bh)
      if (a.patterns[size_t(h)].last_block_rows) rh.push_back(h);
    // One scoring pass per row (the same collectives on every rank): the row's block sums.
    for (int64_t r : rows) {
      if (rh.empty()) break;
      std::vector<float> rc;
      SF_TRY(score_rows(cp, a, rh, {r}, false, &rc, &unused, &bytes, {}, {}, /*pool_cols=*/true));
      for (size_t x = 0; x < rh.size(); ++x)
        last_rows[size_t(rh[x])].emplace_back(rc.begin() + std::ptrdiff_t(x * size_t(n_kb)),
                                              rc.begin() + std::ptrdiff_t((x + 1) * size_t(n_kb)));
    }
  }
  auto local_row = [&](int64_t p) {
    return p < a.ranges[0].end ? p - a.ranges[0].begin : a.ranges[0].size() + p - a.ranges[1].begin;
  };
  const float scale = 1.f / std::sqrt(float(d));
  // One head's block scores for global query block gqb: the last block's exact mass, else pooled
  // q . pooled k.
  auto block_scores = [&](int64_t h, int64_t gqb) {
    if (gqb == n_qb_all - 1) return last_mass[size_t(h)];
    std::vector<float> sc(static_cast<size_t>(n_kb));
    std::vector<float> pq(static_cast<size_t>(d), 0.f);
    const int64_t q0 = gqb * kB, q1 = std::min(S, q0 + kB);
    for (int64_t rr = q0; rr < q1; ++rr) {
      const float* src = a.q_loc + (local_row(rr) * hq + h) * d;
      for (int64_t c = 0; c < d; ++c) pq[size_t(c)] += src[c];
    }
    for (float& v : pq) v = kernels::pooled_mean(v, q1 - q0);
    const int64_t kvh = h / (hq / hkv);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, 1, int(n_kb), int(d), scale, pq.data(),
                int(d), pooled_k.data() + kvh * d, int(hkv * d), 0.f, sc.data(), int(n_kb));
    return sc;
  };
  // Key blocks a block-family head selects for global query block gqb (single-rank rules).
  auto select_blocks = [&](int64_t h, int64_t gqb, const kernels::SparseSlotGeometry& sg) {
    const HeadPattern& hp = a.patterns[h];
    const bool exact = gqb == n_qb_all - 1;
    const int64_t n_allowed = ceil_div(sg.kend, kB);
    const bool shared = shares(h) && !exact;  // a set's last query block ranks per head
    std::vector<float> sc;
    if (!shared) {
      sc = block_scores(h, gqb);
    } else {  // the set's summed probabilities, in head order
      sc.assign(static_cast<size_t>(n_kb), 0.f);
      for (int m : members[size_t(leader[size_t(h)])]) {
        std::vector<float> r = block_scores(m, gqb);
        kernels::cpu::softmax_in_place(r.data(), n_allowed);
        for (int64_t b = 0; b < n_allowed; ++b) sc[size_t(b)] += r[size_t(b)];
      }
    }
    std::vector<int32_t> forced = kernels::block_forced(sg.base, sg.kend, kB);
    Budget bb;
    if (hp.pattern == Pattern::kBlockSparse) {
      bb.k = hp.n_blocks;
    } else {
      if (!exact && !shared) kernels::cpu::softmax_in_place(sc.data(), n_allowed);
      bb.mass = true;
      bb.gamma = hp.gamma;
      bb.min_count = ceil_div(hp.min_budget, kB);
      bb.max_count = ceil_div(hp.max_budget, kB);
    }
    if (exact && !last_rows[size_t(h)].empty()) {
      std::vector<std::vector<float>> rm;
      for (const auto& m : last_rows[size_t(h)])
        rm.emplace_back(m.begin(), m.begin() + std::ptrdiff_t(n_allowed));
      return kernels::select_union_rows(rm, sc.data(), n_allowed, forced, bb);
    }
    return select_ranked(sc.data(), n_allowed, std::move(forced), bb);
  };

  // 4) Candidates per head and segment (identical on every rank), then this rank's slots.
  std::vector<std::vector<std::vector<int32_t>>> cols(static_cast<size_t>(hq), {{}}),
      diags(static_cast<size_t>(hq), {{}});
  std::vector<int64_t> local(static_cast<size_t>(hq));
  for (int64_t h = 0; h < hq; ++h) {
    const HeadPattern& hp = a.patterns[h];
    local[size_t(h)] = hp.local;
    switch (hp.pattern) {
      case Pattern::kDense:
        local[size_t(h)] = S;
        break;
      case Pattern::kMoA:
        local[size_t(h)] = std::clamp<int64_t>(std::llround(hp.alpha + hp.beta * double(S)), 0, S);
        break;
      case Pattern::kVerticalSlash:
      case Pattern::kAdaptiveVS: {
        const kernels::VsSegments& vsg = segs[size_t(h)];
        cols[size_t(h)].assign(size_t(vsg.count()), {});
        diags[size_t(h)].assign(size_t(vsg.count()), {});
        for (int64_t si = 0; si < vsg.count(); ++si) {
          const int64_t src = vsg.source[size_t(si)], n = vsg.end_row(si);
          const size_t l = size_t(leader[size_t(h)]);
          kernels::vs_select(hp, col[l].data() + src * S, n, diag[l].data() + src * S, n,
                             &cols[size_t(h)][size_t(si)], &diags[size_t(h)][size_t(si)]);
        }
        break;
      }
      default:
        break;
    }
  }
  out->assign(a.pieces.size(), kernels::SparseIndex{});
  std::vector<int32_t> blocks, cl;
  for (size_t pi = 0; pi < a.pieces.size(); ++pi) {
    const TokenRange& r = a.pieces[pi];
    if (r.size() == 0) continue;
    const int64_t nqb = (r.size() + kB - 1) / kB;
    std::vector<std::vector<int32_t>> sb(static_cast<size_t>(hq * nqb)),
        sc(static_cast<size_t>(hq * nqb));
    int64_t max_b = 0, max_c = 0;
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t qb = 0; qb < nqb; ++qb) {
        const auto g = kernels::sparse_slot_geometry(r.size(), r.end, r.begin, qb);
        blocks.clear();
        cl.clear();
        std::vector<int32_t> kbs;
        if (uses_blocks(a.patterns[h].pattern)) kbs = select_blocks(h, r.begin / kB + qb, g);
        const size_t si =
            uses_vs(a.patterns[h].pattern) ? size_t(segs[size_t(h)].of_row(r.begin + qb * kB)) : 0;
        kernels::sparse_slot_build(g, cols[size_t(h)][si], diags[size_t(h)][si], kbs,
                                   a.patterns[h].sink, local[size_t(h)],
                                   a.patterns[h].tail_block_min, &blocks, &cl);
        sb[size_t(h * nqb + qb)] = blocks;
        sc[size_t(h * nqb + qb)] = cl;
        max_b = std::max<int64_t>(max_b, int64_t(blocks.size()));
        max_c = std::max<int64_t>(max_c, int64_t(cl.size()));
      }
    kernels::SparseIndex ix =
        kernels::sparse_index_make(int(hq), r.size(), r.end, r.begin, int(max_b), int(max_c));
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t qb = 0; qb < nqb; ++qb) {
        const size_t sl = ix.slot(int(h), qb);
        const auto& b = sb[size_t(h * nqb + qb)];
        const auto& c = sc[size_t(h * nqb + qb)];
        ix.block_count[sl] = int32_t(b.size());
        ix.column_count[sl] = int32_t(c.size());
        std::copy(b.begin(), b.end(), ix.block_offset.begin() + std::ptrdiff_t(sl * size_t(max_b)));
        std::copy(c.begin(), c.end(), ix.column_index.begin() + std::ptrdiff_t(sl * size_t(max_c)));
      }
    (*out)[pi] = std::move(ix);
  }
  if (stats) {
    if (CP > 1) {  // a one-rank group moves nothing
      stats->bytes += bytes.total();
      stats->parts += bytes;
    }
    stats->seconds += sf::seconds_since(t0);
  }
  return Status::ok();
}

}  // namespace sf::runtime
