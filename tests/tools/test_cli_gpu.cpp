// `sparsefill prefill --device cuda` end to end (label gpu; skips without a device): a tiny Llama
// GGUF written here (no model travels to the GPU host), 2,048 prompt tokens, a sparse config that
// gives every head of both layers a different sparse pattern, and an export under a scored
// retention (snapkv). The same command on the CPU is the reference:
// - both runs report a density under 0.9 (the sparse path ran, not dense), within 0.05 of each
//   other (the device estimators pick the CPU's indices up to ties of BF16 scores);
// - the GPU export loads through the decode client with the model's hash, keeps 256 tokens a
//   head with per-block importance from the device's LSE pass (an export without importance
//   cannot apply snapkv at all);
// - layer 0's kept K/V rows equal the CPU full export's rows at the same positions within 1e-2 of
//   their max (BF16 weights against F32: the GPU forward test's bound; layer 0's K/V do not
//   depend on attention). Layer 1's depend on sparse layer 0, whose device picks differ from the
//   CPU's at ties of BF16 scores (this random model's attention is nearly flat, so ties are
//   common), which moves whole rows: they are printed, not bounded (bounds of 5e-2 on the worst
//   element and 1e-2 on nerr failed at 0.0515 and 0.013 with equal densities). test_gpu_forward
//   bounds the sparse forward on one index;
// - the same export with dense attention bounds every layer's kept rows by 1e-2 of their max
//   against the CPU's dense full export (as test_worker_gpu does for the worker);
// - the kept positions shared with the CPU's own snapkv export are printed, not bounded;
// - the dense GPU run tiers its KV from device memory (--kv-pool device=,host=): 4 blocks a layer
//   stay on the device, the other 28 go to pinned host, and its export (bounded above) is read
//   back from those blocks: the forward keeps no host copy of the KV;
// - the same run with a disk tier under host (--kv-pool device=,host=,disk=) keeps 4 blocks a
//   layer on the device, 4 on host and drains the other 24 to disk while later layers compute;
//   its export is byte for byte the two-tier run's.
// - those GPU runs pin --kv-dtype f32; one more dense GPU run without it exports bf16 (auto, the
//   device forward's dtype), every value the f32 export's rounded to nearest.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <utility>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "decode/decode_session.h"
#include "decode/kv_client.h"
#include "tests/common/subprocess.h"
#include "tests/common/test_seed.h"
#include "tests/worker/model/gguf_builder.h"
#include "tests/worker/model/model_test_util.h"
#include "worker/model/device_model.h"
#include "worker/model/model.h"
#include "tests/common/nan_max.h"

