// Prefill forward, layer-major with token chunks. Causal attention of chunk c needs only K/V of
// chunks <= c of the same layer, so every linear layer and the attention of a chunk run while
// activations stay bounded by the chunk size; only the residual [S, hidden] and the KV cache
// grow with the prompt.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <vector>

#include "common/timing.h"
#include "kernels/api.h"
#include "kernels/kv_importance.h"
#include "kernels/sparse.h"
#include "worker/model/sparse_config.h"
#include "worker/model/model.h"

namespace sf::model {
namespace {

TensorView view2(float* p, int64_t a, int64_t b) { return TensorView::make(p, DType::kF32, {a, b}); }
TensorView view3(float* p, int64_t a, int64_t b, int64_t c) { return TensorView::make(p, DType::kF32, {a, b, c}); }

int32_t argmax_row(const float* r, int64_t n) {
  return int32_t(std::max_element(r, r + n) - r);
}

// KV groups whose query heads all came back with estimator scores (importance_from_estimator).
std::vector<bool> estimator_groups(const std::vector<std::vector<float>>& cols, int64_t hkv,
                                   int64_t group, int64_t nk) {
  std::vector<bool> ok(static_cast<size_t>(hkv), !cols.empty());
  for (int64_t g = 0; g < hkv && !cols.empty(); ++g)
    for (int64_t x = 0; x < group; ++x)
      ok[size_t(g)] = ok[size_t(g)] && int64_t(cols[size_t(g * group + x)].size()) == nk;
  return ok;
}

// imp [hkv, nk]: for each reused group, the max-pooled sum of its query heads' scores, the same
// reduction kv_importance applies to its own sums. A head's scores sum softmax rows, as many as its
// estimator scored (64 plus spread rows for vertical-slash, the last query block's for block
// heads: 1 to 64); each is rescaled to `rows` (the LSE pass's window) so groups from either source
// compare (adakv shares a layer's budget across KV heads, tiering takes the max over them).
void importance_from_columns(const std::vector<std::vector<float>>& cols,
                             const std::vector<bool>& reuse, int64_t group, int64_t nk, int pool,
                             double rows, float* imp) {
  std::vector<float> sum(static_cast<size_t>(nk));
  for (size_t g = 0; g < reuse.size(); ++g) {
    if (!reuse[g]) continue;
    std::fill(sum.begin(), sum.end(), 0.f);
    for (int64_t x = 0; x < group; ++x) {
      const auto& c = cols[g * size_t(group) + size_t(x)];
      double mass = 0;  // = the head's scored rows: each softmax row sums to 1
      for (int64_t j = 0; j < nk; ++j) mass += c[size_t(j)];
      const float scale = mass > 0 ? float(rows / mass) : 0.f;
      for (int64_t j = 0; j < nk; ++j) sum[size_t(j)] += scale * c[size_t(j)];
    }
    kernels::max_pool_keys(sum.data(), nk, pool, imp + int64_t(g) * nk);
  }
}

}  // namespace

int kv_staging_slots(const PrefillOptions& opt, int n_layers, int64_t slot_bytes) {
  if (opt.kv_staging_layers <= 0) return n_layers;  // a slot per layer, asked for
  int slots = std::min(n_layers, opt.kv_staging_layers);
  if (opt.kv_staging_max_bytes > 0 && slot_bytes > 0) {
    const int64_t fit = std::max<int64_t>(2, opt.kv_staging_max_bytes / slot_bytes);
    slots = int(std::min<int64_t>(slots, fit));
  }
  return slots;
}

Result<PrefillResult> prefill(const Model& m, std::span<const int32_t> tokens, const PrefillOptions& opt) {
  PrefillResult res;
  SF_TRY(extend(m, tokens, opt, &res));
  return res;
}

Status extend(const Model& m, std::span<const int32_t> tokens, const PrefillOptions& opt, PrefillResult* out) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelConfig& c = m.config();
  const ModelWeights& w = m.weights();
  const int64_t S = int64_t(tokens.size());
  SF_TRY(check_host_weights(m, "prefill"));
  if (S == 0) return SF_ERR(kInvalidArgument, "prefill: empty prompt");
  if (opt.chunk <= 0) return SF_ERR(kInvalidArgument, "prefill: chunk must be positive");
  if (opt.on_layer_kv_device.enqueue || opt.on_layer_kv_device.place)
    return SF_ERR(kUnsupported, "prefill: on_layer_kv_device (device KV tiering) needs the device "
                                "forward; the CPU forward takes on_layer_kv");
  if (opt.kv_host_bf16)
    return SF_ERR(kUnsupported, "prefill: kv_host_bf16 (bf16 host K/V) is the device forward's; "
                                "the CPU forward keeps F32");
  if (opt.kv_hooks.final || opt.kv_hooks.failed)
    return SF_ERR(kUnsupported, "prefill: kv_hooks are the device forward's; the CPU forward "
                                "takes on_layer_kv");
  for (int64_t i = 0; i < S; ++i)
    if (tokens[size_t(i)] < 0 || tokens[size_t(i)] >= c.vocab)
      return SF_ERR(kOutOfRange, "prefill: token id " + std::to_string(tokens[size_t(i)]) + " at position " +
                                     std::to_string(i) + " outside vocab " + std::to_string(c.vocab));
  const int64_t H = c.hidden, hq = c.n_heads, hkv = c.n_kv_heads, d = c.head_dim, I = c.intermediate;
  const int64_t C = std::min(opt.chunk, S);

