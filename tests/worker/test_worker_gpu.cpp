// sparsefill-worker --device cuda end to end (label gpu; skips with fewer than two GPUs): a tiny
// Llama GGUF written here (no model needs to travel to the GPU host), a batch of token lines,
// and the job run under mpiexec on two GPUs as CP 2 and as TP 2, against the CPU worker on one
// rank. Each GPU export (sharded: one shard per layer from each rank) must load through the
// decode client and hold the CPU export's K/V within 1e-2 x max (BF16 weights on the GPU against
// the F32 CPU forward: the GPU forward test's bound), positions identical.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "decode/decode_session.h"
#include "decode/kv_client.h"
#include "tests/worker/model/gguf_builder.h"
#include "tests/worker/model/model_test_util.h"
#include "worker/model/model.h"

namespace sf {
namespace {
namespace fs = std::filesystem;

// Head dim 64, 4 query / 2 KV heads (TP 2 divides both and the intermediate size), 2 layers.
model::ModelConfig tiny_gpu_config() {
  model::ModelConfig c = testing::tiny_config(2);
  c.name = "tiny-gpu-worker";
  c.hidden = 256;
  c.head_dim = 64;  // the device forward's attention: head_dim 64 or 128
  c.intermediate = 512;
  c.vocab = 512;
  c.tied_embeddings = true;
  return c;
}

std::string write_gguf(const std::string& path, uint64_t seed) {
  const model::ModelConfig cfg = tiny_gpu_config();
  auto m = model::Model::synthetic(cfg, seed);
  EXPECT_TRUE(m.is_ok());
  testing::GgufBuilder b;
  testing::add_llama(b, m.value(), cfg.name);
  const auto bytes = b.build();
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  return path;
}

int run(const std::string& cmd, const std::string& log) {
  const int rc = std::system((cmd + " >" + log + " 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

TEST(WorkerGpu, ShardedGpuExportsMatchTheCpuWorker) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2)
    GTEST_SKIP() << "needs two GPUs (found " << n << ")";
  const uint64_t seed = std::random_device{}();
  std::printf("  seed=%llu\n", static_cast<unsigned long long>(seed));
  const fs::path dir = fs::temp_directory_path() / ("sf-worker-gpu-" + std::to_string(seed));
  fs::create_directories(dir);
  const std::string model = write_gguf((dir / "tiny.gguf").string(), seed);
  {
    std::mt19937_64 rng(seed + 1);
    std::ofstream b(dir / "batch.jsonl");
    for (const char* id : {"a", "b"}) {
      b << "{\"id\": \"" << id << "\", \"tokens\": [";
      for (int i = 0; i < 700; ++i) b << (i ? ", " : "") << rng() % 512;
      b << "]}\n";
    }
  }
  const std::string worker = SF_WORKER_BIN, mpiexec = SF_MPIEXEC;
  const std::string common = " --model " + model + " --batch " + (dir / "batch.jsonl").string();
  ASSERT_EQ(run(mpiexec + " --oversubscribe -np 1 " + worker + common + " --out " +
                    (dir / "cpu").string(),
                (dir / "cpu.log").string()),
            0)
      << slurp((dir / "cpu.log").string());
  auto m = model::Model::load(model);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  const std::string hash = decode::model_compat_hash(m.value());
  for (const char* grid : {"--cp 2", "--tp 2"}) {
    const std::string out = (dir / (std::string("gpu") + grid[2] + grid[3])).string();
    const std::string log = out + ".log";
    ASSERT_EQ(run(mpiexec + " --oversubscribe -np 2 " + worker + common + " " + grid +
                      " --device cuda --out " + out,
                  log),
              0)
        << slurp(log);
    for (const char* id : {"a", "b"}) {
      EXPECT_TRUE(fs::exists(out + "/" + id + "/layer_001.r1.safetensors")) << grid;
      EXPECT_NE(slurp(out + "/" + id + ".json").find("\"device\": \"cuda\""), std::string::npos);
      auto g = decode::load_kv_export(out + "/" + id, hash);
      auto c = decode::load_kv_export((dir / "cpu").string() + "/" + id, hash);
      ASSERT_TRUE(g.is_ok()) << g.status().to_string();
      ASSERT_TRUE(c.is_ok()) << c.status().to_string();
      double num = 0, den = 0;
      for (int l = 0; l < 2; ++l)
        for (int h = 0; h < 2; ++h) {
          const auto& a = g->head(l, h);
          const auto& b = c->head(l, h);
          ASSERT_EQ(a.positions, b.positions);
          ASSERT_EQ(a.k.size(), b.k.size());
          for (size_t i = 0; i < a.k.size(); ++i) {
            num = std::max(
                {num, double(std::fabs(a.k[i] - b.k[i])), double(std::fabs(a.v[i] - b.v[i]))});
            den = std::max({den, double(std::fabs(b.k[i])), double(std::fabs(b.v[i]))});
          }
        }
      std::printf(
          "  worker %s %s: GPU export vs CPU K/V max |diff| / max = %.3g; first token gpu "
          "%d cpu %d\n",
          grid, id, num / den, g->first_token, c->first_token);
      EXPECT_LE(num / den, 1e-2) << grid << " " << id;
    }
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace sf
