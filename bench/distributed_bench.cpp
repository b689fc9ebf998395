// GPU TP x CP prefill benchmark (issue 5, "Run on the 2-GPU host"): under mpirun, one rank per
// GPU, a Llama-3-8B-shaped model with deterministic synthetic weights drawn on each device
// (model::DeviceModel::synthetic: every TP slice equals its part of the one-GPU model), dense
// attention. For each length and grid it plans the rank's shard, runs one warm-up and --reps
// timed prefills, and compares the leader's last-row logits with the first grid's (1x1: one GPU).
//
//   mpirun -np 2 sf_bench_distributed --lengths 32768,131072 --grids 1x1,1x2,2x1 --out R.jsonl
//
// A grid written TPxCPb (e.g. 2x1b) runs its TP all-reduces blocking (after a drain) instead of
// overlapped with the next chunk's GEMMs, to measure how much of their time the overlap hides.
// --importance W also computes the SnapKV importance of the last W queries (pool 7), as the worker
// does for a scored retention policy: its time, its bytes, and its distance from one GPU's.
//
// Writes one JSON record per (length, grid) to --out (world rank 0); bench/gpu/distributed.sh
// adds device, driver, date, commit and command and computes speedups. Grids smaller than the
// world run on the first ranks while the others wait at a barrier.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/mpi_world.h"
#include "comm/mpi_communicator.h"
#include "worker/model/config.h"
#include "worker/model/device_model.h"
#include "worker/model/sparse_config.h"
#include "worker/runtime/device_parallel.h"
#include "worker/runtime/grid.h"

