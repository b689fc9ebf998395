#include "decode/decode_attention.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "common/args.h"
#include "common/thread_pool.h"

namespace sf::decode {

Result<DecodeAttnParams> decode_attn_parse(const std::string& spec) {
  DecodeAttnParams p;
  if (spec == "full") return p;
  const size_t colon = spec.find(':');
  std::string mode = spec.substr(0, colon);
  const bool gqa = mode.size() > 4 && mode.compare(mode.size() - 4, 4, "+gqa") == 0;
  if (gqa) mode.resize(mode.size() - 4);
  if (colon != std::string::npos && (mode == "psa" || mode == "psa-avg" || mode == "psa-strict")) {
    // EPS, then optional fields: a guard margin (a number) and a verified draft (verifyN).
    std::vector<std::string> f;
    for (size_t at = colon + 1;;) {
      const size_t c2 = spec.find(':', at);
      f.push_back(spec.substr(at, c2 == std::string::npos ? std::string::npos : c2 - at));
      if (c2 == std::string::npos) break;
      at = c2 + 1;
    }
    const std::string v = f[0];
    for (size_t i = 1; i < f.size(); ++i) {
      const std::string& g = f[i];
      if (g.rfind("verify", 0) == 0) {
        const std::string n = g.substr(6);
        char* nend = nullptr;
        const long k = std::strtol(n.c_str(), &nend, 10);
        if (n.empty() || !std::isdigit(static_cast<unsigned char>(n[0])) || *nend != '\0' ||
            k < 1 || k > kMaxVerifyDraft || p.verify_draft > 0)
          return SF_ERR(kOutOfRange, "decode attention psa: '" + g +
                                         "' must be verifyN, N in [1, " +
                                         std::to_string(kMaxVerifyDraft) + "], given once");
        p.verify_draft = int(k);
        continue;
      }
      double margin = 0;
      if (!whole_number(g, &margin) || !(margin > 0) ||
          p.guard_margin > 0)
        return SF_ERR(kOutOfRange, "decode attention psa: guard margin '" + g +
                                       "' must be a positive number of nats, given once");
      p.guard_margin = margin;
    }
    double e = 0;
    if (!whole_number(v, &e) || !(e > 0 && e <= 1))
      return SF_ERR(kOutOfRange,
                    "decode attention psa: eps '" + v + "' must be a number in (0, 1]");
    p.mode = DecodeAttnMode::kPsa;
    p.eps = e;
    p.pin_sink_recent = mode != "psa-strict";
    p.remainder = mode == "psa-avg" ? PsaRemainder::kRecentMean : PsaRemainder::kAsMin;
    p.share_kv_head = gqa;
    return p;
  }
  return SF_ERR(kInvalidArgument, "decode attention '" + spec +
                                      "' is not 'full', 'psa:EPS', 'psa-avg:EPS' or "
                                      "'psa-strict:EPS' (each psa mode may add '+gqa' before "
                                      "the colon, and ':MARGIN' and ':verifyN' after EPS)");
}

namespace {
// Eight partial sums so the compiler can vectorize without reassociating a single sum.
float dot(const float* a, const float* b, int d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int c = 0;
  for (; c + 8 <= d; c += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[c + j] * b[c + j];
  float s = 0;
  for (; c < d; ++c) s += a[c] * b[c];
  for (int j = 0; j < 8; ++j) s += acc[j];
  return s;
}
}  // namespace

float block_score_bound(const float* q, const KvBlock& b, int d) {
  float u = 0;
  for (int c = 0; c < d; ++c) u += std::max(q[c] * b.kmin[size_t(c)], q[c] * b.kmax[size_t(c)]);
  return u;
}

namespace {
// One query head's online softmax over the blocks folded into it, and its PSA stop rule. acc,
// as_min and recent[] are relative to the running max m; recent[] holds the last kPsaAvgBlocks
// ranked blocks' masses (psa-avg).
struct HeadVisit {
  const float* q = nullptr;
  float* o = nullptr;
  float m = -std::numeric_limits<float>::infinity();
  double acc = 0, as_min = std::numeric_limits<double>::infinity();
  double recent[kPsaAvgBlocks] = {};
  size_t ranked = 0;
  bool done = false;

