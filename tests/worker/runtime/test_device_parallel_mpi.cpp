// The GPU TP x CP prefill (worker/runtime/device_parallel.h) under mpiexec -np 2, one GPU per rank,
// against the one-GPU device forward run on rank 0 with the unsliced model (label gpu: skips
// with fewer than two GPUs). Both grids np 2 holds, TP 2 x CP 1 and TP 1 x CP 2, and both weight
// paths: BF16 weights drawn on the device (DeviceModel::synthetic, cuDNN attention, BF16 K/V
// exchange) and F32 weights uploaded from a host model (DeviceModel::upload with a TP slice, the
// F32 attention kernel, F32 exchange). Checked on every rank: the leader's last-row logits and
// each rank's own K/V rows (its pieces, its KV heads) against the one-GPU run.
//
// Tolerance: max |diff| <= tol * max |ref|, tol 1e-4 for F32 weights (TP sums partial projections
// in another order: fp32 rounding) and 1e-2 for BF16 weights (the GPU-vs-CPU bar of
// test_gpu_forward: a rounding difference of the TP sum can flip a BF16 rounding of the next
// GEMM's input). A one-token error in a CP rank's positions or q_offset exceeds both.
// SnapKV importance (window 32, pool 7), on every rank for every KV head: 1e-4 (F32) and 0.1
// (BF16: both score BF16 keys, but the sharded run's are rounded from other ranks' K, whose TP
// sums differ by rounding; test_gpu_forward's GPU-vs-CPU bound for BF16 importance).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>

#include "common/timing.h"
#include "decode/decode_session.h"
#include "decode/kv_client.h"
#include "kvstore/kv_export.h"
#include "tests/comm/mpi_gpu_env.h"
#include "tests/comm/mpi_test_env.h"
#include "tests/worker/model/model_test_util.h"
#include "worker/model/device_model.h"
#include "worker/model/model.h"
#include "worker/model/sparse_config.h"
#include "worker/runtime/device_parallel.h"
#include "worker/runtime/sharded_export.h"
#include "tests/common/nan_max.h"

