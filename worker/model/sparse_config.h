// Per-layer, per-head sparse attention configuration (DESIGN.md "Pattern config"): what
// `sparsefill search` writes and `--attention config:FILE` reads, or one pattern for all heads.
#pragma once
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/sparse.h"

namespace sf::model {

struct SparseConfig {
  std::string model;                                     // informational
  int n_layers = 0, n_heads = 0;
  std::vector<std::vector<kernels::HeadPattern>> layers;  // [n_layers][n_heads]
  int64_t dense_below = 1024;  // prompts shorter than this run dense (the estimators don't pay)
  double target_density = 0;   // what the search aimed for (informational)
  std::string source;          // "mode:<name>" or the file it came from
};

// --attention values: dense | a-shape | vertical-slash | block-sparse | moa | adaptive |
// adaptive-block | config:FILE. Defaults per mode follow the seeds (MInference budgets,
// gamma = 0.95). Unknown modes are an error naming the value.
Result<SparseConfig> sparse_config_for_mode(const std::string& mode, int n_layers, int n_heads);
// Reads and validates a config file against the model's layer and head counts; errors name the
// layer, head and field.
Result<SparseConfig> sparse_config_load(const std::string& path, int n_layers, int n_heads);
Result<SparseConfig> sparse_config_parse(const std::string& json_text, int n_layers, int n_heads,
                                         const std::string& origin);
Status sparse_config_save(const SparseConfig& c, const std::string& path);
bool sparse_config_is_dense(const SparseConfig& c);

}  // namespace sf::model
