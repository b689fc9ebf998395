#include "kvstore/retention.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <sstream>

namespace sf::kvstore {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// Positions [0, N - window) ranked by score (ties: earlier position first), the best k of them,
// plus the window, ascending.
std::vector<int32_t> window_plus_topk(const float* score, int64_t N, int64_t window, int64_t k) {
  window = std::min(window, N);
  const int64_t cand = N - window;
  k = std::clamp<int64_t>(k, 0, cand);
  std::vector<int32_t> idx(static_cast<size_t>(cand));
  std::iota(idx.begin(), idx.end(), 0);
  if (k < cand && k > 0)
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
      return score[a] != score[b] ? score[a] > score[b] : a < b;
    });
  idx.resize(size_t(k));
  for (int64_t t = cand; t < N; ++t) idx.push_back(int32_t(t));
  std::sort(idx.begin(), idx.end());
  return idx;
}

std::vector<int32_t> range_union(int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
  std::vector<int32_t> v;
  for (int64_t t = a0; t < a1; ++t) v.push_back(int32_t(t));
  for (int64_t t = std::max(a1, b0); t < b1; ++t) v.push_back(int32_t(t));
  return v;
}

Status check_scores(const ImportanceScores* s, const char* policy, int n_layers, int n_kv_heads,
                    int64_t N) {
  if (!s || s->layers.empty())
    return SF_ERR(kInvalidArgument,
                  std::string("retention ") + policy +
                      ": needs importance scores (prefill with importance_window > 0)");
  if (s->n_layers != n_layers || s->n_kv_heads != n_kv_heads || s->n_tokens != N ||
      int64_t(s->layers.size()) != n_layers)
    return SF_ERR(kInvalidArgument, std::string("retention ") + policy +
                                        ": importance scores are for " + str(s->n_layers) +
                                        " layers x " + str(s->n_kv_heads) + " heads x " +
                                        str(s->n_tokens) + " tokens, the cache has " +
                                        str(n_layers) + " x " + str(n_kv_heads) + " x " + str(N));
  for (int l = 0; l < n_layers; ++l)
    if (int64_t(s->layers[size_t(l)].size()) != int64_t(n_kv_heads) * N)
      return SF_ERR(kInvalidArgument, std::string("retention ") + policy +
                                          ": importance of layer " + str(l) + " has " +
                                          str(int64_t(s->layers[size_t(l)].size())) +
                                          " values, expected " + str(int64_t(n_kv_heads) * N));
  return Status::ok();
}

Status check_budget(const char* policy, int64_t budget, int64_t window, int64_t N) {
  if (window < 0)
    return SF_ERR(kOutOfRange,
                  std::string("retention ") + policy + ": window " + str(window) + " is negative");
  if (budget < std::max<int64_t>(window, 1) || budget > N)
    return SF_ERR(kOutOfRange, std::string("retention ") + policy + ": budget " + str(budget) +
                                   " tokens out of range [" + str(std::max<int64_t>(window, 1)) +
                                   ", " + str(N) + "] (at least the window, at most the prompt)");
  return Status::ok();
}

}  // namespace

int64_t Retention::kept_total() const {
  int64_t n = 0;
  for (const auto& k : kept) n += int64_t(k.size());
  return n;
}

bool Retention::is_full() const {
  for (const auto& k : kept)
    if (int64_t(k.size()) != n_tokens) return false;
  return true;
}

const char* retention_kind_name(RetentionKind k) {
  switch (k) {
    case RetentionKind::kFull:
      return "full";
    case RetentionKind::kStreaming:
      return "streaming";
    case RetentionKind::kSnapKV:
      return "snapkv";
    case RetentionKind::kPyramid:
      return "pyramid";
    case RetentionKind::kMoA:
      return "moa";
    case RetentionKind::kLayerwise:
      return "layerwise";
  }
  return "?";
}

