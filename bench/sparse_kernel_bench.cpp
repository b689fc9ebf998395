// Sparse vs dense CPU attention at one length: time per computed 64x64 block, and total time
// against density. Indices carry a planted vertical-slash structure (runs of diagonals plus
// columns, sink 64, local 64) built with sparse_index_build; inputs are random normal.
//
//   sf_bench_sparse [--seq 8192] [--heads 9] [--kv-heads 3] [--dim 64] [--reps 3]
//                   [--densities 1,0.5,0.2,0.1]
//
// A "computed block" is 64 query rows x 64 keys the kernel multiplies: for the dense kernel
// ceil(kend / 64) per (head, query block); for the sparse one the block entries plus
// ceil(columns / 64) per slot. Density 1 uses sparse_index_dense. Last, the estimators' time
// per pattern family (default budgets) against the dense kernel's (best over the rows).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "common/timing.h"
#include "kernels/api.h"
#include "kernels/sparse.h"

namespace {

using sf::DType;
using sf::TensorView;
namespace kn = sf::kernels;

struct Args {
  int64_t seq = 8192;
  int heads = 9, kv_heads = 3, dim = 64, reps = 3;
  std::vector<double> densities{1.0, 0.5, 0.2, 0.1};
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--seq")
      a.seq = std::atoll(v.c_str());
    else if (k == "--heads")
      a.heads = std::atoi(v.c_str());
    else if (k == "--kv-heads")
      a.kv_heads = std::atoi(v.c_str());
    else if (k == "--dim")
      a.dim = std::atoi(v.c_str());
    else if (k == "--reps")
      a.reps = std::atoi(v.c_str());
    else if (k == "--densities") {
      a.densities.clear();
      for (size_t p = 0; p < v.size();) {
        const size_t c = v.find(',', p);
        a.densities.push_back(std::atof(v.substr(p, c - p).c_str()));
        p = c == std::string::npos ? v.size() : c + 1;
      }
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

// Per head: diagonal runs and columns in a fixed random order; budget t takes the first t runs
// and the first 8t columns, so density grows monotonically with t.
struct Planted {
  std::vector<std::vector<std::vector<int32_t>>> runs;  // [head][run] -> offsets
  std::vector<std::vector<int32_t>> cols;               // [head] -> columns
};

Planted plant(const Args& a, std::mt19937_64& rng) {
  Planted p;
  p.runs.resize(size_t(a.heads));
  p.cols.resize(size_t(a.heads));
  for (int h = 0; h < a.heads; ++h) {
    std::vector<int32_t> starts(size_t(a.seq));
    for (int64_t i = 0; i < a.seq; ++i) starts[size_t(i)] = int32_t(i);
    std::shuffle(starts.begin(), starts.end(), rng);
    for (int32_t s : starts) {
      const int len = int(std::uniform_int_distribution<int>(1, 16)(rng));
      std::vector<int32_t> run;
      for (int r = 0; r < len && s + r < a.seq; ++r) run.push_back(s + r);
      p.runs[size_t(h)].push_back(std::move(run));
    }
    p.cols[size_t(h)] = starts;  // another random order of all keys
    std::shuffle(p.cols[size_t(h)].begin(), p.cols[size_t(h)].end(), rng);
  }
  return p;
}

kn::SparseIndex build(const Args& a, const Planted& p, int64_t t) {
  kn::SparseIndex idx = kn::sparse_index_make(a.heads, a.seq, a.seq, 0, 64, 256);
  for (int h = 0; h < a.heads; ++h) {
    kn::IndexCandidates c;
    for (int64_t r = 0; r < std::min<int64_t>(t, int64_t(p.runs[size_t(h)].size())); ++r)
      c.diagonals.insert(c.diagonals.end(), p.runs[size_t(h)][size_t(r)].begin(),
                         p.runs[size_t(h)][size_t(r)].end());
    c.columns.assign(p.cols[size_t(h)].begin(),
                     p.cols[size_t(h)].begin() + std::min<int64_t>(8 * t, a.seq));
    for (int64_t qb = 0; qb < idx.n_qblocks; ++qb) kn::sparse_index_build(&idx, h, qb, c, 64, 64);
  }
  return idx;
}

int64_t computed_blocks(const kn::SparseIndex& idx) {
  int64_t n = 0;
  for (size_t s = 0; s < idx.block_count.size(); ++s)
    n += idx.block_count[s] + (idx.column_count[s] + 63) / 64;
  return n;
}

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return sf::seconds_since(t0);
}

// Best of `reps` for each of two functions, run alternately so that load from other processes
// on a shared machine hits both alike: the ratio is what this bench is for.
std::pair<double, double> best_of_pair(int reps, const std::function<void()>& a,
                                       const std::function<void()>& b) {
  double ta = 1e30, tb = 1e30;
  for (int r = 0; r < reps; ++r) {
    ta = std::min(ta, seconds_of(a));
    tb = std::min(tb, seconds_of(b));
  }
  return {ta, tb};
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const size_t nq = size_t(a.seq) * size_t(a.heads) * size_t(a.dim),
               nk = size_t(a.seq) * size_t(a.kv_heads) * size_t(a.dim);
  std::vector<float> q(nq), k(nk), v(nk), out(nq), lse(size_t(a.heads) * size_t(a.seq));
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  const TensorView tq = TensorView::make(q.data(), DType::kF32, {a.seq, a.heads, a.dim});
  const TensorView tk = TensorView::make(k.data(), DType::kF32, {a.seq, a.kv_heads, a.dim});
  const TensorView tv = TensorView::make(v.data(), DType::kF32, {a.seq, a.kv_heads, a.dim});
  const TensorView to = TensorView::make(out.data(), DType::kF32, {a.seq, a.heads, a.dim});
  const TensorView tl = TensorView::make(lse.data(), DType::kF32, {a.heads, a.seq});
  const kn::AttentionParams params;
  std::printf(
      "sf_bench_sparse: S=%lld heads=%d kv_heads=%d d=%d threads=%d reps=%d (best of) seed=%llu\n",
      (long long)a.seq, a.heads, a.kv_heads, a.dim, sf::num_threads(), a.reps,
      (unsigned long long)seed);

  const kn::SparseIndex dense_idx = kn::sparse_index_dense(a.heads, a.seq, a.seq, 0);
  const int64_t dense_blocks = computed_blocks(dense_idx);
  auto run_dense = [&] {
    if (!kn::attention_dense(tq, tk, tv, to, tl, params).is_ok()) std::exit(1);
  };
  run_dense();  // warm-up: thread pool, BLAS buffers
  std::printf("dense: %lld computed blocks; each row times dense and sparse alternately\n\n",
              (long long)dense_blocks);
  std::printf("%-8s %-8s %-10s %-10s %-10s %-12s %-12s %-10s\n", "target", "density", "blocks",
              "sparse_s", "dense_s", "us/blk sp", "us/blk dense", "time ratio");

  const Planted planted = plant(a, rng);
  double t_dense_min = 1e30;
  for (double target : a.densities) {
    kn::SparseIndex idx;
    if (target >= 1.0) {
      idx = dense_idx;
    } else {  // bisection on the planted budget
      int64_t lo = 0, hi = a.seq;
      while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        (build(a, planted, mid).density() < target ? lo : hi) = mid;
      }
      idx = build(a, planted, hi);
    }
    const double density = idx.density();
    const int64_t blocks = computed_blocks(idx);
    const auto [t_dense, t_sparse] = best_of_pair(a.reps, run_dense, [&] {
      const sf::Status st = kn::attention_sparse(tq, tk, tv, idx, to, tl, params);
      if (!st.is_ok()) {
        std::fprintf(stderr, "%s\n", st.to_string().c_str());
        std::exit(1);
      }
    });
    t_dense_min = std::min(t_dense_min, t_dense);
    const double us_sparse = t_sparse / double(blocks) * 1e6;
    const double us_dense = t_dense / double(dense_blocks) * 1e6;
    std::printf("%-8.2f %-8.3f %-10lld %-10.3f %-10.3f %-12.2f %-12.2f %-10.3f\n", target, density,
                (long long)blocks, t_sparse, t_dense, us_sparse, us_dense, t_sparse / t_dense);
  }

  // Estimation cost per pattern family (all heads one pattern, default budgets), against the
  // dense kernel's time: it is part of prefill time.
  std::printf("\n%-16s %-10s %-10s %-12s\n", "estimator", "est_s", "density", "est/dense");
  for (kn::Pattern pat :
       {kn::Pattern::kVerticalSlash, kn::Pattern::kAdaptiveVS, kn::Pattern::kBlockSparse,
        kn::Pattern::kAdaptiveBlock, kn::Pattern::kAShape}) {
    std::vector<kn::HeadPattern> pats(size_t(a.heads));
    for (auto& hp : pats) hp.pattern = pat;
    kn::SparseIndex idx;
    kn::EstimatorStats st;
    double t = 1e30;
    for (int r = 0; r < a.reps; ++r)
      t = std::min(t, seconds_of([&] {
                     if (!kn::sparse_estimate(tq, tk, pats, 0, &idx, &st).is_ok()) std::exit(1);
                   }));
    std::printf("%-16s %-10.4f %-10.3f %-12.4f\n", kn::pattern_name(pat), t, st.density,
                t / t_dense_min);
  }
  return 0;
}
