// Locating the default model for tests. Tests that need it FAIL (never pass silently) when it
// is missing, naming the script that fetches it. Also the tiny synthetic Llama config the
// synthetic-weight tests share.
#pragma once
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "kernels/sparse.h"
#include "worker/model/config.h"
#include "worker/model/sparse_config.h"

namespace sf::testing {

inline std::string default_model_path() {
  if (const char* e = std::getenv("SF_MODEL")) return e;
  return std::string(SF_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}
inline bool default_model_present() { return std::filesystem::exists(default_model_path()); }
inline std::string missing_model_msg() {
  return "default model not found at " + default_model_path() + " (run deploy/fetch-model.sh)";
}

// Tiny Llama (hidden 64, 4 query / 2 KV heads of 16) for Model::synthetic.
inline model::ModelConfig tiny_config(int n_layers = 2) {
  model::ModelConfig c;
  c.arch = model::Arch::kLlama;
  c.name = "tiny";
  c.n_layers = n_layers;
  c.hidden = 64;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.intermediate = 96;
  c.vocab = 101;
  c.max_context = 4096;
  c.rope.theta = 10000.f;
  return c;
}

// The tiny config at the device forward's smallest shapes (head_dim 64; 4 query / 2 KV heads, so
// TP 2 divides both and the intermediate size), for tests that run the GPU binaries end to end.
inline model::ModelConfig tiny_gpu_config(const std::string& name, int n_layers = 2) {
  model::ModelConfig c = tiny_config(n_layers);
  c.name = name;
  c.hidden = 256;
  c.head_dim = 64;
  c.intermediate = 512;
  c.vocab = 512;
  c.tied_embeddings = true;
  return c;
}

// Llama-3-8B proportions scaled down (the GPU forward tests): hidden 1024, 8 query / 2 KV heads
// of head_dim 128 (GQA 4), intermediate 3584 (3.5 x hidden), vocab 8192, RoPE theta 500000 with
// Llama-3 frequency scaling. TP 2 divides its KV heads and intermediate size.
inline model::ModelConfig small_llama3(int n_layers = 4) {
  model::ModelConfig c;
  c.name = "synthetic-llama3-small";
  c.n_layers = n_layers;
  c.hidden = 1024;
  c.n_heads = 8;
  c.n_kv_heads = 2;
  c.head_dim = 128;
  c.intermediate = 3584;
  c.vocab = 8192;
  c.max_context = 8192;
  c.rms_eps = 1e-5f;
  c.rope.theta = 500000.f;
  c.rope.neox = false;
  c.rope.scaling_factor = 8.f;
  c.rope.low_freq_factor = 1.f;
  c.rope.high_freq_factor = 4.f;
  c.rope.original_max_pos = 8192;
  return c;
}

// Every pattern in each layer (head h gets pattern h % 8): a-shape, vertical-slash 48 / 96,
// block-sparse top-3, adaptive-vs (0.9, min 32), adaptive-block (0.9, min 64), MoA 128 + 0.1 N,
// dense, vertical-slash 16 / 200; sink and window 64; dense below 0 (sparse at any length).
inline model::SparseConfig mixed_sparse_config(const model::ModelConfig& c) {
  model::SparseConfig sc;
  sc.n_layers = c.n_layers;
  sc.n_heads = c.n_heads;
  sc.dense_below = 0;
  sc.source = "mixed";
  using kernels::Pattern;
  std::vector<kernels::HeadPattern> ps(size_t(c.n_heads));
  for (int h = 0; h < c.n_heads; ++h) {
    kernels::HeadPattern& p = ps[size_t(h)];
    const int k = h % 8;
    const Pattern kinds[8] = {Pattern::kAShape,     Pattern::kVerticalSlash, Pattern::kBlockSparse,
                              Pattern::kAdaptiveVS, Pattern::kAdaptiveBlock, Pattern::kMoA,
                              Pattern::kDense,      Pattern::kVerticalSlash};
    p.pattern = kinds[k];
    p.n_vertical = k == 1 ? 48 : 16;
    p.n_slash = k == 1 ? 96 : 200;
    p.n_blocks = 3;
    p.gamma = 0.9;
    p.min_budget = k == 3 ? 32 : 64;
    p.alpha = 128;
    p.beta = 0.1;
  }
  sc.layers.assign(size_t(c.n_layers), ps);
  return sc;
}

}  // namespace sf::testing