  // Folds a block with at least one key at a position <= lim (later keys score -inf, so they
  // add exact zeros). `ranked_here`: the block came from this head's own ranking (not pinned,
  // not named by a group-mate), so its mass may stand for the blocks it has not seen.
  void fold(const KvBlock& B, bool ranked_here, int d, float scale, std::vector<float>& s,
            int32_t lim = std::numeric_limits<int32_t>::max()) {
    float bm = -std::numeric_limits<float>::infinity();
    for (int32_t t = 0; t < B.n; ++t) {
      const float* kr = B.k.data() + size_t(t) * size_t(d);
      s[size_t(t)] = B.pos[size_t(t)] > lim ? -std::numeric_limits<float>::infinity()
                                            : dot(q, kr, d) * scale;
      bm = std::max(bm, s[size_t(t)]);
    }
    if (bm > m) {
      const double r = std::exp(double(m) - double(bm));  // 0 on the first block
      for (int c = 0; c < d; ++c) o[c] = float(o[c] * r);
      acc *= r;
      if (std::isfinite(as_min)) as_min *= r;
      for (double& x : recent) x *= r;
      m = bm;
    }
    double as_b = 0;
    for (int32_t t = 0; t < B.n; ++t) {
      const float e = std::exp(s[size_t(t)] - m);
      as_b += e;
      const float* vr = B.v.data() + size_t(t) * size_t(d);
      for (int c = 0; c < d; ++c) o[c] += e * vr[c];
    }
    acc += as_b;
    // AS_min stands for the blocks not yet seen, so it comes from ranked blocks only (a pinned
    // sink is visited for its mass, not its rank) and from full-block equivalents (the newest
    // block may hold one token, whose tiny mass would end the visit at once).
    if (ranked_here) {
      const double full_b = as_b * double(kBlockTokens) / double(B.n);
      as_min = std::min(as_min, full_b);
      recent[ranked % kPsaAvgBlocks] = full_b;
      ++ranked;
    }
  }

  // The PSA stop rule with `left` blocks not yet folded.
  bool stop(const DecodeAttnParams& p, size_t left) const {
    if (ranked == 0) return false;
    double per_block = as_min;  // the estimate of each unseen block's mass
    if (p.remainder == PsaRemainder::kRecentMean) {
      if (ranked < size_t(kPsaAvgBlocks)) return false;
      per_block = 0;
      for (double x : recent) per_block += x;
      per_block /= kPsaAvgBlocks;
    }
    return acc / (acc + per_block * double(left)) >= p.eps;
  }

  // The share of the true softmax mass the visit captured: every block scored, relative to m.
  double captured(const PagedKvCache& cache, const std::vector<int32_t>& pages, int d,
                  float scale) const {
    double total = 0;
    for (int32_t pg : pages) {
      const KvBlock& B = cache.block(pg);
      for (int32_t t = 0; t < B.n; ++t)
        total += std::exp(double(dot(q, B.k.data() + size_t(t) * size_t(d), d) * scale) -
                          double(m));
    }
    return acc / total;
  }

