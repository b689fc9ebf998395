#include "worker/runtime/grid.h"

#include <algorithm>

#include "kernels/sparse_index.h"

namespace sf::runtime {

std::vector<TokenRange> zigzag_chunks(int64_t n_tokens, int cp) {
  const int64_t n_chunks = 2 * int64_t(std::max(cp, 1));
  const int64_t nb =
      (std::max<int64_t>(n_tokens, 0) + kernels::kSparseBlock - 1) / kernels::kSparseBlock;
  std::vector<TokenRange> out(static_cast<size_t>(n_chunks));
  for (int64_t j = 0; j < n_chunks; ++j) {
    out[size_t(j)].begin = std::min(n_tokens, kernels::kSparseBlock * (j * nb / n_chunks));
    out[size_t(j)].end = std::min(n_tokens, kernels::kSparseBlock * ((j + 1) * nb / n_chunks));
  }
  return out;
}

std::array<TokenRange, 2> cp_rank_ranges(int64_t n_tokens, int cp, int cp_rank) {
  const auto ch = zigzag_chunks(n_tokens, cp);
  return {ch[size_t(cp_rank)], ch[size_t(2 * cp - 1 - cp_rank)]};
}

std::vector<TokenRange> cp_rank_pieces(int64_t n_tokens, int cp, int cp_rank) {
  std::vector<TokenRange> out;
  for (const TokenRange& c : cp_rank_ranges(n_tokens, cp, cp_rank)) {
    if (c.size() == 0) continue;
    if (!out.empty() && out.back().end == c.begin)
      out.back().end = c.end;
    else
      out.push_back(c);
  }
  return out;
}

Status check_world(const GridShape& g, int world_size) {
  if (g.tp <= 0 || g.cp <= 0)
    return SF_ERR(kInvalidArgument, "--tp and --cp must be positive, got tp " +
                                        std::to_string(g.tp) + ", cp " + std::to_string(g.cp));
  if (world_size % g.group_size() != 0)
    return SF_ERR(kInvalidArgument,
                  "world size " + std::to_string(world_size) +
                      " is not a multiple of tp x cp = " + std::to_string(g.tp) + " x " +
                      std::to_string(g.cp) + " = " + std::to_string(g.group_size()) +
                      " (run with -np a multiple of tp*cp; each multiple is one worker group)");
  return Status::ok();
}

Status check_model_divides(const model::ModelConfig& c, int tp) {
  if (tp <= 0) return SF_ERR(kInvalidArgument, "--tp must be positive");
  // Query heads follow their KV head, so dividing the KV heads divides both.
  if (c.n_kv_heads % tp != 0)
    return SF_ERR(kInvalidArgument, "model '" + c.name + "' has " + std::to_string(c.n_kv_heads) +
                                        " KV heads (" + std::to_string(c.n_heads) +
                                        " query heads), which do not divide by --tp " +
                                        std::to_string(tp) + "; use a tp that divides " +
                                        std::to_string(c.n_kv_heads));
  if (c.intermediate % tp != 0)
    return SF_ERR(kInvalidArgument, "model '" + c.name + "' has MLP intermediate size " +
                                        std::to_string(c.intermediate) +
                                        ", which does not divide by --tp " + std::to_string(tp));
  return Status::ok();
}

Result<GridComms> make_grid(comm::Communicator& world, const GridShape& shape) {
  SF_TRY(check_world(shape, world.size()));
  GridComms g;
  g.shape = shape;
  const int gs = shape.group_size();
  g.group = world.rank() / gs;
  const int gr = world.rank() % gs;
  g.tp_rank = gr % shape.tp;
  g.cp_rank = gr / shape.tp;
  SF_ASSIGN(g.group_comm, world.split(g.group, gr, "group " + std::to_string(g.group)));
  // Colors are unique per (group, row/column) so groups never mix.
  SF_ASSIGN(g.tp, world.split(g.group * shape.cp + g.cp_rank, g.tp_rank,
                              "tp (group " + std::to_string(g.group) + ", cp rank " +
                                  std::to_string(g.cp_rank) + ")"));
  SF_ASSIGN(g.cp, world.split(g.group * shape.tp + g.tp_rank, g.cp_rank,
                              "cp (group " + std::to_string(g.group) + ", tp rank " +
                                  std::to_string(g.tp_rank) + ")"));
  return g;
}

}  // namespace sf::runtime
