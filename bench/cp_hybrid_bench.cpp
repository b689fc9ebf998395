// What sparsity-aware CP could move if a rank could also send a query block to the rank that
// holds its keys, instead of only pulling keys (issue 5's 25% target; docs/distributed.md,
// "Sparsity-aware CP: the 25% target is missed", which names this as the next thing to try).
//
// A counting study, not a runtime: one single-rank sparse prefill of a real prompt records each
// layer's index (the same index CP computes with --cp-estimate), then for every zigzag rank r,
// KV head g and remote rank s it prices two exchanges, in f32 elements:
//   pull (what the runtime does): every (token, KV head) row of s that any slot of r reads,
//     K and V: 2 * head_dim a row;
//   hybrid: as pull, except that a (query head, query block) slot may instead send its rows' q to
//     s and get back their partial output and log-sum-exp (rows * (2 * head_dim + 1), plus the
//     slot's entries on s as one element each), so s computes those pairs and r merges them. A
//     greedy pass pushes a slot when the rows only it reads on s cost more than pushing it, and
//     repeats until no slot moves.
// Both against the per-layer all-gather ((n_tokens - rows held) * 2 * head_dim per KV head).
// The estimator's own exchange (2-3 points at 16K) is not in either.
//
//   sf_bench_cp_hybrid --model M.gguf --text FILE[,FILE...] --chars N --config CFG.json
//                      [--cp 2,4] [--out FILE.json] [--skip-pattern P] [--parts blocks|columns]
//                      [--share-group P]
// --skip-pattern leaves the heads of one pattern out of the count and --parts counts only the
// index's blocks or only its columns: where the moved rows come from (the prefill is unchanged).
// --share-group P is a what-if: the heads of pattern P in a KV group are counted as reading the
// slots of the group's first such head, as if that pattern picked once per KV group (the
// attention is unchanged; what a shared pick would cost in quality is not measured here).
#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/timing.h"
#include "kernels/sparse.h"
#include "kernels/sparse_index.h"
#include "tools/eval/quality.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"
#include "worker/runtime/grid.h"

namespace {
using namespace sf;

std::string arg(int argc, char** argv, const std::string& name, const std::string& def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == "--" + name) return argv[i + 1];
  return def;
}

int die(const Status& s) {
  std::fprintf(stderr, "error: %s\n", s.message().c_str());
  return 1;
}

struct CountOptions {
  bool blocks = true, columns = true;
  std::vector<char> skip_head;  // per query head of the layer: left out of the count
  std::vector<int> slot_head;   // per query head: whose slots it is counted as reading
};

struct Totals {
  double allgather = 0, pull = 0, hybrid = 0;
  int64_t slots = 0, pushed = 0;
};

