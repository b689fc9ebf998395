// `sparsefill search`: MInference's kernel-aware offline pattern search (seed 000, Alg. 1).
//
// One dense prefill of the calibration text (repeated to --length if shorter, as eval does),
// observing each layer's q and k. Per layer, every candidate pattern setting is estimated for
// all heads at once (sparse_estimate with the same HeadPattern for every head) and scored per
// head by attention recall on sampled query rows (last 64 plus --rows random rows). The cost of
// a candidate is the kernel's own: query-key pairs it computes after per-row causal clipping
// (SparseIndex::pairs), as a fraction of the head's causal pairs ("density"), measured on the
// index actually built, so merged diagonals, forced sink/local entries and block rounding are
// all counted as the kernel executes them.
//
// Objective per head (--objective): log-recall (default) is the mean over the sampled rows of
// log(row recall), i.e. minus the mean KL(sparse || dense) of the rows' attention distributions;
// recall is the mean row recall (MInference). The plain mean lets a head lose rare rows whole (a
// copy head's row that needs one earlier occurrence), which is where the perplexity went at 8K.
//
// Allocation:
//   uniform  (MInference) every head gets the candidate with the best objective among those
//            whose density is <= the target;
//   global   (default) per-head budgets differ: maximize the mean objective over all heads
//            subject to the mean density <= the target (Lagrangian relaxation over each head's
//            candidates, then a greedy fill of the remaining budget). Total kernel cost is the
//            same bound.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "common/args.h"
#include "common/file_io.h"
#include "common/timing.h"
#include "kernels/sparse.h"
#include "tools/cli/cli.h"
#include "tools/eval/quality.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"

