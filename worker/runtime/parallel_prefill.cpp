#include "worker/runtime/parallel_prefill.h"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <limits>

#include "common/timing.h"
#include "kernels/api.h"
#include "kernels/kv_importance.h"
#include "kernels/sparse.h"
#include "worker/runtime/cp_estimate.h"

namespace sf::runtime {
namespace {

using clock = std::chrono::steady_clock;

TensorView view2(float* p, int64_t a, int64_t b) {
  return TensorView::make(p, DType::kF32, {a, b});
}
TensorView view3(float* p, int64_t a, int64_t b, int64_t c) {
  return TensorView::make(p, DType::kF32, {a, b, c});
}

// Rows [r0, r0 + n) of a [rows, cols] weight: contiguous.
TensorView rows_of(const model::OwnedTensor& t, int64_t r0, int64_t n) {
  const int64_t cols = t.shape[1];
  return TensorView::make(const_cast<float*>(t.data.data()) + r0 * cols, DType::kF32, {n, cols});
}
// Columns [c0, c0 + n) of a [rows, cols] weight: a strided view (the GEMM's leading dimension).
TensorView cols_of(const model::OwnedTensor& t, int64_t c0, int64_t n) {
  TensorView v =
      TensorView::make(const_cast<float*>(t.data.data()) + c0, DType::kF32, {t.shape[0], n});
  v.stride[0] = t.shape[1];
  return v;
}
TensorView slice1(const model::OwnedTensor& t, int64_t i0, int64_t n) {
  if (t.empty()) return TensorView{};
  return TensorView::make(const_cast<float*>(t.data.data()) + i0, DType::kF32, {n});
}

// This rank's TP slice of one layer.
struct SliceWeights {
  TensorView wq, wk, wv, bq, bk, bv, wo, gate, up, down;
};

// Times a collective into stats.comm_s.
template <typename F>
Status timed(ParallelStats* st, F&& f) {
  const auto t0 = clock::now();
  Status s = f();
  st->comm_s += sf::seconds_since(t0);
  return s;
}


float log_add_exp(float a, float b) {
  if (a == -std::numeric_limits<float>::infinity()) return b;
  if (b == -std::numeric_limits<float>::infinity()) return a;
  const float m = std::max(a, b);
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

// One layer's SnapKV importance where the keys live (ParallelOptions::importance_window): this
// CP rank's rows (ranges, merged into pieces at local rows aoff) of q [n_loc, hq_t, d] and of
// its K/V [n_loc, hkv_t, d]. out: [n_kv_heads, S], every rank. Collective over g.cp and g.tp.
struct ImportanceArgs {
  int64_t S = 0, hq_t = 0, hkv_t = 0, d = 0;
  int window = 0, pool = 1;
  std::array<TokenRange, 2> ranges;
  const std::vector<TokenRange>* pieces = nullptr;
  const std::vector<int64_t>* aoff = nullptr;
  const float *q = nullptr, *k = nullptr, *v = nullptr;
};
Status cp_importance(GridComms& g, const ImportanceArgs& a, std::vector<float>* out,
                     ParallelStats* st, int64_t* tp_bytes) {
  const int CP = g.shape.cp, TP = g.shape.tp;
  const int64_t S = a.S, hq_t = a.hq_t, hkv_t = a.hkv_t, d = a.d, kvw = hkv_t * d;
  const int64_t Wn = std::min<int64_t>(a.window, S), w0 = S - Wn;
  const int64_t n_loc = a.ranges[0].size() + a.ranges[1].size();
  const int64_t bytes0 = g.cp->bytes_sent() + g.tp->bytes_sent();
  // 1) The window's queries on every CP rank: each rank sends the window rows it holds (the
  // last chunk's rank all of them, unless the window is longer than that chunk).
  auto window_rows = [&](const std::array<TokenRange, 2>& rr, auto&& f) {
    for (int64_t row = 0; const TokenRange& r : rr) {
      for (int64_t p = std::max(r.begin, w0); p < r.end; ++p) f(row + p - r.begin, p);
      row += r.size();
    }
  };
  std::vector<float> wq(size_t(Wn * hq_t * d)), mine;
  window_rows(a.ranges, [&](int64_t row, int64_t) {
    mine.insert(mine.end(), a.q + row * hq_t * d, a.q + (row + 1) * hq_t * d);
  });
  if (CP > 1) {
    std::vector<int64_t> counts(static_cast<size_t>(CP), 0);
    for (int r = 0; r < CP; ++r)
      window_rows(cp_rank_ranges(S, CP, r),
                  [&](int64_t, int64_t) { counts[size_t(r)] += hq_t * d; });
    std::vector<float> all(wq.size());
    SF_TRY(timed(st, [&] {
      return g.cp->all_gatherv(mine.data(), int64_t(mine.size()), all.data(), counts, DType::kF32);
    }));
    int64_t off = 0;
    for (int r = 0; r < CP; ++r)
      window_rows(cp_rank_ranges(S, CP, r), [&](int64_t, int64_t p) {
        std::copy_n(all.data() + off, hq_t * d, wq.data() + (p - w0) * hq_t * d);
        off += hq_t * d;
      });
  } else {
    wq = std::move(mine);  // one rank holds every row, in order
  }
  const TensorView wqv = view3(wq.data(), Wn, hq_t, d);
  // 2) Each window row's LSE over every key: this rank's pieces, then the ranks' partial LSEs
  // merged in rank order (the same on every rank).
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> lse(size_t(hq_t * Wn), ninf), part(lse.size()), scratch(wq.size());
  const auto& pieces = *a.pieces;
  for (size_t j = 0; j < pieces.size(); ++j) {
    const TokenRange& r = pieces[j];
    if (r.size() == 0) continue;
    const int64_t off = (*a.aoff)[j] * kvw;
    kernels::AttentionParams ap;
    ap.causal = true;
    ap.q_offset = w0 - r.begin;
    SF_TRY(kernels::attention_dense(wqv, view3(const_cast<float*>(a.k) + off, r.size(), hkv_t, d),
                                    view3(const_cast<float*>(a.v) + off, r.size(), hkv_t, d),
                                    view3(scratch.data(), Wn, hq_t, d),
                                    view2(part.data(), hq_t, Wn), ap));
    for (size_t i = 0; i < lse.size(); ++i) lse[i] = log_add_exp(lse[i], part[i]);
  }
  if (CP > 1) {
    std::vector<float> all(lse.size() * size_t(CP));
    SF_TRY(timed(st, [&] {
      return g.cp->all_gather(lse.data(), all.data(), int64_t(lse.size()), DType::kF32);
    }));
    std::fill(lse.begin(), lse.end(), ninf);
    for (int r = 0; r < CP; ++r)
      for (size_t i = 0; i < lse.size(); ++i)
        lse[i] = log_add_exp(lse[i], all[size_t(r) * lse.size() + i]);
  }
  // 3) Column sums of this rank's keys (unpooled: the pooling window crosses ranks), gathered
  // over CP into prompt order, then pooled.
  std::vector<float> sums(size_t(hkv_t * n_loc)), tmp;
  for (size_t j = 0; j < pieces.size(); ++j) {
    const TokenRange& r = pieces[j];
    if (r.size() == 0) continue;
    kernels::ImportanceParams ip;
    ip.window = int(Wn);
    ip.pool = 1;
    ip.q_offset = w0 - r.begin;
    tmp.resize(size_t(hkv_t * r.size()));
    SF_TRY(kernels::kv_importance(
        wqv, view3(const_cast<float*>(a.k) + (*a.aoff)[j] * kvw, r.size(), hkv_t, d),
        view2(lse.data(), hq_t, Wn), ip, view2(tmp.data(), hkv_t, r.size())));
    for (int64_t h = 0; h < hkv_t; ++h)
      std::copy_n(tmp.data() + h * r.size(), r.size(), sums.data() + h * n_loc + (*a.aoff)[j]);
  }
  std::vector<float> raw(size_t(hkv_t * S));
  if (CP > 1) {
    std::vector<int64_t> counts(static_cast<size_t>(CP));
    for (int r = 0; r < CP; ++r) {
      const auto rr = cp_rank_ranges(S, CP, r);
      counts[size_t(r)] = hkv_t * (rr[0].size() + rr[1].size());
    }
    std::vector<float> all(size_t(hkv_t * S));
    SF_TRY(timed(st, [&] {
      return g.cp->all_gatherv(sums.data(), int64_t(sums.size()), all.data(), counts,
                               DType::kF32);
    }));
    int64_t base = 0;
    for (int r = 0; r < CP; ++r) {
      const auto rr = cp_rank_ranges(S, CP, r);
      const int64_t nr = rr[0].size() + rr[1].size();
      for (int64_t h = 0; h < hkv_t; ++h)
        for (int64_t row = 0; const TokenRange& ch : rr) {
          std::copy_n(all.data() + base + h * nr + row, ch.size(), raw.data() + h * S + ch.begin);
          row += ch.size();
        }
      base += hkv_t * nr;
    }
  } else {
    raw = std::move(sums);  // one rank: its rows are the prompt
  }
  std::vector<float> pooled(size_t(hkv_t * S));
  for (int64_t h = 0; h < hkv_t; ++h)
    kernels::max_pool_keys(raw.data() + h * S, S, a.pool, pooled.data() + h * S);
  // 4) Every TP slice's KV heads (slices are contiguous heads in TP rank order).
  out->resize(size_t(TP * hkv_t * S));
  if (TP > 1) {
    const int64_t t0 = g.tp->bytes_sent();
    SF_TRY(timed(st, [&] {
      return g.tp->all_gather(pooled.data(), out->data(), hkv_t * S, DType::kF32);
    }));
    *tp_bytes += g.tp->bytes_sent() - t0;  // not the TP all-reduces' (tp_allreduce_bytes)
  } else
    *out = std::move(pooled);
  st->importance_bytes += g.cp->bytes_sent() + g.tp->bytes_sent() - bytes0;
  return Status::ok();
}
}  // namespace

Result<kernels::SparseIndex> slice_index(const kernels::SparseIndex& gi, int h0, int nh,
                                         const TokenRange& r) {
  constexpr int64_t B = kernels::kSparseBlock;
  if (gi.q_offset != 0 || gi.n_q != gi.n_k)
    return SF_ERR(
        kInvalidArgument,
        "slice_index: the global index must cover the whole prompt (q_offset 0, n_q == n_k)");
  if (h0 < 0 || nh <= 0 || h0 + nh > gi.n_heads)
    return SF_ERR(kInvalidArgument, "slice_index: heads [" + std::to_string(h0) + ", " +
                                        std::to_string(h0 + nh) + ") outside the index's " +
                                        std::to_string(gi.n_heads));
  if (r.begin % B != 0 || r.begin < 0 || r.end > gi.n_q || r.end < r.begin ||
      (r.end % B != 0 && r.end != gi.n_q))
    return SF_ERR(kInvalidArgument,
                  "slice_index: chunk [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                      ") is not 64-aligned inside the index's " + std::to_string(gi.n_q) + " rows");
  kernels::SparseIndex out =
      kernels::sparse_index_make(nh, r.size(), r.end, r.begin, gi.max_blocks, gi.max_cols);
  const int64_t qb0 = r.begin / B;
  for (int h = 0; h < nh; ++h)
    for (int64_t qb = 0; qb < out.n_qblocks; ++qb)
      kernels::sparse_index_copy_slot(gi, gi.slot(h0 + h, qb0 + qb), &out, out.slot(h, qb));
  return out;
}

Status gather_group_stats(GridComms& g, double pairs_done, double pairs_causal, ParallelStats* st) {
  constexpr int kStat = 8;
  const int G = g.group_comm->size();
  const int64_t mine[kStat] = {st->kv_allgather_bytes, st->kv_moved_bytes, st->estimate_bytes,
                               std::bit_cast<int64_t>(pairs_done),
                               std::bit_cast<int64_t>(pairs_causal),
                               std::bit_cast<int64_t>(st->seconds),
                               std::bit_cast<int64_t>(st->attention_s),
                               std::bit_cast<int64_t>(st->comm_s)};
  std::vector<int64_t> all(size_t(G) * kStat);
  SF_TRY(g.group_comm->all_gather(mine, all.data(), kStat, DType::kI64));
  double done = 0, causal = 0;
  st->group_kv_allgather_bytes = st->group_kv_moved_bytes = st->group_estimate_bytes = 0;
  st->kv_moved_bytes_by_rank.resize(size_t(G));
  st->estimate_bytes_by_rank.resize(size_t(G));
  for (auto* v : {&st->seconds_by_rank, &st->attention_s_by_rank, &st->comm_s_by_rank,
                  &st->density_by_rank})
    v->resize(size_t(G));
  for (int r = 0; r < G; ++r) {
    const int64_t* a = all.data() + size_t(r) * kStat;
    st->group_kv_allgather_bytes += a[0];
    st->group_kv_moved_bytes += a[1];
    st->group_estimate_bytes += a[2];
    st->kv_moved_bytes_by_rank[size_t(r)] = a[1];
    st->estimate_bytes_by_rank[size_t(r)] = a[2];
    const double rank_done = std::bit_cast<double>(a[3]), rank_causal = std::bit_cast<double>(a[4]);
    done += rank_done;
    causal += rank_causal;
    st->density_by_rank[size_t(r)] = rank_causal > 0 ? rank_done / rank_causal : 1.0;
    st->seconds_by_rank[size_t(r)] = std::bit_cast<double>(a[5]);
    st->attention_s_by_rank[size_t(r)] = std::bit_cast<double>(a[6]);
    st->comm_s_by_rank[size_t(r)] = std::bit_cast<double>(a[7]);
  }
  st->group_density = causal > 0 ? done / causal : 1.0;
  return Status::ok();
}

Result<ParallelResult> parallel_prefill(const model::Model& m, GridComms& g,
                                        std::span<const int32_t> tokens,
                                        const ParallelOptions& opt) {
  const auto t_start = clock::now();
  const model::ModelConfig& c = m.config();
  const model::ModelWeights& w = m.weights();
  const int TP = g.shape.tp, CP = g.shape.cp;
  if (!g.tp || !g.cp || !g.group_comm || g.tp->size() != TP || g.cp->size() != CP)
    return SF_ERR(kInvalidArgument, "parallel_prefill: communicators do not match the grid shape");
  SF_TRY(check_model_divides(c, TP));
  SF_TRY(model::check_host_weights(m, "parallel_prefill"));
  const int64_t S = int64_t(tokens.size());
  if (S == 0) return SF_ERR(kInvalidArgument, "prefill: empty prompt");
  if (opt.chunk <= 0) return SF_ERR(kInvalidArgument, "prefill: chunk must be positive");
  for (int64_t i = 0; i < S; ++i)
    if (tokens[size_t(i)] < 0 || tokens[size_t(i)] >= c.vocab)
      return SF_ERR(kOutOfRange, "prefill: token id " + std::to_string(tokens[size_t(i)]) +
                                     " at position " + std::to_string(i) + " outside vocab " +
                                     std::to_string(c.vocab));
  const model::SparseConfig* sc = opt.sparse;
  if (sc && (sc->n_layers != c.n_layers || sc->n_heads != c.n_heads))
    return SF_ERR(kInvalidArgument,
                  "prefill: sparse config is for " + std::to_string(sc->n_layers) + "x" +
                      std::to_string(sc->n_heads) + " layers x heads, the model has " +
                      std::to_string(c.n_layers) + "x" + std::to_string(c.n_heads));
  const bool use_sparse =
      (sc && S >= sc->dense_below && !model::sparse_config_is_dense(*sc)) || opt.index_source;

  const int64_t H = c.hidden, d = c.head_dim;
  const int64_t hq_t = c.n_heads / TP, hkv_t = c.n_kv_heads / TP, I_t = c.intermediate / TP;
  const int64_t hq0 = hq_t * g.tp_rank, hkv0 = hkv_t * g.tp_rank, i0 = I_t * g.tp_rank;
  const int64_t kvw = hkv_t * d;  // K (or V) floats per token of this slice

  // This rank's tokens: two zigzag chunks, stored back to back in prompt order of each chunk.
  const auto ranges = cp_rank_ranges(S, CP, g.cp_rank);
  const int64_t n_loc = ranges[0].size() + ranges[1].size();
  std::vector<int32_t> ids, pos;
  for (const auto& r : ranges)
    for (int64_t i = r.begin; i < r.end; ++i) {
      ids.push_back(tokens[size_t(i)]);
      pos.push_back(int32_t(i));
    }
  // Local row of each chunk start; every rank's K/V block in the all-gather is laid out the same.
  const int64_t loc_off[2] = {0, ranges[0].size()};
  // Attention runs per contiguous piece: the two chunks merge when adjacent (CP 1, and the middle
  // CP rank), so CP 1 is exactly the single-rank forward, estimated sparse attention included.
  const std::vector<TokenRange> aranges = cp_rank_pieces(S, CP, g.cp_rank);
  std::vector<int64_t> aoff;  // local row of each piece's start
  for (int64_t off = 0; const TokenRange& r : aranges) {
    aoff.push_back(off);
    off += r.size();
  }
  const int n_ar = int(aranges.size());
  std::vector<int64_t> gather_counts(static_cast<size_t>(CP));
  for (int r = 0; r < CP; ++r) {
    const auto rr = cp_rank_ranges(S, CP, r);
    gather_counts[size_t(r)] = 2 * (rr[0].size() + rr[1].size()) * kvw;  // K then V
  }

  kernels::RopeParams rope = c.rope;
  if (!w.rope_freqs.empty()) rope.freq_factors = w.rope_freqs.data.data();
  const int64_t C = std::max<int64_t>(1, std::min(opt.chunk, std::max<int64_t>(n_loc, 1)));
  std::vector<float> x(size_t(n_loc * H)), q(size_t(n_loc * hq_t * d)),
      att(size_t(n_loc * hq_t * d)), lse(size_t(hq_t * std::max<int64_t>(n_loc, 1))),
      kv_loc(size_t(2 * n_loc * kvw)), kv_all(size_t(2 * S * kvw)), part(size_t(n_loc * H));
  std::vector<float> xn(size_t(C * H)), gate(size_t(C * I_t)), up(size_t(C * I_t));
  std::vector<float> K(size_t(S * kvw)), V(size_t(S * kvw));
  ParallelResult res;
  // A failed run hands its K/V to kv_hooks.failed (whose caller may still read the rows
  // kv_hooks.final named) instead of freeing it as it returns.
  struct HandOver {
    ParallelResult& r;
    const std::function<void(model::KvCache&&)>& failed;
    bool ok = false;
    ~HandOver() {
      if (!ok && failed && !r.kv.k.empty()) failed(std::move(r.kv));
    }
  } hand{res, opt.kv_hooks.failed};
  ParallelStats& st = res.stats;
  const int64_t ar_bytes0 = g.tp->bytes_sent(), cp_bytes0 = g.cp->bytes_sent(),
                grp_bytes0 = g.group_comm->bytes_sent();
  // Leader-side KV cache of this TP slice (gathered over TP at the end).
  // Selective mode: no rank holds every key, so each keeps its own rows and they are gathered
  // over CP after the last layer.
  std::vector<std::vector<float>> kslice, vslice;
  const bool cp_est = opt.cp_estimate && use_sparse && !opt.index_source;
  // A prompt below the config's dense_below has no index: every causal key is read, so the
  // selective exchange would move what the all-gather does. It takes the all-gather (a batch's
  // short documents must not fail for it).
  const bool selective = opt.selective_kv && (use_sparse || opt.index_source);
  const bool keep_local = opt.gather_kv && selective;
  const bool keep = opt.gather_kv && g.cp_rank == 0;
  if (keep || keep_local) {
    kslice.assign(size_t(c.n_layers), {});
    vslice.assign(size_t(c.n_layers), {});
  }
  const TensorView none{};
  double pairs_done = 0, pairs_causal = 0;
  if (selective && !opt.index_source && !cp_est)
    return SF_ERR(
        kInvalidArgument,
        "parallel_prefill: the selective KV exchange needs the index before the exchange: "
        "a shared global index (index_source) or cp_estimate with a sparse config");
  // Checked on the whole config, before any collective: every rank holds the same config and
  // refuses alike (a TP slice without such a head must not go on to wait for one that has it).
  if (cp_est)
    for (const auto& layer : opt.sparse->layers)
      for (size_t h = 0; h < layer.size(); ++h)
        if (layer[h].vs_cover != 0)
          return SF_ERR(kUnsupported, "parallel_prefill: head " + std::to_string(h) +
                                          " has vs_cover, which --cp-estimate does not implement "
                                          "(cp_estimate.h)");
  const bool have_index = opt.index_source || cp_est;
  // An all-gathered [rank][K rows, V rows] buffer back into prompt order.
  auto unpack_gathered = [&](const float* all, float* Kd, float* Vd) {
    int64_t off = 0;
    for (int r = 0; r < CP; ++r) {
      const auto rr = cp_rank_ranges(S, CP, r);
      const int64_t nr = rr[0].size() + rr[1].size();
      const float* kb = all + off;
      const float* vb = kb + nr * kvw;
      int64_t row = 0;
      for (const auto& ch : rr) {
        std::copy_n(kb + row * kvw, ch.size() * kvw, Kd + ch.begin * kvw);
        std::copy_n(vb + row * kvw, ch.size() * kvw, Vd + ch.begin * kvw);
        row += ch.size();
      }
      off += 2 * nr * kvw;
    }
  };

  if (opt.importance_window < 0 || opt.importance_pool < 1 || opt.importance_pool % 2 == 0)
    return SF_ERR(kInvalidArgument,
                  "parallel_prefill: importance_window must be >= 0 and importance_pool odd");
  if (opt.importance_window > 0) res.importance.assign(size_t(c.n_layers), {});
  // kv_hooks.final's readers hold each layer's rows: the per-layer vectors must not move.
  if (opt.local_kv && !opt.gather_kv) {
    res.kv.k.reserve(size_t(c.n_layers));
    res.kv.v.reserve(size_t(c.n_layers));
  }
  int64_t imp_tp_bytes = 0;
  if (n_loc > 0)
    SF_TRY(kernels::embedding(w.tok_embd.view(), ids.data(), n_loc, view2(x.data(), n_loc, H)));
  for (int l = 0; l < c.n_layers; ++l) {
    if (opt.on_layer) opt.on_layer(l);
    const model::LayerWeights& L = w.layers[size_t(l)];
    const SliceWeights sw{rows_of(L.wq, hq0 * d, hq_t * d), rows_of(L.wk, hkv0 * d, kvw),
                          rows_of(L.wv, hkv0 * d, kvw),     slice1(L.bq, hq0 * d, hq_t * d),
                          slice1(L.bk, hkv0 * d, kvw),      slice1(L.bv, hkv0 * d, kvw),
                          cols_of(L.wo, hq0 * d, hq_t * d), rows_of(L.w_gate, i0, I_t),
                          rows_of(L.w_up, i0, I_t),         cols_of(L.w_down, i0, I_t)};
    float* kl = kv_loc.data();
    float* vl = kv_loc.data() + n_loc * kvw;
    // 1) norm, Q/K/V of this slice, RoPE at global positions.
    for (int64_t c0 = 0; c0 < n_loc; c0 += C) {
      const int64_t n = std::min(C, n_loc - c0);
      TensorView xnv = view2(xn.data(), n, H);
      SF_TRY(kernels::rms_norm(view2(x.data() + c0 * H, n, H), L.attn_norm.view(), c.rms_eps, xnv));
      float* qc = q.data() + c0 * hq_t * d;
      SF_TRY(kernels::linear(xnv, sw.wq, sw.bq, view2(qc, n, hq_t * d)));
      SF_TRY(kernels::linear(xnv, sw.wk, sw.bk, view2(kl + c0 * kvw, n, kvw)));
      SF_TRY(kernels::linear(xnv, sw.wv, sw.bv, view2(vl + c0 * kvw, n, kvw)));
      SF_TRY(kernels::rope(view3(qc, n, hq_t, d), pos.data() + c0, rope));
      SF_TRY(kernels::rope(view3(kl + c0 * kvw, n, hkv_t, d), pos.data() + c0, rope));
    }
    // The shared index of this layer, sliced to this rank's heads and chunks (before the
    // exchange: selective mode moves only what these read).
    std::array<kernels::SparseIndex, 2> sliced;  // per attention piece
    if (opt.index_source) {
      const kernels::SparseIndex* gi = opt.index_source(l);
      if (!gi)
        return SF_ERR(kInvalidArgument,
                      "parallel_prefill: no index for layer " + std::to_string(l));
      // Checked whole on every rank, a rank without rows included (slice_index runs only where
      // a piece has rows): a rank that refused alone would leave its peers in the exchange.
      if (gi->n_q != S || gi->n_k != S || gi->q_offset != 0 || gi->n_heads != c.n_heads)
        return SF_ERR(kInvalidArgument,
                      "parallel_prefill: the index of layer " + std::to_string(l) + " covers " +
                          std::to_string(gi->n_q) + " rows x " + std::to_string(gi->n_k) +
                          " keys (q_offset " + std::to_string(gi->q_offset) + ") x " +
                          std::to_string(gi->n_heads) + " heads, the prompt has " +
                          std::to_string(S) + " x " + std::to_string(S) + " (0) x " +
                          std::to_string(c.n_heads));
      for (int j = 0; j < n_ar; ++j) {
        if (aranges[size_t(j)].size() == 0) continue;
        SF_ASSIGN(sliced[size_t(j)], slice_index(*gi, int(hq0), int(hq_t), aranges[size_t(j)]));
      }
    } else if (cp_est) {
      CpEstimateArgs ea;
      ea.n_tokens = S;
      ea.ranges = ranges;
      ea.pieces = aranges;
      ea.q_loc = q.data();
      ea.k_loc = kl;
      ea.n_heads = int(hq_t);
      ea.n_kv_heads = int(hkv_t);
      ea.head_dim = int(d);
      ea.patterns = sc->layers[size_t(l)].data() + hq0;
      std::vector<kernels::SparseIndex> est;
      CpEstimateStats es;
      // Its collectives are in estimate_s with its arithmetic, not in comm_s as well.
      SF_TRY(cp_estimate(*g.cp, ea, &est, &es));
      st.estimate_bytes += es.bytes;
      st.estimate_queries_bytes += es.parts.queries;
      st.estimate_columns_bytes += es.parts.columns;
      st.estimate_diagonals_bytes += es.parts.diagonals;
      st.estimate_blocks_bytes += es.parts.blocks;
      st.estimate_s += es.seconds;
      for (int j = 0; j < n_ar; ++j) sliced[size_t(j)] = std::move(est[size_t(j)]);
    }
    if (opt.on_index && have_index)
      for (int j = 0; j < n_ar; ++j)
        if (aranges[size_t(j)].size() > 0)
          opt.on_index(l, aranges[size_t(j)], int(hq0), sliced[size_t(j)]);
    const int64_t allgather_recv = int64_t(sizeof(float)) * (2 * S * kvw - 2 * n_loc * kvw);
    st.kv_allgather_bytes += allgather_recv;
    if (!selective) {
      // 2) CP all-gather of this slice's K and V, then back into prompt order.
      SF_TRY(timed(&st, [&] {
        return g.cp->all_gatherv(kv_loc.data(), 2 * n_loc * kvw, kv_all.data(), gather_counts,
                                 DType::kF32);
      }));
      st.kv_moved_bytes += allgather_recv;
      unpack_gathered(kv_all.data(), K.data(), V.data());
    } else {
      // 2') Selective exchange, per (token, KV head): a mask of the keys this rank's index
      // slices read through each KV head and it does not hold; masks are all-gathered as bits
      // (S x KV heads / 8 bytes per rank), then each pair of ranks swaps exactly the head rows the
      // other asked for. Keys nobody asked for stay NaN here, so a kernel that read one would
      // poison the output.
      std::fill(K.begin(), K.end(), std::nanf(""));
      std::fill(V.begin(), V.end(), std::nanf(""));
      const int64_t grp = hq_t / hkv_t, nm = S * hkv_t;
      std::vector<uint8_t> need(static_cast<size_t>(nm), 0);
      for (int j = 0; j < n_ar; ++j) {
        if (aranges[size_t(j)].size() == 0) continue;
        const kernels::SparseIndex& ix = sliced[size_t(j)];
        kernels::sparse_index_key_rows(ix, 0, ix.n_qblocks, int(grp), 0, int(hkv_t), need.data());
      }
      for (const auto& r : ranges)
        std::fill(need.begin() + r.begin * hkv_t, need.begin() + r.end * hkv_t, uint8_t(0));
      const int64_t nbits = (nm + 7) / 8;
      std::vector<uint8_t> bits(static_cast<size_t>(nbits), 0), masks(size_t(nbits) * size_t(CP));
      for (int64_t e = 0; e < nm; ++e)
        if (need[size_t(e)]) bits[size_t(e / 8)] |= uint8_t(1u << (e % 8));
      SF_TRY(timed(&st,
                   [&] { return g.cp->all_gather(bits.data(), masks.data(), nbits, DType::kU8); }));
      st.kv_moved_bytes += (CP - 1) * nbits;
      // Own rows into place.
      for (int j = 0; j < 2; ++j) {
        const TokenRange& r = ranges[size_t(j)];
        std::copy_n(kl + loc_off[j] * kvw, r.size() * kvw, K.data() + r.begin * kvw);
        std::copy_n(vl + loc_off[j] * kvw, r.size() * kvw, V.data() + r.begin * kvw);
      }
      std::vector<float> sendbuf, recvbuf;
      for (int step = 1; step < CP; ++step) {
        const int dest = (g.cp_rank + step) % CP, src = (g.cp_rank + CP - step) % CP;
        const uint8_t* dest_mask = masks.data() + size_t(dest) * size_t(nbits);
        // (token * hkv_t + kv head) of my rows dest needs, and of src's rows I need.
        std::vector<int64_t> give, take;
        for (int j = 0; j < 2; ++j)
          for (int64_t e = ranges[size_t(j)].begin * hkv_t; e < ranges[size_t(j)].end * hkv_t; ++e)
            if ((dest_mask[e / 8] >> (e % 8)) & 1u) give.push_back(e);
        for (const auto& r : cp_rank_ranges(S, CP, src))
          for (int64_t e = r.begin * hkv_t; e < r.end * hkv_t; ++e)
            if (need[size_t(e)]) take.push_back(e);
        sendbuf.resize(give.size() * 2 * size_t(d));
        for (size_t i = 0; i < give.size(); ++i) {
          std::copy_n(K.data() + give[i] * d, d, sendbuf.data() + 2 * i * size_t(d));
          std::copy_n(V.data() + give[i] * d, d, sendbuf.data() + (2 * i + 1) * size_t(d));
        }
        recvbuf.resize(take.size() * 2 * size_t(d));
        SF_TRY(timed(&st, [&] {
          return g.cp->sendrecv(sendbuf.data(), int64_t(sendbuf.size()), dest, recvbuf.data(),
                                int64_t(recvbuf.size()), src, DType::kF32, 100 + l);
        }));
        for (size_t i = 0; i < take.size(); ++i) {
          std::copy_n(recvbuf.data() + 2 * i * size_t(d), d, K.data() + take[i] * d);
          std::copy_n(recvbuf.data() + (2 * i + 1) * size_t(d), d, V.data() + take[i] * d);
        }
        st.kv_moved_bytes += int64_t(recvbuf.size() * sizeof(float));
      }
    }
    // 3) Attention of each held chunk against every key before its end.
    for (int j = 0; j < n_ar; ++j) {
      const TokenRange& r = aranges[size_t(j)];
      if (r.size() == 0) continue;
      const TensorView qv = view3(q.data() + aoff[size_t(j)] * hq_t * d, r.size(), hq_t, d),
                       kv3 = view3(K.data(), r.end, hkv_t, d),
                       vv = view3(V.data(), r.end, hkv_t, d),
                       ov = view3(att.data() + aoff[size_t(j)] * hq_t * d, r.size(), hq_t, d),
                       lv = view2(lse.data(), hq_t, r.size());
      kernels::AttentionParams ap;
      ap.causal = true;
      ap.q_offset = r.begin;
      const double causal = double(hq_t) * (double(r.size()) * double(r.begin) +
                                            double(r.size()) * double(r.size() + 1) / 2);
      pairs_causal += causal;
      if (use_sparse) {
        kernels::SparseIndex idx;
        const auto e0 = clock::now();
        if (have_index) {
          idx = std::move(sliced[size_t(j)]);
          pairs_done += causal * idx.density();
        } else {
          const auto& lp = sc->layers[size_t(l)];
          const std::vector<kernels::HeadPattern> pats(lp.begin() + hq0, lp.begin() + hq0 + hq_t);
          kernels::EstimatorStats es;
          SF_TRY(kernels::sparse_estimate(qv, kv3, pats, r.begin, &idx, &es));
          pairs_done += causal * es.density;
        }
        const auto e1 = clock::now();
        SF_TRY(kernels::attention_sparse(qv, kv3, vv, idx, ov, lv, ap));
        st.estimate_s += std::chrono::duration<double>(e1 - e0).count();
        st.attention_s += sf::seconds_since(e1);
      } else {
        const auto a0 = clock::now();
        SF_TRY(kernels::attention_dense(qv, kv3, vv, ov, lv, ap));
        st.attention_s += sf::seconds_since(a0);
        pairs_done += causal;
      }
    }
    if (opt.importance_window > 0) {
      const auto i0 = clock::now();
      ImportanceArgs ia;
      ia.S = S;
      ia.hq_t = hq_t;
      ia.hkv_t = hkv_t;
      ia.d = d;
      ia.window = opt.importance_window;
      ia.pool = opt.importance_pool;
      ia.ranges = ranges;
      ia.pieces = &aranges;
      ia.aoff = &aoff;
      ia.q = q.data();
      ia.k = kl;
      ia.v = vl;
      SF_TRY(cp_importance(g, ia, &res.importance[size_t(l)], &st, &imp_tp_bytes));
      st.importance_s += sf::seconds_since(i0);
    }
    if (opt.local_kv && !opt.gather_kv) {
      res.kv.k.emplace_back(kl, kl + n_loc * kvw);
      res.kv.v.emplace_back(vl, vl + n_loc * kvw);
      if (opt.kv_hooks.final)
        opt.kv_hooks.final(l, res.kv,
                           opt.importance_window > 0
                               ? std::span<const float>(res.importance[size_t(l)])
                               : std::span<const float>());
    }
    if (keep_local) {
      kslice[size_t(l)].assign(kl, kl + n_loc * kvw);
      vslice[size_t(l)].assign(vl, vl + n_loc * kvw);
    } else if (keep) {
      kslice[size_t(l)] = K;
      vslice[size_t(l)] = V;
    }
    // A row-parallel projection's partial sums (part): summed over TP, added to the residual x.
    auto reduce_into_residual = [&]() -> Status {
      if (TP > 1)
        SF_TRY(timed(&st, [&] {
          return g.tp->all_reduce(part.data(), part.data(), n_loc * H, DType::kF32,
                                  comm::ReduceOp::kSum);
        }));
      if (n_loc > 0)
        SF_TRY(kernels::add_inplace(view2(x.data(), n_loc, H), view2(part.data(), n_loc, H)));
      return Status::ok();
    };
    // 4) Row-parallel O projection: partial sums over this slice's heads, all-reduced over TP.
    for (int64_t c0 = 0; c0 < n_loc; c0 += C) {
      const int64_t n = std::min(C, n_loc - c0);
      SF_TRY(kernels::linear(view2(att.data() + c0 * hq_t * d, n, hq_t * d), sw.wo, none,
                             view2(part.data() + c0 * H, n, H)));
    }
    SF_TRY(reduce_into_residual());
    // 5) MLP: column-parallel gate/up, row-parallel down, all-reduce.
    for (int64_t c0 = 0; c0 < n_loc; c0 += C) {
      const int64_t n = std::min(C, n_loc - c0);
      TensorView xnv = view2(xn.data(), n, H);
      SF_TRY(kernels::rms_norm(view2(x.data() + c0 * H, n, H), L.ffn_norm.view(), c.rms_eps, xnv));
      SF_TRY(kernels::linear(xnv, sw.gate, none, view2(gate.data(), n, I_t)));
      SF_TRY(kernels::linear(xnv, sw.up, none, view2(up.data(), n, I_t)));
      SF_TRY(kernels::swiglu(view2(gate.data(), n, I_t), view2(up.data(), n, I_t),
                             view2(gate.data(), n, I_t)));
      SF_TRY(kernels::linear(view2(gate.data(), n, I_t), sw.down, none,
                             view2(part.data() + c0 * H, n, H)));
    }
    SF_TRY(reduce_into_residual());
  }
  if (opt.local_kv && !opt.gather_kv) {
    res.kv.n_layers = c.n_layers;
    res.kv.n_kv_heads = int(hkv_t);
    res.kv.head_dim = int(d);
    res.kv.n_tokens = n_loc;
  }
  st.tp_allreduce_bytes = TP > 1 ? g.tp->bytes_sent() - ar_bytes0 - imp_tp_bytes : 0;
  st.density = pairs_causal > 0 ? pairs_done / pairs_causal : 1.0;

  // Logits. The last prompt token is in chunk 2*CP-1, which CP rank 0 holds; TP rank 0 of it (the
  // leader) computes. all_logits: every CP rank's TP rank 0 computes its rows, gathered in order.
  const model::OwnedTensor& head = m.output_weight();
  const int64_t vocab = c.vocab;
  std::vector<float> my_logits;
  int64_t my_rows = 0, my_row0 = 0;
  if (g.tp_rank == 0) {
    my_row0 = opt.all_logits ? 0 : n_loc - 1;
    my_rows = opt.all_logits ? n_loc : (g.cp_rank == 0 && n_loc > 0 ? 1 : 0);
    my_logits.resize(size_t(my_rows * vocab));
    for (int64_t r = 0; r < my_rows; r += C) {
      const int64_t n = std::min(C, my_rows - r);
      TensorView xnv = view2(xn.data(), n, H);
      SF_TRY(kernels::rms_norm(view2(x.data() + (my_row0 + r) * H, n, H), w.out_norm.view(),
                               c.rms_eps, xnv));
      SF_TRY(
          kernels::linear(xnv, head.view(), none, view2(my_logits.data() + r * vocab, n, vocab)));
    }
  }
  if (opt.all_logits && g.tp_rank == 0) {
    std::vector<int64_t> counts(static_cast<size_t>(CP));
    for (int r = 0; r < CP; ++r) {
      const auto rr = cp_rank_ranges(S, CP, r);
      counts[size_t(r)] = (rr[0].size() + rr[1].size()) * vocab;
    }
    std::vector<float> all(size_t(S * vocab));
    SF_TRY(timed(&st, [&] {
      return g.cp->all_gatherv(my_logits.data(), my_rows * vocab, all.data(), counts, DType::kF32);
    }));
    if (g.leader()) {
      res.logits.resize(size_t(S * vocab));
      int64_t off = 0;
      for (int r = 0; r < CP; ++r)
        for (const auto& ch : cp_rank_ranges(S, CP, r)) {
          std::copy_n(all.data() + off, ch.size() * vocab, res.logits.data() + ch.begin * vocab);
          off += ch.size() * vocab;
        }
      res.n_logit_rows = S;
    }
  } else if (g.leader()) {
    res.logits = std::move(my_logits);
    res.n_logit_rows = 1;
  }
  int32_t first = -1;
  if (g.leader()) {
    const float* last = res.logits.data() + (res.n_logit_rows - 1) * vocab;
    first = int32_t(std::max_element(last, last + vocab) - last);
  }
  SF_TRY(timed(&st, [&] { return g.group_comm->bcast(&first, 1, DType::kI32, 0); }));
  res.first_token = first;

  // Selective mode: the CP rows of each layer meet on every CP rank (only CP rank 0 keeps them).
  if (keep_local)
    for (int l = 0; l < c.n_layers; ++l) {
      std::copy_n(kslice[size_t(l)].data(), n_loc * kvw, kv_loc.data());
      std::copy_n(vslice[size_t(l)].data(), n_loc * kvw, kv_loc.data() + n_loc * kvw);
      SF_TRY(timed(&st, [&] {
        return g.cp->all_gatherv(kv_loc.data(), 2 * n_loc * kvw, kv_all.data(), gather_counts,
                                 DType::kF32);
      }));
      if (!keep) continue;
      kslice[size_t(l)].resize(size_t(S * kvw));
      vslice[size_t(l)].resize(size_t(S * kvw));
      unpack_gathered(kv_all.data(), kslice[size_t(l)].data(), vslice[size_t(l)].data());
    }
  // KV to the leader: CP rank 0's TP row holds every token of its slice; gather the slices.
  // That row alone gathers, for minutes at 1M tokens; the other CP rows pass a group barrier
  // after each of its layers, so what they wait for is one layer's gather, under the deadline,
  // not all of them (then the stats below, or the caller's next collective).
  const bool layer_barriers = opt.gather_kv && TP > 1 && CP > 1;
  if (!keep && layer_barriers)
    for (int l = 0; l < c.n_layers; ++l)
      SF_TRY(timed(&st, [&] { return g.group_comm->barrier(); }));
  if (keep) {
    model::KvCache& kv = res.kv;
    if (g.leader()) {
      kv.n_layers = c.n_layers;
      kv.n_kv_heads = c.n_kv_heads;
      kv.head_dim = int(d);
      kv.n_tokens = S;
      kv.k.assign(size_t(c.n_layers), {});
      kv.v.assign(size_t(c.n_layers), {});
    }
    std::vector<float> all(TP > 1 ? size_t(TP * S * kvw) : 0);
    for (int l = 0; l < c.n_layers; ++l) {
      for (int which = 0; which < 2; ++which) {
        std::vector<float>& mine = (which ? vslice : kslice)[size_t(l)];
        if (TP == 1) {
          if (g.leader()) (which ? kv.v : kv.k)[size_t(l)] = std::move(mine);
          continue;
        }
        SF_TRY(timed(
            &st, [&] { return g.tp->all_gather(mine.data(), all.data(), S * kvw, DType::kF32); }));
        // Sent: the slice goes now, so the leader's peak is the whole cache, not the whole
        // cache and its own slice of it (the worker's host memory check counts the former).
        std::vector<float>().swap(mine);
        if (!g.leader()) continue;
        auto& dst = (which ? kv.v : kv.k)[size_t(l)];
        dst.resize(size_t(S * c.n_kv_heads * d));
        for (int t = 0; t < TP; ++t)
          for (int64_t i = 0; i < S; ++i)
            std::copy_n(all.data() + (int64_t(t) * S + i) * kvw, kvw,
                        dst.data() + (i * c.n_kv_heads + t * hkv_t) * d);
      }
      if (opt.on_kv_gathered) opt.on_kv_gathered(l);
      if (layer_barriers) SF_TRY(timed(&st, [&] { return g.group_comm->barrier(); }));
    }
  }
  st.comm_bytes = (g.tp->bytes_sent() - ar_bytes0) + (g.cp->bytes_sent() - cp_bytes0) +
                  (g.group_comm->bytes_sent() - grp_bytes0);
  st.seconds = sf::seconds_since(t_start);

  // Group totals, for reporting only: after the clock and the byte counters stop.
  SF_TRY(gather_group_stats(g, pairs_done, pairs_causal, &st));
  hand.ok = true;
  return res;
}

}  // namespace sf::runtime
