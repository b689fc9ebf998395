#include "kvstore/retention.h"

#include <algorithm>
#include <boost/json.hpp>
#include <charconv>
#include <cmath>
#include <iterator>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>

#include "common/args.h"
#include "common/dtype.h"
#include "common/file_io.h"

namespace sf::kvstore {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

constexpr int kMaxSpan = kRetentionMaxSpan;
constexpr int kMaxPool = kRetentionMaxPool;

// RetentionPolicy::span: out[j] = max of s over [j - span + 1, j], per head row of N. A
// monotonic queue of candidate positions (scores decreasing), so a 1M-token row costs O(N)
// whatever the span.
ImportanceScores forward_span(const ImportanceScores& in, int span) {
  ImportanceScores out = in;
  const int64_t N = in.n_tokens;
  std::vector<int64_t> q(static_cast<size_t>(N));
  for (size_t l = 0; l < in.layers.size(); ++l)
    for (int h = 0; h < in.n_kv_heads; ++h) {
      const float* a = in.layers[l].data() + h * N;
      float* o = out.layers[l].data() + h * N;
      size_t head = 0, tail = 0;  // q[head, tail)
      for (int64_t j = 0; j < N; ++j) {
        while (tail > head && nan_last(a[q[tail - 1]]) <= nan_last(a[j])) --tail;
        q[tail++] = j;
        if (q[head] <= j - span) ++head;
        o[j] = nan_last(a[q[head]]);
      }
    }
  return out;
}

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
      const float sa = nan_last(score[a]), sb = nan_last(score[b]);
      return sa != sb ? sa > sb : a < b;
    });
  idx.resize(size_t(k));
  for (int64_t t = cand; t < N; ++t) idx.push_back(int32_t(t));
  std::sort(idx.begin(), idx.end());
  return idx;
}

// Ada-KV (Feng et al. 2024, Ada-SnapKV): one layer's scored budget H * k is shared by its KV
// heads. Each head first keeps its own best `floor_k`; the rest go to the best remaining positions
// of any head. The scores are softmax column sums over the same window rows, so they compare
// across heads. Returns each head's positions plus its window, ascending.
std::vector<std::vector<int32_t>> ada_window_plus_topk(const float* score, int n_heads, int64_t N,
                                                       int64_t window, int64_t k, int64_t floor_k) {
  window = std::min(window, N);
  const int64_t cand = N - window;
  k = std::clamp<int64_t>(k, 0, cand);
  floor_k = std::clamp<int64_t>(floor_k, 0, k);
  struct Item {
    float s;
    int32_t h, t;
  };
  auto better = [](const Item& a, const Item& b) {
    return a.s != b.s ? a.s > b.s : (a.h != b.h ? a.h < b.h : a.t < b.t);
  };
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(n_heads));
  std::vector<Item> rest;
  rest.reserve(size_t(n_heads) * size_t(cand - floor_k));
  for (int h = 0; h < n_heads; ++h) {
    std::vector<Item> it(static_cast<size_t>(cand));
    for (int64_t t = 0; t < cand; ++t) it[size_t(t)] = {nan_last(score[h * N + t]), h, int32_t(t)};
    std::partial_sort(it.begin(), it.begin() + floor_k, it.end(), better);
    for (int64_t i = 0; i < floor_k; ++i) out[size_t(h)].push_back(it[size_t(i)].t);
    rest.insert(rest.end(), it.begin() + floor_k, it.end());
  }
  const int64_t shared = std::min<int64_t>(int64_t(n_heads) * (k - floor_k), int64_t(rest.size()));
  std::nth_element(rest.begin(), rest.begin() + shared, rest.end(), better);
  for (int64_t i = 0; i < shared; ++i) out[size_t(rest[size_t(i)].h)].push_back(rest[size_t(i)].t);
  for (auto& v : out) {
    for (int64_t t = cand; t < N; ++t) v.push_back(int32_t(t));
    std::sort(v.begin(), v.end());
  }
  return out;
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