namespace sf {
namespace {

using testing::test_seed;
using testing::test_world;

bool have_gpus() { return testing::every_rank_has_a_gpu(); }

// Llama-3-like proportions, small (GQA 4:1, head_dim 128 for cuDNN and the F32 kernel; TP 2
// divides the 2 KV heads and the intermediate size), 3 layers.
model::ModelConfig small_llama3() { return testing::small_llama3(3); }

constexpr int64_t kTokens = 1000;  // not a multiple of 64: CP chunks end mid-block
constexpr int64_t kChunk = 256;

struct Reference {
  std::vector<float> logits;             // last row
  std::vector<std::vector<float>> k, v;  // per layer [S, hkv*d]
  std::vector<std::vector<float>> imp;   // per layer [hkv, S]
};
constexpr int kImpWindow = 32;

// The weights for a slice: synthetic on the device, or uploaded from a host model.
Result<model::DeviceModel> make_model(bool f32, const model::Model* host, model::TpSlice s,
                                      int dev) {
  if (f32) return model::DeviceModel::upload(*host, DType::kF32, dev, s);
  return model::DeviceModel::synthetic(small_llama3(), test_seed(), DType::kBF16, dev, s);
}

// Rank 0: the one-GPU run; then broadcast to every rank.
Reference reference(bool f32, const model::Model* host, std::span<const int32_t> tokens,
                    const model::SparseConfig* sc) {
  auto& w = test_world();
  const model::ModelConfig c = small_llama3();
  const int64_t kvd = int64_t(c.n_kv_heads) * c.head_dim;
  const int64_t S = int64_t(tokens.size());
  Reference r;
  r.logits.resize(size_t(c.vocab));
  r.k.assign(size_t(c.n_layers), std::vector<float>(size_t(S * kvd)));
  r.v = r.k;
  int32_t ok = 1;
  if (w.rank() == 0) {
    auto dm = make_model(f32, host, {}, 0);
    model::PrefillOptions o;
    o.chunk = kChunk;
    o.sparse = sc;
    o.importance_window = kImpWindow;
    Result<model::PrefillResult> res = dm.is_ok() ? model::prefill_device(dm.value(), tokens, o)
                                                  : Result<model::PrefillResult>(dm.status());
    if (!res.is_ok()) {
      ADD_FAILURE() << res.status().to_string();
      ok = 0;
    } else {
      r.logits = res.value().logits;
      r.k = res.value().kv.k;
      r.v = res.value().kv.v;
      r.imp = res.value().importance;
    }
  }
  EXPECT_TRUE(w.bcast(&ok, 1, DType::kI32, 0).is_ok());
  if (!ok) return {};
  EXPECT_TRUE(w.bcast(r.logits.data(), c.vocab, DType::kF32, 0).is_ok());
  for (int l = 0; l < c.n_layers; ++l) {
    EXPECT_TRUE(w.bcast(r.k[size_t(l)].data(), S * kvd, DType::kF32, 0).is_ok());
    EXPECT_TRUE(w.bcast(r.v[size_t(l)].data(), S * kvd, DType::kF32, 0).is_ok());
    r.imp.resize(size_t(c.n_layers));
    r.imp[size_t(l)].resize(size_t(c.n_kv_heads * S));
    EXPECT_TRUE(w.bcast(r.imp[size_t(l)].data(), c.n_kv_heads * S, DType::kF32, 0).is_ok());
  }
  return r;
}

// max |got - want| / max |want| over this rank's rows and KV heads of every layer (0 for a rank
// that holds no rows and returned none).
double kv_nerr(const model::KvCache& kv, const Reference& r,
               const std::vector<std::array<int64_t, 2>>& pieces, int tp_rank) {
  const model::ModelConfig c = small_llama3();
  const int64_t d = c.head_dim, kvd = int64_t(c.n_kv_heads) * d, w = int64_t(kv.n_kv_heads) * d;
  double num = 0, den = 0;
  bool bad = false;
  int64_t rows = 0;
  for (const auto& p : pieces) rows += p[1] - p[0];
  if (kv.n_tokens != rows) return INFINITY;
  for (int l = 0; l < c.n_layers; ++l)
    for (int which = 0; which < 2; ++which) {
      const std::vector<float>& got = (which ? kv.v : kv.k)[size_t(l)];
      if (int64_t(got.size()) != rows * w) return INFINITY;
      const std::vector<float>& want = (which ? r.v : r.k)[size_t(l)];
      int64_t row = 0;
      for (const auto& p : pieces)
        for (int64_t t = p[0]; t < p[1]; ++t, ++row)
          for (int64_t j = 0; j < w; ++j) {
            const float g = got[size_t(row * w + j)];
            const float e = want[size_t(t * kvd + tp_rank * w + j)];
            if (!std::isfinite(g)) bad = true;
            num = std::max(num, double(std::fabs(g - e)));
            den = std::max(den, double(std::fabs(e)));
          }
    }
  if (rows == 0) return 0.0;
  return bad || den == 0 ? INFINITY : num / den;
}

void check_grid(bool f32, runtime::GridShape shape, const model::SparseConfig* sc = nullptr,
                int64_t n_tokens = kTokens) {
  auto& w = test_world();
  const model::ModelConfig c = small_llama3();
  std::mt19937_64 rng(test_seed() + 7);
  std::vector<int32_t> tokens(static_cast<size_t>(n_tokens));
  for (auto& t : tokens) t = int32_t(rng() % uint64_t(c.vocab));
  std::optional<model::Model> host;
  if (f32) {
    auto m = model::Model::synthetic(c, test_seed());
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    host.emplace(std::move(m).value());
  }
  const Reference ref = reference(f32, host ? &*host : nullptr, tokens, sc);
  ASSERT_FALSE(ref.k.empty());

  auto g = runtime::make_grid(w, shape);
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  const int dev = w.rank();
  auto dm = make_model(f32, host ? &*host : nullptr, {shape.tp, g.value().tp_rank}, dev);
  ASSERT_TRUE(dm.is_ok()) << dm.status().to_string();
  EXPECT_EQ(dm.value().config().n_kv_heads, c.n_kv_heads / shape.tp);
  auto dg = runtime::make_device_grid(g.value(), dev);
  ASSERT_TRUE(dg.is_ok()) << dg.status().to_string();
  model::PrefillOptions o;
  o.chunk = kChunk;
  o.sparse = sc;
  o.importance_window = kImpWindow;
  auto p = runtime::DeviceParallelPrefill::plan(dm.value(), g.value(), dg.value(), n_tokens, o);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  // Twice: the second run reuses the plan's buffers (poisoned once, at plan time).
  for (int run = 0; run < 2; ++run) {
    auto res = p.value().run(tokens);
    ASSERT_TRUE(res.is_ok()) << res.status().to_string();
    const double tol = f32 ? 1e-4 : 1e-2;
    const double kv_err = kv_nerr(res.value().kv, ref, p.value().pieces(), g.value().tp_rank);
    std::printf(
        "  rank %d %s%s tp %d cp %d run %d: K/V nerr %.3g (tol %.0e), %lld bytes "
        "all-gathered, comm %.4f s, density %.4f\n",
        w.rank(), f32 ? "f32" : "bf16", sc ? (" " + sc->source).c_str() : "", shape.tp, shape.cp,
        run, kv_err, tol, (long long)res.value().stats.kv_allgather_bytes, res.value().stats.comm_s,
        res.value().stats.density);
    if (sc) {
      EXPECT_GT(res.value().stats.density, 0.05);
      EXPECT_LT(res.value().stats.density, 0.95);
    }
    EXPECT_LE(kv_err, tol) << "rank " << w.rank();
    // Importance: every rank, every KV head, from the rank holding the prompt's end.
    const auto& imp = res.value().importance;
    ASSERT_EQ(imp.size(), ref.imp.size());
    double inum = 0, iden = 0;
    for (size_t l = 0; l < imp.size(); ++l) {
      ASSERT_EQ(imp[l].size(), ref.imp[l].size()) << "layer " << l;
      for (size_t i = 0; i < imp[l].size(); ++i) {
        ASSERT_TRUE(std::isfinite(imp[l][i])) << "layer " << l << " item " << i;
        inum = testing::nan_max(inum, double(std::fabs(imp[l][i] - ref.imp[l][i])));
        iden = std::max(iden, double(std::fabs(ref.imp[l][i])));
      }
    }
    const double imp_tol = f32 ? 1e-4 : 1e-2;  // (bf16 measured up to 2.7e-3)
    std::printf("  rank %d importance nerr %.3g (tol %.0e)\n", w.rank(),
                iden > 0 ? inum / iden : INFINITY, imp_tol);
    EXPECT_GT(iden, 0.0);
    EXPECT_LE(inum / iden, imp_tol) << "rank " << w.rank();
    if (g.value().leader()) {
      const std::vector<float>& lg = res.value().logits;
      ASSERT_EQ(lg.size(), ref.logits.size());
      double num = 0, den = 0;
      for (size_t i = 0; i < lg.size(); ++i) {
        ASSERT_TRUE(std::isfinite(lg[i])) << i;
        num = std::max(num, double(std::fabs(lg[i] - ref.logits[i])));
        den = std::max(den, double(std::fabs(ref.logits[i])));
      }
      std::printf("  leader logits nerr %.3g\n", num / den);
      EXPECT_LE(num / den, tol);
      // Every logit is within tol x max|ref| of one GPU's, so the token picked must be within
      // twice that of one GPU's top logit (the same token unless one GPU's top two are closer).
      const int32_t top =
          int32_t(std::max_element(ref.logits.begin(), ref.logits.end()) - ref.logits.begin());
      const int32_t ft = res.value().first_token;
      ASSERT_TRUE(ft >= 0 && size_t(ft) < ref.logits.size()) << ft;
      EXPECT_GE(double(ref.logits[size_t(ft)]), double(ref.logits[size_t(top)]) - 2 * tol * den)
          << "first token " << ft << " against one GPU's " << top;
    }
    // Under a 64-token block a CP rank, every CP rank computes the prompt whole: no exchange.
    const bool whole = n_tokens < 2 * shape.cp * 64;
    if (shape.cp > 1 && !whole) EXPECT_GT(res.value().stats.kv_allgather_bytes, 0);
    if (whole) EXPECT_EQ(res.value().stats.kv_allgather_bytes, 0);
  }
}

TEST(DeviceParallel, Bf16SyntheticTp2) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  check_grid(false, {2, 1});
}
TEST(DeviceParallel, Bf16SyntheticCp2) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  check_grid(false, {1, 2});
}
// 50 tokens at CP 2: one 64-token block, so CP rank 1's zigzag chunks are empty. Each CP rank
// computes the prompt whole; rank 0 keeps every row, rank 1 none; logits and importance as one GPU.
TEST(DeviceParallel, F32UploadCp2ShortPrompt) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  check_grid(true, {1, 2}, nullptr, 50);
}
TEST(DeviceParallel, F32UploadTp2) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  check_grid(true, {2, 1});
}
TEST(DeviceParallel, F32UploadCp2) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  check_grid(true, {1, 2});
}

