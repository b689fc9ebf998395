#include "tools/eval/quality.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <set>

#include "common/file_io.h"
#include "common/text.h"
#include "common/thread_pool.h"
#include "worker/model/gguf.h"

namespace sf::eval {

// ---- attention recall ------------------------------------------------------------------------

std::vector<int64_t> sample_rows(int64_t n_q, int n_last, int n_random, uint64_t seed) {
  std::vector<int64_t> rows;
  if (n_q <= 0) return rows;
  const int64_t last0 = std::max<int64_t>(0, n_q - std::max(0, n_last));
  for (int64_t r = last0; r < n_q; ++r) rows.push_back(r);
  // Distinct random rows from [0, last0): partial Fisher-Yates over a virtual array.
  const int64_t pool = last0;
  const int64_t want = std::min<int64_t>(pool, std::max(0, n_random));
  std::mt19937_64 rng(seed);
  std::vector<int64_t> perm;
  if (want > 0) {
    if (want * 4 >= pool) {
      perm.resize(size_t(pool));
      for (int64_t i = 0; i < pool; ++i) perm[size_t(i)] = i;
      for (int64_t i = 0; i < want; ++i) {
        std::uniform_int_distribution<int64_t> u(i, pool - 1);
        std::swap(perm[size_t(i)], perm[size_t(u(rng))]);
      }
      perm.resize(size_t(want));
    } else {
      std::set<int64_t> seen;
      std::uniform_int_distribution<int64_t> u(0, pool - 1);
      while (int64_t(seen.size()) < want) seen.insert(u(rng));
      perm.assign(seen.begin(), seen.end());
    }
  }
  rows.insert(rows.end(), perm.begin(), perm.end());
  std::sort(rows.begin(), rows.end());
  return rows;
}

Status DenseRowMass::compute(const TensorView& q, const TensorView& k, int64_t q_offset, std::vector<int64_t> rows,
                             float scale) {
  if (q.ndim != 3 || k.ndim != 3 || q.dtype != DType::kF32 || k.dtype != DType::kF32 || !q.contiguous() ||
      !k.contiguous() || q.device != Device::kCpu || k.device != Device::kCpu)
    return SF_ERR(kInvalidArgument, "recall: q and k must be contiguous CPU f32 [n, heads, d] views");
  const int64_t n_q = q.shape[0], hq = q.shape[1], d = q.shape[2];
  const int64_t n_k = k.shape[0], hkv = k.shape[1];
  if (k.shape[2] != d || hkv <= 0 || hq % hkv != 0)
    return SF_ERR(kInvalidArgument, "recall: q " + q.shape_str() + " and k " + k.shape_str() + " do not match");
  for (int64_t r : rows)
    if (r < 0 || r >= n_q) return SF_ERR(kOutOfRange, "recall: sampled row " + std::to_string(r) + " outside q");
  if (q_offset < 0) return SF_ERR(kInvalidArgument, "recall: negative q_offset");
  n_heads_ = int(hq);
  n_k_ = n_k;
  q_offset_ = q_offset;
  rows_ = std::move(rows);
  const size_t R = rows_.size(), W = size_t(n_k + 1);
  prefix_.assign(size_t(hq) * R * W, 0.0);
  if (R == 0 || n_k == 0) return Status::ok();
  const float sc = scale > 0 ? scale : 1.f / std::sqrt(float(d));
  const int64_t group = hq / hkv;
  const float* qp = q.ptr<float>();
  const float* kp = k.ptr<float>();
  parallel_for(size_t(hq), [&](size_t h0, size_t h1) {
    std::vector<float> qs(R * size_t(d)), s(R * size_t(n_k));
    for (size_t h = h0; h < h1; ++h) {
      for (size_t i = 0; i < R; ++i)
        std::copy_n(qp + (rows_[i] * hq + int64_t(h)) * d, d, qs.data() + i * size_t(d));
      const int64_t kvh = int64_t(h) / group;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(R), int(n_k), int(d), sc, qs.data(), int(d),
                  kp + kvh * d, int(hkv * d), 0.f, s.data(), int(n_k));
      for (size_t i = 0; i < R; ++i) {
        const float* row = s.data() + i * size_t(n_k);
        const int64_t n_vis = std::min(n_k, q_offset + rows_[i] + 1);
        double* P = prefix_.data() + (h * R + i) * W;
        if (n_vis <= 0) continue;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n_vis; ++j) mx = std::max(mx, row[j]);
        double sum = 0;
        for (int64_t j = 0; j < n_vis; ++j) {
          sum += std::exp(double(row[j]) - double(mx));
          P[j + 1] = sum;
        }
        const double inv = 1.0 / sum;
        for (int64_t j = 1; j <= n_vis; ++j) P[j] *= inv;
        for (int64_t j = n_vis + 1; j <= n_k; ++j) P[j] = 1.0;
      }
    }
  });
  return Status::ok();
}