// snapkv and adakv: scores of the cache's geometry, pooled with the policy's kernel.
Status check_snapkv_family(const char* policy, const RetentionPolicy& p,
                           const ImportanceScores* scores, int n_layers, int n_kv_heads,
                           int64_t N) {
  SF_TRY(check_scores(scores, policy, n_layers, n_kv_heads, N));
  if (scores->pool != p.pool)
    return SF_ERR(kInvalidArgument, std::string("retention ") + policy + ": pool " +
                                        std::to_string(p.pool) +
                                        " but the importance scores were pooled with kernel " +
                                        std::to_string(scores->pool));
  return Status::ok();
}

// One head's recent span on an N-token prompt; retention_apply and the budget search share it so
// the search counts exactly what apply keeps.
int64_t moa_span(const MoaSpan& s, int64_t N) {
  // Clamped as a double first: llround of a value past int64 (a config's alpha of 1e19) is
  // undefined, and glibc's LLONG_MIN would clamp to a span of 1.
  return int64_t(std::llround(std::clamp(s.alpha + s.beta * double(N), 1.0, double(N))));
}

int64_t moa_kept_total(const RetentionPolicy& p, int64_t N) {
  const int64_t sink = std::min(p.moa_sink, N);
  int64_t n = 0;
  for (const auto& layer : p.moa)
    for (const MoaSpan& s : layer) n += std::min(N, sink + moa_span(s, N));
  return n;
}

// The shortest text that parses back to x exactly: a policy's canonical params name it in the
// job's fingerprint, so two values must never print alike (the stream's 6 digits made
// floor=0.1234567 and 0.123457 one policy).
std::string num(double x) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

// A spec's "key=value,..." after its colon, in order: each key one of `allowed` and given once,
// no empty field (",," or a trailing comma: getline yields no field after a trailing comma, so
// it is refused up front). Values are left to the caller: moa's config is a path, not a number.
Result<std::vector<std::pair<std::string, std::string>>> spec_params(
    const std::string& name, const std::string& params, const std::vector<std::string>& allowed) {
  if (!params.empty() && params.back() == ',')
    return SF_ERR(kInvalidArgument,
                  "retention " + name + ": unknown or malformed parameter '' (trailing comma)");
  std::vector<std::pair<std::string, std::string>> out;
  std::stringstream ss(params);
  std::string kv;
  while (std::getline(ss, kv, ',')) {
    const auto eq = kv.find('=');
    std::string key = kv.substr(0, eq);
    if (eq == std::string::npos || std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      std::string keys;
      for (const auto& a : allowed) keys += (keys.empty() ? "" : ", ") + a;
      return SF_ERR(kInvalidArgument, "retention " + name + ": unknown or malformed parameter '" +
                                          kv + "' (" + (keys.empty() ? "it takes none" : keys) +
                                          ")");
    }
    for (const auto& [k, v] : out)
      if (k == key) return SF_ERR(kInvalidArgument, "retention " + name + ": " + key + " given twice");
    out.emplace_back(std::move(key), kv.substr(eq + 1));
  }
  return out;
}

Result<RetentionPolicy> moa_parse_spec(const std::string& spec) {
  const auto colon = spec.find(':');
  if (colon == std::string::npos)
    return SF_ERR(kInvalidArgument,
                  "retention moa needs config=FILE (per-layer, per-KV-head spans; docs/api.md)");
  // A second config= is refused, not taken silently with the first never read. A path cannot
  // hold a comma.
  const std::vector<std::string> allowed = {"config", "sink"};
  SF_ASSIGN(auto params, spec_params("moa", spec.substr(colon + 1), allowed));
  std::string config;
  int64_t sink = -1;
  for (const auto& [key, val] : params) {
    if (key == "config") {
      config = val;
      continue;
    }
    int64_t x = 0;
    if (!whole_int(val, &x) || x < 0)
      return SF_ERR(kInvalidArgument,
                    "retention moa: sink = '" + val + "' must be an integer >= 0");
    sink = x;
  }
  if (config.empty()) return SF_ERR(kInvalidArgument, "retention moa needs config=FILE");
  SF_ASSIGN(RetentionPolicy p, moa_config_load(config));
  if (sink >= 0) p.moa_sink = sink;
  return p;
}

}  // namespace