Result<RetentionPolicy> retention_parse(const std::string& spec) {
  const auto colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  RetentionPolicy p;
  std::vector<std::string> allowed;
  if (name == "full")
    p.kind = RetentionKind::kFull;
  else if (name == "streaming")
    p.kind = RetentionKind::kStreaming, allowed = {"sink", "window"};
  else if (name == "snapkv")
    p.kind = RetentionKind::kSnapKV, allowed = {"budget", "window", "pool"};
  else if (name == "pyramid")
    p.kind = RetentionKind::kPyramid, allowed = {"budget", "window", "beta"};
  else if (name == "layerwise")
    p.kind = RetentionKind::kLayerwise, allowed = {"n_full", "window", "topk"};
  else if (name == "moa")
    return SF_ERR(kInvalidArgument,
                  "retention 'moa' takes per-head spans from a config, not a spec string");
  else
    return SF_ERR(kInvalidArgument, "unknown retention policy '" + name +
                                        "' (full, streaming, snapkv, pyramid, moa, layerwise)");
  if (colon == std::string::npos) {
    if (p.kind == RetentionKind::kSnapKV || p.kind == RetentionKind::kPyramid)
      return SF_ERR(kInvalidArgument, "retention " + name + " needs budget=TOKENS");
    return p;
  }
  std::stringstream ss(spec.substr(colon + 1));
  std::string kv;
  bool have_budget = false;
  while (std::getline(ss, kv, ',')) {
    const auto eq = kv.find('=');
    const std::string key = kv.substr(0, eq);
    if (eq == std::string::npos || std::find(allowed.begin(), allowed.end(), key) == allowed.end())
      return SF_ERR(kInvalidArgument,
                    "retention " + name + ": unknown or malformed parameter '" + kv + "'");
    const std::string val = kv.substr(eq + 1);
    char* end = nullptr;
    const double x = std::strtod(val.c_str(), &end);
    if (val.empty() || *end != '\0' || !std::isfinite(x))
      return SF_ERR(kInvalidArgument,
                    "retention " + name + ": " + key + " = '" + val + "' is not a number");
    if (key != "beta" && x != std::floor(x))
      return SF_ERR(kInvalidArgument,
                    "retention " + name + ": " + key + " = '" + val + "' must be an integer");
    if (key == "sink")
      p.sink = int64_t(x);
    else if (key == "window")
      p.window = int64_t(x);
    else if (key == "budget")
      p.budget = int64_t(x), have_budget = true;
    else if (key == "pool")
      p.pool = int(x);
    else if (key == "beta")
      p.beta = x;
    else if (key == "n_full")
      p.n_full = int(x);
    else if (key == "topk")
      p.topk = int64_t(x);
  }
  if ((p.kind == RetentionKind::kSnapKV || p.kind == RetentionKind::kPyramid) && !have_budget)
    return SF_ERR(kInvalidArgument, "retention " + name + " needs budget=TOKENS");
  return p;
}

std::string retention_params(const RetentionPolicy& p) {
  std::ostringstream o;
  switch (p.kind) {
    case RetentionKind::kFull:
      break;
    case RetentionKind::kStreaming:
      o << "sink=" << p.sink << ",window=" << p.window;
      break;
    case RetentionKind::kSnapKV:
      o << "budget=" << p.budget << ",window=" << p.window << ",pool=" << p.pool;
      break;
    case RetentionKind::kPyramid:
      o << "budget=" << p.budget << ",window=" << p.window << ",beta=" << p.beta;
      break;
    case RetentionKind::kMoA:
      o << "sink=" << p.moa_sink << ",heads=" << p.moa.size() << "x"
        << (p.moa.empty() ? 0 : p.moa[0].size());
      break;
    case RetentionKind::kLayerwise:
      o << "n_full=" << p.n_full << ",window=" << p.window << ",topk=" << p.topk;
      break;
  }
  return o.str();
}