  kernels::RopeParams rope = c.rope;
  if (!w.rope_freqs.empty()) rope.freq_factors = w.rope_freqs.data.data();

  PrefillResult& res = *out;
  KvCache& kv = res.kv;
  const int64_t P = kv.n_tokens;  // tokens already in the cache
  // Checked here too: when the estimator supplies every group's importance, kv_importance (which
  // checks it) never runs, and a bad pool would be used as is.
  if (opt.importance_window > 0 && (opt.importance_pool <= 0 || opt.importance_pool % 2 == 0))
    return SF_ERR(kInvalidArgument, "prefill: importance_pool must be a positive odd kernel size, got " +
                                        std::to_string(opt.importance_pool));
  // A cached prefix is extended in place: a run that keeps no K/V would free the prefix's rows
  // too (and a failure could not give them back), and a bf16 host cache is not extended here.
  if (P > 0 && !opt.keep_kv)
    return SF_ERR(kInvalidArgument, "extend: keep_kv false with " + std::to_string(P) +
                                        " cached tokens would drop the cache's own rows");
  if (P > 0 && kv.bf16())
    return SF_ERR(kInvalidArgument, "extend: the cache holds bf16 rows (kv_host_bf16); extend "
                                    "takes an F32 cache");
  if (P > 0 && (kv.n_layers != c.n_layers || kv.n_kv_heads != hkv || kv.head_dim != d ||
                int64_t(kv.k.size()) != c.n_layers || int64_t(kv.v.size()) != c.n_layers))
    return SF_ERR(kInvalidArgument, "extend: KV cache does not match the model");
  for (int l = 0; P > 0 && l < c.n_layers; ++l)
    if (int64_t(kv.k[size_t(l)].size()) != P * hkv * d || int64_t(kv.v[size_t(l)].size()) != P * hkv * d)
      return SF_ERR(kInvalidArgument, "extend: layer " + std::to_string(l) + " of the KV cache does not hold " +
                                          std::to_string(P) + " tokens");
  // A call that fails leaves the cache as it found it (its P tokens), so a later extend does not
  // attend to rows this one never finished.
  struct Restore {
    KvCache& kv;
    int64_t P, row;
    bool armed = true;
    ~Restore() {
      if (!armed) return;
      for (auto* side : {&kv.k, &kv.v})
        for (auto& layer : *side)
          if (int64_t(layer.size()) > P * row) layer.resize(size_t(P * row));
      kv.n_tokens = P;
    }
  } restore{kv, P, hkv * d};
  if (P == 0) {
    kv.n_layers = c.n_layers;
    kv.n_kv_heads = int(hkv);
    kv.head_dim = int(d);
    kv.k.assign(size_t(c.n_layers), {});
    kv.v.assign(size_t(c.n_layers), {});
  }
  kv.n_tokens = P + S;

