// The TP x CP grid of one worker group, and how a job of N ranks is cut into groups.
//
// Layout: group rank g = cp_rank * tp + tp_rank (TP ranks adjacent: on one host they share the
// fast link). World rank w belongs to group w / (tp * cp). Within a group, "tp" communicators
// join the ranks of one CP rank, "cp" communicators the ranks of one TP slice.
//
// CP: the prompt is cut into 2*cp chunks on 64-token block boundaries (so a sparse index's query
// blocks never straddle ranks); CP rank i holds chunks i and 2*cp-1-i, which balances causal work.
// TP: KV heads are split into tp contiguous slices and the query heads of each KV head follow
// it (GQA groups never split); MLP intermediate columns are split likewise.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/status.h"
#include "worker/model/config.h"

namespace sf::runtime {

struct GridShape {
  int tp = 1, cp = 1;
  int group_size() const { return tp * cp; }
};

// A token range [begin, end) of the prompt.
struct TokenRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

// The 2*cp zigzag chunks of an n_tokens prompt, in prompt order (64-token aligned boundaries,
// balanced to within one block; chunks may be empty when the prompt has fewer than 2*cp blocks).
std::vector<TokenRange> zigzag_chunks(int64_t n_tokens, int cp);
// The two chunks CP rank cp_rank holds: {chunk cp_rank, chunk 2*cp-1-cp_rank}.
std::array<TokenRange, 2> cp_rank_ranges(int64_t n_tokens, int cp, int cp_rank);
// The same rows as attention pieces: the two chunks merged when adjacent (CP 1, the middle CP
// rank), empty ones dropped; in prompt order, which is also the order of the rank's local rows.
std::vector<TokenRange> cp_rank_pieces(int64_t n_tokens, int cp, int cp_rank);

// tp and cp positive; the world divides into groups of tp*cp. One message naming all three.
Status check_world(const GridShape& g, int world_size);
// The model splits by tp: KV heads (and so query heads) and the MLP intermediate size.
Status check_model_divides(const model::ModelConfig& c, int tp);

// One rank's communicators: its whole group, its TP row and its CP column.
struct GridComms {
  GridShape shape;
  int group = 0;  // which group of the job this rank is in
  int tp_rank = 0, cp_rank = 0;
  std::unique_ptr<comm::Communicator> group_comm, tp, cp;
  bool leader() const { return tp_rank == 0 && cp_rank == 0; }
};

// Splits `world` into groups of shape.group_size() and each group into its TP and CP
// communicators. Collective over world; check_world must have passed.
Result<GridComms> make_grid(comm::Communicator& world, const GridShape& shape);

}  // namespace sf::runtime
