#include "decode/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "common/thread_pool.h"

namespace sf::decode {

Result<DecodeAttnParams> decode_attn_parse(const std::string& spec) {
  DecodeAttnParams p;
  if (spec == "full") return p;
  const bool strict = spec.rfind("psa-strict:", 0) == 0;
  const bool avg = spec.rfind("psa-avg:", 0) == 0;
  if (spec.rfind("psa:", 0) == 0 || strict || avg) {
    const std::string v = spec.substr(strict ? 11 : avg ? 8 : 4);
    char* end = nullptr;
    const double e = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(e > 0 && e <= 1))
      return SF_ERR(kOutOfRange,
                    "decode attention psa: eps '" + v + "' must be a number in (0, 1]");
    p.mode = DecodeAttnMode::kPsa;
    p.eps = e;
    p.pin_sink_recent = !strict;
    p.remainder = avg ? PsaRemainder::kRecentMean : PsaRemainder::kAsMin;
    return p;
  }
  return SF_ERR(kInvalidArgument, "decode attention '" + spec +
                                      "' is not 'full', 'psa:EPS', 'psa-avg:EPS' or "
                                      "'psa-strict:EPS'");
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
  // Query heads are independent: one task per head range, each with its own scratch.
  parallel_for(size_t(n_heads), [&](size_t hb, size_t he) {
    std::vector<float> s(kBlockTokens), ub;
    std::vector<size_t> order;
    for (int h = int(hb); h < int(he); ++h) {
      const float* qh = q + size_t(h) * size_t(d);
      float* o = out + size_t(h) * size_t(d);
      std::fill(o, o + d, 0.f);
      const auto& pages = cache.pages(layer, h / group);
      const size_t nb = pages.size();
      order.resize(nb);
      std::iota(order.begin(), order.end(), size_t(0));
      if (psa) {
        ub.resize(nb);
        for (size_t b = 0; b < nb; ++b) {
          ub[b] = block_score_bound(qh, cache.block(pages[b]), d);
        }
        // Pinned blocks rank above every bound.
        if (p.pin_sink_recent && nb > 0) {
          ub[0] = std::numeric_limits<float>::infinity();
          ub[nb - 1] = std::numeric_limits<float>::infinity();
        }
        std::stable_sort(order.begin(), order.end(),
                         [&](size_t a, size_t b) { return ub[a] > ub[b]; });
      }
      // Online softmax over visited blocks; acc, as_min and recent[] are relative to the running
      // max m. recent[]: the last kPsaAvgBlocks ranked blocks' masses (psa-avg).
      float m = -std::numeric_limits<float>::infinity();
      double acc = 0, as_min = std::numeric_limits<double>::infinity();
      double recent[kPsaAvgBlocks] = {};
      size_t visited = 0, ranked = 0;
      for (size_t oi = 0; oi < nb; ++oi) {
        const KvBlock& B = cache.block(pages[order[oi]]);
        float bm = -std::numeric_limits<float>::infinity();
        for (int32_t t = 0; t < B.n; ++t) {
          const float* kr = B.k.data() + size_t(t) * size_t(d);
          s[size_t(t)] = dot(qh, kr, d) * scale;
          bm = std::max(bm, s[size_t(t)]);
        }
        ++visited;
        if (B.n == 0) continue;
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
        const bool pinned = p.pin_sink_recent && (order[oi] == 0 || order[oi] == nb - 1);
        if (!pinned) {
          const double full_b = as_b * double(kBlockTokens) / double(B.n);
          as_min = std::min(as_min, full_b);
          recent[ranked % kPsaAvgBlocks] = full_b;
          ++ranked;
        }
        if (!psa || ranked == 0) continue;
        double per_block = as_min;  // the estimate of each unseen block's mass
        if (p.remainder == PsaRemainder::kRecentMean) {
          if (ranked < size_t(kPsaAvgBlocks)) continue;
          per_block = 0;
          for (double x : recent) per_block += x;
          per_block /= kPsaAvgBlocks;
        }
        const double left = double(nb - visited);
        if (acc / (acc + per_block * left) >= p.eps) break;
      }
      if (measure && acc > 0) {
        // The true denominator, relative to the same running max m: every block scored.
        double total = 0;
        for (size_t b = 0; b < nb; ++b) {
          const KvBlock& B = cache.block(pages[b]);
          for (int32_t t = 0; t < B.n; ++t)
            total += std::exp(double(dot(qh, B.k.data() + size_t(t) * size_t(d), d) * scale) -
                              double(m));
        }
        share_h[size_t(h)] = acc / total;
      }
      if (acc > 0) {
        const float inv = float(1.0 / acc);
        for (int c = 0; c < d; ++c) o[c] *= inv;
      }
      visited_h[size_t(h)] = int64_t(visited);
      total_h[size_t(h)] = int64_t(nb);
    }
  });
  if (stats) stats->last_visited_by_head.assign(visited_h.begin(), visited_h.end());
  if (stats)
    for (int h = 0; h < n_heads; ++h) {
      stats->blocks_visited += visited_h[size_t(h)];
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

}  // namespace sf::decode