double DenseRowMass::mass(int h, size_t i, int64_t a, int64_t b) const {
  const int64_t lim = std::min(n_k_, q_offset_ + rows_[i] + 1);
  a = std::max<int64_t>(a, 0);
  b = std::min(b, lim);
  if (b <= a) return 0;
  const double* P = prefix_.data() + (size_t(h) * rows_.size() + i) * size_t(n_k_ + 1);
  return P[b] - P[a];
}

double DenseRowMass::recall(const kernels::SparseIndex& idx, int h) const {
  if (rows_.empty()) return 1.0;
  double total = 0;
  for (size_t i = 0; i < rows_.size(); ++i) total += row_recall(idx, h, i);
  return total / double(rows_.size());
}

double DenseRowMass::log_recall(const kernels::SparseIndex& idx, int h) const {
  if (rows_.empty()) return 0.0;
  double total = 0;
  for (size_t i = 0; i < rows_.size(); ++i) total += std::log(std::max(1e-6, row_recall(idx, h, i)));
  return total / double(rows_.size());
}

double DenseRowMass::row_recall(const kernels::SparseIndex& idx, int h, size_t i) const {
  const int64_t qb = rows_[i] / kernels::kSparseBlock;
  if (qb >= idx.n_qblocks || h >= idx.n_heads) return 0.0;  // not covered: recall 0
  const size_t slot = idx.slot(h, qb);
  double m = 0;
  const int32_t nb = idx.block_count[slot];
  const int32_t* bo = idx.block_offset.data() + slot * size_t(idx.max_blocks);
  for (int32_t b = 0; b < nb; ++b) m += mass(h, i, bo[b], int64_t(bo[b]) + kernels::kSparseBlock);
  const int32_t nc = idx.column_count[slot];
  const int32_t* ci = idx.column_index.data() + slot * size_t(idx.max_cols);
  for (int32_t c = 0; c < nc; ++c) m += mass(h, i, ci[c], int64_t(ci[c]) + 1);
  return std::min(1.0, m);
}

double head_density(const kernels::SparseIndex& idx, int h) {
  double pairs = 0, causal = 0;
  for (int64_t qb = 0; qb < idx.n_qblocks; ++qb) pairs += double(idx.pairs(h, qb));
  for (int64_t r = 0; r < idx.n_q; ++r) causal += double(std::min(idx.n_k, idx.q_offset + r + 1));
  return causal > 0 ? pairs / causal : 1.0;
}

namespace {
double mean_of_layers(const std::vector<double>& v) {
  if (v.empty()) return 1.0;
  double s = 0;
  for (double x : v) s += x;
  return s / double(v.size());
}
}  // namespace

double RecallStats::mean() const { return mean_of_layers(per_layer); }
double RecallStats::mean_held_out() const { return mean_of_layers(per_layer_held_out); }
double RecallStats::mean_last() const { return mean_of_layers(per_layer_last); }

