// The Llama-3-8B shape the GPU-host benchmarks run with synthetic weights (config.json of
// meta-llama/Meta-Llama-3-8B): 32 layers, hidden 4096, 32 query / 8 KV heads of 128,
// intermediate 14336, vocab 128256, rope theta 500000 with Llama-3 scaling (factor 8, low 1,
// high 4, original 8192). layers > 0 keeps that many.
#pragma once
#include "worker/model/config.h"

namespace sf::bench {

inline model::ModelConfig llama3_8b(int layers = 0) {
  model::ModelConfig c;
  c.name = "llama3-8b-shaped (synthetic weights)";
  c.n_layers = layers > 0 ? layers : 32;
  c.hidden = 4096;
  c.n_heads = 32;
  c.n_kv_heads = 8;
  c.head_dim = 128;
  c.intermediate = 14336;
  c.vocab = 128256;
  c.max_context = 1 << 20;
  c.rms_eps = 1e-5f;
  c.rope.theta = 500000.f;
  c.rope.scaling_factor = 8.f;
  c.rope.low_freq_factor = 1.f;
  c.rope.high_freq_factor = 4.f;
  c.rope.original_max_pos = 8192;
  return c;
}

}  // namespace sf::bench
