// Retention policies (DESIGN.md "KV store and tiering"): which prompt positions each layer and KV
// head keeps for decode. Applied per request before export. Scored policies use the SnapKV
// importance computed during prefill (kernels/kv_importance.h, PrefillResult::importance).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace sf::kvstore {

// Per layer [n_kv_heads, n_tokens] scores, and how they were computed.
struct ImportanceScores {
  int n_layers = 0, n_kv_heads = 0;
  int64_t n_tokens = 0;
  int window = 0;  // observation window (last queries)
  int pool = 1;    // max-pool kernel already applied over keys
  std::vector<std::vector<float>> layers;
  // How they were computed (the manifest's importance.method).
  std::string method =
      "snapkv column sums of the observation window's softmax, from the attention LSE";
};

enum class RetentionKind { kFull, kStreaming, kSnapKV, kPyramid, kMoA, kLayerwise, kAdaKV };

struct MoaSpan {
  double alpha = 0, beta = 0;  // span(N) = alpha + beta * N recent tokens (seed 003)
};

// Every policy always keeps the most recent `window` tokens (the observation window in SnapKV
// terms); `sink` leading tokens are kept where the policy names them.
struct RetentionPolicy {
  RetentionKind kind = RetentionKind::kFull;
  int64_t sink = 4;       // streaming: leading tokens always kept (attention sinks)
  int64_t window = 32;    // streaming, snapkv, pyramid, layerwise: recent tokens always kept
  int64_t budget = 0;     // snapkv: tokens per layer and KV head; pyramid: average over layers
  int pool = 7;           // snapkv, adakv: the max-pool kernel the scores must carry
  // snapkv, adakv, pyramid: a position also takes the best score of the span - 1 positions
  // before it, so a scored token is kept with the tokens that follow it. Decoding that copies a
  // span (a number, a name) reads it forward one token a step, and the observation window only
  // attended to its start: SnapKV's symmetric pool keeps 3 tokens past it. 1: plain SnapKV.
  int span = 1;
  double floor = 0.2;     // adakv: share of a head's scored budget it keeps whatever the others
  double beta = 20;       // pyramid: bottom-to-top ratio of the scored part (PyramidKV's beta)
  int n_full = 0;         // layerwise: the first n_full layers keep every token
  int64_t topk = 0;       // layerwise: top-scored tokens kept besides the window
  int64_t moa_sink = 64;  // moa: leading tokens every head keeps
  std::vector<std::vector<MoaSpan>> moa;  // moa: [n_layers][n_kv_heads]
  std::string moa_config;                 // moa: the file the spans came from (provenance)
  double moa_scale = 1;  // moa: factor already applied to the file's spans (retention_moa_scaled)
  // snapkv, adakv, pyramid: > 0 splits the kept tokens into two tiers for a two-encoding export
  // (kv_quant.h KvEncodings): the tokens the same policy keeps at budget `high` are the high tier,
  // the rest of what it keeps at `budget` the low tier (Retention::low). A high-budget pick the
  // full budget drops is kept too (the budgets' picks nest except at score ties across heads).
  int64_t high = 0;
};

struct Retention {
  std::string policy;  // "full", "streaming", "snapkv", "pyramid", "moa", "layerwise", "adakv"
  std::string params;  // canonical "key=value,..." of the policy's parameters
  int n_layers = 0, n_kv_heads = 0;
  int64_t n_tokens = 0;
  std::vector<std::vector<int32_t>> kept;  // [layer * n_kv_heads + head]: ascending positions
  // Empty, or per [layer * n_kv_heads + head] the kept positions of the low tier (ascending, a
  // subset of kept): stored in the export's low encoding, the others in its high one.
  std::vector<std::vector<int32_t>> low;

  const std::vector<int32_t>& positions(int layer, int head) const {
    return kept[size_t(layer) * size_t(n_kv_heads) + size_t(head)];
  }
  bool has_low() const { return !low.empty(); }
  // A head's high-tier positions: kept minus low.
  std::vector<int32_t> high_positions(int layer, int head) const;
  int64_t kept_total() const;
  bool is_full() const;  // every layer and head keeps every position
};