std::vector<int32_t> Retention::high_positions(int layer, int head) const {
  const auto& k = positions(layer, head);
  if (low.empty()) return k;
  const auto& lo = low[size_t(layer) * size_t(n_kv_heads) + size_t(head)];
  std::vector<int32_t> out;
  std::set_difference(k.begin(), k.end(), lo.begin(), lo.end(), std::back_inserter(out));
  return out;
}

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

bool retention_needs_scores(const RetentionPolicy& p) {
  return retention_uses_span(p.kind) || (p.kind == RetentionKind::kLayerwise && p.topk > 0);
}

bool retention_uses_span(RetentionKind k) {
  return k == RetentionKind::kSnapKV || k == RetentionKind::kAdaKV || k == RetentionKind::kPyramid;
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
    case RetentionKind::kAdaKV:
      return "adakv";
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
    p.kind = RetentionKind::kSnapKV, allowed = {"budget", "window", "pool", "span", "high"};
  else if (name == "adakv")
    p.kind = RetentionKind::kAdaKV, allowed = {"budget", "window", "pool", "floor", "span", "high"};
  else if (name == "pyramid")
    p.kind = RetentionKind::kPyramid, allowed = {"budget", "window", "beta", "span", "high"};
  else if (name == "layerwise")
    p.kind = RetentionKind::kLayerwise, allowed = {"n_full", "window", "topk"};
  else if (name == "moa")
    return moa_parse_spec(spec);
  else
    return SF_ERR(kInvalidArgument,
                  "unknown retention policy '" + name +
                      "' (full, streaming, snapkv, adakv, pyramid, moa, layerwise)");
  const bool needs_budget = p.kind == RetentionKind::kSnapKV || p.kind == RetentionKind::kAdaKV ||
                            p.kind == RetentionKind::kPyramid;
  if (colon == std::string::npos) {
    if (needs_budget) return SF_ERR(kInvalidArgument, "retention " + name + " needs budget=TOKENS");
    return p;
  }
  SF_ASSIGN(auto params, spec_params(name, spec.substr(colon + 1), allowed));
  bool have_budget = false;
  for (const auto& [key, val] : params) {
    double x = 0;
    if (!whole_number(val, &x))
      return SF_ERR(kInvalidArgument,
                    "retention " + name + ": " + key + " = '" + val + "' is not a number");
    if (key != "beta" && key != "floor" && x != std::floor(x))
      return SF_ERR(kInvalidArgument,
                    "retention " + name + ": " + key + " = '" + val + "' must be an integer");
    // Integers convert only in range (a huge double is undefined behaviour as an integer).
    if (key != "beta" && key != "floor" && std::fabs(x) > double(INT32_MAX))
      return SF_ERR(kOutOfRange, "retention " + name + ": " + key + " = '" + val +
                                     "' is out of range (|value| <= " + str(INT32_MAX) + ")");
    if (key == "sink")
      p.sink = int64_t(x);
    else if (key == "window")
      p.window = int64_t(x);
    else if (key == "budget")
      p.budget = int64_t(x), have_budget = true;
    else if (key == "pool") {
      if (x < 1 || x > kMaxPool || std::fmod(x, 2) == 0)
        return SF_ERR(kOutOfRange, "retention " + name + ": pool " + val +
                                       " must be odd and in [1, " + str(kMaxPool) + "]");
      p.pool = int(x);
    } else if (key == "beta")
      p.beta = x;
    else if (key == "floor")
      p.floor = x;
    else if (key == "n_full")
      p.n_full = int(x);
    else if (key == "topk")
      p.topk = int64_t(x);
    else if (key == "high")
      p.high = int64_t(x);
    else if (key == "span") {
      if (x < 1 || x > kMaxSpan)
        return SF_ERR(kOutOfRange, "retention " + name + ": span " + val + " out of range [1, " +
                                       str(kMaxSpan) + "]");
      p.span = int(x);
    }
  }
  if (needs_budget && !have_budget)
    return SF_ERR(kInvalidArgument, "retention " + name + " needs budget=TOKENS");
  if (p.kind == RetentionKind::kAdaKV && !(p.floor >= 0 && p.floor <= 1))
    return SF_ERR(kOutOfRange, "retention adakv: floor " + num(p.floor) + " out of range [0, 1]");
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
    case RetentionKind::kAdaKV:
      o << "budget=" << p.budget << ",window=" << p.window << ",pool=" << p.pool
        << ",floor=" << num(p.floor);
      break;
    case RetentionKind::kPyramid:
      o << "budget=" << p.budget << ",window=" << p.window << ",beta=" << num(p.beta);
      break;
    case RetentionKind::kMoA:
      if (!p.moa_config.empty()) o << "config=" << p.moa_config << ",";
      o << "sink=" << p.moa_sink << ",heads=" << p.moa.size() << "x"
        << (p.moa.empty() ? 0 : p.moa[0].size());
      if (p.moa_scale != 1) o << ",scale=" << num(p.moa_scale);
      break;
    case RetentionKind::kLayerwise:
      o << "n_full=" << p.n_full << ",window=" << p.window << ",topk=" << p.topk;
      break;
  }
  if (p.span != 1 && retention_uses_span(p.kind)) o << ",span=" << p.span;
  if (p.high != 0) o << ",high=" << p.high;
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
  // Each layer's share floored, then the tokens the floors left out of the total (budget -
  // window a layer) handed one each to the largest remainders, the lower layer first at a tie:
  // rounding each share on its own added a token wherever two mirrored shares ended in .5 (at
  // budget 42, window 32, 20 layers: 850 tokens for 840). The order keeps the schedule falling.
  std::vector<int64_t> k(static_cast<size_t>(n_layers));
  std::vector<double> rem(static_cast<size_t>(n_layers));
  int64_t floored = 0;
  for (int l = 0; l < n_layers; ++l) {
    const double scored = std::clamp(n_layers > 1 ? hi - step * l : avg, 0.0, cap);
    k[size_t(l)] = int64_t(std::floor(scored));
    rem[size_t(l)] = scored - double(k[size_t(l)]);
    floored += k[size_t(l)];
  }
  std::vector<int> order(static_cast<size_t>(n_layers));
  for (int l = 0; l < n_layers; ++l) order[size_t(l)] = l;
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return rem[size_t(a)] > rem[size_t(b)]; });
  int64_t left = std::clamp<int64_t>(int64_t(n_layers) * (budget - window) - floored, 0, n_layers);
  for (size_t i = 0; left > 0 && i < order.size(); ++i)
    if (k[size_t(order[i])] < N - window) ++k[size_t(order[i])], --left;
  int64_t raised = 0;
  for (int l = 0; l < n_layers; ++l) {
    // Without a window, a top layer's share can round to 0: each keeps at least one token, and
    // the bottom layers give those tokens back so the total stays the schedule's.
    raised += window == 0 && k[size_t(l)] == 0 ? 1 : 0;
    out[size_t(l)] = window + (window == 0 ? std::max<int64_t>(k[size_t(l)], 1) : k[size_t(l)]);
  }
  for (int l = 0; raised > 0 && l < n_layers; ++l) {
    const int64_t give = std::min(raised, out[size_t(l)] - 1);
    out[size_t(l)] -= give;
    raised -= give;
  }
  return out;
}