// One layer's index, one CP size: adds every (rank, KV head, remote rank)'s costs to t.
void count_layer(const kernels::SparseIndex& idx, int n_kv, int d, int cp, const CountOptions& co,
                 Totals* t) {
  constexpr int64_t B = kernels::kSparseBlock;
  const int64_t n = idx.n_k;
  const int qpk = idx.n_heads / n_kv;
  // owner[key]: the CP rank holding it.
  std::vector<int> owner(size_t(n), 0);
  for (int r = 0; r < cp; ++r)
    for (const runtime::TokenRange& p : runtime::cp_rank_ranges(n, cp, r))
      for (int64_t k = p.begin; k < p.end; ++k) owner[size_t(k)] = r;
  const double row_cost = 2.0 * d;
  for (int r = 0; r < cp; ++r) {
    int64_t held = 0;
    std::vector<std::pair<int64_t, int64_t>> qrows;  // (query block, rows of it this rank holds)
    for (const runtime::TokenRange& p : runtime::cp_rank_pieces(n, cp, r)) {
      held += p.size();
      for (int64_t qb = p.begin / B; qb * B < p.end; ++qb)
        qrows.push_back({qb, std::min(p.end, (qb + 1) * B) - std::max(p.begin, qb * B)});
    }
    for (int g = 0; g < n_kv; ++g) {
      t->allgather += double(n - held) * row_cost;
      // Per remote rank s: each slot's remote keys on s, and how many slots read each key.
      for (int s = 0; s < cp; ++s) {
        if (s == r) continue;
        std::vector<std::vector<int32_t>> keys;  // per slot (h, qb): its keys on s
        std::vector<int64_t> slot_rows;
        std::vector<int32_t> count(size_t(n), 0);
        for (int hh = 0; hh < qpk; ++hh) {
          const int h = g * qpk + hh;
          if (!co.skip_head.empty() && co.skip_head[size_t(h)]) continue;
          for (const auto& [qb, rows] : qrows) {
            const size_t sl = idx.slot(co.slot_head.empty() ? h : co.slot_head[size_t(h)], qb);
            const int64_t causal_end = std::min(n, (qb + 1) * B + idx.q_offset);
            std::vector<int32_t> ks;
            for (int32_t i = 0; co.blocks && i < idx.block_count[sl]; ++i) {
              const int64_t b0 = int64_t(idx.block_offset[sl * size_t(idx.max_blocks) + size_t(i)]);
              for (int64_t k = b0; k < std::min(b0 + B, causal_end); ++k)
                if (owner[size_t(k)] == s) ks.push_back(int32_t(k));
            }
            for (int32_t i = 0; co.columns && i < idx.column_count[sl]; ++i) {
              const int32_t k = idx.column_index[sl * size_t(idx.max_cols) + size_t(i)];
              if (owner[size_t(k)] == s) ks.push_back(k);
            }
            std::sort(ks.begin(), ks.end());
            ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
            for (int32_t k : ks) ++count[size_t(k)];
            if (!ks.empty()) {
              keys.push_back(std::move(ks));
              slot_rows.push_back(rows);
            }
          }
        }
        int64_t pulled = 0;
        for (int32_t c : count) pulled += c > 0;
        t->pull += double(pulled) * row_cost;
        t->slots += int64_t(keys.size());
        // Greedy: push a slot while the keys only it still reads cost more than pushing it.
        std::vector<char> pushed(keys.size(), 0);
        double push_cost = 0;
        for (bool moved = true; moved;) {
          moved = false;
          for (size_t i = 0; i < keys.size(); ++i) {
            if (pushed[i]) continue;
            int64_t own = 0;
            for (int32_t k : keys[i]) own += count[size_t(k)] == 1;
            const double cost = double(slot_rows[i]) * (2.0 * d + 1) + double(keys[i].size());
            if (double(own) * row_cost > cost) {
              pushed[i] = 1;
              moved = true;
              push_cost += cost;
              for (int32_t k : keys[i]) --count[size_t(k)];
            }
          }
        }
        int64_t still = 0;
        for (int32_t c : count) still += c > 0;
        t->hybrid += double(still) * row_cost + push_cost;
        t->pushed += std::count(pushed.begin(), pushed.end(), 1);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string model_path = arg(argc, argv, "model", "");
  const std::string texts = arg(argc, argv, "text", "");
  const std::string cfg_path = arg(argc, argv, "config", "");
  const int64_t chars = std::atoll(arg(argc, argv, "chars", "72000").c_str());
  const std::string out_path = arg(argc, argv, "out", "");
  if (model_path.empty() || texts.empty() || cfg_path.empty())
    return die(SF_ERR(kInvalidArgument,
                      "usage: sf_bench_cp_hybrid --model M.gguf --text FILE[,FILE...] --chars N "
                      "--config CFG.json [--cp 2,4] [--out FILE.json] [--skip-pattern P] "
                      "[--parts blocks|columns] [--share-group P]"));
  CountOptions co;
  const std::string parts = arg(argc, argv, "parts", "all");
  if (parts != "all" && parts != "blocks" && parts != "columns")
    return die(SF_ERR(kInvalidArgument, "--parts: all, blocks or columns, got '" + parts + "'"));
  co.blocks = parts != "columns";
  co.columns = parts != "blocks";
  const std::string skip = arg(argc, argv, "skip-pattern", "");
  const std::string share = arg(argc, argv, "share-group", "");
  if (!share.empty() && !kernels::pattern_from_string(share).is_ok())
    return die(kernels::pattern_from_string(share).status());
  if (!skip.empty() && !kernels::pattern_from_string(skip).is_ok())
    return die(kernels::pattern_from_string(skip).status());
  std::vector<int> cps;
  {
    std::stringstream ss(arg(argc, argv, "cp", "2,4"));
    for (std::string x; std::getline(ss, x, ',');) {
      const int c = std::atoi(x.c_str());
      if (c < 2 || c > 64) return die(SF_ERR(kInvalidArgument, "--cp: sizes in [2, 64]"));
      cps.push_back(c);
    }
  }
  // The documents joined by a blank line, cut to --chars, as bench/mpi/sparse_cp.sh does.
  std::string text;
  {
    std::stringstream ss(texts);
    for (std::string f; std::getline(ss, f, ',');) {
      std::ifstream in(f, std::ios::binary);
      if (!in) return die(SF_ERR(kNotFound, "--text: cannot read " + f));
      if (!text.empty()) text += "\n\n";
      text += std::string(std::istreambuf_iterator<char>(in), {});
    }
    text.resize(std::min(text.size(), size_t(chars)));
  }
  auto m = model::Model::load(model_path);
  if (!m.is_ok()) return die(m.status());
  const model::ModelConfig& c = m->config();
  auto tok = eval::load_tokenizer(model_path);
  if (!tok.is_ok()) return die(tok.status());
  const std::vector<int32_t> ids = tok->encode(text);
  auto sc = model::sparse_config_load(cfg_path, c.n_layers, c.n_heads);
  if (!sc.is_ok()) return die(sc.status());
  std::vector<Totals> tot(cps.size());
  model::PrefillOptions o;
  o.keep_kv = false;
  o.sparse = &sc.value();
  int dense_layers = 0;
  o.on_attention = [&](int layer, const TensorView&, const TensorView&,
                       const kernels::SparseIndex* idx) {
    if (!idx) {
      ++dense_layers;
      return;
    }
    co.skip_head.assign(size_t(c.n_heads), 0);
    co.slot_head.resize(size_t(c.n_heads));
    const int qpk = c.n_heads / c.n_kv_heads;
    for (int h = 0; h < c.n_heads; ++h) {
      co.slot_head[size_t(h)] = h;
      const auto name = [&](int x) {
        return std::string(kernels::pattern_name(sc->layers[size_t(layer)][size_t(x)].pattern));
      };
      if (share.empty() || name(h) != share) continue;
      for (int f = h - h % qpk; f < h; ++f)
        if (name(f) == share) {
          co.slot_head[size_t(h)] = f;
          break;
        }
    }
    for (int h = 0; h < c.n_heads && !skip.empty(); ++h)
      co.skip_head[size_t(h)] =
          kernels::pattern_name(sc->layers[size_t(layer)][size_t(h)].pattern) == skip;
    for (size_t i = 0; i < cps.size(); ++i)
      count_layer(*idx, c.n_kv_heads, c.head_dim, cps[i], co, &tot[i]);
  };
  const auto t0 = std::chrono::steady_clock::now();
  auto r = model::prefill(m.value(), ids, o);
  if (!r.is_ok()) return die(r.status());
  const double secs = sf::seconds_since(t0);
  std::printf("%zu tokens, density %.4f, %d dense layers, %.1f s (prefill and counting)\n",
              ids.size(), r->density, dense_layers, secs);
  boost::json::array recs;
  for (size_t i = 0; i < cps.size(); ++i) {
    const Totals& t = tot[i];
    std::printf(
        "CP %d: pull %.4f of the all-gather, hybrid %.4f (%lld of %lld slots pushed, %.4f)\n",
        cps[i], t.pull / t.allgather, t.hybrid / t.allgather, static_cast<long long>(t.pushed),
        static_cast<long long>(t.slots), t.slots ? double(t.pushed) / double(t.slots) : 0.0);
    recs.push_back(boost::json::object{{"cp", cps[i]},
                                       {"seq_len", int64_t(ids.size())},
                                       {"density", r->density},
                                       {"pull_fraction", t.pull / t.allgather},
                                       {"hybrid_fraction", t.hybrid / t.allgather},
                                       {"slots_with_remote_keys", t.slots},
                                       {"slots_pushed", t.pushed}});
  }
  if (!out_path.empty()) {
    boost::json::object doc{{"config", cfg_path},   {"model", c.name},      {"parts", parts},
                            {"skip_pattern", skip}, {"share_group", share}, {"records", recs}};
    std::ofstream(out_path) << boost::json::serialize(doc) << "\n";
  }
  return 0;
}