namespace sf::cli {
namespace {

using kernels::HeadPattern;
using kernels::Pattern;

struct Cand {
  HeadPattern p;
  double recall = 0, density = 0;
  double value = 0;  // what the allocation maximizes: recall, or mean log recall (--objective)
};

// Candidate settings of every pattern, sized from the sink/local minimum up to the whole
// sequence on geometric grids; the grid is cut per layer once every head exceeds `cap`.
std::vector<std::vector<HeadPattern>> candidate_families(int64_t L, const std::set<Pattern>& use,
                                                         int64_t spread_rows, int64_t segment_rows) {
  std::vector<std::vector<HeadPattern>> fam;
  HeadPattern base;
  base.sink = 64;
  base.local = 64;
  base.spread_rows = spread_rows;
  base.segment_rows = segment_rows;
  auto geo = [](double lo, double hi, double step) {
    std::vector<int64_t> v;
    for (double x = lo; x <= hi * 1.0001; x *= step) {
      const int64_t r = std::llround(x);
      if (v.empty() || v.back() != r) v.push_back(r);
    }
    return v;
  };
  // A-shape: sink + local window (ascending cost).
  if (use.count(Pattern::kAShape)) {
    std::vector<HeadPattern> f;
    for (int64_t w : geo(64, double(L), std::pow(2.0, 0.25))) {
      HeadPattern p = base;
      p.pattern = Pattern::kAShape;
      p.local = w;
      f.push_back(p);
    }
    fam.push_back(f);
  }
  // Vertical-slash: one family per slash count, vertical count ascending. The sink columns and
  // local diagonals count toward the budgets (as the estimator ranks them first).
  for (int64_t ns : geo(double(base.local + 1), double(L) / 2, std::sqrt(2.0))) {
    if (!use.count(Pattern::kVerticalSlash)) break;
    std::vector<HeadPattern> f;
    for (int64_t nv : geo(double(base.sink), double(L) / 2, std::sqrt(2.0))) {
      HeadPattern p = base;
      p.pattern = Pattern::kVerticalSlash;
      p.n_vertical = nv;
      p.n_slash = ns;
      f.push_back(p);
    }
    fam.push_back(f);
  }
  // Block-sparse: top-k key blocks per query block (sink block and diagonal blocks included).
  if (use.count(Pattern::kBlockSparse)) {
    std::vector<HeadPattern> f;
    const int64_t n_kb = (L + 63) / 64;
    for (int64_t k : geo(1, double(n_kb), std::pow(2.0, 0.25))) {
      HeadPattern p = base;
      p.pattern = Pattern::kBlockSparse;
      p.n_blocks = k;
      f.push_back(p);
    }
    fam.push_back(f);
  }
  // Adaptive (PSA / FlexPrefill thresholds): the budget follows each input's estimated mass,
  // so one gamma costs what the calibration text needs; the grid is gamma ascending, and cost
  // grows with it. min_budget stays at its default (HeadPattern). Adaptive-block candidates keep
  // each last-block row's own gamma set (last_block_rows): with the rows' mean mass, a block only
  // the final rows read (a pass key) fell under gamma and 2K passkey dropped to 0.90. They are
  // not searched by default: a search that took them put 144 heads on them and lost 2K passkey
  // (0.80 against dense 1.00) through their pooled mid-sequence estimate (bench/NOTES.md).
  static constexpr double kGammas[] = {0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99};
  for (Pattern ap : {Pattern::kAdaptiveVS, Pattern::kAdaptiveBlock}) {
    if (!use.count(ap)) continue;
    std::vector<HeadPattern> f;
    for (double g : kGammas) {
      HeadPattern p = base;
      p.pattern = ap;
      p.gamma = g;
      p.last_block_rows = ap == Pattern::kAdaptiveBlock ? 1 : 0;
      f.push_back(p);
    }
    fam.push_back(f);
  }
  return fam;
}

std::string describe(const HeadPattern& p) {
  char b[96];
  switch (p.pattern) {
    case Pattern::kAShape: std::snprintf(b, sizeof b, "a-shape(local %lld)", static_cast<long long>(p.local)); break;
    case Pattern::kVerticalSlash:
      std::snprintf(b, sizeof b, "vs(%lld,%lld)", static_cast<long long>(p.n_vertical), static_cast<long long>(p.n_slash));
      break;
    case Pattern::kBlockSparse: std::snprintf(b, sizeof b, "block(%lld)", static_cast<long long>(p.n_blocks)); break;
    case Pattern::kAdaptiveVS:
      std::snprintf(b, sizeof b, "avs(%.2f)", p.gamma);
      break;
    case Pattern::kAdaptiveBlock:
      std::snprintf(b, sizeof b, "ablock(%.2f)", p.gamma);
      break;
    default: std::snprintf(b, sizeof b, "%s", kernels::pattern_name(p.pattern)); break;
  }
  return b;
}

// Upper-left convex hull of (density, value): the only points a Lagrangian choice can pick.
std::vector<Cand> hull(std::vector<Cand> c) {
  std::sort(c.begin(), c.end(), [](const Cand& a, const Cand& b) {
    return a.density < b.density || (a.density == b.density && a.value > b.value);
  });
  std::vector<Cand> mono;  // strictly increasing value with density
  for (const Cand& x : c)
    if (mono.empty() || x.value > mono.back().value + 1e-12) mono.push_back(x);
  std::vector<Cand> h;
  for (const Cand& x : mono) {
    while (h.size() >= 2) {
      const Cand& a = h[h.size() - 2];
      const Cand& b = h.back();
      // drop b when it lies on or below the segment a-x
      const double cross = (b.density - a.density) * (x.value - a.value) - (b.value - a.value) * (x.density - a.density);
      if (cross >= 0) h.pop_back();
      else break;
    }
    h.push_back(x);
  }
  return h;
}

}  // namespace

int cmd_search(int argc, char** argv) {
  auto args_r =
      parse_args(argc, argv, 2,
                 {"model", "calib", "target-density", "out", "length", "allocation", "rows", "seed",
                  "dense-below", "patterns", "spread-rows", "segment-rows", "objective"},
                 {"share-group"});
  if (!args_r.is_ok()) return fail(args_r.status());
  const Args& a = args_r.value();
  if (!a.has("calib")) return fail(SF_ERR(kInvalidArgument, "--calib FILE is required (a text not used for eval)"));
  if (!a.has("target-density")) return fail(SF_ERR(kInvalidArgument, "--target-density D is required"));
  if (!a.has("out")) return fail(SF_ERR(kInvalidArgument, "--out FILE.json is required"));
  // What would fail after an hours-long search fails now.
  if (Status st = check_output_file(a.get("out"), "--out"); !st.is_ok()) return fail(st);
  auto dense_below = a.get_int("dense-below", 0, 0, INT32_MAX);
  if (!dense_below.is_ok()) return fail(dense_below.status());
  double target = 0;
  if (!whole_number(a.get("target-density"), &target) || !(target > 0 && target <= 1))
    return fail(SF_ERR(kInvalidArgument, "--target-density must be a number in (0, 1]"));
  const std::string alloc = a.get("allocation", "global");
  if (alloc != "uniform" && alloc != "global")
    return fail(SF_ERR(kInvalidArgument, "--allocation must be 'uniform' or 'global'"));
  auto rows_r = a.get_int("rows", 256, 0, 4096);
  if (!rows_r.is_ok()) return fail(rows_r.status());
  const int n_random = int(rows_r.value());
  auto seed_r = a.get_int("seed", 7, 0, INT64_MAX);
  if (!seed_r.is_ok()) return fail(seed_r.status());
  const uint64_t seed = uint64_t(seed_r.value());
  auto spread_r = a.get_int("spread-rows", 64, 0, 4096);
  if (!spread_r.is_ok()) return fail(spread_r.status());
  const int spread_rows = int(spread_r.value());
  const std::string objective = a.get("objective", "log-recall");
  if (objective != "recall" && objective != "log-recall")
    return fail(SF_ERR(kInvalidArgument, "--objective must be 'recall' or 'log-recall'"));
  const bool log_objective = objective == "log-recall";
  auto segment_r = a.get_int("segment-rows", 0, 0, int64_t(1) << 30);
  if (!segment_r.is_ok()) return fail(segment_r.status());
  const int64_t segment_rows = segment_r.value();
  if (segment_rows < 0 || segment_rows % 64 != 0)
    return fail(SF_ERR(kInvalidArgument, "--segment-rows must be 0 or a positive multiple of 64"));
  std::set<Pattern> use;
  {
    auto items = parse_list(a.get("patterns", "a-shape,vertical-slash,block-sparse,adaptive-vs"),
                            "--patterns");
    if (!items.is_ok()) return fail(items.status());
    for (const std::string& item : items.value()) {
      auto p = kernels::pattern_from_string(item);
      if (!p.is_ok() || (p.value() != Pattern::kAShape && p.value() != Pattern::kVerticalSlash &&
                         p.value() != Pattern::kBlockSparse && p.value() != Pattern::kAdaptiveVS &&
                         p.value() != Pattern::kAdaptiveBlock))
        return fail(
            SF_ERR(kInvalidArgument, "--patterns: '" + item +
                                         "' is not one of a-shape, vertical-slash, block-sparse, "
                                         "adaptive-vs, adaptive-block"));
      use.insert(p.value());
    }
    if (use.empty()) return fail(SF_ERR(kInvalidArgument, "--patterns is empty"));
  }
  auto text = read_text_files(a.get("calib"), "calibration text");
  if (!text.is_ok()) return fail(text.status());

  const std::string model_path = resolve_model(a.get("model", "default"));
  auto em = eval::load_eval_model(model_path);
  if (!em.is_ok()) return fail(em.status());
  const model::Tokenizer* tok = &em->tok;
  const model::Model& m = em->m;
  const auto& cfg = m.config();
  const std::vector<int32_t> doc = tok->encode(text.value(), true, false);
  if (doc.size() < 256) return fail(SF_ERR(kInvalidArgument, "the calibration text has fewer than 256 tokens"));
  // Default: the model's context (at most 8192), the calibration text repeated to reach it as
  // eval repeats its document, so budgets are sized at the length the targets are measured at.
  auto L_r = a.get_int("length", std::min<int64_t>(cfg.max_context, 8192), 256, cfg.max_context);
  if (!L_r.is_ok()) return fail(L_r.status());
  int64_t L = L_r.value();
  const std::vector<int32_t> ids = eval::fit_tokens(doc, L);

  const auto t0 = std::chrono::steady_clock::now();
  const auto families = candidate_families(L, use, spread_rows, segment_rows);
  const double cap = alloc == "uniform" ? target : std::min(1.0, 3.0 * target);
  std::vector<std::vector<std::vector<Cand>>> cands(size_t(cfg.n_layers));  // [layer][head][cand]
  Status err;
  int64_t n_estimates = 0;
  model::PrefillOptions opt;
  opt.keep_kv = false;
  opt.on_attention = [&](int layer, const TensorView& q, const TensorView& k, const kernels::SparseIndex*) {
    if (!err.is_ok()) return;
    const auto l0 = std::chrono::steady_clock::now();
    const int hq = int(q.shape[1]);
    eval::DenseRowMass dm;
    err = dm.compute(q, k, 0, eval::sample_rows(q.shape[0], 64, n_random, seed + uint64_t(layer)));
    if (!err.is_ok()) return;
    auto& lc = cands[size_t(layer)];
    lc.assign(size_t(hq), {});
    for (const auto& fam : families) {
      for (const HeadPattern& p : fam) {
        kernels::SparseIndex idx;
        kernels::EstimatorStats st;
        err = kernels::sparse_estimate(q, k, std::vector<HeadPattern>(size_t(hq), p), 0, &idx, &st);
        if (!err.is_ok()) return;
        ++n_estimates;
        double min_d = 1e9;
        for (int h = 0; h < hq; ++h) {
          Cand c{p, dm.recall(idx, h), eval::head_density(idx, h), 0};
          c.value = log_objective ? dm.log_recall(idx, h) : c.recall;
          c.p.score = c.recall;
          min_d = std::min(min_d, c.density);
          lc[size_t(h)].push_back(c);
        }
        if (min_d > cap) break;  // larger settings of this family only cost more
      }
    }
    if (alloc == "global") {
      for (int h = 0; h < hq; ++h) {
        HeadPattern d;
        d.pattern = Pattern::kDense;
        d.score = 1.0;
        lc[size_t(h)].push_back({d, 1.0, 1.0, log_objective ? 0.0 : 1.0});
      }
    }
    std::fprintf(stderr, "layer %2d: %zu candidates per head, %.1f s\n", layer, lc.empty() ? 0 : lc[0].size(),
                 sf::seconds_since(l0));
  };
  std::printf("search: %s, calibration %s (%zu tokens, run at %lld), target density %.3f, allocation %s\n",
              cfg.name.c_str(), a.get("calib").c_str(), doc.size(), static_cast<long long>(L), target, alloc.c_str());
  std::fflush(stdout);
  auto pr = model::prefill(m, ids, opt);
  if (!pr.is_ok()) return fail(pr.status());
  if (!err.is_ok()) return fail(err);

  // Choose per head.
  const int NL = cfg.n_layers, NH = cfg.n_heads;
  std::vector<std::vector<Cand>> pick(static_cast<size_t>(NL), std::vector<Cand>(static_cast<size_t>(NH)));
  if (alloc == "uniform") {
    for (int l = 0; l < NL; ++l)
      for (int h = 0; h < NH; ++h) {
        const auto& cs = cands[size_t(l)][size_t(h)];
        const Cand* best = nullptr;
        const Cand* cheapest = nullptr;
        for (const Cand& c : cs) {
          if (!cheapest || c.density < cheapest->density) cheapest = &c;
          if (c.density <= target && (!best || c.value > best->value)) best = &c;
        }
        pick[size_t(l)][size_t(h)] = best ? *best : *cheapest;
      }
  } else {
    std::vector<std::vector<Cand>> hulls;
    for (int l = 0; l < NL; ++l)
      for (int h = 0; h < NH; ++h) hulls.push_back(hull(cands[size_t(l)][size_t(h)]));
    const double budget = target * double(hulls.size());
    auto choose = [&](double lambda, std::vector<size_t>* sel) {
      double tot = 0;
      sel->assign(hulls.size(), 0);
      for (size_t i = 0; i < hulls.size(); ++i) {
        double bestv = -1e300;
        for (size_t j = 0; j < hulls[i].size(); ++j) {
          const double v = hulls[i][j].value - lambda * hulls[i][j].density;
          if (v > bestv) {
            bestv = v;
            (*sel)[i] = j;
          }
        }
        tot += hulls[i][(*sel)[i]].density;
      }
      return tot;
    };
    std::vector<size_t> sel;
    double lo = 0, hi = 1;
    while (choose(hi, &sel) > budget && hi < 1e9) hi *= 2;
    for (int it = 0; it < 100; ++it) {
      const double mid = 0.5 * (lo + hi);
      if (choose(mid, &sel) > budget) lo = mid;
      else hi = mid;
    }
    double used = choose(hi, &sel);
    // Greedy fill: upgrade the head with the best objective gain per density while it fits.
    for (;;) {
      double best_ratio = 0;
      size_t bi = SIZE_MAX;
      for (size_t i = 0; i < hulls.size(); ++i) {
        if (sel[i] + 1 >= hulls[i].size()) continue;
        const Cand& c0 = hulls[i][sel[i]];
        const Cand& c1 = hulls[i][sel[i] + 1];
        const double dd = c1.density - c0.density;
        if (used + dd > budget) continue;
        const double ratio = (c1.value - c0.value) / std::max(dd, 1e-12);
        if (ratio > best_ratio) {
          best_ratio = ratio;
          bi = i;
        }
      }
      if (bi == SIZE_MAX) break;
      used += hulls[bi][sel[bi] + 1].density - hulls[bi][sel[bi]].density;
      ++sel[bi];
    }
    for (size_t i = 0; i < hulls.size(); ++i) pick[i / size_t(NH)][i % size_t(NH)] = hulls[i][sel[i]];
  }

  model::SparseConfig sc;
  sc.model = cfg.name;
  sc.n_layers = NL;
  sc.n_heads = NH;
  sc.target_density = target;
  if (a.has("dense-below")) sc.dense_below = dense_below.value();
  sc.layers.assign(size_t(NL), {});
  double sum_d = 0, sum_r = 0, min_r = 1;
  std::map<std::string, int> counts;
  for (int l = 0; l < NL; ++l) {
    double ld = 0, lr = 0;
    std::string line;
    for (int h = 0; h < NH; ++h) {
      const Cand& c = pick[size_t(l)][size_t(h)];
      HeadPattern p = c.p;
      p.score = c.recall;
      // --share-group marks the written config only: candidates were costed per head.
      if (a.has("share-group")) p.share_group = 1;
      sc.layers[size_t(l)].push_back(p);
      ld += c.density;
      lr += c.recall;
      min_r = std::min(min_r, c.recall);
      counts[kernels::pattern_name(p.pattern)]++;
      line += " " + describe(p);
    }
    sum_d += ld;
    sum_r += lr;
    std::printf("layer %2d: density %.3f recall %.4f:%s\n", l, ld / NH, lr / NH, line.c_str());
  }
  const double secs = sf::seconds_since(t0);
  Status st = model::sparse_config_save(sc, a.get("out"));
  if (!st.is_ok()) return fail(st);
  std::printf("patterns:");
  for (const auto& [k, v] : counts) std::printf(" %s %d", k.c_str(), v);
  std::printf("\ncalibration estimate (cost = query-key pairs the kernel computes, SparseIndex::pairs): mean density "
              "%.4f (target %.3f), mean recall %.4f, min head recall %.4f\n",
              sum_d / (NL * NH), target, sum_r / (NL * NH), min_r);
  std::printf("search time %.1f s (%lld estimates, dense calibration prefill included)\nwrote %s\n", secs,
              static_cast<long long>(n_estimates), a.get("out").c_str());
  return 0;
}

}  // namespace sf::cli