const char* retention_kind_name(RetentionKind k);
// The policies that take RetentionPolicy::span (snapkv, adakv, pyramid), and its largest value.
bool retention_uses_span(RetentionKind k);
constexpr int kRetentionMaxSpan = 256;
// snapkv and adakv's max-pool kernel over keys: odd, at most this (the CUDA importance kernel's
// halo: kernels/kv_importance.h).
constexpr int kRetentionMaxPool = 65;
// Whether a policy selects with importance scores (snapkv, adakv, pyramid; layerwise with topk).
bool retention_needs_scores(const RetentionPolicy& p);
// "full" | "streaming[:sink=S,window=W]" | "snapkv:budget=B[,window=W,pool=P,span=N]" |
// "adakv:budget=B[,window=W,pool=P,floor=F,span=N]" | "pyramid:budget=B[,window=W,span=N]" |
// (snapkv, adakv and pyramid also take high=H: RetentionPolicy::high) |
// "layerwise:n_full=F,window=W,topk=K" |
// "moa:config=FILE[,sink=S]" (reads FILE with moa_config_load; sink overrides the file's).
// Unknown policies and keys are errors naming them.
Result<RetentionPolicy> retention_parse(const std::string& spec);
// span appears only when it is not 1, so specs written before it existed stay canonical.
std::string retention_params(const RetentionPolicy& p);

// A moa retention config (docs/api.md): {"format": "sparsefill-moa-retention", "model": NAME,
// "n_layers": L, "n_kv_heads": H, "sink": S, "layers": [[{"alpha": A, "beta": B} x H] x L]}.
// "format" and "model" are optional, "sink" defaults to 64. Every field is checked; errors name
// the layer, head and field. The layer and head counts are checked against the model by
// retention_check_geometry (or retention_apply).
Result<RetentionPolicy> moa_config_parse(const std::string& json_text, const std::string& origin);
Result<RetentionPolicy> moa_config_load(const std::string& path);

// What retention_apply checks before it looks at the prompt: for moa, span counts equal to the
// cache's layers and KV heads, alpha >= 0, beta in [0, 1], sink >= 0. Other policies: ok. Lets a
// CLI fail before a long prefill.
Status retention_check_geometry(const RetentionPolicy& p, int n_layers, int n_kv_heads);

// What retention_apply checks of the policy against an n_tokens prompt before it looks at any
// score: budgets, windows, sinks and spans in range, moa geometry (retention_apply runs it first).
// Lets a worker refuse a request before its prefill.
Status retention_check_prompt(const RetentionPolicy& p, int n_layers, int n_kv_heads,
                              int64_t n_tokens);

// The kept positions of every layer and KV head. Budgets out of range (negative, larger than the
// prompt, smaller than the always-kept window) and scores of the wrong geometry are errors.
// scores may be null for policies that need none (full, streaming, moa, layerwise with topk 0).
Result<Retention> retention_apply(const RetentionPolicy& p, int n_layers, int n_kv_heads,
                                  int64_t n_tokens, const ImportanceScores* scores);

// PyramidKV's per-layer budgets (scored part + window): linear from the bottom layer down to the
// top layer, whose scored part is 1/beta of the average; the total equals n_layers x budget.
Result<std::vector<int64_t>> pyramid_layer_budgets(int64_t budget, int64_t window, double beta,
                                                   int n_layers, int64_t n_tokens);

// A policy of the given kind whose kept tokens are `fraction` (0, 1] of the full cache, with the
// defaults the evaluation uses (streaming sink 4; snapkv/adakv/pyramid window `window`, pool 7;
// layerwise n_full = fraction x n_layers / 2, window `window`). `window` is the kept recent
// window; the evaluation gives its observation window, as SnapKV keeps that window. (A policy
// whose window is shorter than the scores' observation window ranks the keys between by column
// sums that include their own rows: allowed, but not SnapKV.)
Result<RetentionPolicy> retention_for_fraction(RetentionKind kind, double fraction, int n_layers,
                                               int64_t n_tokens, int64_t window = 32);

// moa at a budget: every span scaled by one factor s (alpha * s, min(1, beta * s); a beta that
// reaches 1 keeps the whole prompt either way), s the largest whose kept tokens on an n_tokens
// prompt are at most `fraction` of the full cache (bisection over the kept count, which grows
// with s). The sink is not scaled: a fraction below sink + 1 token per head is an error. The
// result carries s in moa_scale (times the base's).
Result<RetentionPolicy> retention_moa_scaled(const RetentionPolicy& base, double fraction,
                                             int n_layers, int n_kv_heads, int64_t n_tokens);

}  // namespace sf::kvstore