  std::vector<float> x(static_cast<size_t>(S * H));  // residual stream
  // Q and the attention output span the whole call: sparse estimation needs the last queries
  // before any row's attention runs. Linear layers still run in chunks of C tokens.
  std::vector<float> q(static_cast<size_t>(S * hq * d)), att(static_cast<size_t>(S * hq * d)),
      lse(static_cast<size_t>(hq * S));
  std::vector<float> xn(static_cast<size_t>(C * H)), tmp(static_cast<size_t>(C * H)),
      gate(static_cast<size_t>(C * I)), up(static_cast<size_t>(C * I));
  std::vector<int32_t> pos(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) pos[size_t(i)] = int32_t(P + i);

  SF_TRY(kernels::embedding(w.tok_embd.view(), tokens.data(), S, view2(x.data(), S, H)));
  const TensorView none{};
  const SparseConfig* sc = opt.sparse;
  if (sc && (sc->n_layers != c.n_layers || sc->n_heads != hq))
    return SF_ERR(kInvalidArgument, "prefill: sparse config is for " + std::to_string(sc->n_layers) + "x" +
                                        std::to_string(sc->n_heads) + " layers x heads, the model has " +
                                        std::to_string(c.n_layers) + "x" + std::to_string(hq));
  const bool use_sparse = sc && P + S >= sc->dense_below && !sparse_config_is_dense(*sc);
  res.estimate_s = res.attention_s = res.importance_s = 0;
  res.kv_peak_bytes = 0;
  res.importance_reused_groups = 0;  // (this call's, as the other figures)
  if (opt.importance_window > 0) res.importance.assign(size_t(c.n_layers), {});
  else res.importance.clear();
  double pairs_done = 0, pairs_causal = 0;
  using clock = std::chrono::steady_clock;

