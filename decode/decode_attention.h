// Decode attention of one new token over a paged cache (DESIGN.md: progressive decode attention).
//   full:     every block of the head, in position order, online softmax.
//   psa(eps): seed 002. Blocks are ranked by an upper bound on q.k from their per-channel key
//             min/max (sum_c max(q_c min_c, q_c max_c)) and visited in descending order. After
//             each block, the unseen mass is estimated as AS_min * N_left (AS_min: the smallest
//             block mass seen so far). The seed calls it a bound, as blocks come in descending
//             criticality, but the ranking is by a bound on a block's best score, not by its
//             mass: a wide min/max box with little mass can rank early, make AS_min small and
//             end the visit short of eps (DecodeAttention.PsaAvgReachesEpsWhereAMisrankedBlock-
//             FoolsAsMin); the visit stops once AS_acc / (AS_acc + AS_min * N_left) >= eps.
//   psa-avg(eps): the same visit, but the unseen blocks are estimated at the mean mass of the last
//             kPsaAvgBlocks ranked blocks, and no stop comes before that many ranked blocks. With
//             min/max bounds over 64 keys the ranking is loose: one low-mass block ranked early
//             makes AS_min tiny and ends the visit far short of eps (bench/results/retention.md
//             measures the mass each rule captures).
//   +gqa (psa+gqa:EPS, psa-avg+gqa:EPS): one visit per KV head instead of one per query head.
//             Each query head of the group keeps its own ranking and stop rule, the heads take
//             turns naming the next block (the best one of their own order not yet loaded), and
//             every head folds every loaded block: a block is read once for the group, and a head
//             whose rule has stopped still takes the mass of blocks its group-mates asked for.
//             The visit ends when every head's rule has stopped. Blocks visited are then the
//             blocks loaded for the KV head, the same count for each of its query heads.
#pragma once
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "decode/paged_kv.h"

namespace sf::decode {

enum class DecodeAttnMode { kFull, kPsa };
enum class PsaRemainder { kAsMin, kRecentMean };
inline constexpr int kPsaAvgBlocks = 4;

struct DecodeAttnParams {
  DecodeAttnMode mode = DecodeAttnMode::kFull;
  double eps = 0.95;  // psa: accumulated attention mass at which the visit stops
  float scale = 0.f;  // 0: 1/sqrt(head_dim)
  // psa: visit the first block (attention sink) and the newest block before the ranked ones,
  // as every sparse pattern here keeps the sink and the local window. "psa-strict:EPS" clears it.
  bool pin_sink_recent = true;
  PsaRemainder remainder = PsaRemainder::kAsMin;  // "psa-avg:EPS" sets kRecentMean
  bool share_kv_head = false;                      // "+gqa": one visit per KV head (above)
  // psa: also score every block to measure the share of the true softmax mass the visit captured
  // (stats mass_*). A diagnostic for evaluation; it costs a full pass over the keys.
  bool measure_mass = false;
  // psa, decode sessions on the host ("psa-avg:EPS:MARGIN"): a step whose top two logits are
  // closer than this many nats is run again with full attention (its cache appends undone), so
  // the token a near-tie decides is the full cache's. 0: off. The re-run's blocks count as
  // visited (DecodeAttnStats::guard_steps counts the re-runs). With verify_draft, the margin
  // instead marks the draft's near-ties, where a draft may stop early for verification
  // (decode_session.h: verify_stops_at_tie).
  double guard_margin = 0;
  // psa, decode sessions on the host ("psa-avg:EPS:verifyN"): self-speculative decoding. PSA
  // drafts up to N greedy tokens, then one full-attention pass over the draft (each block read
  // once for all its tokens, decode_attention_causal) keeps the draft up to its first token the
  // full cache would not choose, puts the full cache's token there, and leaves the cache with
  // the pass's K/V. The tokens equal full decode's up to the batched pass's float rounding.
  // 0: off. Single steps (DecodeSession::step) run the draft's PSA alone.
  int verify_draft = 0;
};

inline constexpr int kMaxVerifyDraft = 256;

// Blocks visited and available, summed over query heads (and layers, when accumulated).
struct DecodeAttnStats {
  int64_t blocks_visited = 0, blocks_total = 0;
  // Distinct blocks any query head of a KV head visited, summed over KV heads (and layers), and
  // the blocks available to them: what a kernel reading each block once for its KV head's query
  // heads would load. With +gqa it is blocks_visited / (query heads per KV head). The device
  // session, whose kernel reports counts and not blocks, fills them with +gqa only (else 0).
  int64_t kv_blocks_loaded = 0, kv_blocks_total = 0;
  // The last call's blocks visited per query head (a device kernel's check).
  std::vector<int32_t> last_visited_by_head;
  // With measure_mass: over (head, step) visits, the sum of captured mass shares, their count,
  // how many fell short of eps (by more than 1e-6, float rounding), and the smallest share.
  double mass_sum = 0, mass_min = 1;
  int64_t mass_n = 0, mass_below_eps = 0;
  // Decode sessions: steps run, and steps run again in full by the guard (guard_margin).
  int64_t steps = 0, guard_steps = 0;
  // Verified generation (verify_draft): draft steps run (rejected ones included) and accepted,
  // verification passes and the tokens they ran. There, blocks_visited counts the drafts' visits
  // plus each pass's blocks once per query head (a block is read once for all the pass's
  // tokens), blocks_total the blocks full decode would visit for the tokens kept (as for any
  // session: every step's blocks per query head), and blocks_computed the drafts' visits plus
  // each pass's blocks per token (the attention's arithmetic, not its reads).
  int64_t draft_steps = 0, draft_accepted = 0, verify_passes = 0, verify_tokens = 0;
  int64_t blocks_computed = 0;
  // decode_attention_causal: the last call's blocks each token reads, summed over query heads.
  std::vector<int64_t> last_total_by_token;
};

// q: [n_heads, head_dim] of one token (already rotated); out: [n_heads, head_dim]. Query head h
// reads KV head h / (n_heads / n_kv_heads) of `layer`.
Status decode_attention(const PagedKvCache& cache, int layer, const float* q, int n_heads,
                        const DecodeAttnParams& p, float* out, DecodeAttnStats* stats);

// Full attention of n new tokens whose K/V `cache` already holds (appended in position order):
// token i reads the keys of position <= pos[i]. q and out: [n, n_heads, head_dim]. Each query
// head reads each block once for all n tokens; token i's output equals a single-token full
// decode_attention over the cache as it stood after token i's append, bit for bit. stats: the
// blocks read (blocks_visited, kv_blocks_loaded), blocks_total and blocks_computed as for n
// single-token calls.
Status decode_attention_causal(const PagedKvCache& cache, int layer, const float* q, int n,
                               const int32_t* pos, int n_heads, float scale, float* out,
                               DecodeAttnStats* stats);

// Upper bound on q.k over the block's keys from their per-channel min/max (unscaled).
float block_score_bound(const float* q, const KvBlock& b, int head_dim);

// "full", or "psa", "psa-avg" or "psa-strict", optionally followed by "+gqa", then ":EPS" (EPS in
// (0, 1]) and optionally ":MARGIN" (the guard, nats > 0) and ":verifyN" (verified drafts of up
// to N tokens), in either order: "psa-avg+gqa:0.95", "psa-avg:0.95:0.2", "psa-avg:0.95:verify16".
Result<DecodeAttnParams> decode_attn_parse(const std::string& spec);

}  // namespace sf::decode
