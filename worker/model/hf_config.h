// Hugging Face checkpoints: config.json -> ModelConfig, and the list of safetensors shards.
// Supported: LlamaForCausalLM (Llama-2, Llama-3/3.1 incl. "llama3" rope scaling, SmolLM2),
// MistralForCausalLM (without a sliding window) and Qwen2ForCausalLM. Anything the forward pass
// would silently get wrong (other rope scalings, biases on o_proj/MLP, sliding windows,
// activations other than SiLU, quantized checkpoints) is rejected with kUnsupported.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "worker/model/config.h"

namespace sf::model {

// `name` becomes ModelConfig::name and prefixes error messages. RoPE is rotate-half (neox) for
// every HF checkpoint.
Result<ModelConfig> config_from_hf_json(std::string_view json_text, const std::string& name);
// Reads dir/config.json; the name is the directory's last component.
Result<ModelConfig> config_from_hf_dir(const std::string& dir);
// Paths of the checkpoint's safetensors files: the distinct files named by
// dir/model.safetensors.index.json ("weight_map"), sorted, or else dir/model.safetensors.
// Every listed file must exist; names with path separators are rejected.
Result<std::vector<std::string>> hf_shard_files(const std::string& dir);

}  // namespace sf::model