Status retention_check_prompt(const RetentionPolicy& p, int n_layers, int n_kv_heads, int64_t N) {
  if (n_layers <= 0 || n_kv_heads <= 0 || N <= 0)
    return SF_ERR(kInvalidArgument, "retention: empty cache geometry");
  if (N > INT32_MAX)
    return SF_ERR(kOutOfRange, "retention: " + str(N) + " tokens exceed int32 positions");
  if (retention_uses_span(p.kind) && (p.span < 1 || p.span > kMaxSpan))
    return SF_ERR(kOutOfRange, std::string("retention ") + retention_kind_name(p.kind) + ": span " +
                                   str(p.span) + " out of range [1, " + str(kMaxSpan) + "]");
  if (p.high != 0) {
    const char* name = retention_kind_name(p.kind);
    if (!retention_uses_span(p.kind))
      return SF_ERR(kInvalidArgument, std::string("retention ") + name +
                                          ": high= (a two-tier split) needs a scored policy "
                                          "(snapkv, adakv, pyramid)");
    if (p.high < p.window || p.high >= p.budget)
      return SF_ERR(kOutOfRange, std::string("retention ") + name + ": high " + str(p.high) +
                                     " out of range [window " + str(p.window) + ", budget " +
                                     str(p.budget) + ")");
  }
  switch (p.kind) {
    case RetentionKind::kFull:
      return Status::ok();
    case RetentionKind::kStreaming:
      if (p.sink < 0 || p.window < 1 || p.sink + p.window > N)
        return SF_ERR(kOutOfRange,
                      "retention streaming: sink " + str(p.sink) + " + window " + str(p.window) +
                          " out of range (window >= 1, sink >= 0, sink + window <= " + str(N) +
                          " prompt tokens)");
      return Status::ok();
    case RetentionKind::kSnapKV:
    case RetentionKind::kAdaKV:
      if (p.pool < 1 || p.pool > kMaxPool || p.pool % 2 == 0)
        return SF_ERR(kOutOfRange, std::string("retention ") + retention_kind_name(p.kind) +
                                       ": pool " + str(p.pool) + " must be odd and in [1, " +
                                       str(kMaxPool) + "]");
      return check_budget(retention_kind_name(p.kind), p.budget, p.window, N);
    case RetentionKind::kPyramid:
      return pyramid_layer_budgets(p.budget, p.window, p.beta, n_layers, N).status();
    case RetentionKind::kMoA:
      return retention_check_geometry(p, n_layers, n_kv_heads);
    case RetentionKind::kLayerwise:
      if (p.n_full < 0 || p.n_full > n_layers)
        return SF_ERR(kOutOfRange, "retention layerwise: n_full " + str(p.n_full) +
                                       " out of range [0, " + str(n_layers) + "]");
      if (p.window < 1 || p.topk < 0 || p.window + p.topk > N)
        return SF_ERR(kOutOfRange, "retention layerwise: window " + str(p.window) + " + topk " +
                                       str(p.topk) +
                                       " out of range (window >= 1, topk >= 0, sum <= " + str(N) +
                                       " prompt tokens)");
      return Status::ok();
  }
  return SF_ERR(kInvalidArgument, "retention: unknown policy");
}