model::AttentionObserver recall_observer(RecallStats* out, int n_last, int n_random, uint64_t seed) {
  return [out, n_last, n_random, seed](int layer, const TensorView& q, const TensorView& k,
                                       const kernels::SparseIndex* idx) {
    if (!out->error.is_ok() || layer < 0) return;
    const size_t L = size_t(layer) + 1;
    if (out->per_layer.size() < L) {
      out->per_layer.resize(L, 1.0);
      out->per_head.resize(L);
      out->per_layer_held_out.resize(L, 1.0);
      out->per_head_held_out.resize(L);
      out->per_layer_last.resize(L, 1.0);
      out->density_per_layer.resize(L, 1.0);
    }
    const int hq = int(q.shape[1]);
    if (!idx) {
      out->per_head[size_t(layer)].assign(size_t(hq), 1.0);
      out->per_head_held_out[size_t(layer)].assign(size_t(hq), 1.0);
      return;
    }
    // The two sets apart: the last n_last rows and the random ones before them.
    const int64_t n_q = q.shape[0];
    const int64_t last0 = std::max<int64_t>(0, n_q - std::max(0, n_last));
    std::vector<int64_t> rows_last, rows_rand;
    for (int64_t r : sample_rows(n_q, n_last, n_random, seed + uint64_t(layer)))
      (r >= last0 ? rows_last : rows_rand).push_back(r);
    // Per head: {recall over the last rows, over the random rows}; a set with no rows weighs 0.
    std::vector<double> ph_last(size_t(hq), 1.0), ph_rand(size_t(hq), 1.0);
    for (int set = 0; set < 2; ++set) {
      std::vector<int64_t>& rows = set == 0 ? rows_last : rows_rand;
      if (rows.empty()) continue;
      DenseRowMass dm;
      Status st = dm.compute(q, k, idx->q_offset, rows);
      if (!st.is_ok()) {
        out->error = st;
        return;
      }
      std::vector<double>& ph = set == 0 ? ph_last : ph_rand;
      parallel_for(size_t(hq), [&](size_t b, size_t e) {
        for (size_t h = b; h < e; ++h) ph[h] = dm.recall(*idx, int(h));
      });
    }
    // Every sampled row alike (what this record gave before the split).
    const double nl = double(rows_last.size()), nr = double(rows_rand.size());
    std::vector<double> ph(static_cast<size_t>(hq));
    double s = 0, s_rand = 0, s_last = 0;
    for (int h = 0; h < hq; ++h) {
      ph[size_t(h)] = (nl * ph_last[size_t(h)] + nr * ph_rand[size_t(h)]) / std::max(1.0, nl + nr);
      s += ph[size_t(h)];
      s_rand += ph_rand[size_t(h)];
      s_last += ph_last[size_t(h)];
    }
    out->per_head[size_t(layer)] = ph;
    out->per_layer[size_t(layer)] = s / double(hq);
    out->per_head_held_out[size_t(layer)] = ph_rand;
    out->per_layer_held_out[size_t(layer)] = s_rand / double(hq);
    out->per_layer_last[size_t(layer)] = s_last / double(hq);
    out->density_per_layer[size_t(layer)] = idx->density();
  };
}

// ---- next-token distributions ----------------------------------------------------------------

namespace {
double log_sum_exp(const float* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(double(x[i]) - double(mx));
  return double(mx) + std::log(s);
}
}  // namespace

std::vector<double> kl_rows(const float* p_logits, const float* q_logits, int64_t rows, int64_t vocab) {
  std::vector<double> kl(size_t(std::max<int64_t>(rows, 0)), 0.0);
  parallel_for(size_t(rows), [&](size_t b, size_t e) {
    for (size_t r = b; r < e; ++r) {
      const float* p = p_logits + r * size_t(vocab);
      const float* q = q_logits + r * size_t(vocab);
      const double lp = log_sum_exp(p, vocab), lq = log_sum_exp(q, vocab);
      double s = 0;
      for (int64_t i = 0; i < vocab; ++i) {
        const double a = double(p[i]) - lp, c = double(q[i]) - lq;
        s += std::exp(a) * (a - c);
      }
      kl[r] = std::max(0.0, s);
    }
  });
  return kl;
}

