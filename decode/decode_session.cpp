#include "decode/decode_session.h"

#include <algorithm>
#include <limits>

#include "kernels/api.h"
#include "kvstore/kv_export.h"

namespace sf::decode {
namespace {
TensorView v2(float* p, int64_t a, int64_t b) { return TensorView::make(p, DType::kF32, {a, b}); }

// The gap between the largest and second-largest of z[0..n) (a near-tie is a small gap).
double top_two_gap(const float* z, size_t n) {
  float top = -std::numeric_limits<float>::infinity(), second = top;
  for (size_t i = 0; i < n; ++i) {
    if (z[i] > top) {
      second = top;
      top = z[i];
    } else if (z[i] > second) {
      second = z[i];
    }
  }
  return double(top) - double(second);
}

int32_t argmax_row(const float* z, size_t n) { return int32_t(std::max_element(z, z + n) - z); }
}  // namespace

std::string model_compat_hash(const model::Model& m) {
  return kvstore::compat_hash(kvstore::model_export_spec(m));
}

DecodeSession::DecodeSession(const model::Model& m, PagedKvCache cache, int64_t next_pos,
                             DecodeAttnParams p)
    : m_(m), cache_(std::move(cache)), pos_(next_pos), p_(p) {}

Status DecodeSession::step(int32_t token, std::vector<float>* logits) {
  const bool guard =
      p_.mode == DecodeAttnMode::kPsa && p_.guard_margin > 0 && p_.verify_draft == 0;
  std::vector<PagedKvCache::AppendUndo> undo;
  SF_TRY(run(&token, 1, p_, logits, guard ? &undo : nullptr));
  ++stats_.steps;
  if (!guard) return Status::ok();
  if (top_two_gap(logits->data(), logits->size()) >= p_.guard_margin) return Status::ok();
  // A near-tie: take the step back and run it with full attention. The re-run's blocks count as
  // visited, over the same blocks available.
  for (auto it = undo.rbegin(); it != undo.rend(); ++it) cache_.undo_append(std::move(*it));
  --pos_;
  DecodeAttnParams full;
  full.scale = p_.scale;
  const int64_t total = stats_.blocks_total, kv_total = stats_.kv_blocks_total;
  SF_TRY(run(&token, 1, full, logits, nullptr));
  stats_.blocks_total = total;
  stats_.kv_blocks_total = kv_total;
  ++stats_.guard_steps;
  return Status::ok();
}

Status DecodeSession::run(const int32_t* tokens, int n, const DecodeAttnParams& p,
                          std::vector<float>* logits, std::vector<PagedKvCache::AppendUndo>* undo,
                          std::vector<int>* undo_token, std::vector<int64_t>* totals) {
  // The constructor takes any cache; one whose geometry is not the model's would be indexed out
  // of bounds by the appends.
  const model::ModelConfig& c = m_.config();
  SF_TRY(check_cache_geometry(cache_, c.n_layers, c.n_kv_heads, c.head_dim, "decode"));
  // Every append is recorded, so a failure at layer L takes back layers 0..L's (a session used
  // after an error must not hold a token in some layers only).
  std::vector<PagedKvCache::AppendUndo> mine;
  std::vector<PagedKvCache::AppendUndo>* u = undo ? undo : &mine;
  const size_t u0 = u->size(), t0 = undo_token ? undo_token->size() : 0;
  Status st = run_layers(tokens, n, p, logits, u, undo_token, totals);
  if (!st.is_ok()) {
    for (size_t i = u->size(); i-- > u0;) cache_.undo_append(std::move((*u)[i]));
    u->resize(u0);
    if (undo_token) undo_token->resize(t0);
  }
  return st;
}

Status DecodeSession::run_layers(const int32_t* tokens, int n, const DecodeAttnParams& p,
                                 std::vector<float>* logits,
                                 std::vector<PagedKvCache::AppendUndo>* undo,
                                 std::vector<int>* undo_token, std::vector<int64_t>* totals) {
  const model::ModelConfig& c = m_.config();
  const model::ModelWeights& w = m_.weights();
  if (n < 1) return SF_ERR(kInvalidArgument, "decode: no tokens to run");
  if (n > 1 && p.mode != DecodeAttnMode::kFull)
    return SF_ERR(kInvalidArgument, "decode: several tokens at once need full attention");
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= c.vocab)
      return SF_ERR(kOutOfRange, "decode: token id " + std::to_string(tokens[i]) +
                                     " outside vocab " + std::to_string(c.vocab));
  const int64_t H = c.hidden, hq = c.n_heads, hkv = c.n_kv_heads, d = c.head_dim,
                I = c.intermediate, N = n;
  kernels::RopeParams rope = c.rope;
  if (!w.rope_freqs.empty()) rope.freq_factors = w.rope_freqs.data.data();
  const auto buf = [N](int64_t cols) { return std::vector<float>(static_cast<size_t>(N * cols)); };
  std::vector<float> x = buf(H), xn = buf(H), tmp = buf(H), q = buf(hq * d), k = buf(hkv * d),
                     v = buf(hkv * d), att = buf(hq * d), gate = buf(I), up = buf(I);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) pos[size_t(i)] = int32_t(pos_ + i);
  if (totals) totals->assign(static_cast<size_t>(n), 0);
  const TensorView none{};
  SF_TRY(kernels::embedding(w.tok_embd.view(), tokens, N, v2(x.data(), N, H)));
  for (int l = 0; l < c.n_layers; ++l) {
    const model::LayerWeights& L = w.layers[size_t(l)];
    SF_TRY(
        kernels::rms_norm(v2(x.data(), N, H), L.attn_norm.view(), c.rms_eps, v2(xn.data(), N, H)));
    SF_TRY(kernels::linear(v2(xn.data(), N, H), L.wq.view(), L.bq.empty() ? none : L.bq.view(),
                           v2(q.data(), N, hq * d)));
    SF_TRY(kernels::linear(v2(xn.data(), N, H), L.wk.view(), L.bk.empty() ? none : L.bk.view(),
                           v2(k.data(), N, hkv * d)));
    SF_TRY(kernels::linear(v2(xn.data(), N, H), L.wv.view(), L.bv.empty() ? none : L.bv.view(),
                           v2(v.data(), N, hkv * d)));
    SF_TRY(kernels::rope(TensorView::make(q.data(), DType::kF32, {N, hq, d}), pos.data(), rope));
    SF_TRY(kernels::rope(TensorView::make(k.data(), DType::kF32, {N, hkv, d}), pos.data(), rope));
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < hkv; ++h) {
        const float* kr = k.data() + (i * hkv + h) * d;
        const float* vr = v.data() + (i * hkv + h) * d;
        undo->push_back(cache_.append_undoable(l, h, pos[size_t(i)], kr, vr));
        if (undo_token) undo_token->push_back(i);
      }
    if (n == 1) {
      const int64_t before = stats_.blocks_total;
      SF_TRY(decode_attention(cache_, l, q.data(), int(hq), p, att.data(), &stats_));
      if (totals) (*totals)[0] += stats_.blocks_total - before;
    } else {
      SF_TRY(decode_attention_causal(cache_, l, q.data(), n, pos.data(), int(hq), p.scale,
                                     att.data(), &stats_));
      if (totals)
        for (int i = 0; i < n; ++i) (*totals)[size_t(i)] += stats_.last_total_by_token[size_t(i)];
    }
    SF_TRY(kernels::linear(v2(att.data(), N, hq * d), L.wo.view(), none, v2(tmp.data(), N, H)));
    SF_TRY(kernels::add_inplace(v2(x.data(), N, H), v2(tmp.data(), N, H)));
    SF_TRY(
        kernels::rms_norm(v2(x.data(), N, H), L.ffn_norm.view(), c.rms_eps, v2(xn.data(), N, H)));
    SF_TRY(kernels::linear(v2(xn.data(), N, H), L.w_gate.view(), none, v2(gate.data(), N, I)));
    SF_TRY(kernels::linear(v2(xn.data(), N, H), L.w_up.view(), none, v2(up.data(), N, I)));
    SF_TRY(kernels::swiglu(v2(gate.data(), N, I), v2(up.data(), N, I), v2(gate.data(), N, I)));
    SF_TRY(kernels::linear(v2(gate.data(), N, I), L.w_down.view(), none, v2(tmp.data(), N, H)));
    SF_TRY(kernels::add_inplace(v2(x.data(), N, H), v2(tmp.data(), N, H)));
  }
  SF_TRY(kernels::rms_norm(v2(x.data(), N, H), w.out_norm.view(), c.rms_eps, v2(xn.data(), N, H)));
  logits->resize(size_t(N * c.vocab));
  SF_TRY(kernels::linear(v2(xn.data(), N, H), m_.output_weight().view(), none,
                         v2(logits->data(), N, c.vocab)));
  pos_ += n;
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
  if (p_.mode == DecodeAttnMode::kPsa && p_.verify_draft > 0)
    return generate_verified(first_token, n_new, on_logits);
  return greedy_decode(
      first_token, n_new, [this](int32_t t, std::vector<float>* z) { return step(t, z); },
      on_logits);
}