Result<std::vector<int64_t>> pyramid_layer_budgets(int64_t budget, int64_t window, double beta,
                                                   int n_layers, int64_t N) {
  SF_TRY(check_budget("pyramid", budget, window, N));
  if (!(beta >= 1))
    return SF_ERR(kOutOfRange, "retention pyramid: beta " + std::to_string(beta) + " must be >= 1");
  if (n_layers <= 0) return SF_ERR(kInvalidArgument, "retention pyramid: no layers");
  // PyramidKV (pyramidkv_utils.py): scored part falls linearly from max_num (bottom) to min_num
  // (top) with min_num = avg / beta and mean avg; when max_num would exceed what a layer can
  // hold, the bottom is capped and the top raised to keep the same total.
  const double avg = double(budget - window), cap = double(N - window);
  double lo = avg / beta, hi = 2 * avg - lo;
  if (hi > cap) {
    hi = cap;
    lo = 2 * avg - hi;
  }
  std::vector<int64_t> out(static_cast<size_t>(n_layers));
  const double step = n_layers > 1 ? (hi - lo) / (n_layers - 1) : 0;
  for (int l = 0; l < n_layers; ++l) {
    const double scored = n_layers > 1 ? hi - step * l : avg;
    out[size_t(l)] = window + std::clamp<int64_t>(int64_t(std::llround(scored)), 0, N - window);
  }
  return out;
}

Result<Retention> retention_apply(const RetentionPolicy& p, int n_layers, int n_kv_heads, int64_t N,
                                  const ImportanceScores* scores) {
  if (n_layers <= 0 || n_kv_heads <= 0 || N <= 0)
    return SF_ERR(kInvalidArgument, "retention: empty cache geometry");
  if (N > INT32_MAX)
    return SF_ERR(kOutOfRange, "retention: " + str(N) + " tokens exceed int32 positions");
  Retention r;
  r.policy = retention_kind_name(p.kind);
  r.params = retention_params(p);
  r.n_layers = n_layers;
  r.n_kv_heads = n_kv_heads;
  r.n_tokens = N;
  r.kept.resize(size_t(n_layers) * size_t(n_kv_heads));
  auto all = [&] { return range_union(0, N, N, N); };
  switch (p.kind) {
    case RetentionKind::kFull:
      for (auto& k : r.kept) k = all();
      break;
    case RetentionKind::kStreaming: {
      if (p.sink < 0 || p.window < 1 || p.sink + p.window > N)
        return SF_ERR(kOutOfRange,
                      "retention streaming: sink " + str(p.sink) + " + window " + str(p.window) +
                          " out of range (window >= 1, sink >= 0, sink + window <= " + str(N) +
                          " prompt tokens)");
      for (auto& k : r.kept) k = range_union(0, p.sink, N - p.window, N);
      break;
    }
    case RetentionKind::kSnapKV: {
      SF_TRY(check_budget("snapkv", p.budget, p.window, N));
      SF_TRY(check_scores(scores, "snapkv", n_layers, n_kv_heads, N));
      if (scores->pool != p.pool)
        return SF_ERR(kInvalidArgument, "retention snapkv: pool " + std::to_string(p.pool) +
                                            " but the importance scores were pooled with kernel " +
                                            std::to_string(scores->pool));
      for (int l = 0; l < n_layers; ++l)
        for (int h = 0; h < n_kv_heads; ++h)
          r.kept[size_t(l * n_kv_heads + h)] = window_plus_topk(
              scores->layers[size_t(l)].data() + h * N, N, p.window, p.budget - p.window);
      break;
    }
    case RetentionKind::kPyramid: {
      SF_ASSIGN(auto budgets, pyramid_layer_budgets(p.budget, p.window, p.beta, n_layers, N));
      SF_TRY(check_scores(scores, "pyramid", n_layers, n_kv_heads, N));
      for (int l = 0; l < n_layers; ++l)
        for (int h = 0; h < n_kv_heads; ++h)
          r.kept[size_t(l * n_kv_heads + h)] = window_plus_topk(
              scores->layers[size_t(l)].data() + h * N, N, p.window, budgets[size_t(l)] - p.window);
      break;
    }
    case RetentionKind::kMoA: {
      if (int64_t(p.moa.size()) != n_layers)
        return SF_ERR(kInvalidArgument, "retention moa: config has " + str(int64_t(p.moa.size())) +
                                            " layers, the cache has " + str(n_layers));
      if (p.moa_sink < 0)
        return SF_ERR(kOutOfRange, "retention moa: sink " + str(p.moa_sink) + " is negative");
      for (int l = 0; l < n_layers; ++l) {
        if (int64_t(p.moa[size_t(l)].size()) != n_kv_heads)
          return SF_ERR(kInvalidArgument, "retention moa: layer " + str(l) + " has " +
                                              str(int64_t(p.moa[size_t(l)].size())) +
                                              " head spans, the cache has " + str(n_kv_heads) +
                                              " KV heads");
        for (int h = 0; h < n_kv_heads; ++h) {
          const MoaSpan& s = p.moa[size_t(l)][size_t(h)];
          if (!(s.alpha >= 0) || !(s.beta >= 0 && s.beta <= 1))
            return SF_ERR(kOutOfRange, "retention moa: layer " + str(l) + " head " + str(h) +
                                           ": alpha " + std::to_string(s.alpha) +
                                           " must be >= 0 and beta " + std::to_string(s.beta) +
                                           " in [0, 1]");
          const int64_t span =
              std::clamp<int64_t>(int64_t(std::llround(s.alpha + s.beta * double(N))), 1, N);
          r.kept[size_t(l * n_kv_heads + h)] = range_union(0, std::min(p.moa_sink, N), N - span, N);
        }
      }
      break;
    }
    case RetentionKind::kLayerwise: {
      if (p.n_full < 0 || p.n_full > n_layers)
        return SF_ERR(kOutOfRange, "retention layerwise: n_full " + str(p.n_full) +
                                       " out of range [0, " + str(n_layers) + "]");
      if (p.window < 1 || p.topk < 0 || p.window + p.topk > N)
        return SF_ERR(kOutOfRange, "retention layerwise: window " + str(p.window) + " + topk " +
                                       str(p.topk) +
                                       " out of range (window >= 1, topk >= 0, sum <= " + str(N) +
                                       " prompt tokens)");
      if (p.topk > 0) SF_TRY(check_scores(scores, "layerwise", n_layers, n_kv_heads, N));
      for (int l = 0; l < n_layers; ++l)
        for (int h = 0; h < n_kv_heads; ++h)
          r.kept[size_t(l * n_kv_heads + h)] =
              l < p.n_full
                  ? all()
                  : (p.topk > 0 ? window_plus_topk(scores->layers[size_t(l)].data() + h * N, N,
                                                   p.window, p.topk)
                                : range_union(0, 0, N - p.window, N));
      break;
    }
  }
  return r;
}