// Sparse attention on the grid. TP: each slice estimates its own heads, which is what one GPU
// does per head, so with F32 weights (the estimators see the same Q/K up to TP rounding) the
// mixed config's indices and outputs equal one GPU's. CP: each rank estimates its pieces from
// their own rows; for a-shape heads that is the one-GPU index exactly (vertical-slash heads would
// score from the piece's last queries instead: not compared). "mixed": every pattern in each
// layer (testing::mixed_sparse_config); "a-shape": a-shape on every head.
model::SparseConfig sparse_for(const char* mode) {
  model::SparseConfig sc = testing::mixed_sparse_config(small_llama3());
  if (std::string(mode) == "a-shape") {
    for (auto& layer : sc.layers)
      for (auto& p : layer) p.pattern = kernels::Pattern::kAShape;
    sc.source = "a-shape";
  }
  return sc;
}

TEST(DeviceParallel, F32UploadTp2SparseMixed) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  const model::SparseConfig sc = sparse_for("mixed");
  check_grid(true, {2, 1}, &sc);
}
TEST(DeviceParallel, Bf16SyntheticCp2SparseAShape) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  const model::SparseConfig sc = sparse_for("a-shape");
  check_grid(false, {1, 2}, &sc);
}

// A sparse index that outgrows its plan on one CP rank only: 4600 vertical columns a head at
// 5000 tokens. CP rank 0's last piece ([3750, 5000)) plans the default 4096 column slots and needs
// 4600; CP rank 1's pieces end at 2500 and 3750 keys, whose defaults hold every key. Rank 0 grows
// its plan during the run and redoes those layers' attention while rank 1 waits in the next
// exchange: the run must finish on both (no deadlock; the group reports one grow), the grown plan
// must serve a second run without growing, and a plan that starts at the grown capacity
// (PrefillOptions::sparse_capacity, each rank its own) must give the same K/V and logits. Those
// agree up to near-tie flips in the estimators' float-atomic scoring at the 4600th column (the
// smallest, nearly equal scores): the grid test's bf16 bound, 1e-2 of the largest value.
void sparse_grow_case(bool fail) {
  auto& w = test_world();
  const model::ModelConfig c = small_llama3();
  constexpr int64_t kLong = 5000;
  std::mt19937_64 rng(test_seed() + 17);
  std::vector<int32_t> tokens(static_cast<size_t>(kLong));
  for (auto& t : tokens) t = int32_t(rng() % uint64_t(c.vocab));
  model::SparseConfig sc = testing::mixed_sparse_config(c);
  for (auto& layer : sc.layers)
    for (auto& p : layer) {
      p = kernels::HeadPattern{};
      p.pattern = kernels::Pattern::kVerticalSlash;
      p.n_vertical = 4600;
      p.n_slash = 64;
    }
  // Layer 0 fits every default plan, so rank 0 outgrows its plan at layer 1, after layer 0's K/V
  // are final (the failing case's hand-over below).
  for (auto& p : sc.layers[0]) p.n_vertical = 1000;
  sc.source = "vertical-slash 1000 (layer 0), 4600";
  auto g = runtime::make_grid(w, {1, 2});
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  const int dev = w.rank();
  auto dm = make_model(false, nullptr, {1, 0}, dev);
  ASSERT_TRUE(dm.is_ok()) << dm.status().to_string();
  auto dg = runtime::make_device_grid(g.value(), dev);
  ASSERT_TRUE(dg.is_ok()) << dg.status().to_string();
  model::PrefillOptions o;
  o.chunk = kChunk;
  o.sparse = &sc;
  if (fail) {
    // No grow allowed: rank 0 fails at layer 1 and must keep rank 1 in step (the rest of the
    // layers' exchanges without attention), so both return at once with the group's error
    // instead of rank 1 waiting in an exchange until the communicator's deadline aborts it.
    // With a one-slot K/V ring, rank 0 lands layer 0 while it enqueues layer 1: its run's
    // kv_hooks name layer 0 final and no layer after the failure (the layers it enqueues to keep
    // in step are not the prompt's), and each rank's failed run hands its K/V over once, with
    // the named rows in place.
    model::PrefillOptions no_grow = o;
    no_grow.sparse_max_grows = 0;
    no_grow.kv_staging_layers = 1;
    auto pf = runtime::DeviceParallelPrefill::plan(dm.value(), g.value(), dg.value(), kLong,
                                                   no_grow);
    ASSERT_TRUE(pf.is_ok()) << pf.status().to_string();
    std::vector<int> named;
    std::vector<const float*> named_at;
    model::KvCache handed;
    int n_handed = 0;
    model::LayerKvHooks hooks;
    hooks.final = [&](int l, const model::KvCache& kv, std::span<const float>) {
      named.push_back(l);
      named_at.push_back(kv.k[size_t(l)].data());
    };
    hooks.failed = [&](model::KvCache&& kv) {
      handed = std::move(kv);
      ++n_handed;
    };
    const auto t0 = std::chrono::steady_clock::now();
    auto r = pf.value().run(tokens, hooks);
    const double s = sf::seconds_since(t0);
    ASSERT_FALSE(r.is_ok());
    std::printf("  rank %d: failed in %.2f s: %s; layers named final:", w.rank(), s,
                r.status().message().c_str());
    for (const int l : named) std::printf(" %d", l);
    std::printf("\n");
    EXPECT_LT(s, 20.0);
    const std::string want = g.value().cp_rank == 0 ? "sparse_max_grows" : "another rank";
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().to_string();
    if (g.value().cp_rank == 0) EXPECT_EQ(named, std::vector<int>{0});
    EXPECT_EQ(n_handed, 1);
    ASSERT_EQ(handed.k.size(), size_t(c.n_layers));
    for (size_t i = 0; i < named.size(); ++i)
      EXPECT_EQ(handed.k[size_t(named[i])].data(), named_at[i]) << "layer " << named[i];
    // The group's communicators are intact: a plan that may grow runs next.
  }
  auto p = runtime::DeviceParallelPrefill::plan(dm.value(), g.value(), dg.value(), kLong, o);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  const std::array<int, 2> planned = p.value().prefill().sparse_capacity();
  auto grown = p.value().run(tokens);
  ASSERT_TRUE(grown.is_ok()) << grown.status().to_string();
  const std::array<int, 2> cap = p.value().prefill().sparse_capacity();
  std::printf("  rank %d cp 2: capacity {%d, %d} -> {%d, %d}, need {%d, %d}, group grows %d\n",
              w.rank(), planned[0], planned[1], cap[0], cap[1],
              p.value().prefill().sparse_need()[0], p.value().prefill().sparse_need()[1],
              grown.value().stats.sparse_grows);
  EXPECT_EQ(grown.value().stats.sparse_grows, 1);
  if (g.value().cp_rank == 0) {
    EXPECT_GT(cap[1], planned[1]);  // this rank grew
    EXPECT_GE(cap[1], 4600);
  } else {
    EXPECT_EQ(cap, planned);  // its peer did not
  }
  auto again = p.value().run(tokens);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(again.value().stats.sparse_grows, 0);
  model::PrefillOptions big = o;
  big.sparse_capacity = cap;
  auto p2 = runtime::DeviceParallelPrefill::plan(dm.value(), g.value(), dg.value(), kLong, big);
  ASSERT_TRUE(p2.is_ok()) << p2.status().to_string();
  auto once = p2.value().run(tokens);
  ASSERT_TRUE(once.is_ok()) << once.status().to_string();
  EXPECT_EQ(once.value().stats.sparse_grows, 0);
  const auto nerr = [](const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() != b.size() || a.empty()) return double(INFINITY);
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return double(INFINITY);
      num = std::max(num, double(std::fabs(a[i] - b[i])));
      den = std::max(den, double(std::fabs(b[i])));
    }
    return den > 0 ? num / den : double(INFINITY);
  };
  double worst = 0;
  ASSERT_EQ(grown.value().kv.k.size(), size_t(c.n_layers));
  ASSERT_EQ(once.value().kv.k.size(), size_t(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    worst = std::max(worst, nerr(grown.value().kv.k[size_t(l)], once.value().kv.k[size_t(l)]));
    worst = std::max(worst, nerr(grown.value().kv.v[size_t(l)], once.value().kv.v[size_t(l)]));
  }
  std::printf("  rank %d: grown-in-run against planned-big K/V nerr %.3g, density %.4f / %.4f\n",
              w.rank(), worst, grown.value().stats.density, once.value().stats.density);
  EXPECT_LE(worst, 1e-2) << "rank " << w.rank();
  EXPECT_NEAR(grown.value().stats.density, once.value().stats.density, 1e-3);
  if (g.value().leader()) {
    const double le = nerr(grown.value().logits, once.value().logits);
    std::printf("  leader logits nerr %.3g\n", le);
    EXPECT_LE(le, 1e-2);
  }
}