  std::vector<std::vector<float>> est_columns;  // this layer's estimator scores, when kept
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    auto& K = kv.k[size_t(l)];
    auto& V = kv.v[size_t(l)];
    K.resize(size_t((P + S) * hkv * d));
    V.resize(size_t((P + S) * hkv * d));
    {
      int64_t held = 0;
      for (int j = 0; j < c.n_layers; ++j)
        held += int64_t(kv.k[size_t(j)].size() + kv.v[size_t(j)].size()) * int64_t(sizeof(float));
      res.kv_peak_bytes = std::max(res.kv_peak_bytes, held);
    }
    // 1) norm, QKV, RoPE per chunk.
    for (int64_t c0 = 0; c0 < S; c0 += C) {
      const int64_t n = std::min(C, S - c0);
      TensorView xnv = view2(xn.data(), n, H);
      SF_TRY(kernels::rms_norm(view2(x.data() + c0 * H, n, H), L.attn_norm.view(), c.rms_eps, xnv));
      float* qc = q.data() + c0 * hq * d;
      float* kc = K.data() + (P + c0) * hkv * d;
      float* vc = V.data() + (P + c0) * hkv * d;
      SF_TRY(kernels::linear(xnv, L.wq.view(), L.bq.empty() ? none : L.bq.view(), view2(qc, n, hq * d)));
      SF_TRY(kernels::linear(xnv, L.wk.view(), L.bk.empty() ? none : L.bk.view(), view2(kc, n, hkv * d)));
      SF_TRY(kernels::linear(xnv, L.wv.view(), L.bv.empty() ? none : L.bv.view(), view2(vc, n, hkv * d)));
      SF_TRY(kernels::rope(view3(qc, n, hq, d), pos.data() + c0, rope));
      SF_TRY(kernels::rope(view3(kc, n, hkv, d), pos.data() + c0, rope));
    }
    // 2) attention over all rows of this call against all keys (estimator first when sparse).
    const int64_t nk = P + S;
    const TensorView qv = view3(q.data(), S, hq, d), kv3 = view3(K.data(), nk, hkv, d),
                     vv = view3(V.data(), nk, hkv, d), ov = view3(att.data(), S, hq, d),
                     lv = view2(lse.data(), hq, S);
    kernels::AttentionParams ap;
    ap.causal = true;
    ap.q_offset = P;
    const double causal_pairs = double(hq) * (double(S) * double(P) + double(S) * double(S + 1) / 2);
    pairs_causal += causal_pairs;
    if (use_sparse) {
      kernels::SparseIndex idx;
      kernels::EstimatorStats st;
      st.keep_columns = opt.importance_window > 0 && opt.importance_from_estimator;
      const auto e0 = clock::now();
      SF_TRY(kernels::sparse_estimate(qv, kv3, sc->layers[size_t(l)], P, &idx, &st));
      const auto e1 = clock::now();
      SF_TRY(kernels::attention_sparse(qv, kv3, vv, idx, ov, lv, ap));
      const auto e2 = clock::now();
      res.estimate_s += std::chrono::duration<double>(e1 - e0).count();
      res.attention_s += std::chrono::duration<double>(e2 - e1).count();
      pairs_done += st.density * causal_pairs;
      if (opt.on_attention) opt.on_attention(l, qv, kv3, &idx);
      if (opt.on_sparse_index) opt.on_sparse_index(l, idx);
      est_columns = std::move(st.columns);
    } else {
      const auto a0 = clock::now();
      SF_TRY(kernels::attention_dense(qv, kv3, vv, ov, lv, ap));
      res.attention_s += sf::seconds_since(a0);
      pairs_done += causal_pairs;
      if (opt.on_attention) opt.on_attention(l, qv, kv3, nullptr);
    }
    if (opt.importance_window > 0) {
      const auto i0 = clock::now();
      auto& imp = res.importance[size_t(l)];
      imp.resize(size_t(hkv * nk));
      // Groups the estimator's scores cover; the LSE pass fills the rest (all, by default).
      const std::vector<bool> reuse = estimator_groups(est_columns, hkv, hq / hkv, nk);
      res.importance_reused_groups += std::count(reuse.begin(), reuse.end(), true);
      if (std::count(reuse.begin(), reuse.end(), true) < hkv) {
        kernels::ImportanceParams ip;
        ip.window = opt.importance_window;
        ip.pool = opt.importance_pool;
        ip.q_offset = P;
        if (use_sparse) {
          // A sparse layer's LSE covers the selected keys only, so exp(s - lse) would over-count
          // every key the index left out. SnapKV's scores need each window row's softmax over
          // all the keys it may see: a dense pass over the window rows gives that LSE.
          const int64_t wn = std::min<int64_t>(opt.importance_window, S);
          std::vector<float> w_out(size_t(wn * hq * d)), w_lse(size_t(hq * wn));
          const TensorView wq = view3(q.data() + (S - wn) * hq * d, wn, hq, d);
          kernels::AttentionParams wp = ap;
          wp.q_offset = P + S - wn;
          SF_TRY(kernels::attention_dense(wq, kv3, vv, view3(w_out.data(), wn, hq, d),
                                          view2(w_lse.data(), hq, wn), wp));
          ip.window = int(wn);
          ip.q_offset = wp.q_offset;
          SF_TRY(kernels::kv_importance(wq, kv3, view2(w_lse.data(), hq, wn), ip,
                                        view2(imp.data(), hkv, nk)));
        } else {
          SF_TRY(kernels::kv_importance(qv, kv3, lv, ip, view2(imp.data(), hkv, nk)));
        }
      }
      importance_from_columns(est_columns, reuse, hq / hkv, nk, opt.importance_pool,
                              double(std::min<int64_t>(opt.importance_window, S)), imp.data());
      res.importance_s += sf::seconds_since(i0);
    }
    est_columns.clear();
    if (opt.on_layer_kv)
      SF_TRY(opt.on_layer_kv(l, kv3, vv,
                             opt.importance_window > 0 ? std::span<const float>(res.importance[size_t(l)])
                                                       : std::span<const float>()));
    if (opt.on_layer_done) opt.on_layer_done(l);
    // Not kept: this layer's K/V are done with (the hook, e.g. KV tiering, has its own copy), so
    // a tiered prefill holds one layer's KV at a time besides the pool.
    if (!opt.keep_kv) {
      std::vector<float>().swap(K);
      std::vector<float>().swap(V);
    }
    // 3) O projection, residual, MLP per chunk.
    for (int64_t c0 = 0; c0 < S; c0 += C) {
      const int64_t n = std::min(C, S - c0);
      float* xc = x.data() + c0 * H;
      TensorView xnv = view2(xn.data(), n, H);
      SF_TRY(kernels::linear(view2(att.data() + c0 * hq * d, n, hq * d), L.wo.view(), none, view2(tmp.data(), n, H)));
      SF_TRY(kernels::add_inplace(view2(xc, n, H), view2(tmp.data(), n, H)));
      SF_TRY(kernels::rms_norm(view2(xc, n, H), L.ffn_norm.view(), c.rms_eps, xnv));
      SF_TRY(kernels::linear(xnv, L.w_gate.view(), none, view2(gate.data(), n, I)));
      SF_TRY(kernels::linear(xnv, L.w_up.view(), none, view2(up.data(), n, I)));
      SF_TRY(kernels::swiglu(view2(gate.data(), n, I), view2(up.data(), n, I), view2(gate.data(), n, I)));
      SF_TRY(kernels::linear(view2(gate.data(), n, I), L.w_down.view(), none, view2(tmp.data(), n, H)));
      SF_TRY(kernels::add_inplace(view2(xc, n, H), view2(tmp.data(), n, H)));
    }
  }
  res.density = pairs_causal > 0 ? pairs_done / pairs_causal : 1.0;

  // Final norm + LM head on the requested rows, chunked so [rows, vocab] is the only big buffer.
  const int64_t row0 = opt.all_logits ? 0 : S - 1;
  const int64_t rows = S - row0;
  res.n_logit_rows = rows;
  res.logits.resize(size_t(rows * c.vocab));
  const OwnedTensor& head = m.output_weight();
  for (int64_t r = 0; r < rows; r += C) {
    const int64_t n = std::min(C, rows - r);
    TensorView xnv = view2(xn.data(), n, H);
    SF_TRY(kernels::rms_norm(view2(x.data() + (row0 + r) * H, n, H), w.out_norm.view(), c.rms_eps, xnv));
    SF_TRY(kernels::linear(xnv, head.view(), none, view2(res.logits.data() + r * c.vocab, n, c.vocab)));
  }
  res.first_token = argmax_row(res.logits.data() + (rows - 1) * c.vocab, c.vocab);
  if (!opt.keep_kv) {
    kv.k.clear();
    kv.v.clear();
  }
  res.seconds = sf::seconds_since(t0);
  restore.armed = false;
  return Status::ok();
}

Result<std::vector<int32_t>> generate_greedy(const Model& m, std::span<const int32_t> prompt, int n_new) {
  PrefillOptions opt;
  PrefillResult r;
  SF_TRY(extend(m, prompt, opt, &r));
  std::vector<int32_t> out;
  for (int i = 0; i < n_new; ++i) {
    const int32_t t = r.first_token;
    out.push_back(t);
    if (i + 1 == n_new) break;
    SF_TRY(extend(m, std::span<const int32_t>(&t, 1), opt, &r));
  }
  return out;
}

}  // namespace sf::model