  void normalize(int d) const {
    if (acc <= 0) return;
    const float inv = float(1.0 / acc);
    for (int c = 0; c < d; ++c) o[c] *= inv;
  }
};

// Block order of one query head: position order, or (psa) descending bound with the pinned sink
// and newest block first.
void rank_blocks(const PagedKvCache& cache, const std::vector<int32_t>& pages, const float* q,
                 int d, const DecodeAttnParams& p, std::vector<float>& ub,
                 std::vector<size_t>& order) {
  const size_t nb = pages.size();
  order.resize(nb);
  std::iota(order.begin(), order.end(), size_t(0));
  if (p.mode != DecodeAttnMode::kPsa) return;
  ub.resize(nb);
  // A NaN bound (NaN keys or query) counts as unbounded: the block is visited first, so the NaN
  // reaches the output as with full attention, and the sort keeps a strict order.
  for (size_t b = 0; b < nb; ++b) {
    ub[b] = block_score_bound(q, cache.block(pages[b]), d);
    if (std::isnan(ub[b])) ub[b] = std::numeric_limits<float>::infinity();
  }
  // Pinned blocks rank above every bound.
  if (p.pin_sink_recent && nb > 0) {
    ub[0] = std::numeric_limits<float>::infinity();
    ub[nb - 1] = std::numeric_limits<float>::infinity();
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ub[a] > ub[b]; });
}
}  // namespace

Status decode_attention(const PagedKvCache& cache, int layer, const float* q, int n_heads,
                        const DecodeAttnParams& p, float* out, DecodeAttnStats* stats) {
  const int hkv = cache.n_kv_heads(), d = cache.head_dim();
  if (layer < 0 || layer >= cache.n_layers())
    return SF_ERR(kOutOfRange, "decode_attention: layer out of range");
  if (n_heads <= 0 || n_heads % hkv)
    return SF_ERR(kInvalidArgument, "decode_attention: heads not a multiple of kv heads");
  const int group = n_heads / hkv;
  const float scale = p.scale > 0.f ? p.scale : 1.f / std::sqrt(float(d));
  std::vector<int64_t> visited_h(static_cast<size_t>(n_heads), 0),
      total_h(static_cast<size_t>(n_heads), 0);
  const bool psa = p.mode == DecodeAttnMode::kPsa;
  const bool measure = p.measure_mass && psa;
  std::vector<double> share_h(static_cast<size_t>(n_heads), 1.0);
  // Blocks each KV head loaded: the union of its query heads' visits (a flag per block), kept
  // when a PSA call's stats ask for it or +gqa needs it. Full mode loads every block: no flags.
  const bool shared = psa && p.share_kv_head;
  const bool track = psa && (stats || shared);
  std::vector<std::vector<char>> loaded_g(static_cast<size_t>(hkv));
  if (stats || shared)
    for (int g = 0; g < hkv; ++g)
      loaded_g[size_t(g)].assign(cache.pages(layer, g).size(), track ? 0 : 1);
  const auto start_head = [&](int h) {
    HeadVisit hv;
    hv.q = q + size_t(h) * size_t(d);
    hv.o = out + size_t(h) * size_t(d);
    std::fill(hv.o, hv.o + d, 0.f);
    return hv;
  };
  const auto finish_head = [&](int h, const HeadVisit& hv, const std::vector<int32_t>& pages,
                               size_t visited) {
    if (measure && hv.acc > 0) share_h[size_t(h)] = hv.captured(cache, pages, d, scale);
    hv.normalize(d);
    visited_h[size_t(h)] = int64_t(visited);
    total_h[size_t(h)] = int64_t(pages.size());
  };
  if (shared) {
    // One visit per KV head: its query heads take turns naming the next block (module comment).
    parallel_for(size_t(hkv), [&](size_t gb, size_t ge) {
      std::vector<float> s(kBlockTokens), ub;
      std::vector<std::vector<size_t>> order(static_cast<size_t>(group));
      std::vector<HeadVisit> hv(static_cast<size_t>(group));
      std::vector<size_t> next(static_cast<size_t>(group));
      for (int g = int(gb); g < int(ge); ++g) {
        const auto& pages = cache.pages(layer, g);
        const size_t nb = pages.size();
        for (int j = 0; j < group; ++j) {
          hv[size_t(j)] = start_head(g * group + j);
          rank_blocks(cache, pages, hv[size_t(j)].q, d, p, ub, order[size_t(j)]);
          next[size_t(j)] = 0;
        }
        std::vector<char>& loaded = loaded_g[size_t(g)];
        size_t n_loaded = 0;
        int running = group;
        while (n_loaded < nb && running > 0) {
          for (int j = 0; j < group && n_loaded < nb && running > 0; ++j) {
            if (hv[size_t(j)].done) continue;
            auto& ord = order[size_t(j)];
            size_t& nx = next[size_t(j)];
            while (loaded[ord[nx]]) ++nx;  // n_loaded < nb: an unloaded block remains
            const size_t b = ord[nx];
            loaded[b] = 1;
            ++n_loaded;
            const KvBlock& B = cache.block(pages[b]);
            if (B.n == 0) continue;
            const bool pinned = p.pin_sink_recent && (b == 0 || b == nb - 1);
            for (int i = 0; i < group; ++i)
              hv[size_t(i)].fold(B, i == j && !pinned, d, scale, s);
            for (auto& v : hv)
              if (!v.done && v.stop(p, nb - n_loaded)) {
                v.done = true;
                --running;
              }
          }
        }
        for (int j = 0; j < group; ++j) finish_head(g * group + j, hv[size_t(j)], pages, n_loaded);
      }
    });
  } else {
    // Query heads are independent: one task per head range, each with its own scratch.
    std::vector<std::vector<size_t>> seen_h(static_cast<size_t>(n_heads));
    parallel_for(size_t(n_heads), [&](size_t hb, size_t he) {
      std::vector<float> s(kBlockTokens), ub;
      std::vector<size_t> order;
      for (int h = int(hb); h < int(he); ++h) {
        HeadVisit hv = start_head(h);
        const auto& pages = cache.pages(layer, h / group);
        const size_t nb = pages.size();
        rank_blocks(cache, pages, hv.q, d, p, ub, order);
        size_t visited = 0;
        for (size_t oi = 0; oi < nb; ++oi) {
          const KvBlock& B = cache.block(pages[order[oi]]);
          ++visited;
          if (B.n == 0) continue;
          const bool pinned = p.pin_sink_recent && (order[oi] == 0 || order[oi] == nb - 1);
          hv.fold(B, !pinned, d, scale, s);
          if (psa && hv.stop(p, nb - visited)) break;
        }
        finish_head(h, hv, pages, visited);
        if (track) seen_h[size_t(h)].assign(order.begin(), order.begin() + ptrdiff_t(visited));
      }
    });
    for (int h = 0; h < n_heads; ++h)
      for (size_t b : seen_h[size_t(h)]) loaded_g[size_t(h / group)][b] = 1;
  }
  if (!stats) return Status::ok();
  stats->last_visited_by_head.assign(visited_h.begin(), visited_h.end());
  for (const auto& l : loaded_g) {
    stats->kv_blocks_loaded += std::count(l.begin(), l.end(), char(1));
    stats->kv_blocks_total += int64_t(l.size());
  }
  for (int h = 0; h < n_heads; ++h) {
    stats->blocks_visited += visited_h[size_t(h)];
    stats->blocks_computed += visited_h[size_t(h)];
    stats->blocks_total += total_h[size_t(h)];
    if (measure) {
      const double sh = share_h[size_t(h)];
      stats->mass_sum += sh;
      stats->mass_min = std::min(stats->mass_min, sh);
      stats->mass_n += 1;
      stats->mass_below_eps += sh < p.eps - 1e-6;  // short by more than float rounding
    }
  }
  return Status::ok();
}

Status decode_attention_causal(const PagedKvCache& cache, int layer, const float* q, int n,
                               const int32_t* pos, int n_heads, float scale, float* out,
                               DecodeAttnStats* stats) {
  const int hkv = cache.n_kv_heads(), d = cache.head_dim();
  if (layer < 0 || layer >= cache.n_layers())
    return SF_ERR(kOutOfRange, "decode_attention_causal: layer out of range");
  if (n_heads <= 0 || n_heads % hkv)
    return SF_ERR(kInvalidArgument, "decode_attention_causal: heads not a multiple of kv heads");
  if (n <= 0) return SF_ERR(kInvalidArgument, "decode_attention_causal: no tokens");
  for (int i = 1; i < n; ++i)
    if (pos[i] <= pos[i - 1])
      return SF_ERR(kInvalidArgument, "decode_attention_causal: positions not increasing");
  const int group = n_heads / hkv;
  if (!(scale > 0.f)) scale = 1.f / std::sqrt(float(d));
  const size_t row = size_t(n_heads) * size_t(d);
  // visible[h][i]: blocks token i of query head h reads (those holding a key at or before it).
  std::vector<std::vector<int64_t>> visible(static_cast<size_t>(n_heads),
                                            std::vector<int64_t>(static_cast<size_t>(n), 0));
  parallel_for(size_t(n_heads), [&](size_t hb, size_t he) {
    std::vector<float> s(kBlockTokens);
    std::vector<HeadVisit> hv(static_cast<size_t>(n));
    for (int h = int(hb); h < int(he); ++h) {
      for (int i = 0; i < n; ++i) {
        hv[size_t(i)] = HeadVisit{};
        hv[size_t(i)].q = q + size_t(i) * row + size_t(h) * size_t(d);
        hv[size_t(i)].o = out + size_t(i) * row + size_t(h) * size_t(d);
        std::fill(hv[size_t(i)].o, hv[size_t(i)].o + d, 0.f);
      }
      // One read of each block serves every token that can see it, in position order as a
      // single-token full call folds them.
      for (int32_t pg : cache.pages(layer, h / group)) {
        const KvBlock& B = cache.block(pg);
        for (int i = 0; i < n; ++i) {
          if (B.n > 0 && B.pos[0] > pos[i]) continue;  // opened after token i
          ++visible[size_t(h)][size_t(i)];  // an empty block counts, as a single call counts it
          if (B.n > 0) hv[size_t(i)].fold(B, false, d, scale, s, pos[i]);
        }
      }
      for (auto& v : hv) v.normalize(d);
    }
  });
  if (!stats) return Status::ok();
  stats->last_total_by_token.assign(static_cast<size_t>(n), 0);
  for (int h = 0; h < n_heads; ++h) {
    const int64_t read = int64_t(cache.pages(layer, h / group).size());
    stats->blocks_visited += read;
    if (h % group == 0) stats->kv_blocks_loaded += read;
    for (int i = 0; i < n; ++i) {
      const int64_t vis = visible[size_t(h)][size_t(i)];
      stats->blocks_total += vis;
      stats->blocks_computed += vis;
      stats->last_total_by_token[size_t(i)] += vis;
      if (h % group == 0) stats->kv_blocks_total += vis;
    }
  }
  return Status::ok();
}

}  // namespace sf::decode
