#include "decode/decode_session.h"

#include <algorithm>
#include <limits>

#include "kernels/api.h"
#include "kvstore/kv_export.h"

namespace sf::decode {
namespace {
TensorView v2(float* p, int64_t a, int64_t b) { return TensorView::make(p, DType::kF32, {a, b}); }
}  // namespace

kvstore::KvExportSpec model_export_spec(const model::Model& m) {
  const model::ModelConfig& c = m.config();
  kvstore::KvExportSpec s;
  s.model_name = c.name;
  s.arch = model::arch_name(c.arch);
  s.n_layers = c.n_layers;
  s.n_kv_heads = c.n_kv_heads;
  s.head_dim = c.head_dim;
  s.rope_theta = c.rope.theta;
  s.keys_interleaved = !c.rope.neox;
  return s;
}

std::string model_compat_hash(const model::Model& m) {
  return kvstore::compat_hash(model_export_spec(m));
}

DecodeSession::DecodeSession(const model::Model& m, PagedKvCache cache, int64_t next_pos,
                             DecodeAttnParams p)
    : m_(m), cache_(std::move(cache)), pos_(next_pos), p_(p) {}

Status DecodeSession::step(int32_t token, std::vector<float>* logits) {
  const bool guard = p_.mode == DecodeAttnMode::kPsa && p_.guard_margin > 0;
  std::vector<PagedKvCache::AppendUndo> undo;
  SF_TRY(run(token, p_, logits, guard ? &undo : nullptr));
  ++stats_.steps;
  if (!guard) return Status::ok();
  float top = -std::numeric_limits<float>::infinity(), second = top;
  for (float z : *logits) {
    if (z > top) {
      second = top;
      top = z;
    } else if (z > second) {
      second = z;
    }
  }
  if (double(top) - double(second) >= p_.guard_margin) return Status::ok();
  // A near-tie: take the step back and run it with full attention. The re-run's blocks count as
  // visited, over the same blocks available.
  for (auto it = undo.rbegin(); it != undo.rend(); ++it) cache_.undo_append(std::move(*it));
  --pos_;
  DecodeAttnParams full;
  full.scale = p_.scale;
  const int64_t total = stats_.blocks_total, kv_total = stats_.kv_blocks_total;
  SF_TRY(run(token, full, logits, nullptr));
  stats_.blocks_total = total;
  stats_.kv_blocks_total = kv_total;
  ++stats_.guard_steps;
  return Status::ok();
}

Status DecodeSession::run(int32_t token, const DecodeAttnParams& p, std::vector<float>* logits,
                          std::vector<PagedKvCache::AppendUndo>* undo) {
  const model::ModelConfig& c = m_.config();
  const model::ModelWeights& w = m_.weights();
  if (token < 0 || token >= c.vocab)
    return SF_ERR(kOutOfRange, "decode: token id " + std::to_string(token) + " outside vocab " +
                                   std::to_string(c.vocab));
  const int64_t H = c.hidden, hq = c.n_heads, hkv = c.n_kv_heads, d = c.head_dim,
                I = c.intermediate;
  kernels::RopeParams rope = c.rope;
  if (!w.rope_freqs.empty()) rope.freq_factors = w.rope_freqs.data.data();
  std::vector<float> x(static_cast<size_t>(H)), xn(static_cast<size_t>(H)),
      tmp(static_cast<size_t>(H)), q(static_cast<size_t>(hq * d)), k(static_cast<size_t>(hkv * d)),
      v(static_cast<size_t>(hkv * d)), att(static_cast<size_t>(hq * d)),
      gate(static_cast<size_t>(I)), up(static_cast<size_t>(I));
  const int32_t pos = int32_t(pos_);
  const TensorView none{};
  SF_TRY(kernels::embedding(w.tok_embd.view(), &token, 1, v2(x.data(), 1, H)));
  for (int l = 0; l < c.n_layers; ++l) {
    const model::LayerWeights& L = w.layers[size_t(l)];
    SF_TRY(
        kernels::rms_norm(v2(x.data(), 1, H), L.attn_norm.view(), c.rms_eps, v2(xn.data(), 1, H)));
    SF_TRY(kernels::linear(v2(xn.data(), 1, H), L.wq.view(), L.bq.empty() ? none : L.bq.view(),
                           v2(q.data(), 1, hq * d)));
    SF_TRY(kernels::linear(v2(xn.data(), 1, H), L.wk.view(), L.bk.empty() ? none : L.bk.view(),
                           v2(k.data(), 1, hkv * d)));
    SF_TRY(kernels::linear(v2(xn.data(), 1, H), L.wv.view(), L.bv.empty() ? none : L.bv.view(),
                           v2(v.data(), 1, hkv * d)));
    SF_TRY(kernels::rope(TensorView::make(q.data(), DType::kF32, {1, hq, d}), &pos, rope));
    SF_TRY(kernels::rope(TensorView::make(k.data(), DType::kF32, {1, hkv, d}), &pos, rope));
    for (int h = 0; h < hkv; ++h) {
      if (undo)
        undo->push_back(cache_.append_undoable(l, h, pos, k.data() + h * d, v.data() + h * d));
      else
        cache_.append(l, h, pos, k.data() + h * d, v.data() + h * d);
    }
    SF_TRY(decode_attention(cache_, l, q.data(), int(hq), p, att.data(), &stats_));
    SF_TRY(kernels::linear(v2(att.data(), 1, hq * d), L.wo.view(), none, v2(tmp.data(), 1, H)));
    SF_TRY(kernels::add_inplace(v2(x.data(), 1, H), v2(tmp.data(), 1, H)));
    SF_TRY(
        kernels::rms_norm(v2(x.data(), 1, H), L.ffn_norm.view(), c.rms_eps, v2(xn.data(), 1, H)));
    SF_TRY(kernels::linear(v2(xn.data(), 1, H), L.w_gate.view(), none, v2(gate.data(), 1, I)));
    SF_TRY(kernels::linear(v2(xn.data(), 1, H), L.w_up.view(), none, v2(up.data(), 1, I)));
    SF_TRY(kernels::swiglu(v2(gate.data(), 1, I), v2(up.data(), 1, I), v2(gate.data(), 1, I)));
    SF_TRY(kernels::linear(v2(gate.data(), 1, I), L.w_down.view(), none, v2(tmp.data(), 1, H)));
    SF_TRY(kernels::add_inplace(v2(x.data(), 1, H), v2(tmp.data(), 1, H)));
  }
  SF_TRY(kernels::rms_norm(v2(x.data(), 1, H), w.out_norm.view(), c.rms_eps, v2(xn.data(), 1, H)));
  logits->resize(size_t(c.vocab));
  SF_TRY(kernels::linear(v2(xn.data(), 1, H), m_.output_weight().view(), none,
                         v2(logits->data(), 1, c.vocab)));
  ++pos_;
  return Status::ok();
}

Result<std::vector<int32_t>> greedy_decode(
    int32_t first_token, int n_new, const std::function<Status(int32_t, std::vector<float>*)>& step,
    const std::function<void(int, const std::vector<float>&)>& on_logits) {
  std::vector<int32_t> out;
  std::vector<float> logits;
  int32_t t = first_token;
  for (int i = 0; i < n_new; ++i) {
    out.push_back(t);
    if (i + 1 == n_new) break;
    SF_TRY(step(t, &logits));
    if (on_logits) on_logits(i + 1, logits);
    t = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  return out;
}

Result<std::vector<int32_t>> DecodeSession::generate_greedy(
    int32_t first_token, int n_new,
    const std::function<void(int, const std::vector<float>&)>& on_logits) {
  return greedy_decode(
      first_token, n_new, [this](int32_t t, std::vector<float>* z) { return step(t, z); },
      on_logits);
}

Result<DecodeSession> open_decode_session(const model::Model& m, const std::string& kv_dir,
                                          DecodeAttnParams p, KvExport* manifest_out) {
  SF_ASSIGN(KvExport e, load_kv_export(kv_dir, model_compat_hash(m)));
  SF_ASSIGN(PagedKvCache cache, PagedKvCache::from_export(e, !m.config().rope.neox));
  const int64_t next = e.n_tokens;
  if (manifest_out) {
    // The K/V copies now live in the cache; keep only the manifest fields.
    for (auto& h : e.heads) h = HeadKv{};
    *manifest_out = std::move(e);
  }
  return DecodeSession(m, std::move(cache), next, p);
}

}  // namespace sf::decode
