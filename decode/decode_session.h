// The reference decode node's engine: greedy generation on CPU from a paged KV cache that came
// from an export, with the model of worker/model. One token per step; positions continue from
// the prompt length the export recorded (keys of dropped tokens are gone, positions are not
// renumbered, as in SnapKV).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "decode/decode_attention.h"
#include "decode/kv_client.h"
#include "decode/paged_kv.h"
#include "kvstore/kv_export.h"
#include "worker/model/model.h"

namespace sf::decode {

// The compatibility hash of exports this model can consume (kvstore::compat_hash of its spec).
std::string model_compat_hash(const model::Model& m);

// The greedy loop both sessions share: n_new tokens starting with first_token, each next one the
// argmax of step(previous). on_logits (optional) sees the logits that chose tokens 2..n_new.
Result<std::vector<int32_t>> greedy_decode(
    int32_t first_token, int n_new, const std::function<Status(int32_t, std::vector<float>*)>& step,
    const std::function<void(int, const std::vector<float>&)>& on_logits = {});

// Verified drafts (DecodeAttnParams::verify_draft) with a margin: whether a draft that has just
// hit a near-tie stops for verification. The near-tie's token may be the draft's first wrong
// one. Stopping costs one more pass, which reads every block once; going on risks the drafts
// left, wasted if that token is wrong. So it stops when P(wrong) x drafts_left x draft_share (a
// draft step's share of the blocks) exceeds one pass, P(wrong) being the session's rate of
// near-ties the passes rejected (hits) against accepted (misses), with a prior of 1 in 4.
bool verify_stops_at_tie(int64_t hits, int64_t misses, int drafts_left, double draft_share);

// What verified generation needs of a session (host or device), each appending to its cache:
//   draft: one PSA step of `token` (stats: its blocks, as any step counts them);
//   drop_drafts: take back every draft append since the round began;
//   pass: the round's tokens at once with full attention; logits [n, vocab]; totals[i] token
//         i's blocks over layers and query heads (stats: blocks read, computed and available);
//   keep: take back the pass's appends of tokens past the first `kept`.
struct VerifyOps {
  std::function<Status(int32_t token, std::vector<float>* logits)> draft;
  std::function<Status()> drop_drafts;
  std::function<Status(const std::vector<int32_t>& tokens, std::vector<float>* logits,
                       std::vector<int64_t>* totals)>
      pass;
  std::function<Status(int kept)> keep;
  // Whether the loop adds the kept tokens' KV-head blocks to kv_blocks_total (the device
  // session counts KV-head loads with +gqa only: DecodeAttnStats).
  bool count_kv = true;
};
// The verified loop both sessions share (DecodeAttnParams::verify_draft): rounds of up to
// verify_draft PSA drafts (stopped early at a near-tie by verify_stops_at_tie), each verified by
// one pass; the tokens are the pass's argmaxes. group: query heads per KV head; stats: the
// session's (DecodeAttnStats: the verified fields).
Result<std::vector<int32_t>> verified_decode(
    int32_t first_token, int n_new, const DecodeAttnParams& p, int64_t vocab, int group,
    DecodeAttnStats* stats, const VerifyOps& ops,
    const std::function<void(int, const std::vector<float>&)>& on_logits = {});

class DecodeSession {
 public:
  // The cache must come from an export whose compat hash matched m (load_kv_export checks it).
  DecodeSession(const model::Model& m, PagedKvCache cache, int64_t next_pos, DecodeAttnParams p);

  // Runs `token` at the next position, appends its K/V to every head, returns the logits. A step
  // that fails leaves the cache and position as they were (and so does generate_greedy). With a
  // psa guard margin (DecodeAttnParams::guard_margin), a step whose top two logits are closer
  // than the margin is taken back and run again with full attention. With verify_draft, a step
  // is the draft's PSA alone (no guard, no verification).
  Status step(int32_t token, std::vector<float>* logits);
  // Greedy: returns n_new tokens starting with first_token (the prefill's), like
  // model::generate_greedy. on_logits (optional) sees the logits that chose tokens 2..n_new.
  // With verify_draft, PSA drafts and full-attention passes verify (DecodeAttnParams); the
  // logits are then the verification's.
  Result<std::vector<int32_t>> generate_greedy(
      int32_t first_token, int n_new,
      const std::function<void(int, const std::vector<float>&)>& on_logits = {});
  const DecodeAttnStats& stats() const { return stats_; }
  const PagedKvCache& cache() const { return cache_; }

 private:
  // Runs tokens[0..n) at the next n positions under attention params p and appends their K/V;
  // logits: [n, vocab]. n > 1 needs full attention (decode_attention_causal; a verification
  // pass). undo (optional) receives every cache append, and undo_token the token index of each;
  // totals (optional) each token's blocks over layers and query heads. On failure every append
  // of the call is taken back (undo and undo_token as they were) and the position kept.
  Status run(const int32_t* tokens, int n, const DecodeAttnParams& p, std::vector<float>* logits,
             std::vector<PagedKvCache::AppendUndo>* undo, std::vector<int>* undo_token = nullptr,
             std::vector<int64_t>* totals = nullptr);
  Status run_layers(const int32_t* tokens, int n, const DecodeAttnParams& p,
                    std::vector<float>* logits, std::vector<PagedKvCache::AppendUndo>* undo,
                    std::vector<int>* undo_token, std::vector<int64_t>* totals);
  // generate_greedy with verify_draft.
  Result<std::vector<int32_t>> generate_verified(
      int32_t first_token, int n_new,
      const std::function<void(int, const std::vector<float>&)>& on_logits);
  const model::Model& m_;
  PagedKvCache cache_;
  int64_t pos_;
  DecodeAttnParams p_;
  DecodeAttnStats stats_;
};

// load_kv_export + PagedKvCache for model m, ready to decode.
Result<DecodeSession> open_decode_session(const model::Model& m, const std::string& kv_dir,
                                          DecodeAttnParams p, KvExport* manifest_out = nullptr);

}  // namespace sf::decode
