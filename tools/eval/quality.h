// Quality measures of sparse prefill against dense on the real model (DESIGN.md "Measuring"):
// attention recall of an index, next-token KL, perplexity, output relative error, passkey
// retrieval, and side-by-side timing. Used by `sparsefill eval`, `sparsefill search` and the
// `quality` tests. Library code: Status/Result, no exits, no printing.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/sparse_index.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"
#include "worker/model/tokenizer.h"

namespace sf::eval {

// ---- attention recall ------------------------------------------------------------------------

// Query rows to measure: the last n_last rows plus n_random distinct others drawn uniformly
// (deterministic for a seed), sorted ascending.
std::vector<int64_t> sample_rows(int64_t n_q, int n_last, int n_random, uint64_t seed);

// Dense softmax probabilities of a few query rows for every query head, kept as prefix sums over
// keys so the mass of any key range is O(1). q [n_q, n_heads, d] (row 0 at global key position
// q_offset), k [n_k, n_kv_heads, d]; scale 0 means 1/sqrt(d). Causal: row r sees keys
// [0, q_offset + r].
class DenseRowMass {
 public:
  Status compute(const TensorView& q, const TensorView& k, int64_t q_offset, std::vector<int64_t> rows,
                 float scale = 0.f);
  int n_heads() const { return n_heads_; }
  const std::vector<int64_t>& rows() const { return rows_; }
  // Dense mass of keys [a, b) for head h and sampled row i, clipped to the row's causal limit.
  double mass(int h, size_t i, int64_t a, int64_t b) const;
  // Attention recall of idx for head h: mean over the sampled rows of the dense probability mass
  // on the keys idx selects for that row (its query block's key blocks and columns, each clipped
  // to the row's own causal limit).
  double recall(const kernels::SparseIndex& idx, int h) const;
  // Mean over the sampled rows of log(recall of the row), each row's recall floored at 1e-6.
  // -log(recall) is exactly KL(sparse || dense) of the row's attention distribution (the sparse
  // one is the dense one renormalized over the selected keys), so a rare row that loses its one
  // attended key (a copy head's earlier occurrence) costs far more than its share of the mean.
  double log_recall(const kernels::SparseIndex& idx, int h) const;