Result<Retention> retention_apply(const RetentionPolicy& p, int n_layers, int n_kv_heads, int64_t N,
                                  const ImportanceScores* scores) {
  SF_TRY(retention_check_prompt(p, n_layers, n_kv_heads, N));
  if (p.high > 0) {
    // Two tiers: the policy at both budgets; high-budget picks outside the full budget's are
    // kept as well, so the high tier is always a subset of kept.
    RetentionPolicy one = p, hi = p;
    one.high = hi.high = 0;
    hi.budget = p.high;
    SF_ASSIGN(Retention r, retention_apply(one, n_layers, n_kv_heads, N, scores));
    SF_ASSIGN(Retention h, retention_apply(hi, n_layers, n_kv_heads, N, scores));
    r.params = retention_params(p);
    r.low.resize(r.kept.size());
    for (size_t i = 0; i < r.kept.size(); ++i) {
      std::vector<int32_t> all;
      std::set_union(r.kept[i].begin(), r.kept[i].end(), h.kept[i].begin(), h.kept[i].end(),
                     std::back_inserter(all));
      std::set_difference(all.begin(), all.end(), h.kept[i].begin(), h.kept[i].end(),
                          std::back_inserter(r.low[i]));
      r.kept[i] = std::move(all);
    }
    return r;
  }
  std::optional<ImportanceScores> spanned;
  if (retention_uses_span(p.kind) && p.span > 1 && scores) {
    SF_TRY(check_scores(scores, retention_kind_name(p.kind), n_layers, n_kv_heads, N));
    spanned = forward_span(*scores, p.span);
    scores = &*spanned;
  }
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
      for (auto& k : r.kept) k = range_union(0, p.sink, N - p.window, N);
      break;
    }
    case RetentionKind::kSnapKV: {
      SF_TRY(check_snapkv_family("snapkv", p, scores, n_layers, n_kv_heads, N));
      for (int l = 0; l < n_layers; ++l)
        for (int h = 0; h < n_kv_heads; ++h)
          r.kept[size_t(l * n_kv_heads + h)] = window_plus_topk(
              scores->layers[size_t(l)].data() + h * N, N, p.window, p.budget - p.window);
      break;
    }
    case RetentionKind::kAdaKV: {
      SF_TRY(check_snapkv_family("adakv", p, scores, n_layers, n_kv_heads, N));
      const int64_t k = p.budget - p.window;
      for (int l = 0; l < n_layers; ++l) {
        // Without a window a head whose floor rounds to 0 could lose every pick to the others
        // and keep no token, which no export can hold: each head keeps at least one.
        const int64_t floor_k = std::max<int64_t>(int64_t(std::floor(p.floor * double(k) + 1e-9)),
                                                  p.window == 0 ? 1 : 0);
        auto kept = ada_window_plus_topk(scores->layers[size_t(l)].data(), n_kv_heads, N, p.window,
                                         k, floor_k);
        for (int h = 0; h < n_kv_heads; ++h)
          r.kept[size_t(l * n_kv_heads + h)] = std::move(kept[size_t(h)]);
      }
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
      for (int l = 0; l < n_layers; ++l)
        for (int h = 0; h < n_kv_heads; ++h)
          r.kept[size_t(l * n_kv_heads + h)] = range_union(
              0, std::min(p.moa_sink, N), N - moa_span(p.moa[size_t(l)][size_t(h)], N), N);
      break;
    }
    case RetentionKind::kLayerwise: {
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
                                               int64_t N, int64_t window) {
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
    case RetentionKind::kAdaKV:
    case RetentionKind::kPyramid:
      p.window = std::min<int64_t>(window, B);
      p.budget = B;
      break;
    case RetentionKind::kLayerwise: {
      // Full layers at the bottom take half the budget; the rest split window + top-k evenly.
      p.n_full = std::min(n_layers - 1, int(f * n_layers / 2));
      const double rest = (f * n_layers - p.n_full) / double(n_layers - p.n_full);
      const int64_t per = std::max<int64_t>(1, std::llround(rest * double(N)));
      p.window = std::min<int64_t>(window, per);
      p.topk = per - p.window;
      break;
    }
    case RetentionKind::kMoA:
      return SF_ERR(kInvalidArgument,
                    "retention moa: spans come from a per-head config, not a fraction");
  }
  return p;
}