TEST(DeviceParallel, Bf16Cp2SparseGrowsOnOneRank) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  sparse_grow_case(false);
}
// The same grid where the grow is not allowed (PrefillOptions::sparse_max_grows 0), then the
// growing run on the same communicators.
TEST(DeviceParallel, Bf16Cp2SparseGrowFailureKeepsTheGroupInStep) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  sparse_grow_case(true);
}

// Overlapped TP (the default: per-chunk all-reduces enqueued on NCCL's stream behind events)
// against the blocking all-reduce of every row after a drain: with two slices each sum is one
// fp32 addition, whose result does not depend on when or in which pieces it runs, so logits and
// K/V must agree bit for bit, on every rank. The overlapped run stages its K/V through a
// one-slot pinned ring (kv_staging_layers 1), the blocking one through a slot per layer.
TEST(DeviceParallel, Bf16Tp2OverlapEqualsBlocking) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  auto& w = test_world();
  const model::ModelConfig c = small_llama3();
  std::mt19937_64 rng(test_seed() + 11);
  std::vector<int32_t> tokens(static_cast<size_t>(kTokens));
  for (auto& t : tokens) t = int32_t(rng() % uint64_t(c.vocab));
  auto g = runtime::make_grid(w, {2, 1});
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  const int dev = w.rank();
  auto dm = make_model(false, nullptr, {2, g.value().tp_rank}, dev);
  ASSERT_TRUE(dm.is_ok()) << dm.status().to_string();
  auto dg = runtime::make_device_grid(g.value(), dev);
  ASSERT_TRUE(dg.is_ok()) << dg.status().to_string();
  model::PrefillOptions o;
  o.chunk = kChunk;
  std::vector<runtime::ParallelResult> res;
  for (bool overlap : {true, false}) {
    runtime::DeviceParallelOptions po;
    po.overlap_tp = overlap;
    // The overlapped run also stages K/V through one pinned slot (its landings wait on copies
    // behind the TP sums, under the communicator's deadline): the same bytes either way.
    o.kv_staging_layers = overlap ? 1 : 0;
    auto p =
        runtime::DeviceParallelPrefill::plan(dm.value(), g.value(), dg.value(), kTokens, o, po);
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    auto r = p.value().run(tokens);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    std::printf("  rank %d tp 2 %s: %.4f s, host waited on comm %.4f s\n", w.rank(),
                overlap ? "overlapped" : "blocking", r.value().stats.seconds,
                r.value().stats.comm_s);
    res.push_back(std::move(r).value());
  }
  EXPECT_EQ(res[0].logits, res[1].logits);
  EXPECT_EQ(res[0].first_token, res[1].first_token);
  ASSERT_EQ(res[0].kv.k.size(), size_t(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    EXPECT_EQ(res[0].kv.k[size_t(l)], res[1].kv.k[size_t(l)]) << "layer " << l;
    EXPECT_EQ(res[0].kv.v[size_t(l)], res[1].kv.v[size_t(l)]) << "layer " << l;
  }
}