 private:
  double row_recall(const kernels::SparseIndex& idx, int h, size_t i) const;
  int n_heads_ = 0;
  int64_t n_k_ = 0, q_offset_ = 0;
  std::vector<int64_t> rows_;
  std::vector<double> prefix_;  // [n_heads][rows][n_k + 1]
};

// Fraction of head h's causal query-key pairs that idx computes (SparseIndex::pairs, i.e. the
// kernel's own count after per-row causal clipping).
double head_density(const kernels::SparseIndex& idx, int h);

// Per-layer recall collected by an attention observer during a (sparse) prefill: the index of
// each layer is scored against dense attention of that same layer's q and k. Layers that ran
// dense (idx null) score 1.
// The sampled rows are the last n_last rows (the last query block at 64: the rows the
// vertical-slash and adaptive estimators score themselves, so a measure of the index on the rows
// it was fitted to) and n_random others before them (held out from that fit, except where one
// happens to be an estimator's spread row): each set is also kept on its own.
struct RecallStats {
  std::vector<double> per_layer;                // mean over heads and every sampled row
  std::vector<std::vector<double>> per_head;    // [layer][head]
  std::vector<double> per_layer_held_out;       // the random rows only
  std::vector<std::vector<double>> per_head_held_out;
  std::vector<double> per_layer_last;           // the last n_last rows only
  std::vector<double> density_per_layer;        // idx density (1 for dense layers)
  Status error;                                 // first failure inside the observer
  double mean() const;
  double mean_held_out() const;
  double mean_last() const;
};
model::AttentionObserver recall_observer(RecallStats* out, int n_last, int n_random, uint64_t seed);

// ---- next-token distributions ----------------------------------------------------------------

// Per row KL(P || Q), and its mean over rows; P and Q the softmax of the rows of p_logits and q_logits.
std::vector<double> kl_rows(const float* p_logits, const float* q_logits, int64_t rows, int64_t vocab);
// Mean over rows of KL(P || Q), P and Q the softmax of the rows of p_logits and q_logits.
double kl_mean(const float* p_logits, const float* q_logits, int64_t rows, int64_t vocab);
// Negative log-likelihood of targets[i] under row i of logits, per row.
std::vector<double> nll_rows(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab);
// ||a - b||_2 / ||b||_2 over n values.
double rel_l2(const float* a, const float* b, int64_t n);

// ---- text and tokens -------------------------------------------------------------------------

// The GGUF's own tokenizer (TokenizerCompat::kGguf: SmolLM2's metadata, no BOS).
Result<model::Tokenizer> load_tokenizer(const std::string& model_path);
// A model with its GGUF tokenizer, as eval, search, moa-profile and eval --retention load them:
// the tokenizer first, so a Hugging Face directory fails before minutes of weight loading.
struct EvalModel {
  model::Tokenizer tok;
  model::Model m;
};
Result<EvalModel> load_eval_model(const std::string& model_path);
// doc repeated as often as needed, then truncated to exactly len tokens.
std::vector<int32_t> fit_tokens(std::span<const int32_t> doc, int64_t len);

// ---- passkey retrieval -----------------------------------------------------------------------

// Formats, easiest last. The ladder: start at some level; if dense accuracy is below the bar at
// a length, move one level easier and retry.
constexpr int kPasskeyLevels = 4;
std::string passkey_format_description(int level);

struct PasskeyPrompt {
  std::vector<int32_t> ids;
  std::string key;    // five digits
  double depth = 0;   // fraction of the filler before the key line
};
// n_depths prompts of at most `length` tokens (depths 0, 1/n, ..., (n-1)/n), keys drawn from
// (seed, length, trial, depth index).
Result<std::vector<PasskeyPrompt>> passkey_prompts(const model::Tokenizer& tok, int64_t length, int level,
                                                   int n_depths, int trial, uint64_t seed);
struct PasskeyAnswer {
  bool found = false;
  std::string text;       // decoded continuation
  double prefill_s = 0;   // prompt prefill time (in the mode under test)
};
// Prefill of the prompt in the given mode (null: dense), then n_new greedy tokens decoded with
// dense attention over that cache. Success: the key's five digits appear in the continuation.
Result<PasskeyAnswer> passkey_answer(const model::Model& m, const model::Tokenizer& tok, const PasskeyPrompt& p,
                                     const model::SparseConfig* sparse, int n_new);

// ---- one evaluation at one length --------------------------------------------------------------

struct EvalSettings {
  int64_t seq_len = 2048;
  int recall_last = 64, recall_random = 64;
  int kl_positions = 256;
  int passkey_trials = 1, passkey_depths = 10, passkey_new_tokens = 10;
  int passkey_level = 0;            // first format level tried
  double passkey_dense_bar = 0.8;   // dense must reach this, else the format gets easier
  uint64_t seed = 0x5eed5eedULL;
  int timing_reps = 1;
  bool do_logits = true, do_timing = true, do_passkey = true, do_recall = true;
  // When set: per-position loss written there as TSV (position, target token, dense nll, sparse
  // nll), to see which tokens a pattern costs (copies of earlier text, at 8K).
  std::string nll_dump_path;
};

struct PasskeyLevelTry {
  int level = 0;
  double dense_accuracy = 0;
};

struct EvalRecord {
  std::string mode;
  int64_t seq_len = 0;
  // density of the sparse prefill (fraction of causal pairs computed), from the forward.
  double density = 1;
  double attention_recall = 1;  // every sampled row (the last 64 and 64 random ones)
  std::vector<double> recall_per_layer, density_per_layer;
  double min_head_recall = 1;
  // The random rows only (held out from the estimators' last-64-row fit), and the last 64 only.
  double attention_recall_held_out = 1, min_head_recall_held_out = 1;
  double attention_recall_last_block = 1;
  // logits
  double ppl_dense = 0, ppl_sparse = 0, ppl_ratio = 1;
  double ppl_tail_dense = 0, ppl_tail_sparse = 0, ppl_tail_ratio = 1;  // last kl_positions only
  std::vector<double> ppl_ratio_by_quarter;  // ppl ratio over each quarter of the positions, in order
  double kl_mean = 0, kl_max = 0;
  double output_rel_error = 0;  // relative L2 of logits over the last kl_positions positions
  double top1_agreement = 1;    // argmax agreement over the same positions
  // timing (side by side, keep_kv off, last-position logits only)
  double prefill_s = 0, dense_prefill_s = 0, speedup = 1;
  double estimate_s = 0, attention_s = 0, dense_attention_s = 0;
  // passkey
  double passkey_accuracy = -1, dense_passkey_accuracy = -1;
  int passkey_level = -1;
  std::string passkey_format;
  std::vector<PasskeyLevelTry> passkey_ladder;
  std::vector<double> passkey_depths;
  std::vector<int> passkey_dense_hits, passkey_sparse_hits;  // per depth, summed over trials
  int64_t passkey_prompt_tokens = 0;
  // Per prompt, not only in total: equal accuracies can hide a swap (a prompt only sparse finds
  // beside one only dense finds).
  int passkey_dense_hit_sparse_miss = 0, passkey_sparse_hit_dense_miss = 0;
  bool passkey_bar_met = false;  // dense reached passkey_dense_bar at passkey_level (else L3 anyway)
  // Prompts shorter than the sparse config's dense_below: they ran dense in the "sparse" run too.
  int passkey_prompts_below_dense_below = 0;
  std::vector<std::string> passkey_failures;  // "depth 0.3 key 12345: dense '...' sparse '...'"
};

// Runs dense and the sparse config side by side on doc (fit to seq_len). sparse == null or all
// dense evaluates dense against itself.
Result<EvalRecord> evaluate(const model::Model& m, const model::Tokenizer& tok, std::span<const int32_t> doc,
                            const model::SparseConfig* sparse, const std::string& mode, const EvalSettings& s);

}  // namespace sf::eval