Status retention_check_geometry(const RetentionPolicy& p, int n_layers, int n_kv_heads) {
  if (p.kind != RetentionKind::kMoA) return Status::ok();
  const std::string from = p.moa_config.empty() ? "" : " ('" + p.moa_config + "')";
  if (int64_t(p.moa.size()) != n_layers)
    return SF_ERR(kInvalidArgument, "retention moa: config" + from + " has " +
                                        str(int64_t(p.moa.size())) + " layers, the cache has " +
                                        str(n_layers));
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
      if (!(s.alpha >= 0 && std::isfinite(s.alpha)) || !(s.beta >= 0 && s.beta <= 1))
        return SF_ERR(kOutOfRange, "retention moa: layer " + str(l) + " head " + str(h) +
                                       ": alpha " + num(s.alpha) +
                                       " must be finite and >= 0, beta " + num(s.beta) +
                                       " in [0, 1]");
    }
  }
  return Status::ok();
}

Result<RetentionPolicy> moa_config_parse(const std::string& text, const std::string& origin) {
  namespace json = boost::json;
  const std::string where = "moa config '" + origin + "'";
  auto bad = [&](const std::string& what) { return SF_ERR(kInvalidArgument, where + ": " + what); };
  boost::system::error_code ec;
  json::parse_options po;
  po.max_depth = 8;
  const json::value v = json::parse(text, ec, {}, po);
  if (ec) return bad("invalid JSON: " + ec.message());
  if (!v.is_object()) return bad("top level must be an object");
  const json::object& o = v.as_object();
  for (const auto& kv : o) {
    const std::string k(kv.key());
    if (k != "format" && k != "model" && k != "n_layers" && k != "n_kv_heads" && k != "sink" &&
        k != "layers" && k != "profile")
      return bad("unknown field '" + k +
                 "' (format, model, n_layers, n_kv_heads, sink, layers, profile)");
  }
  // "profile": how `sparsefill moa-profile` made the spans (provenance, not read).
  if (const json::value* pf = o.if_contains("profile"); pf && !pf->is_object())
    return bad("field 'profile' must be an object");
  // A JSON integer (or an integral double); INT64_MIN when it is not one.
  auto as_int = [](const json::value& x) -> int64_t {
    if (x.is_int64()) return x.as_int64();
    if (x.is_uint64()) return x.as_uint64() <= uint64_t(INT64_MAX) ? int64_t(x.as_uint64()) : -1;
    if (x.is_double() && std::isfinite(x.as_double()) &&
        std::floor(x.as_double()) == x.as_double() && std::fabs(x.as_double()) < 9e15)
      return int64_t(x.as_double());
    return INT64_MIN;
  };
  if (const json::value* f = o.if_contains("format"))
    if (!f->is_string() || f->as_string() != "sparsefill-moa-retention")
      return bad("field 'format' must be \"sparsefill-moa-retention\"");
  if (const json::value* m = o.if_contains("model"); m && !m->is_string())
    return bad("field 'model' must be a string");
  int64_t dims[2];
  const char* dim_names[2] = {"n_layers", "n_kv_heads"};
  for (int i = 0; i < 2; ++i) {
    const json::value* x = o.if_contains(dim_names[i]);
    if (!x) return bad(std::string("field '") + dim_names[i] + "' is missing");
    dims[i] = as_int(*x);
    if (dims[i] < 1 || dims[i] > 1 << 16)
      return bad(std::string("field '") + dim_names[i] + "' must be an integer in [1, 65536]");
  }
  RetentionPolicy p;
  p.kind = RetentionKind::kMoA;
  p.moa_config = origin;
  if (const json::value* x = o.if_contains("sink")) {
    p.moa_sink = as_int(*x);
    if (p.moa_sink < 0) return bad("field 'sink' must be an integer >= 0");
  }
  const json::value* layers = o.if_contains("layers");
  if (!layers || !layers->is_array() || int64_t(layers->as_array().size()) != dims[0])
    return bad("field 'layers' must be an array of n_layers = " + str(dims[0]) + " layers");
  p.moa.resize(size_t(dims[0]));
  for (int64_t l = 0; l < dims[0]; ++l) {
    const json::value& lv = layers->as_array()[size_t(l)];
    if (!lv.is_array() || int64_t(lv.as_array().size()) != dims[1])
      return bad("layer " + str(l) + " must be an array of n_kv_heads = " + str(dims[1]) +
                 " head spans");
    for (int64_t h = 0; h < dims[1]; ++h) {
      const std::string at = "layer " + str(l) + " head " + str(h);
      const json::value& hv = lv.as_array()[size_t(h)];
      if (!hv.is_object()) return bad(at + ": must be an object {\"alpha\": A, \"beta\": B}");
      MoaSpan span;
      for (const auto& kv : hv.as_object()) {
        const std::string k(kv.key());
        if (k != "alpha" && k != "beta")
          return bad(at + ": unknown field '" + k + "' (alpha, beta)");
      }
      for (auto [name, dst] : {std::pair{"alpha", &span.alpha}, std::pair{"beta", &span.beta}}) {
        const json::value* x = hv.as_object().if_contains(name);
        if (!x) return bad(at + ": field '" + name + "' is missing");
        if (!x->is_number() || !std::isfinite(x->to_number<double>()))
          return bad(at + ": field '" + name + "' must be a number");
        *dst = x->to_number<double>();
      }
      if (span.alpha < 0)
        return SF_ERR(kOutOfRange, where + ": " + at + ": field 'alpha' must be >= 0 (got " +
                                       num(span.alpha) + ")");
      if (span.beta < 0 || span.beta > 1)
        return SF_ERR(kOutOfRange, where + ": " + at + ": field 'beta' must be in [0, 1] (got " +
                                       num(span.beta) + ")");
      p.moa[size_t(l)].push_back(span);
    }
  }
  return p;
}