// The sharded export of a grid's run (runtime::export_sharded: every rank writes the shards of
// its own rows and KV heads, the leader the manifest) loads, through the decode client, as the
// one-GPU run's whole-cache export: exactly for CP 2, within 1e-4 x max for TP 2 (F32 weights).
// bf16_host: the ranks keep their K/V in bf16 (PrefillOptions::kv_host_bf16), exported as the
// one-GPU run's K/V rounded to bf16 (exactly, for CP 2).
void check_sharded_export(runtime::GridShape shape, bool bf16_host = false) {
  auto& w = test_world();
  const model::ModelConfig c = small_llama3();
  std::mt19937_64 rng(test_seed() + 13);
  std::vector<int32_t> tokens(static_cast<size_t>(kTokens));
  for (auto& t : tokens) t = int32_t(rng() % uint64_t(c.vocab));
  auto m = model::Model::synthetic(c, test_seed());
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  const Reference ref = reference(true, &m.value(), tokens, nullptr);
  ASSERT_FALSE(ref.k.empty());
  kvstore::KvExportSpec spec = kvstore::model_export_spec(m.value());
  spec.n_tokens = kTokens;
  spec.token_ids = tokens;
  spec.first_token =
      int32_t(std::max_element(ref.logits.begin(), ref.logits.end()) - ref.logits.begin());
  const std::string base = "/tmp/sf-device-parallel-" + std::to_string(test_seed()) + "-" +
                           std::to_string(shape.tp) + "x" + std::to_string(shape.cp);
  std::vector<std::vector<float>> rk = ref.k, rv = ref.v;  // bf16_host: rounded
  if (bf16_host)
    for (auto* side : {&rk, &rv})
      for (auto& layer : *side)
        for (float& x : layer) x = round_to_bf16(x);
  if (w.rank() == 0) {
    const Status st = kvstore::export_kv(
        base + "/whole", spec, [&](int l, bool v) { return (v ? rv : rk)[size_t(l)].data(); },
        true);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  auto g = runtime::make_grid(w, shape);
  ASSERT_TRUE(g.is_ok());
  const int dev = w.rank();
  auto dm = make_model(true, &m.value(), {shape.tp, g.value().tp_rank}, dev);
  ASSERT_TRUE(dm.is_ok()) << dm.status().to_string();
  auto dg = runtime::make_device_grid(g.value(), dev);
  ASSERT_TRUE(dg.is_ok()) << dg.status().to_string();
  model::PrefillOptions o;
  o.chunk = kChunk;
  o.kv_host_bf16 = bf16_host;
  auto p = runtime::DeviceParallelPrefill::plan(dm.value(), g.value(), dg.value(), kTokens, o);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  auto res = p.value().run(tokens);
  ASSERT_TRUE(res.is_ok()) << res.status().to_string();
  EXPECT_EQ(res.value().first_token, spec.first_token);
  EXPECT_EQ(res.value().kv.bf16(), bf16_host);
  const Status st = runtime::export_sharded(g.value(), base + "/sharded", spec, res.value().kv);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  if (w.rank() != 0) return;
  const std::string hash = decode::model_compat_hash(m.value());
  auto whole = decode::load_kv_export(base + "/whole", hash);
  auto sharded = decode::load_kv_export(base + "/sharded", hash);
  ASSERT_TRUE(whole.is_ok()) << whole.status().to_string();
  ASSERT_TRUE(sharded.is_ok()) << sharded.status().to_string();
  double num = 0, den = 0;
  for (int l = 0; l < c.n_layers; ++l)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const decode::HeadKv& a = sharded->head(l, h);
      const decode::HeadKv& b = whole->head(l, h);
      ASSERT_EQ(a.positions, b.positions);
      ASSERT_EQ(a.k.size(), b.k.size());
      for (size_t i = 0; i < a.k.size(); ++i) {
        num =
            std::max({num, double(std::fabs(a.k[i] - b.k[i])), double(std::fabs(a.v[i] - b.v[i]))});
        den = std::max({den, double(std::fabs(b.k[i])), double(std::fabs(b.v[i]))});
      }
      ASSERT_EQ(a.block_kmin.size(), b.block_kmin.size());
    }
  std::printf("  sharded export tp %d cp %d%s: %zu files, K/V max |diff| / max = %.3g\n", shape.tp,
              shape.cp, bf16_host ? " (bf16 host K/V)" : "",
              size_t(std::distance(std::filesystem::directory_iterator(base + "/sharded"),
                                   std::filesystem::directory_iterator{})),
              num / den);
  EXPECT_LE(num / den, shape.tp > 1 ? 1e-4 : 0.0);
  std::error_code ec;
  std::filesystem::remove_all(base, ec);
}

