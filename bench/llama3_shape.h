// The Llama-3-8B shape the GPU-host benchmarks run with synthetic weights
// (model::llama3_8b_config, which `--model synthetic:llama3-8b` uses too). layers > 0 keeps that
// many.
#pragma once
#include "worker/model/config.h"

namespace sf::bench {

inline model::ModelConfig llama3_8b(int layers = 0) { return model::llama3_8b_config(layers); }

}  // namespace sf::bench