bool verify_stops_at_tie(int64_t hits, int64_t misses, int drafts_left, double draft_share) {
  const double p_wrong = double(hits + 1) / double(hits + misses + 4);
  return p_wrong * double(drafts_left) * draft_share > 1.0;
}

Result<std::vector<int32_t>> verified_decode(
    int32_t first_token, int n_new, const DecodeAttnParams& p, int64_t vocab, int group,
    DecodeAttnStats* stats, const VerifyOps& ops,
    const std::function<void(int, const std::vector<float>&)>& on_logits) {
  std::vector<int32_t> out;
  if (n_new <= 0) return out;
  if (p.verify_draft < 1) return SF_ERR(kInvalidArgument, "decode: verify_draft must be >= 1");
  out.push_back(first_token);
  const size_t V = size_t(vocab);
  DecodeAttnStats& st = *stats;
  std::vector<float> z, zv;
  std::vector<int64_t> totals;
  std::vector<char> tie;  // per draft of the round: a near-tie (gap under the margin)
  // Near-ties the passes have judged (rejected: hits) and the drafts' blocks visited and
  // available, for the stop rule below.
  int64_t tie_hits = 0, tie_misses = 0, draft_visits = 0, draft_blocks = 0;
  int32_t x = first_token;
  while (int(out.size()) < n_new) {
    // A round emits the accepted drafts and one token of the full cache's: at most k + 1.
    const int k_max = std::min(p.verify_draft, n_new - int(out.size()) - 1);
    const int64_t total0 = st.blocks_total, kv_total0 = st.kv_blocks_total;
    std::vector<int32_t> in{x};
    tie.clear();
    for (int j = 0; j < k_max; ++j) {
      const int64_t v0 = st.blocks_visited, t0 = st.blocks_total;
      SF_TRY(ops.draft(in.back(), &z));
      ++st.draft_steps;
      draft_visits += st.blocks_visited - v0;
      draft_blocks += st.blocks_total - t0;
      in.push_back(argmax_row(z.data(), V));
      tie.push_back(p.guard_margin > 0 && top_two_gap(z.data(), V) < p.guard_margin);
      if (!tie.back()) continue;
      if (verify_stops_at_tie(tie_hits, tie_misses, k_max - j - 1,
                              double(draft_visits) / double(std::max<int64_t>(draft_blocks, 1))))
        break;
    }
    SF_TRY(ops.drop_drafts());
    // One full pass over the round's inputs; row i's argmax is the full cache's token after in[i].
    SF_TRY(ops.pass(in, &zv, &totals));
    ++st.verify_passes;
    st.verify_tokens += int64_t(in.size());
    size_t acc = 0;  // drafts accepted
    while (acc + 1 < in.size() && argmax_row(zv.data() + acc * V, V) == in[acc + 1]) ++acc;
    // Keep the K/V of in[0..acc]; the later tokens' appends go back.
    if (acc + 1 < in.size()) SF_TRY(ops.keep(int(acc) + 1));
    st.draft_accepted += int64_t(acc);
    // The near-ties this pass judged: accepted drafts, and the first rejected one.
    for (size_t i = 0; i < tie.size() && i <= acc; ++i)
      if (tie[i]) ++(i < acc ? tie_misses : tie_hits);
    st.steps += int64_t(acc) + 1;
    // Blocks available count for the kept tokens only, as full decode would have run them.
    st.blocks_total = total0;
    st.kv_blocks_total = kv_total0;
    for (size_t i = 0; i <= acc; ++i) {
      st.blocks_total += totals[i];
      if (ops.count_kv) st.kv_blocks_total += totals[i] / group;
    }
    for (size_t i = 0; i <= acc; ++i) {
      const float* row = zv.data() + i * V;
      out.push_back(i < acc ? in[i + 1] : argmax_row(row, V));
      if (on_logits) on_logits(int(out.size()) - 1, std::vector<float>(row, row + V));
    }
    x = out.back();
  }
  return out;
}