TEST(DeviceParallel, ShardedExportOfCp2EqualsOneGpu) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  check_sharded_export({1, 2});
}
TEST(DeviceParallel, ShardedExportOfCp2Bf16HostKvEqualsOneGpuRounded) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  check_sharded_export({1, 2}, /*bf16_host=*/true);
}
TEST(DeviceParallel, ShardedExportOfTp2EqualsOneGpu) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  check_sharded_export({2, 1});
}

TEST(DeviceParallel, RejectsAMismatchedSlice) {
  if (!have_gpus()) GTEST_SKIP() << "needs one GPU per rank";
  auto& w = test_world();
  auto g = runtime::make_grid(w, {2, 1});
  ASSERT_TRUE(g.is_ok());
  const int dev = w.rank();
  // The other rank's slice: planning must refuse before any collective.
  auto dm = model::DeviceModel::synthetic(small_llama3(), 1, DType::kBF16, dev,
                                          {2, 1 - g.value().tp_rank});
  ASSERT_TRUE(dm.is_ok()) << dm.status().to_string();
  auto dg = runtime::make_device_grid(g.value(), dev);
  ASSERT_TRUE(dg.is_ok()) << dg.status().to_string();
  auto p = runtime::DeviceParallelPrefill::plan(dm.value(), g.value(), dg.value(), kTokens, {});
  ASSERT_FALSE(p.is_ok());
  EXPECT_NE(p.status().message().find("slice"), std::string::npos) << p.status().message();
}

}  // namespace
}  // namespace sf