namespace sf {
namespace {

struct Args {
  std::vector<int64_t> lengths{32768};
  std::vector<runtime::GridShape> grids{{1, 1}, {1, 2}, {2, 1}};
  std::vector<bool> blocking{false, false, false};  // per grid: TP all-reduces not overlapped
  std::vector<std::string> modes{"dense"};  // --attention: dense or a sparse mode
  int reps = 2, layers = 0, importance = 0;
  int64_t chunk = 8192;
  uint64_t seed = 1;
  std::string out;
};


Result<Args> parse(int argc, char** argv) {
  Args a;
  auto list = [](const std::string& s) {
    std::vector<std::string> v;
    std::stringstream ss(s);
    std::string x;
    while (std::getline(ss, x, ',')) v.push_back(x);
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) return SF_ERR(kInvalidArgument, k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--lengths") {
      a.lengths.clear();
      for (const auto& x : list(v)) a.lengths.push_back(std::atoll(x.c_str()));
    } else if (k == "--grids") {
      a.grids.clear();
      a.blocking.clear();
      for (const auto& x : list(v)) {
        runtime::GridShape g;
        char b = 0;
        const int n = std::sscanf(x.c_str(), "%dx%d%c", &g.tp, &g.cp, &b);
        if (n < 2 || g.tp < 1 || g.cp < 1 || (n == 3 && b != 'b'))
          return SF_ERR(kInvalidArgument, "--grids: '" + x + "' is not TPxCP or TPxCPb");
        a.grids.push_back(g);
        a.blocking.push_back(n == 3);
      }
    } else if (k == "--attention") {
      a.modes = list(v);
    } else if (k == "--reps") {
      a.reps = std::max(1, std::atoi(v.c_str()));
    } else if (k == "--layers") {
      a.layers = std::atoi(v.c_str());
    } else if (k == "--importance") {
      a.importance = std::atoi(v.c_str());
      if (a.importance < 0) return SF_ERR(kInvalidArgument, "--importance must be >= 0");
    } else if (k == "--chunk") {
      a.chunk = std::atoll(v.c_str());
    } else if (k == "--seed") {
      a.seed = std::strtoull(v.c_str(), nullptr, 10);
    } else if (k == "--out") {
      a.out = v;
    } else {
      return SF_ERR(kInvalidArgument, "unknown option " + k);
    }
  }
  for (int64_t L : a.lengths)
    if (L <= 0) return SF_ERR(kInvalidArgument, "--lengths must be positive");
  if (a.grids.empty() || a.grids[0].tp != 1 || a.grids[0].cp != 1)
    return SF_ERR(kInvalidArgument, "--grids must start with 1x1 (the one-GPU reference)");
  return a;
}

struct Measured {
  std::vector<double> seconds, comm_s, attention_s, estimate_s, importance_s;
  std::vector<double> layer_s;  // of the fastest run
  runtime::ParallelStats stats;
  std::vector<float> logits;  // leader
  std::vector<std::vector<float>> importance;  // leader, per layer [KV heads, tokens]
  int32_t first_token = -1;
  size_t weight_bytes = 0, workspace_bytes = 0;
  std::string device_name;
  double plan_s = 0;
  // The warm-up run on a fresh plan: what a worker pays per request (it plans each one),
  // grows of an outgrown sparse index included.
  double first_run_s = 0;
};

// One grid at one length on group 0 of the world (other groups idle).
Result<Measured> run_grid(comm::Communicator& world, const Args& a, const model::ModelConfig& cfg,
                          runtime::GridShape shape, bool blocking, std::span<const int32_t> tokens,
                          const model::SparseConfig* sc) {
  SF_ASSIGN(runtime::GridComms g, runtime::make_grid(world, shape));
  Measured m;
  if (g.group != 0) return m;
  SF_ASSIGN(const int dev, runtime::local_device(world.rank()));
  SF_ASSIGN(model::DeviceModel dm,
            model::DeviceModel::synthetic(cfg, a.seed, DType::kBF16, dev,
                                          model::TpSlice{shape.tp, g.tp_rank}));
  SF_ASSIGN(runtime::DeviceGrid dg, runtime::make_device_grid(g, dev));
  model::PrefillOptions opt;
  opt.chunk = a.chunk;
  opt.keep_kv = false;
  opt.sparse = sc;
  opt.importance_window = a.importance;
  opt.importance_pool = 7;
  runtime::DeviceParallelOptions po;
  po.overlap_tp = !blocking;
  SF_ASSIGN(runtime::DeviceParallelPrefill p,
            runtime::DeviceParallelPrefill::plan(dm, g, dg, int64_t(tokens.size()), opt, po));
  m.weight_bytes = dm.weight_bytes();
  m.workspace_bytes = p.prefill().workspace_bytes();
  m.device_name = dm.device_name();
  m.plan_s = p.prefill().plan_seconds();
  double best = 1e300;
  for (int r = 0; r <= a.reps; ++r) {  // run 0 warms up (cuDNN and cuBLASLt first launches)
    SF_ASSIGN(runtime::ParallelResult res, p.run(tokens));
    if (r == 0) {
      m.first_run_s = res.stats.seconds;
      continue;
    }
    m.seconds.push_back(res.stats.seconds);
    m.comm_s.push_back(res.stats.comm_s);
    m.attention_s.push_back(res.stats.attention_s);
    m.estimate_s.push_back(res.stats.estimate_s);
    m.importance_s.push_back(res.stats.importance_s);
    m.stats = res.stats;
    if (res.stats.seconds < best) {
      best = res.stats.seconds;
      m.layer_s = p.layer_seconds();
    }
    m.logits = std::move(res.logits);
    m.importance = std::move(res.importance);
    m.first_token = res.first_token;
  }
  return m;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string json_list(const std::vector<double>& v, double scale = 1.0) {
  std::string s = "[";
  char b[32];
  for (size_t i = 0; i < v.size(); ++i) {
    std::snprintf(b, sizeof b, "%s%.6g", i ? ", " : "", v[i] * scale);
    s += b;
  }
  return s + "]";
}

int run(int argc, char** argv) {
  std::unique_ptr<comm::Communicator> world = bench::mpi_world(&argc, &argv);
  if (!world) return 2;
  // Idle ranks wait at the barrier while a grid smaller than the world runs (minutes at 128K).
  world->set_timeout(std::chrono::seconds(1800));
  const bool rank0 = world->rank() == 0;
  auto args = parse(argc, argv);
  if (!args.is_ok()) {
    if (rank0) std::fprintf(stderr, "error: %s\n", args.status().message().c_str());
    world.reset();
    comm::mpi_finalize();
    return 2;
  }
  const Args& a = args.value();
  const model::ModelConfig cfg = model::llama3_8b_config(a.layers);
  std::ofstream out;
  if (rank0 && !a.out.empty()) out.open(a.out, std::ios::trunc);
  for (int64_t L : a.lengths) {
    std::vector<int32_t> tokens(static_cast<size_t>(L));
    std::mt19937_64 rng(a.seed + uint64_t(L));
    std::uniform_int_distribution<int32_t> tok(0, cfg.vocab - 1);
    for (auto& t : tokens) t = tok(rng);
    for (const std::string& mode : a.modes) {
      std::optional<model::SparseConfig> sc;
      if (mode != "dense") {
        auto r = model::sparse_config_for_mode(mode, cfg.n_layers, cfg.n_heads);
        if (!r.is_ok()) {
          if (rank0) std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
          comm::mpi_abort_job(2);
        }
        sc.emplace(std::move(r).value());
      }
      std::vector<float> ref;
      std::vector<std::vector<float>> ref_imp;
      double ref_s = 0;
      for (size_t gi = 0; gi < a.grids.size(); ++gi) {
        const runtime::GridShape& shape = a.grids[gi];
        const bool blocking = a.blocking[gi];
        if (world->size() % shape.group_size() != 0) {
          if (rank0)
            std::fprintf(stderr, "skip %dx%d: world of %d ranks\n", shape.tp, shape.cp,
                         world->size());
          continue;
        }
        auto mr = run_grid(*world, a, cfg, shape, blocking, tokens, sc ? &*sc : nullptr);
        Status st = mr.status();
        // Every rank learns of a failure anywhere (a failed rank would leave the others waiting).
        int32_t ok = st.is_ok() ? 1 : 0, all = 0;
        if (!world->all_reduce(&ok, &all, 1, DType::kI32, comm::ReduceOp::kMin).is_ok() || !all) {
          std::fprintf(stderr, "error (rank %d, %dx%d at %lld): %s\n", world->rank(), shape.tp,
                       shape.cp, (long long)L, st.is_ok() ? "a peer failed" : st.message().c_str());
          comm::mpi_abort_job(1);
        }
        if (!rank0) continue;
        const Measured& m = mr.value();
        const double s = median(m.seconds);
        double rel = 0;
        int32_t ref_top1 = -1;
        if (shape.tp == 1 && shape.cp == 1) {
          ref = m.logits;
          ref_imp = m.importance;
          ref_s = s;
        }
        // Importance against one GPU's: worst layer's max |diff| over its max (-1: not computed).
        double imp_rel = -1;
        if (!ref_imp.empty() && ref_imp.size() == m.importance.size()) {
          imp_rel = 0;
          for (size_t l = 0; l < ref_imp.size(); ++l) {
            double num = 0, den = 0;
            for (size_t i = 0; i < ref_imp[l].size() && i < m.importance[l].size(); ++i) {
              num = std::max(num, double(std::fabs(m.importance[l][i] - ref_imp[l][i])));
              den = std::max(den, double(std::fabs(ref_imp[l][i])));
            }
            imp_rel = std::max(imp_rel, den > 0 ? num / den : 0.0);
          }
        }
        if (!ref.empty() && ref.size() == m.logits.size()) {
          double num = 0, den = 0;
          for (size_t i = 0; i < ref.size(); ++i) {
            num = std::max(num, double(std::fabs(m.logits[i] - ref[i])));
            den = std::max(den, double(std::fabs(ref[i])));
          }
          rel = den > 0 ? num / den : 0;
          ref_top1 = int32_t(std::max_element(ref.begin(), ref.end()) - ref.begin());
        }
        double layer_mean = 0;
        for (double x : m.layer_s) layer_mean += x;
        if (!m.layer_s.empty()) layer_mean /= double(m.layer_s.size());
        char b[4096];
        std::snprintf(
            b, sizeof b,
            "{\"tp\": %d, \"cp\": %d, \"gpus\": %d, \"seq_len\": %lld, \"layers\": %d, "
            "\"prefill_s\": %.6f, \"prefill_s_runs\": %s, \"first_run_s\": %.6f, "
            "\"single_gpu_prefill_s\": %.6f, "
            "\"comm_exposed_s\": %.6f, \"attention_s\": %.6f, \"layer_ms_mean\": %.4f, "
            "\"layer_ms\": %s, \"comm_bytes\": %lld, \"allgather_bytes\": %lld, "
            "\"tp_allreduce_bytes\": %lld, \"logits_max_rel_err_vs_1gpu\": %.3e, "
            "\"top1\": %d, \"top1_1gpu\": %d, \"weight_bytes\": %zu, \"workspace_bytes\": %zu, "
            "\"plan_s\": %.3f, \"chunk\": %lld, \"device\": \"%s\", \"attention\": \"%s\", "
            "\"density\": %.5f, \"group_density\": %.5f, \"density_by_rank\": %s, "
            "\"estimate_s\": %.6f, \"tp_overlap\": %s, "
            "\"importance_window\": %d, \"importance_s\": %.6f, \"importance_bytes\": %lld, "
            "\"importance_max_rel_err_vs_1gpu\": %.3e}",
            shape.tp, shape.cp, shape.group_size(), (long long)L, cfg.n_layers, s,
            json_list(m.seconds).c_str(), m.first_run_s, ref_s, median(m.comm_s), median(m.attention_s),
            layer_mean * 1e3, json_list(m.layer_s, 1e3).c_str(), (long long)m.stats.comm_bytes,
            (long long)m.stats.kv_allgather_bytes, (long long)m.stats.tp_allreduce_bytes, rel,
            m.first_token, ref_top1, m.weight_bytes, m.workspace_bytes, m.plan_s,
            (long long)a.chunk, m.device_name.c_str(), mode.c_str(), m.stats.density,
            m.stats.group_density, json_list(m.stats.density_by_rank).c_str(), median(m.estimate_s), shape.tp > 1 && !blocking ? "true" : "false", a.importance,
            median(m.importance_s), (long long)m.stats.importance_bytes, imp_rel);
        std::printf("%s\n", b);
        std::fflush(stdout);
        if (out) out << b << "\n" << std::flush;
      }
    }
  }
  world.reset();
  comm::mpi_finalize();
  return 0;
}

}  // namespace
}  // namespace sf

int main(int argc, char** argv) { return sf::run(argc, argv); }