Result<RetentionPolicy> moa_config_load(const std::string& path) {
  SF_ASSIGN(const std::string text, read_file(path, "moa config"));
  return moa_config_parse(text, path);
}

Result<RetentionPolicy> retention_moa_scaled(const RetentionPolicy& base, double f, int n_layers,
                                             int n_kv_heads, int64_t N) {
  if (base.kind != RetentionKind::kMoA)
    return SF_ERR(kInvalidArgument, "retention_moa_scaled: the policy is not moa");
  if (!(f > 0 && f <= 1))
    return SF_ERR(kOutOfRange,
                  "retention budget fraction " + std::to_string(f) + " out of range (0, 1]");
  if (N <= 0) return SF_ERR(kInvalidArgument, "retention moa: empty prompt");
  SF_TRY(retention_check_geometry(base, n_layers, n_kv_heads));
  const int64_t full = int64_t(n_layers) * n_kv_heads * N;
  const int64_t target = int64_t(std::floor(f * double(full)));
  auto scaled = [&](double s) {
    RetentionPolicy p = base;
    for (auto& layer : p.moa)
      for (MoaSpan& sp : layer) sp = {sp.alpha * s, std::min(1.0, sp.beta * s)};
    p.moa_scale = base.moa_scale * s;
    return p;
  };
  const int64_t floor_kept = moa_kept_total(scaled(0), N);
  if (floor_kept > target)
    return SF_ERR(kOutOfRange, "retention moa: budget " + num(f) + " keeps " + str(target) +
                                   " tokens, below the " + str(floor_kept) +
                                   " of the sink plus one token per head (at least " +
                                   num(double(floor_kept) / double(full)) + " of this prompt)");
  // Every nonzero span covers the prompt at s_hi; heads with alpha = beta = 0 stay at one token.
  double s_hi = 0;
  for (const auto& layer : base.moa)
    for (const MoaSpan& sp : layer)
      if (sp.alpha + sp.beta * double(N) > 0)
        s_hi = std::max(s_hi, 2 * double(N) / (sp.alpha + sp.beta * double(N)));
  if (!std::isfinite(s_hi))  // a span near 0 but not 0 (alpha 1e-310): no finite scale covers it
    return SF_ERR(kInvalidArgument,
                  "retention moa: a head's span (alpha + beta * N) is too small to scale to "
                  "the prompt; give it alpha = beta = 0 or a usable span");
  if (s_hi == 0 || moa_kept_total(scaled(s_hi), N) <= target) return scaled(s_hi);
  // kept(lo) <= target < kept(hi). One head's tiny span can put s_hi hundreds of orders of
  // magnitude above the answer, beyond what bisecting from 0 reaches in 200 steps: step down by
  // 2^16 until the budget holds (lo reaches 0 only by underflow, where kept is floor_kept).
  double hi = s_hi, lo = s_hi / 65536;
  while (lo > 0 && moa_kept_total(scaled(lo), N) > target) {
    hi = lo;
    lo /= 65536;
  }
  for (int i = 0; i < 200 && hi - lo > 1e-12 * hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (moa_kept_total(scaled(mid), N) <= target)
      lo = mid;
    else
      hi = mid;
  }
  return scaled(lo);
}

}  // namespace sf::kvstore