Result<std::vector<int32_t>> DecodeSession::generate_verified(
    int32_t first_token, int n_new,
    const std::function<void(int, const std::vector<float>&)>& on_logits) {
  DecodeAttnParams full;
  full.scale = p_.scale;
  std::vector<PagedKvCache::AppendUndo> undo, pass_undo;  // the drafts', the last pass's
  std::vector<int> undo_token;
  int drafts = 0;
  VerifyOps ops;
  ops.draft = [&](int32_t t, std::vector<float>* z) {
    SF_TRY(run(&t, 1, p_, z, &undo));
    ++drafts;
    return Status::ok();
  };
  ops.drop_drafts = [&]() {
    for (auto it = undo.rbegin(); it != undo.rend(); ++it) cache_.undo_append(std::move(*it));
    pos_ -= drafts;
    drafts = 0;
    undo.clear();
    return Status::ok();
  };
  int n_pass = 0;
  ops.pass = [&](const std::vector<int32_t>& in, std::vector<float>* zv,
                 std::vector<int64_t>* totals) {
    pass_undo.clear();
    undo_token.clear();
    n_pass = int(in.size());
    return run(in.data(), n_pass, full, zv, &pass_undo, &undo_token, totals);
  };
  ops.keep = [&](int kept) {
    // Newest first: a head's appends come back in the reverse of their order.
    for (size_t u = pass_undo.size(); u-- > 0;)
      if (undo_token[u] >= kept) cache_.undo_append(std::move(pass_undo[u]));
    pos_ -= n_pass - kept;
    pass_undo.clear();
    return Status::ok();
  };
  auto out = verified_decode(first_token, n_new, p_, m_.config().vocab,
                             m_.config().n_heads / m_.config().n_kv_heads, &stats_, ops, on_logits);
  // A failure mid-round leaves the round's drafts in the cache (a failed pass or draft took its
  // own appends back; a pass's kept tokens stay, as with plain steps).
  if (!out.is_ok()) (void)ops.drop_drafts();
  return out;
}

Result<DecodeSession> open_decode_session(const model::Model& m, const std::string& kv_dir,
                                          DecodeAttnParams p, KvExport* manifest_out) {
  SF_ASSIGN(KvExport e, load_kv_export(kv_dir, model_compat_hash(m)));
  SF_ASSIGN(PagedKvCache cache, PagedKvCache::take_from_export(e, !m.config().rope.neox));
  const model::ModelConfig& c = m.config();
  SF_TRY(check_cache_geometry(cache, c.n_layers, c.n_kv_heads, c.head_dim, "decode"));
  const int64_t next = e.n_tokens;
  if (manifest_out) *manifest_out = std::move(e);  // (its K/V copies were freed as paged)
  return DecodeSession(m, std::move(cache), next, p);
}

}  // namespace sf::decode