double kl_mean(const float* p_logits, const float* q_logits, int64_t rows, int64_t vocab) {
  if (rows <= 0) return 0;
  const std::vector<double> kl = kl_rows(p_logits, q_logits, rows, vocab);
  double s = 0;
  for (double x : kl) s += x;
  return s / double(rows);
}

std::vector<double> nll_rows(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab) {
  std::vector<double> nll(static_cast<size_t>(std::max<int64_t>(rows, 0)), 0.0);
  parallel_for(size_t(rows), [&](size_t b, size_t e) {
    for (size_t r = b; r < e; ++r) {
      const float* x = logits + r * size_t(vocab);
      nll[r] = log_sum_exp(x, vocab) - double(x[targets[r]]);
    }
  }, 16);
  return nll;
}

double mean_of(const std::vector<double>& v, size_t b, size_t e) {
  if (e <= b) return 0;
  double s = 0;
  for (size_t i = b; i < e; ++i) s += v[i];
  return s / double(e - b);
}

double rel_l2(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// ---- text and tokens -------------------------------------------------------------------------

Result<model::Tokenizer> load_tokenizer(const std::string& model_path) {
  std::error_code ec;
  if (std::filesystem::is_directory(model_path, ec))
    return SF_ERR(kUnsupported, "'" + model_path +
                                    "' is a Hugging Face directory: eval, search and moa-profile "
                                    "read the tokenizer from a GGUF file (give a .gguf model)");
  auto g = model::GgufFile::open(model_path);
  if (!g.is_ok()) return g.status();
  auto spec = model::tokenizer_spec_from_gguf(g.value(), model::TokenizerCompat::kGguf);
  if (!spec.is_ok()) return spec.status();
  return model::Tokenizer::create(std::move(spec).value());
}

Result<EvalModel> load_eval_model(const std::string& model_path) {
  auto tok = load_tokenizer(model_path);
  if (!tok.is_ok()) return tok.status();
  auto m = model::Model::load(model_path);
  if (!m.is_ok()) return m.status();
  return EvalModel{std::move(tok).value(), std::move(m).value()};
}

std::vector<int32_t> fit_tokens(std::span<const int32_t> doc, int64_t len) {
  std::vector<int32_t> ids;
  if (doc.empty() || len <= 0) return ids;
  ids.reserve(size_t(len));
  while (int64_t(ids.size()) < len) ids.insert(ids.end(), doc.begin(), doc.end());
  ids.resize(size_t(len));
  return ids;
}

// ---- passkey retrieval -----------------------------------------------------------------------

namespace {

// Original filler for this project: uneventful harbour sentences, repeated.
constexpr const char* kFillerUnit =
    " The tide crept up the shingle and slid back again. A gull stood on the harbour wall and watched"
    " the empty water. Somewhere a rope creaked against a wooden post, and then the afternoon went on as before.";

struct PasskeyFormat {
  bool chat = false;
  int key_repeats = 1;
  bool key_marked = false;    // "PASS KEY: n" with the digits spelled twice
  bool question_first = false;  // the question is also asked before the text
};

PasskeyFormat format_for(int level) {
  PasskeyFormat f;
  switch (level) {
    case 0: break;
    case 1: f.chat = true; break;
    case 2: f.chat = true; f.key_repeats = 3; break;
    default: f.chat = true; f.key_repeats = 3; f.key_marked = true; f.question_first = true; break;
  }
  return f;
}

std::string key_line(const PasskeyFormat& f, const std::string& key) {
  std::string one = f.key_marked ? " PASS KEY: " + key + ". The pass key is " + key + ". Remember " + key + "."
                                 : " The pass key is " + key + ". Remember it. " + key + " is the pass key.";
  std::string s;
  for (int i = 0; i < f.key_repeats; ++i) s += one;
  return s;
}

std::string build_passkey_text(const PasskeyFormat& f, const std::string& key, int64_t n_units, int64_t at) {
  std::string intro =
      "Somewhere in the long text below there is a pass key, a number with five digits. Find it and keep it in"
      " mind, because at the end you will be asked what the pass key is.";
  if (f.question_first) intro += " The only question will be: what is the pass key?";
  std::string body;
  for (int64_t u = 0; u <= n_units; ++u) {
    if (u == at) body += key_line(f, key);
    if (u < n_units) body += kFillerUnit;
  }
  const std::string question = "\n\nWhat is the pass key?";
  if (!f.chat) return intro + "\n\n" + body + question + " The pass key is";
  return "<|im_start|>user\n" + intro + "\n\n" + body + question +
         " Answer with its five digits.<|im_end|>\n<|im_start|>assistant\nThe pass key is";
}

}  // namespace

std::string passkey_format_description(int level) {
  const PasskeyFormat f = format_for(level);
  std::string s = "level " + std::to_string(level) + ": ";
  s += f.chat ? "SmolLM2 chat template (<|im_start|>user ... <|im_end|>\\n<|im_start|>assistant\\n), "
              : "plain text (no chat template), ";
  s += "intro asking to find the 5-digit pass key, filler of repeated harbour sentences, key line '";
  s += f.key_marked ? "PASS KEY: N. The pass key is N. Remember N." : "The pass key is N. Remember it. N is the pass key.";
  s += "'";
  if (f.key_repeats > 1) s += " x" + std::to_string(f.key_repeats);
  s += " at the depth";
  if (f.question_first) s += ", question also stated before the text";
  s += ", question 'What is the pass key?' at the end, answer primed with 'The pass key is'; success = the 5 digits"
       " appear in the greedy continuation";
  return s;
}

Result<std::vector<PasskeyPrompt>> passkey_prompts(const model::Tokenizer& tok, int64_t length, int level,
                                                   int n_depths, int trial, uint64_t seed) {
  if (length < 256) return SF_ERR(kInvalidArgument, "passkey: length must be >= 256 tokens");
  if (n_depths <= 0) return SF_ERR(kInvalidArgument, "passkey: need at least one depth");
  const PasskeyFormat f = format_for(level);
  const int64_t unit_tokens = int64_t(tok.encode(kFillerUnit, true, false).size());
  std::vector<PasskeyPrompt> out;
  for (int di = 0; di < n_depths; ++di) {
    std::mt19937_64 rng(seed ^ (uint64_t(length) * 0x9E3779B97F4A7C15ULL) ^ (uint64_t(trial) * 0xBF58476D1CE4E5B9ULL) ^
                        (uint64_t(di) * 0x94D049BB133111EBULL));
    const std::string key = std::to_string(10000 + int(rng() % 90000));
    const double depth = double(di) / double(n_depths);
    const int64_t overhead = int64_t(tok.encode(build_passkey_text(f, key, 0, 0), true, true).size());
    int64_t n = std::max<int64_t>(1, (length - overhead) / std::max<int64_t>(1, unit_tokens));
    std::vector<int32_t> ids;
    for (int it = 0; it < 64; ++it) {
      ids = tok.encode(build_passkey_text(f, key, n, int64_t(std::llround(depth * double(n)))), true, true);
      if (int64_t(ids.size()) <= length || n <= 1) break;
      n -= std::max<int64_t>(1, (int64_t(ids.size()) - length + unit_tokens - 1) / unit_tokens);
      n = std::max<int64_t>(1, n);
    }
    if (int64_t(ids.size()) > length)
      return SF_ERR(kInternal, "passkey: cannot fit a prompt into " + std::to_string(length) + " tokens");
    out.push_back({std::move(ids), key, depth});
  }
  return out;
}

Result<PasskeyAnswer> passkey_answer(const model::Model& m, const model::Tokenizer& tok, const PasskeyPrompt& p,
                                     const model::SparseConfig* sparse, int n_new) {
  model::PrefillOptions opt;
  opt.sparse = sparse;
  opt.keep_kv = true;
  auto r = model::prefill(m, p.ids, opt);
  if (!r.is_ok()) return r.status();
  PasskeyAnswer a;
  a.prefill_s = r->seconds;
  model::PrefillOptions dense;  // decode steps: dense attention over the cache
  dense.keep_kv = true;
  std::vector<int32_t> gen;
  for (int i = 0; i < n_new; ++i) {
    const int32_t t = r->first_token;
    gen.push_back(t);
    if (t == tok.eos_id() || i + 1 == n_new) break;
    SF_TRY(model::extend(m, std::span<const int32_t>(&t, 1), dense, &r.value()));
  }
  a.text = tok.decode(gen);
  a.found = a.text.find(p.key) != std::string::npos;
  return a;
}

// ---- one evaluation at one length --------------------------------------------------------------

Result<EvalRecord> evaluate(const model::Model& m, const model::Tokenizer& tok, std::span<const int32_t> doc,
                            const model::SparseConfig* sparse, const std::string& mode, const EvalSettings& s) {
  if (s.seq_len < 2) return SF_ERR(kInvalidArgument, "eval: seq_len must be >= 2");
  if (doc.empty()) return SF_ERR(kInvalidArgument, "eval: the document has no tokens");
  const bool active = sparse && !model::sparse_config_is_dense(*sparse);
  const model::SparseConfig* sp = active ? sparse : nullptr;
  const int64_t V = m.config().vocab;
  const int64_t L = s.seq_len;
  const std::vector<int32_t> ids = fit_tokens(doc, L);
  EvalRecord rec;
  rec.mode = mode;
  rec.seq_len = L;

  // 1) Quality runs: all positions' logits (perplexity), recall observed in the sparse run.
  if (s.do_logits || s.do_recall) {
    const int64_t K = std::min<int64_t>(s.kl_positions, L);
    std::vector<float> dense_tail;
    model::PrefillOptions o;
    o.keep_kv = false;
    o.all_logits = s.do_logits;
    double nll_d = 0, nll_tail_d = 0;
    std::vector<double> rows_d;
    // --dump-nll: each position's NLL, dense and under test (a dense mode's run is the dense one).
    auto dump_nll = [&](const std::vector<double>& rows_s) -> Status {
      if (s.nll_dump_path.empty()) return Status::ok();
      std::string t = "position\ttoken\tdense_nll\tsparse_nll\n";
      for (size_t i = 0; i < rows_s.size(); ++i)
        t += sformat("%zu\t%d\t%.5f\t%.5f\n", i + 1, ids[i + 1], rows_d[i], rows_s[i]);
      return write_file_atomic(s.nll_dump_path, t);
    };
    if (s.do_logits) {
      auto rd = model::prefill(m, ids, o);
      if (!rd.is_ok()) return rd.status();
      const float* lg = rd->logits.data();
      rows_d = nll_rows(lg, ids.data() + 1, L - 1, V);
      nll_d = mean_of(rows_d, 0, rows_d.size());
      nll_tail_d = mean_of(rows_d, static_cast<size_t>(L - K), rows_d.size());
      dense_tail.assign(lg + size_t(L - K) * size_t(V), lg + size_t(L) * size_t(V));
      if (!sp) SF_TRY(dump_nll(rows_d));
    }
    RecallStats rs;
    model::PrefillOptions os = o;
    os.sparse = sp;
    if (s.do_recall && sp) os.on_attention = recall_observer(&rs, s.recall_last, s.recall_random, s.seed);
    if (sp) {
      auto rsp = model::prefill(m, ids, os);
      if (!rsp.is_ok()) return rsp.status();
      if (!rs.error.is_ok()) return rs.error;
      rec.density = rsp->density;
      if (s.do_logits) {
        const float* lg = rsp->logits.data();
        const std::vector<double> rows_s = nll_rows(lg, ids.data() + 1, L - 1, V);
        const double nll_s = mean_of(rows_s, 0, rows_s.size());
        const double nll_tail_s = mean_of(rows_s, static_cast<size_t>(L - K), rows_s.size());
        SF_TRY(dump_nll(rows_s));
        // Where the loss goes: the ratio per quarter of the positions.
        for (size_t qi = 0; qi < 4; ++qi) {
          const size_t b = rows_s.size() * qi / 4, e = rows_s.size() * (qi + 1) / 4;
          rec.ppl_ratio_by_quarter.push_back(std::exp(mean_of(rows_s, b, e) - mean_of(rows_d, b, e)));
        }
        rec.ppl_dense = std::exp(nll_d);
        rec.ppl_sparse = std::exp(nll_s);
        rec.ppl_ratio = rec.ppl_sparse / rec.ppl_dense;
        rec.ppl_tail_dense = std::exp(nll_tail_d);
        rec.ppl_tail_sparse = std::exp(nll_tail_s);
        rec.ppl_tail_ratio = rec.ppl_tail_sparse / rec.ppl_tail_dense;
        const float* st = lg + size_t(L - K) * size_t(V);
        const std::vector<double> kl = kl_rows(dense_tail.data(), st, K, V);
        for (double x : kl) {
          rec.kl_mean += x / double(K);
          rec.kl_max = std::max(rec.kl_max, x);
        }
        rec.output_rel_error = rel_l2(st, dense_tail.data(), K * V);
        int64_t agree = 0;
        for (int64_t r = 0; r < K; ++r) {
          const float* a = st + r * V;
          const float* b = dense_tail.data() + r * V;
          agree += (std::max_element(a, a + V) - a) == (std::max_element(b, b + V) - b);
        }
        rec.top1_agreement = double(agree) / double(K);
      }
    } else if (s.do_logits) {
      rec.ppl_dense = rec.ppl_sparse = std::exp(nll_d);
      rec.ppl_tail_dense = rec.ppl_tail_sparse = std::exp(nll_tail_d);
    }
    const int n_layers = m.config().n_layers;
    if (sp && s.do_recall) {
      rec.recall_per_layer = rs.per_layer;
      rec.density_per_layer = rs.density_per_layer;
      rec.attention_recall = rs.mean();
      for (const auto& l : rs.per_head)
        for (double x : l) rec.min_head_recall = std::min(rec.min_head_recall, x);
      rec.attention_recall_held_out = rs.mean_held_out();
      rec.attention_recall_last_block = rs.mean_last();
      for (const auto& l : rs.per_head_held_out)
        for (double x : l) rec.min_head_recall_held_out = std::min(rec.min_head_recall_held_out, x);
    } else {
      rec.recall_per_layer.assign(size_t(n_layers), 1.0);
      rec.density_per_layer.assign(size_t(n_layers), 1.0);
    }
  }

  // 2) Timing, side by side: alternate dense and sparse, best of reps each.
  if (s.do_timing) {
    model::PrefillOptions o;
    o.keep_kv = false;
    double best_d = 1e300, best_s = 1e300;
    for (int r = 0; r < std::max(1, s.timing_reps); ++r) {
      auto rd = model::prefill(m, ids, o);
      if (!rd.is_ok()) return rd.status();
      if (rd->seconds < best_d) {
        best_d = rd->seconds;
        rec.dense_attention_s = rd->attention_s;
      }
      if (!sp) continue;
      model::PrefillOptions os = o;
      os.sparse = sp;
      auto rsp = model::prefill(m, ids, os);
      if (!rsp.is_ok()) return rsp.status();
      if (rsp->seconds < best_s) {
        best_s = rsp->seconds;
        rec.estimate_s = rsp->estimate_s;
        rec.attention_s = rsp->attention_s;
        rec.density = rsp->density;
      }
    }
    rec.dense_prefill_s = best_d;
    if (!sp) {
      best_s = best_d;
      rec.attention_s = rec.dense_attention_s;
    }
    rec.prefill_s = best_s;
    rec.speedup = best_d / best_s;
  }

  // 3) Passkey: dense first (the format gets easier until dense reaches the bar), then sparse on
  //    the very same prompts.
  if (s.do_passkey) {
    int level = std::clamp(s.passkey_level, 0, kPasskeyLevels - 1);
    std::vector<PasskeyPrompt> prompts;
    std::vector<PasskeyAnswer> dense_ans;
    for (;;) {
      prompts.clear();
      dense_ans.clear();
      for (int t = 0; t < s.passkey_trials; ++t) {
        auto ps = passkey_prompts(tok, L, level, s.passkey_depths, t, s.seed);
        if (!ps.is_ok()) return ps.status();
        prompts.insert(prompts.end(), ps->begin(), ps->end());
      }
      int hits = 0;
      for (const auto& p : prompts) {
        auto a = passkey_answer(m, tok, p, nullptr, s.passkey_new_tokens);
        if (!a.is_ok()) return a.status();
        hits += a->found;
        dense_ans.push_back(std::move(a).value());
      }
      const double acc = double(hits) / double(prompts.size());
      rec.passkey_ladder.push_back({level, acc});
      if (acc >= s.passkey_dense_bar || level + 1 >= kPasskeyLevels) {
        rec.dense_passkey_accuracy = acc;
        rec.passkey_bar_met = acc >= s.passkey_dense_bar;
        break;
      }
      ++level;
    }
    rec.passkey_level = level;
    rec.passkey_format = passkey_format_description(level);
    rec.passkey_depths.resize(size_t(s.passkey_depths));
    rec.passkey_dense_hits.assign(size_t(s.passkey_depths), 0);
    rec.passkey_sparse_hits.assign(size_t(s.passkey_depths), 0);
    for (int d = 0; d < s.passkey_depths; ++d) rec.passkey_depths[size_t(d)] = prompts[size_t(d)].depth;
    int hits = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      rec.passkey_prompt_tokens = std::max<int64_t>(rec.passkey_prompt_tokens, int64_t(prompts[i].ids.size()));
      if (sp && int64_t(prompts[i].ids.size()) < sp->dense_below) ++rec.passkey_prompts_below_dense_below;
      PasskeyAnswer a = dense_ans[i];
      if (sp) {
        auto r = passkey_answer(m, tok, prompts[i], sp, s.passkey_new_tokens);
        if (!r.is_ok()) return r.status();
        a = std::move(r).value();
      }
      const size_t d = i % size_t(s.passkey_depths);
      rec.passkey_dense_hits[d] += dense_ans[i].found;
      rec.passkey_sparse_hits[d] += a.found;
      hits += a.found;
      rec.passkey_dense_hit_sparse_miss += dense_ans[i].found && !a.found;
      rec.passkey_sparse_hit_dense_miss += a.found && !dense_ans[i].found;
      if ((!a.found || !dense_ans[i].found) && rec.passkey_failures.size() < 20)
        rec.passkey_failures.push_back("depth " + std::to_string(prompts[i].depth).substr(0, 4) + " key " +
                                       prompts[i].key + ": dense '" + dense_ans[i].text + "' sparse '" + a.text + "'");
    }
    rec.passkey_accuracy = double(hits) / double(prompts.size());
  }
  return rec;
}

}  // namespace sf::eval