namespace sf {
namespace {
namespace fs = std::filesystem;

double reported_density(const std::string& log) {
  std::smatch m;
  static const std::regex re("density ([0-9.]+),");
  return std::regex_search(log, m, re) ? std::stod(m[1]) : -1.0;
}

// A synthetic model of cfg written as DIR/tiny.gguf (*model its path) and n random token ids of
// its vocabulary as DIR/prompt.txt (the CLI's --prompt-tokens), both from seed.
void write_model_and_prompt(const fs::path& dir, const model::ModelConfig& cfg, uint64_t seed,
                            int n, std::string* model) {
  auto synth = model::Model::synthetic(cfg, seed);
  ASSERT_TRUE(synth.is_ok()) << synth.status().to_string();
  *model = testing::write_llama_gguf((dir / "tiny.gguf").string(), synth.value(), cfg.name);
  std::mt19937_64 rng(seed + 1);
  std::ofstream t(dir / "prompt.txt");
  for (int i = 0; i < n; ++i) t << (rng() % uint64_t(cfg.vocab)) << ' ';
}

TEST(CliGpu, SparsePrefillWithImportanceExportsWhatTheCpuDoes) {
  const uint64_t seed = testing::fresh_seed();  // printed; SF_TEST_SEED replays it
  const fs::path dir = fs::temp_directory_path() / ("sf-cli-gpu-" + std::to_string(seed));
  fs::create_directories(dir);
  const model::ModelConfig cfg = testing::tiny_gpu_config("tiny-gpu-cli");
  std::string model;
  ASSERT_NO_FATAL_FAILURE(write_model_and_prompt(dir, cfg, seed, 2048, &model));
  // One pattern a head, the same in both layers: every device estimator family runs.
  {
    const std::string head[4] = {
        R"({"pattern":"vertical-slash","sink":64,"local":64,"n_vertical":64,"n_slash":128})",
        R"({"pattern":"block-sparse","sink":64,"local":64,"n_blocks":4})",
        R"({"pattern":"adaptive-vs","sink":64,"local":64,"gamma":0.9,"min_budget":64})",
        R"({"pattern":"a-shape","sink":64,"local":256})"};
    std::string layer = "[" + head[0] + "," + head[1] + "," + head[2] + "," + head[3] + "]";
    std::ofstream(dir / "sparse.json")
        << R"({"format":"sparsefill-pattern-config","model":"tiny-gpu-cli","n_layers":2,)"
        << R"("n_heads":4,"dense_below":512,"layers":[)" << layer << "," << layer << "]}";
  }
  const std::string cli = SF_CLI_BIN;
  const std::string base = cli + " prefill --model " + model + " --prompt-tokens " +
                           (dir / "prompt.txt").string();
  const std::string common = base + " --force";  // with --export-kv: replaces an earlier run's
  const std::string sparse = " --attention config:" + (dir / "sparse.json").string();
  const std::string snap = " --retention snapkv:budget=256";
  struct Run {
    std::string name, args;
  };
  // The CPU references run everywhere (they test the CLI's sparse export on a GGUF without a
  // tokenizer); the GPU runs and the comparisons only where there is a device.
  const Status dev = model::cuda_device_check(0);
  // The dense GPU run also tiers its KV from device memory: 4 blocks a layer on the device, the
  // other 28 of 32 on pinned host.
  const int64_t block_bytes = int64_t(2) * 64 * cfg.n_kv_heads * cfg.head_dim * 4;
  const std::string pool = " --kv-pool device=" + std::to_string(4 * cfg.n_layers * block_bytes) +
                           ",host=" + std::to_string(32 * cfg.n_layers * block_bytes);
  // Three tiers: the host holds two layers' landings (28 blocks each), a swap block and 4 blocks
  // a placed layer keeps; the disk takes the rest.
  const std::string pool3 = " --kv-pool device=" + std::to_string(4 * cfg.n_layers * block_bytes) +
                            ",host=" + std::to_string((4 * cfg.n_layers + 2 * 28 + 1) * block_bytes) +
                            ",disk=" + (dir / "disk-tier").string();
  std::vector<Run> runs{{"cpu-full", " --device cpu" + sparse},
                        {"cpu-snap", " --device cpu" + sparse + snap}};
  if (dev.is_ok())
    // The GPU runs pin --kv-dtype f32 so the comparisons below bound the forward's K/V; the
    // "auto" run takes the default (bf16 on the device) and must be exactly gpu-dense rounded.
    for (const Run& r : {Run{"gpu-snap", " --device cuda --kv-dtype f32" + sparse + snap},
                         Run{"cpu-dense", " --device cpu"},
                         Run{"gpu-dense", " --device cuda --kv-dtype f32" + snap + pool},
                         Run{"gpu-dense3", " --device cuda --kv-dtype f32" + snap + pool3},
                         Run{"gpu-dense-auto", " --device cuda" + snap}})
      runs.push_back(r);
  for (const Run& r : runs) {
    const std::string log = (dir / (r.name + ".log")).string();
    ASSERT_EQ(testing::run_logged(common + r.args + " --export-kv " + (dir / r.name).string(), log), 0)
        << r.name << ":\n" << testing::slurp(log);
  }
  const double d_cpu = reported_density(testing::slurp((dir / "cpu-snap.log").string()));
  if (!dev.is_ok()) {
    EXPECT_GT(d_cpu, 0.0);
    EXPECT_LT(d_cpu, 0.9);
    std::error_code ec;
    fs::remove_all(dir, ec);
    GTEST_SKIP() << "no CUDA device: " << dev.message() << " (CPU density " << d_cpu << ")";
  }
  const double d_gpu = reported_density(testing::slurp((dir / "gpu-snap.log").string()));
  std::printf("  density: cpu %.3f gpu %.3f\n", d_cpu, d_gpu);
  EXPECT_GT(d_gpu, 0.0);
  EXPECT_LT(d_gpu, 0.9) << testing::slurp((dir / "gpu-snap.log").string());
  EXPECT_LT(d_cpu, 0.9);
  // Ties of BF16 scores move a few picks: 0.005 at most over 67 suite runs, so bound 0.02.
  EXPECT_NEAR(d_gpu, d_cpu, 0.02);
  {
    const std::string log = testing::slurp((dir / "gpu-dense.log").string());
    std::smatch pm;
    const std::regex pool_re("kv pool: device ([0-9]+) blocks .*host ([0-9]+) blocks .*moved device->host ([0-9]+)");
    ASSERT_TRUE(std::regex_search(log, pm, pool_re)) << log;
    std::printf("  gpu-dense --kv-pool: device %s blocks, host %s blocks, %s swapped\n",
                pm[1].str().c_str(), pm[2].str().c_str(), pm[3].str().c_str());
    EXPECT_EQ(std::stoll(pm[1]), 4 * cfg.n_layers);
    EXPECT_EQ(std::stoll(pm[2]), 28 * cfg.n_layers);
    // The export reads the pool (device and host blocks): the forward keeps no host copy.
    EXPECT_NE(log.find("the forward held at most 0 bytes of KV"), std::string::npos) << log;
    // A host budget one block short of the rest plus the swap block is refused before the
    // prefill, with the size it needs.
    const std::string short_pool = " --kv-pool device=" + std::to_string(4 * cfg.n_layers * block_bytes) +
                                   ",host=" + std::to_string(28 * cfg.n_layers * block_bytes);
    const std::string slog = (dir / "short-host.log").string();
    EXPECT_NE(testing::run_logged(base + " --device cuda" + short_pool, slog), 0);
    const std::string need = "--kv-pool: tiered kv: the host tier holds " +
                             std::to_string(28 * cfg.n_layers) + " blocks of " + std::to_string(block_bytes) +
                             " bytes; 2048 tokens need " + std::to_string(28 * cfg.n_layers) +
                             " beyond the device's share, plus one to swap through: a host budget of " +
                             std::to_string((28 * cfg.n_layers + 1) * block_bytes) + " bytes or more";
    EXPECT_NE(testing::slurp(slog).find(need), std::string::npos) << testing::slurp(slog);
  }
  {
    const std::string log = testing::slurp((dir / "gpu-dense3.log").string());
    std::smatch pm;
    const std::regex pool_re("kv pool: device ([0-9]+) blocks .*host ([0-9]+) blocks .*disk ([0-9]+) blocks "
                             ".*host->disk ([0-9]+) \\(the forward waited [0-9.]+ s for host room\\);");
    ASSERT_TRUE(std::regex_search(log, pm, pool_re)) << log;
    std::printf("  gpu-dense three tiers: device %s, host %s, disk %s blocks (%s drained)\n", pm[1].str().c_str(),
                pm[2].str().c_str(), pm[3].str().c_str(), pm[4].str().c_str());
    EXPECT_EQ(std::stoll(pm[1]), 4 * cfg.n_layers);
    EXPECT_EQ(std::stoll(pm[2]), 4 * cfg.n_layers);
    EXPECT_EQ(std::stoll(pm[3]), 24 * cfg.n_layers);
    EXPECT_EQ(std::stoll(pm[4]), 24 * cfg.n_layers);
    EXPECT_NE(log.find("the forward held at most 0 bytes of KV"), std::string::npos) << log;
    // Every shard of the export equals the two-tier run's, byte for byte.
    int shards = 0;
    for (const auto& e : fs::directory_iterator(dir / "gpu-dense")) {
      if (e.path().extension() != ".safetensors") continue;
      ++shards;
      EXPECT_EQ(testing::slurp(e.path().string()),
                testing::slurp((dir / "gpu-dense3" / e.path().filename()).string()))
          << e.path().filename();
    }
    EXPECT_GT(shards, 0);
  }

  auto m = model::Model::load(model);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  const std::string hash = decode::model_compat_hash(m.value());
  auto full = decode::load_kv_export((dir / "cpu-full").string(), hash);
  auto cs = decode::load_kv_export((dir / "cpu-snap").string(), hash);
  auto dense = decode::load_kv_export((dir / "cpu-dense").string(), hash);
  ASSERT_TRUE(full.is_ok() && cs.is_ok() && dense.is_ok());
  const int64_t d = cfg.head_dim;
  // Layer by layer: the kept rows of a GPU snapkv export against a CPU full export's rows at the
  // same positions (max |diff| / max and nerr), layers listed in `bounded` held to 1e-2 of max.
  auto compare = [&](const std::string& name, const decode::KvExport& ref,
                     std::vector<int> bounded) {
    auto g = decode::load_kv_export((dir / name).string(), hash);
    ASSERT_TRUE(g.is_ok()) << name << ": " << g.status().to_string();
    EXPECT_EQ(g->retention_policy, "snapkv");
    int64_t same = 0, kept = 0;
    for (int l = 0; l < cfg.n_layers; ++l) {
      double num = 0, den = 0, sq_err = 0, sq_ref = 0;
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        const decode::HeadKv& a = g->head(l, h);
        const decode::HeadKv& f = ref.head(l, h);
        ASSERT_EQ(a.positions.size(), 256u) << name << " layer " << l << " head " << h;
        ASSERT_FALSE(a.block_importance.empty()) << name << " layer " << l << " head " << h;
        for (size_t i = 0; i < a.positions.size(); ++i)
          for (int64_t j = 0; j < d; ++j) {
            const size_t gi = i * size_t(d) + size_t(j);
            const size_t fi = size_t(a.positions[i]) * size_t(d) + size_t(j);
            const double ek = double(a.k[gi]) - f.k[fi], ev = double(a.v[gi]) - f.v[fi];
            num = testing::nan_max(testing::nan_max(num, std::fabs(ek)), std::fabs(ev));
            den = std::max({den, double(std::fabs(f.k[fi])), double(std::fabs(f.v[fi]))});
            sq_err += ek * ek + ev * ev;
            sq_ref += double(f.k[fi]) * f.k[fi] + double(f.v[fi]) * f.v[fi];
          }
        const auto& cp = cs->head(l, h).positions;
        for (int32_t p : a.positions) same += std::binary_search(cp.begin(), cp.end(), p);
        kept += int64_t(a.positions.size());
      }
      std::printf("  %s layer %d: kept K/V vs CPU full rows, max |diff| / max = %.3g, nerr %.3g\n",
                  name.c_str(), l, num / den, std::sqrt(sq_err / sq_ref));
      if (std::find(bounded.begin(), bounded.end(), l) != bounded.end())
        EXPECT_LE(num / den, 1e-2) << name << " layer " << l;
    }
    std::printf("  %s: kept positions shared with the CPU's sparse snapkv export %.3f\n",
                name.c_str(), double(same) / double(kept));
  };
  compare("gpu-snap", full.value(), {0});
  compare("gpu-dense", dense.value(), {0, 1});
  {
    // --kv-dtype auto on the device is bf16, and each stored value is the F32 export's value
    // rounded to nearest (the same tokens kept: importance does not depend on the encoding).
    auto a = decode::load_kv_export((dir / "gpu-dense-auto").string(), hash);
    auto f = decode::load_kv_export((dir / "gpu-dense").string(), hash);
    ASSERT_TRUE(a.is_ok() && f.is_ok()) << a.status().to_string();
    EXPECT_EQ(f->kv_dtype, "f32");
    EXPECT_EQ(a->kv_dtype, "bf16");
    int64_t values = 0, differ = 0, rounded = 0;
    for (int l = 0; l < cfg.n_layers; ++l)
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        const decode::HeadKv& x = a->head(l, h);
        const decode::HeadKv& y = f->head(l, h);
        ASSERT_EQ(x.positions, y.positions) << "layer " << l << " head " << h;
        ASSERT_EQ(x.k.size(), y.k.size());
        for (size_t i = 0; i < x.k.size(); ++i)
          for (const auto& [got, src] : {std::pair{x.k[i], y.k[i]}, std::pair{x.v[i], y.v[i]}}) {
            ++values;
            differ += got != round_to_bf16(src);
            rounded += got != src;
          }
      }
    std::printf("  gpu-dense-auto (bf16): %lld values, %lld differ from the f32 export rounded, "
                "%lld changed by rounding\n",
                static_cast<long long>(values), static_cast<long long>(differ),
                static_cast<long long>(rounded));
    EXPECT_EQ(differ, 0);
    EXPECT_GT(rounded, values / 2);  // real F32 values, not already bf16
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// The tokens line of a sparsefill-decode log ("" when there is none).
std::string decoded_tokens(const std::string& log) {
  std::smatch m;
  static const std::regex re("\ntokens:([ 0-9]+)\n");
  return std::regex_search(log, m, re) ? m[1].str() : std::string();
}

// sparsefill-decode --device auto on a GPU without room for it (this process holds all but a few
// MiB of the device's memory) decodes on the CPU, says why in one note, and gives the CPU's
// tokens; before, a device out-of-memory failed the command.
TEST(CliGpu, DecodeAutoFallsBackToTheCpuWhenTheDeviceIsFull) {
  const Status dev = model::cuda_device_check(0);
  if (!dev.is_ok()) GTEST_SKIP() << "no CUDA device: " << dev.message();
  const uint64_t seed = testing::fresh_seed();
  const fs::path dir = fs::temp_directory_path() / ("sf-cli-gpu-oom-" + std::to_string(seed));
  fs::create_directories(dir);
  const model::ModelConfig cfg = testing::tiny_gpu_config("tiny-gpu-oom");
  std::string model;
  ASSERT_NO_FATAL_FAILURE(write_model_and_prompt(dir, cfg, seed, 300, &model));
  const std::string kv = (dir / "kv").string();
  ASSERT_EQ(testing::run_logged(std::string(SF_CLI_BIN) + " prefill --model " + model +
                                    " --prompt-tokens " + (dir / "prompt.txt").string() +
                                    " --device cpu --export-kv " + kv,
                                (dir / "prefill.log").string()),
            0)
      << testing::slurp((dir / "prefill.log").string());
  const std::string decode = std::string(SF_DECODE_BIN) + " --model " + model + " --kv " + kv +
                             " --tokens 8 --device ";
  ASSERT_EQ(testing::run_logged(decode + "cpu", (dir / "cpu.log").string()), 0)
      << testing::slurp((dir / "cpu.log").string());
  const std::string want = decoded_tokens(testing::slurp((dir / "cpu.log").string()));
  ASSERT_FALSE(want.empty()) << testing::slurp((dir / "cpu.log").string());

  // Fill the device: large pieces, then smaller ones, until less than 8 MiB is free.
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  std::vector<void*> held;
  size_t free_b = 0, total_b = 0;
  for (size_t piece = size_t(1) << 30; piece >= (size_t(1) << 20); piece /= 4) {
    while (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && free_b > piece + (8u << 20)) {
      void* p = nullptr;
      if (cudaMalloc(&p, piece) != cudaSuccess) {
        (void)cudaGetLastError();
        break;
      }
      held.push_back(p);
    }
  }
  free_b = total_b;  // (stays "not full" should the query fail)
  const cudaError_t got = cudaMemGetInfo(&free_b, &total_b);
  const int rc = testing::run_logged(decode + "auto", (dir / "auto.log").string());
  for (void* p : held) cudaFree(p);
  EXPECT_EQ(got, cudaSuccess) << cudaGetErrorString(got);
  const std::string log = testing::slurp((dir / "auto.log").string());
  std::printf("  device: %zu MiB of %zu held (this process and others), %zu MiB free during the "
              "run; auto: exit %d\n",
              size_t(total_b - free_b) >> 20, size_t(total_b) >> 20, size_t(free_b) >> 20, rc);
  EXPECT_LT(free_b, size_t(64) << 20) << "the device was not full: the case did not run";
  ASSERT_EQ(rc, 0) << log;
  EXPECT_NE(log.find("note: decoding on cpu: "), std::string::npos) << log;
  EXPECT_EQ(decoded_tokens(log), want) << log;
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace sf