Result<RetentionPolicy> retention_for_fraction(RetentionKind kind, double f, int n_layers,
                                               int64_t N) {
  if (!(f > 0 && f <= 1))
    return SF_ERR(kOutOfRange,
                  "retention budget fraction " + std::to_string(f) + " out of range (0, 1]");
  RetentionPolicy p;
  p.kind = kind;
  const int64_t B = std::max<int64_t>(1, std::llround(f * double(N)));
  switch (kind) {
    case RetentionKind::kFull:
      break;
    case RetentionKind::kStreaming:
      p.sink = std::min<int64_t>(4, B / 2);
      p.window = B - p.sink;
      break;
    case RetentionKind::kSnapKV:
    case RetentionKind::kPyramid:
      p.window = std::min<int64_t>(32, B);
      p.budget = B;
      break;
    case RetentionKind::kLayerwise: {
      // Full layers at the bottom take half the budget; the rest split window + top-k evenly.
      p.n_full = std::min(n_layers - 1, int(f * n_layers / 2));
      const double rest = (f * n_layers - p.n_full) / double(n_layers - p.n_full);
      const int64_t per = std::max<int64_t>(1, std::llround(rest * double(N)));
      p.window = std::min<int64_t>(32, per);
      p.topk = per - p.window;
      break;
    }
    case RetentionKind::kMoA:
      return SF_ERR(kInvalidArgument,
                    "retention moa: spans come from a per-head config, not a fraction");
  }
  return p;
}

}  // namespace sf::kvstore
